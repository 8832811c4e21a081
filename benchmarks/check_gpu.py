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
from pathlib import Path

import torch

from evomerge import dist, simulate, study
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy

POLICY_DIR = Path(__file__).resolve().parent.parent / "studies" / "policies"

POLICIES = {
    "no-merging": MergePolicy(scheme="none"),
    "fedavg": MergePolicy(scheme="allreduce", mean_interval=50, weighting="examples"),
    "ring push-pull": MergePolicy(topology="ring", mean_interval=3),
    "communities winner bias": MergePolicy(topology="communities", winner_bias=0.6, lerp="random", mean_interval=2),
    "top-k delta": MergePolicy(topology="ring", payload="delta", topk_fraction=0.1, quantize_bits=4, mean_interval=2),
    "adaptive": MergePolicy(topology="complete", weighting="adaptive", mean_interval=2),
    "schema 2 fields": MergePolicy(topology="communities", regroup_every=2, similarity_bias=0.5, data_exchange_k=16,
                                   retire_threshold=0.9, swap_p=0.2),
    # the field's rules and the newer fields (issues 24 and 26), added after the first GPU check
    "diloco": MergePolicy.load(POLICY_DIR / "diloco.json"),
    "streaming diloco": MergePolicy.load(POLICY_DIR / "streaming-diloco.json"),
    "snoo": MergePolicy.load(POLICY_DIR / "snoo.json"),
    "slowmo over gossip": MergePolicy(topology="ring", mean_interval=2, outer_optimizer="nesterov", outer_lr=0.7,
                                      outer_momentum=0.9, outer_every=10),
    "compressed outer (top-k)": MergePolicy(scheme="allreduce", mean_interval=14, mixing_weight=1.0, payload="delta",
                                            topk_fraction=0.1, outer_optimizer="nesterov", outer_lr=0.7,
                                            outer_momentum=0.9),
    "gradient payload, sign": MergePolicy(scheme="allreduce", mean_interval=1, mixing_weight=1.0, payload="gradient",
                                          quantize_bits=1),
    "swaps + data by similarity": MergePolicy(topology="complete", swap_p=0.3, swap_recency=0.5, swap_confidence=0.5,
                                              data_exchange_k=16, data_similarity_sign=1.0, similarity_bias=0.5),
    "streaming, compressed outer": MergePolicy(scheme="allreduce", mean_interval=14, mixing_weight=1.0,
                                               outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                                               fragments=2, fragment_delay=1, fragment_alpha=0.5, payload="delta",
                                               topk_fraction=0.1, quantize_bits=4),
    "examples-weighted allreduce": MergePolicy(scheme="allreduce", mean_interval=5, weighting="examples"),
}
# on a simulated clock (mnist-stragglers): the simulated times depend on the schedule alone, so they must be equal
CLOCK_POLICIES = {
    "ring gossip": MergePolicy.load(POLICY_DIR / "ring-gossip.json"),
    "async diloco": MergePolicy.load(POLICY_DIR / "async-diloco.json"),
    "allreduce, backup workers": MergePolicy.load(POLICY_DIR / "allreduce-backup.json"),
    "swaps + data by similarity": POLICIES["swaps + data by similarity"],
    "regroup by similarity": MergePolicy(topology="communities", regroup_every=2, similarity_bias=0.5),
    "slowmo over gossip": POLICIES["slowmo over gossip"],
    "streaming, compressed outer": POLICIES["streaming, compressed outer"],
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
    clock(args.data_dir)
    generic()


def clock(data_dir, dev: str = "cuda") -> None:
    """mnist-stragglers (a simulated clock) on CUDA against the CPU: the simulated seconds are the schedule's
    and the cluster's, the same on any device; accuracies agree to a tolerance."""
    st = study.load("mnist-stragglers")
    setup = simulate.prepare(st, data_dir=data_dir)
    print(f"\n{st.name} (simulated clock) on CUDA against the CPU", flush=True)
    print(f"{'policy':<28} {'cpu s':>7} {'cuda s':>7} {'cpu acc':>8} {'cuda acc':>8} {'max |d acc|':>11} "
          f"{'sim times equal':>15}")
    for name, pol in CLOCK_POLICIES.items():
        t = time.perf_counter()
        a = simulate.simulate(setup, pol, 0, device="cpu")
        tc = time.perf_counter() - t
        t = time.perf_counter()
        b = simulate.simulate(setup, pol, 0, device=dev)
        tg = time.perf_counter() - t
        same = [h.sim_time for h in a.history] == [h.sim_time for h in b.history]
        print(f"{name:<28} {tc:7.2f} {tg:7.2f} {a.final.val_accuracy:8.4f} {b.final.val_accuracy:8.4f} "
              f"{compare(a, b):11.4f} {str(same):>15}", flush=True)


def generic(dev: str = "cuda") -> None:
    """Users' own modules on CUDA: every strategy runs (a forced one the model cannot take is refused in one line),
    ``stacked`` and ``loop`` give the same outputs and gradients where no random layer draws, and ``auto``'s pick."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_generic import RowTransformer, bn_cnn, cnn3

    from evomerge.models.generic import GenericModel

    print("\nusers' modules on CUDA: stacked against loop (W = 8, batch 32; eval mode for models with dropout)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, 1, 28, 28, generator=g).to(dev)
    y = torch.randint(0, 10, (8, 32), generator=g).to(dev)
    for name, build in (("BatchNorm CNN", bn_cnn), ("CNN3 + BN + dropout", cnn3), ("transformer on rows", RowTransformer)):
        out, grads, why = {}, {}, {}
        for execution in ("auto", "stacked", "loop"):
            m = GenericModel(build, (1, 28, 28), 10, execution=execution)
            try:
                m.check(x[0, :4], y[0, :4], workers=8, batch=32)
            except ConfigError as e:
                why[execution] = str(e)
                continue
            why[execution] = f"{m.execution} ({m.execution_reason})"
            if execution == "auto":
                continue
            st = m.stack(8, x.device)
            st.set_rows(m.init(torch.Generator().manual_seed(1)).to(dev).expand(8, -1))
            out[execution] = m.forward(st.params, x)
            gr = st.like()
            m.loss_and_grad(st.params, x, y, gr.params)  # a training step runs (with dropout: masks differ)
            if not m.random:
                grads[execution] = gr.rows()
        d_out = (out["stacked"] - out["loop"]).abs().max().item() if len(out) == 2 else None
        d_grad = (grads["stacked"] - grads["loop"]).abs().max().item() if len(grads) == 2 else None
        print(f"{name:<22} auto: {why['auto']}", flush=True)
        if "stacked" not in out:
            print(f"{'':<22} stacked refused: {why['stacked']}")
        print(f"{'':<22} max |stacked - loop|: outputs {d_out}, gradients {d_grad}", flush=True)


if __name__ == "__main__":
    main()
