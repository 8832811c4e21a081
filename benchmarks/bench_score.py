"""The winner test's two scores side by side: ``holdout`` (both models' loss on the pair's validation slices, one
forward per merge) against ``running`` (each model's running training loss, no forward; what evomerge.Merger runs).

1. What they find: winner-biased policies on mnist-gossip (final validation accuracy) and mnist-stragglers (simulated
   time to 0.88), seeds 0..2, both scores.
2. What they cost: the merge-heavy policy (complete graph, push, every 1.5 steps, adaptive weighting, winner bias
   0.5) against the same run without merging, in process on mnist-gossip, interleaved, ``--reps`` each.

    .venv/bin/python benchmarks/bench_score.py [--seeds 0 1 2] [--reps 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from evomerge import simulate, study
from evomerge.policy import MergePolicy

P = MergePolicy
POLICIES = {
    "complete push /1.5 adaptive wb0.5": P(topology="complete", exchange="push", mean_interval=1.5, weighting="adaptive",
                                           winner_bias=0.5),
    "complete push-pull /10.7 adaptive wb0.08": P(topology="complete", exchange="push_pull", mean_interval=10.7,
                                                  mixing_weight=0.5, weighting="adaptive", winner_bias=0.08),
    "ring push-pull /4 wb0.8": P(topology="ring", exchange="push_pull", mean_interval=4, winner_bias=0.8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    print("| study | policy | holdout | running |")
    print("|---|---|---|---|")
    for name, metric in (("mnist-gossip", "val_accuracy"), ("mnist-stragglers", "time_to_target")):
        setup = simulate.prepare(study.load(name), data_dir=args.data_dir)
        for label, pol in POLICIES.items():
            cells = []
            for score in ("holdout", "running"):
                vals = [simulate.simulate(setup, dataclasses.replace(pol, score=score), s).metrics()[metric]
                        for s in args.seeds]
                cells.append(f"{statistics.mean(vals):.4f} ({', '.join(f'{v:.4f}' for v in vals)})")
            print(f"| {name} ({metric}) | {label} | {cells[0]} | {cells[1]} |", flush=True)
    setup = simulate.prepare(study.load("mnist-gossip"), data_dir=args.data_dir)
    heavy = POLICIES["complete push /1.5 adaptive wb0.5"]
    arms = {"no merging": P(scheme="none"), "holdout": heavy, "running": dataclasses.replace(heavy, score="running")}
    times = {k: [] for k in arms}
    for _ in range(args.reps):
        for k, pol in arms.items():
            t = time.perf_counter()
            simulate.simulate(setup, pol, 0)
            times[k].append(time.perf_counter() - t)
    with open("/proc/loadavg") as fh:
        load_avg = " ".join(fh.read().split()[:3])
    base = statistics.median(times["no merging"])
    print(f"\ncost in process on mnist-gossip, {args.reps} reps interleaved (load average at the end: {load_avg})")
    for k, v in times.items():
        print(f"  {k}: median {statistics.median(v):.2f} s ({', '.join(f'{x:.2f}' for x in v)}), "
              f"{statistics.median(v) / base:.2f}x no merging")


if __name__ == "__main__":
    main()
