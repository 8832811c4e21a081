"""The search itself: one worker loop (ask, run, tell) serves every sampler; ``jobs`` > 1 runs
that loop in separate processes on the same storage (supervised by :mod:`evomerge.procs`).

``n_trials`` counts toward a total: the study ends with that many finished trials (complete or
pruned); failed trials do not count and are asked again. Running the same search again resumes
it. Only the main process writes to MLflow: workers send a record of every finished trial back.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..dburls import shown
from ..errors import ConfigError, RunError
from .config import SearchConfig
from .results import best_trials, count_states
from .storage import check_storage, fail_gone, fail_unstarted, load_or_create, open_storage, quiet_optuna, retry_setup, search_lock
from .trial import Interrupted, bare_record, beat_if_slow, mark_interrupted, run_batch, run_trial


#: trials in a row that fail with an error before a search process stops (every trial failing, e.g. a user's
#: model that raises, would otherwise be asked again forever: failed trials do not count toward n_trials)
MAX_ERRORS = 10
MAX_REUSES = 10  # proposals in a row of policies already evaluated: the sampler has converged


def check_fragments(study, model) -> None:
    """Before any trial: Streaming DiLoCo's fragments (fixed or searched) are at most the model's parameter tensors."""
    from ..errors import ConfigError

    n = model.n_trained_blocks
    for p in study.search.space:
        if p.name == "fragments":
            top = max(p.choices) if p.kind == "categorical" else p.high
            if top > n:
                raise ConfigError("study.search.space.fragments", f"{top:g} is more than the model's {n} parameter "
                                                                  f"tensors; allowed: at most {n}")
    if study.policy.fragments > n:
        raise ConfigError("study.policy.fragments", f"{study.policy.fragments} is more than the model's {n} parameter "
                                                    f"tensors; allowed: at most {n}")


def checked_setup(cfg: SearchConfig, data=None):
    """The trials' setup, checked (the data, the model on a few examples, the backend, the fragments): each worker's
    before its first trial, and the search's before the study is stored, so that a mistake in a user's loader or
    model is one line and the fixed file then searches as a new study (its definition was never stored)."""
    from .. import backends
    from ..engine.setup import prepare

    setup = prepare(cfg.study, data=data, data_dir=cfg.data_dir)
    backends.check_model(cfg.backend, setup.model)
    backends.check_launch(cfg.backend)
    check_fragments(cfg.study, setup.model)
    return setup


def nsga2_notes(cfg: SearchConfig, ostudy) -> list[str]:
    """An NSGA-II search's generations (a third of the first search's --n-trials, 4 to 20, kept with the study:
    :func:`evomerge.search.storage.kept_population`): said where this search's own --n-trials would give another
    size, and where the search is one generation or less (every trial then a random draw)."""
    from .config import nsga2_population
    from .storage import kept_population

    trials = ostudy.get_trials(deepcopy=False)
    held = kept_population(ostudy.user_attrs, trials) if trials else None
    size = held or cfg.nsga2_population or nsga2_population(cfg.n_trials)
    notes = []
    if held and held != (cfg.nsga2_population or nsga2_population(cfg.n_trials)):
        notes.append(f"nsga2: study {cfg.study.name}'s generations are of {held} trials, as its first NSGA-II search "
                     f"drew them (a third of its --n-trials, 4 to 20; its trials hold their places in them)")
    if cfg.n_trials <= size:
        notes.append(f"nsga2: --n-trials {cfg.n_trials} is at most one generation of {size} trials: NSGA-II breeds "
                     "from a generation once it is done, so every trial is a random draw (more trials)")
    return notes


# -- the worker loop ---------------------------------------------------------------------------
MODEL_BYTES = "model_bytes"  # the Optuna study's user attribute: one worker's parameters and buffers in float32
# the Optuna study's user attribute: its CMA-ES generations' size and seed, fixed by its first CMA-ES trials (a
# resume with another --batch replayed generations of another size: trials were credited to points never run)
CMA_ATTR = "cmaes"


def cmaes_fixed(cfg: SearchConfig, ostudy) -> list[str]:
    """A CMA-ES search's generations: the size and seed the study's CMA-ES trials were drawn with, kept with the study
    once it holds any (their places in them are stored, and replayed); a resume that would draw others uses those,
    and says so. An explicit --cmaes-popsize of another size is one line naming it. A study whose CMA-ES trials came
    before the attribute: the size its trials show (a whole first generation's, else at least its places). Notes
    for the search's start."""
    from . import space as space_mod
    from .cmaes import ATTR_GEN, ATTR_INDEX, ATTR_RESTART, default_popsize

    dim = len(space_mod.numeric(cfg.study.search.space))
    want = {"popsize": cfg.cmaes_popsize or (cfg.batch if cfg.batch > 1 else default_popsize(dim)), "seed": cfg.seed}
    placed = [t.user_attrs for t in ostudy.get_trials(deepcopy=False) if ATTR_GEN in t.user_attrs]
    have = ostudy.user_attrs.get(CMA_ATTR) if placed else None  # (binding once a trial holds its place)
    notes = []
    if have is None and placed:  # trials from before the attribute: the size they show
        first = {a[ATTR_INDEX] for a in placed if a[ATTR_RESTART] == 0 and a[ATTR_GEN] == 0}
        later = any(a[ATTR_RESTART] == 0 and a[ATTR_GEN] > 0 for a in placed)
        least = max(first, default=-1) + 1  # (a first generation not yet whole: at least its places)
        size = (len(first) if later else want["popsize"] if want["popsize"] >= least else
                max(least, default_popsize(dim)))
        have = {"popsize": size, "seed": cfg.seed}
        ostudy.set_user_attr(CMA_ATTR, have)
        if size != want["popsize"]:
            notes.append(f"cmaes: study {cfg.study.name}'s trials are placed in generations of {size} candidates "
                         f"(taken from them; the seed taken as --seed {cfg.seed})")
    elif have is None:
        ostudy.set_user_attr(CMA_ATTR, want)
        have = want
    elif cfg.cmaes_popsize and cfg.cmaes_popsize != have["popsize"]:
        raise ConfigError("--cmaes-popsize", f"{cfg.cmaes_popsize}; study {cfg.study.name}'s CMA-ES generations are of "
                                             f"{have['popsize']} candidates (its first CMA-ES search's: its trials "
                                             f"hold their places in them); allowed: {have['popsize']} or 0, or another "
                                             "[study] name or --runs-dir to start afresh")
    elif have != want:
        asked = f", asked {cfg.batch} at a time" if cfg.batch > 1 and cfg.batch != have["popsize"] else ""
        seed = f" and seed {have['seed']}" if have["seed"] != want["seed"] else ""
        notes.append(f"cmaes: study {cfg.study.name}'s generations are of {have['popsize']} candidates{seed}, as its "
                     f"first CMA-ES search drew them (its trials hold their places in them){asked}")
    if cfg.n_trials < have["popsize"] and not placed:
        notes.append(f"cmaes: --n-trials {cfg.n_trials} is less than one generation of {have['popsize']} candidates: "
                     "CMA-ES learns from a generation once all of it is done, so every trial is a draw from its "
                     "start (more trials, or a smaller --cmaes-popsize)")
    return notes


def work(cfg: SearchConfig, worker: int, on_record: Callable[[dict], None], data=None, should_stop=lambda: False,
         keeper=None, setup=None, stop=None) -> None:
    """Ask, run and tell trials until the study holds ``cfg.n_trials`` finished trials; ``keeper`` keeps the best
    trial's consensus model (search/consensus.py); ``setup``: the trials' setup, already checked (``checked_setup``);
    ``stop`` (procs.Stop): a stop signal that a callback swallowed is raised before the next trial."""
    with quiet_optuna():
        _work(cfg, worker, on_record, data, should_stop, keeper, setup, stop)


def _work(cfg, worker, on_record, data, should_stop, keeper=None, setup=None, stop=None) -> None:
    import optuna

    from .. import backends
    from . import asking
    from . import space as space_mod
    from .cmaes import CmaDriver
    from .warmstart import ATTR as ATTR_WARM

    storage = open_storage(cfg.storage, cfg.grace_period, cfg.study.name)
    setup = setup if setup is not None else checked_setup(cfg, data)
    if cfg.batch > 1 and getattr(setup.model, "random", False) and getattr(setup.model, "execution", "") == "stacked":
        import warnings

        warnings.warn("--batch: the model has random layers and runs 'stacked' (study.model.execution), whose masks a "
                      "population draws for all its rows together: its trials will differ from their runs alone and "
                      "from evomerge run's replay; execution 'auto' or 'loop' keeps each worker's masks its own",
                      stacklevel=2)
    # the pruner judges by the run's local steps
    ostudy = load_or_create(cfg, storage, worker, setup.total_steps, asking=True)
    from ..models import float32_bytes

    size = float32_bytes(setup.model)
    if ostudy.user_attrs.get(MODEL_BYTES) != size:  # the model's size: an export carries it, and a Merger given a
        ostudy.set_user_attr(MODEL_BYTES, size)     # model of another size says so (a study whose trials all failed
        #                                             takes its model as it is now)
    run_fn = backends.runner(cfg.backend, cfg.procs)
    space = cfg.study.search.space
    dists = space_mod.distributions(space)
    driver = None
    if cfg.sampler == "cmaes":
        warm = ostudy.user_attrs.get(ATTR_WARM) or {}  # a warm-started study replays from its stored start
        # with --batch N a generation is N candidates unless --cmaes-popsize says otherwise
        popsize = cfg.cmaes_popsize or (cfg.batch if cfg.batch > 1 else None)
        fixed = ostudy.user_attrs.get(CMA_ATTR) or {}  # the study's generations, as its first CMA-ES search drew them
        driver = CmaDriver(len(space_mod.numeric(space)), seed=fixed.get("seed", cfg.seed),
                           popsize=fixed.get("popsize", popsize),
                           restarts=cfg.cmaes_restarts, maximize=cfg.study.directions[0] == "maximize",
                           **{k: warm[k] for k in ("x0", "sigma0", "stds") if k in warm})
        if cfg.cmaes_categoricals == "fixed":
            dists = {k: v for k, v in dists.items() if k in {p.name for p in space_mod.numeric(space)}}
    # a batch of TPE asks goes to an in-memory copy of the study (search/asking.py), with a sampler of its own that
    # starts where the study's does
    mirror = asking.Mirror(ostudy, copy.deepcopy(ostudy.sampler)) if cfg.batch > 1 and asking.mirrored(ostudy) else None
    engines: dict = {}
    Done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    errors = 0  # trials of this process that failed with an error since the last one that finished
    reuses = 0  # trials of this process in a row whose policy was already evaluated (reused, not trained)

    while not should_stop():
        if stop is not None:
            stop.check()
        asked: list = []
        n_before = None
        try:
            with search_lock(cfg, engines):
                optuna.storages.fail_stale_trials(ostudy)
                trials = ostudy.get_trials(deepcopy=False)
                if fail_unstarted(ostudy, trials, cfg.grace_period):  # (no heartbeat: Optuna's check never fails them)
                    trials = ostudy.get_trials(deepcopy=False)
                n_before = len(trials)
                done = sum(t.state in Done for t in trials)
                running = sum(t.state == optuna.trial.TrialState.RUNNING for t in trials)
                if done >= cfg.n_trials:
                    return
                # --batch N: up to N trials at once (TPE's constant liar takes the running ones for bad;
                # CMA-ES hands out its generation's candidates until they all run)
                k = min(cfg.batch, cfg.n_trials - done - running)
                asking_since = time.monotonic()
                if k > 0 and (driver is not None or asking.independent(ostudy)):  # random, CMA-ES: created with values
                    asking.ask_batch(ostudy, storage, dists, k, asked, trials=trials, driver=driver, space=space)
                else:
                    if k > 0 and mirror is not None:  # TPE's batch: asked against a copy of the study
                        mirror.ask(storage, dists, k, asked, trials=trials)
                        if not mirror.usable:  # a trial the copy cannot hold: Study.ask from now on
                            mirror = None
                    for _ in range(k - len(asked)):
                        trial = ostudy.ask(fixed_distributions=dists)
                        # a heartbeat from the start: Optuna only ever fails as stale trials that have one
                        storage.record_heartbeat(trial._trial_id)
                        asked.append(trial)
                beat_if_slow(storage, asked, asking_since, cfg.grace_period)  # a big batch: its first trials too
            if not asked:
                time.sleep(0.5)  # the last trials are running elsewhere; a dead one goes stale after the grace period
                continue
            if cfg.batch == 1:
                records = [run_trial(asked[0], ostudy, setup, cfg, storage, run_fn, keeper)]
            else:
                records = run_batch(asked, ostudy, setup, cfg, storage)
        except KeyboardInterrupt:
            # a Ctrl-C between ask and the trials' own handler: the asked trials must not stay RUNNING
            marked = [t for t in asked if mark_interrupted(ostudy, t)]
            if n_before is not None:
                _fail_orphans(ostudy, n_before)  # interrupted inside ask(): the trial it created is not ours to keep
            if marked:
                raise Interrupted(*[bare_record(t, cfg, setup.total_steps, state="FAIL", failure="interrupted")
                                    for t in marked]) from None
            raise
        for record in records:
            on_record(record)
            if record.get("failure") == "error":
                errors += 1
                if errors >= MAX_ERRORS:
                    last = record.get("error", "").splitlines()[0] if record.get("error") else "?"
                    raise RunError(f"search stopped: the last {errors} trials failed with an error (the last: {last}); "
                                   "finished trials are kept; fix the cause and run the same command again")
            elif record.get("state") in ("COMPLETE", "PRUNED"):
                errors = 0
            if record.get("reused_from") is not None:
                reuses += 1
                if reuses >= MAX_REUSES:
                    raise RunError(f"search stopped: the sampler proposed {reuses} policies in a row that were already "
                                   f"evaluated (the last: trial {record['reused_from']}'s), so it has converged; "
                                   "finished trials are kept; widen [search.space] or search with another --seed")
            elif record.get("state") in ("COMPLETE", "PRUNED"):
                reuses = 0


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


# -- processes ---------------------------------------------------------------------------------
def _worker_main(cfg: SearchConfig, worker: int, queue) -> None:
    """One ``--jobs`` process. SIGINT (the command's Ctrl-C, passed on) and SIGTERM stop it as a Ctrl-C stops a
    search: the running trial fails as interrupted; a signal a callback of Python's swallowed is kept and raised
    before the next trial (procs.Stop), rather than lost while the command waits for this worker."""
    import signal

    from ..procs import signals_raise

    try:
        with signals_raise((signal.SIGINT, signal.SIGTERM)) as stop:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked while it started (_run_processes)
            import optuna
            import torch  # noqa: F401 (seconds of start-up: a Ctrl-C in it ends the worker quietly, as in a trial)

            optuna.logging.set_verbosity(optuna.logging.WARNING)  # a process of ours: its logging is ours to set
            from ..procs import apply_threads

            apply_threads(share=cfg.jobs)  # the command decided its threads once; each of its jobs gets a share
            work(cfg, worker, queue.put, stop=stop)
    except Interrupted as i:
        for rec in i.args:
            queue.put(rec)
    except KeyboardInterrupt:
        pass
    except (ConfigError, RunError) as e:
        queue.put({"fatal": str(e), "exit": 2 if isinstance(e, ConfigError) else 1})
    finally:
        queue.put({"worker_done": worker})


def _run_processes(cfg: SearchConfig, on_record, stop=None) -> None:
    """``cfg.jobs`` worker processes on the study; their records come back through a queue. A Ctrl-C,
    SIGTERM or SIGHUP asks them to stop (SIGINT: each fails its running trial as interrupted), waits
    up to 30 s for their last records, and the process group stops whatever is left."""
    import multiprocessing as mp
    import queue as queue_mod
    import signal

    from ..procs import ProcessGroup

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with ProcessGroup(grace=10) as group:
        # the workers start with SIGINT blocked (a process inherits its mask): a Ctrl-C while Python starts and
        # imports is held until _worker_main's first line, and ends the worker there quietly, not with a traceback
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the mask now, restored however the spawning ends
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            procs = [group.spawn(_worker_main, (cfg, w, q), ctx=ctx, name=f"evomerge-search-{w}") for w in range(cfg.jobs)]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        done = 0
        try:
            while done < len(procs):
                if stop is not None:
                    stop.check()
                try:
                    rec = q.get(timeout=1.0)
                except queue_mod.Empty:
                    if not group.alive():
                        break
                    continue
                if "worker_done" in rec:
                    done += 1
                else:
                    on_record(rec)
        except KeyboardInterrupt:
            group.send(signal.SIGINT)  # each worker leads its own process group: a terminal's Ctrl-C reaches only us
            deadline = time.time() + 30
            while time.time() < deadline and group.alive():
                try:
                    rec = q.get(timeout=0.5)
                    if "worker_done" not in rec:
                        on_record(rec)
                except queue_mod.Empty:
                    pass
            raise
        group.wait(5)


# -- the whole search ------------------------------------------------------------------------------
STUDY_EVERY = 2.0  # seconds between two reads of the whole study for the progress bar (search_view)


@dataclass
class SearchResult:
    """What ``evomerge.search`` returns: ``best`` (the best trials, each a dict with ``number``, ``values``,
    ``policy``, the searched ``run`` values, ``metrics`` and ``spread``), ``verdict`` (the picks against the tuned
    baselines on fresh seeds: ``headline``, ``lines``, ``notes``, ``seeds``; None without one), ``baselines``,
    ``counts`` (trials by state), ``errors``, ``interrupted`` and ``optuna_study``; ``evomerge.export(result)`` writes
    the policy to deploy."""

    config: SearchConfig
    records: list[dict] = field(default_factory=list)
    interrupted: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    diverged: int = 0  # COMPLETE trials whose runs diverged (counted in counts["COMPLETE"] too)
    best: list[dict] = field(default_factory=list)
    parent_run_id: str | None = None
    errors: list[str] = field(default_factory=list)
    fatal: list[tuple[str, int]] = field(default_factory=list)  # what stopped a worker process, and its exit status
    warm_start: dict | None = None  # the study's warm start (search/warmstart.py), if it has one
    verdict: dict | None = None  # the picks against the baselines on fresh seeds (search/verdict.py)
    baselines: list[dict] | None = None  # the baselines on the study's seeds (search/baselines.py): the table's
    data: Any = None  # the study's data (data.Data) as this process loaded it, once

    @property
    def optuna_study(self):
        import optuna

        return optuna.load_study(study_name=self.config.study.name, storage=open_storage(self.config.storage))


def run_search(cfg: SearchConfig, *, data=None, progress=None, stop=None) -> SearchResult:
    """Run the search described by ``cfg``. ``progress(event, **info)`` is told of the start and of each trial;
    ``stop``: the :class:`~evomerge.procs.Stop` of the command's stop signals, checked between trials and before the
    verdict (a signal that arrived while Python ran one of its callbacks is otherwise lost)."""
    from ..version import __version__
    from ..report.tracking import Tracker, check_reachable, resolve_tracking_uri
    from . import warmstart
    from .results import diverged

    uri = resolve_tracking_uri(cfg.tracking_uri, cfg.study_dir)
    check_reachable(uri)  # before the first trial
    check_storage(cfg.storage)  # a wrong database address is said before the data is read (was after)
    if data is None:  # loaded once, for this process's trials, the best model, the verdict and the end screen
        from .. import data as data_mod

        data = data_mod.load_spec(cfg.study.data, cfg.data_dir,
                                  cfg.study.path.parent if cfg.study.path is not None else None)
    setup = checked_setup(cfg, data)  # a user's loader or model refused in one line, before anything is stored
    # a cluster file timed for another model; a time budget many times the step budget's work
    model_notes = cfg.study.setup_notes(setup.model, setup.total_steps)
    model_notes += [n for n in (cfg.study.interval_note(setup.total_steps),) if n]  # (trials that never merge)
    storage = open_storage(cfg.storage)  # a store that cannot be opened leaves no folder behind
    # the study's runs folder holds what is kept on this machine: the default stores, the search's lock file (a store
    # other than PostgreSQL's, whose lock is the server's), a database tracking store's artifacts; not made for a
    # search whose stores are both servers' (it was left empty)
    if cfg.default_store or not cfg.storage.startswith("postgresql") or not uri.startswith(("http://", "https://")):
        cfg.study_dir.mkdir(parents=True, exist_ok=True)
    ostudy = load_or_create(cfg, storage)
    with search_lock(cfg, {}):  # before any worker asks: the source's trials are enqueued first
        cma_notes = cmaes_fixed(cfg, ostudy) if cfg.sampler == "cmaes" else []  # (a refusal: before anything changes)
        warm = warmstart.apply(cfg, ostudy)
        start_notes = fail_gone(ostudy)  # a killed search's trials: failed and asked again now, not after the grace period
        start_notes += cma_notes
        if cfg.sampler == "nsga2":
            start_notes += nsga2_notes(cfg, ostudy)
    before = count_states(ostudy.get_trials(deepcopy=False))
    tracker = retry_setup(lambda: Tracker(uri, cfg.study.name, cfg.study_dir / "mlartifacts", study=cfg.study))
    finished = before.get("COMPLETE", 0) + before.get("PRUNED", 0)
    tracker.end_orphans()  # a killed search's parent run said RUNNING for ever
    mixed = tracker.other_storages(shown(cfg.storage))  # (a new --storage logged into the old one's experiment, mute)
    if mixed:
        start_notes.append(f"the MLflow experiment {cfg.study.name} ({shown(uri)}) holds the runs of searches of "
                    f"{mixed[0]}{f' and {len(mixed) - 1} more' if len(mixed) > 1 else ''} too: give --tracking-uri "
                    "to keep this storage's runs apart")
    # nothing left to run: the study's last search run is taken up again (its best and verdict), not a new empty one
    parent = tracker.reopen_parent() if finished >= cfg.n_trials else None
    reopened = parent is not None
    parent = parent or tracker.start_parent(
        # (the process too: two machines' searches of a shared study that started in the same second had one name)
        f"search-{cfg.sampler}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
        {"sampler": cfg.sampler, "pruner": cfg.pruner_used, "n_trials": cfg.n_trials,
         "jobs": cfg.jobs, "batch": cfg.batch, "seed": cfg.seed, "storage": shown(cfg.storage),
         "objectives": ",".join(cfg.study.objectives), "cmaes_categoricals": cfg.cmaes_categoricals if cfg.sampler == "cmaes" else "",
         "warm_start_from": shown((warm or {}).get("spec", "")), "warm_start_trials": (warm or {}).get("trials", 0),
         "study_file": str(cfg.study.path or "")},
        {"evomerge.version": __version__, "evomerge.study": cfg.study.name})
    result = SearchResult(cfg, parent_run_id=parent, warm_start=warm)
    if progress:
        prior = best_trials(ostudy, cfg.study, 1)  # the study's best so far: a resumed bar starts from it
        from ..backends import ran_on
        from ..engine.setup import resolve_device

        # how the workers' steps run and where (a user's dropout model under --batch: whether its masks are each
        # worker's own; the torch threads a trial's sums split over), as each trial keeps them, said once here
        dev = resolve_device(cfg.device).type
        steps = (f"{setup.model.execution} ({getattr(setup.model, 'execution_reason', 'the named model')})"
                 if getattr(setup.model, "execution", None) else None)
        if steps and dev != "cpu":  # (auto is timed again on the trials' device)
            steps += f", as timed on the cpu; chosen again on {dev}"
        where = ran_on(cfg.backend, cfg.procs, cfg.study.run.workers, dev) if cfg.jobs == 1 else None
        progress("start", before=before, storage=cfg.storage, tracking_uri=uri, warm_start=warm,
                 notes=[*model_notes, *start_notes], steps=steps, where=where,
                 best=prior[0]["values"][0] if prior else None)

    def on_record(rec: dict) -> None:
        if "fatal" in rec:
            result.errors.append(rec["fatal"])
            result.fatal.append((rec["fatal"], rec.get("exit", 1)))
            return
        rec["mlflow_run_id"] = tracker.log_trial(rec)
        result.records.append(rec)
        if rec.get("failure") == "error":
            result.errors.append(f"trial {rec['number']}: {rec['error'].splitlines()[0]}")
        if progress:
            progress("trial", record=rec, study=study_now())

    seen = {"at": time.monotonic()}

    def study_now(force: bool = False) -> dict | None:
        """The study's finished trials and best, read at most every few seconds (``force``: now): other processes
        or machines sharing it finish trials this one never hears of (its bar stopped at its own share)."""
        import optuna

        if not force and time.monotonic() - seen["at"] < STUDY_EVERY:
            return None
        seen["at"] = time.monotonic()
        done = ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                         optuna.trial.TrialState.PRUNED))
        best = best_trials(ostudy, cfg.study, 1)
        return {"done": len(done), "best": best[0]["values"][0] if best else None}

    from .consensus import Keeper

    keeper = Keeper(cfg.study.directions[0] == "maximize")  # the best trial's model, from its own run (--jobs 1)
    result.data = data
    status, ended = "FINISHED", False
    try:
        if cfg.jobs == 1:
            try:
                work(cfg, 0, on_record, data=data, keeper=keeper, setup=setup, stop=stop)
            except Interrupted as i:
                for rec in i.args:
                    on_record(rec)
                raise KeyboardInterrupt from None
        else:
            _run_processes(cfg, on_record, stop)
        if stop is not None:
            stop.check()  # a signal lost in the last trial: the search stops before its verdict
        ended = True
        if progress:  # the bar ends at the study's count, where other processes finished the last trials
            progress("study", study=study_now(force=True))
    except KeyboardInterrupt:
        result.interrupted = True
        status = "KILLED"
    finally:
        trials = ostudy.get_trials(deepcopy=False)
        result.counts = count_states(trials)
        result.diverged = sum(1 for t in trials if t.state.name == "COMPLETE" and diverged(t))
        result.best = best_trials(ostudy, cfg.study, 5)
        best_value = result.best[0]["values"][0] if result.best else None
        tracker.end_parent(status, {"best_" + cfg.study.objectives[0]: best_value,
                                    "trials_complete": result.counts.get("COMPLETE", 0)})
        best = result.best[0] if result.best else None
        if reopened and best is not None and tracker.logged_best() == str(best["number"]):
            best = None  # the run taken up again holds this best already
        if best is not None and not result.interrupted and not cfg.log_model:  # its values and policy, no model
            tracker.log_best(best, not_logged="the search was told not to log it (--no-log-model; log_model=False in "
                                              "Python); the same search without it logs the best's model")
        elif best is not None and not result.interrupted:  # the best trial's values, policy and consensus model on the parent
            from .consensus import consensus

            with search_lock(cfg, {}):  # processes ending together: the first logs the model, the others link it
                tracker.log_best(best, model=lambda: consensus(cfg.study, best, data=data, data_dir=cfg.data_dir,
                                                               device=cfg.device, keeper=keeper))
        elif best is not None:  # stopped: the best so far's values and policy at once (a model takes a run)
            tracker.log_best(best)
        if stop is not None and stop.signum is not None:  # a signal lost while the best was logged: no verdict
            result.interrupted = True
        if ended and result.best and cfg.verdict and not result.interrupted:  # the picks against the baselines
            from . import verdict

            if progress:
                progress("verdict", reevaluate=cfg.reevaluate)
            try:
                result.verdict = verdict.compute(
                    cfg.study, ostudy, cfg.reevaluate, data=data, data_dir=cfg.data_dir, device=cfg.device,
                    announce=(lambda runs, part="": progress("runs", runs=runs, what="judging", part=part))
                    if progress else None,
                    ran=(lambda: progress("ran")) if progress else None)
            except KeyboardInterrupt:  # the trials are done and kept; the runs judged so far are cached
                result.interrupted = True
                result.errors.append("the verdict was interrupted; the same command judges again (its runs so far "
                                     "are kept)")
            except Exception as e:  # never lose the search's end for it
                result.errors.append(f"the verdict failed: {type(e).__name__}: {e}")
            if result.verdict:
                tracker.describe_parent(verdict.markdown(result.verdict), result.verdict["headline"])
        if ended and result.best and not result.interrupted and cfg.baselines and cfg.study.baselines:
            table_baselines(cfg, ostudy, data, tracker, progress, result)
    return result


def table_baselines(cfg: SearchConfig, ostudy, data, tracker, progress, result: SearchResult) -> None:
    """The baselines on the study's own seeds (the end screen's table beside the best trials; runs kept in the
    Optuna study), into ``result.baselines``, and logged in MLflow beside the trials (``Tracker.log_baselines``).
    A failure is one of the result's errors: the search's trials and verdict stand."""
    from . import fingerprint
    from .baselines import baseline_rows

    def announce(runs: int, tuning: bool = False) -> None:
        if progress:
            progress("baselines", runs=runs, tuning=tuning)
            progress("runs", runs=runs, what="baselines")

    try:
        result.baselines = baseline_rows(cfg.study, data=data, data_dir=cfg.data_dir, device=cfg.device,
                                         storage_study=ostudy, announce=announce,
                                         ran=(lambda: progress("ran")) if progress else None)
    except KeyboardInterrupt:  # the trials and the verdict are kept; the table is left out
        result.interrupted = True
        result.errors.append("the baselines were interrupted; the same command runs them again")
        return
    except Exception as e:  # noqa: BLE001 - never lose the search's end for it
        result.errors.append(f"the baselines failed: {type(e).__name__}: {e}")
        return
    try:
        with search_lock(cfg, {}):  # processes ending together: one logs them, the others find them logged
            tracker.log_baselines(result.baselines, fingerprint.of(cfg.study)["hash"])
    except Exception as e:  # noqa: BLE001 - a tracking server gone at the end: the table still stands
        result.errors.append(f"the baselines' runs were not logged in MLflow: {type(e).__name__}: {e}")
