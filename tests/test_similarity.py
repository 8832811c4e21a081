"""Model similarity (schema 2): sketches, CKA, self-forming communities and similarity-biased peers, on real MNIST."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import tiny_study
from evomerge import models, simulate
from evomerge.engine import similarity
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


def split_by_label(setup, groups_of_worker: list[int]) -> simulate.Setup:
    """The same study with worker w trained only on digits 0-4 (group 0) or 5-9 (group 1)."""
    labels = setup.data.train_y.numpy()
    pools = {g: np.flatnonzero((labels < 5) == (g == 0)) for g in (0, 1)}
    shards = []
    for w, g in enumerate(groups_of_worker):
        members = [i for i, h in enumerate(groups_of_worker) if h == g]
        shards.append(np.array_split(pools[g], len(members))[members.index(w)])
    return dataclasses.replace(setup, shards=shards)


def test_sketch_similarity_is_one_for_identical_models_and_the_projection_is_fixed_by_the_seed():
    m = models.build("mlp", (28, 28), 10, hidden=[32])
    g = torch.Generator().manual_seed(0)
    start = m.init(g)
    a, b = m.init(g), m.init(g)
    stack = models.Stack.from_rows(m, torch.stack([a, a.clone(), b, start]))
    sk = similarity.Sketcher(m.offsets, start, seed=7)
    sim = similarity.cosine_matrix(sk(stack.blocks))
    assert sim[0, 1] == pytest.approx(1.0, abs=1e-6)
    assert sim[3, 3] == 1.0 and sim[0, 3] == 0.0  # an unmoved model: similarity 0 to a moved one
    unmoved = models.Stack.from_rows(m, torch.stack([start, start.clone()]))
    assert similarity.cosine_matrix(sk(unmoved.blocks))[0, 1] == 1.0  # identical, neither moved
    # the sketch estimates the true cosine of the changes
    true = torch.nn.functional.cosine_similarity(a - start, b - start, dim=0)
    assert float(sim[0, 2]) == pytest.approx(float(true), abs=0.1)
    again, other = similarity.Sketcher(m.offsets, start, seed=7), similarity.Sketcher(m.offsets, start, seed=8)
    assert torch.equal(again.bucket, sk.bucket) and torch.equal(again.sign, sk.sign)
    assert not torch.equal(other.bucket, sk.bucket)


def test_linear_cka_of_identical_activations_is_one_and_invariant_to_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 10, generator=g)
    y = torch.randn(50, 10, generator=g)
    m = similarity.linear_cka(torch.stack([x, 3 * x, y]))
    assert m[0, 1] == pytest.approx(1.0, abs=1e-5)
    assert float(m[0, 2]) < 0.6


def test_similarities_are_reported_per_round(setup):
    res = simulate.simulate(setup, MergePolicy(scheme="none"), 0, device="cpu")
    for h in res.history:
        assert -1 <= h.similarity_min <= h.similarity_mean <= 1
    merged = simulate.simulate(setup, MergePolicy(scheme="allreduce", mean_interval=1, mixing_weight=1.0), 0, device="cpu")
    assert merged.final.similarity_min == pytest.approx(1.0, abs=1e-5)  # all workers hold one model
    assert res.final.similarity_mean < 0.99  # alone on different data they drift apart


# -- clustering --------------------------------------------------------------------------------------
def test_workers_on_two_disjoint_label_sets_form_two_communities(setup):
    s = split_by_label(setup, [0, 1, 0, 1])  # the static split would be {0, 1} {2, 3}: wrong on purpose
    alone = simulate.simulate(s, MergePolicy(scheme="none"), 0, device="cpu", keep_params=True)
    m = s.model
    stack = models.Stack.from_rows(m, alone.params)
    sk = similarity.Sketcher(m.offsets, simulate.initial_row(m, 0), 0)
    assert similarity.cluster(similarity.cosine_matrix(sk(stack.blocks)), 2).tolist() == [0, 1, 0, 1]
    # and inside a run: regrouped every round, merging only inside the communities found
    pol = MergePolicy(topology="communities", n_communities=2, p_intra=1.0, regroup_every=1, mean_interval=20)
    for kind in ("sketch", "cka"):
        res = simulate.simulate(s, pol.replace(similarity=kind), 0, device="cpu")
        assert res.communities == [0, 1, 0, 1], kind


def test_similarity_bias_changes_who_merges_with_whom(setup):
    s = split_by_label(setup, [0, 1, 0, 1])
    base = MergePolicy(topology="complete", mean_interval=4)
    acc = {}
    for bias in (-1.0, 0.0, 1.0):
        res = simulate.simulate(s, base.replace(similarity_bias=bias), 0, device="cpu")
        acc[bias] = res.final.similarity_min
    # preferring similar peers keeps the two label groups apart; dissimilar peers mix them
    assert acc[1.0] < acc[0.0] < acc[-1.0]
