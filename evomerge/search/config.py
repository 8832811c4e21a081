"""What a search is: :class:`SearchConfig`, validated once by :func:`make_config` before any
trial runs, and the registries of samplers and objectives that outside code can extend.

The defaults here are the defaults of ``evomerge.search()`` and of ``evomerge search``
(``tests/test_search_config.py`` holds the three to one set of names and defaults).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError
from ..study import OBJECTIVES as _DIRECTIONS
from ..study import Study
from .storage import GRACE_PERIOD, HEARTBEAT_INTERVAL, default_storage, normalise_url  # noqa: F401

CMAES_CATEGORICALS = ("independent", "fixed")


# -- registries ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampler:
    """A sampler by name. ``make(cfg, seed)`` returns the Optuna sampler of one search process;
    ``multi_objective``: "required" (refused on single-objective studies), "supported" or "no"."""
    make: Callable[[Any, int], Any]
    multi_objective: str = "supported"
    note: str = ""


def _tpe(cfg, seed):
    import optuna

    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


def _nsga2(cfg, seed):
    import optuna

    return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, cfg.n_trials // 3)))


def _random(cfg, seed):
    import optuna

    return optuna.samplers.RandomSampler(seed=seed)


SAMPLERS: dict[str, Sampler] = {
    "tpe": Sampler(_tpe),
    "random": Sampler(_random),
    "nsga2": Sampler(_nsga2, multi_objective="required",
                     note="NSGA-II ranks trials by Pareto dominance: with one objective it is a plain genetic algorithm"),
    # CMA-ES proposes the numeric fields itself (search/cmaes.py); Optuna's sampler draws the categoricals
    "cmaes": Sampler(_random, multi_objective="no"),
}


@dataclass(frozen=True)
class Objective:
    """A metric a study may optimise: its direction, a short label for tables, and how to read it
    from one round's metrics (``simulate.RoundMetrics``) for pruning."""
    direction: str
    label: str
    from_round: Callable[[Any], float]


OBJECTIVES: dict[str, Objective] = {
    "val_accuracy": Objective("maximize", "val acc", lambda m: m.val_accuracy),
    "mean_worker_accuracy": Objective("maximize", "mean worker acc", lambda m: m.mean_worker_accuracy),
    "bytes": Objective("minimize", "bytes", lambda m: float(m.bytes)),
    # simulated time ([environment]); time_to_target per round is what it would be if accuracy stalled there
    "time_to_target": Objective("minimize", "time to target s", lambda m: m.time_to_target),
    "accuracy_at_time": Objective("maximize", "acc at time", lambda m: m.accuracy_at_time),
    "sim_time": Objective("minimize", "sim s", lambda m: m.sim_time),
}


def register_sampler(name: str, sampler: Sampler) -> None:
    SAMPLERS[name] = sampler


def register_objective(name: str, objective: Objective) -> None:
    """Add an objective; study files may then name it in ``[objectives] metrics``."""
    OBJECTIVES[name] = objective
    _DIRECTIONS[name] = objective.direction  # what study validation accepts


# -- the configuration ----------------------------------------------------------------------
def default_runs_dir() -> Path:
    return Path(os.environ.get("EVOMERGE_RUNS_DIR") or "runs")


@dataclass(frozen=True)
class SearchConfig:
    study: Study
    n_trials: int
    sampler: str = "tpe"
    storage: str = ""  # Optuna storage URL; default runs/<study>/optuna.db
    tracking_uri: str = ""  # MLflow; empty: $MLFLOW_TRACKING_URI, else runs/<study>/mlflow.db (tracking.resolve_tracking_uri)
    runs_dir: Path = Path("runs")
    jobs: int = 1
    seed: int = 0
    data_dir: str | None = None
    device: str | None = None
    cmaes_categoricals: str = "independent"
    cmaes_restarts: int = 0
    cmaes_popsize: int = 0
    prune: bool = True
    grace_period: int = GRACE_PERIOD  # seconds without a heartbeat before a running trial is failed and retried
    backend: str = "inprocess"  # how each trial's runs execute: backends.BACKENDS
    procs: int | None = None  # distributed backend: processes per run (default: one per worker)

    @property
    def study_dir(self) -> Path:
        return self.runs_dir / self.study.name

    @property
    def multi(self) -> bool:
        return len(self.study.objectives) > 1

    @property
    def default_store(self) -> bool:
        return self.storage == default_storage(self.study_dir)

    def make_sampler(self, worker: int = 0, resumed_at: int = 0):
        """The sampler of one search process. Its seed mixes the search seed, the worker and how many
        trials the study held when it started, so a resumed search does not replay earlier samples."""
        import numpy as np

        seed = int(np.random.SeedSequence([self.seed, worker, resumed_at]).generate_state(1)[0])
        return SAMPLERS[self.sampler].make(self, seed)

    def make_pruner(self):
        import optuna

        if not self.prune or self.multi or self.sampler == "cmaes":
            return optuna.pruners.NopPruner()  # multi-objective studies prune by search.trial.mo_should_prune
        first_round = max(1, self.study.run.rounds // 5)
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=first_round, n_min_trials=3)


# keyword -> default of make_config(), evomerge.search() and `evomerge search` (None: from the study / the environment)
DEFAULTS: dict[str, Any] = {"n_trials": None, "sampler": None, "storage": None, "tracking_uri": None, "runs_dir": None,
                            **{f.name: f.default for f in fields(SearchConfig)
                               if f.name not in ("study", "n_trials", "sampler", "storage", "tracking_uri", "runs_dir")}}


def make_config(study: Study, *, n_trials: int | None = None, sampler: str | None = None, storage: str | None = None,
                tracking_uri: str | None = None, runs_dir: str | Path | None = None, jobs: int = 1, seed: int = 0,
                data_dir=None, device=None, cmaes_categoricals: str = "independent", cmaes_restarts: int = 0,
                cmaes_popsize: int = 0, prune: bool = True, grace_period: int = GRACE_PERIOD,
                backend: str = "inprocess", procs: int | None = None) -> SearchConfig:
    """Validate everything a search needs before any trial runs."""
    from .. import backends
    from .. import space as space_mod

    sampler = sampler or study.search.sampler
    if sampler not in SAMPLERS:
        raise ConfigError("--sampler", f"unknown {sampler!r}; allowed: {', '.join(SAMPLERS)}")
    n_obj = len(study.objectives)
    if SAMPLERS[sampler].multi_objective == "required" and n_obj == 1:
        others = [n for n, s in SAMPLERS.items() if s.multi_objective != "required"]
        raise ConfigError("--sampler", f"{sampler} is for studies with several objectives; this study has one "
                                       f"({study.objectives[0]}); allowed: {', '.join(others)}")
    if SAMPLERS[sampler].multi_objective == "no" and n_obj > 1:
        raise ConfigError("--sampler", f"{sampler} optimises one objective; this study has {n_obj} "
                                       f"(use {', '.join(n for n, s in SAMPLERS.items() if s.multi_objective != 'no')})")
    n_trials = study.search.n_trials if n_trials is None else n_trials
    if n_trials < 1:
        raise ConfigError("--n-trials", f"{n_trials} is out of range; allowed: [1, inf)")
    if jobs < 1:
        raise ConfigError("--jobs", f"{jobs} is out of range; allowed: [1, inf)")
    if grace_period < 2:
        raise ConfigError("--grace-period", f"{grace_period} is out of range; allowed: [2, inf) seconds")
    if not study.search.space:
        raise ConfigError("study.search.space", "is empty: nothing to search")
    for o in study.objectives:
        if o not in OBJECTIVES:
            raise ConfigError("study.objectives.metrics", f"unknown {o!r}; allowed: {', '.join(OBJECTIVES)}")
    backends.check(backend, procs, study.run.workers)
    backends.check_policy(backend, study.policy)
    backends.check_space(backend, [p.name for p in study.search.space])
    if sampler == "cmaes":
        if not space_mod.numeric(study.search.space):
            raise ConfigError("--sampler", "cmaes needs at least one numeric field in study.search.space")
        if cmaes_categoricals not in CMAES_CATEGORICALS:
            raise ConfigError("--cmaes-categoricals", f"unknown {cmaes_categoricals!r}; allowed: {', '.join(CMAES_CATEGORICALS)}")
    runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir()
    study_dir = runs_dir / study.name
    return SearchConfig(study, n_trials, sampler, normalise_url(storage) if storage else default_storage(study_dir),
                        tracking_uri or "", runs_dir, jobs, seed,
                        str(data_dir) if data_dir else None, device, cmaes_categoricals, cmaes_restarts, cmaes_popsize, prune,
                        grace_period, backend, procs)
