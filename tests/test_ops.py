"""Exact unit tests for each merge operator, and a conformance suite over every registered weighting and
payload, run through the merge kernel (evomerge.engine.kernel) that every backend calls."""

import math

import numpy as np
import pytest
import torch

from evomerge.engine import ops
from evomerge import registry
from evomerge.engine import kernel


def test_scheduled_weight_endpoints_and_shapes():
    assert ops.scheduled_weight(0.2, 0.8, "constant", 0.7) == 0.2
    assert ops.scheduled_weight(0.2, 0.8, "linear", 0.5) == pytest.approx(0.5)
    assert ops.scheduled_weight(0.2, 0.8, "cosine", 0.0) == pytest.approx(0.2)
    assert ops.scheduled_weight(0.2, 0.8, "cosine", 1.0) == pytest.approx(0.8)
    assert ops.scheduled_weight(0.2, 0.8, "cosine", 0.5) == pytest.approx(0.5)


def test_pair_moves_winner_bias():
    assert ops.pair_moves(0.5, 0.3, 0.0, False, None) == (0.5, 0.5)
    assert ops.pair_moves(0.5, 0.3, 0.0, True, None) == pytest.approx((0.15, 0.15))
    assert ops.pair_moves(0.5, 1.0, 1.0, False, 0) == (0.0, 0.5)  # initiator wins: not moved at all
    assert ops.pair_moves(0.5, 1.0, 0.4, False, 1) == pytest.approx((0.5, 0.3))


def test_kernel_lerp_and_sum_are_exact_and_record_the_change():
    blk = torch.tensor([[0.0, 2.0], [4.0, 4.0], [1.0, 1.0]])
    chg = torch.zeros_like(blk)
    kernel.lerp_rows_(blk, [0], [blk[1]], torch.tensor([[0.25]]), chg)
    assert torch.equal(blk[0], torch.tensor([1.0, 2.5])) and torch.equal(chg[0], torch.tensor([1.0, 0.5]))
    kernel.sum_rows_(blk, [2], [torch.tensor([2.0**62, 1.0])], chg, limit=kernel.COUNTER_LIMIT)
    assert torch.equal(blk[2], torch.tensor([2.0**62, 2.0]))  # counters stop at the limit
    gathered = torch.tensor([[0.0, 2.0], [4.0, 4.0]])
    kernel.lerp_rows_gathered_(gathered, torch.tensor([0]), gathered[1:], torch.tensor([[0.25]]))
    assert torch.equal(gathered[0], torch.tensor([1.0, 2.5]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_a_users_integer_counter_sums_and_stops_where_its_type_does(dtype):
    """A module's own counter in a user's loop (BatchNorm's int64 num_batches_tracked, or a narrower one): summed
    without a float clamp (int64 raised), and capped at its type's largest value, not wrapped (int32 at 3e9 read
    -2147483648, uint8 at 300 read 44)."""
    top = min(torch.iinfo(dtype).max, int(kernel.COUNTER_LIMIT))
    blk = torch.tensor([[top - 3], [5]], dtype=dtype)
    kernel.sum_rows_(blk, [1], [torch.tensor([9], dtype=dtype)], None, limit=kernel.COUNTER_LIMIT)
    assert blk[1].item() == 14 and blk.dtype == dtype
    kernel.sum_rows_(blk, [0], [blk[0].clone()], None, limit=kernel.COUNTER_LIMIT)
    assert blk[0].item() == top
    kernel.counters_from_sum_(blk, torch.tensor([float(top) * 4]))
    assert blk.flatten().tolist() == [top, top]
    kernel.counters_from_sum_(blk, torch.tensor([20.0]))
    assert blk.flatten().tolist() == [20, 20]


def test_exchange_push_pull_uses_the_peers_state_before_it_moved():
    blk = torch.tensor([[0.0], [8.0], [2.0], [6.0]])
    kernel.exchange_([blk], None, [kernel.LERP], [(0, 1)], [0, 2], [1, 3], None, None, torch.tensor([[0.5], [0.25]]),
                     torch.tensor([[0.5], [0.5]]))
    assert blk.flatten().tolist() == [4.0, 4.0, 4.0, 5.0]  # 3 moved a quarter towards 2's old 2.0; 2 half to 3's old 6


def test_incoming_weight_by_support():
    assert ops.incoming_weight(0.3) == 0.3
    assert ops.incoming_weight(0.5, 10.0, 30.0) == pytest.approx(0.75)  # a = 1/2: weighted average by examples
    assert ops.incoming_weight(0.3, 5.0, 5.0) == pytest.approx(0.3)  # equal supports: plain a
    per = ops.incoming_weight(0.5, torch.tensor([1.0, 0.0, 0.0]), torch.tensor([3.0, 2.0, 0.0]))
    assert torch.allclose(per, torch.tensor([0.75, 1.0, 0.5]))  # zero on both sides falls back to a


def test_weighted_average_sums_counters():
    params = torch.tensor([[0.0, 0.0], [4.0, 8.0]])
    avg, n = ops.weighted_average(params, torch.tensor([1.0, 3.0]))
    assert torch.allclose(avg, torch.tensor([3.0, 6.0])) and float(n) == 4.0
    avg, acc = ops.weighted_average(params, torch.tensor([[1.0, 0.0], [1.0, 2.0]]))  # per coordinate
    assert torch.allclose(avg, torch.tensor([2.0, 8.0])) and torch.equal(acc, torch.tensor([2.0, 2.0]))
    assert torch.allclose(ops.weighted_average(params)[0], torch.tensor([2.0, 4.0]))


def test_delta_semantics():
    base, cur = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 1.0])
    d = ops.delta(cur, base)
    assert torch.equal(d, torch.tensor([0.5, -1.0])) and torch.equal(ops.apply_delta(base, d), cur)
    d2 = ops.delta(torch.tensor([3.0, 2.0]), base)
    merged = ops.weighted_average(torch.stack([d, d2]))[0]  # merging deltas merges the models they describe
    assert torch.allclose(ops.apply_delta(base, merged), (cur + torch.tensor([3.0, 2.0])) / 2)


def test_topk_with_error_feedback_loses_nothing():
    x = torch.tensor([0.1, -5.0, 0.3, 2.0])
    sent, res = ops.topk_with_feedback(x, None, 0.5)
    assert torch.equal(sent, torch.tensor([0.0, -5.0, 0.0, 2.0])) and torch.equal(res, torch.tensor([0.1, 0.0, 0.3, 0.0]))
    x2 = torch.tensor([0.0, 0.0, 0.0, 0.05])
    sent2, res2 = ops.topk_with_feedback(x2, res, 0.25)
    assert torch.equal(sent2, torch.tensor([0.0, 0.0, 0.3, 0.0]))  # the residual is sent later
    assert torch.equal(sent2 + res2, x2 + res)


def test_stochastic_quantisation_levels_and_unbiasedness():
    x = torch.linspace(-1, 1, 101)
    g = torch.Generator().manual_seed(0)
    q = ops.quantize_stochastic(x, 3, g)  # 3 levels of magnitude: 0, 1/3, 2/3, 1
    assert set(torch.round(q.abs() * 3).unique().tolist()) <= {0.0, 1.0, 2.0, 3.0}
    assert torch.all(torch.sign(q) * torch.sign(x) >= 0)
    mean = torch.stack([ops.quantize_stochastic(x, 3, g) for _ in range(4000)]).mean(0)
    assert torch.allclose(mean, x, atol=0.03)
    assert torch.equal(ops.quantize_stochastic(torch.zeros(3), 4), torch.zeros(3))


def test_payload_bytes():
    assert ops.payload_bytes(1000) == 4000
    assert ops.payload_bytes(1000, 0.01) == 10 * 4 + 10 * 4  # values + positions
    assert ops.payload_bytes(1000, 0.5) == 500 * 4 + 125  # a bit mask is cheaper than positions
    assert ops.payload_bytes(1000, 1.0, 8) == 1000 + 4
    assert ops.payload_bytes(1000, 0.1, 4) == 50 + 125 + 4


def test_consensus_distance():
    p = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    assert torch.equal(ops.consensus(p), torch.tensor([1.0, 0.0]))
    assert ops.consensus_distance(p) == pytest.approx(1.0)


# -- conformance: every registered weighting and payload, through the kernel ------------------------------
def _workers(weighting: str, payload: str, seed: int):
    """Two real workers' state (a small MLP) with random parameters, counters and accumulators."""
    from conftest import tiny_study
    from evomerge import models
    from evomerge.engine.state import Workers
    from evomerge.policy import MergePolicy

    extra = {"topk_fraction": 0.3, "quantize_bits": 4} if payload == "delta" else {}
    policy = MergePolicy(weighting=weighting, payload=payload, **extra)
    model = models.build("mlp", (28, 28), 10, hidden=[4])
    st = Workers(model, tiny_study(workers=2).run, policy, seed, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    st.params.set_rows(torch.randn(2, model.n_params, generator=gen))
    st.examples.copy_(torch.rand(2, generator=gen, dtype=torch.float64) * 100)
    if st.accum is not None:
        st.accum.set_rows(torch.rand(2, model.n_params, generator=gen))
    return st, policy, model


def _merge(weighting: str, payload: str, seed: int, same: bool = False):
    """Worker 1 merges worker 0 (move 0.6) as every backend does: the payload's ``outgoing``, the weighting's
    weights, :func:`kernel.exchange_`. Returns (before, incoming, after, weights) of worker 1."""
    st, policy, model = _workers(weighting, payload, seed)
    if same:
        st.params.set_rows(st.params.row(1).unsqueeze(0).expand(2, -1))
        if st.base is not None:
            st.base.set_rows(st.params.rows())
    w = registry.WEIGHTINGS.get_object(weighting)()
    p = registry.PAYLOADS.get_object(payload)()
    before, theirs = st.params.row(1), st.params.row(0)
    sent = p.outgoing(st, policy, seed, np.array([0]), np.array([0]), 0)
    incoming = theirs if sent is None else sent[0]
    weights = w.pair_weights(st, [0.6], np.array([1]), np.array([0]))
    kernel.exchange_(st.params.blocks, st.merge_change.blocks, kernel.block_rules(model, policy.buffers),
                     model.offsets, [0], [1], kernel.columns(sent), None, weights)
    flat = torch.cat([x.expand(1, n).reshape(-1) for x, (_, n) in zip(weights if isinstance(weights, list)
                      else [weights] * len(model.offsets), model.offsets)])
    return before, incoming, st.params.row(1), flat, st.merge_change.row(1)


RULES = [(w, p) for w in list(registry.WEIGHTINGS) for p in list(registry.PAYLOADS)
         if registry.PAYLOADS.get_object(p).models]  # the gradient payload merges no model


@pytest.mark.parametrize("weighting,payload", RULES)
def test_merging_identical_models_is_the_identity(weighting, payload):
    before, _, after, _, change = _merge(weighting, payload, 0, same=True)
    assert torch.allclose(after, before, atol=1e-6) and float(change.abs().max()) < 1e-5


@pytest.mark.parametrize("weighting,payload", RULES)
def test_weights_lie_in_the_unit_interval_and_the_result_between_the_two(weighting, payload):
    before, incoming, after, w, change = _merge(weighting, payload, 1)
    assert bool(((w >= 0) & (w <= 1)).all())
    lo, hi = torch.minimum(before, incoming), torch.maximum(before, incoming)
    assert bool(((after >= lo - 1e-6) & (after <= hi + 1e-6)).all())
    assert torch.allclose(after, before + w * (incoming - before), atol=1e-6)  # the lerp the weights describe
    assert torch.allclose(change, after - before, atol=1e-6)  # what the merge changed is recorded


@pytest.mark.parametrize("weighting,payload", RULES)
def test_fixed_seed_fixed_result(weighting, payload):
    assert torch.equal(_merge(weighting, payload, 7)[2], _merge(weighting, payload, 7)[2])


def test_supports_are_summed_and_rescaled_by_a_power_of_two():
    blk = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    kernel.sum_pairs_([blk], [0], [1], push_pull=True)
    assert blk.tolist() == [[4.0, 7.0], [4.0, 7.0]]
    examples = torch.tensor([2.0**65, 3.0], dtype=torch.float64)
    accum = torch.tensor([[2.0**64, 1.0]])
    kernel.rescale_supports(examples, accum)
    assert examples.tolist() == [2.0, 3.0 / 2**64] and accum.tolist() == [[1.0, 2.0**-64]]  # ratios exact


def test_one_bit_is_the_scaled_sign_charged_one_bit_a_value():
    x = torch.tensor([3.0, -1.0, 0.5, -0.5, 0.0])
    assert torch.equal(ops.compress(x, 1.0, 1), torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0]))  # sign(x) mean|x|
    assert torch.equal(ops.compress(x, 0.4, 1), torch.tensor([2.0, -2.0, 0.0, 0.0, 0.0]))  # of the top 2
    assert ops.payload_bytes(1000, 1.0, 1) == 125 + 4  # 1000 signs and one scale
    assert ops.payload_bytes(1000, 0.1, 1) == 13 + 125 + 4  # 100 signs, a 1000-bit mask, one scale
    parts = ops.encode(x, 0.4, 1)
    assert [p.dtype for p in parts] == [d for _, d in ops.wire_spec(5, 0.4, 1)]


def test_error_feedback_makes_sign_compression_converge_where_plain_sign_stalls():
    """The known result (Karimireddy et al. 2019, EF-signSGD): f(x) = |x - 1|^2 / 2 per coordinate with stochastic
    gradients x - b, b = 4 with probability 1/4 else 0 (mean 1, median 0). The sign follows the median: scaled sign
    alone stalls at 0 (loss 0.5 a coordinate); with error feedback it reaches the mean's minimum."""
    d = 100
    final = {}
    for ef in (False, True):
        gen = torch.Generator().manual_seed(1)
        x, e = torch.zeros(d), torch.zeros(d)
        for t in range(4000):
            b = torch.where(torch.rand(d, generator=gen) < 0.25, 4.0, 0.0)
            v = x - b + (e if ef else 0.0)
            c = ops.compress(v, 1.0, 1)
            if ef:
                e = v - c
            x = x - 0.05 / (1 + t / 200) * c
        final[ef] = float(0.5 * ((x - 1) ** 2).mean())
    assert final[False] > 0.4 and final[True] < 0.01, final
