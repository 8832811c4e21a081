"""The merge policy: a small, frozen, JSON-serialisable description of how
workers merge.

Each field's type, range, choices and meaning are written once, on the pydantic
model below; validation, ``from_dict``, :func:`field_specs` (what the search space
checks against) and the JSON Schema (``evomerge policy schema``) are all read from it.
Rules that need the study (how many workers) are :func:`check_workers` and
:func:`fit_to_workers`, also here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

from pydantic import Field, model_validator
from pydantic_core import ArgsKwargs

from . import settings
from .errors import ConfigError
from .settings import Choice
from .engine.topology import TOPOLOGIES

# a policy's fields that do not change what it does (its name, its words, its file format)
NOT_IN_POLICY = ("name", "description", "schema_version")


def what_merges(policy: dict) -> dict:
    """A policy's fields less :data:`NOT_IN_POLICY`: what two policies must share to merge alike."""
    return {k: v for k, v in policy.items() if k not in NOT_IN_POLICY}
SCHEMA_VERSION = 10
EXPORT_FORMAT = 2  # evomerge export's files; 2: the run settings the policy was found with (run.lr, run.weight_decay)
# Fields added by each schema version; older files lack them and get their defaults (off).
ADDED_IN = {2: ("similarity", "similarity_bias", "regroup_every", "data_exchange_k", "retire_threshold",
                "reserve_rate", "swap_p", "stop_tol", "stop_patience"),
            3: ("optimizer_state", "buffers"),
            4: ("outer_optimizer", "outer_lr", "outer_momentum"),
            5: ("score",),
            6: ("fragments", "fragment_delay", "fragment_alpha", "momentum_every", "local_steps_by_speed"),
            7: ("fragment_pattern",),
            8: ("p_intra_schedule", "p_intra_final", "data_unseen_first", "data_similarity_sign", "swap_confidence",
                "swap_recency", "backup_workers"),
            9: ("outer_every",),
            10: ("publish_every",)}

# Names of the choices that no registry holds yet (the merge code tests them by name);
# topologies come from the registry in topology.py.
SCHEMES = ("gossip", "allreduce", "none", "async")
EXCHANGES = ("push", "push_pull")
SCHEDULES = ("constant", "linear", "cosine")
LERPS = ("fixed", "random")
from .registry import PAYLOADS, WEIGHTINGS  # noqa: E402  (registries: a new rule registers its name there)
SIMILARITIES = ("sketch", "cka")
OPTIMIZER_STATES = ("keep", "average", "reset")
BUFFERS = ("average", "local")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov")
SCORES = ("holdout", "running")
FRAGMENT_PATTERNS = ("contiguous", "strided")


def _f(default, doc: str, **bounds):
    return Field(default, description=doc, **bounds)


@settings.model("policy")
class MergePolicy:
    """How workers merge. Defaults give push-pull ring gossip every ~10 steps."""

    name: str = _f("", "A label for people; not used by the run.")
    scheme: Annotated[str, Choice(SCHEMES)] = _f(
        "gossip",
        "gossip: pairwise merge events on Poisson timers; allreduce: every worker averages with all "
        "every round(mean_interval) local steps (FedAvg / local SGD; 1 = synchronous all-reduce); "
        "none: no merging until the end (the consensus model is the final average); async: asynchronous DiLoCo on "
        "a simulated cluster (Liu et al. 2024): each worker pushes its pseudo-gradient to a server after "
        "round(mean_interval) local steps, the server takes the outer step at once, and the worker pulls the new "
        "global model.",
    )
    mean_interval: float = _f(
        10.0,
        "Mean number of local steps between a worker's merges. Gossip draws each gap as "
        "1 + Poisson(mean_interval - 1); allreduce uses round(mean_interval).",
        ge=1.0, le=1e6,
    )
    topology: Annotated[str, Choice(TOPOLOGIES)] = _f("ring", "Who may be a peer in a gossip merge.")
    degree: int = _f(4, "Neighbours per worker for the random_regular topology (fewer than the workers; "
                        "degree * workers even).", ge=1, le=1024)
    n_communities: int = _f(2, "Number of groups for the communities topology (at most the workers).", ge=1, le=1024)
    p_intra: float = _f(0.8, "Communities: probability that the peer is from the own group.", ge=0.0, le=1.0)
    exchange: Annotated[str, Choice(EXCHANGES)] = _f(
        "push_pull", "push: only the peer moves towards the initiator; push_pull: both move.")
    mixing_weight: float = _f(
        0.5, "Weight a on the incoming model: w <- (1 - a) w + a w_in (at the start of the run). Left out with an "
             "outer_optimizer on scheme allreduce or async, or streamed fragments: 1.0, the whole average.", gt=0.0, le=1.0)
    mixing_schedule: Annotated[str, Choice(SCHEDULES)] = _f(
        "constant", "How a moves from mixing_weight at the start to mixing_weight_final at the end of the run.")
    mixing_weight_final: float = _f(
        0.5, "Mixing weight at the end of the run (ignored when mixing_schedule is constant).", gt=0.0, le=1.0)
    lerp: Annotated[str, Choice(LERPS)] = _f(
        "fixed", "fixed: move by a; random: move by u * a with u ~ U(0, 1) drawn per merge event.")
    winner_bias: float = _f(
        0.0,
        "The worker with the lower loss on the two workers' validation slices moves (1 - winner_bias) "
        "times as far as the other: 0 symmetric, 1 the winner is not moved.",
        ge=0.0, le=1.0,
    )
    weighting: Annotated[str, Choice(WEIGHTINGS)] = _f(
        "uniform",
        "uniform: plain lerp; examples: weighted by examples seen (counters summed on merge); "
        "adaptive: per coordinate, weighted by the workers' squared-gradient accumulators (summed on merge).",
    )
    payload: Annotated[str, Choice(PAYLOADS)] = _f(
        "weights", "weights: send the model; delta: send the change since the last synchronised state; gradient "
        "(scheme allreduce, every step): all-reduce each local step's gradient before every worker's update instead "
        "of averaging models (compressed as a delta is, with error feedback).")
    topk_fraction: float = _f(
        1.0, "Delta or gradient payload: fraction of coordinates sent (largest first), the rest kept as error "
        "feedback.",
        gt=0.0, le=1.0,
    )
    quantize_bits: int = Field(
        0, description="Delta or gradient payload: bits per sent value with stochastic rounding; 1 = scaled sign (the "
        "signs and their mean magnitude, EF-signSGD with the error feedback); 0 = send float32.",
        ge=0, le=16,
    )
    # -- schema 2: fields no other tool offers as searchable knobs (all off by default) --
    similarity: Annotated[str, Choice(SIMILARITIES)] = _f(
        "sketch",
        "How model similarity is measured: sketch (cosine of a fixed random projection of each worker's change "
        "since the start) or cka (linear CKA of the workers' logits on a fixed probe batch).",
    )
    similarity_bias: float = _f(
        0.0, "Gossip peer choice: > 0 prefers similar peers, < 0 dissimilar ones, 0 is the topology's plain draw.",
        ge=-1.0, le=1.0,
    )
    regroup_every: int = _f(
        0, "Communities topology: every this many rounds, regroup the workers into n_communities by "
        "agglomerative clustering of their similarity; 0 keeps the static split.", ge=0, le=10_000,
    )
    data_exchange_k: int = _f(
        0, "Gossip: at each merge event the initiator also sends its k least confident training examples "
        "(lowest probability of the true label) to the peer; 0 = data stays.", ge=0, le=100_000,
    )
    retire_threshold: float = _f(
        0.0, "Examples whose true-label probability was at least this the last two times they were "
        "trained on move to the worker's reserve; 0 = off.", ge=0.0, le=1.0,
    )
    reserve_rate: float = _f(
        0.1, "Chance that a reserve example is included in a pass over the worker's data.", ge=0.0, le=1.0,
    )
    swap_p: float = _f(
        0.0, "Gossip: probability that a merge event swaps the two workers' models instead of merging "
        "(each model goes on with the other's data; charged as two full transfers).", ge=0.0, le=1.0,
    )
    stop_tol: float = _f(
        0.0, "Stop the run once the per-step norms of local and of merge updates both stay below this "
        "for stop_patience rounds; 0 = never.", ge=0.0, le=1e6,
    )
    stop_patience: int = _f(2, "Rounds the update norms must stay below stop_tol.", ge=1, le=10_000)
    # -- schema 3: the training state besides the parameters (VW: every piece of state has a merge rule) --
    optimizer_state: Annotated[str, Choice(OPTIMIZER_STATES)] = _f(
        "keep",
        "The optimiser's state (SGD momentum, Adam's moments and step count) on a merge: keep (each worker keeps "
        "its own), average (with the same weights as the parameters) or reset (zeroed). A swap moves it with the model.",
    )
    buffers: Annotated[str, Choice(BUFFERS)] = _f(
        "average",
        "A model's buffers (BatchNorm running statistics) on a merge: average (like the parameters) or local (each "
        "worker keeps its own). Counters (num_batches_tracked) are summed when averaged. The consensus model "
        "always uses the mean of the workers' buffers.",
    )
    # -- schema 4: the outer optimiser (DiLoCo, SlowMo) --
    outer_optimizer: Annotated[str, Choice(OUTER_OPTIMIZERS)] = _f(
        "none",
        "An outer step at each all-reduce (DiLoCo; SlowMo's slow momentum): the pseudo-gradient d = anchor - mean "
        "of the workers (the weighted mean under examples or adaptive weighting) updates the anchor by SGD "
        "(sgd: heavy-ball m = mu m + d, anchor -= lr m; nesterov: anchor -= lr (d + mu m), as torch.optim.SGD), "
        "and every worker restarts from the new anchor. none: the workers take the mean. Needs scheme allreduce, "
        "mixing_weight 1, lerp fixed and payload weights. With scheme none (no merging) each worker takes its own "
        "outer step on anchor_w - w every round(mean_interval) local steps: Lookahead (sgd), SNOO (nesterov), the "
        "control that tells the outer optimiser's gain from the merging's.",
    )
    outer_lr: float = _f(0.7, "The outer step's learning rate (DiLoCo: 0.7; sgd with 1 and momentum 0 is FedAvg).",
                         gt=0.0, le=10.0)
    outer_momentum: float = _f(0.9, "The outer step's momentum mu (DiLoCo: 0.9; nesterov needs mu > 0).",
                               ge=0.0, lt=1.0)
    # -- schema 9: SlowMo over a gossip base --
    outer_every: int = _f(
        0, "SlowMo over a gossip base (scheme gossip with an outer_optimizer; SlowMo's slow momentum is heavy-ball: "
        "sgd): after every this many local steps (and that step's gossip) an exact average of all workers, then the "
        "outer step on it, and every worker restarts from the new anchor; 0 = off.", ge=0, le=1_000_000)
    # -- schema 5: how the winner-biased lerp scores a model --
    score: Annotated[str, Choice(SCORES)] = _f(
        "holdout",
        "What winner_bias compares: holdout (both models' loss on the pair's validation slices, one extra forward per "
        "merge) or running (each model's running training loss: a bias-corrected exponential mean, decay 0.9, of its "
        "minibatch losses, merged with the model; no forward, and what evomerge.Merger computes in a training loop).",
    )
    # -- schema 6: Streaming DiLoCo (Douillard et al. 2025): fragments synced on staggered steps, overlapped --
    fragments: int = _f(
        1, "The all-reduce scheme in k fragments: the parameter tensors in k contiguous groups balanced by size, "
        "cut between modules where the model has k layers or more (buffers with the last); fragment j syncs after "
        "local steps round((j + 1) H / k) + m H (H = round(mean_interval)), each with its own outer step.",
        ge=1, le=64)
    fragment_delay: int = _f(
        0, "Local steps a fragment's all-reduce travels while training goes on: its average is of the workers at "
        "step t, applied after step t + fragment_delay (needs fragments x fragment_delay < H; 0 = at once).",
        ge=0, le=1_000_000)
    fragment_alpha: float = _f(
        0.0, "How a landed fragment mixes with the worker's own: p = lerp(global, local, alpha) = global + "
        "alpha (local - global); 0 takes the global value (torchft's fragment_update_alpha).", ge=0.0, le=1.0)
    # -- schema 7: Streaming DiLoCo's strided fragments --
    fragment_pattern: Annotated[str, Choice(FRAGMENT_PATTERNS)] = _f(
        "contiguous", "How the parameter tensors form the fragments: contiguous (groups of neighbouring tensors "
        "balanced by size, cut between modules where the model has enough layers) or strided (the paper's "
        "pattern: layer l, i.e. the tensors of one module, goes to fragment l mod k, so every fragment spans the "
        "depth; buffers with the last).")
    # -- schema 6: asynchronous DiLoCo (Liu et al. 2024, arXiv 2401.09135), scheme "async" --
    momentum_every: int = _f(
        0, "Asynchronous DiLoCo's delayed Nesterov: every arriving pseudo-gradient d moves the global model by "
        "outer_lr d / N at once; every N arrivals the momentum takes their mean and the global model its momentum "
        "step. 0: N = the number of workers.", ge=0, le=1_000_000)
    local_steps_by_speed: bool = _f(
        False, "Asynchronous DiLoCo's dynamic local updates: a worker's local steps per round are "
        "round(mean_interval) scaled by its configured speed against the fastest's, so that arrivals line up.")
    # -- schema 8: communities that converge (explore apart early, mix later) --
    p_intra_schedule: Annotated[str, Choice(SCHEDULES)] = _f(
        "constant", "Communities: how p_intra moves from its value at the start to p_intra_final at the end of the "
        "run (as mixing_schedule moves the mixing weight).")
    p_intra_final: float = _f(
        0.8, "Communities: p_intra at the end of the run (ignored when p_intra_schedule is constant).", ge=0.0, le=1.0)
    # -- schema 8: data that travels with its history, and chosen by similarity --
    data_unseen_first: bool = _f(
        False, "Data that travels (data_exchange_k): the initiator sends first the examples the peer has never "
        "trained on (each example keeps which workers have trained on it), in the order the rule below gives.")
    data_similarity_sign: float = _f(
        0.0, "Data that travels: which examples a pair exchanges, by how dissimilar the peer is among the "
        "initiator's (d in [0, 1], 1 the least similar now, by `similarity`). > 0: a fraction s d of the k are the "
        "most confident, the rest the least confident (dissimilar pairs exchange easy examples); < 0: a fraction "
        "|s| (1 - d) (similar pairs exchange easy ones, dissimilar pairs the hard ones); 0: the k least confident.",
        ge=-1.0, le=1.0)
    # -- schema 8: conditioned swaps --
    swap_confidence: float = _f(
        0.0, "Swaps: the chance is swap_p (1 + s (2c - 1)), c the peer's model's mean confidence on the peer's "
        "training examples (true-label probability); > 0 swaps more where the peer's data is learnt, < 0 where it is "
        "not; 0 = unconditioned.", ge=-1.0, le=1.0)
    swap_recency: float = _f(
        0.0, "Swaps: the chance is also scaled by 1 - exp(-age / swap_recency), age the local steps since the "
        "initiator's model last held the peer's data (1 if it never has); 0 = unconditioned.", ge=0.0, le=1e6)
    # -- schema 10: decisions from what the workers publish --
    publish_every: int = _f(
        0, "Gossip decisions by the workers' state (peers or examples by similarity, swaps by the peer's confidence) "
        "read what every worker last published: its sketch (or CKA logits) and its data's confidence, published "
        "after every publish_every local steps (on a simulated cluster, at every publish_every of the median worker's "
        "step times). 0 = every worker's state at each decision's instant, gathered for that decision.",
        ge=0, le=1_000_000)
    # -- schema 8: backup workers, the synchronous answer to stragglers --
    backup_workers: int = _f(
        0, "All-reduce: each all-reduce waits only for the first W - b workers to arrive on the simulated clock; the "
        "b late ones drop the work of their step (Chen et al. 2016, revisiting synchronous SGD) and take the "
        "average. Without a clock, or when workers arrive together, nobody is late.", ge=0, le=1023)
    schema_version: int = _f(SCHEMA_VERSION, "Version of this format.", ge=1, le=SCHEMA_VERSION)

    @model_validator(mode="before")
    @classmethod
    def _read_older_versions(cls, data: Any) -> Any:
        """A file of an older schema means what it always meant: the fields added since are off,
        and naming one is an error; it is then read as the current version."""
        kwargs = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(kwargs, dict):
            return data
        version = kwargs.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1 or version == SCHEMA_VERSION:
            return data  # a bad version is the field's own error
        if version > SCHEMA_VERSION:
            raise ConfigError("policy.schema_version", f"{version} is newer than this evomerge reads (<= {SCHEMA_VERSION})")
        late = [(n, v) for n in kwargs for v, names in ADDED_IN.items() if n in names and version < v]  # file order
        if late:
            (name, v), need = late[0], max(v for _, v in late)
            raise ConfigError(f"policy.{name}", f"is a schema {v} field; this file says schema_version {version}; "
                                                f"allowed: schema_version {need} to {SCHEMA_VERSION}, or leave "
                                                "schema_version out (the current one)")
        kwargs = {**kwargs, "schema_version": SCHEMA_VERSION}
        return ArgsKwargs(data.args, kwargs) if isinstance(data, ArgsKwargs) else kwargs

    @model_validator(mode="before")
    @classmethod
    def _outer_step_takes_the_whole_average(cls, data: Any) -> Any:
        """An outer step after an all-reduce (DiLoCo) or a server's (asynchronous DiLoCo), and streamed fragments
        (Streaming DiLoCo), take the whole average (mixing_weight 1): left out of such a policy, it is 1, not the
        gossip default 0.5 (a DiLoCo file as one writes it was refused for a field it never named)."""
        kwargs = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(kwargs, dict) or "mixing_weight" in kwargs or \
                kwargs.get("scheme", "gossip") not in ("allreduce", "async"):
            return data
        streamed = any(k in kwargs and kwargs[k] != off for k, off in STREAMING_OFF.items())
        if kwargs.get("outer_optimizer", "none") == "none" and not streamed:
            return data
        kwargs = {**kwargs, "mixing_weight": 1.0}
        return ArgsKwargs(data.args, kwargs) if isinstance(data, ArgsKwargs) else kwargs

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "MergePolicy":
        if self.regroup_every and self.topology != "communities":
            raise ConfigError("policy.regroup_every", f"{self.regroup_every} needs topology 'communities'; "
                                                      f"got {self.topology!r}")
        if self.outer_every and (self.scheme != "gossip" or self.outer_optimizer == "none"):
            raise ConfigError("policy.outer_every", f"{self.outer_every} applies to scheme 'gossip' with an "
                                                    f"outer_optimizer (SlowMo); this is scheme {self.scheme!r}, "
                                                    f"outer_optimizer {self.outer_optimizer!r}; allowed: 0")
        if self.outer_optimizer != "none" and self.scheme == "gossip":  # SlowMo over a gossip base
            if not self.outer_every:
                raise ConfigError("policy.outer_every", f"0 with outer_optimizer {self.outer_optimizer!r} over a gossip "
                                                        "base (SlowMo: the local steps between exact averages); "
                                                        "allowed: >= 1, or scheme allreduce")
            if self.payload != "weights":
                raise ConfigError("policy.payload", f"{self.payload!r} cannot take an outer step over a gossip base "
                                                    "(SlowMo's exact average is of the models); allowed: 'weights'")
        elif self.outer_optimizer != "none" and self.scheme != "none":  # scheme none: each worker's own (Lookahead)
            need = {"scheme": (self.scheme if self.scheme == "async" else "allreduce",
                               "the outer step follows an all-reduce, each worker's own steps with scheme none, or "
                               "a gossip base's exact average every outer_every steps")}
            need |= {k: (v, "deltas against the anchor are not built yet" if k == "payload" else
                         "the workers restart from the anchor") for k, v in OUTER_NEEDS.items()}
            if self.scheme == "allreduce" and self.payload == "delta":  # compressed outer gradients (MuLoCo)
                del need["payload"]
                need["weighting"] = ("uniform", "the compressed outer gradients are averaged plainly")
            for name, (value, why) in need.items():
                if getattr(self, name) != value:
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)!r} cannot take an outer step "
                                                        f"(outer_optimizer {self.outer_optimizer!r}: {why}); "
                                                        f"allowed: {value!r}")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            raise ConfigError("policy.outer_momentum", "0 with outer_optimizer 'nesterov'; allowed: (0, 1), "
                                                       "or outer_optimizer 'sgd'")
        if self.backup_workers:
            for name, value in {"scheme": "allreduce", **BACKUP_NEEDS}.items():
                if getattr(self, name) != value:
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)!r} cannot drop backup workers "
                                                        f"(backup_workers {self.backup_workers}: the late workers' "
                                                        f"rows are left out of a plain average that every row "
                                                        f"takes); allowed: {value!r}")
        asynchronous = [k for k, off in ASYNC_OFF.items() if getattr(self, k) != off]
        if asynchronous and self.scheme != "async":
            raise ConfigError(f"policy.{asynchronous[0]}", f"{getattr(self, asynchronous[0])!r} applies to scheme "
                                                           f"'async' only; this is {self.scheme!r}")
        if self.scheme == "async":
            if self.outer_optimizer == "none":
                raise ConfigError("policy.outer_optimizer", "'none' with scheme 'async': the server's step is the "
                                                            "outer step; allowed: sgd, nesterov")
            for name, value in {**OUTER_NEEDS, **STREAMING_NEEDS, **STREAMING_OFF}.items():
                if getattr(self, name) != value:
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)!r} with scheme 'async' (the workers "
                                                        f"restart from the server's model); allowed: {value!r}")
        streaming = [k for k, off in STREAMING_OFF.items() if getattr(self, k) != off]
        if streaming:
            need = {"scheme": "allreduce", **OUTER_NEEDS, **STREAMING_NEEDS}
            if self.payload == "delta" and self.outer_optimizer != "none":
                need.pop("payload")  # each fragment's outer gradients compressed (the paper's 4-bit float's stand-in)
            for name, value in need.items():
                if getattr(self, name) != value:
                    also = " (or 'delta' with an outer step: compressed outer gradients)" if name == "payload" else ""
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)!r} cannot stream fragments "
                                                        f"({streaming[0]} {getattr(self, streaming[0])!r}); "
                                                        f"allowed: {value!r}{also}")
            H = max(1, round(self.mean_interval))
            if self.fragments > H:
                raise ConfigError("policy.fragments", f"{self.fragments} is more than the {H} local steps between "
                                                      f"syncs (mean_interval); allowed: 1..{H}")
            if self.fragments * self.fragment_delay >= H:
                raise ConfigError("policy.fragment_delay", f"{self.fragment_delay} with {self.fragments} fragments "
                                                           f"every {H} steps; allowed: fragments x fragment_delay < "
                                                           f"{H} (0..{(H - 1) // self.fragments})")
        if self.payload not in COMPRESSED:
            for name, off in COMPRESSION_OFF.items():
                if getattr(self, name) != off:
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)} needs payload 'delta' or 'gradient' "
                                                        "(compression applies to deltas and gradients); allowed: "
                                                        f"{off!r} with payload {self.payload!r}, or payload 'delta' or "
                                                        "'gradient'")
        if self.payload == "gradient":
            for name, value in GRADIENT_NEEDS.items():
                if getattr(self, name) != value:
                    raise ConfigError(f"policy.{name}", f"{getattr(self, name)!r} cannot all-reduce gradients (payload "
                                                        "'gradient': every local step's gradient averaged plainly "
                                                        f"before each worker's update); allowed: {value!r}")
        return self

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> "MergePolicy":
        if not isinstance(data, dict):
            raise ConfigError(where, f"must be a JSON object, got {type(data).__name__}")
        try:
            return settings.build(cls, data, where)
        except ConfigError as e:  # a study's [policy] table: its fields named as the study's (study.policy.X)
            if where.startswith("study.") and (e.field == "policy" or e.field.startswith("policy.")):
                raise ConfigError(where + e.field[len("policy"):], e.message) from None
            raise

    @classmethod
    def from_json(cls, text: str, where: str = "policy") -> "MergePolicy":
        return cls.from_dict(parse_json(text, where), where)

    @classmethod
    def load(cls, path: str | Path) -> "MergePolicy":
        """Read a policy file, or an exported file that holds one under ``policy``; a name that is no file but a
        shipped policy's (``"diloco"``) reads that one, as ``evomerge run --policy`` does."""
        from .registry import shipped_studies_dir

        folder = shipped_studies_dir() / "policies"
        if isinstance(path, str) and path.strip() and "/" not in path and not Path(path).exists():
            if (folder / f"{path}.json").is_file():
                path = folder / f"{path}.json"
            elif not path.endswith(".json"):  # a name, not a file
                from .errors import did_you_mean

                named = sorted(f.stem for f in folder.glob("*.json"))
                raise ConfigError(path, f"no such file or shipped policy; named: {', '.join(named)}"
                                        + did_you_mean(path, named))
        data = read_json_file(path)
        check_not_a_broken_export(data, str(path))
        if isinstance(data, dict) and "policy" in data and "schema_version" not in data:
            data = data["policy"]
        return cls.from_dict(data, str(path))

    def replace(self, **changes: Any) -> "MergePolicy":
        """A copy with ``changes``, validated (``dataclasses.replace`` does the same)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The policy in words, one line."""
        if self.scheme == "none":
            if self.outer_optimizer != "none":  # Lookahead / SNOO: the control without merging
                return (f"no merging; each worker takes its own outer {self.outer_optimizer} step "
                        f"{self._every()} (lr {self.outer_lr:.3g}, momentum "
                        f"{self.outer_momentum:.3g}; Lookahead/SNOO); the consensus model is the average at the end")
            return "no merging; the consensus model is the average at the end" + self._describe_extras(merges=False)
        a = f"a={self.mixing_weight:.3g}" if self.mixing_schedule == "constant" else (
            f"a={self.mixing_weight:.3g}->{self.mixing_weight_final:.3g} ({self.mixing_schedule})")
        comp = ""
        if self.payload in COMPRESSED:  # what squeezes it, where something does
            squeeze = [f"top-k {self.topk_fraction:.3g}"] * (self.topk_fraction < 1.0)
            if self.quantize_bits:
                squeeze.append("scaled sign" if self.quantize_bits == 1 else f"{self.quantize_bits} bits")
            comp = ", delta payload" + (f" ({', '.join(squeeze)})" if squeeze else "")
        extra = self._describe_extras()
        if self.payload == "gradient":
            squeezed = self.topk_fraction < 1.0 or self.quantize_bits
            return (f"all workers average every local step's gradient before their update"
                    f"{comp.replace(', delta payload', ', compressed') if squeezed else ''}{extra}")
        if self.scheme == "async":
            n = max(1, round(self.mean_interval))
            after = "every local step" if n == 1 else f"{n} local steps"
            return (f"asynchronous DiLoCo: each worker pushes after {after}"
                    f"{' (scaled by its speed)' if self.local_steps_by_speed else ''}, the server takes an outer "
                    f"{self.outer_optimizer} step (lr {self.outer_lr:.3g}, momentum {self.outer_momentum:.3g}, every "
                    f"{self.momentum_every or 'W'} arrivals){extra}")
        if self.scheme == "allreduce":
            if any(getattr(self, k) != off for k, off in STREAMING_OFF.items()  # Streaming DiLoCo (one fragment
                   if k != "fragment_pattern" or self.fragments > 1):        # has no pattern)
                strided = " strided" if self.fragment_pattern == "strided" and self.fragments > 1 else ""
                how = f"in {self.fragments}{strided} fragments" if self.fragments > 1 else "whole"
                extra = (f", streamed {how} (delay {self.fragment_delay} step{'s' * (self.fragment_delay != 1)}, "
                         f"alpha {self.fragment_alpha:.3g})") + extra
            if self.outer_optimizer != "none":  # DiLoCo / SlowMo
                comp = comp.replace("delta payload", "compressed outer gradients")
                return (f"all workers average {self._every()}, then an outer "
                        f"{self.outer_optimizer} step (lr {self.outer_lr:.3g}, momentum {self.outer_momentum:.3g}), "
                        f"{self.weighting} weighting{comp}{extra}")
            random = "random lerp " if self.lerp == "random" else ""  # (u * a, u drawn per merge event)
            return (f"all workers average {self._every()}, {random}{a}, "
                    f"{self.weighting} weighting{comp}{extra}")
        topo = self.topology
        if topo == "communities":
            topo = f"{self.n_communities} communities, p_intra={self.p_intra:.3g}" if self.p_intra_schedule == "constant" \
                else (f"{self.n_communities} communities, p_intra {self.p_intra:.3g}->{self.p_intra_final:.3g} "
                      f"({self.p_intra_schedule})")
            if self.regroup_every:
                topo += f", regrouped by {self.similarity} similarity every {self.regroup_every} rounds"
        elif topo == "random_regular":
            topo = f"random {self.degree}-regular"
        if self.outer_every:  # SlowMo over a gossip base
            extra = (f", and every {self.outer_every} steps an exact average and an outer {self.outer_optimizer} step "
                     f"(lr {self.outer_lr:.3g}, momentum {self.outer_momentum:.3g}; SlowMo)") + extra
        return (f"{self.exchange} gossip on {topo} every ~{self.mean_interval:.3g} steps, {self.lerp} lerp {a}, "
                f"winner bias {self.winner_bias:.3g}, {self.weighting} weighting{comp}{extra}")

    def _every(self) -> str:
        """``every N steps`` of the all-reduce and the outer steps (``every step`` at 1)."""
        n = max(1, round(self.mean_interval))
        return "every step" if n == 1 else f"every {n} steps"

    def _describe_extras(self, merges: bool = True) -> str:
        """The words for the fields beside the rule's own; without ``merges`` (no merging) none of what a merge
        does (its optimiser state, its buffers)."""
        parts = []
        gossip = self.scheme == "gossip"  # the peer's choice and the swap are a gossip pair's; other schemes carry them
        if self.similarity_bias and gossip:
            parts.append(f"prefers {'similar' if self.similarity_bias > 0 else 'dissimilar'} peers "
                         f"({self.similarity} bias {self.similarity_bias:.3g})")
        if self.data_exchange_k:
            which = "least confident" if not self.data_similarity_sign else (
                f"least or most confident by similarity (sign {self.data_similarity_sign:.3g})")
            unseen = ", unseen by the peer first" if self.data_unseen_first else ""
            parts.append(f"sends its {self.data_exchange_k} {which} examples{unseen}")
        if self.retire_threshold:
            parts.append(f"retires examples confident above {self.retire_threshold:.3g} "
                         f"(reserve rate {self.reserve_rate:.3g})")
        if self.swap_p and gossip:
            cond = "".join([f", by the peer's confidence ({self.swap_confidence:.3g})" if self.swap_confidence else "",
                            f", by recency ({self.swap_recency:.3g} steps)" if self.swap_recency else ""])
            parts.append(f"swaps models with p={self.swap_p:.3g}{cond}")
        if publishes(self):
            parts.append(f"decides from what the workers publish every {self.publish_every} steps")
        if self.backup_workers:
            parts.append(f"drops the {self.backup_workers} last to arrive at each all-reduce")
        if self.stop_tol:
            parts.append(f"stops when updates stay below {self.stop_tol:.3g} for {self.stop_patience} rounds")
        if self.optimizer_state != "keep" and merges:
            parts.append(f"optimiser state {'averaged' if self.optimizer_state == 'average' else 'reset'} on merge")
        if self.buffers != "average" and merges:
            parts.append("buffers kept local")
        return "".join(f", {p}" for p in parts)


# Values that mean "off" for fields that only apply with another field's value: the policy refuses
# them switched on elsewhere, and the search space switches them off where a sampled point has them.
COMPRESSION_OFF = {"topk_fraction": 1.0, "quantize_bits": 0}  # only with payload 'delta' or 'gradient'
COMPRESSED = ("delta", "gradient")
# payload 'gradient': the all-reduce of every step's gradient (synchronous data parallelism, compressed)
GRADIENT_NEEDS = {"scheme": "allreduce", "mean_interval": 1.0, "weighting": "uniform", "outer_optimizer": "none",
                  "fragments": 1, "backup_workers": 0, "optimizer_state": "keep"}
REGROUP_OFF = {"regroup_every": 0, "p_intra_schedule": "constant"}  # only with topology 'communities'
DATA_TRAVEL_OFF = {"data_unseen_first": False, "data_similarity_sign": 0.0}  # only with data_exchange_k
SWAP_OFF = {"swap_confidence": 0.0, "swap_recency": 0.0}  # only with swap_p
#: fields that only a gossip pair's merge reads (its peer's choice, its winner test): another scheme carries them
#: unused in every backend (a search that varies the scheme draws them for every trial), so what refuses them
#: refuses them on gossip. (Not swap_p, whose confidence-conditioned form draws the minibatches from a data pool, nor
#: regroup_every, which the in-process backend runs and charges bytes for, whatever the scheme.)
GOSSIP_ONLY = ("similarity_bias", "winner_bias", "score")
BACKUP_NEEDS = {"weighting": "uniform", "payload": "weights", "fragments": 1, "fragment_delay": 0,
                "optimizer_state": "keep", "mixing_weight": 1.0, "lerp": "fixed", "mixing_schedule": "constant"}
# what an outer step needs of the other fields (the workers restart from the anchor); the validator's rule
OUTER_NEEDS = {"mixing_weight": 1.0, "lerp": "fixed", "mixing_schedule": "constant", "payload": "weights"}
# Streaming DiLoCo's fields, off; and what streaming needs besides OUTER_NEEDS (supports and the optimiser's
# state are merged with the whole model, not per fragment)
STREAMING_OFF = {"fragments": 1, "fragment_delay": 0, "fragment_alpha": 0.0, "fragment_pattern": "contiguous"}
STREAMING_NEEDS = {"weighting": "uniform", "optimizer_state": "keep"}
ASYNC_OFF = {"momentum_every": 0, "local_steps_by_speed": False}  # asynchronous DiLoCo's own fields, off
ASYNC_NEEDS_CLOCK = ("'async' (asynchronous DiLoCo) runs on a simulated cluster only: its pushes arrive in the "
                     "order of their times; add an [environment], or use scheme gossip, allreduce or none")


def describe_policy(policy: dict, run: dict | None = None) -> str:
    """A stored policy (a dict) in words, and the run settings a trial searched with it (``; run.lr 0.0123``);
    "?" for a policy of a later schema, read by an older evomerge. (What takes no effect: :func:`no_effect`.)"""
    searched = "".join(f"; run.{k} {v:.3g}" for k, v in sorted((run or {}).items()))
    try:
        return MergePolicy.from_dict(policy).describe() + searched
    except Exception:
        return "?" + searched


#: fields that only a gossip merge reads: who the peer is, how the pair moves and what it sends besides
#: (not the swap's fields: a confidence-conditioned swap draws the minibatches from a data pool, whatever the scheme)
GOSSIP_FIELDS = ("topology", "degree", "n_communities", "p_intra", "p_intra_schedule", "p_intra_final", "exchange",
                 *GOSSIP_ONLY, "outer_every")


def no_effect(policy: dict) -> set[str]:
    """The fields of ``policy`` (a dict, a policy's ``to_dict()``) that take no effect in it, whatever their values:
    a gossip field off gossip (an all-reduce's ``topology``), ``degree`` off ``random_regular``, the communities'
    fields off ``communities``, a schedule's final value on a constant schedule, the outer step's settings without
    one. Not every inert field: the ones a reader takes for settings that matter (what a policy holds but does not
    do). Checked by runs (tests/test_policy.py): each set to another value, the same run, bit for bit."""
    d = {**MergePolicy().to_dict(), **policy}
    out = set()
    if d["scheme"] != "gossip":
        out.update(GOSSIP_FIELDS)
    if d["topology"] != "random_regular":
        out.add("degree")
    if d["topology"] != "communities":
        out.update(("n_communities", "p_intra", "p_intra_final", *REGROUP_OFF))
    if d["mixing_schedule"] == "constant":
        out.add("mixing_weight_final")
    if d["p_intra_schedule"] == "constant":
        out.add("p_intra_final")
    if d["outer_optimizer"] == "none" and d["scheme"] != "async":
        out.update(("outer_lr", "outer_momentum"))
    if d["retire_threshold"] == 0:
        out.add("reserve_rate")
    if d["stop_tol"] == 0:
        out.add("stop_patience")
    if not (d["scheme"] == "gossip" and d["winner_bias"]):
        out.add("score")
    if d["outer_optimizer"] == "none":
        out.add("outer_every")
    if d["payload"] not in COMPRESSED:
        out.update(COMPRESSION_OFF)
    if d["fragments"] == 1:  # (not its delay or alpha: a whole model streamed takes them)
        out.add("fragment_pattern")
    if d["scheme"] != "async":
        out.update(ASYNC_OFF)
    if not decides_by_state(SimpleNamespace(**d)):
        out.add("publish_every")
    if d["regroup_every"] and d["topology"] == "communities":  # (regrouped whatever the scheme: the communities are
        out -= {"topology", "n_communities"}                     # the run's, and its result's)
    if d["scheme"] == "none" and d["outer_optimizer"] == "none":
        out.update(("mean_interval", "mixing_weight", "mixing_schedule", "mixing_weight_final", "lerp", "payload",
                    "topk_fraction", "quantize_bits", "optimizer_state", "buffers"))
    return out


def decides_by_confidence(policy) -> bool:
    """Whether gossip swaps of ``policy`` are decided by the peer's data's confidence."""
    return policy.scheme == "gossip" and bool(policy.swap_p and policy.swap_confidence)


def decides_by_state(policy) -> bool:
    """Whether gossip events of ``policy`` are decided by the workers' state: peers or examples by similarity, swaps
    by the peer's confidence (what ``publish_every`` publishes). ``policy``: a MergePolicy, or any object with its
    fields (a search's sampled values over the fixed ones)."""
    return policy.scheme == "gossip" and bool(policy.similarity_bias
                                              or (policy.data_exchange_k and policy.data_similarity_sign)) \
        or decides_by_confidence(policy)


def publishes(policy: MergePolicy) -> int:
    """The local steps between publications of what ``policy``'s decisions read (``publish_every``); 0 where each
    decision reads the state at its instant, or where nothing is decided by the state."""
    return policy.publish_every if decides_by_state(policy) else 0


def switch_off_inapplicable(values: dict[str, Any], fixed: MergePolicy) -> dict[str, Any]:
    """``values`` (field -> value, over ``fixed``) with the fields that do not apply to the resulting
    policy set to off: compression without a delta payload, regrouping off communities, an outer step
    off the all-reduce, async and none schemes (none: each worker's own, Lookahead/SNOO) and SlowMo's gossip
    base (``outer_every``). With an outer step the workers restart from the anchor, so the fields
    of a lerp toward the mean do not apply and take the values the outer step needs (:data:`OUTER_NEEDS`);
    Nesterov with momentum 0 is the plain outer SGD step, and is written so."""
    out = dict(values)
    scheme = out.get("scheme", fixed.scheme)
    slowmo = scheme == "gossip" and out.get("outer_every", fixed.outer_every) > 0  # SlowMo over a gossip base
    if scheme not in ("allreduce", "async", "none") and not slowmo:
        out["outer_optimizer"] = "none"
    if scheme != "allreduce":
        out.update(STREAMING_OFF)
    if scheme != "async":
        out.update(ASYNC_OFF)
    else:  # the server's step is an outer step
        out.update(OUTER_NEEDS | STREAMING_NEEDS)
        if out.get("outer_optimizer", fixed.outer_optimizer) == "none":
            out["outer_optimizer"] = "nesterov"
    outer = out.get("outer_optimizer", fixed.outer_optimizer)
    if any(out.get(k, getattr(fixed, k)) != off for k, off in STREAMING_OFF.items()):
        out.update(OUTER_NEEDS | STREAMING_NEEDS)
        H = max(1, round(out.get("mean_interval", fixed.mean_interval)))
        k = min(out.get("fragments", fixed.fragments), H)
        out["fragments"] = k
        out["fragment_delay"] = min(out.get("fragment_delay", fixed.fragment_delay), (H - 1) // k)
    if outer != "none" and scheme not in ("none", "gossip"):  # Lookahead / SNOO lerps toward no mean, SlowMo's
        out.update(OUTER_NEEDS)  # gossip merges are lerps of their own: those fields stay as they are
    if outer == "none" or scheme != "gossip":
        out["outer_every"] = 0
    elif slowmo:  # SlowMo's exact average is of the models
        out["payload"] = "weights"
    if outer == "nesterov" and out.get("outer_momentum", fixed.outer_momentum) == 0:
        out["outer_optimizer"] = "sgd"
    if out.get("payload", fixed.payload) == "gradient":  # an all-reduce of every step's gradient, or no gradients
        if scheme == "allreduce":
            out.update(GRADIENT_NEEDS | STREAMING_OFF)
        else:
            out["payload"] = "weights"
    if out.get("payload", fixed.payload) not in COMPRESSED:
        out.update(COMPRESSION_OFF)
    if out.get("topology", fixed.topology) != "communities":
        out.update(REGROUP_OFF)
    if not out.get("data_exchange_k", fixed.data_exchange_k):
        out.update(DATA_TRAVEL_OFF)
    if not out.get("swap_p", fixed.swap_p):
        out.update(SWAP_OFF)
    state = ("scheme", "similarity_bias", "data_exchange_k", "data_similarity_sign", "swap_p", "swap_confidence")
    if not decides_by_state(SimpleNamespace(**{k: out.get(k, getattr(fixed, k)) for k in state})):
        out["publish_every"] = 0  # nothing decided by the state: nothing to publish
    if out.get("backup_workers", fixed.backup_workers) and (
            scheme != "allreduce" or any(out.get(k, getattr(fixed, k)) != v for k, v in BACKUP_NEEDS.items())):
        out["backup_workers"] = 0
    return out


def inert_fields(space, fixed: MergePolicy, most: int = 4096) -> dict[str, Any]:
    """The searched policy fields of ``space`` (a study's ``Param``s) that :func:`switch_off_inapplicable` sets to
    one value whatever the space gives (``outer_optimizer`` searched over a gossip scheme with ``outer_every`` 0:
    'none' in every trial), each with that value: a dimension the sampler spends for nothing. Judged on the space's
    corners and midpoints (every combination, or ``most`` of them drawn with a fixed seed)."""
    import itertools
    import math as _math
    import random

    params = [p for p in space if p.name in MergePolicy.__pydantic_fields__]
    if not params:
        return {}

    def values(p) -> list:
        if p.kind == "categorical":
            return list(p.choices)
        if p.kind == "int":
            return sorted({int(p.low), int(p.high), round((p.low + p.high) / 2)})
        mid = _math.sqrt(p.low * p.high) if p.kind == "log-float" and p.low > 0 else (p.low + p.high) / 2
        return sorted({float(p.low), float(p.high), float(mid)})

    grids = [values(p) for p in params]
    if _math.prod(len(g) for g in grids) <= most:
        combos = itertools.product(*grids)
    else:
        rng = random.Random(0)
        combos = ([rng.choice(g) for g in grids] for _ in range(most))
    seen: dict[str, set] = {p.name: set() for p in params}
    open_ = {p.name for p, g in zip(params, grids) if len(set(g)) > 1}  # fields not yet seen to take two values
    for combo in combos:
        out = switch_off_inapplicable(dict(zip((p.name for p in params), combo)), fixed)
        for name in list(open_):
            seen[name].add(out[name])
            if len(seen[name]) > 1:
                open_.discard(name)
        if not open_:  # (most studies: every field takes effect, seen within a few combinations)
            break
    return {name: next(iter(seen[name])) for name in open_}


# -- rules that need the number of workers ------------------------------------------------
def possible_degree(degree: int, workers: int) -> int:
    """The random-regular degree nearest ``degree`` (from below where one exists) that ``workers`` can
    have: fewer than the workers, and degree * workers even."""
    if workers < 2:
        return degree
    d = min(degree, workers - 1)
    if (d * workers) % 2:
        d -= 1
    return max(d, 1 if workers % 2 == 0 else 2)


def possible_communities(n_communities: int, workers: int) -> int:
    """At most one community per worker."""
    return max(1, min(n_communities, workers))


WORKER_BOUND = {"degree": possible_degree, "n_communities": possible_communities}
TOPOLOGY_OF = {"degree": "random_regular", "n_communities": "communities"}  # where each bound field applies


def fit_to_workers(values: dict[str, Any], workers: int) -> dict[str, Any]:
    """``values`` with ``degree`` and ``n_communities`` (where present) moved to the nearest value
    ``workers`` allow."""
    return {k: WORKER_BOUND[k](v, workers) if k in WORKER_BOUND else v for k, v in values.items()}


# policy fields a run on a simulated cluster ([environment]) does not run yet, and why
TIMED_UNSUPPORTED: dict[str, str] = {}


def check_timed(policy: MergePolicy, where: str = "policy") -> None:
    """One line naming a policy field the simulated clock cannot run."""
    defaults = MergePolicy()
    for name, why in TIMED_UNSUPPORTED.items():
        if getattr(policy, name) != getattr(defaults, name):
            raise ConfigError(f"{where}.{name}", f"cannot run with an [environment]: {why}; allowed: "
                                                 f"{getattr(defaults, name)!r} (or a study without [environment])")


def check_backup_workers(policy: MergePolicy, workers: int, where: str = "policy") -> None:
    """Refuse ``backup_workers`` that would leave no worker in an all-reduce (the clock's rule too)."""
    if policy.backup_workers and policy.backup_workers >= workers:
        raise ConfigError(f"{where}.backup_workers", f"{policy.backup_workers} with {workers} workers; allowed: "
                                                     f"0..{workers - 1}")


def check_workers(policy: MergePolicy, workers: int, where: str = "policy") -> None:
    """Refuse, in one line, a policy that cannot run on ``workers`` workers (checked before any data is read)."""
    check_backup_workers(policy, workers, where)
    if policy.scheme != "gossip" or workers < 2:
        return
    if policy.topology == "random_regular" and possible_degree(policy.degree, workers) != policy.degree:
        # (a policy that leaves degree out has the default: said, so that its user knows what to set)
        default = " (the default)" if policy.degree == MergePolicy.__pydantic_fields__["degree"].default else ""
        raise ConfigError(f"{where}.degree", f"{policy.degree}{default} with {workers} workers is impossible; "
                                             "allowed: degree < workers and degree * workers even, e.g. "
                                             f"{possible_degree(policy.degree, workers)}")
    if policy.topology == "communities" and policy.n_communities > workers:
        raise ConfigError(f"{where}.n_communities", f"{policy.n_communities} is out of range; "
                                                    f"allowed: [1, {workers}] for {workers} workers")


def workers_needed(policy: MergePolicy) -> str | None:
    """In words, the numbers of workers the policy's topology runs on (None: any): what :func:`check_workers`
    refuses, said before a launch."""
    if policy.scheme != "gossip":
        return None
    if policy.topology == "random_regular":
        d = policy.degree
        return f"at least {d + 1} workers" + (", an even number" if d % 2 else "")
    if policy.topology == "communities" and policy.n_communities > 1:
        return f"at least {policy.n_communities} workers"
    return None


# -- what other code reads from the model ---------------------------------------------------
def field_specs() -> dict[str, dict[str, Any]]:
    """Name -> kind (choice, int, float), range, choices and doc of every searchable policy field,
    read from the model."""
    out = {}
    for name, info in MergePolicy.__pydantic_fields__.items():
        if name in ("name", "schema_version"):
            continue
        choice = settings.choice_of(info)
        low, high, low_open, _ = settings.bounds(info)
        kind = "choice" if choice else {int: "int", float: "float"}.get(info.annotation, "str")
        out[name] = {"kind": kind, "doc": info.description, "low": low, "high": high, "low_open": low_open,
                     "choices": choice.names if choice else None}
    return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy file, generated from the model."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(MergePolicy).json_schema()
    for p in schema["properties"].values():
        p.pop("title", None)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://evomerge.dev/schema/policy-v{SCHEMA_VERSION}.json",
        "title": "evomerge merge policy",
        "description": MergePolicy.__doc__,
        "type": "object",
        "properties": schema["properties"],
        "additionalProperties": False,
    }


def parse_json(text: str, where: str) -> Any:
    if not text.strip():
        raise ConfigError(where, "empty file; expected a JSON object")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # ("Unterminated string starting at" is a sentence its position ends)
        raise ConfigError(where, f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None


def policy_hint(ref: str | Path, named) -> str:
    """``; did you mean X?`` for a policy reference that names nothing: the nearest of the ``named`` policies, else,
    for a path, the JSON file beside it whose name is nearest (best.json for bset.json); nothing when none is close."""
    from .errors import did_you_mean, nearest

    hint = did_you_mean(str(ref), named)
    ref = str(ref)
    if hint or not ref.strip() or ("/" not in ref and not ref.endswith(".json")):  # (a bare name: a named policy)
        return hint
    folder = Path(ref).parent
    try:  # (by the names before .json: the suffix they share made nope.json near p.json)
        stems = sorted(f.stem for f in itertools.islice(folder.glob("*.json"), 500))
    except OSError:
        return ""
    near = nearest(Path(ref).stem, [x for x in stems if x != Path(ref).stem])  # (a folder named x.json: not itself)
    return f"; did you mean {folder / (near + '.json')}?" if near else ""


def read_json_file(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), f"cannot read: {e}") from None
    return parse_json(text, str(path))


def check_not_a_broken_export(data: Any, where: str) -> None:
    """A ConfigError naming ``where`` for an exported file (it has ``trial`` and ``study``) that lost its ``policy``
    key (a typo: it was read as a policy, and its first export key named as unknown)."""
    if isinstance(data, dict) and "trial" in data and "study" in data and "policy" not in data:
        from .errors import nearest

        typo = next((k for k in data if isinstance(k, str) and nearest(k, ["policy"])), None)
        raise ConfigError(where, "an exported file (it has 'trial' and 'study') with no 'policy' key; allowed: the "
                                 "policy under 'policy', as evomerge export writes it"
                                 + (f"; did you mean 'policy' for {typo!r}?" if typo else ""))


def read_export(path: str | Path) -> dict | None:
    """The metadata of an exported file (``evomerge export``: the policy plus study, trial, seeds and their
    metrics), or None for a plain policy file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and "policy" in data and "trial" in data):
        return None
    fmt = data.get("format", 1)
    if not isinstance(fmt, int) or isinstance(fmt, bool) or not 1 <= fmt <= EXPORT_FORMAT:
        newer = isinstance(fmt, int) and not isinstance(fmt, bool) and fmt > EXPORT_FORMAT
        raise ConfigError("export.format", f"{json.dumps(fmt)} in {path} "
                          + (f"is newer than this evomerge reads; allowed: 1 to {EXPORT_FORMAT} (a newer evomerge "
                             "wrote it)" if newer else f"is not an export format; allowed: 1 to {EXPORT_FORMAT}"))
    if "run" in data:
        from .study import check_found_run

        check_found_run(data["run"])
    return data
