"""Judging one trial: run its policy on every seed of the study, report each round (Optuna's
pruner for one objective, :func:`mo_should_prune` for several), and tell the study how it ended.

A trial that raises fails alone (``failure: error``); a Ctrl-C fails it as ``interrupted`` and
is raised on as :class:`Interrupted` carrying the trial's record; a trial another process
failed as stale (no heartbeat within the grace period) is left to it (``taken over``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any

from .results import DIVERGED, RUN_STATUS, curve_of, diverged, dominated_count, objective_values, round_dict, slim, summarise
from ..procs import process_tag

if TYPE_CHECKING:
    from .config import SearchConfig

# -- multi-objective pruning --------------------------------------------------------------
MO_MIN_TRIALS, MO_FRACTION = 5, 0.5


def mo_should_prune(point, step: int, completed_curves: list[dict], directions: list[str]) -> bool:
    """The rule for multi-objective studies, which Optuna cannot prune: stop a trial whose
    point at a reporting step is dominated by at least half of the completed trials'
    points at the same step, once at least 5 completed trials have reached that step."""
    others = [tuple(c[str(step)]) for c in completed_curves if str(step) in c]
    if len(others) < MO_MIN_TRIALS:
        return False
    return dominated_count(point, others, directions) >= math.ceil(MO_FRACTION * len(others))


# -- one trial ------------------------------------------------------------------------------
class Pruned(Exception):
    pass


class Interrupted(Exception):
    """Carries the record of the trial that a Ctrl-C interrupted."""


class Evaluation:
    """A trial's runs, seed by seed: the callback of each run (reporting each round to the pruner,
    which may raise :class:`Pruned`) and what each finished run adds. :func:`evaluate` drives it one
    run at a time; a population (:func:`run_batch`) drives several trials' evaluations at once."""

    def __init__(self, trial, ostudy, setup, policy, cfg: "SearchConfig", storage, complete=None, beat: bool = True):
        """``complete``: the study's complete trials, read once for several evaluations (a batch); default: read
        here. ``beat``: record the trial's heartbeat every round (off where a batch's thread records them)."""
        from ..engine.setup import round_bounds
        from .config import OBJECTIVES, PRUNERS

        self.trial, self.policy, self.cfg, self.storage = trial, policy, cfg, storage
        self.T = setup.total_steps
        self.histories, self.finals = [], []
        self.curve: dict[str, list[float]] = {}
        self.completed_curves: list[dict] | None = None
        if cfg.multi and cfg.prune:  # diverged runs are no yardstick
            self.completed_curves = [t.user_attrs["curve"] for t in (complete_trials(ostudy) if complete is None
                                     else complete) if "curve" in t.user_attrs and not diverged(t)]
        self.beat = beat
        self.trial_id = trial._trial_id  # Optuna's own optimize loop records heartbeats by this id too
        self.readers = [OBJECTIVES[o].from_round for o in cfg.study.objectives]
        # one objective: an Optuna pruner judges every round ("rounds") or each seed's final value ("seeds")
        self.over = PRUNERS[cfg.pruner].over if cfg.prunes_by_optuna else None
        # a round's step on Optuna's axis: the lockstep round's end, also for a run on a simulated clock
        # (whose workers did uneven numbers of steps), so every trial reports each round at the same step
        self.bounds = round_bounds(self.T, cfg.study.run.rounds)

    def on_round(self, k: int):
        """The callback of seed ``k``'s run."""
        cfg, trial, T, seeds = self.cfg, self.trial, self.T, self.cfg.study.run.seeds

        def on_round(m):
            if self.beat:
                self.storage.record_heartbeat(self.trial_id)
            step = k * T + self.bounds[m.round - 1]
            point = [read(m) for read in self.readers]
            self.curve[str(step)] = point
            if cfg.multi:
                if (self.completed_curves is not None and m.round > 1
                        and mo_should_prune(point, step, self.completed_curves, cfg.study.directions)):
                    raise Pruned(step, point[0])
            elif self.over == "rounds":
                trial.report(point[0], step)
                last = k == len(seeds) - 1 and m.round == len(self.bounds)  # complete: nothing left to save
                if not last and trial.should_prune():
                    raise Pruned(step, point[0])

        return on_round

    def add(self, k: int, res) -> bool:
        """Seed ``k``'s finished run; whether the next seed runs (may raise :class:`Pruned`)."""
        seeds = self.cfg.study.run.seeds
        self.histories.append([round_dict(h) for h in res.history])
        self.finals.append(res.metrics())
        if res.status == DIVERGED:
            return False
        if self.over == "seeds":  # the seed is the step: the pruner pairs this trial's seeds with the best trial's
            self.trial.report(objective_values(self.cfg.study, self.finals[-1:])[0], seeds[k])
            if k < len(seeds) - 1 and self.trial.should_prune():  # after the last seed the trial is complete
                raise Pruned((k + 1) * self.T, objective_values(self.cfg.study, self.finals)[0])
        return k < len(seeds) - 1

    def outcome(self) -> dict:
        return {"histories": self.histories, "finals": self.finals, "curve": self.curve, "total_steps": self.T,
                "status": DIVERGED if any(f["status"] == DIVERGED for f in self.finals) else "ok"}


def evaluate(trial, ostudy, setup, policy, cfg: "SearchConfig", storage, simulate_fn, keeper=None) -> dict:
    """Run the policy on every seed of the study, reporting each round; return a record. With ``keeper``
    (:class:`evomerge.search.consensus.Keeper`) the first seed's consensus model is kept in ``out["consensus"]``."""
    ev = Evaluation(trial, ostudy, setup, policy, cfg, storage)
    center = None
    for k, seed in enumerate(cfg.study.run.seeds):
        keep = keeper is not None and k == 0
        more = {"keep_params": True} if keep else {}  # a runner registered from outside may not take it otherwise
        res = simulate_fn(setup, policy, seed, callback=ev.on_round(k), device=cfg.device, **more)
        if keep and res.params is not None:
            center = res.params.mean(0)
        if not ev.add(k, res):
            break
    out = ev.outcome()
    out["consensus"] = center
    return out


def bare_record(trial, cfg: "SearchConfig", total_steps: int, **state) -> dict[str, Any]:
    """A trial's record before it has run; ``state`` fills in how it ended, if it already has."""
    now = time.time()
    return {"number": trial.number, "study": cfg.study.name, "sampler": cfg.sampler, "seeds": list(cfg.study.run.seeds),
            "start": now, "end": now, "histories": [], "final": {}, "total_steps": total_steps, "params": dict(trial.params),
            "policy": {}, "cma": {}, **state}


def mark_interrupted(ostudy, trial) -> bool:
    """Fail ``trial`` as interrupted if it is still running; True if this call did it."""
    import optuna

    try:
        trial.set_user_attr("failure", "interrupted")
        ostudy.tell(trial, state=optuna.trial.TrialState.FAIL)
        return True
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
        return False  # already finished


@contextlib.contextmanager
def heartbeat(storage, trial_id, every: float):
    """Record the heartbeat of the trial (or of each of a list of trials) every ``every`` seconds while it
    runs, as Optuna's own optimize loop does: a slow round must not make other processes take it for dead."""
    import threading

    ids = list(trial_id) if isinstance(trial_id, (list, tuple)) else [trial_id]
    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            beat_all(storage, ids)

    thread = threading.Thread(target=beat, name=f"evomerge-heartbeat-{ids[0]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def beat_if_slow(storage, trials, since: float, grace_period: float) -> bool:
    """Record every asked trial's heartbeat once more, before the search lock is let go, where asking them took
    over a third of the grace period since ``since`` (``time.monotonic()``). The first trials of a big batch beat
    only at their creation, and the heartbeat thread's first beat comes a third of the grace period after the lock is
    let go: another process that takes the lock first looks for stale trials, and would fail them. True if it beat."""
    if not trials or time.monotonic() - since <= grace_period / 3:
        return False
    beat_all(storage, [t._trial_id for t in trials])
    return True


def beat_all(storage, trial_ids) -> None:
    """Record each trial's heartbeat; a beat the storage refuses (briefly unreachable, locked) is skipped: the next
    one tries again, and a missed beat is no worse than none."""
    for i in trial_ids:
        try:
            storage.record_heartbeat(i)
        except Exception:
            pass


def run_trial(trial, ostudy, setup, cfg: "SearchConfig", storage, simulate_fn, keeper=None) -> dict:
    with heartbeat(storage, trial._trial_id, max(0.5, cfg.grace_period / 3)):
        return _run_trial(trial, ostudy, setup, cfg, storage, simulate_fn, keeper)


def _run_trial(trial, ostudy, setup, cfg: "SearchConfig", storage, simulate_fn, keeper=None) -> dict:
    t = TrialRun(trial, ostudy, setup, cfg, storage)
    try:
        if t.start() and (src := t.reused()) is not None:
            t.complete_from(src)
        elif not t.ended:
            out = evaluate(trial, ostudy, t.setup, t.policy, cfg, storage, simulate_fn, keeper)
            t.complete(out)
            if keeper is not None and out["status"] != DIVERGED:  # the best so far keeps its model
                keeper.offer(trial.number, t.record["values"][0], out["consensus"], out["finals"][0].get("val_accuracy"))
    except KeyboardInterrupt:
        t.interrupted()
        raise Interrupted(t.record) from None
    except Exception as e:
        t.failed(e)
    return t.finish()


class TrialRun:
    """One trial from its start to what the study is told: its record, policy and attributes,
    the values of a complete trial, and how it ended otherwise (pruned, failed, taken over)."""

    def __init__(self, trial, ostudy, setup, cfg: "SearchConfig", storage):
        self.trial, self.ostudy, self.setup, self.cfg, self.storage = trial, ostudy, setup, cfg, storage
        self.record = bare_record(trial, cfg, setup.total_steps)
        self.policy = None
        self.ended = False

    def start(self) -> bool:
        """The trial's policy and attributes; False (and the trial failed) if they cannot be made."""
        from ..backends import ran_on
        from ..engine.setup import resolve_device
        from . import space as space_mod

        try:
            trial, cfg = self.trial, self.cfg
            self.record["cma"] = {k: v for k, v in trial.user_attrs.items() if k.startswith("cma_")}
            self.policy = space_mod.policy_from_params(cfg.study, trial.params)
            self.record["policy"] = self.policy.to_dict()
            trial.set_user_attr("policy", self.record["policy"])
            run = space_mod.run_values(trial.params)  # a searched step size: this trial's runs use it
            self.record["policy_key"] = policy_key(self.record["policy"], run, cfg.study.run.seeds)
            trial.set_user_attr(ATTR_KEY, self.record["policy_key"])
            if run:
                self.setup = dataclasses.replace(self.setup, study=space_mod.with_run(self.setup.study, run))
                self.record["run"] = run
                trial.set_user_attr("run", run)
            trial.set_user_attr("sampler", cfg.sampler)
            # how the workers' steps ran (models.generic: stacked or loop, and why), kept with the trial
            self.record["execution"] = f"{self.setup.model.execution} ({getattr(self.setup.model, 'execution_reason', 'the named model')})"
            trial.set_user_attr("execution", self.record["execution"])
            # and where its sums ran (a replay elsewhere is not held to match it bit for bit)
            self.record["ran_on"] = ran_on(cfg.backend, cfg.procs, cfg.study.run.workers,
                                           resolve_device(cfg.device).type)
            trial.set_user_attr("ran_on", self.record["ran_on"])
            if cfg.prunes_by_optuna:
                trial.set_user_attr("pruner", cfg.pruner)
            if cfg.batch > 1:
                trial.set_user_attr("batch", cfg.batch)
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            trial.set_user_attr("process", process_tag())  # a later search tells whether this process is gone
        except KeyboardInterrupt:
            raise
        except Exception as e:
            self.failed(e)
            return False
        return True

    def reused(self, complete=None):
        """A complete trial of this study that ran the same policy with the same run settings and seeds (the
        sampler proposed it again), or None. Its results are this trial's: a repeated proposal is not trained.
        ``complete``: the study's complete trials, read once for a batch (default: read here)."""
        key = self.record["policy_key"]
        for t in complete_trials(self.ostudy) if complete is None else complete:
            if t.user_attrs.get(ATTR_KEY) == key and "metrics" in t.user_attrs and t.number != self.trial.number:
                return t
        return None

    def complete_from(self, src) -> None:
        """This trial's results are ``src``'s (:meth:`reused`), marked ``reused_from``."""
        seeds = self.cfg.study.run.seeds
        finals = [dict(src.user_attrs["metrics"][str(s)]) for s in seeds]
        self.trial.set_user_attr(ATTR_REUSED, src.number)
        self.record["reused_from"] = src.number
        self.complete({"histories": [], "finals": finals, "status": src.user_attrs.get(RUN_STATUS, "ok"),
                       "curve": src.user_attrs.get("curve", {})}, history=src.user_attrs.get("history", {}))

    def complete(self, out: dict, history: dict | None = None) -> None:
        trial, cfg, record = self.trial, self.cfg, self.record
        record.update(histories=out["histories"], final=summarise(out["finals"]), run_status=out["status"])
        values = objective_values(cfg.study, out["finals"])
        trial.set_user_attr("metrics", {str(s): slim(f) for s, f in zip(cfg.study.run.seeds, out["finals"])})
        trial.set_user_attr("spread", {k: v for k, v in record["final"].items() if k.endswith("_std")})
        trial.set_user_attr(RUN_STATUS, out["status"])  # "diverged": kept off best and the Pareto set (results.py)
        trial.set_user_attr("history", curve_of(out["histories"][0]) if out["histories"] else history or {})
        if cfg.multi:
            trial.set_user_attr("curve", out["curve"])
        self.ostudy.tell(trial, values)
        record.update(state="COMPLETE", values=values)
        self.ended = True

    def failed(self, e: BaseException) -> None:
        """The trial ended by an exception: pruned, taken over by another process, or a bad trial (it fails alone)."""
        import optuna

        trial, record = self.trial, self.record
        self.ended = True
        if isinstance(e, Pruned):
            step, last = e.args
            record.update(state="PRUNED", values=None, pruned_at=step)
            try:
                trial.set_user_attr("last_value", last)
                trial.set_user_attr("pruned_at_step", step)
                self.ostudy.tell(trial, state=optuna.trial.TrialState.PRUNED)
            except optuna.exceptions.UpdateFinishedTrialError:
                self._taken_over()
            return
        if isinstance(e, optuna.exceptions.UpdateFinishedTrialError):
            self._taken_over()
            return
        msg = f"{type(e).__name__}: {e}"
        try:
            trial.set_user_attr("failure", "error")
            trial.set_user_attr("error", msg[:1000])
            self.ostudy.tell(trial, state=optuna.trial.TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=5))
        record.update(state="FAIL", failure="error", error=msg + "\n" + tb)

    def _taken_over(self) -> None:
        # another process took this trial for dead (no heartbeat within the grace period) and failed it
        self.record.update(state="FAIL", failure="taken over", error="failed by another process (heartbeat missed)")

    def interrupted(self) -> None:
        """A Ctrl-C: the trial fails as interrupted (asked again when the search resumes). One the study was told
        of before the Ctrl-C came (between ``tell`` and the record's own update) keeps what the study holds: under
        --jobs 2 a trial complete in the study was logged to MLflow as interrupted, with its final metrics."""
        if not self.ended:
            told = None if mark_interrupted(self.ostudy, self.trial) else \
                self.ostudy._storage.get_trial(self.trial._trial_id)
            if told is not None and told.state.is_finished():
                self.record.update(state=told.state.name, values=told.values, end=time.time())
            else:  # (still running where telling it failed otherwise: not "running" in MLflow)
                self.record.update(state="FAIL", failure="interrupted", end=time.time())
            self.ended = True

    def finish(self) -> dict:
        self.record["end"] = time.time()
        return self.record


def run_batch(trials, ostudy, setup, cfg: "SearchConfig", storage) -> list[dict]:
    """Several trials at once, as one population per seed (:mod:`evomerge.backends.population`): each
    trial's run of seed k is a member; a member pruned, diverged or failed ends alone. Returns the
    trials' records; a Ctrl-C fails every unfinished one as interrupted (:class:`Interrupted` carries them all)."""
    from ..backends.population import Member, run_population

    runs = [TrialRun(t, ostudy, setup, cfg, storage) for t in trials]
    with heartbeat(storage, [t._trial_id for t in trials], max(0.5, cfg.grace_period / 3)):
        try:
            evals = {}
            # the study's complete trials, read once for the batch: Optuna's cached storage reads every running
            # trial again on each read, so a read per trial costs the batch a time that grows as its size squared
            complete = complete_trials(ostudy)
            for r in runs:
                if r.start():
                    if (src := r.reused(complete)) is not None:  # proposed again: its results, not a run
                        r.complete_from(src)
                        continue
                    # the heartbeat thread above records every trial's: none per member and round
                    evals[id(r)] = Evaluation(r.trial, ostudy, setup, r.policy, cfg, storage, complete, beat=False)
            alive = [r for r in runs if not r.ended]
            for k, seed in enumerate(cfg.study.run.seeds):
                if not alive:
                    break
                members = [Member(r.policy, seed, evals[id(r)].on_round(k)) for r in alive]
                try:
                    outs = run_population(setup, members, cfg.device)
                except Exception as e:  # not one member's callback: the population itself failed, and all with it
                    outs = [e] * len(alive)
                nxt = []
                for r, out in zip(alive, outs):
                    try:
                        if isinstance(out, BaseException):
                            raise out
                        if evals[id(r)].add(k, out):
                            nxt.append(r)
                        else:
                            r.complete(evals[id(r)].outcome())
                    except Exception as e:
                        r.failed(e)
                alive = nxt
            for r in alive:  # every seed ran
                try:
                    r.complete(evals[id(r)].outcome())
                except Exception as e:
                    r.failed(e)
        except KeyboardInterrupt:
            for r in runs:
                r.interrupted()
            # every record: the batch's trials that ended before the Ctrl-C (complete, pruned, failed) are logged too
            raise Interrupted(*[r.finish() for r in runs]) from None
    return [r.finish() for r in runs]


ATTR_KEY, ATTR_REUSED = "policy_key", "reused_from"


def complete_trials(ostudy) -> list:
    """The study's complete trials, in number order (one read of the storage)."""
    import optuna

    return ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def policy_key(policy: dict, run: dict, seeds) -> str:
    """What a trial's results depend on within one study (its fingerprint is the study's): the canonical
    policy (fields that do not apply switched off, fitted to the workers; the fields that take no effect in it,
    :func:`evomerge.policy.no_effect`, at their defaults: a complete graph's ``p_intra`` changes nothing, and two
    trials apart only there were both trained), the searched run settings and the seeds. Two trials with one key
    would train the same runs."""
    import hashlib
    import json

    from ..policy import MergePolicy, no_effect

    idle, default = no_effect(policy), MergePolicy().to_dict()
    canon = {k: (default[k] if k in idle and k in default else v) for k, v in policy.items() if k != "name"}
    doc = {"policy": canon, "run": run, "seeds": list(seeds)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
