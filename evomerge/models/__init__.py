"""Models whose W workers train as one batched computation.

A model knows its layout (parameter names and shapes). The workers' parameters
live in a :class:`Stack`: one 1-D buffer in which each parameter is a contiguous
``[W, *shape]`` block, so batched matrix products read and write whole blocks
(writing into strided per-worker rows was measured 2x slower), elementwise
updates are single ops on the whole buffer, and a worker's parameters can still be
read and written as one flat row ``[P]`` for merging. The forward/backward of all
workers is one batched computation (``bmm`` for linear layers, grouped
convolutions for the CNN).

Each model also builds the equivalent plain ``nn.Module`` (same parameter order
and shapes), which the tests and benchmarks use as the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, did_you_mean


class StackedModel:
    """Base class: a layout of named parameter shapes over a flat ``[W, P]`` buffer."""

    name = "base"

    def __init__(self, layout: list[tuple[str, tuple[int, ...]]], input_shape, n_classes: int, n_buffers: int = 0):
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
        # the last ``n_buffers`` layout entries are buffers (running statistics): merged with the
        # parameters, never trained; the first ``n_trained_blocks`` are trained (``n_train`` numbers)
        self.n_trained_blocks = len(layout) - n_buffers
        self.n_train = sum(n for _, n in self.offsets[:self.n_trained_blocks])
        self.counters: frozenset[int] = frozenset()  # buffer blocks that count (num_batches_tracked): summed on merge
        from ..task import Task

        self.task = Task()  # the study's loss (build_spec sets it)
        self.random = False  # the model draws random numbers in train mode (dropout): see models.generic
        self.execution = "stacked"  # how W workers' steps run (models.generic: stacked or loop)

    # -- parameters -----------------------------------------------------------
    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views ``[W, *shape]`` of row-layout parameters ``[W, P]`` (or ``[*shape]`` of one row ``[P]``)."""
        lead = flat.shape[:-1]
        return [flat[..., o:o + n].view(*lead, *shape) for (o, n), (_, shape) in zip(self.offsets, self.layout)]

    def stack(self, workers: int, device=None) -> "Stack":
        return Stack(self, workers, device)

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
        """Logits ``[W, B, C]`` for inputs ``x`` ``[W, B, *input_shape]`` (float, normalised);
        ``params`` are ``[W, *shape]`` tensors in layout order."""
        raise NotImplementedError

    def loss_and_grad(self, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                      grads: list[torch.Tensor], keys=None) -> torch.Tensor:
        """The task's loss per example ``[W, B]`` (:class:`evomerge.task.Task`); writes the gradient of each
        worker's mean loss into ``grads``. ``keys`` seed random layers (models.generic); named models have none.

        The default uses autograd; models may override it with hand-written gradients.
        """
        leaves = [p.detach().requires_grad_(True) for p in params]
        losses, objective = self.task.train_losses(self.forward(leaves, x), y)
        for g, gl in zip(grads, torch.autograd.grad(objective.sum(), leaves)):
            g.copy_(gl)
        return losses.detach()

    def plain_classes(self) -> bool:
        """The task is cross-entropy on one class per input, none ignored: what hand-written gradients assume."""
        return self.task.classification and not self.task.per_position and not self.task.ignores

    def sgd_step_(self, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor | None:
        """Plain SGD fused into the backward pass, in place; returns the per-example losses, or None when the
        model has no fused path (the caller then uses :meth:`loss_and_grad`)."""
        return None

    @torch.no_grad()
    def logits(self, params: list[torch.Tensor], x: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
        """Logits ``[W, N, C]`` of every worker on shared inputs ``x`` ``[N, *input_shape]``."""
        w = params[0].shape[0]
        outs = [self.forward(params, xc.unsqueeze(0).expand(w, *xc.shape)) for xc in x.split(chunk)]
        return torch.cat(outs, dim=1)

    def module(self) -> nn.Module:
        """The equivalent single-worker ``nn.Module`` (parameters in the same order)."""
        raise NotImplementedError


def float32_bytes(model) -> int:
    """The bytes of one worker's parameters and buffers in float32 (what ``evomerge calibrate`` records of the model
    it timed)."""
    return module_float32_bytes(model.module())


def module_float32_bytes(m: nn.Module, every_buffer: bool = False) -> int:
    """:func:`float32_bytes` of an ``nn.Module`` (a Merger's trace says it of the loop's model): its parameters and
    the buffers that are its state (:func:`state_buffers`; a causal mask is not merged or sent). ``every_buffer``:
    the non-persistent ones too, as exports and cluster files of evomerge before 2026-12-06 counted them."""
    buffers = [b for b in m.buffers()] if every_buffer else [b for _, b in state_buffers(m)]
    return 4 * (sum(p.numel() for p in m.parameters()) + sum(b.numel() for b in buffers))


def state_buffer_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Where the module's state buffers live: (full name, owning submodule, attribute name), in order."""
    return [(f"{prefix}.{name}" if prefix else name, m, name) for prefix, m in module.named_modules()
            for name, b in m._buffers.items() if b is not None and name not in m._non_persistent_buffers_set]


def state_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's buffers that are part of its state (running statistics, counters): the persistent ones.
    A non-persistent buffer (a causal mask, a table of constants) is not trained, merged or sent; it stays
    the module's own."""
    return [(full, m._buffers[name]) for full, m, name in state_buffer_slots(module)]


def load_row(module: nn.Module, row: torch.Tensor) -> nn.Module:
    """Copy one flat parameter row into ``module`` (same parameter order); a longer row also
    fills the module's state buffers, which follow the parameters (:mod:`evomerge.models.generic`)."""
    with torch.no_grad():
        off = 0
        ts = list(module.parameters())
        if row.numel() > sum(p.numel() for p in ts):
            ts += [b for _, b in state_buffers(module)]
        for p in ts:
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

    # Activations are kept feature-major, [W, features, B]: W @ h^T was measured 1.7x faster
    # than h @ W^T with a broadcast bias at W = 64.
    def forward(self, params, x):
        h = x.flatten(2).transpose(1, 2)
        n = len(params) // 2
        for i in range(n):
            h = torch.bmm(params[2 * i], h).add_(params[2 * i + 1].unsqueeze(2))
            if i < n - 1:
                h = h.relu_()
        return h.transpose(1, 2)

    def loss_and_grad(self, params, x, y, grads, keys=None):
        if not self.plain_classes():
            return super().loss_and_grad(params, x, y, grads)
        return relu_mlp_grads(params, x, y, grads)

    def sgd_step_(self, params, x, y, lr):
        if not self.plain_classes():
            return None
        return relu_mlp_sgd_(params, x, y, lr)

    def module(self):
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(self.sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)


def relu_mlp_forward_backward(params, x, y, on_layer):
    """The hand-written forward and backward of a ReLU MLP (linears with biases, ReLU between them) of W stacked
    workers, with the mean cross-entropy of one class per input: ``params`` ``[W, out, in]`` weights and ``[W, out]``
    biases in turn, ``x`` ``[W, B, ...]`` (flattened from dimension 2), ``y`` ``[W, B]``. ``on_layer(i, d, a)``
    receives layer i's output gradient ``d`` ``[W, out, B]`` and input ``a`` ``[W, B, in]``, after the gradient for
    the layer below has been taken from its weight (so ``on_layer`` may update the weight in place). Returns the
    per-example losses ``[W, B]``. The one definition for the named ``mlp`` and for a user's ``nn.Sequential`` of the
    same shape (:mod:`evomerge.models.generic`)."""
    n = len(params) // 2
    acts = [x.flatten(2)]  # inputs of each layer, [W, B, in]
    h = acts[0].transpose(1, 2)
    for i in range(n):
        h = torch.bmm(params[2 * i], h).add_(params[2 * i + 1].unsqueeze(2))
        if i < n - 1:
            h = h.relu_()
            acts.append(h.transpose(1, 2))
    logp = torch.log_softmax(h, dim=1)  # [W, C, B]
    losses = -logp.gather(1, y.unsqueeze(1)).squeeze(1)  # per example, [W, B]
    d = logp.exp_()
    d.scatter_add_(1, y.unsqueeze(1), torch.full_like(d[:, :1], -1.0))
    d.mul_(1.0 / y.shape[1])  # dL/dlogits for the per-worker mean loss
    for i in reversed(range(n)):
        a = acts[i]
        below = torch.bmm(params[2 * i].transpose(1, 2), d).mul_(a.transpose(1, 2) > 0) if i > 0 else None
        on_layer(i, d, a)
        d = below
    return losses


def relu_mlp_grads(params, x, y, grads):
    """:func:`relu_mlp_forward_backward` writing each worker's gradient into ``grads``; the per-example losses."""
    def write(i, d, a):
        torch.bmm(d, a, out=grads[2 * i])
        torch.sum(d, dim=2, out=grads[2 * i + 1])

    return relu_mlp_forward_backward(params, x, y, write)


def relu_mlp_sgd_(params, x, y, lr):
    """:func:`relu_mlp_forward_backward` with plain SGD fused into the backward, in place; the per-example losses."""
    def update(i, d, a):
        params[2 * i].baddbmm_(d, a, alpha=-lr)
        params[2 * i + 1].sub_(d.sum(2), alpha=lr)

    return relu_mlp_forward_backward(params, x, y, update)


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


class Stack:
    """W workers' parameters (or gradients, momenta, accumulators) in block-major layout.

    ``buf`` is 1-D; parameter k occupies a contiguous ``[W, *shape_k]`` block of it.
    ``params`` are those blocks; a worker's parameters as one flat row ``[P]`` (in the
    model's layout order, as ``nn.Module.parameters()`` flattens them) are read with
    :meth:`row` and written with :meth:`set_row`.
    """

    def __init__(self, model: StackedModel, workers: int, device=None, buf: torch.Tensor | None = None):
        self.model, self.W = model, workers
        self.buf = torch.zeros(workers * model.n_params, device=device) if buf is None else buf
        self.params, self.blocks = [], []
        for (o, n), (_, shape) in zip(model.offsets, model.layout):
            block = self.buf[workers * o: workers * (o + n)].view(workers, n)
            self.blocks.append(block)
            self.params.append(block.view(workers, *shape))

    @classmethod
    def from_rows(cls, model: StackedModel, rows: torch.Tensor) -> "Stack":
        st = cls(model, rows.shape[0], rows.device)
        st.set_rows(rows)
        return st

    @classmethod
    def view(cls, whole: "Stack", lo: int, hi: int) -> "Stack":
        """Rows ``lo..hi-1`` of ``whole`` as a stack of their own that shares its memory (a member of a
        population, :mod:`evomerge.backends.population`). Its blocks are views; it has no 1-D ``buf``
        (the rows of one worker range are not contiguous in a block-major buffer)."""
        st = object.__new__(cls)
        st.model, st.W, st.buf = whole.model, hi - lo, None
        st.blocks = [b[lo:hi] for b in whole.blocks]
        st.params = [p[lo:hi] for p in whole.params]
        return st

    @property
    def device(self) -> torch.device:
        return self.blocks[0].device

    def like(self) -> "Stack":
        return Stack(self.model, self.W, self.device)

    def clone(self) -> "Stack":
        if self.buf is None:
            out = self.like()
            for b, ob in zip(self.blocks, out.blocks):
                ob.copy_(b)
            return out
        return Stack(self.model, self.W, buf=self.buf.clone())

    def zero_(self) -> "Stack":
        for b in ([self.buf] if self.buf is not None else self.blocks):
            b.zero_()
        return self

    def mul_(self, factor: float) -> "Stack":
        for b in ([self.buf] if self.buf is not None else self.blocks):
            b.mul_(factor)
        return self

    def total(self) -> float:
        """The sum of every entry (non-finite iff an entry is)."""
        if self.buf is not None:
            return float(self.buf.sum())
        return float(sum(float(b.sum()) for b in self.blocks))

    def rows(self) -> torch.Tensor:
        """All workers as rows ``[W, P]`` (a copy)."""
        return torch.cat(self.blocks, dim=1)

    def set_rows(self, rows: torch.Tensor) -> None:
        for b, (o, n) in zip(self.blocks, self.model.offsets):
            b.copy_(rows[:, o:o + n])

    def row(self, w: int) -> torch.Tensor:
        """Worker ``w``'s parameters as one flat row ``[P]`` (a copy)."""
        return torch.cat([b[w] for b in self.blocks])

    def set_row(self, w: int, row: torch.Tensor) -> None:
        for b, (o, n) in zip(self.blocks, self.model.offsets):
            b[w].copy_(row[o:o + n])

    def swap_rows_(self, a: int, b: int) -> None:
        for blk in self.blocks:
            blk[[a, b]] = blk[[b, a]]

    def row_norms(self, n_blocks: int | None = None) -> torch.Tensor:
        """``[W]``: the L2 norm of each worker's row (of its first ``n_blocks`` blocks: the trained ones)."""
        return torch.stack([blk.pow(2).sum(1) for blk in self.blocks[:n_blocks]]).sum(0).sqrt()

    def mean(self) -> torch.Tensor:
        """The consensus model as a row ``[P]``."""
        return torch.cat([b.mean(0) for b in self.blocks])


from ..registry import MODELS  # noqa: E402  (name -> model class; code outside the package may register more)


def build_spec(spec, input_shape, n_classes: int, base_dir=None, task=None) -> StackedModel:
    """The model of a study's ``[model]``: a user's factory (:mod:`evomerge.models.generic`) or a named model;
    ``task`` the study's loss (:mod:`evomerge.task`; default cross-entropy)."""
    if getattr(spec, "factory", ""):
        from .generic import build as build_generic

        model = build_generic(spec, input_shape, n_classes, base_dir)
    else:
        execution = getattr(spec, "execution", "auto")
        if execution == "loop":
            raise ConfigError("study.model.execution", f"'loop' applies to a [model] factory; the named model "
                                                       f"{spec.name!r} runs its own stacked code; allowed: auto, stacked")
        model = build(spec.name, input_shape, n_classes, **spec.options)
    if task is not None:
        model.task = task
    return model


def build(name: str, input_shape, n_classes: int, **options: Any) -> StackedModel:
    cls = MODELS.get_object(name)
    import inspect

    params = list(inspect.signature(cls).parameters.values())[2:]  # after input_shape and n_classes
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)] + ["execution"]
        for k in options:
            if k not in takes:  # a misspelt option: named, with what the model takes
                raise ConfigError(f"study.model.{k}", f"unknown option of the {name!r} model; allowed: "
                                                      f"{', '.join(takes)}" + did_you_mean(k, takes))
    try:
        return cls(input_shape, n_classes, **options)
    except TypeError as e:
        raise ConfigError("study.model", f"bad options for {name!r}: {e}") from None
