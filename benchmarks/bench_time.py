"""What the simulated clock costs: wall time per worker-step of a timed run against the lockstep run.

mnist-gossip (16 workers by default, 2 passes over each shard) run three ways, interleaved
and repeated, for a few policies:

  lockstep    no [environment]: today's run
  homogeneous [environment] with equal speeds and free links: the same computation through
              the clock (targets: <= 15% over lockstep)
  lognormal   speeds exp(0.5 z), free links, non-blocking: the workers step at different
              times, so the batched steps hold only the rows that step (target: <= 50%)

The step budget is the same work in every case (W x T local steps), so the figure compared is
training-and-merging wall time (evaluation excluded) per worker-step. Run:

    .venv/bin/python benchmarks/bench_time.py [--workers 16] [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from evomerge import simulate, study
from evomerge.policy import MergePolicy
from evomerge.study import EnvSpec

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {
    "ring gossip every 10": MergePolicy(topology="ring", mean_interval=10.0),
    "complete push-pull every 2, winner 0.5": MergePolicy(topology="complete", mean_interval=2.0, winner_bias=0.5),
    "fedavg (all-reduce every 50)": MergePolicy(scheme="allreduce", mean_interval=50.0, mixing_weight=1.0),
}
ENVS = {"lockstep": None, "homogeneous": EnvSpec(step_time=0.05),
        "lognormal 0.5": EnvSpec(step_time=0.05, speeds="lognormal", sigma=0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    base = study.load("mnist-gossip")
    base = dataclasses.replace(base, run=dataclasses.replace(base.run, workers=args.workers, rounds=2, eval_samples=500))
    setup = simulate.prepare(base, data_dir=args.data_dir)
    W, T = args.workers, setup.total_steps
    print(f"mnist-gossip, {W} workers, {T} local steps each ({W * T} worker-steps); {args.repeats} repeats, interleaved")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for pname, policy in POLICIES.items():
            for ename, env in ENVS.items():
                s = dataclasses.replace(setup, study=dataclasses.replace(base, environment=env))
                t = time.perf_counter()
                r = simulate.simulate(s, policy, 0, device="cpu")
                wall = time.perf_counter() - t - r.eval_time
                steps = W * T if env is None else r.final.steps_mean * W
                times.setdefault((pname, ename), []).append(wall / steps * 1e3)
    print(f"\n{'policy':42s} {'environment':14s} {'ms / worker-step':>17s} {'vs lockstep':>12s}")
    for pname in POLICIES:
        ref = statistics.median(times[(pname, "lockstep")])
        for ename in ENVS:
            m = statistics.median(times[(pname, ename)])
            print(f"{pname:42s} {ename:14s} {m:17.3f} {m / ref:11.2f}x")


if __name__ == "__main__":
    main()
