"""Where a study's trials live and how processes share them: storage URLs, opening an Optuna
RDB storage with heartbeats, the cross-process lock, and opening (or creating) the study with
its fingerprint checked.

Storage: ``runs/<study>/optuna.db`` (SQLite) by default, or any Optuna storage URL. SQLite's
busy timeout keeps concurrent writers from failing with "database is locked", and the file is kept in
write-ahead-log mode with ``synchronous = NORMAL`` (:mod:`evomerge.sqlitefiles`): a trial's dozen small
transactions each wait for the disk no more, and readers do not wait for a writer.

The lock makes "count the finished trials, then ask" atomic, so ``n_trials`` is an exact
total: a PostgreSQL advisory lock when the study lives in PostgreSQL (every machine sharing
it), else a lock file (``filelock``) in the study's runs folder.

Stale trials are Optuna's own business: the storage is opened with a heartbeat interval and
``grace_period``; ``optuna.storages.fail_stale_trials`` (called under the lock) fails a trial
whose process stopped beating, and its ``heartbeat_stale_trial_callback`` enqueues the same
parameters again (user attribute ``retry_of``), so the dead trial does not count and its
point is still judged.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dburls import check_database, check_mistyped, connect_args, driver_missing, normalise_url, shown  # noqa: F401 (normalise_url: this module's name)
from ..errors import ConfigError

if TYPE_CHECKING:  # config imports this module, not the other way round
    from .config import SearchConfig

HEARTBEAT_INTERVAL = 5  # seconds
from .options import GRACE_PERIOD  # noqa: E402  (seconds; a search option)


STORAGE_URLS = ("sqlite:///PATH/optuna.db, postgresql://USER@HOST/DB, mysql+pymysql://USER@HOST/DB (an Optuna "
                "storage: a database SQLAlchemy opens)")
DEFINITION = "definition"  # the study file's text and place, stored with its trials


def stored_definition_of(study) -> dict | None:
    """What is stored of a study's file: its TOML text and where it was (relative references resolve there)."""
    if study.path is None or not Path(study.path).is_file():
        return None
    return {"toml": Path(study.path).read_text(encoding="utf-8"), "path": str(Path(study.path).resolve())}


def default_storage(study_dir: Path) -> str:
    return f"sqlite:///{(study_dir / 'optuna.db').resolve()}"


@contextlib.contextmanager
def quiet_optuna():
    """Silence Optuna's notes that heartbeats and metric names are experimental and that heartbeats
    are meant for Study.optimize: evomerge records heartbeats itself while a trial runs."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def check_storage(url: str) -> None:
    """What :func:`open_storage` would refuse about a database server's address (unreadable, no such dialect or
    driver, a server that refuses or does not answer), said before a search reads its data: one connection, nothing
    written. A SQLite file is left to :func:`open_storage`, which makes its folder."""
    check_mistyped(url, "--storage", STORAGE_URLS)
    if not url.startswith("sqlite:"):
        check_database(url, "--storage", STORAGE_URLS, 10)


def open_storage(url: str, grace_period: int = GRACE_PERIOD, study: str | None = None):
    """An Optuna RDB storage with heartbeats. With ``study``, a trial that goes stale (its process
    died) is retried: its parameters are enqueued again, marked ``retry_of``."""
    import optuna

    check_mistyped(url, "--storage", STORAGE_URLS)  # (sqlite:/tmp/x.db made a folder named sqlite:)
    kwargs: dict[str, Any] = {}
    if study is not None:
        kwargs["heartbeat_stale_trial_callback"] = _retry_stale
    try:
        sqlite = url.startswith("sqlite:")
        if sqlite:
            path = url.split("sqlite:///", 1)[-1]
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError("--storage", f"cannot open {shown(url)}: cannot make the folder {Path(path).parent} "
                                               f"({e.strerror})") from None
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        else:  # one connection first: an address, a driver or a server that is wrong is one line at once (not retried)
            check_database(url, "--storage", STORAGE_URLS, 10)
            if args := connect_args(url, 10):  # a server that stops answering: an error in seconds, not a wait without end
                kwargs["engine_kwargs"] = {"connect_args": args}
        with quiet_optuna():
            storage = retry_setup(lambda: optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_INTERVAL, grace_period=grace_period, **kwargs))
        if sqlite:
            from ..sqlitefiles import sqlite_wal

            sqlite_wal(url, storage.engine)
        return storage
    except ConfigError:
        raise
    except Exception as e:  # bad URL, missing driver, unreachable server: one line
        hint = driver_missing(url, e)
        raise ConfigError("--storage", f"cannot open {shown(url)}: "
                          + (hint or f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")) from None


def retry_setup(make, attempts: int = 8):
    """Call ``make`` again when a database error comes from another process creating the same
    tables at the same moment (several searches started together on a new database)."""
    import random

    import sqlalchemy.exc

    for i in range(attempts):
        try:
            return make()
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError):
            if i == attempts - 1:
                raise
            time.sleep(0.2 * (i + 1) + random.random() * 0.3)


def _retry_stale(study, trial) -> None:
    """Enqueue a dead process's trial again (CMA-ES re-asks its own candidates and needs no copy)."""
    if any(k.startswith("cma_") for k in trial.user_attrs):
        return
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})


def fail_gone(study) -> list[str]:
    """The running trials whose search process is gone from this machine (user attribute ``process``,
    :func:`evomerge.procs.process_tag`: killed with SIGKILL, or out of memory): failed now (``failure`` "its process
    was gone") and their parameters asked again (``retry_of``), as Optuna's stale-trial check does once the grace
    period has passed (a resumed search waited that long, saying nothing). A trial of another machine, or whose
    process still runs, is left to the heartbeats. One line for each, for the search's start."""
    from optuna.trial import TrialState

    from ..procs import still_running

    lines = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        tag = t.user_attrs.get("process", "")
        if still_running(tag) is False and _fail_and_retry(study, t, "its process was gone"):
            lines.append(f"trial {t.number} was left running by a search process that is gone (pid "
                         f"{tag.split('/')[2]}); failed, and its policy asked again")
    return lines


def _fail_and_retry(study, trial, why: str) -> bool:
    """Fail a running trial (user attribute ``failure``: ``why``) and ask its parameters again (``retry_of``); False
    where another search failed it first."""
    import optuna
    from optuna.trial import TrialState

    try:
        study._storage.set_trial_user_attr(trial._trial_id, "failure", why)
        if not study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
            return False
    except (RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
        return False
    _retry_stale(study, trial)
    return True


UNSTARTED = 60.0  # seconds a running trial may go without its process recorded before it is taken for dead


def fail_unstarted(study, trials, grace_period: int = GRACE_PERIOD) -> list[int]:
    """The running trials with no process recorded (user attributes ``worker`` and ``process``, set in a trial's
    first seconds) long after they were asked (the grace period, and at least :data:`UNSTARTED` s): a search killed
    between Optuna's ask and the trial's first heartbeat left it so, and Optuna never fails a trial without a
    heartbeat, so a search whose last trial it was waited for it for ever. Failed (``failure`` "its process never
    started it") and asked again (``retry_of``); their numbers. ``trials``: the study's, as just read. A live process
    that was that slow to start one finds its trial taken over, as after a stale heartbeat."""
    import datetime

    from optuna.trial import TrialState

    now = datetime.datetime.now()
    late = datetime.timedelta(seconds=max(float(grace_period), UNSTARTED))
    return [t.number for t in trials if t.state == TrialState.RUNNING and "worker" not in t.user_attrs
            and "process" not in t.user_attrs and t.datetime_start is not None and now - t.datetime_start >= late
            and _fail_and_retry(study, t, "its process never started it")]


# -- the lock ---------------------------------------------------------------------------------
@contextlib.contextmanager
def search_lock(cfg: "SearchConfig", engine_cache: dict):
    """Make "count the finished trials, then ask" atomic: a PostgreSQL advisory lock when the study
    lives in PostgreSQL (every machine sharing it), else a lock file in the study's runs folder."""
    if cfg.storage.startswith("postgresql"):
        with advisory_lock(cfg.storage, f"evomerge:{cfg.study.name}", engine_cache):
            yield
    else:
        with file_lock(cfg.study_dir / "search.lock"):
            yield


@contextlib.contextmanager
def advisory_lock(url: str, name: str, engine_cache: dict):
    import hashlib

    import sqlalchemy

    engine = engine_cache.get("engine")
    if engine is None:
        engine = engine_cache["engine"] = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    key = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big", signed=True)
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text("select pg_advisory_lock(:k)"), {"k": key})
        try:
            yield
        finally:
            conn.execute(sqlalchemy.text("select pg_advisory_unlock(:k)"), {"k": key})


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock among local processes (``filelock``; released if the holder dies)."""
    import filelock

    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path)):
        yield


# -- the study ----------------------------------------------------------------------------------
def kept_population(attrs: dict, trials) -> int | None:
    """The NSGA-II generation size of a stored study (``attrs``: its user attributes): its attribute, or (a study
    searched before it was kept) the complete trials of its first generation where a later one began (Optuna closes a
    generation at that many complete trials: pruned, failed and running ones do not count); None where neither
    says."""
    held = (attrs.get(NSGA_ATTR) or {}).get("population")
    if held:
        return int(held)
    gens = [t.system_attrs.get(NSGA_GENERATION) for t in trials]
    if any(isinstance(g, int) and g >= 1 for g in gens):
        return sum(1 for t, g in zip(trials, gens) if g == 0 and t.state.name == "COMPLETE") or None
    return None


NSGA_GENERATION = "NSGAIISampler:generation"  # Optuna's trial system attribute
NSGA_ATTR = "nsga2"  # the study's user attribute: {"population": its NSGA-II generations' size}
STARTS = "starts"  # the study's user attribute: processes started per (trials then, worker), for their samplers' seeds


def load_or_create(cfg: "SearchConfig", storage, worker: int = 0, total_steps: int | None = None,
                   asking: bool = False):
    """The Optuna study of ``cfg``: loaded when it exists (silently: no "Using an existing study"
    line), else created. Its directions must match the study file's objectives and its
    fingerprint what the study file says now (:mod:`evomerge.search.fingerprint`). ``asking``: a
    process that will ask trials counts itself among the study's starts (under the search lock), and a
    second start as the same worker on the study as it stood (another machine) seeds its sampler apart. (Under
    MySQL the search lock is a file's, on this machine only: two machines there can still draw alike.)"""
    import optuna

    from . import fingerprint

    directions = cfg.study.directions
    resumed_at, exists, finished, failed = 0, True, 0, 0
    try:
        trials = storage.get_all_trials(storage.get_study_id_from_name(cfg.study.name), deepcopy=False)
        resumed_at = len(trials)
        finished = sum(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials)
        failed = sum(t.state == optuna.trial.TrialState.FAIL for t in trials)
    except KeyError:
        exists = False
    if exists and not resumed_at:  # stored without a trial (`evomerge baselines` keeps their step sizes there): a
        # study file whose objectives changed since takes the study afresh (Optuna's directions are fixed)
        held = optuna.load_study(study_name=cfg.study.name, storage=storage)
        if [d.name.lower() for d in held.directions] != directions:
            optuna.delete_study(study_name=cfg.study.name, storage=storage)
            exists = False
    if cfg.sampler == "nsga2" and exists:  # its generations keep their size (a resume with more trials grew them)
        import dataclasses

        held = kept_population(storage.get_study_user_attrs(storage.get_study_id_from_name(cfg.study.name)), trials)
        if held and cfg.nsga2_population and cfg.nsga2_population != held:
            raise ConfigError("--nsga2-population", f"{cfg.nsga2_population}; study {cfg.study.name}'s NSGA-II "
                                                    f"generations are of {held} trials (its first NSGA-II search's: "
                                                    f"its trials hold their places in them); allowed: {held} or 0, or "
                                                    "another [study] name or --runs-dir to start afresh")
        if held:
            cfg = dataclasses.replace(cfg, nsga2_population=held)
    sampler, pruner = cfg.make_sampler(worker, resumed_at), cfg.make_pruner(total_steps)
    if exists:
        study = optuna.load_study(study_name=cfg.study.name, storage=storage, sampler=sampler, pruner=pruner)
    else:  # another process may create it at the same moment: load_if_exists
        study = optuna.create_study(storage=storage, study_name=cfg.study.name, directions=directions,
                                    load_if_exists=True, sampler=sampler, pruner=pruner)
    have = [d.name.lower() for d in study.directions]
    if have != directions:
        was = study.user_attrs.get("objectives") or f"directions {have}"
        where = (f"move {cfg.study_dir} away or search with another --runs-dir" if cfg.default_store
                 else "search with another --storage")
        raise ConfigError("study.objectives.metrics", f"the {resumed_at} stored trials of {cfg.study.name!r} were searched "
                                                      f"for {was}; the study now asks {list(cfg.study.objectives)}; to "
                                                      f"start afresh, {where} (the old results stay readable there)")
    fingerprint.check(study, cfg, resumed_at, failed)
    if asking and finished < cfg.n_trials:  # (a search with nothing to run counts no start: the next keeps its seed)
        with search_lock(cfg, {}):
            starts = dict(study.user_attrs.get(STARTS) or {})
            key = f"{resumed_at}:{worker}"
            before = int(starts.get(key, 0))
            starts[key] = before + 1
            study.set_user_attr(STARTS, starts)
            if cfg.sampler == "nsga2" and not study.user_attrs.get(NSGA_ATTR):  # bound as its first trials are asked
                from .config import nsga2_population

                study.set_user_attr(NSGA_ATTR, {"population": cfg.nsga2_population or nsga2_population(cfg.n_trials)})
        if before:  # the first start of each keeps the seed a lone search has always had
            study.sampler = cfg.make_sampler(worker, resumed_at, before)
    if worker == 0:
        definition = stored_definition_of(cfg.study)
        if definition and study.user_attrs.get(DEFINITION) != definition:  # the study is stored with its trials
            study.set_user_attr(DEFINITION, definition)
        attrs = study.user_attrs
        if "objectives" not in attrs:
            from ..version import __version__

            study.set_user_attr("objectives", list(cfg.study.objectives))
            study.set_user_attr("evomerge_version", __version__)
        if study.metric_names != list(cfg.study.objectives):  # optuna-dashboard shows them instead of "Objective 0"
            with quiet_optuna():
                study.set_metric_names(list(cfg.study.objectives))
    return study
