"""Weightings and payloads: the registered rules (``registry.WEIGHTINGS``, ``registry.PAYLOADS``) that the
merge kernel (:mod:`.kernel`) applies, on every path; no other code compares their names.

A weighting turns each receiver's move ``a`` into the weight on the incoming model,
from the two workers' supports (``ops.incoming_weight``): none, examples seen (counters
summed on merge) or per-coordinate squared-gradient accumulators (summed on merge).
A payload says what a worker puts on the wire: its weights, or its compressed change
since its public copy (VW's model_delta with CHOCO's public copies). A new rule is a
small class registered under a new name; the policy accepts the name at once.
"""

from __future__ import annotations

import numpy as np
import torch

from . import kernel, ops
from . import plan as plan_mod
from .state import Workers


class Weighting:
    """How supports weight a merge."""

    #: whether workers keep per-coordinate accumulators (summed on merge)
    accumulators = False
    #: whether models are weighted by the examples their workers have seen
    by_examples = False

    def pair_weights(self, st: Workers, move: list[float], own: np.ndarray, incoming: np.ndarray):
        """The weight on the incoming model for receivers ``own`` merging the rows ``incoming``: a ``[k, 1]``
        column, or one ``[k, n]`` tensor per parameter block. A rule overrides :meth:`incoming_weights` (and,
        for a column, :meth:`column`), which every path asks (sets of pairs, a clock's landings, the distributed
        ranks), not this."""
        acc = [blk.index_select(0, torch.as_tensor(incoming, device=blk.device)) for blk in st.accum.blocks] \
            if self.accumulators else None
        return self.incoming_weights(st, move, own, ops.counts(st.examples)[incoming].tolist(), acc)

    def pair_column(self, st: Workers, move: list[float], own: np.ndarray, incoming: np.ndarray) -> list[float]:
        """:meth:`pair_weights` of a column rule as numbers (a population weighs every member's pairs into one
        column); only for rules without accumulators."""
        return self.column(st, move, own, ops.counts(st.examples)[incoming].tolist())

    def column(self, st: Workers, move: list[float], own: np.ndarray, examples: list[float],
               examples_of=None) -> list[float]:
        """The weights of a column rule (no accumulators), as numbers: here the moves themselves."""
        return list(move)

    def incoming_weights(self, st: Workers, move: list[float], own: np.ndarray, examples: list[float], accum,
                         examples_of=None):
        """:meth:`pair_weights` with the incoming side's supports given: its example counters, and its
        accumulators as one ``[k, n]`` tensor per block (a payload's, when it was sent). ``own`` are rows
        of ``st``; ``examples_of``: the receivers' worker numbers in the counters, if not ``own``."""
        w = self.column(st, move, own, examples, examples_of)
        return torch.tensor(w, dtype=torch.float32, device=st.params.device).unsqueeze(1)

    def supports(self, st: Workers) -> list:
        """Per parameter block, the supports an all-reduce averages with (None: a plain mean)."""
        return [None] * len(st.params.blocks)


class Uniform(Weighting):
    """A plain lerp."""


class Examples(Weighting):
    """Weighted by examples seen (VW's merge: counters summed, not averaged)."""

    by_examples = True

    def column(self, st, move, own, examples, examples_of=None):
        ex = ops.counts(st.examples)
        mine = own.tolist() if examples_of is None else examples_of
        return [ops.incoming_weight(m, float(ex[i]), e) for m, i, e in zip(move, mine, examples)]

    def supports(self, st):
        return [st.examples] * len(st.params.blocks)


class Adaptive(Weighting):
    """Per coordinate, by the workers' squared-gradient accumulators (VW's save_resume merge)."""

    accumulators = True

    def incoming_weights(self, st, move, own, examples, accum, examples_of=None):
        dev = st.params.device
        a = torch.tensor(move, dtype=torch.float32, device=dev).unsqueeze(1)
        rest = torch.tensor([1.0 - m for m in move], dtype=torch.float32, device=dev).unsqueeze(1)  # as ops computes it
        I = torch.as_tensor(own, device=dev)
        # every block in one piece (the rule is elementwise): a few kernels per set of pairs, not a few per block
        blocks = st.accum.blocks
        s_own = torch.cat([blk.index_select(0, I) for blk in blocks], 1) if len(blocks) > 1 else blocks[0].index_select(0, I)
        s_in = torch.cat(list(accum), 1) if len(blocks) > 1 else accum[0]
        num = a * s_in
        den = num + rest * s_own
        out = torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), a)
        return list(out.split([blk.shape[1] for blk in blocks], 1))

    def supports(self, st):
        return st.accum.blocks


class Payload:
    """What a worker sends."""

    #: whether peers keep each worker's public copy (the base its deltas apply to): the payload then goes to
    #: every topology neighbour of the sender, and travels encoded (``ops.encode``)
    public = False
    #: whether it carries a model to merge (gossip, model all-reduce); the gradient payload does not
    models = True

    def wire_bytes(self, n: int, policy) -> int:
        """Bytes on the wire for one payload of ``n`` float32 values."""
        return ops.payload_bytes(n)

    def outgoing(self, st: Workers, policy, seed: int, workers: np.ndarray, events: np.ndarray, side) -> torch.Tensor | None:
        """The models the receivers merge with, as rows ``[k, P]``; None: the senders' current rows."""
        return None


class Weights(Payload):
    """The model itself."""


class Delta(Payload):
    """The change since the sender's public copy, compressed (top-k, stochastic rounding); what was
    not sent stays in ``params - public`` (error feedback). The receiver merges with ``public + sent``."""

    public = True

    def wire_bytes(self, n, policy):
        return ops.payload_bytes(n, policy.topk_fraction, policy.quantize_bits)

    def outgoing(self, st, policy, seed, workers, events, side):
        out = []
        sides = side if isinstance(side, (list, tuple)) else [side] * len(workers)
        for w, ev, sd in zip(workers.tolist(), events.tolist(), sides):
            base = st.base.row(w)
            gen = plan_mod.quant_generator(seed, ev, sd) if policy.quantize_bits else None
            sent = ops.compress(kernel.delta_to_send(st.params.row(w), base, st.unsent), policy.topk_fraction,
                                policy.quantize_bits, gen)
            public = ops.apply_delta(base, sent)
            st.base.set_row(w, public)
            out.append(public)
        return torch.stack(out)


class Gradient(Payload):
    """Every local step's gradient, compressed as a delta is (top-k, stochastic rounding or scaled sign) with error
    feedback, all-reduced before every worker's update (:func:`kernel.gradient_average_`); no model is sent."""

    models = False

    def wire_bytes(self, n, policy):
        return ops.payload_bytes(n, policy.topk_fraction, policy.quantize_bits)

