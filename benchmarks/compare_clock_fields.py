"""Do the asynchronous-training ideas earn their place on a clock? Two searches per search seed on a time study
(mnist-stragglers or mnist-two-sites), same sampler and budget, objective time to target:

  without   the study's own space
  with      the same space plus the fields that ran only in the lockstep world before (issue 24 part 1), with
            mnist-skewed's ranges: similarity, similarity_bias, regroup_every, n_communities, p_intra (and its
            schedule), data_exchange_k, data_unseen_first, data_similarity_sign, retire_threshold, reserve_rate,
            swap_p, swap_confidence, swap_recency

and prints, per arm, the best trial's simulated time to target (means over search seeds) and which of the added
fields each best policy uses; each best policy is re-run on fresh seeds and fresh clusters (its time to target
there, the figure to compare). Run:

    .venv/bin/python benchmarks/compare_clock_fields.py [--study mnist-stragglers] [--trials 30] [--search-seeds 0 1 2]
        [--arms without with]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

from evomerge import data as data_mod
from evomerge import simulate, study
from evomerge.search.baselines import fresh_seeds

from compare_new_fields import best_of_search, uses

ADDED = ("similarity", "similarity_bias", "regroup_every", "n_communities", "p_intra", "p_intra_schedule",
         "p_intra_final", "data_exchange_k", "data_unseen_first", "data_similarity_sign", "retire_threshold",
         "reserve_rate", "swap_p", "swap_confidence", "swap_recency")


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mnist-stragglers")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fresh-seeds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--sampler", default="tpe")
    ap.add_argument("--arms", nargs="+", choices=("without", "with"), default=["without", "with"],
                    help="run only these arms (to finish a comparison stopped part way)")
    args = ap.parse_args()
    full = study.load(args.study)
    have = {p.name for p in full.search.space}
    extra = tuple(p for p in study.load("mnist-skewed").search.space if p.name in ADDED and p.name not in have)
    arms = {"without": full,
            "with": dataclasses.replace(full, search=dataclasses.replace(full.search, space=full.search.space + extra))}
    d = full.data
    data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    setup = simulate.prepare(full, data=data)
    fresh = fresh_seeds(full, args.fresh_seeds)
    print(f"{full.name}: added to the space: {', '.join(p.name for p in extra)}", flush=True)
    rows: dict[str, list[dict]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.search_seeds:
            for arm, st in arms.items():
                if arm not in args.arms:
                    continue
                best, pol = best_of_search(st, seed, args.trials, args.sampler, tmp, f"{arm}-{seed}", data)
                times = [simulate.simulate(setup, pol, s).final.time_to_target for s in fresh]
                rows[arm].append({"seed": seed, "search": best["values"][0], "fresh": statistics.fmean(times),
                                  "uses": uses(best["policy"]), "describe": pol.describe()})
                print(f"search seed {seed}, {arm:>7}: best {best['values'][0]:.2f} s, on fresh seeds "
                      f"{statistics.fmean(times):.2f} s; added fields used: {', '.join(rows[arm][-1]['uses']) or 'none'}",
                      flush=True)
    print(f"\n{full.name}: {args.trials} trials of {args.sampler}, search seeds {args.search_seeds}, "
          f"time to {full.target} on fresh seeds {fresh}\n")
    print("| space | best found (s) | on fresh seeds (s) |")
    print("|---|---|---|")
    for arm, rs in rows.items():
        if not rs:
            continue

        def ms(key):
            vals = [r[key] for r in rs]
            return f"{statistics.fmean(vals):.2f} +- {statistics.stdev(vals) if len(vals) > 1 else 0.0:.2f}"
        print(f"| {arm} the added fields | {ms('search')} | {ms('fresh')} |")
    print()
    for arm, rs in rows.items():
        for r in rs:
            print(f"{arm}, seed {r['seed']}: {r['describe']}")


if __name__ == "__main__":
    main()
