"""In-process backend vs the torch.distributed backend on the same runs, side by side in one run.

For mnist-gossip (8 workers, 428 local steps) and a few policies, runs each policy
alternately on both backends (repeated, medians) and splits the distributed backend's
wall time into

  start-up   spawning the processes, importing torch there, receiving the data,
             the gloo rendezvous (everything before the first local step)
  training   local steps and merges (evaluation excluded, for both backends)

and prints ratios to the in-process backend's training time. The distributed runs
use one process per worker (8) and, to show what grouping buys, 2 processes of 4
workers each. The machine has 2 cores: 8 processes share them. ``--start`` adds the
ranks started the other way (``spawn``: a fresh interpreter per rank, as before the
fork server) beside the default, interleaved, for the start-up's comparison. Run:

    .venv/bin/python benchmarks/bench_backends.py [--repeats 3] [--data-dir DIR] [--study mnist-gossip] [--start spawn]
"""

from __future__ import annotations

import argparse
import statistics
import time

from evomerge import dist, simulate, study
from evomerge.policy import MergePolicy

POLICIES = {
    "ring gossip every 10": MergePolicy(scheme="gossip", topology="ring", mean_interval=10),
    "complete gossip every 2": MergePolicy(scheme="gossip", topology="complete", mean_interval=2),
    "FedAvg every 50": MergePolicy(scheme="allreduce", mean_interval=50, weighting="examples"),
    "top-k delta every 2": MergePolicy(scheme="gossip", topology="ring", mean_interval=2, payload="delta",
                                       topk_fraction=0.05, quantize_bits=8),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--start", nargs="*", choices=("spawn",), default=[],
                    help="also time the distributed runs with their ranks started this way (spawn)")
    ap.add_argument("--policies", nargs="*", choices=list(POLICIES), default=list(POLICIES))
    args = ap.parse_args()
    st = study.load(args.study)
    setup = simulate.prepare(st, data_dir=args.data_dir)
    W = st.run.workers
    variants = [("inprocess", None, None), ("distributed", W, None), ("distributed", 2, None)]
    variants += [("distributed", procs, m) for m in args.start for procs in (W, 2)]
    print(f"{st.name}: {W} workers, {setup.total_steps} local steps, {args.repeats} repeats (medians)\n")
    print(f"{'policy':<24} {'backend':<22} {'start-up s':>10} {'training s':>10} {'train/in':>9} {'total/in':>9} {'val acc':>8}")
    for name, pol in ((n, POLICIES[n]) for n in args.policies):
        times: dict = {v: {"start": [], "train": [], "acc": []} for v in variants}
        for _ in range(args.repeats):
            for v in variants:  # interleaved, so drift hits all alike
                backend, procs, start = v
                t = time.perf_counter()
                if backend == "inprocess":
                    res = simulate.simulate(setup, pol, 0, device="cpu")
                else:
                    res = dist.simulate(setup, pol, 0, device="cpu", procs=procs, _start=start)
                total = time.perf_counter() - t
                times[v]["start"].append(total - res.wall_time)
                times[v]["train"].append(res.wall_time - res.eval_time)
                times[v]["acc"].append(res.final.val_accuracy)
        base = statistics.median(times[variants[0]]["train"])
        for v in variants:
            backend, procs, start = v
            m = {k: statistics.median(x) for k, x in times[v].items()}
            label = backend if procs is None else f"{backend} x{procs}" + (f" {start}" if start else "")
            print(f"{name:<24} {label:<22} {m['start']:>10.2f} {m['train']:>10.2f} {m['train'] / base:>9.2f} "
                  f"{(m['start'] + m['train']) / base:>9.2f} {m['acc']:>8.4f}")
        print()


if __name__ == "__main__":
    main()
