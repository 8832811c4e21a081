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


def new_mlflow_store(url: str) -> bool:
    """Make the SQLite MLflow store of ``url`` a copy of a blank one, if it does not exist yet; True if it did.

    MLflow makes a new SQLite store by creating its first tables and then running its migrations one by one (about
    70 in MLflow 3.17): 1.5-2 s for every new study. evomerge keeps the blank store MLflow makes, once per MLflow
    version, in the user cache (``$XDG_CACHE_HOME/evomerge``, else ``~/.cache/evomerge``, where the datasets go), and
    copies it: MLflow then finds its tables at the current revision and only adds its default experiment, as it does in
    a store of its own making (its artifact folder ``mlruns/0`` under the folder the command runs in). Anything in the
    way (no cache folder, a file system without hard links, a write-ahead log left where a store was removed, which
    SQLite would read into the copy) leaves the store to MLflow, as before; a cache file that is not a blank store (cut
    short, another tool's) is made again. The copy is linked
    into place, so it never replaces a store another process has just made."""
    import os
    import shutil
    from pathlib import Path

    db = sqlite_file(url)
    if db is None or any(os.path.exists(db + end) for end in ("", "-wal", "-shm", "-journal")):
        return False  # a store's log left by a process that ended there would be read into the copy: MLflow's own
    target = Path(db)
    try:
        blank = _blank_mlflow_store()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.new")
        shutil.copyfile(blank, tmp)
        try:
            os.link(tmp, target)
        except FileExistsError:  # another process made the store first: it is theirs
            return False
        finally:
            tmp.unlink(missing_ok=True)
    except Exception:  # the cache, not the store: MLflow makes the store itself and says what is wrong with it
        return False
    return True


def _blank_path():
    import mlflow

    from .userdirs import user_cache_dir

    return user_cache_dir() / f"mlflow-{mlflow.__version__}-blank.db"


def _blank_mlflow_store():
    """The cached blank store of this MLflow version, made by MLflow (in a folder of its own, then renamed into place,
    so that a reader never sees half a file) if it is not there. Its default experiment is removed: MLflow adds it
    again in each copy, with the copy's folders."""
    import os
    import sqlite3
    import tempfile
    from pathlib import Path

    blank = _blank_path()
    if _is_blank_store(blank):
        return blank
    blank.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=blank.parent, prefix=".mlflow-blank-") as d:
        path = Path(d) / "blank.db"
        _make_mlflow_store(f"sqlite:///{path}", d)
        with contextlib.closing(sqlite3.connect(path)) as con, con:
            con.execute("DELETE FROM experiments")
        os.replace(path, blank)
    return blank


def _is_blank_store(path) -> bool:
    """``path`` is a SQLite file with MLflow's revision table and no experiment (a file cut short, or another tool's,
    is not: it is made again)."""
    import sqlite3

    if not path.is_file():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
            return (len(con.execute("SELECT version_num FROM alembic_version").fetchall()) == 1
                    and con.execute("SELECT count(*) FROM experiments").fetchone()[0] == 0)
    except sqlite3.Error:
        return False


def _make_mlflow_store(url: str, folder: str) -> None:
    """MLflow's own new store at ``url`` (its tables and migrations), its default experiment's artifacts under
    ``folder`` (the experiment is removed after)."""
    from pathlib import Path

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(url, (Path(folder) / "mlruns").as_uri())
    store.engine.dispose()
