"""In-process backend vs plain PyTorch, measured side by side in one run.

For W workers (default 8 and 64) and one epoch-equivalent of mnist-gossip (every
training sample seen once across all workers), times, interleaved and repeated:

  inprocess   evomerge's stacked backend: a full run (ring gossip, one round), timed
              without and with its evaluation (the references do not evaluate)
  central     (a) one nn.Module trained with the combined batch W x B, same steps
  loop        (b) a Python loop over W nn.Module workers, batch B each, same steps
  matmul      (c) a large float32 matmul, for the machine's own multiply rate

and prints medians, ratios, the time per sample, and the fraction of the matmul
rate the in-process run achieves. Run:

    .venv/bin/python benchmarks/bench_inprocess.py [--workers 8 64] [--repeats 5] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from evomerge import simulate, study
from evomerge.policy import MergePolicy

ROOT = Path(__file__).resolve().parent.parent


def make_setup(base: study.Study, data, workers: int) -> simulate.Setup:
    n = len(data.train_y)
    batch = base.run.batch_size
    steps = math.ceil(n / (workers * batch))  # one epoch-equivalent across all workers
    s = dataclasses.replace(base, run=dataclasses.replace(base.run, workers=workers, steps=steps, rounds=1, eval_samples=500))
    return simulate.prepare(s, data=data)


def time_inprocess(setup, policy):
    """(training and merging time, whole run time): the run's evaluation is excluded from the first,
    since the references do not evaluate."""
    t = time.perf_counter()
    r = simulate.simulate(setup, policy, seed=0, device="cpu")
    total = time.perf_counter() - t
    return total - r.eval_time, total


def _indices(setup):
    b = setup.study.run.batch_size
    return np.stack([simulate.batch_indices(s, b, 0, setup.total_steps, 0, w) for w, s in enumerate(setup.shards)], axis=1)


def time_central(setup):
    data, run = setup.data, setup.study.run
    idx = torch.as_tensor(_indices(setup).reshape(setup.total_steps, -1))
    m = setup.model.module()
    opt = torch.optim.SGD(m.parameters(), lr=run.lr)
    t = time.perf_counter()
    for i in range(setup.total_steps):
        bi = idx[i]
        loss = F.cross_entropy(m(simulate.normalise(data.train_x[bi], data.spec)), data.train_y[bi])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t


def time_loop(setup):
    data, run = setup.data, setup.study.run
    idx = torch.as_tensor(_indices(setup))
    mods = [setup.model.module() for _ in range(run.workers)]
    opts = [torch.optim.SGD(m.parameters(), lr=run.lr) for m in mods]
    t = time.perf_counter()
    for i in range(setup.total_steps):
        for w, (m, opt) in enumerate(zip(mods, opts)):
            bi = idx[i, w]
            loss = F.cross_entropy(m(simulate.normalise(data.train_x[bi], data.spec)), data.train_y[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return time.perf_counter() - t


def matmul_rate(n=2048, reps=10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def mlp_flops_per_sample(sizes) -> float:
    """Forward 2*in*out per layer; backward 2x that for every layer but the first (no input gradient)."""
    layers = list(zip(sizes[:-1], sizes[1:]))
    fwd = sum(2 * a * b for a, b in layers)
    return fwd + 2 * fwd - 2 * layers[0][0] * layers[0][1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--study", default="mnist-gossip")
    args = ap.parse_args(argv)

    base = study.load(args.study)
    if base.model.name != "mlp":
        raise SystemExit("this benchmark compares MLP studies")
    from evomerge import data as data_mod

    d = base.data
    data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    setups = {w: make_setup(base, data, w) for w in args.workers}
    policy = MergePolicy(name="ring-gossip")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.study}: MLP {setups[args.workers[0]].model.sizes}, "
          f"batch {base.run.batch_size} per worker, {len(data.train_y)} samples per epoch-equivalent; "
          f"{args.repeats} interleaved repeats, medians")

    kinds = ["inprocess", "central", "loop"]
    whole = {w: [] for w in args.workers}
    times = {(w, k): [] for w in args.workers for k in kinds}
    rates = []
    for w in args.workers:  # warm-up: first calls allocate and load kernels
        time_inprocess(setups[w], policy), time_central(setups[w])
    for r in range(args.repeats):
        rates.append(matmul_rate())
        for w in args.workers:
            order = kinds if r % 2 == 0 else kinds[::-1]
            for k in order:
                s = setups[w]
                if k == "inprocess":
                    train, total = time_inprocess(s, policy)
                    times[w, k].append(train)
                    whole[w].append(total)
                else:
                    times[w, k].append(time_central(s) if k == "central" else time_loop(s))
    rate = statistics.median(rates)

    print(f"\nmatmul rate (c): {rate / 1e9:.1f} GFLOP/s (2048 x 2048 float32)\n")
    head = (f"{'W':>4} {'steps':>6} {'inprocess s':>12} {'(with eval)':>12} {'central s (a)':>14} {'loop s (b)':>11} "
            f"{'in/(a)':>7} {'(b)/in':>7} {'us/sample':>10} {'% of (c)':>9}")
    print(head)
    print("-" * len(head))
    per_sample = {}
    for w in args.workers:
        s = setups[w]
        med = {k: statistics.median(times[w, k]) for k in kinds}
        samples = s.total_steps * w * base.run.batch_size
        per_sample[w] = med["inprocess"] / samples
        achieved = samples * mlp_flops_per_sample(s.model.sizes) / med["inprocess"]
        print(f"{w:>4} {s.total_steps:>6} {med['inprocess']:>12.3f} {statistics.median(whole[w]):>12.3f} "
              f"{med['central']:>14.3f} {med['loop']:>11.3f} "
              f"{med['inprocess'] / med['central']:>7.2f} {med['loop'] / med['inprocess']:>7.2f} "
              f"{per_sample[w] * 1e6:>10.2f} {100 * achieved / rate:>8.0f}%")
    if len(args.workers) > 1:
        lo, hi = min(args.workers), max(args.workers)
        print(f"\ntime per sample, W={hi} / W={lo}: {per_sample[hi] / per_sample[lo]:.2f} (1.00 = flat)")
    print("targets: in/(a) <= 1.2, (b)/in >= 3, time per sample flat from W=8 to W=64")


if __name__ == "__main__":
    main()
