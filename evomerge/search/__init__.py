"""Searching merge policies, split by job:

- :mod:`.config`: :class:`SearchConfig`, :func:`make_config`, the sampler and objective registries;
- :mod:`.storage`: storage URLs, opening the storage and the study, the cross-process lock;
- :mod:`.fingerprint`: what a study's stored results depend on, checked on every search;
- :mod:`.trial`: judging one trial (seeds, pruning, the multi-objective prune rule);
- :mod:`.loop`: the worker loop, ``--jobs`` processes, :func:`run_search`;
- :mod:`.results`: reading results back (status, export, the dashboard); it trains nothing and does not import
  the loop;
- :mod:`.baselines`: the study's baselines, run and cached;
- :mod:`.consensus`: the best trial's consensus model (for MLflow; the tracker only logs it);
- :mod:`.cmaes`: CMA-ES through ask/tell, its state replayed from the study.

Importing this package is cheap: the names below are loaded from their modules on first use.
Note that ``evomerge.search`` (the attribute) is the function :func:`evomerge.search`; reach this
package with ``from evomerge.search import ...`` or ``import evomerge.search.loop``.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "SearchConfig": "config", "make_config": "config", "SAMPLERS": "config", "OBJECTIVES": "config",
    "PRUNERS": "config", "Pruner": "config", "register_pruner": "config",
    "Sampler": "config", "Objective": "config", "register_sampler": "config", "register_objective": "config",
    "DEFAULTS": "config", "CMAES_CATEGORICALS": "config", "GRACE_PERIOD": "config",
    "default_storage": "storage", "normalise_url": "storage", "open_storage": "storage", "load_or_create": "storage",
    "search_lock": "storage", "file_lock": "storage",
    "mo_should_prune": "trial", "evaluate": "trial", "run_trial": "trial",
    "run_search": "loop", "work": "loop", "SearchResult": "loop",
    "load_study": "results", "best_trials": "results", "trial_summary": "results", "pareto_trials": "results",
    "baseline_rows": "baselines", "count_states": "results", "count_line": "results", "dominated_count": "results",
    "objective_label": "results", "objective_values": "results", "curve_of": "results", "diverged": "results",
    "RUN_STATUS": "results", "DIVERGED": "results",
    "CmaDriver": "cmaes",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
