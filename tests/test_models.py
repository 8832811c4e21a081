import pytest
import torch
import torch.nn.functional as F

from evomerge import models
from evomerge.errors import ConfigError


@pytest.mark.parametrize("name, options", [("mlp", {"hidden": [32]}), ("mlp", {"hidden": [24, 16]}), ("mlp", {"hidden": []}),
                                           ("cnn", {"channels": [4, 8]})])
def test_batched_loss_and_gradients_equal_each_workers_nn_module(name, options):
    m = models.build(name, (28, 28), 10, **options)
    g = torch.Generator().manual_seed(0)
    W, B = 3, 7
    flat = torch.stack([m.init(g) for _ in range(W)])
    x = torch.randn(W, B, 28, 28, generator=g)
    y = torch.randint(0, 10, (W, B), generator=g)
    grad = torch.zeros_like(flat)
    losses = m.loss_and_grad(m.views(flat), x, y, m.views(grad))
    for w in range(W):
        mod = models.load_row(m.module(), flat[w])
        inp = x[w].unsqueeze(1) if name == "cnn" else x[w]
        loss = F.cross_entropy(mod(inp), y[w])
        loss.backward()
        ref = torch.cat([p.grad.reshape(-1) for p in mod.parameters()])
        assert losses.shape == (W, B)
        assert torch.allclose(losses[w].mean(), loss.detach(), atol=1e-6)
        per_example = F.cross_entropy(mod(inp), y[w], reduction="none").detach()
        assert torch.allclose(losses[w], per_example, atol=1e-5)
        assert torch.allclose(grad[w], ref, atol=1e-6, rtol=1e-5)
        assert torch.allclose(models.module_row(mod), flat[w])


def test_hand_written_mlp_gradients_match_autograd_path():
    m = models.build("mlp", (28, 28), 10, hidden=[16, 8])
    g = torch.Generator().manual_seed(1)
    flat = torch.stack([m.init(g) for _ in range(4)])
    x, y = torch.randn(4, 5, 28, 28, generator=g), torch.randint(0, 10, (4, 5), generator=g)
    g1, g2 = torch.zeros_like(flat), torch.zeros_like(flat)
    l1 = m.loss_and_grad(m.views(flat), x, y, m.views(g1))
    l2 = models.StackedModel.loss_and_grad(m, m.views(flat), x, y, m.views(g2))
    assert torch.allclose(l1, l2, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)


def test_fused_sgd_step_equals_gradient_then_update():
    m = models.build("mlp", (28, 28), 10, hidden=[16, 8])
    g = torch.Generator().manual_seed(2)
    rows = torch.stack([m.init(g) for _ in range(3)])
    x, y = torch.randn(3, 5, 28, 28, generator=g), torch.randint(0, 10, (3, 5), generator=g)
    fused = models.Stack.from_rows(m, rows)
    l1 = m.sgd_step_(fused.params, x, y, lr=0.1)
    grad = torch.zeros_like(rows)
    l2 = m.loss_and_grad(m.views(rows), x, y, m.views(grad))
    assert torch.allclose(l1, l2) and torch.allclose(fused.rows(), rows - 0.1 * grad, atol=1e-6)
    assert models.build("cnn", (28, 28), 10).sgd_step_([], x, y, 0.1) is None  # no fused path: caller falls back


def test_stack_rows_round_trip_and_row_ops():
    m = models.build("mlp", (28, 28), 10, hidden=[4])
    rows = torch.randn(3, m.n_params)
    st = models.Stack.from_rows(m, rows)
    assert torch.equal(st.rows(), rows) and torch.equal(st.row(1), rows[1])
    for p, v in zip(st.params, m.views(rows)):
        assert p.is_contiguous() and torch.equal(p, v)
    assert torch.allclose(st.mean(), rows.mean(0))
    st.set_row(0, torch.zeros(m.n_params))
    assert torch.equal(st.row(0), torch.zeros(m.n_params)) and torch.equal(st.row(1), rows[1])


def test_logits_on_shared_inputs_match_the_module():
    m = models.build("cnn", (28, 28), 10)
    flat = torch.stack([m.init(torch.Generator().manual_seed(s)) for s in range(2)])
    x = torch.randn(5, 28, 28)
    out = m.logits(m.views(flat), x, chunk=2)
    assert out.shape == (2, 5, 10)
    assert torch.allclose(out[1], models.load_row(m.module(), flat[1])(x.unsqueeze(1)), atol=1e-5)


def test_init_is_seeded_and_follows_fan_in():
    m = models.build("mlp", (28, 28), 10, hidden=[64])
    a, b = m.init(torch.Generator().manual_seed(5)), m.init(torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    w0 = m.views(a)[0]
    assert w0.shape == (64, 784) and float(w0.abs().max()) <= 1 / 784 ** 0.5


@pytest.mark.parametrize("name, options, field", [("resnet", {}, "study.model.name"),
                                                  ("mlp", {"hidden": [0]}, "study.model.hidden"),
                                                  ("cnn", {"channels": [4]}, "study.model.channels"),
                                                  ("mlp", {"width": 3}, "study.model.width")])
def test_bad_model_options(name, options, field):
    with pytest.raises(ConfigError) as e:
        models.build(name, (28, 28), 10, **options)
    assert e.value.field == field
    if "width" in options:  # an option the model does not take: what it takes
        assert e.value.message == "unknown option of the 'mlp' model; allowed: hidden, execution"
