"""Data that travels (schema 2): examples move between workers, retire and come back, on real MNIST."""

from __future__ import annotations


import numpy as np
import pytest

from conftest import tiny_study
from evomerge.engine import datapool
from evomerge import simulate
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


def test_no_example_is_lost_or_duplicated_while_data_moves():
    rng = np.random.default_rng(0)
    shards = [np.sort(p) for p in np.array_split(rng.permutation(1000), 4)]
    pool = datapool.DataPool(shards, 1200, seed=3, retire_threshold=0.9, reserve_rate=0.2)
    original = np.sort(np.concatenate(shards))
    for step in range(200):
        pos = pool.batches(16)
        assert all(pool.holder[pos[w]].tolist() == [w] * 16 for w in range(4))  # each trains on its own data
        pool.record(pos, rng.random(pos.shape).astype(np.float32))
        if step % 3 == 0:
            a, b = rng.choice(4, 2, replace=False)
            pool.send_least_confident(int(a), int(b), 10)
        held = np.concatenate(pool.holdings())
        assert len(held) == len(original) and np.array_equal(np.sort(held), original)
    assert pool.moved > 0 and pool.retired > 0
    assert sum(len(pool.reserve(w)) for w in range(4)) == int(pool.reserved.sum())


def test_data_exchange_charges_bytes_and_changes_the_label_skew(setup):
    pol = MergePolicy(topology="complete", mean_interval=3)
    still = simulate.simulate(setup, pol, 0, device="cpu")
    moving = simulate.simulate(setup, pol.replace(data_exchange_k=8, retire_threshold=0.9, reserve_rate=0.3), 0, device="cpu")
    f = moving.final
    example_bytes = 28 * 28 + 1
    assert f.examples_moved > 0
    assert f.bytes - still.final.bytes == f.examples_moved * example_bytes  # merges cost the same; examples on top
    assert still.final.label_skew == pytest.approx(setup.label_skew)
    assert f.label_skew != pytest.approx(setup.label_skew)
    # the least confident examples went to the peer: the same seed moves the same ones
    again = simulate.simulate(setup, pol.replace(data_exchange_k=8, retire_threshold=0.9, reserve_rate=0.3), 0, device="cpu")
    assert [h.val_accuracy for h in again.history] == [h.val_accuracy for h in moving.history]
