"""The event-by-event reference for the step-batched merges: the merge code as it was before
merges were planned per step (one event at a time, in schedule order), kept here, in
the tests, to check the product against. Not used by the product.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from evomerge import data as data_mod
from evomerge.engine import datapool, ops, similarity
from evomerge.engine import schedule as schedule_mod
from evomerge.engine.setup import RoundMetrics, RunResult, Setup, normalise, round_bounds
from evomerge.engine.judge import Judge, Similarity, slice_losses, update_norms
from evomerge.engine.run import train_steps
from evomerge.engine import plan as plan_mod
from evomerge.engine.plan import TAG_QUANT
from evomerge.engine.kernel import rescale_supports
from evomerge.engine.state import Workers
from evomerge.policy import MergePolicy



def _lerp_row_(stack, w: int, target: torch.Tensor, weight, change) -> None:
    """``row_w <- (1 - weight) * row_w + weight * target`` block by block (``weight`` a scalar or a ``[P]``
    row); ``change`` accumulates what moved. The oracle's own lerp, kept apart from the product's kernel."""
    per = isinstance(weight, torch.Tensor)
    for k, (b, (o, n)) in enumerate(zip(stack.blocks, stack.model.offsets)):
        before = b[w].clone()
        b[w].lerp_(target[o:o + n], weight[o:o + n] if per else weight)
        change.blocks[k][w].add_(b[w]).sub_(before)


class _Workers(Workers):
    def __init__(self, setup, policy, seed, device):
        super().__init__(setup.model, setup.study.run, policy, seed, device)


def reference_simulate(
    setup: Setup,
    policy: MergePolicy,
    seed: int = 0,
    *,
    callback: Callable[[RoundMetrics], None] | None = None,
    device: str | torch.device | None = None,
    evaluate_test: bool = False,
    keep_params: bool = False,
) -> RunResult:
    """Run one merge run; ``callback`` gets each round's metrics (it may raise to stop the run).

    ``evaluate_test`` also scores the consensus model on the test set (never during a
    search); ``keep_params`` returns the workers' final ``[W, P]`` parameters.
    """
    t0 = time.perf_counter()
    study, model, data = setup.study, setup.model, setup.data
    run = study.run
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    W, B, T = run.workers, run.batch_size, setup.total_steps
    sched = schedule_mod.build(policy, W, T, seed)
    st = _Workers(setup, policy, seed, dev)

    train_x, train_y = data.train_x.to(dev), data.train_y.to(dev)
    slice_idx = [torch.as_tensor(s, device=dev) for s in setup.slices]
    neighbours = None
    if sched.topology is not None:
        neighbours = [len(sched.topology.neighbours(i)) for i in range(W)]
    judge = Judge(setup, policy, seed, dev, train_x, t0)
    pool = None
    if policy.data_exchange_k or policy.retire_threshold or (policy.swap_p and policy.swap_confidence):
        pool = datapool.DataPool(setup.shards, len(train_y), seed, retire_threshold=policy.retire_threshold,
                                 reserve_rate=policy.reserve_rate)

    merger = _Merger(st, policy, sched, model, data.spec, train_x, train_y, slice_idx, neighbours, seed, T,
                     judge.similarity, pool)
    history: list[RoundMetrics] = []
    status, start, ev, converged = "ok", 0, 0, None
    labels = data.train_y.numpy()

    def merge_after(step: int) -> None:
        nonlocal ev
        st.examples += B
        while ev < len(sched) and sched.step[ev] == step:
            merger.apply(ev, step)
            ev += 1

    for r, end in enumerate(round_bounds(T, run.rounds)):
        round_start = st.params.clone()
        st.merge_change.buf.zero_()
        loss_sum = train_steps(setup, st, range(W), seed, start, end, train_x, train_y, merge_after, pool)
        local, merged = update_norms(st, round_start, end - start)
        skew = data_mod.label_skew(labels, pool.holdings(), data.n_classes) if pool is not None else setup.label_skew
        rm = judge.round(r, end, end - start, st.params, float(loss_sum), local, merged, merger.bytes, merger.count,
                         skew, pool.moved if pool is not None else 0,
                         visitors=pool.visitors() if pool is not None else None)
        start = end
        history.append(rm)
        if not judge.finite:
            status = "diverged"
            break
        if callback is not None:
            callback(rm)
        if policy.regroup_every and (r + 1) % policy.regroup_every == 0:
            merger.regroup()
        if judge.converged(rm.local_update_norm, rm.merge_update_norm, rm.step, T):
            converged = end
            break
    test_acc, test_loss = judge.test_metrics(st.params) if evaluate_test and status == "ok" else (None, None)
    return RunResult(status=status, seed=seed, policy=policy.to_dict(), history=history, total_steps=T,
                     wall_time=time.perf_counter() - t0, label_skew=setup.label_skew, workers=W, test_accuracy=test_acc,
                     test_loss=test_loss,
                     eval_time=judge.eval_time, params=st.params.rows().cpu() if keep_params else None,
                     converged_step=converged, communities=merger.groups.tolist() if policy.regroup_every else None,
                     model_at=st.model_at.tolist())


class _Merger:
    """Applies the schedule's merge events to the stacked workers and charges their bytes."""

    def __init__(self, st, policy, sched, model, spec, train_x, train_y, slice_idx, neighbours, seed, total,
                 sim: "Similarity | None" = None, pool: datapool.DataPool | None = None):
        self.st, self.p, self.sched, self.model, self.spec = st, policy, sched, model, spec
        self.train_x, self.train_y, self.slice_idx = train_x, train_y, slice_idx
        self.neighbours, self.seed, self.total = neighbours, seed, total
        self.sim, self.pool = sim, pool
        self.bytes = 0
        self.count = 0
        P = st.P
        self.dense_bytes = ops.payload_bytes(P)
        self.sent_bytes = ops.payload_bytes(P, policy.topk_fraction, policy.quantize_bits) if policy.payload == "delta" else self.dense_bytes
        # the adaptive weighting's supports go dense with each gossip payload; a weighted all-reduce of weights sums
        # three rows (the supported models, the supports, the plain models)
        self.support_bytes = self.dense_bytes if policy.weighting == "adaptive" else 0
        self.allreduce_rows = 3 if policy.weighting in ("adaptive", "examples") and policy.payload != "delta" else 1
        self.example_bytes = train_x[0].numel() * train_x.element_size() + 1  # pixels as stored, one label byte
        # one worker's similarity on the wire: its sketch, or for CKA its logits on the probe batch
        n_out = int(train_y.max()) + 1
        self.similarity_bytes = 4 * similarity.SKETCH_DIM if policy.similarity == "sketch" else \
            4 * similarity.PROBE_SIZE * n_out
        # peers drawn during the run, not from the schedule: by similarity, or in regrouped communities
        self.live_peers = policy.scheme == "gossip" and bool(policy.similarity_bias or policy.regroup_every)
        self.groups = getattr(sched.topology, "groups", np.zeros(st.W, dtype=np.int64))
        self.topo = sched.topology
        self.peer_p = sched.topology.probabilities() if sched.topology is not None else None
        self._sim_at: tuple[int, np.ndarray] | None = None  # (step, similarity matrix) cache
        self.left_at = np.full((st.W, st.W), -np.inf)  # [model, worker]: the step the model last left the worker's data
        self._swap_at = None  # (step, model_at, left_at, confidences) at the step's first event

    def weight(self, step: int) -> float:
        p = self.p
        return ops.scheduled_weight(p.mixing_weight, p.mixing_weight_final, p.mixing_schedule, step / self.total)

    def apply(self, ev: int, step: int) -> None:
        self.count += 1
        if self.sched.scheme == "allreduce":
            self._allreduce(ev, step)
        else:
            a = int(self.sched.initiator[ev])
            sign = self.p.data_similarity_sign if self.pool is not None and self.p.data_exchange_k else 0.0
            sims = self._similarities(step) if sign else None  # taken before the step's first merge
            b = self._peer(ev, step) if self.live_peers else int(self.sched.peer[ev])
            if self.p.swap_p and float(self.sched.u_swap[ev]) < self._swap_chance(a, b, step):
                self.left_at[self.st.model_at[[a, b]], [a, b]] = step  # each model leaves its worker's data
                self._swap(a, b)
            else:
                self._pair(ev, step, a, b)
            if self.pool is not None and self.p.data_exchange_k:
                most = datapool.most_confident_share(sign, sims[a], a, b) if sign else 0.0
                self.bytes += self.example_bytes * self.pool.send(a, b, self.p.data_exchange_k, most=most,
                                                                  unseen_first=self.p.data_unseen_first)
            if self.p.similarity_bias or sign:  # the initiator took every other worker's similarity for it
                self.bytes += (self.st.W - 1) * self.similarity_bytes
        self._rescale_supports()

    # -- peers drawn during the run ------------------------------------------------------------
    def _similarities(self, step: int) -> np.ndarray:
        """The workers' similarity matrix, recomputed at most once per step (every 10 for CKA)."""
        every = 1 if self.p.similarity == "sketch" else 10
        if self._sim_at is None or step - self._sim_at[0] >= every:
            self._sim_at = (step, self.sim.matrix(self.st.params).cpu().numpy())
        return self._sim_at[1]

    def _peer(self, ev: int, step: int) -> int:
        a = int(self.sched.initiator[ev])
        moving = getattr(self.topo, "schedule", "constant") != "constant"  # communities whose p_intra moves
        p = self.topo.probabilities(step / self.total)[a] if moving else self.peer_p[a]
        if self.p.similarity_bias:
            p = similarity.biased_peer_probabilities(p, self._similarities(step)[a], self.p.similarity_bias)
        return similarity.draw(p, float(self.sched.u_peer[ev]))

    def regroup(self) -> None:
        """Self-forming communities: cluster the workers by similarity into ``n_communities`` groups."""
        from evomerge.engine.topology import Communities

        self.groups = similarity.cluster(self.sim.matrix(self.st.params), self.p.n_communities)
        W = self.st.W
        self.bytes += (W - 1) * (self.similarity_bytes + 8 * W)  # every sketch to one worker, the groups back
        self.topo = Communities(self.st.W, self.p.n_communities, self.p.p_intra, groups=self.groups,
                                p_intra_final=self.p.p_intra_final, schedule=self.p.p_intra_schedule)
        self.peer_p = self.topo.probabilities()
        self._sim_at = None

    # -- model swap ---------------------------------------------------------------------------
    def _swap_chance(self, a: int, b: int, step: int) -> float:
        """plan.swap_chance from the state at the step's first event: the step's swaps are decided together."""
        p = self.p
        if not (p.swap_confidence or p.swap_recency):
            return p.swap_p
        if self._swap_at is None or self._swap_at[0] != step:
            confs = [self.pool.confidence(w) for w in range(self.st.W)] if p.swap_confidence else None
            self._swap_at = (step, self.st.model_at.copy(), self.left_at.copy(), confs)
        _, model_at, left_at, confs = self._swap_at
        conf = confs[b] if p.swap_confidence else None
        return plan_mod.swap_chance(p, conf, step - left_at[model_at[a], b])

    def _swap(self, a: int, b: int) -> None:
        """The two workers exchange models, with everything that belongs to a model (optimiser
        state, supports, public copy); each goes on with the other's data. Two full transfers."""
        st = self.st
        ra, rb = st.params.row(a), st.params.row(b)
        for stack in (st.params, st.momentum, st.accum, st.base):
            if stack is not None:
                stack.swap_rows_(a, b)
        st.merge_change.set_row(a, st.merge_change.row(a) + (rb - ra))
        st.merge_change.set_row(b, st.merge_change.row(b) + (ra - rb))
        st.examples[[a, b]] = st.examples[[b, a]]
        st.model_at[[a, b]] = st.model_at[[b, a]]
        self.bytes += 2 * self.dense_bytes

    # what a worker puts on the wire, and what the receiver reconstructs from it
    def _outgoing(self, w: int, ev: int, side: int) -> torch.Tensor:
        st, p = self.st, self.p
        if p.payload == "weights":
            return st.params.row(w)
        base = st.base.row(w)
        d = ops.delta(st.params.row(w), base)
        gen = None
        if p.quantize_bits:
            gen = torch.Generator().manual_seed(int(schedule_mod.rng_for(self.seed, TAG_QUANT, ev, side).integers(2**62)))
        sent = ops.compress(d, p.topk_fraction, p.quantize_bits, gen)
        # the base is the public copy peers hold: what was not sent stays in params - base (error feedback)
        public = ops.apply_delta(base, sent)
        st.base.set_row(w, public)
        return public

    def _support(self, w: int):
        if self.p.weighting == "examples":
            return float(self.st.examples[w])
        if self.p.weighting == "adaptive":
            return self.st.accum.row(w)
        return None

    def _pair(self, ev: int, step: int, a_i: int, b_i: int) -> None:
        st, p, s = self.st, self.p, self.sched
        winner = self._winner(a_i, b_i) if p.winner_bias > 0 else None
        move_a, move_b = ops.pair_moves(self.weight(step), float(s.u[ev]), p.winner_bias, p.lerp == "random", winner)
        push_pull = p.exchange == "push_pull"
        from_a = self._outgoing(a_i, ev, 0)
        from_b = self._outgoing(b_i, ev, 1) if push_pull else None
        fan = self.neighbours[a_i] if p.payload == "delta" else 1
        self.bytes += (self.sent_bytes + self.support_bytes) * fan
        sa, sb = self._support(a_i), self._support(b_i)
        sa = sa.clone() if isinstance(sa, torch.Tensor) else sa
        sb = sb.clone() if isinstance(sb, torch.Tensor) else sb
        _lerp_row_(st.params, b_i, from_a, ops.incoming_weight(move_b, sb, sa), st.merge_change)
        if push_pull:
            self.bytes += (self.sent_bytes + self.support_bytes) * (self.neighbours[b_i] if p.payload == "delta" else 1)
            _lerp_row_(st.params, a_i, from_b, ops.incoming_weight(move_a, sa, sb), st.merge_change)
        self._merge_supports(a_i, b_i, push_pull)

    def _merge_supports(self, a: int, b: int, push_pull: bool) -> None:
        """Counters and accumulators are summed, not averaged (VW's merge)."""
        st = self.st
        total = st.examples[a] + st.examples[b]
        st.examples[b] = total
        if push_pull:
            st.examples[a] = total
        if st.accum is not None:
            acc = st.accum.row(a) + st.accum.row(b)
            st.accum.set_row(b, acc)
            if push_pull:
                st.accum.set_row(a, acc)

    def _rescale_supports(self) -> None:
        rescale_supports(self.st.examples, self.st.accum.buf if self.st.accum is not None else None)

    @torch.no_grad()
    def _winner(self, a: int, b: int) -> int:
        """0 if the initiator has the lower loss on both workers' validation slices, else 1."""
        idx = torch.cat([self.slice_idx[a], self.slice_idx[b]])
        loss = slice_losses(self.model, self.st.params.params, [a, b], normalise(self.train_x[idx], self.spec), self.train_y[idx])
        return 0 if float(loss[0]) <= float(loss[1]) else 1

    def _allreduce(self, ev: int, step: int) -> None:
        st, p, W = self.st, self.p, self.st.W
        a = self.weight(step) * (float(self.sched.u[ev]) if p.lerp == "random" else 1.0)
        if p.payload == "delta":
            sent = torch.stack([self._outgoing(w, ev, w) for w in range(W)])
            blocks = [sent[:, o:o + n] for o, n in self.model.offsets]
        else:
            blocks = st.params.blocks
        supports: list = [st.examples] * len(blocks) if p.weighting == "examples" else (
            st.accum.blocks if p.weighting == "adaptive" else [None] * len(blocks))
        before = st.params.buf.clone()
        for own, models, support in zip(st.params.blocks, blocks, supports):
            avg, merged = ops.weighted_average(models, support)
            own.lerp_(avg.unsqueeze(0).expand_as(own), a)
            if p.weighting == "adaptive":
                support.copy_(merged.unsqueeze(0).expand_as(support))
        st.merge_change.buf.add_(st.params.buf).sub_(before)
        st.examples.fill_(float(st.examples.sum()))  # counters are summed, not averaged
        # each worker uploads its payload and downloads the dense average (parameter-server accounting)
        self.bytes += W * (self.sent_bytes + self.dense_bytes) * self.allreduce_rows
