"""Plain ``nn.Module`` training on the same samples as a merge run: the references
the in-process backend is checked and benchmarked against."""

from __future__ import annotations

import numpy as np
import torch

from . import models as models_mod
from .engine.setup import Setup, batch_indices, normalise
from .engine.state import initial_row


def optimizer(module, run) -> torch.optim.Optimizer:
    """The study's optimiser (``run.optimizer``) on one plain module, as torch offers it."""
    if run.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay)
    cls = torch.optim.Adam if run.optimizer == "adam" else torch.optim.AdamW
    return cls(module.parameters(), lr=run.lr, betas=tuple(run.betas), eps=run.eps, weight_decay=run.weight_decay,
               foreach=False)


def _module_input(setup: Setup, x):
    return x.unsqueeze(1) if setup.study.model.name == "cnn" else x


def train_central(setup: Setup, seed: int, steps: int | None = None) -> torch.nn.Module:
    """One model trained with the combined batch: at each step the union of every worker's minibatch."""
    run, data = setup.study.run, setup.data
    steps = setup.total_steps if steps is None else steps
    module = models_mod.load_row(setup.model.module(), initial_row(setup.model, seed))
    opt = optimizer(module, run)
    idx = np.concatenate([batch_indices(s, run.batch_size, 0, steps, seed, w) for w, s in enumerate(setup.shards)], axis=1)
    for t in range(steps):
        bi = torch.as_tensor(idx[t])
        x = normalise(data.train_x[bi], data.spec)
        loss = setup.model.task.module_loss(module(_module_input(setup, x)), data.train_y[bi])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return module


def train_alone(setup: Setup, seed: int, worker: int, steps: int | None = None) -> torch.nn.Module:
    """One model trained on one worker's shard with that worker's minibatches and nothing else."""
    run, data = setup.study.run, setup.data
    steps = setup.total_steps if steps is None else steps
    module = models_mod.load_row(setup.model.module(), initial_row(setup.model, seed))
    opt = optimizer(module, run)
    idx = batch_indices(setup.shards[worker], run.batch_size, 0, steps, seed, worker)
    for t in range(steps):
        bi = torch.as_tensor(idx[t])
        loss = setup.model.task.module_loss(module(_module_input(setup, normalise(data.train_x[bi], data.spec))),
                                             data.train_y[bi])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return module


@torch.no_grad()
def val_accuracy(setup: Setup, module: torch.nn.Module) -> float:
    data = setup.data
    x = normalise(data.val_x, data.spec)
    return float((module(_module_input(setup, x)).argmax(1) == data.val_y).float().mean())
