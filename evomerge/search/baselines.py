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


def baseline_rows(study: Study, data=None, data_dir=None, device=None, storage_study=None,
                  seeds=None, announce=None, curves: bool = True) -> list[dict]:
    """Every baseline on ``seeds`` (default: the study's), their means over seeds and each seed's final metrics
    (``per_seed``); cached in the Optuna study's user attributes, per list of seeds. ``announce(runs)`` is told
    before runs that are not cached start. ``curves=False``: the runs evaluate their last round only and the rows
    carry no ``history`` (the same final metrics, for readers of those alone: the verdict's fresh seeds); cached
    apart from the rows with curves."""
    import hashlib
    import json

    from . import fingerprint

    seeds = list(study.run.seeds if seeds is None else seeds)
    policies = [(name, study.resolve_policy(name)) for name in study.baselines]
    # what the rows depend on: the study (its fingerprint; the target too), the baselines' policies, the seeds
    what = json.dumps([fingerprint.of(study)["hash"], study.target, [(n, p.to_dict()) for n, p in policies]],
                      sort_keys=True)
    key = f"baselines-v4:{hashlib.sha256(what.encode()).hexdigest()[:16]}:" + ",".join(map(str, seeds)) + \
        ("" if curves else ":finals")
    if storage_study is not None and key in storage_study.user_attrs:
        return storage_study.user_attrs[key]
    from ..backends.inprocess import run
    from ..engine.setup import prepare

    if announce is not None:
        announce(len(policies) * len(seeds))
    setup = prepare(study, data=data, data_dir=data_dir)
    rows = []
    for name, pol in policies:
        results = [run(setup, pol, s, device=device, curves=curves) for s in seeds]
        finals = [r.metrics() for r in results]
        rows.append({"name": name, "values": objective_values(study, finals), **summarise(finals),
                     "per_seed": [slim(f) for f in finals], "seeds": seeds,
                     "history": curve_of([round_dict(h) for h in results[0].history]) if curves else [],
                     "policy": pol.to_dict(),
                     RUN_STATUS: DIVERGED if any(r.status == DIVERGED for r in results) else "ok"})
    if storage_study is not None:
        storage_study.set_user_attr(key, rows)
    return rows
