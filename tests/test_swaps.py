"""Model swaps (schema 2): a gossip event may exchange the two workers' models with everything that belongs to them."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import tiny_study
from evomerge import simulate
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


def test_swap_with_probability_one_applied_twice_restores_the_assignment(setup):
    pol = MergePolicy(topology="ring", swap_p=1.0, payload="delta", weighting="adaptive")
    run = setup.study.run
    from evomerge.backends.inprocess import InProcess
    from evomerge.engine.plan import PairSet
    from evomerge.engine.merger import StepMerger

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
