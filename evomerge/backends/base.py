"""The small interface a backend implements: where the workers' rows live and how tensors move.

The engine (:func:`evomerge.engine.run.execute`) owns what a run means: the schedule,
the plan of each step's merges, counters, bytes, the round loop and the judge. A
backend holds the rows of the workers it owns (:attr:`state`), trains them, and applies
the planned merges: :meth:`pairs` for a set of disjoint gossip pairs, :meth:`allreduce`
for a complete average. The hooks with defaults are what a backend may add (peers drawn
during the run, data that travels, regrouping).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from ..engine import run as run_mod
from ..engine.plan import PairSet
from ..engine.state import Workers
from ..policy import MergePolicy
from ..schedule import Schedule, build


class Backend(ABC):
    """One backend's share of a run (all of it in one process, one rank's in ``torch.distributed``)."""

    #: whether this backend (this rank) sees every row at the end of a round, evaluates and decides
    judges: bool = True

    def __init__(self, setup: run_mod.Setup, policy: MergePolicy, seed: int, device: torch.device, own: list[int],
                 public: bool = True):
        run = setup.study.run
        self.setup, self.p, self.seed, self.dev, self.own = setup, policy, seed, device, own
        self.sched: Schedule = build(policy, run.workers, setup.total_steps, seed)
        self.state = Workers(setup.model, run, policy, seed, device,
                             rows=None if len(own) == run.workers else len(own), public=public)
        data = setup.data
        self.train_x, self.train_y = data.train_x.to(device), data.train_y.to(device)

    # -- what every backend does ------------------------------------------------------------------
    def start(self, judge: "run_mod.Judge | None") -> None:
        """Called once before the first step, with the judge where this backend judges."""

    def train(self, start: int, end: int, after_step: Callable[[int], None]) -> torch.Tensor:
        """Local steps ``start+1..end`` of the own workers; ``after_step(step)`` merges. Returns the summed loss."""
        return run_mod.train_steps(self.setup, self.state, self.own, self.seed, start, end, self.train_x, self.train_y,
                                   after_step)

    @abstractmethod
    def pairs(self, ps: PairSet) -> None:
        """Apply a set of gossip events on disjoint pairs (merges and swaps) to the rows this backend holds."""

    @abstractmethod
    def allreduce(self, event: int, step: int, weight: float) -> None:
        """Every worker moves ``weight`` of the way towards the (support-weighted) average of all."""

    def totals(self, loss_sum: float, local: float, merged: float) -> tuple[float, float, float]:
        """The run-wide summed loss and mean update norms from this backend's share."""
        return loss_sum, local, merged

    @abstractmethod
    def gather(self):
        """Every worker's parameters (a :class:`models.Stack`) where this backend judges, else None."""

    def agree(self, go: bool) -> bool:
        """The judge's decision to go on, known everywhere."""
        return go

    # -- a timed run ([environment]): one side of a merge at a time ---------------------------------
    def snapshot(self, event: int, w: int, side: int):
        """What worker ``w`` sends in ``event``, as it is now (side 0: the initiator; 1: a push-pull answer)."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot run a study with an [environment]")

    def land(self, event: int, r: int, payload, weight: float, u: float, initiator: int, winner: int | None = None):
        """Worker ``r`` merges a payload from :meth:`snapshot`; returns the winner of the winner test."""
        return self.land_many([(event, r, payload, weight, u, initiator, winner)])[0]

    def land_many(self, items: list[tuple]) -> list:
        """:meth:`land` for several workers at once, each at most once: ``(event, r, payload, weight, u,
        initiator, winner)`` each; returns their winners."""
        raise NotImplementedError(f"the {type(self).__name__} backend cannot run a study with an [environment]")

    # -- hooks: what a backend may add ------------------------------------------------------------
    def peers(self, events: np.ndarray, step: int) -> np.ndarray:
        """The peers of ``events`` (the schedule's, unless drawn during the run)."""
        return self.sched.peer[events]

    def after_events(self, events: np.ndarray, a: np.ndarray, b: np.ndarray) -> int:
        """After a step's gossip events: anything else they do (data that travels); returns its bytes."""
        return 0

    def end_round(self, r: int) -> None:
        """After round ``r`` was judged and reported (self-forming communities regroup here)."""

    def label_skew(self) -> float:
        return self.setup.label_skew

    def moved(self) -> int:
        return 0

    def communities(self) -> list[int] | None:
        return None

    def model_at(self) -> list[int]:
        return list(range(self.setup.study.run.workers))
