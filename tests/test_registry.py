"""Registries: a rule registered from outside the package is accepted by the policy and used by a run."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_study
from evomerge import registry, simulate
from evomerge.engine.weighting import Uniform
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy


class Halved(Uniform):
    """A rule of a user's: move half as far as a plain lerp."""

    def incoming_weights(self, st, move, own, examples, accum, examples_of=None):
        return super().incoming_weights(st, [m / 2 for m in move], own, examples, accum, examples_of)


def test_a_registered_weighting_is_a_valid_policy_value_and_changes_the_run(mnist):
    with pytest.raises(ConfigError, match="policy.weighting: unknown 'halved'; allowed: uniform, examples, adaptive"):
        MergePolicy(weighting="halved")
    registry.WEIGHTINGS.register("halved", Halved)
    try:
        setup = simulate.prepare(tiny_study(), data=mnist)
        halved = simulate.simulate(setup, MergePolicy(weighting="halved", mean_interval=2), 0, device="cpu")
        plain = simulate.simulate(setup, MergePolicy(mean_interval=2), 0, device="cpu")
        assert halved.final.bytes == plain.final.bytes  # the same merges...
        assert halved.final.consensus_distance > plain.final.consensus_distance  # ...moving half as far
        # on a simulated clock the landings ask the same rule (a free clock keeps the lockstep numbers)
        from evomerge.study import EnvSpec

        free = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.1)))
        timed = simulate.simulate(free, MergePolicy(weighting="halved", mean_interval=2), 0, device="cpu")
        assert timed.final.val_accuracy == halved.final.val_accuracy
        assert timed.final.consensus_distance == halved.final.consensus_distance
        # in a population (merges applied together, the CUDA default) the rule is the member's own, still
        from evomerge.backends.population import Member, run_population

        pols = [MergePolicy(weighting="halved", mean_interval=2), MergePolicy(mean_interval=2)]
        members = run_population(setup, [Member(p, 0) for p in pols], "cpu", cross=True)
        assert members[0].final.consensus_distance == halved.final.consensus_distance
        assert members[1].final.consensus_distance == plain.final.consensus_distance
        from evomerge.backends import check_policy

        with pytest.raises(ConfigError, match="policy.weighting: 'halved' is not supported by the distributed backend"):
            check_policy("distributed", MergePolicy(weighting="halved"))
    finally:
        del registry.WEIGHTINGS["halved"]


def test_unknown_names_are_one_line_errors_naming_the_field():
    with pytest.raises(ConfigError, match=r"study.model.name: unknown 'resnet'; allowed: mlp, cnn"):
        registry.MODELS.get_object("resnet")
    assert registry.PAYLOADS.get_object("delta").public and not registry.PAYLOADS.get_object("weights").public


def test_a_backends_refusals_follow_from_what_it_declares(mnist):
    """A backend registered from outside says what it runs; every refusal is generated from that."""
    from evomerge import backends
    from evomerge.backends import Capabilities, run_inputs

    caps = Capabilities(name="mine", rules={"weighting": ("uniform",)}, refuses={"swap_p": "models stay put"},
                        only={"exchange": ("push", "one message per merge")}, buffers=False, timed_payloads=())
    backends.register("mine", "evomerge.simulate:simulate", caps)
    try:
        study = tiny_study()
        with pytest.raises(ConfigError, match=r"^policy.weighting: 'examples' is not supported by the mine backend; "
                                              r"allowed: uniform, or --backend inprocess$"):
            run_inputs(study, MergePolicy(weighting="examples", exchange="push"), backend="mine")
        with pytest.raises(ConfigError, match=r"^policy.exchange: 'push_pull' is not supported by the mine backend "
                                              r"\(one message per merge\); allowed: 'push'"):
            run_inputs(study, MergePolicy(), backend="mine")
        with pytest.raises(ConfigError, match=r"^policy.swap_p: 0.5 is not supported by the mine backend \(models stay"):
            run_inputs(study, MergePolicy(exchange="push", swap_p=0.5), backend="mine")
        with pytest.raises(ConfigError, match=r"^study.search.space.exchange: is not supported by the mine backend"):
            backends.check_space("mine", ["mixing_weight", "exchange"])
        from evomerge.study import EnvSpec

        timed = dataclasses.replace(study, environment=EnvSpec(step_time=0.1))
        with pytest.raises(ConfigError, match=r"^policy.payload: 'weights' is not supported by the mine backend with "
                                              r"an \[environment\] yet"):
            run_inputs(timed, MergePolicy(exchange="push"), backend="mine")
        policy, seed, _ = run_inputs(study, MergePolicy(exchange="push"), backend="mine")  # what it runs, it runs
        assert policy.exchange == "push" and seed == study.run.seeds[0]
        setup = simulate.prepare(study, data=mnist)
        backends.check_model("mine", setup.model)  # the MLP has no buffers
        backends.check_model("inprocess", setup.model)
    finally:
        del backends.BACKENDS["mine"], backends.CAPABILITIES["mine"]
