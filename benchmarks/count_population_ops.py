"""Tensor operations per member per local step of a population: what a GPU launches, counted on any machine.

On a GPU a population of small trials is bound by the host: every tensor operation is a kernel launch and some
Python, so the operations a member costs per local step say how far ``--batch N`` can go, and a change that
removes some is measured here without a GPU (timings on CUDA: ``bench_population.py --device cuda``). Every aten
operation the population dispatches is counted (``TorchDispatchMode``; views such as ``select`` and ``expand``
launch nothing but still cost the host a call) and charged to the part of ``run_population`` it ran in: local
steps, merges, evaluation, the round's bookkeeping. ``--by-line`` lists where in evomerge they come from.

Run two versions side by side (``--root`` a checkout of each) to compare them:

    .venv/bin/python benchmarks/count_population_ops.py [--n 32] [--scale 0.25] [--cross on] [--root DIR] [--by-line]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARTS = {  # (file name, function) -> part of the population, as profile_population.py has them
    ("population.py", "step"): "local steps",
    ("population.py", "merge"): "merges",
    ("judge.py", "evaluate_many"): "evaluation",
    ("population.py", "_judge_round"): "round bookkeeping",
    ("population.py", "compact"): "compaction",
}
VIEWS = {"aten.view.default", "aten.select.int", "aten.slice.Tensor", "aten.expand.default", "aten.unsqueeze.default",
         "aten.transpose.int", "aten.t.default", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.alias.default",
         "aten.squeeze.dim", "aten.permute.default", "aten.lift_fresh.default", "aten._unsafe_view.default",
         "aten.detach.default", "aten.as_strided.default", "aten.unbind.int"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--study", default=str(HERE.parent / "studies" / "mnist-gossip.toml"))
    ap.add_argument("--cross", choices=("on", "off"), default="on", help="merges applied together (the CUDA default)")
    ap.add_argument("--root", default=str(HERE.parent), help="the checkout whose evomerge to count (default: this one)")
    ap.add_argument("--data-dir", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--by-line", type=int, default=0, help="list this many lines of evomerge with the most operations")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(args.root).resolve()))
    sys.path.insert(1, str(HERE))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import evomerge
    from bench_population import policies
    from evomerge import simulate, study
    from evomerge.backends.population import Member, run_population

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.parts, self.launches, self.lines = collections.Counter(), collections.Counter(), collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            f, part, line = sys._getframe(1), "other", None
            while f is not None:
                code = f.f_code
                if line is None and "evomerge" in code.co_filename:
                    line = f"{Path(code.co_filename).name}:{f.f_lineno} {code.co_name}"
                key = (Path(code.co_filename).name, code.co_name)
                if key in PARTS:
                    part = PARTS[key]
                    break
                f = f.f_back
            self.parts[part] += 1
            if str(func) not in VIEWS:
                self.launches[part] += 1
            self.lines[(part, line)] += 1
            return func(*args, **(kwargs or {}))

    s = study.load(args.study)
    s = dataclasses.replace(s, run=dataclasses.replace(s.run, epochs=s.run.epochs * args.scale))
    setup = simulate.prepare(s, data_dir=args.data_dir)
    members = [Member(p, s.run.seeds[0]) for p in policies(s, args.n, seed=args.n)]
    with Count() as c:
        run_population(setup, members, "cpu", cross=args.cross == "on")
    per = args.n * setup.total_steps
    print(f"{s.name}, evomerge from {Path(evomerge.__file__).parent.parent}: N={args.n}, {setup.total_steps} local steps "
          f"a trial, merges together: {args.cross}")
    print(f"{'part':<20} {'operations':>11} {'per member-step':>16} {'not views':>10}")
    for part, v in sorted(c.parts.items(), key=lambda kv: -kv[1]):
        print(f"{part:<20} {v:>11} {v / per:>16.2f} {c.launches[part] / per:>10.2f}")
    total = sum(c.parts.values())
    print(f"{'all':<20} {total:>11} {total / per:>16.2f} {sum(c.launches.values()) / per:>10.2f}")
    for (part, line), v in c.lines.most_common(args.by_line):
        print(f"  {part:<18} {line or '(outside evomerge)':<60} {v / per:6.2f}")


if __name__ == "__main__":
    main()
