"""The in-process backend's step-batched merges against the event-by-event reference."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from conftest import tiny_study
from evomerge import simulate
from evomerge.policy import MergePolicy
from merge_reference import reference_simulate

P = MergePolicy
# every topology, exchange, weighting, payload, compression, winner bias and schema 2 field
POLICIES = {
    "ring-push-pull": P(),
    "complete-push-adaptive-winner": P(topology="complete", exchange="push", mean_interval=1.5, weighting="adaptive",
                                       winner_bias=0.5),
    "regular-examples-random-linear": P(topology="random_regular", degree=3, mean_interval=1.5, weighting="examples",
                                        lerp="random", mixing_schedule="linear", mixing_weight_final=0.1),
    "communities-winner-cosine": P(topology="communities", n_communities=2, p_intra=0.7, winner_bias=1.0,
                                   mixing_schedule="cosine", mixing_weight=0.9, mixing_weight_final=0.2, mean_interval=2),
    "delta-topk-quantised": P(topology="ring", payload="delta", topk_fraction=0.1, quantize_bits=4, mean_interval=1.5),
    "delta-dense-push-examples": P(topology="complete", exchange="push", payload="delta", weighting="examples",
                                   quantize_bits=8, mean_interval=2),
    "allreduce-adaptive": P(scheme="allreduce", mean_interval=3, weighting="adaptive"),
    "allreduce-delta-examples": P(scheme="allreduce", mean_interval=4, payload="delta", topk_fraction=0.3,
                                  weighting="examples", lerp="random"),
    "allreduce-sign-examples": P(scheme="allreduce", mean_interval=2, payload="delta", quantize_bits=1,
                                 weighting="examples"),
    "none": P(scheme="none"),
    "similarity-bias-sketch": P(topology="complete", similarity="sketch", similarity_bias=0.8, mean_interval=1.5,
                                winner_bias=0.3),
    "regroup-cka": P(topology="communities", n_communities=2, similarity="cka", regroup_every=1, similarity_bias=-0.5,
                     mean_interval=2),
    "communities-converging": P(topology="communities", n_communities=2, p_intra=1.0, p_intra_final=0.0,
                                p_intra_schedule="linear", mean_interval=1.5),
    "regroup-converging-cosine": P(topology="communities", n_communities=2, similarity="sketch", regroup_every=1,
                                   similarity_bias=0.5, p_intra=0.9, p_intra_final=0.1, p_intra_schedule="cosine",
                                   mean_interval=2),
    "data-unseen-by-similarity": P(topology="complete", data_exchange_k=4, data_unseen_first=True,
                                   data_similarity_sign=-0.7, mean_interval=1.5),
    "data-travels": P(topology="complete", data_exchange_k=4, retire_threshold=0.9, reserve_rate=0.3, mean_interval=1.5),
    "swaps-adaptive": P(topology="complete", swap_p=0.5, weighting="adaptive", payload="delta", topk_fraction=0.5,
                        mean_interval=1.5),
    "swaps-conditioned": P(topology="complete", swap_p=0.8, swap_confidence=0.9, swap_recency=20.0, mean_interval=1.5),
    "swaps-conditioned-data-travels": P(topology="complete", swap_p=0.6, swap_confidence=-0.8, data_exchange_k=6,
                                        data_unseen_first=True, mean_interval=1.5),
    "swaps-recency-only": P(topology="ring", swap_p=0.9, swap_recency=5.0, mean_interval=1.2, winner_bias=0.5),
    "stop-tol": P(stop_tol=1e5, stop_patience=2, mean_interval=2),
}


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=6, rounds=4), data=mnist)


@pytest.mark.parametrize("name", list(POLICIES))
def test_step_batched_merges_equal_event_by_event(setup, name):
    policy = POLICIES[name]
    batched = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    ref = reference_simulate(setup, policy, 3, device="cpu", keep_params=True)
    assert batched.status == ref.status and len(batched.history) == len(ref.history)
    for x, y in zip(batched.history, ref.history):
        x, y = ({k: v for k, v in asdict(m).items() if v is not None} for m in (x, y))  # time fields: lockstep has none
        x.pop("wall_time"), y.pop("wall_time")
        # bit for bit on the CPU: every coordinate goes through the same operations in the same order
        assert x == pytest.approx(y, rel=0, abs=0, nan_ok=True), name
    assert torch.equal(batched.params, ref.params)
    assert batched.model_at == ref.model_at and batched.communities == ref.communities
    assert batched.converged_step == ref.converged_step
    if policy.scheme == "gossip" and policy.mean_interval <= 2 and not batched.converged_step:
        assert batched.final.merges > setup.total_steps  # several events per step: sets of pairs were batched
