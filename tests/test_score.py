"""The running score (``policy.score = "running"``): what the winner-biased lerp compares when there is no
validation slice to test on, as in a user's training loop (``evomerge.Merger``). One rule in the kernel, the
same on every path of the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_study
from evomerge import simulate
from evomerge.engine import kernel
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy
from evomerge.study import EnvSpec

P = MergePolicy
WINNERS = {
    "complete push": P(topology="complete", exchange="push", mean_interval=1.5, winner_bias=0.5, score="running"),
    "ring push-pull adaptive": P(topology="ring", exchange="push_pull", mean_interval=3, winner_bias=0.8,
                                 score="running", weighting="adaptive"),
}


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=4, steps=40), data=mnist)


def test_the_running_score_is_a_bias_corrected_exponential_mean():
    score, weight = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    losses = [torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([4.0, 1.0])]
    for x in losses:
        kernel.score_step_(score, weight, x)
    d = kernel.SCORE_DECAY
    by_hand = sum((1 - d) * d ** (2 - t) * float(x[0]) for t, x in enumerate(losses)) / (1 - d ** 3)
    assert float(score[0]) == pytest.approx(by_hand) and float(score[1]) == pytest.approx(1.0)  # no zero start
    assert kernel.merged_score(2.0, 1.0, 0.25) == 1.75


@pytest.mark.parametrize("name", list(WINNERS))
def test_the_running_score_picks_winners_without_a_forward_and_changes_the_run(setup, name):
    running = WINNERS[name]
    holdout = dataclasses.replace(running, score="holdout")
    a = simulate.simulate(setup, running, 3, device="cpu", keep_params=True)
    b = simulate.simulate(setup, holdout, 3, device="cpu", keep_params=True)
    assert a.status == b.status == "ok"
    assert not torch.equal(a.params, b.params)  # the winners differ somewhere
    symmetric = simulate.simulate(setup, dataclasses.replace(running, winner_bias=0.0), 3, device="cpu", keep_params=True)
    assert not torch.equal(a.params, symmetric.params)  # the score decided something
    assert a.final.val_accuracy > 0.5


@pytest.mark.parametrize("name", list(WINNERS))
def test_a_free_clock_and_a_population_keep_the_running_score_bit_for_bit(setup, name):
    from evomerge.backends.population import Member, run_population

    policy = WINNERS[name]
    lockstep = simulate.simulate(setup, policy, 1, device="cpu", keep_params=True)
    free = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.1)))
    timed = simulate.simulate(free, policy, 1, device="cpu", keep_params=True)
    for cross in (False, True):
        member = run_population(setup, [Member(P(), 1), Member(policy, 1)], device="cpu", keep_params=True,
                                cross=cross)[1]
        assert torch.equal(member.params, lockstep.params)
    assert torch.equal(timed.params, lockstep.params)


def test_score_is_a_schema_5_field_and_the_distributed_backend_says_it_does_not_run_it():
    with pytest.raises(ConfigError, match=r"^policy.score: is a schema 5 field"):
        MergePolicy.from_dict({"schema_version": 4, "score": "running"})
    assert MergePolicy.from_dict({"schema_version": 4, "winner_bias": 0.5}).score == "holdout"  # old files keep their meaning
    with pytest.raises(ConfigError, match=r"^policy.score: unknown 'bogus'; allowed: holdout, running"):
        MergePolicy(score="bogus")
    from evomerge.backends import check_policy

    with pytest.raises(ConfigError, match=r"^policy.score: 'running' is not supported by the distributed backend"):
        check_policy("distributed", WINNERS["complete push"])
