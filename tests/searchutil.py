"""Helpers of the search tests: the real command in a subprocess, and reading the SQLite study directly."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time


def states(db):
    with sqlite3.connect(db) as c:
        return dict(c.execute("select state, count(*) from trials group by state").fetchall())


def running(db) -> int:
    """How many trials of the study in ``db`` are running: 0 while the file, or its tables, are not there yet."""
    try:
        return states(db).get("RUNNING", 0)
    except sqlite3.Error:
        return 0


def cli(*args, cwd, data_dir, wait=True, env_extra=None, process=False):
    """The evomerge command with ``args`` in folder ``cwd``: in this process (``cli.main``, the command's own
    code, without paying a Python start-up per call) unless ``process`` is set or it must be signalled
    (``wait=False``: the running subprocess is returned)."""
    if wait and not process:
        return _in_process(args, cwd, data_dir, env_extra or {})
    env = dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir), **(env_extra or {}))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("EVOMERGE_RUNS_DIR", None)
    cmd = [sys.executable, "-m", "evomerge.cli", *args]
    if wait:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)  # minutes on a loaded machine
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _in_process(args, cwd, data_dir, env_extra: dict) -> subprocess.CompletedProcess:
    """``cli.main(args)`` run as the subprocess would be: in ``cwd``, with the same environment, its output
    captured; the caller's folder and environment are restored afterwards."""
    import contextlib
    import io

    from evomerge import cli as cli_mod

    env = {"EVOMERGE_DATA_DIR": str(data_dir), **env_extra}
    keys = {*env, "MLFLOW_TRACKING_URI", "EVOMERGE_RUNS_DIR"}
    saved, here = {k: os.environ.get(k) for k in keys}, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        os.environ.pop("EVOMERGE_RUNS_DIR", None)
        os.environ.update(env)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_mod.main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["evomerge", *args], rc, out.getvalue(), err.getvalue())


def wait_for(pred, timeout=120, proc=None, every=0.2):
    """Poll ``pred`` until it holds (True) or ``timeout`` seconds pass; with ``proc``, give up (False) as soon as
    that process has ended, so that a search that finished before the awaited moment fails at once."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(every)
    return False


def edit_study(path, old: str, new: str):
    """Change a study file in place (a copy of a study that keeps its name)."""
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    return path


def cma_points(db):
    """(generation, index) -> params of every COMPLETE trial that CMA-ES proposed."""
    with sqlite3.connect(db) as c:
        rows = c.execute("""select t.trial_id, a.key, a.value_json from trials t join trial_user_attributes a
                            on a.trial_id = t.trial_id where t.state = 'COMPLETE' and a.key like 'cma_%'""").fetchall()
        params = c.execute("""select t.trial_id, p.param_name, p.param_value from trials t join trial_params p
                              on p.trial_id = t.trial_id where t.state = 'COMPLETE'""").fetchall()
    keys, vals = {}, {}
    for tid, k, v in rows:
        keys.setdefault(tid, {})[k] = json.loads(v)
    for tid, k, v in params:
        vals.setdefault(tid, {})[k] = round(v, 9)
    return {(keys[t]["cma_generation"], keys[t]["cma_index"]): vals[t] for t in keys}
