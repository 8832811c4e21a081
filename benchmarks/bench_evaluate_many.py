"""A population's evaluation in forwards of how many rows: ``engine.judge.evaluate_many`` on 32 members of 8
mnist-gossip workers (MLP 784-128-10, 256 rows), each member's consensus model on 5,000 inputs and every worker on
2,000, as a round of ``bench_population.py --sizes 32`` evaluates them, with ``max_rows`` 256, 64, 32 and 16, the
sizes taking turns (4 repeats; best and second best). Checks that every size gives the same numbers.

    EVOMERGE_THREADS=2 .venv/bin/python benchmarks/bench_evaluate_many.py [--members 32] [--workers 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64, 32, 16])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    from evomerge import models
    from evomerge.engine.judge import evaluate_many
    from evomerge.procs import apply_threads

    apply_threads()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = models.MLP((1, 28, 28), 10, [128])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5000, 1, 28, 28, generator=g).to(dev), torch.randint(0, 10, (5000,), generator=g).to(dev)
    rows = args.members * args.workers
    params = [(torch.randn(rows, *shape, generator=g) * 0.05).to(dev) for _, shape in model.layout]
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    first = None
    for _ in range(args.repeats):
        for r in args.rows:  # interleaved
            sync()
            t = time.perf_counter()
            got = evaluate_many(model, params, args.members, x, y, 2000, max_rows=r)
            sync()
            times[r].append(time.perf_counter() - t)
            first = got if first is None else first
            assert got == first, f"max_rows {r} gave other numbers"
    base = sorted(times[args.rows[0]])[0]
    print(f"{args.members} members x {args.workers} workers on {dev}, torch threads {torch.get_num_threads()}; "
          f"every size gave the same numbers")
    print("| max_rows | best s | second s | best / max_rows " + f"{args.rows[0]} |")
    print("|---:|---:|---:|---:|")
    for r in args.rows:
        s = sorted(times[r])
        print(f"| {r} | {s[0]:.3f} | {s[1]:.3f} | {s[0] / base:.2f} |")


if __name__ == "__main__":
    main()
