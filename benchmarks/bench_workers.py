"""Many workers in one process: time per sample and peak memory at W = 8, 64, 256 and 1024.

The mnist-gossip run (MLP 784-128-10, batch 32 per worker, push-pull ring gossip every ~10 local
steps, lerp 0.5) with W workers on IID shards of MNIST (at W = 1024 a worker holds ~53 samples:
Dirichlet(0.5) shards cannot all hold the 33 a worker's score slice needs, so the partition is IID
for every W). Each W trains about the same number of samples (2^17, at least 10 local steps), so
the runs take similar time and the time per sample is comparable; flat is the goal.

Each measurement runs in a fresh process (its peak memory is its own), the W's interleaved,
``--repeats`` rounds; the table gives medians: training and merging time per sample (the run's
evaluation excluded), the evaluation's share, and memory: the process's peak RSS, its RSS once
the data and model were set up, their difference (what the run itself added), and on CUDA the
peak of allocated device memory. On a shared machine, fix the threads (EVOMERGE_THREADS=1):
two threads beside a busy process spike. Run:

    EVOMERGE_THREADS=1 .venv/bin/python benchmarks/bench_workers.py [--workers 8 64 256 1024] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 2 ** 17  # --samples changes it


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def one(workers: int, device: str, data_dir: str, samples: int = SAMPLES) -> dict:
    """One run with ``workers`` workers in this process; what it measured."""
    import resource
    import time

    import torch

    from evomerge import simulate, study
    from evomerge.policy import MergePolicy
    from evomerge.procs import apply_threads

    apply_threads()  # as the command line does: the idle cores when it starts, or $EVOMERGE_THREADS
    batch = 32
    steps = max(10, samples // (workers * batch))
    s = study.from_dict({
        "study": {"name": f"workers-{workers}"},
        "data": {"dataset": "mnist", "val_size": 5000, "partition": "iid", "seed": 0},
        "model": {"name": "mlp", "hidden": [128]},
        "run": {"workers": workers, "batch_size": batch, "steps": steps, "lr": 0.05, "rounds": 1,
                "score_samples": 32, "eval_samples": 200},
    })
    t = time.perf_counter()
    setup = simulate.prepare(s, data_dir=data_dir)
    t_setup = time.perf_counter() - t
    rss_setup = _rss_now_mb()  # the data and model in memory (the peak while loading is passed)
    policy = MergePolicy(scheme="gossip", topology="ring", exchange="push_pull", mean_interval=10.0, mixing_weight=0.5)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    r = simulate.simulate(setup, policy, seed=0, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    samples = workers * steps * batch
    return {"workers": workers, "steps": steps, "samples": samples, "status": r.status, "wall": wall,
            "eval": r.eval_time, "us_per_sample": 1e6 * (wall - r.eval_time) / samples, "setup": t_setup,
            "rss_setup_mb": rss_setup, "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20 if device.startswith("cuda") else None,
            "val_accuracy": r.final.val_accuracy, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help=f"training samples per run (at least 10 local steps; default {SAMPLES})")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.device, args.data_dir, args.samples)))
        return
    from evomerge.procs import default_threads

    os.environ.setdefault("EVOMERGE_THREADS", str(default_threads()))  # one decision for every measurement
    results: dict[int, list[dict]] = {w: [] for w in args.workers}
    for rep in range(args.repeats):
        for w in args.workers:  # interleaved: a busy moment of the machine falls on every W alike
            p = subprocess.run([sys.executable, __file__, "--one", str(w), "--device", args.device, "--data-dir", args.data_dir,
                                "--samples", str(args.samples)],
                               capture_output=True, text=True, check=True)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            results[w].append(res)
            print(f"  repeat {rep} W={w}: {res['us_per_sample']:.2f} us/sample, peak {res['rss_peak_mb']:.0f} MB", file=sys.stderr)
    base = statistics.median(r["us_per_sample"] for r in results[args.workers[0]])
    print(f"device {args.device}, {results[args.workers[0]][0]['threads']} torch threads, {args.repeats} repeats "
          f"(medians), {args.samples} samples per run (at least 10 steps)")
    head = ("W", "steps", "us/sample", f"vs W={args.workers[0]}", "eval share", "peak RSS MB", "RSS after setup MB",
            "run added MB", "CUDA peak MB", "val acc")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for w in args.workers:
        rs = results[w]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        cuda = f"{med('cuda_peak_mb'):.0f}" if rs[0]["cuda_peak_mb"] is not None else "-"
        print(f"| {w} | {rs[0]['steps']} | {med('us_per_sample'):.2f} | {med('us_per_sample') / base:.2f} | "
              f"{statistics.median(r['eval'] / r['wall'] for r in rs):.0%} | {med('rss_peak_mb'):.0f} | "
              f"{med('rss_setup_mb'):.0f} | {med('rss_peak_mb') - med('rss_setup_mb'):.0f} | {cuda} | "
              f"{statistics.median(r['val_accuracy'] for r in rs):.4f} |")


if __name__ == "__main__":
    main()
