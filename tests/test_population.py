"""A population (backends/population.py): N members trained as one stacked computation give each
member exactly its one-at-a-time run, whatever the others do (diverge, get pruned, stop)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import tiny_study
from evomerge import simulate
from evomerge.backends.population import Member, run_population
from evomerge.policy import MergePolicy


class Stop(Exception):
    pass


def _strip(history):
    nan = lambda v: "nan" if isinstance(v, float) and math.isnan(v) else v  # noqa: E731  (NaN != NaN)
    return [{k: nan(v) for k, v in dataclasses.asdict(h).items() if k != "wall_time"} for h in history]


def _same(a, b):
    assert a.status == b.status
    assert _strip(a.history) == _strip(b.history)
    assert a.converged_step == b.converged_step and a.model_at == b.model_at and a.communities == b.communities
    assert torch.equal(a.params.isnan(), b.params.isnan())
    assert torch.equal(a.params.nan_to_num(), b.params.nan_to_num())


MIXED = [
    MergePolicy(topology="ring", mean_interval=3, exchange="push_pull", winner_bias=0.5, weighting="examples"),
    MergePolicy(topology="complete", mean_interval=5, exchange="push", payload="delta", topk_fraction=0.2,
                weighting="adaptive", lerp="random"),
    MergePolicy(scheme="allreduce", mean_interval=10, mixing_schedule="cosine", mixing_weight_final=0.2),
    MergePolicy(topology="communities", n_communities=2, regroup_every=1, similarity_bias=0.5, data_exchange_k=4,
                swap_p=0.2),
    MergePolicy(topology="ring", mean_interval=200),  # almost no merging
    # decisions from what the workers publish every 3 steps (schema 10)
    MergePolicy(topology="complete", similarity_bias=-0.5, swap_p=0.3, swap_confidence=0.7, mean_interval=2,
                publish_every=3),
]


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(rounds=4), data=mnist)


CROSS = [  # plain gossip lerps of weights: applied together across members with cross=True
    MergePolicy(topology="ring", mean_interval=2, exchange="push_pull", winner_bias=0.7, weighting="examples"),
    MergePolicy(topology="complete", mean_interval=3, exchange="push", lerp="random", mixing_schedule="linear"),
    MergePolicy(topology="communities", n_communities=2, similarity_bias=0.5, mean_interval=2, winner_bias=0.3),
    MergePolicy(topology="ring", mean_interval=4, exchange="push", winner_bias=1.0, data_exchange_k=3),
    # per-coordinate weights (accumulators): weighed and summed for every such member at once
    MergePolicy(topology="complete", mean_interval=1.5, exchange="push_pull", weighting="adaptive", winner_bias=0.5),
    MergePolicy(topology="ring", mean_interval=2, exchange="push", weighting="adaptive", lerp="random"),
]


@pytest.mark.parametrize("cross", [False, True])
def test_each_member_equals_its_run_alone_bit_for_bit(setup, cross):
    pols = MIXED + (CROSS if cross else [])
    members = [Member(p, seed) for p, seed in zip(pols, [0, 1, 0, 2, 3, 4, 0, 1, 0, 5, 2, 0])]
    out = run_population(setup, members, "cpu", keep_params=True, cross=cross)
    for m, got in zip(members, out):
        _same(got, simulate.simulate(setup, m.policy, m.seed, device="cpu", keep_params=True))


@pytest.mark.parametrize("cross", [False, True])
def test_members_that_diverge_or_are_pruned_end_alone_and_the_others_go_on(mnist, cross):
    # at lr 300 some of these runs diverge (in round 1 or 3) and others do not
    setup = simulate.prepare(tiny_study(rounds=4, lr=300.0), data=mnist)
    pols = [(MergePolicy(topology="ring", mean_interval=200), 0),
            (MergePolicy(scheme="allreduce", mean_interval=2), 0),
            (MergePolicy(topology="complete", mean_interval=1, weighting="adaptive"), 1),
            (MergePolicy(topology="ring", mean_interval=3, exchange="push_pull", winner_bias=0.5, weighting="examples"), 0),
            (MIXED[1], 2)]

    def prune(m):  # as the search's pruner does: the callback raises
        if m.round == 2:
            raise Stop(m.round)

    members = [Member(p, seed) for p, seed in pols]
    members[3].callback = prune
    out = run_population(setup, members, "cpu", keep_params=True, cross=cross)
    assert isinstance(out[3], Stop) and out[3].args == (2,)
    with pytest.raises(Stop):
        simulate.simulate(setup, pols[3][0], 0, callback=prune, device="cpu")
    alone = [simulate.simulate(setup, p, seed, device="cpu", keep_params=True) for p, seed in pols]
    for k in (0, 1, 2, 4):
        _same(out[k], alone[k])
    assert [out[k].status for k in (0, 1, 2)] == ["diverged", "ok", "diverged"]
    assert len(out[0].history) == 3 and len(out[2].history) == 1


@pytest.mark.parametrize("optimizer", ["adam", "sgd-momentum"])
def test_optimisers_and_their_merged_state(mnist, optimizer):
    run = {"optimizer": "adam"} if optimizer == "adam" else {"momentum": 0.9}
    setup = simulate.prepare(tiny_study(rounds=3, lr=0.01 if optimizer == "adam" else 0.05, **run), data=mnist)
    pols = [MergePolicy(topology="ring", mean_interval=3, optimizer_state="average"),
            MergePolicy(topology="complete", mean_interval=4, optimizer_state="reset", exchange="push"),
            MergePolicy(topology="ring", mean_interval=5)]
    got = run_population(setup, [Member(p, 1) for p in pols], "cpu", keep_params=True)
    for p, g in zip(pols, got):
        _same(g, simulate.simulate(setup, p, 1, device="cpu", keep_params=True))


def test_a_callback_that_returns_false_stops_only_its_member(setup):
    pols = MIXED[:2]
    got = run_population(setup, [Member(pols[0], 0, callback=lambda m: m.round < 2), Member(pols[1], 0)], "cpu",
                         keep_params=True)
    assert got[0].status == "stopped" and len(got[0].history) == 2
    _same(got[0], simulate.simulate(setup, pols[0], 0, callback=lambda m: m.round < 2, device="cpu", keep_params=True))
    _same(got[1], simulate.simulate(setup, pols[1], 0, device="cpu", keep_params=True))


def test_on_a_simulated_cluster_members_run_one_at_a_time_with_their_own_results(setup):
    from evomerge.study import EnvSpec

    timed = dataclasses.replace(setup, study=dataclasses.replace(
        setup.study, environment=EnvSpec(step_time=0.1, speeds="lognormal", sigma=0.5, time_budget=3.0), target=0.5))
    pols = [MIXED[0], MIXED[2]]
    got = run_population(timed, [Member(p, 4) for p in pols], "cpu", keep_params=True)
    for p, g in zip(pols, got):
        assert g.final.sim_time is not None
        _same(g, simulate.simulate(timed, p, 4, device="cpu", keep_params=True))


def test_adaptive_gossip_is_applied_with_the_other_members(setup):
    """Per-coordinate weights (adaptive) join the members' merges applied together; what cannot (a compressed
    delta, swaps) stays with its own backend. The arithmetic is held bit for bit above."""
    from evomerge.backends.population import cross_mergeable
    from evomerge.engine.state import Workers, initial_row

    run = setup.study.run
    whole = Workers.population(setup.model, run, [initial_row(setup.model, 0)] * 2, True, torch.device("cpu"))
    adaptive = MergePolicy(topology="ring", mean_interval=2, weighting="adaptive")
    assert cross_mergeable(adaptive, setup.model, whole.member(0, run.workers, adaptive, run))
    for other in (MergePolicy(topology="ring", weighting="adaptive", payload="delta", topk_fraction=0.2),
                  MergePolicy(topology="ring", weighting="adaptive", swap_p=0.2)):
        assert not cross_mergeable(other, setup.model, whole.member(run.workers, 2 * run.workers, other, run))
