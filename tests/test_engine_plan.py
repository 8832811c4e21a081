"""The plan of a step's merges: sets of disjoint pairs, and bytes."""

from __future__ import annotations

import numpy as np

from evomerge.engine.plan import Bytes, group_disjoint
from evomerge.policy import MergePolicy


def test_sets_of_pairs_are_disjoint_and_keep_each_workers_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        a = rng.integers(0, 6, n)
        b = (a + rng.integers(1, 6, n)) % 6
        sets = group_disjoint(a, b)
        assert sorted(i for s in sets for i in s) == list(range(n))
        for s in sets:
            ws = [w for i in s for w in (a[i], b[i])]
            assert len(ws) == len(set(ws))
        where = {i: k for k, s in enumerate(sets) for i in s}
        for i in range(n):
            for j in range(i + 1, n):
                if {a[i], b[i]} & {a[j], b[j]}:
                    assert where[i] < where[j]


def test_bytes_charge_payloads_per_neighbour_for_deltas_and_two_ways_for_push_pull():
    n = 1000
    dense = Bytes(MergePolicy(), n, [2, 2, 2, 2])
    assert dense.pair(0, 1) == 2 * 4 * n and dense.swap() == 2 * 4 * n and dense.allreduce(4) == 4 * 2 * 4 * n
    push = Bytes(MergePolicy(exchange="push"), n, [2, 2, 2, 2])
    assert push.pair(0, 1) == 4 * n
    delta = Bytes(MergePolicy(exchange="push", payload="delta", topk_fraction=0.1, quantize_bits=8), n, [3, 1, 1, 1])
    assert delta.pair(0, 1) == 3 * (100 + min(400, 125) + 4)  # values, a bit mask of positions, the scale; 3 neighbours


def test_bytes_charge_the_supports_that_travel_with_a_weighted_merge():
    """Adaptive weighting: each gossip payload carries the sender's per-coordinate supports (as the Merger packs
    them), and a weighted all-reduce sums three rows (supported models, supports, plain models), also under the
    examples weighting."""
    n = 1000
    adaptive = Bytes(MergePolicy(weighting="adaptive"), n, [2, 2, 2, 2])
    assert adaptive.message(0) == 2 * 4 * n and adaptive.pair(0, 1) == 2 * 2 * 4 * n
    for w in ("adaptive", "examples"):
        ar = Bytes(MergePolicy(scheme="allreduce", weighting=w), n, None)
        assert ar.allreduce(4) == 3 * 4 * 2 * 4 * n and ar.allreduce_sizes(None) == (3.0 * 4 * n, 3.0 * 4 * n)
    examples = Bytes(MergePolicy(weighting="examples"), n, [2, 2, 2, 2])
    assert examples.pair(0, 1) == 2 * 4 * n  # its counter rides in the message's few bytes of metadata
