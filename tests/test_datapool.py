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
            pool.send(int(a), int(b), 10)
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


def _pool_after_one_pass(W=3, per=6):
    """W workers of ``per`` examples each, every one trained on once by its holder, confidence = its index / 100."""
    shards = [np.arange(w * per, (w + 1) * per) for w in range(W)]
    pool = datapool.DataPool(shards, W * per, seed=0)
    pos = np.stack(shards)
    pool.record(pos, (pos / 100).astype(np.float32))
    return pool


def test_travel_with_history_never_brings_an_example_back_to_a_worker_that_trained_on_it():
    """0 sends its two least confident (0, 1) to 1, which trains on them, so they are now 1's least confident. Sent
    back without the history they return to 0, which has trained on them; unseen first, 1 sends two of its own."""
    for unseen_first, back in ((False, [0, 1]), (True, [6, 7])):
        pool = _pool_after_one_pass()
        assert pool.send(0, 1, 2, unseen_first=unseen_first) == 2 and pool.holder[[0, 1]].tolist() == [1, 1]
        pool.record(np.array([[2, 3], [0, 1], [12, 13]]), np.array([[.5, .5], [0., 0.], [.5, .5]], np.float32))
        pool.send(1, 0, 2, unseen_first=unseen_first)
        assert pool.holder[back].tolist() == [0, 0]
        arrived = np.array(back)
        assert pool.seen[arrived, 0].any() == (not unseen_first)  # with the history: nothing 0 has trained on
        # the history: the travelled examples' distinct trainers (0 and 1 for 0, 1; 1 alone for 6, 7)
        assert pool.visitors() == pytest.approx(2.0 if not unseen_first else (2 + 2 + 1 + 1) / 4)


def test_similarity_decides_whether_easy_or_hard_examples_travel():
    sims = np.array([1.0, 0.9, 0.5, 0.7])  # worker 0's row: 1 its most similar, 2 its least
    assert datapool.most_confident_share(1.0, sims, 0, 2) == 1.0  # +1: the least similar sends its easiest
    assert datapool.most_confident_share(1.0, sims, 0, 1) == 0.0  # ... the most similar its hardest (today's rule)
    assert datapool.most_confident_share(-1.0, sims, 0, 1) == 1.0  # -1: similar pairs exchange easy examples
    assert datapool.most_confident_share(-1.0, sims, 0, 2) == 0.0  # ... dissimilar ones the hardest
    assert datapool.most_confident_share(0.5, sims, 0, 3) == pytest.approx(0.5 * 0.5)
    pool = _pool_after_one_pass()
    pool.conf[5] = datapool.UNSEEN  # never trained on: not among the most confident
    pool.send(0, 2, 3, most=2 / 3)  # two most confident (4, 3) and the least confident (0)
    assert sorted(np.flatnonzero(pool.holder[:6] == 2).tolist()) == [0, 3, 4]


def test_the_history_is_reported_with_the_run(mnist):
    """Three passes over each shard, so that travelled examples are trained on where they arrive."""
    setup = simulate.prepare(tiny_study(steps=750), data=mnist)
    pol = MergePolicy(topology="complete", mean_interval=3, data_exchange_k=8)
    plain = simulate.simulate(setup, pol, 0, device="cpu").final
    unseen = simulate.simulate(setup, pol.replace(data_unseen_first=True, data_similarity_sign=0.5), 0,
                               device="cpu").final
    assert plain.travel_visitors > 1.0 and unseen.travel_visitors > 1.0
    assert unseen.examples_moved == plain.examples_moved and unseen.val_accuracy != plain.val_accuracy
    assert simulate.simulate(setup, MergePolicy(topology="complete", mean_interval=3), 0,
                             device="cpu").final.travel_visitors is None


def test_swap_chance_is_conditioned_on_the_peers_confidence_and_the_models_absence():
    from evomerge.engine.plan import swap_chance

    p = MergePolicy(topology="complete", swap_p=0.5)
    assert swap_chance(p, 0.9, 3.0) == 0.5  # neutral values: today's coin
    conf = p.replace(swap_confidence=1.0)
    assert swap_chance(conf, 0.9, 3.0) == pytest.approx(0.5 * 1.8) and swap_chance(conf, 0.1, 3.0) == pytest.approx(0.1)
    assert swap_chance(conf, None, 3.0) == 0.5  # no confidence yet: not conditioned
    rec = p.replace(swap_recency=10.0)
    assert swap_chance(rec, None, float("inf")) == 0.5  # the model never held the peer's data
    assert swap_chance(rec, None, 10.0) == pytest.approx(0.5 * (1 - np.exp(-1.0)))
    assert swap_chance(rec, None, 0.0) == 0.0  # it has just left it


def test_conditioned_swaps_change_how_often_models_swap(setup):
    """Push gossip: a swap moves two models, a merge one, so the bytes count the swaps. swap_confidence +1 and -1
    move the chance to opposite sides of the plain coin (by 2c - 1, c the peer's confidence), and a long recency
    keeps a model from going back to the data it just left."""
    pol = MergePolicy(topology="complete", exchange="push", swap_p=0.5, mean_interval=2)
    plain = simulate.simulate(setup, pol, 0, device="cpu").final
    less = simulate.simulate(setup, pol.replace(swap_confidence=-1.0), 0, device="cpu").final
    more = simulate.simulate(setup, pol.replace(swap_confidence=1.0), 0, device="cpu").final
    assert plain.merges == less.merges == more.merges
    assert (less.bytes - plain.bytes) * (more.bytes - plain.bytes) < 0, (less.bytes, plain.bytes, more.bytes)
    recent = simulate.simulate(setup, pol.replace(swap_recency=1000.0), 0, device="cpu").final
    assert recent.bytes < plain.bytes  # a model that just left a worker's data rarely goes back


def test_the_examples_chosen_are_a_full_stable_sort_s_first_k():
    """leave() selects without sorting the whole shard; it chooses what the stable sorts of the whole shard (by
    whether the receiver trained on an example, then by confidence) would, ties and unseen examples included."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        n = int(rng.integers(3, 400))
        conf = rng.choice([0.1, 0.5, 0.9, datapool.UNSEEN], n).astype(np.float32)  # many ties
        free = rng.random(n) < 0.5
        conf[free] = (rng.random(int(free.sum())) * rng.choice([1.0, 1e-18], int(free.sum()))).astype(np.float32)
        seen = rng.random(n) < 0.4
        k, most, unseen_first = int(rng.integers(1, n)), float(rng.choice([0.0, 0.25, 1.0])), bool(trial % 2)
        pool = datapool.DataPool([np.arange(n)], n, seed=0)
        pool.conf[:] = conf
        pool.seen[:, 0] = seen
        chosen = pool.leave(0, 0, k, most=most, unseen_first=unseen_first)
        k = min(k, n - 1)
        first = seen if unseen_first else np.zeros(n, dtype=bool)
        least = np.lexsort((conf, first))
        n_most = int(round(most * k))
        trained = np.where(conf >= datapool.UNSEEN, -1.0, conf)
        top = np.lexsort((-trained, first))[:n_most]
        want = np.concatenate([top, least[~np.isin(least, top)][:k - n_most]])
        assert chosen.tolist() == want.tolist()
    key = np.array([3.0, 1.0, 2.0, 1.0, 1.0, 0.5])
    assert datapool.first_k(key, 3).tolist() == [5, 1, 3]
    # confidences too small to survive an offset, and NaN (a diverged model), ordered as lexsort orders them
    for c, later, k in [([.5, 1e-17, 1e-19, .3], [False, True, True, False], 3),
                        ([np.nan, .9, .2], [False, True, True], 2),
                        ([np.nan, np.nan, .1, .4, np.nan], [False, False, False, True, True], 4)]:
        c, later = np.asarray(c, dtype=np.float32), np.asarray(later)
        assert datapool.first_k(c, k, later).tolist() == np.lexsort((c, later))[:k].tolist()
