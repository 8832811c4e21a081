"""Each rank's progress, told through torch.distributed's key-value store, so that a rank waiting for a slow one can
tell it from a hung one.

Gossip and asynchronous DiLoCo let a slow rank fall behind: at the end of the run (``Merger.finish``) or at a
checkpoint (``state_dict``, ``close``) the others wait for it, and a wait bounded by one ``timeout`` from its start
ended healthy runs whose slow rank was more than ``timeout`` behind (``rank 1 did not answer``). Here every rank adds
its step count to the store at most every :data:`BEAT` (a quarter of the timeout, at most 5 s), and a rank that
waits for others keeps waiting as long as each one it waits for has moved within the last ``timeout``: a hung rank
is still named a ``timeout`` after its last step. The ranks also meet here (:meth:`Progress.arrive`): each says its
step once it is at the end (``finish``, ``close``), in place of a collective bounded by the process group's timeout.

The store is the process group's (``dist.distributed_c10d._get_default_store()``: torchrun's, or the one
``init_process_group`` made); its keys are under ``evomerge/<run>/``, where ``<run>`` is a number rank 0 drew from the
store for this Merger (every Merger of a process, and a resumed one, has its own). Without a store the Merger waits
as before (one ``timeout``).
"""

from __future__ import annotations

import time
from typing import Iterable

RUNS_KEY = "evomerge/runs"  # the store's counter of Mergers (each takes the next number for its keys)


def default_store():
    """The process group's key-value store, or None where there is none to reach."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without it: the Merger waits as before
        return None


def next_run(store) -> int:
    """A number for a new Merger's keys (rank 0 draws it; 0: no store)."""
    if store is None:
        return 0
    try:
        return int(store.add(RUNS_KEY, 1))
    except Exception:  # noqa: BLE001 - the store cannot be reached: no progress is told
        return 0


class Progress:
    """This rank's view of every rank's step count in the store. ``rank``: this rank's place among ``W``;
    ``timeout``: how long a rank may go without a step before a rank waiting for it names it."""

    def __init__(self, store, run: int, rank: int, W: int, timeout: float):
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"evomerge/{run}/", store)
        self.rank, self.W, self.timeout = rank, W, timeout
        self.beat_every = min(max(timeout / 4, 0.01), 5.0)
        self.poll_every = min(max(timeout / 8, 0.01), 1.0)
        self._told, self._t_told = 0, -float("inf")
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its step count, when it was first seen)
        self._t_polled: dict[int, float] = {}
        self._meets = 0  # meetings held (every rank holds them at the same points)

    def beat(self, step: int) -> None:
        """This rank is at ``step``: told to the store, at most every :attr:`beat_every` seconds. A store that cannot
        be reached is left alone here (the ranks waiting for this one find out)."""
        now = time.perf_counter()
        if now - self._t_told < self.beat_every or step == self._told:
            return
        try:
            self.store.add(f"step/{self.rank}", step - self._told)
        except Exception:  # noqa: BLE001
            return
        self._told, self._t_told = step, now

    def _step_of(self, r: int, now: float) -> None:
        if now - self._t_polled.get(r, -float("inf")) < self.poll_every:
            return
        self._t_polled[r] = now
        n = int(self.store.add(f"step/{r}", 0))
        if r not in self._seen or self._seen[r][0] != n:
            self._seen[r] = (n, now)

    def moving(self, ranks: Iterable[int]) -> bool:
        """Whether every rank of ``ranks`` (at least one) has told a new step within the last ``timeout`` seconds, as
        far as this rank has looked (the first look counts as a move). Raises RuntimeError if the store is gone."""
        ranks = list(ranks)
        self.watch(ranks)
        now = time.perf_counter()
        return bool(ranks) and all(now - self._seen[r][1] <= self.timeout for r in ranks)

    def watch(self, ranks: Iterable[int]) -> None:
        """Look at ``ranks``' step counts (at most every :attr:`poll_every` seconds each), so that a later
        :meth:`moving` knows when each last moved."""
        now = time.perf_counter()
        for r in ranks:
            self._step_of(r, now)

    def arrive(self, value: int) -> int:
        """This rank is at a meeting (the run's end, a checkpoint), with ``value`` (its step): told to the store.
        Returns the meeting's number, for :meth:`arrived`."""
        n = self._meets
        self._meets += 1
        self.store.add(f"meet/{n}/{self.rank}", int(value) + 1)
        return n

    def arrived(self, n: int, ranks: Iterable[int]) -> dict[int, int]:
        """Those of ``ranks`` at meeting ``n`` so far, with their values."""
        out = {}
        for r in ranks:
            v = int(self.store.add(f"meet/{n}/{r}", 0))
            if v:
                out[r] = v - 1
        return out
