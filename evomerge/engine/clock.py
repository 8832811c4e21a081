"""Simulated time: when each worker steps, sends, receives and waits on a modelled cluster.

A pure function of (policy, study, environment, seed): :func:`build` runs a discrete-event
simulation of the clocks alone (no tensors) and returns a :class:`Timeline` that every
backend replays: each worker's step completion times, and per worker the *actions* at its
step boundaries in the order they happen (sends, landings, all-reduces), with the round
ends and the per-round time metrics.

The model (``[environment]``, :class:`evomerge.study.EnvSpec`):

- **compute**: worker ``w``'s ``k``-th local step takes ``step_time x m_w x jitter x spell``
  simulated seconds: ``m_w`` from the speed model (``1/speed``; lognormal speeds
  ``exp(sigma z)``, Pareto multipliers ``1 + Pareto(alpha)``, or a list / file of speeds;
  ``slow_workers`` times ``slow_factor``), per-step lognormal jitter, and slow spells (a
  two-state chain: enter with ``straggle_p`` per step, leave with ``1/straggle_length``).
- **a worker's own merge work**: ``merge_time`` simulated seconds at each step boundary where the worker took part
  in a merge (sent a payload, applied one, averaged, pushed, took a fragment or a model back), added to its next
  step, as :class:`evomerge.Merger`'s own work at such a step (encoding, applying, copying: not the waits, which
  the clock models) delays the loop's next step. 0 (the default): merges cost the worker no time of its own.
- **merge timers count the worker's own local steps** (the schedule of :mod:`evomerge.engine.schedule`,
  unchanged): a policy's ``mean_interval`` keeps its meaning (merge every ~k local steps, as
  local SGD and gossip implementations trigger), a slow worker merges less often per second
  because its timer ticks with its work, and without heterogeneity the events are exactly the
  lockstep ones.
- **network**: a send of ``B`` bytes from ``i`` to ``j`` starts at once and moves at its share
  (:func:`fair_shares`) of ``bandwidth[i, j]``: the transfers in flight together share their
  senders' uplinks and their receivers' downlinks (a pair's two directions are two, as a link
  carries both ways at once), and each moves at an equal share of its most crowded end, as TCP flows
  share a link; the shares change whenever a transfer starts or ends. Alone it takes
  ``B / bandwidth[i, j]``, and it lands ``latency[i, j]`` after its last byte left. Measured
  under netlab (each rank its own 50 Mbit/s link, gloo, 407 KB): one send 68 ms, two into one
  receiver 139 ms, one rank sending and receiving with two others 75 ms; a pair both ways at once
  94-138 ms for one message each way, and 6 each way 1.6-1.9x the bytes of one way
  (``benchmarks/sim_vs_real.py`` holds the clock against real runs). First come, first
  served (each transfer holding its three ends until done) queued gossip 2-3x longer than the real
  runs did (ring gossip: median 0.27 s from send to landing, real 0.11 s). Links are per
  site (``sites`` contiguous groups, split as topology communities are: intra and inter values)
  or given as matrices.
- **staleness**: a payload is the sender's state when it was sent; the receiver applies it at
  its first step boundary at or after the landing (at once if it is idle). In push-pull the
  receiver answers with its state when it applies the request.
- **overlap**: non-blocking, the initiator keeps training; blocking, it pauses until its merge
  is done (push: its payload has landed; push-pull: the answer has landed).
- **Streaming DiLoCo** (``fragment_delay``): a fragment's all-reduce is not a barrier: each worker sends at its
  step t and trains on; the ring all-reduce of the fragment's bytes ends after the last send, and a worker
  waits at step t + delay only if it has not landed by then.
- **asynchronous DiLoCo** (scheme ``async``): the server is worker 0's (as :class:`evomerge.Merger` runs it, on
  rank 0). After its local steps a worker pushes its model to worker 0 (a transfer like a gossip payload's,
  sharing its ends), the server steps at worker 0's first step boundary at or after the push lands, on every push
  landed by then (one batch; worker 0's own push is served at its boundary, with no transfer), and the worker
  idles until the new model is back (a transfer from worker 0).
- **all-reduce**: a barrier at the slowest worker, then a ring all-reduce of
  ``2 (W - 1) latency + (W - 1) / W (up + down bytes) / bandwidth`` (the ring's slowest link;
  for a weights payload ``2 (W - 1) / W x bytes / bandwidth``); everyone leaves together. With
  ``backup_workers = b`` the barrier opens at the first ``W - b`` arrivals (and any others at that
  instant); the late workers drop their step and leave with the others (:meth:`Simulation.release`).
- **budget**: ``time_budget`` simulated seconds (what is in flight then never lands), else the work of the step
  budget: the work is done when the workers together have done ``W x T`` local steps (the lockstep run's work,
  in whatever time the cluster needs); then no step starts (one under way is dropped) and the run ends when every
  merge in flight has landed and been applied (push-pull answered), as ``Merger.finish()`` completes them
  (:meth:`Simulation.work_done`, :meth:`Simulation.drained`). Rounds end at equal shares of either (the last
  at the run's end). With ``step_budget = "per_worker"`` every worker takes ``T`` local steps and no more (a
  worker done with them idles, its merges still landing: a real job's ranks, each taking ``total_steps``): the
  work is the same ``W x T``, done when the slowest worker is.

Idle time is time a worker waits on a barrier or on its own merge (blocking). A homogeneous
environment with free links reproduces the lockstep run exactly: every worker completes step
``k`` at the same time, events are applied at the boundary after the step they were drawn for,
in schedule order.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from ..policy import check_backup_workers
from .plan import gathers_per_event, publishes, slowmo_due, swap_chance
from .schedule import STREAMS, Schedule, rng_for

TAG_SPEEDS, TAG_JITTER, TAG_SPELLS = (STREAMS[k] for k in ("speeds", "jitter", "spells"))
CHUNK = 256  # step times are drawn in blocks of this many per worker (the same numbers however many are used)

# action kinds, also their order among equal (time, event); AR_SEND / AR_APPLY: a Streaming DiLoCo fragment
# leaves a worker (its rows as they are) / lands there fragment_delay steps later
# ASYNC: asynchronous DiLoCo: the worker's push reaches the server, which steps; the worker takes the new model
SEND, LAND, REPLY, ALLREDUCE, AR_SEND, AR_APPLY, ASYNC = 0, 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Action:
    """Something that happens to one worker's state at a step boundary (after ``boundary`` local steps)."""

    worker: int
    boundary: int
    time: float
    event: int  # index into the schedule
    kind: int  # SEND (snapshot the payload), LAND (the peer merges it), REPLY (push-pull: the initiator merges the answer), ALLREDUCE
    sent: float = 0.0  # for LAND / REPLY: when the payload was sent (staleness = time - sent)
    landed: float = 0.0  # for LAND / REPLY: when it arrived (applied at ``time``, the receiver's next boundary)
    late: int = 0  # 1: after every other action of its worker at that instant (a swap's held landings)

    @property
    def key(self) -> tuple:
        return (self.time, self.late, self.event, self.kind)


@dataclass
class Timeline:
    schedule: Schedule
    end: float  # simulated seconds of the run
    round_ends: list[float]
    completions: list[np.ndarray]  # per worker: the completion time of each local step it does
    actions: list[list[Action]]  # per worker, in the order they happen
    idle: np.ndarray  # [rounds, W] seconds waiting (barriers, blocking merges)
    staleness: list[list[float]]  # per round: staleness of each payload applied in it
    bytes: list[int]  # cumulative bytes sent by each round's end
    merges: list[int]  # cumulative merge events started by each round's end
    horizon: int  # the schedule was built for this many local steps per worker
    # what each worker did when, for pictures (the dashboard's "where the time went"): per worker, the start of
    # each local step (its end is in ``completions``), the spans it waited and the spans its uplink was sending
    step_starts: list = field(default_factory=list)
    idle_spans: list = field(default_factory=list)
    send_spans: list = field(default_factory=list)
    dropped: dict = field(default_factory=dict)  # all-reduce event -> the late workers left out (backup workers)
    swaps: frozenset = frozenset()  # the gossip events that swap the two models instead of merging them
    peers: np.ndarray | None = None  # each event's peer as resolved (drawn from the state, or the schedule's)
    most: dict = field(default_factory=dict)  # event -> the share of most confident examples it sends (by similarity)
    cancelled: frozenset = frozenset()  # swaps that reached a worker without a model: the sender's came back
    steps_at: np.ndarray = field(init=False)  # [rounds, W] local steps done by each round's end

    def __post_init__(self):
        self.steps_at = np.array([[int(np.searchsorted(c, t, side="right")) for c in self.completions]
                                  for t in self.round_ends], dtype=np.int64).reshape(len(self.round_ends), -1)

    def round_metrics(self, r: int) -> dict[str, float]:
        """Round ``r``'s time metrics (the fields of ``RoundMetrics`` that only a timed run has)."""
        steps = self.steps_at[r]
        length = self.round_ends[r] - (self.round_ends[r - 1] if r else 0.0)
        W = len(steps)
        st = self.staleness[r]
        return dict(sim_time=float(self.round_ends[r]), steps_min=int(steps.min()), steps_mean=float(steps.mean()),
                    steps_max=int(steps.max()),
                    idle_fraction=float(self.idle[r].sum() / (W * length)) if length > 0 else 0.0,
                    staleness=float(np.mean(st)) if st else 0.0)


class Compute:
    """Each worker's step times, drawn from the seed in blocks (:data:`CHUNK`) and kept."""

    def __init__(self, env, workers: int, seed: int):
        self.env, self.W, self.seed = env, workers, seed
        self.factor = speed_factors(env, workers, seed)
        self.times: list[np.ndarray] = [np.zeros(0) for _ in range(workers)]
        self._jitter = [rng_for(seed, TAG_JITTER, w) for w in range(workers)]
        self._spell = [rng_for(seed, TAG_SPELLS, w) for w in range(workers)]
        self._slow = [False] * workers

    def duration(self, w: int, k: int) -> float:
        """Seconds of worker ``w``'s local step ``k`` (1-based)."""
        while len(self.times[w]) < k:
            self._extend(w)
        return float(self.times[w][k - 1])

    def _extend(self, w: int) -> None:
        env = self.env
        d = np.full(CHUNK, env.step_time * self.factor[w])
        if env.jitter:
            d = d * np.exp(env.jitter * self._jitter[w].standard_normal(CHUNK))
        if env.straggle_p:
            u = self._spell[w].random(CHUNK)
            slow, leave = self._slow[w], 1.0 / env.straggle_length
            mult = np.ones(CHUNK)
            for i in range(CHUNK):
                slow = (u[i] >= leave) if slow else (u[i] < env.straggle_p)
                if slow:
                    mult[i] = env.straggle_factor
            self._slow[w] = slow
            d = d * mult
        self.times[w] = np.concatenate([self.times[w], d])

    def free_completions(self, w: int, n: int) -> np.ndarray:
        """Completion times of the first ``n`` steps without any waiting."""
        self.duration(w, n)
        return np.cumsum(self.times[w][:n])


def speed_factors(env, workers: int, seed: int) -> np.ndarray:
    """Per worker, the multiplier of ``step_time`` (1 / speed)."""
    if isinstance(env.speeds, tuple):
        m = 1.0 / np.asarray(env.speeds, dtype=np.float64)
    elif env.speeds == "lognormal" and env.sigma:
        m = np.exp(-env.sigma * rng_for(seed, TAG_SPEEDS).standard_normal(workers))
    elif env.speeds == "pareto":
        m = 1.0 + rng_for(seed, TAG_SPEEDS).pareto(env.alpha, workers)
    else:
        m = np.ones(workers)
    for w in env.slow_workers:
        m[w] *= env.slow_factor
    return m


class Network:
    """Latency (s) and bandwidth (bytes/s, inf when unlimited) of every link ``i -> j``."""

    def __init__(self, env, workers: int):
        W = workers
        sites = np.concatenate([np.full(len(s), g) for g, s in enumerate(np.array_split(np.arange(W), env.sites))])
        same = sites[:, None] == sites[None, :]
        lat_inter = env.latency if env.latency_inter is None else env.latency_inter
        bw_inter = env.bandwidth if env.bandwidth_inter is None else env.bandwidth_inter
        self.latency = np.where(same, env.latency, lat_inter).astype(np.float64)
        bw = np.where(same, env.bandwidth, bw_inter).astype(np.float64)
        if env.latency_matrix:
            self.latency = np.asarray(env.latency_matrix, dtype=np.float64)
        if env.bandwidth_matrix:
            bw = np.asarray(env.bandwidth_matrix, dtype=np.float64)
        self.bandwidth = np.where(bw > 0, bw, np.inf)
        self.sites = sites

    @property
    def uniform(self) -> bool:
        """Whether every link is the same (then a peer drawn during the run costs what any peer costs)."""
        off = ~np.eye(len(self.latency), dtype=bool)
        return bool(np.ptp(self.latency[off]) == 0 and np.ptp(self.bandwidth[off]) == 0) if off.any() else True

    def transmit(self, i: int, j: int, nbytes: float) -> float:
        return nbytes / self.bandwidth[i, j] if nbytes else 0.0

    def ring_allreduce(self, up: float, down: float) -> float:
        """A ring all-reduce's time: ``2 (W-1) latency + (W-1)/W (up + down) / bandwidth`` over the ring's slowest link."""
        W = len(self.latency)
        if W < 2:
            return 0.0
        ring = [(i, (i + 1) % W) for i in range(W)]
        lat = max(self.latency[i, j] for i, j in ring)
        bw = min(self.bandwidth[i, j] for i, j in ring)
        return 2 * (W - 1) * lat + (W - 1) / W * (up + down) / bw


def flow_ends(i: int, j: int) -> tuple[tuple, ...]:
    """What a transfer from ``i`` to ``j`` shares with others in flight: ``i``'s uplink and ``j``'s downlink. A
    pair's two directions do not share (a link carries both ways at once): counted as one connection, they made a
    2-rank push-pull gossip job under netlab +84% on the clock (-3% without), and 6 messages each way at once moved
    1.6-1.9x the bytes of one way (``benchmarks/RESULTS.md``)."""
    return ("out", i), ("in", j)


def share(counts: dict, ends: tuple) -> float:
    """A transfer's share of its link's rate: an equal share of its most crowded end (``counts``: how many
    transfers are in flight through each end, itself included)."""
    return 1.0 / max(counts[e] for e in ends)


def fair_shares(flows: list[tuple[int, int]]) -> list[float]:
    """The shares (:func:`share`) of transfers ``(sender, receiver)`` in flight together, as fractions of each one's
    own link rate. The clock moves its transfers at these rates, and ``evomerge calibrate --from-trace`` takes them
    out of measured durations. Not max-min fair: what a transfer held back at another end leaves of an end goes
    unused (max-min would give ``4 -> 1`` 2/3 beside three sends from 0, one of them to 1; this gives it 1/2), and
    in exchange a start or an end changes only the transfers through its own three ends, so the clock's cost per
    transfer does not grow with the number in flight."""
    ends = [flow_ends(i, j) for i, j in flows]
    counts: dict = {}
    for es in ends:
        for e in es:
            counts[e] = counts.get(e, 0) + 1
    return [share(counts, es) for es in ends]


def free_horizon(compute: Compute, workers: int, total_steps: int, time_budget: float,
                 per_worker: bool = False) -> tuple[float, int]:
    """Without any waiting: the end time, and the most local steps one worker does by then (``per_worker``: each
    worker takes ``total_steps`` and no more, :data:`evomerge.study.STEP_BUDGETS`)."""
    W = workers
    if per_worker and total_steps:
        c = [compute.free_completions(w, total_steps) for w in range(W)]
        end = max(float(x[-1]) for x in c)
        if time_budget and end > time_budget:
            return time_budget, max(int(np.searchsorted(x, time_budget, side="right")) for x in c)
        return end, total_steps
    if time_budget:
        n = CHUNK
        while True:
            c = [compute.free_completions(w, n) for w in range(W)]
            if all(x[-1] > time_budget for x in c):
                return time_budget, max(int(np.searchsorted(x, time_budget, side="right")) for x in c)
            n *= 2
    need, n = W * total_steps, total_steps
    while True:
        c = [compute.free_completions(w, n) for w in range(W)]
        reach = min(x[-1] for x in c)  # every worker's first n steps are known up to here
        done = np.sort(np.concatenate([x[x <= reach] for x in c]))
        if len(done) >= need:
            end = float(done[need - 1])
            return end, max(int(np.searchsorted(x, end, side="right")) for x in c)
        n *= 2


def slowmo_event(events: int, step: int) -> int:
    """The event number of SlowMo's exact average after local ``step`` (after the schedule's ``events``: at that
    boundary the step's gossip comes first)."""
    return events + step


def slowmo_step(events: int, event: int) -> int | None:
    """The local step of SlowMo's exact average ``event`` (None for a schedule's event)."""
    return event - events if event >= events else None


def build(env, policy, workers: int, total_steps: int, rounds: int, seed: int, payload_bytes,
          make_schedule) -> Timeline:
    """The run's timeline; ``make_schedule(horizon)`` builds the schedule for that many local steps
    per worker, ``payload_bytes`` is the engine's :class:`plan.Bytes`."""
    compute = Compute(env, workers, seed)
    _, horizon = free_horizon(compute, workers, total_steps, env.time_budget, env.step_budget == "per_worker")
    while True:
        tl = Simulation(env, policy, workers, total_steps, rounds, compute, make_schedule(horizon), payload_bytes,
                        horizon).run()
        if env.time_budget or max(len(c) for c in tl.completions) <= horizon:
            return tl
        horizon *= 2  # waiting let a fast worker run past the horizon (step budget only): more events


def simulation(env, policy, workers: int, total_steps: int, rounds: int, seed: int, payload_bytes, make_schedule,
               horizon: int) -> "Simulation":
    """A simulation not yet run, for a run that decides with its state (:attr:`Simulation.oracle`): its schedule is
    drawn for ``horizon`` local steps per worker (a fast worker that gets past it merges no more: the caller takes
    it from a first timeline, with room to spare where the cluster is not the lockstep world's)."""
    return Simulation(env, policy, workers, total_steps, rounds, Compute(env, workers, seed), make_schedule(horizon),
                      payload_bytes, horizon)


class Simulation:
    """One run's discrete-event simulation of the clocks: the workers' steps, sends, landings, barriers, streamed
    fragments and server pushes on a heap of timed events; :meth:`run` returns the :class:`Timeline`."""

    SERVER = 0  # asynchronous DiLoCo's server sits at worker 0's node: worker w reaches it over link (w, 0)

    def __init__(self, env, policy, W: int, T: int, rounds: int, compute: Compute, sched: Schedule, cost,
                 horizon: int):
        self.env, self.policy, self.W, self.T, self.rounds = env, policy, W, T, rounds
        self.compute, self.sched, self.cost, self.horizon = compute, sched, cost, horizon
        self.net = Network(env, W)
        self.blocking = env.overlap == "blocking"
        self.push_pull = policy.exchange == "push_pull"
        self.budget = env.time_budget or float("inf")
        self.need = W * T  # step budget: the run's work in local steps
        self.cap = T if env.step_budget == "per_worker" else None  # each worker's own steps (STEP_BUDGETS)
        self.allreduce = sched.scheme == "allreduce"
        self.asynchronous = sched.scheme == "async"
        self.delay = policy.fragment_delay if self.allreduce else 0
        # events by (initiator, step), in schedule order
        self.fire: dict[tuple[int, int], list[int]] = {}
        for e, (s, i) in enumerate(zip(sched.step.tolist(), sched.initiator.tolist())):
            for w in (range(W) if self.allreduce else (i,)):  # an all-reduce involves everybody
                self.fire.setdefault((w, s), []).append(e)
        self.heap: list = []
        self.seq = 0
        self.done = [0] * W
        self.completions: list[list[float]] = [[] for _ in range(W)]
        self.busy = [False] * W  # in a step
        self.step_end = [0.0] * W
        self.waits = [0] * W  # merges this worker is blocked on
        self.idle_since: list[float | None] = [None] * W
        self.idle_spans: list[list[tuple[float, float]]] = [[] for _ in range(W)]
        self.step_starts: list[list[float]] = [[] for _ in range(W)]
        self.send_spans: list[list[tuple[float, float]]] = [[] for _ in range(W)]  # a picture's, not a metric's
        self.finished = [False] * W
        # transfers in flight, each moving at its share (fair_shares): id -> [sender, receiver, seconds left at the
        # link's full rate, rate, version, start, what lands, when `seconds left` was last brought up to date, its
        # ends]; a share changes whenever a transfer through one of its ends starts or ends
        self.flows: dict[int, list] = {}
        self.flow_id = 0
        self.at_end: dict[tuple, set[int]] = {}  # end (flow_ends) -> the transfers in flight through it
        self.counts: dict[tuple, int] = {}
        self.actions: list[list[Action]] = [[] for _ in range(W)]
        # (worker, its action there, the Action it replaced) for each action moved to an earlier boundary after it
        # was recorded (a step dropped at the work's end): a reader of the running clock's actions takes the new one
        self.moved: list[tuple[int, int, Action]] = []
        self.sends: list[tuple[float, int]] = []  # (time, bytes) of every merge started
        self.barrier: dict[int, float] = {}
        self.barrier_bytes = 0  # each worker's share of the open barrier's all-reduce
        self.barrier_at: tuple[int, int] | None = None  # (event, boundary) of the all-reduce being waited for
        self.step_seq = [0] * W  # each worker's step number: an "end" event of a dropped step is stale
        self.merge_time = float(getattr(env, "merge_time", 0.0) or 0.0)
        self.owed = [False] * W  # merge_time: the worker merged at a boundary whose step has not paid for it yet
        self.charged_at = [-1] * W  # the last boundary whose merge work a step paid for
        check_backup_workers(policy, W)
        self.backups = policy.backup_workers
        self.dropped: dict[int, tuple[int, ...]] = {}  # all-reduce event -> the late workers left out of it
        self.total = 0
        self.end = self.budget
        # step budget: once the work is done (at t_work), no step starts and every step under way is dropped; the
        # merges in flight land and are applied (push-pull answered), as Merger.finish() completes them, and the run
        # ends when the last one is applied
        self.t_work: float | None = None
        self.t_pulled = 0.0  # when the last global model came back to a worker (asynchronous DiLoCo)
        self.dropped_at_end: set[int] = set()  # the workers whose step under way was dropped when the work was done
        self.streams: dict[int, dict[int, float]] = {}  # streamed all-reduce event -> worker -> when it sent
        self.t_landed: dict[int, float] = {}  # streamed event -> when its average has reached every worker
        self.due_landing: dict[tuple[int, int], int] = {}  # (worker, boundary) -> the streamed event landing there
        self.parked: dict[int, list[int]] = {}  # streamed event -> workers waiting for it
        self.parked_at: dict[int, float] = {}  # worker -> since when it waits for a streamed fragment (or the server)
        # model swaps: decided here from the schedule's uniforms (plan.swap_chance; with swap_recency, from which
        # model is at which worker and when each model last left each worker's data, both kept here)
        self.swap_p = policy.swap_p if sched.scheme == "gossip" else 0.0
        self.swaps: set[int] = set()
        self.model_at = list(range(W))
        self.left_at = np.full((W, W), -np.inf)  # [model, worker]: the boundary the model last left the worker's data
        self.swap_models: dict[int, list[int]] = {}  # swap event -> [the initiator's model, the peer's]
        # a swap's halves as the workers apply them (time, event, kind, worker, boundary): which model is where
        # follows each worker's actions in their order, settled before each decision on what came strictly before
        self.swap_steps: list[tuple] = []
        self.t_now = 0.0  # the time of the event being handled
        # decisions that need the workers' state at the event (peers drawn by similarity or in regrouped communities,
        # examples chosen by similarity, swaps by the peer's confidence): asked of ``oracle`` (a simulated run's
        # replay, brought up to that instant) while the clock runs; None: the schedule's peers, nothing asked
        self.oracle = None
        self.peer = sched.peer.copy()  # each gossip event's peer, as resolved when it fired
        self.most: dict[int, float] = {}  # data_similarity_sign: the share of most confident examples an event sends
        from .setup import round_bounds

        self.round_works = [W * b for b in round_bounds(T, rounds)]  # step budget: the work done at each round's end
        self.round_ends: list[float] = ([env.time_budget * (r + 1) / rounds for r in range(rounds)]
                                        if env.time_budget else [])
        self.started = False
        self.gathers = gathers_per_event(policy)
        # publish_every: the workers publish what decisions read at every publish_every of the cluster's nominal
        # step times: the median worker's step time without jitter, summed as a worker sums its steps (so on a
        # homogeneous free cluster they are its step boundaries exactly, whatever its speed)
        self.publish_every = publishes(policy) if sched.scheme == "gossip" else 0
        self.nominal_step = float(env.step_time * np.median(compute.factor))
        self._publications = [0.0]
        self.regroup_every = policy.regroup_every if sched.scheme == "gossip" else 0
        self.other_sends: list[tuple[float, int]] = []  # (time, bytes) sent outside the schedule's events
        self.other_merges: list[float] = []  # when merges outside the schedule's events happened (SlowMo's averages)
        # SlowMo over a gossip base: every outer_every local steps (after that step's gossip) an exact average, as a
        # barrier all-reduce; its event is len(schedule) + the step
        self.slowmo = sched.scheme == "gossip" and policy.outer_every > 0
        self.leaving: set[int] = set()  # workers between an all-reduce's release and their leaving it ("go")
        self.gradient = policy.payload == "gradient"
        # swaps: a worker that has given its model away (waiting for the other) takes no payload until the other
        # model is in; what lands meanwhile is held and lands just after (at its next boundary)
        self.swap_wait: dict[int, tuple[int, float]] = {}  # worker -> (its swap event in flight, when it sent)
        self.held: dict[int, list] = {}  # worker -> the landings held for it
        self.cancelled: set[int] = set()  # swaps whose peer had given its model away: the model went back

    # -- what the events do ---------------------------------------------------------------------------------
    def _act(self, a: Action) -> None:
        """Record worker ``a.worker``'s action; it owes ``merge_time`` for that boundary's work (:meth:`_owe`)."""
        self.actions[a.worker].append(a)
        self._owe(a.worker, a.boundary)

    def _owe(self, w: int, boundary: int) -> None:
        """Worker ``w`` worked at a merge at ``boundary``: the step after it pays ``merge_time``, once per boundary.
        Where that step is already under way (it began at this instant, as a payload landed there), it ends later."""
        if not self.merge_time or boundary <= self.charged_at[w]:
            return
        if self.busy[w] and boundary == self.done[w]:  # (the step under way began at this boundary, at this instant)
            self.step_end[w] += self.merge_time
            self.step_seq[w] += 1  # its end event moves: the one pushed is stale
            self.push(self.step_end[w], "end", (w, self.step_seq[w]))
            self.charged_at[w] = boundary
        else:
            self.owed[w] = True

    def push(self, t, kind, data) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, data))
        self.seq += 1

    def start_step(self, w: int, t: float) -> None:
        if self.t_work is not None:  # the work is done: the run drains its merges in flight, this worker idle
            self.finished[w] = True
            if self.idle_since[w] is None:
                self.idle_since[w] = t
            return
        if self.cap is not None and self.done[w] >= self.cap:  # its own steps done: idle, its merges still landing
            self.finished[w] = True
            if self.idle_since[w] is None:
                self.idle_since[w] = t
            return
        d = self.compute.duration(w, self.done[w] + 1)
        if self.owed[w]:  # it merged at this boundary (or at the one before, applied at its step's end): that work first
            d += self.merge_time
            self.owed[w], self.charged_at[w] = False, self.done[w]
        if t + d > self.budget:
            self.finished[w] = True
            return
        self.busy[w], self.step_end[w] = True, t + d
        self.step_starts[w].append(t)
        self.step_seq[w] += 1
        self.push(t + d, "end", (w, self.step_seq[w]))

    def resume(self, w: int, t: float) -> None:
        self.waits[w] -= 1
        if self.waits[w] == 0 and not self.busy[w] and not self.finished[w] and w not in self.barrier \
                and w not in self.leaving:
            if self.idle_since[w] is not None:
                self.idle_spans[w].append((self.idle_since[w], t))
                self.idle_since[w] = None
            self.start_step(w, t)

    def send(self, e: int, i: int, j: int, t: float, kind: int, t_snap: float | None = None) -> None:
        """The message of event ``e`` from ``i`` to ``j``, leaving at ``t`` (taken at ``t_snap``, if earlier): a gossip
        payload (with the examples that travel, from the initiator), or a whole model for a swap."""
        if e in self.swaps:
            nbytes = self.cost.dense + (self.cost.data if kind == LAND else 0)
        else:
            nbytes = self.cost.message(i) + (self.cost.data if kind == LAND else 0)
        self.transfer(i, j, nbytes, t, "land", (e, i, j, t if t_snap is None else t_snap, kind))

    def gather_time(self, w: int) -> float:
        """How long worker ``w`` takes to gather every other worker's sketch (a decision by similarity): the slowest
        link's latency, and the sketches one after another through its downlink. Not shared with the transfers in
        flight (small beside a model)."""
        others = [v for v in range(self.W) if v != w]
        if not others or not self.cost.similarity:
            return 0.0
        net = self.net
        return (max(float(net.latency[v, w]) for v in others)
                + sum(net.transmit(v, w, self.cost.similarity) for v in others))

    def peer_of(self, e: int, w: int, k: int) -> int:
        """The peer of gossip event ``e`` (``w``'s, at its boundary ``k``): the schedule's, or drawn now from the state
        (:attr:`oracle`); with examples chosen by similarity, their share is taken now too."""
        o = self.oracle
        if o is not None and o.live_peers:
            self.peer[e] = o.peer(e, w, k, self.t_now)
        j = int(self.peer[e])
        if o is not None and self.cost.data and self.policy.data_similarity_sign:
            self.most[e] = o.share(e, w, j, k, self.t_now)
        return j

    def decide_swap(self, e: int, w: int, j: int, k: int) -> bool:
        """Whether gossip event ``e`` (``w``'s, at its boundary ``k``) swaps the two models: the schedule's uniform
        against :func:`plan.swap_chance` (unconditioned, or by the local steps since ``w``'s model last held ``j``'s
        data), as the lockstep merger decides it."""
        if not self.swap_p:
            return False
        if self.policy.swap_recency:
            self.settle(self.t_now)
        conf = self.oracle.confidence(j, self.t_now) if self.oracle is not None and self.policy.swap_confidence else None
        chance = swap_chance(self.policy, conf, k - self.left_at[self.model_at[w], j])
        if not float(self.sched.u_swap[e]) < chance:
            return False
        self.swaps.add(e)
        if self.policy.swap_recency:  # the initiator's model leaves its data
            self.swap_models[e] = [-1, -1]
            heapq.heappush(self.swap_steps, (self.t_now, e, SEND, w, k))
        return True

    def settle(self, t: float) -> None:
        """Apply the halves of swaps that happened strictly before ``t``, in the workers' order of actions (a step's
        decisions see the models where they were before any of that instant's merges, as the lockstep run's do)."""
        q = self.swap_steps
        while q and q[0][0] < t:
            _, e, kind, w, k = heapq.heappop(q)
            models = self.swap_models[e]
            if kind == SEND:
                models[0] = self.model_at[w]
                self.left_at[models[0], w] = k
            elif e in self.cancelled:  # the initiator's model came back: nothing moved
                continue
            elif kind == LAND:  # the peer: its model leaves its data, the initiator's arrives
                models[1] = self.model_at[w]
                self.left_at[models[1], w] = k
                self.model_at[w] = models[0]
            else:
                self.model_at[w] = models[1]

    def transfer(self, i: int, j: int, nbytes: int, t: float, kind: str, data) -> None:
        """``nbytes`` from ``i`` to ``j`` starting at ``t``, at its share of its ends while it is in flight; at its
        end (and the link's latency) the event ``(kind, data)`` happens."""
        tx = self.net.transmit(i, j, nbytes)
        if tx <= 0:
            self.push(t + self.net.latency[i, j], kind, data)
            return
        k, self.flow_id = self.flow_id, self.flow_id + 1
        ends = flow_ends(i, j)
        self.flows[k] = [i, j, tx, 0.0, 0, t, (kind, data), t, ends]
        for end in ends:
            self.at_end.setdefault(end, set()).add(k)
            self.counts[end] = self.counts.get(end, 0) + 1
        self._reshare(ends, t)

    def _reshare(self, ends: tuple, t: float) -> None:
        """New shares for the transfers through ``ends`` after one of theirs started or ended; each one whose rate
        changed has its bytes left brought up to ``t`` and gets a new end."""
        for k in sorted(set().union(*(self.at_end.get(e, ()) for e in ends))):
            f = self.flows[k]
            r = share(self.counts, f[8])
            if r != f[3]:
                f[2] -= f[3] * (t - f[7])
                f[3], f[4], f[7] = r, f[4] + 1, t
                self.push(t + max(f[2], 0.0) / r, "sent", (k, f[4]))

    def sent(self, k: int, version: int, t: float) -> None:
        f = self.flows.get(k)
        if f is None or f[4] != version:
            return  # its share changed since: a later end stands
        del self.flows[k]
        i, j = f[0], f[1]
        for end in f[8]:
            self.at_end[end].discard(k)
            self.counts[end] -= 1
        self.send_spans[i].append((f[5], t))
        self.push(t + self.net.latency[i, j], *f[6])
        self._reshare(f[8], t)

    def complete(self, w: int, t: float) -> None:
        """Worker ``w``'s local step is done at ``t``: the step budget's work and the rounds' ends count it."""
        self.completions[w].append(t)
        self.total += 1
        works = self.round_works
        if not self.env.time_budget and len(self.round_ends) < len(works) - 1 and \
                self.total == works[len(self.round_ends)]:
            self.round_ends.append(t)
        if not self.env.time_budget and self.total == self.need:
            self.work_done(t)  # the step budget's work is done; what happens at this instant still counts

    def work_done(self, t: float) -> None:
        """The step budget's work is done at ``t``: the steps under way are dropped (their workers idle from here), no
        step starts, and the run goes on until the merges in flight are applied (:meth:`drained`)."""
        if self.t_work is not None:
            return
        self.t_work = t
        for w in range(self.W):
            self.finished[w] = True
            if self.busy[w] and self.step_end[w] > t:  # its step is dropped (a stale end event): idle from here
                self.busy[w] = False
                self.step_seq[w] += 1
                self.step_starts[w].pop()
                self.idle_since[w] = t
                self.dropped_at_end.add(w)
                self._now_not_at_step_end(w, self.step_end[w], t)

    def _now_not_at_step_end(self, w: int, end: float, t: float) -> None:
        """Worker ``w``'s step that would have ended at ``end`` is dropped at ``t``: what landed during it, due at
        that step's end (its next boundary), is applied now at its current boundary, and answered now."""
        k = self.done[w]
        acts = self.actions[w]
        for i, a in enumerate(acts):
            if a.boundary == k + 1 and a.time == end:
                acts[i] = Action(a.worker, k, t, a.event, a.kind, a.sent, a.landed, a.late)
                self.moved.append((w, i, a))
        moved = False
        for i, x in enumerate(self.heap):
            # its answers (push-pull), and, at the server (asynchronous DiLoCo), the pushes deferred to that step's end
            if x[0] == end and ((x[2] == "reply" and x[3][1] == w) or (x[2] == "serve" and w == self.SERVER)):
                self.heap[i] = (t, *x[1:])
                moved = True
        if moved:
            heapq.heapify(self.heap)
        q = self.swap_steps
        if any(x[0] == end and x[3] == w for x in q):
            q[:] = [(t, e, what, j, k) if (at == end and j == w) else (at, e, what, j, b) for at, e, what, j, b in q]
            heapq.heapify(q)

    def drained(self) -> None:
        """Nothing is left in flight after the work was done: the run ends at the last merge applied (at the work's
        end if none was in flight), and so does its last round."""
        last = max((a.time for acts in self.actions for a in acts), default=self.t_work)
        if self.merge_time:  # the work of a worker's last merges, which no step after them paid for (as a Merger's
            # step() does it before finish())
            last = max([last] + [self.actions[w][-1].time + self.merge_time for w in range(self.W)
                                 if self.owed[w] and self.actions[w]])
        # and the last global model back at a worker (asynchronous DiLoCo: Merger's step() waits for it), and the
        # last streamed fragment's all-reduce (Merger.finish() settles those in flight)
        self.end = max(self.t_work, last, self.t_pulled, max(self.t_landed.values(), default=0.0))
        if len(self.round_ends) < len(self.round_works):
            self.round_ends.append(self.end)

    def landed(self, data, t: float, held: bool = False) -> None:
        """A payload has landed at ``t`` (``data``: event, sender, receiver, when it was sent, LAND or REPLY): the
        receiver applies it at its first boundary at or after ``t`` (at once if it is not in a step). A worker that
        has given its model away for a swap takes it only after the other model (``held``: now, just after that
        one, at the same boundary); a swap reaching it then is cancelled (its sender's model goes back)."""
        e, i, j, t_sent, what = data
        wait = self.swap_wait.get(j)
        if not held and wait is not None and not (what == REPLY and wait[0] == e) \
                and not (t == wait[1] and e < wait[0]):  # at the swap's own instant an earlier event comes first
            if what == LAND and e in self.swaps and t > wait[1]:  # holding it could wait in a cycle of swaps
                self.cancelled.add(e)
            else:
                self.held.setdefault(j, []).append((data, t))
                return
        if held:
            at, boundary = t, self.done[j]
        elif self.busy[j] and not (self.completions[j] and self.completions[j][-1] == t):
            at, boundary = self.step_end[j], self.done[j] + 1
        else:
            at, boundary = t, self.done[j]
        if at > self.end or (self.busy[j] and at > self.budget):
            return
        self._act(Action(j, boundary, at, e, what, sent=t_sent, landed=t, late=int(held)))
        swap = e in self.swaps
        if swap and self.policy.swap_recency and e not in self.cancelled:
            heapq.heappush(self.swap_steps, (at, e, what, j, boundary))
        if swap and what == REPLY:  # the initiator has its new model: what was held for it lands just after
            del self.swap_wait[j]
            for d, _ in self.held.pop(j, ()):
                self.landed(d, t, held=True)
        if what == LAND and (self.push_pull or swap):
            self.push(at, "reply", (e, j, i))
        elif self.blocking or swap:
            # the initiator: push when it lands, push-pull when the answer does
            self.push(t, "resume", i if what == LAND else j)

    def release(self, e: int, k: int, t: float) -> None:
        """All-reduce ``e`` after local step ``k`` leaves its barrier at ``t``: every worker there (all of them, or
        the first W - b with backup workers) averages; a late one drops the work of its step(s) up to ``k`` (they
        count as done at ``t``, their rows are left out of the average) and takes the average with the others."""
        W = self.W
        late = [v for v in range(W) if v not in self.barrier]
        t_all = max(self.barrier.values())
        # the bytes of an all-reduce that takes place: a barrier still open at the run's end sent nothing
        if self.barrier_bytes:  # (SlowMo's barrier: its bytes are the exact average's, below)
            self.sends.extend((t, self.barrier_bytes) for _ in self.barrier)
        self.barrier_bytes = 0
        t_done = t_all + self.ring(e)
        if self.gradient:  # payload "gradient": the steps are done when the averaged gradient has updated them
            for v in range(W):
                self.complete(v, t_done)
        for v in late:
            self.busy[v] = False
            self.step_seq[v] += 1  # its pending end is stale
            ended = v in self.dropped_at_end  # its step under way was dropped (and its start) when the work was done
            if ended:
                self.idle_since[v] = None  # (its wait is the barrier's, below)
            for i in range(k - self.done[v]):
                if i or ended:  # a step it had not started: begun and dropped at once
                    self.step_starts[v].append(t)
                self.completions[v].append(t)
                self.total += 1
            self.done[v] = k
            self.barrier[v] = t
            self.sends.append((t, self.cost.allreduce(1, None)))  # it takes the average (one fragment)
        if late:
            self.dropped[e] = tuple(late)
            if not self.env.time_budget and self.total >= self.need:
                self.work_done(t)  # the step budget's work is done (the late workers' steps count)
        for v in range(W):
            self._act(Action(v, k, t_done, e, ALLREDUCE))
            self.idle_spans[v].append((self.barrier[v], t_done))
            self.send_spans[v].append((t_all, t_done))
        self.barrier.clear()
        self.barrier_at = None
        self.leaving.update(range(W))  # until "go": a blocking merge's resume must not start a step in the ring
        if self.slowmo:  # one exact average: its bytes and one merge
            self.other_sends.append((t_done, self.cost.allreduce(W)))
            self.other_merges.append(t_done)
        for v in range(W):
            self.push(t_done, "go", v)

    def ring(self, e: int) -> float:
        return self.net.ring_allreduce(
            *self.cost.allreduce_sizes(None if self.sched.fragment is None else int(self.sched.fragment[e])))

    def serve(self, t: float, data) -> None:
        """Asynchronous DiLoCo's server steps at ``t`` on the pushes it serves now, one batch: ``data`` and every other
        push landed or waiting to be served at this instant (as rank 0 of :class:`evomerge.Merger` serves, at its step
        boundaries, what has arrived); each worker of the batch pulls the new model (worker 0 at once)."""
        heap, S = self.heap, self.SERVER
        now = [x for x in heap if x[0] == t and x[2] in ("server", "serve")]
        if now:
            heap[:] = [x for x in heap if not (x[0] == t and x[2] in ("server", "serve"))]
            heapq.heapify(heap)
        for e, w, k, t_sent in sorted([data] + [x[3] for x in now], key=lambda b: b[1]):
            self._act(Action(w, k, t, e, ASYNC, sent=t_sent, landed=t))
            if w != S:  # the server's own work at its boundary (its step ending now: the one after it)
                self._owe(S, self.done[S] + (1 if self.busy[S] and self.step_end[S] <= t else 0))
            if w == S:
                self.push(t, "pulled", w)
            else:
                self.transfer(S, w, self.cost.dense, t, "pulled", w)

    def at_boundary(self, w: int, t: float, applied: bool = False) -> None:
        """Worker ``w`` at the boundary after its ``done[w]`` local steps, at time ``t``: a streamed fragment due
        here lands (or the worker waits for it), then the merges drawn for this step start."""
        k, sched, cost, W = self.done[w], self.sched, self.cost, self.W
        e = None if applied else self.due_landing.pop((w, k), None)
        if e is not None:
            if e not in self.t_landed or self.t_landed[e] > t:  # still in flight: wait (streaming blocks only here)
                self.parked_at[w] = t
                if e in self.t_landed:
                    self.push(self.t_landed[e], "landed", (w, e))
                else:
                    self.parked.setdefault(e, []).append(w)
                return
            self._act(Action(w, k, t, e, AR_APPLY))
        evs = self.fire.get((w, k), ())
        if self.asynchronous and evs:  # push the model to the server (worker 0's node) over this worker's link to it
            e, S = evs[0], self.SERVER
            self.parked_at[w] = t
            if w == S:  # its own push: no transfer, served at this boundary
                self.push(t, "serve", (e, w, k, t))
                return
            self.sends.append((t, 2 * cost.dense))  # the push and the pull
            self.transfer(w, S, cost.dense, t, "server", (e, w, k, t))
            return
        if self.allreduce and evs and self.delay:  # Streaming DiLoCo: the fragment travels while training goes on
            e = evs[0]
            frag = int(sched.fragment[e]) if sched.fragment is not None else None
            self._act(Action(w, k, t, e, AR_SEND))
            self.due_landing[(w, k + self.delay)] = e
            bar = self.streams.setdefault(e, {})
            bar[w] = t
            if len(bar) == W:  # the ring runs once every worker has sent: its bytes then, not before
                self.sends.extend((max(bar.values()), cost.allreduce(1, frag)) for _ in range(W))
                self.t_landed[e] = max(bar.values()) + self.ring(e)
                for v in range(W):
                    self.send_spans[v].append((max(bar.values()), self.t_landed[e]))
                for v in self.parked.pop(e, []):
                    self.push(max(self.t_landed[e], self.parked_at[v]), "landed", (v, e))
            self.start_step(w, t)
            return
        if self.allreduce and evs:
            e = evs[0]
            frag = int(sched.fragment[e]) if sched.fragment is not None else None
            self.barrier[w] = t
            self.barrier_at = (e, k)
            self.barrier_bytes = cost.allreduce(1, frag)  # each worker's share, sent when the barrier is left
            if len(self.barrier) == W:
                self.release(e, k, t)
            elif self.backups and len(self.barrier) == W - self.backups:
                self.push(t, "release", (e, k))  # after the other arrivals at this instant: those are not late
            return
        for e in evs:
            j = self.peer_of(e, w, k)
            swap = self.decide_swap(e, w, j, k)
            late = 0
            if swap:
                self.swap_wait[w] = (e, t)
                # payloads that landed during its step and are applied at this boundary after its send (a later
                # event) go into the model it keeps, so its send comes after them (never on a free cluster)
                for a in reversed(self.actions[w]):
                    if a.boundary < k:
                        break
                    if a.boundary == k and a.time == t and a.event > e and a.kind in (LAND, REPLY):
                        late = 1
                        break
            self._act(Action(w, k, t, e, SEND, late=late))
            self.sends.append((t, (cost.swap() if swap else cost.pair(w, j)) + cost.data
                               + (cost.gather(self.W) if self.gathers else 0)))
            # decided by similarity: the payload (taken now) leaves once the others' sketches are in
            delay = self.gather_time(w) if self.gathers else 0.0
            if delay > 0:
                self.push(t + delay, "send", (e, w, j, t))
            else:
                self.send(e, w, j, t, LAND)
            if self.blocking or swap:  # a swap's initiator has given its model away: it waits for the other
                self.waits[w] += 1
        if self.slowmo and slowmo_due(self.policy, k):  # SlowMo: the exact average, a barrier after the gossip
            e = slowmo_event(len(sched), k)
            self.barrier[w] = t
            self.barrier_at = (e, k)
            if len(self.barrier) == W:
                self.release(e, k, t)
            return
        if self.waits[w]:
            self.idle_since[w] = t
        else:
            self.start_step(w, t)

    # -- the event loop ----------------------------------------------------------------------------------
    def run(self) -> Timeline:
        self.advance()
        return self.timeline()

    def through_round(self, r: int) -> float:
        """Run until round ``r``'s end is known and everything at or before it has happened; its end. A regrouping
        after the round before (the run's, :meth:`evomerge.backends.base.Backend.end_round`) sends its sketches just
        after that round's end."""
        if r and self.regroup_every and r % self.regroup_every == 0:
            self.other_sends.append((float(np.nextafter(self.round_ends[r - 1], np.inf)), self.cost.regroup(self.W)))
        self.advance(lambda t: r < len(self.round_ends) and t > self.round_ends[r])
        if r >= len(self.round_ends):  # nothing left to happen: the run's end
            self.round_ends.append(self.end if self.end < float("inf") else self.t_now)
        return self.round_ends[r]

    def steps_by(self, t: float) -> np.ndarray:
        """Each worker's local steps done by ``t`` (the clock at ``t`` or after it): those completed by then, and one
        it is in if that ends at ``t``."""
        return np.array([bisect_right(c, t) + (1 if self.busy[w] and self.step_end[w] <= t else 0)
                         for w, c in enumerate(self.completions)], dtype=np.int64)

    def publication_time(self, n: int) -> float:
        """The instant of the ``n``-th publication (``publish_every``; 0: the start)."""
        pubs, k, d = self._publications, self.publish_every, self.nominal_step
        while len(pubs) <= n:
            t = pubs[-1]
            for _ in range(k):
                t = t + d
            pubs.append(t)
        return pubs[n]

    def publications_by(self, t: float) -> int:
        """The last publication at or before ``t``."""
        while self.publication_time(len(self._publications) - 1) <= t:  # known up to the first one after t
            self.publication_time(len(self._publications))
        return bisect_right(self._publications, t) - 1

    def advance(self, stop=None) -> None:
        """Handle the events in time order, until none is left, the run's end, or ``stop(t)`` for the next one's
        time (it then stays for the next call)."""
        env, W = self.env, self.W
        if not self.started:
            self.started = True
            for w in range(W):
                self.start_step(w, 0.0)
        heap = self.heap
        while heap:
            t = heap[0][0]
            if t > self.end or (stop is not None and stop(t)):
                return
            t, _, kind, data = heapq.heappop(heap)
            if kind == "end" and data[1] != self.step_seq[data[0]]:
                continue  # a step dropped at a backup all-reduce's barrier, or at the work's end
            self.t_now = t
            if kind == "end":
                w, seq = data
                self.busy[w] = False
                self.done[w] += 1
                if not self.gradient:  # a gradient's step is done when its update is: at the all-reduce (release)
                    self.complete(w, t)
                self.at_boundary(w, t)
            elif kind == "landed":  # a streamed fragment a worker waited for has landed: apply it, go on
                w, e = data
                self._act(Action(w, self.done[w], t, e, AR_APPLY))
                self.idle_spans[w].append((self.parked_at.pop(w), t))
                self.at_boundary(w, t, applied=True)
            elif kind == "server":  # a push has landed: served at worker 0's next step boundary (now if between steps)
                S = self.SERVER
                between = not self.busy[S] or (self.completions[S] and self.completions[S][-1] == t)
                at = t if between or self.step_end[S] <= t else self.step_end[S]
                if at > t:
                    self.push(at, "serve", data)
                    continue
                self.serve(t, data)
            elif kind == "serve":
                self.serve(t, data)
            elif kind == "pulled":  # the global model is back: the worker goes on
                self.t_pulled = max(self.t_pulled, t)
                self.idle_spans[data].append((self.parked_at.pop(data), t))
                self.start_step(data, t)
            elif kind == "go":  # leaving an all-reduce (SlowMo's: unless still waiting for its blocking merge)
                self.leaving.discard(data)
                if self.waits[data]:
                    self.idle_since[data] = t
                else:
                    self.start_step(data, t)
            elif kind == "release":  # the first W - b workers are at the barrier, and nobody else at this instant
                if self.barrier_at == data:
                    self.release(*data, t)
            elif kind == "land":
                self.landed(data, t)
            elif kind == "sent":
                self.sent(*data, t)
            elif kind == "reply":
                e, j, i = data
                self.send(e, j, i, t, REPLY)
            elif kind == "resume":
                self.resume(data, t)
            elif kind == "send":  # a payload held for its decision's sketches leaves
                e, i, j, t_snap = data
                self.send(e, i, j, t, LAND, t_snap)
        if self.t_work is not None and self.end == float("inf"):
            self.drained()
        return self.timeline()

    def timeline(self, rounds_so_far: int | None = None) -> Timeline:
        """The run as it happened: what each worker did at each boundary, the rounds' ends, idle time,
        staleness, bytes and merges per round. ``rounds_so_far``: only the first rounds (their ends known, everything
        up to the last of them happened; a run that decides with its state takes each round's metrics from this)."""
        env, W, T, rounds = self.env, self.W, self.T, self.rounds
        completions = self.completions
        idle_spans = [list(x) for x in self.idle_spans]
        if rounds_so_far is not None:
            round_ends = list(self.round_ends[:rounds_so_far])
            end_t = round_ends[-1]
        else:
            end_t = self.end if self.end < float("inf") else max((c[-1] for c in completions if c), default=0.0)
            if env.time_budget:
                round_ends = [env.time_budget * (r + 1) / rounds for r in range(rounds)]
            else:
                from .setup import round_bounds

                done_times = np.sort(np.concatenate([np.asarray(c) for c in completions]))
                round_ends = [float(done_times[W * b - 1]) for b in round_bounds(T, rounds)]
                round_ends[-1] = end_t  # the last round ends when its merges in flight are applied (drained)
        comp = [np.asarray([x for x in c if x <= end_t]) for c in completions]
        actions = []
        for w in range(W):
            if self.idle_since[w] is not None:
                idle_spans[w].append((self.idle_since[w], end_t))
            if w in self.barrier:  # waiting at a barrier that never filled
                idle_spans[w].append((self.barrier[w], end_t))
            if w in self.parked_at:  # waiting for a streamed fragment that never landed
                idle_spans[w].append((self.parked_at[w], end_t))
            actions.append(sorted((a for a in self.actions[w] if a.time <= end_t), key=lambda a: (a.boundary, a.key)))
        R = len(round_ends)
        idle = np.zeros((R, W))
        starts = [0.0, *round_ends[:-1]]
        for w in range(W):
            for a, b in idle_spans[w]:
                for r in range(R):
                    idle[r, w] += max(0.0, min(b, round_ends[r]) - max(a, starts[r]))
        stale: list[list[float]] = [[] for _ in range(R)]
        for acts in actions:
            for a in acts:
                if a.kind in (LAND, REPLY, ASYNC):
                    r = min(int(np.searchsorted(round_ends, a.time, side="left")), R - 1)
                    stale[r].append(a.time - a.sent)
        sends = sorted(self.sends)
        times = np.asarray([s[0] for s in sends])
        published = []  # publish_every: every worker's publication to every other (the start's is free)
        if self.publish_every:
            n, each = 1, self.cost.publish(W)
            pub_end = end_t if self.t_work is None else min(end_t, self.t_work)  # none while the run drains
            while self.publication_time(n) <= pub_end:
                published.append((self._publications[n], each))
                n += 1
        everything = sorted(self.sends + self.other_sends + published)
        all_times = np.asarray([s[0] for s in everything])
        cum = np.cumsum([s[1] for s in everything]) if everything else np.zeros(0)
        nbytes, merges = [], []
        extra = np.sort(np.asarray(self.other_merges))
        for t in round_ends:
            n = int(np.searchsorted(times, t, side="right"))
            m = int(np.searchsorted(all_times, t, side="right"))
            nbytes.append(int(cum[m - 1]) if m else 0)
            merges.append((n // W if self.allreduce else n) + int(np.searchsorted(extra, t, side="right")))
        step_starts = [[x for x, c in zip(st, cs) if c <= end_t] for st, cs in zip(self.step_starts, completions)]
        send_spans = [[(a, min(b, end_t)) for a, b in spans if a < end_t] for spans in self.send_spans]
        return Timeline(self.sched, end_t, round_ends, comp, actions, idle, stale, nbytes, merges, self.horizon,
                        step_starts, [list(x) for x in idle_spans], send_spans, dict(self.dropped),
                        frozenset(self.swaps), self.peer.copy(), dict(self.most), frozenset(self.cancelled))
