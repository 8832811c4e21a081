"""What merging costs in a run: merge-heavy policies against the same study with no merging.

Runs, interleaved and repeated (medians), one mnist-gossip run (8 workers, 428 local
steps) of each policy below, with the step-batched merges of the product and, for
comparison, with the event-by-event merges they replaced (kept in
``tests/merge_reference.py``). Prints each run's time and its ratio to no merging in the
same repeat. Run:

    .venv/bin/python benchmarks/bench_merges.py [--repeats 3] [--threads 2] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from evomerge import simulate, study
from evomerge.policy import MergePolicy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from merge_reference import reference_simulate  # noqa: E402

POLICIES = {
    "no merging": MergePolicy(scheme="none"),
    "ring gossip every 10": MergePolicy(scheme="gossip", topology="ring", mean_interval=10),
    "merge-heavy (complete, push, 1.5, adaptive, winner 0.5)": MergePolicy(
        scheme="gossip", topology="complete", exchange="push", mean_interval=1.5, weighting="adaptive", winner_bias=0.5),
    "complete push-pull every 1.2, uniform": MergePolicy(scheme="gossip", topology="complete", mean_interval=1.2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-reference", action="store_true", help="skip the event-by-event runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = study.load(args.study)
    setup = simulate.prepare(s, data_dir=args.data_dir)
    ways = {"step-batched": simulate.simulate}
    if not args.no_reference:
        ways["event-by-event"] = reference_simulate
    times: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    simulate.simulate(setup, POLICIES["no merging"], 0, device="cpu")  # warm-up
    for rep in range(args.repeats):
        base = None
        for name, pol in POLICIES.items():
            for way, fn in ways.items():
                if name == "no merging" and way != "step-batched":
                    continue
                t = time.perf_counter()
                fn(setup, pol, 0, device="cpu")
                dt = time.perf_counter() - t
                times.setdefault((name, way), []).append(dt)
                if name == "no merging":
                    base = dt
                ratios.setdefault((name, way), []).append(dt / base)
        print(f"repeat {rep + 1} done", file=sys.stderr)
    print(f"{s.name}: {s.run.workers} workers, {setup.total_steps} local steps, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}")
    print("| policy | merges | run s | / no merging |")
    print("|---|---|---|---|")
    for (name, way), ts in times.items():
        print(f"| {name} | {way} | {statistics.median(ts):.2f} | {statistics.median(ratios[(name, way)]):.2f} |")


if __name__ == "__main__":
    main()
