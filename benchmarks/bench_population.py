"""Trials per minute: mnist-gossip trials run one at a time against the same trials trained as one
population (backends/population.py, what ``evomerge search --batch N`` does), at N = 1, 8, 32, 128.

The trials are N policies drawn at random (seeded) from mnist-gossip's search space, each run on
the study's seed, as a search's trials are. The population is timed twice: with each member
applying its own merges (the CPU default) and with the members' plain gossip merges applied
together (``cross=True``, the CUDA default); ``--ways groups`` adds populations of ``--group-size`` members
in turn (what the CPU makes of smaller populations). All the ways run the same N trials in the same
process on the same data, interleaved (they take turns going first); each ratio is of timings
taken side by side. ``--scale`` shortens every run to a fraction
of the study's epochs (rounds kept), so N = 128 fits in minutes on a CPU; trials per minute at
full length are about the measured figure times ``--scale``. The check that batching changes no
number is the test suite's (tests/test_population.py); here the final accuracies are compared too.

    EVOMERGE_THREADS=2 .venv/bin/python benchmarks/bench_population.py [--sizes 1 8 32 128] [--scale 0.25] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


NAMES = {"alone": "one at a time", "batched": "batched", "cross": "batched, merges together", "groups": "in groups"}


def policies(study, n: int, seed: int = 0):
    """``n`` policies of the study's space, drawn by Optuna's RandomSampler (seeded)."""
    import optuna

    from evomerge.search import space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        t = st.ask(space.distributions(study.search.space))
        out.append(space.policy_from_params(study, t.params))
        st.tell(t, 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the study's epochs per run (default 0.25)")
    ap.add_argument("--study", default=str(ROOT / "studies" / "mnist-gossip.toml"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--ways", nargs="+", choices=tuple(NAMES), default=["alone", "batched", "cross"],
                    help="which ways to time (default the first three; 'cross' alone for sizes where one at a time takes "
                         "long; 'groups': populations of --group-size members in turn)")
    ap.add_argument("--group-size", type=int, default=8, help="members per population of the 'groups' way (default 8)")
    args = ap.parse_args()
    ways = [w for w in NAMES if w in args.ways]  # in NAMES' order, whatever the command line's

    import torch

    from evomerge import simulate, study
    from evomerge.backends.population import Member, run_population
    from evomerge.procs import apply_threads

    apply_threads()
    s = study.load(args.study)
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, epochs=s.run.epochs * args.scale))
    setup = simulate.prepare(s, data_dir=args.data_dir)
    seed = s.run.seeds[0]
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"{s.name}: W={s.run.workers}, {setup.total_steps} local steps per run ({args.scale} of the study's), "
          f"{s.run.rounds} rounds, device {dev}, torch threads {torch.get_num_threads()}")
    # warm up both paths (first-call costs: allocator, kernels)
    warm = policies(s, 2, seed=99)
    simulate.simulate(setup, warm[0], seed, device=dev)
    run_population(setup, [Member(p, seed) for p in warm], dev)

    rows = []
    for i, n in enumerate(args.sizes):
        pols = policies(s, n, seed=n)
        timings = {}

        def alone():
            sync()
            t = time.perf_counter()
            res = [simulate.simulate(setup, p, seed, device=dev) for p in pols]
            sync()
            timings["alone"] = time.perf_counter() - t
            return res

        def batched(cross):
            def go():
                sync()
                t = time.perf_counter()
                res = run_population(setup, [Member(p, seed) for p in pols], dev, cross=cross)
                sync()
                timings["cross" if cross else "batched"] = time.perf_counter() - t
                return res
            return go

        def groups():
            sync()
            t = time.perf_counter()
            g = args.group_size
            res = [r for lo in range(0, n, g) for r in run_population(setup, [Member(p, seed) for p in pols[lo:lo + g]], dev)]
            sync()
            timings["groups"] = time.perf_counter() - t
            return res

        runs = {"alone": alone, "batched": batched(False), "cross": batched(True), "groups": groups}
        order = [runs[w] for w in ways]
        k = i % len(order)
        order = order[k:] + order[:k]  # interleaved: each way goes first in turn
        results = [f() for f in order]
        same = all(all(x.final.val_accuracy == y.final.val_accuracy for x, y in zip(results[0], res)) for res in results)
        per_min = {w: 60 * n / t for w, t in timings.items()}
        rows.append((n, per_min, same))
        print(f"N={n:4d}  " + "   ".join(f"{NAMES[w]} {per_min[w]:7.1f} trials/min" + (
            f" ({per_min[w] / per_min['alone']:4.2f}x)" if w != "alone" and "alone" in per_min else "")
            for w in ways) + f"   same accuracies: {same}", flush=True)
    ratios = [w for w in ways if w != "alone"] if "alone" in ways else []
    print("\n| N | " + " | ".join(NAMES[w] + (" (trials/min)" if j == 0 else "") for j, w in enumerate(ways))
          + "".join(f" | {NAMES[w]} / one at a time" for w in ratios) + " |")
    print("|---:|" + "---:|" * (len(ways) + len(ratios)))
    for n, per_min, _ in rows:
        print(f"| {n} | " + " | ".join(f"{per_min[w]:.1f}" for w in ways)
              + "".join(f" | {per_min[w] / per_min['alone']:.2f}x" for w in ratios) + " |")


if __name__ == "__main__":
    main()
