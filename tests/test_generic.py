"""The generic stacked model (any nn.Module: evomerge.models.generic) against the hand-written MLP and
against W separate modules, and how merges treat its buffers (policy.buffers)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_study
from evomerge import reference, simulate
from evomerge.backends.inprocess import InProcess
from evomerge.engine.plan import PairSet
from evomerge.errors import ConfigError
from evomerge.models.generic import GenericModel
from evomerge.models import load_row
from evomerge.policy import MergePolicy


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(steps=40), data=mnist)


def _with(setup, model, **run):
    study = dataclasses.replace(setup.study, run=dataclasses.replace(setup.study.run, **run))
    return dataclasses.replace(setup, model=model, study=study)


@pytest.mark.parametrize("policy", [MergePolicy(scheme="none"), MergePolicy(scheme="allreduce", mean_interval=10,
                                                                            mixing_weight=1.0), MergePolicy()],
                         ids=["none", "fedavg", "ring-gossip"])
def test_generic_path_on_the_mlp_equals_the_hand_written_mlp(setup, policy):
    mlp = setup.model

    class SameStart(GenericModel):  # the MLP's nn.Module, started from the hand-written model's rows
        def init(self, generator):
            return mlp.init(generator)

    generic = _with(setup, SameStart(mlp.module, mlp.input_shape, mlp.n_classes))
    assert generic.model.relu_mlp  # a ReLU MLP: its stacked steps take the hand-written backward
    a = simulate.simulate(setup, policy, 2, device="cpu", keep_params=True)
    b = simulate.simulate(generic, policy, 2, device="cpu", keep_params=True)
    assert generic.model.n_params == mlp.n_params and generic.model.n_train == mlp.n_params
    assert torch.equal(a.params, b.params), (a.params - b.params).abs().max()  # the same arithmetic: bit for bit
    assert not torch.equal(a.params[0], setup.model.init(torch.Generator().manual_seed(0)))
    assert abs(a.final.val_accuracy - b.final.val_accuracy) < 0.005
    # with momentum (the gradients written, then the batched optimiser) and against autograd's gradients of the same
    # stacked matmuls and the loop of modules: to float tolerance
    runs = {}
    for name, execution, hand in (("hand", "stacked", True), ("autograd", "stacked", False), ("loop", "loop", False)):
        model = SameStart(mlp.module, mlp.input_shape, mlp.n_classes, execution=execution)
        model.relu_mlp = hand
        runs[name] = simulate.simulate(_with(setup, model, momentum=0.9), policy, 2, device="cpu", keep_params=True)
    for name in ("autograd", "loop"):
        assert torch.allclose(runs["hand"].params, runs[name].params, atol=1e-4), (name, (runs["hand"].params -
                                                                                          runs[name].params).abs().max())
    assert not torch.equal(runs["hand"].params, runs["autograd"].params)  # two ways of taking the gradient


def small_bn():
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 10))


@pytest.fixture(scope="module")
def bn(setup):
    return _with(setup, GenericModel(small_bn, (28, 28), 10), optimizer="adamw", lr=0.01, weight_decay=0.01)


def test_layout_holds_parameters_then_buffers(bn):
    m = bn.model
    names = [n for n, _ in m.layout]
    assert names[-3:] == ["2.running_mean", "2.running_var", "2.num_batches_tracked"]
    assert m.n_trained_blocks == 5 and m.n_train == m.n_params - 9 and m.counters == {7}
    row = m.init(torch.Generator().manual_seed(0))
    assert torch.equal(row[-9:], torch.tensor([0.0] * 4 + [1.0] * 4 + [0.0]))  # BatchNorm's own start
    # the same generator state gives the same start; torch's global generator is left as it was
    state = torch.random.get_rng_state()
    assert torch.equal(row, m.init(torch.Generator().manual_seed(0)))
    assert torch.equal(state, torch.random.get_rng_state())
    again = pickle.loads(pickle.dumps(m))
    assert again.layout == m.layout


def test_batchnorm_model_without_merging_equals_w_modules_with_adamw(bn):
    """Training mode with running statistics updated per worker, AdamW on the stacked rows: the same
    as W separate nn.Modules each with torch.optim.AdamW, on the same batches."""
    res = simulate.simulate(bn, MergePolicy(scheme="none"), 4, device="cpu", keep_params=True)
    for w in range(bn.study.run.workers):
        alone = reference.train_alone(bn, 4, w)
        row = bn.model.row_of(alone)
        # Adam divides by small second moments: float differences of the batched ops grow in 40 steps, to ~1e-4
        # with 2 threads and to 1.5e-3 (parameters) and 8e-3 (a running variance) with 1 thread, whose kernels
        # sum in another order; training moved the parameters by ~0.1-1, and a missing running-statistics
        # update is off by ~0.1
        n = bn.model.n_train
        assert torch.allclose(res.params[w, :n], row[:n], rtol=5e-3, atol=5e-3), (w, (res.params[w] - row).abs().max())
        assert torch.allclose(res.params[w, n:], row[n:], rtol=0, atol=2e-2), (w, (res.params[w] - row).abs().max())
    assert float(res.params[0, -1]) == bn.total_steps  # num_batches_tracked counted every step
    assert not torch.equal(res.params[0, -9:-5], torch.zeros(4))  # running means moved


def _bn_backend(bn, policy):
    b = InProcess(bn, policy, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    b.state.params.buf.copy_(torch.rand(b.state.params.buf.shape, generator=g) + 0.5)
    blk = b.state.params.blocks[7]  # counters
    blk.copy_(torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
    return b


def _buffers(b):
    return [b.state.params.blocks[k].clone() for k in (5, 6, 7)]


def test_averaging_identical_buffers_is_the_identity(bn):
    b = _bn_backend(bn, MergePolicy(scheme="allreduce", mixing_weight=1.0))
    for k in (5, 6):
        b.state.params.blocks[k].copy_(b.state.params.blocks[k][:1].expand_as(b.state.params.blocks[k]))
    before = _buffers(b)
    b.allreduce(0, 1, 1.0)
    after = _buffers(b)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert after[2].flatten().tolist() == [10.0] * 4  # counters summed


@pytest.mark.parametrize("mode", ["average", "local"])
def test_two_workers_buffers_average_to_their_mean(bn, mode):
    b = _bn_backend(bn, MergePolicy(buffers=mode, mixing_weight=0.5))
    before = _buffers(b)
    params_before = b.state.params.blocks[0].clone()
    b.pairs(PairSet(1, np.arange(1), np.array([0]), np.array([1]), np.full(1, 0.5), np.zeros(1, dtype=bool), 0.5))
    after = _buffers(b)
    assert not torch.equal(b.state.params.blocks[0][:2], params_before[:2])  # the parameters merged either way
    if mode == "average":
        for k in (0, 1):
            mean = (before[k][0] + before[k][1]) / 2
            assert torch.allclose(after[k][0], mean) and torch.allclose(after[k][1], mean)
        assert after[2].flatten().tolist() == [3.0, 3.0, 3.0, 4.0]
    else:
        assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_consensus_model_is_evaluated_with_merged_buffers(bn):
    """The consensus model's accuracy is that of the module holding the mean parameters and mean buffers."""
    res = simulate.simulate(bn, MergePolicy(), 1, device="cpu", keep_params=True)
    center = res.params.mean(0)
    module = load_row(bn.model.module(), center).eval()
    assert torch.equal(module[2].running_var, center[-5:-1])  # the module got the merged buffers
    val_x, val_y = bn.data.val_x, bn.data.val_y
    with torch.no_grad():
        acc = float((module(simulate.normalise(val_x, bn.data.spec)).argmax(1) == val_y).float().mean())
    assert res.final.val_accuracy == pytest.approx(acc, abs=1e-3)
    # ...and not with the first worker's buffers
    other = center.clone()
    other[-9:] = res.params[0, -9:] * 0 + torch.tensor([0.0] * 4 + [1.0] * 4 + [0.0])
    with torch.no_grad():
        stale = load_row(bn.model.module(), other).eval()(simulate.normalise(val_x, bn.data.spec)).argmax(1)
    assert float((stale == val_y).float().mean()) != pytest.approx(acc, abs=1e-4)


def test_factory_errors_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"study.model.factory: .* returned int; expected a torch.nn.Module"):
        GenericModel(lambda: 3, (28, 28), 10)
    with pytest.raises(ConfigError, match=r"study.model.factory: .* raised ValueError: no"):
        GenericModel(lambda: (_ for _ in ()).throw(ValueError("no\nsecond line")), (28, 28), 10)
    # a lazy layer (a RuntimeError from deep inside: "Can't access the shape of an uninitialized parameter")
    with pytest.raises(ConfigError, match=r"^study.model.factory: .*: parameter '1.weight' is not initialised yet \(a "
                                          r"lazy layer, whose shape its first forward sets\); allowed: layers of set "
                                          r"sizes, or a factory that calls the module once on an example batch"):
        GenericModel(lambda: nn.Sequential(nn.Flatten(), nn.LazyLinear(10)), (28, 28), 10)

    def called_once():
        m = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))
        m(torch.zeros(1, 28, 28))
        return m

    assert GenericModel(called_once, (28, 28), 10).layout == [("1.weight", (10, 784)), ("1.bias", (10,))]
    m = GenericModel(lambda: nn.Sequential(nn.Flatten(), nn.Linear(10, 10)), (28, 28), 10)
    with pytest.raises(ConfigError, match=r"rejects the data's inputs of shape \[4, 28, 28\]: RuntimeError") as e:
        m.check(torch.zeros(4, 28, 28), torch.zeros(4, dtype=torch.int64))
    assert "\n" not in str(e.value)
    m = GenericModel(lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 3)), (28, 28), 10)
    # the number of classes is the model's output, not the largest label: 3 logits take classes 0..2
    m.check(torch.zeros(4, 28, 28), torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ConfigError, match=r"study.model.factory: .* returns 3 logits but the data hold class 5; "
                                          r"expected at least 6"):
        m.check(torch.zeros(4, 28, 28), torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ConfigError, match=r"returns outputs of shape \[4, 3\] for labels of shape \[4, 2\]"):
        m.check(torch.zeros(4, 28, 28), torch.zeros(4, 2, dtype=torch.int64))


def test_buffers_are_not_counted_as_updates_distances_or_similarity(bn):
    """A frozen model (lr 0) whose running statistics and counters still move: no update, no distance."""
    frozen = _with(bn, bn.model, lr=0.0)
    res = simulate.simulate(frozen, MergePolicy(scheme="none"), 0, device="cpu", keep_params=True)
    f = res.final
    assert f.local_update_norm == 0 and f.update_norm == 0 and f.consensus_distance == 0
    assert f.similarity_mean == 1.0
    assert float(res.params[0, -1]) == frozen.total_steps and not torch.equal(res.params[0, -9:-5], res.params[1, -9:-5])


def plain_sequential():
    """A user's plain MLP: flatten, linears (one without bias) and elementwise activations."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 48), nn.GELU(), nn.Linear(48, 24, bias=False), nn.Tanh(),
                         nn.Linear(24, 10))


def test_a_plain_sequential_runs_stacked_in_batched_matmuls_and_gives_the_same_run(setup):
    """A plain nn.Sequential MLP runs its stacked steps as batched matrix products (models.generic.sequential_plan),
    not vmap over functional_call; the run equals the vmap path and the loop of modules to float tolerance."""
    from evomerge.models.generic import relu_mlp_plan, sequential_plan

    assert [op[0] for op in sequential_plan(plain_sequential())] == ["flatten", "linear", "act", "linear", "act",
                                                                      "linear"]
    # the hand-written ReLU step covers flattened inputs, biased linears and ReLU between them, and nothing else
    relu = [nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(inplace=True), nn.Linear(16, 10)),
            nn.Sequential(nn.Flatten(), nn.Linear(784, 10))]
    near = [plain_sequential(), nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10), nn.ReLU()),
            nn.Sequential(nn.Flatten(), nn.Linear(784, 16, bias=False), nn.ReLU(), nn.Linear(16, 10)),
            nn.Sequential(nn.Linear(28, 10))]  # no flatten on 28 x 28 inputs: a linear over the last dimension
    assert [relu_mlp_plan(sequential_plan(m), (28, 28)) for m in relu + near] == [True, True, False, False, False, False]
    assert relu_mlp_plan(sequential_plan(nn.Sequential(nn.Linear(784, 10))), (784,))
    for other in (nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.Dropout(0.1)),  # random: the loop's keyed masks
                  nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)),  # buffers
                  nn.Sequential(nn.Flatten(start_dim=2), nn.Linear(28, 10)),
                  nn.Sequential(nn.Linear(28, 10), nn.Flatten(), nn.Linear(280, 10)),
                  small_bn()):
        assert sequential_plan(other) is None, other
    shared = nn.Linear(784, 784)  # one layer used twice: its parameters once, in two places
    assert sequential_plan(nn.Sequential(nn.Flatten(), shared, nn.ReLU(), shared, nn.ReLU(), nn.Linear(784, 10))) is None
    runs = {}
    for name, execution, plan in (("matmuls", "stacked", True), ("vmap", "stacked", False), ("loop", "loop", True)):
        model = GenericModel(plain_sequential, (28, 28), 10, execution=execution)
        if not plan:
            model.plan = None
        assert (model.plan is not None) == plan
        runs[name] = simulate.simulate(_with(setup, model), MergePolicy(), 1, device="cpu", keep_params=True)
    for name in ("vmap", "loop"):
        a, b = runs["matmuls"], runs[name]
        assert torch.allclose(a.params, b.params, atol=1e-5), (name, (a.params - b.params).abs().max())
        for ha, hb in zip(a.history, b.history):
            assert ha.val_loss == pytest.approx(hb.val_loss, abs=1e-5) and ha.bytes == hb.bytes
    assert not torch.equal(runs["matmuls"].params[0], runs["matmuls"].params[1])  # the workers trained apart
