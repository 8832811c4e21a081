"""The SQLite files evomerge keeps (a study's Optuna trials and its MLflow runs) in write-ahead-log mode.

SQLite's defaults (a rollback journal, ``synchronous = FULL``) wait for the disk several times at every commit, and a
search commits a dozen small transactions per trial. In WAL mode a commit appends to the log; with ``synchronous =
NORMAL`` SQLite waits for the disk only at checkpoints. A process killed at any moment leaves the database whole; a
power loss can undo the last transactions. Readers do not wait for a writer. WAL needs the file on a local disk (its
shared-memory index does not work on a network file system): a study shared between machines lives in PostgreSQL.
"""

from __future__ import annotations

import contextlib


def sqlite_file(url: str) -> str | None:
    """The file of a SQLite URL (SQLAlchemy's form, a query string allowed), or None for any other URL and for a
    database that is not a plain file (in memory, a ``file:`` URI)."""
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception:  # not a URL SQLAlchemy reads: the storage itself says what is wrong with it
        return None
    db = u.database
    if not u.drivername.startswith("sqlite") or not db or db == ":memory:" or db.startswith("file:") or "uri" in u.query:
        return None
    return db


def sqlite_wal(url: str, engine=None) -> bool:
    """Put the SQLite database of ``url`` (SQLAlchemy's form: ``sqlite:///path.db``, a query string allowed) in
    write-ahead-log mode, which the file keeps for every process that opens it; with ``engine`` (SQLAlchemy's, on that
    file), its connections then commit with ``synchronous = NORMAL``: SQLite waits for the disk at WAL checkpoints,
    not at every commit. A database that is not a file (in memory, a ``file:`` URI) or that does not take WAL (a file
    system without shared memory, a read-only file) stays as it is, and so do its connections. True if in WAL."""
    import sqlite3

    db = sqlite_file(url)
    if db is None:
        return False
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=120)) as con:
            mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.Error:
        return False
    if str(mode).lower() != "wal":
        return False
    if engine is not None:
        from sqlalchemy import event

        def normal(dbapi_connection, _record) -> None:
            dbapi_connection.execute("PRAGMA synchronous=NORMAL")

        event.listen(engine, "connect", normal)
        engine.dispose()  # the connections made before (the storage's own setup) reconnect with it
    return True
