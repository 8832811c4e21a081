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


def cli(*args, cwd, data_dir, wait=True, env_extra=None):
    env = dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir), **(env_extra or {}))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("EVOMERGE_RUNS_DIR", None)
    cmd = [sys.executable, "-m", "evomerge.cli", *args]
    if wait:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)  # minutes on a loaded machine
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(pred, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.2)
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
