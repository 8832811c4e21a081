"""Optimisers batched over workers (engine.optim) against torch.optim, and the optimiser state's
merge rule (policy.optimizer_state) in the in-process backend's pairs, all-reduce and swaps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_study
from evomerge import reference, simulate
from evomerge.backends.inprocess import InProcess
from evomerge.engine.plan import PairSet
from evomerge.models import module_row
from evomerge.policy import MergePolicy


@pytest.mark.parametrize("optimizer, weight_decay", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.0), ("adamw", 0.05),
                                                     ("sgd", 0.01)])
def test_stacked_optimiser_without_merging_equals_separate_torch_optimisers(mnist, optimizer, weight_decay):
    run = dict(optimizer=optimizer, lr=0.01 if optimizer != "sgd" else 0.1, weight_decay=weight_decay, steps=25)
    if optimizer == "adam":
        run["betas"] = [0.8, 0.99]
    setup = simulate.prepare(tiny_study(**run), data=mnist)
    res = simulate.simulate(setup, MergePolicy(scheme="none"), 5, device="cpu", keep_params=True)
    for w in range(setup.study.run.workers):
        alone = module_row(reference.train_alone(setup, 5, w))
        # the same formulas on a stacked buffer: equal to float tolerance, and the run really moved
        assert torch.allclose(res.params[w], alone, rtol=1e-4, atol=1e-6), (w, (res.params[w] - alone).abs().max())
        assert not torch.allclose(res.params[w], res.params[(w + 1) % 4])


def _backend(mnist, policy, optimizer="adamw", workers=4):
    setup = simulate.prepare(tiny_study(optimizer=optimizer, lr=0.01, workers=workers), data=mnist)
    b = InProcess(setup, policy, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    st = b.state
    st.params.buf.copy_(torch.randn(st.params.buf.shape, generator=g))
    for s in st.optim.stacks():
        s.buf.copy_(torch.rand(s.buf.shape, generator=g))
    if st.optim.steps is not None:
        st.optim.steps.copy_(torch.tensor([3.0, 5.0, 7.0, 9.0][:workers], dtype=torch.float64))
    return b


def _state(b):
    st = b.state
    return [s.rows().clone() for s in st.optim.stacks()], st.optim.steps.clone()


@pytest.mark.parametrize("mode", ["keep", "average", "reset"])
def test_optimizer_state_on_a_complete_average(mnist, mode):
    b = _backend(mnist, MergePolicy(scheme="allreduce", optimizer_state=mode, mixing_weight=1.0))
    before, steps = _state(b)
    b.allreduce(0, 1, 1.0)
    after, steps_after = _state(b)
    assert len(after) == 2  # Adam's two moments
    for x, y in zip(before, after):
        if mode == "keep":
            assert torch.equal(x, y)
        elif mode == "reset":
            assert not y.any()
        else:  # every worker's state is the average of all
            assert torch.allclose(y, x.mean(0, keepdim=True).expand_as(x), atol=1e-6)
            assert torch.equal(y, y[:1].expand_as(y))
    want = {"keep": steps, "reset": torch.zeros(4, dtype=torch.float64), "average": torch.full((4,), 6.0, dtype=torch.float64)}
    assert torch.equal(steps_after, want[mode])


def test_optimizer_state_average_follows_the_parameters_weights(mnist):
    """Examples weighting: the state is averaged with the same weights as the parameters."""
    b = _backend(mnist, MergePolicy(scheme="allreduce", optimizer_state="average", weighting="examples"))
    b.state.examples.copy_(torch.tensor([1.0, 3.0, 0.0, 0.0], dtype=torch.float64))
    before, _ = _state(b)
    b.allreduce(0, 1, 1.0)
    after, _ = _state(b)
    for x, y in zip(before, after):
        assert torch.allclose(y[2], 0.25 * x[0] + 0.75 * x[1], atol=1e-6)


def _pairs(b, a, bb, swap=False, weight=0.5):
    n = len(a)
    return PairSet(1, np.arange(n), np.asarray(a), np.asarray(bb), np.full(n, 0.5), np.full(n, swap), weight)


@pytest.mark.parametrize("mode", ["keep", "average", "reset"])
def test_optimizer_state_on_gossip_pairs(mnist, mode):
    b = _backend(mnist, MergePolicy(optimizer_state=mode, exchange="push_pull", mixing_weight=0.5))
    (m0, v0), steps = _state(b)
    b.pairs(_pairs(b, [0], [1]))
    (m1, v1), steps1 = _state(b)
    # workers 2 and 3 took no part
    assert torch.equal(m1[2:], m0[2:]) and torch.equal(v1[2:], v0[2:]) and torch.equal(steps1[2:], steps[2:])
    if mode == "keep":
        assert torch.equal(m1, m0) and torch.equal(steps1, steps)
    elif mode == "reset":
        assert not m1[:2].any() and not v1[:2].any() and not steps1[:2].any()
    else:  # a = 0.5 push-pull: both end at the mean of the two
        mid = (m0[0] + m0[1]) / 2
        assert torch.allclose(m1[0], mid, atol=1e-6) and torch.allclose(m1[1], mid, atol=1e-6)
        assert steps1[:2].tolist() == [4.0, 4.0]


def test_a_swap_moves_the_optimizer_state(mnist):
    b = _backend(mnist, MergePolicy(topology="complete", swap_p=1.0))
    (m0, v0), steps = _state(b)
    b.pairs(_pairs(b, [0], [2], swap=True))
    (m1, v1), steps1 = _state(b)
    assert torch.equal(m1[0], m0[2]) and torch.equal(m1[2], m0[0]) and torch.equal(v1[0], v0[2])
    assert steps1.tolist() == [7.0, 5.0, 3.0, 9.0]


def test_adam_after_merges_that_left_workers_at_different_steps_runs_on(mnist):
    """Averaged step counts are fractional and differ between workers: the per-worker bias correction."""
    setup = simulate.prepare(tiny_study(optimizer="adam", lr=0.01, steps=30), data=mnist)
    pol = MergePolicy(optimizer_state="reset", mean_interval=3)
    res = simulate.simulate(setup, pol, 0, device="cpu")
    assert res.status == "ok" and res.final.val_accuracy > 0.5


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_workers_at_different_steps_each_get_torchs_bias_correction(kind):
    """Worker 1 has taken 3 steps already, worker 0 none: two more steps of both equal torch's optimiser
    continued from each worker's own state."""
    from types import SimpleNamespace

    from evomerge import models
    from evomerge.engine.optim import Optimizer

    model = models.build("mlp", (6,), 3, hidden=[4])
    g = torch.Generator().manual_seed(0)
    run = SimpleNamespace(optimizer=kind, lr=0.01, weight_decay=0.1, momentum=0.0, betas=(0.9, 0.99), eps=1e-8)
    grads = [torch.randn(2, model.n_params, generator=g) for _ in range(5)]
    start = torch.randn(2, model.n_params, generator=g)
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    refs = []
    for w in range(2):
        t = start[w].clone().requires_grad_(True)
        refs.append((t, cls([t], lr=run.lr, betas=run.betas, eps=run.eps, weight_decay=run.weight_decay, foreach=False)))
    t1, o1 = refs[1]
    for k in range(3):  # worker 1's head start
        t1.grad = grads[k][1].clone()
        o1.step()
    params = model.stack(2)
    params.set_rows(torch.stack([start[0], t1.detach()]))
    grad = params.like()
    opt = Optimizer(run, params)
    st1 = o1.state[t1]
    rows = torch.stack([torch.zeros(model.n_params), st1["exp_avg"]]), torch.stack([torch.zeros(model.n_params), st1["exp_avg_sq"]])
    opt.exp_avg.set_rows(rows[0])
    opt.exp_avg_sq.set_rows(rows[1])
    opt.steps.copy_(torch.tensor([0.0, 3.0], dtype=torch.float64))
    for k in range(3, 5):
        grad.set_rows(grads[k])
        opt.step(params, grad, None)
        for w, (t, o) in enumerate(refs):
            t.grad = grads[k][w].clone()
            o.step()
    for w, (t, _) in enumerate(refs):
        assert torch.allclose(params.row(w), t.detach(), rtol=1e-6, atol=1e-7), (w, (params.row(w) - t.detach()).abs().max())
    assert opt.steps.tolist() == [2.0, 5.0]


def test_averaging_the_optimizer_state_is_charged_on_the_wire(mnist):
    """Adam's two moments travel with the model: three times the bytes of the parameters alone."""
    from evomerge.engine.plan import Bytes

    setup = simulate.prepare(tiny_study(optimizer="adam", lr=0.01, steps=20), data=mnist)
    keep = simulate.simulate(setup, MergePolicy(mean_interval=3), 0, device="cpu")
    avg = simulate.simulate(setup, MergePolicy(mean_interval=3, optimizer_state="average"), 0, device="cpu")
    assert keep.final.merges == avg.final.merges > 0
    assert avg.final.bytes == 3 * keep.final.bytes
    n = setup.model.n_params
    assert Bytes(MergePolicy(scheme="allreduce", optimizer_state="average"), n, None, 1).allreduce(4) == 4 * 4 * n * 4
