"""A plain PyTorch training loop that deploys a merge policy found by ``evomerge search``.

    torchrun --nproc-per-node 4 examples/deploy/train.py --policy best.json [--slow-rank 3 --slow-factor 4]

Each process is one worker: its own shard of the training set, its own optimiser (the one an exported policy was
found with, at its lr, unless ``--optimizer`` / ``--lr`` say otherwise; another optimiser starts at its own default,
1e-3 for Adam(W) and 0.05 for SGD; with a plain policy file, AdamW at 1e-3), AMP on CUDA. evomerge's part is
three lines: build the ``Merger``, call ``merger.step(loss=...)`` after each optimiser step, and ``finish()`` at
the end, which leaves the consensus model (every rank's model averaged) on every rank. ``--slow-rank R
--slow-factor F`` makes rank R sleep (F - 1) times its compute after each step: a device F times slower.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import evomerge
from evomerge.data import load
from evomerge.runtime import read_policy_and_run


def cnn() -> nn.Module:
    """The example's model, on images of [N, 28, 28] as evomerge's studies give them (``job.toml`` beside this file
    names it, so that ``evomerge run --against`` can hold this job's traces to the clock)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28)),  # [N, 28, 28] -> [N, 1, 28, 28]
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", required=True, help="a policy or exported JSON file (evomerge export)")
    ap.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--train-size", type=int, default=0, help="training samples to use (0: all)")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=0, help="local steps per rank (overrides --epochs)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--optimizer", default=None, choices=["adamw", "adam", "sgd"],
                    help="default: the exported policy's (its 'run'), else adamw")
    ap.add_argument("--lr", type=float, default=None,
                    help="default: the exported policy's with its optimiser; else 1e-3 for adam(w), 0.05 for sgd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout-size", type=int, default=32,
                    help="examples of each rank's shard kept out of training for the winner test of a policy that "
                         "scores on held-out examples (score 'holdout'; the studies' score_samples)")
    ap.add_argument("--overlap", default="nonblocking", choices=["nonblocking", "blocking", "lockstep"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--trace", default=None, help="a directory for each rank's trace (JSON Lines)")
    ap.add_argument("--speeds", type=float, nargs="+", default=None,
                    help="each rank's speed in steps per second (asynchronous DiLoCo with local_steps_by_speed)")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 0))
    bad = [("RANK", "not set: start this script with torchrun (torchrun --nproc-per-node N train.py ...), or a "
                    "launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT") if "RANK" not in os.environ
            else None,
           ("--batch-size", f"{args.batch_size}; allowed: >= 1") if args.batch_size < 1 else None,
           ("--steps", f"{args.steps}; allowed: >= 0 (0: --epochs)") if args.steps < 0 else None,
           ("--epochs", f"{args.epochs}; allowed: > 0") if not args.epochs > 0 else None,
           ("--timeout", f"{args.timeout}; allowed: > 0 seconds") if not args.timeout > 0 else None,
           ("--slow-rank", f"{args.slow_rank}; allowed: -1 (none) or a rank, 0..{world - 1}")
           if not -1 <= args.slow_rank < max(world, 1) else None]
    bad = [b for b in bad if b]
    if bad:  # one line, from one rank
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {bad[0][0]}: {bad[0][1]}", file=sys.stderr, flush=True)
        return 2

    try:  # the policy, and the optimiser and step size it was found with: the best merge policy depends on them
        policy, found = read_policy_and_run(args.policy)
    except evomerge.ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank reads it: one says why
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2

    # a GPU per rank with NCCL; ranks that share one GPU talk through host memory under gloo; else the CPU
    dev, backend = evomerge.rank_device()
    # --timeout bounds the start too: a rank that never comes ends the others' wait (torch's default is 30 minutes)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    except (RuntimeError, ValueError) as e:  # DistStoreError, a rank that never joined
        print(f"error: the ranks did not all start within --timeout {args.timeout:g} s "
              f"({str(e).splitlines()[0][:200]}); stopped", file=sys.stderr, flush=True)
        return 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cpu":  # the ranks on this machine share its cores: torchrun says how many; netlab does not
        local = os.environ.get("LOCAL_WORLD_SIZE")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (int(local) if local else evomerge.ranks_on_this_machine())))

    data = load(args.dataset, args.data_dir, val_size=2000, train_size=args.train_size)
    mean, std = data.spec.mean, data.spec.std
    mine = torch.arange(rank, len(data.train_y), world)  # this rank's shard
    holdout = None
    if evomerge.Merger.needs_holdout(policy):  # the winner test's examples, kept out of training
        held, mine = mine[:args.holdout_size], mine[args.holdout_size:]
        holdout = (((data.train_x[held].float() / 255 - mean) / std).to(dev), data.train_y[held].to(dev))
    x_train = (data.train_x[mine].float() / 255 - mean) / std
    y_train = data.train_y[mine]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train), batch_size=args.batch_size,
                                         shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed * 1000 + rank))
    if len(loader) == 0:  # (with --steps the loop waited for a batch that never came)
        if rank == 0:
            print(f"error: --batch-size: {args.batch_size} is more than a rank's shard ({len(y_train)} examples to "
                  f"train on); allowed: at most {len(y_train)}, or more --train-size", file=sys.stderr, flush=True)
        return 2
    steps = args.steps or max(1, int(args.epochs * len(loader)))

    torch.manual_seed(args.seed)
    model = cnn().to(dev)
    kind = args.optimizer or found.get("optimizer", "adamw")
    # the exported step size belongs to the exported optimiser: another optimiser starts from its own default
    default_lr = {"sgd": 0.05}.get(kind, 1e-3)
    lr = args.lr if args.lr is not None else (found["lr"] if kind == found.get("optimizer") and "lr" in found
                                              else default_lr)
    # the found optimiser's other settings (weight decay, SGD's momentum, Adam's betas and eps), with that optimiser
    keys = {"sgd": ("weight_decay", "momentum"), "adam": ("weight_decay", "betas", "eps"),
            "adamw": ("weight_decay", "betas", "eps")}[kind]
    extra = {k: found[k] for k in keys if k in found} if kind == found.get("optimizer") else {}
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    optimizer = cls(model.parameters(), lr=lr, **extra)
    scaler = torch.amp.GradScaler("cuda", enabled=dev.type == "cuda")
    step = 0
    try:
        merger = evomerge.Merger(args.policy, model, optimizer, seed=args.seed, total_steps=steps,
                                 overlap=args.overlap, timeout=args.timeout, trace=args.trace, speeds=args.speeds,
                                 holdout=holdout)
        t0 = time.perf_counter()
        while step < steps:
            for x, y in loader:
                if step == steps:
                    break
                tc = time.perf_counter()
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                with torch.autocast(dev.type, enabled=dev.type == "cuda"):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                if rank == args.slow_rank and args.slow_factor > 1:  # a slower device
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    time.sleep((args.slow_factor - 1) * (time.perf_counter() - tc))
                merger.step(loss=loss)
                step += 1
        merger.finish()  # the consensus model, on every rank (it waits for the slowest rank's last merges)
        seconds = time.perf_counter() - t0  # the run's time: this rank's loop alone would leave out a slower rank
    except evomerge.ConfigError as e:  # a bad policy or argument: one line, before any merge
        if rank == 0:  # the Merger's speeds come from this script's --speeds
            print(f"error: {'--speeds: ' + e.message if e.field == 'speeds' else e}", file=sys.stderr, flush=True)
        return 2
    except evomerge.MergerError as e:  # a peer died or hangs: one line, and leave the broken group as it is
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    except KeyboardInterrupt:  # Ctrl-C, which torchrun passes to every rank: one line, not a traceback per rank
        if rank == 0:
            print(f"interrupted at local step {step} of {steps}; stopped", file=sys.stderr, flush=True)
        os._exit(130)  # every rank stops where it is: nothing to finish the run with (as for a dead peer)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            xv = ((data.val_x.float() / 255 - mean) / std).to(dev)
            acc = (model(xv).argmax(1).cpu() == data.val_y).float().mean().item()
        print(f"consensus val accuracy {acc:.4f} after {steps} steps per rank, {merger.merges} merges on rank 0, "
              f"{seconds:.1f} s to the consensus on {world} ranks ({kind}, lr {lr:g}"
              + (f"; {torch.get_num_threads()} torch thread{'s' * (torch.get_num_threads() != 1)} per rank"
                 if dev.type == "cpu" else "") + ")", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (reading the data, the start, the evaluation)
        if os.environ.get("RANK", "0") == "0":
            print("interrupted; stopped", file=sys.stderr, flush=True)
        os._exit(130)
