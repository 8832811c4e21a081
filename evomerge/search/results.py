"""Reading a study's results back: counts, best trials (or the Pareto set), trial summaries,
baseline rows and labels. Used by ``status``, ``export``, the dashboard and the search's final
table; it imports nothing of the search loop.

A trial whose run diverged (a loss went non-finite) stays COMPLETE with the values it reached,
so samplers learn from it, and carries the user attribute ``run_status = "diverged"``
(:data:`RUN_STATUS`). It is counted apart (``diverged``) and kept off "best" and off the
Pareto set: a run that stopped early has sent few bytes and would look Pareto-optimal.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..dburls import shown
from ..errors import ConfigError
from ..sqlitefiles import sqlite_file
from ..study import ACCURACY_OBJECTIVES, Study

RUN_STATUS, DIVERGED = "run_status", "diverged"
CURVE_KEYS = ("step", "val_accuracy", "val_loss", "val_perplexity", "consensus_distance", "bytes",
              "sim_time")  # sim_time: [environment] only; accuracy: tasks with classes; perplexity: language models
SUMMARY_KEYS = ("val_accuracy", "val_loss", "val_perplexity", "mean_worker_accuracy", "worst_worker_accuracy", "consensus_distance",
                "bytes", "merges", "local_steps", "wall_time", "sim_time", "time_to_target", "accuracy_at_time",
                "loss_at_time", "perplexity_at_time")


def load_study(study: Study, storage_url: str):
    """The stored Optuna study of ``study``, for reading; one line if there is none."""
    import optuna

    from .storage import open_storage

    def missing() -> ConfigError:
        beside = runs_beside(study, storage_url)
        return ConfigError("--study", f"no search results for {study.name!r} in {shown(storage_url)}; " + (
            f"the runs folder beside the study file holds them: --runs-dir {beside}" if beside else
            "run `evomerge search` first, or say where it stored them (--runs-dir or $EVOMERGE_RUNS_DIR, --storage)"))

    if not _may_hold(storage_url, study.name):
        raise missing()  # (opening it would write Optuna's tables, or a new file, behind a command that only reads)
    storage = open_storage(storage_url)
    try:
        return optuna.load_study(study_name=study.name, storage=storage)
    except KeyError:
        raise missing() from None


def runs_beside(study: Study, storage_url: str) -> str | None:
    """The ``runs`` folder beside the study's file, as the user can give it to ``--runs-dir``, where it holds the
    study and ``storage_url`` (a SQLite file, as ``--runs-dir`` makes) is another that does not: the search ran in
    the file's folder, this command elsewhere (a new user's export from the folder above said "run evomerge search
    first", and a search there would have started anew)."""
    import os

    import shlex

    db = sqlite_file(storage_url)
    if db is None or study.path is None or _may_hold(storage_url, study.name):
        return None
    if Path(db).name != "optuna.db" or Path(db).parent.name != study.name:  # --storage's own file: --runs-dir
        return None                                                          # would not be read
    runs = Path(study.path).parent / "runs"
    there = runs / study.name / "optuna.db"
    if not there.is_file() or there.resolve() == Path(db).resolve():
        return None
    names = _sqlite_studies(there)
    if not names or study.name not in names:
        return None
    rel = os.path.relpath(runs)
    return shlex.quote(rel if not rel.startswith("..") else str(runs.resolve()))


def _may_hold(storage_url: str, name: str) -> bool:
    """False for a SQLite file (a query string allowed) that is not there or holds no study ``name`` (an empty file
    an interrupted start left); True for any other storage, which Optuna reads without writing, and for a file this
    check cannot read (Optuna then opens it and says what is wrong)."""
    db = sqlite_file(storage_url)
    if db is None:
        return True
    if not Path(db).is_file():
        return False
    names = _sqlite_studies(db)
    return names is None or name in names


def _sqlite_studies(db) -> set[str] | None:
    """The names of the studies a SQLite file of Optuna's holds, read without writing: none for a file that is
    empty or has no table of studies (an interrupted start can leave an empty one); None where it cannot be read
    here (locked, or in a folder this user cannot write, as a read-only look at a WAL store needs)."""
    import contextlib
    import sqlite3

    path = Path(db).resolve()
    if path.stat().st_size == 0:
        return set()
    try:  # a file: URI of its own (a '#' or '?' in a folder's name is not the URI's)
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as con:
            return {n for (n,) in con.execute("SELECT study_name FROM studies")}
    except sqlite3.Error as e:
        if "no such table" in str(e) or "not a database" in str(e):
            return set()
        return None


def stored_names(runs_dir) -> list[str]:
    """The studies stored under ``runs_dir`` (``runs_dir/NAME/optuna.db`` holding a study NAME, or a file that
    cannot be read here), sorted."""
    found = []
    for p in Path(runs_dir).glob("*/optuna.db"):
        names = _sqlite_studies(p)
        if names is None or p.parent.name in names:
            found.append(p.parent.name)
    return sorted(found)


def storage_names(storage_url: str) -> list[str]:
    """The studies a storage (``--storage``) holds, sorted, read without writing: a SQLite file that is not there
    holds none (Optuna would create it); [] where it cannot be read (the caller's own line says what it looked for)."""
    db = sqlite_file(storage_url)
    if db is not None:
        if not Path(db).is_file():
            return []
        return sorted(_sqlite_studies(db) or ())
    import optuna

    from .storage import open_storage

    try:
        return sorted(optuna.get_all_study_names(open_storage(storage_url)))
    except Exception:  # noqa: BLE001 - a store that cannot be read here: nothing to list
        return []


def stored_study(name: str, storage_url: str):
    """The study ``name`` as stored with its trials (``evomerge search`` keeps the file's text), or None when
    the storage holds no such study or no definition for it (searched before definitions were kept)."""
    import tomllib

    import optuna

    from .. import study as study_mod
    from .storage import DEFINITION, open_storage

    if not _may_hold(storage_url, name):
        return None  # never create a database, or write Optuna's tables into one, to read it
    try:
        ostudy = optuna.load_study(study_name=name, storage=open_storage(storage_url))
    except KeyError:
        return None
    definition = ostudy.user_attrs.get(DEFINITION)
    if not definition:
        return None
    from .fingerprint import ATTR

    definition = dict(definition, fingerprint=ostudy.user_attrs.get(ATTR))  # what its trials ran on
    return study_mod.from_dict(tomllib.loads(definition["toml"]), path=Path(definition["path"]),
                               default_name=Path(definition["path"]).stem), definition


def is_path(ref) -> bool:
    """``--study``'s value names a file, not a study by name (:func:`evomerge.study.names_a_file`)."""
    from ..study import names_a_file

    return names_a_file(ref)


def load_or_stored(ref, runs_dir=None, storage: str | None = None, on_stored=None):
    """``evomerge run``'s study (and ``search``'s, ``transfer --target``'s): a file or a shipped name as it says now,
    else the name of a study a search stored under ``runs_dir`` (or in ``storage``) from a file elsewhere, as stored
    with its trials (``on_stored(path)`` is told the file it was searched from); None for a name that is neither (the
    caller says what is known), and a file's own error for a file."""
    from ..errors import ConfigError
    from ..study import load
    from .config import default_runs_dir
    from .storage import default_storage

    try:
        return load(ref)
    except ConfigError:
        if is_path(ref):
            raise
    got = stored_study(str(ref), storage or default_storage(Path(runs_dir or default_runs_dir()) / str(ref)))
    if got is not None and on_stored is not None:
        on_stored(got[1]["path"])
    return got[0] if got is not None else None


def diverged(t) -> bool:
    return t.user_attrs.get(RUN_STATUS) == DIVERGED


def count_states(trials) -> dict[str, int]:
    """Trials by state (COMPLETE, PRUNED, FAIL, RUNNING, ...)."""
    out: dict[str, int] = {}
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def count_line(trials) -> str:
    """``5 complete (1 diverged), 2 pruned``: the counts as tables show them."""
    import optuna

    counts = count_states(trials)
    n_div = sum(1 for t in trials if t.state == optuna.trial.TrialState.COMPLETE and diverged(t))
    return format_counts(counts, n_div)


def format_counts(counts: dict[str, int], n_diverged: int = 0) -> str:
    parts = []
    for k, n in sorted(counts.items()):
        parts.append(f"{n} {k.lower()}" + (f" ({n_diverged} diverged)" if k == "COMPLETE" and n_diverged else ""))
    return ", ".join(parts) or "no trials yet"


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


def judged(ostudy) -> list:
    """COMPLETE trials whose runs did not diverge: the ones "best" and the Pareto set choose from."""
    import optuna

    return [t for t in ostudy.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if not diverged(t)]


def rank_trials(trials: list, directions: list[str]) -> list:
    """``trials`` (finished, with values) best first: with one objective by its value; with several by Pareto
    layer (the non-dominated trials first, then the trials only those dominate, and so on), and by the first
    objective within a layer. So a warm start or a transfer of a multi-objective study carries the trade-offs
    over first, not the trials that bought the first objective at any cost."""
    sign = -1.0 if directions[0] == "maximize" else 1.0

    def first(t):
        return (sign * t.values[0], t.number)

    if len(directions) == 1:
        return sorted(trials, key=first)
    out, rest = [], list(trials)
    while rest:
        points = [tuple(t.values) for t in rest]
        front = [t for t, p in zip(rest, points) if dominated_count(p, points, directions) == 0]
        out += sorted(front, key=first)
        taken = {t.number for t in front}
        rest = [t for t in rest if t.number not in taken]
    return out


def pareto_trials(ostudy, study: Study) -> list:
    """The non-dominated trials among :func:`judged` ones, by trial number."""
    trials = judged(ostudy)
    points = [tuple(t.values) for t in trials]
    return [t for t, p in zip(trials, points) if dominated_count(p, points, study.directions) == 0]


def best_trials(ostudy, study: Study, n: int = 5) -> list[dict]:
    """The best finished trials: by the objective (single), or the Pareto set sorted by the first
    objective. Diverged trials are never among them."""
    rev = study.directions[0] == "maximize"
    if len(study.objectives) == 1:
        ranked = sorted(judged(ostudy), key=lambda t: t.values[0], reverse=rev)[:n]
    else:
        ranked = sorted(pareto_trials(ostudy, study), key=lambda t: t.values[0], reverse=rev)
    return [trial_summary(t, study) for t in ranked]


def read_tolerance(text: str) -> tuple[float, bool]:
    """``--tolerance``: ``0.005`` (in the first objective's unit) or ``2%`` (of its best value): (value, relative).
    A ConfigError naming ``--tolerance`` for anything else."""
    from ..errors import ConfigError

    t = str(text).strip()
    relative = t.endswith("%")
    try:
        v = float(t[:-1] if relative else t)
    except ValueError:
        v = float("nan")
    if not (v >= 0 and math.isfinite(v)):
        raise ConfigError("--tolerance", f"{text!r}; allowed: a number >= 0 in the first objective's unit (0.005), "
                                         "or a percentage of its best value (2%)")
    return (v / 100, True) if relative else (v, False)


def pick_one(ostudy, study: Study, tolerance: float | str | None = None, limits: dict[str, float] | None = None):
    """One policy of a study (what ``evomerge export`` writes), and the rule that picked it, in words.

    One objective: the best trial that meets every limit in ``limits`` (objective -> value: at most it for a
    minimised objective, at least for a maximised one). Several: among the Pareto set, the trials that meet every
    limit; of those, the ones within ``tolerance`` of the best first objective (a number: in its own unit, 0.005
    is half a point of accuracy; ``"2%"``: of its best value; None: 0.005 for an accuracy, else 0.5%); of those, the best by the second objective (then the third). A limit or tolerance that no
    trial meets raises a ConfigError naming ``--limit`` (None: no trial at all)."""
    from ..errors import ConfigError

    dirs = study.directions
    names = list(study.objectives)
    # one objective: every judged trial is a candidate (its Pareto set is its best trial alone, which a limit on
    # that objective would then only accept or refuse); several: the Pareto set
    front = judged(ostudy) if len(names) == 1 else pareto_trials(ostudy, study)
    if not front:
        return None, ""
    for name, bound in (limits or {}).items():
        if name not in names:
            raise ConfigError("--limit", f"{name!r} is not an objective of {study.name}; allowed: {', '.join(names)}")
        if name in ACCURACY_OBJECTIVES and not 0 <= bound <= 1:  # (95 met by no trial, said as if none were good)
            raise ConfigError("--limit", f"{name}={bound:g} is out of range; allowed: [0, 1] for {name}, a fraction "
                                         f"(0.95, not 95)")
        k = names.index(name)
        had = front
        front = [t for t in front if (t.values[k] <= bound if dirs[k] == "minimize" else t.values[k] >= bound)]
        if not front:
            best = (min if dirs[k] == "minimize" else max)(t.values[k] for t in had)
            raise ConfigError("--limit", f"{name}={bound:g}: no {'complete' if len(names) == 1 else 'Pareto-optimal'} "
                                         f"trial meets it (the best has {name} {best:.4g})")
    bound_words = {"minimize": "at most", "maximize": "at least"}  # (a lower bound read "val_accuracy limited to 0.9")
    limited = (f", with {', '.join(f'{k} {bound_words[dirs[names.index(k)]]} {v:g}' for k, v in limits.items())}"
               if limits else "")
    if len(names) == 1:
        pick = rank_trials(front, dirs)[0]
        return trial_summary(pick, study), f"the best {names[0]}{limited}"
    sign = [1 if d == "minimize" else -1 for d in dirs]
    best0 = min(sign[0] * t.values[0] for t in front)
    if tolerance is None:  # half a point of an accuracy; 0.5% of a time, a loss, a perplexity or a byte count
        tolerance = "0.005" if names[0] in ACCURACY_OBJECTIVES else "0.5%"
    value, relative = read_tolerance(tolerance)
    if not relative and value >= 1 and names[0] in ACCURACY_OBJECTIVES:  # meant as points: it would take every trial
        raise ConfigError("--tolerance", f"{tolerance} on {names[0]}, a fraction from 0 to 1, takes every trial; "
                                         "allowed: a number below 1 (0.05 is 5 points of accuracy) or a percentage of "
                                         "its best value (5%)")
    width = value * abs(best0) if relative else value
    close = [t for t in front if sign[0] * t.values[0] <= best0 + width]
    pick = min(close, key=lambda t: tuple(sign[k] * t.values[k] for k in range(1, len(names))) + (t.number,))
    within = f"{value * 100:g}% ({width:.4g})" if relative else f"{value:g}"
    # (with limits, the best first objective is the best of those that meet them, not the study's)
    said = (f"the best {names[1]} among the Pareto-optimal trials{limited}, within {within} of their best {names[0]}"
            if limits else f"the best {names[1]} among the Pareto-optimal trials within {within} of the best {names[0]}")
    return trial_summary(pick, study), said


SATURATED = 2.0  # a run that sent this many times what its links carry in its simulated time


def saturated(study: Study, finals: list[dict]) -> str | None:
    """Words for runs on a simulated cluster that sent more than their links can carry in their simulated time (a
    policy that merges faster than its payloads travel): most of their payloads were still in flight at the time
    budget, where the simulated clock stops and does not wait for them, so they cost it no time and merged nothing; a
    real run's ``finish()`` waits for every one (a gossip every step on 50 Mbit/s links: 0.56 simulated s, 34.7 s
    under netlab). With the step budget the clock waits for them too (its run ends when the last is applied), so
    only a time budget's run says this. None otherwise, and for free links. ``finals``: each seed's final metrics."""
    env = study.environment
    if env is None or not finals:
        return None
    import numpy as np

    from ..engine.clock import Network
    from ..units import size

    bw = Network(env, study.run.workers).bandwidth.copy()
    np.fill_diagonal(bw, 0.0)
    capacity = float(bw.max(axis=1).sum())  # every worker sending at its fastest link's rate at once
    if not math.isfinite(capacity) or capacity <= 0:
        return None
    over = [(float(f["bytes"]) / float(f["sim_time"]) / capacity, f) for f in finals
            if f.get("bytes") and f.get("sim_time")]
    if not over:
        return None
    ratio, f = max(over, key=lambda x: x[0])
    if ratio <= SATURATED:
        return None
    return (f"sent {size(float(f['bytes']))} in {float(f['sim_time']):.3g} simulated s, {ratio:,.0f}x what its links "
            f"carry in that time ({size(capacity)}/s): most of its payloads were still in flight at the time budget, "
            "where the simulated clock stops (they merged nothing and cost it no time); a real run's finish() waits "
            "for every one")


def policy_notes(policy, finals: list[dict], study: Study) -> dict[str, str]:
    """What a run, an export and the verdict say of a policy's runs (``finals``: each seed's final metrics), by
    kind: ``never_merged`` (:func:`never_merged`) and ``saturated`` (:func:`saturated`), those that apply."""
    said = {"never_merged": never_merged(policy, finals, study.run.workers), "saturated": saturated(study, finals)}
    return {k: v for k, v in said.items() if v}


def never_merged(policy, finals: list[dict], workers: int | None = None) -> str | None:
    """Words for a policy that merges but merged on none of its runs (``finals``: each seed's final metrics): the
    run's local steps ended before its first merge, so it ran as no merging does and sent nothing; on a simulated
    cluster, its time ran out first (workers at a barrier waited: not as no merging). None otherwise (no-merging
    itself, or any merge on any seed)."""
    if policy.scheme == "none" or not finals or any(int(f.get("merges", 1)) for f in finals):
        return None
    if workers == 1:  # (it said the steps ended before the first merge, with a merge due every step)
        return "never merged: one worker has no one to merge with (run.workers = 1), so it ran as no-merging"
    if any(f.get("sim_time") is not None for f in finals):  # a simulated cluster: its time ran out first
        slowest = min(int(f.get("steps_min") or f.get("local_steps") or 0) for f in finals)
        if not any(int(f.get("steps_max") or f.get("local_steps") or 0) for f in finals):
            return (f"never merged: the time ran out before any worker's first local step ({policy.describe()})")
        barrier = policy.scheme == "allreduce" and not getattr(policy, "fragment_delay", 0)
        return (f"never merged: the time ran out before its first merge ({policy.describe()}); the slowest worker "
                f"did {slowest} local steps" + (", and the others waited for it at the barrier" if barrier else ""))
    steps = max(int(f.get("local_steps", 0)) for f in finals)
    return (f"never merged: a worker's {steps} local steps ended before its first merge ({policy.describe()}), "
            f"so it ran as no-merging")


def trial_summary(t, study: Study) -> dict:
    return {"number": t.number, "values": list(t.values), "objectives": list(study.objectives),
            "params": dict(t.params), "policy": t.user_attrs.get("policy", {}), "metrics": t.user_attrs.get("metrics", {}),
            "spread": t.user_attrs.get("spread", {}), "run_status": t.user_attrs.get(RUN_STATUS, "ok"),
            "run": t.user_attrs.get("run", {}), "policy_key": t.user_attrs.get("policy_key"),
            "execution": t.user_attrs.get("execution"), "ran_on": t.user_attrs.get("ran_on"),
            "cma": {k: v for k, v in t.user_attrs.items() if k.startswith("cma_")}}


# -- what a run's metrics become -------------------------------------------------------------
def objective_values(study: Study, finals: list[dict]) -> list[float]:
    """Each objective's mean over seeds. A loss or perplexity that is not a number (a diverged run's) is the worst
    value, +inf: Optuna fails a trial told NaN, and a diverged trial must stay COMPLETE for the sampler to learn."""
    out = []
    for o, d in zip(study.objectives, study.directions):
        v = statistics.fmean(float(f[o]) for f in finals)
        out.append(math.inf if d == "minimize" and v != v else v)
    return out


def spread(vals: list[float]) -> float:
    """The sample standard deviation of 2 or more values; NaN where one is not finite (a diverged run's loss), where
    ``statistics.stdev`` raised AttributeError and took the verdict down with it."""
    return statistics.stdev(vals) if all(math.isfinite(v) for v in vals) else float("nan")


def summarise(finals: list[dict]) -> dict[str, float]:
    """Means over seeds of the final metrics, and their spread (``*_std``) over several seeds."""
    out: dict[str, float] = {}
    for k in SUMMARY_KEYS:
        vals = [float(f[k]) for f in finals if k in f]
        if vals:
            out[k] = statistics.fmean(vals)
            if len(vals) > 1:
                out[f"{k}_std"] = spread(vals)
    return out


def slim(f: dict) -> dict:
    """A run's final metrics as stored with a trial: the numbers and words, not the lists."""
    return {k: v for k, v in f.items() if isinstance(v, (int, float, str))}


def round_dict(h) -> dict:
    from dataclasses import asdict

    return asdict(h)


def curve_of(history: list[dict]) -> dict[str, list[float]]:
    """The learning curve a dashboard draws: one list per key, one entry per round."""
    return {k: [h[k] for h in history] for k in CURVE_KEYS if history and h_has(history, k)}


def h_has(history: list[dict], key: str) -> bool:
    """Whether every round of ``history`` has ``key`` (simulated time only exists with an [environment])."""
    return all(h.get(key) is not None for h in history)


def objective_label(name: str) -> str:
    from .config import OBJECTIVES

    o = OBJECTIVES.get(name)
    label, unit = (o.label, o.unit) if o else (name, "")
    way = "max" if (o.direction if o else "maximize") == "maximize" else "min"
    return f"{label}{', ' + unit if unit else ''} ({way})"  # ("time to target (s, min)" read as seconds and minutes)


def missed(study, name: str, value: float) -> str:
    """' (missed)' after a time-to-target value over the study's time budget: the target was not reached on at least
    one seed, whose penalty time (:func:`evomerge.engine.judge.penalty_words`) the value is, or holds in its mean; ''
    otherwise."""
    env = getattr(study, "environment", None)
    budget = getattr(env, "time_budget", 0) if env is not None else 0
    return " (missed)" if name == "time_to_target" and budget and value > budget else ""

