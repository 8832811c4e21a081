"""``python -m evomerge.dist``: the distributed backend's entry point under torchrun.

The backend itself is :mod:`evomerge.backends.distributed` (one rank's share of a run) and
:mod:`evomerge.backends.launch` (spawning the ranks on this machine); this module is the command under torchrun,
and keeps the names (``simulate``, ``DistributedRunError``, ...) users already call.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

from .backends import check_policy
from .backends.distributed import DistributedRunError, groups, run_rank  # noqa: F401
from .backends.launch import simulate  # noqa: F401
from .engine.setup import prepare, resolve_device
from .units import size


def main(argv=None) -> int:
    """``python -m evomerge.dist --study S --policy P`` under torchrun (or any launcher setting the env)."""
    import argparse
    import json

    from .errors import ConfigError as _CE
    from .study import load

    ap = argparse.ArgumentParser(prog="python -m evomerge.dist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--json", dest="json_out", default=None, help="rank 0 writes the result here")
    args = ap.parse_args(argv)
    try:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise _CE(var, "is not set; launch with torchrun (or use `evomerge run --backend distributed`)")
        study = load(args.study)
        policy = study.resolve_policy(args.policy)
        check_policy("distributed", policy)
        from .backends import found_with
        from .policy import read_export

        study, note = found_with(study, read_export(args.policy) if os.path.isfile(args.policy) else None)
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(note, flush=True)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        groups(study.run.workers, world)
    except _CE as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = resolve_device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://")
    try:
        setup = prepare(study, data_dir=args.data_dir)
        seed = study.run.seeds[0] if args.seed is None else args.seed

        def report(rm):
            print(f"round {rm.round}: step {rm.step}, val accuracy {rm.val_accuracy if rm.val_accuracy is None else round(rm.val_accuracy, 4)}, "
                  f"{size(rm.bytes)}", flush=True)
            return True

        res = run_rank(setup, policy, seed, rank=rank, world=world, report=report if rank == 0 else None, device=dev)
        if rank == 0:
            print(f"{res.status}: val accuracy {res.final.val_accuracy if res.final.val_accuracy is None else round(res.final.val_accuracy, 4)}, {size(res.final.bytes)}, "
                  f"{res.wall_time:.1f} s on {world} processes", flush=True)
            if args.json_out:
                with open(args.json_out, "w") as fh:
                    json.dump(res.to_dict(), fh, indent=1)
    finally:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
