"""Emulated time: a real distributed run paced to the simulated clock, its wall clock held against it.

Four ranks (one worker each, gloo on 127.0.0.1) run a small MNIST study on an uneven cluster
(speeds 1, 1, 0.8, 0.4; 5 ms links at 100 MB/s; 4 s budget) with ``--emulate-time``: each rank
sleeps until each of its steps and merges is due on the simulated clock. The figure is the
ratio of the measured wall time (training and merging; the round-end evaluation on rank 0 is
not part of the simulated cluster and is excluded) to the simulated time, per policy
(target: within 15%). Run:

    .venv/bin/python benchmarks/bench_emulate.py [--repeats 2] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from evomerge import data as data_mod
from evomerge import simulate, study
from evomerge.backends import launch as distributed
from evomerge.policy import MergePolicy
from evomerge.study import EnvSpec

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {
    "push-pull ring gossip every 4": MergePolicy(topology="ring", mean_interval=4.0),
    "push gossip complete every 2, blocking": MergePolicy(topology="complete", exchange="push", mean_interval=2.0),
    "all-reduce every 5": MergePolicy(scheme="allreduce", mean_interval=5.0, mixing_weight=1.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    raw = {"study": {"name": "emulate"}, "data": {"val_size": 1000, "train_size": 8000},
           "model": {"name": "mlp", "hidden": [64]},
           "run": {"workers": 4, "batch_size": 32, "steps": 200, "rounds": 4, "eval_samples": 500}}
    s = study.from_dict(raw)
    data = data_mod.load("mnist", args.data_dir, val_size=1000, train_size=8000, split_seed=0)
    setup = simulate.prepare(s, data=data)
    envs = {"nonblocking": EnvSpec(step_time=0.02, speeds=(1.0, 1.0, 0.8, 0.4), latency=0.005, bandwidth=1e8,
                                   time_budget=4.0)}
    envs["blocking"] = dataclasses.replace(envs["nonblocking"], overlap="blocking")
    print("4 ranks, one worker each; wall time (evaluation excluded) / simulated time, "
          f"median of {args.repeats}")
    print(f"{'policy':42s} {'overlap':12s} {'simulated s':>11s} {'wall s':>8s} {'ratio':>7s}")
    for name, policy in POLICIES.items():
        env = envs["blocking" if "blocking" in name else "nonblocking"]
        st = dataclasses.replace(setup, study=dataclasses.replace(s, environment=env))
        walls, sim = [], None
        for _ in range(args.repeats):
            r = distributed.simulate(st, policy, 0, procs=4, device="cpu", emulate_time=True)
            walls.append(r.wall_time - r.eval_time)
            sim = r.final.sim_time
        w = statistics.median(walls)
        print(f"{name:42s} {env.overlap:12s} {sim:11.2f} {w:8.2f} {w / sim:7.3f}", flush=True)


if __name__ == "__main__":
    main()
