"""Payload "gradient" (issue 24 part 6): every local step's gradient all-reduced before every worker's update, plain
or compressed with error feedback (top-k, scaled sign: EF-signSGD); the synchronous rival a merge policy must beat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import tiny_study
from evomerge import simulate
from evomerge.engine import kernel, ops, plan
from evomerge.engine.setup import batch_indices, normalise
from evomerge.engine.state import initial_row
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy as P
from evomerge.study import EnvSpec

GRADIENT = P(scheme="allreduce", mean_interval=1, payload="gradient")


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=3, rounds=2, steps=12, momentum=0.9), data=mnist)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_uncompressed_gradient_allreduce_is_data_parallel_training(mnist, optimizer):
    """By hand: each worker's gradient on its own minibatch, their mean, torch.optim.SGD (momentum 0.9) or Adam on
    one model. Every worker's row is that model at the end. Averaging the models every step instead is the same for
    SGD with momentum (linear in the gradients) but not for Adam (each worker's moments of its own gradients)."""
    run = dict(momentum=0.9) if optimizer == "sgd" else dict(optimizer="adam", lr=0.01)
    setup = simulate.prepare(tiny_study(workers=3, rounds=2, steps=12, **run), data=mnist)
    res = simulate.simulate(setup, GRADIENT, 5, device="cpu", keep_params=True)
    model, run = setup.model, setup.study.run
    row = initial_row(model, 5).clone()
    flat = torch.nn.Parameter(row.clone())
    opt = (torch.optim.SGD([flat], lr=run.lr, momentum=run.momentum) if optimizer == "sgd" else
           torch.optim.Adam([flat], lr=run.lr, betas=run.betas))
    for k in range(setup.total_steps):
        grads = []
        for w in range(run.workers):
            params, grad = model.stack(1, torch.device("cpu")), model.stack(1, torch.device("cpu"))
            params.set_rows(flat.detach().unsqueeze(0))
            idx = torch.as_tensor(batch_indices(setup.shards[w], run.batch_size, k, 1, 5, w))
            x, y = normalise(setup.data.train_x[idx], setup.data.spec), setup.data.train_y[idx]
            model.loss_and_grad(params.params, x, y, grad.params)
            grads.append(grad.row(0))
        flat.grad = torch.stack(grads).mean(0)
        opt.step()
    assert torch.allclose(res.params, flat.detach().expand_as(res.params), atol=1e-5)
    assert torch.equal(res.params[0], res.params[-1])  # every worker holds the one model
    averaged = simulate.simulate(setup, P(scheme="allreduce", mean_interval=1, mixing_weight=1.0), 5, device="cpu",
                                 keep_params=True)
    assert torch.allclose(averaged.params, res.params, atol=1e-4) == (optimizer == "sgd")


def test_a_compressed_gradient_keeps_what_it_did_not_send():
    """Scaled sign and top-k: each row sends compress(g + e), keeps g + e - sent, and takes the mean of the sent."""
    class Rows:
        def __init__(self, x):
            self.x = x.clone()

        def rows(self):
            return self.x.clone()

        def set_rows(self, r):
            self.x = r.clone()

    g = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.2, 0.4, -0.6, 3.0]])
    e = torch.tensor([[0.5, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    for fraction, bits in ((1.0, 1), (0.5, 0)):
        grad, residual = Rows(g), Rows(e)
        kernel.gradient_average_(grad, residual, fraction, bits, [None, None])
        v = g + e
        sent = torch.stack([ops.compress(v[w], fraction, bits) for w in range(2)])
        assert torch.equal(residual.x, v - sent) and torch.allclose(grad.x, sent.mean(0).expand(2, -1))
    assert torch.equal(ops.compress(torch.tensor([1.5, -2.0, 0.5, -1.0]), 1.0, 1),
                       torch.tensor([1.25, -1.25, 1.25, -1.25]))  # signs times their mean magnitude


def test_ef_sign_gradients_train_where_they_are_charged_a_bit_a_value(setup):
    """EF-signSGD on MNIST learns (the quadratic case is tests/test_ops.py's), and its all-reduce is charged 1 bit a
    value plus a scale up and the dense average down, as a delta's is."""
    sign = GRADIENT.replace(quantize_bits=1)
    res = simulate.simulate(setup, sign, 0, device="cpu")
    plain = simulate.simulate(setup, GRADIENT, 0, device="cpu")
    n, W = setup.model.n_params, setup.study.run.workers
    cost = plan.Bytes(sign, n, None)
    assert cost.sent == ops.payload_bytes(n, 1.0, 1) < cost.dense // 16
    assert res.final.bytes == setup.total_steps * W * (cost.sent + cost.dense)
    assert plain.final.bytes == setup.total_steps * W * 2 * cost.dense
    assert res.final.val_accuracy > 0.5 and res.final.train_loss < res.history[0].train_loss


def test_on_a_clock_it_is_every_step_s_barrier_and_a_free_one_is_the_lockstep_run(setup):
    env = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.25)))
    for policy in (GRADIENT, GRADIENT.replace(topk_fraction=0.05)):
        lock = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
        waves = simulate.simulate(env, policy, 3, device="cpu", keep_params=True, waves=True)
        assert torch.equal(lock.params, waves.params)
        assert [h.bytes for h in lock.history] == [h.bytes for h in waves.history]
    # links that cost time: the same steps and updates, later; every step's update is in before its round is judged
    latency = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(
        step_time=0.25, latency=0.01)))
    lock = simulate.simulate(setup, GRADIENT, 3, device="cpu", keep_params=True)
    late = simulate.simulate(latency, GRADIENT, 3, device="cpu", keep_params=True)
    assert torch.equal(lock.params, late.params)
    assert [h.val_accuracy for h in lock.history] == [h.val_accuracy for h in late.history]
    assert late.final.sim_time == pytest.approx(setup.total_steps * (0.25 + 2 * 2 * 0.01))
    slow = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(
        step_time=0.25, speeds=(1.0, 1.0, 0.25))))
    res = simulate.simulate(slow, GRADIENT, 3, device="cpu")
    assert res.final.sim_time == pytest.approx(setup.total_steps * 1.0)  # every step waits for the 4x straggler


@pytest.mark.parametrize("fields, name", [(dict(scheme="gossip"), "scheme"), (dict(mean_interval=4.0), "mean_interval"),
                                          (dict(weighting="examples"), "weighting"),
                                          (dict(optimizer_state="average"), "optimizer_state")])
def test_what_a_gradient_allreduce_cannot_be_is_refused_in_one_line(fields, name):
    with pytest.raises(ConfigError, match=rf"^policy\.{name}: .* cannot all-reduce gradients") as e:
        P(**{**GRADIENT.to_dict(), **fields})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^policy\.\w+: ") as e:  # an outer step is refused by its own rule
        P(**{**GRADIENT.to_dict(), "outer_optimizer": "sgd"})
    assert "\n" not in str(e.value)


def test_a_search_that_samples_gradient_off_the_allreduce_gets_weights():
    from evomerge.policy import switch_off_inapplicable

    out = switch_off_inapplicable({"scheme": "gossip", "payload": "gradient", "quantize_bits": 1}, P())
    assert out["payload"] == "weights" and out["quantize_bits"] == 0
    out = switch_off_inapplicable({"scheme": "allreduce", "payload": "gradient", "mean_interval": 7.0,
                                   "quantize_bits": 1}, P())
    assert out["mean_interval"] == 1.0 and out["quantize_bits"] == 1 and out["weighting"] == "uniform"
    P(**{**P().to_dict(), **out})  # a valid policy


def test_the_distributed_backend_and_a_users_loop_refuse_it_in_one_line():
    from evomerge import runtime
    from evomerge.backends import check_policy

    with pytest.raises(ConfigError, match=r"^policy\.payload: 'gradient' is not supported by the distributed backend"):
        check_policy("distributed", GRADIENT)
    with pytest.raises(ConfigError, match=r"^policy\.payload: 'gradient' cannot run in a training loop"):
        runtime.check_policy(GRADIENT, 4)
