"""A user's own training loop with ``evomerge.Merger``, as tests/test_runtime.py launches it: one process per
rank (torchrun, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).

It trains the study's model as a plain ``nn.Module`` with ``torch.optim.SGD`` on the study's data, in the
order evomerge's engine draws it (the worker's shard, ``batch_indices``), so that its consensus can be held
against an in-process run of the same study, policy and seed. ``--mixing`` instead sets every parameter to
the rank, trains nothing, and records the parameters after every step (the exact-mixing test torch's
model-averaging tests use).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import evomerge
from evomerge import reference, simulate, study as study_mod
from evomerge.engine.setup import batch_indices, normalise
from evomerge.engine.state import initial_row
from evomerge.runtime import read_policy


@torch.no_grad()
def fill(model: torch.nn.Module, rank: int, ramp: bool) -> None:
    """--mixing: every parameter at the rank, or with ``ramp`` parameter i (in order) at r + 0.37 i (r + 1)."""
    o = 0
    for p in model.parameters():
        i = torch.arange(o, o + p.numel(), dtype=torch.float32, device=p.device).view_as(p)
        p.copy_(rank + 0.37 * i * (rank + 1) if ramp else torch.full_like(p, float(rank)))
        o += p.numel()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--policy", action="append", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", action="append", default=None, help="per policy (the last one repeats)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds every rank sleeps per step")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=1.0, help="the slow rank's step takes F x the others'")
    ap.add_argument("--die-rank", type=int, default=-1, help="this rank kills itself (SIGKILL) at --die-at")
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--hang-rank", type=int, default=-1, help="this rank stops stepping (sleeps) at --hang-at")
    ap.add_argument("--hang-at", type=int, default=0)
    ap.add_argument("--hang-for", type=float, default=0.0, help="seconds it sleeps there")
    ap.add_argument("--freeze-rank", type=int, default=-1, help="this rank stops its whole process (SIGSTOP, as a "
                                                                "frozen node: its threads too) at --freeze-at")
    ap.add_argument("--freeze-at", type=int, default=0)
    ap.add_argument("--freeze-for", type=float, default=0.0, help="seconds until a SIGCONT wakes it")
    ap.add_argument("--with", dest="with_", action="store_true", help="the loop inside `with merger:` (deploy.md's "
                                                                     "form): a MergerError leaves through __exit__")
    ap.add_argument("--stop-at", type=int, default=0, help="stop after this many steps and save a checkpoint")
    ap.add_argument("--stop-rank", type=int, default=-1, help="only this rank stops at --stop-at (-1: every rank)")
    ap.add_argument("--short-rank", type=int, default=-1, help="this rank's loader runs out at --short-at: it calls "
                                                              "finish() then (-2: every rank's does)")
    ap.add_argument("--short-at", type=int, default=0)
    ap.add_argument("--resume", default=None, help="a checkpoint directory written by --stop-at")
    ap.add_argument("--mixing", action="store_true")
    ap.add_argument("--ramp", action="store_true", help="with --mixing: parameter i of rank r starts at "
                                                        "r + 0.37 i (r + 1), distinct values (for top-k payloads)")
    ap.add_argument("--device", default="cpu", help="the model's device (cuda: every rank on cuda:0, gloo between "
                                                      "them, payloads staged through host memory)")
    ap.add_argument("--speeds", type=float, nargs="+", default=None,
                    help="each rank's speed, for a policy with scheme 'async' (Merger(speeds=...))")
    ap.add_argument("--worker-size", type=int, default=1, help="ranks per worker: DDP inside each worker "
                                                                 "(dist.new_subgroups), Merger(worker_group=...)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_subgroups(args.worker_size)[0] if args.worker_size > 1 else None
    worker = rank // args.worker_size  # whose shard and batches this rank trains on
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = study_mod.load(args.study)
    setup = simulate.prepare(st, data_dir=args.data_dir)
    T, B = setup.total_steps, st.run.batch_size
    try:
        for i, policy in enumerate(args.policy):
            if args.mixing:
                model = torch.nn.Linear(3, 2).to(dev)
                fill(model, rank, args.ramp)
                opt = None
            else:
                model = setup.model.builder()  # the user's own nn.Module
                row = initial_row(setup.model, args.seed)
                with torch.no_grad():
                    o = 0
                    for t in list(model.parameters()) + list(model.buffers()):
                        t.copy_(row[o:o + t.numel()].view_as(t))
                        o += t.numel()
                model.to(dev)
                opt = reference.optimizer(model, st.run)  # the study's optimiser, as torch offers it
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=sub) if sub is not None else model
            overlaps = args.overlap or ["lockstep"]
            overlap = overlaps[min(i, len(overlaps) - 1)]
            speeds = args.speeds if read_policy(policy).local_steps_by_speed else None
            # this worker's held-out examples, as the engine carves them from its shard (score = "holdout")
            held = torch.as_tensor(setup.slices[worker])
            holdout = (normalise(setup.data.train_x[held], setup.data.spec).to(dev), setup.data.train_y[held].to(dev))
            merger = evomerge.Merger(policy, model, opt, seed=args.seed, total_steps=T, overlap=overlap,
                                     timeout=args.timeout, trace=out / f"trace-{i}", worker_group=sub, speeds=speeds,
                                     holdout=holdout)
            if args.mixing and rank != 0:  # the Merger starts every rank from rank 0's model, as DDP does
                fill(model, rank, args.ramp)
            start = 0
            if args.resume:
                ck = torch.load(Path(args.resume) / f"ck-{i}-{rank}.pt", weights_only=False)
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["optimizer"])
                merger.load_state_dict(ck["merger"])
                start = ck["merger"]["step"]
            idx = batch_indices(setup.shards[worker], B, 0, T, args.seed, worker)
            values = []
            t0 = time.perf_counter()
            stopped = False  # at --stop-at, with a checkpoint: the Merger closed, not finished
            for t in range(start, T):
                if args.short_at and t == args.short_at and args.short_rank in (-2, rank):
                    break  # its loader ran out: on to finish()
                if t == args.die_at and rank == args.die_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                if t == args.freeze_at and rank == args.freeze_rank:
                    (out / f"frozen-{rank}.json").write_text(f'{{"at": {time.time()}}}')
                    subprocess.Popen(["sh", "-c", f"sleep {args.freeze_for}; kill -CONT {os.getpid()}"])
                    os.kill(os.getpid(), signal.SIGSTOP)
                if t == args.hang_at and rank == args.hang_rank:
                    time.sleep(args.hang_for)  # alive, not stepping: a hung rank (a deadlock, a stuck loader)
                if args.stop_at and t == args.stop_at and args.stop_rank in (-1, rank):
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "merger": merger.state_dict()}, out / f"ck-{i}-{rank}.pt")
                    merger.close()
                    stopped = True
                    break
                loss, t_step = None, time.perf_counter()
                if not args.mixing:
                    bi = torch.as_tensor(idx[t])
                    x, y = normalise(setup.data.train_x[bi], setup.data.spec).to(dev), setup.data.train_y[bi].to(dev)
                    loss = F.cross_entropy(net(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                # a device S slower; the slow rank one F x slower, as `evomerge calibrate` emulates it: F x (compute
                # + S), so that its step is F x the others' whatever the compute takes on a busy machine
                sleep = args.step_sleep
                if rank == args.slow_rank:
                    sleep += (args.slow_factor - 1) * (time.perf_counter() - t_step + args.step_sleep)
                if sleep:
                    time.sleep(sleep)
                merger.step(loss=loss)
                if args.mixing:
                    values.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
            if not stopped:
                seconds = time.perf_counter() - t0
                t_loop_end = time.time()
                merger.finish()
                flat = torch.cat([t.detach().float().reshape(-1) for t in
                                  list(model.parameters()) + list(model.buffers())]).cpu()
                torch.save({"consensus": flat, "values": values, "merges": merger.merges, "seconds": seconds,
                            "arrivals": list(merger.arrivals)},
                           out / f"result-{i}-{rank}.pt")
    except evomerge.MergerError as e:
        if args.with_:  # what `with merger:` does with the error on its way out
            merger.__exit__(type(e), e, e.__traceback__)
        # when the loop ended (null: in the loop), and when the error reached the caller (wall clock)
        ended = t_loop_end if "t_loop_end" in locals() else "null"
        (out / f"error-{rank}.json").write_text(f'{{"loop_end": {ended}, "error": {time.time()}}}')
        # the process group is broken: say why in one line and leave without tearing it down
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
