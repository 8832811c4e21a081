"""Study files (TOML): the data, model, workers and budget a policy is judged on,
the policy's fixed values, the searched fields and the objectives.

``--study NAME`` is looked up as a path, then ``./studies/NAME.toml``, then the
studies shipped with evomerge.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from . import data as data_mod
from . import policy as policy_mod
from . import settings
from .errors import ConfigError, did_you_mean, unknown, unknown_key
from .policy import MergePolicy, field_specs
from .settings import Choice
from .userref import check_format

SPACE_KINDS = ("float", "log-float", "int", "categorical")
OPTIMIZERS = ("sgd", "adam", "adamw")  # engine.optim.OPTIMIZERS (without importing torch)
from .registry import MODELS as MODEL_NAMES  # noqa: E402  (names known without importing torch)
from .registry import shipped_studies_dir  # noqa: E402,F401  (where the shipped studies and policies are)
OBJECTIVES = {  # name -> direction
    "val_accuracy": "maximize",
    "mean_worker_accuracy": "maximize",
    "bytes": "minimize",
    "time_to_target": "minimize",  # simulated seconds to [objectives] target ([environment])
    "accuracy_at_time": "maximize",  # consensus validation accuracy at the time budget
    "loss_at_time": "minimize",  # consensus validation loss at the time budget (any task)
    "perplexity_at_time": "minimize",  # consensus validation perplexity at the time budget (a language model)
    "sim_time": "minimize",
    "val_loss": "minimize",  # the task's loss (run.loss) of the consensus model on the validation split
    "val_perplexity": "minimize",  # exp(token-weighted mean NLL): cross-entropy with labels per position
}
#: objectives measured on a simulated cluster's clock ([environment]); objectives that are accuracies (fractions)
TIMED_OBJECTIVES = ("time_to_target", "accuracy_at_time", "loss_at_time", "perplexity_at_time", "sim_time")
ACCURACY_OBJECTIVES = ("val_accuracy", "mean_worker_accuracy", "accuracy_at_time")
TARGET_METRICS = ("val_accuracy", "mean_worker_accuracy", "val_loss", "val_perplexity")  # time_to_target's
LOSS_NAMES = ("cross_entropy", "mse")  # task.LOSSES (without importing torch); or "module:function"
EXECUTIONS = ("auto", "stacked", "loop")  # models.generic.EXECUTIONS
# objectives that were, and why they are not any more (named in the error line)
RETIRED_OBJECTIVES = {
    "wall_time": "retired as an objective: it measures how fast this machine simulates, not how fast a cluster "
                 "trains (it is still reported); use time_to_target or accuracy_at_time with an [environment]",
}
SPEED_MODELS = ("equal", "lognormal", "pareto")
OVERLAPS = ("nonblocking", "blocking")
#: [environment] step_budget: "shared": the run's work is W x run.steps local steps, the faster workers doing more
#: of it (a fair budget for policies that let workers step at their own pace); "per_worker": every worker takes
#: run.steps local steps and then idles, as the ranks of a real job each take total_steps (run --against)
STEP_BUDGETS = ("shared", "per_worker")
DEFAULT_BASELINES = ("no-merging", "fedavg", "allreduce", "ring-gossip")


def _as_tuple(v: Any) -> Any:
    """TOML lists become tuples (the settings are frozen); anything else is left to the type check."""
    return tuple(v) if isinstance(v, list) else v


Seq = BeforeValidator(_as_tuple)


@settings.model("study.data")
class DataSpec:
    dataset: Annotated[str, Choice((*data_mod.DATASETS, "text"))] = "mnist"
    val_size: int = Field(5000, ge=1)
    train_size: int = Field(0, ge=0)  # 0 = every training sample left after the validation split
    partition: Annotated[str, Choice(data_mod.PARTITIONS)] = "dirichlet"
    alpha: float = Field(0.5, gt=0)
    seed: int = 0  # validation split and partition
    loader: str = ""  # "module:function" returning the user's data (data.load_user); replaces dataset
    # dataset "text" (evomerge.text): a byte-level language-modelling corpus
    path: str = ""  # a text file or a folder of them, relative to the study file
    sha256: str = ""  # the corpus's content hash (evomerge.text.digest); checked when given
    context: int = Field(64, ge=2)  # tokens per training window

    @model_validator(mode="after")
    def _text(self) -> "DataSpec":
        if self.dataset == "text" and not self.path:
            raise ConfigError("study.data.path", "is required by dataset 'text' (a text file or a folder of them, "
                                                 "relative to the study file)")
        if self.path and self.dataset != "text":
            raise ConfigError("study.data.path", f"applies to dataset 'text'; the study's dataset is {self.dataset!r}")
        return self


@settings.model("study.model")
class ModelSpec:
    name: Annotated[str, Choice(MODEL_NAMES)] = "mlp"
    options: dict = Field(default_factory=lambda: {"hidden": [128]})
    factory: str = ""  # "module:function" returning a torch.nn.Module (name "module"); options are its keywords
    execution: Annotated[str, Choice(EXECUTIONS)] = "auto"  # how W workers' steps run (models.generic)


@settings.model("study.run")
class RunSpec:
    workers: int = Field(8, ge=1)
    batch_size: int = Field(32, ge=1)
    epochs: float = 2.0  # budget in passes over the mean shard; converted to local steps
    steps: int = Field(0, ge=0)  # budget in local steps; overrides epochs when > 0
    lr: float = Field(0.05, ge=0)  # 0 freezes the models: a control run (merges alone, or the convergence stop)
    momentum: float = Field(0.0, ge=0, lt=1)  # sgd only
    weight_decay: float = Field(0.0, ge=0)  # sgd, adam: L2 in the gradient; adamw: decoupled
    rounds: int = Field(10, ge=1)
    seeds: Annotated[tuple[int, ...], Seq] = Field((0,), min_length=1)
    score_samples: int = Field(32, ge=1)  # per-worker validation slice for the winner-biased lerp
    eval_samples: int = Field(0, ge=0)  # validation samples for the per-worker accuracies (0 = all)
    optimizer: Annotated[str, Choice(OPTIMIZERS)] = "sgd"  # batched over workers (engine.optim)
    betas: Annotated[tuple[float, float], Seq] = (0.9, 0.999)  # adam, adamw
    eps: float = Field(1e-8, gt=0)  # adam, adamw
    loss: str = "cross_entropy"  # or "mse", or "module:function" giving per-example losses (evomerge.task)

    @model_validator(mode="after")
    def _a_budget(self) -> "RunSpec":
        if self.steps == 0 and not self.epochs > 0:
            raise ConfigError("study.run.epochs", f"{self.epochs} is out of range; allowed: (0, inf) when steps is 0")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError("study.run.momentum", f"{self.momentum} applies to optimizer 'sgd' only; Adam's "
                                                    "momentum is betas[0]; allowed: 0 with optimizer "
                                                    f"{self.optimizer!r}")
        if self.loss not in LOSS_NAMES:
            check_format(self.loss, "study.run.loss", "mylosses:huber", allowed=f"{', '.join(LOSS_NAMES)} or ")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("study.run.betas", f"{list(self.betas)} is out of range; allowed: two numbers in [0, 1)")
        return self


def _context(name: str) -> dict[str, Any]:
    """Other policy fields that make a single field's value meaningful (compression needs a delta payload)."""
    if name in policy_mod.COMPRESSION_OFF:
        return {"payload": "delta"}
    if name in policy_mod.REGROUP_OFF:
        return {"topology": "communities"}
    if name in policy_mod.DATA_TRAVEL_OFF:
        return {"data_exchange_k": 4}
    if name in policy_mod.SWAP_OFF:
        return {"swap_p": 0.5}
    if name == "backup_workers":
        return {"scheme": "allreduce", **policy_mod.BACKUP_NEEDS}
    if name == "outer_optimizer":
        return {"scheme": "allreduce", **policy_mod.OUTER_NEEDS}
    if name == "outer_every":  # SlowMo over a gossip base
        return {"scheme": "gossip", "outer_optimizer": "sgd"}
    if name in policy_mod.ASYNC_OFF:  # asynchronous DiLoCo's own fields
        return {"scheme": "async", "outer_optimizer": "nesterov", **policy_mod.OUTER_NEEDS, **policy_mod.STREAMING_NEEDS}
    if name in policy_mod.STREAMING_OFF:  # Streaming DiLoCo: the all-reduce scheme, far enough apart
        return {"scheme": "allreduce", **policy_mod.OUTER_NEEDS, **policy_mod.STREAMING_NEEDS, "mean_interval": 1e6}
    return {}


def _excluded(info) -> list:
    """Values inside a field's range that the field refuses (its JSON Schema's ``not: {const: ...}``)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return [extra["not"]["const"]] if "const" in extra.get("not", {}) else []


# run settings a search may tune with the policy, as namespaced keys of [search.space] ("run.lr")
RUN_PREFIX = "run."
RUN_SEARCHABLE = ("lr", "weight_decay")


FOUND_RUN_KEYS = ("optimizer", "lr", "weight_decay", "momentum", "betas", "eps")  # an export's "run"


def check_found_run(run: Any, where: str = "run") -> dict[str, Any]:
    """An exported file's ``run`` (the optimiser and step size its policy was found with), checked by the rules of a
    study's ``[run]``: one line naming ``run.<key>`` and what is allowed."""
    if not isinstance(run, dict):
        raise ConfigError(where, f"must be a table, got {type(run).__name__}")
    for k in run:
        if k not in FOUND_RUN_KEYS:
            raise ConfigError(f"{where}.{k}", unknown_key(str(k), FOUND_RUN_KEYS))
    try:
        RunSpec(**run)
    except ConfigError as e:
        raise ConfigError(e.field.replace("study.run", where, 1), e.message) from None
    return run


def with_run(study: "Study", values: dict[str, Any]) -> "Study":
    """``study`` with the ``[run]`` settings ``values`` (a trial's searched ``run.lr``), checked as the file's are."""
    if not values:
        return study
    return dataclasses.replace(study, run=dataclasses.replace(study.run, **values))


@settings.model(lambda kw: f"study.search.space.{kw.get('name')}")
class Param:
    """One searched policy field: its kind and range (or choices), checked against the policy model."""

    name: str
    kind: Annotated[str, Choice(SPACE_KINDS)]
    low: float | None = None
    high: float | None = None
    choices: Annotated[tuple, Seq] = ()

    @model_validator(mode="after")
    def _fits_the_field(self) -> "Param":
        where, specs = f"study.search.space.{self.name}", field_specs()
        if self.name.startswith(RUN_PREFIX):
            return self._fits_the_run()
        if self.name not in specs:
            run = [RUN_PREFIX + k for k in RUN_SEARCHABLE]
            raise ConfigError(where, f"unknown policy field; allowed: {', '.join(specs)}, or the run's "
                                     f"{', '.join(run)}" + did_you_mean(self.name, [*specs, *run]))
        meta = specs[self.name]
        if self.kind == "categorical":
            if not self.choices:
                raise ConfigError(f"{where}.choices", "must be a non-empty list")
            twice = next((c for i, c in enumerate(self.choices) if c in self.choices[:i]), None)
            if twice is not None:  # (it doubled the sampler's prior on that choice, in silence)
                raise ConfigError(f"{where}.choices", f"{twice!r} is listed twice; allowed: each choice once")
            for c in self.choices:
                try:
                    ctx = _context(self.name) if not (self.name == "scheme" and c == "async") else \
                        {"outer_optimizer": "nesterov", **policy_mod.OUTER_NEEDS, **policy_mod.STREAMING_NEEDS}
                    MergePolicy(**({self.name: c} | ctx))
                except ConfigError as e:
                    raise ConfigError(f"{where}.choices", e.message) from None
            return self
        if meta["kind"] not in ("int", "float") or (self.kind == "int") != (meta["kind"] == "int"):
            want = "categorical" if meta["kind"] in ("str", "choice") else ("int" if meta["kind"] == "int" else "float or log-float")
            raise ConfigError(f"{where}.kind", f"{self.kind!r} does not fit this field; allowed: {want}")
        if self.choices:
            raise ConfigError(f"{where}.choices", f"applies to kind 'categorical' only; this is {self.kind!r}")
        for key in ("low", "high"):
            v = getattr(self, key)
            if v is None:
                raise ConfigError(f"{where}.{key}", "is required")
            if self.kind == "int":
                if v != int(v):
                    raise ConfigError(f"{where}.{key}", f"must be an integer, got {v}")
                object.__setattr__(self, key, int(v))
        low, high = self.low, self.high
        if not low < high:
            raise ConfigError(where, f"impossible range [{low}, {high}]: low must be below high")
        if self.kind == "log-float" and low <= 0:
            raise ConfigError(f"{where}.low", f"{low}: a log-float range needs low > 0")
        info = MergePolicy.__pydantic_fields__[self.name]
        for v in (low, high):  # the ranges are intervals: both ends inside means every point inside
            try:
                ctx = _context(self.name) if v or self.name != "outer_every" else {}  # 0: SlowMo off, no context
                MergePolicy(**({self.name: int(v) if self.kind == "int" else v} | ctx))
            except ConfigError:
                raise ConfigError(where, f"[{low}, {high}] leaves the field's allowed range "
                                         f"{settings.range_text(info)}") from None
        for v in _excluded(info):
            if low <= v <= high:
                raise ConfigError(where, f"[{low}, {high}] includes {v}, which the field does not allow; "
                                         f"use a range without it or kind 'categorical'")
        return self

    def _fits_the_run(self) -> "Param":
        """A searched run setting (``run.lr``, ``run.weight_decay``): a float range inside the field's own."""
        where, key = f"study.search.space.{self.name}", self.name[len(RUN_PREFIX):]
        if key not in RUN_SEARCHABLE:
            raise ConfigError(where, f"the run's {key!r} cannot be searched; allowed: "
                                     f"{', '.join(RUN_PREFIX + k for k in RUN_SEARCHABLE)}")
        if self.kind not in ("float", "log-float"):
            raise ConfigError(f"{where}.kind", f"{self.kind!r} does not fit this field; allowed: float or log-float")
        for k in ("low", "high"):
            if getattr(self, k) is None:
                raise ConfigError(f"{where}.{k}", "is required")
        if self.choices:
            raise ConfigError(f"{where}.choices", f"applies to kind 'categorical' only; this is {self.kind!r}")
        if not self.low < self.high:
            raise ConfigError(where, f"impossible range [{self.low}, {self.high}]: low must be below high")
        if self.kind == "log-float" and self.low <= 0:
            raise ConfigError(f"{where}.low", f"{self.low}: a log-float range needs low > 0")
        if self.low < 0:
            raise ConfigError(where, f"[{self.low}, {self.high}] leaves the field's allowed range [0, inf)")
        return self


@settings.model("study.search")
class SearchSpec:
    sampler: str = "tpe"  # checked with --sampler by the search (search.config.SAMPLERS)
    n_trials: int = Field(30, ge=1)
    space: Annotated[tuple[Param, ...], Seq] = ()


def _speeds(v: Any) -> Any:
    """``[environment] speeds``: a speed model's name, or a list of per-worker speeds."""
    if isinstance(v, str) and v in SPEED_MODELS:
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return tuple(float(x) for x in v)
    raise settings.Invalid(f"{settings.show(v)} is not a speed model or a list of speeds; allowed: "
                           f"{', '.join(SPEED_MODELS)}, or one positive speed per worker")


@settings.model("study.environment")
class EnvSpec:
    """The simulated cluster (``[environment]``; see :mod:`evomerge.engine.clock`). Every draw comes from
    the run seed; absent, a run is the lockstep world of local steps, exactly."""

    step_time: float = Field(0.1, gt=0)  # simulated seconds per local step of a speed-1 worker
    speeds: Annotated[Any, BeforeValidator(_speeds)] = "equal"  # a model, or one speed per worker
    speeds_file: str = ""  # a text file of per-worker speeds (one per line; relative to the study file)
    sigma: float = Field(0.5, ge=0)  # lognormal speeds: exp(sigma * z)
    alpha: float = Field(2.0, gt=0)  # pareto: step-time multipliers 1 + Pareto(alpha)
    slow_workers: Annotated[tuple[int, ...], Seq] = ()  # these workers' step times are slow_factor times longer
    slow_factor: float = Field(4.0, ge=1)
    jitter: float = Field(0.0, ge=0)  # per-step lognormal noise on the step time (sigma)
    straggle_p: float = Field(0.0, ge=0, le=1)  # chance per step of entering a slow spell
    straggle_factor: float = Field(4.0, ge=1)
    straggle_length: float = Field(10.0, ge=1)  # mean length of a slow spell, in steps
    merge_time: float = Field(0.0, ge=0)  # a worker's own seconds at a step boundary where it merges (before its next step)
    latency: float = Field(0.0, ge=0)  # seconds per message on a link inside a site
    bandwidth: float = Field(0.0, ge=0)  # bytes per second on a link inside a site; 0 = unlimited
    sites: int = Field(1, ge=1)  # workers in contiguous sites (racks), as topology communities split them
    latency_inter: float | None = Field(None, ge=0)  # between sites (default: latency)
    bandwidth_inter: float | None = Field(None, ge=0)  # between sites (default: bandwidth); 0 = unlimited
    latency_matrix: Annotated[tuple[Annotated[tuple[float, ...], Seq], ...], Seq] = ()  # [W][W], overrides the above
    bandwidth_matrix: Annotated[tuple[Annotated[tuple[float, ...], Seq], ...], Seq] = ()
    overlap: Annotated[str, Choice(OVERLAPS)] = "nonblocking"  # blocking: the initiator pauses until its merge is done
    time_budget: float = Field(0.0, ge=0)  # simulated seconds; 0 = the work of the step budget (W x steps), however long
    step_budget: Annotated[str, Choice(STEP_BUDGETS)] = "shared"  # (STEP_BUDGETS) who takes the run's steps

    def check(self, workers: int, base: Path | None) -> "EnvSpec":
        """The checks that need the run's workers (and the study's folder for ``speeds_file``)."""
        where = "study.environment"
        if isinstance(self.speeds, tuple):
            if len(self.speeds) != workers:
                raise ConfigError(f"{where}.speeds", f"a list needs {workers} positive speeds (run.workers), "
                                                     f"got {len(self.speeds)}; or one of: {', '.join(SPEED_MODELS)}")
            bad = next((i for i, v in enumerate(self.speeds) if not 0 < v < float("inf")), None)
            if bad is not None:
                raise ConfigError(f"{where}.speeds[{bad}]", f"{self.speeds[bad]} is out of range; allowed: a speed > 0 "
                                                            "(1.0 = step_time per step)")
        if self.speeds_file:
            path = Path(self.speeds_file)
            path = path if path.is_absolute() or base is None else base / path
            try:
                values = tuple(float(x) for x in path.read_text(encoding="utf-8").split())
            except (OSError, ValueError) as e:
                raise ConfigError(f"{where}.speeds_file", f"{path}: cannot read speeds ({e})") from None
            if len(values) != workers:
                raise ConfigError(f"{where}.speeds_file", f"{path}: needs {workers} positive speeds, got {len(values)}")
            bad = next((i for i, v in enumerate(values) if not 0 < v < float("inf")), None)
            if bad is not None:
                raise ConfigError(f"{where}.speeds_file", f"{path}: speed {bad + 1} is {values[bad]}; allowed: speeds > 0")
            return dataclasses.replace(self, speeds=values, speeds_file="").check(workers, base)
        bad = [w for w in self.slow_workers if not 0 <= w < workers]
        if bad:
            raise ConfigError(f"{where}.slow_workers", f"{bad[0]} is not a worker; allowed: 0..{workers - 1}")
        if self.sites > workers:
            raise ConfigError(f"{where}.sites", f"{self.sites} is out of range; allowed: [1, {workers}] for {workers} workers")
        for key in ("latency_matrix", "bandwidth_matrix"):
            m = getattr(self, key)
            if m and (len(m) != workers or any(len(row) != workers for row in m)):
                lengths = sorted({len(row) for row in m})
                got = (f"{len(m)} x {lengths[0]}" if len(lengths) == 1 else
                       f"{len(m)} rows of {', '.join(map(str, lengths))} entries")
                raise ConfigError(f"{where}.{key}", f"must be {workers} x {workers} (run.workers), got {got}")
            if any(v < 0 for row in m for v in row):
                raise ConfigError(f"{where}.{key}", "entries must be >= 0")
        return self


@settings.model("study.study")
class _Meta:
    name: str = ""
    description: str = ""


def _not_retired(name: Any) -> Any:
    if isinstance(name, str) and name in RETIRED_OBJECTIVES:
        raise settings.Invalid(f"{name!r} is {RETIRED_OBJECTIVES[name]}")
    return name


@settings.model("study.objectives")
class _Objectives:
    metrics: Annotated[tuple[Annotated[str, BeforeValidator(_not_retired), Choice(OBJECTIVES)], ...], Seq] = \
        Field(("val_accuracy",), min_length=1)
    target: float | None = None  # the value of target_metric that time_to_target waits for
    target_metric: Annotated[str, Choice(TARGET_METRICS)] = "val_accuracy"

    @model_validator(mode="after")
    def _target_in_range(self) -> "_Objectives":
        """One range per metric, said the same way for a value below it and above it."""
        accuracy = self.target_metric.endswith("accuracy")
        if self.target is not None and not (0 <= self.target <= (1 if accuracy else float("inf"))):
            hint = (' (a perplexity or a loss to reach: target_metric = "val_perplexity" or "val_loss")'
                    if accuracy and self.target > 1 else "")  # (a language model's target 8 said nothing of how)
            raise ConfigError("study.objectives.target", f"{self.target} is out of range; allowed: "
                                                         f"{'[0, 1]' if accuracy else '[0, inf)'} for {self.target_metric}"
                                                         f"{hint}")
        return self

    @model_validator(mode="after")
    def _distinct(self) -> "_Objectives":
        if len(set(self.metrics)) != len(self.metrics):
            twice = next(m for m in self.metrics if self.metrics.count(m) > 1)
            raise ConfigError("study.objectives.metrics", f"lists {twice!r} more than once; allowed: one or more "
                                                          "distinct metrics")
        return self


BASELINE_LRS = "distinct step sizes > 0, e.g. [0.025, 0.05, 0.1, 0.2] (each baseline runs at its best)"


def _step_sizes(v: Any) -> Any:
    """``[baselines] lr``: a list of distinct step sizes > 0 (a number alone, or a word in it, said so)."""
    def step(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

    ok = isinstance(v, (list, tuple)) and all(step(x) for x in v)
    if not ok or len(set(v)) != len(v):
        shown = settings.show(list(v) if isinstance(v, tuple) else v)
        if isinstance(v, (list, tuple)):  # the element at fault, in a list of several (it named the list alone)
            bad = next((x for x in v if not step(x)), None)
            twice = next((x for i, x in enumerate(v) if x in v[:i]), None) if bad is None else None
            if bad is not None:
                shown += f": {settings.show(bad)} is not a step size > 0"
            elif twice is not None:
                shown += f": {twice!r} is listed twice"
        raise settings.Invalid(f"{shown}; allowed: {BASELINE_LRS}")
    return tuple(float(x) for x in v)


@settings.model("study.baselines")
class _Baselines:
    policies: Annotated[tuple[str, ...], Seq] = DEFAULT_BASELINES
    # the step sizes each baseline is tried at on the study's seeds; it is compared at its best (empty: run.lr)
    lr: Annotated[Any, BeforeValidator(_step_sizes)] = ()


@settings.model("study")
class Study:
    name: str
    description: str = ""
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    run: RunSpec = RunSpec()
    policy: MergePolicy = MergePolicy()
    search: SearchSpec = SearchSpec()
    objectives: Annotated[tuple[Annotated[str, Choice(OBJECTIVES)], ...], Seq] = ("val_accuracy",)
    environment: EnvSpec | None = None  # None: the lockstep world of local steps
    target: float | None = None  # [objectives] target: the value of target_metric time_to_target waits for
    target_metric: str = "val_accuracy"  # [objectives] target_metric (minimised metrics: reached at or below)
    baselines: Annotated[tuple[str, ...], Seq] = DEFAULT_BASELINES
    baseline_lr: Annotated[tuple[float, ...], Seq] = ()  # [baselines] lr: the step sizes each baseline is tuned over
    path: Path | None = None
    # what loading changed so that every point of the space can run on these workers (see fit_to_workers)
    notes: Annotated[tuple[str, ...], Seq] = ()
    # the cluster file (environment.from) and the bytes of the model evomerge calibrate timed for it, where it says
    calibrated_model: tuple[str, int] | None = None
    # environment.from as the study wrote it, and the keys the study set beside it (every other key is the file's)
    environment_from: tuple[str, tuple[str, ...]] | None = None

    def model_note(self, model) -> str | None:
        """A note when the cluster file timed another model than this study's ``model`` (its float32 parameters
        and buffers counted, as ``evomerge calibrate`` counts them): its step times are another model's. None
        when the cluster file says nothing of its model, or timed one of the same size."""
        if self.calibrated_model is None:
            return None
        from .models import float32_bytes, module_float32_bytes

        nbytes = float32_bytes(model)
        path, timed = self.calibrated_model
        if timed in (nbytes, module_float32_bytes(model.module(), every_buffer=True)):  # (a file of an evomerge that
            return None                                                          # counted a causal mask too)
        return (f"study.environment.from: {path} timed steps of a model of {timed:,} bytes; this study's model has "
                f"{nbytes:,} bytes: its step times are another model's (calibrate with this study)")

    def setup_notes(self, model, total_steps: int) -> list[str]:
        """What a run or search says once its model and step budget are known: :meth:`model_note` and
        :meth:`budget_note`, those that apply."""
        return [n for n in (self.model_note(model), self.budget_note(total_steps)) if n]

    def interval_note(self, total_steps: int) -> str | None:
        """A note when the searched ``mean_interval`` reaches past the local steps a worker takes: the run's
        ``total_steps``, or on a time budget those a worker at ``step_time`` takes in it (with its slow spells and
        jitter): a policy there merges never (every round(mean_interval) steps) or seldom (gossip's random
        intervals), and its trial runs much as no merging does. None where no searched interval is past them."""
        p = next((p for p in self.search.space if p.name == "mean_interval"), None)
        if p is None:
            return None
        env = self.environment
        steps, them = total_steps, f"the run's {total_steps:,} local steps a worker"
        remedy = "raise study.run.steps (or epochs)"
        if env is not None and env.time_budget and env.step_budget != "per_worker":
            steps = int(env.time_budget / self._mean_step())  # (the time budget ends the run, not run.steps)
            them = (f"the {steps:,} local steps a worker at step_time {env.step_time:.3g} s takes in "
                    f"study.environment.time_budget {env.time_budget:g} s")
            remedy = "raise the time budget"
        values = list(p.choices) if p.kind == "categorical" else [p.low, p.high]
        past = [v for v in values if round(float(v)) > steps]
        if not past:
            return None
        given = f"{list(p.choices)}" if p.kind == "categorical" else f"[{p.low:g}, {p.high:g}]"
        every = len(past) == len(values) if p.kind == "categorical" else round(float(p.low)) > steps
        how = ("merges never (every round(mean_interval) steps) or seldom (gossip's random intervals), and runs "
               "much as no-merging does")
        if every:
            return (f"study.search.space.mean_interval: {given} is past {them}: every policy it gives {how}; lower "
                    f"the range, or {remedy}")
        return (f"study.search.space.mean_interval: {given} reaches past {them}: a policy with mean_interval above "
                f"{steps:,} {how}")

    def _mean_step(self) -> float:
        """A speed-1 worker's mean step on the simulated cluster: step_time, times the slow spells' share (a
        two-state chain: a step is in a spell with the chain's stationary chance p L / (1 + p L)) and the jitter's
        mean (a lognormal's)."""
        env = self.environment
        pl = env.straggle_p * env.straggle_length
        return env.step_time * (1 + pl / (1 + pl) * (env.straggle_factor - 1)) * math.exp(env.jitter ** 2 / 2)

    def budget_note(self, total_steps: int) -> str | None:
        """A note when ``[environment] time_budget`` gives a worker at ``step_time`` more than 10x the study's step
        budget (``total_steps``): every run simulates those steps, each a real step of the model (a budget written
        for a slower device, or 600 s beside a calibrated step of half a millisecond: a million steps a run)."""
        env = self.environment
        if env is None or not env.time_budget or env.step_budget == "per_worker":  # (there each stops at its steps)
            return None
        # a speed-1 worker's mean step, so that the estimate is of the steps the run takes (it said 2,873 where a
        # run with slow spells took 500)
        mean_step = self._mean_step()
        slowed = mean_step > env.step_time * 1.001
        steps = env.time_budget / mean_step
        if env.time_budget / env.step_time < 1:  # (a run said its slowest worker did 0 steps "and the others waited for it")
            return (f"study.environment.time_budget: {env.time_budget:g} s is shorter than one local step of a worker "
                    f"at step_time {env.step_time:.3g} s: a worker of speed 1 trains no step in it")
        if steps <= 10 * total_steps:
            return None
        return (f"study.environment.time_budget: {env.time_budget:g} s is about {steps:,.0f} local steps of a worker "
                f"at step_time {env.step_time:.3g} s{' with its slow spells and jitter' if slowed else ''}, "
                f"{steps / total_steps:,.0f}x the study's step budget "
                f"({total_steps:,} steps), and every run takes them; {total_steps * env.step_time:.3g} s is the step "
                "budget's time")

    @model_validator(mode="after")
    def _space_fits_the_policy(self) -> "Study":
        names = {p.name for p in self.search.space}
        if names & set(policy_mod.COMPRESSION_OFF) and "payload" not in names and self.policy.payload != "delta":
            raise ConfigError("study.search.space", "searching topk_fraction or quantize_bits needs payload 'delta' "
                                                    "in [policy] or payload in the space")
        return self

    @model_validator(mode="after")
    def _async_needs_a_clock(self) -> "Study":
        if self.environment is None:
            if self.policy.scheme == "async":
                raise ConfigError("study.policy.scheme", policy_mod.ASYNC_NEEDS_CLOCK)
            for p in self.search.space:
                if p.name == "scheme" and "async" in p.choices:
                    raise ConfigError("study.search.space.scheme", policy_mod.ASYNC_NEEDS_CLOCK)
        return self

    @model_validator(mode="after")
    def _time_objectives(self) -> "Study":
        timed = set(TIMED_OBJECTIVES) & set(self.objectives)
        if timed and self.environment is None:
            raise ConfigError("study.objectives.metrics", f"{sorted(timed)[0]} needs an [environment] "
                                                          "(the simulated cluster whose time it measures)")
        if "time_to_target" in self.objectives and self.target is None:
            raise ConfigError("study.objectives.target", "is required by time_to_target; allowed: [0, 1]")
        if "time_to_target" in self.objectives and not self.environment.time_budget:
            raise ConfigError("study.environment.time_budget", "is required by time_to_target (every policy gets the "
                                                               "same clock to reach the target in); allowed: > 0 seconds")
        if self.environment is not None:  # what the simulated clock cannot run yet, found before any trial
            policy_mod.check_timed(self.policy, "study.policy")
            for p in self.search.space:
                if p.name in policy_mod.TIMED_UNSUPPORTED:
                    raise ConfigError(f"study.search.space.{p.name}", f"cannot be searched with an [environment]: "
                                                                      f"{policy_mod.TIMED_UNSUPPORTED[p.name]}")
        return self

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o] for o in self.objectives]

    def policies_dir(self) -> Path:
        """Where this study's named policies (baselines) live: ``policies/`` beside the study file."""
        base = self.path.parent if self.path else shipped_studies_dir()
        return base / "policies"

    def policy_dirs(self) -> list[Path]:
        """Where named policies are looked up: the study's own ``policies/``, then the shipped ones."""
        dirs = [self.policies_dir(), shipped_studies_dir() / "policies"]
        return [d for i, d in enumerate(dirs) if d.resolve() not in {x.resolve() for x in dirs[:i]}]

    def named_policies(self) -> list[str]:
        return sorted({f.stem for d in self.policy_dirs() if d.is_dir() for f in d.glob("*.json")})

    def resolve_policy(self, ref: str | Path, where: str = "--policy") -> MergePolicy:
        """A policy from a file path, or by name from the study's policies folder, else the shipped ones
        (so a study copied elsewhere still finds ``no-merging``, ``fedavg``, ...)."""
        def load(path: Path) -> MergePolicy:
            try:
                return MergePolicy.load(path)
            except ConfigError as e:  # a bad file in [baselines]: named with the field that lists it
                if where == "--policy" and e.field != str(path):  # a field of the policy: named as it is
                    raise
                if where == "--policy":  # the file itself (not JSON, empty): named with the option that gave it
                    hint = ("; allowed: a policy JSON file, an exported file or a named policy (this looks like a "
                            "study file: that is --study)") if path.suffix == ".toml" else ""
                    raise ConfigError(where, f"{e}{hint}") from None
                raise ConfigError(where, f"{ref}: {e}") from None

        p = Path(ref)
        if p.is_file():
            return load(p)
        for d in self.policy_dirs():
            if (d / f"{ref}.json").is_file():
                return load(d / f"{ref}.json")
        from .policy import policy_hint

        named = self.named_policies()
        raise ConfigError(where, f"{ref}: no such file or named policy; named: {', '.join(named) or 'none'}"
                                 + policy_hint(ref, named))

    def with_overrides(self, **run_changes: Any) -> "Study":
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **run_changes))


def fit_to_workers(policy: MergePolicy, space: tuple[Param, ...], workers: int):
    """Resolve the corners of the space that ``workers`` make impossible (issue: ``degree`` >= workers,
    more communities than workers), before any trial runs.

    The rule: a fixed ``degree`` / ``n_communities`` the workers cannot have is moved to the nearest
    possible value, and a searched range is clamped to the possible values; each change is a note.
    A searched range with no possible value at all is refused in one line. (Every sampled point then
    passes :func:`policy.fit_to_workers` as well, which settles the parity of ``degree`` for an odd
    number of workers.) Returns (policy, space, notes).
    """
    topo = next((p for p in space if p.name == "topology"), None)
    topologies = set(topo.choices) if topo else {policy.topology}
    notes, changes, out = [], {}, []
    for p in space:
        fit = policy_mod.WORKER_BOUND.get(p.name)
        if fit is None:
            out.append(p)
        elif p.kind == "categorical":
            kept = tuple(dict.fromkeys(fit(c, workers) for c in p.choices))
            out.append(Param(p.name, p.kind, choices=kept) if kept != p.choices else p)
            if kept != p.choices:
                notes.append(f"study.search.space.{p.name}: choices {list(p.choices)} -> {list(kept)} for {workers} workers")
        else:
            cap = fit(10**9, workers)  # the largest possible value
            if p.low > cap:
                raise ConfigError(f"study.search.space.{p.name}", f"[{p.low}, {p.high}] is impossible with {workers} "
                                                                 f"workers; allowed: at most {cap}")
            if p.high <= cap:
                out.append(p)
            elif cap > p.low:
                out.append(dataclasses.replace(p, high=cap))
                notes.append(f"study.search.space.{p.name}: [{p.low}, {p.high}] -> [{p.low}, {cap}] for {workers} workers")
            else:
                changes[p.name] = cap
                notes.append(f"study.search.space.{p.name}: [{p.low}, {p.high}] -> fixed at {cap} for {workers} workers")
    searched = {p.name for p in out}
    for name, fit in policy_mod.WORKER_BOUND.items():
        value = getattr(policy, name)
        if name not in searched and name not in changes and fit(value, workers) != value \
                and policy_mod.TOPOLOGY_OF[name] in topologies:
            changes[name] = fit(value, workers)
            default = " (the default)" if value == policy_mod.MergePolicy.__pydantic_fields__[name].default else ""
            notes.append(f"study.policy.{name}: {value}{default} is impossible with {workers} workers; using "
                         f"{changes[name]}")
    return (policy.replace(**changes) if changes else policy), tuple(out), tuple(notes)


# -- loading -------------------------------------------------------------------
def known_studies() -> list[str]:
    """The study names found by name: ./studies/*.toml and the shipped ones, less the cluster files there (what
    ``evomerge calibrate`` writes, which a study reads with ``[environment] from``)."""
    return sorted({f.stem for b in (Path.cwd() / "studies", shipped_studies_dir()) if b.is_dir()
                   for f in b.glob("*.toml") if not _cluster_file(f)})


def _cluster_file(path: Path) -> bool:
    """Whether ``path`` holds only an ``[environment]`` table (a cluster, not a study); a file that cannot be read
    is left to the study that names it."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return set(raw) == {"environment"} and isinstance(raw["environment"], dict) and "from" not in raw["environment"]


def names_a_file(ref) -> bool:
    """``--study``'s value names a file (whose own error a failed load is), not a study by name: a .toml, a file, or
    a path with a folder in it (``./seq.tom``: no study's name has a slash)."""
    text = str(ref)
    return text.endswith(".toml") or "/" in text or os.sep in text or Path(text).is_file()


def find(ref: str | Path) -> Path:
    p = Path(ref)
    if names_a_file(ref):
        if p.is_file():
            return p
        near = p.with_suffix(".toml") if p.name and p.suffix != ".toml" and p.with_suffix(".toml").is_file() else None
        raise ConfigError("--study", f"{ref}: no such file" + (f"; did you mean {near}?" if near else ""))
    for base in (Path.cwd() / "studies", shipped_studies_dir()):
        if (base / f"{ref}.toml").is_file():
            return base / f"{ref}.toml"
    known = known_studies()
    raise ConfigError("--study", f"unknown study {str(ref)!r}; known: {', '.join(known) or 'none'} "
                                 "(or give a path to a .toml file)" + study_hint(str(ref), known))


def study_hint(ref: str, names) -> str:
    """``; did you mean X?`` for an unknown study: ``REF.toml`` where the command runs (what was meant, most
    likely), else the nearest of ``names``; else nothing."""
    here = Path(f"{ref}.toml")
    return f"; did you mean {here}?" if here.is_file() else did_you_mean(ref, names)


def load(ref: str | Path, calibrating: bool = False) -> Study:
    """The study ``ref`` names (a file, or a shipped study's name). ``calibrating``: the study ``evomerge calibrate``
    times, whose ``[environment] from`` file calibrate (re)writes: it is not read (it may not exist yet, or be stale);
    the keys beside ``from`` alone."""
    path = find(ref)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), f"cannot read: {e}") from None
    if not text.strip():
        raise ConfigError(str(path), "empty file; expected a TOML study")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"invalid TOML: {e}{_toml_line(text, e)}") from None
    if _cluster_file(path):  # what evomerge calibrate writes: a cluster, not a study of the defaults on it
        raise ConfigError(str(path), "holds only an [environment] table: a cluster (as evomerge calibrate writes), not a "
                                     f"study; a study reads it with [environment] from = \"{path.name}\"")
    env = raw.get("environment")
    if isinstance(env, dict) and "speeds" in env and "speeds_file" in env:  # before the file is read: it is not used
        raise ConfigError("study.environment.speeds_file", "gives the speeds, and so does speeds; allowed: one of them")
    try:
        s = from_dict(raw, path=path, default_name=path.stem, calibrating=calibrating)
    except ConfigError:
        if not calibrating or "environment" in raw:
            raise
        # no cluster yet (the file calibrate writes is what it will read): a study that needs one (scheme async, time
        # objectives) is read as on one, for the model, data and batch calibrate times (it was refused); one that
        # fails for another reason says that reason
        try:
            s = from_dict(raw | {"environment": {"time_budget": 1.0}}, path=path, default_name=path.stem,
                          calibrating=True)  # (a budget: time_to_target's check; calibrate runs none)
        except ConfigError:
            pass
        else:
            return s
        raise
    _check_used(raw, s.environment)
    if not calibrating:  # (calibrate reads a study without its cluster as on one: its target is the search's)
        _check_target_used(raw, s)
    return s


_TOP = ("study", "data", "model", "run", "policy", "search", "objectives", "baselines", "environment")


def _toml_line(text: str, e: Exception) -> str:
    """The line a TOML error points at (``: line 31 reads 'speeds = [1, 2]'``), which names the key (a second
    ``speeds`` was "Cannot overwrite a value (at line 31, column 12)", no key named)."""
    import re

    m = re.search(r"at line (\d+), column \d+", str(e))
    lines = text.splitlines()
    if not m or not 1 <= int(m[1]) <= len(lines) or not lines[int(m[1]) - 1].strip():
        return ""
    line = lines[int(m[1]) - 1].strip()
    return f": line {m[1]} reads {line[:80] + ('...' if len(line) > 80 else '')!r}"


def _fixed_policy(raw: dict) -> MergePolicy:
    """``[policy]``, the fields every trial shares. One that needs a field the search draws (SlowMo's
    ``outer_optimizer`` over gossip needs ``outer_every``, searched) takes the field's first value there (its
    ``low``, or its first choice) to be checked: each trial's own value replaces it (it was refused, naming the field
    as though it were not searched)."""
    fixed = dict(_table(raw, "policy"))
    space = _table(raw, "search").get("space", {})
    space = space if isinstance(space, dict) else {}
    filled: set[str] = set()
    for _ in range(len(space) + 1):
        try:
            return MergePolicy.from_dict(fixed, "study.policy")
        except ConfigError as e:
            name = e.field.removeprefix("study.policy.")
            if name in filled:  # the search's own first value refused: said of the space, not as the user's [policy]
                raise ConfigError(f"study.search.space.{name}", f"its first value {fixed[name]!r}, taken to check "
                                                                f"[policy]: {e.message}") from None
            spec = space.get(name)
            first = (spec.get("low", (spec.get("choices") or [None])[0]) if isinstance(spec, dict) else None)
            if name in fixed or first is None:
                raise
            fixed[name] = first
            filled.add(name)
    return MergePolicy.from_dict(fixed, "study.policy")


def from_dict(raw: dict, path: Path | None = None, default_name: str = "study", calibrating: bool = False) -> Study:
    """A study from its TOML tables; every setting is checked here, before any data is read."""
    _no_unknown(raw, _TOP, "study")
    meta = settings.build(_Meta, _table(raw, "study"), "study.study")
    d = _data(_table(raw, "data"))
    model = _model(dict(_table(raw, "model")))
    r = settings.build(RunSpec, _table(raw, "run"), "study.run")
    policy = _fixed_policy(raw)

    s = dict(_table(raw, "search"))
    space_raw = s.pop("space", {})
    if not isinstance(space_raw, dict):
        raise ConfigError("study.search.space", f"must be a table, got {type(space_raw).__name__}")
    params = []
    nested = space_raw.get(RUN_PREFIX[:-1])  # TOML reads the dotted key run.lr = {...} as a table "run"
    if isinstance(nested, dict) and "kind" not in nested:
        space_raw = {k: v for k, v in space_raw.items() if k != RUN_PREFIX[:-1]} | \
            {RUN_PREFIX + k: v for k, v in nested.items()}
    for name, spec in space_raw.items():
        where = f"study.search.space.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(where, f"must be a table like {{ kind = \"float\", low = 0.1, high = 1.0 }}, "
                                     f"got {type(spec).__name__}")
        _no_unknown(spec, [k for k in Param.__pydantic_fields__ if k != "name"], where)
        if "kind" not in spec:
            raise ConfigError(f"{where}.kind", f"is required; allowed: {', '.join(SPACE_KINDS)}")
        params.append(Param(name=name, **spec))
    policy, space, notes = fit_to_workers(policy, tuple(params), r.workers)
    from .policy import inert_fields

    for name, value in inert_fields(space, policy).items():  # (TPE spent a dimension on it; Optuna showed the
        # sampled value, the policy, MLflow and the export the switched-off one, with no word)
        notes += (f"study.search.space.{name}: never takes effect: every policy the space gives has {name} "
                  f"{value!r} (it does not apply with [policy]'s fields and the other searched ones); the search "
                  "spends a dimension on it",)
    if model.factory and not {"dataset", "loader"} & set(_table(raw, "data")):  # (a forgotten loader: MNIST's
        # download error, or the user's model refusing [B, 28, 28] inputs, said nothing of why MNIST)
        notes += (f"study.data: names no dataset or loader, so your model ({model.factory}) trains on mnist, the "
                  "default; your own data: [data] loader = \"module:function\" (or dataset = \"mnist\" to say it)",)
    search = settings.build(SearchSpec, s, "study.search")
    search = dataclasses.replace(search, space=space)

    objectives = dict(_table(raw, "objectives"))
    if "target" in objectives and "target_metric" not in objectives and r.loss != "cross_entropy":
        objectives["target_metric"] = "val_loss"  # (a regression has no accuracy to reach: its loss is the target's)
    obj = settings.build(_Objectives, objectives, "study.objectives")
    env, calibrated, env_from = None, None, None
    if "environment" in raw:
        env, measured, calibrated, env_from = _environment(_table(raw, "environment"), r,
                                                           path.parent if path else None, calibrating)
        notes += measured
    bases = settings.build(_Baselines, _table(raw, "baselines"), "study.baselines")
    baselines = bases.policies
    study = Study(name=meta.name or default_name, description=meta.description, data=d, model=model, run=r,
                  policy=policy, search=search, objectives=obj.metrics, environment=env, target=obj.target,
                  target_metric=obj.target_metric,
                  baselines=baselines, baseline_lr=bases.lr, path=path, notes=notes, calibrated_model=calibrated,
                  environment_from=env_from)
    for ref in study.baselines:  # found now, not after the search's trials have run
        pol = study.resolve_policy(ref, where="study.baselines.policies")
        if pol.scheme == "async" and env is None:
            raise ConfigError("study.baselines.policies", f"{ref}: {policy_mod.ASYNC_NEEDS_CLOCK}")
        try:
            policy_mod.check_workers(pol, r.workers)
        except ConfigError as e:  # a study copied with fewer workers than a baseline it names needs
            raise ConfigError("study.baselines.policies", f"{ref} cannot run on {r.workers} workers ({e}); allowed: "
                                                          "policies that can, or more run.workers") from None
    return study


def _environment(table: dict, run: RunSpec, base: Path | None, calibrating: bool = False) \
        -> tuple[EnvSpec, tuple[str, ...], tuple[str, int] | None, tuple[str, tuple[str, ...]] | None]:
    """``[environment]``, or with ``from = "cluster.toml"`` (relative to the study file) the keys of that file
    (``evomerge calibrate`` writes it) with the keys beside ``from`` overriding them; ``calibrating``: the keys beside
    ``from`` alone. With the notes on the file (measured with another batch size or optimiser than the study's), and
    the file with the bytes of the model it timed, where it says (``Study.calibrated_model``), and ``from`` with the
    keys set beside it (``Study.environment_from``)."""
    workers = run.workers
    from .errors import unknown_key

    for k in table:  # 'from' is a key here too, not a field of EnvSpec: the list of allowed keys names it
        if k != "from" and k not in EnvSpec.__pydantic_fields__:
            raise ConfigError(f"study.environment.{k}", unknown_key(k, [*EnvSpec.__pydantic_fields__, "from"]))
    if "from" not in table:
        return settings.build(EnvSpec, table, "study.environment").check(workers, base), (), None, None
    ref, where = table["from"], "study.environment.from"
    if not isinstance(ref, str) or not ref:
        raise ConfigError(where, f"must be a path to a TOML file (e.g. \"cluster.toml\"), got {settings.show(ref)}")
    path = Path(ref).expanduser()
    path = path if path.is_absolute() or base is None else base / path
    own = {k: v for k, v in table.items() if k != "from"}
    if calibrating:  # the file calibrate (re)writes: missing, stale or broken, it is not read
        return settings.build(EnvSpec, own, "study.environment").check(workers, base), (), None, None
    try:
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(where, f"{path}: no such file (write one with evomerge calibrate)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(where, f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(where, f"{path}: invalid TOML: {e}") from None
    keys = raw.get("environment", raw) if set(raw) <= {"environment"} else raw
    tables = [k for k, v in raw.items() if isinstance(v, dict)]
    if tables and "environment" not in raw:  # (a [cluster] table was "unknown key 'cluster'; allowed: step_time, ...")
        raise ConfigError(where, f"{path}: holds a [{tables[0]}] table; expected an [environment] table (as evomerge "
                                 "calibrate writes it), or the environment's keys alone")
    if not isinstance(keys, dict) or not keys:
        raise ConfigError(where, f"{path}: no environment keys; expected an [environment] table")
    if "from" in keys:
        raise ConfigError(where, f"{path}: has a 'from' of its own; allowed: the environment's keys")
    for k in keys:
        if k not in EnvSpec.__pydantic_fields__:
            raise ConfigError(where, f"{path}: " + unknown(k, EnvSpec.__pydantic_fields__, noun="key"))
    # a key beside `from` wins over the file's way of giving the same thing: one bandwidth or latency for every link
    # over the file's measured matrix, speeds over its speeds_file and the other way round (a new user's
    # `bandwidth = 1e6` beside a calibrated file was "overridden by bandwidth_matrix: it would be ignored")
    for mine, theirs in FROM_REPLACES:
        if mine in own and theirs in keys and theirs not in own:
            keys = {k: v for k, v in keys.items() if k != theirs}
    if isinstance(keys.get("speeds_file"), str) and not Path(keys["speeds_file"]).is_absolute():
        # beside the file that names it (absolute: check() joins a relative one to the study's folder again, and a
        # study given as b/s.toml read b/b/speeds.txt)
        keys = keys | {"speeds_file": str((path.parent / keys["speeds_file"]).absolute())}
    try:
        spec = settings.build(EnvSpec, keys | own, "study.environment").check(workers, base)
    except ConfigError as e:
        key = re.split(r"[.\[]", e.field.removeprefix("study.environment."))[0]  # (speeds[0]: the key speeds)
        if key not in keys or key in own:
            raise
        hint = ""
        if key in ("speeds", "latency_matrix", "bandwidth_matrix") and isinstance(keys[key], list) and \
                len(keys[key]) != workers:  # measured on another number of ranks (not a malformed entry)
            ranks = len(keys[key])
            said = re.search(r"^# evomerge calibrate [^\n]*?: (\d+) ranks?,", text, re.MULTILINE)
            if said is None or int(said[1]) == ranks:
                hint = f", measured on {ranks} rank{'s' * (ranks != 1)}"
            else:  # edited since: the header's count is what was measured (it said the list's length)
                hint = f", whose {key} holds {ranks}, though it says it measured {said[1]} ranks"
            hint += f"; for {workers} workers write it with evomerge calibrate --fit lognormal or pareto"
        raise ConfigError(e.field, f"{e.message} (from {path}{hint})") from None
    m = MEASURED_WITH.search(text)
    return spec, _measured_with(path, text, run), ((str(path), int(m[1])) if m else None), \
        (ref, tuple(sorted(own)))


#: a key beside `from` and the file's key it replaces (the file's is not read: no change of the study's if it moves)
FROM_REPLACES = (("bandwidth", "bandwidth_matrix"), ("latency", "latency_matrix"), ("speeds", "speeds_file"),
                 ("speeds_file", "speeds"))


def ignored_keys(spec: EnvSpec) -> dict[str, str]:
    """The [environment] keys ``spec`` does not use, with why: a speed model's parameter with another speed model, a
    slow spell's setting with no slow spells, the links between sites with one site, the single link values beside
    the matrices that override them. (Their values change nothing: the fingerprint of a stored study skips them.)"""
    speeds = "a list" if isinstance(spec.speeds, tuple) else f'"{spec.speeds}"'
    one_site = "and there is one site (sites = 1)"
    rules = [("sigma", spec.speeds == "lognormal", f'applies with speeds = "lognormal"; speeds is {speeds}'),
             ("alpha", spec.speeds == "pareto", f'applies with speeds = "pareto"; speeds is {speeds}'),
             ("slow_factor", bool(spec.slow_workers), "applies to slow_workers, and there are none"),
             ("straggle_factor", spec.straggle_p > 0, "applies to slow spells, and straggle_p is 0 (none)"),
             ("straggle_length", spec.straggle_p > 0, "applies to slow spells, and straggle_p is 0 (none)"),
             ("latency_inter", spec.sites > 1 and not spec.latency_matrix,
              "is overridden by latency_matrix" if spec.sites > 1 else f"is the latency between sites, {one_site}"),
             ("bandwidth_inter", spec.sites > 1 and not spec.bandwidth_matrix,
              "is overridden by bandwidth_matrix" if spec.sites > 1 else f"is the bandwidth between sites, {one_site}"),
             ("latency", not spec.latency_matrix, "is overridden by latency_matrix"),
             ("bandwidth", not spec.bandwidth_matrix, "is overridden by bandwidth_matrix")]
    return {key: why for key, used, why in rules if not used}


def _check_used(raw: dict, spec: EnvSpec | None) -> None:
    """One line for a key a study file wrote in its own [environment] (not one of a file it reads with ``from``)
    that its environment would ignore. Checked on the files a user writes, not on the definitions stored with a
    search's trials, which were accepted when they were searched."""
    given = raw.get("environment")
    if spec is None or not isinstance(given, dict):
        return
    ignored = ignored_keys(spec)
    for key in given:
        if key in ignored:
            raise ConfigError(f"study.environment.{key}", f"{ignored[key]}: it would be ignored; remove it")


def _check_target_used(raw: dict, s: Study) -> None:
    """One line for an ``[objectives] target`` nothing waits for (no simulated clock), or a ``target_metric`` with no
    target (a new user's regression study ran with both, in silence). Checked on the files a user writes, as
    :func:`_check_used` is."""
    given = raw.get("objectives")
    if not isinstance(given, dict):
        return
    if s.target is not None and s.environment is None:  # (a time objective without one is refused before)
        raise ConfigError("study.objectives.target", f"{s.target:g} has no effect: time to target is measured on a "
                                                     "simulated cluster, and the study has no [environment]; allowed: "
                                                     "an [environment] (time to target is timed there), or no target")
    if "target_metric" in given and s.target is None:
        raise ConfigError("study.objectives.target_metric", f"{s.target_metric!r} has no effect without "
                                                            "study.objectives.target; allowed: a target beside it "
                                                            "(time_to_target, with an [environment]), or no "
                                                            "target_metric")


# the line evomerge calibrate writes into its file: what the timed steps trained (calibrate.measure)
# (a file fitted from a Merger's trace says the model alone: --from-trace has no batch size or optimiser)
MEASURED_WITH = re.compile(r"^# model: (\d+) bytes of float32 parameters and buffers(?:; batch (\d+), optimiser "
                           r"(\S+))?$", re.MULTILINE)


def _measured_with(path: Path, text: str, run: RunSpec) -> tuple[str, ...]:
    """A note when the calibrated file (``text``, read from ``path``) timed another batch size or optimiser than
    ``run``: its step times are another training's."""
    m = MEASURED_WITH.search(text)
    if m is None or m[2] is None or (int(m[2]), m[3]) == (run.batch_size, run.optimizer):
        return ()
    return (f"study.environment.from: {path} timed steps of batch {m[2]} with {m[3]}; this study trains batch "
            f"{run.batch_size} with {run.optimizer}: its step times are another training's (calibrate with this "
            "study)",)


def _data(d: dict) -> DataSpec:
    if "loader" in d:
        check_format(d["loader"], "study.data.loader", "mydata:load")
        if "dataset" in d:
            raise ConfigError("study.data.dataset", "does not apply with loader (the loader's function gives the data); "
                                                    "allowed: one of dataset, loader")
    return settings.build(DataSpec, d, "study.data")


def _model(m: dict) -> ModelSpec:
    """Named models take their options as keys of ``[model]``; a factory takes ``options = {...}``."""
    if "factory" not in m:
        if "options" in m:  # (taken for an option of the named model)
            raise ConfigError("study.model.options", "applies with factory (your own nn.Module's keywords); a named "
                                                     "model takes its options as keys of [model] (hidden = [128])")
        for k in m:  # a misspelt [model] key (factroy) was taken for an option of the default mlp
            near = did_you_mean(k, ("factory", "options", "name", "execution"))
            if k not in ("name", "execution") and near:
                raise ConfigError(f"study.model.{k}", f"unknown key of [model]; allowed: name (a named model), factory "
                                                      "(your own nn.Module: \"mymodels:build\"), options (its "
                                                      "keywords), execution, or a named model's options" + near)
        model_name = m.pop("name", "mlp")
        execution = m.pop("execution", "auto")
        if model_name == "module":
            raise ConfigError("study.model.factory", "is required with name 'module' (e.g. factory = "
                                                     "\"mymodels:small_resnet\")")
        if isinstance(model_name, str) and model_name not in MODEL_NAMES:  # a named model, or your own by factory
            raise ConfigError("study.model.name", unknown(model_name, [n for n in MODEL_NAMES if n != "module"],
                                                          more=' (or your own nn.Module: factory = "mymodels:build")'))
        return ModelSpec(model_name, m or ({"hidden": [128]} if model_name == "mlp" else {}), "", execution)
    _no_unknown(m, ("factory", "options", "name", "execution"), "study.model")
    if m.get("name", "module") != "module":
        raise ConfigError("study.model.name", f"{m['name']!r} does not apply with factory (a factory's model is "
                                              "named 'module'); allowed: leave name out, or drop factory")
    check_format(m["factory"], "study.model.factory", "mymodels:small_resnet")
    options = m.get("options", {})
    if not isinstance(options, dict):
        raise ConfigError("study.model.options", f"must be a table of keyword arguments, e.g. {{ width = 16 }}, "
                                                 f"got {type(options).__name__}")
    return ModelSpec("module", options, m["factory"], m.get("execution", "auto"))


# -- small checks --------------------------------------------------------------
def _table(raw: dict, key: str) -> dict:
    v = raw.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"study.{key}", f"must be a table, got {type(v).__name__}")
    return v


def _no_unknown(d: dict, allowed, where: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{where}.{k}", unknown_key(k, allowed))


def check_given(study, field: str = "study") -> None:
    """A study given to a Python call (``evomerge.search``, ``run``, ``transfer``) is a name, a path or a Study:
    anything else is one line naming ``field``."""
    import os

    if not isinstance(study, (str, os.PathLike, Study)):
        raise ConfigError(field, f"{study!r} ({type(study).__name__}) is not a study; allowed: a study's name, its "
                                 "file's path, or an evomerge.study.Study")
