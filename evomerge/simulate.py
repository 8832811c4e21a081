"""The in-process backend as one call: all workers' parameters stacked, one batched
forward/backward per local step, merges applied a set of disjoint pairs at a time.

Every round it evaluates, reports to ``callback`` (the search prunes through it), and
stops with status ``diverged`` if the loss goes non-finite. The pieces live in
:mod:`evomerge.engine` (what a run means) and :mod:`evomerge.backends.inprocess` (how
its tensors move); this module keeps the names the Python API has always offered.
"""

from __future__ import annotations

from .engine.plan import TAG_QUANT  # noqa: F401
from .engine.judge import Judge, Similarity, slice_losses, update_norms  # noqa: F401
from .engine.run import execute, train_steps  # noqa: F401
from .engine.setup import (  # noqa: F401
    TAG_BATCHES, TAG_SLICES, RoundMetrics, RunResult, Setup, batch_indices, normalise, prepare, resolve_device,
    round_bounds, total_steps,
)
from .engine.kernel import SUPPORT_LIMIT, rescale_supports  # noqa: F401
from .engine.state import TAG_INIT, Workers, initial_row  # noqa: F401
from .backends.inprocess import run as simulate  # noqa: F401  (one run in this process)

__all__ = [
    "Judge", "RoundMetrics", "RunResult", "Setup", "Similarity", "Workers", "batch_indices", "execute", "initial_row",
    "normalise", "prepare", "rescale_supports", "resolve_device", "round_bounds", "simulate", "slice_losses",
    "total_steps", "train_steps", "update_norms", "SUPPORT_LIMIT", "TAG_BATCHES", "TAG_INIT", "TAG_QUANT", "TAG_SLICES",
]
