"""The merges due after each local step: :class:`StepMerger` plans them (:mod:`.plan`) and has a backend apply
them, a set of disjoint pairs or an all-reduce at a time, with the swaps, the similarity-biased peers, the data that
travels and the supports' rescaling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import ops
from . import schedule as schedule_mod
from ..policy import MergePolicy
from . import plan as plan_mod
from .setup import Setup

if TYPE_CHECKING:
    from ..backends.base import Backend


class StepMerger:
    """Applies the merges due after each local step through a backend, a set of disjoint
    pairs at a time (:func:`plan.group_disjoint`), and keeps what every backend agrees on:
    the example counters (summed on merge), the bytes on the wire and the merge count."""

    def __init__(self, setup: Setup, policy: MergePolicy, sched: schedule_mod.Schedule, backend: "Backend"):
        self.p, self.sched, self.backend = policy, sched, backend
        self.T, self.B = setup.total_steps, setup.study.run.batch_size
        self.st = backend.state
        neighbours = None
        if sched.topology is not None:
            neighbours = [len(sched.topology.neighbours(i)) for i in range(setup.study.run.workers)]
        self.cost = plan_mod.costs(setup, policy, neighbours, len(self.st.optim.stacks()))
        self.W = setup.study.run.workers
        self.gathers = plan_mod.gathers_per_event(policy)
        self.publish = plan_mod.publishes(policy)  # publish_every: the workers publish what decisions read
        self.bytes = 0
        self.count = 0
        self.landing: dict[int, list[int]] = {}  # Streaming DiLoCo: step -> all-reduce events that land after it
        # Lookahead / SNOO: no merging, each worker's own outer step every H local steps
        self.each = plan_mod.own_outer_every(policy)

    def after_step(self, step: int) -> None:
        plan = self.plan(step)
        if plan is None:
            return
        for ps in plan[3]:
            self.apply_set(ps)
        self.finish(plan)

    def plan(self, step: int):
        """After local step ``step``: count the examples and plan the step's gossip as sets of disjoint
        pairs ``(events, a, b, sets, step)``, for :meth:`apply_set` in order and then :meth:`finish`. None
        when nothing is left to do (no event; an all-reduce, applied here)."""
        ex = self.st.examples
        counts = ops.counts(ex)  # the counters live on the host: numpy's add in their memory, no tensor op
        counts += self.B
        s, p = self.sched, self.p
        if self.publish and step % self.publish == 0:  # after the local step, before its merges
            self.backend.publish()
            self.bytes += self.cost.publish(self.W)
        if self.each and step % self.each == 0:
            self.backend.outer_each()
        for ev in self.landing.pop(step, ()):  # fragments sent fragment_delay steps ago land first
            self.backend.allreduce_finish(ev, plan_mod.allreduce_weight(p, int(s.step[ev]), self.T, float(s.u[ev])))
        evs = self.sched.events_at(step)
        if not len(evs):
            self._slowmo(step)
            return None
        if s.scheme == "allreduce":
            for ev in evs:
                frag = None if s.fragment is None else int(s.fragment[ev])
                if p.fragment_delay:
                    self.backend.allreduce_start(ev)
                    self.landing.setdefault(step + p.fragment_delay, []).append(ev)
                else:
                    self.backend.allreduce(ev, step, plan_mod.allreduce_weight(p, step, self.T, float(s.u[ev])))
                if s.syncs_whole_model(ev):  # counters are summed, not averaged (with the last
                    ex.fill_(float(ex.sum()))  # fragment, which holds the buffers, when the model is streamed)
                self.bytes += self.cost.allreduce(len(ex), frag)
                self._rescale()
            self.count += len(evs)
            return None
        events = np.arange(evs.start, evs.stop)
        a = s.initiator[events]
        b = self.backend.peers(events, step)
        swap = (s.u_swap[events] < self.backend.swap_chances(a, b, step)) if p.swap_p else np.zeros(len(events), bool)
        weight = plan_mod.scheduled_weight(p, step, self.T)
        sets = []
        for members in plan_mod.group_disjoint(a, b):
            m = np.asarray(members)
            sets.append(plan_mod.PairSet(step, events[m], a[m], b[m], s.u[events[m]], swap[m], weight))
        return events, a, b, sets, step

    def finish(self, plan) -> None:
        events, a, b, _, step = plan
        self.bytes += self.backend.after_events(events, a, b, step)
        if self.gathers:  # each event's initiator took every other worker's sketch
            self.bytes += self.cost.gather(self.W) * len(events)
        self.count += len(events)
        self._slowmo(step)

    def _slowmo(self, step: int) -> None:
        """SlowMo over a gossip base: after every ``outer_every`` local steps (and that step's gossip) an exact
        average of all workers, the outer step on it, and every worker restarts from the anchor."""
        if not plan_mod.slowmo_due(self.p, step):
            return
        ex = self.st.examples
        self.backend.allreduce(plan_mod.OUTER_AVERAGE, step, 1.0)
        ex.fill_(float(ex.sum()))  # counters are summed, as an all-reduce sums them
        self.bytes += self.cost.allreduce(len(ex))
        self.count += 1
        self._rescale()

    def apply_set(self, ps: plan_mod.PairSet) -> None:
        """One set of disjoint gossip events: the backend moves the tensors; counters and bytes here."""
        self.backend.pairs(ps)
        self.account(ps)

    def account(self, ps: plan_mod.PairSet) -> None:
        """The counters and bytes of a set of disjoint gossip events the tensors of which were moved."""
        ex, push_pull = ops.counts(self.st.examples), self.p.exchange == "push_pull"  # on the host: its memory
        # the pairs of a set are disjoint: every pair's counters at once, as pair by pair
        sw = ps.swap
        if sw.any():
            i, j = ps.a[sw], ps.b[sw]
            ex[i], ex[j] = ex[j], ex[i]
            self.bytes += self.cost.swap() * int(sw.sum())
        plain = ~sw
        if plain.any():
            i, j = ps.a[plain], ps.b[plain]
            total = ex[i] + ex[j]
            ex[j] = total
            if push_pull:
                ex[i] = total
            for a, b in zip(i.tolist(), j.tolist()):
                self.bytes += self.cost.pair(a, b)
        self._rescale()

    def _rescale(self) -> None:
        self.st.rescale_supports()
