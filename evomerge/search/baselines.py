"""The baselines of a study, run: every policy of its ``[baselines]`` on its seeds (or on fresh seeds, for the
verdict), summarised as the search's trials are and cached in the Optuna study. (Reading results back,
:mod:`.results`, trains nothing.)"""

from __future__ import annotations

from ..study import Study
from .results import DIVERGED, RUN_STATUS, curve_of, objective_values, round_dict, slim, summarise

SEED_OFFSET = 1000  # fresh seeds start this far past the study's own (`run --reevaluate`, the verdict, transfer)


def fresh_seeds(study: Study, n: int) -> list[int]:
    """``n`` seeds no search of ``study`` used: past the study's own seeds."""
    start = max(study.run.seeds) + SEED_OFFSET
    return list(range(start, start + n))


def _key(study: Study, policies, kind: str, seeds, extra=None) -> str:
    """The user attribute under which runs of ``policies`` on ``seeds`` are kept: what they depend on (the study's
    fingerprint, its target, the policies, ``extra``), hashed."""
    import hashlib
    import json

    from . import fingerprint

    what = json.dumps([fingerprint.of(study)["hash"], study.target, [(n, p.to_dict()) for n, p in policies],
                       *([extra] if extra is not None else [])], sort_keys=True)
    return f"{kind}:{hashlib.sha256(what.encode()).hexdigest()[:16]}:" + ",".join(map(str, seeds))


def edge_note(study: Study, lrs: dict[str, float], said_tuned: bool = False,
              ties: dict[str, list[float]] | None = None) -> str | None:
    """Where a baseline's best step size is an end of the study's ``[baselines] lr`` (of two or more), a note: its
    best may lie beyond, so the rival was not tuned to its best; and what was tuned (the step size alone), unless
    ``said_tuned`` (the verdict's note before it says so). ``ties``: the baselines whose best was shared by several
    step sizes (:func:`tuned_lrs`), said as such, not as an end."""
    grid = sorted(set(study.baseline_lr))
    if len(grid) < 2:
        return None
    ties = {n: v for n, v in (ties or {}).items() if n in lrs}
    ends = {"highest": [n for n, v in lrs.items() if v == grid[-1] and n not in ties],
            "lowest": [n for n, v in lrs.items() if v == grid[0] and n not in ties]}
    said = [f"{', '.join(names)} at the grid's {end} ({grid[-1] if end == 'highest' else grid[0]:g})"
            for end, names in ends.items() if names]
    out = []
    if said:
        out.append(f"best step size at an end of [baselines] lr {grid}: {'; '.join(said)}; a wider grid may find a "
                   "better one")
    if ties:  # (a new user's rivals all reached the target at the first evaluation: "tuned" to the grid's first)
        out.append("; ".join(f"{n} tied at lr {', '.join(f'{v:g}' for v in vs)}" for n, vs in ties.items())
                   + f" on {study.objectives[0]} (the first of them taken): the step size was not told apart"
                   + (", as where the target is reached at the first evaluation (a harder study.objectives.target, "
                      "or evaluations more often, tells them apart)" if study.target is not None else ""))
    if not out:
        return None
    return "; ".join(out) + ("" if said_tuned else " (only the step size is tuned: each rule's other settings are "
                                                   "its policy file's)")


def kept_lrs(study: Study, storage_study) -> dict[str, float]:
    """Each baseline's step size as a search of ``study`` chose and kept it (:func:`tuned_lrs`), without tuning:
    ``{}`` when none is kept (no search, or one of another ``[baselines] lr`` or fingerprint)."""
    if not study.baseline_lr or storage_study is None:
        return {}
    policies = [(name, study.resolve_policy(name)) for name in study.baselines]
    return dict(storage_study.user_attrs.get(_key(study, policies, "baseline-lr-v1", list(study.run.seeds),
                                                  list(study.baseline_lr)), {}))


TIES = ":ties"  # beside a tuning's kept step sizes: the baselines whose best several step sizes shared


def tuned_lrs(study: Study, data=None, data_dir=None, device=None, storage_study=None, announce=None,
              setups: dict | None = None, keep_or_not: bool = False, ran=None,
              ties: dict | None = None) -> dict[str, float]:
    """Each baseline's step size: of the study's ``[baselines] lr``, the one whose runs on the study's own seeds
    have the best first objective (mean over seeds; the first listed of equals). ``{}`` when the study lists none
    (every baseline runs at ``run.lr``). Kept in the Optuna study's user attributes (``keep_or_not``: unless the
    storage refuses the write: a read-only or locked one, for a command that only reads it). ``setups``: the
    engine's setups by step size, filled and reused. ``ran()`` is told after each run. ``ties``: filled with the
    baselines whose best value several step sizes shared, and those step sizes."""
    if not study.baseline_lr:
        return {}
    seeds = list(study.run.seeds)
    policies = [(name, study.resolve_policy(name)) for name in study.baselines]
    key = _key(study, policies, "baseline-lr-v1", seeds, list(study.baseline_lr))
    if storage_study is not None and key in storage_study.user_attrs:
        if ties is not None:
            ties.update(storage_study.user_attrs.get(key + TIES, {}))
        return storage_study.user_attrs[key]
    from ..backends.inprocess import run

    if announce is not None:
        announce(len(policies) * len(study.baseline_lr) * len(seeds), tuning=True)
    sign = 1.0 if study.directions[0] == "minimize" else -1.0
    out, tied = {}, {}
    for name, pol in policies:
        scored = []
        for lr in study.baseline_lr:
            setup = lr_setup(study, lr, setups, data, data_dir)
            finals = [_told(run(setup, pol, s, device=device, curves=False).metrics(), ran) for s in seeds]
            v = objective_values(study, finals)[0]
            scored.append((sign * v if v == v else float("inf"), lr))  # NaN (a diverged accuracy): the worst
        out[name] = min(scored, key=lambda x: x[0])[1]  # min keeps the first of equals
        best = min(v for v, _ in scored)
        if sum(1 for v, _ in scored if v == best) > 1:
            tied[name] = [lr for v, lr in scored if v == best]
    if ties is not None:
        ties.update(tied)
    if storage_study is not None:
        try:
            if tied:  # (none kept: none read back)
                storage_study.set_user_attr(key + TIES, tied)
            storage_study.set_user_attr(key, out)
        except Exception:  # noqa: BLE001 - whatever the storage's driver raises
            if not keep_or_not:
                raise
    return out


def _told(result, ran):
    """``result``, once ``ran()`` (where given) is told that a run ended: the progress of a search's end."""
    if ran is not None:
        ran()
    return result


def lr_setup(study: Study, lr: float | None, setups: dict | None, data=None, data_dir=None):
    """The engine's setup of ``study`` at step size ``lr`` (None: the study's), made once per ``setups``."""
    from ..engine.setup import prepare
    from ..study import with_run

    setups = {} if setups is None else setups
    lr = None if lr == study.run.lr else lr
    if data is None and setups:  # the data another step size's setup read: read once
        data = next(iter(setups.values())).data
    if lr not in setups:
        setups[lr] = prepare(with_run(study, {"lr": lr}) if lr is not None else study, data=data, data_dir=data_dir)
    return setups[lr]


def baseline_rows(study: Study, data=None, data_dir=None, device=None, storage_study=None,
                  seeds=None, announce=None, curves: bool = True, ran=None, ties: dict | None = None) -> list[dict]:
    """Every baseline on ``seeds`` (default: the study's), their means over seeds and each seed's final metrics
    (``per_seed``); cached in the Optuna study's user attributes, per list of seeds. ``announce(runs)`` is told
    before runs that are not cached start, and ``ran()`` after each of them. ``curves=False``: the runs evaluate their last round only and the rows
    carry no ``history`` (the same final metrics, for readers of those alone: the verdict's fresh seeds); cached
    apart from the rows with curves."""
    seeds = list(study.run.seeds if seeds is None else seeds)
    policies = [(name, study.resolve_policy(name)) for name in study.baselines]
    setups: dict = {}
    lrs = tuned_lrs(study, data=data, data_dir=data_dir, device=device, storage_study=storage_study,
                    announce=announce, setups=setups, ran=ran, ties=ties)  # (ties: filled for the verdict's note)
    if not curves:
        return _final_rows(study, policies, lrs, seeds, setups, data, data_dir, device, storage_study, announce, ran)
    # what the rows depend on: the study (its fingerprint; the target too), the baselines' policies and step
    # sizes, the seeds
    key = _key(study, policies, "baselines-v4", seeds, lrs or None)
    if storage_study is not None and key in storage_study.user_attrs:
        return storage_study.user_attrs[key]
    from ..backends.inprocess import run

    if announce is not None:
        announce(len(policies) * len(seeds))
    rows = []
    for name, pol in policies:
        setup = lr_setup(study, lrs.get(name), setups, data, data_dir)
        results = [_told(run(setup, pol, s, device=device, curves=curves), ran) for s in seeds]
        finals = [r.metrics() for r in results]
        rows.append({"name": name, "values": objective_values(study, finals), **summarise(finals),
                     "per_seed": [slim(f) for f in finals], "seeds": seeds,
                     "history": curve_of([round_dict(h) for h in results[0].history]),
                     "policy": pol.to_dict(), "lr": lrs.get(name),
                     RUN_STATUS: DIVERGED if any(r.status == DIVERGED for r in results) else "ok"})
    if storage_study is not None:
        storage_study.set_user_attr(key, rows)
    return rows


def runs_by_seed(storage_study, key: str, sides: list[str], seeds: list[int], run_one, announce=None,
                 ran=None) -> dict[str, dict[str, dict]]:
    """``{side: {seed: final metrics}}`` for each of ``sides`` on each of ``seeds``: what the Optuna study keeps
    under ``key``, and the runs it lacks made (``run_one(side, seed)``), each kept as soon as it ran (an interrupted
    verdict resumes from there). By seed: a verdict on 5 fresh seeds runs only the 2 that one on 3 did not (it ran
    all 5, the runs kept under the list of seeds). ``announce(runs)`` is told first of the runs to make, ``ran()``
    after each. The verdict's picks and its baselines."""
    kept = (storage_study.user_attrs.get(key) or {}) if storage_study is not None else {}
    runs = {side: dict(v) for side, v in kept.items()}
    todo = [(side, s) for side in sides for s in seeds if str(s) not in runs.get(side, {})]
    if todo and announce is not None:
        announce(len(todo))
    for side, s in todo:
        runs.setdefault(side, {})[str(s)] = run_one(side, s)
        if storage_study is not None:
            storage_study.set_user_attr(key, runs)
        if ran is not None:
            ran()
    return runs


def _final_rows(study: Study, policies, lrs: dict, seeds: list[int], setups: dict, data, data_dir, device,
                storage_study, announce, ran) -> list[dict]:
    """:func:`baseline_rows` without curves (the verdict's fresh seeds): each baseline's final metrics, kept in the
    Optuna study by baseline and seed (:func:`runs_by_seed`)."""
    from ..backends.inprocess import run

    by_name = dict(policies)

    def run_one(name: str, seed: int) -> dict:
        setup = lr_setup(study, lrs.get(name), setups, data, data_dir)
        return slim(run(setup, by_name[name], seed, device=device, curves=False).metrics())

    cached = runs_by_seed(storage_study, _key(study, policies, "baselines-finals-v1", [], lrs or None),
                          [name for name, _ in policies], seeds, run_one, announce, ran)
    rows = []
    for name, pol in policies:
        finals = [cached[name][str(s)] for s in seeds]
        rows.append({"name": name, "values": objective_values(study, finals), **summarise(finals),
                     "per_seed": finals, "seeds": seeds, "history": [], "policy": pol.to_dict(), "lr": lrs.get(name),
                     RUN_STATUS: DIVERGED if any(f.get("status") == DIVERGED for f in finals) else "ok"})
    return rows
