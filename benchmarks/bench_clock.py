"""What the simulated clock alone costs (no tensors): wall seconds to build the timeline of a shipped study's cluster.

The network's transfers move at their shares of their ends (``evomerge.engine.clock.fair_shares``), and every
start or end of a transfer changes the shares of those through the same ends. This times the clock on the shipped
studies' environments for a merge-heavy policy (push-pull gossip on the complete graph every step) and a light one
(ring every 10), at 16 and 64 workers, the MLP's 101,770 parameters, 800 local steps a worker:

    .venv/bin/python benchmarks/bench_clock.py [--repeats 3] [--studies mnist-two-sites mnist-stragglers]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from evomerge import study
from evomerge.engine import clock, plan
from evomerge.engine import schedule as schedule_mod
from evomerge.policy import MergePolicy

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"complete push-pull every step": MergePolicy(topology="complete", mean_interval=1.0),
            "ring push-pull every 10": MergePolicy(topology="ring", mean_interval=10.0)}
P = 101_770  # the MLP 784-128-10


def build(env, policy, W: int, steps: int) -> tuple[float, int]:
    cost = plan.Bytes(policy, P, [1] * W)
    t = time.perf_counter()
    tl = clock.build(env, policy, W, steps, 10, 0, cost, lambda horizon: schedule_mod.build(policy, W, horizon, 0))
    return time.perf_counter() - t, sum(len(a) for a in tl.actions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--studies", nargs="+", default=["mnist-two-sites", "mnist-stragglers"])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| study | W | policy | seconds (median) | actions |")
    print("|---|---|---|---|---|")
    for name in args.studies:
        env = study.load(ROOT / "studies" / f"{name}.toml").environment
        for W in args.workers:
            for label, policy in POLICIES.items():
                runs = [build(env, policy, W, args.steps) for _ in range(args.repeats)]
                print(f"| {name} | {W} | {label} | {statistics.median(r[0] for r in runs):.3f} | {runs[0][1]} |",
                      flush=True)


if __name__ == "__main__":
    main()
