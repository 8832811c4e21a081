"""Simulated time to the target on the timed studies: every baseline, and the best policy found by
each sampler (several search seeds), all re-evaluated on fresh seeds; ratios to synchronous all-reduce.

    .venv/bin/python benchmarks/time_to_target.py [--studies mnist-stragglers mnist-two-sites]
        [--samplers tpe cmaes] [--search-seeds 0 1 2] [--n-trials 30] [--reevaluate 3] [--data-dir DIR]

Simulated times are functions of the seeds alone (not of this machine's speed), so the figures
are the same on a loaded machine; only the wall time it takes changes. A time to target above the
study's time budget means "not reached" (ranked by how close it came; see Judge.timing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import optuna

import evomerge
from evomerge import data as data_mod
from evomerge import simulate, study
from evomerge.search.baselines import fresh_seeds
from evomerge.policy import MergePolicy

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--studies", nargs="+", default=["mnist-stragglers", "mnist-two-sites"])
    ap.add_argument("--samplers", nargs="+", default=["tpe", "cmaes"])
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-trials", type=int, default=None)
    ap.add_argument("--reevaluate", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in args.studies:
        s = study.load(name)
        n = args.n_trials or s.search.n_trials
        d = s.data
        data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
        setup = simulate.prepare(s, data=data)
        seeds = fresh_seeds(s, args.reevaluate)
        budget = s.environment.time_budget

        def reevaluate(policy: MergePolicy):
            rs = [simulate.simulate(setup, policy, sd) for sd in seeds]
            return [r.final.time_to_target for r in rs], [r.final.val_accuracy for r in rs]

        rows = [(b, reevaluate(s.resolve_policy(b)), s.resolve_policy(b)) for b in s.baselines]
        with tempfile.TemporaryDirectory() as tmp:
            for sampler in args.samplers:
                for seed in args.search_seeds:
                    t0 = time.perf_counter()
                    res = evomerge.search(s, verdict=False, baselines=False, n_trials=n, sampler=sampler, seed=seed,
                                          runs_dir=Path(tmp) / f"{sampler}-{seed}", data=data)
                    best = res.best[0]
                    pol = MergePolicy.from_dict(best["policy"])
                    rows.append((f"{sampler} seed {seed}", reevaluate(pol), pol))
                    print(f"{name} {sampler} seed {seed}: best {best['values'][0]:.3f} s (trial {best['number']}), "
                          f"fresh seeds {statistics.fmean(rows[-1][1][0]):.3f} s, {time.perf_counter() - t0:.0f} s wall",
                          flush=True)
        ref = statistics.fmean(dict((r[0], r[1]) for r in rows)["allreduce"][0])
        print(f"\n{name}: target {s.target} validation accuracy within {budget:g} simulated s; {n} trials per search; "
              f"re-evaluated on fresh seeds {seeds}")
        print(f"{'policy':<16} {'time to target (s)':>20} {'vs allreduce':>13} {'reached':>8} {'val acc':>8}")
        for label, (ttt, acc), _ in rows:
            m = statistics.fmean(ttt)
            print(f"{label:<16} {m:>12.2f} +- {statistics.stdev(ttt) if len(ttt) > 1 else 0:<5.2f} {m / ref:>12.2f}x "
                  f"{sum(t <= budget for t in ttt):>5}/{len(ttt)} {statistics.fmean(acc):>8.4f}")
        print("found policies:")
        for label, _, pol in rows[len(s.baselines):]:
            print(f"  {label}: {pol.describe()}")
        print(flush=True)


if __name__ == "__main__":
    main()
