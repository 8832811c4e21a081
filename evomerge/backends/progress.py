"""Each rank's progress, told through torch.distributed's key-value store, so that a rank waiting for a slow one can
tell it from a hung one.

Gossip and asynchronous DiLoCo let a slow rank fall behind: at the end of the run (``Merger.finish``) or at a
checkpoint (``state_dict``, ``close``) the others wait for it, and a wait bounded by one ``timeout`` from its start
ended healthy runs whose slow rank was more than ``timeout`` behind (``rank 1 did not answer``). Here every rank adds
its step count to the store at most every :data:`BEAT` (a quarter of the timeout, at most 5 s), and a rank that
waits for others keeps waiting as long as each one it waits for has moved within the last ``timeout``: a hung rank
is still named a ``timeout`` after its last step. A worker's leader (``Merger(worker_group=...)``) also tells, while
it waits inside the Merger (for a slow worker at the end, a peer's payload), that it is waiting (:meth:`Progress.pulse`):
its worker's other ranks, which wait for its broadcast, keep waiting while it does. The ranks also meet here (:meth:`Progress.arrive`): each says its
step once it is at the end (``finish``, ``close``), in place of a collective bounded by the process group's timeout.

The store is the process group's (``dist.distributed_c10d._get_default_store()``: torchrun's, or the one
``init_process_group`` made); its keys are under ``evomerge/<run>/``, where ``<run>`` is a number rank 0 drew from the
store for this Merger (every Merger of a process, and a resumed one, has its own). Without a store the Merger waits
as before (one ``timeout``).

A store call waits for the store's process, and a TCPStore's client waits for a reply for ever: under
``init_process_group`` with ``MASTER_ADDR`` (not torchrun, whose agent holds the store) rank 0's process holds it,
and a rank 0 stopped (``kill -STOP``, a frozen node) left every other rank blocked in a call, where it should name
rank 0 within ``timeout``. So every call runs on a thread of its own (:class:`_Calls`): a step's call is not waited
for, and a wait's call is waited for at most ``timeout``, after which the store counts as gone (``RuntimeError``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterable

RUNS_KEY = "evomerge/runs"  # the store's counter of Mergers (each takes the next number for its keys)


def default_store():
    """The process group's key-value store, or None where there is none to reach."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without it: the Merger waits as before
        return None


class _Calls:
    """Store calls on a daemon thread of their own (started at the first), so that one the store never answers
    blocks that thread, not the caller's: :meth:`wait` waits for a call at most ``limit`` seconds (then the store
    counts as gone: every later call raises at once), :meth:`post` does not wait (one at a time: skipped while the
    last one is still out)."""

    def __init__(self, limit: float):
        self.limit, self.gone = limit, False
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._out = threading.Event()  # a posted call is under way
        self._out.set()

    def _run(self) -> None:
        while True:
            fn, box, done = self._q.get()
            if fn is None:
                return
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                box.append((False, e))
            done.set()

    def _submit(self, fn: Callable[[], Any], done: threading.Event) -> list:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="evomerge-progress", daemon=True)
            self._thread.start()
        box: list = []
        self._q.put((fn, box, done))
        return box

    def wait(self, fn: Callable[[], Any]) -> Any:
        """``fn()``'s value, or RuntimeError if it raised one or the store did not answer within ``limit``."""
        if self.gone:
            raise RuntimeError("the store did not answer")
        done = threading.Event()
        box = self._submit(fn, done)
        if not done.wait(self.limit):
            self.gone = True
            raise RuntimeError(f"the store did not answer for {self.limit:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise RuntimeError(str(value))

    def post(self, fn: Callable[[], Any]) -> bool:
        """``fn()`` on the thread, not waited for; False (not sent) while the last one is out or the store is gone."""
        if self.gone or not self._out.is_set():
            return False
        self._out.clear()
        self._submit(fn, self._out)
        return True

    def close(self) -> None:
        """The thread ends once its calls are done (a call the store never answers keeps it, a daemon, blocked)."""
        if self._thread is not None:
            self._q.put((None, None, None))
            self._thread = None


def next_run(store, timeout: float) -> int:
    """A number for a new Merger's keys (rank 0 draws it; 0: no store, or one that does not answer in ``timeout``)."""
    if store is None:
        return 0
    calls = _Calls(timeout)
    try:
        return int(calls.wait(lambda: store.add(RUNS_KEY, 1)))
    except Exception:  # noqa: BLE001 - the store cannot be reached: no progress is told
        return 0
    finally:
        calls.close()


class Progress:
    """This rank's view of every rank's step count in the store. ``rank``: this rank's place among ``W``;
    ``timeout``: how long a rank may go without a step before a rank waiting for it names it."""

    def __init__(self, store, run: int, rank: int, W: int, timeout: float):
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"evomerge/{run}/", store)
        self._calls = _Calls(timeout)
        self.run, self.rank, self.W, self.timeout = run, rank, W, timeout
        self.beat_every = min(max(timeout / 4, 0.01), 5.0)
        # each rank's count read at most this often: an eighth of the timeout tells a silent rank in time (a rank
        # that steps is seen within that of its step), and keeps the reads of W ranks each watching the others (at
        # the run's end) to W^2 / (timeout / 8) a second
        self.poll_every = min(max(timeout / 8, 0.01), 15.0)
        self._told, self._t_told, self._t_pulsed = 0, -float("inf"), -float("inf")
        # (what, rank) -> (its count, when it was first seen); what: "step" (steps told), "wait" (waits told)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._t_polled: dict[tuple[str, int], float] = {}
        self._meets = 0  # meetings held (every rank holds them at the same points)
        self._counted: dict[int, int] = {}  # meeting -> the count at this rank's last read of its list

    def close(self) -> None:
        """No more calls (the Merger is done): the calls' thread ends."""
        self._calls.close()

    def beat(self, step: int) -> None:
        """This rank is at ``step``: told to the store, at most every :attr:`beat_every` seconds, not waited for (a
        step does not wait for the store). A store that cannot be reached is left alone here (the ranks waiting for
        this one find out)."""
        now = time.perf_counter()
        if now - self._t_told < self.beat_every or step == self._told:
            return
        key, store = f"step/{self.rank}", self.store

        def tell(n=step - self._told):
            try:
                store.add(key, n)
            except Exception:  # noqa: BLE001 - see above
                pass
        if self._calls.post(tell):  # (the count grows by what was told: a beat not sent is told with the next)
            self._told, self._t_told = step, now

    def pulse(self) -> None:
        """This rank is waiting inside the Merger, for ranks that answer or step (each wait is bounded): told to the
        store at most every :attr:`beat_every` seconds, for its worker's other ranks (``moving(..., "wait")``)."""
        now = time.perf_counter()
        if now - self._t_pulsed < self.beat_every:
            return
        key, store = f"wait/{self.rank}", self.store

        def tell():
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - as beat()
                pass
        if self._calls.post(tell):
            self._t_pulsed = now

    def _count_of(self, what: str, r: int, now: float) -> None:
        key = (what, r)
        if now - self._t_polled.get(key, -float("inf")) < self.poll_every:
            return
        self._t_polled[key] = now
        n = int(self._calls.wait(lambda: self.store.add(f"{what}/{r}", 0)))
        if key not in self._seen or self._seen[key][0] != n:
            self._seen[key] = (n, now)

    def moving(self, ranks: Iterable[int], what: str = "step") -> bool:
        """Whether every rank of ``ranks`` (at least one) has told a new step (``what="wait"``: that it still waits
        inside the Merger) within the last ``timeout`` seconds, as far as this rank has looked (the first look counts
        as a move). Raises RuntimeError if the store is gone."""
        ranks = list(ranks)
        self.watch(ranks, what)
        now = time.perf_counter()
        # (a move is seen at the next read, up to poll_every after it: reads are an eighth of the timeout apart)
        return bool(ranks) and all(now - self._seen[(what, r)][1] <= self.timeout for r in ranks)

    def told(self, r: int, what: str = "step") -> int | None:
        """Rank ``r``'s count (its step, or its waits) as this rank last read it; None before the first look."""
        seen = self._seen.get((what, r))
        return None if seen is None else seen[0]

    def watch(self, ranks: Iterable[int], what: str = "step") -> None:
        """Look at ``ranks``' step counts (or wait counts) at most every :attr:`poll_every` seconds each, so that a
        later :meth:`moving` knows when each last moved."""
        now = time.perf_counter()
        for r in ranks:
            self._count_of(what, r, now)

    def arrive(self, value: int) -> int:
        """This rank is at a meeting (the run's end, a checkpoint), with ``value`` (its step): appended to the
        meeting's list in the store, then counted. Returns the meeting's number, for :meth:`arrived`."""
        n = self._meets
        self._meets += 1
        def say():
            self.store.append(f"meet/{n}/list", f"{self.rank}:{int(value)};")
            self.store.add(f"meet/{n}/count", 1)
        self._calls.wait(say)
        return n

    def read(self, n: int) -> None:
        """This rank has read every rank's value at meeting ``n`` (:meth:`readers`)."""
        self._calls.wait(lambda: self.store.add(f"meet/{n}/read", 1))

    def readers(self, n: int) -> int:
        """How many ranks have read every rank's value at meeting ``n``: a rank that finds them at odds waits for the
        others to read them before it leaves (its process may hold the store)."""
        return int(self._calls.wait(lambda: self.store.add(f"meet/{n}/read", 0)))

    def arrived(self, n: int) -> dict[int, int]:
        """The ranks at meeting ``n`` so far, with their values: one read of the meeting's count, and of its list
        when the count has grown since the last call (not a read per rank: a meeting of W ranks polled by each is
        O(W) reads a poll, not W squared)."""
        count = int(self._calls.wait(lambda: self.store.add(f"meet/{n}/count", 0)))
        if count == self._counted.get(n, 0):
            return {}
        self._counted[n] = count
        said = self._calls.wait(lambda: self.store.get(f"meet/{n}/list")).decode().split(";")
        return {int(r): int(v) for r, v in (x.split(":") for x in said if x)}
