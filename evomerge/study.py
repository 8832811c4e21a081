"""Study files (TOML): the data, model, workers and budget a policy is judged on,
the policy's fixed values, the searched fields and the objectives.

``--study NAME`` is looked up as a path, then ``./studies/NAME.toml``, then the
studies shipped with evomerge.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import data as data_mod
from .errors import ConfigError
from .policy import MergePolicy, field_specs

SPACE_KINDS = ("float", "log-float", "int", "categorical")
MODEL_NAMES = ("mlp", "cnn")  # the keys of models.MODELS, known here without importing torch
OBJECTIVES = {  # name -> direction
    "val_accuracy": "maximize",
    "mean_worker_accuracy": "maximize",
    "bytes": "minimize",
    "wall_time": "minimize",
}


@dataclass(frozen=True)
class DataSpec:
    dataset: str = "mnist"
    val_size: int = 5000
    train_size: int = 0  # 0 = every training sample left after the validation split
    partition: str = "dirichlet"
    alpha: float = 0.5
    seed: int = 0  # validation split and partition


@dataclass(frozen=True)
class ModelSpec:
    name: str = "mlp"
    options: dict = field(default_factory=lambda: {"hidden": [128]})


@dataclass(frozen=True)
class RunSpec:
    workers: int = 8
    batch_size: int = 32
    epochs: float = 2.0  # budget in passes over the mean shard; converted to local steps
    steps: int = 0  # budget in local steps; overrides epochs when > 0
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    rounds: int = 10
    seeds: tuple[int, ...] = (0,)
    score_samples: int = 32  # per-worker validation slice for the winner-biased lerp
    eval_samples: int = 0  # validation samples for the per-worker accuracies (0 = all)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple = ()


@dataclass(frozen=True)
class SearchSpec:
    sampler: str = "tpe"
    n_trials: int = 30
    space: tuple[Param, ...] = ()


@dataclass(frozen=True)
class Study:
    name: str
    description: str = ""
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    run: RunSpec = RunSpec()
    policy: MergePolicy = MergePolicy()
    search: SearchSpec = SearchSpec()
    objectives: tuple[str, ...] = ("val_accuracy",)
    baselines: tuple[str, ...] = ("no-merging", "fedavg", "allreduce", "ring-gossip")
    path: Path | None = None

    @property
    def directions(self) -> list[str]:
        return [OBJECTIVES[o] for o in self.objectives]

    def policies_dir(self) -> Path:
        """Where this study's named policies (baselines) live: ``policies/`` beside the study file."""
        base = self.path.parent if self.path else shipped_studies_dir()
        return base / "policies"

    def resolve_policy(self, ref: str | Path) -> MergePolicy:
        """A policy from a file path, or by name from the study's policies folder."""
        p = Path(ref)
        if p.is_file():
            return MergePolicy.load(p)
        named = self.policies_dir() / f"{ref}.json"
        if named.is_file():
            return MergePolicy.load(named)
        known = sorted(f.stem for f in self.policies_dir().glob("*.json"))
        raise ConfigError("--policy", f"{ref}: no such file or named policy; named: {', '.join(known) or 'none'}")

    def with_overrides(self, **run_changes: Any) -> "Study":
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **run_changes))


# -- loading -------------------------------------------------------------------
def shipped_studies_dir() -> Path:
    """The studies folder shipped with evomerge (the ``evomerge.studies`` package, or the source tree)."""
    try:
        import evomerge.studies as shipped  # mapped onto ``studies/`` by pyproject

        return Path(shipped.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parent.parent / "studies"


def find(ref: str | Path) -> Path:
    p = Path(ref)
    if p.suffix == ".toml" or p.is_file():
        if p.is_file():
            return p
        raise ConfigError("--study", f"{ref}: no such file")
    for base in (Path.cwd() / "studies", shipped_studies_dir()):
        if (base / f"{ref}.toml").is_file():
            return base / f"{ref}.toml"
    known = sorted({f.stem for b in (Path.cwd() / "studies", shipped_studies_dir()) if b.is_dir() for f in b.glob("*.toml")})
    raise ConfigError("--study", f"unknown study {str(ref)!r}; known: {', '.join(known) or 'none'} (or give a path to a .toml file)")


def load(ref: str | Path) -> Study:
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
        raise ConfigError(str(path), f"invalid TOML: {e}") from None
    return from_dict(raw, path=path, default_name=path.stem)


_TOP = ("study", "data", "model", "run", "policy", "search", "objectives", "baselines")


def from_dict(raw: dict, path: Path | None = None, default_name: str = "study") -> Study:
    _no_unknown(raw, _TOP, "study")
    meta = _table(raw, "study")
    _no_unknown(meta, ("name", "description"), "study.study")
    name = _typed(meta.get("name", default_name), str, "study.study.name")
    description = _typed(meta.get("description", ""), str, "study.study.description")

    d = _dataclass_from(DataSpec, _table(raw, "data"), "study.data")
    data_mod.get_spec(d.dataset)
    if d.partition not in data_mod.PARTITIONS:
        raise ConfigError("study.data.partition", f"unknown {d.partition!r}; allowed: {', '.join(data_mod.PARTITIONS)}")
    _positive(d.alpha, "study.data.alpha")
    _at_least(d.val_size, 1, "study.data.val_size")
    _at_least(d.train_size, 0, "study.data.train_size")

    m = dict(_table(raw, "model"))
    model_name = _typed(m.pop("name", "mlp"), str, "study.model.name")
    if model_name not in MODEL_NAMES:
        raise ConfigError("study.model.name", f"unknown {model_name!r}; allowed: {', '.join(MODEL_NAMES)}")
    model = ModelSpec(model_name, m or ({"hidden": [128]} if model_name == "mlp" else {}))

    r = _dataclass_from(RunSpec, _table(raw, "run"), "study.run")
    _at_least(r.workers, 1, "study.run.workers")
    _at_least(r.batch_size, 1, "study.run.batch_size")
    _at_least(r.rounds, 1, "study.run.rounds")
    _at_least(r.steps, 0, "study.run.steps")
    _at_least(r.score_samples, 1, "study.run.score_samples")
    _at_least(r.eval_samples, 0, "study.run.eval_samples")
    if r.steps == 0:
        _positive(r.epochs, "study.run.epochs")
    if not r.lr >= 0:  # 0 freezes the models: a control run (merges alone, or the convergence stop)
        raise ConfigError("study.run.lr", f"{r.lr} is out of range; allowed: [0, inf)")
    if not 0 <= r.momentum < 1:
        raise ConfigError("study.run.momentum", f"{r.momentum} is out of range; allowed: [0, 1)")
    if r.weight_decay < 0:
        raise ConfigError("study.run.weight_decay", f"{r.weight_decay} is out of range; allowed: [0, inf)")
    if not r.seeds:
        raise ConfigError("study.run.seeds", "must list at least one seed")

    policy = MergePolicy.from_dict(_table(raw, "policy"), "study.policy")

    s = dict(_table(raw, "search"))
    space_raw = s.pop("space", {})
    sr = _dataclass_from(SearchSpec, s, "study.search", skip=("space",))
    _at_least(sr.n_trials, 1, "study.search.n_trials")
    space = tuple(_param(k, v) for k, v in _typed(space_raw, dict, "study.search.space").items())
    _check_space_point(policy, space)
    search = dataclasses.replace(sr, space=space)

    o = _table(raw, "objectives")
    _no_unknown(o, ("metrics",), "study.objectives")
    objectives = tuple(_typed(o.get("metrics", ["val_accuracy"]), list, "study.objectives.metrics"))
    if not objectives or len(set(objectives)) != len(objectives):
        raise ConfigError("study.objectives.metrics", "must list one or more distinct metrics")
    for ob in objectives:
        if ob not in OBJECTIVES:
            raise ConfigError("study.objectives.metrics", f"unknown {ob!r}; allowed: {', '.join(OBJECTIVES)}")

    b = _table(raw, "baselines")
    _no_unknown(b, ("policies",), "study.baselines")
    baselines = tuple(_typed(b.get("policies", list(Study.baselines)), list, "study.baselines.policies"))

    return Study(name, description, d, model, r, policy, search, objectives, baselines, path)


def _param(name: str, spec: Any) -> Param:
    where = f"study.search.space.{name}"
    fields = field_specs()
    if name not in fields:
        raise ConfigError(where, f"unknown policy field; allowed: {', '.join(fields)}")
    spec = _typed(spec, dict, where)
    _no_unknown(spec, ("kind", "low", "high", "choices"), where)
    kind = spec.get("kind")
    if kind not in SPACE_KINDS:
        raise ConfigError(f"{where}.kind", f"unknown {kind!r}; allowed: {', '.join(SPACE_KINDS)}")
    meta = fields[name]
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}.choices", "must be a non-empty list")
        for c in choices:
            try:
                MergePolicy.from_dict({name: c} | _compatible(name, c))
            except ConfigError as e:
                raise ConfigError(f"{where}.choices", e.message) from None
        return Param(name, kind, choices=tuple(choices))
    if meta["kind"] not in ("int", "float") or (kind == "int") != (meta["kind"] == "int"):
        want = "categorical" if meta["kind"] in ("str", "choice") else ("int" if meta["kind"] == "int" else "float or log-float")
        raise ConfigError(f"{where}.kind", f"{kind!r} does not fit this field; allowed: {want}")
    low, high = spec.get("low"), spec.get("high")
    for key, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}.{key}", f"must be a number, got {v!r}")
    if not low < high:
        raise ConfigError(where, f"impossible range [{low}, {high}]: low must be below high")
    if kind == "log-float" and low <= 0:
        raise ConfigError(f"{where}.low", f"{low}: a log-float range needs low > 0")
    lo_ok = low > meta["low"] if meta["low_open"] else low >= meta["low"]
    if not lo_ok or high > meta["high"]:
        raise ConfigError(where, f"[{low}, {high}] leaves the field's allowed range "
                                 f"{'(' if meta['low_open'] else '['}{meta['low']}, {meta['high']}]")
    return Param(name, kind, float(low) if kind != "int" else int(low), float(high) if kind != "int" else int(high))


def _compatible(name: str, value: Any) -> dict:
    """Other fields that make a single-field check meaningful (compression needs a delta payload)."""
    return {"payload": "delta"} if name in ("topk_fraction", "quantize_bits") else {}


def _check_space_point(policy: MergePolicy, space: tuple[Param, ...]) -> None:
    """The space's lower corner must make a valid policy with the fixed fields (catches impossible mixes)."""
    point = {}
    for p in space:
        point[p.name] = p.choices[0] if p.kind == "categorical" else p.low
    if any(p.name in ("topk_fraction", "quantize_bits") for p in space) and "payload" not in point:
        if policy.payload != "delta":
            raise ConfigError("study.search.space", "searching topk_fraction or quantize_bits needs payload 'delta' "
                                                    "in [policy] or payload in the space")


# -- small checks --------------------------------------------------------------
def _table(raw: dict, key: str) -> dict:
    v = raw.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"study.{key}", f"must be a table, got {type(v).__name__}")
    return v


def _no_unknown(d: dict, allowed, where: str) -> None:
    for k in d:
        if k not in allowed:
            raise ConfigError(f"{where}.{k}", f"unknown key; allowed: {', '.join(allowed)}")


def _typed(v, t, where):
    if t is int and isinstance(v, bool) or not isinstance(v, t):
        names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
        raise ConfigError(where, f"must be {names.get(t, t.__name__)}, got {type(v).__name__} {v!r}")
    return v


def _dataclass_from(cls, d: dict, where: str, skip=()):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    _no_unknown(d, list(fields), where)
    kwargs = {}
    for k, v in d.items():
        default = fields[k].default
        if isinstance(default, bool):
            v = _typed(v, bool, f"{where}.{k}")
        elif isinstance(default, int):
            v = _typed(v, int, f"{where}.{k}")
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{where}.{k}", f"must be a number, got {type(v).__name__} {v!r}")
            v = float(v)
            if not math.isfinite(v):
                raise ConfigError(f"{where}.{k}", f"must be finite, got {v}")
        elif isinstance(default, str):
            v = _typed(v, str, f"{where}.{k}")
        elif isinstance(default, tuple):
            v = tuple(_typed(v, list, f"{where}.{k}"))
            for x in v:
                _typed(x, int, f"{where}.{k}")
        kwargs[k] = v
    return cls(**kwargs)


def _at_least(v, low, where):
    if v < low:
        raise ConfigError(where, f"{v} is out of range; allowed: [{low}, inf)")


def _positive(v, where):
    if not v > 0:
        raise ConfigError(where, f"{v} is out of range; allowed: (0, inf)")
