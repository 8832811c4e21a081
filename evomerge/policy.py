"""The merge policy: a small, frozen, JSON-serialisable description of how
workers merge.

Each field's type, range and meaning live once, in its metadata; validation,
``from_dict`` and the JSON Schema (``evomerge policy schema``) are all read
from there.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

SCHEMA_VERSION = 2
# Fields added by each schema version; older files lack them and get their defaults (off).
ADDED_IN = {2: ("similarity", "similarity_bias", "regroup_every", "data_exchange_k", "retire_threshold",
                "reserve_rate", "swap_p", "stop_tol", "stop_patience")}

SCHEMES = ("gossip", "allreduce", "none")
TOPOLOGIES = ("ring", "complete", "random_regular", "communities")
EXCHANGES = ("push", "push_pull")
SCHEDULES = ("constant", "linear", "cosine")
LERPS = ("fixed", "random")
WEIGHTINGS = ("uniform", "examples", "adaptive")
PAYLOADS = ("weights", "delta")
SIMILARITIES = ("sketch", "cka")


def _f(default, kind: str, doc: str, *, low=None, high=None, low_open=False, choices=None):
    """A policy field with the facts validation and the schema are built from."""
    meta = {"kind": kind, "doc": doc, "low": low, "high": high, "low_open": low_open, "choices": choices}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class MergePolicy:
    """How workers merge. Defaults give push-pull ring gossip every ~10 steps."""

    name: str = _f("", "str", "A label for people; not used by the run.")
    scheme: str = _f(
        "gossip", "choice",
        "gossip: pairwise merge events on Poisson timers; allreduce: every worker averages with all "
        "every round(mean_interval) local steps (FedAvg / local SGD; 1 = synchronous all-reduce); "
        "none: no merging until the end (the consensus model is the final average).",
        choices=SCHEMES,
    )
    mean_interval: float = _f(
        10.0, "float",
        "Mean number of local steps between a worker's merges. Gossip draws each gap as "
        "1 + Poisson(mean_interval - 1); allreduce uses round(mean_interval).",
        low=1.0, high=1e6,
    )
    topology: str = _f("ring", "choice", "Who may be a peer in a gossip merge.", choices=TOPOLOGIES)
    degree: int = _f(4, "int", "Neighbours per worker for the random_regular topology.", low=1, high=1024)
    n_communities: int = _f(2, "int", "Number of groups for the communities topology.", low=1, high=1024)
    p_intra: float = _f(0.8, "float", "Communities: probability that the peer is from the own group.", low=0.0, high=1.0)
    exchange: str = _f(
        "push_pull", "choice",
        "push: only the peer moves towards the initiator; push_pull: both move.",
        choices=EXCHANGES,
    )
    mixing_weight: float = _f(
        0.5, "float", "Weight a on the incoming model: w <- (1 - a) w + a w_in (at the start of the run).",
        low=0.0, high=1.0, low_open=True,
    )
    mixing_schedule: str = _f(
        "constant", "choice",
        "How a moves from mixing_weight at the start to mixing_weight_final at the end of the run.",
        choices=SCHEDULES,
    )
    mixing_weight_final: float = _f(
        0.5, "float", "Mixing weight at the end of the run (ignored when mixing_schedule is constant).",
        low=0.0, high=1.0, low_open=True,
    )
    lerp: str = _f(
        "fixed", "choice",
        "fixed: move by a; random: move by u * a with u ~ U(0, 1) drawn per merge event.",
        choices=LERPS,
    )
    winner_bias: float = _f(
        0.0, "float",
        "The worker with the lower loss on the two workers' validation slices moves (1 - winner_bias) "
        "times as far as the other: 0 symmetric, 1 the winner is not moved.",
        low=0.0, high=1.0,
    )
    weighting: str = _f(
        "uniform", "choice",
        "uniform: plain lerp; examples: weighted by examples seen (counters summed on merge); "
        "adaptive: per coordinate, weighted by the workers' squared-gradient accumulators (summed on merge).",
        choices=WEIGHTINGS,
    )
    payload: str = _f(
        "weights", "choice",
        "weights: send the model; delta: send the change since the last synchronised state.",
        choices=PAYLOADS,
    )
    topk_fraction: float = _f(
        1.0, "float", "Delta payload: fraction of coordinates sent (largest first), the rest kept as error feedback.",
        low=0.0, high=1.0, low_open=True,
    )
    quantize_bits: int = _f(
        0, "int", "Delta payload: bits per sent value with stochastic rounding; 0 = send float32.",
        low=0, high=16,
    )
    # -- schema 2: fields no other tool offers as searchable knobs (all off by default) --
    similarity: str = _f(
        "sketch", "choice",
        "How model similarity is measured: sketch (cosine of a fixed random projection of each worker's change "
        "since the start) or cka (linear CKA of the workers' logits on a fixed probe batch).",
        choices=SIMILARITIES,
    )
    similarity_bias: float = _f(
        0.0, "float", "Gossip peer choice: > 0 prefers similar peers, < 0 dissimilar ones, 0 is the topology's plain draw.",
        low=-1.0, high=1.0,
    )
    regroup_every: int = _f(
        0, "int", "Communities topology: every this many rounds, regroup the workers into n_communities by "
        "agglomerative clustering of their similarity; 0 keeps the static split.", low=0, high=10_000,
    )
    data_exchange_k: int = _f(
        0, "int", "Gossip: at each merge event the initiator also sends its k least confident training examples "
        "(lowest probability of the true label) to the peer; 0 = data stays.", low=0, high=100_000,
    )
    retire_threshold: float = _f(
        0.0, "float", "Examples whose true-label probability was at least this the last two times they were "
        "trained on move to the worker's reserve; 0 = off.", low=0.0, high=1.0,
    )
    reserve_rate: float = _f(
        0.1, "float", "Chance that a reserve example is included in a pass over the worker's data.", low=0.0, high=1.0,
    )
    swap_p: float = _f(
        0.0, "float", "Gossip: probability that a merge event swaps the two workers' models instead of merging "
        "(each model goes on with the other's data; charged as two full transfers).", low=0.0, high=1.0,
    )
    stop_tol: float = _f(
        0.0, "float", "Stop the run once the per-step norms of local and of merge updates both stay below this "
        "for stop_patience rounds; 0 = never.", low=0.0, high=1e6,
    )
    stop_patience: int = _f(2, "int", "Rounds the update norms must stay below stop_tol.", low=1, high=10_000)
    schema_version: int = _f(SCHEMA_VERSION, "int", "Version of this format.", low=1, high=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check(f, getattr(self, f.name)))
        if self.quantize_bits == 1:
            raise ConfigError("policy.quantize_bits", "1 is not allowed; use 0 (off) or 2..16")
        if self.regroup_every and self.topology != "communities":
            raise ConfigError("policy.regroup_every", f"{self.regroup_every} needs topology 'communities'; "
                                                      f"got {self.topology!r}")
        if self.payload == "weights":
            if self.topk_fraction < 1.0:
                raise ConfigError("policy.topk_fraction", f"{self.topk_fraction} needs payload 'delta' (compression applies to deltas)")
            if self.quantize_bits:
                raise ConfigError("policy.quantize_bits", f"{self.quantize_bits} needs payload 'delta' (compression applies to deltas)")

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> "MergePolicy":
        if not isinstance(data, dict):
            raise ConfigError(where, f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"policy.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(known))}")
        version = data.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, int) and not isinstance(version, bool):
            if version > SCHEMA_VERSION:
                raise ConfigError("policy.schema_version", f"{version} is newer than this evomerge reads (<= {SCHEMA_VERSION})")
            for v, names in ADDED_IN.items():
                late = sorted(n for n in names if n in data and version < v)
                if late:
                    raise ConfigError(f"policy.{late[0]}", f"is a schema {v} field; this file says schema_version {version}")
            # an older file means what it always meant: the fields added since are off; read as current
            data = {**data, "schema_version": SCHEMA_VERSION}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str, where: str = "policy") -> "MergePolicy":
        return cls.from_dict(parse_json(text, where), where)

    @classmethod
    def load(cls, path: str | Path) -> "MergePolicy":
        """Read a policy file, or an exported file that holds one under ``policy``."""
        data = read_json_file(path)
        if isinstance(data, dict) and "policy" in data and "schema_version" not in data:
            data = data["policy"]
        return cls.from_dict(data, str(path))

    def replace(self, **changes: Any) -> "MergePolicy":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The policy in words, one line."""
        if self.scheme == "none":
            return "no merging; the consensus model is the average at the end"
        a = f"a={self.mixing_weight:.3g}" if self.mixing_schedule == "constant" else (
            f"a {self.mixing_weight:.3g}->{self.mixing_weight_final:.3g} ({self.mixing_schedule})")
        comp = ""
        if self.payload == "delta":
            comp = f", delta payload (top-k {self.topk_fraction:.3g}, {self.quantize_bits or 32} bits)"
        extra = self._describe_extras()
        if self.scheme == "allreduce":
            return (f"all workers average every {max(1, round(self.mean_interval))} steps, {a}, "
                    f"{self.weighting} weighting{comp}{extra}")
        topo = self.topology
        if topo == "communities":
            topo = f"{self.n_communities} communities, p_intra={self.p_intra:.3g}"
            if self.regroup_every:
                topo += f", regrouped by {self.similarity} similarity every {self.regroup_every} rounds"
        elif topo == "random_regular":
            topo = f"random {self.degree}-regular"
        return (f"{self.exchange} gossip on {topo} every ~{self.mean_interval:.3g} steps, {self.lerp} lerp {a}, "
                f"winner bias {self.winner_bias:.3g}, {self.weighting} weighting{comp}{extra}")

    def _describe_extras(self) -> str:
        parts = []
        if self.similarity_bias:
            parts.append(f"prefers {'similar' if self.similarity_bias > 0 else 'dissimilar'} peers "
                         f"({self.similarity} bias {self.similarity_bias:.3g})")
        if self.data_exchange_k:
            parts.append(f"sends its {self.data_exchange_k} least confident examples")
        if self.retire_threshold:
            parts.append(f"retires examples confident above {self.retire_threshold:.3g} "
                         f"(reserve rate {self.reserve_rate:.3g})")
        if self.swap_p:
            parts.append(f"swaps models with p={self.swap_p:.3g}")
        if self.stop_tol:
            parts.append(f"stops when updates stay below {self.stop_tol:.3g} for {self.stop_patience} rounds")
        return "".join(f", {p}" for p in parts)


def _check(f: dataclasses.Field, value: Any) -> Any:
    """Validate one field's value; return it normalised (ints given for floats become floats)."""
    meta, name = f.metadata, f"policy.{f.name}"
    kind = meta["kind"]
    if kind in ("str", "choice"):
        if not isinstance(value, str):
            raise ConfigError(name, f"must be a string, got {_show(value)}")
        if kind == "choice" and value not in meta["choices"]:
            raise ConfigError(name, f"unknown {_show(value)}; allowed: {', '.join(meta['choices'])}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"must be an integer, got {_show(value)}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"must be a number, got {_show(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(name, f"must be finite, got {value}")
    low, high = meta["low"], meta["high"]
    if low is not None and (value <= low if meta["low_open"] else value < low) or high is not None and value > high:
        raise ConfigError(name, f"{value} is out of range; allowed: {_range(meta)}")
    return value


def _range(meta) -> str:
    return f"{'(' if meta['low_open'] else '['}{meta['low']}, {meta['high']}]"


def _show(value: Any) -> str:
    return f"{type(value).__name__} {json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else ''}".strip()


def field_specs() -> dict[str, dict[str, Any]]:
    """Name -> metadata (kind, range, choices, doc) of every searchable policy field."""
    return {f.name: dict(f.metadata) for f in dataclasses.fields(MergePolicy) if f.name not in ("name", "schema_version")}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy file."""
    props: dict[str, Any] = {}
    for f in dataclasses.fields(MergePolicy):
        m = f.metadata
        p: dict[str, Any] = {"description": m["doc"], "default": f.default}
        if m["kind"] in ("str", "choice"):
            p["type"] = "string"
            if m["choices"]:
                p["enum"] = list(m["choices"])
        else:
            p["type"] = "integer" if m["kind"] == "int" else "number"
            if m["low"] is not None:
                p["exclusiveMinimum" if m["low_open"] else "minimum"] = m["low"]
            if m["high"] is not None:
                p["maximum"] = m["high"]
        props[f.name] = p
    props["quantize_bits"]["not"] = {"const": 1}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://evomerge.dev/schema/policy-v{SCHEMA_VERSION}.json",
        "title": "evomerge merge policy",
        "type": "object",
        "properties": props,
        "additionalProperties": False,
    }


def parse_json(text: str, where: str) -> Any:
    if not text.strip():
        raise ConfigError(where, "empty file; expected a JSON object")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(where, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def read_json_file(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), f"cannot read: {e}") from None
    return parse_json(text, str(path))
