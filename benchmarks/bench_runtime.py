"""What evomerge.Merger costs in a training loop, side by side with torch's own averaging, in one run.

Two gloo ranks on this machine train the same model (the CNN of examples/deploy/train.py, or an MLP) on MNIST with
the same loop; the arms differ only in how they average, and run interleaved, ``--reps`` times each:

  local            no communication (the floor)
  periodic-50      torch's PeriodicModelAverager(period=50): average_parameters() after each optimiser step
  merger-fedavg-50 evomerge.Merger, scheme allreduce every 50 steps (FedAvg), lockstep
  ddp              DistributedDataParallel (gradients all-reduced in the backward pass)
  merger-allreduce evomerge.Merger, scheme allreduce every step (parameters averaged after each step)

Each arm's figure is the slowest rank's wall time for ``--steps`` steps after a warm-up, median over the reps;
the ratios Merger/PeriodicModelAverager and Merger/DDP are the point. Run on a quiet machine:

    .venv/bin/python benchmarks/bench_runtime.py [--model cnn|mlp] [--steps 300] [--reps 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ARMS = ["local", "periodic-50", "merger-fedavg-50", "ddp", "merger-allreduce"]


def build(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def one_arm(arm: str, args, x, y, rank: int) -> float:
    import evomerge
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    torch.manual_seed(0)
    model = build(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    net, averager, merger = model, None, None
    total = args.warmup + args.steps
    if arm == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    elif arm == "periodic-50":
        averager = PeriodicModelAverager(period=50, warmup_steps=0)
    elif arm.startswith("merger"):
        every = 50 if arm == "merger-fedavg-50" else 1
        merger = evomerge.Merger({"scheme": "allreduce", "mean_interval": every, "mixing_weight": 1.0}, model, opt,
                                 seed=0, total_steps=total, overlap="lockstep")
    g = torch.Generator().manual_seed(rank)
    t0 = 0.0
    for t in range(total):
        if t == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        i = torch.randint(0, len(y), (args.batch,), generator=g)
        opt.zero_grad()  # at the start, as torch's model-averaging example: the averager skips params without grads
        loss = F.cross_entropy(net(x[i]), y[i])
        loss.backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
        if merger is not None:
            merger.step(loss=loss)
    seconds = torch.tensor([time.perf_counter() - t0])
    if merger is not None:
        merger.finish()
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0])


def rank_main(rank: int, world: int, port: int, args, out) -> None:
    from evomerge.data import load

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = load("mnist", args.data_dir, val_size=1000, train_size=8000)
    mine = torch.arange(rank, len(data.train_y), world)
    x = ((data.train_x[mine].float() / 255 - data.spec.mean) / data.spec.std).unsqueeze(1)
    y = data.train_y[mine]
    times = {a: [] for a in ARMS}
    for _ in range(args.reps):
        for arm in ARMS:  # interleaved: every rep runs every arm once
            times[arm].append(one_arm(arm, args, x, y, rank))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    import queue

    while True:
        try:
            times = out.get(timeout=1)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit("a rank failed; see its traceback above")
    for p in procs:
        p.join()
    with open("/proc/loadavg") as fh:
        load_avg = fh.read().split()[:3]
    print(f"{args.world} gloo ranks, {args.model}, batch {args.batch}, {args.steps} steps, {args.reps} reps "
          f"interleaved; load average before the run's end: {' '.join(load_avg)}")
    med = {a: statistics.median(v) for a, v in times.items()}
    print("| arm | s per 100 steps (median) | all reps |")
    print("|---|---|---|")
    for a in ARMS:
        print(f"| {a} | {100 * med[a] / args.steps:.3f} | {', '.join(f'{v:.2f}' for v in times[a])} |")
    print(f"Merger FedAvg-50 / PeriodicModelAverager(50): {med['merger-fedavg-50'] / med['periodic-50']:.3f}x "
          "(target <= 1.05x)")
    print(f"Merger all-reduce every step / DDP: {med['merger-allreduce'] / med['ddp']:.3f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
