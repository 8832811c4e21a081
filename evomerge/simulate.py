"""The in-process backend as one call: all workers' parameters stacked, one batched
forward/backward per local step, merges applied a set of disjoint pairs at a time.

Every round it evaluates, reports to ``callback`` (the search prunes through it), and
stops with status ``diverged`` if the loss goes non-finite. The pieces live in
:mod:`evomerge.engine` (what a run means) and :mod:`evomerge.backends.inprocess` (how
its tensors move); this module keeps the names the Python API has always offered.
"""

from __future__ import annotations

from typing import Callable

import torch

from .engine.plan import TAG_QUANT  # noqa: F401
from .engine.judge import Judge, Similarity, slice_losses, update_norms  # noqa: F401
from .engine.run import execute, train_steps  # noqa: F401
from .engine.setup import (  # noqa: F401
    TAG_BATCHES, TAG_SLICES, RoundMetrics, RunResult, Setup, batch_indices, normalise, prepare, resolve_device,
    round_bounds, total_steps,
)
from .engine.kernel import SUPPORT_LIMIT, rescale_supports  # noqa: F401
from .engine.state import TAG_INIT, Workers, initial_row  # noqa: F401
from .policy import MergePolicy

__all__ = [
    "Judge", "RoundMetrics", "RunResult", "Setup", "Similarity", "Workers", "batch_indices", "execute", "initial_row",
    "normalise", "prepare", "rescale_supports", "resolve_device", "round_bounds", "simulate", "slice_losses",
    "total_steps", "train_steps", "update_norms", "SUPPORT_LIMIT", "TAG_BATCHES", "TAG_INIT", "TAG_QUANT", "TAG_SLICES",
]


def simulate(
    setup: Setup,
    policy: MergePolicy,
    seed: int = 0,
    *,
    callback: Callable[[RoundMetrics], None] | None = None,
    device: str | torch.device | None = None,
    evaluate_test: bool = False,
    keep_params: bool = False,
) -> RunResult:
    """Run one merge run; ``callback`` gets each round's metrics (it may raise to stop the run).

    ``evaluate_test`` also scores the consensus model on the test set (never during a
    search); ``keep_params`` returns the workers' final ``[W, P]`` parameters.
    """
    import time

    from .backends.inprocess import InProcess

    t0 = time.perf_counter()
    backend = InProcess(setup, policy, seed, resolve_device(device))
    return execute(setup, policy, seed, backend, callback=callback, evaluate_test=evaluate_test,
                   keep_params=keep_params, t0=t0)
