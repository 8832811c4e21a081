import numpy as np
import pytest

from evomerge.engine import schedule
from evomerge.policy import MergePolicy


def test_same_seed_same_schedule_other_seed_other_schedule():
    p = MergePolicy(topology="complete", mean_interval=5)
    a, b, c = (schedule.build(p, 8, 500, s) for s in (0, 0, 1))
    for f in ("step", "initiator", "peer", "u"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.step, c.step) or not np.array_equal(a.peer, c.peer)


def test_gossip_timers_are_poisson_with_the_mean_interval():
    s = schedule.build(MergePolicy(mean_interval=10), 16, 20000, 3)
    per_worker = np.bincount(s.initiator, minlength=16)
    assert per_worker.mean() == pytest.approx(2000, rel=0.03)
    gaps = np.diff(s.step[s.initiator == 0])
    assert gaps.min() >= 1 and gaps.var() == pytest.approx(9, rel=0.25)  # Poisson(9) + 1
    assert np.all(np.diff(s.step) >= 0) and s.step.max() <= 20000 and s.step.min() >= 1
    assert np.all(s.peer != s.initiator) and np.all((s.u >= 0) & (s.u < 1))


def test_events_at_a_step_are_ordered_by_initiator():
    s = schedule.build(MergePolicy(mean_interval=1.5), 8, 100, 0)
    for t in range(1, 101):
        r = s.events_at(t)
        assert np.all(np.diff(s.initiator[r.start:r.stop]) > 0)


def test_allreduce_and_none():
    s = schedule.build(MergePolicy(scheme="allreduce", mean_interval=50), 8, 230, 0)
    assert s.step.tolist() == [50, 100, 150, 200] and np.all(s.peer == -1)
    assert len(schedule.build(MergePolicy(scheme="none"), 8, 230, 0)) == 0
    assert len(schedule.build(MergePolicy(), 1, 230, 0)) == 0
