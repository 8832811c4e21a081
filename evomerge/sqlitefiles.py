"""The SQLite files evomerge keeps (a study's Optuna trials and its MLflow runs) in write-ahead-log mode.

SQLite's defaults (a rollback journal, ``synchronous = FULL``) wait for the disk several times at every commit, and a
search commits a dozen small transactions per trial. In WAL mode a commit appends to the log; with ``synchronous =
NORMAL`` SQLite waits for the disk only at checkpoints. A process killed at any moment leaves the database whole; a
power loss can undo the last transactions. Readers do not wait for a writer. WAL needs the file on a local disk (its
shared-memory index does not work on a network file system): a study shared between machines lives in PostgreSQL.
"""

from __future__ import annotations

import contextlib


def sqlite_wal(path: str, engine=None) -> None:
    """Put the SQLite file at ``path`` in write-ahead-log mode (kept in the file, for every process that opens it);
    with ``engine`` (SQLAlchemy's), its connections commit with ``synchronous = NORMAL``: at WAL checkpoints, not at
    every commit, does SQLite wait for the disk. A file that cannot take WAL (an in-memory database, a file system
    without shared memory) stays as it is."""
    import sqlite3

    if path in ("", ":memory:") or path.startswith("file:"):
        return
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=120)) as con:
            con.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error:
        return
    if engine is not None:
        from sqlalchemy import event

        def normal(dbapi_connection, _record) -> None:
            dbapi_connection.execute("PRAGMA synchronous=NORMAL")

        event.listen(engine, "connect", normal)
        engine.dispose()  # the connections made before (the storage's own setup) reconnect with it
