"""Point-to-point work handles that can be polled.

gloo's send and receive works report completion only from a blocking ``wait()`` (``is_completed()`` stays false
until then; torch 2.13, checked), and a ``wait(timeout)`` that expires aborts the whole gloo context. So a small
daemon thread waits on each (torch releases the GIL there) and the caller polls :meth:`Pending.done`, bounding the
wait by its own timeout. The thread's ``wait()`` is given :data:`UNBOUNDED`: without it gloo bounds it by the process
group's timeout (``init_process_group(timeout=...)``), and a receive posted long before its message comes (the
Merger's standing stop message, which comes at the run's end) failed there: every run longer than that timeout
stopped, naming a healthy rank.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

UNBOUNDED = timedelta(days=365)  # a wait the caller bounds (gloo takes it in milliseconds; far from overflowing)


class Pending:
    """A ``torch.distributed`` work handle (``None`` with ``error``: it failed when posted), pollable. ``peer``:
    the rank at the other end, where the caller keeps it. ``unbounded``: a gloo work, waited for without gloo's
    bound (False for NCCL's)."""

    def __init__(self, work, error: BaseException | None = None, peer: int | None = None, unbounded: bool = True):
        self.error = error
        self.peer = peer
        self._done = threading.Event()
        self.finished_at: float | None = None  # wall-clock time (time.time()) the message went or came
        self._thread = None
        self._work = work
        if work is None:
            self.finished_at = time.time()
            self._done.set()
            return
        self._unbounded = unbounded  # gloo's works; NCCL's wait(timeout) would poll on the CPU (its watchdog bounds it)
        self._thread = threading.Thread(target=self._wait, args=(work,), daemon=True, name="evomerge-p2p-wait")
        self._thread.start()

    def _wait(self, work) -> None:
        try:
            work.wait(UNBOUNDED) if self._unbounded else work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the polling thread
            self.error = e
        self.finished_at = time.time()
        self._done.set()

    def done(self) -> bool:
        """Whether the message went or came (raises RuntimeError if it failed)."""
        if not self._done.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(str(self.error) or type(self.error).__name__)
        return True

    def alive(self) -> bool:
        """Whether its waiting thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until its waiting thread has ended: after the message went or came, it
        still has to return from the process group's ``wait()``."""
        if self._thread is not None:
            self._thread.join(timeout)

    def cut(self) -> None:
        """End the wait of a message that will not come (its peer stopped, at the process's end): a short ``wait``
        from here times out, which closes gloo's context and wakes the waiting thread with an error. A process that
        ends while the thread still waits is aborted (``terminate called without an active exception``)."""
        if self.alive():
            from datetime import timedelta

            try:
                self._work.wait(timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the time-out that closes it, or a connection already closed
                pass
            self.join(1.0)

    def wait(self) -> None:
        """Block until the message went or came (raises RuntimeError if it failed)."""
        self._done.wait()
        self.done()
