"""Start a user's script as several ranks, forked from one interpreter that has imported torch and evomerge once.

``python tests/forkranks.py SPEC.json``: SPEC names the script, the modules to import first, and per rank its
arguments, its environment (RANK, ...) and the files its stdout and stderr go to. Each rank is its own process,
forked before it runs anything of the script: it then sets its environment, runs the script as ``__main__`` (as
``python script.py ARGS`` would, the script's folder first on ``sys.path``) and ends as that interpreter would (an
uncaught exception printed, status 1; ``sys.exit``; a signal). The launcher prints the ranks' exit statuses as one
JSON list, in the form ``subprocess`` gives them (-N for signal N), once every rank has ended.

Why: a rank started as ``python script.py`` pays torch's and evomerge's imports, about 2.4 s of CPU on the test
machine, before it does anything; four ranks of a test on two cores paid more for their imports than for their
run. The tests of the Merger launch about a hundred ranks. The ranks stay separate processes with their own gloo
connections, as torchrun's; the torchrun launch itself is tested where a user's command is
(tests/test_runtime.py's deploy example, tests/test_any_model.py's language model).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project: evomerge importable by the launcher and its ranks
# torch._dynamo: the first torch.optim optimiser a process builds imports it (with sympy), about 1.7 s of CPU on the test
# machine, which each rank paid again after the fork
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "evomerge", "evomerge.runtime", "evomerge.simulate",
           "evomerge.reference"]


def run_ranks(script, argv: list[list], *, logs, cwd=None, env: dict | None = None,
              rank_env: list[dict] | None = None, timeout: float = 240,
              preload: list[str] = PRELOAD) -> list[subprocess.CompletedProcess]:
    """``script`` as ``len(argv)`` ranks in folder ``cwd``, rank r with arguments ``argv[r]`` and environment
    ``os.environ`` with the project first on PYTHONPATH, ``env`` (read by every rank's imports too:
    TORCH_CPP_LOG_LEVEL, ...) and ``rank_env[r]``. Each rank's exit status and output (kept in folder ``logs``), as
    ``subprocess.run`` gives them; an AssertionError naming a hang after ``timeout`` seconds, every rank killed."""
    logs = Path(logs)
    n = len(argv)
    spec = {"script": str(script), "preload": preload,
            "ranks": [{"argv": [str(a) for a in argv[r]], "env": {k: str(v) for k, v in (rank_env or [{}] * n)[r].items()},
                       "stdout": str(logs / f".rank-{r}.out"), "stderr": str(logs / f".rank-{r}.err")} for r in range(n)]}
    (logs / ".ranks.json").write_text(json.dumps(spec))
    p = subprocess.Popen([sys.executable, __file__, str(logs / ".ranks.json")], cwd=cwd,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                                  **(env or {})),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank (one session)
        p.communicate()
        raise AssertionError("the ranks did not end in time (a hang)") from None
    assert p.returncode == 0, f"the launcher failed: {err[-2000:]}"
    codes = json.loads(out)
    return [subprocess.CompletedProcess([str(script), *map(str, argv[r])], codes[r],
                                        Path(spec["ranks"][r]["stdout"]).read_text(),
                                        Path(spec["ranks"][r]["stderr"]).read_text()) for r in range(n)]


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


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    script = os.path.abspath(spec["script"])
    sys.path[0] = os.path.dirname(script)  # as `python script.py`: its folder first, not this launcher's
    for name in spec["preload"]:
        importlib.import_module(name)
    # what the imports made is never garbage: kept out of every collection the ranks make (Python's advice for a
    # fork without exec, gc.freeze), which each of them spent walking it again, at its exit too
    gc.freeze()
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
    print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    main()
