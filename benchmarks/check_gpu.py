"""The CUDA paths, checked on a machine with a GPU (not part of the tests: CI has none).

1. The in-process backend on CUDA against the CPU, per policy: per-round metrics agree to
   a tolerance (different kernels, so not bitwise), and the time of each.
2. The distributed backend on CUDA (NCCL, one process per GPU) against the in-process
   backend on CUDA; and that asking for more processes than GPUs is refused clearly.
3. A population on CUDA (every policy above as one member, merges applied together) against
   each member run alone on CUDA. Trials per minute: benchmarks/bench_population.py --device cuda.

    python benchmarks/check_gpu.py [--data-dir DIR] [--study mnist-gossip]
"""

from __future__ import annotations

import argparse
import time

import torch

from evomerge import dist, simulate, study
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy

POLICIES = {
    "no-merging": MergePolicy(scheme="none"),
    "fedavg": MergePolicy(scheme="allreduce", mean_interval=50, weighting="examples"),
    "ring push-pull": MergePolicy(topology="ring", mean_interval=3),
    "communities winner bias": MergePolicy(topology="communities", winner_bias=0.6, lerp="random", mean_interval=2),
    "top-k delta": MergePolicy(topology="ring", payload="delta", topk_fraction=0.1, quantize_bits=4, mean_interval=2),
    "adaptive": MergePolicy(topology="complete", weighting="adaptive", mean_interval=2),
    "schema 2 fields": MergePolicy(topology="communities", regroup_every=2, similarity_bias=0.5, data_exchange_k=16,
                                   retire_threshold=0.9, swap_p=0.2),
}


def compare(a, b) -> float:
    return max(abs(x.val_accuracy - y.val_accuracy) for x, y in zip(a.history, b.history))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    st = study.load(args.study)
    setup = simulate.prepare(st, data_dir=args.data_dir)
    simulate.simulate(setup, POLICIES["no-merging"], 0, device="cuda")  # warm-up
    print(f"{'policy':<26} {'cpu s':>7} {'cuda s':>7} {'cpu acc':>8} {'cuda acc':>8} {'max |d acc|':>11} {'bytes equal':>11}")
    for name, pol in POLICIES.items():
        t = time.perf_counter()
        a = simulate.simulate(setup, pol, 0, device="cpu")
        tc = time.perf_counter() - t
        t = time.perf_counter()
        b = simulate.simulate(setup, pol, 0, device="cuda")
        tg = time.perf_counter() - t
        same_bytes = [h.bytes for h in a.history] == [h.bytes for h in b.history] if not pol.data_exchange_k else "n/a"
        print(f"{name:<26} {tc:7.2f} {tg:7.2f} {a.final.val_accuracy:8.4f} {b.final.val_accuracy:8.4f} "
              f"{compare(a, b):11.4f} {str(same_bytes):>11}", flush=True)
    print("\ndistributed on CUDA (NCCL, 1 process holding all workers) against in-process on CUDA", flush=True)
    for name in ("ring push-pull", "fedavg", "top-k delta"):
        pol = POLICIES[name]
        a = simulate.simulate(setup, pol, 0, device="cuda")
        t = time.perf_counter()
        b = dist.simulate(setup, pol, 0, device="cuda", procs=1)
        print(f"{name:<26} dist {time.perf_counter() - t:6.2f} s  in-process acc {a.final.val_accuracy:.4f}  "
              f"dist acc {b.final.val_accuracy:.4f}  max |d acc| {compare(a, b):.5f}  "
              f"bytes equal {[h.bytes for h in a.history] == [h.bytes for h in b.history]}", flush=True)
    from evomerge.backends.population import Member, run_population

    print("\na population on CUDA (merges together) against each member alone on CUDA", flush=True)
    pols = list(POLICIES.items())
    t = time.perf_counter()
    together = run_population(setup, [Member(p, 0) for _, p in pols], "cuda", cross=True)
    tp = time.perf_counter() - t
    t = time.perf_counter()
    alone = [simulate.simulate(setup, p, 0, device="cuda") for _, p in pols]
    ta = time.perf_counter() - t
    for (name, _), a, b in zip(pols, alone, together):
        print(f"{name:<26} alone acc {a.final.val_accuracy:.4f}  in the population {b.final.val_accuracy:.4f}  "
              f"max |d acc| {compare(a, b):.5f}", flush=True)
    print(f"{len(pols)} members: one at a time {ta:.2f} s, as one population {tp:.2f} s ({ta / tp:.2f}x)", flush=True)
    try:
        dist.simulate(setup, POLICIES["ring push-pull"], 0, device="cuda", procs=st.run.workers)
        print("more processes than GPUs: NOT refused")
    except ConfigError as e:
        print(f"more processes than GPUs: refused: {e}")


if __name__ == "__main__":
    main()
