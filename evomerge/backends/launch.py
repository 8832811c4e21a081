"""Launching a distributed run on this machine: :func:`simulate` spawns one process per rank (or per group of
workers), each running :func:`evomerge.backends.distributed.run_rank` (gloo on the CPU, NCCL on CUDA, rendezvous
through a file), relays rank 0's rounds to the caller's callback, and stops every rank however it ends: a rank
that dies or raises ends the run with one line naming it.

On Linux the ranks are forked from multiprocessing's fork server, started once per launching process with this
module (so torch and evomerge) imported: a rank then starts in well under a second instead of the seconds a fresh
interpreter takes to import torch, which a distributed search pays on every trial. A rank takes the launcher's
working directory, ``sys.path`` and environment as they are at its launch, as a spawned rank would, before it
unpickles its arguments (which imports a user's modules). The server does not take the launcher's ``sys.path``
(Python 3.11): where that finds another evomerge than the launcher's, each rank says so in one line instead of
running other code. Elsewhere the ranks are spawned."""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - its tensor reductions, in ForkingPickler

from ..engine.setup import RunResult, Setup, resolve_device
from ..errors import ConfigError
from ..policy import MergePolicy
from ..procs import ProcessGroup, ignored, pid_running
from . import check_model, check_policy
from .distributed import DistributedRunError, groups, run_rank


# -- local launch --------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, however it dies (no orphaned ranks). A rank forked
    by the fork server has the server as its parent; :func:`evomerge.procs._group_entry` watches the launcher."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the launcher died before we got here
        os._exit(1)


def _rank_main(rank: int, world: int, store_path: str, setup, policy, seed, up, down, device: str,
               evaluate_test: bool, keep_params: bool, threads: int, emulate_time: bool = False) -> None:
    """Entry point of a spawned rank: join the group, run, send rank 0's rounds and result up."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; a Ctrl-C reaches it too
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    # rendezvous through a file: nothing listens on a network port but gloo's own 127.0.0.1 pairs
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store,
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        def report(rm):
            _send(up, "round", rm)
            return down.get()

        res = run_rank(setup, policy, seed, rank=rank, world=world, report=report if rank == 0 else None,
                       device=dev, evaluate_test=evaluate_test, keep_params=keep_params, emulate_time=emulate_time)
        if rank == 0:
            _send(up, "result", res)
    finally:
        dist.destroy_process_group()


def _send(up, kind: str, payload) -> None:
    """Put ``(kind, payload)`` on the queue to the launcher, pickled here into bytes. A queue of
    ``torch.multiprocessing`` would share a tensor's storage by a handle (a file descriptor, or CUDA IPC)
    that the sending process must stay alive to hand over, and rank 0 exits right after sending its
    result: the launcher then met "connection reset by peer". Bytes outlive their sender."""
    up.put((kind, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))


def _receive(up, timeout: float):
    kind, payload = up.get(timeout=timeout)
    return kind, pickle.loads(payload)


def simulate(setup: Setup, policy: MergePolicy, seed: int = 0, *, callback=None, device: str | None = None,
             evaluate_test: bool = False, keep_params: bool = False, procs: int | None = None,
             emulate_time: bool = False, _entry=None, _start: str | None = None) -> RunResult:
    """Like :func:`evomerge.simulate.simulate`, on ``procs`` processes (default: one per worker)
    started on this machine (:func:`_context`). ``callback`` runs here, in the caller's process; if it raises, the
    ranks stop at the end of that round and the exception propagates. A rank that dies or raises
    ends the run with :class:`DistributedRunError` naming it, and no rank is left running. ``_start``: a start
    method other than :func:`_context`'s (``"spawn"``; benchmarks/bench_backends.py compares them)."""
    check_policy("distributed", policy)
    check_model("distributed", setup.model)
    world = procs or setup.study.run.workers
    groups(setup.study.run.workers, world)  # a clear error before anything starts
    device = str(resolve_device(device))
    if torch.device(device).type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError("--procs", f"{world} processes on {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per "
                                     f"process; allowed: at most {torch.cuda.device_count()}, or --device cpu (gloo)")
    check_socket_folder()
    ctx = _context(_start)
    up, down = ctx.Queue(), ctx.Queue()
    threads = max(1, int(os.environ.get("EVOMERGE_THREADS") or os.cpu_count() or 1) // world)  # procs.apply_threads
    _remove_orphans()
    tmp = tempfile.TemporaryDirectory(prefix=TMP_PREFIX)
    open(os.path.join(tmp.name, f"launcher-{os.getpid()}"), "w").close()  # whose it is (_remove_orphans)
    # the head pickled here, once per rank, and unpickled in the rank once it has the launcher's environment:
    # unpickling the setup imports the user's modules (a model, a loss), whose import-time code must see it. torch's
    # pickler puts the tensors (the data) in shared memory, as for the process's own arguments. The head and the
    # environment go through a file, the queues and the tail's plain values through the start pipe: that stays
    # smaller than a pipe holds, so a rank that dies before reading it (killed, out of memory) cannot leave the
    # launcher blocked writing to it (spawn keeps the pipe's read end open in the launcher until the write ends)
    head = (world, os.path.join(tmp.name, "store"), setup, policy, seed)
    tail = (device, evaluate_test, keep_params, threads, emulate_time)
    result, error = None, None
    # one supervisor for every process evomerge starts: each rank leads its own process group, and
    # leaving the block (normally, on an error, Ctrl-C, SIGTERM or SIGHUP) stops every group
    with ProcessGroup(grace=3) as ranks:
        try:  # the folder (the environment's copies in it) goes whatever happens from here
            for rank in range(world):
                sent = os.path.join(tmp.name, f"args-{rank}")
                with open(sent, "wb") as fh:
                    pickle.dump((dict(os.environ), bytes(ForkingPickler.dumps(head))), fh,
                                protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    ranks.spawn(_rank_process, (_entry or _rank_main, rank, os.path.join(tmp.name, f"error-{rank}"),
                                                sent, (up, down, tail), _package()), ctx=ctx)
                except OSError as e:  # no process, or one that ended before it read its start (a broken pipe)
                    raise DistributedRunError(rank, f"could not be started ({e}); the run was stopped") from None
            while True:
                try:
                    kind, payload = _receive(up, 0.05)
                except queue_mod.Empty:
                    kind = None
                if kind == "round":
                    go = True
                    if error is None and callback is not None:
                        try:
                            callback(payload)
                        except BaseException as e:  # noqa: BLE001 - re-raised once the ranks have stopped
                            error, go = e, False
                    down.put(go)
                elif kind == "result":
                    result = payload
                if kind is None:
                    multiprocessing.connection.wait([p.sentinel for p in ranks.processes], timeout=0.05)
                _raise_if_failed(ranks.processes, tmp.name)
                if all(p.exitcode == 0 for p in ranks.processes):
                    break
        finally:
            ranks.stop()
            tmp.cleanup()
    while result is None:  # the result may still sit in the queue after every rank exited
        try:
            kind, payload = _receive(up, 5)
        except queue_mod.Empty:
            raise DistributedRunError(0, "ended without a result") from None
        if kind == "result":
            result = payload
    if error is not None:
        raise error
    return result


TMP_PREFIX = "evomerge-dist-"  # a run's private folder: the ranks' rendezvous file, their arguments, their errors


def _remove_orphans() -> None:
    """Remove the private folders of runs whose launcher is gone (killed outright: SIGKILL leaves it no chance to
    clean up; its ranks went with it). A folder names its launcher (``launcher-PID``); one whose launcher still
    runs, or that names none, is left as it is."""
    import glob
    import shutil

    for d in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
        try:
            pids = [f.split("-", 1)[1] for f in os.listdir(d) if f.startswith("launcher-")]
        except OSError:  # not a folder, or not ours to read
            continue
        if len(pids) == 1 and pids[0].isdigit() and not pid_running(int(pids[0])):
            shutil.rmtree(d, ignore_errors=True)


SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path holds 108 with the closing NUL)
_MP_SOCKET = len("/pymp-XXXXXXXX/listener-XXXXXXXX")  # multiprocessing's folder and socket under the temporary one


def check_socket_folder() -> None:
    """One line naming ``TMPDIR`` where the temporary folder's path is too long for the ranks' start: the tensors
    the launcher hands its ranks pass as file descriptors over a Unix socket that multiprocessing makes in a folder
    of its own there (as does the fork server), and a socket's path holds at most 107 bytes; Python's own error is
    a traceback ending in ``OSError: AF_UNIX path too long``."""
    folder = tempfile.gettempdir()
    n = len(os.fsencode(folder))
    if n + _MP_SOCKET > SOCKET_PATH_MAX:
        raise ConfigError("TMPDIR", f"the temporary folder {folder} is too long ({n} bytes) for the Unix sockets "
                                    f"the ranks start through (at most {SOCKET_PATH_MAX} bytes with the "
                                    f"{_MP_SOCKET} multiprocessing adds); allowed: a folder of at most "
                                    f"{SOCKET_PATH_MAX - _MP_SOCKET} bytes, e.g. TMPDIR=/tmp")


def _context(method: str | None = None):
    """The multiprocessing context the ranks start from: the fork server, with this module preloaded, where the
    platform has one; spawn elsewhere (or where ``method`` says so)."""
    import torch.multiprocessing as mp

    if method == "spawn" or sys.platform != "linux":  # the rank's watch of its launcher needs Linux's pidfd
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts: the first launch in this process
    # the server shields itself from a Ctrl-C only once it has imported this module (torch: seconds); one that
    # reached it before printed the import's traceback. It starts with SIGINT ignored, which it inherits, and the
    # ranks ignore it too (_rank_main): the launcher decides
    from multiprocessing import forkserver

    with ignored([signal.SIGINT]):
        forkserver.ensure_running()
    return ctx


def _package() -> str:
    """Where this evomerge is (the package's folder)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _rank_process(entry, rank: int, error_path: str, sent: str, args: tuple, package: str | None = None) -> None:
    """A started rank: ``entry(rank, *head, up, down, *tail)`` with ``args = (up, down, tail)``. ``sent``: a file
    that holds the launcher's environment at launch and the head pickled; the environment is applied before the
    head is unpickled (a rank forked from the fork server has the server's environment). If it raises (unpickling
    included), its last traceback line goes to ``error_path`` for the launcher's one-line message, and the process
    exits with code 1. ``package``: the launcher's evomerge, which the rank must be running."""
    try:
        with open(sent, "rb") as fh:
            environ, head = pickle.load(fh)
        os.remove(sent)
        if environ != os.environ:
            os.environ.clear()
            os.environ.update(environ)
        if package is not None and package != _package():
            raise RuntimeError(f"this rank runs evomerge from {_package()} (the fork server's sys.path), its launcher "
                               f"from {package}; make one evomerge importable (pip install -e) or launch from that one")
        up, down, tail = args
        entry(rank, *pickle.loads(head), up, down, *tail)
    except BaseException:  # noqa: BLE001 - reported by the launcher
        import traceback

        with open(error_path, "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)


# signals that come from outside a rank (the OOM killer, a user, a scheduler), not from a failure inside it (SIGABRT,
# SIGSEGV), which may follow a peer's error: a rank that got one of these is the cause
_FROM_OUTSIDE = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def _raise_if_failed(processes, error_dir: str, settle: float = 1.0) -> None:
    """The rank that failed, as a one-line error naming it (the others are stopped by the caller's ``finally``):
    one killed by a signal from outside (SIGKILL, SIGTERM, SIGINT, SIGHUP), else the first that exited non-zero.
    A rank that dies takes its peers' connections with it, and they raise moments later, sometimes before the launcher hears of the death (a forked rank's end
    is reported through the fork server): so when the first failure seen is a raise, the others get up to
    ``settle`` seconds to end, and a rank killed from outside among them is the one named."""
    failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
    if not failed:
        return
    if all(processes[r].exitcode > 0 for r in failed):
        deadline = time.monotonic() + settle
        while (left := deadline - time.monotonic()) > 0 and any(p.exitcode is None for p in processes):
            multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=left)
    killed = [rank for rank, p in enumerate(processes) if p.exitcode is not None and -p.exitcode in _FROM_OUTSIDE]
    for rank in killed[:1] or failed[:1]:
        p = processes[rank]
        if p.exitcode < 0:
            try:
                why = f"was killed by {signal.Signals(-p.exitcode).name}"
            except ValueError:
                why = f"was killed by signal {-p.exitcode}"
            raise DistributedRunError(rank, f"(pid {p.pid}) {why}; the run was stopped")
        last = f"exited with code {p.exitcode}"
        path = os.path.join(error_dir, f"error-{rank}")
        if os.path.exists(path):
            with open(path) as fh:
                lines = [ln.strip() for ln in fh.read().strip().splitlines() if ln.strip()]
            if lines:
                last = f"raised {lines[-1]}"
        raise DistributedRunError(rank, f"(pid {p.pid}) {last}")


