"""Tuned rivals, not defaults: a search over DiLoCo's own knobs against evomerge's full space, each with the
same trial budget and the inner lr searched in both (issue 26, part 6).

    .venv/bin/python benchmarks/rivals.py [--studies mnist-gossip mnist-stragglers] [--trials 24]
        [--search-seeds 0 1 2] [--eval-seeds 1000 1001 1002] [--out benchmarks/rivals.json]

Arms, each searched by CMA-ES (categoricals by Optuna's independent sampler, as `--sampler cmaes`), on the
shipped study's data, model, workers and [environment]:

- ``diloco``: scheme allreduce with the outer Nesterov step; searched: the local steps H (``mean_interval``,
  log [2, 100]), ``outer_lr`` log [0.1, 2], ``outer_momentum`` [0, 0.95] and ``run.lr`` log [0.01, 0.5] (with Adam
  or AdamW, as tiny-lm trains: log [0.001, 0.05]); on the
  time studies also Streaming DiLoCo's ``fragments`` {1, 2, 4}, ``fragment_delay`` [0, 4], ``fragment_alpha``
  [0, 0.5].
- ``evomerge``: the study's own [search.space] (scheme, gossip fields, the outer step) plus ``run.lr`` log
  [0.01, 0.5].
- ``async-diloco`` (studies with an [environment]): asynchronous DiLoCo's own knobs, H, ``outer_lr``,
  ``outer_momentum``, ``momentum_every`` [0, 16], ``local_steps_by_speed`` and ``run.lr``: the fairer rival
  where workers run at different speeds.
- ``snoo``: the control without merging (Lookahead / SNOO: scheme none, each worker's own outer Nesterov step every
  H local steps); searched: the same H, ``outer_lr``, ``outer_momentum`` and ``run.lr`` as ``diloco``. It tells
  how much of DiLoCo's gain is the outer optimiser rather than the merging.

``--arms`` runs some of them (default: all); results already in ``--out`` are kept and not run again.

Each search's best trial is re-run on fresh seeds (``--eval-seeds``, never the search's own) at the lr it was
found with; the table gives the mean and spread of the study's objective and of validation accuracy, and says
whether the full space's winner is itself a DiLoCo instance (allreduce or async with an outer step). Every metric is
simulated (accuracy, simulated seconds), so the machine's load does not change a figure, only how long it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import evomerge
from evomerge import simulate, study as study_mod
from evomerge.policy import MergePolicy
from evomerge.study import Param, with_run

LR = Param("run.lr", "log-float", 0.01, 0.5)
DILOCO_SPACE = (Param("mean_interval", "log-float", 2.0, 100.0), Param("outer_lr", "log-float", 0.1, 2.0),
                Param("outer_momentum", "float", 0.0, 0.95), LR)


# asynchronous DiLoCo's own knobs (Liu et al. 2024): delayed Nesterov every N arrivals, dynamic local updates
ASYNC_SPACE = (Param("mean_interval", "log-float", 1.0, 100.0), Param("outer_lr", "log-float", 0.1, 2.0),
               Param("outer_momentum", "float", 0.0, 0.95), Param("momentum_every", "int", 0, 16),
               Param("local_steps_by_speed", "categorical", choices=(False, True)), LR)
STREAMING_SPACE = (Param("fragments", "categorical", choices=(1, 2, 4)), Param("fragment_delay", "int", 0, 4),
                   Param("fragment_alpha", "float", 0.0, 0.5))


ADAM_LR = Param("run.lr", "log-float", 0.001, 0.05)  # the inner lr of a study that trains with Adam(W)


def _lr_for(s, space: tuple) -> tuple:
    """``space`` with the inner lr's range for the study's optimiser (SGD's [0.01, 0.5] diverges under AdamW)."""
    if s.run.optimizer in ("adam", "adamw"):
        return tuple(ADAM_LR if p is LR else p for p in space)
    return space


def arms(s) -> dict:
    # CMA-ES takes one objective (the study's first); no baselines: each arm's best is re-run here instead
    s = dataclasses.replace(s, objectives=s.objectives[:1], baselines=())
    out = _arms(s)
    for name, arm in out.items():
        out[name] = dataclasses.replace(arm, search=dataclasses.replace(arm.search,
                                                                        space=_lr_for(s, arm.search.space)))
    return out


def _arms(s) -> dict:
    space = DILOCO_SPACE + (STREAMING_SPACE if s.environment is not None else ())  # time studies: Streaming DiLoCo
    diloco = dataclasses.replace(
        s, name=f"{s.name}-rival-diloco",
        policy=s.policy.replace(scheme="allreduce", mixing_weight=1.0, outer_optimizer="nesterov"),
        search=dataclasses.replace(s.search, space=space))
    full = dataclasses.replace(s, name=f"{s.name}-rival-evomerge",
                               search=dataclasses.replace(s.search, space=(*s.search.space, LR)))
    snoo = dataclasses.replace(
        s, name=f"{s.name}-rival-snoo", policy=s.policy.replace(scheme="none", outer_optimizer="nesterov"),
        search=dataclasses.replace(s.search, space=DILOCO_SPACE))
    out = {"diloco": diloco, "evomerge": full, "snoo": snoo}
    if s.environment is not None:  # the fairer rival on a cluster with stragglers: asynchronous DiLoCo, tuned
        out["async-diloco"] = dataclasses.replace(
            s, name=f"{s.name}-rival-async", search=dataclasses.replace(s.search, space=ASYNC_SPACE),
            policy=s.policy.replace(scheme="async", mixing_weight=1.0, outer_optimizer="nesterov"))
    return out


def is_diloco(p: MergePolicy) -> bool:
    """DiLoCo, streamed or asynchronous: an outer step on the workers' pseudo-gradients."""
    return p.scheme in ("allreduce", "async") and p.outer_optimizer != "none"


def reevaluate(s, data, policy: MergePolicy, run: dict, seeds: list[int]) -> dict:
    """The best policy on fresh seeds: the study's objective (its first: time to target, perplexity, ...) and the
    validation accuracy."""
    setup = simulate.prepare(with_run(s, run), data=data)
    finals = [simulate.simulate(setup, policy, seed).final for seed in seeds]
    out = {"val_accuracy": [f.val_accuracy for f in finals]}
    if s.target is not None:
        out["time_to_target"] = [f.time_to_target for f in finals]
    obj = s.objectives[0]
    if obj not in out:
        out[obj] = [getattr(f, obj) for f in finals]
    return out


def main() -> None:
    from evomerge.procs import apply_threads

    apply_threads()  # as the commands do: side by side, torch's default threads ran trials 4-7x slower
    ap = argparse.ArgumentParser()
    ap.add_argument("--studies", nargs="+", default=["mnist-gossip", "mnist-stragglers"])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-seeds", type=int, nargs="+", default=[1000, 1001, 1002])
    ap.add_argument("--data-dir", default=os.environ.get("EVOMERGE_DATA_DIR", "../shared/data"))
    ap.add_argument("--out", default="benchmarks/rivals.json")
    ap.add_argument("--arms", nargs="+", default=["diloco", "evomerge", "snoo", "async-diloco"])
    args = ap.parse_args()
    results = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    for name in args.studies:
        base = study_mod.load(name)
        data = simulate.prepare(base, data_dir=args.data_dir).data
        for arm, s in arms(base).items():
            if arm not in args.arms:
                continue
            for seed in args.search_seeds:
                key = f"{name}/{arm}/{seed}"
                if key in results:
                    continue
                t0 = time.time()
                with tempfile.TemporaryDirectory() as runs:
                    res = evomerge.search(s, n_trials=args.trials, sampler="cmaes", runs_dir=runs, seed=seed,
                                          verdict=False, baselines=False, data=data)
                    best = res.best[0]
                policy = MergePolicy.from_dict(best["policy"])
                ev = reevaluate(base, data, policy, best["run"], args.eval_seeds)
                results[key] = {"study": name, "arm": arm, "search_seed": seed, "trial": best["number"],
                                "search_value": best["values"][0], "policy": policy.to_dict(), "run": best["run"],
                                "describe": policy.describe(), "diloco": is_diloco(policy), "eval": ev,
                                "minutes": (time.time() - t0) / 60}
                Path(args.out).write_text(json.dumps(results, indent=1))
                print(f"{key}: {policy.describe()} at lr {best['run'].get('lr', base.run.lr):.3g}: "
                      + ", ".join(f"{k} {statistics.fmean(v):.4g}" for k, v in ev.items()), flush=True)
    table(results)


def table(results: dict) -> None:
    print("| study | arm | search seed | objective on fresh seeds (mean ± sd) | val accuracy | lr | winner |")
    print("|---|---|---|---|---|---|---|")
    for key, r in results.items():
        ev = r["eval"]
        obj = next((k for k in ev if k != "val_accuracy"), "val_accuracy")  # the study's objective
        v = ev[obj]
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(f"| {r['study']} | {r['arm']} | {r['search_seed']} | {obj} {statistics.fmean(v):.4g} ± {sd:.2g} | "
              f"{statistics.fmean(ev['val_accuracy']):.4f} | {r['run'].get('lr', float('nan')):.3g} | "
              f"{'DiLoCo' if r['diloco'] else ''} {r['describe']} |")


if __name__ == "__main__":
    main()
