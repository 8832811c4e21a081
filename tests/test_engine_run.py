"""The engine's round loop: the convergence stop in both backends, and determinism with every schema 2 field on."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_study
from evomerge import simulate
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("distributed", marks=pytest.mark.system)])
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


def test_same_seed_same_run_with_every_new_field_on(setup):
    pol = MergePolicy(topology="communities", n_communities=2, regroup_every=1, similarity_bias=0.5, data_exchange_k=4,
                      retire_threshold=0.8, swap_p=0.2, stop_tol=1e-9)
    a = simulate.simulate(setup, pol, 5, device="cpu")
    b = simulate.simulate(setup, pol, 5, device="cpu")
    strip = [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in a.history]
    assert strip == [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in b.history]
    assert a.communities == b.communities and a.model_at == b.model_at
