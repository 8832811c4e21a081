"""The generic stacked model (any nn.Module: evomerge.models.generic) measured side by side, interleaved.

1. The generic path against the hand-written MLP (784-128-10, SGD, batch 32 per worker) at
   W = 8 and W = 64: one local step of all W workers (forward, backward, update), each the
   way a run takes it (the MLP's fused SGD step; the generic model of the same nn.Sequential, which
   takes that hand-written step too: a ReLU MLP, models.generic.relu_mlp_plan), the same network with
   Tanh in place of ReLU (``generic, Tanh``: batched matmuls with autograd over the stacked leaves,
   what a plain nn.Sequential of other activations takes), and the generic ReLU model through
   functional_call under vmap as it ran before (``generic via vmap``).
2. Models a user brings, with AdamW, against a Python loop over W nn.Modules, each with its own
   torch.optim.AdamW, on the same batches: a plain two-conv BatchNorm CNN, the Fashion-MNIST
   example's ResNet (width 8), and two held out from the choice of strategy: a 3-layer CNN with
   BatchNorm and dropout, and a transformer encoder (2 layers, width 64, dropout 0.1) over the
   image's rows as a sequence. evomerge's two strategies are timed (``stacked``: vmap over the
   stack; ``loop``: functional_call per worker on views of the stack, batched update), and
   ``auto`` is the one ``[model] execution = "auto"`` picks (GenericModel.check), whose ratio
   to the loop of modules is the target (<= 1.0).
3. The two ways of taking the generic model's gradient: autograd over stacked leaves (used)
   against vmap(grad(...)).

Each case is timed in rounds that alternate the contenders (interleaved), and the medians
and their ratio are printed. Run:

    .venv/bin/python benchmarks/bench_generic.py [--workers 8 64] [--repeats 5] [--steps 10] [--device cuda]
        [--models mlp modules]

On CUDA every contender's parameters and batches live on the GPU, and each timing ends with a
synchronize.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from evomerge import models
from evomerge.engine.optim import Optimizer
from evomerge.errors import ConfigError
from evomerge.models.generic import GenericModel

ROOT = Path(__file__).resolve().parent.parent


def _resnet():
    spec = importlib.util.spec_from_file_location("fashion_resnet", ROOT / "examples" / "fashion-resnet" / "fashion_resnet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.small_resnet


def tanh_mlp():
    """The MLP 784-128-10 with Tanh: a plain nn.Sequential that the hand-written ReLU step does not cover."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 10))


def bn_cnn():
    return nn.Sequential(nn.Conv2d(1, 8, 5, padding=2, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 5, padding=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


def cnn3():
    """Held out: a 3-layer CNN with BatchNorm and dropout."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout2d(0.1), nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(0.2), nn.Linear(128, 10))


class RowTransformer(nn.Module):
    """Held out: a transformer encoder (2 layers, width 64, dropout 0.1) over an image's 28 rows."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(28, 64)
        self.pos = nn.Parameter(torch.zeros(28, 64))
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.enc(self.proj(x.reshape(x.shape[0], 28, 28)) + self.pos).mean(1))


class Run:
    """What train_steps needs of a study's [run]."""

    def __init__(self, optimizer, lr, weight_decay=0.0):
        self.optimizer, self.lr, self.weight_decay, self.momentum = optimizer, lr, weight_decay, 0.0
        self.betas, self.eps = (0.9, 0.999), 1e-8


class Stacked:
    """W workers of ``model`` as a run steps them."""

    def __init__(self, model, W, run, device="cpu"):
        self.model, self.run = model, run
        self.params = model.stack(W, device)
        self.params.set_rows(model.init(torch.Generator().manual_seed(0)).to(device).unsqueeze(0).expand(W, -1))
        self.grad = self.params.like()
        self.opt = Optimizer(run, self.params)
        self.fused = run.optimizer == "sgd" and not run.weight_decay

    def step(self, x, y):
        if self.fused and self.model.sgd_step_(self.params.params, x, y, self.run.lr) is not None:
            return
        self.model.loss_and_grad(self.params.params, x, y, self.grad.params)
        self.opt.step(self.params, self.grad, None)


def strategy(build, shape, execution: str, data) -> GenericModel:
    """The generic model of ``build`` with its steps run by ``execution`` (auto: resolved as a study's is, by
    GenericModel.check at the benchmark's W and batch size)."""
    g = GenericModel(build, shape, 10, execution=execution)
    x, y = data[0]
    g.check(x[0, :4], y[0, :4], workers=x.shape[0], batch=x.shape[1])
    return g


class Loop:
    """W nn.Modules, each with its own torch.optim optimiser."""

    def __init__(self, build, W, run, device="cpu"):
        self.mods = [build().to(device) for _ in range(W)]
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[run.optimizer]
        kw = dict(lr=run.lr, weight_decay=run.weight_decay)
        self.opts = [cls(m.parameters(), **kw) for m in self.mods]

    def step(self, x, y):
        for m, o, xw, yw in zip(self.mods, self.opts, x, y):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(xw), yw).backward()
            o.step()


class VmapGrad:
    """The alternative gradient: vmap(grad(loss)) over the stacked parameters and buffers."""

    def __init__(self, model: GenericModel, W, device="cpu"):
        self.m = model
        st = model.stack(W, device)
        st.set_rows(model.init(torch.Generator().manual_seed(0)).to(device).unsqueeze(0).expand(W, -1))
        k = model.n_trained_blocks
        self.p = dict(zip(model.names[:k], st.params[:k]))
        self.b = dict(zip(model.names[k:], st.params[k:]))

        def loss(p, b, x, y):
            return F.cross_entropy(functional_call(model.template, (p, b), (x,)), y)

        self.g = vmap(grad(loss))

    def step(self, x, y):
        self.m.template.train(True)
        self.g(self.p, {k: v.clone() for k, v in self.b.items()}, x, y)


def batches(W, B, shape, steps, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(W, B, *shape, generator=g).to(device), torch.randint(0, 10, (W, B), generator=g).to(device))
            for _ in range(steps)]


def timed(contenders: dict, data, repeats: int) -> dict:
    cuda = data[0][0].is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for c in contenders.values():  # warm up
        c.step(*data[0])
    out = {k: [] for k in contenders}
    for _ in range(repeats):
        for name, c in contenders.items():  # interleaved: every round times each contender once
            sync()
            t = time.perf_counter()
            for x, y in data:
                c.step(x, y)
            sync()
            out[name].append((time.perf_counter() - t) / len(data))
    return {k: statistics.median(v) for k, v in out.items()}


def show(title, W, med, base, other):
    parts = "  ".join(f"{k} {1000 * v:8.2f} ms" for k, v in med.items())
    print(f"{title:<34} W={W:<3} {parts}  ratio {other}/{base} = {med[other] / med[base]:.2f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", choices=("mlp", "modules"), default=["mlp", "modules"],
                    help="the MLP against its hand-written twin, and/or the modules against a loop of modules")
    a = ap.parse_args(argv)
    dev = a.device
    where = torch.cuda.get_device_name(0) if torch.device(dev).type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; per local step of all W workers, "
          f"batch {a.batch} each; medians of {a.repeats} interleaved rounds of {a.steps} steps")
    mlp = models.build("mlp", (28, 28), 10, hidden=[128])
    resnet = _resnet()
    for W in a.workers:
        data = batches(W, a.batch, (28, 28), a.steps, device=dev)
        sgd = Run("sgd", 0.05)
        if "mlp" in a.models:
            vmapped = GenericModel(mlp.module, (28, 28), 10)
            vmapped.plan = None  # the plain Sequential's batched matmuls off: vmap over functional_call, as before
            med = timed({"hand-written": Stacked(mlp, W, sgd, dev),
                         "generic": Stacked(GenericModel(mlp.module, (28, 28), 10), W, sgd, dev),
                         "generic, Tanh": Stacked(GenericModel(tanh_mlp, (28, 28), 10), W, sgd, dev),
                         "generic via vmap": Stacked(vmapped, W, sgd, dev)},
                        data, a.repeats)
            show("MLP 784-128-10, SGD", W, med, "hand-written", "generic")
            print(f"{'':<34} W={W:<3} ratio generic, Tanh/hand-written = {med['generic, Tanh'] / med['hand-written']:.2f}",
                  flush=True)
        if "modules" not in a.models:
            continue
        data = batches(W, a.batch, (1, 28, 28), a.steps, device=dev)
        adamw = Run("adamw", 0.003, 0.01)
        for name, build in (("BatchNorm CNN (2 conv), AdamW", bn_cnn), ("ResNet example (w=8), AdamW", resnet),
                            ("held out: CNN3 + BN + dropout", cnn3), ("held out: transformer on rows", RowTransformer)):
            auto = strategy(build, (1, 28, 28), "auto", data)
            contenders = {"loop of modules": Loop(build, W, adamw, dev)}
            for execution in ("stacked", "loop"):
                try:
                    contenders[execution] = Stacked(strategy(build, (1, 28, 28), execution, data), W, adamw, dev)
                except ConfigError as e:  # a forced strategy the model cannot take: said, and timed without it
                    print(f"{name}: {execution} refused: {e}", flush=True)
            med = timed(contenders, data, a.repeats)
            med["auto"] = med[auto.execution]
            show(f"{name} [auto: {auto.execution}]", W, med, "loop of modules", "auto")
        g = GenericModel(bn_cnn, (1, 28, 28), 10)
        med = timed({"autograd": Stacked(g, W, Run("sgd", 0.05), dev), "vmap(grad)": VmapGrad(g, W, dev)}, data, a.repeats)
        show("CNN gradient: vmap(grad) / leaves", W, med, "autograd", "vmap(grad)")


if __name__ == "__main__":
    main()
