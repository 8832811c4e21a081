"""The verdict at the end of a search: did the search find anything better than the baselines a user would
otherwise try (FedAvg, ring gossip, ...)? One source for the terminal, ``evomerge status``, the dashboard and
the description of the search's parent run in MLflow.

- **The picks** are named before anything is run again: a single-objective study's best trial; of a
  multi-objective study, the policy ``evomerge export`` writes (``results.pick_one``) and then the other
  Pareto-optimal trials by the first objective, :data:`PICKS` in all. They are never re-chosen.
- **Fresh seeds.** The picks won among many noisy trials, so they and every baseline are run again on the same
  fresh seeds (``--reevaluate N``, past the study's own; 0: the search's own seeds, with a note that this
  flatters the picks). Metrics are the validation split's; the test set is never used.
- **Paired differences.** Per objective, the pick's value minus the baseline's on each seed; shown as the mean
  +- one standard error, in the metric's unit (points of accuracy, percent of bytes, seconds).
- **Ties.** A difference is a tie unless every seed agrees in its sign and the mean exceeds two standard errors.
  A pick *beats* a baseline when it is better on at least one objective and worse on none; *loses to* it in
  the mirror case; *ties* when every objective ties; else it *trades off* with it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

from ..study import Study
from ..units import size

ATTR = "verdict"  # the Optuna study's user attribute that holds the last verdict
FRESH_ATTR = "verdict-fresh-v3:"  # + the study's fingerprint: the picks' runs on fresh seeds, by trial and seed
MAX_DESCRIPTION = 8000  # MLflow's longest tag value
PICKS = 2  # at most this many picks of a multi-objective study
#: how often the tie rule calls a difference where there is none (two-sided, normal differences; measured by
#: simulation): the rule is the issue's, and few seeds make it loose, which the verdict's notes say
FALSE_CALLS = {2: 0.29, 3: 0.18, 4: 0.11, 5: 0.06}
LEAD = ("fedavg", "ring-gossip")  # the baselines a verdict speaks of first: what people tune by hand
POINTS = {"val_accuracy", "mean_worker_accuracy", "worst_worker_accuracy", "accuracy_at_time"}  # in points (x100)
RATIO = {"bytes"}  # in percent of the baseline's
SECONDS = {"time_to_target", "sim_time", "wall_time"}
WORDS = {"better": "beats", "worse": "loses to", "tie": "ties with", "trade-off": "trades off with"}


# -- the rule -------------------------------------------------------------------------------------------
def decide(diffs: list[float], maximize: bool) -> tuple[float, float, str]:
    """Mean and standard error of paired differences (pick - baseline), and ``better`` / ``worse`` / ``tie``:
    a tie unless every seed agrees in sign and the mean exceeds two standard errors (one seed: no spread,
    so only the sign counts)."""
    n = len(diffs)
    if not all(math.isfinite(d) for d in diffs):  # a metric a run could not give: no difference to tell
        return float("nan"), float("nan"), "tie"
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else 0.0
    agree = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    if not agree or abs(mean) <= 2 * se or not math.isfinite(mean):
        return mean, se, "tie"
    return mean, se, "better" if (mean > 0) == maximize else "worse"


def combine(outcomes: list[str]) -> str:
    """One comparison's outcome from its objectives' (see the module's docstring)."""
    if all(o == "tie" for o in outcomes):
        return "tie"
    if "worse" not in outcomes:
        return "better"
    if "better" not in outcomes:
        return "worse"
    return "trade-off"


def _label(name: str) -> str:
    from .config import OBJECTIVES

    o = OBJECTIVES.get(name)
    return o.label if o else name


def _seconds(v: float) -> str:
    """Seconds to two decimals, or to two significant digits below 0.005 (never 0.00 for a difference that is not)."""
    return f"{v:.2f}" if v >= 0.005 or v == 0 or not math.isfinite(v) else f"{v:.2g}"


def _percent(x: float) -> str:
    """A share in percent as a person writes it: ``190%``, ``19%``, ``2.9%``, ``0.05%``, ``<0.01%`` (never 2e+02%)."""
    return f"{x:.0f}%" if x >= 10 else f"{x:.2g}%" if x >= 0.01 else "<0.01%"


def difference_text(name: str, pick: list[float], base: list[float], mean: float, se: float, maximize: bool) -> str:
    """A paired difference in the metric's unit, from the pick's side: ``+0.3 +- 0.2 points val acc``, ``21% fewer
    bytes``, ``1.20 +- 0.30 s faster (time to target)``, ``0.0013 +- 0.001 lower val loss``."""
    label = _label(name)
    one = len(pick) < 2  # one seed: no spread to say (a "± 0.00" read as one measured)
    if name in POINTS:
        return f"{100 * mean:+.2f}{'' if one else f' ± {100 * se:.2f}'} points {label}"
    if name in RATIO:
        if any(b <= 0 for b in base):
            p = statistics.fmean(pick)
            return f"{size(p)} more {label} (the baseline sends none)" if p > 0 else f"no {label} (as the baseline)"
        ratios = [p / b for p, b in zip(pick, base)]
        if not all(math.isfinite(x) for x in ratios):
            return f"{label}: not comparable"
        r = statistics.fmean(ratios)
        rse = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0
        spread = f" ± {100 * rse:.0f}%" if rse >= 0.005 else ""
        if not spread and abs(r - 1) < 0.005:  # ("0% fewer bytes")
            return f"the same {label}"
        if r <= 1:
            return f"{100 * (1 - r):.0f}%{spread} fewer {label}"
        if r <= 2:
            return f"{100 * (r - 1):.0f}%{spread} more {label}"
        return f"{r:.1f}x{f' ± {rse:.1f}x' if rse >= 0.05 else ''} the {label}"  # ("(± 0.1x) (worse)" read oddly)
    if name in SECONDS and not maximize:  # (a difference below 0.005 s: its own digits, not "0.00 s slower")
        return f"{_seconds(abs(mean))}{'' if one else f' ± {_seconds(se)}'} s {'faster' if mean < 0 else 'slower'} " \
               f"({label})"
    if mean == 0:  # (no direction to say: the same on average)
        return f"the same {label}" if one or not se else f"the same {label} on average (± {se:.2g})"
    # lower or higher in words: a signed difference of a loss ("-0.0013 val loss" on a "loses to" line) read oddly;
    # and by how much of the baseline's (a regression's "0.0008115 ± 9.4e-05 lower val loss" said nothing of scale)
    ref = statistics.fmean(base) if base else 0.0
    rel = f" (by {_percent(100 * abs(mean) / ref)})" if ref > 0 and math.isfinite(ref) and math.isfinite(mean) else ""
    return f"{abs(mean):.4g}{'' if one else f' ± {se:.2g}'} {'lower' if mean < 0 else 'higher'} {label}{rel}"


def compare(study: Study, pick: list[list[float]], base: list[list[float]], seeds: list[int] | None = None,
            pick_diverged: list[int] = (), base_diverged: list[int] = (), pick_missed: list[int] = (),
            base_missed: list[int] = ()) -> dict[str, Any]:
    """A pick against a baseline: per-seed objective values (``[seed][objective]``) of each, on the same seeds.
    A side whose run diverged on a seed (``*_diverged``: those seeds) loses to one that did not, whatever its
    numbers (a run that blew up reports accuracy 0 and the few bytes it sent before); both diverging is a tie.
    ``*_missed``: seeds on which a time study's target was not reached (ranked as the penalty time)."""
    if pick_diverged or base_diverged:
        said = "; ".join(f"{who} diverged on seed{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))}"
                         for who, ss in (("the pick", pick_diverged), ("the baseline", base_diverged)) if ss)
        outcome = "tie" if pick_diverged and base_diverged else ("worse" if pick_diverged else "better")
        return {"outcome": outcome, "objectives": [], "text": said}
    objs = []
    for k, (name, direction) in enumerate(zip(study.objectives, study.directions)):
        p, b = [float(v[k]) for v in pick], [float(v[k]) for v in base]
        maximize = direction == "maximize"
        diffs = [x - y for x, y in zip(p, b)]
        mean, se, outcome = decide(diffs, maximize)
        text = difference_text(name, p, b, mean, se, maximize)
        same_sign = sum(1 for d in diffs if d and (d > 0) == (mean > 0))
        if outcome == "tie" and len(diffs) > 1 and mean and math.isfinite(mean) and same_sign < len(diffs):
            way = ("faster" if mean < 0 else "slower") if name in SECONDS and not maximize else \
                ("more" if mean > 0 else "fewer") if name in RATIO else ("higher" if mean > 0 else "lower")
            text += f", {way} on only {same_sign} of {len(diffs)} seeds"  # why a tie: the seeds that disagree
        objs.append({"name": name, "pick": p, "baseline": b, "mean": mean, "se": se, "outcome": outcome,
                     "text": text})
    outcome = combine([o["outcome"] for o in objs])
    # where a tie on one objective stands beside the one that decided: each one's part ("loses to X: +0.5 points
    # (a tie), 27x the bytes (worse)"; a "loses to" beside a plus sign read oddly)
    mixed = outcome != "tie" and any(o["outcome"] == "tie" for o in objs)
    mark = {"tie": " (a tie)", "better": " (better)", "worse": " (worse)"}
    marked = [o["text"] + (mark.get(o["outcome"], "") if mixed else "") for o in objs]
    n = len(pick)
    missed = [f"by the {who} on {len(ss)} of {n} seeds" for who, ss in (("pick", pick_missed),
                                                                        ("baseline", base_missed)) if ss]
    if missed:  # a miss counts as the penalty time it is ranked as: say so
        both = len(pick_missed) == n and len(base_missed) == n  # (read as seconds by a new user)
        marked.append("the target not reached " + " and ".join(missed) + (
            " (the difference is of penalty times, how close each came, not of seconds)" if both else
            " (a miss counts as its penalty time)"))
    return {"outcome": outcome, "objectives": objs, "text": ", ".join(marked)}


def _at_first_round(study: Study, sides: list[tuple[str, dict]]) -> str | None:
    """A note where two or more sides reached the time target at the first evaluation on every seed: time to
    target is taken at round resolution there (the first round's end), so it cannot tell them apart."""
    env = study.environment
    if "time_to_target" not in study.objectives or env is None or not env.time_budget:
        return None
    k, first = study.objectives.index("time_to_target"), env.time_budget / study.run.rounds
    at = [who for who, side in sides
          if side.get("per_seed") and all(abs(v[k] - first) <= 1e-6 * first for v in side["per_seed"])]
    if len(at) < 2:
        return None
    return (f"{_join(at)} reached the target at the first evaluation ({first:g} s, the end of round 1) on every "
            "seed: time to target cannot tell them apart there; a harder study.objectives.target or more run.rounds "
            "can")


def ordered(names: list[str]) -> list[str]:
    """Baselines in the order a verdict speaks of them: FedAvg and ring gossip first, then the study's order."""
    return [n for n in LEAD if n in names] + [n for n in names if n not in LEAD]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def judge(study: Study, picks: list[dict], baselines: list[dict], seeds: list[int], fresh: bool,
          picked_by: str) -> dict[str, Any]:
    """The verdict from values alone: ``picks`` (``number``, ``describe``, ``per_seed`` ``[seed][objective]``) and
    ``baselines`` (``name``, ``per_seed``), all on ``seeds``. Returns what every view shows: ``headline``,
    ``lines`` (per pick and baseline), ``notes`` and the comparisons themselves."""
    names = ordered([b["name"] for b in baselines])
    base = {b["name"]: b for b in baselines}
    comparisons = []
    for p in picks:
        for n in names:
            b = base[n]
            c = compare(study, p["per_seed"], b["per_seed"], seeds, p.get("diverged", []), b.get("diverged", []),
                        p.get("missed", []), b.get("missed", []))
            comparisons.append({"pick": p["number"], "baseline": n, **c})
    by = {(c["pick"], c["baseline"]): c for c in comparisons}
    first = picks[0]["number"]
    beaten_by = [n for n in names if all(by[p["number"], n]["outcome"] == "worse" for p in picks)]
    seed_s = f"seed{'s' * (len(seeds) != 1)} {', '.join(map(str, seeds))}"
    where = f"fresh {seed_s}" if fresh else f"the search's own {seed_s}"
    every = "every pick" if len(picks) > 1 else f"trial {first}"
    won = bool(names) and all(by[first, n]["outcome"] == "better" for n in names)  # (then none beat it)
    if not names:
        headline = f"trial {first}: no baselines to compare with (the study's [baselines] policies is empty)"
    elif beaten_by:
        # the figures of one comparison: whose, where more than one pick or baseline could be meant
        whose = []
        if len(picks) > 1:
            whose.append(f"trial {first}")
        if len(beaten_by) > 1:
            whose.append(f"against {beaten_by[0]}")
        figures = by[first, beaten_by[0]]["text"]
        if whose:
            figures = f"{' '.join(whose)}: {figures}"
        headline = (f"A baseline beats the search: {_join(beaten_by)} {'beat' if len(beaten_by) > 1 else 'beats'} "
                    f"{every} on {where} ({figures})")
    elif won:
        headline = f"trial {first} beats every baseline ({_join(names)}) on {where}"
    else:
        groups = {}
        for n in names:
            groups.setdefault(by[first, n]["outcome"], []).append(n)
        parts = [f"{WORDS[o]} {_join(groups[o])}" for o in ("better", "tie", "trade-off", "worse") if o in groups]
        headline = f"trial {first} " + "; ".join(parts) + f" (on {where})"
    searched = sorted({k for p in picks for k in (p.get("run") or {})})
    tuned = [(n, base[n]["lr"]) for n in names if base[n].get("lr") is not None]
    if any(v != study.run.lr for _, v in tuned) and "lr" not in searched and not won:
        # (a new user read "a baseline beats the search" as a search of no use; the fourth note said why)
        headline += f"; the baselines at their tuned step sizes, the picks at the study's lr {study.run.lr:g} " \
                    "(search run.lr to tune theirs)"
    lines = []
    for p in picks:
        lines.append(f"trial {p['number']}: {p['describe']}")
        for n in names:
            c = by[p["number"], n]
            lines.append(f"  {WORDS[c['outcome']]} {n}: {c['text']}")
    notes = [f"picks named before they were run again: {picked_by}",
             "each difference is paired by seed, pick minus baseline, ± one standard error; a tie unless every seed "
             "agrees in sign and the mean exceeds two standard errors; metrics on the validation split (the test set "
             "is not used)"]
    if not fresh:
        notes.append("judged on the search's own seeds (--reevaluate 0; reevaluate=0 in Python): the picks won on "
                     "these seeds, so this flatters them; --reevaluate N (reevaluate=N) runs them again on N fresh "
                     "seeds")
    if len(seeds) == 1:
        notes.append("one seed: no spread, so no difference is tested against noise")
    elif len(seeds) in FALSE_CALLS:
        notes.append(f"with {len(seeds)} seeds this rule calls about {FALSE_CALLS[len(seeds)]:.0%} of true ties a "
                     "difference (more seeds: --reevaluate N; reevaluate=N in Python)")
    for who, side in [(f"trial {p['number']}", p) for p in picks] + [(n, base[n]) for n in names]:
        if side.get("never_merged"):  # its interval is longer than the run: what it is compared as is no merging
            notes.append(f"{who} {side['never_merged']}")
        if side.get("saturated"):  # its payloads mostly never landed: a real run would wait for them at its end
            notes.append(f"{who} {side['saturated']}")
    sides = [p for p in picks] + [base[n] for n in names]
    none_reached = study.target is not None and bool(sides) and all(len(x.get("missed") or ()) == len(seeds)
                                                                    for x in sides)
    if none_reached:
        from ..engine.judge import penalty_words

        notes.append(f"no side reached the target ({study.target_metric} {study.target:g}) on any seed: each is "
                     f"ranked by how close it came, its penalty time ({penalty_words(study.target_metric)}); a longer "
                     "study.environment.time_budget or an easier study.objectives.target tells them apart by time")
    first_round = _at_first_round(study, [(f"trial {p['number']}", p) for p in picks] + [(n, base[n]) for n in names])
    if first_round:
        notes.append(first_round)
    if tuned:
        notes.append(f"each baseline ran at its best step size of lr {list(study.baseline_lr)} on the study's seeds "
                     f"({', '.join(f'{n} {v:g}' for n, v in tuned)})"
                     + (f"; the picks at their searched {', '.join('run.' + k for k in searched)}" if searched
                        else f"; the picks at the study's lr {study.run.lr:g}")
                     + "; only the step size is tuned: each rule's other settings are its policy file's")
        from .baselines import edge_note

        edge = edge_note(study, dict(tuned), said_tuned=True,
                         ties={n: base[n]["lr_tied"] for n in names if base[n].get("lr_tied")})
        if edge:
            notes.append(edge)
    else:
        notes.append(f"the baselines ran at the study's step size (lr {study.run.lr:g}), not tuned for each"
                     + (f"; the picks at their searched {', '.join('run.' + k for k in searched)}" if searched else ""))
    return {"headline": headline, "lines": lines, "notes": notes, "seeds": list(seeds), "fresh": fresh,
            "picks": [{k: p[k] for k in ("number", "describe", "per_seed", "diverged") if k in p} for p in picks],
            "baselines": [{k: base[n][k] for k in ("name", "per_seed", "diverged", "lr", "lr_tied")
                           if base[n].get(k) is not None}
                          for n in names],  # (lr: a baseline's tuned step size, where [baselines] lr tunes it)
            "beaten_by": beaten_by, "comparisons": comparisons, "objectives": list(study.objectives),
            "none_reached": none_reached}  # (no side reached the time target on any seed: nothing to deploy yet)


# -- choosing and running ------------------------------------------------------------------------------
def choose_picks(ostudy, study: Study) -> tuple[list[dict], str]:
    """The picks (trial summaries) and the rule that named them, in words. A trial that reused another's results
    (``reused_from``: the same policy) is never a second pick."""
    from .results import pareto_trials, pick_one, rank_trials, trial_summary

    first, rule = pick_one(ostudy, study)
    if first is None:
        return [], ""
    if len(study.objectives) == 1:
        return [first], f"trial {first['number']}, {rule}"
    seen = {first["policy_key"]} if first.get("policy_key") else set()
    rest = []
    for t in rank_trials([t for t in pareto_trials(ostudy, study) if t.number != first["number"]], study.directions):
        key = t.user_attrs.get("policy_key")
        if t.user_attrs.get("reused_from") is not None or (key and key in seen):
            continue
        seen.add(key)
        rest.append(t)
    picks = [first] + [trial_summary(t, study) for t in rest[:PICKS - 1]]
    more = (f", then {'the next' if len(picks) == 2 else f'the next {len(picks) - 1}'} Pareto-optimal by "
            f"{study.objectives[0]}") if len(picks) > 1 else ""
    return picks, f"trial {first['number']} as `evomerge export` picks it ({rule}){more}"


def per_seed(study: Study, finals: list[dict]) -> list[list[float]]:
    return [[float(f[o]) for o in study.objectives] for f in finals]


def _outcomes(study: Study, finals: list[dict], seeds: list[int]) -> dict[str, list[int]]:
    """The seeds on which a side's run diverged, and (time to target) on which it missed the target."""
    from .results import DIVERGED

    budget = study.environment.time_budget if study.environment is not None else None
    missed = []
    if "time_to_target" in study.objectives:
        missed = [s for s, f in zip(seeds, finals)
                  if float(f["time_to_target"]) > (budget or float(f.get("sim_time", float("inf"))))]
    return {"diverged": [s for s, f in zip(seeds, finals) if f.get("status") == DIVERGED], "missed": missed}


def _idle(policy: dict, finals: list[dict], study: Study) -> dict:
    """``{"never_merged": words}`` for a side that merged on no seed (:func:`results.never_merged`), and
    ``{"saturated": words}`` for one that sent more than its links carry (:func:`results.saturated`); else ``{}``."""
    from ..policy import MergePolicy
    from .results import policy_notes, saturated

    try:
        return policy_notes(MergePolicy.from_dict(policy), finals, study)
    except Exception:  # a policy of a later schema, read by an older evomerge
        flooded = saturated(study, finals)
        return {"saturated": flooded} if flooded else {}


def fresh_key(study: Study) -> str:
    """The user attribute that keeps the picks' runs on fresh seeds, ``{trial: {seed: final metrics}}``: the
    study's fingerprint and, where it has one, its target (left out of the hash, :data:`fingerprint.UNHASHED`, and a
    run's time to target depends on it). By seed: a verdict on 5 fresh seeds reuses the 3 a verdict before ran (it
    ran all 5, the runs kept under the list of seeds)."""
    from . import fingerprint

    aim = f"@{study.target_metric}={study.target!r}" if study.target is not None else ""
    return FRESH_ATTR + fingerprint.of(study)["hash"][:16] + aim


def compute(study: Study, ostudy, reevaluate: int, *, data=None, data_dir=None, device=None,
            announce: Callable[..., None] | None = None, ran: Callable[[], None] | None = None
            ) -> dict[str, Any] | None:
    """Name the picks, run them and the baselines on ``reevaluate`` fresh seeds (0: the search's own seeds; runs
    are cached in the Optuna study under the study's fingerprint, each pick and each baseline as soon as it ran),
    judge, and store the verdict with the study (:data:`ATTR`). None when no trial completed. ``announce(runs, part=)`` is
    told before the runs that are not cached start (``part``: the picks', then the baselines', in words), ``ran()``
    after each."""
    from ..backends.inprocess import run
    from ..engine.setup import prepare
    from ..policy import MergePolicy
    from ..study import with_run
    from .baselines import baseline_rows, fresh_seeds, runs_by_seed
    from ..policy import describe_policy
    from .results import slim

    picks, rule = choose_picks(ostudy, study)
    if not picks:
        return None
    if reevaluate:
        seeds = fresh_seeds(study, reevaluate)
        setups: dict = {}
        by_number = {str(p["number"]): p for p in picks}

        def run_one(number: str, seed: int) -> dict:
            p = by_number[number]
            found = p.get("run") or {}
            rkey = tuple(sorted(found.items()))
            if rkey not in setups:
                setups[rkey] = prepare(with_run(study, found), data=data, data_dir=data_dir)
            return slim(run(setups[rkey], MergePolicy.from_dict(p["policy"]), seed, device=device,
                            curves=False).metrics())  # only the final values are read

        told = (lambda runs: announce(runs, part="the picks")) if announce is not None else None
        cached = runs_by_seed(ostudy, fresh_key(study), list(by_number), seeds, run_one, told, ran)
        finals_of = {p["number"]: [cached[str(p["number"])][str(s)] for s in seeds] for p in picks}
    else:
        seeds = list(study.run.seeds)
        finals_of = {p["number"]: [p["metrics"][str(s)] for s in seeds] for p in picks}
    for p in picks:
        p.update(per_seed=per_seed(study, finals_of[p["number"]]), describe=describe_policy(p["policy"], p.get("run")),
                 **_outcomes(study, finals_of[p["number"]], seeds), **_idle(p["policy"], finals_of[p["number"]], study))
    # on fresh seeds only the final values are read; on the search's own, the rows (and their curves) are the end
    # screen's and the dashboard's
    ties: dict = {}
    rows = baseline_rows(study, data=data, data_dir=data_dir, device=device, storage_study=ostudy, seeds=seeds,
                         curves=not reevaluate, ran=ran, ties=ties,
                         announce=(lambda runs, tuning=False: announce(runs, part="tuning the baselines' step sizes"
                                                                        if tuning else "the baselines"))
                         if announce is not None else None)
    bases = [{"name": r["name"], "lr": r.get("lr"), "lr_tied": ties.get(r["name"]),
              "per_seed": per_seed(study, r["per_seed"]),
              **_outcomes(study, r["per_seed"], seeds),
              **_idle(r["policy"], r["per_seed"], study)} for r in rows]
    verdict = judge(study, picks, bases, seeds, bool(reevaluate), rule)
    verdict["complete"] = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.state.name == "COMPLETE")
    ostudy.set_user_attr(ATTR, verdict)
    return verdict


def markdown(verdict: dict[str, Any]) -> str:
    """The verdict as the parent MLflow run's description (Markdown)."""
    out = [f"**Verdict.** {verdict['headline']}", ""]
    for line in verdict["lines"]:
        out.append(("    - " + line.strip()) if line.startswith("  ") else f"- {line}")
    out.append("")
    out += [f"*{n}*  " for n in verdict["notes"]]
    return "\n".join(out)[:MAX_DESCRIPTION]


def stale_note(verdict: dict[str, Any], complete: int | None) -> str | None:
    """What a stored verdict says when the study holds more complete trials than when it was judged."""
    then = verdict.get("complete")
    if complete is None or then is None or then == complete:
        return None
    return (f"judged when the study held {then} complete trial{'s' * (then != 1)}; it holds {complete} now (a search that ends "
            "judges again)")


def render(verdict: dict[str, Any], console, complete: int | None = None) -> None:
    """The verdict on a terminal (rich ``console``); ``complete``: the study's complete trials now (a stored
    verdict from fewer says so)."""
    from rich.markup import escape

    console.print(f"[bold]verdict:[/bold] {escape(verdict['headline'])}")
    stale = stale_note(verdict, complete)
    if stale:  # under the headline it qualifies, not after the lines (which read as today's)
        console.print(f"[yellow]note: {escape(stale)}[/yellow]", highlight=False)
    for line in verdict["lines"]:
        console.print(escape(line), highlight=False)
    for n in verdict["notes"]:
        console.print(f"[dim]note: {escape(n)}[/dim]", highlight=False)
