"""What a search is: :class:`SearchConfig`, validated once by :func:`make_config` before any
trial runs, and the registries of samplers and objectives that outside code can extend.

The options and their defaults are one table, :mod:`.options`, which also makes ``evomerge.search()``'s keywords
and ``evomerge search``'s flags (``tests/test_search_config.py`` holds the three to one set of names and
defaults).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, unknown
from ..study import OBJECTIVES as _DIRECTIONS
from ..study import Study
from . import options as options_mod
from .options import DEFAULTS, GRACE_PERIOD  # noqa: F401
from .storage import HEARTBEAT_INTERVAL, NSGA_ATTR, default_storage, normalise_url  # noqa: F401

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


def nsga2_population(n_trials: int) -> int:
    """NSGA-II's generation size for a first search of ``n_trials`` (a third of them, 4 to 20); a study keeps its
    first NSGA-II search's (:data:`NSGA_ATTR`)."""
    return max(4, min(20, n_trials // 3))


def _nsga2(cfg, seed):
    import optuna

    return optuna.samplers.NSGAIISampler(seed=seed, population_size=cfg.nsga2_population or
                                         nsga2_population(cfg.n_trials))


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
    from one round's metrics (``engine.setup.RoundMetrics``) for pruning."""
    direction: str
    label: str
    from_round: Callable[[Any], float]
    unit: str = ""  # shown in tables' headers beside the direction: "time to target, s (min)"


OBJECTIVES: dict[str, Objective] = {
    "val_accuracy": Objective("maximize", "val acc", lambda m: m.val_accuracy),
    "mean_worker_accuracy": Objective("maximize", "mean worker acc", lambda m: m.mean_worker_accuracy),
    "bytes": Objective("minimize", "bytes", lambda m: float(m.bytes)),
    # simulated time ([environment]); time_to_target per round is what it would be if accuracy stalled there
    "time_to_target": Objective("minimize", "time to target", lambda m: m.time_to_target, "s"),
    "accuracy_at_time": Objective("maximize", "acc at time", lambda m: m.accuracy_at_time),
    "loss_at_time": Objective("minimize", "loss at time", lambda m: m.loss_at_time),
    "perplexity_at_time": Objective("minimize", "ppl at time", lambda m: m.perplexity_at_time),
    "sim_time": Objective("minimize", "sim time", lambda m: m.sim_time, "s"),
    "val_loss": Objective("minimize", "val loss", lambda m: m.val_loss),
    "val_perplexity": Objective("minimize", "val ppl", lambda m: m.val_perplexity),
}


@dataclass(frozen=True)
class Pruner:
    """A pruner by name. ``make(cfg, total_steps)`` returns the Optuna pruner of one search process;
    ``over``: "rounds" (every round reports the objective at its local step, ``k * total_steps + step``
    for seed k) or "seeds" (each seed reports its final objective once, at the seed as the step);
    ``min_seeds``: the seeds a trial must run for the pruner ever to prune."""
    make: Callable[[Any, int], Any]
    over: str = "rounds"
    min_seeds: int = 1
    note: str = ""


def warmup_step(cfg, total_steps: int) -> int:
    """The local step of the round that ends the first fifth of the rounds (at least the first round):
    no trial is pruned before it, and multi-fidelity pruners take it as their smallest budget."""
    from ..engine.setup import round_bounds

    bounds = round_bounds(total_steps, cfg.study.run.rounds)
    return bounds[min(len(bounds), max(1, cfg.study.run.rounds // 5)) - 1]


def _median(cfg, total_steps):
    import optuna

    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=warmup_step(cfg, total_steps), n_min_trials=3)


def _hyperband(cfg, total_steps):
    import optuna

    # the budget a trial may reach is every seed's run: seed k reports at k * total_steps + step
    return optuna.pruners.HyperbandPruner(min_resource=warmup_step(cfg, total_steps),
                                          max_resource=total_steps * len(cfg.study.run.seeds), reduction_factor=3)


def _successive_halving(cfg, total_steps):
    import optuna

    return optuna.pruners.SuccessiveHalvingPruner(min_resource=warmup_step(cfg, total_steps), reduction_factor=3,
                                                  min_early_stopping_rate=0)


def _wilcoxon(cfg, total_steps):
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=2)


PRUNERS: dict[str, Pruner] = {
    "median": Pruner(_median, note="stops a trial whose value at a round is worse than the median of earlier "
                                   "trials' at that round (after 5 trials and the first fifth of the rounds)"),
    "hyperband": Pruner(_hyperband, note="Hyperband over the rounds: brackets of successive halving, reduction factor 3"),
    "successive-halving": Pruner(_successive_halving, note="asynchronous successive halving over the rounds, "
                                                           "reduction factor 3"),
    # a one-sided Wilcoxon signed-rank test at p < 0.1 needs 4 paired seeds (the smallest p: 1/8 with 3, 1/16
    # with 4), and a trial is judged before its last seed: 5 seeds at least
    "wilcoxon": Pruner(_wilcoxon, over="seeds", min_seeds=5,
                       note="a Wilcoxon signed-rank test against the best trial, seed by seed (p < 0.1)"),
}


def register_sampler(name: str, sampler: Sampler) -> None:
    SAMPLERS[name] = sampler


def register_pruner(name: str, pruner: Pruner) -> None:
    """Add a pruner; ``--pruner NAME`` may then name it."""
    PRUNERS[name] = pruner


def register_objective(name: str, objective: Objective) -> None:
    """Add an objective; study files may then name it in ``[objectives] metrics``."""
    OBJECTIVES[name] = objective
    _DIRECTIONS[name] = objective.direction  # what study validation accepts


# -- the configuration ----------------------------------------------------------------------
def default_runs_dir() -> Path:
    return Path(os.environ.get("EVOMERGE_RUNS_DIR") or "runs")


@dataclass(frozen=True)
class SearchConfig:
    """A search as :func:`make_config` resolved it: every option of :mod:`.options` (what each means is there),
    with the study's and the environment's defaults filled in."""
    study: Study
    n_trials: int
    sampler: str
    storage: str  # Optuna storage URL; default runs/<study>/optuna.db
    tracking_uri: str  # MLflow; empty: $MLFLOW_TRACKING_URI, else runs/<study>/mlflow.db (tracking.resolve_tracking_uri)
    runs_dir: Path
    jobs: int
    batch: int
    seed: int
    reevaluate: int  # fresh seeds for the verdict (search/verdict.py); 0: the search's own
    verdict: bool  # end with the verdict
    baselines: bool  # end with the baselines on the study's seeds (the table, MLflow runs); off: no verdict either
    log_model: bool  # end by logging the best trial's consensus model to MLflow (report.tracking.Tracker.log_best)
    data_dir: str | None
    device: str | None
    prune: bool
    pruner: str  # PRUNERS; multi-objective studies are pruned by search.trial.mo_should_prune
    warm_start_from: str | None  # a study name in runs_dir, or STORAGE_URL#NAME (search.warmstart)
    cmaes_categoricals: str
    cmaes_restarts: int
    cmaes_popsize: int
    grace_period: int
    backend: str  # how each trial's runs execute: backends.BACKENDS
    procs: int | None
    nsga2_population: int = 0  # NSGA-II's generation size (a study keeps its first: search.storage); 0: from n_trials

    @property
    def study_dir(self) -> Path:
        return self.runs_dir / self.study.name

    @property
    def multi(self) -> bool:
        return len(self.study.objectives) > 1

    @property
    def default_store(self) -> bool:
        return self.storage == default_storage(self.study_dir)

    def make_sampler(self, worker: int = 0, resumed_at: int = 0, start: int = 0):
        """The sampler of one search process. Its seed mixes the search seed, the worker and how many
        trials the study held when it started, so a resumed search does not replay earlier samples; and
        ``start``, how many processes had started as this worker on the study as it stood (another machine
        sharing the study, started at the same moment: it drew the same trials)."""
        import numpy as np

        seed = int(np.random.SeedSequence([self.seed, worker, resumed_at, *([start] if start else [])])
                   .generate_state(1)[0])
        return SAMPLERS[self.sampler].make(self, seed)

    @property
    def prunes_by_optuna(self) -> bool:
        """Whether trials report to an Optuna pruner (one objective, pruning on, not CMA-ES, whose
        generations are judged on complete runs)."""
        return self.prune and not self.multi and self.sampler != "cmaes"

    @property
    def pruner_used(self) -> str:
        """What prunes this search's trials, as its MLflow parent run says: an Optuna pruner's name, ``dominated``
        (evomerge's rule for several objectives, whatever ``--pruner`` says), or ``none`` (``--no-prune``, CMA-ES)."""
        if not self.prune or self.sampler == "cmaes":
            return "none"
        return "dominated" if self.multi else self.pruner

    def make_pruner(self, total_steps: int | None = None):
        """The Optuna pruner of one search process; ``total_steps`` (one run's local steps) sets where
        it starts judging. Without it (a process that runs no trial) a pruner that never prunes."""
        import optuna

        if not self.prunes_by_optuna or total_steps is None:
            return optuna.pruners.NopPruner()  # multi-objective studies prune by search.trial.mo_should_prune
        return PRUNERS[self.pruner].make(self, total_steps)


def make_config(study: Study, **options) -> SearchConfig:
    """Validate everything a search needs before any trial runs. The keywords are the options of
    :mod:`.options` (``help(make_config)`` lists them with their defaults)."""
    from .. import backends
    from . import space as space_mod

    options_mod.check_keywords("make_config", options)
    opts = {**DEFAULTS, **options}
    n_trials, sampler, storage, tracking_uri, runs_dir = (opts[k] for k in ("n_trials", "sampler", "storage",
                                                                         "tracking_uri", "runs_dir"))
    jobs, batch, prune, pruner, backend, procs = (opts[k] for k in ("jobs", "batch", "prune", "pruner", "backend",
                                                                 "procs"))
    grace_period, warm_start_from, cmaes_categoricals = opts["grace_period"], opts["warm_start_from"], opts["cmaes_categoricals"]

    where = "--sampler" if sampler else "study.search.sampler"  # the field the user wrote it in
    sampler = sampler or study.search.sampler
    if sampler not in SAMPLERS:
        raise ConfigError(where, unknown(sampler, SAMPLERS))
    n_obj = len(study.objectives)
    if SAMPLERS[sampler].multi_objective == "required" and n_obj == 1:
        others = [n for n, s in SAMPLERS.items() if s.multi_objective != "required"]
        raise ConfigError(where, f"{sampler} is for studies with several objectives; this study has one "
                                       f"({study.objectives[0]}); allowed: {', '.join(others)}")
    if SAMPLERS[sampler].multi_objective == "no" and n_obj > 1:
        raise ConfigError(where, f"{sampler} optimises one objective; this study has {n_obj} "
                                       f"(use {', '.join(n for n, s in SAMPLERS.items() if s.multi_objective != 'no')})")
    n_trials = study.search.n_trials if n_trials is None else n_trials
    if n_trials < 1:
        raise ConfigError("--n-trials", f"{n_trials} is out of range; allowed: [1, inf)")
    if jobs < 1:
        raise ConfigError("--jobs", f"{jobs} is out of range; allowed: [1, inf)")
    if batch < 1:
        raise ConfigError("--batch", f"{batch} is out of range; allowed: [1, inf)")
    searched_run = [p.name for p in study.search.space if p.name.startswith("run.")]
    if batch > 1 and searched_run:
        raise ConfigError("--batch", f"{batch} trains trials as one population with one step size; "
                                     f"study.search.space.{searched_run[0]} gives each trial its own; allowed: 1")
    if batch > 1 and backend != "inprocess":
        raise ConfigError("--batch", f"{batch} trains trials as one population in one process; allowed with "
                                     f"--backend {backend}: 1 (or use --backend inprocess)")
    if opts["reevaluate"] is not None and opts["reevaluate"] < 0:
        raise ConfigError("--reevaluate", f"{opts['reevaluate']} is out of range; allowed: [0, inf) fresh seeds")
    if not opts["baselines"] and opts["reevaluate"] not in (0, None):
        raise ConfigError("--reevaluate", f"{opts['reevaluate']} given with --no-baselines, which runs no verdict on "
                                          "fresh seeds (it judges against the baselines); allowed: one of them")
    if not opts["verdict"] and opts["reevaluate"] not in (0, None):  # (None: not given)
        raise ConfigError("--reevaluate", f"{opts['reevaluate']} given with --no-verdict, which runs no verdict on "
                                          "fresh seeds; allowed: one of them")
    if not opts["baselines"]:  # nothing to judge the picks against
        opts["verdict"] = False
    if opts["cmaes_popsize"] < 0 or opts["cmaes_popsize"] == 1:
        raise ConfigError("--cmaes-popsize", f"{opts['cmaes_popsize']} is out of range; allowed: 0 (N with --batch N, "
                                             "else 4 + 3 ln d for d numeric fields) or [2, inf)")
    if opts["nsga2_population"] < 0 or opts["nsga2_population"] == 1:
        raise ConfigError("--nsga2-population", f"{opts['nsga2_population']} is out of range; allowed: 0 (a third of "
                                                "--n-trials, 4 to 20) or [2, inf)")
    if opts["nsga2_population"] and sampler != "nsga2":
        raise ConfigError("--nsga2-population", f"{opts['nsga2_population']} applies with --sampler nsga2; this "
                                                f"search's sampler is {sampler}; allowed: --sampler nsga2, or leave it out")
    if opts["cmaes_restarts"] < 0:
        raise ConfigError("--cmaes-restarts", f"{opts['cmaes_restarts']} is out of range; allowed: [0, inf) restarts")
    if grace_period < 2:
        raise ConfigError("--grace-period", f"{grace_period} is out of range; allowed: [2, inf) seconds")
    if not study.search.space:
        raise ConfigError("study.search.space", "is empty: nothing to search")
    for o in study.objectives:
        if o not in OBJECTIVES:
            raise ConfigError("study.objectives.metrics", unknown(o, OBJECTIVES))
    backends.check(backend, procs, study.run.workers)
    backends.check_policy(backend, study.policy)
    backends.check_space(backend, [p.name for p in study.search.space], study.search.space,
                         timed=study.environment is not None)
    if sampler == "cmaes":
        if not space_mod.numeric(study.search.space):
            raise ConfigError(where, "cmaes needs at least one numeric field in study.search.space")
        if cmaes_categoricals not in CMAES_CATEGORICALS:
            raise ConfigError("--cmaes-categoricals", unknown(cmaes_categoricals, CMAES_CATEGORICALS))
    check_pruner(pruner, sampler, study, prune)
    if sampler != "cmaes":  # (CMA-ES's own settings, taken without a word by another sampler)
        for key, off in (("cmaes_popsize", 0), ("cmaes_restarts", 0), ("cmaes_categoricals", "independent")):
            if opts[key] != off:
                raise ConfigError("--" + key.replace("_", "-"), f"{opts[key]!r} applies with --sampler cmaes; this "
                                                                f"search's sampler is {sampler}; allowed: --sampler cmaes, "
                                                                "or leave it out")
    runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir()
    study_dir = runs_dir / study.name
    if warm_start_from is not None:
        from .warmstart import check_source

        check_source(warm_start_from, study, runs_dir)
    opts["reevaluate"] = options_mod.REEVALUATE if opts["reevaluate"] is None else opts["reevaluate"]
    return SearchConfig(**{**opts, "study": study, "n_trials": n_trials, "sampler": sampler, "runs_dir": runs_dir,
                           "storage": normalise_url(storage) if storage else default_storage(study_dir),
                           "tracking_uri": tracking_uri or "", "data_dir": str(opts["data_dir"]) if opts["data_dir"] else None})


make_config.__signature__ = options_mod.signature(make_config)


def check_pruner(pruner: str, sampler: str, study: Study, prune: bool) -> None:
    """One line naming ``--pruner`` for a pruner that is unknown or cannot judge this search."""
    if pruner not in PRUNERS:
        raise ConfigError("--pruner", unknown(pruner, PRUNERS))
    if not prune and pruner != "median":  # (taken without a word, pruning nothing)
        raise ConfigError("--pruner", f"{pruner} given with --no-prune, which prunes nothing; allowed: one of them")
    if not prune or pruner == "median":  # the default: the dominance rule on several objectives, none for CMA-ES
        return
    if len(study.objectives) > 1:
        raise ConfigError("--pruner", f"{pruner} prunes studies with one objective; this study has {len(study.objectives)}, "
                                      "pruned by evomerge's dominance rule; allowed: median (the default), or --no-prune")
    if sampler == "cmaes":
        raise ConfigError("--pruner", "cmaes judges each generation on complete runs and prunes nothing; "
                                      "allowed with cmaes: median (the default, unused), or --no-prune")
    n_seeds = len(study.run.seeds)
    if n_seeds < PRUNERS[pruner].min_seeds:
        others = [n for n, p in PRUNERS.items() if p.min_seeds <= n_seeds]
        raise ConfigError("--pruner", f"{pruner} compares trials seed by seed and needs at least {PRUNERS[pruner].min_seeds} "
                                      f"seeds in run.seeds; this study runs {n_seeds}; allowed: {', '.join(others)}")
