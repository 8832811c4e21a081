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
    # plain all-reduces of weights (uniform, by examples): every member's applied at once with cross=True
    MergePolicy(scheme="allreduce", mean_interval=2, weighting="examples", mixing_weight=0.7, lerp="random"),
    MergePolicy(scheme="allreduce", mean_interval=3, mixing_schedule="linear", mixing_weight_final=0.3),
    MergePolicy(scheme="allreduce", mean_interval=1, mixing_weight=0.4),
    # DiLoCo's outer step (each member's own anchor and momentum) on the average taken with the others'
    MergePolicy(scheme="allreduce", mean_interval=4, mixing_weight=1.0, outer_optimizer="nesterov", outer_lr=0.7,
                outer_momentum=0.9),
    # compressed outer gradients: applied by its own backend
    MergePolicy(scheme="allreduce", mean_interval=3, mixing_weight=1.0, outer_optimizer="sgd", outer_lr=0.8,
                outer_momentum=0.5, payload="delta", topk_fraction=0.3),
]


@pytest.mark.parametrize("cross", [False, True])
def test_each_member_equals_its_run_alone_bit_for_bit(setup, cross):
    pols = MIXED + (CROSS if cross else [])
    members = [Member(p, seed) for p, seed in zip(pols, [0, 1, 0, 2, 3, 4, 0, 1, 0, 5, 2, 0, 1, 3, 0, 2, 1])]
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


def test_plain_allreduces_are_applied_with_the_other_members(setup):
    """With ``cross``, the members whose all-reduces are averages of weights (a mean, or weighted by examples; with
    or without DiLoCo's outer step on it) leave them to the population, which applies every member's at once;
    streamed fragments, compressed deltas, per-coordinate supports and merged optimiser state stay with the member's
    own backend. The arithmetic is held bit for bit above (CROSS has both kinds)."""
    from evomerge.backends.population import cross_allreducible
    from evomerge.engine.state import Workers, initial_row

    run = setup.study.run

    def member(policy):
        whole = Workers.population(setup.model, run, [initial_row(setup.model, 0)], policy.weighting == "adaptive",
                                   torch.device("cpu"))
        return whole.member(0, run.workers, policy, run)

    for plain in (MergePolicy(scheme="allreduce", mean_interval=2), MIXED[2],
                  MergePolicy(scheme="allreduce", weighting="examples", lerp="random"),
                  MergePolicy(scheme="allreduce", mixing_weight=1.0, outer_optimizer="nesterov", outer_momentum=0.9)):
        assert cross_allreducible(plain, setup.model, member(plain))
    for other in (MergePolicy(scheme="allreduce", mixing_weight=1.0, outer_optimizer="sgd", payload="delta"),
                  MergePolicy(scheme="allreduce", mean_interval=8, mixing_weight=1.0, fragments=2),
                  MergePolicy(scheme="allreduce", payload="delta", topk_fraction=0.2),
                  MergePolicy(scheme="allreduce", weighting="adaptive"),
                  MergePolicy(topology="ring", mean_interval=2)):
        assert not cross_allreducible(other, setup.model, member(other))


def test_allreduces_applied_together_with_eight_workers_and_users_rules(mnist):
    """Eight workers (a sum over more than four rows is where a layout's order of additions shows), several members
    weighted by examples, and rules of a user's that weigh gossip by examples but average plainly (and the reverse):
    each member's all-reduce is its rule's, bit for bit as its run alone."""
    from evomerge import registry
    from evomerge.engine.weighting import Examples, Weighting

    class GossipByExamples(Weighting):  # by_examples for its pairs' column, but the all-reduce's plain mean
        by_examples = True

        def column(self, st, move, own, examples, examples_of=None):
            return Examples.column(self, st, move, own, examples, examples_of)

    class ExamplesUnflagged(Examples):
        by_examples = False

    registry.WEIGHTINGS["gossip-by-examples"] = GossipByExamples
    registry.WEIGHTINGS["examples-unflagged"] = ExamplesUnflagged
    try:
        setup = simulate.prepare(tiny_study(rounds=3, workers=8), data=mnist)
        pols = [MergePolicy(scheme="allreduce", mean_interval=2, weighting="examples", mixing_weight=0.6, lerp="random"),
                MergePolicy(scheme="allreduce", mean_interval=1, weighting="examples", mixing_weight=0.8),
                MergePolicy(scheme="allreduce", mean_interval=3, weighting="examples", mixing_schedule="linear",
                            mixing_weight_final=0.2),
                MergePolicy(scheme="allreduce", mean_interval=1, mixing_weight=0.5),
                MergePolicy(scheme="allreduce", mean_interval=2, weighting="gossip-by-examples", mixing_weight=0.7),
                MergePolicy(scheme="allreduce", mean_interval=2, weighting="examples-unflagged", mixing_weight=0.7),
                MergePolicy(topology="ring", mean_interval=2, exchange="push_pull", weighting="examples"),
                MergePolicy(scheme="allreduce", mean_interval=3, weighting="examples", mixing_weight=1.0,
                            outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9),
                MergePolicy(scheme="allreduce", mean_interval=2, mixing_weight=1.0, outer_optimizer="sgd", outer_lr=1.3,
                            outer_momentum=0.5)]
        seeds = [0, 1, 0, 2, 1, 0, 3, 1, 2]
        out = run_population(setup, [Member(p, s) for p, s in zip(pols, seeds)], "cpu", keep_params=True, cross=True)
        for p, s, got in zip(pols, seeds, out):
            _same(got, simulate.simulate(setup, p, s, device="cpu", keep_params=True))
    finally:
        del registry.WEIGHTINGS["gossip-by-examples"], registry.WEIGHTINGS["examples-unflagged"]


@pytest.mark.parametrize("workers", [1, 4])
def test_the_consensus_models_loss_and_one_worker_runs_are_their_runs_alones(mnist, workers):
    """Each member's consensus model is evaluated in a forward of its own, as its run alone evaluates it (on the CPU
    a matrix product of one row runs multithreaded and rounds otherwise than rows one thread each: the loss differed
    in the last bits in some rounds), and members of one worker each run one at a time, for the same reason."""
    study = tiny_study(rounds=3, workers=workers)
    study = dataclasses.replace(study, model=dataclasses.replace(study.model, options={"hidden": [64]}))  # 50176 weights
    setup = simulate.prepare(study, data=mnist)
    pols = [MergePolicy(scheme="allreduce", mean_interval=2, weighting="examples", mixing_weight=0.6),
            MergePolicy(scheme="allreduce", mean_interval=3, mixing_weight=0.5),
            MergePolicy(topology="ring", mean_interval=2, exchange="push_pull"),
            MergePolicy(topology="ring", mean_interval=5)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as a user's run has them (a test process has one): where one row rounds otherwise
    try:
        out = run_population(setup, [Member(p, s) for s, p in enumerate(pols)], "cpu", keep_params=True)
        for s, (p, got) in enumerate(zip(pols, out)):
            _same(got, simulate.simulate(setup, p, s, device="cpu", keep_params=True))
    finally:
        torch.set_num_threads(threads)
