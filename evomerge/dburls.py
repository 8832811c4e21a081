"""Database addresses, as the Optuna storage (``--storage``) and the MLflow store (``--tracking-uri``) take them:
the driver a ``postgresql://`` address uses, how long a connection may wait, what to install when a driver is
missing, and an address as it may be printed (its password masked). Imports nothing heavy at module level."""

from __future__ import annotations

import re

# the keyword each driver takes for the seconds a connection may wait (SQLAlchemy's driver names)
TIMEOUT_KEYWORD = {"psycopg2": "connect_timeout", "psycopg": "connect_timeout", "pg8000": "timeout",
                   "mysqldb": "connect_timeout", "pymysql": "connect_timeout", "mysqlconnector": "connection_timeout",
                   "pyodbc": "timeout", "pymssql": "login_timeout"}
DEFAULT_DRIVER = {"postgresql": "psycopg2", "mysql": "mysqldb", "mssql": "pyodbc"}  # SQLAlchemy's defaults


def normalise_url(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; use psycopg 3 when that is the driver installed."""
    if url.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """(scheme://, user:password, @host...) of a server's address whose user and password are written unencoded
    (an ``@``, ``/``, ``?`` or ``#`` in the password), split at its last ``@``; else None."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)$", url, re.DOTALL)
    if not m or m[1].startswith("sqlite") or "@" not in m[2] or any(c in m[2].split("@", 1)[0] for c in "/?#"):
        return None  # no user (an '@' further on is in the path or the query)
    user, host = m[2].rsplit("@", 1)
    return (m[1], user, "@" + host) if any(c in user for c in "@/?#") else None


def unencoded_password(url: str, option: str) -> None:
    """A ConfigError naming ``option`` for an address whose password holds a character an address must encode
    (PostgreSQL then looked up a host made of the password's end, and printed it)."""
    if _userinfo(url) is not None:
        from .errors import ConfigError

        raise ConfigError(option, f"{shown(url)}: the password holds a character an address must encode ('@', '/', "
                                  "'?' or '#'); allowed: the password percent-encoded (@ as %40, / as %2F, ? as %3F, "
                                  "# as %23; urllib.parse.quote(password, safe=''))")


def shown(url: str) -> str:
    """``url`` with the password of its user masked (``user:***@host``), for messages and pages. The host is what
    follows the last ``@`` before the path, so a password holding an ``@`` is masked whole (and one holding a
    ``/`` too)."""
    bare = _userinfo(url)
    if bare is not None:
        return f"{bare[0]}{bare[1].split(':', 1)[0] + ':***' if ':' in bare[1] else '***'}{bare[2]}"
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)(.*)$", url, re.DOTALL)
    if not m or "@" not in m[2]:
        return url
    user, host = m[2].rsplit("@", 1)
    return f"{m[1]}{user.split(':', 1)[0] + ':***' if ':' in user else user}@{host}{m[3]}"


def connect_args(url: str, seconds: float) -> dict:
    """The connection argument that makes ``url``'s driver give up after ``seconds`` (a server that does not answer:
    an error, not a wait without end); none where the address sets its own or the driver is not one we know."""
    try:
        from sqlalchemy.engine import make_url

        u = make_url(url)
    except Exception:  # noqa: BLE001 (not an address SQLAlchemy reads: it says so itself)
        return {}
    backend, _, driver = u.drivername.partition("+")
    key = TIMEOUT_KEYWORD.get(driver or DEFAULT_DRIVER.get(backend, ""))
    if key is None or key in u.query:
        return {}
    return {key: max(1, int(seconds))}


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_database(url: str, option: str, allowed: str, seconds: float) -> None:
    """Connect to the database at ``url`` once, giving up after ``seconds``; a ``ConfigError`` naming ``option``, in
    one line, for an address SQLAlchemy cannot read, a dialect or driver it does not have, and a server that refuses,
    does not answer or turns the user away. Nothing is written."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    from .errors import ConfigError

    said = shown(url)
    unencoded_password(url, option)
    try:
        sqlalchemy.engine.make_url(url)
    except Exception as e:  # noqa: BLE001 (not an address SQLAlchemy can read)
        raise ConfigError(option, f"{said} is not a database address ({first_line(e)}); "
                                  f"{_as_file(url)}allowed: {allowed}") from None
    try:
        engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args=connect_args(url, seconds))
    except Exception as e:  # noqa: BLE001 (a missing driver, an unknown dialect)
        hint = driver_missing(url, e)
        if hint is not None and hint.startswith("SQLAlchemy has no"):
            mean = "; did you mean postgresql://?" if url.startswith("postgres://") else ""  # Heroku's and libpq's
            raise ConfigError(option, f"{said} is not a database address ({hint}); allowed: {allowed}{mean}") from None
        raise ConfigError(option, f"cannot open {said}: {hint or first_line(e)}") from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # noqa: BLE001 (refused, no such database, timed out, bad password)
        raise ConfigError(option, f"cannot reach the database at {said} ({first_line(getattr(e, 'orig', None) or e)}); "
                                  f"start it or pass another {option}") from None
    finally:
        engine.dispose()


def _as_file(text: str) -> str:
    """For a path given where an address belongs: the SQLite address of a file there."""
    if "://" in text or not text.strip():
        return ""
    from pathlib import Path

    p = Path(text).expanduser().resolve()
    return f"for a SQLite file there: sqlite:///{p / 'optuna.db' if p.is_dir() else p}; "


def driver_missing(url: str, e: BaseException) -> str | None:
    """For an error that says a database driver is not installed: what to install, in words; else None."""
    import sqlalchemy.exc

    while not isinstance(e, (ModuleNotFoundError, sqlalchemy.exc.NoSuchModuleError)) and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__  # Optuna says "Failed to import DB access module" over the import's own error
    if isinstance(e, sqlalchemy.exc.NoSuchModuleError):
        return f"SQLAlchemy has no dialect for {url.split('://', 1)[0]}:// ({str(e).splitlines()[0]})"
    if not isinstance(e, ModuleNotFoundError):
        return None
    scheme = url.split("://", 1)[0]
    if scheme.startswith("postgresql+") and scheme != "postgresql+psycopg":  # the address names its own driver
        return (f"the driver {scheme.split('+', 1)[1]} that the address names is not installed (no module named "
                f"{e.name!r}); pip install it, or write postgresql:// to use psycopg 3 "
                '(pip install "evomerge[postgres]")')
    if url.startswith("postgresql"):
        return (f"the PostgreSQL driver is not installed (no module named {e.name!r}); "
                'pip install "evomerge[postgres]" installs psycopg 3, which postgresql:// addresses then use')
    return f"its database driver is not installed (no module named {e.name!r}); pip install it"
