"""Optimisers batched over workers: SGD (with momentum), Adam and AdamW on the stacked rows.

Every worker's optimiser state is a :class:`models.Stack` in the same block layout as its
parameters (SGD's momentum; Adam's first and second moments) plus, for Adam, a per-worker
step count. One update is a handful of elementwise ops on the whole buffer at once (written
once, the formulas of ``torch.optim.SGD`` / ``Adam`` / ``AdamW``'s single-tensor path), so W
workers cost the same number of kernel launches as one.

Only the trainable prefix of a row is updated: a model's buffers (BatchNorm running
statistics) follow its parameters in the layout and are not trained (``model.n_train``).

On a merge (``policy.optimizer_state``) the state is kept (every worker keeps its own, what
evomerge always did), averaged with the same weights as the parameters, or reset to zero
(Adam's step count too, so its bias correction starts again); a swap moves it with the model.
"""

from __future__ import annotations

import math

import torch

from .. import models as models_mod
from . import kernel

OPTIMIZERS = ("sgd", "adam", "adamw")


def state_stacks(run) -> int:
    """How many state tensors per parameter the run's optimiser keeps (what :meth:`Optimizer.stacks` holds):
    SGD with momentum one, Adam and AdamW two, plain SGD none."""
    return 1 if run.optimizer == "sgd" and run.momentum else (2 if run.optimizer in ("adam", "adamw") else 0)


class Optimizer:
    """The state and update of one run's optimiser over the stacked workers of ``params``."""

    def __init__(self, run, params: models_mod.Stack):
        self.run, self.kind, self.W = run, run.optimizer, params.W
        self.n = params.W * params.model.n_train  # the trainable prefix of the block-major buffer
        self.n_blocks = params.model.n_trained_blocks
        self.momentum = params.like() if self.kind == "sgd" and run.momentum else None
        adam = self.kind in ("adam", "adamw")
        self.exp_avg = params.like() if adam else None
        self.exp_avg_sq = params.like() if adam else None
        # Adam's step count per worker (a merge may average or reset it); float64 keeps it exact
        self.steps = torch.zeros(params.W, dtype=torch.float64, device=params.device) if adam else None

    def stacks(self) -> list[models_mod.Stack]:
        """The state stacks, each in the parameters' layout."""
        return [s for s in (self.momentum, self.exp_avg, self.exp_avg_sq) if s is not None]

    def view(self, lo: int, hi: int) -> "Optimizer":
        """The state of rows ``lo..hi-1`` as an optimiser of their own that shares its memory (a member of a
        population): it merges and resets its rows; the population's optimiser steps them."""
        sub = object.__new__(Optimizer)
        sub.run, sub.kind, sub.W, sub.n, sub.n_blocks = self.run, self.kind, hi - lo, None, self.n_blocks
        for name in ("momentum", "exp_avg", "exp_avg_sq"):
            whole = getattr(self, name)
            setattr(sub, name, models_mod.Stack.view(whole, lo, hi) if whole is not None else None)
        sub.steps = self.steps[lo:hi] if self.steps is not None else None
        return sub

    def step(self, params: models_mod.Stack, grad: models_mod.Stack, accum: models_mod.Stack | None,
             segments: list[tuple[int, int]] | None = None) -> None:
        """One update of every worker from the gradients in ``grad``; ``accum`` (adaptive weighting)
        gathers the squared gradients (after SGD's and Adam's L2 weight decay). ``segments``: row ranges
        that are separate runs (a population's members): Adam's bias correction is decided per range,
        so each run gets the numbers it gets alone."""
        run, n = self.run, self.n
        g, p = grad.buf[:n], params.buf[:n]
        if self.kind == "sgd":  # torch.optim.SGD: weight decay, then momentum
            if run.weight_decay:
                g.add_(p, alpha=run.weight_decay)
            if accum is not None:
                accum.buf[:n].addcmul_(g, g)
            if self.momentum is not None:
                g = self.momentum.buf[:n].mul_(run.momentum).add_(g)
            p.add_(g, alpha=-run.lr)
            return
        beta1, beta2 = run.betas
        wd = run.weight_decay
        if wd and self.kind == "adamw":  # decoupled weight decay
            p.mul_(1 - run.lr * wd)
        elif wd:  # Adam: L2 in the gradient
            g = g.add(p, alpha=wd)
        if accum is not None:
            accum.buf[:n].addcmul_(g, g)
        self.steps += 1
        m, v = self.exp_avg.buf[:n], self.exp_avg_sq.buf[:n]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = self.steps.tolist()
        if len(set(t)) == 1:  # every worker at the same step: torch's scalar formula over the whole buffer
            step_size = run.lr / (1 - beta1 ** t[0])
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** t[0])).add_(run.eps)
            p.addcdiv_(m, denom, value=-step_size)
            return
        for lo, hi in segments or [(0, self.W)]:
            ts = t[lo:hi]
            if len(set(ts)) == 1:  # this run's workers at the same step: the scalar formula on its rows
                step_size = run.lr / (1 - beta1 ** ts[0])
                for k in range(self.n_blocks):
                    vb = self.exp_avg_sq.blocks[k][lo:hi]
                    denom = (vb.sqrt() / math.sqrt(1 - beta2 ** ts[0])).add_(run.eps)
                    params.blocks[k][lo:hi].addcdiv_(self.exp_avg.blocks[k][lo:hi], denom, value=-step_size)
                continue
            # workers at different steps (merges averaged or reset the counts): one column of factors per block
            steps = self.steps[lo:hi]
            step_size = (run.lr / (1 - beta1 ** steps)).float().unsqueeze(1)
            bc2 = torch.sqrt(1 - beta2 ** steps).float().unsqueeze(1)
            for k in range(self.n_blocks):
                pb, mb, vb = params.blocks[k][lo:hi], self.exp_avg.blocks[k][lo:hi], self.exp_avg_sq.blocks[k][lo:hi]
                denom = (vb.sqrt() / bc2).add_(run.eps)
                pb.sub_(mb / denom * step_size)

    # -- merges -------------------------------------------------------------------------------
    def merge_pairs(self, mode: str, a: list[int], b: list[int], weight_b, weight_a, moves) -> None:
        """A set of disjoint pairs merged: ``b[r]`` moves towards ``a[r]`` with ``weight_b`` (and ``a[r]``
        towards ``b[r]``'s old state with ``weight_a`` for push-pull), the weights the parameters
        used (a ``[k, 1]`` column, or one ``[k, n]`` tensor per block); ``moves`` are the scheduled
        moves ``(a's, b's)``, which weight the step counts when the weights are per coordinate."""
        push_pull = weight_a is not None
        if mode == "keep" or not self.stacks():
            return
        if mode == "reset":
            self.reset_rows_(b + (a if push_pull else []))
            return
        for s in self.stacks():  # lerped as the parameters were, with their weights
            kernel.exchange_(s.blocks, None, [kernel.LERP] * len(s.blocks), s.model.offsets, a, b, None, None,
                             weight_b, weight_a)
        if self.steps is not None:
            for r, (i, j) in enumerate(zip(a, b)):
                wb = float(weight_b[r]) if not isinstance(weight_b, list) else moves[r][1]
                old_b = float(self.steps[j])
                self.steps[j] = old_b + wb * (float(self.steps[i]) - old_b)
                if push_pull:
                    wa = float(weight_a[r]) if not isinstance(weight_a, list) else moves[r][0]
                    self.steps[i] = float(self.steps[i]) + wa * (old_b - float(self.steps[i]))

    def merge_all(self, mode: str, supports: list, weight: float) -> None:
        """A complete average: every worker's state moves ``weight`` towards the average of all,
        weighted by the parameters' ``supports`` (per block; None: a plain mean)."""
        if mode == "keep":
            return
        if mode == "reset":
            self.reset_rows_(list(range(self.W)))
            return
        for s in self.stacks():
            kernel.average_all_(s.blocks, None, [kernel.LERP] * len(s.blocks), s.blocks, supports, weight, False)
        if self.steps is not None:
            self.steps.lerp_(self.steps.mean().expand_as(self.steps), weight)

    def reset_rows_(self, rows: list[int]) -> None:
        for s in self.stacks():
            for blk in s.blocks:
                blk[rows] = 0.0
        if self.steps is not None:
            self.steps[rows] = 0.0

    # -- some rows at a time (a timed run steps the workers that are due) -------------------------------
    def take(self, idx: torch.Tensor, params: models_mod.Stack) -> "Optimizer":
        """The state of rows ``idx`` as the optimiser of ``params`` (those rows, gathered); :meth:`put` writes it back."""
        sub = Optimizer(self.run, params)
        for whole, part in zip(self.stacks(), sub.stacks()):
            for b, pb in zip(whole.blocks, part.blocks):
                torch.index_select(b, 0, idx, out=pb)
        if self.steps is not None:
            sub.steps = self.steps.index_select(0, idx.to(self.steps.device))
        return sub

    def put(self, sub: "Optimizer", idx: torch.Tensor) -> None:
        for whole, part in zip(self.stacks(), sub.stacks()):
            for b, pb in zip(whole.blocks, part.blocks):
                b.index_copy_(0, idx, pb)
        if self.steps is not None:
            self.steps.index_copy_(0, idx.to(self.steps.device), sub.steps)

    def row_state(self, w: int) -> dict:
        """Worker ``w``'s state (copies): what a payload carries when the state is averaged."""
        return {"stacks": [s.row(w) for s in self.stacks()],
                "steps": float(self.steps[w]) if self.steps is not None else None}

    def merge_row(self, mode: str, w: int, incoming: dict | None, weight, move: float, offsets) -> None:
        """Worker ``w`` merges one payload's state (a timed run): ``weight`` as the parameters used (a
        ``[1, 1]`` column or one ``[1, n]`` tensor per block), ``move`` the scheduled move (step counts)."""
        if mode == "keep" or not self.stacks():
            return
        if mode == "reset":
            self.reset_rows_([w])
            return
        for s, row in zip(self.stacks(), incoming["stacks"]):
            kernel.receive_(s.blocks, None, [kernel.LERP] * len(s.blocks), offsets, [w],
                            lambda k, o, n, row=row: [row[o:o + n]], weight)
        if self.steps is not None:
            wb = float(weight[0]) if not isinstance(weight, list) else move
            old = float(self.steps[w])
            self.steps[w] = old + wb * (incoming["steps"] - old)

    def swap_rows_(self, a: int, b: int) -> None:
        """The step counts of a swap (the stacks are swapped with every other per-model stack)."""
        if self.steps is not None:
            self.steps[[a, b]] = self.steps[[b, a]]
