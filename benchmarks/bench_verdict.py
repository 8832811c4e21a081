"""The verdict's runs on fresh seeds with every round evaluated (curves) and with the last round only, side by side.

For a study (default mnist-gossip) and each of its baselines, one run on a fresh seed each way, interleaved and
repeated; prints per policy the median wall and CPU seconds of a run each way, their ratio, and whether the final
metrics agree (they must, bit for bit: tests/test_engine_run.py holds it). The verdict of the README's quick start
runs 21 such runs (the 5 baselines and 2 picks on 3 fresh seeds). Run on a quiet machine:

    .venv/bin/python benchmarks/bench_verdict.py [--study mnist-gossip] [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch

    from evomerge import study as study_mod
    from evomerge.backends.inprocess import run
    from evomerge.engine.setup import prepare
    from evomerge.search.baselines import fresh_seeds

    if args.threads:
        torch.set_num_threads(args.threads)
    study = study_mod.load(args.study)
    setup = prepare(study, data_dir=args.data_dir)
    seed = fresh_seeds(study, 1)[0]
    print(f"{study.name}: {study.run.rounds} rounds, {torch.get_num_threads()} threads, fresh seed {seed}, "
          f"{args.repeats} repeats interleaved")
    run(setup, study.resolve_policy(study.baselines[0]), seed, curves=False)  # warm-up
    totals = {True: [0.0, 0.0], False: [0.0, 0.0]}
    print(f"{'policy':<14} {'curves wall':>11} {'last wall':>10} {'curves cpu':>11} {'last cpu':>9} "
          f"{'cpu ratio':>9}  same finals")
    for name in study.baselines:
        pol = study.resolve_policy(name)
        times = {True: [], False: []}
        finals = {}
        for rep in range(args.repeats):
            for curves in ((True, False) if rep % 2 == 0 else (False, True)):
                w, c = time.perf_counter(), time.process_time()
                r = run(setup, pol, seed, curves=curves)
                times[curves].append((time.perf_counter() - w, time.process_time() - c))
                finals[curves] = {k: v for k, v in r.metrics().items() if k != "wall_time"}
        med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
        for k in totals:
            totals[k][0] += med[k][0]
            totals[k][1] += med[k][1]
        same = repr(finals[True]) == repr(finals[False])
        print(f"{name:<14} {med[True][0]:>10.2f}s {med[False][0]:>9.2f}s {med[True][1]:>10.2f}s {med[False][1]:>8.2f}s "
              f"{med[False][1] / med[True][1]:>9.2f}  {same}")
    print(f"{'all':<14} {totals[True][0]:>10.2f}s {totals[False][0]:>9.2f}s {totals[True][1]:>10.2f}s "
          f"{totals[False][1]:>8.2f}s {totals[False][1] / totals[True][1]:>9.2f}")


if __name__ == "__main__":
    main()
