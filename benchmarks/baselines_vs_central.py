"""Validation accuracy of every baseline against one model trained centrally with the
combined batch (same samples, same number of steps), on IID and label-skewed shards.

    .venv/bin/python benchmarks/baselines_vs_central.py [--seeds 0 1 2] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from evomerge import data as data_mod
from evomerge import reference, simulate, study

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args(argv)
    base = study.load(args.study)
    d = base.data
    data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    partitions = [("iid", dataclasses.replace(d, partition="iid")), (f"dirichlet({d.alpha:g})", d)]
    names = ["central (combined batch)", *base.baselines]
    rows = {}
    for label, dspec in partitions:
        setup = simulate.prepare(dataclasses.replace(base, data=dspec), data=data)
        accs = {n: [] for n in names}
        for seed in args.seeds:
            accs[names[0]].append(reference.val_accuracy(setup, reference.train_central(setup, seed)))
            for b in base.baselines:
                accs[b].append(simulate.simulate(setup, base.resolve_policy(b), seed).final.val_accuracy)
        rows[label] = (setup, accs)
    print(f"{args.study}: validation accuracy, mean +- sd over seeds {args.seeds}")
    print(f"{'policy':<26}" + "".join(f"{label + ' (skew %.2f)' % rows[label][0].label_skew:>28}" for label in rows))
    for n in names:
        cells = []
        for label in rows:
            v = rows[label][1][n]
            cells.append(f"{statistics.mean(v):.4f} +- {statistics.stdev(v) if len(v) > 1 else 0:.4f}")
        print(f"{n:<26}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
