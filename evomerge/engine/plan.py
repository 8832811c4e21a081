"""The plan of a step's merges: which events, grouped how, with what weights and bytes.

Pure functions of the policy, the schedule and the seed, shared by every backend, so a
backend only decides how the tensors move.

Grouping: the events due after one local step are split into *sets of disjoint pairs*.
An event goes into the first set after the last one that already holds one of its two
workers, so events that share a worker keep their schedule order, and events in one set
touch different workers: applying a set all at once gives exactly what applying its
events one by one gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import ops
from .. import registry
from ..errors import ConfigError
from ..policy import MergePolicy, decides_by_confidence, publishes  # noqa: F401  (publishes: for the engine)
from .schedule import STREAMS, rng_for

TAG_QUANT = STREAMS["quant"]


def group_disjoint(initiators, peers) -> list[list[int]]:
    """Positions of the events, grouped into sets in which no worker appears twice.

    Events that share a worker stay in their order (a later event lands in a later set);
    the sets are listed in the order they must be applied.
    """
    last: dict[int, int] = {}  # worker -> index of the last set that touches it
    sets: list[list[int]] = []
    for i, (a, b) in enumerate(zip(initiators, peers)):
        a, b = int(a), int(b)
        k = max(last.get(a, -1), last.get(b, -1)) + 1
        if k == len(sets):
            sets.append([])
        sets[k].append(i)
        last[a] = last[b] = k
    return sets


@dataclass(frozen=True)
class PairSet:
    """Gossip events on disjoint pairs, applied together.

    ``events`` index the schedule; ``a`` are the initiators and ``b`` their peers (resolved:
    peers drawn during the run are already drawn); ``weight`` is the scheduled mixing weight
    at this step and ``u`` the events' uniform draws for the random lerp. ``swap`` marks the
    events that swap the two models instead of merging them.
    """

    step: int
    events: np.ndarray
    a: np.ndarray
    b: np.ndarray
    u: np.ndarray
    swap: np.ndarray
    weight: float

    def __len__(self) -> int:
        return len(self.events)

    def only(self, mask: np.ndarray) -> "PairSet":
        return PairSet(self.step, self.events[mask], self.a[mask], self.b[mask], self.u[mask], self.swap[mask], self.weight)


OUTER_AVERAGE = -1  # the event number of SlowMo's exact average over a gossip base (not a schedule event)


def compressed_outer(policy: MergePolicy) -> bool:
    """DiLoCo's outer gradients compressed: a delta payload with an outer step on the all-reduce scheme."""
    return policy.scheme == "allreduce" and policy.outer_optimizer != "none" and policy.payload == "delta"


def slowmo_due(policy: MergePolicy, step: int) -> bool:
    """SlowMo over a gossip base: whether the exact average and the outer step follow local step ``step``."""
    return policy.scheme == "gossip" and policy.outer_every > 0 and step % policy.outer_every == 0


def refuse_compressed_outer_buffers(policy: MergePolicy, buffers: list[str]) -> None:
    """Compressed outer gradients on a model with buffers (``buffers``: their names) are not built: one line."""
    if compressed_outer(policy) and buffers:
        raise ConfigError("policy.payload", f"'delta' with an outer step on a model with buffers ({buffers[0]!r}) is "
                                            "not built yet; allowed: weights, or a model without buffers")


def own_outer_every(policy: MergePolicy) -> int:
    """Lookahead / SNOO (``scheme = "none"`` with an outer step): each worker takes its own outer step after every
    this many of its local steps; 0 for every other policy."""
    if policy.scheme == "none" and policy.outer_optimizer != "none":
        return max(1, round(policy.mean_interval))
    return 0


def steps_by_speed(H: int, step_times) -> list[int]:
    """Asynchronous DiLoCo's dynamic local updates: each worker's local steps per push, ``H`` for the fastest and
    scaled by its speed for the others (``step_times``: each worker's time per step, any unit), at least 1."""
    fastest = min(float(x) for x in step_times)
    return [max(1, round(H * fastest / float(x))) for x in step_times]


def scheduled_weight(policy: MergePolicy, step: int, total: int) -> float:
    """The mixing weight ``a`` at ``step`` of ``total`` local steps (policy.mixing_schedule)."""
    return ops.scheduled_weight(policy.mixing_weight, policy.mixing_weight_final, policy.mixing_schedule, step / total)


def allreduce_weight(policy: MergePolicy, step: int, total: int, u: float) -> float:
    """How far every worker moves towards the average in an all-reduce event (Streaming DiLoCo's
    ``lerp(global, local, alpha)``: ``1 - fragment_alpha`` of the way, its mixing weight being 1)."""
    w = scheduled_weight(policy, step, total) * (u if policy.lerp == "random" else 1.0)
    return w * (1.0 - policy.fragment_alpha) if policy.fragment_alpha else w


def winner(loss_a: float, loss_b: float) -> int:
    """The winner-biased lerp's comparison: 0 if the initiator's loss is not higher, else 1."""
    return 0 if loss_a <= loss_b else 1


def moves(policy: MergePolicy, weight: float, u: float, winner_: int | None) -> tuple[float, float]:
    """How far (initiator, peer) move towards each other in one event (see :func:`ops.pair_moves`)."""
    return ops.pair_moves(weight, u, policy.winner_bias, policy.lerp == "random", winner_)


def swap_chance(policy, confidence: float | None, age: float) -> float:
    """The chance that a gossip event swaps the two models instead of merging them: ``swap_p``, conditioned on the
    peer's model's confidence on its data (``confidence``, None before it has any: not conditioned) and on ``age``,
    the local steps since the initiator's model last held the peer's data (inf: never)."""
    p = policy.swap_p
    if policy.swap_confidence and confidence is not None:
        p *= 1.0 + policy.swap_confidence * (2.0 * confidence - 1.0)
    if policy.swap_recency:
        p *= 1.0 if math.isinf(age) else -math.expm1(-age / policy.swap_recency)
    return min(max(p, 0.0), 1.0)


def quant_generator(seed: int, event: int, side: int) -> torch.Generator:
    """The stochastic-rounding noise of one payload: side 0 is the initiator's, 1 the peer's
    (an all-reduce uses the worker's index); every backend draws the same numbers."""
    return torch.Generator().manual_seed(int(rng_for(seed, TAG_QUANT, event, side).integers(2**62)))


class Bytes:
    """What merges cost on the wire, charged by the engine for every backend.

    A weights payload is 4 bytes per parameter; a delta payload is what
    :func:`ops.payload_bytes` says for its compression, sent to every topology neighbour
    of the sender (they all keep its public copy). An all-reduce charges each worker its
    upload plus the dense average back; a swap two full transfers. Averaging the optimiser's
    state (``optimizer_state = "average"``) sends it densely with each merge, both ways in an
    all-reduce.
    """

    def __init__(self, policy: MergePolicy, n_params: int, neighbours: list[int] | None, state_stacks: int = 0,
                 model=None, example_bytes: int = 0, similarity_bytes: int = 0):
        self.p = policy
        self.similarity = similarity_bytes  # one worker's sketch (or CKA logits), for peers or examples by similarity
        # data that travels: the initiator's k examples ride with its gossip payload (a simulated clock charges k;
        # a worker holding k active examples or fewer sends fewer, as the lockstep run counts them)
        self.data = policy.data_exchange_k * example_bytes if policy.scheme == "gossip" else 0
        # Streaming DiLoCo: an all-reduce of fragment j sends that fragment's numbers only
        self.fragments = fragments_of(policy, model) if model is not None and policy.fragments > 1 else None
        payload = registry.PAYLOADS.get_object(policy.payload)()
        # per fragment (dense bytes, bytes sent): a compressed outer gradient sends the fragment compressed
        sizes = [] if self.fragments is None else [sum(model.offsets[k][1] for k in blocks) for blocks in self.fragments]
        self.fragment_bytes = None if self.fragments is None else [ops.payload_bytes(n) for n in sizes]
        self.fragment_sent = None if self.fragments is None else [payload.wire_bytes(n, policy) for n in sizes]
        weighting = registry.WEIGHTINGS.get_object(policy.weighting)()
        self.dense = ops.payload_bytes(n_params)
        self.sent = payload.wire_bytes(n_params, policy)
        self.fans_out = payload.public  # peers keep the sender's public copy: it goes to every neighbour
        self.neighbours = neighbours
        # optimizer_state "average": the optimiser's state (state_stacks rows, dense) goes with each merge
        self.state = state_stacks * self.dense if policy.optimizer_state == "average" else 0
        # per-coordinate supports (adaptive weighting) travel with each gossip payload, dense
        self.supports = self.dense if weighting.accumulators else 0
        # a weighted all-reduce of weights sums three rows: the supported models, the supports and the plain models
        # (kernel.reduced_average); a delta payload's all-reduce gathers the changes instead
        self.rows = 3 if (weighting.accumulators or weighting.by_examples) and not payload.public else 1

    def fan(self, w: int) -> int:
        return self.neighbours[w] if self.fans_out else 1

    def message(self, w: int) -> int:
        """The bytes worker ``w`` sends for one gossip payload: the payload with its supports and optimiser state
        (what the runtime packs into one message), to each neighbour when peers keep its public copy."""
        return (self.sent + self.supports + self.state) * self.fan(w)

    def pair(self, a: int, b: int) -> int:
        """A gossip merge: the initiator's payload, and the peer's too for push-pull."""
        out = self.message(a)
        if self.p.exchange == "push_pull":
            out += self.message(b)
        return out

    def swap(self) -> int:
        return 2 * self.dense

    def gather(self, workers: int) -> int:
        """A decision by similarity (a peer, or which examples travel): the initiator takes every other worker's
        sketch at the event."""
        return (workers - 1) * self.similarity

    def publish(self, workers: int) -> int:
        """One publication (``publish_every``): every worker's sketch (or CKA logits), and its data's confidence
        (float32) where swaps are decided by it, to every other worker."""
        sim = self.similarity if gathers_similarity(self.p) else 0
        conf = 4 if decides_by_confidence(self.p) else 0
        return workers * (workers - 1) * (sim + conf)

    def regroup(self, workers: int) -> int:
        return regroup_bytes(workers, self.similarity)

    def allreduce(self, workers: int, fragment: int | None = None) -> int:
        if fragment is not None and self.fragment_bytes is not None:  # optimiser state kept, uniform weights
            return workers * (self.fragment_sent[fragment] + self.fragment_bytes[fragment])
        return workers * ((self.sent + self.dense) * self.rows + 2 * self.state)

    def allreduce_sizes(self, fragment: int | None) -> tuple[float, float]:
        """What one worker sends into an all-reduce of ``fragment`` (None: the whole model) and the dense average it
        takes back, in bytes (times the rows a weighted all-reduce sums): the clock's ring all-reduce of these."""
        if fragment is None or self.fragment_bytes is None:
            return float(self.sent * self.rows), float(self.dense * self.rows)
        return float(self.fragment_sent[fragment]), float(self.fragment_bytes[fragment])


def gathers_similarity(policy: MergePolicy) -> bool:
    """Whether each gossip event of ``policy`` is decided with the workers' similarity (its peer, or which examples
    travel): the initiator gathers every other worker's sketch for it (:meth:`Bytes.gather`), or, with
    ``publish_every``, reads the sketches last published (:meth:`Bytes.publish`)."""
    return policy.scheme == "gossip" and bool(policy.similarity_bias
                                              or (policy.data_exchange_k and policy.data_similarity_sign))


def gathers_per_event(policy: MergePolicy) -> bool:
    """Whether each decision by similarity gathers every other worker's sketch at its instant (no ``publish_every``)."""
    return gathers_similarity(policy) and not publishes(policy)


def regroup_bytes(workers: int, similarity_bytes: int) -> int:
    """Regrouping self-forming communities: every other worker's sketch to one, and the groups (int64) back."""
    return (workers - 1) * (similarity_bytes + 8 * workers)


def similarity_bytes(policy: MergePolicy, n_outputs: int) -> int:
    """One worker's similarity on the wire, for a policy that decides by similarity or regroups (else 0)."""
    from .similarity import wire_bytes

    if gathers_similarity(policy) or (policy.scheme == "gossip" and policy.regroup_every):
        return wire_bytes(policy.similarity, n_outputs)
    return 0


def costs(setup, policy: MergePolicy, neighbours: list[int] | None, state_stacks: int) -> "Bytes":
    """The :class:`Bytes` of a run of ``policy`` on ``setup`` (its model, its examples, its similarity)."""
    return Bytes(policy, setup.model.n_params, neighbours, state_stacks, setup.model,
                 example_bytes(setup.data.train_x), similarity_bytes(policy, setup.data.n_classes))


def example_bytes(train_x: torch.Tensor) -> int:
    """What one training example costs on the wire when data travels: its values as stored, and a label byte."""
    return train_x[0].numel() * train_x.element_size() + 1


def fragments_of(policy: MergePolicy, model) -> list[list[int]]:
    """The blocks of each of the policy's fragments (Streaming DiLoCo) on ``model``: :func:`kernel.fragment_blocks`,
    refused in one line naming ``policy.fragments`` when the model has fewer parameter tensors."""
    from . import kernel

    layers = kernel.layer_ids([name for name, _ in model.layout][:model.n_trained_blocks])
    try:
        return kernel.fragment_blocks([n for _, n in model.offsets], model.n_trained_blocks, policy.fragments,
                                      policy.fragment_pattern, layers)
    except ValueError:
        if policy.fragment_pattern == "strided":
            raise ConfigError("policy.fragments", f"{policy.fragments} strided fragments is more than the model's "
                                                  f"{max(layers) + 1} layers; allowed: 1..{max(layers) + 1}") from None
        raise ConfigError("policy.fragments", f"{policy.fragments} is more than the model's "
                                              f"{model.n_trained_blocks} parameter tensors; allowed: 1.."
                                              f"{model.n_trained_blocks}") from None
