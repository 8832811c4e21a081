"""Trials per minute of the search a user runs: ``evomerge search --batch N`` as a command, with its Optuna study and
MLflow runs on SQLite in a fresh folder, timed from the first trial's start to the last trial's end (as the Optuna
study records them) and over the whole command (start-up and the baselines' runs too). Where
``benchmarks/bench_population.py`` times the population alone, this times everything a trial costs: Optuna's ask,
tell and attributes, the MLflow run.

    .venv/bin/python benchmarks/bench_search.py [--study mnist-gossip] [--batch 128] [--trials 256] [--sampler random]
        [--device cuda] [--data-dir DIR] [--epochs 0.02] [--jobs 2] [--profile FILE]

``--epochs`` replaces the study's epochs (a copy of the study in the run's folder): a short training shows what the
bookkeeping costs per trial on a CPU. ``--profile FILE`` runs the command under cProfile (its times then run
slower) and prints the functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", default="mnist-gossip")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--trials", type=int, default=256)
    ap.add_argument("--sampler", default="random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--epochs", type=float, default=None, help="replace the study's epochs (default: keep them)")
    ap.add_argument("--jobs", type=int, default=1, help="search processes on the study (evomerge search --jobs)")
    ap.add_argument("--profile", default=None, help="cProfile the command into this file (the main process only)")
    args = ap.parse_args()

    import optuna

    from evomerge import study as study_mod

    with tempfile.TemporaryDirectory() as tmp:
        s = study_mod.load(args.study)
        path = s.path
        if args.epochs is not None:
            text = Path(s.path).read_text()
            text, n = re.subn(r"(?m)^epochs = [0-9.]+", f"epochs = {args.epochs}", text)
            assert n == 1, "the study's [run] epochs line"
            path = Path(tmp) / Path(s.path).name
            path.write_text(text)
        prof = ["-m", "cProfile", "-o", str(Path(args.profile).resolve())] if args.profile else []
        cmd = [sys.executable, *prof, "-m", "evomerge.cli", "search", "--study", str(path), "--data-dir", str(Path(args.data_dir).resolve()),
               "--device", args.device, "--batch", str(args.batch), "--n-trials", str(args.trials), "--sampler",
               args.sampler, "--jobs", str(args.jobs), "--no-verdict", "--quiet", "--runs-dir", str(Path(tmp) / "runs")]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        wall = time.perf_counter() - t
        if p.returncode:
            sys.exit(f"the search failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
        st = optuna.load_study(study_name=s.name, storage=f"sqlite:///{Path(tmp) / 'runs' / s.name / 'optuna.db'}")
        ended = [x for x in st.trials if x.datetime_complete]
        span = (max(x.datetime_complete for x in ended) - min(x.datetime_start for x in ended)).total_seconds()
        states = {k: sum(x.state.name == k for x in st.trials) for k in ("COMPLETE", "PRUNED", "FAIL")}
        print(f"{s.name}: --batch {args.batch} --jobs {args.jobs}, {len(ended)} trials {states}, sampler {args.sampler}, device "
              f"{args.device}: first start to last end {span:.1f} s = {60 * len(ended) / span:.0f} trials/min; "
              f"the command {wall:.1f} s = {60 * len(ended) / wall:.0f} trials/min{' (profiled)' if args.profile else ''}")
    if args.profile:
        import pstats

        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
