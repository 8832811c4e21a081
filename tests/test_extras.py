"""Schema 2 policy fields: similarity sketches, self-forming communities, data that travels,
model swaps and the convergence stop, on real MNIST."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import tiny_study, write_study
from evomerge import datapool, models, simulate, similarity
from evomerge.errors import ConfigError
from evomerge.policy import SCHEMA_VERSION, MergePolicy, json_schema


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


# -- sketches ----------------------------------------------------------------------------------------
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


# -- data that travels -------------------------------------------------------------------------------
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


# -- model swap --------------------------------------------------------------------------------------
def test_swap_with_probability_one_applied_twice_restores_the_assignment(setup):
    pol = MergePolicy(topology="ring", swap_p=1.0, payload="delta", weighting="adaptive")
    run = setup.study.run
    from evomerge.backends.inprocess import InProcess
    from evomerge.engine.plan import PairSet
    from evomerge.engine.run import StepMerger

    backend = InProcess(setup, pol, 0, torch.device("cpu"))
    st, sched = backend.state, backend.sched
    g = torch.Generator().manual_seed(1)
    st.params.set_rows(torch.randn(run.workers, setup.model.n_params, generator=g))
    st.accum.set_rows(torch.rand(run.workers, setup.model.n_params, generator=g))
    st.examples.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    before = (st.params.rows(), st.accum.rows(), st.examples.clone())
    merger = StepMerger(setup, pol, sched, backend)
    ev = 0
    a, b = int(sched.initiator[ev]), int(sched.peer[ev])
    one = PairSet(int(sched.step[ev]), np.array([ev]), np.array([a]), np.array([b]), sched.u[[ev]], np.array([True]), 0.5)
    merger.apply_set(one)
    assert st.model_at.tolist() != [0, 1, 2, 3]
    assert torch.equal(st.params.row(a), before[0][b]) and torch.equal(st.params.row(b), before[0][a])
    assert merger.bytes == 2 * merger.cost.dense
    merger.apply_set(one)
    assert st.model_at.tolist() == [0, 1, 2, 3]
    assert torch.equal(st.params.rows(), before[0]) and torch.equal(st.accum.rows(), before[1])
    assert torch.equal(st.examples, before[2])


def test_a_swapping_run_reports_where_the_models_went(setup):
    res = simulate.simulate(setup, MergePolicy(topology="complete", swap_p=1.0, mean_interval=5), 0, device="cpu")
    assert sorted(res.model_at) == [0, 1, 2, 3] and res.final.merges > 0
    assert res.final.bytes == res.final.merges * 2 * 4 * setup.model.n_params


# -- convergence stop -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["inprocess", "distributed"])
def test_convergence_stop_ends_a_run_whose_learning_rate_is_zero(mnist, backend):
    from evomerge.backends import runner

    setup = simulate.prepare(tiny_study(lr=0.0, rounds=6), data=mnist)
    pol = MergePolicy(topology="ring", mean_interval=2, stop_tol=1e-6, stop_patience=2)
    res = runner(backend)(setup, pol, 0, device="cpu")
    assert res.status == "ok"
    assert len(res.history) == 2 and res.converged_step == res.history[1].step < setup.total_steps
    assert res.metrics()["converged_step"] == res.converged_step
    learning = runner(backend)(simulate.prepare(tiny_study(rounds=6), data=mnist), pol, 0, device="cpu")
    assert learning.converged_step is None and len(learning.history) == 6


# -- schema -------------------------------------------------------------------------------------------
def test_schema_two_reads_version_one_files(tmp_path):
    v1 = {"name": "old", "scheme": "gossip", "topology": "ring", "mean_interval": 4, "schema_version": 1}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(v1))
    pol = MergePolicy.load(f)
    assert pol.schema_version == SCHEMA_VERSION == 2
    assert (pol.swap_p, pol.data_exchange_k, pol.similarity_bias, pol.regroup_every, pol.stop_tol) == (0, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match=r"policy.swap_p: is a schema 2 field; this file says schema_version 1"):
        MergePolicy.from_dict({**v1, "swap_p": 0.5})
    props = json_schema()["properties"]
    assert props["similarity_bias"]["minimum"] == -1.0 and props["similarity"]["enum"] == ["sketch", "cka"]
    with pytest.raises(ConfigError, match=r"policy.regroup_every: 2 needs topology 'communities'"):
        MergePolicy(regroup_every=2)


def test_distributed_backend_refuses_what_it_cannot_run(tmp_path, data_dir):
    study = write_study(tmp_path, workers=4)
    pol = tmp_path / "swap.json"
    pol.write_text(json.dumps({"topology": "ring", "swap_p": 0.5}))
    r = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", str(study), "--policy", str(pol),
                        "--backend", "distributed", "--data-dir", str(data_dir)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: policy.swap_p: 0.5 is not supported by the distributed backend (models are "
                                "swapped between workers); allowed: 0, or --backend inprocess")


def test_same_seed_same_run_with_every_new_field_on(setup):
    pol = MergePolicy(topology="communities", n_communities=2, regroup_every=1, similarity_bias=0.5, data_exchange_k=4,
                      retire_threshold=0.8, swap_p=0.2, stop_tol=1e-9)
    a = simulate.simulate(setup, pol, 5, device="cpu")
    b = simulate.simulate(setup, pol, 5, device="cpu")
    strip = [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in a.history]
    assert strip == [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in b.history]
    assert a.communities == b.communities and a.model_at == b.model_at


def test_the_new_fields_are_searchable(tmp_path, mnist):
    import evomerge
    from evomerge import study as study_mod

    f = write_study(tmp_path, workers=4, steps=40, topologies=("communities", "complete"))
    text = f.read_text().replace("[objectives]", "\n".join([
        'similarity_bias = { kind = "float", low = -1.0, high = 1.0 }',
        'regroup_every = { kind = "int", low = 0, high = 2 }',
        'data_exchange_k = { kind = "int", low = 0, high = 8 }',
        'swap_p = { kind = "float", low = 0.0, high = 0.5 }',
        'stop_tol = { kind = "float", low = 0.0, high = 0.001 }',
        'similarity = { kind = "categorical", choices = ["sketch", "cka"] }',
        "[objectives]"]))
    f.write_text(text)
    s = study_mod.load(f)
    res = evomerge.search(s, n_trials=5, sampler="random", runs_dir=tmp_path / "runs", seed=2, data=mnist)
    assert res.counts.get("COMPLETE", 0) == 5 and not res.errors
    policies = [r["policy"] for r in res.records]
    assert len({p["swap_p"] for p in policies}) == 5 and len({p["similarity_bias"] for p in policies}) == 5
    for p in policies:  # regrouping only where it applies
        assert p["regroup_every"] == 0 or p["topology"] == "communities"
        assert p["schema_version"] == SCHEMA_VERSION
    with pytest.raises(ConfigError, match=r"study.search.space.similarity_bias: is not supported by the distributed"):
        evomerge.search(s, n_trials=1, runs_dir=tmp_path / "runs2", data=mnist, backend="distributed")
