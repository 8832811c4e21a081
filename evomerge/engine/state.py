"""The workers' training state: every piece has a merge rule (VW's rule).

Rows of stacked tensors (one :class:`models.Stack` each, block layout): parameters (a model's
buffers follow its parameters in the same rows), gradients, the optimiser's state
(:mod:`.optim`: merged by ``policy.optimizer_state``), per-coordinate accumulators (adaptive weighting: summed on merge),
public copies (delta payloads: what peers hold of each worker), and what merges changed
in the current round; plus the example counters (summed on merge) of all workers.
A backend holds the rows of the workers it owns (all of them in one process).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import models as models_mod
from .. import registry
from ..policy import MergePolicy
from .schedule import STREAMS, rng_for
from . import kernel
from .optim import Optimizer

TAG_INIT = STREAMS["init"]


def initial_row(model: models_mod.StackedModel, seed: int) -> torch.Tensor:
    """The parameters every worker starts from (one flat row), drawn from the run seed."""
    return model.init(torch.Generator().manual_seed(int(rng_for(seed, TAG_INIT).integers(2**62))))


class Workers:
    """Mutable state of ``rows`` workers during one run (of ``workers`` in all)."""

    outer = None  # the outer optimiser (kernel.Outer), when the policy has one
    #: how many times the supports were scaled down (:func:`kernel.rescale_supports`)
    support_epoch = 0

    def __init__(self, model: models_mod.StackedModel, run, policy: MergePolicy, seed: int, device: torch.device,
                 rows: int | None = None, public: bool = True):
        workers = run.workers
        self.W, self.P = rows or workers, model.n_params
        self.params = model.stack(self.W, device)
        self.params.set_rows(initial_row(model, seed).to(device).unsqueeze(0).expand(self.W, -1))
        self.grad = self.params.like()
        self.optim = Optimizer(run, self.params)
        self.momentum = self.optim.momentum  # SGD's momentum (None for Adam, or without momentum)
        accumulators = registry.WEIGHTINGS.get_object(policy.weighting).accumulators
        self.accum = self.params.like() if accumulators else None
        # example counters of every worker: a function of the schedule alone, so every backend keeps all of them; on
        # the host, where the merges' Python reads and adds them one pair at a time (on a GPU each would be a kernel
        # and a read back); a weighted average takes them to the parameters' device (ops.weighted_average)
        self.examples = torch.zeros(workers, dtype=torch.float64)
        self.base = self.params.clone() if registry.PAYLOADS.get_object(policy.payload).public and public else None
        # the blocks a delta payload leaves out (counters, buffers kept local): once per run, not per send
        self.unsent = kernel.unsent(kernel.block_rules(model, policy.buffers), model.offsets)
        self.merge_change = self.params.like()  # what merges and swaps changed in this round
        self.model_at = np.arange(self.W)  # swaps move models between workers
        # payload "gradient": a local step leaves its gradient for the all-reduce, which updates (error feedback kept)
        self.deferred = policy.payload == "gradient"
        self.residual = self.params.like() if self.deferred else None
        self.fused = fusable(run, self.accum is not None) and not self.deferred
        self.score, self.score_weight = _scores(self.W, device)  # the running score (policy.score)
        # DiLoCo's anchor: the start (Lookahead / SNOO: each worker's own)
        self.outer = kernel.outer_for(policy, model, lambda: self.params.row(0), self.params.rows)

    @classmethod
    def population(cls, model: models_mod.StackedModel, run, starts: list[torch.Tensor], accumulators: bool,
                   device: torch.device) -> "Workers":
        """What a population's local step reads and writes: the rows of ``len(starts)`` runs of
        ``run.workers`` workers each (run k's rows start from ``starts[k]``), stacked as one state;
        :meth:`member` gives each run its rows."""
        W = run.workers
        st = object.__new__(cls)
        st.W, st.P = W * len(starts), model.n_params
        st.params = model.stack(st.W, device)
        for k, row in enumerate(starts):
            models_mod.Stack.view(st.params, k * W, (k + 1) * W).set_rows(row.to(device).unsqueeze(0).expand(W, -1))
        st.grad = st.params.like()
        st.optim = Optimizer(run, st.params)
        st.momentum = st.optim.momentum
        st.accum = st.params.like() if accumulators else None
        st.merge_change = st.params.like()  # each run's rows of it are its own (views), zeroed every round
        st.examples, st.base, st.model_at = None, None, None
        st.fused = fusable(run, accumulators)
        st.score, st.score_weight = _scores(st.W, device)
        return st

    def member(self, lo: int, hi: int, policy: MergePolicy, run, public: bool = True) -> "Workers":
        """Rows ``lo..hi-1`` of a :meth:`population` state as one run's state: what a local step touches
        is shared with the population (views); the rest (counters, public copies, merge changes) is the run's own."""
        st = object.__new__(Workers)
        st.W, st.P, st.fused = hi - lo, self.P, self.fused
        st.point_at(self, lo, hi)
        accumulators = registry.WEIGHTINGS.get_object(policy.weighting).accumulators
        if accumulators and st.accum is None:
            raise ValueError(f"weighting {policy.weighting!r} needs a population state with accumulators")
        if not accumulators:
            st.accum = None
        st.examples = torch.zeros(run.workers, dtype=torch.float64)  # on the host, as in __init__
        st.base = st.params.clone() if registry.PAYLOADS.get_object(policy.payload).public and public else None
        st.unsent = kernel.unsent(kernel.block_rules(self.params.model, policy.buffers), self.params.model.offsets)
        st.model_at = np.arange(st.W)
        st.outer = kernel.outer_for(policy, self.params.model, lambda: st.params.row(0),  # members start equal
                                    st.params.rows)
        return st

    def point_at(self, whole: "Workers", lo: int, hi: int) -> None:
        """Make this run's stepped state (and what merges changed this round) the views of rows ``lo..hi-1``
        of the population state ``whole``."""
        view = models_mod.Stack.view
        had_accum = getattr(self, "accum", True) is not None
        self.params, self.grad = view(whole.params, lo, hi), view(whole.grad, lo, hi)
        self.merge_change = view(whole.merge_change, lo, hi)
        self.accum = view(whole.accum, lo, hi) if whole.accum is not None and had_accum else None
        self.optim = whole.optim.view(lo, hi)
        self.momentum = self.optim.momentum
        self.score, self.score_weight = whole.score[lo:hi], whole.score_weight[lo:hi]

    def stacks(self):
        """The per-model stacks a swap moves with the model."""
        return [s for s in (self.params, *self.optim.stacks(), self.accum, self.base) if s is not None]

    STEPPED = ("params", "accum")  # what a local step reads and writes, besides the optimiser's state

    def take(self, rows: list[int], step: bool = False) -> "Workers":
        """The state of some rows as a smaller stacked state (copies) that a local step can run on;
        :meth:`put` writes it back. ``step``: only for one local step (no gradient stack where it is not needed)."""
        idx = torch.as_tensor(rows, device=self.params.device)
        sub = object.__new__(Workers)
        sub.W, sub.P, sub.fused = len(rows), self.P, self.fused
        sub.deferred = getattr(self, "deferred", False)
        for name in self.STEPPED:
            whole = getattr(self, name)
            part = None
            if whole is not None:
                part = models_mod.Stack(whole.model, len(rows), whole.device)
                for b, pb in zip(whole.blocks, part.blocks):
                    torch.index_select(b, 0, idx, out=pb)
            setattr(sub, name, part)
        # a fused SGD step (the update inside the model's backward) needs no gradient stack: for ``step`` alone it is
        # made only if the step asks (run.local_step)
        sub.grad = None if step and sub.fused and not sub.deferred else sub.params.like()
        sub.score, sub.score_weight = self.score[idx], self.score_weight[idx]
        sub.optim = self.optim.take(idx, sub.params)
        sub.momentum = sub.optim.momentum
        return sub

    def put(self, sub: "Workers", rows: list[int]) -> None:
        idx = torch.as_tensor(rows, device=self.params.device)
        for name in self.STEPPED + (("grad",) if getattr(self, "deferred", False) else ()):
            whole = getattr(self, name)
            if whole is not None:
                for b, pb in zip(whole.blocks, getattr(sub, name).blocks):
                    b.index_copy_(0, idx, pb)
        self.optim.put(sub.optim, idx)
        self.score[idx], self.score_weight[idx] = sub.score, sub.score_weight


    def rescale_supports(self) -> None:
        """Keep the supports (example counters, accumulators) far from overflow (:func:`kernel.rescale_supports`)."""
        if kernel.rescale_supports(self.examples, self.accum):
            self.support_epoch += 1


def _scores(rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's running score and its weight (:func:`kernel.score_step_`), float64, on ``device``."""
    return torch.zeros(rows, dtype=torch.float64, device=device), torch.zeros(rows, dtype=torch.float64, device=device)


def fusable(run, accumulators: bool) -> bool:
    """Plain SGD is fused into the backward pass where the model offers it."""
    return run.optimizer == "sgd" and not run.momentum and not run.weight_decay and not accumulators
