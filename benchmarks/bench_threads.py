"""1 or 2 torch threads per process, on a quiet machine and beside a competing busy process.

For each configuration a fresh process loads mnist-gossip once and times whole runs
(ring gossip every 10 steps; the merge-heavy policy: complete graph, push, mean interval
1.5, adaptive weighting, winner bias 0.5). The configurations are interleaved and
repeated; the table gives medians and the ratio to 2 threads on the quiet machine. The
competing process is a pure-Python busy loop (one core), as another user's job would be.

    .venv/bin/python benchmarks/bench_threads.py [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
from evomerge import simulate, study
from evomerge.policy import MergePolicy
threads, data_dir = int(sys.argv[1]), sys.argv[2] or None
torch.set_num_threads(threads)
setup = simulate.prepare(study.load("mnist-gossip"), data_dir=data_dir)
pols = {"ring gossip every 10": MergePolicy(topology="ring", mean_interval=10),
        "merge-heavy": MergePolicy(topology="complete", exchange="push", mean_interval=1.5, weighting="adaptive",
                                   winner_bias=0.5)}
simulate.simulate(setup, pols["ring gossip every 10"], 0, device="cpu")  # warm-up
out = {}
for name, pol in pols.items():
    t = time.perf_counter()
    simulate.simulate(setup, pol, 0, device="cpu")
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default="")
    args = ap.parse_args()
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for rep in range(args.repeats):
        for load in ("quiet", "busy"):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                for threads in (1, 2):
                    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), args.data_dir], check=True,
                                         capture_output=True, text=True).stdout
                    for name, t in json.loads(out.strip().splitlines()[-1]).items():
                        results.setdefault((load, threads), {}).setdefault(name, []).append(t)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        print(f"repeat {rep + 1} done", file=sys.stderr)
    ref = {name: statistics.median(ts) for name, ts in results[("quiet", 2)].items()}
    print(f"mnist-gossip, one run each, medians of {args.repeats} (ratio to 2 threads on a quiet machine)")
    print("| machine | threads | " + " | ".join(ref) + " |")
    print("|---|---|" + "---|" * len(ref))
    for (load, threads), by in results.items():
        cells = [f"{statistics.median(by[n]):.2f} s ({statistics.median(by[n]) / ref[n]:.2f})" for n in ref]
        print(f"| {load} | {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
