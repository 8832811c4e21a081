"""The distributed backend: one process per worker (or per group of workers) over ``torch.distributed``.

Every rank replays the same event schedule as the in-process backend (``schedule.build``
is a function of the policy and the seed) and draws the same minibatches
(``simulate.batch_indices``). A gossip merge is a point-to-point exchange between the
ranks of the two workers involved, while every other rank keeps training; a complete
average (``scheme = "allreduce"``) is a collective. Delta payloads travel encoded
(positions, integer levels and a scale: ``ops.encode``) to every rank that holds a
topology neighbour of the sender, since neighbours keep the sender's public copy
(CHOCO-style, as in the in-process backend). At the end of each round the workers'
parameters are gathered to rank 0, which evaluates and reports through the callback
(so a search can prune), and tells the others whether to go on.

Launch: :func:`evomerge.backends.launch.simulate` spawns the processes on this machine (gloo on CPU,
NCCL on CUDA). Across hosts, run ``python -m evomerge.dist`` under ``torchrun``, which sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (:mod:`evomerge.dist`).

Deadlock freedom: all ranks walk the events in the same global order and post every
send and receive of an event without blocking before waiting on any, so the earliest
unfinished event always has all its ranks at it.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..engine import ops
from ..engine import kernel, plan as plan_mod
from ..engine.plan import PairSet
from ..engine.run import execute
from ..engine.setup import RoundMetrics, RunResult, Setup, resolve_device
from ..engine.state import initial_row
from ..errors import RunError
from ..policy import MergePolicy
from . import check, check_model, check_policy
from .base import Backend
from .pending import Pending

class DistributedRunError(RunError):
    """A rank of a distributed run died or raised; the message names the rank."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} {message}")
        self.rank = rank


def groups(workers: int, world: int) -> list[list[int]]:
    """Contiguous groups of workers, one per rank; every rank gets the same number."""
    check("distributed", world, workers)
    n = workers // world
    return [list(range(r * n, (r + 1) * n)) for r in range(world)]


# -- one rank ---------------------------------------------------------------------------------------
class Distributed(Backend):
    """One rank's share of a run: its own workers' rows, and what it knows about everyone
    (every worker's example counters; for delta payloads, the public copies it must keep)."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, rank: int, world: int, device: torch.device):
        W = setup.study.run.workers
        own = groups(W, world)[rank]
        super().__init__(setup, policy, seed, device, own, public=False)
        model = setup.model
        self.rank, self.world, self.W, self.P = rank, world, W, model.n_params
        self.judges = rank == 0
        self.groups = groups(W, world)
        self.st = self.state  # short: the rank code reads it on every event
        self.owner = np.repeat(np.arange(world), len(own))
        self.pos = {w: i for i, w in enumerate(own)}
        self.delta = self.payload.public  # payloads travel encoded, and neighbours keep public copies
        self.public = initial_row(model, seed).to(device).repeat(W, 1) if self.delta else None
        # a merge here sums counters from what arrived (a delta payload's public copy, whose counters do not move):
        # check_model refuses a model with buffers on this backend, so there are none
        assert kernel.SUM not in self.rules, "the distributed backend runs no model with counters"
        self.unsent = kernel.unsent(self.rules, model.offsets)  # left out of a delta payload (none: see above)
        self.neighbours = None
        if self.sched.topology is not None:
            self.neighbours = [self.sched.topology.neighbours(i).tolist() for i in range(W)]
        self.spec = ops.wire_spec(self.P, policy.topk_fraction, policy.quantize_bits) if self.delta else [((self.P,), torch.float32)]
        self._outbox: list = []  # sends of a timed run still in flight (their tensors must live until done)
        self._inbox: dict = {}  # receives of a timed run posted, not yet applied

    # -- helpers ---------------------------------------------------------------------------
    def _encode(self, w: int, ev: int, side: int) -> list[torch.Tensor]:
        """Worker ``w``'s wire tensors; for deltas also moves its public copy (error feedback stays local)."""
        row = self.st.params.row(self.pos[w])
        if not self.delta:
            return [row]
        p = self.p
        gen = plan_mod.quant_generator(self.seed, ev, side) if p.quantize_bits else None
        parts = ops.encode(kernel.delta_to_send(row, self.public[w], self.unsent), p.topk_fraction, p.quantize_bits,
                           gen)
        self._receive_delta(w, parts)
        return parts

    def _receive_delta(self, w: int, parts: list[torch.Tensor]) -> None:
        p = self.p
        self.public[w] = ops.apply_delta(self.public[w], ops.decode(parts, self.P, p.topk_fraction, p.quantize_bits))

    def _empty(self) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=self.dev) for shape, dtype in self.spec]

    def _dests(self, w: int) -> list[int]:
        """Ranks that keep worker ``w``'s public copy: those of its topology neighbours (delta payloads)."""
        return sorted({int(self.owner[n]) for n in self.neighbours[w]} - {int(self.owner[w])})

    def _loss(self, w: int, a: int, b: int) -> torch.Tensor:
        """Worker ``w``'s winner-test loss on the pair ``(a, b)``'s slices, as the kernel scores pairs."""
        x, y = kernel.pair_examples(self.train_x, self.train_y, self.slices, [a], [b], self.setup.data.spec)
        params = [q[[self.pos[w]]] for q in self.st.params.params]
        return torch.tensor(kernel.pair_losses(self.setup.model, params, x[:1], y[:1]), device=self.dev)

    # -- what the engine asks of a backend -----------------------------------------------------
    def pairs(self, ps: PairSet) -> None:
        """The set's events in order; each is a point-to-point exchange between the ranks involved
        (every rank walks every event, so the earliest unfinished one has all its ranks at it)."""
        for ev, a, b, u in zip(ps.events.tolist(), ps.a.tolist(), ps.b.tolist(), ps.u.tolist()):
            self._pair(ev, ps.weight, a, b, u)

    def _pair(self, ev: int, weight: float, a: int, b: int, u: float) -> None:
        p, r = self.p, self.rank
        oa, ob = int(self.owner[a]), int(self.owner[b])
        push_pull = p.exchange == "push_pull"
        biased = p.winner_bias > 0
        dests_a = self._dests(a) if self.delta else ([ob] if ob != oa else [])
        dests_b = (self._dests(b) if self.delta else ([oa] if oa != ob else [])) if push_pull else []
        if r not in (oa, ob) and r not in dests_a and r not in dests_b:
            return
        # 1. what this rank's participants compute before anything moves
        loss = {}
        if biased:  # both on the initiator-first pair of slices, as the in-process backend scores them
            for w, o in ((a, oa), (b, ob)):
                if r == o:
                    loss[w] = self._loss(w, a, b)
        out = {}
        if r == oa:
            out[a] = self._encode(a, ev, 0)
        if r == ob and push_pull:
            out[b] = self._encode(b, ev, 1)
        # 2. messages, in one canonical order on every rank: losses a->b, b->a, payload a, payload b
        ops_, recv = [], {}
        if biased and oa != ob:
            if r == oa:
                ops_.append(dist.P2POp(dist.isend, loss[a], ob))
            elif r == ob:
                loss[a] = torch.empty(1, device=self.dev)
                ops_.append(dist.P2POp(dist.irecv, loss[a], oa))
            if push_pull:
                if r == ob:
                    ops_.append(dist.P2POp(dist.isend, loss[b], oa))
                elif r == oa:
                    loss[b] = torch.empty(1, device=self.dev)
                    ops_.append(dist.P2POp(dist.irecv, loss[b], ob))
        for w, src, dests in ((a, oa, dests_a), (b, ob, dests_b)):
            if r == src:
                ops_ += [dist.P2POp(dist.isend, t, d) for d in dests for t in out[w]]
            elif r in dests:
                recv[w] = self._empty()
                ops_ += [dist.P2POp(dist.irecv, t, src) for t in recv[w]]
        # adaptive weighting: the movers need the other side's accumulator (before the merge)
        accum = {}
        if self.st.accum is not None:
            for w, o in ((a, oa), (b, ob)):
                if r == o:
                    accum[w] = self.st.accum.row(self.pos[w])
            pairs = [(a, oa, ob)] + ([(b, ob, oa)] if push_pull else [])
            for w, src, dst in pairs:
                if src == dst:
                    continue
                if r == src:
                    ops_.append(dist.P2POp(dist.isend, accum[w], dst))
                elif r == dst:
                    accum[w] = torch.empty(self.P, device=self.dev)
                    ops_.append(dist.P2POp(dist.irecv, accum[w], src))
        if ops_:
            for req in dist.batch_isend_irecv(ops_):
                req.wait()
        for w, parts in recv.items():
            if self.delta:
                self._receive_delta(w, parts)
        # 3. the merge itself, on the rows this rank owns
        incoming = {}
        for w in (a, b):
            if self.delta:
                incoming[w] = self.public[w]
            elif w in out:
                incoming[w] = out[w][0]
            elif w in recv:
                incoming[w] = recv[w][0]
        if r == ob or (r == oa and push_pull):  # push: the initiator does not move
            winner = plan_mod.winner(float(loss[a][0]), float(loss[b][0])) if biased else None
            move_a, move_b = plan_mod.moves(p, weight, u, winner)
            if r == ob:
                self._merge(b, move_b, a, incoming[a], accum.get(a))
            if r == oa and push_pull:
                self._merge(a, move_a, b, incoming[b], accum.get(b))
            if self.st.accum is not None:  # accumulators are summed, not averaged (VW's merge)
                for w, other in ((b, a), (a, b)):
                    if r == self.owner[w] and (w == b or push_pull):
                        for blk, (o, n) in zip(self.st.accum.blocks, self.setup.model.offsets):
                            kernel.sum_rows_(blk, [self.pos[w]], [accum[other][o:o + n]])

    def _merge(self, w: int, move: float, sender: int, incoming: torch.Tensor, accum_in: torch.Tensor | None) -> None:
        """Worker ``w`` (a row of this rank) merges ``sender``'s model ``incoming`` (a flat row) by the kernel,
        with the weights its weighting gives; ``accum_in``: the sender's accumulators (a flat row)."""
        st, model = self.st, self.setup.model
        row = self.pos[w]
        acc = None if accum_in is None else [accum_in[o:o + n].unsqueeze(0) for o, n in model.offsets]
        w_in = self.weighting.incoming_weights(st, [move], np.array([row]), [float(st.examples[sender])], acc,
                                               examples_of=[w])
        kernel.receive_(st.params.blocks, st.merge_change.blocks, self.rules, model.offsets, [row],
                        lambda k, o, n: [incoming[o:o + n]], w_in)

    def allreduce(self, event: int, step: int, weight: float) -> None:
        p, own = self.p, self.own
        if self.fragments is not None:  # Streaming DiLoCo without delay: the fragment's average lands at once
            kernel.lerp_targets_(self.st.params.blocks, self.st.merge_change.blocks, self._targets(event), weight)
            return
        if self.delta:
            # each worker's compressed delta goes to every rank, which rebuilds all public copies
            mine = [self._encode(w, event, w) for w in own]
            parts: dict[int, list[torch.Tensor]] = {}
            for k in range(len(self.spec)):
                local = torch.stack([m[k] for m in mine])
                gathered = [torch.empty_like(local) for _ in self.groups]
                dist.all_gather(gathered, local)
                for g, ws in zip(gathered, self.groups):
                    for i, w in enumerate(ws):
                        parts.setdefault(w, []).append(g[i])
            for w, wire in parts.items():
                if w not in self.pos:
                    self._receive_delta(w, wire)
            # every rank now holds all public copies: average them here, as the in-process backend does
            support = None
            if self.weighting.by_examples:
                support = self.st.examples.to(self.dev)
            elif self.weighting.accumulators:
                acc = self.st.accum.rows()
                gathered = [torch.empty_like(acc) for _ in self.groups]
                dist.all_gather(gathered, acc)
                support = torch.cat(gathered)
            avg, merged = ops.weighted_average(self.public, support)
            if merged is not None and self.weighting.accumulators:
                self.st.accum.set_rows(merged.unsqueeze(0).expand(len(own), -1))
        else:
            avg = self._average(self.st.params.rows())
        outer = self.st.outer
        if outer is not None:  # every rank takes the same outer step on the same average
            outer.step_flat_(avg, self.setup.model.offsets)
        rows = list(range(len(own)))
        kernel.receive_(self.st.params.blocks, self.st.merge_change.blocks, self.rules, self.setup.model.offsets, rows,
                        lambda k, o, n: [avg[o:o + n]] * len(rows), torch.full((len(rows), 1), float(weight), device=self.dev))

    # -- Streaming DiLoCo: a fragment's average (and its outer step) taken now, landed fragment_delay steps later --
    def _targets(self, event: int) -> dict[int, torch.Tensor]:
        """Per block of the event's fragment (every block without fragments), the value every row moves towards:
        the average over all ranks (one all-reduce of the fragment's coordinates), after the outer step where there
        is one (:func:`kernel.average_targets_`'s rule; streaming needs uniform weighting, and this backend merges
        no buffers)."""
        offsets, st = self.setup.model.offsets, self.st
        only = self.fragment(event)
        blocks = list(range(len(offsets))) if only is None else list(only)
        total = torch.cat([st.params.blocks[k].sum(0) for k in blocks])
        dist.all_reduce(total)
        avg, targets, at = total / self.W, {}, 0
        for k in blocks:
            o, n = offsets[k]
            a = avg[at:at + n]
            at += n
            targets[k] = st.outer.step_(a, o, n).clone() if st.outer is not None and k < st.outer.blocks else a
        return targets

    def allreduce_start(self, event: int) -> None:
        self._in_flight[event] = self._targets(event)

    def allreduce_finish(self, event: int, weight: float) -> None:
        kernel.lerp_targets_(self.st.params.blocks, self.st.merge_change.blocks, self._in_flight.pop(event), weight)

    def _average(self, models: torch.Tensor) -> torch.Tensor:
        """The weighted average over all ranks of the own workers' ``models``, by all-reduce."""
        own, s = self.own, None
        if self.weighting.accumulators:
            s = self.st.accum.rows()
        elif self.weighting.by_examples:
            s = self.st.examples[own].to(models.dtype).to(self.dev).unsqueeze(1).expand_as(models)
        avg, total, _ = kernel.reduced_average(models, s, dist.all_reduce, self.W)
        if self.weighting.accumulators:  # summed, not averaged
            self.st.accum.set_rows(total.unsqueeze(0).expand(len(own), -1))
        return avg

    def totals(self, loss_sum: float, local: float, merged: float) -> tuple[float, float, float]:
        n = len(self.own)
        t = torch.tensor([loss_sum, local * n, merged * n], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t)
        return float(t[0]), float(t[1]) / self.W, float(t[2]) / self.W

    def gather(self):
        rows = self.st.params.rows().contiguous()
        gathered = [torch.empty_like(rows) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(rows, gathered, dst=0)
        if self.rank != 0:
            return None
        stack = self.setup.model.stack(self.W, self.dev)
        stack.set_rows(torch.cat(gathered))
        return stack

    # -- a timed run: payloads between ranks as tagged messages -------------------------------------
    def _tag(self, event: int, kind: int, part: int) -> int:
        return (event * 4 + kind) * 4 + part

    def _wire(self, payload: dict | None = None) -> list[torch.Tensor]:
        """A payload's tensors: the model row, its counter (float64, exact), winner and support epoch (the scale of
        its supports), its accumulators."""
        if payload is None:
            out = [torch.empty(self.P, device=self.dev), torch.empty(3, dtype=torch.float64, device=self.dev)]
            return out + ([torch.empty(self.P, device=self.dev)] if self.st.accum is not None else [])
        win = payload.get("winner")
        out = [payload["sent"].contiguous(),
               torch.tensor([payload["examples"], -1.0 if win is None else float(win), float(payload["epoch"])],
                            dtype=torch.float64, device=self.dev)]
        if payload["accum"] is not None:
            out.append(torch.cat([a[0] for a in payload["accum"]]))
        return out

    def send_payload(self, event: int, kind: int, payload: dict, to: int) -> None:
        dst = int(self.owner[to])
        tensors = self._wire(payload)
        works = [Pending(dist.isend(t, dst, tag=self._tag(event, kind, k))) for k, t in enumerate(tensors)]
        self._outbox.append((works, tensors))
        self._outbox = [(w, t) for w, t in self._outbox if not all(x.done() for x in w)]

    def _posted(self, event: int, kind: int, sender: int):
        key = (event, kind)
        if key not in self._inbox:
            src = int(self.owner[sender])
            tensors = self._wire()
            self._inbox[key] = ([Pending(dist.irecv(t, src, tag=self._tag(event, kind, k))) for k, t in enumerate(tensors)],
                                tensors)
        return self._inbox[key]

    def _received(self, event: int, kind: int) -> dict:
        _, tensors = self._inbox.pop((event, kind))
        row, meta = tensors[0], tensors[1]
        accum = None
        if len(tensors) > 2:
            accum = [tensors[2][o:o + n].unsqueeze(0) for o, n in self.setup.model.offsets]
        win = int(meta[1])
        return {"sent": row, "params": row, "examples": float(meta[0]), "accum": accum,
                "winner": None if win < 0 else win, "epoch": int(meta[2])}

    def poll_payload(self, event: int, kind: int, sender: int) -> dict | None:
        works, _ = self._posted(event, kind, sender)
        if all(w.done() for w in works):
            return self._received(event, kind)
        return None

    def wait_payload(self, event: int, kind: int, sender: int) -> dict:
        works, _ = self._posted(event, kind, sender)
        for w in works:
            w.wait()
        return self._received(event, kind)

    def sum_examples(self) -> float:
        t = self.st.examples[self.own].to(torch.float64).sum().reshape(1).to(self.dev)
        dist.all_reduce(t)
        return float(t[0])

    def agree(self, go: bool) -> bool:
        flag = torch.ones(1, device=self.dev) if go else torch.zeros(1, device=self.dev)
        dist.broadcast(flag, src=0)
        return bool(float(flag[0]))


def run_rank(setup: Setup, policy: MergePolicy, seed: int, *, rank: int, world: int,
             report: Callable[[RoundMetrics], bool] | None = None, device: str | torch.device | None = None,
             evaluate_test: bool = False, keep_params: bool = False, emulate_time: bool = False) -> RunResult | None:
    """This rank's part of one run, inside an initialised process group. ``report`` (rank 0 only)
    gets each round's metrics and returns False to stop the run. Rank 0 returns the result."""
    check_policy("distributed", policy)
    check_model("distributed", setup.model)
    t0 = time.perf_counter()
    backend = Distributed(setup, policy, seed, rank, world, resolve_device(device))
    try:
        return execute(setup, policy, seed, backend, callback=report, evaluate_test=evaluate_test,
                       keep_params=keep_params, t0=t0, emulate_time=emulate_time)
    finally:
        for works, _ in backend._outbox:  # a timed run's last sends
            for w in works:
                w.wait()
