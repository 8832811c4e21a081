"""Export searched policies as JSON that ``evomerge run --policy`` replays.

An exported file is the policy plus metadata: study, trial, objective values, the
seeds it was judged on with each seed's validation metrics, and the evomerge
version. ``MergePolicy.load`` reads the ``policy`` key.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..version import __version__
from ..errors import ConfigError
from ..policy import EXPORT_FORMAT, MergePolicy, no_effect  # noqa: F401 (EXPORT_FORMAT: this module's name for it too)
from ..search import fingerprint
from ..study import RUN_SEARCHABLE, Study


def export_document(summary: dict, study: Study, stored: dict | None = None, model_bytes: int | None = None) -> dict:
    """``stored``: the fingerprint kept with the Optuna study (what its trials ran under; the study file and the
    user's module beside it may have changed since); ``model_bytes``: its model's size as the search kept it (a
    Merger given a model of another size says so)."""
    policy = MergePolicy.from_dict(summary["policy"])  # validated again: what we write must load
    return {
        "format": EXPORT_FORMAT,
        "evomerge_version": __version__,
        "study": study.name,
        "study_file": str(study.path) if study.path else None,
        "trial": summary["number"],
        "objectives": dict(zip(summary["objectives"], summary["values"])),
        "seeds": list(study.run.seeds),
        "metrics_per_seed": summary["metrics"],
        "spread": summary["spread"],
        # what the policy does, in words (a policy file holds every field; "no_effect" names those that take none,
        # as an all-reduce's topology)
        "description": policy.describe(),
        # the fields that take no effect in it, whatever their values (policy.no_effect): not settings to tune
        "no_effect": sorted(no_effect(policy.to_dict())),
        "policy": policy.to_dict(),
        # the step size the policy was judged with: searched ([search.space] run.lr) or the study's own
        "run": {"optimizer": study.run.optimizer} | {k: (summary.get("run") or {}).get(k, getattr(study.run, k))
                                                     for k in RUN_SEARCHABLE} | _optimizer_settings(study),
        "run_searched": sorted(summary.get("run") or {}),
        # how the workers' steps ran (models.generic): `evomerge run --policy` runs the same strategy
        "execution": summary.get("execution"),
        # where its sums ran: a replay there matches it bit for bit (`evomerge run --policy` says whether it does)
        "ran_on": summary.get("ran_on"),
        # what the trial's results depend on (the study's fingerprint): a replay of a study changed since says what
        # changed instead of holding its figures to the trial's
        "fingerprint": _fingerprint(study, stored),
        # one worker's parameters and buffers in float32: the model whose merges the search timed
        **({"model_bytes": int(model_bytes)} if isinstance(model_bytes, int) else {}),
    }


def _fingerprint(study: Study, stored) -> dict:
    """The fingerprint an export carries: the one kept with the Optuna study, else the study file's now."""
    return stored if isinstance(stored, dict) and "summary" in stored else fingerprint.of(study)


def _optimizer_settings(study: Study) -> dict:
    """The study's optimiser settings beyond the step size, as torch.optim takes them (a loop that deploys the policy
    builds the same optimiser): SGD's momentum, Adam's and AdamW's betas and eps."""
    run = study.run
    if run.optimizer == "sgd":
        return {"momentum": run.momentum}
    return {"betas": list(run.betas), "eps": run.eps}


def load_study_trials(study: Study, storage_url: str):
    """The stored Optuna study (``evomerge.search.results.load_study``; kept here for the dashboard)."""
    from ..search.results import load_study

    return load_study(study, storage_url)


def verdict_note(ostudy, number: int) -> str | None:
    """What the search's last verdict (``evomerge status`` shows it) said of trial ``number`` against each baseline,
    where it judged that trial (an export that a baseline beat said nothing of it); None otherwise."""
    from ..search.verdict import ATTR, WORDS

    v = ostudy.user_attrs.get(ATTR) or {}
    said = [f"{WORDS.get(c.get('outcome'), c.get('outcome'))} {c.get('baseline')}" for c in v.get("comparisons", [])
            if c.get("pick") == number]
    if not said:
        return None
    seeds = v.get("seeds") or []
    where = f"{'fresh' if v.get('fresh') else 'the search' + chr(39) + 's own'} seed{'s' * (len(seeds) != 1)} " \
            f"{', '.join(map(str, seeds))}" if seeds else "its seeds"
    return f"the search's verdict on trial {number} ({where}): it " + "; ".join(said)


def export_best(study: Study, storage_url: str, out: Path, tolerance: float | str | None = None,
                limits: dict[str, float] | None = None) -> dict:
    """The one policy :func:`evomerge.search.results.pick_one` picks (its rule in words under ``picked_by``)."""
    from ..search.results import pick_one

    ostudy = load_study_trials(study, storage_url)
    best, rule = pick_one(ostudy, study, tolerance, limits)
    if best is None:
        raise ConfigError("--study", f"{study.name!r} has no completed trial yet{_diverged_note(ostudy)}")
    doc = export_document(best, study, ostudy.user_attrs.get(fingerprint.ATTR),
                          ostudy.user_attrs.get("model_bytes")) | {"picked_by": rule}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    return doc | {"verdict_note": verdict_note(ostudy, doc["trial"])}  # (said, not written: a verdict can be redone)


def export_trial(study: Study, storage_url: str, out: Path, number: int) -> dict:
    """One trial's policy, chosen by its number (as the dashboard and the MLflow UI show it): a complete trial whose
    run did not diverge."""
    from ..search.results import diverged, trial_summary

    ostudy = load_study_trials(study, storage_url)
    trials = ostudy.get_trials(deepcopy=False)
    ok = [t.number for t in trials if t.state.name == "COMPLETE" and not diverged(t)]
    got = next((t for t in trials if t.number == number), None)
    if got is None or got.number not in ok:
        states = {"PRUNED": "was pruned", "FAIL": "failed", "RUNNING": "is still running", "WAITING": "is waiting",
                  "COMPLETE": "diverged (its values are not finite)"}
        what = f"trial {number} {states.get(got.state.name, got.state.name.lower())}" if got is not None else \
            f"{study.name!r} has no trial {number}"
        which = ", ".join(map(str, ok)) if len(ok) <= 12 else f"{len(ok)} of them, from {min(ok)} to {max(ok)}"
        allowed = (f"the number of a complete trial that did not diverge: {which}" if ok else
                   "none yet (no complete trial that did not diverge)")
        raise ConfigError("--trial", f"{what}; allowed: {allowed}")
    doc = export_document(trial_summary(got, study), study, ostudy.user_attrs.get(fingerprint.ATTR),
                          ostudy.user_attrs.get("model_bytes")) | {"picked_by": f"--trial {number}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    return doc | {"verdict_note": verdict_note(ostudy, number)}


def export_pareto(study: Study, storage_url: str, out_dir: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """One file per Pareto-optimal trial (``trial-NNNN.json``); the files this study's earlier exports left there
    for trials that are no longer on the front are removed (a folder of "the Pareto set" that kept a dominated
    trial's policy was deployed as one). Returns the files written, those removed, and the ``trial-*.json`` files
    of other studies, left as they are."""
    from ..search.results import pareto_trials, trial_summary

    ostudy = load_study_trials(study, storage_url)
    trials = pareto_trials(ostudy, study)  # diverged runs are never exported
    if not trials:
        raise ConfigError("--study", f"{study.name!r} has no completed trial yet{_diverged_note(ostudy)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for t in sorted(trials, key=lambda t: t.number):
        p = out_dir / f"trial-{t.number:04d}.json"
        p.write_text(json.dumps(export_document(trial_summary(t, study), study, ostudy.user_attrs.get(fingerprint.ATTR),
                                                ostudy.user_attrs.get("model_bytes")), indent=2))
        paths.append(p)
    removed, others = [], []
    mine = _fingerprint(study, ostudy.user_attrs.get(fingerprint.ATTR)).get("hash")  # (what export_document writes)
    for p in sorted(out_dir.glob("trial-*.json")):
        if p in paths or not p.is_file():
            continue
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            doc = None
        # an earlier --pareto's file of this stored study (not a --trial or best export, which names its pick; not
        # another study of the name, in another store or of another definition)
        if isinstance(doc, dict) and doc.get("study") == study.name and "policy" in doc and "picked_by" not in doc \
                and mine is not None and (doc.get("fingerprint") or {}).get("hash") == mine:
            p.unlink()
            removed.append(p)
        else:
            others.append(p)
    return paths, removed, others


def _diverged_note(ostudy) -> str:
    from ..search.results import diverged

    n = sum(1 for t in ostudy.get_trials(deepcopy=False) if t.state.name == "COMPLETE" and diverged(t))
    return f" that did not diverge ({n} diverged)" if n else ""


from ..policy import read_export  # noqa: E402,F401  (read by `run`; it lives beside the policy it holds)
