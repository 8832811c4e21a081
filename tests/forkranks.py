"""Start a user's script as several ranks, forked from one interpreter that has imported torch and evomerge once.

``run_ranks`` writes a spec (the script, and per rank its arguments, its environment (RANK, ...) and the files its
stdout and stderr go to) and has a launcher start it. Each rank is its own process, forked before it runs anything
of the script: it then sets its environment, runs the script as ``__main__`` (as ``python script.py ARGS`` would,
the script's folder first on ``sys.path``) and ends as that interpreter would (an uncaught exception printed, status
1; ``sys.exit``; a signal). The launcher writes the ranks' exit statuses as one JSON list, in the form
``subprocess`` gives them (-N for signal N), once every rank has ended.

Why: a rank started as ``python script.py`` pays torch's and evomerge's imports, about 2.4 s of CPU on the test
machine, before it does anything; four ranks of a test on two cores paid more for their imports than for their
run. The tests of the Merger launch about a hundred ranks. The ranks stay separate processes with their own gloo
connections, as torchrun's; the torchrun launch itself is tested where a user's command is
(tests/test_runtime.py's deploy example, tests/test_any_model.py's language model).

The launcher itself is forked too: ``python tests/forkranks.py --serve`` (one per test process, started at its first
launch) imports once and forks a launcher per launch, which then forks the ranks. A launcher started as a process of
its own paid the same imports (about 3.9 s of CPU) for each of the suite's sixty-odd launches. A launch whose
environment differs in a variable torch may read as it is imported (``TORCH_CPP_LOG_LEVEL``: anything but the
rendezvous variables) is forked from a server of its own.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project: evomerge importable by the launcher and its ranks
# torch._dynamo: the first torch.optim optimiser a process builds imports it (with sympy), about 1.7 s of CPU on the test
# machine, which each rank paid again after the fork
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "evomerge", "evomerge.runtime", "evomerge.simulate",
           "evomerge.reference"]


def run_ranks(script, argv: list[list], *, logs, cwd=None, env: dict | None = None,
              rank_env: list[dict] | None = None, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``script`` as ``len(argv)`` ranks in folder ``cwd``, rank r with arguments ``argv[r]`` and environment
    ``os.environ`` with the project first on PYTHONPATH, ``env`` (read by every rank's imports too:
    TORCH_CPP_LOG_LEVEL, ...) and ``rank_env[r]``. Each rank's exit status and output (kept in folder ``logs``), as
    ``subprocess.run`` gives them; an AssertionError naming a hang after ``timeout`` seconds, every rank killed."""
    logs = Path(logs).resolve()
    n = len(argv)
    spec = {"script": str(script),
            "ranks": [{"argv": [str(a) for a in argv[r]], "env": {k: str(v) for k, v in (rank_env or [{}] * n)[r].items()},
                       "stdout": str(logs / f".rank-{r}.out"), "stderr": str(logs / f".rank-{r}.err")} for r in range(n)]}
    (logs / ".ranks.json").write_text(json.dumps(spec))
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    **(env or {}))
    imports = {k: v for k, v in full_env.items() if k not in RUNTIME_ENV}  # what torch is imported with
    server = _SERVERS.setdefault(json.dumps(imports, sort_keys=True), _Server(imports))
    codes = server.launch(logs, cwd, full_env, timeout)
    return [subprocess.CompletedProcess([str(script), *map(str, argv[r])], codes[r],
                                        Path(spec["ranks"][r]["stdout"]).read_text(),
                                        Path(spec["ranks"][r]["stderr"]).read_text()) for r in range(n)]


# read when the process group starts, not as torch is imported: a launch that differs in these alone can be forked
# from a server that imported torch with its own environment (and pytest's name of the test that runs)
RUNTIME_ENV = {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "PYTEST_CURRENT_TEST"}


class _Server:
    """A fork server (``--serve``) of this test process, for launches whose environment is ``imports`` but for the
    rendezvous variables; started at its first launch and ended with the process (its stdin closes)."""

    def __init__(self, imports: dict):
        self.proc = None
        self.imports = imports
        self.errors = Path(os.devnull)
        self.lock = threading.Lock()

    def launch(self, logs: Path, cwd, env: dict, timeout: float) -> list[int]:
        result = logs / ".ranks.result.json"
        result.unlink(missing_ok=True)
        request = {"spec": str(logs / ".ranks.json"), "cwd": str(cwd or os.getcwd()), "env": env,
                   "result": str(result), "log": str(logs / ".launcher.err")}
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.errors = logs / ".forkserver.err"  # its own errors (an import that fails): the launch's folder
                with open(self.errors, "w") as err:
                    self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, stderr=err, text=True,
                                                 start_new_session=True, env=self.imports)
            proc = self.proc
            try:  # one request, its one reply line; anything else ends this server (its next reply is not read)
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                if not select.select([proc.stdout], [], [], timeout)[0]:
                    raise AssertionError(f"the fork server did not answer in {timeout} s")
                line = proc.stdout.readline()
                if not line:
                    raise AssertionError(f"the fork server ended (exit status {proc.wait(timeout=10)}): "
                                         f"{self.errors.read_text()[-2000:]}")
            except BaseException:
                _killpg(proc.pid)
                proc.wait()
                self.proc = None
                raise
        pid = int(line)  # the launcher: the leader of its own session, its ranks in it
        deadline = time.monotonic() + timeout
        try:
            while not result.exists():
                if not _alive(pid):
                    if result.exists():
                        break
                    err = Path(request["log"])
                    raise AssertionError(f"the launcher failed: {err.read_text()[-2000:] if err.exists() else ''}")
                if time.monotonic() > deadline:
                    raise AssertionError("the ranks did not end in time (a hang)")
                time.sleep(0.02)
        except BaseException:  # a hang, a launcher that failed with ranks started, the test interrupted: none left
            _killpg(pid)
            raise
        ends = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < ends:  # the result is its last act: its exit follows
            time.sleep(0.01)
        return json.loads(result.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the number now another user's process: this one has ended
        return False
    return True


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_SERVERS: dict[str, _Server] = {}  # by the environment of their imports


def serve() -> None:
    """The fork server: imports once, then per request line on stdin forks a launcher (its pid on stdout) that sets
    the request's folder and environment, starts the ranks and writes their exit statuses to the request's result
    file. Its children are not waited for (SIGCHLD ignored: the kernel reaps them); it ends when stdin closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports made is never garbage: kept out of every collection the ranks make (Python's advice for a
    # fork without exec, gc.freeze), which each of them spent walking it again, at its exit too
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _launcher(request)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


def _launcher(request: dict) -> None:
    """In the server's forked child: the launcher of one request. Never returns; its ranks, forked from it, leave
    through it as a rank does (an exception or SystemExit, up to the interpreter's own exit)."""
    me, status = os.getpid(), 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its ranks are waited for
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        err = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 1)
        os.dup2(err, 2)
        os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(request["spec"]) as f:
            spec = json.load(f)
        codes = _start(spec)
        tmp = request["result"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(codes, f)
        os.replace(tmp, request["result"])
        status = 0
    except BaseException:  # noqa: BLE001 - said in its log, which the test shows
        if os.getpid() != me:
            raise  # a rank's end
        traceback.print_exc()
    finally:
        if os.getpid() == me:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def _rank(script: str, rank: dict) -> None:
    """In the forked child: becomes the rank. Never returns: it leaves by SystemExit, an exception or a signal."""
    os.environ.update(rank["env"])
    for fd, path in ((1, rank["stdout"]), (2, rank["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [script, *rank["argv"]]
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)  # the script's end: the interpreter's own exit (atexit, flushes), status 0


def _start(spec: dict) -> list[int]:
    """Forks the spec's ranks and waits for them: their exit statuses."""
    script = os.path.abspath(spec["script"])
    sys.path[0] = os.path.dirname(script)  # as `python script.py`: its folder first, not this launcher's
    ranks = {}
    for r, rank in enumerate(spec["ranks"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _rank(script, rank)
        ranks[pid] = r
    codes = [0] * len(ranks)
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    return codes


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
