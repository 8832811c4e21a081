"""Exact unit tests for each merge operator, and a conformance suite over all of them."""

import math

import pytest
import torch

from evomerge import ops


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


def test_lerp_exact():
    own, inc = torch.tensor([0.0, 2.0]), torch.tensor([4.0, 4.0])
    assert torch.equal(ops.lerp_(own, inc, 0.25), torch.tensor([1.0, 2.5]))


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
    merged = ops.merge_deltas(torch.stack([d, d2]))
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


# -- conformance: every operator --------------------------------------------------
def _pair_merge(op):
    """Each operator as 'receiver merges incoming' with the mixing weights it used."""
    def run(own, inc, gen):
        if op == "lerp":
            return ops.lerp_(own.clone(), inc, 0.3), (0.7, 0.3)
        if op == "random_lerp":
            u = float(torch.rand((), generator=gen))
            m = ops.pair_moves(0.8, u, 0.0, True, None)[1]
            return ops.lerp_(own.clone(), inc, m), (1 - m, m)
        if op == "examples":
            w = ops.incoming_weight(0.5, 3.0, 5.0)
            return ops.lerp_(own.clone(), inc, w), (1 - w, w)
        if op == "adaptive":
            w = ops.incoming_weight(0.5, torch.rand(own.shape, generator=gen), torch.rand(own.shape, generator=gen))
            return ops.lerp_(own.clone(), inc, w), (1 - w, w)
        if op == "weighted_average":
            return ops.weighted_average(torch.stack([own, inc]), torch.tensor([2.0, 6.0]))[0], (0.25, 0.75)
        if op == "delta_topk":
            sent = ops.compress(ops.delta(inc, own), 0.3, 0, gen)
            return ops.lerp_(own.clone(), ops.apply_delta(own, sent), 0.5), (0.5, 0.5)
        if op == "delta_quant":
            sent = ops.compress(ops.delta(inc, own), 1.0, 4, gen)
            return ops.lerp_(own.clone(), ops.apply_delta(own, sent), 0.5), (0.5, 0.5)
        raise AssertionError(op)
    return run


OPERATORS = ["lerp", "random_lerp", "examples", "adaptive", "weighted_average", "delta_topk", "delta_quant"]


@pytest.mark.parametrize("op", OPERATORS)
def test_merging_identical_models_is_the_identity(op):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, generator=gen)
    out, _ = _pair_merge(op)(w, w.clone(), gen)
    assert torch.allclose(out, w, atol=1e-6)


@pytest.mark.parametrize("op", OPERATORS)
def test_mixing_weights_sum_to_one_and_lie_in_unit_interval(op):
    gen = torch.Generator().manual_seed(1)
    _, (a, b) = _pair_merge(op)(torch.randn(20, generator=gen), torch.randn(20, generator=gen), gen)
    total = a + b
    assert torch.allclose(torch.as_tensor(total, dtype=torch.float32), torch.tensor(1.0))
    for c in (a, b):
        c = torch.as_tensor(c)
        assert bool(((c >= 0) & (c <= 1)).all())


@pytest.mark.parametrize("op", OPERATORS)
def test_fixed_seed_fixed_result(op):
    def once():
        gen = torch.Generator().manual_seed(7)
        own, inc = torch.randn(30, generator=gen), torch.randn(30, generator=gen)
        return _pair_merge(op)(own, inc, gen)[0]
    assert torch.equal(once(), once())


@pytest.mark.parametrize("op", OPERATORS)
def test_merged_model_lies_between_the_two(op):
    gen = torch.Generator().manual_seed(2)
    own, inc = torch.zeros(40), torch.ones(40)
    out, _ = _pair_merge(op)(own, inc, gen)
    assert bool(((out >= -1e-6) & (out <= 1 + 1e-6)).all()) and math.isfinite(float(out.sum()))
