"""Samplers compared on a study: best validation accuracy after 10, 20 and all trials, then each
best policy re-evaluated on fresh seeds (test accuracy and bytes) next to every baseline.

    .venv/bin/python benchmarks/compare_samplers.py [--study mnist-gossip] [--samplers tpe cmaes random tpe+hyperband]
        [--search-seeds 0 1 2] [--n-trials N] [--reevaluate 3] [--data-dir DIR]

A sampler may name its pruner after a plus (``tpe+hyperband``; else the default, median). Each search
runs in a fresh temporary store with one job, so it is reproducible.

Search efficiency: when ``random`` is among the samplers, its mean best after all trials is the
target, and for every search the table gives the compute (in full trials' worth of local steps: a
pruned trial counts the fraction it ran) and the wall time it took until its best so far reached it.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def best_after(trials, k: int, maximize: bool = True):
    vals = [t.values[0] for t in trials if t.number < k and t.state == optuna.trial.TrialState.COMPLETE]
    return (max if maximize else min)(vals) if vals else float("nan")


def compute_of(t, full_steps: int) -> float:
    """A trial's compute in full trials' worth: a pruned trial ran until its ``pruned_at_step``."""
    if t.state == optuna.trial.TrialState.PRUNED and "pruned_at_step" in t.user_attrs:
        return min(1.0, t.user_attrs["pruned_at_step"] / full_steps)
    return 1.0


def to_target(trials, target: float, full_steps: int, t0: float, maximize: bool = True):
    """(trials' worth of compute, wall seconds) until the best so far reached ``target``; None if never."""
    spent, best = 0.0, None
    for t in sorted(trials, key=lambda t: t.number):
        if t.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
            continue
        spent += compute_of(t, full_steps)
        if t.state == optuna.trial.TrialState.COMPLETE:
            v = t.values[0]
            best = v if best is None else (max if maximize else min)(best, v)
            if (best >= target) if maximize else (best <= target):
                return spent, t.datetime_complete.timestamp() - t0
    return None


def ms(vals):
    return f"{statistics.fmean(vals):.4f} +- {statistics.stdev(vals) if len(vals) > 1 else 0.0:.4f}"


def main(argv=None):
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--samplers", nargs="+", default=["tpe", "cmaes", "random"])
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-trials", type=int, default=None)
    ap.add_argument("--reevaluate", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = study.load(args.study)
    s = dataclasses.replace(s, objectives=s.objectives[:1])  # CMA-ES and Optuna's pruners take one: the first
    n = args.n_trials or s.search.n_trials
    d = s.data
    data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    setup = simulate.prepare(s, data=data)
    seeds = fresh_seeds(s, args.reevaluate)
    marks = [k for k in (10, 20) if k < n] + [n]

    def reevaluate(policy: MergePolicy):
        rs = [simulate.simulate(setup, policy, sd, evaluate_test=True) for sd in seeds]
        return [r.test_accuracy or 0.0 for r in rs], [r.final.bytes / 1e6 for r in rs]

    rows = []
    searches: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sampler in args.samplers:
            name, _, pruner = sampler.partition("+")
            for seed in args.search_seeds:
                t0, wall0 = time.perf_counter(), time.time()
                res = evomerge.search(s, verdict=False, baselines=False, n_trials=n, sampler=name, pruner=pruner or "median", seed=seed,
                                      runs_dir=Path(tmp) / f"{sampler}-{seed}", data=data)
                trials = res.optuna_study.get_trials(deepcopy=False)
                searches[(sampler, seed)] = (trials, wall0)
                best = res.best[0]
                test, mb = reevaluate(MergePolicy.from_dict(best["policy"]))
                rows.append((sampler, seed, [best_after(trials, k) for k in marks], test, mb, best["policy"],
                             time.perf_counter() - t0))
                print(f"{sampler} seed {seed}: best val {best['values'][0]:.4f} (trial {best['number']}), "
                      f"test {ms(test)}, {statistics.fmean(mb):.1f} MB, {rows[-1][-1]:.0f} s", flush=True)
    base = {b: reevaluate(s.resolve_policy(b)) for b in s.baselines}

    print(f"\n{args.study}: {n} trials per search, search seeds {args.search_seeds}; "
          f"best policies re-evaluated on fresh seeds {seeds}")
    head = f"{'sampler':<14} {'seed':>4} " + "".join(f"{'best@' + str(k):>9}" for k in marks) + f" {'test acc (fresh seeds)':>24} {'MB sent':>9}"
    print(head)
    print("-" * len(head))
    for sampler, seed, bests, test, mb, _, _ in rows:
        print(f"{sampler:<14} {seed:>4} " + "".join(f"{b:>9.4f}" for b in bests) + f" {ms(test):>24} {statistics.fmean(mb):>9.1f}")
    for sampler in args.samplers:
        sel = [r for r in rows if r[0] == sampler]
        print(f"{sampler:<14} {'mean':>4} " + "".join(f"{statistics.fmean(r[2][i] for r in sel):>9.4f}" for i in range(len(marks)))
              + f" {ms([statistics.fmean(r[3]) for r in sel]):>24} {statistics.fmean(statistics.fmean(r[4]) for r in sel):>9.1f}")
    for b, (test, mb) in base.items():
        print(f"{b:<19} " + " " * (9 * len(marks)) + f" {ms(test):>24} {statistics.fmean(mb):>9.1f}")
    if "random" in args.samplers:
        target = statistics.fmean(r[2][-1] for r in rows if r[0] == "random")
        full = setup.total_steps * len(s.run.seeds)
        print(f"\nsearch efficiency: compute (full trials' worth) and wall time until the best so far reached "
              f"random search's mean best of {n}, {target:.4f}")
        for (sampler, seed), (trials, wall0) in searches.items():
            hit = to_target(trials, target, full, wall0)
            print(f"  {sampler:<16} seed {seed}: " + (f"{hit[0]:5.1f} trials' worth, {hit[1]:6.0f} s" if hit else "not reached"))
    print("\nbest policies:")
    for sampler, seed, _, _, _, pol, _ in rows:
        print(f"  {sampler} seed {seed}: {MergePolicy.from_dict(pol).describe()}")


if __name__ == "__main__":
    main()
