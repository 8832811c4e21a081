"""Models whose W workers train as one batched computation.

Every worker's parameters live in one flat row of a ``[W, P]`` tensor; a model
knows its layout (names and shapes) and reads views of that buffer. Merge maths
therefore works on rows of one tensor, and the forward/backward of all workers
is one batched computation (``bmm`` for linear layers, grouped convolutions for
the CNN).

Each model also builds the equivalent plain ``nn.Module`` (same parameter order
and shapes), which the tests and benchmarks use as the reference.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError


class StackedModel:
    """Base class: a layout of named parameter shapes over a flat ``[W, P]`` buffer."""

    name = "base"

    def __init__(self, layout: list[tuple[str, tuple[int, ...]]], input_shape, n_classes: int):
        self.layout = layout
        self.input_shape = tuple(input_shape)
        self.n_classes = n_classes
        self.offsets = []
        off = 0
        for _, shape in layout:
            size = math.prod(shape)
            self.offsets.append((off, size))
            off += size
        self.n_params = off

    # -- parameters -----------------------------------------------------------
    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views ``[W, *shape]`` (or ``[*shape]`` for a 1-D row) into ``flat``."""
        lead = flat.shape[:-1]
        return [flat[..., o:o + n].view(*lead, *shape) for (o, n), (_, shape) in zip(self.offsets, self.layout)]

    def init(self, generator: torch.Generator) -> torch.Tensor:
        """One worker's initial parameters as a flat row, like ``nn.Linear`` / ``nn.Conv2d``'s defaults
        (uniform in +-1/sqrt(fan_in)), drawn from ``generator``."""
        row = torch.empty(self.n_params)
        for v, (name, shape) in zip(self.views(row), self.layout):
            fan_in = self._fan_in(name, shape)
            bound = 1.0 / math.sqrt(fan_in)
            v.uniform_(-bound, bound, generator=generator)
        return row

    def _fan_in(self, name: str, shape: tuple[int, ...]) -> int:
        """Weights are ``[out, *in]``; a bias takes its layer's weight's fan-in."""
        if name.endswith(".bias"):
            shape = dict(self.layout)[name.removesuffix(".bias") + ".weight"]
        return math.prod(shape[1:])

    # -- compute --------------------------------------------------------------
    def forward(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits ``[W, B, C]`` for inputs ``x`` ``[W, B, *input_shape]`` (float, normalised)."""
        raise NotImplementedError

    def loss_and_grad(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy per worker ``[W]``; writes d(loss_w)/d(flat_w) into ``grad`` ``[W, P]``.

        The default uses autograd; models may override it with hand-written gradients.
        """
        leaf = flat.detach().requires_grad_(True)
        logits = self.forward(self.views(leaf), x)
        losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        (g,) = torch.autograd.grad(losses.sum(), leaf)
        grad.copy_(g)
        return losses.detach()

    @torch.no_grad()
    def logits(self, flat: torch.Tensor, x: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
        """Logits ``[W, N, C]`` of every worker on shared inputs ``x`` ``[N, *input_shape]``."""
        views = self.views(flat)
        w = flat.shape[0]
        outs = [self.forward(views, xc.unsqueeze(0).expand(w, *xc.shape)) for xc in x.split(chunk)]
        return torch.cat(outs, dim=1)

    def module(self) -> nn.Module:
        """The equivalent single-worker ``nn.Module`` (parameters in the same order)."""
        raise NotImplementedError


def load_row(module: nn.Module, row: torch.Tensor) -> nn.Module:
    """Copy one flat parameter row into ``module`` (same parameter order)."""
    with torch.no_grad():
        off = 0
        for p in module.parameters():
            n = p.numel()
            p.copy_(row[off:off + n].view_as(p))
            off += n
    return module


def module_row(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class MLP(StackedModel):
    """Fully connected ReLU network with hand-written batched gradients."""

    name = "mlp"

    def __init__(self, input_shape, n_classes: int, hidden: list[int] | tuple[int, ...] = (128,)):
        if not isinstance(hidden, (list, tuple)) or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
            raise ConfigError("study.model.hidden", f"{hidden!r} must be a list of positive integers, e.g. [128]")
        self.hidden = list(hidden)
        self.sizes = [math.prod(input_shape), *self.hidden, n_classes]
        layout = []
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layout += [(f"fc{i}.weight", (b, a)), (f"fc{i}.bias", (b,))]
        super().__init__(layout, input_shape, n_classes)

    def forward(self, params, x):
        h = x.flatten(2)
        n = len(params) // 2
        for i in range(n):
            w, b = params[2 * i], params[2 * i + 1]
            h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            if i < n - 1:
                h = h.relu()
        return h

    def loss_and_grad(self, flat, x, y, grad):
        params, grads = self.views(flat), self.views(grad)
        n = len(params) // 2
        acts = [x.flatten(2)]
        h = acts[0]
        for i in range(n):
            h = torch.baddbmm(params[2 * i + 1].unsqueeze(1), h, params[2 * i].transpose(1, 2))
            if i < n - 1:
                h = h.relu_()
                acts.append(h)
        batch = y.shape[1]
        logp = torch.log_softmax(h, dim=2)
        losses = -logp.gather(2, y.unsqueeze(2)).squeeze(2).mean(1)
        d = logp.exp_()
        d.scatter_add_(2, y.unsqueeze(2), torch.full_like(d[..., :1], -1.0))
        d.mul_(1.0 / batch)  # dL/dlogits for the per-worker mean loss
        for i in reversed(range(n)):
            a = acts[i]
            grads[2 * i].copy_(torch.bmm(d.transpose(1, 2), a))
            grads[2 * i + 1].copy_(d.sum(1))
            if i > 0:
                d = torch.bmm(d, params[2 * i])
                d.mul_(a > 0)
        return losses

    def module(self):
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(self.sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)


class CNN(StackedModel):
    """Two 5x5 conv + ReLU + 2x2 max-pool blocks and a linear classifier.
    Workers are batched as groups of grouped convolutions; gradients by autograd."""

    name = "cnn"

    def __init__(self, input_shape, n_classes: int, channels: list[int] | tuple[int, ...] = (8, 16)):
        if (not isinstance(channels, (list, tuple)) or len(channels) != 2
                or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in channels)):
            raise ConfigError("study.model.channels", f"{channels!r} must be two positive integers, e.g. [8, 16]")
        if len(input_shape) == 2:
            input_shape = (1, *input_shape)
        cin, hgt, wid = input_shape
        c1, c2 = channels
        self.channels = list(channels)
        self.flat_features = c2 * (hgt // 4) * (wid // 4)
        layout = [
            ("conv0.weight", (c1, cin, 5, 5)), ("conv0.bias", (c1,)),
            ("conv1.weight", (c2, c1, 5, 5)), ("conv1.bias", (c2,)),
            ("fc.weight", (n_classes, self.flat_features)), ("fc.bias", (n_classes,)),
        ]
        super().__init__(layout, input_shape, n_classes)

    def forward(self, params, x):
        w_, b_ = x.shape[0], x.shape[1]
        h = x.reshape(w_, b_, *self.input_shape).transpose(0, 1).reshape(b_, w_ * self.input_shape[0], *self.input_shape[1:])
        for i in range(2):
            wt, bs = params[2 * i], params[2 * i + 1]
            h = F.conv2d(h, wt.reshape(-1, *wt.shape[2:]), bs.reshape(-1), padding=2, groups=w_)
            h = F.max_pool2d(h.relu(), 2)
        h = h.reshape(b_, w_, -1).transpose(0, 1)
        return torch.baddbmm(params[5].unsqueeze(1), h, params[4].transpose(1, 2))

    def module(self):
        c1, c2 = self.channels
        return nn.Sequential(
            nn.Conv2d(self.input_shape[0], c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(self.flat_features, self.n_classes),
        )


MODELS: dict[str, Callable[..., StackedModel]] = {"mlp": MLP, "cnn": CNN}


def build(name: str, input_shape, n_classes: int, **options: Any) -> StackedModel:
    if name not in MODELS:
        raise ConfigError("study.model.name", f"unknown {name!r}; allowed: {', '.join(MODELS)}")
    try:
        return MODELS[name](input_shape, n_classes, **options)
    except TypeError as e:
        raise ConfigError("study.model", f"bad options for {name!r}: {e}") from None
