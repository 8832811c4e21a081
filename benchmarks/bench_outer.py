"""DiLoCo's outer step against the plain merges on a shipped study: final validation accuracy and bytes.

    .venv/bin/python benchmarks/bench_outer.py [--study mnist-gossip] [--seeds 0 1 2] [--every 14]

Every policy runs at the study's own inner lr; the outer step acts partly as a larger step size, so
read the table beside an lr sweep (issue: tuned rivals), not as a verdict.
"""

from __future__ import annotations

import argparse
import os
import statistics

from evomerge import simulate, study
from evomerge.policy import MergePolicy as P


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--every", type=int, default=14, help="local steps between all-reduces")
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR", "../shared/data"))
    args = ap.parse_args()
    s = study.load(args.study)
    setup = simulate.prepare(s, data_dir=args.data_dir)
    h = args.every
    policies = {
        f"diloco (nesterov 0.7, 0.9) every {h}": P(scheme="allreduce", mean_interval=h, mixing_weight=1.0,
                                                   outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9),
        f"outer sgd (0.7, 0.9) every {h}": P(scheme="allreduce", mean_interval=h, mixing_weight=1.0,
                                             outer_optimizer="sgd", outer_lr=0.7, outer_momentum=0.9),
        f"fedavg every {h}": P(scheme="allreduce", mean_interval=h, mixing_weight=1.0),
        "fedavg every 50": P(scheme="allreduce", mean_interval=50, mixing_weight=1.0),
        "all-reduce every step": P(scheme="allreduce", mean_interval=1, mixing_weight=1.0),
        "ring gossip (push-pull, ~10 steps)": P(),
    }
    print(f"{args.study}: {setup.total_steps} local steps, {s.run.workers} workers, inner lr {s.run.lr}, "
          f"seeds {args.seeds}")
    print(f"| policy | val accuracy (mean over seeds) | MB sent |\n|---|---|---|")
    for name, pol in policies.items():
        runs = [simulate.simulate(setup, pol, seed) for seed in args.seeds]
        acc = [r.final.val_accuracy for r in runs]
        print(f"| {name} | {statistics.mean(acc):.4f} | {runs[0].final.bytes / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
