"""The baselines of a study, run: every policy of its ``[baselines]`` on its seeds, summarised as the search's
trials are and cached in the Optuna study. (Reading results back, :mod:`.results`, trains nothing.)"""

from __future__ import annotations

from ..study import Study
from .results import DIVERGED, RUN_STATUS, curve_of, objective_values, round_dict, summarise


def baseline_rows(study: Study, data=None, data_dir=None, device=None, storage_study=None) -> list[dict]:
    """Every baseline on the study's seeds (mean over seeds); cached in the Optuna study's user attributes."""
    key = "baselines-v2:" + ",".join(map(str, study.run.seeds))
    if storage_study is not None and key in storage_study.user_attrs:
        return storage_study.user_attrs[key]
    from ..backends.inprocess import run
    from ..engine.setup import prepare

    setup = prepare(study, data=data, data_dir=data_dir)
    rows = []
    for name in study.baselines:
        pol = study.resolve_policy(name)
        results = [run(setup, pol, s, device=device) for s in study.run.seeds]
        finals = [r.metrics() for r in results]
        rows.append({"name": name, "values": objective_values(study, finals), **summarise(finals),
                     "history": curve_of([round_dict(h) for h in results[0].history]), "policy": pol.to_dict(),
                     RUN_STATUS: DIVERGED if any(r.status == DIVERGED for r in results) else "ok"})
    if storage_study is not None:
        storage_study.set_user_attr(key, rows)
    return rows
