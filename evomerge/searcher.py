"""``evomerge search``: sample merge policies with Optuna or CMA-ES, judge each by a
real merge run, track everything in MLflow.

One worker loop (ask, run, tell) serves every sampler; ``jobs`` > 1 runs that loop
in separate processes on the same storage. A file lock in the study's runs folder
makes "count the finished trials, then ask" atomic among local processes, so
``n_trials`` is an exact total; SQLite's busy timeout keeps concurrent writers from
failing with "database is locked". Only the main process writes to MLflow: workers
send a record of every finished trial back to it.

Storage: ``runs/<study>/optuna.db`` (SQLite) by default, or any Optuna storage URL.
``n_trials`` counts toward a total: the study ends with that many finished trials
(complete or pruned); failed trials do not count and are asked again. Running the
same command again resumes the study.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import socket
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import __version__
from . import backends
from . import space as space_mod
from .errors import ConfigError
from .study import OBJECTIVES, Study

SAMPLERS = ("tpe", "random", "nsga2", "cmaes")
CMAES_CATEGORICALS = ("independent", "fixed")
HEARTBEAT_INTERVAL, GRACE_PERIOD = 5, 30


# -- configuration --------------------------------------------------------------------
@dataclass(frozen=True)
class SearchConfig:
    study: Study
    n_trials: int
    sampler: str = "tpe"
    storage: str = ""  # Optuna storage URL; default runs/<study>/optuna.db
    tracking_uri: str = ""  # MLflow; empty: $MLFLOW_TRACKING_URI, else runs/<study>/mlflow.db (tracking.resolve_tracking_uri)
    runs_dir: Path = Path("runs")
    jobs: int = 1
    seed: int = 0
    data_dir: str | None = None
    device: str | None = None
    cmaes_categoricals: str = "independent"
    cmaes_restarts: int = 0
    cmaes_popsize: int = 0
    prune: bool = True
    grace_period: int = GRACE_PERIOD  # seconds without a heartbeat before a running trial is failed and retried
    backend: str = "inprocess"  # how each trial's runs execute: simulate.BACKENDS
    procs: int | None = None  # distributed backend: processes per run (default: one per worker)

    @property
    def study_dir(self) -> Path:
        return self.runs_dir / self.study.name

    @property
    def multi(self) -> bool:
        return len(self.study.objectives) > 1


def default_storage(study_dir: Path) -> str:
    return f"sqlite:///{(study_dir / 'optuna.db').resolve()}"


def make_config(study: Study, *, n_trials: int | None = None, sampler: str | None = None, storage: str | None = None,
                tracking_uri: str | None = None, runs_dir: str | Path = "runs", jobs: int = 1, seed: int = 0,
                data_dir=None, device=None, cmaes_categoricals: str = "independent", cmaes_restarts: int = 0,
                cmaes_popsize: int = 0, prune: bool = True, grace_period: int = GRACE_PERIOD,
                backend: str = "inprocess", procs: int | None = None) -> SearchConfig:
    """Validate everything a search needs before any trial runs."""
    sampler = sampler or study.search.sampler
    if sampler not in SAMPLERS:
        raise ConfigError("--sampler", f"unknown {sampler!r}; allowed: {', '.join(SAMPLERS)}")
    n_trials = study.search.n_trials if n_trials is None else n_trials
    if n_trials < 1:
        raise ConfigError("--n-trials", f"{n_trials} is out of range; allowed: [1, inf)")
    if jobs < 1:
        raise ConfigError("--jobs", f"{jobs} is out of range; allowed: [1, inf)")
    if grace_period < 2:
        raise ConfigError("--grace-period", f"{grace_period} is out of range; allowed: [2, inf) seconds")
    if not study.search.space:
        raise ConfigError("study.search.space", "is empty: nothing to search")
    backends.check(backend, procs, study.run.workers)
    backends.check_policy(backend, study.policy)
    backends.check_space(backend, [p.name for p in study.search.space])
    if sampler == "cmaes":
        if len(study.objectives) > 1:
            raise ConfigError("--sampler", "cmaes optimises one objective; this study has "
                                           f"{len(study.objectives)} (use nsga2, tpe or random)")
        if not space_mod.numeric(study.search.space):
            raise ConfigError("--sampler", "cmaes needs at least one numeric field in study.search.space")
        if cmaes_categoricals not in CMAES_CATEGORICALS:
            raise ConfigError("--cmaes-categoricals", f"unknown {cmaes_categoricals!r}; allowed: {', '.join(CMAES_CATEGORICALS)}")
    runs_dir = Path(runs_dir)
    study_dir = runs_dir / study.name
    return SearchConfig(study, n_trials, sampler, normalise_url(storage) if storage else default_storage(study_dir),
                        tracking_uri or "", runs_dir, jobs, seed,
                        str(data_dir) if data_dir else None, device, cmaes_categoricals, cmaes_restarts, cmaes_popsize, prune,
                        grace_period, backend, procs)


def normalise_url(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; use psycopg 3 when that is the driver installed."""
    if url.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


# -- Optuna plumbing -------------------------------------------------------------------
@contextlib.contextmanager
def quiet_optuna():
    """Silence Optuna's notes that heartbeats are experimental and meant for Study.optimize:
    evomerge records heartbeats itself from each round of a run."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def open_storage(url: str, grace_period: int = GRACE_PERIOD, study: str | None = None):
    """An Optuna RDB storage with heartbeats. With ``study``, a trial that goes stale (its process
    died) is retried: its parameters are enqueued again, marked ``retry_of``."""
    import optuna

    kwargs: dict[str, Any] = {}
    if study is not None:
        kwargs["heartbeat_stale_trial_callback"] = _retry_stale
    if url.startswith("sqlite:"):
        path = url.split("sqlite:///", 1)[-1]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    try:
        with quiet_optuna():
            return retry_setup(lambda: optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_INTERVAL, grace_period=grace_period, **kwargs))
    except Exception as e:  # bad URL, missing driver, unreachable server: one line
        raise ConfigError("--storage", f"cannot open {url}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


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


@contextlib.contextmanager
def search_lock(cfg: SearchConfig, engine_cache: dict):
    """Make "count the finished trials, then ask" atomic: a PostgreSQL advisory lock when the study
    lives in PostgreSQL (every machine sharing it), else a lock file in the study's runs folder."""
    if cfg.storage.startswith("postgresql"):
        import hashlib

        import sqlalchemy

        engine = engine_cache.get("engine")
        if engine is None:
            engine = engine_cache["engine"] = sqlalchemy.create_engine(cfg.storage, poolclass=sqlalchemy.pool.NullPool)
        key = int.from_bytes(hashlib.sha1(f"evomerge:{cfg.study.name}".encode()).digest()[:8], "big", signed=True)
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("select pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("select pg_advisory_unlock(:k)"), {"k": key})
    else:
        with file_lock(cfg.study_dir / "search.lock"):
            yield


def make_sampler(cfg: SearchConfig, worker: int = 0, resumed_at: int = 0):
    """The sampler of one search process. Its seed mixes the search seed, the worker and how many
    trials the study held when it started, so a resumed search does not replay earlier samples."""
    import optuna

    seed = int(np.random.SeedSequence([cfg.seed, worker, resumed_at]).generate_state(1)[0])
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if cfg.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, cfg.n_trials // 3)))
    return optuna.samplers.RandomSampler(seed=seed)  # random, and cmaes's categoricals


def make_pruner(cfg: SearchConfig):
    import optuna

    if not cfg.prune or cfg.multi or cfg.sampler == "cmaes":
        return optuna.pruners.NopPruner()
    first_round = max(1, cfg.study.run.rounds // 5)
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=first_round, n_min_trials=3)


def load_or_create(cfg: SearchConfig, storage, worker: int = 0):
    import optuna

    directions = cfg.study.directions
    resumed_at = 0
    try:
        resumed_at = len(storage.get_all_trials(storage.get_study_id_from_name(cfg.study.name), deepcopy=False))
    except KeyError:
        pass
    study = optuna.create_study(storage=storage, study_name=cfg.study.name, directions=directions, load_if_exists=True,
                                sampler=make_sampler(cfg, worker, resumed_at), pruner=make_pruner(cfg))
    have = [d.name.lower() for d in study.directions]
    if have != directions:
        raise ConfigError("study.objectives.metrics", f"the stored study {cfg.study.name!r} has directions {have}; "
                                                      f"this study file asks {directions} (use another --storage)")
    if worker == 0 and "objectives" not in study.user_attrs:
        study.set_user_attr("objectives", list(cfg.study.objectives))
        study.set_user_attr("evomerge_version", __version__)
    return study


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def count_states(trials) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


# -- multi-objective pruning --------------------------------------------------------------
MO_MIN_TRIALS, MO_FRACTION = 5, 0.5


def dominated_count(point: tuple[float, ...], others: list[tuple[float, ...]], directions: list[str]) -> int:
    """How many of ``others`` dominate ``point`` (no worse in every objective, better in one)."""
    sign = [1.0 if d == "maximize" else -1.0 for d in directions]
    p = [s * v for s, v in zip(sign, point)]
    n = 0
    for o in others:
        q = [s * v for s, v in zip(sign, o)]
        if all(a >= b for a, b in zip(q, p)) and any(a > b for a, b in zip(q, p)):
            n += 1
    return n


def mo_should_prune(point, step: int, completed_curves: list[dict], directions: list[str]) -> bool:
    """The rule for multi-objective studies, which Optuna cannot prune: stop a trial whose
    point at a reporting step is dominated by at least half of the completed trials'
    points at the same step, once at least 5 completed trials have reached that step."""
    others = [tuple(c[str(step)]) for c in completed_curves if str(step) in c]
    if len(others) < MO_MIN_TRIALS:
        return False
    return dominated_count(point, others, directions) >= math.ceil(MO_FRACTION * len(others))


# -- one trial ------------------------------------------------------------------------------
class _Pruned(Exception):
    pass


def objective_values(study: Study, finals: list[dict]) -> list[float]:
    return [statistics.fmean(float(f[o]) for f in finals) for o in study.objectives]


def evaluate(trial, ostudy, setup, policy, cfg: SearchConfig, storage, simulate_fn) -> dict:
    """Run the policy on every seed of the study, reporting each round; return a record."""
    import optuna

    study = cfg.study
    T = setup.total_steps
    histories, finals = [], []
    curve: dict[str, list[float]] = {}
    completed_curves: list[dict] | None = None
    if cfg.multi and cfg.prune:
        completed_curves = [t.user_attrs["curve"] for t in ostudy.get_trials(deepcopy=False,
                            states=(optuna.trial.TrialState.COMPLETE,)) if "curve" in t.user_attrs]
    trial_id = trial._trial_id  # Optuna's own optimize loop records heartbeats by this id too

    for k, seed in enumerate(study.run.seeds):
        def on_round(m, k=k):
            storage.record_heartbeat(trial_id)
            step = k * T + m.step
            point = [m.val_accuracy if o == "val_accuracy" else m.mean_worker_accuracy if o == "mean_worker_accuracy"
                     else float(m.bytes) if o == "bytes" else m.wall_time for o in study.objectives]
            curve[str(step)] = point
            if cfg.multi:
                if completed_curves is not None and m.round > 1 and mo_should_prune(point, step, completed_curves, study.directions):
                    raise _Pruned(step, point[0])
            else:
                trial.report(point[0], step)
                if trial.should_prune():
                    raise _Pruned(step, point[0])

        res = simulate_fn(setup, policy, seed, callback=on_round, device=cfg.device)
        histories.append([_round_dict(h) for h in res.history])
        finals.append(res.metrics())
        if res.status == "diverged":
            break
    return {"histories": histories, "finals": finals, "curve": curve, "total_steps": T,
            "status": "diverged" if any(f["status"] == "diverged" for f in finals) else "ok"}


def _round_dict(h) -> dict:
    from dataclasses import asdict

    return asdict(h)


CURVE_KEYS = ("step", "val_accuracy", "consensus_distance", "bytes")


def curve_of(history: list[dict]) -> dict[str, list[float]]:
    """The learning curve a dashboard draws: one list per key, one entry per round."""
    return {k: [h[k] for h in history] for k in CURVE_KEYS}


def _summarise(finals: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    keys = ("val_accuracy", "val_loss", "mean_worker_accuracy", "worst_worker_accuracy", "consensus_distance",
            "bytes", "merges", "local_steps", "wall_time")
    for k in keys:
        vals = [float(f[k]) for f in finals if k in f]
        if vals:
            out[k] = statistics.fmean(vals)
            if len(vals) > 1:
                out[f"{k}_std"] = statistics.stdev(vals)
    return out


# -- the worker loop ---------------------------------------------------------------------------
def work(cfg: SearchConfig, worker: int, on_record: Callable[[dict], None], data=None, should_stop=lambda: False) -> None:
    """Ask, run and tell trials until the study holds ``cfg.n_trials`` finished trials."""
    with quiet_optuna():
        _work(cfg, worker, on_record, data, should_stop)


def _work(cfg, worker, on_record, data, should_stop) -> None:
    import optuna

    from . import simulate
    from .cmaes import ATTR_GEN, ATTR_INDEX, ATTR_RESTART, CmaDriver

    storage = open_storage(cfg.storage, cfg.grace_period, cfg.study.name)
    ostudy = load_or_create(cfg, storage, worker)
    setup = simulate.prepare(cfg.study, data=data, data_dir=cfg.data_dir)
    run_fn = backends.runner(cfg.backend, cfg.procs)
    space = cfg.study.search.space
    dists = space_mod.distributions(space)
    driver = None
    if cfg.sampler == "cmaes":
        driver = CmaDriver(len(space_mod.numeric(space)), seed=cfg.seed, popsize=cfg.cmaes_popsize or None,
                           restarts=cfg.cmaes_restarts, maximize=cfg.study.directions[0] == "maximize")
        if cfg.cmaes_categoricals == "fixed":
            dists = {k: v for k, v in dists.items() if k in {p.name for p in space_mod.numeric(space)}}
    engines: dict = {}
    Done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)

    while not should_stop():
        trial, n_before = None, None
        try:
            with search_lock(cfg, engines):
                optuna.storages.fail_stale_trials(ostudy)
                trials = ostudy.get_trials(deepcopy=False)
                n_before = len(trials)
                done = sum(t.state in Done for t in trials)
                running = sum(t.state == optuna.trial.TrialState.RUNNING for t in trials)
                if done >= cfg.n_trials:
                    return
                if done + running < cfg.n_trials:
                    if driver is None:
                        trial = ostudy.ask(fixed_distributions=dists)
                    else:
                        cand = driver.next(trials)
                        if cand is not None:
                            ostudy.enqueue_trial(space_mod.decode(space, cand.x), user_attrs={
                                ATTR_RESTART: cand.restart, ATTR_GEN: cand.generation, ATTR_INDEX: cand.index})
                            trial = ostudy.ask(fixed_distributions=dists)
                if trial is not None:
                    # a heartbeat from the start: Optuna only ever fails as stale trials that have one
                    storage.record_heartbeat(trial._trial_id)
            if trial is None:
                time.sleep(0.5)  # the last trials are running elsewhere; a dead one goes stale after the grace period
                continue
            record = run_trial(trial, ostudy, setup, cfg, storage, run_fn)
        except KeyboardInterrupt:
            # a Ctrl-C between ask and the trial's own handler: the asked trial must not stay RUNNING
            if trial is not None and mark_interrupted(ostudy, trial):
                raise _Interrupted(_bare_record(trial, cfg, setup.total_steps, state="FAIL", failure="interrupted")) from None
            if trial is None and n_before is not None:
                _fail_orphans(ostudy, n_before)  # interrupted inside ask(): the trial it created is not ours to keep
            raise
        on_record(record)


def _fail_orphans(ostudy, n_before: int) -> None:
    """Fail RUNNING trials that appeared while this process held the lock and never started
    (no ``policy`` attribute yet, which run_trial sets first)."""
    import optuna

    for t in ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if t.number >= n_before and "policy" not in t.user_attrs:
            try:
                ostudy._storage.set_trial_user_attr(t._trial_id, "failure", "interrupted")
                ostudy.tell(t.number, state=optuna.trial.TrialState.FAIL)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
                pass


def mark_interrupted(ostudy, trial) -> bool:
    """Fail ``trial`` as interrupted if it is still running; True if this call did it."""
    import optuna

    try:
        trial.set_user_attr("failure", "interrupted")
        ostudy.tell(trial, state=optuna.trial.TrialState.FAIL)
        return True
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
        return False  # already finished


def _bare_record(trial, cfg: SearchConfig, total_steps: int, **state) -> dict[str, Any]:
    """A trial's record before it has run; ``state`` fills in how it ended, if it already has."""
    now = time.time()
    return {"number": trial.number, "study": cfg.study.name, "sampler": cfg.sampler, "seeds": list(cfg.study.run.seeds),
            "start": now, "end": now, "histories": [], "final": {}, "total_steps": total_steps, "params": dict(trial.params),
            "policy": {}, "cma": {}, **state}


@contextlib.contextmanager
def heartbeat(storage, trial_id: int, every: float):
    """Record the trial's heartbeat every ``every`` seconds while it runs, as Optuna's own optimize
    loop does: a slow round must not make other processes take the trial for dead."""
    import threading

    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            try:
                storage.record_heartbeat(trial_id)
            except Exception:  # the storage is briefly unreachable: the next beat tries again
                pass

    thread = threading.Thread(target=beat, name=f"evomerge-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_trial(trial, ostudy, setup, cfg: SearchConfig, storage, simulate_fn) -> dict:
    with heartbeat(storage, trial._trial_id, max(0.5, cfg.grace_period / 3)):
        return _run_trial(trial, ostudy, setup, cfg, storage, simulate_fn)


def _run_trial(trial, ostudy, setup, cfg: SearchConfig, storage, simulate_fn) -> dict:
    import optuna

    record = _bare_record(trial, cfg, setup.total_steps)
    try:
        record["cma"] = {k: v for k, v in trial.user_attrs.items() if k.startswith("cma_")}
        policy = space_mod.policy_from_params(cfg.study, trial.params)
        record["policy"] = policy.to_dict()
        trial.set_user_attr("policy", record["policy"])
        trial.set_user_attr("sampler", cfg.sampler)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        out = evaluate(trial, ostudy, setup, policy, cfg, storage, simulate_fn)
        record.update(histories=out["histories"], final=_summarise(out["finals"]), run_status=out["status"])
        values = objective_values(cfg.study, out["finals"])
        trial.set_user_attr("metrics", {str(s): _slim(f) for s, f in zip(cfg.study.run.seeds, out["finals"])})
        trial.set_user_attr("spread", {k: v for k, v in record["final"].items() if k.endswith("_std")})
        trial.set_user_attr("run_status", out["status"])
        trial.set_user_attr("history", curve_of(out["histories"][0]))
        if cfg.multi:
            trial.set_user_attr("curve", out["curve"])
        ostudy.tell(trial, values)
        record.update(state="COMPLETE", values=values)
    except _Pruned as p:
        step, last = p.args
        record.update(state="PRUNED", values=None, pruned_at=step)
        trial.set_user_attr("last_value", last)
        trial.set_user_attr("pruned_at_step", step)
        ostudy.tell(trial, state=optuna.trial.TrialState.PRUNED)
    except KeyboardInterrupt:
        mark_interrupted(ostudy, trial)
        record.update(state="FAIL", failure="interrupted", end=time.time())
        raise _Interrupted(record) from None
    except optuna.exceptions.UpdateFinishedTrialError:
        # another process took this trial for dead (no heartbeat within the grace period) and failed it
        record.update(state="FAIL", failure="taken over", error="failed by another process (heartbeat missed)")
    except Exception as e:  # a bad trial fails alone; the search goes on
        msg = f"{type(e).__name__}: {e}"
        try:
            trial.set_user_attr("failure", "error")
            trial.set_user_attr("error", msg[:1000])
            ostudy.tell(trial, state=optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass
        record.update(state="FAIL", failure="error", error=msg + "\n" + traceback.format_exc(limit=5))
    record["end"] = time.time()
    return record


class _Interrupted(Exception):
    """Carries the record of the trial that a Ctrl-C interrupted."""


def _slim(f: dict) -> dict:
    return {k: v for k, v in f.items() if isinstance(v, (int, float, str))}


# -- processes ---------------------------------------------------------------------------------
def _worker_main(cfg: SearchConfig, worker: int, queue) -> None:
    import optuna
    import torch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a process of ours: its logging is ours to set
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.jobs))
    try:
        work(cfg, worker, queue.put)
    except _Interrupted as i:
        queue.put(i.args[0])
    except KeyboardInterrupt:
        pass
    except ConfigError as e:
        queue.put({"fatal": str(e)})
    finally:
        queue.put({"worker_done": worker})


# -- the whole search ------------------------------------------------------------------------------
@dataclass
class SearchResult:
    config: SearchConfig
    records: list[dict] = field(default_factory=list)
    interrupted: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    best: list[dict] = field(default_factory=list)
    parent_run_id: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def optuna_study(self):
        import optuna

        return optuna.load_study(study_name=self.config.study.name, storage=open_storage(self.config.storage))


def run_search(cfg: SearchConfig, *, data=None, progress=None) -> SearchResult:
    """Run the search described by ``cfg``. ``progress(event, **info)`` is told of the start and of each trial."""
    from .tracking import Tracker, check_reachable, resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking_uri, cfg.study_dir)
    check_reachable(uri)  # before the first trial
    cfg.study_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(cfg.storage)
    ostudy = load_or_create(cfg, storage)
    before = count_states(ostudy.get_trials(deepcopy=False))
    tracker = retry_setup(lambda: Tracker(uri, cfg.study.name, cfg.study_dir / "mlartifacts", study=cfg.study))
    parent = tracker.start_parent(
        f"search-{cfg.sampler}-{time.strftime('%Y%m%d-%H%M%S')}",
        {"sampler": cfg.sampler, "n_trials": cfg.n_trials, "jobs": cfg.jobs, "seed": cfg.seed, "storage": cfg.storage,
         "objectives": ",".join(cfg.study.objectives), "cmaes_categoricals": cfg.cmaes_categoricals if cfg.sampler == "cmaes" else "",
         "study_file": str(cfg.study.path or "")},
        {"evomerge.version": __version__, "evomerge.study": cfg.study.name})
    result = SearchResult(cfg, parent_run_id=parent)
    if progress:
        progress("start", before=before, storage=cfg.storage, tracking_uri=uri)

    def on_record(rec: dict) -> None:
        if "fatal" in rec:
            result.errors.append(rec["fatal"])
            return
        rec["mlflow_run_id"] = tracker.log_trial(rec)
        result.records.append(rec)
        if rec.get("failure") == "error":
            result.errors.append(f"trial {rec['number']}: {rec['error'].splitlines()[0]}")
        if progress:
            progress("trial", record=rec)

    status = "FINISHED"
    try:
        if cfg.jobs == 1:
            try:
                work(cfg, 0, on_record, data=data)
            except _Interrupted as i:
                on_record(i.args[0])
                raise KeyboardInterrupt from None
        else:
            _run_processes(cfg, on_record)
    except KeyboardInterrupt:
        result.interrupted = True
        status = "KILLED"
    finally:
        trials = ostudy.get_trials(deepcopy=False)
        result.counts = count_states(trials)
        result.best = best_trials(ostudy, cfg.study, 5)
        best_value = result.best[0]["values"][0] if result.best else None
        tracker.end_parent(status, {"best_" + cfg.study.objectives[0]: best_value,
                                    "trials_complete": result.counts.get("COMPLETE", 0)})
        if result.best and not result.interrupted:  # the best trial's values, policy and consensus model on the parent
            tracker.log_best(result.best[0], data=data, data_dir=cfg.data_dir, device=cfg.device)
    return result


def _run_processes(cfg: SearchConfig, on_record) -> None:
    import multiprocessing as mp
    import queue as queue_mod
    import signal

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(cfg, w, q), daemon=True) for w in range(cfg.jobs)]
    for p in procs:
        p.start()
    done = 0
    try:
        while done < len(procs):
            try:
                rec = q.get(timeout=1.0)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if "worker_done" in rec:
                done += 1
            else:
                on_record(rec)
    except KeyboardInterrupt:
        for p in procs:  # a Ctrl-C in a terminal reached them too; a signal to this process alone did not
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        deadline = time.time() + 30
        while time.time() < deadline and any(p.is_alive() for p in procs):
            try:
                rec = q.get(timeout=0.5)
                if "worker_done" not in rec:
                    on_record(rec)
            except queue_mod.Empty:
                pass
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()


# -- reading a study back -----------------------------------------------------------------------------
def best_trials(ostudy, study: Study, n: int = 5) -> list[dict]:
    """The best finished trials: by the objective (single), or the Pareto set sorted by the first objective."""
    import optuna

    complete = ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not complete:
        return []
    if len(study.objectives) == 1:
        rev = study.directions[0] == "maximize"
        ranked = sorted(complete, key=lambda t: t.values[0], reverse=rev)[:n]
    else:
        pareto = {t.number for t in ostudy.best_trials}
        ranked = sorted((t for t in complete if t.number in pareto), key=lambda t: t.values[0],
                        reverse=study.directions[0] == "maximize")
    return [trial_summary(t, study) for t in ranked]


def trial_summary(t, study: Study) -> dict:
    return {"number": t.number, "values": list(t.values), "objectives": list(study.objectives),
            "params": dict(t.params), "policy": t.user_attrs.get("policy", {}), "metrics": t.user_attrs.get("metrics", {}),
            "spread": t.user_attrs.get("spread", {}), "run_status": t.user_attrs.get("run_status", "ok"),
            "cma": {k: v for k, v in t.user_attrs.items() if k.startswith("cma_")}}


def baseline_rows(study: Study, data=None, data_dir=None, device=None, storage_study=None) -> list[dict]:
    """Every baseline on the study's seeds (mean over seeds); cached in the Optuna study's user attributes."""
    key = "baselines-v2:" + ",".join(map(str, study.run.seeds))
    if storage_study is not None and key in storage_study.user_attrs:
        return storage_study.user_attrs[key]
    from . import simulate

    setup = simulate.prepare(study, data=data, data_dir=data_dir)
    rows = []
    for name in study.baselines:
        pol = study.resolve_policy(name)
        results = [simulate.simulate(setup, pol, s, device=device) for s in study.run.seeds]
        finals = [r.metrics() for r in results]
        rows.append({"name": name, "values": objective_values(study, finals), **_summarise(finals),
                     "history": curve_of([_round_dict(h) for h in results[0].history]), "policy": pol.to_dict()})
    if storage_study is not None:
        storage_study.set_user_attr(key, rows)
    return rows


def objective_label(name: str) -> str:
    return {"val_accuracy": "val acc", "mean_worker_accuracy": "mean worker acc", "bytes": "bytes",
            "wall_time": "wall s"}.get(name, name) + (" (max)" if OBJECTIVES[name] == "maximize" else " (min)")
