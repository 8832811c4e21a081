"""Judging one trial: run its policy on every seed of the study, report each round (Optuna's
pruner for one objective, :func:`mo_should_prune` for several), and tell the study how it ended.

A trial that raises fails alone (``failure: error``); a Ctrl-C fails it as ``interrupted`` and
is raised on as :class:`Interrupted` carrying the trial's record; a trial another process
failed as stale (no heartbeat within the grace period) is left to it (``taken over``).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any

from .results import DIVERGED, RUN_STATUS, curve_of, diverged, dominated_count, objective_values, round_dict, summarise

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


def evaluate(trial, ostudy, setup, policy, cfg: "SearchConfig", storage, simulate_fn) -> dict:
    """Run the policy on every seed of the study, reporting each round; return a record."""
    import optuna

    from .config import OBJECTIVES, PRUNERS

    study = cfg.study
    T = setup.total_steps
    histories, finals = [], []
    curve: dict[str, list[float]] = {}
    completed_curves: list[dict] | None = None
    if cfg.multi and cfg.prune:  # diverged runs are no yardstick
        completed_curves = [t.user_attrs["curve"] for t in ostudy.get_trials(deepcopy=False,
                            states=(optuna.trial.TrialState.COMPLETE,)) if "curve" in t.user_attrs and not diverged(t)]
    trial_id = trial._trial_id  # Optuna's own optimize loop records heartbeats by this id too
    readers = [OBJECTIVES[o].from_round for o in study.objectives]
    # one objective: an Optuna pruner judges every round ("rounds") or each seed's final value ("seeds")
    over = PRUNERS[cfg.pruner].over if cfg.prunes_by_optuna else None
    # a round's step on Optuna's axis: the lockstep round's end, also for a run on a simulated clock
    # (whose workers did uneven numbers of steps), so every trial reports each round at the same step
    from ..engine.run import round_bounds

    bounds = round_bounds(T, study.run.rounds)

    for k, seed in enumerate(study.run.seeds):
        def on_round(m, k=k):
            storage.record_heartbeat(trial_id)
            step = k * T + bounds[m.round - 1]
            point = [read(m) for read in readers]
            curve[str(step)] = point
            if cfg.multi:
                if completed_curves is not None and m.round > 1 and mo_should_prune(point, step, completed_curves, study.directions):
                    raise Pruned(step, point[0])
            elif over == "rounds":
                trial.report(point[0], step)
                last = k == len(study.run.seeds) - 1 and m.round == len(bounds)  # complete: nothing left to save
                if not last and trial.should_prune():
                    raise Pruned(step, point[0])

        res = simulate_fn(setup, policy, seed, callback=on_round, device=cfg.device)
        histories.append([round_dict(h) for h in res.history])
        finals.append(res.metrics())
        if res.status == DIVERGED:
            break
        if over == "seeds":  # the seed is the step: the pruner pairs this trial's seeds with the best trial's
            trial.report(objective_values(study, finals[-1:])[0], seed)
            if k < len(study.run.seeds) - 1 and trial.should_prune():  # after the last seed the trial is complete
                raise Pruned((k + 1) * T, objective_values(study, finals)[0])
    return {"histories": histories, "finals": finals, "curve": curve, "total_steps": T,
            "status": DIVERGED if any(f["status"] == DIVERGED for f in finals) else "ok"}


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


def run_trial(trial, ostudy, setup, cfg: "SearchConfig", storage, simulate_fn) -> dict:
    with heartbeat(storage, trial._trial_id, max(0.5, cfg.grace_period / 3)):
        return _run_trial(trial, ostudy, setup, cfg, storage, simulate_fn)


def _run_trial(trial, ostudy, setup, cfg: "SearchConfig", storage, simulate_fn) -> dict:
    import optuna

    from .. import space as space_mod

    record = bare_record(trial, cfg, setup.total_steps)
    try:
        record["cma"] = {k: v for k, v in trial.user_attrs.items() if k.startswith("cma_")}
        policy = space_mod.policy_from_params(cfg.study, trial.params)
        record["policy"] = policy.to_dict()
        trial.set_user_attr("policy", record["policy"])
        trial.set_user_attr("sampler", cfg.sampler)
        if cfg.prunes_by_optuna:
            trial.set_user_attr("pruner", cfg.pruner)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        out = evaluate(trial, ostudy, setup, policy, cfg, storage, simulate_fn)
        record.update(histories=out["histories"], final=summarise(out["finals"]), run_status=out["status"])
        values = objective_values(cfg.study, out["finals"])
        trial.set_user_attr("metrics", {str(s): _slim(f) for s, f in zip(cfg.study.run.seeds, out["finals"])})
        trial.set_user_attr("spread", {k: v for k, v in record["final"].items() if k.endswith("_std")})
        trial.set_user_attr(RUN_STATUS, out["status"])  # "diverged": kept off best and the Pareto set (results.py)
        trial.set_user_attr("history", curve_of(out["histories"][0]))
        if cfg.multi:
            trial.set_user_attr("curve", out["curve"])
        ostudy.tell(trial, values)
        record.update(state="COMPLETE", values=values)
    except Pruned as p:
        step, last = p.args
        record.update(state="PRUNED", values=None, pruned_at=step)
        trial.set_user_attr("last_value", last)
        trial.set_user_attr("pruned_at_step", step)
        ostudy.tell(trial, state=optuna.trial.TrialState.PRUNED)
    except KeyboardInterrupt:
        mark_interrupted(ostudy, trial)
        record.update(state="FAIL", failure="interrupted", end=time.time())
        raise Interrupted(record) from None
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


def _slim(f: dict) -> dict:
    return {k: v for k, v in f.items() if isinstance(v, (int, float, str))}
