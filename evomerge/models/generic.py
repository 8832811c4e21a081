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

**Execution** (``[model] execution``): the parameters always live in the stacked buffers; the forward and
backward run either as one vmap over the stack (``stacked``) or as a loop over the W workers (``loop``): W copies
of the module whose parameters are *views* of their rows of the stack and whose ``.grad`` are views of the
gradient stack, so that the backward lands in the stack and the update and the merges stay batched. (A
``functional_call`` per worker, which swaps every tensor in and out of the module at each call, was the first
version: against a loop of W modules it measured 1.15x (W = 8) and 1.06x (W = 64) for a BatchNorm CNN, and these
copies 0.93x and 0.96x; benchmarks/bench_generic.py, two runs on a quiet machine.) ``auto`` takes the loop where vmap cannot batch the
model (recurrent layers, custom autograd functions, data-dependent control flow) or where the model has random
layers, and otherwise times a few steps of each at the study's W and batch size and keeps the faster
(:meth:`GenericModel.check`).

**Random layers** (dropout and the like) draw per-worker randomness from keys the engine derives from
(run seed, worker, local step) (:func:`evomerge.engine.schedule.layer_keys`). Under the loop, worker w's masks
are torch's generator seeded with its own key: a function of (seed, worker, step, call), the same whatever W,
population batch or rank runs the worker. Under a forced ``stacked``, vmap's ``randomness="different"`` draws
every worker's masks from one generator seeded with the first row's key: reproducible for a given seed, W and
batching, but not the same masks as the loop's.

The hand-written :class:`models.MLP` and :class:`models.CNN` are fast paths of the same
interface (:class:`models.StackedModel`).
"""

from __future__ import annotations

import copy
import inspect
import os
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from ..errors import ConfigError, unknown
from . import StackedModel, relu_mlp_grads, relu_mlp_sgd_, state_buffer_slots, state_buffers
from ..userref import one_line, raised, resolve

FIELD = "study.model.factory"
EXECUTION = "study.model.execution"
EXECUTIONS = ("auto", "stacked", "loop")
#: layers that draw random numbers in train mode (a module with a positive ``dropout`` rate counts too:
#: nn.GRU / nn.LSTM between layers, nn.MultiheadAttention)
RANDOM_LAYERS = (nn.modules.dropout._DropoutNd, nn.RReLU)


def has_random_layers(module: nn.Module) -> bool:
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.p > 0:
                return True
        elif isinstance(m, RANDOM_LAYERS):
            return True
        rate = getattr(m, "dropout", 0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


#: layers without parameters that act on each number alone: any shape of leading dimensions goes through them
_ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity)


def sequential_plan(module: nn.Module) -> list[tuple] | None:
    """For an ``nn.Sequential`` of ``nn.Flatten`` (from dimension 1, before the first linear), ``nn.Linear`` and
    elementwise activations, and nothing else (no buffers, no random layers), its layers as a plan the stacked strategy runs in batched matrix
    products (:meth:`GenericModel._sequential`) instead of ``vmap`` over ``functional_call``, whose per-op overhead
    made such a model 2.3-5x slower than the hand-written MLP. None for any other module."""
    if type(module) is not nn.Sequential or any(True for _ in module.buffers()):
        return None
    plan, k = [], 0
    for child in module:
        if type(child) is nn.Flatten and child.start_dim == 1 and child.end_dim == -1 and not k:
            plan.append(("flatten",))  # before the first linear: after it the activations are feature-major
        elif type(child) is nn.Linear:
            plan.append(("linear", k, child.bias is not None))
            k += 2 if child.bias is not None else 1
        elif type(child) in _ELEMENTWISE:
            plan.append(("act", child))
        else:
            return None
    if k != sum(1 for _ in module.parameters()):  # a linear used twice: one set of parameters, two places in the plan
        return None
    return plan


def relu_mlp_plan(plan: list[tuple] | None, input_shape) -> bool:
    """Whether a :func:`sequential_plan` is the named ``mlp``'s network: flattened inputs (a flatten first, or inputs
    of one dimension), linears with biases, ``nn.ReLU`` between them and nothing after the last, so that its steps can
    take the hand-written backward (:func:`evomerge.models.relu_mlp_forward_backward`) instead of autograd's."""
    if plan is None:
        return False
    ops = plan[1:] if plan and plan[0][0] == "flatten" else plan
    if (len(ops) == len(plan) and len(input_shape) != 1) or not ops or len(ops) % 2 == 0:
        return False
    return all(op[0] == "linear" and op[2] if i % 2 == 0 else op[0] == "act" and type(op[1]) is nn.ReLU
               for i, op in enumerate(ops))


@contextmanager
def _tracking_layers(module: nn.Module):
    """Yield a list naming the innermost submodule whose forward was entered and not left: the layer an
    exception came from."""
    stack: list[str] = []
    failed: list[str] = []
    handles = []
    for name, m in module.named_modules():
        if not name:
            continue

        def pre(_m, _a, name=name):
            stack.append(name)

        def post(_m, _a, _o, name=name):
            if stack and stack[-1] == name:
                stack.pop()

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield failed
    except BaseException:
        if stack:
            failed.append(stack[-1])
        raise
    finally:
        for h in handles:
            h.remove()


class GenericModel(StackedModel):
    """A stacked model over the ``nn.Module`` that ``builder()`` returns."""

    name = "module"

    def __init__(self, builder: Callable[[], nn.Module], input_shape, n_classes: int, *, ref: str | None = None,
                 options: dict | None = None, base_dir: str | None = None, execution: str = "auto"):
        if execution not in EXECUTIONS:
            raise ConfigError(EXECUTION, unknown(execution, EXECUTIONS))
        self.builder, self.ref, self.options, self.base_dir = builder, ref, dict(options or {}), base_dir
        self.template = self._build()
        params = list(self.template.named_parameters())
        lazy = [name for name, t in params if nn.parameter.is_lazy(t)]
        if lazy:  # (a RuntimeError from deep inside: "Can't access the shape of an uninitialized parameter")
            raise ConfigError(FIELD, f"{self._what()}: parameter {lazy[0]!r} is not initialised yet (a lazy layer, "
                                     "whose shape its first forward sets); allowed: layers of set sizes, or a factory "
                                     "that calls the module once on an example batch before it returns it")
        buffers = state_buffers(self.template)  # persistent ones: a causal mask stays the module's own
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
        self.execution_asked = execution
        #: the strategy the steps run with: ``stacked`` or ``loop`` (``auto`` is resolved by :meth:`check`)
        self.execution = "loop" if execution == "loop" else "stacked"
        self.execution_reason = "forced" if execution != "auto" else "not checked yet"
        self._chosen: dict[tuple, tuple[str, str]] = {}  # auto's choice per (W, batch, device)
        self.timings: dict[str, float] = {}  # auto's measured seconds per step of each strategy
        self.random = has_random_layers(self.template)
        self.plan = sequential_plan(self.template)  # a plain MLP's stacked step in batched matmuls (None: vmap)
        # a ReLU MLP of the named mlp's shape: its training steps run the hand-written backward (models.relu_mlp_*)
        self.relu_mlp = relu_mlp_plan(self.plan, self.input_shape)
        self._reps: list = []  # the loop's copies of the module (models.generic._replicas)
        self._pool = None  # (pid, threads, executor): the loop's worker threads on the CPU (models.generic._threads)
        self._device = torch.device("cpu")  # where the template and the copies live (their own buffers: a mask)
        self._probe = None  # auto's timed choice: a few examples to time it again on another device
        # parameters the user froze (requires_grad=False): no gradient under either strategy
        self.frozen = [i for i, (_, t) in enumerate(params) if not t.requires_grad]
        self.counters = frozenset(len(params) + i for i, (_, t) in enumerate(buffers) if not t.is_floating_point())
        self.names = [n for n, _ in layout]
        self.buffer_names = [n for n, _ in buffers]

    @classmethod
    def from_ref(cls, ref: str, options: dict | None, base_dir: str | None, input_shape, n_classes: int,
                 execution: str = "auto", task=None) -> "GenericModel":
        """The model a study's ``[model] factory`` / ``options`` name (imported from ``base_dir``, then sys.path)."""
        fn = resolve(ref, FIELD, base_dir, "mymodels:small_resnet")
        options = dict(options or {})
        try:
            sig = inspect.signature(fn)
        except (ValueError, TypeError):  # no signature to check (a builtin): the call will tell
            sig = None
        if sig is not None:
            try:
                sig.bind(**options)
            except TypeError as e:
                ps = sig.parameters.values()
                named = [p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
                unknown = sorted(set(options) - set(named)) if not any(p.kind == p.VAR_KEYWORD for p in ps) else []
                if unknown:
                    raise ConfigError("study.model.options", f"{ref} does not take {', '.join(map(repr, unknown))}; "
                                                             f"allowed: {', '.join(named) or 'no options'}") from None
                raise ConfigError("study.model.options", f"{ref}({', '.join(f'{k}=...' for k in options)}): {e}") \
                    from None
        model = cls(partial(fn, **options), input_shape, n_classes, ref=ref, options=options,
                    base_dir=None if base_dir is None else str(base_dir), execution=execution)
        if task is not None:
            model.task = task
        return model

    def __reduce__(self):
        # worker processes build it again from the reference (the module itself need not pickle), with the
        # strategy this process chose (so every rank runs the same one)
        if self.ref is not None:
            return (_rebuild, (self.ref, self.options, self.base_dir, self.input_shape, self.n_classes,
                               self.execution_asked, self.execution, self.task, self.random))
        return (_rebuild_builder, (self.builder, self.input_shape, self.n_classes, self.execution_asked,
                                   self.execution, self.task, self.random))

    def _what(self) -> str:
        return self.ref or getattr(self.builder, "__name__", "the factory")

    def _build(self) -> nn.Module:
        try:
            m = self.builder()
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming the field
            raise ConfigError(FIELD, f"{self._what()} raised {raised(e, self.base_dir)}") from None
        if not isinstance(m, nn.Module):
            raise ConfigError(FIELD, f"{self._what()} returned {type(m).__name__}; expected a torch.nn.Module")
        return m

    # -- parameters -----------------------------------------------------------------------------
    def row_of(self, module: nn.Module) -> torch.Tensor:
        """A module's parameters then buffers, as one flat float32 row."""
        ts = [t for _, t in module.named_parameters()] + [t for _, t in state_buffers(module)]
        return torch.cat([t.detach().float().reshape(-1) for t in ts])

    def init(self, generator: torch.Generator) -> torch.Tensor:
        """The module's own initialisation (its factory called afresh), with torch's generator seeded
        from ``generator`` and restored afterwards."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.row_of(self._build())

    # -- compute --------------------------------------------------------------------------------
    def _place(self, device: torch.device) -> None:
        """The template and the loop's copies on the run's device: their non-persistent buffers (a causal mask)
        are the module's own, not rows of the stack, and must be where the stack is."""
        if self._device != device:
            self.template.to(device)
            self._reps = []
            self._device = device
            probe = self._probe
            if probe is not None and device.type != probe[0].device.type:
                # auto was timed on the data's device (the CPU) at setup: time it again where the run is
                x, y, workers, batch = probe
                key = (workers, batch, device.type)
                if key not in self._chosen:
                    self._chosen[key] = self._time(x.to(device), y.to(device), workers, batch)
                self.execution, self.execution_reason = self._chosen[key]

    @staticmethod
    def _seed(device: torch.device, key: int) -> None:
        """Seed the generator random layers on ``device`` draw from, and only that one (``torch.manual_seed``
        would seed every CUDA device, outside the forked state)."""
        if device.type == "cuda":
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()] \
                .manual_seed(key)
        else:
            torch.default_generator.manual_seed(key)

    def _seeded(self, train: bool, keys, device):
        """torch's generator forked for a training forward of a model with random layers (the caller's and
        the process's generator are left as they were); None where no random numbers are drawn."""
        if not (train and self.random):
            return None
        devices = [device] if device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    def _call(self, params: list[torch.Tensor], x: torch.Tensor, train: bool, x_dim: int | None,
              keys=None, execution: str | None = None) -> torch.Tensor:
        execution = execution or self.execution
        self._place(params[0].device)
        self.template.train(train)
        fork = self._seeded(train, keys, params[0].device)
        with fork if fork is not None else nullcontext():
            if execution == "loop":
                return self._loop([p.detach() for p in params], x, x_dim, keys if fork is not None else None, train)
            if fork is not None:
                self._seed(params[0].device, int(keys[0]) if keys is not None else 0)
            return self._vmapped(params, x, x_dim, "different" if fork is not None else "error")

    def _vmapped(self, params, x, x_dim, randomness: str) -> torch.Tensor:
        if self.plan is not None:
            return self._sequential(params, x, x_dim)
        k = self.n_trained_blocks
        p = dict(zip(self.names[:k], params[:k]))
        b = dict(zip(self.names[k:], params[k:]))

        def one(p, b, x):
            return functional_call(self.template, (p, b), (x,))

        with warnings.catch_warnings(), _attention_under_vmap(x.device):
            # torch's note that an op has no batching rule: auto times it anyway
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
            return vmap(one, in_dims=(0, 0, x_dim), randomness=randomness)(p, b, x)

    def _sequential(self, params, x, x_dim) -> torch.Tensor:
        """The stacked forward of a :func:`sequential_plan` model: each ``nn.Linear`` one batched matrix product over
        the W rows (``x`` per row ``[W, B, ...]``, or shared ``[B, ...]`` with ``x_dim`` None: broadcast, not copied);
        autograd takes the gradient, as it does through vmap."""
        h, shared, major = x, x_dim is None, False  # major: h is feature-major [W, features, N] (N: the leading dims)
        lead = None
        for op in self.plan:
            if op[0] == "flatten":
                h = h.flatten(1 if shared else 2)
            elif op[0] == "act":
                h = op[1](h)
            else:
                w = params[op[1]]
                if not major:  # into feature-major, as the hand-written MLP keeps it: W @ h^T, measured faster
                    lead = h.shape[:-1] if shared else h.shape[1:-1]
                    flat = h.reshape(-1, h.shape[-1]) if shared else h.reshape(h.shape[0], -1, h.shape[-1])
                    h = flat.t() if shared else flat.transpose(1, 2)
                    major = True
                if shared:  # [W, out, in] x [in, N]: broadcast over the rows
                    out = torch.matmul(w, h)
                    if op[2]:
                        out = out + params[op[1] + 1].unsqueeze(2)
                    shared = False
                elif op[2]:
                    out = torch.baddbmm(params[op[1] + 1].unsqueeze(2), w, h)
                else:
                    out = torch.bmm(w, h)
                h = out
        if major:  # back to [W, *leading dims, features]
            h = h.transpose(1, 2).reshape(h.shape[0], *lead, h.shape[1])
        return h

    def _replicas(self, W: int) -> list[tuple[nn.Module, list[nn.Parameter], list[tuple[nn.Module, str]]]]:
        """W copies of the module (made once), each with its parameters in layout order and the slots of its state
        buffers: the loop binds them to views of the stacked rows at every call."""
        while len(self._reps) < W:
            m = copy.deepcopy(self.template)
            self._reps.append((m, list(m.parameters()), [(sub, name) for _, sub, name in state_buffer_slots(m)]))
        return self._reps[:W]

    def _threads(self, W: int, device: torch.device, keyed: bool) -> tuple[ThreadPoolExecutor | None, int]:
        """The loop's rows split over threads on the CPU, each thread with one intra-op thread: small layers
        (a convolution of a few channels, a minibatch of 32) keep two cores busier as two workers at once than as
        one worker on two threads (``benchmarks/RESULTS.md``). As many threads as torch has (``EVOMERGE_THREADS``),
        at most W; none on a GPU, with one torch thread, or where random layers draw from torch's one generator
        (``keyed``: each worker's masks from its own key, in order). Each worker's arithmetic is then one
        thread's, whatever the number of threads: a run's numbers do not depend on it."""
        threads = torch.get_num_threads()
        n = min(threads, W)
        if device.type != "cpu" or keyed or n < 2:
            return None, 1
        got = self._pool
        if got is None or got[0] != os.getpid() or got[1] != n:  # a forked process starts its own threads
            pool = ThreadPoolExecutor(n, thread_name_prefix="evomerge-loop", initializer=_one_intra_op_thread)
            barrier = threading.Barrier(n)  # start all n now, each setting its one thread
            list(pool.map(lambda _: barrier.wait(), range(n)))
            torch.set_num_threads(threads)  # torch keeps the last setting for threads yet to start: this thread's
            if got is not None and got[0] == os.getpid():
                got[2].shutdown(wait=False)
            self._pool = got = (os.getpid(), n, pool)
        return got[2], n

    def _bind(self, params, W: int, train: bool, grads=None) -> list:
        """The W copies with row w of ``params`` (and of ``grads``) bound to copy w (see :meth:`_loop`)."""
        k = self.n_trained_blocks
        reps = self._replicas(W)
        for w, (m, ps, slots) in enumerate(reps):
            if m.training != train:
                m.train(train)
            for i, p in enumerate(ps):
                v = params[i][w]
                if p.data_ptr() != v.data_ptr() or p.shape != v.shape:
                    p.data = v
                if grads is not None and p.requires_grad:
                    g = grads[i][w]
                    if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                        p.grad = g
                elif p.grad is not None:
                    p.grad = None
            for j, (sub, name) in enumerate(slots):
                sub._buffers[name] = params[k + j][w]
        return reps

    def _in_threads(self, pool: ThreadPoolExecutor, n: int, W: int, run) -> list:
        """``run(rows)`` for n contiguous slices of range(W), one per thread, with this thread's grad mode; their
        results in row order (a worker's error is raised here)."""
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def one(rows):
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return run(rows)

        cuts = [W * i // n for i in range(n + 1)]
        return list(pool.map(one, [range(cuts[i], cuts[i + 1]) for i in range(n)]))

    def _loop(self, params, x, x_dim, keys, train: bool = False, grads=None) -> torch.Tensor:
        """The loop strategy: worker w's forward is the w-th copy of the module, whose parameters are *views* of
        row w of the stacked blocks (``.data`` rebound when the rows move) and whose state buffers are views of
        ``params``' buffer blocks. With ``grads``, each copy's ``.grad`` is a view of row w of the gradient blocks
        (zeroed here), so that the backward accumulates the gradients into the stack in place."""
        W = params[0].shape[0]
        reps = self._bind(params, W, train, grads)
        pool, n = self._threads(W, params[0].device, train and self.random)  # a training forward draws masks
        if pool is not None:
            return torch.cat(self._in_threads(pool, n, W, lambda ws: self._forwards(reps, ws, x, x_dim, None)))
        return self._forwards(reps, range(W), x, x_dim, keys)

    def _forwards(self, reps, ws: range, x, x_dim, keys) -> torch.Tensor:
        """Rows ``ws``' outputs, stacked: each bound copy on its own minibatch (``x_dim`` 0) or the shared ``x``,
        its random layers seeded by its key first (``keys``: in order, on one thread)."""
        outs = []
        for w in ws:
            if keys is not None:
                self._seed(x.device, int(keys[w]))
            outs.append(reps[w][0](x[w] if x_dim == 0 else x))
        return torch.stack(outs)

    def forward(self, params, x, execution: str | None = None):
        """Outputs ``[W, B, ...]`` in eval mode (running statistics read, not updated)."""
        return self._call(params, x, False, 0, execution=execution)

    def loss_and_grad(self, params, x, y, grads, keys=None, execution: str | None = None):
        """Train mode: BatchNorm uses batch statistics and updates each worker's running statistics in
        place (the buffer blocks of ``params``); gradients of the trained parameters into ``grads``.
        ``keys``: one per row, seeding the row's random layers (:func:`evomerge.engine.schedule.layer_keys`)."""
        k = self.n_trained_blocks
        self._place(params[0].device)
        # the buffers are updated on copies, written back after the backward: the stack's blocks share
        # one version counter, and an in-place write into it would void the saved parameters
        buffers = [b.clone() for b in params[k:]]
        if (execution or self.execution) == "loop":
            for g in grads[:k]:
                g.zero_()
            self.template.train(True)
            fork = self._seeded(True, keys, params[0].device)
            rows = [p.detach() for p in params[:k]] + buffers
            reps = self._bind(rows, x.shape[0], True, grads)
            keyed = keys if fork is not None else None

            def step(ws: range) -> torch.Tensor:  # rows ws' forwards, their losses and one backward
                losses, objective = self.task.train_losses(self._forwards(reps, ws, x, 0, keyed), y[ws.start:ws.stop])
                objective.sum().backward()
                return losses.detach()

            # on the threads where there are several; random layers in order, each worker's masks from its key
            pool, n = self._threads(x.shape[0], params[0].device, fork is not None)
            if pool is not None:
                losses = torch.cat(self._in_threads(pool, n, x.shape[0], step))
            else:
                with fork if fork is not None else nullcontext():
                    losses = step(range(x.shape[0]))
        elif self._hand_written(execution):
            losses = relu_mlp_grads(params, x, y, grads)
        else:
            leaves = [p.detach().requires_grad_(True) for p in params[:k]]
            out = self._call(leaves + buffers, x, True, 0, keys, execution)
            losses, objective = self.task.train_losses(out, y)
            for g, gl in zip(grads, torch.autograd.grad(objective.sum(), leaves)):
                g.copy_(gl)
            for i in self.frozen:  # as the loop's copies leave them: the user froze them
                grads[i].zero_()
        for b, new in zip(params[k:], buffers):
            b.copy_(new)
        return losses.detach()

    def sgd_step_(self, params, x, y, lr):
        """Plain SGD for a :func:`sequential_plan` model run ``stacked``: each gradient taken from the leaves straight
        into ``p -= lr g`` (what the batched optimiser does with it), without the gradient stack's copy and pass;
        None for any other model, strategy, or with frozen parameters (the caller then takes :meth:`loss_and_grad`)."""
        if self.plan is None or self.execution != "stacked" or self.frozen:
            return None
        if self._hand_written(None):
            return relu_mlp_sgd_(params, x, y, lr)
        with torch.enable_grad():  # the caller may step under no_grad (the in-place update is)
            leaves = [p.detach().requires_grad_(True) for p in params]
            losses, objective = self.task.train_losses(self._sequential(leaves, x, 0), y)
            grads = torch.autograd.grad(objective.sum(), leaves)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-lr)
        return losses.detach()

    def _hand_written(self, execution: str | None) -> bool:
        """The stacked step of a ReLU MLP (:func:`relu_mlp_plan`) with the mean cross-entropy of one class per input and
        nothing frozen: the named ``mlp``'s hand-written backward (on the CPU a step takes 0.9-1.0x the ``mlp``'s time at
        W = 8 and 64, where autograd's backward of the same matmuls took 1.4-1.5x)."""
        return (self.relu_mlp and self.plan is not None and (execution or self.execution) == "stacked" and not self.frozen
                and self.plain_classes())

    @torch.no_grad()
    def logits(self, params, x, chunk: int = 2048, execution: str | None = None):
        """Outputs ``[W, N, ...]`` on shared inputs ``x`` (not copied per worker)."""
        return torch.cat([self._call(params, xc, False, None, execution=execution) for xc in x.split(chunk)], dim=1)

    def module(self) -> nn.Module:
        return self._build()

    def check(self, x: torch.Tensor, y: torch.Tensor, workers: int = 2, batch: int | None = None) -> None:
        """Refuse, in one line, a model that cannot take the study's inputs ``x`` (a few normalised training
        examples) and labels ``y``, or cannot be trained; and resolve ``execution = "auto"``: the loop where vmap
        cannot batch the model or where it has random layers, else the faster of the two over a few timed steps
        at ``workers`` rows and minibatches of ``batch`` (cached per W, batch and device)."""
        shape = list(x.shape)
        st = self.stack(2, x.device)
        st.set_rows(self.init(torch.Generator().manual_seed(0)).to(x.device).expand(2, -1))
        grads = st.like()
        xs, ys = x.unsqueeze(0).expand(2, *x.shape), y.unsqueeze(0).expand(2, *y.shape)

        def trial(execution: str) -> str | None:
            """None if ``execution`` runs a forward and a training step, else the one-line reason."""
            failed: list[str] = []
            try:
                with _tracking_layers(self.template) as failed:
                    self.logits(st.params, x, execution=execution)
                    self.loss_and_grad(st.params, xs, ys, grads.params, execution=execution)
                return None
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - the user's model: one line naming the field
                return f"layer {failed[0]!r}: {one_line(e)}" if failed else one_line(e)

        # the model must take the inputs and give outputs the loss can take (under the loop: any module can)
        try:
            out = self._call(st.params, x, False, None, execution="loop")
        except Exception as e:  # noqa: BLE001
            kind = _returns(self.template, x)
            if kind is not None:  # (it read "rejects the data's inputs ...: expected Tensor as element 0 ...")
                raise ConfigError(FIELD, f"{self._what()}'s forward returns a {kind}; expected one tensor, the outputs "
                                         "the loss takes (return the logits alone)") from None
            why = one_line(e)
            if x.is_floating_point() and "'indices'" in why:  # an nn.Embedding given float ids (uint8 read as float32)
                why += (" (token ids must be integers: give them as int16, int32 or int64; inputs of uint8 are read "
                        "as float32 images)")
            elif not x.is_floating_point() and x.numel() and "index out of range" in why:  # a vocabulary too small
                why += (f" (this batch holds token ids up to {int(x.max())}: an embedding needs at least "
                        f"{int(x.max()) + 1} rows)")
            raise ConfigError(FIELD, f"{self._what()} rejects the data's inputs of shape {shape}: {why}") from None
        self.task.check_output(out[0], y, self._what())
        asked = self.execution_asked
        stacked = None if asked == "loop" else trial("stacked")
        if stacked is not None and "random" in stacked and not self.random:
            # random numbers drawn where no dropout module shows them (F.dropout, torch.rand in forward): keyed too
            self.random = True
            stacked = trial("stacked")
        if asked == "stacked" and stacked is not None:
            raise ConfigError(EXECUTION, f"'stacked' cannot batch {self._what()} over workers with torch.func.vmap "
                                         f"({stacked}); allowed: auto or loop")
        if asked != "stacked":
            looped = trial("loop")
            if looped is not None:
                raise ConfigError(FIELD, f"{self._what()} cannot be trained: {looped}")
        if asked != "auto":
            self.execution, self.execution_reason = asked, "forced"
            return
        key = (workers, batch, x.device.type)
        if key not in self._chosen:
            if stacked is not None:
                self._chosen[key] = ("loop", "vmap cannot batch it: " + stacked)
            elif self.random:
                self._chosen[key] = ("loop", "random layers: each worker's masks from its own key")
            else:
                self._chosen[key] = self._time(x, y, workers, batch or len(x))
                self._probe = (x, y, workers, batch or len(x))
        self.execution, self.execution_reason = self._chosen[key]

    def _time(self, x, y, workers: int, batch: int) -> tuple[str, str]:
        """Time a training step of each strategy at ``workers`` rows and ``batch`` examples each, interleaved and
        taking turns going first, after a warm-up; the faster by the median of 6, with the figures."""
        reps = -(-batch // len(x))
        xb = x.repeat(reps, *[1] * (x.dim() - 1))[:batch]
        yb = y.repeat(reps, *[1] * (y.dim() - 1))[:batch]
        st = self.stack(workers, x.device)
        st.set_rows(self.init(torch.Generator().manual_seed(0)).to(x.device).expand(workers, -1))
        grads = st.like()
        xs = xb.unsqueeze(0).expand(workers, *xb.shape).contiguous()  # each worker's minibatch its own memory
        ys = yb.unsqueeze(0).expand(workers, *yb.shape).contiguous()
        took: dict[str, list[float]] = {"stacked": [], "loop": []}
        sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
        for rep in range(8):  # the first two of each are a warm-up (the loop's starts its threads)
            for execution in ("stacked", "loop") if rep % 2 else ("loop", "stacked"):  # each goes first in turn
                sync()
                t0 = time.perf_counter()
                self.loss_and_grad(st.params, xs, ys, grads.params, execution=execution)
                sync()
                if rep > 1:
                    took[execution].append(time.perf_counter() - t0)
        best = {k: statistics.median(v) for k, v in took.items()}
        self.timings = dict(best)
        pick = "stacked" if best["stacked"] <= best["loop"] else "loop"
        return pick, (f"timed at W={workers}, batch {batch} on {x.device.type}: stacked {best['stacked'] * 1e3:.1f} ms, "
                      f"loop {best['loop'] * 1e3:.1f} ms per step")


def _one_intra_op_thread() -> None:
    """A loop thread's start: torch's intra-op threads for this thread only (read first, so that torch's lazy
    start of this thread's pool does not later reset it from the process's setting)."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def _attention_under_vmap(device: torch.device):
    """On CUDA, scaled-dot-product attention under vmap takes torch's math kernel: the fused kernels' backward
    refuses vmap's batched strides ("LSE is not correctly aligned", torch 2.11 on an H100), so a transformer could not
    run ``stacked`` there. A context of torch's own (``torch.nn.attention.sdpa_kernel``), left on return; other
    devices and models without attention are untouched."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _returns(module: nn.Module, x: torch.Tensor) -> str | None:
    """The type of what ``module``'s forward returns on ``x`` (in eval mode, without gradients; each module's mode
    is put back) when it is not a tensor (a tuple of outputs and state, a dict); None otherwise, or if it raises."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            out = module(x)
    except Exception:  # noqa: BLE001 - the caller reports the error itself
        return None
    finally:
        for m, training in modes:
            m.training = training
    return None if isinstance(out, torch.Tensor) else type(out).__name__


def _rebuild(ref, options, base_dir, input_shape, n_classes, asked, execution, task, random) -> GenericModel:
    model = GenericModel.from_ref(ref, options, base_dir, input_shape, n_classes, asked, task)
    model.execution, model.random = execution, random
    return model


def _rebuild_builder(builder, input_shape, n_classes, asked, execution, task, random) -> GenericModel:
    model = GenericModel(builder, input_shape, n_classes, execution=asked)
    model.execution, model.task, model.random = execution, task, random
    return model


def build(spec, input_shape, n_classes: int, base_dir: str | Path | None) -> GenericModel:
    """The generic model of a study's ``[model]`` (``spec.factory``, ``spec.options``, ``spec.execution``)."""
    return GenericModel.from_ref(spec.factory, spec.options, None if base_dir is None else str(base_dir),
                                 input_shape, n_classes, getattr(spec, "execution", "auto"))

