"""Is each shipped study's inner lr sensible? A short lr sweep of all-reduce after every step (synchronous SGD,
the rule that wants the largest step) and of the study's ring gossip baseline (issue 26, part 5).

    .venv/bin/python benchmarks/lr_sweep.py [--studies mnist-gossip ...] [--lrs 0.025 0.05 0.1 0.2 0.4] [--seeds 0 1]

Prints, per study, the objective (validation accuracy, or simulated seconds to the target on the time studies)
of each policy at each lr, mean over the seeds. Every figure is simulated, so the machine's load does not change it.
"""

from __future__ import annotations

import argparse
import os
import statistics

from evomerge import simulate, study as study_mod
from evomerge.study import with_run

STUDIES = ["mnist-gossip", "mnist-skewed", "mnist-stragglers", "mnist-two-sites", "mnist-gossip-64"]


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser()
    ap.add_argument("--studies", nargs="+", default=STUDIES)
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.025, 0.05, 0.1, 0.2, 0.4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--policies", nargs="+", default=["allreduce", "ring-gossip"])
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR", "../shared/data"))
    args = ap.parse_args()
    for name in args.studies:
        s = study_mod.load(name)
        data = simulate.prepare(s, data_dir=args.data_dir).data
        obj = s.objectives[0]
        print(f"\n{name} (study lr {s.run.lr:g}; {obj}, mean over seeds {args.seeds})")
        print("| policy | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " |")
        print("|---|" + "---|" * len(args.lrs))
        for ref in args.policies:
            pol = s.resolve_policy(ref)
            row = []
            for lr in args.lrs:
                setup = simulate.prepare(with_run(s, {"lr": lr}), data=data)
                finals = [simulate.simulate(setup, pol, seed).final for seed in args.seeds]
                vals = [getattr(f, obj) for f in finals]
                bad = sum(f.val_accuracy != f.val_accuracy or f.val_accuracy < 0.2 for f in finals)
                row.append(f"{statistics.fmean(vals):.4g}" + (" (diverged)" if bad else ""))
            print(f"| {ref} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
