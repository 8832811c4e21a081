"""The clock with and without ``merge_time``, held against the same real jobs.

    .venv/bin/python benchmarks/merge_time_against.py [--steps 120] [--step-sleep 0.002] [--ranks 2] [--repeats 2]

For each policy, a ``Merger`` job of ``--ranks`` gloo ranks on this host (the user's loop of
``tests/merger_loop.py``: a 784-16-10 MLP on MNIST, SGD, every rank sleeping ``--step-sleep`` a step, the last
rank 3x as long, a slower device), traced; ``evomerge calibrate --from-trace`` fits the job's ``[environment]``,
and ``evomerge run --against`` runs the job's steps on that clock; and again on the file fitted from the same
traces with their ``wait_s`` and ``wire_s`` taken out, which is the calibration before them: no ``merge_time`` (the
ranks' own work inside ``merger.step()`` at a step with a merge), no time of that work at the other steps in the
steps, and the all-reduces' links fitted on the whole merge's time. Short steps are where a ``Merger``'s own work
is a large share of a job's time, and where the clock without it came out short (a new user's LSTM job: -34%).
Prints one row per job: the job's seconds, the clock's now and before, their errors, and the fitted
``merge_time``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOOP = ROOT / "tests" / "merger_loop.py"
POLICIES = {
    "allreduce/2": {"scheme": "allreduce", "mean_interval": 2},
    "diloco/5": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                 "outer_lr": 0.7, "outer_momentum": 0.9},
    "ring-gossip/3": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3},
    "slowmo/4": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 2,
                 "outer_every": 4, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.5},
}
STUDY = """
[study]
name = "merge-time"
[data]
dataset = "mnist"
val_size = 500
train_size = 2000
partition = "iid"
[model]
factory = "user_mlp:mlp"
[run]
workers = {workers}
batch_size = 16
steps = {steps}
rounds = 2
score_samples = 8
{environment}
"""
USER_MLP = """
import torch.nn as nn


def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(d: Path, policy: str, args) -> Path:
    """The user's loop on ``args.ranks`` ranks; returns its trace folder."""
    port, procs = free_port(), []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, str(LOOP), "--study", str(d / "s.toml"), "--data-dir", args.data_dir, "--policy",
             str(d / policy), "--out", str(d / "out"), "--step-sleep", str(args.step_sleep), "--slow-rank",
             str(args.ranks - 1), "--slow-factor", "3", "--overlap", "nonblocking"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"the job failed: {err[-2000:]}")
    return d / "out" / "trace-0"


def against(d: Path, cluster: str, policy: str, trace: Path) -> tuple[float, float]:
    (d / "run.toml").write_text(STUDY.format(workers=ARGS.ranks, steps=ARGS.steps,
                                             environment=f'[environment]\nfrom = "{cluster}"'))
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", str(d / "run.toml"), "--policy",
                        str(d / policy), "--data-dir", ARGS.data_dir, "--quiet", "--against", str(trace)],
                       cwd=d, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    m = re.search(r"the job took ([\d.]+) s .*; the clock says ([\d.]+) s", p.stdout)
    if not m:
        raise SystemExit(f"run --against: {p.stdout[-1500:]}{p.stderr[-1500:]}")
    return float(m[1]), float(m[2])


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--step-sleep", type=float, default=0.002)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--json", default=None)
    ARGS = args = ap.parse_args()
    rows = []
    print(f"{args.ranks} ranks on this host, {args.steps} steps, {args.step_sleep * 1e3:g} ms sleep a step (the last "
          f"rank 3x): the job, the clock now and before wait_s (its error), merge_time")
    print(f"{'policy':<14} {'job s':>7} {'now':>7} {'err':>7} {'before':>8} {'err':>7} {'merge_time':>11}")
    for k in range(args.repeats):
        for name in args.policies:  # interleaved: each repeat runs every policy once
            with tempfile.TemporaryDirectory() as tmp:
                d = Path(tmp)
                (d / "user_mlp.py").write_text(USER_MLP)
                (d / "s.toml").write_text(STUDY.format(workers=args.ranks, steps=args.steps, environment=""))
                (d / "p.json").write_text(json.dumps(POLICIES[name]))
                trace = job(d, "p.json", args)
                old = d / "old-trace"  # the same traces as a Merger before wait_s and wire_s wrote them
                old.mkdir()
                for f in trace.glob("rank-*.jsonl"):
                    rows = [json.loads(x) for x in f.read_text().splitlines()]
                    (old / f.name).write_text("".join(json.dumps({k: v for k, v in r.items() if k not in
                                                                  ("wait_s", "wire_s")}) + "\n" for r in rows))
                for src, out in ((trace, "with.toml"), (old, "without.toml")):
                    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "calibrate", "--from-trace", str(src),
                                        "-o", str(d / out)], cwd=d, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                       capture_output=True, text=True)
                    if p.returncode != 0:
                        raise SystemExit(p.stderr[-2000:])
                m = re.search(r"^merge_time = ([\d.e-]+)$", (d / "with.toml").read_text(), re.M)
                mt = float(m[1]) if m else 0.0
                job_s, with_s = against(d, "with.toml", "p.json", trace)
                _, without_s = against(d, "without.toml", "p.json", trace)
            row = dict(policy=name, repeat=k, job=job_s, clock=with_s, clock_without=without_s, merge_time=mt)
            rows.append(row)
            print(f"{name:<14} {job_s:7.3f} {with_s:7.3f} {with_s / job_s - 1:+7.1%} {without_s:8.3f} "
                  f"{without_s / job_s - 1:+7.1%} {mt * 1e3:9.3f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


ARGS = None

if __name__ == "__main__":
    raise SystemExit(main())
