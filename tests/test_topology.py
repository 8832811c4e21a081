"""Conformance over every registered topology, and each one's own shape."""

import numpy as np
import pytest

from evomerge.engine import topology
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy


def build(name, n=8, seed=0, **kw):
    return topology.build(MergePolicy(topology=name, **kw), n, np.random.default_rng(seed))


@pytest.mark.parametrize("name", list(topology.TOPOLOGIES))
@pytest.mark.parametrize("n", [2, 5, 8])
def test_rows_are_distributions_without_self(name, n):
    kw = {"degree": 1} if name == "random_regular" and n == 2 else {}
    if name == "random_regular" and n == 5:
        kw = {"degree": 2}
    p = build(name, n, **kw).probabilities()
    assert p.shape == (n, n)
    assert np.allclose(p.sum(1), 1.0) and np.all(np.diag(p) == 0) and np.all(p >= 0)


@pytest.mark.parametrize("name", list(topology.TOPOLOGIES))
def test_sampling_follows_the_probabilities_and_is_seeded(name):
    t = build(name)
    init = np.repeat(np.arange(8), 4000)
    peers = t.sample(init, np.random.default_rng(1))
    assert np.array_equal(peers, t.sample(init, np.random.default_rng(1)))
    assert not np.any(peers == init)
    freq = np.zeros((8, 8))
    np.add.at(freq, (init, peers), 1)
    assert np.allclose(freq / 4000, t.probabilities(), atol=0.03)


def test_ring_neighbours():
    assert sorted(build("ring").neighbours(0).tolist()) == [1, 7]


def test_random_regular_is_regular_and_seeded():
    t = build("random_regular", 10, degree=3)
    adj = t.adjacency
    assert np.all(adj.sum(0) == 3) and np.all(adj == adj.T) and not adj.diagonal().any()
    assert np.array_equal(adj, build("random_regular", 10, degree=3).adjacency)
    assert not np.array_equal(adj, build("random_regular", 10, seed=5, degree=3).adjacency)
    with pytest.raises(ConfigError, match="policy.degree"):
        build("random_regular", 7, degree=3)


def test_communities_split_by_p_intra():
    p = build("communities", 8, n_communities=2, p_intra=0.9).probabilities()
    assert p[0, 1:4].sum() == pytest.approx(0.9) and p[0, 4:].sum() == pytest.approx(0.1)
    single = build("communities", 8, n_communities=1, p_intra=0.2).probabilities()
    assert np.allclose(single, build("complete").probabilities())
    with pytest.raises(ConfigError, match="policy.n_communities"):
        build("communities", 3, n_communities=4)


def _intra_share(sched, groups, lo, hi):
    """The share of events in [lo, hi) of the run whose peer is in the initiator's own community."""
    m = (sched.step / sched.total_steps >= lo) & (sched.step / sched.total_steps < hi)
    return float(np.mean(groups[sched.initiator[m]] == groups[sched.peer[m]]))


def test_communities_converge_as_p_intra_moves_to_its_final_value():
    """Linear from 1 (peers only inside the community) to 0 (only outside): the first fifth of the run's merges stay
    inside, the last fifth go outside, and the middle mixes; cosine too, and constant keeps p_intra all along."""
    from evomerge.engine import schedule

    groups = np.repeat([0, 1], 8)
    for kind in ("linear", "cosine"):
        pol = MergePolicy(topology="communities", n_communities=2, p_intra=1.0, p_intra_final=0.0,
                          p_intra_schedule=kind, mean_interval=2.0)
        s = schedule.build(pol, 16, 1000, seed=3)
        assert _intra_share(s, groups, 0.0, 0.2) > 0.85, kind
        assert _intra_share(s, groups, 0.8, 1.0) < 0.15, kind
        assert 0.3 < _intra_share(s, groups, 0.4, 0.6) < 0.7, kind
        # it reaches its final value at the last step: the last step's peer distributions are p_intra_final's
        assert s.topology.p_intra_at(s.total_steps / s.total_steps) == 0.0 and s.topology.p_intra_at(0.0) == 1.0
        last = s.topology.probabilities(1.0)
        assert last[0, groups == 0].sum() == 0.0 and last[0, groups == 1].sum() == pytest.approx(1.0)
    const = MergePolicy(topology="communities", n_communities=2, p_intra=1.0, p_intra_final=0.0, mean_interval=2.0)
    s = schedule.build(const, 16, 1000, seed=3)
    assert _intra_share(s, groups, 0.8, 1.0) == 1.0


def test_a_constant_or_unmoving_p_intra_draws_the_peers_it_drew_before():
    """The neutral values give today's schedule exactly: the same uniforms, the same peers."""
    from evomerge.engine import schedule

    base = MergePolicy(topology="communities", n_communities=3, p_intra=0.7, mean_interval=3.0)
    before = schedule.build(base, 12, 300, seed=5)
    for kw in ({"p_intra_final": 0.1}, {"p_intra_schedule": "linear", "p_intra_final": 0.7},
               {"p_intra_schedule": "cosine", "p_intra_final": 0.7}):
        s = schedule.build(base.replace(**kw), 12, 300, seed=5)
        assert np.array_equal(s.peer, before.peer) and np.array_equal(s.step, before.step), kw


def test_p_intra_schedule_is_a_schema_8_field_and_is_described():
    from evomerge.errors import ConfigError as Err

    pol = MergePolicy(topology="communities", p_intra=0.9, p_intra_final=0.2, p_intra_schedule="cosine")
    assert "p_intra 0.9->0.2 (cosine)" in pol.describe()
    with pytest.raises(Err, match="policy.p_intra_schedule: is a schema 8 field"):
        MergePolicy.from_dict({"schema_version": 7, "topology": "communities", "p_intra_schedule": "linear"})
    with pytest.raises(Err, match="policy.p_intra_schedule"):
        MergePolicy.from_dict({"p_intra_schedule": "step"})


def test_a_moving_p_intra_is_timed_by_the_runs_steps_and_opens_every_group_it_will_reach():
    """On a simulated clock the schedule is built for a longer horizon than the run: p_intra still reaches its final
    value at the run's last step (past it, it stays there). A worker's possible peers are everyone it may draw over
    the run, so p_intra 1 -> 0 opens the other group (what senders of deltas and the bytes charged need)."""
    from evomerge.engine import schedule

    groups = np.repeat([0, 1], 8)
    pol = MergePolicy(topology="communities", n_communities=2, p_intra=1.0, p_intra_final=0.0,
                      p_intra_schedule="linear", mean_interval=2.0)
    s = schedule.build(pol, 16, 2000, seed=3, run_steps=1000)
    late = s.step >= 1000
    assert np.all(groups[s.initiator[late]] != groups[s.peer[late]])
    assert _intra_share(s, groups, 0.0, 0.05) > 0.85
    assert list(s.topology.neighbours(0)) == list(range(1, 16))
