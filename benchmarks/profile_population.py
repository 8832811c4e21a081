"""Where a population's time goes: one ``run_population`` of N mnist-gossip trials (the policies
bench_population.py draws), run once to warm up, then again under cProfile. Prints the wall time,
trials per minute, the shares of the population's parts (local steps, merges, evaluation and the
round's bookkeeping) and the functions with the most time of their own.

On CUDA the kernels run asynchronously, so cProfile sees the host's time: launches, Python and
every wait for the device (a ``.item()``, a copy to the host). The totals are synchronised.

    EVOMERGE_THREADS=2 .venv/bin/python benchmarks/profile_population.py [--n 32] [--scale 0.25] [--device cpu]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = {  # (file suffix, function) -> part of the population
    ("backends/population.py", "step"): "local steps",
    ("backends/population.py", "merge"): "merges",
    ("engine/judge.py", "evaluate_many"): "evaluation (batched forwards)",
    ("backends/population.py", "_judge_round"): "round bookkeeping (close_round)",
    ("backends/population.py", "compact"): "compaction",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--study", default=str(ROOT / "studies" / "mnist-gossip.toml"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--cross", choices=("default", "on", "off"), default="default")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime", help="pstats order of the listing (tottime, cumulative)")
    ap.add_argument("--only", default=None, help="list only functions whose file path holds this (evomerge)")
    ap.add_argument("--out", default=None, help="write the raw profile here (pstats)")
    args = ap.parse_args()

    import torch

    from bench_population import policies
    from evomerge import simulate, study
    from evomerge.backends.population import Member, run_population
    from evomerge.procs import apply_threads

    apply_threads()
    s = study.load(args.study)
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, epochs=s.run.epochs * args.scale))
    setup = simulate.prepare(s, data_dir=args.data_dir)
    seed, dev = s.run.seeds[0], torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cross = None if args.cross == "default" else args.cross == "on"
    pols = policies(s, args.n, seed=args.n)

    def once():
        sync()
        t = time.perf_counter()
        run_population(setup, [Member(p, seed) for p in pols], dev, cross=cross)
        sync()
        return time.perf_counter() - t

    warm = once()
    prof = cProfile.Profile()
    prof.enable()
    took = once()
    prof.disable()
    bare = once()
    print(f"N={args.n} scale {args.scale} on {dev}: {setup.total_steps} steps a trial; warm-up {warm:.2f} s, "
          f"profiled {took:.2f} s, unprofiled {bare:.2f} s = {60 * args.n / bare:.0f} trials/min")
    st = pstats.Stats(prof)
    if args.out:
        st.dump_stats(args.out)
    total = sum(v[3] for k, v in st.stats.items() if k[2] == "once") or took
    for (suffix, fn), part in PARTS.items():
        cum = sum(v[3] for k, v in st.stats.items() if k[0].endswith(suffix) and k[2] == fn)
        print(f"  {part:<34} {cum:7.2f} s  {100 * cum / total:5.1f}%")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(args.sort).print_stats(*([args.only] if args.only else []), args.top)
    print(buf.getvalue().split("\n", 6)[-1][:12000])


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
