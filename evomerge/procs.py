"""Process supervision: start child processes, each in its own process group, and stop every
one of those groups (SIGTERM, then SIGKILL after a grace period) however the parent ends:
normal exit, an exception, Ctrl-C, SIGTERM or SIGHUP. Nothing a child started (an MLflow
server's uvicorn workers, a worker's own ranks) is left running, reparented, holding a port.

Usage::

    from evomerge.procs import ProcessGroup, Terminated

    try:
        with ProcessGroup(grace=10) as group:          # SIGTERM/SIGHUP now raise Terminated here
            server = group.popen([...])                # a command, in its own session
            worker = group.spawn(fn, (arg,))           # a Python function, spawned, in its own group
            ...                                        # watch them: group.alive(), group.wait(t)
            group.send(signal.SIGINT)                  # e.g. ask them to finish politely
    except Terminated as t:                            # leaving the block stopped every group
        return 128 + t.signum

``Terminated`` is a ``KeyboardInterrupt``, so code that already keeps its work safe on Ctrl-C
(fails the running trial as interrupted, keeps what finished) does the same on SIGTERM and
SIGHUP. Signal handlers are installed only from the main thread and restored on exit.

Spawned Python children also ask the kernel to send them SIGTERM if the parent dies without
cleaning up (SIGKILL; Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Iterable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) reached the supervising process; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Stop:
    """The stop signal a :func:`signals_raise` block received, kept: a :class:`Terminated` raised while Python runs
    a callback of its own (a garbage collector's, a weak reference's, a ``__del__``) is printed as ignored and lost,
    and :meth:`check` raises it again where the code can take it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def check(self) -> None:
        if self.signum is not None:
            raise Terminated(self.signum)


@contextlib.contextmanager
def signals_raise(signals: Iterable[int] = STOP_SIGNALS):
    """Within the block, the given signals raise :class:`Terminated` in the main thread (so
    ``finally`` blocks and context managers run); the previous handlers come back after it.
    Outside the main thread it changes nothing. Yields a :class:`Stop` that keeps the signal."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def raise_terminated(signum, frame):
        stop.signum = signum
        raise Terminated(signum)

    previous = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, raise_terminated)
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the parent's own cleanup is what there is
        pass


def _group_entry(target: Callable, args: tuple, parent: int) -> None:
    """The start of a spawned child: its own process group, a signal if the parent dies."""
    os.setpgid(0, 0)
    _set_pdeathsig()
    if os.getppid() != parent:
        # forked by a start server (multiprocessing's forkserver): the kernel's signal watches that server, which
        # outlives the supervisor while any child it forked runs, so a thread here watches the supervisor
        if not _watch(parent):  # the supervisor died before the watch began
            return
    target(*args)


def _exit_waiter(pid: int) -> Callable[[], None] | None:
    """A call that returns once process ``pid`` has ended (on its pidfd; polling where there is none, before Linux
    5.3), or None if it has ended already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfd: poll
        fd = None
    if fd is None and not pid_running(pid):
        return None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_running(pid):
                time.sleep(0.2)

    return wait


def _watch(pid: int, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` to this process's group (it leads its own) when process ``pid`` ends: a daemon thread waiting
    for it (:func:`_exit_waiter`). False, and no thread, if it has already ended."""
    gone = _exit_waiter(pid)
    if gone is None:
        return False

    def wait() -> None:
        gone()
        os.killpg(0, sig)  # this process's own group: what it started goes with it

    threading.Thread(target=wait, name=f"evomerge-watch-{pid}", daemon=True).start()
    return True


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@contextlib.contextmanager
def _deferred(signals: Iterable[int]):
    """Within the block, the given signals wait, and are delivered again as it ends: a child being started is a
    child known once they act. (A Ctrl-C inside ``Process.start()`` left a forked rank that no one stopped: it read
    its start after the launcher had gone and printed multiprocessing's traceback.) Outside the main thread it
    changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


@contextlib.contextmanager
def ignored(signals: Iterable[int]):
    """Within the block, the given signals are ignored (and so are they in a process started in it, which inherits
    that); the previous handlers come back after it. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


class _Handle:
    def __init__(self, proc: Any):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None if isinstance(self.proc, subprocess.Popen) else self.proc.is_alive()

    def join(self, timeout: float) -> None:
        if isinstance(self.proc, subprocess.Popen):
            try:
                self.proc.wait(timeout=max(0.0, timeout))
            except subprocess.TimeoutExpired:
                pass
        else:
            self.proc.join(max(0.0, timeout))


class ProcessGroup:
    """Children started here are stopped, with everything they started, when the ``with`` block
    ends (or :meth:`stop` is called): SIGTERM to each child's process group, then SIGKILL to the
    groups still there after ``grace`` seconds."""

    def __init__(self, grace: float = 10.0, signals: Iterable[int] = STOP_SIGNALS):
        self.grace = grace
        self._signals = tuple(signals)
        self._handles: list[_Handle] = []
        self._stack: contextlib.ExitStack | None = None

    # -- starting -----------------------------------------------------------------------
    def popen(self, args, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(args, **kwargs)`` in a new session (its own process group), under a watcher that
        ends the group if this process is killed outright (:func:`_watched`; an MLflow server outlived ``ui``)."""
        import sys

        # (-P: not this file's folder first on the path, where evomerge's modules would shadow a library's)
        watched = [sys.executable, "-P", os.path.abspath(__file__), str(os.getpid()), str(self.grace), "--",
                   *map(str, args)]
        proc = subprocess.Popen(watched, start_new_session=True, **kwargs)
        self._handles.append(_Handle(proc))
        return proc

    def spawn(self, target: Callable, args: tuple = (), *, ctx=None, name: str | None = None):
        """Start ``target(*args)`` in a spawned Python process (a ``multiprocessing.Process``, daemonic)
        that makes itself the leader of a new process group; return the started process."""
        import multiprocessing as mp

        ctx = ctx or mp.get_context("spawn")
        proc = ctx.Process(target=_group_entry, args=(target, args, os.getpid()), name=name, daemon=True)
        with _deferred((signal.SIGINT, *self._signals)):
            proc.start()
            self._handles.append(_Handle(proc))
        return proc

    # -- watching -----------------------------------------------------------------------
    @property
    def processes(self) -> list:
        return [h.proc for h in self._handles]

    def alive(self) -> list:
        return [h.proc for h in self._handles if h.running()]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every child has ended (or ``timeout`` seconds); True if they all have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self._handles:
            while h.running():
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                h.join(min(left, 1.0))
        return True

    def send(self, sig: int) -> None:
        """Send ``sig`` to every child's process group (and to a child not yet leading its own)."""
        for h in self._handles:
            try:
                os.killpg(h.pid, sig)
                continue
            except (ProcessLookupError, PermissionError):
                pass
            if h.running():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(h.pid, sig)

    # -- stopping -----------------------------------------------------------------------
    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every group, wait up to ``grace`` seconds for the children, SIGKILL the groups, reap."""
        if not self._handles:
            return
        grace = self.grace if grace is None else grace
        self.send(signal.SIGTERM)
        self.wait(grace)
        self.send(signal.SIGKILL)  # the groups: also what a child that exited left behind
        for h in self._handles:
            h.join(5.0)

    def __enter__(self) -> "ProcessGroup":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(signals_raise(self._signals))
        return self

    def __exit__(self, *exc) -> bool:
        try:
            self._shield(self.stop)
        finally:
            if self._stack is not None:
                self._stack.close()
        return False

    def _shield(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` with the stop signals and SIGINT ignored, so a second signal cannot cut the cleanup short."""
        with ignored({*self._signals, signal.SIGINT}):
            fn()


# -- threads ------------------------------------------------------------------------------------
def idle_cores(window: float = 0.25) -> float:
    """How many cores nobody is using right now: idle time over ``window`` seconds (Linux /proc/stat;
    elsewhere every core)."""
    def idle_and_total():
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals)  # idle + iowait

    try:
        i0, t0 = idle_and_total()
        time.sleep(window)
        i1, t1 = idle_and_total()
    except (OSError, ValueError, IndexError):
        return float(os.cpu_count() or 1)
    cores = os.cpu_count() or 1
    return cores * (i1 - i0) / max(1, t1 - t0)


def default_threads() -> int:
    """torch threads for the training processes of one evomerge command: ``$EVOMERGE_THREADS`` if set,
    else the cores idle when the command starts (at least one).

    Why (``benchmarks/bench_threads.py``, 2 cores): on a quiet machine 2 threads run mnist-gossip
    1.6-1.7x faster than 1; beside one busy process, 2 threads are 4.3-4.8x slower than on a quiet
    machine while 1 thread keeps its speed (OpenMP threads wait for each other at every op, and
    one of them waits for a core). So: as many threads as there are idle cores."""
    env = os.environ.get("EVOMERGE_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            from .errors import ConfigError

            raise ConfigError("EVOMERGE_THREADS", f"{env!r} is not a number of threads; allowed: an integer >= 1")
    return max(1, min(os.cpu_count() or 1, round(idle_cores())))


def apply_threads(share: int = 1) -> int:
    """Set this process's torch threads to its share of :func:`default_threads` (``share`` processes
    of the command train at once). Called by the command's own processes only, never on a library
    caller's behalf; the decision goes into ``$EVOMERGE_THREADS`` so the command's children share it."""
    import torch

    total = default_threads()
    os.environ.setdefault("EVOMERGE_THREADS", str(total))
    n = max(1, total // max(1, share))
    torch.set_num_threads(n)
    return n


def _machine() -> str:
    """This machine, as its ranks share its cores: the kernel's boot id (network namespaces and containers of one
    machine share it), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_tag() -> str:
    """This process as a later one can tell whether it still runs (:func:`still_running`): the machine's boot id,
    the pid namespace, the pid and its start time. A host name and a pid alone took a live search in another
    container of one host for a dead one, and a container's restarted process for the dead one of the same pid."""
    return "/".join([_machine(), _pid_namespace() or "?", str(os.getpid()), _started(os.getpid()) or "?"])


def still_running(tag: str) -> bool | None:
    """Whether the process :func:`process_tag` gave ``tag`` still runs: None where this process cannot tell (another
    machine or pid namespace, or a tag without its parts)."""
    try:
        machine, ns, pid, started = tag.split("/")
        pid_n = int(pid)
    except ValueError:
        return None
    if machine != _machine() or ns == "?" or ns != _pid_namespace():
        return None
    if not pid_running(pid_n):
        return False
    return started == "?" or _started(pid_n) == started  # the same pid started again is another process


def ranks_on_this_machine() -> int:
    """How many ranks of the default process group run on this rank's machine (one all-gather, on every rank), to
    share its cores where the launcher does not say (torchrun's ``LOCAL_WORLD_SIZE``; netlab and a script of one's
    own do not): without it each rank of four on two cores took both, and ran 10-55x slower."""
    import torch.distributed as dist

    me, machines = _machine(), [None] * dist.get_world_size()
    dist.all_gather_object(machines, me)
    return machines.count(me)


# -- a rank's device ----------------------------------------------------------------------------
def rank_device() -> tuple[Any, str]:
    """This rank's device and process-group backend, for a process torchrun started (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``): the GPU ``LOCAL_RANK % GPUs`` and NCCL when every local rank has a GPU of its
    own; several ranks on one GPU share it under gloo (NCCL refuses two ranks on one device), their
    payloads staged through host memory; the CPU and gloo where there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    local, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    dev = torch.device(f"cuda:{local % gpus}")
    torch.cuda.set_device(dev)
    return dev, "nccl" if gpus >= local_world else "gloo"


def _others_in_group() -> bool:
    """Whether a live process other than this one is in this process's group (Linux's /proc; elsewhere: assumed,
    so the whole grace is waited)."""
    me, group = os.getpid(), os.getpgrp()
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return True
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        except OSError:  # gone meanwhile
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == group:
            return True
    return False


def _watched(parent: int, grace: float, args: list[str]) -> int:
    """``python procs.py PARENT GRACE -- CMD ...``, as :meth:`ProcessGroup.popen` starts a command: CMD runs as
    this process's child, in its group (this process leads its own session), and its exit status is passed on.
    If process PARENT ends first without stopping the group (SIGKILL, out of memory: no chance to clean up), the
    group gets SIGTERM, then SIGKILL after GRACE seconds: a command's own children (the MLflow server's uvicorn)
    go too, where ``PR_SET_PDEATHSIG`` would reach CMD alone. The stop signals that reach this process (the
    supervisor's, sent to the whole group) are left to CMD, which is waited for; one that came before CMD started is
    passed on to it at once. CMD's death by a signal is this process's own (``Popen.returncode`` -N, as CMD's)."""
    early: list[int] = []  # stop signals that came before CMD existed (sent to the group: CMD missed them)
    started = threading.Event()

    def held(signum, frame) -> None:
        if not started.is_set():
            early.append(signum)

    for sig in (*STOP_SIGNALS, signal.SIGINT):  # a handler, not SIG_IGN, which CMD would inherit
        signal.signal(sig, held)
    parent_gone = _exit_waiter(parent)
    if parent_gone is None:
        return 1  # the supervisor is gone already: nothing to start
    child = subprocess.Popen(args)
    started.set()
    if early:
        child.send_signal(early[0])

    fired = threading.Event()

    def watch() -> None:
        parent_gone()
        fired.set()
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _others_in_group():  # (it waited the whole grace, the group gone)
            time.sleep(0.1)
        os.killpg(0, signal.SIGKILL)  # this process too

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    rc = child.wait()
    if fired.is_set():  # CMD ended on the group's SIGTERM: what it started gets the grace, then SIGKILL
        watcher.join()
    if rc < 0:  # killed by a signal: so is this process, as the supervisor reads it (a rank's SIGKILL, not "exit 137")
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    import sys

    sys.exit(_watched(int(sys.argv[1]), float(sys.argv[2]), sys.argv[4:]))
