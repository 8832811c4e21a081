"""The ``evomerge`` command. Each command registers its parser and handler;
``main`` returns an exit code: 0 ok, 1 a run failed, 2 bad input, 130 interrupted.

torch, rich and the rest are imported inside handlers so that ``--help`` and input
errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from .errors import ConfigError

COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def command(fn):
    COMMANDS[fn.__name__.removeprefix("add_")] = fn
    return fn


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help="study name (studies/NAME.toml) or path to a .toml file")
    p.add_argument("--data-dir", default=None, help="where the dataset's IDX files are (else $EVOMERGE_DATA_DIR, then the user cache)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@command
def add_run(sub):
    p = sub.add_parser("run", help="run one policy on a study and print its metrics")
    _common(p)
    p.add_argument("--policy", required=True, help="policy JSON file (or exported file), or a named policy of the study")
    p.add_argument("--seed", type=int, default=None, help="run seed (default: the study's first seed)")
    p.set_defaults(handler=cmd_run)


@command
def add_baselines(sub):
    p = sub.add_parser("baselines", help="run the study's baseline policies and print one row each")
    _common(p)
    p.add_argument("--seed", type=int, default=None, help="run seed (default: the study's first seed)")
    p.set_defaults(handler=cmd_baselines)


@command
def add_policy(sub):
    p = sub.add_parser("policy", help="policy files: print the JSON Schema, or validate a file")
    ps = p.add_subparsers(dest="policy_command", required=True, metavar="{schema,validate}")
    s = ps.add_parser("schema", help="print the policy JSON Schema")
    s.set_defaults(handler=cmd_policy_schema)
    v = ps.add_parser("validate", help="check a policy file and describe it")
    v.add_argument("file")
    v.set_defaults(handler=cmd_policy_validate)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="evomerge", description="Search for the best way for data-parallel workers to merge their models.")
    parser.add_argument("--version", action="version", version=f"evomerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# -- handlers ---------------------------------------------------------------------
def cmd_policy_schema(args) -> int:
    from .policy import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_policy_validate(args) -> int:
    from .policy import MergePolicy

    pol = MergePolicy.load(args.file)
    print(f"ok: {pol.describe()}")
    return 0


def _prepare(study, args):
    from . import simulate

    return simulate.prepare(study, data_dir=args.data_dir)


def _run_with_progress(setup, policy, seed, device, quiet, label):
    from . import simulate

    if quiet:
        return simulate.simulate(setup, policy, seed, device=device)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), transient=True,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task(label, total=setup.total_steps, acc="")

        def on_round(m):
            bar.update(task, completed=m.step, acc=f"val acc {m.val_accuracy:.4f}")

        return simulate.simulate(setup, policy, seed, callback=on_round, device=device)


def _console():
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def cmd_run(args) -> int:
    from .study import load

    study = load(args.study)
    policy = study.resolve_policy(args.policy)  # every input is checked before data is read
    setup = _prepare(study, args)
    seed = study.run.seeds[0] if args.seed is None else args.seed
    res = _run_with_progress(setup, policy, seed, args.device, args.quiet, policy.name or Path(args.policy).stem)
    from rich.table import Table

    f = res.final
    t = Table(title=f"{study.name}: {policy.name or args.policy} (seed {seed})", caption=policy.describe())
    t.add_column("metric")
    t.add_column("value", justify="right")
    for name, value in [
        ("status", res.status),
        ("consensus val accuracy", f"{f.val_accuracy:.4f}"),
        ("mean worker accuracy", f"{f.mean_worker_accuracy:.4f}"),
        ("worst worker accuracy", f"{f.worst_worker_accuracy:.4f}"),
        ("consensus distance", f"{f.consensus_distance:.4g}"),
        ("bytes sent", _mb(f.bytes)),
        ("merge events", f"{f.merges}"),
        ("local steps", f"{f.step} of {res.total_steps}"),
        ("wall time", f"{res.wall_time:.2f} s"),
    ]:
        t.add_row(name, value)
    _console().print(t)
    if args.json_out:
        out = res.to_dict() | {"study": study.name}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0 if res.status == "ok" else 1


def cmd_baselines(args) -> int:
    from .study import load

    study = load(args.study)
    seed = study.run.seeds[0] if args.seed is None else args.seed
    policies = [(name, study.resolve_policy(name)) for name in study.baselines]
    setup = _prepare(study, args)
    results = [(name, _run_with_progress(setup, pol, seed, args.device, args.quiet, name)) for name, pol in policies]
    from rich.table import Table

    t = Table(title=f"{study.name}: baselines (seed {seed}, {setup.total_steps} local steps, {study.run.workers} workers)")
    for col in ("policy", "status", "val acc", "mean worker", "worst worker", "consensus dist", "bytes", "merges", "wall"):
        t.add_column(col, justify="left" if col in ("policy", "status") else "right")
    for name, r in results:
        f = r.final
        t.add_row(name, r.status, f"{f.val_accuracy:.4f}", f"{f.mean_worker_accuracy:.4f}", f"{f.worst_worker_accuracy:.4f}",
                  f"{f.consensus_distance:.3g}", _mb(f.bytes), f"{f.merges}", f"{r.wall_time:.2f} s")
    _console().print(t)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"study": study.name, "seed": seed,
                                                   "baselines": {n: r.to_dict() for n, r in results}}, indent=2))
    return 0 if all(r.status == "ok" for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
