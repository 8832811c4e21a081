"""What reading published state costs a policy (issue 24, schema 10's ``publish_every``): the same decisions by
similarity read at each event's instant (0) or from what the workers published every k steps, on a time study.

Complete-graph push-pull gossip every 4 local steps with peers drawn by similarity (``similarity_bias`` -0.5 and
+0.5, sketch), at the study's own lr, each publication interval run on the study's fresh seeds (seeds no search
used, fresh clusters). Prints each variant's simulated time to the study's target and final accuracy, means over
the seeds. The figures are simulated: the machine's load does not change them. Run:

    .venv/bin/python benchmarks/compare_publish.py [--study mnist-stragglers] [--every 0 4 16] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from evomerge import simulate, study
from evomerge.policy import MergePolicy
from evomerge.search.baselines import fresh_seeds

ROOT = Path(__file__).resolve().parent.parent
BASE = MergePolicy(topology="complete", mean_interval=4.0, exchange="push_pull")


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mnist-stragglers")
    ap.add_argument("--every", type=int, nargs="+", default=[0, 4, 16])
    ap.add_argument("--biases", type=float, nargs="+", default=[-0.5, 0.5])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    full = study.load(args.study)
    setup = simulate.prepare(full, data_dir=args.data_dir)
    seeds = fresh_seeds(full, args.seeds)
    print(f"{full.name}: target {full.target}, fresh seeds {seeds}; a miss counts past the run's length (the "
          "objective's own penalty)")
    print("\n| similarity_bias | publish_every | time to target (s), mean | per seed | final accuracy, mean |")
    print("|---|---|---|---|---|")
    for bias in args.biases:
        for k in args.every:
            policy = BASE.replace(similarity_bias=bias, publish_every=k)
            times, accs = [], []
            for seed in seeds:
                r = simulate.simulate(setup, policy, seed)
                times.append(r.final.time_to_target)
                accs.append(r.final.val_accuracy)
            per = " / ".join(f"{t:.2f}" for t in times)
            print(f"| {bias:+g} | {k} | {statistics.mean(times):.2f} | {per} | {statistics.mean(accs):.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
