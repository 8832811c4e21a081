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


def _parsed(url: str):
    """SQLAlchemy's reading of a database address (its user, password and host, as the storage will connect with
    them), or None for an HTTP address, a SQLite file or what it cannot read."""
    if _parsed_kind(url):
        return None
    try:
        from sqlalchemy.engine import make_url

        return make_url(url)
    except Exception:  # noqa: BLE001 (not an address it reads: check_database says so)
        return None


def _password_in_host(url: str):
    """For an address whose password holds an unencoded ``@`` (SQLAlchemy takes the password's end for the host):
    the address with everything before the host's last ``@`` masked; else None."""
    u = _parsed(url)
    prefix = url.split("://", 1)[0] + "://"
    if u is None:  # unreadable (the password's end taken for a port): two '@' before any '/' and query
        rest = url[len(prefix):] if "://" in url else ""
        head = rest.split("@", 1)[0]
        if _parsed_kind(url) or rest.count("@") < 2 or any(c in head for c in "/?#"):
            return None
        user = head.split(":", 1)[0]
    elif u.password is None or "@" not in f"{u.host or ''}{u.database or ''}":
        return None
    else:
        user = u.username
    # the host: after the last '@' that a host (and a port) follows, then the path or the end
    ats = [m.start() for m in re.finditer(r"@(?=(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d+)?(/|\?|$))", url)]
    if not ats:
        return f"{prefix}{user}:***"
    return f"{prefix}{user}:***{url[ats[-1]:]}"


def _parsed_kind(url: str) -> bool:
    """An HTTP address, a SQLite or file one, or no address: not a database server's."""
    return not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url) or url.split("://", 1)[0].lower().split("+")[0] in (
        "http", "https", "sqlite", "file")


def unencoded_password(url: str, option: str) -> None:
    """A ConfigError naming ``option`` for an address whose password holds an ``@`` an address must encode (the
    driver then looked up a host made of the password's end, and printed it)."""
    if _password_in_host(url) is not None:
        from .errors import ConfigError

        raise ConfigError(option, f"{shown(url)}: the password holds an '@', which an address must encode; allowed: "
                                  "the password percent-encoded (@ as %40, / as %2F, ? as %3F, # as %23; "
                                  "urllib.parse.quote(password, safe=''))")


def shown(url: str) -> str:
    """``url`` with the password of its user masked (``user:***@host``), for messages and pages. A database's address
    is read as SQLAlchemy reads it (a password holding ``/``, ``?`` or ``#`` is masked whole; one holding an
    unencoded ``@`` too, up to the host); others by their authority (what comes before the path)."""
    bare = _password_in_host(url)
    if bare is not None:
        return bare
    u = _parsed(url)
    if u is not None and u.password is not None:
        prefix = url.split("://", 1)[0] + "://"
        end = url.find("@" + (u.host or ""), len(prefix)) if u.host else url.rfind("@")
        if end >= 0:  # the user as written, the rest as written: only the password goes
            return f"{prefix}{url[len(prefix):].split(':', 1)[0]}:***{url[end:]}"
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)(.*)$", url, re.DOTALL)
    if not m:  # no address as written (postgresql:/user:password@host/db, user:password@host): a password, if any,
        # is somewhere before the last '@' (it was printed whole, in a line that offered it as a file)
        return _query_masked(_userinfo_masked(url))
    if "@" not in m[2]:  # (postgresql:///user:password@host/db: an empty host, the user in the path)
        return _query_masked(m[1] + m[2] + _userinfo_masked(m[3]) if not m[2] else url)
    user, host = m[2].rsplit("@", 1)
    return _query_masked(f"{m[1]}{user.split(':', 1)[0] + ':***' if ':' in user else user}@{host}{m[3]}")


def _userinfo_masked(text: str) -> str:
    """``text`` with everything before its last ``@`` masked, but a scheme it starts with, where that part holds a
    ``:`` (a user and a password, however mistyped); else as it is (a folder whose name holds an ``@``)."""
    if "@" not in text:
        return text
    m = re.match(r"^(\s*[A-Za-z][A-Za-z0-9+.-]*:/{0,3}(?=[^:/]*:))?(.*)@([^@]*)$", text, re.DOTALL)
    if not m or ":" not in m[2]:
        return text
    return f"{m[1] or ''}***@{m[3]}"


def _query_masked(url: str) -> str:
    """A ``password=`` in an address's query (libpq takes one there) masked."""
    return re.sub(r"(?i)([?&](?:password|passwd|pwd)=)[^&#]*", r"\1***", url)


# the schemes a mistyped address is read as (a folder named postgresql: is not what a user means; file:/PATH is an
# address MLflow takes)
SCHEMES = ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle", "sqlite", "http", "https")


def mistyped(text: str) -> str | None:
    """For an address whose scheme lost a slash or its colon (``postgresql:/u@h/db``, ``http//h:5000``): the address
    it means, its password masked; else None. Such a text was taken for a folder (MLflow's file store, a SQLite file
    made in it) and printed whole, password and all."""
    text = text.strip()
    m = re.match(r"^([A-Za-z][A-Za-z0-9.-]*)(\+[A-Za-z0-9_]+)?(:/?|/{2,3})(?!/)(.*)$", text, re.DOTALL)
    if not m or m[1].lower() not in SCHEMES:
        return None
    scheme = m[1] + (m[2] or "")
    if m[1].lower() == "sqlite":  # its path as written after the colon (sqlite:/tmp/x.db: the file /tmp/x.db)
        return shown(f"{scheme}:///{text[len(scheme) + 1:]}" if m[3].startswith(":") else f"{scheme}:///{m[4]}")
    return shown(f"{scheme}://{m[4]}")


def check_mistyped(url: str, option: str, allowed: str) -> None:
    """A ConfigError naming ``option`` for an address whose scheme lost a slash or its colon (:func:`mistyped`)."""
    if (meant := mistyped(url)) is not None:
        from .errors import ConfigError

        raise ConfigError(option, f"{shown(url)} is not an address (its scheme wants '://'); did you mean {meant}? "
                                  f"allowed: {allowed}")


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
            from .errors import nearest

            base = url.split("://", 1)[0].split("+", 1)[0].lower()  # (postgres://: Heroku's and libpq's; postgresq://)
            near = "postgresql" if base == "postgres" else nearest(base, ("postgresql", "sqlite", "mysql", "mssql",
                                                                          "oracle"))
            mean = f"; did you mean {near}://?" if near and near != base else ""
            raise ConfigError(option, f"{said} is not a database address ({hint}); allowed: {allowed}{mean}") from None
        raise ConfigError(option, f"cannot open {said}: {hint or first_line(e)}") from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # noqa: BLE001 (refused, no such database, timed out, bad password)
        why = first_line(getattr(e, "orig", None) or e)
        raise ConfigError(option, f"cannot reach the database at {said} ({why}); {_reach_advice(why, url)} or pass "
                                  f"another {option}") from None
    finally:
        engine.dispose()


def _reach_advice(why: str, url: str) -> str:
    """What to do about a database that answered no, by its driver's reason (a wrong password or database was told
    to start it)."""
    low = why.lower()
    if ("authentication failed" in low or "access denied" in low or "login failed" in low or "no password" in low
            or re.search(r'role "[^"]*" does not exist', low)):
        return ("check the user and its password (PGPASSWORD or ~/.pgpass give libpq one and keep it out of the "
                "address)" if url.startswith("postgres") else "check the user and its password")
    if re.search(r'database "[^"]*" does not exist', low) or "unknown database" in low:
        import shlex

        name = getattr(_parsed(url), "database", None) or "DB"
        return f"create it (createdb {shlex.quote(name)})" if url.startswith("postgres") else "create it"
    return host_advice(why) or "start it"


def host_advice(why: str) -> str | None:
    """What to do where a server's address is at fault, not the server (a host no name server knows, a port where
    something else answers: both were told to "start it")."""
    low = why.lower()
    if any(s in low for s in ("name or service not known", "could not translate host name", "nodename nor servname",
                              "temporary failure in name resolution", "no address associated", "getaddrinfo failed")):
        return "check the host name in the address"
    if "remote end closed connection" in low or "connection reset" in low or "badstatusline" in low or \
            "server closed the connection unexpectedly" in low:
        return "something else answers at that port: check the address's port"
    return None


def _as_file(text: str) -> str:
    """For a path given where an address belongs: the SQLite address of a file there (for a mistyped address: the
    address it means)."""
    if (meant := mistyped(text)) is not None:
        return f"did you mean {meant}? "
    if "://" in text or not text.strip() or "@" in text:  # (an address's user, mistyped: no file of it, said whole)
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
