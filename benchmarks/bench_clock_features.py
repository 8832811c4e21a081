"""What the asynchronous-training ideas cost the simulated clock: wall time of a timed run of a policy with each
feature against the same policy without it (issue 24's target: <= 1.5x).

mnist-stragglers' cluster (16 workers, lognormal speeds, one 4x straggler, blocking merges, 1 Gbit/s links), its
time budget, two rounds. Complete-graph push-pull gossip every 4 local steps, alone and with:

  swaps               swap_p 0.3 (two model transfers; the initiator waits)
  data                data_exchange_k 8 (the examples ride with the payloads)
  swaps by confidence swap_p 0.3, swap_confidence 0.5 (the clock asks the replay for the peer's confidence)
  similarity peers    similarity_bias 0.5 (the clock asks the replay for every worker's sketch at each event)
  data by similarity  data_exchange_k 8, data_similarity_sign 0.5
  regrouping          communities of 4, regrouped every round (against the same communities without)
  ..., published      the three decided by the state, reading what every worker publishes every 4 nominal
                      step times (publish_every 4) instead of its state at each event
  ... vs data         examples by similarity against data that travels without similarity (the same k)

Interleaved and repeated; the figure is training-and-merging wall time (evaluation excluded) per worker-step, and
the ratio with / without (each repeat's pair side by side; the median of those ratios). Check that nothing else
runs (uptime) and that two runs agree. Run:

    .venv/bin/python benchmarks/bench_clock_features.py [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from evomerge import simulate, study
from evomerge.policy import MergePolicy

ROOT = Path(__file__).resolve().parent.parent
PLAIN = MergePolicy(topology="complete", mean_interval=4.0, exchange="push_pull")
DATA = PLAIN.replace(data_exchange_k=8)
COMMUNITIES = MergePolicy(topology="communities", n_communities=4, mean_interval=4.0, exchange="push_pull")
CASES = {
    "swaps": (PLAIN, PLAIN.replace(swap_p=0.3)),
    "data": (PLAIN, PLAIN.replace(data_exchange_k=8)),
    "swaps by confidence": (PLAIN, PLAIN.replace(swap_p=0.3, swap_confidence=0.5)),
    "similarity peers": (PLAIN, PLAIN.replace(similarity_bias=0.5)),
    "data by similarity": (PLAIN, PLAIN.replace(data_exchange_k=8, data_similarity_sign=0.5)),
    "regrouping": (COMMUNITIES, COMMUNITIES.replace(regroup_every=1)),
    # the same decisions read from what the workers publish every 4 nominal step times (publish_every)
    "swaps by confidence, published": (PLAIN, PLAIN.replace(swap_p=0.3, swap_confidence=0.5, publish_every=4)),
    "similarity peers, published": (PLAIN, PLAIN.replace(similarity_bias=0.5, publish_every=4)),
    "data by similarity, published": (PLAIN, PLAIN.replace(data_exchange_k=8, data_similarity_sign=0.5,
                                                           publish_every=4)),
    # examples by similarity against data that travels without it (the least confident travel)
    "data by similarity vs data": (DATA, DATA.replace(data_similarity_sign=0.5)),
    "data by similarity, published, vs data": (DATA, DATA.replace(data_similarity_sign=0.5, publish_every=4)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    args = ap.parse_args()
    base = study.load("mnist-stragglers")
    base = dataclasses.replace(base, run=dataclasses.replace(base.run, rounds=2, eval_samples=500))
    setup = simulate.prepare(base, data_dir=args.data_dir)
    W = base.run.workers
    print(f"mnist-stragglers' cluster, {W} workers, {base.environment.time_budget:g} simulated s; "
          f"{args.repeats} repeats, interleaved")
    per: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for name, pair in CASES.items():
            for k, policy in enumerate(pair):
                t = time.perf_counter()
                r = simulate.simulate(setup, policy, 0, device="cpu")
                wall = time.perf_counter() - t - r.eval_time
                per.setdefault((name, k), []).append(wall / (r.final.steps_mean * W) * 1e3)
    # the ratio of each repeat's pair, run one after the other (a slow drift of the machine cancels), then the median
    print("\n| feature | without (ms / worker-step) | with | with / without (median of the repeats' ratios) |")
    print("|---|---|---|---|")
    for name in CASES:
        a, b = statistics.median(per[(name, 0)]), statistics.median(per[(name, 1)])
        ratio = statistics.median(y / x for x, y in zip(per[(name, 0)], per[(name, 1)]))
        print(f"| {name} | {a:.3f} | {b:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
