"""The in-process backend: all workers' rows stacked in one buffer, merges by row indexing.

A set of gossip events on disjoint pairs (:class:`engine.plan.PairSet`) is applied
together: the winner test is one batched forward over every pair of the set, the
weights (scalar or per coordinate) are computed for the whole set, and the rows are
lerped in place through views (gathering and scattering whole rows with advanced
indexing was measured 2-5x slower per row on the CPU). The same numbers come out as
applying the events one by one (the tests keep that event-by-event reference),
because each coordinate goes through the same operations in the same order.

It also runs what needs every worker's state at every event: peers drawn by
similarity, self-forming communities, data that travels, and model swaps.
"""

from __future__ import annotations

import numpy as np
import torch

from ..engine import datapool, ops, similarity
from ..engine import kernel, plan as plan_mod
from ..engine import run as run_mod, setup as setup_mod
from ..engine.plan import PairSet
from ..policy import MergePolicy
from .base import Backend


class InProcess(Backend):
    def __init__(self, setup: setup_mod.Setup, policy: MergePolicy, seed: int, device: torch.device,
                 state=None, tensors=None):
        W = setup.study.run.workers
        super().__init__(setup, policy, seed, device, list(range(W)), state=state, tensors=tensors)
        self.W = W
        self.pool = None
        # a population's list: this member's all-reduces are collected there and applied with other members' (None:
        # applied here, at once; population._Group.collect_allreduces)
        self.collect: list | None = None
        if policy.data_exchange_k or policy.retire_threshold or (policy.swap_p and policy.swap_confidence):
            self.pool = datapool.DataPool(setup.shards, len(self.train_y), seed, retire_threshold=policy.retire_threshold,
                                          reserve_rate=policy.reserve_rate)
        self.example_bytes = plan_mod.example_bytes(self.train_x)
        # peers drawn during the run, not from the schedule: by similarity, or in regrouped communities
        self.live_peers = policy.scheme == "gossip" and bool(policy.similarity_bias or policy.regroup_every)
        topo = self.sched.topology
        self.groups = getattr(topo, "groups", np.zeros(W, dtype=np.int64))
        self.topo = topo
        self.peer_p = topo.probabilities() if topo is not None else None
        self._peer_p_at: tuple[int, np.ndarray] | None = None  # (step, peer distributions) of a moving p_intra
        self.left_at = np.full((W, W), -np.inf)  # [model, worker]: the step the model last left the worker's data
        self._sim_at: tuple[int, np.ndarray] | None = None  # (step, similarity matrix) cache
        self._sim_t = None  # on a simulated clock: the instant the cached sketches' similarities were taken
        self._sketches: torch.Tensor | None = None  # on a simulated clock: each row's sketch, kept between decisions
        self._touched: set[int] = set()  # rows changed since
        # publish_every: what decisions read, as the workers last published it (similarities, each worker's
        # confidence); published at the start and after every publish_every local steps
        self.publish_every = plan_mod.publishes(policy)
        self._published: tuple[np.ndarray | None, list | None] | None = None
        self.sim = None
        self.labels = setup.data.train_y.numpy()

    def start(self, judge) -> None:
        self.sim = judge.similarity
        if self.publish_every:
            self.publish()

    def publish(self) -> None:
        """Every worker publishes what decisions read (``publish_every``): its sketch (or CKA logits), taken as the
        similarity matrix, and its data's confidence where swaps are decided by it."""
        p = self.p
        sims = self.sim.matrix(self.state.params).cpu().numpy() if plan_mod.gathers_similarity(p) else None
        conf = [self.pool.confidence(w) for w in range(self.W)] if plan_mod.decides_by_confidence(p) else None
        self._published = (sims, conf)

    def clock_confidence(self, j: int) -> float | None:
        """Worker ``j``'s data's confidence as a decision on a simulated clock reads it (the replay brought up to the
        decision's instant, or to the last publication)."""
        return self._published[1][j] if self.publish_every else self.pool.confidence(j)

    def train(self, start, end, after_step):
        return run_mod.train_steps(self.setup, self.state, self.own, self.seed, start, end, self.train_x, self.train_y,
                                   after_step, self.pool)

    def gather(self):
        return self.state.params

    def label_skew(self) -> float:
        if self.pool is None:
            return self.setup.label_skew
        from .. import data as data_mod

        return data_mod.label_skew(self.labels, self.pool.holdings(), self.setup.data.n_classes)

    def moved(self) -> int:
        return self.pool.moved if self.pool is not None else 0

    def visitors(self) -> float | None:
        return self.pool.visitors() if self.pool is not None else None

    def communities(self):
        return self.groups.tolist() if self.p.regroup_every else None

    def model_at(self):
        return self.state.model_at.tolist()

    # -- peers drawn during the run, and regrouping -------------------------------------------------
    def _similarities(self, step: int) -> np.ndarray:
        """The workers' similarity matrix, recomputed at most once per step (every 10 for CKA); with
        ``publish_every``, the one last published."""
        if self.publish_every:
            return self._published[0]
        every = 1 if self.p.similarity == "sketch" else 10
        if self._sim_at is None or step - self._sim_at[0] >= every:
            self._sim_at = (step, self.sim.matrix(self.state.params).cpu().numpy())
        return self._sim_at[1]

    def peers(self, events, step):
        if self.pool is not None and self.p.data_exchange_k and self.p.data_similarity_sign:
            self._similarities(step)  # what travels is chosen by the similarities before the step's merges
        if not self.live_peers:
            return self.sched.peer[events]
        return np.array([self._draw_peer(int(ev), step, self._similarities) for ev in events], dtype=np.int64)

    def _draw_peer(self, ev: int, step: int, sims) -> int:
        """Event ``ev``'s peer, drawn at local step ``step`` from the (regrouped, moving) topology, biased by
        similarity (``sims(step)``: the similarity matrix then)."""
        a = int(self.sched.initiator[ev])
        p = self._peer_p(step)[a]
        if self.p.similarity_bias:
            p = similarity.biased_peer_probabilities(p, sims(step)[a], self.p.similarity_bias)
        return int(similarity.draw(p, float(self.sched.u_peer[ev])))

    # on a simulated clock: asked by the clock at an event's instant, the replay brought up to it (timed.Timed)
    def clock_peer(self, ev: int, w: int, k: int, t: float) -> int:
        """The peer of worker ``w``'s event ``ev`` at its boundary ``k``, at simulated time ``t``."""
        return self._draw_peer(ev, k, lambda step: self._similarities_at(step, t))

    def clock_share(self, i: int, j: int, k: int, t: float) -> float:
        """The share of most confident examples ``i`` sends ``j`` at its boundary ``k`` (data_similarity_sign)."""
        return datapool.most_confident_share(self.p.data_similarity_sign, self._similarities_at(k, t)[i], i, j)

    def _similarities_at(self, step: int, t: float) -> np.ndarray:
        """The similarity matrix at simulated time ``t`` (of a decision at a worker's local step ``step``): sketches
        again at every new instant (of the rows changed since: a sketch is a function of its row alone), CKA every
        10 of the deciding worker's steps (as :meth:`_similarities`)."""
        if self.p.similarity == "sketch" and not self.publish_every:
            if self._sim_at is None or self._sim_t != t:
                st = self.state
                if self._sketches is None:
                    self._sketches = self.sim.sketcher(st.params.blocks)
                elif self._touched:
                    rows = torch.as_tensor(sorted(self._touched), device=st.params.device)
                    self._sketches[rows] = self.sim.sketcher([b.index_select(0, rows) for b in st.params.blocks])
                self._touched.clear()
                self._sim_at = (step, similarity.cosine_matrix(self._sketches).cpu().numpy())
                self._sim_t = t
            return self._sim_at[1]
        return self._similarities(step)

    def touched(self, workers) -> None:
        """Workers whose parameters a timed run's replay changed (a step, a merge, a swap): their sketches are stale."""
        self._touched.update(workers)

    def end_round(self, r: int) -> None:
        if self.p.regroup_every and (r + 1) % self.p.regroup_every == 0:
            from ..engine.topology import Communities

            self.groups = similarity.cluster(self.sim.matrix(self.state.params), self.p.n_communities)
            self.regroup_bytes += plan_mod.regroup_bytes(self.W, plan_mod.similarity_bytes(
                self.p, self.setup.data.n_classes))
            self.topo = Communities(self.W, self.p.n_communities, self.p.p_intra, groups=self.groups,
                                    p_intra_final=self.p.p_intra_final, schedule=self.p.p_intra_schedule)
            self.peer_p = self.topo.probabilities()
            self._peer_p_at = None
            self._sim_at = None

    def _peer_p(self, step: int) -> np.ndarray:
        """The peer distributions at ``step``: communities whose p_intra moves over the run change with it."""
        if getattr(self.topo, "schedule", "constant") == "constant":
            return self.peer_p
        if self._peer_p_at is None or self._peer_p_at[0] != step:
            self._peer_p_at = (step, self.topo.probabilities(step / self.setup.total_steps))  # the run's steps
        return self._peer_p_at[1]

    def after_events(self, events, a, b, step: int) -> int:
        if self.pool is None or not self.p.data_exchange_k:
            return 0
        sent = 0
        sign = self.p.data_similarity_sign
        sims = self._similarities(step) if sign else None
        for i, j in zip(a.tolist(), b.tolist()):
            most = datapool.most_confident_share(sign, sims[i], i, j) if sign else 0.0
            sent += self.example_bytes * self.pool.send(i, j, self.p.data_exchange_k, most=most,
                                                        unseen_first=self.p.data_unseen_first)
        return sent

    # -- gossip: a set of disjoint pairs at once --------------------------------------------------------
    def swap_chances(self, a, b, step):
        p = self.p
        if not (p.swap_confidence or p.swap_recency):
            return p.swap_p
        conf = {j: self.clock_confidence(j) for j in set(b.tolist())} if p.swap_confidence else {}
        return np.array([plan_mod.swap_chance(p, conf.get(j), step - self.left_at[self.state.model_at[i], j])
                         for i, j in zip(a.tolist(), b.tolist())])

    def pairs(self, ps: PairSet) -> None:
        if ps.swap.any():
            for i, j in zip(ps.a[ps.swap].tolist(), ps.b[ps.swap].tolist()):
                self.left_at[self.state.model_at[[i, j]], [i, j]] = ps.step  # each model leaves its worker's data
                self._swap(i, j)
            ps = ps.only(~ps.swap)
            if not len(ps):
                return
        p, st = self.p, self.state
        winners = [None] * len(ps)
        running = p.score == "running"
        if p.winner_bias > 0:
            if running:  # the models' running training losses: no forward
                sc = st.score.tolist()
                winners = [plan_mod.winner(sc[i], sc[j]) for i, j in zip(ps.a.tolist(), ps.b.tolist())]
            else:
                loss = self._pair_losses(ps.a, ps.b)
                winners = [plan_mod.winner(loss[2 * i], loss[2 * i + 1]) for i in range(len(ps))]
        moves = [plan_mod.moves(p, ps.weight, float(u), w) for u, w in zip(ps.u.tolist(), winners)]
        push_pull = p.exchange == "push_pull"
        if running:
            kernel.merge_scores_(st.score, ps.a, ps.b, [m[0] for m in moves], [m[1] for m in moves], push_pull)
        a_rows, b_rows = ps.a.tolist(), ps.b.tolist()
        # what each side puts on the wire (delta payloads: its public copy after this send)
        sent_a = self.payload.outgoing(st, p, self.seed, ps.a, ps.events, 0)
        sent_b = self.payload.outgoing(st, p, self.seed, ps.b, ps.events, 1) if push_pull else None
        weight_b = self.weighting.pair_weights(st, [m[1] for m in moves], ps.b, ps.a)
        weight_a = self.weighting.pair_weights(st, [m[0] for m in moves], ps.a, ps.b) if push_pull else None
        kernel.exchange_(st.params.blocks, st.merge_change.blocks, self.rules, self.setup.model.offsets, a_rows,
                         b_rows, kernel.columns(sent_a), kernel.columns(sent_b), weight_b, weight_a)
        st.optim.merge_pairs(p.optimizer_state, a_rows, b_rows, weight_b, weight_a, moves)
        if st.accum is not None:  # accumulators are summed, not averaged (VW's merge)
            kernel.sum_pairs_(st.accum.blocks, a_rows, b_rows, push_pull)

    def _swap(self, a: int, b: int) -> None:
        """The two workers exchange models, with everything that belongs to a model (optimiser
        state, supports, public copy); each goes on with the other's data."""
        st = self.state
        ra, rb = st.params.row(a), st.params.row(b)
        for stack in st.stacks():
            stack.swap_rows_(a, b)
        st.optim.swap_rows_(a, b)
        st.merge_change.set_row(a, st.merge_change.row(a) + (rb - ra))
        st.merge_change.set_row(b, st.merge_change.row(b) + (ra - rb))
        st.model_at[[a, b]] = st.model_at[[b, a]]
        st.score[[a, b]], st.score_weight[[a, b]] = st.score[[b, a]], st.score_weight[[b, a]]

    # -- a simulated clock: a swap's two halves, and examples in transit ---------------------------------------
    def model_of(self, w: int) -> dict:
        """Worker ``w``'s model with everything that belongs to it (what a swap moves, :meth:`_swap`), as it is now:
        the stacks' rows, the optimiser's state, its counter and supports, its running score and which model it is."""
        st, k = self.state, self.pos[w]
        return {"rows": [s.row(k) for s in (st.params, st.accum, st.base) if s is not None],
                "optim": st.optim.row_state(k), "examples": float(st.examples[w]), "epoch": st.support_epoch,
                "score": (st.score[k].clone(), st.score_weight[k].clone()), "model": int(st.model_at[k])}

    def install(self, w: int, got: dict) -> None:
        """Worker ``w`` takes a model from :meth:`model_of` in place of its own (one half of a swap); what merges
        changed this round takes the difference, as :meth:`_swap` does."""
        st, k = self.state, self.pos[w]
        old, new = st.params.row(k), got["rows"][0]
        stacks = [s for s in (st.params, st.accum, st.base) if s is not None]
        scale = kernel.support_factor(st.support_epoch - got["epoch"])  # supports rescaled since it left
        for s, row in zip(stacks, got["rows"]):
            s.set_row(k, row * scale if s is st.accum and scale != 1.0 else row)
        for s, row in zip(st.optim.stacks(), got["optim"]["stacks"]):
            s.set_row(k, row)
        if st.optim.steps is not None:
            st.optim.steps[k] = got["optim"]["steps"]
        st.merge_change.set_row(k, st.merge_change.row(k) + (new - old))
        st.examples[w] = got["examples"] * scale
        st.score[k], st.score_weight[k] = got["score"]
        st.model_at[k] = got["model"]

    def data_out(self, i: int, j: int, most: float = 0.0) -> np.ndarray:
        """The examples ``i`` sends ``j`` with an event's payload (:meth:`after_events`' choice; ``most``: the share
        of its most confident), now in transit."""
        return self.pool.leave(i, j, self.p.data_exchange_k, most=most, unseen_first=self.p.data_unseen_first)

    def data_in(self, j: int, positions: np.ndarray) -> None:
        self.pool.arrive(j, positions)

    # -- complete average ----------------------------------------------------------------------------
    def allreduce(self, event: int, step: int, weight: float, dropped: tuple[int, ...] = ()) -> None:
        """``dropped``: backup workers late at the clock's barrier, left out of the average (they take it)."""
        st, p, W = self.state, self.p, self.W
        if p.payload == "gradient":  # every step's gradient, averaged before every worker's update
            gens = [plan_mod.quant_generator(self.seed, event, w) if p.quantize_bits else None for w in range(W)]
            kernel.gradient_average_(st.grad, st.residual, p.topk_fraction, p.quantize_bits, gens)
            run_mod.update(self.setup, st)
            return
        if self.collect is not None:  # the weight, and the supports as they are now (the counters move on at once)
            support = self.weighting.supports(st)[0]  # a plain mean (None) or the example counters, as below
            self.collect.append((self, weight, None if support is None else support.clone()))
            return
        every = np.arange(W)
        if self.outer_delta and (self.fragment(event) is not None or p.fragment_alpha):  # streamed, landing now
            models, sends = self._fragment_sent(event, list(range(W)))
            supports = self.weighting.supports(st)
            st.optim.merge_all(p.optimizer_state, supports, weight)
            kernel.average_all_(st.params.blocks, st.merge_change.blocks, self.rules,
                                [models.get(b) for b in range(len(st.params.blocks))], supports,
                                weight, False, st.outer, self.setup.model.offsets, self.fragment(event))
            self._fragment_owed(event, list(range(W)), sends)
            return
        if self.outer_delta:  # compressed outer gradients (MuLoCo): the anchor plus each worker's sent change
            before, rows = st.base.rows().clone(), st.params.rows().clone()
            public = self.payload.outgoing(st, p, self.seed, every, np.full(W, event), list(range(W)))
            sent = kernel.outer_gradient_targets(st.outer.anchor, public, before)
        else:
            sent = self.payload.outgoing(st, p, self.seed, every, np.full(W, event), list(range(W)))
        blocks = st.params.blocks if sent is None else [sent[:, o:o + n] for o, n in self.setup.model.offsets]
        if dropped:
            keep = torch.as_tensor([w for w in range(W) if w not in dropped], device=blocks[0].device)
            blocks = [blk.index_select(0, keep) for blk in blocks]
        supports = self.weighting.supports(st)
        st.optim.merge_all(p.optimizer_state, supports, weight)  # before the supports merge
        kernel.average_all_(st.params.blocks, st.merge_change.blocks, self.rules, blocks, supports, weight,
                            self.weighting.accumulators, st.outer, self.setup.model.offsets, self.fragment(event))
        if self.outer_delta:  # what each did not send stays owed: its public copy is the new anchor less that
            st.base.set_rows(kernel.owed_public(st.params.rows(), rows, public))

    # -- Streaming DiLoCo: a fragment's all-reduce sent now, landed fragment_delay steps later -------------
    def allreduce_start(self, event: int) -> None:
        """The workers' average of the event's fragment as they are now (and its outer step), kept until
        :meth:`allreduce_finish` (streaming needs uniform weighting: the rows themselves, or with compressed outer
        gradients the anchor plus what each sent)."""
        st = self.state
        models = st.params.blocks
        if self.outer_delta:
            sent, self._owing[event] = self._fragment_sent(event, list(range(self.W)))
            models = [sent.get(b) for b in range(len(st.params.blocks))]
        self._in_flight[event] = kernel.average_targets_(
            st.params.blocks, self.rules, models, self.weighting.supports(st), False, st.outer,
            self.setup.model.offsets, self.fragment(event))

    def allreduce_finish(self, event: int, weight: float) -> None:
        st = self.state
        kernel.lerp_targets_(st.params.blocks, st.merge_change.blocks, self._in_flight.pop(event), weight)
        if event in self._owing:
            self._fragment_owed(event, list(range(self.W)), self._owing.pop(event))

    # -- Streaming DiLoCo with compressed outer gradients ---------------------------------------------------
    def _fragment_parts(self, event: int) -> tuple[list[int], list[int], torch.Tensor]:
        """The event's fragment: its blocks (every block without fragments), their sizes, and the anchor there."""
        only = self.fragment(event)
        only = list(range(len(self.state.params.blocks))) if only is None else only
        offsets, anchor = self.setup.model.offsets, self.state.outer.anchor
        return only, [offsets[b][1] for b in only], torch.cat([anchor[offsets[b][0]:offsets[b][0] + offsets[b][1]]
                                                              for b in only])

    def _fragment_sent(self, event: int, workers: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, tuple]]:
        """Each of ``workers`` sends its change since its public copy on the event's fragment, compressed as a whole
        model's is (:func:`ops.compress`, the same generator), and its public copy there moves by what it sent.
        Returns per block of the fragment the models averaged, ``[len(workers), n]``: the anchor plus each sent change
        (:func:`kernel.outer_gradient_targets`); and per worker its rows and its public copy there after the send,
        what :func:`kernel.owed_public` takes when the average lands (error feedback)."""
        st, p = self.state, self.p
        only, sizes, anchor = self._fragment_parts(event)
        models, sends = [], {}
        for w in workers:
            k = self.pos[w]
            now = torch.cat([st.params.blocks[b][k] for b in only])
            before = torch.cat([st.base.blocks[b][k] for b in only])
            gen = plan_mod.quant_generator(self.seed, event, w) if p.quantize_bits else None
            public = ops.apply_delta(before, ops.compress(ops.delta(now, before), p.topk_fraction, p.quantize_bits, gen))
            for b, part in zip(only, public.split(sizes)):
                st.base.blocks[b][k].copy_(part)
            models.append(kernel.outer_gradient_targets(anchor, public.unsqueeze(0), before.unsqueeze(0))[0])
            sends[w] = (now, public)
        return dict(zip(only, torch.stack(models).split(sizes, dim=1))), sends

    def _fragment_owed(self, event: int, workers: list[int], sends: dict[int, tuple]) -> None:
        """The fragment has landed at ``workers``: each one's public copy there is the new anchor (the global value
        the pseudo-gradient is taken from, whatever ``fragment_alpha`` mixed into the rows) less what it did not send
        (:func:`kernel.owed_public`), so that its next change sent carries the rest."""
        st = self.state
        only, sizes, anchor = self._fragment_parts(event)
        for w in workers:
            k = self.pos[w]
            rows, public = sends.pop(w)
            for b, part in zip(only, kernel.owed_public(anchor, rows, public).split(sizes)):
                st.base.blocks[b][k].copy_(part)

    # -- asynchronous DiLoCo: pushes to the server, in the clock's order -------------------------------------------
    def async_push(self, workers: list[int]) -> None:
        """``workers`` (one batch) push their rows to the server, which steps; each takes the new global model."""
        st = self.state
        if self.server is None:
            raise RuntimeError("asynchronous DiLoCo without its server (a bug in evomerge)")
        rows = torch.stack([st.params.row(self.pos[w]) for w in workers])
        glob = self.server.push_(rows, workers)
        for w in workers:
            k = self.pos[w]
            st.merge_change.set_row(k, st.merge_change.row(k) + (glob - st.params.row(k)))
            st.params.set_row(k, glob)

    # on a simulated clock each worker sends its fragment at its own time and takes the average at its own
    def allreduce_send(self, event: int, workers: list[int]) -> bool:
        """``workers`` send their rows of the event's fragment as they are now; once every worker has, the
        average (and its outer step) is taken. Returns whether it has."""
        st, only = self.state, self.fragment(event)
        blocks = range(len(st.params.blocks)) if only is None else only
        sent = self._sending.setdefault(event, {})
        if self.outer_delta:  # compressed outer gradients: the anchor plus what each sent, owed the rest
            models, sends = self._fragment_sent(event, workers)
            self._owing.setdefault(event, {}).update(sends)
            for i, w in enumerate(workers):
                sent[w] = {b: models[b][i] for b in blocks}
        else:
            for w in workers:
                sent[w] = {b: st.params.blocks[b][self.pos[w]].clone() for b in blocks}
        if len(sent) < self.W:
            return False
        models = [torch.stack([sent[w][b] for w in range(self.W)]) if b in blocks else None
                  for b in range(len(st.params.blocks))]
        del self._sending[event]
        self._in_flight[event] = (kernel.average_targets_(st.params.blocks, self.rules, models,
                                                          self.weighting.supports(st), False, st.outer,
                                                          self.setup.model.offsets, only), set(range(self.W)))
        return True

    def allreduce_landed(self, event: int) -> bool:
        return event in self._in_flight

    def allreduce_land(self, event: int, workers: list[int], weight: float) -> None:
        """The fragment's average lands at ``workers``: each moves ``weight`` of the way to it."""
        st = self.state
        targets, left = self._in_flight[event]
        if len(workers) == self.W:  # all at once, as the lockstep run does it
            kernel.lerp_targets_(st.params.blocks, st.merge_change.blocks, targets, weight)
        else:
            for w in workers:
                k = self.pos[w]
                kernel.lerp_targets_([blk[k:k + 1] for blk in st.params.blocks],
                                     [chg[k:k + 1] for chg in st.merge_change.blocks], targets, weight)
        if event in self._owing:
            self._fragment_owed(event, workers, self._owing[event])
            if not self._owing[event]:
                del self._owing[event]
        left.difference_update(workers)
        if not left:
            del self._in_flight[event]


def run(setup: setup_mod.Setup, policy: MergePolicy, seed: int = 0, *, callback=None, device=None,
        evaluate_test: bool = False, keep_params: bool = False, waves: bool = False,
        curves: bool = True) -> setup_mod.RunResult:
    """One merge run in this process; ``callback`` gets each round's metrics (it may raise to stop the run).

    ``evaluate_test`` also scores the consensus model on the test set (never during a
    search); ``keep_params`` returns the workers' final ``[W, P]`` parameters; ``waves``: replay a timed run one
    wave at a time even where its timeline is the lockstep world's (the tests hold the waves to the lockstep run);
    ``curves=False``: the validation split evaluated at the last round only, where only the final metrics are read
    (:func:`evomerge.engine.run.execute`).
    """
    import time

    t0 = time.perf_counter()
    backend = InProcess(setup, policy, seed, setup_mod.resolve_device(device))
    return run_mod.execute(setup, policy, seed, backend, callback=callback, evaluate_test=evaluate_test,
                           keep_params=keep_params, t0=t0, waves=waves, curves=curves)
