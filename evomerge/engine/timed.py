"""A run on a simulated cluster (``[environment]``): the timeline of :mod:`.clock` replayed on a backend.

The timeline says, per worker, how many local steps it does and which actions happen at
which of its step boundaries (snapshot a payload, merge a landed one, take part in an
all-reduce). Each action reads or changes the state of one worker only (a landed payload
is the snapshot its sender took when it sent it), so a worker's state depends on its own
sequence of steps and actions alone, and workers may be advanced in any interleaving
that respects two rules: a worker applies its actions in its own order, and a payload is
applied only after its sender snapshotted it. That is what keeps compute batched:

- *waves*: every worker that is not waiting for a payload (or for the others at an
  all-reduce or at the round's end) does its next local step, all of them in one batched
  step over the rows that step (all rows: the lockstep computation itself);
- between waves, every action that can be applied is applied.

Each round ends when every worker has reached the round's simulated end time; the engine
then judges it as in the lockstep world.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import clock, plan as plan_mod
from . import schedule as schedule_mod
from .run import local_step
from .setup import Setup, batch_indices, normalise

from ..policy import TIMED_UNSUPPORTED as UNSUPPORTED, check_timed as check_policy  # noqa: F401  (re-exported)


def async_local_steps(policy, env, workers: int, seed: int) -> list[int] | None:
    """Asynchronous DiLoCo's local steps per round of each worker: round(mean_interval), or with dynamic local
    updates (``local_steps_by_speed``) that scaled by the worker's configured speed against the fastest's."""
    if policy.scheme != "async":
        return None
    H = max(1, round(policy.mean_interval))
    if not policy.local_steps_by_speed:
        return [H] * workers
    return plan_mod.steps_by_speed(H, clock.speed_factors(env, workers, seed))  # step-time multipliers: 1 / speed


def lockstep_equivalent(tl: clock.Timeline, policy, T: int) -> bool:
    """Whether a timeline is the lockstep world's: every worker does all ``T`` steps, each ending when the others'
    do, and every action happens at the boundary of its event's own step (a streamed fragment's landing
    ``fragment_delay`` steps later); no asynchronous server, no late backup workers. A homogeneous cluster with free
    links is (the identity the tests hold it to); its replay may then go through the lockstep run's sets of disjoint
    pairs instead of one wave at a time."""
    s = tl.schedule
    if s.scheme == "async" or tl.dropped:
        return False
    first = tl.completions[0]
    if len(first) != T or any(len(c) != T or not np.array_equal(c, first) for c in tl.completions):
        return False
    delay = policy.fragment_delay
    steps, E = s.step, len(s)
    return all(a.boundary == (int(steps[a.event]) if a.event < E else clock.slowmo_step(E, a.event))
               + (delay if a.kind == clock.AR_APPLY else 0) for acts in tl.actions for a in acts)


def decides_with_state(policy) -> bool:
    """Whether a run of ``policy`` on a clock decides with the workers' state at its events (peers drawn by similarity
    or in regrouped communities, examples chosen by similarity, swaps by the peer's confidence): its clock then runs
    beside the replay (:class:`Timed`), not before it."""
    return plan_mod.gathers_similarity(policy) or (policy.scheme == "gossip" and bool(
        policy.regroup_every or (policy.swap_p and policy.swap_confidence)))


def build_timeline(setup: Setup, policy, seed: int, state_stacks: int, horizon: int | None = None):
    """The simulated clock of one run of ``policy`` (seed ``seed``) on the study's ``[environment]``, without
    training anything: what a timed run replays, and what the dashboard draws. ``state_stacks``: the optimiser's
    state tensors per parameter (what ``optimizer_state = "average"`` sends; ``optim.state_stacks``). A run that
    decides with its state gets the timeline its schedule's own peers (and unconditioned swaps) would give; with
    ``horizon`` the :class:`clock.Simulation` to run beside its replay instead (a schedule of that many steps)."""
    from . import schedule as schedule_mod

    run = setup.study.run
    neighbours = None
    if policy.scheme == "gossip":
        from . import topology as topo_mod

        topo = topo_mod.build(policy, run.workers, schedule_mod.rng_for(seed, schedule_mod.TAG_TOPOLOGY))
        neighbours = [len(topo.neighbours(i)) for i in range(run.workers)]
    cost = plan_mod.costs(setup, policy, neighbours, state_stacks)
    local_steps = async_local_steps(policy, setup.study.environment, run.workers, seed)
    make = (lambda h: schedule_mod.build(policy, run.workers, h, seed, local_steps, run_steps=setup.total_steps))
    if horizon is not None:
        return clock.simulation(setup.study.environment, policy, run.workers, setup.total_steps, run.rounds, seed,
                                cost, make, horizon)
    return clock.build(setup.study.environment, policy, run.workers, setup.total_steps, run.rounds, seed, cost, make)


class Timed:
    """The driver of a timed run (see :class:`.run.Lockstep` for the lockstep one), on the workers the
    backend owns: all of them in process, one rank's under ``torch.distributed`` (payloads between
    ranks travel as messages; a rank waits for one only when nothing else can go on).

    ``emulate``: pace the run to the simulated clock (sleep until each step's and each merge's
    simulated time), so a distributed run's wall clock can be held against the simulated one. ``waves``: replay
    one wave at a time even where the timeline is the lockstep world's (:func:`lockstep_equivalent`)."""

    def __init__(self, setup: Setup, policy, seed: int, backend, emulate: bool = False, waves: bool = False):
        check_policy(policy)
        run = setup.study.run
        self.setup, self.p, self.seed, self.backend = setup, policy, seed, backend
        self.W, self.T = run.workers, setup.total_steps
        self.own = list(backend.own)
        if len(self.own) < self.W and backend.payload.public:
            from ..errors import ConfigError

            raise ConfigError("policy.payload", f"{policy.payload!r} is not supported by the distributed backend with "
                                                "an [environment] yet; allowed: weights, or --backend inprocess")
        stacks = len(backend.state.optim.stacks())
        self.timeline = build_timeline(setup, policy, seed, stacks)
        # asynchronous DiLoCo: the server's batches in time order; each is applied when all its workers are there
        batches: dict[float, list[tuple[int, int]]] = {}
        for acts in self.timeline.actions:
            for a in acts:
                if a.kind == clock.ASYNC:
                    batches.setdefault(a.time, []).append((a.worker, a.boundary))
        self.batches = [sorted(batches[t]) for t in sorted(batches)]
        self.served = 0
        backend.sched = self.timeline.schedule  # every backend replays the timeline's schedule
        self._horizon = setup.study.environment.time_budget or self.timeline.end
        self.done = np.zeros(self.W, dtype=np.int64)
        self.ptr = [0] * self.W
        self.snaps: dict[tuple[int, int], dict] = {}  # payloads that were sent to this backend's workers
        # payloads that land before the end (the others are never sent: nobody would receive them)
        self.landing = {(a.event, a.kind) for acts in self.timeline.actions for a in acts
                        if a.kind in (clock.LAND, clock.REPLY)}
        self._batches: list[tuple[int, np.ndarray]] = [(0, np.zeros((0, run.batch_size), dtype=np.int64))] * self.W
        self._r = -1
        self.emulate, self._t0 = emulate, None
        self.each = plan_mod.own_outer_every(policy)
        self.data = bool(policy.data_exchange_k) and policy.scheme == "gossip"  # examples travel with the payloads
        # the fast path: a timeline that is the lockstep world's (every worker's steps end together, every merge
        # applied at the boundary of its own step) is replayed as the lockstep run replays its steps
        self.merger = None
        free = lockstep_equivalent(self.timeline, policy, self.T)
        if not (emulate or waves) and free:
            from .merger import StepMerger

            self.merger = StepMerger(setup, policy, backend.sched, backend)
        # deciding with the state: the clock runs beside the replay, which it brings up to each decision's instant
        # (a free cluster's timing does not depend on those decisions: it takes the lockstep path above)
        self.live = None
        self._partial: clock.Timeline | None = None  # deciding with the state: the timeline up to the last round's end
        # what the replayed clock decided: each event's peer, examples by similarity, swaps (and those cancelled)
        tl = self.timeline
        self.peers = tl.peers if tl.peers is not None else tl.schedule.peer
        self.most, self.swaps, self.cancelled = tl.most, tl.swaps, tl.cancelled
        # a free cluster deciding with the state took the lockstep path: its bytes and merges are the merger's
        self.merger_counts = self.merger is not None and decides_with_state(policy)
        if self.merger is None and decides_with_state(policy):
            if len(self.own) < self.W or emulate:
                raise RuntimeError("a run that decides with its state runs in process only (a bug in evomerge)")
            # its schedule: the first timeline's horizon, with room to spare where waiting may differ
            self.live = build_timeline(setup, policy, seed, stacks, self.timeline.horizon * (1 if free else 2))
            self.live.oracle = self
            backend.sched = self.live.sched
            # the running clock's own (growing) records
            self.peers, self.most, self.swaps, self.cancelled = (self.live.peer, self.live.most, self.live.swaps,
                                                                 self.live.cancelled)
            self.landing = None  # not known before it happens: every payload is kept until it lands or the run ends
            self.acts: list[list[clock.Action]] = [[] for _ in range(self.W)]
            self._seen = [0] * self.W
            self._moved = 0  # the running clock's moved actions taken in (_collect)
            self._pending: list[list] = [[] for _ in range(self.W)]
            self._loss = torch.zeros((), device=backend.state.params.device)
            self.live_peers = backend.live_peers  # the clock asks for peers drawn during the run
        # publish_every: the publication the backend holds (0: the start's, published when the run started)
        self.publish = plan_mod.publishes(policy)
        self._published = 0

    @property
    def horizon(self) -> float:
        """The run's simulated length (a miss's time to target ranks after it): the time budget, else the first
        timeline's end, or the clock's last round end so far where the run decides with its state (waiting may make
        it longer than the first timeline)."""
        if self.live is not None and self.live.round_ends and not self.setup.study.environment.time_budget:
            return max(self._horizon, self.live.round_ends[-1])
        return self._horizon

    @property
    def schedule(self):
        return self.live.sched if self.live is not None else self.timeline.schedule

    @property
    def rounds(self) -> int:
        return len(self.timeline.round_ends)

    @property
    def sent(self) -> int:
        if self.merger_counts:  # its first timeline had the schedule's choices
            return self.merger.bytes + self.backend.regroup_bytes
        return (self._partial or self.timeline).bytes[self._r]

    @property
    def merges(self) -> int:
        if self.merger_counts:
            return self.merger.count
        return (self._partial or self.timeline).merges[self._r]

    def timing(self, r: int) -> dict:
        return (self._partial or self.timeline).round_metrics(r)

    # -- deciding with the state: the clock asks, the replay answers from the state at that instant ----------------
    def peer(self, e: int, w: int, k: int, t: float) -> int:
        if self.p.similarity_bias:  # regrouped communities alone change only between rounds
            self._state_at(t)
        return self.backend.clock_peer(e, w, k, t)

    def share(self, e: int, w: int, j: int, k: int, t: float) -> float:
        self._state_at(t)
        return self.backend.clock_share(w, j, k, t)

    def confidence(self, j: int, t: float) -> float | None:
        self._state_at(t)
        return self.backend.clock_confidence(j)

    def _state_at(self, t: float) -> None:
        """What a decision at ``t`` reads: the state just before ``t``, or with ``publish_every`` the last
        publication at or before ``t`` (the replay is brought up to it only when it is new: the waves between stay
        wide)."""
        if not self.publish:
            self._catch_up(t)
            return
        n = self.live.publications_by(t)
        if n > self._published:
            self._catch_up(self.live.publication_time(n))
            self.backend.publish()
            self._published = n

    def _catch_up(self, t: float) -> None:
        """The replay brought to the state just before ``t``: every step done by ``t``, every action before it."""
        self._collect(t, False)
        self._advance(t, False, self.live.steps_by(t), self._loss)  # each step's loss added in turn, as lockstep

    def _collect(self, t: float, inclusive: bool) -> None:
        """Each worker's actions up to ``t`` from the running clock, in the order it applies them. Those before ``t``
        are all known when the clock is at ``t``, and come first in that order (a worker's boundaries follow time)."""
        import heapq

        # an action the clock moved after this replay took it in (a landing due at a step that the work's end
        # dropped, applied at the boundary before): the pending copy gives way to the new one (the copy's boundary
        # was never reached, and the landing was never applied while the clock counted it)
        for w, i, old in self.live.moved[self._moved:]:
            if i < self._seen[w]:
                q = self._pending[w]
                kept = [x for x in q if x[1] is not old]
                if len(kept) < len(q):
                    a = self.live.actions[w][i]
                    q[:] = kept + [((a.boundary, *a.key), a)]
                    heapq.heapify(q)
        self._moved = len(self.live.moved)
        for w in range(self.W):
            new = self.live.actions[w][self._seen[w]:]
            self._seen[w] += len(new)
            q = self._pending[w]
            for a in new:
                heapq.heappush(q, ((a.boundary, *a.key), a))
            while q and (q[0][1].time <= t if inclusive else q[0][1].time < t):
                self.acts[w].append(heapq.heappop(q)[1])

    # -- the waves of one round ---------------------------------------------------------------
    def train_round(self, r: int) -> tuple[torch.Tensor, int, float]:
        tl, b = self.timeline, self.backend
        self._r = r
        if self.merger is not None:  # the lockstep world's steps and merges (the same numbers, fewer passes)
            start = int(tl.steps_at[r - 1][0]) if r else 0
            end = int(tl.steps_at[r][0])
            loss = b.train(start, end, self.merger.after_step) if end > start else \
                torch.zeros((), device=b.state.params.device)
            self.done[:] = end
            return loss, end, float(end - start) if end > start else 1.0
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self.live is not None:
            t_end = self.live.through_round(r)  # its decisions bring the replay along
            if max(self.live.done) > self.live.horizon:
                raise RuntimeError(f"simulated clock: a worker ran past its schedule's {self.live.horizon} steps "
                                   "(a bug in evomerge)")
            if self.publish:  # the last publication of the round, before the replay passes it
                self._state_at(t_end)
            self._collect(t_end, True)
            target = self.live.steps_by(t_end)
            loss_sum = self._advance(t_end, True, target, self._loss)
            self._loss = torch.zeros((), device=b.state.params.device)
            self._partial = self.live.timeline(r + 1)
            if r + 1 == self.rounds:
                self.timeline = self.live.timeline()
            before = self._partial.steps_at[r - 1].sum() if r else 0
            steps = float(target.sum() - before) / self.W
            return loss_sum, int(round(float(target.mean()))), steps if steps > 0 else 1.0
        t_end, target = tl.round_ends[r], tl.steps_at[r]
        loss_sum = self._advance(t_end, True, target)
        before = tl.steps_at[r - 1].sum() if r else 0
        steps = float(tl.steps_at[r].sum() - before) / self.W
        return loss_sum, int(round(float(tl.steps_at[r].mean()))), steps if steps > 0 else 1.0

    def _advance(self, t_end: float, inclusive: bool, target, loss_sum: torch.Tensor | None = None) -> torch.Tensor:
        """The waves up to ``t_end``: every worker to its ``target`` steps, with every action before ``t_end`` (at it
        too when ``inclusive``) applied. Returns the summed loss of the steps done (added into ``loss_sum``)."""
        b = self.backend
        acts = self.acts if self.live is not None else self.timeline.actions
        if loss_sum is None:
            loss_sum = torch.zeros((), device=b.state.params.device)

        def due(w: int):
            """Worker w's next action if it is due at its current boundary within this round, else None."""
            k = self.ptr[w]
            if k < len(acts[w]):
                a = acts[w][k]
                if a.boundary == self.done[w] and (a.time <= t_end if inclusive else a.time < t_end):
                    return a
            return None

        while True:
            waiting = []  # landings whose payload has not arrived from another rank
            while True:  # apply what can be applied: each worker's next action, all workers' at once
                ready, waiting = [], []
                for w in self.own:
                    a = due(w)
                    if a is None:
                        continue
                    if a.kind in (clock.LAND, clock.REPLY) and not self._arrived(a):
                        waiting.append(a)
                        continue
                    if a.kind == clock.AR_APPLY and not b.allreduce_landed(a.event):
                        continue  # the fragment's average needs the other workers' sends first
                    if a.kind == clock.ASYNC:  # the server's next batch, once all its workers are there
                        batch = self.batches[self.served]
                        if (w, a.boundary) in batch and all(
                                (x := due(v)) is not None and x.kind == clock.ASYNC and x.boundary == k
                                for v, k in batch):
                            ready = [due(v) for v, _ in batch]
                            break
                        continue
                    if a.kind == clock.ALLREDUCE:
                        if all((x := due(v)) is not None and x.kind == clock.ALLREDUCE and x.event == a.event
                               for v in self.own):
                            ready = [a]
                            break
                        continue
                    ready.append(a)
                if not ready:
                    break
                self._apply(ready)
            rows = [w for w in self.own if self.done[w] < target[w] and due(w) is None]
            if rows:
                loss_sum += self._step(rows)
            elif waiting:  # nothing else can go on here: wait for the earliest payload still in flight
                a = min(waiting, key=lambda x: x.key)
                self.snaps[(a.event, a.kind)] = b.wait_payload(a.event, a.kind, self._sender(a))
            elif all(self.done[w] == target[w] and due(w) is None for w in self.own):
                break
            else:
                raise RuntimeError(f"simulated clock: no worker can go on before {t_end:.6g} s (a bug in evomerge)")
        return loss_sum

    # -- actions ------------------------------------------------------------------------------------
    def _sender(self, a: clock.Action) -> int:
        s = self.schedule
        return int(s.initiator[a.event]) if a.kind == clock.LAND else int(self.peers[a.event])

    def _arrived(self, a: clock.Action) -> bool:
        key = (a.event, a.kind)
        if key in self.snaps:
            return True
        sender = self._sender(a)
        if sender in self.backend.pos:
            return False  # sent from here, not yet
        got = self.backend.poll_payload(a.event, a.kind, sender)
        if got is not None:
            self.snaps[key] = got
        return got is not None

    def _post(self, event: int, kind: int, payload: dict, to: int) -> None:
        if self.landing is not None and (event, kind) not in self.landing:
            return
        if to in self.backend.pos:
            self.snaps[(event, kind)] = payload
        else:
            self.backend.send_payload(event, kind, payload, to)

    def _pace(self, t: float) -> None:
        """Emulated time: wait until simulated time ``t`` on the wall clock."""
        if self.emulate:
            ahead = self._t0 + t - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)

    def _apply(self, ready: list[clock.Action]) -> None:
        """Actions of different workers, each its worker's next: sends first (a payload is snapshotted
        before it can land), then every landing in one batch."""
        s, b = self.schedule, self.backend
        self._pace(max(a.time for a in ready))
        b.touched(self.own if ready[0].kind == clock.ALLREDUCE else [a.worker for a in ready])
        if ready[0].kind == clock.ALLREDUCE:
            self._allreduce(ready[0])
            for v in self.own:
                self.ptr[v] += 1
            return
        if ready[0].kind == clock.ASYNC:
            b.async_push([a.worker for a in ready])
            self.served += 1
            for a in ready:
                self.ptr[a.worker] += 1
            return
        streamed = [a for a in ready if a.kind in (clock.AR_SEND, clock.AR_APPLY)]
        if streamed:  # Streaming DiLoCo: each event's workers together (all of them on a homogeneous clock)
            self._stream(streamed)
            ready = [a for a in ready if a.kind not in (clock.AR_SEND, clock.AR_APPLY)]
            for a in streamed:
                self.ptr[a.worker] += 1
            if not ready:
                return
        lands, answers = [], []
        swaps = self.swaps
        for a in ready:
            e = a.event
            i, j = int(s.initiator[e]), int(self.peers[e])
            if a.kind == clock.SEND:
                # the examples leave now, landing or not
                data = b.data_out(i, j, self.most.get(e, 0.0)) if self.data else None
                if self.landing is None or (e, clock.LAND) in self.landing:
                    payload = b.model_of(i) if e in swaps else b.snapshot(e, i, 0)
                    payload["data"] = data
                    self._post(e, clock.LAND, payload, j)
                continue
            payload = self.snaps.pop((e, a.kind))
            if payload.get("data") is not None:
                b.data_in(j, payload["data"])
            if e in swaps:  # the peer answers with its own model and takes the initiator's; the initiator takes it
                cancelled = e in self.cancelled
                if a.kind == clock.LAND:
                    if self.landing is None or (e, clock.REPLY) in self.landing:
                        # a peer that has given its own model away sends the initiator's back
                        answer = dict(payload) if cancelled else b.model_of(j)
                        answer["data"] = None
                        self._post(e, clock.REPLY, answer, i)
                    if not cancelled:
                        b.install(j, payload)
                else:
                    b.install(i, payload)
                continue
            weight = plan_mod.scheduled_weight(self.p, int(s.step[e]), self.T)
            if a.kind == clock.LAND:
                if (e, clock.REPLY) in self.landing if self.landing is not None else self.p.exchange == "push_pull":
                    # the answer is the peer's state before it merges
                    answers.append((len(lands), b.snapshot(e, j, 1)))
                lands.append((e, j, payload, weight, float(s.u[e]), i, None))
            else:  # the answer of a push-pull lands at the initiator, with the winner the peer found
                lands.append((e, i, payload, weight, float(s.u[e]), i, payload.get("winner")))
        winners = b.land_many(lands) if lands else []
        if lands:  # supports were summed: keep them from overflowing, as the lockstep merger does
            b.state.rescale_supports()
        for k, answer in answers:
            e, j, _, _, _, i, _ = lands[k]
            answer["winner"] = winners[k]
            self._post(e, clock.REPLY, answer, i)
        for a in ready:
            self.ptr[a.worker] += 1

    def _stream(self, acts: list[clock.Action]) -> None:
        s, b = self.schedule, self.backend
        by = {}
        for a in acts:
            by.setdefault((a.event, a.kind), []).append(a.worker)
        for (e, kind), workers in sorted(by.items(), key=lambda x: (x[0][1] == clock.AR_SEND, x[0][0])):
            if kind == clock.AR_APPLY:  # landings first, as the lockstep merger does
                step = int(s.step[e])
                b.allreduce_land(e, workers, plan_mod.allreduce_weight(self.p, step, self.T, float(s.u[e])))
            elif b.allreduce_send(e, workers):  # every worker has sent: the average is taken
                if s.syncs_whole_model(e):
                    b.state.examples.fill_(b.sum_examples())  # counters are summed, not averaged
                b.state.rescale_supports()

    def _allreduce(self, a: clock.Action) -> None:
        s, st = self.schedule, self.backend.state
        step = clock.slowmo_step(len(s), a.event)
        if step is not None:  # SlowMo over a gossip base: the exact average after this step's gossip
            self.backend.allreduce(plan_mod.OUTER_AVERAGE, step, 1.0)
            st.examples.fill_(self.backend.sum_examples())
            st.rescale_supports()
            return
        step = int(s.step[a.event])
        weight = plan_mod.allreduce_weight(self.p, step, self.T, float(s.u[a.event]))
        dropped = self.timeline.dropped.get(a.event)
        if dropped:  # backup workers: the late ones' rows are left out of the average
            self.backend.allreduce(a.event, step, weight, dropped=dropped)
        else:
            self.backend.allreduce(a.event, step, weight)
        if s.syncs_whole_model(a.event):  # as the lockstep merger: once
            st.examples.fill_(self.backend.sum_examples())  # per sync of the whole model (its last fragment)
        st.rescale_supports()

    # -- a batched local step of some rows ---------------------------------------------------------
    def _indices(self, w: int) -> np.ndarray:
        """Worker w's minibatch for its next local step (drawn in blocks, as the lockstep run draws them)."""
        start, block = self._batches[w]
        k = int(self.done[w])
        if not start <= k < start + len(block):
            block = batch_indices(self.setup.shards[w], self.setup.study.run.batch_size, k, 64, self.seed, w)
            self._batches[w] = (k, block)
            start = k
        return block[k - start]

    def _step(self, rows: list[int]) -> torch.Tensor:
        b, setup = self.backend, self.setup
        st = b.state
        dev = st.params.device
        pool = getattr(b, "pool", None)  # data that travels or retires: each worker's batches from what it holds
        pos = np.stack([pool.batch(w, setup.study.run.batch_size) if pool is not None else self._indices(w)
                        for w in rows])
        idx = torch.as_tensor(pos, device=dev)
        x, y = normalise(b.train_x[idx], setup.data.spec), b.train_y[idx]
        keys = (schedule_mod.layer_keys(self.seed, rows, [int(self.done[w]) + 1 for w in rows])
                if setup.model.random else None)
        if len(rows) == len(self.own):
            losses = local_step(setup, st, x, y, keys=keys)
        else:
            at = [b.pos[w] for w in rows]
            sub = st.take(at, step=True)
            losses = local_step(setup, sub, x, y, keys=keys)
            st.put(sub, at)
        if pool is not None:
            pool.record(pos, torch.exp(-losses).cpu().numpy(), rows)
        st.examples[rows] += setup.study.run.batch_size
        self.done[rows] += 1
        b.touched(rows)
        if self.each:  # Lookahead / SNOO: each worker's own outer step after its every H-th local step
            due = [b.pos[w] for w in rows if self.done[w] % self.each == 0]
            if due:
                b.outer_each(due)
        if self.emulate:
            self._pace(max(float(self.timeline.completions[w][self.done[w] - 1]) for w in rows))
        return losses.mean(1).sum()
