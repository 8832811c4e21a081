"""Does a policy found on a small study hold on the big run? ``evomerge transfer --study S --target T --top K``.

The top K policies of S (its completed trials that did not diverge, ranked by S's objective; a multi-objective
S by Pareto layer, then its first objective within a layer: ``results.rank_trials``) are run
again on the target study T (more workers, a longer budget, another dataset) on fresh seeds, seeds no
search of T used (past T's own seeds, as ``run --reevaluate`` takes them). The same metric (S's first
objective, e.g. the consensus model's validation accuracy) ranks them on T. The two rankings are
compared by Spearman's rho and Kendall's tau-b (``scipy.stats``; ties get average ranks): near 1, the
small study ranks policies as the big run would; near 0, it does not, and a search should be sized
closer to the run it is for.

The result is printed, logged to S's MLflow experiment (one run ``transfer-to-T``: the correlations as
metrics, both rankings as ``transfer.json``) and kept with S's Optuna study (user attribute
``transfer:T``, JSON), from which S's dashboard draws its transfer section.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ConfigError, unknown

if TYPE_CHECKING:
    from ..study import Study

ATTR_PREFIX = "transfer:"
RUNS_PREFIX = "transfer-runs:"  # a transfer's runs so far, by trial (it resumes from them)


def unmeasured(metric: str, target: "Study", task) -> str | None:
    """Why the runs of ``target`` (its loss's ``task``) do not measure ``metric``, or None when they do."""
    from ..engine.setup import NEEDS_CLASSES, NEEDS_POSITIONS  # check_task's rule, for a study's own objectives
    from ..study import TIMED_OBJECTIVES

    if metric in TIMED_OBJECTIVES and target.environment is None:
        return "it has no [environment], no simulated clock"
    if metric == "time_to_target" and target.target is None:
        return "it has no [objectives] target"
    if metric in NEEDS_CLASSES and not task.classification:
        return f"its loss {task.loss!r} has no classes to be accurate on"
    if metric in NEEDS_POSITIONS and not task.per_position:
        return "it is not a language model (labels per position)"
    return None


def average_ranks(values: list[float], maximize: bool) -> list[float]:
    """Rank 1 = best; tied values share the mean of their ranks."""
    from scipy.stats import rankdata

    return [float(r) for r in rankdata([-v if maximize else v for v in values], method="average")]


def correlations(a: list[float], b: list[float]) -> dict[str, float]:
    """Spearman's rho and Kendall's tau-b of two paired lists, with their p-values (NaN when one list is constant)."""
    import warnings

    from scipy.stats import kendalltau, spearmanr

    with warnings.catch_warnings():  # a constant input: scipy warns and answers NaN, which is the answer
        warnings.simplefilter("ignore")
        rho, p_rho = spearmanr(a, b)
        tau, p_tau = kendalltau(a, b)  # exact for few policies without ties (scipy's method "auto")
    if len(a) <= EXACT_UP_TO and rho == rho:
        p_rho = spearman_exact_p(a, b)
    return {"spearman": float(rho), "spearman_p": float(p_rho), "kendall": float(tau), "kendall_p": float(p_tau)}


EXACT_UP_TO = 8  # policies: 8! = 40,320 pairings


def spearman_exact_p(a: list[float], b: list[float]) -> float:
    """The two-sided p-value of Spearman's rho over every pairing of the two rankings (each equally likely if they
    are unrelated). scipy's t approximation gave p 0 for three policies in the same order, which any pairing of 3 is
    with a chance of 1 in 6 (1 in 3, either order)."""
    import itertools

    import numpy as np
    from scipy.stats import rankdata

    ra, rb = rankdata(a) - (len(a) + 1) / 2, rankdata(b)
    perms = rb[np.array(list(itertools.permutations(range(len(b)))))]
    perms = perms - perms.mean(axis=1, keepdims=True)
    rhos = perms @ ra / (np.linalg.norm(perms, axis=1) * np.linalg.norm(ra))
    return float(np.mean(np.abs(rhos) >= abs(rhos[0]) - 1e-9))  # the first pairing is the observed one


def top_trials(ostudy, study: "Study", k: int) -> list:
    """The ``k`` best judged trials of ``study`` (``results.rank_trials``: several objectives by Pareto layer, then
    the first objective)."""
    from .results import judged, rank_trials

    return rank_trials(judged(ostudy), study.directions)[:k]


def transfer(source: "Study", target: "Study", *, top: int = 10, seeds: int = 1, storage: str | None = None,
             runs_dir=None, data_dir=None, device=None, backend: str = "inprocess", procs: int | None = None,
             data=None, on_run: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Re-evaluate the top ``top`` policies of ``source`` on ``target`` (each a name, a path or a Study) on ``seeds``
    fresh seeds; return the result (both rankings and the correlations). ``on_run(done, total)`` is told of each run. Its errors name these
    keywords (``evomerge transfer`` calls it too: there, they name its flags)."""
    import inspect

    from ..errors import keyword_names

    with keyword_names(inspect.signature(transfer).parameters, {"study": "source"}):
        from ..study import Study, check_given, load

        studies = []
        for key, st in (("source", source), ("target", target)):  # a name or a path, as evomerge.search takes
            try:
                check_given(st, key)
                studies.append(st if isinstance(st, Study) else load(st))
            except ConfigError as e:
                raise ConfigError(key, e.message) from None
        source, target = studies
        return _transfer(source, target, top=top, seeds=seeds, storage=storage, runs_dir=runs_dir, data_dir=data_dir,
                         device=device, backend=backend, procs=procs, data=data, on_run=on_run)


def _transfer(source: "Study", target: "Study", *, top: int = 10, seeds: int = 1, storage: str | None = None,
              runs_dir=None, data_dir=None, device=None, backend: str = "inprocess", procs: int | None = None,
              data=None, on_run: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """:func:`transfer`, its errors naming ``evomerge transfer``'s flags."""
    from pathlib import Path

    from ..engine.setup import prepare
    from ..backends import runner
    from ..policy import WORKER_BOUND, MergePolicy, fit_to_workers
    from .config import OBJECTIVES, default_runs_dir
    from .results import load_study
    from .storage import default_storage
    from ..backends import run_inputs

    if source.name == target.name:  # (the command's check only: a call ran it, and its result showed on the page)
        raise ConfigError("--target", f"is the study itself ({source.name}); name another study")
    if top < 2:
        raise ConfigError("--top", f"{top} is out of range; allowed: [2, inf) (a correlation needs two policies)")
    if seeds < 1:
        raise ConfigError("--seeds", f"{seeds} is out of range; allowed: [1, inf)")
    metric = source.objectives[0]
    if metric not in OBJECTIVES:
        raise ConfigError("study.objectives.metrics", unknown(metric, OBJECTIVES))
    runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir()
    url = storage or default_storage(runs_dir / source.name)
    ostudy = load_study(source, url)
    trials = top_trials(ostudy, source, top)
    if len(trials) < 2:
        raise ConfigError("--study", f"{source.name} has {len(trials)} completed trials that did not diverge; "
                                     "transfer ranks at least 2 (search further first)")
    policies, kept, left_out = [], [], []
    for t in trials:  # each policy on the target's workers (degree and communities to what they allow)
        pol = MergePolicy.from_dict(t.user_attrs["policy"])
        bound = {k: getattr(pol, k) for k in WORKER_BOUND}
        pol = pol.replace(**fit_to_workers(bound, target.run.workers))
        try:
            policies.append(run_inputs(target, pol, 0, backend=backend, procs=procs)[0])  # checked before data is read
            kept.append(t)
        except ConfigError as e:  # a rule the target cannot run (asynchronous DiLoCo without a clock): said, not run
            left_out.append({"trial": t.number, "why": str(e)})
    trials = kept
    if len(trials) < 2:
        raise ConfigError("--target", f"{target.name} can run {len(trials)} of the top policies of {source.name}"
                                      f"{' (' + left_out[0]['why'] + ')' if left_out else ''}; transfer ranks at least 2")
    run_fn = runner(backend, procs, target.run.workers)
    base = prepare(target, data=data, data_dir=data_dir)
    why = unmeasured(metric, target, base.model.task)
    if why:  # (every run ran, then a KeyError on the metric the target's runs do not have)
        raise ConfigError("--target", f"{target.name} does not measure {source.name}'s objective {metric} ({why}); "
                                      f"allowed: a target whose runs measure it")
    from ..study import with_run
    from . import fingerprint
    from .baselines import fresh_seeds
    from .results import slim

    fresh = fresh_seeds(target, seeds)
    # each policy's runs, kept with the source study as they finish: an interrupted transfer goes on from there
    import hashlib

    what = f"{fingerprint.of(target)['hash']}:{target.target}:{target.target_metric}"  # (the threshold is not in it)
    key = (f"{RUNS_PREFIX}{target.name}:{hashlib.sha256(what.encode()).hexdigest()[:16]}:{backend}:"
           + ",".join(map(str, fresh)))
    cached = dict(ostudy.user_attrs.get(key) or {})
    maximize = source.directions[0] == "maximize"
    rows, total, t0 = [], len(policies) * len(fresh), time.time()
    reused = sum(1 for t in trials if str(t.number) in cached)
    done = reused * len(fresh)
    if on_run and done:
        on_run(done, total)
    for t, pol in zip(trials, policies):
        found = t.user_attrs.get("run") or {}  # a searched step size travels with its policy
        finals = cached.get(str(t.number))
        if finals is None:
            finals = []
            setup = dataclasses.replace(base, study=with_run(target, found)) if found else base
            for s in fresh:
                finals.append(slim(run_fn(setup, pol, s, device=device).metrics()))
                done += 1
                if len(finals) == len(fresh):  # kept before the progress is told (an interrupt may come there)
                    cached[str(t.number)] = finals
                    ostudy.set_user_attr(key, cached)
                if on_run:
                    on_run(done, total)
        values = [float(f[metric]) for f in finals]
        rows.append({"trial": t.number, "source_value": float(t.values[0]), "target_value": statistics.fmean(values),
                     "target_values": values, "diverged": sum(f["status"] == "diverged" for f in finals),
                     "policy": pol.to_dict(), "description": pol.describe(), **({"run": found} if found else {})})
    src_rank = average_ranks([r["source_value"] for r in rows], maximize)
    tgt_rank = average_ranks([r["target_value"] for r in rows], maximize)
    for r, a, b in zip(rows, src_rank, tgt_rank):
        r.update(source_rank=a, target_rank=b)
    corr = correlations([r["source_value"] for r in rows], [r["target_value"] for r in rows])
    result = {"source": source.name, "target": target.name, "metric": metric, "direction": source.directions[0],
              "top": len(rows), "seeds": fresh, "rows": rows, **corr,
              "target_workers": target.run.workers, "target_total_steps": base.total_steps, "left_out": left_out,
              "reused": reused,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_time": time.time() - t0}
    ostudy.set_user_attr(ATTR_PREFIX + target.name, _finite(result))
    return result


def _finite(obj):
    """JSON the storage keeps: NaN (a constant ranking) as None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def stored(ostudy) -> list[dict[str, Any]]:
    """The transfer checks kept with a study, by target name."""
    return [v for k, v in sorted(ostudy.user_attrs.items()) if k.startswith(ATTR_PREFIX)]


#: below this many policies a rank correlation cannot tell agreement from chance (with 4, even a perfect one has
#: Spearman's p = 0.083 one-sided, and 1 in 24 random orders gives it)
MIN_RANKED = 5
FEW_RANKED = 10  # fewer policies than this whose rho is no agreement (p over AGREEMENT_P): no disagreement said either


#: the p-value of Spearman's rho under which an agreement is called one (above it, chance could give it)
AGREEMENT_P = 0.05


def verdict(rho: float | None, n: int | None = None, p: float | None = None) -> str:
    """What a rank correlation over ``n`` policies (two-sided p-value ``p``) says about sizing the search study."""
    if n is not None and n < MIN_RANKED:
        return (f"{n} policies are too few to judge: any order of them is likely by chance "
                f"(--top {MIN_RANKED} or more)")
    if rho is None or not math.isfinite(rho):
        return "no ranking on the target (every policy scored the same)"
    if rho >= 0.7 and p is not None and p == p and p > AGREEMENT_P:  # (5 policies at rho 0.7: p 0.23, "sound")
        return (f"the rankings look alike, but over {n} policies chance alone would give this often (p {p:.2g}): "
                "--top more to tell")
    if rho >= 0.7:
        return "the source study ranks policies much as the target does: searching it is a sound proxy"
    if p is not None and p == p and p > AGREEMENT_P and n is not None and n < FEW_RANKED:
        # (6 policies at rho 0.14, p 0.8, were called a source that does not rank as the target: so few tell little)
        return (f"the rankings {'agree only roughly' if rho >= 0.3 else 'do not agree'} over {n} policies, but so few "
                f"tell little either way (p {p:.2g}; an agreement of 0.7 over {n} is often missed): --top more, or "
                "more --seeds, to tell")
    if rho >= 0.3:
        return "the rankings agree only roughly: re-check the source study's best few on the target before choosing"
    return "the source study does not rank policies as the target does: search a study closer to the target run"
