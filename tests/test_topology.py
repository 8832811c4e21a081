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
