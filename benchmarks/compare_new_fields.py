"""Does searching the schema 2 fields pay (or, with --schema 8, the schema 8 fields)? Two searches per search
seed on mnist-skewed (Dirichlet 0.1 shards), same sampler and budget:

  without   the space of mnist-gossip (the 11 schema 1 fields)
  with      the same space plus similarity, similarity_bias, regroup_every, data_exchange_k,
            retire_threshold, reserve_rate, swap_p and stop_tol
  (--schema 8: without = the schema 1 and 2 fields; with = those plus p_intra_schedule, p_intra_final,
   data_unseen_first, data_similarity_sign, swap_confidence and swap_recency)

and prints, per arm, the best trial's validation accuracy and bytes (means over search
seeds) and which of the new fields each best policy uses. Each best policy is also
re-evaluated on 3 fresh seeds (test accuracy), the same way for both arms. Last, an
ablation: each best "with" policy with one new field turned off at a time (validation
accuracy on the study's seeds), to show which field the gain comes from. Run:

    .venv/bin/python benchmarks/compare_new_fields.py [--schema 2|8] [--trials 30] [--search-seeds 0 1 2] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile

import evomerge
from evomerge.search.baselines import fresh_seeds
from evomerge import data as data_mod
from evomerge import simulate, study
from evomerge.policy import ADDED_IN, MergePolicy

NEW = set(ADDED_IN[2])
LATER = set(ADDED_IN[8])  # left out of both arms of the schema 2 comparison


def uses(policy: dict) -> list[str]:
    """The schema 2 fields a policy turns on (with their values)."""
    p = MergePolicy.from_dict(policy)
    out = []
    if p.similarity_bias:
        out.append(f"similarity_bias={p.similarity_bias:.2f} ({p.similarity})")
    if p.regroup_every and p.topology == "communities":
        out.append(f"regroup_every={p.regroup_every} ({p.similarity})")
    if p.scheme == "gossip" and p.data_exchange_k:
        out.append(f"data_exchange_k={p.data_exchange_k}")
    if p.retire_threshold:
        out.append(f"retire_threshold={p.retire_threshold:.2f} (reserve_rate {p.reserve_rate:.2f})")
    if p.scheme == "gossip" and p.swap_p:
        out.append(f"swap_p={p.swap_p:.2f}")
    if p.stop_tol:
        out.append(f"stop_tol={p.stop_tol:.4f}")
    if p.topology == "communities" and p.p_intra_schedule != "constant":
        out.append(f"p_intra {p.p_intra:.2f}->{p.p_intra_final:.2f} ({p.p_intra_schedule})")
    if p.scheme == "gossip" and p.data_exchange_k:
        if p.data_unseen_first:
            out.append("data_unseen_first")
        if p.data_similarity_sign:
            out.append(f"data_similarity_sign={p.data_similarity_sign:.2f}")
    if p.scheme == "gossip" and p.swap_p and (p.swap_confidence or p.swap_recency):
        out.append(f"swap_confidence={p.swap_confidence:.2f}, swap_recency={p.swap_recency:.3g}")
    return out


def best_of_search(st, seed: int, trials: int, sampler: str, tmp: str, name: str, data) -> tuple[dict, MergePolicy]:
    """One search of ``st`` (MLflow and Optuna stores under ``tmp``, named ``name``): its best trial and policy."""
    res = evomerge.search(st, verdict=False, baselines=False, n_trials=trials, sampler=sampler, runs_dir=f"{tmp}/{name}",
                          tracking_uri=f"sqlite:///{tmp}/{name}-mlflow.db", seed=seed, data=data)
    best = res.best[0]
    return best, MergePolicy.from_dict(best["policy"])


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="mnist-skewed")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fresh-seeds", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--sampler", default="tpe")
    ap.add_argument("--schema", type=int, choices=(2, 8), default=2)
    args = ap.parse_args()
    full = study.load(args.study)
    d = full.data
    data = data_mod.load(d.dataset, args.data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    new, later = (NEW, LATER) if args.schema == 2 else (LATER, set())

    def leave_out(names):
        return dataclasses.replace(full, search=dataclasses.replace(
            full.search, space=tuple(p for p in full.search.space if p.name not in names)))

    arms = {"without": leave_out(new | later), "with": leave_out(later)}
    setup = simulate.prepare(full, data=data)
    fresh = fresh_seeds(full, args.fresh_seeds)
    rows: dict[str, list[dict]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.search_seeds:
            for arm, st in arms.items():
                best, pol = best_of_search(st, seed, args.trials, args.sampler, tmp, f"{arm}-{seed}", data)
                tests = [simulate.simulate(setup, pol, s, evaluate_test=True).test_accuracy for s in fresh]
                sent = statistics.fmean(m["bytes"] for m in best["metrics"].values())
                rows[arm].append({"seed": seed, "val": best["values"][0], "bytes": sent, "policy": pol,
                                  "test": statistics.fmean(tests), "uses": uses(best["policy"]),
                                  "describe": pol.describe()})
                print(f"search seed {seed}, {arm:>7}: best val {best['values'][0]:.4f}, "
                      f"{sent / 1e6:.0f} MB, test {statistics.fmean(tests):.4f}; "
                      f"new fields used: {', '.join(rows[arm][-1]['uses']) or 'none'}", flush=True)
    print(f"\n{full.name}: {args.trials} trials of {args.sampler}, search seeds {args.search_seeds}, "
          f"test accuracy on fresh seeds {fresh}\n")
    print("| space | best val accuracy | MB sent | test accuracy |")
    print("|---|---|---|---|")
    for arm, rs in rows.items():
        def ms(key, scale=1.0):
            vals = [r[key] / scale for r in rs]
            return f"{statistics.fmean(vals):.4f} +- {statistics.stdev(vals) if len(vals) > 1 else 0.0:.4f}"
        print(f"| {arm} new fields | {ms('val')} | {statistics.fmean(r['bytes'] for r in rs) / 1e6:.0f} | {ms('test')} |")
    print()
    for arm, rs in rows.items():
        for r in rs:
            print(f"{arm}, seed {r['seed']}: {r['describe']}")
    ablate(setup, full, [r["policy"] for r in rows["with"]], args.schema)


def ablate(setup, st, policies: list[MergePolicy], schema: int = 2) -> None:
    """Validation accuracy of each policy with one new field group turned off at a time."""
    off = {"p_intra_schedule": {"p_intra_schedule": "constant"}, "data_unseen_first": {"data_unseen_first": False},
           "data_similarity_sign": {"data_similarity_sign": 0.0},
           "swap conditions": {"swap_confidence": 0.0, "swap_recency": 0.0},
           "all new fields": {"p_intra_schedule": "constant", "data_unseen_first": False, "data_similarity_sign": 0.0,
                              "swap_confidence": 0.0, "swap_recency": 0.0}} if schema == 8 else {"similarity_bias": {"similarity_bias": 0.0}, "regroup_every": {"regroup_every": 0},
           "data_exchange_k": {"data_exchange_k": 0}, "retire_threshold": {"retire_threshold": 0.0},
           "swap_p": {"swap_p": 0.0}, "stop_tol": {"stop_tol": 0.0},
           "all new fields": {"similarity_bias": 0.0, "regroup_every": 0, "data_exchange_k": 0,
                              "retire_threshold": 0.0, "swap_p": 0.0, "stop_tol": 0.0}}

    def val(p: MergePolicy) -> float:
        return statistics.fmean(simulate.simulate(setup, p, s).final.val_accuracy for s in st.run.seeds)

    print("\nablation of the best 'with' policies (validation accuracy; change when the field is turned off)\n")
    print("| turned off | " + " | ".join(f"policy {i}" for i in range(len(policies))) + " | mean change |")
    print("|---|" + "---|" * (len(policies) + 1))
    base = [val(p) for p in policies]
    print("| nothing | " + " | ".join(f"{b:.4f}" for b in base) + " | |")
    for name, changes in off.items():
        vals = [val(p.replace(**changes)) for p in policies]
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in vals) + f" | {statistics.fmean(v - b for v, b in zip(vals, base)):+.4f} |")


if __name__ == "__main__":
    main()
