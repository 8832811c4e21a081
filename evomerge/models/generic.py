"""Any ``torch.nn.Module`` as a stacked model: W workers' parameters and buffers stacked with a
leading worker dimension, one batched forward/backward per step.

The module's parameters, then its buffers (BatchNorm running statistics, counters), are the
model's layout, so a worker's row holds both and everything that moves rows (merges, swaps,
the consensus mean, gathering to rank 0) moves the buffers with the parameters. Only the
parameters are trained (``n_train``); how merges treat the buffers is ``policy.buffers``, and
integer buffers (``num_batches_tracked``) are counters, summed on merge as VW sums counters.

The forward of all workers is ``torch.func.functional_call`` under ``torch.func.vmap``; the
gradient is autograd over the stacked leaves, measured against ``vmap(grad(...))`` on the CPU
(benchmarks/bench_generic.py): as fast for an MLP (1.0-1.2x), faster for a BatchNorm CNN
(1.2-2.6x at W = 8 and 64), and it needs no functional form of the loss.
Training runs the module in train mode (BatchNorm updates each worker's running statistics
in place, in the stack); every other forward (evaluation, the winner test, CKA) in eval mode.

The hand-written :class:`models.MLP` and :class:`models.CNN` are fast paths of the same
interface (:class:`models.StackedModel`).
"""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from ..errors import ConfigError
from . import StackedModel
from ..userref import one_line, resolve

FIELD = "study.model.factory"


class GenericModel(StackedModel):
    """A stacked model over the ``nn.Module`` that ``builder()`` returns."""

    name = "module"

    def __init__(self, builder: Callable[[], nn.Module], input_shape, n_classes: int, *, ref: str | None = None,
                 options: dict | None = None, base_dir: str | None = None):
        self.builder, self.ref, self.options, self.base_dir = builder, ref, dict(options or {}), base_dir
        self.template = self._build()
        params = list(self.template.named_parameters())
        buffers = list(self.template.named_buffers())
        for name, t in params:
            if not t.is_floating_point():
                raise ConfigError(FIELD, f"{self._what()}: parameter {name!r} is {t.dtype}; allowed: floating point")
        for name, t in buffers:
            if t.is_complex() or t.dtype == torch.bool:
                raise ConfigError(FIELD, f"{self._what()}: buffer {name!r} is {t.dtype}; allowed: floating point or "
                                         "integer counters")
        if not params:
            raise ConfigError(FIELD, f"{self._what()}: the module has no parameters to train")
        layout = [(n, tuple(t.shape)) for n, t in params + buffers]
        super().__init__(layout, input_shape, n_classes, n_buffers=len(buffers))
        self.counters = frozenset(len(params) + i for i, (_, t) in enumerate(buffers) if not t.is_floating_point())
        self.names = [n for n, _ in layout]
        self.buffer_names = [n for n, _ in buffers]

    @classmethod
    def from_ref(cls, ref: str, options: dict | None, base_dir: str | None, input_shape, n_classes: int) -> "GenericModel":
        """The model a study's ``[model] factory`` / ``options`` name (imported from ``base_dir``, then sys.path)."""
        fn = resolve(ref, FIELD, base_dir, "mymodels:small_resnet")
        options = dict(options or {})
        try:
            inspect.signature(fn).bind(**options)
        except TypeError as e:
            raise ConfigError("study.model.options", f"{ref} does not take {sorted(options)}: {e}") from None
        except ValueError:  # no signature to check (a builtin): the call will tell
            pass
        return cls(partial(fn, **options), input_shape, n_classes, ref=ref, options=options,
                   base_dir=None if base_dir is None else str(base_dir))

    def __reduce__(self):
        # worker processes build it again from the reference (the module itself need not pickle)
        if self.ref is not None:
            return (GenericModel.from_ref, (self.ref, self.options, self.base_dir, self.input_shape, self.n_classes))
        return (GenericModel, (self.builder, self.input_shape, self.n_classes))

    def _what(self) -> str:
        return self.ref or getattr(self.builder, "__name__", "the factory")

    def _build(self) -> nn.Module:
        try:
            m = self.builder()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming the field
            raise ConfigError(FIELD, f"{self._what()} raised {one_line(e)}") from None
        if not isinstance(m, nn.Module):
            raise ConfigError(FIELD, f"{self._what()} returned {type(m).__name__}; expected a torch.nn.Module")
        return m

    # -- parameters -----------------------------------------------------------------------------
    def row_of(self, module: nn.Module) -> torch.Tensor:
        """A module's parameters then buffers, as one flat float32 row."""
        ts = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
        return torch.cat([t.detach().float().reshape(-1) for t in ts])

    def init(self, generator: torch.Generator) -> torch.Tensor:
        """The module's own initialisation (its factory called afresh), with torch's generator seeded
        from ``generator`` and restored afterwards."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.row_of(self._build())

    # -- compute --------------------------------------------------------------------------------
    def _call(self, params: list[torch.Tensor], x: torch.Tensor, train: bool, x_dim: int | None) -> torch.Tensor:
        k = self.n_trained_blocks
        p = dict(zip(self.names[:k], params[:k]))
        b = dict(zip(self.names[k:], params[k:]))
        self.template.train(train)

        def one(p, b, x):
            return functional_call(self.template, (p, b), (x,))

        return vmap(one, in_dims=(0, 0, x_dim))(p, b, x)

    def forward(self, params, x):
        """Logits ``[W, B, C]`` in eval mode (running statistics read, not updated)."""
        return self._call(params, x, False, 0)

    def loss_and_grad(self, params, x, y, grads):
        """Train mode: BatchNorm uses batch statistics and updates each worker's running statistics in
        place (the buffer blocks of ``params``); gradients of the trained parameters into ``grads``."""
        k = self.n_trained_blocks
        leaves = [p.detach().requires_grad_(True) for p in params[:k]]
        # the buffers are updated on copies, written back after the backward: the stack's blocks share
        # one version counter, and an in-place write into it would void the saved parameters
        buffers = [b.clone() for b in params[k:]]
        logits = self._call(leaves + buffers, x, True, 0)
        losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        for g, gl in zip(grads, torch.autograd.grad(losses.mean(1).sum(), leaves)):
            g.copy_(gl)
        for b, new in zip(params[k:], buffers):
            b.copy_(new)
        return losses.detach()

    @torch.no_grad()
    def logits(self, params, x, chunk: int = 2048):
        """Logits ``[W, N, C]`` on shared inputs ``x`` (not copied per worker)."""
        return torch.cat([self._call(params, xc, False, None) for xc in x.split(chunk)], dim=1)

    def module(self) -> nn.Module:
        return self._build()

    def check(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Refuse, in one line, a model that cannot take the study's inputs ``x`` (a few normalised
        training examples) or cannot be trained batched over workers."""
        shape = list(x.shape)
        st = self.stack(2, x.device)
        st.set_rows(self.init(torch.Generator().manual_seed(0)).to(x.device).expand(2, -1))
        try:
            out = self.logits(st.params, x)
        except Exception as e:  # noqa: BLE001 - the user's model: one line naming the field
            raise ConfigError(FIELD, f"{self._what()} rejects the data's inputs of shape {shape}: {one_line(e)}") from None
        if tuple(out.shape[1:]) != (len(x), self.n_classes):
            raise ConfigError(FIELD, f"{self._what()} returns outputs of shape {list(out.shape[1:])} for inputs of shape "
                                     f"{shape}; expected [{len(x)}, {self.n_classes}] (logits of the data's "
                                     f"{self.n_classes} classes)")
        grads = st.like()
        try:
            self.loss_and_grad(st.params, x.unsqueeze(0).expand(2, *x.shape), y.unsqueeze(0).expand(2, -1), grads.params)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(FIELD, f"{self._what()} cannot be trained batched over workers (torch.func.vmap): "
                                     f"{one_line(e)}") from None


def build(spec, input_shape, n_classes: int, base_dir: str | Path | None) -> GenericModel:
    """The generic model of a study's ``[model]`` (``spec.factory``, ``spec.options``)."""
    return GenericModel.from_ref(spec.factory, spec.options, None if base_dir is None else str(base_dir),
                                 input_shape, n_classes)

