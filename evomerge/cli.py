"""The ``evomerge`` command. Each command registers its parser and handler;
``main`` returns an exit code: 0 ok, 1 a run failed, 2 bad input, 130 interrupted.

torch, rich and the rest are imported inside handlers so that ``--help`` and input
errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable

from .dburls import shown
from . import _check_seed_and_device
from .errors import ConfigError, RunError, did_you_mean, unknown

COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def command(fn):
    COMMANDS[fn.__name__.removeprefix("add_")] = fn
    return fn


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help as written: every option states its default in its own words; the epilog keeps its lines."""


STUDY_HELP = ("study name (studies/NAME.toml in the current folder, else the shipped studies) or path to a .toml "
              "file; required")
# the environment variables and the flag of a command that reads each (the threads: the commands that train,
# which read data)
ENV_LINES = (("--data-dir", "  EVOMERGE_DATA_DIR   where the dataset files are when --data-dir is not given"),
             ("--runs-dir", "  EVOMERGE_RUNS_DIR   the default of --runs-dir (else ./runs)"),
             ("--tracking-uri", "  MLFLOW_TRACKING_URI the default of --tracking-uri"),
             ("--data-dir", "  EVOMERGE_THREADS    torch threads for training (default: the cores idle when the command "
                            "starts)"))
ENV_NOTE = "\n".join(["environment:", *(line for _, line in ENV_LINES)])


class _Parser(argparse.ArgumentParser):
    """Bad flags as every other bad input: one line naming the flag, exit 2 (``--help`` shows the usage)."""

    def error(self, message: str):
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        c = re.match(r"invalid choice: '(.*)' \(choose from (.*)\)$", m[2]) if m else None
        if c:  # a command, or a flag's choices
            allowed = [x.strip(" '") for x in c[2].split(",")]
            line = f"{'command' if m[1].startswith('{') else m[1]}: {unknown(c[1], allowed)}"
        elif m and (t := re.match(r"invalid (int|float) value: (.*)$", m[2])):  # argparse's words for a type
            line = f"{m[1]}: must be {'an integer' if t[1] == 'int' else 'a number'}, got {t[2]}; see {self.prog} --help"
        elif m and m[2] == "expected one argument":
            line = f"{m[1]}: needs a value ({m[1]} {self._metavar(m[1])}); see {self.prog} --help"
        elif m:
            line = f"{m[1]}: {m[2]}"
        elif message.startswith("the following arguments are required: "):
            names = ", ".join("command" if n.startswith("{") else n for n in message.split(": ", 1)[1].split(", "))
            line = f"{names}: required; see {self.prog} --help"
        else:
            line = message
        self.exit(2, f"error: {line}\n")

    def _metavar(self, flag: str) -> str:
        """What ``flag`` takes, as its help names it (FILE, N, ...)."""
        for a in self._actions:
            if flag in a.option_strings:
                return a.metavar or a.dest.upper()
        return "VALUE"


def _unrecognized(parser: argparse.ArgumentParser, args, extra: list[str], argv: list[str]) -> str:
    """The one line for flags the command does not take (or ``evomerge`` itself, before the command), with the
    nearest it does."""
    flag = next((x.split("=", 1)[0] for x in extra if x.startswith("-") and x != "--"), extra[0])
    path = tuple(x for x in (args.command, getattr(args, "policy_command", None)) if x)
    raw = next((x for x in extra if x.startswith("-") and x != "--"), extra[0])  # as typed (--runs-dir=r)
    before = raw in argv and args.command in argv and argv.index(raw) < argv.index(args.command)
    sub = parser if before else dict(commands(parser)).get(path, parser)
    if extra[0] == "--":
        return f"--: {sub.prog} takes no arguments after it ({' '.join(extra)}); see {sub.prog} --help"
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    # a flag of other commands (baselines --runs-dir) is theirs, not a misspelling of one of this command's
    others = [p.prog.split(" ", 1)[1] for k, p in commands(parser)
              if p is not sub and any(flag in a.option_strings for a in p._actions)]
    if before and flag.startswith("--") and args.command in others:  # `evomerge --runs-dir r search`
        hint = f"a flag of evomerge {args.command} goes after it (evomerge {args.command} {flag} ...)"
    elif flag.startswith("--") and others:
        hint = f"{flag} is for evomerge {', '.join(others)}; see {sub.prog} --help"
    elif others and not flag.startswith("--"):
        # another command's short flag (export's -o): this command's nearest to its long form, spelt as the short
        # one (transfer's --top is no -o)
        near = did_you_mean(_long_form(parser, flag), known)[2:]
        near = near if near.startswith(f"did you mean --{flag[1:]}") else f"see {sub.prog} --help"
        hint = f"{near} ({flag} is evomerge {', '.join(others)}'s)"
    else:
        hint = did_you_mean(flag, known)[2:] or f"see {sub.prog} --help"
    return f"{flag}: {sub.prog} does not take it ({' '.join(shown(x) for x in extra)}); {hint}"


def _long_form(parser: argparse.ArgumentParser, flag: str) -> str:
    """The long form of a short flag, as the first command that takes it spells it (``-o``: ``--output``)."""
    return next((o for _, p in commands(parser) for a in p._actions if flag in a.option_strings
                 for o in a.option_strings if o.startswith("--")), flag)


def _parser(sub, name: str, help: str, example: str, env: bool = True) -> argparse.ArgumentParser:
    """A command's parser whose help ends with an example (and the environment variables it reads)."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=_Help,
                          epilog=f"example:\n  {example}" + (f"\n\n{ENV_NOTE}" if env else ""))


def _study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help=STUDY_HELP)


def _option(p: argparse.ArgumentParser, name: str, why: str = "") -> None:
    """A flag that is one of the search's options (search/options.py: its help and default, defined once)."""
    from .search.options import BY_NAME

    BY_NAME[name].add_to(p, why)


def _data_dir(p: argparse.ArgumentParser, why: str = "") -> None:
    _option(p, "data_dir", why)


def _common(p: argparse.ArgumentParser) -> None:
    _study(p)
    _data_dir(p)
    _option(p, "device")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="also write the results as JSON to FILE "
                                                                                  "(default: no file)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _option(p, "backend")
    _option(p, "procs")


def _emulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate-time", action="store_true",
                   help="distributed backend on a study with an [environment]: each rank sleeps its simulated step "
                        "and transfer times, so the wall clock can be held against the simulated one (default: off)")


def _store(p: argparse.ArgumentParser, tracking: bool = True) -> None:
    _option(p, "runs_dir")
    _option(p, "storage")
    if tracking:
        _option(p, "tracking_uri")


@command
def add_search(sub):
    p = _parser(sub, "search", "search merge policies with Optuna or CMA-ES, tracked in MLflow",
                "evomerge search --study mnist-gossip --n-trials 30 --jobs 2")
    _common(p)
    _store(p)
    from .search.options import OPTIONS

    for o in OPTIONS:  # the rest of the search's options, from the one table (search/options.py)
        if not o.common:
            o.add_to(p)
    p.set_defaults(handler=cmd_search)


@command
def add_transfer(sub):
    p = _parser(sub, "transfer", "re-run a study's top policies on a target study and compare the two rankings",
                "evomerge transfer --study mnist-gossip --target mnist-gossip-64 --top 10")
    _common(p)
    _store(p)
    p.add_argument("--target", required=True, help="the study to re-run them on (a name or a .toml file, as --study); "
                                                   "required")
    p.add_argument("--top", type=int, default=10, help="how many of the study's best policies (default: 10)")
    p.add_argument("--seeds", type=int, default=1,
                   help="fresh seeds per policy on the target, past its own seeds (default: 1)")
    p.set_defaults(handler=cmd_transfer)


@command
def add_status(sub):
    p = _parser(sub, "status", "a study's trials by state and its best: the top 5, or the Pareto-optimal trials", "evomerge status --study mnist-gossip")
    _study(p)
    _store(p, tracking=False)
    p.set_defaults(handler=cmd_status)


@command
def add_export(sub):
    p = _parser(sub, "export", "write the best policy (or the Pareto set) as replayable JSON",
                "evomerge export --study mnist-gossip -o best.json && "
                "evomerge run --study mnist-gossip --policy best.json --reevaluate 5")
    _study(p)
    _store(p, tracking=False)
    p.add_argument("-o", "--output", required=True, help="a file (best policy) or, with --pareto, a folder; required")
    p.add_argument("--pareto", action="store_true", help="one file per Pareto-optimal trial")
    p.add_argument("--trial", type=int, default=None, metavar="N",
                   help="write trial N's policy (a complete trial, by its number in the dashboard or MLflow) instead "
                        "of the best (default: the best)")
    p.add_argument("--tolerance", default=None, metavar="X or P%",
                   help="several objectives: the Pareto-optimal trials within X of the best first objective (in its "
                        "unit), or within P%% of it, are candidates, and the best by the second is written (default: "
                        "0.005 for an accuracy, else 0.5%%)")
    p.add_argument("--limit", action="append", default=None, metavar="OBJECTIVE=VALUE",
                   help="only trials whose OBJECTIVE is at most VALUE (minimised) or at least VALUE (maximised), "
                        "e.g. --limit bytes=1e8; repeatable (default: none)")
    p.set_defaults(handler=cmd_export)


@command
def add_dashboard(sub):
    p = _parser(sub, "dashboard", "write the study's dashboard (HTML with plots) and say where",
                "evomerge dashboard --study mnist-gossip --open")
    _study(p)
    _store(p)
    p.add_argument("-o", "--out", default=None, help="folder for index.html (default: dashboards/STUDY)")
    _data_dir(p, " (for running the baselines, if the search has not yet)")
    p.add_argument("--no-baselines", action="store_true", help="leave the baselines out (no runs at all)")
    p.add_argument("--open", action="store_true", help="open the page in the web browser")
    p.set_defaults(handler=cmd_dashboard)


@command
def add_ui(sub):
    p = _parser(sub, "ui", "the MLflow UI on the study's tracking store, on 127.0.0.1",
                "evomerge ui --study mnist-gossip --port 5000")
    _study(p)
    _store(p)
    p.add_argument("--port", type=int, default=0, help="port (default: 0, meaning a free one)")
    p.set_defaults(handler=cmd_ui)


def _shipped_policies() -> str:
    """The shipped named policies, for the help (without importing the study module)."""
    from .registry import shipped_studies_dir

    return ", ".join(sorted(f.stem for f in (shipped_studies_dir() / "policies").glob("*.json"))) or "none"


@command
def add_run(sub):
    p = _parser(sub, "run", "run one policy on a study and print its metrics",
                "evomerge run --study mnist-gossip --policy ring-gossip --seed 1")
    _common(p)
    _store(p, tracking=False)  # where a study named by --study alone was searched
    _emulate(p)
    p.add_argument("--policy", default=None,
                   help="policy JSON file (or exported file), or a named policy: the study's policies/NAME.json, "
                        f"else a shipped one ({_shipped_policies()}); required, but with --against (default: the job's "
                        "policy, as its traces say)")
    p.add_argument("--seed", type=int, default=None,
                   help="run seed (default: an exported file's first seed, else the study's first seed)")
    p.add_argument("--reevaluate", type=int, default=0, metavar="N",
                   help="run N fresh seeds and report test-set accuracy with mean and spread (default: 0, off)")
    p.add_argument("--lr", type=float, default=None,
                   help="the step size of this run, e.g. a baseline's best as the search's verdict names it "
                        "(default: an exported file's searched run.lr, else the study's run.lr)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="hold the simulated clock against a Merger job's traces (trace=DIR): --policy the policy the "
                        "job ran (without it, the traces' own), on every worker the job's steps, as each rank took them, with the job's seed (unless "
                        "--seed); its simulated time is printed beside the job's wall time, with the error (default: none)")
    p.set_defaults(handler=cmd_run)


@command
def add_baselines(sub):
    p = _parser(sub, "baselines", "run the study's baseline policies and print one row each",
                "evomerge baselines --study path/to/my-study.toml")
    _common(p)
    _store(p, tracking=False)  # where a study named by --study alone was searched, and its baselines' step sizes
    _emulate(p)
    p.add_argument("--seed", type=int, default=None, help="run seed (default: the study's first seed)")
    p.set_defaults(handler=cmd_baselines)


@command
def add_calibrate(sub):
    from .calibrate import add_options

    p = _parser(sub, "calibrate", "measure this cluster (step times, links) or a Merger's traces, and write an "
                                  "[environment] for a study's `from`",
                "evomerge calibrate --study my.toml --procs 4 -o cluster.toml")
    add_options(p, launcher=True)
    p.set_defaults(handler=cmd_calibrate)


@command
def add_policy(sub):
    p = _parser(sub, "policy", "policy files: print the JSON Schema, or validate a file",
                "evomerge policy validate best.json", env=False)
    ps = p.add_subparsers(dest="policy_command", required=True, metavar="{schema,validate}")
    s = _parser(ps, "schema", "print the policy JSON Schema", "evomerge policy schema > policy.schema.json", env=False)
    s.set_defaults(handler=cmd_policy_schema)
    v = _parser(ps, "validate", "check a policy file and describe it", "evomerge policy validate best.json", env=False)
    v.add_argument("file", help="a policy JSON file, an exported file, or a shipped policy's name")
    v.set_defaults(handler=cmd_policy_validate)


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    parser = _Parser(
        prog="evomerge", description="Search for the best way for data-parallel workers to merge their models.",
        formatter_class=_Help, epilog="example:\n  evomerge search --study mnist-gossip && evomerge dashboard --study "
                                      f"mnist-gossip --open\n\n{ENV_NOTE}")
    parser.add_argument("--version", action="version", version=f"evomerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for add in COMMANDS.values():
        add(sub)
    for _, p in commands(parser):  # each command's environment: the variables of the flags it has
        if p.epilog and ENV_NOTE in p.epilog:
            flags = {s for a in p._actions for s in a.option_strings}
            lines = [line for flag, line in ENV_LINES if flag in flags]
            p.epilog = p.epilog.replace(f"\n\n{ENV_NOTE}", "\n\n" + "\n".join(["environment:", *lines]) if lines
                                        else "")
    return parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every command and sub-command under ``parser``, depth first: what the CLI
    reference (docs/hooks/reference.py) documents and the CLI tests walk."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                yield path + (name,), p
                yield from commands(p, path + (name,))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # a negative percentage after --tolerance looked to argparse like a flag ("needs a value"): held to its flag,
    # so that its own range check says what is wrong with it
    argv = [f"{a}={argv[i + 1]}" if a == "--tolerance" and i + 1 < len(argv) and argv[i + 1].startswith("-")
            and argv[i + 1][1:2].isdigit() else a for i, a in enumerate(argv)
            if not (i > 0 and argv[i - 1] == "--tolerance" and a.startswith("-") and a[1:2].isdigit())]
    args, extra = parser.parse_known_args(argv)
    if extra:
        print(f"error: {_unrecognized(parser, args, extra, argv)}", file=sys.stderr)
        return 2
    from .procs import signals_raise

    # MLflow prints "View run ... at: URL" for every run it ends on a tracking server, addresses that open its GenAI
    # view; the commands print their own (workflowType=machine_learning). The process is the command's: its setting
    # for MLflow, unless the user's environment says otherwise
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    try:
        _check_seed_and_device(getattr(args, "seed", None), getattr(args, "device", None))  # before any data is read
        if getattr(args, "json_out", None):  # before the work whose results it would hold
            from .userdirs import check_writable

            check_writable(args.json_out, "--json")
        with signals_raise():  # SIGTERM and SIGHUP stop every command as Ctrl-C does (run and baselines died silently)
            return args.handler(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`evomerge policy schema | head`, or of stderr `2>&1 | head`): end
        # quietly, as a shell tool does
        gone = [f for f in (sys.stdout, sys.stderr) if _gone(f)]
        if not gone:
            raise
        # what is still buffered for them would raise again at the interpreter's exit: send it nowhere
        null = os.open(os.devnull, os.O_WRONLY)
        for f in gone:
            os.dup2(null, f.fileno())
        os.close(null)
        return 128 + 13  # SIGPIPE's exit status
    except Exception as e:  # a database that stopped answering mid-command: one line, not its drivers' tracebacks
        said = _database_gone(e)
        if said is not None:
            print(f"error: the database connection failed ({said}); what finished before it is stored: run the same "
                  "command again once the database answers", file=sys.stderr)
            return 1
        said = _tracking_gone(e)
        if said is None:
            raise
        print(f"error: the MLflow tracking server stopped answering ({said}); the trials finished before it are stored "
              "with the study: run the same command again once the server answers", file=sys.stderr)
        return 1


def _database_gone(e: BaseException) -> str | None:
    """The driver's own first line where ``e`` (or what it was raised from) is a lost connection to a database:
    SQLAlchemy's OperationalError or InterfaceError, or psycopg's (Optuna wraps them in a StorageInternalError that
    blames "invalid data in the commit"); else None."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:  # what it was raised from (Optuna: `raise ... from e`), not near
        seen.add(id(e))
        mod, name = type(e).__module__ or "", type(e).__name__
        if mod.startswith(("sqlalchemy", "psycopg")) and name in ("OperationalError", "InterfaceError"):
            orig = getattr(e, "orig", None) or e  # the driver's words; SQLite's own (a locked file) are not a server's
            if not (type(orig).__module__ or "").startswith("sqlite3"):
                found = orig
        e = e.__cause__
    if found is None:
        return None
    from .dburls import first_line

    return first_line(found)


def _tracking_gone(e: BaseException) -> str | None:
    """What MLflow said, in a few words, where ``e`` is its request to a tracking server that failed to connect (after
    its own retries: ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``); else None."""
    if type(e).__name__ != "MlflowException" or not (type(e).__module__ or "").startswith("mlflow"):
        return None
    text = str(e)
    m = re.match(r"API request to (\S+) failed with exception", text)
    if m is None or not re.search(r"Max retries exceeded|ConnectionError|Connection refused|timed out|"
                                  r"RemoteDisconnected|Connection aborted", text):
        return None
    why = re.search(r"\[Errno -?\d+\] ([^'\"]+)", text) or re.search(r"(Read timed out|Connection aborted|"
                                                                   r"RemoteDisconnected|Max retries exceeded)", text)
    from .dburls import shown

    return f"a request to {shown(m[1])} failed: {why[1] if why else 'no answer'}"  # (a password in it masked)


def _prog() -> str:
    """This command as its user can type it again: ``evomerge`` where that is the one the shell finds, else the
    path it was started by (the quick start's ``.venv/bin/evomerge``, its environment not activated: a printed
    ``evomerge export ...`` was "command not found"), or ``python -m evomerge`` where it was started so."""
    import shlex
    import shutil

    argv0 = sys.argv[0] if sys.argv else ""
    found = shutil.which("evomerge")
    if Path(argv0).name in ("cli.py", "__main__.py") and Path(argv0).parent.name == "evomerge":  # python -m
        # evomerge(.cli): the environment's own script where the shell finds that one, else this interpreter's -m
        if found and Path(found).parent == Path(sys.executable).parent:
            return "evomerge"
        return f"{shlex.quote(sys.executable)} -m evomerge"
    if Path(argv0).name != "evomerge":  # a caller's own main()
        return "evomerge"
    if found and Path(found).resolve() == Path(argv0).resolve():
        return "evomerge"
    return shlex.quote(argv0)


def _write_json(path: str, text: str) -> None:
    """``--json FILE``'s results (the file was checked before the work: :func:`userdirs.check_writable`)."""
    try:
        Path(path).write_text(text)
    except OSError as e:  # taken away since: one line
        raise RunError(f"--json: cannot write {e.filename or path}: {e.strerror or e}") from None


def _gone(stream) -> bool:
    """Whether ``stream`` (stdout, stderr) is a pipe whose reader has closed it (another pipe's is an error of its
    own)."""
    import select

    try:
        fd = stream.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # a stdout without a descriptor (captured): not a pipe that broke
        return False


# -- handlers ---------------------------------------------------------------------
def cmd_policy_schema(args) -> int:
    from .policy import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_policy_validate(args) -> int:
    from .policy import MergePolicy

    from .policy import read_export

    from .registry import shipped_studies_dir

    path = Path(args.file)
    shipped = shipped_studies_dir() / "policies" / f"{args.file}.json"
    if not path.exists() and path.suffix != ".json" and shipped.is_file():  # a shipped policy's name, as run takes it
        path = shipped
    elif not path.exists():
        raise ConfigError("file", f"{args.file}: no such file; allowed: a policy JSON file, an exported file, or a "
                                  f"shipped policy's name ({_shipped_policies()})"
                                  + did_you_mean(args.file, _shipped_policies().split(", ")))
    pol = MergePolicy.load(path)
    read_export(path)  # an exported file's "run": the optimiser and step size it was found with
    print(f"ok: {pol.describe()}")
    _merger_note(pol)
    doc = json.loads(path.read_text())
    fields = doc.get("policy", doc) if isinstance(doc, dict) else {}
    if pol.scheme == "allreduce" and pol.outer_optimizer == "none" and isinstance(fields, dict) and \
            "mixing_weight" not in fields:  # (a user's "average every 10 steps" took half of FedAvg's step, unsaid)
        print(f"note: mixing_weight is not given: {pol.mixing_weight:g}, the default, moves each worker "
              f"{'halfway' if pol.mixing_weight == 0.5 else 'part of the way'} to the average at each all-reduce; "
              "complete averaging (FedAvg, the shipped fedavg and allreduce) is mixing_weight 1", file=sys.stderr)
    if pol.fragments > 1:  # (said "ok" to 8 fragments of a model of 4 tensors, which run then refused)
        strided = pol.fragment_pattern == "strided"
        print(f"note: {pol.fragments} {'strided ' * strided}fragments need a model of at least {pol.fragments} "
              f"{'layers' if strided else 'parameter tensors'}: checked against the study's model when it runs "
              "(evomerge run --study S --policy FILE)", file=sys.stderr)
    return 0


def _merger_note(policy, study=None) -> None:
    """One line where evomerge.Merger would refuse ``policy`` in a training loop (evomerge run still replays it), or
    needs more of the loop than its model and optimiser (each rank's held-out examples)."""
    from .runtime import _holdout_scored, check_policy

    try:
        check_policy(policy)
    except ConfigError as e:
        print(f"note: evomerge run replays it; in a training loop evomerge.Merger refuses it: {e}")
        return
    from .policy import workers_needed

    need = workers_needed(policy)
    if need:
        print(f"note: its topology ({policy.topology}, "
              + (f"degree {policy.degree}" if policy.topology == "random_regular" else f"{policy.n_communities} communities")
              + f") runs on {need}: in a training loop, one rank per worker")
    if policy.scheme == "async" and policy.local_steps_by_speed:
        env, simulated = getattr(study, "environment", None), ""
        if env is not None:  # what the search ran it on: the study's speeds, 1 / each worker's step time multiplier
            from .engine.clock import speed_factors

            seed = study.run.seeds[0]
            speeds = 1.0 / speed_factors(env, study.run.workers, seed)
            if len(set(speeds.tolist())) > 1:
                simulated = (f"; the study simulated [{', '.join(f'{v:.3g}' for v in speeds)}]"
                             + (f" (seed {seed})" if env.speeds in ("lognormal", "pareto") else ""))
        print("note: its local steps scale by each rank's speed (local_steps_by_speed): in a training loop, pass "
              "evomerge.Merger(..., speeds=[...]), one per rank (steps per second in any common unit, or the speeds "
              f"evomerge calibrate writes{simulated})")
    if _holdout_scored(policy):
        print(f"note: its winner test (winner_bias {policy.winner_bias:g}, score 'holdout') scores models on held-out "
              "examples: in a training loop, pass evomerge.Merger(..., holdout=(x, y)) with examples each rank does "
              "not train on (and loss_fn=your loss, where it is not cross-entropy on class labels)")


def _prepare(study, args):
    from .engine.setup import prepare
    from .procs import apply_threads

    apply_threads()  # as many torch threads as there are idle cores, or $EVOMERGE_THREADS
    return prepare(study, data_dir=args.data_dir)


def _run_notes(study) -> None:
    """The study's load notes that concern a run (``run``, ``baselines``): a cluster file measured for another
    training, a user's model on mnist by default. (The search space's notes are the search's and status's.)"""
    for n in study.notes:
        if n.startswith(("study.environment", "study.data")):
            print(f"note: {n}", file=sys.stderr)


def _setup_notes(study, setup) -> None:
    """What the run commands say once the model and the step budget are known: a cluster file timed for another
    model, a time budget many times the step budget's work."""
    for note in study.setup_notes(setup.model, setup.total_steps):
        print(f"note: {note}", file=sys.stderr)


def _runner(args, study):
    from functools import partial

    from .backends import check_emulate_time, runner

    if getattr(args, "emulate_time", False):
        check_emulate_time(args.backend, study)
        return partial(runner(args.backend, args.procs, study.run.workers), emulate_time=True)
    return runner(args.backend, args.procs, study.run.workers)


def _run_with_progress(run_fn, setup, policy, seed, device, quiet, label):
    from rich.console import Console

    err = Console(stderr=True)
    if quiet or not err.is_terminal:  # a bar is for a person at a terminal (redirected, it left an empty line)
        return run_fn(setup, policy, seed, device=device)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TextColumn("{task.fields[acc]}"), TimeElapsedColumn(), transient=True, console=err) as bar:
        task = bar.add_task(label, total=setup.total_steps, acc="")

        def on_round(m):
            bar.update(task, completed=m.step, acc=f"val acc {m.val_accuracy:.4f}" if m.val_accuracy is not None else
                       f"val loss {m.val_loss:.4f}")

        return run_fn(setup, policy, seed, callback=on_round, device=device)


def _console():
    from .report.search_view import console

    return console()


def _mb(n: int) -> str:
    from .report.search_view import mb

    return mb(n)


def _num(v, fmt: str = ".4f") -> str:
    """A metric for a table: absent where the task has none (accuracy of a regression)."""
    return "—" if v is None else format(v, fmt)


def cmd_run(args) -> int:
    from .backends import found_with, given_lr, run_inputs
    from .search.results import load_or_stored

    # a file or a shipped name as it says now, else a study searched from a file elsewhere, as stored; an unknown
    # name: _load_stored's line with the known and the stored ones
    study = load_or_stored(args.study, args.runs_dir, args.storage) or _load_stored(args)
    if args.reevaluate < 0:
        raise ConfigError("--reevaluate", f"{args.reevaluate} is out of range; allowed: [0, inf)")
    if args.reevaluate and args.seed is not None:  # (dropped in silence: the fresh seeds are the study's)
        raise ConfigError("--seed", f"given with --reevaluate, which runs {args.reevaluate} fresh seeds past the "
                                    "study's; allowed: one of --seed (one run), --reevaluate")
    # every input is checked before data is read (the same checks as evomerge.run())
    job_seed, chosen = None, args.policy
    if args.against is not None and (args.seed is None or chosen is None):  # the seed the job ran: its merges as the
        from .calibrate import job_policy, job_start  # job drew them; its policy, where --policy is not given

        ran, ran_seed = job_policy(job_start(args.against))
        job_seed = ran_seed if args.seed is None else None
        if chosen is None and ran is not None:  # (a new user gave --policy the file the traces already name)
            from .policy import MergePolicy

            try:  # (one of another evomerge's fields was named "policy.x", of a --policy never given)
                chosen = MergePolicy.from_dict(ran)
            except ConfigError as e:
                raise ConfigError("--against", f"the job's policy, as its traces say, is not one this evomerge reads "
                                               f"({e}); allowed: --policy the policy the job ran") from None
    if chosen is None:
        raise ConfigError("--policy", "required" + ("; the traces of --against do not name the job's policy (an "
                                                    "older evomerge's Merger)" if args.against is not None else "")
                          + "; see evomerge run --help")  # (argparse's own line for a required flag)
    policy, seed, exported = run_inputs(study, chosen, args.seed if job_seed is None else job_seed,
                                        backend=args.backend, procs=args.procs)
    label = policy.name or (str(chosen) if isinstance(chosen, (str, Path)) else "the job's policy")
    short = policy.name or (Path(chosen).stem if isinstance(chosen, (str, Path)) else "the job's policy")
    changed = _changed_since(exported, study) if exported else ""  # the study as its file says, against the trial's
    # the step size the policy was found with (--lr's own line says the trial's)
    study, note = found_with(study, exported, ("lr",) if args.lr is not None else ())
    given = None
    if args.lr is not None:  # (after the found values: a searched weight decay stays, and is said)
        study, given, changed = given_lr(args.lr, study, exported, changed)
    elif not exported:
        note = _baseline_lr_note(study, chosen, args)
    for line in (note, given):
        if line:
            print(line)
    job = None
    if args.against is not None:  # the job's steps, on the clock, without a time budget: its time to hold against
        study, job = _against(args, study, policy, seed)
    _run_notes(study)
    run_fn = _runner(args, study)
    setup = _prepare(study, args)
    _setup_notes(study, setup)
    if job is not None and isinstance(job[3], int) and not isinstance(job[3], bool):
        from .models import float32_bytes
        from .units import size

        if job[3] != float32_bytes(setup.model):  # (a figure for another model's merges, said as the job's error)
            raise ConfigError("--against", f"the job's model is {size(job[3])} (float32 parameters and buffers, its "
                                           f"traces say), {study.name}'s {size(float32_bytes(setup.model))}: the clock "
                                           "would time another model's merges; allowed: the study of the job's model "
                                           "([model] factory, docs/own-model.md)")
    # the strategy the trial ran with, for a replay on its own study (another study's model is not the one it timed)
    own = (exported or {}).get("study") in (None, study.name) and not changed
    replay = ((exported or {}).get("execution") or "") if own else ""
    if replay and getattr(setup.model, "execution_asked", "") == "auto" and replay.split()[0] in ("stacked", "loop"):
        # the strategy the trial ran with: the same numbers, not only the same to float tolerance
        setup.model.execution, setup.model.execution_reason = replay.split()[0], "as the exported trial ran"
    from .backends import check_model

    check_model(args.backend, setup.model)
    if args.reevaluate:
        return _reevaluate(study, setup, policy, args, run_fn)
    res = _run_with_progress(run_fn, setup, policy, seed, args.device, args.quiet, short)
    from rich.table import Table

    f = res.final
    t = Table(title=f"{study.name}: {label} (seed {seed})", caption=policy.describe())
    t.add_column("metric")
    t.add_column("value", justify="right")
    backend = args.backend + (f" ({args.procs or study.run.workers} processes)" if args.backend == "distributed" else "")
    reason = getattr(setup.model, "execution_reason", "the named model")
    execution = f"{setup.model.execution} ({reason})"  # in full in --json; the table's cell cut to its first 60
    cell = f"{setup.model.execution} ({reason if len(reason) <= 60 else reason[:57] + '...'})"
    for name, value in [
        ("status", res.status),
        *([("consensus val accuracy", f"{f.val_accuracy:.4f}"),
           ("mean worker accuracy" + _worker_samples(study, setup, short=True), f"{f.mean_worker_accuracy:.4f}"),
           ("worst worker accuracy" + _worker_samples(study, setup, short=True), f"{f.worst_worker_accuracy:.4f}")]
          if f.val_accuracy is not None else []),
        (f"consensus val loss ({study.run.loss})", f"{f.val_loss:.4f}"),
        *([("consensus val perplexity", f"{f.val_perplexity:.3f}")] if f.val_perplexity is not None else []),
        ("consensus distance", f"{f.consensus_distance:.4g}"),
        ("bytes sent", _mb(f.bytes)),
        ("merge events", f"{f.merges}"),
        ("local steps", f"{f.step} of {res.total_steps}" if f.sim_time is None else
         f"{f.steps_min} / {f.steps_mean:.1f} / {f.steps_max} (slowest / mean / fastest worker{_in_budget(study)})"),
        *_time_rows(study, f),
        ("wall time", f"{res.wall_time:.2f} s"),
        ("backend", backend),
        ("execution", cell),
    ]:
        t.add_row(name, value)
    _console().print(t)
    from .search.results import policy_notes

    for words in (policy_notes(policy, [res.metrics()], study) if res.status == "ok" else {}).values():
        print(f"note: {label} {words}", file=sys.stderr)
    if job is not None and f.sim_time is not None:
        W, T, seconds, _ = job
        if not f.steps_min == f.steps_max == T:  # (the checks above keep it from happening: said, never hidden)
            print(f"error: --against: the clock's workers took {f.steps_min} to {f.steps_max} steps, not {T} each as "
                  "the job's ranks did: its time is not the job's", file=sys.stderr)
            return 1
        print(f"against {args.against}: the job took {seconds:.4g} s for {T} steps a rank on {W} ranks (its first "
              f"step to its last finish()); the clock says {f.sim_time:.4g} s, {f.sim_time / seconds - 1:+.1%} off")
        from .calibrate import _ms, job_figures, jobs_held

        held = jobs_held(args.against)
        if held > 1:  # (calibrate said it; run --against did not)
            print(f"note: --against: {args.against} holds {held} jobs (a Merger appends): the last one is held to the "
                  "clock", file=sys.stderr)

        shares, means = job_figures(args.against)
        # the job's own compute against the cluster's: a file timed on another device or model explains an error
        # by itself (a user's job of 12.4 ms steps on a file of 30.2 ms was +99%, with nothing said of why)
        env = study.environment
        if means and env is not None and env.step_time > 0:
            from .engine.clock import Compute

            # the ranks' mean steps against the clock's workers' (as it draws them: their speeds, jitter and slow
            # spells), on average: what the calibration's step_time is scaled to (one rank's own was not its mean)
            drawn, n = Compute(env, W, seed), 2000
            clock = sum(float(drawn.free_completions(w, n)[-1]) / n for w in range(W)) / W
            ratio = sum(means) / len(means) / clock
            if not 1 / STEP_SAID <= ratio <= STEP_SAID:
                print(f"note: --against: the job's ranks computed {_ms(sum(means) / len(means))} a step on average, "
                      f"the clock's workers {_ms(clock)} (the study's [environment], step_time "
                      f"{_ms(env.step_time)}; {ratio:.2f}x): the clock times steps other than this job's: another "
                      f"device or model, or another job's load on the machine (`evomerge calibrate --from-trace "
                      f"{args.against}` fits this job's)", file=sys.stderr)
        # the clock's known shortfall, said where the clock is short by SHORT_SAID or more (it was said of a clock
        # 0.4% short) and the Merger's share large enough to matter: the least share of the ranks (a rank that waits
        # for slower ones spends the waits, which the clock models, there)
        if shares and min(shares) >= IN_STEP_SAID and f.sim_time < seconds * (1 - SHORT_SAID):
            mt = env.merge_time if env is not None else 0.0
            print(f"note: --against: every rank spent at least {min(shares):.0%} of its time inside merger.step() "
                  "(merges applied and sent, the transfers, waits for peers); the clock charges the transfers and "
                  "waits it models and " + (f"merge_time ({_ms(mt)} at a step where a worker merged)" if mt else
                                            "no merge_time (the study's [environment] has none: the Merger's own work "
                                            f"at a merge is free; `evomerge calibrate --from-trace {args.against}` "
                                            "fits it)")
                  + ", so a job whose steps are short beside that work comes out short (docs/calibrate.md, How well "
                  "it predicts)", file=sys.stderr)
    if exported and exported.get("study") not in (None, study.name):  # another study's trial: nothing to match
        print(f"note: the policy is trial {exported.get('trial')} of study {exported['study']}; this run is of "
              f"{study.name}, so its figures are not compared with the trial's", file=sys.stderr)
    elif exported and job is not None:
        print(f"note: --against runs the job's {job[1]} steps without a time budget, so this run's figures are not "
              f"held to trial {exported.get('trial')}'s", file=sys.stderr)
    elif exported and str(seed) in exported.get("metrics_per_seed", {}) and changed:
        print(f"note: {study.name} changed since trial {exported.get('trial')} ran ({changed}), so this run's figures "
              "are not held to the trial's", file=sys.stderr)
    elif exported and str(seed) in exported.get("metrics_per_seed", {}):
        # the study's first objective where the run and the trial both have it (a language model's perplexity, a
        # time to target), else the consensus model's validation accuracy, or its loss
        stored_seed = exported["metrics_per_seed"][str(seed)]
        first = study.objectives[0]
        if first not in ("bytes", "sim_time") and getattr(f, first, None) is not None and \
                stored_seed.get(first) is not None:  # (bytes and time are the policy's, not the model's)
            key = first
        else:
            key = "val_accuracy" if f.val_accuracy is not None else "val_loss"
        what, fmt = REPLAY_WORDS.get(key, key), ".6g" if key == "time_to_target" else ".4f"
        want = stored_seed.get(key)
        trial = f"trial {exported['trial']} of {exported['study']}"
        from .search.results import missed

        def shown(v) -> str:  # a time to target past the budget is a miss's penalty, marked as the tables mark it
            return format(v, fmt) + missed(study, key, v)
        from .backends import ran_on
        from .engine.setup import resolve_device

        # where the trial's sums ran (an export written before it was kept: in process, on whatever device)
        theirs = exported.get("ran_on") or "in process"
        here = ran_on(args.backend, args.procs, study.run.workers, str(resolve_device(args.device).type))
        if want is None:
            pass
        elif here.startswith(theirs):  # the same sums in the same order: held to match bit for bit
            got = getattr(f, key)
            same = want == got or (want != want and got != got)  # a diverged run's NaN is the same NaN again
            print(f"{what} {'matches' if same else 'DIFFERS from'} {trial} (seed {seed}: {shown(want)})")
        else:
            print(f"{what} {shown(getattr(f, key))}, {trial} {shown(want)} (seed {seed}): not held to match bit for bit, "
                  f"the trial ran {theirs} and this run {here}, whose sums run in another order")
    if args.json_out:
        out = res.to_dict() | {"study": study.name, "backend": backend, "execution": execution}  # the table's, uncut
        if job is not None and f.sim_time is not None:
            out["against"] = {"traces": str(args.against), "ranks": job[0], "steps": job[1], "job_seconds": job[2],
                              "clock_seconds": f.sim_time, "error": f.sim_time / job[2] - 1}
        _write_json(args.json_out, json.dumps(out, indent=2))
    return 0 if res.status == "ok" else 1


def _against(args, study, policy, seed):
    """``run --against DIR``: the study with the job's steps a worker, each worker taking them (``[environment]
    step_budget = "per_worker"``, as each of the job's ranks takes ``total_steps``) and no time budget (the clock's
    run ends when the slowest worker is done and its merges have landed), and the job's (ranks, steps a rank,
    seconds). One line where they cannot be held together: no clock, other workers, ranks that took different
    steps, or --reevaluate."""
    import dataclasses

    from .calibrate import job_policy, job_start, job_time
    from .study import with_run

    if args.reevaluate:
        raise ConfigError("--against", "is one run of the job's steps; allowed: without --reevaluate")
    env = study.environment
    if env is None:
        raise ConfigError("--against", f"{study.name} has no [environment]: nothing simulates time; allowed: a study "
                                       "whose [environment] is the job's cluster (from = the file evomerge calibrate "
                                       "--from-trace writes of these traces)")
    from .runtime import check_policy as merger_runs

    merger_runs(policy)  # (a policy no Merger job runs: its own line)
    W, steps, seconds = job_time(args.against)
    first = job_start(args.against)  # the job's policy, seed, overlap and local steps (read once)
    ran, ran_seed = job_policy(first)
    if ran is not None:  # (a trace of an older evomerge does not say)
        from .policy import MergePolicy

        from .policy import what_merges
        from .runtime import _differences

        try:
            theirs = what_merges(MergePolicy.from_dict(ran, where="--against").to_dict())
        except ConfigError:
            theirs = None  # (a policy of another evomerge's fields: not compared)
        mine = what_merges(policy.to_dict())
        if theirs is not None and theirs != mine:  # (one rule with the Merger's resume: what two policies share)
            from .calibrate import jobs_held

            n = jobs_held(args.against)
            held = f" (the folder holds {n} jobs, a Merger appending: the last one's)" if n > 1 else ""
            raise ConfigError("--against", f"the job{held} ran another policy "
                                           f"({_differences(theirs, mine, 'in the job')}): its time is not the job's; "
                                           "allowed: --policy the policy the job ran")
    if ran_seed is not None and ran_seed != seed:
        print(f"note: --against: the job ran seed {ran_seed}, this run seed {seed}: its merges are drawn otherwise "
              "(without --seed it takes the job's)", file=sys.stderr)
    overlap = first.get("overlap")
    if overlap == "lockstep" and policy.scheme != "allreduce":  # (an all-reduce's ranks wait for each other anyway)
        raise ConfigError("--against", f"the job's Merger ran overlap 'lockstep' (every rank merges at the same steps, "
                                       f"waiting for the others), which the clock does not model for scheme "
                                       f"{policy.scheme!r}; allowed: a job of overlap 'nonblocking' or 'blocking'")
    if overlap in ("nonblocking", "blocking") and overlap != env.overlap and policy.scheme == "gossip":
        print(f"note: --against: the job's Merger ran overlap {overlap!r}; the clock takes it (the study's "
              f"[environment] has {env.overlap!r}, {'the default' if env.overlap == 'nonblocking' else 'its own'})",
              file=sys.stderr)
        env = dataclasses.replace(env, overlap=overlap)
    if isinstance(env.speeds, str) and env.speeds != "equal":  # (calibrate --fit: a model of many clusters' speeds)
        print(f"note: --against: the study's speeds are drawn from a model ({env.speeds}), not the job's ranks' own: "
              "the clock's workers are other devices than the job's (calibrate without --fit to hold the job)",
              file=sys.stderr)
    ran_steps = first.get("local_steps")
    if policy.scheme == "async" and isinstance(ran_steps, list):
        from .engine.timed import async_local_steps

        clock_steps = async_local_steps(policy, env, W, seed)
        if clock_steps is not None and list(clock_steps) != ran_steps:  # (local_steps_by_speed: the Merger's speeds=)
            print(f"note: --against: the job's ranks pushed after {ran_steps} local steps, the clock's workers after "
                  f"{list(clock_steps)} (the [environment]'s speeds): their merges differ", file=sys.stderr)
    if W != study.run.workers:
        raise ConfigError("--against", f"{args.against} holds {W} ranks' traces; {study.name} has {study.run.workers} "
                                       "workers (run.workers); allowed: a job of as many ranks")
    if len(set(steps)) > 1:
        raise ConfigError("--against", f"the job's ranks took {min(steps)} to {max(steps)} steps; allowed: a job whose "
                                       "ranks each took the same steps (total_steps)")
    study = with_run(study, {"steps": steps[0]})
    # no time budget: the run ends when the slowest worker's steps are done (and objectives that need one are not
    # taken); each worker takes the job's steps, as each rank did
    from .study import TIMED_OBJECTIVES

    kept = tuple(o for o in study.objectives if o not in TIMED_OBJECTIVES) or ("sim_time",)
    study = dataclasses.replace(study, environment=dataclasses.replace(env, time_budget=0.0, step_budget="per_worker"),
                                objectives=kept)
    return study, (W, steps[0], seconds, first.get("model_bytes"))


def _baseline_lr_note(study, given, args) -> str | None:
    """``run --policy NAME`` of one of the study's baselines, where its search chose the baseline's step size
    (``[baselines] lr``) other than the study's: the verdict judged it there, and this run is at the study's."""
    from .policy import MergePolicy

    name = given.name if isinstance(given, MergePolicy) else str(given)  # (a policy the traces of --against name)
    if not name or name not in study.baselines or not study.baseline_lr or Path(name).is_file():
        return None
    from .search.baselines import kept_lrs

    best = kept_lrs(study, _searched(study, args)).get(name)
    if best is None or best == study.run.lr:
        return None
    return (f"note: {name} runs at the study's run.lr {study.run.lr:g}; its search judged it at its best step size, "
            f"{best:g} of [baselines] lr (--lr {best:g} runs it there)")


def _changed_since(exported: dict, study) -> str:
    """What changed in ``study`` since the exported trial ran (its fingerprint, where the export holds one), in
    words; empty if nothing did."""
    from .search import fingerprint

    then = exported.get("fingerprint")
    if not isinstance(then, dict) or not isinstance(then.get("summary"), dict):
        return ""
    now = fingerprint.of(study)
    return "" if then.get("hash") == now["hash"] else fingerprint.changed_since(then["summary"], now["summary"], study)


#: what a replay's line calls the metric it holds against the trial's
REPLAY_WORDS = {"val_accuracy": "validation accuracy", "val_loss": "validation loss",
                "val_perplexity": "validation perplexity", "mean_worker_accuracy": "mean worker accuracy",
                "time_to_target": "time to target", "accuracy_at_time": "accuracy at the time budget",
                "loss_at_time": "loss at the time budget", "perplexity_at_time": "perplexity at the time budget"}


def _in_budget(study) -> str:
    """Where a timed run's steps come from: its time budget, not run.steps (a new user's study said steps = 60, its
    workers took 42 to 72, and the user guessed which number to give a Merger's total_steps)."""
    env = study.environment
    if env is None or not env.time_budget or env.step_budget != "shared":  # (per_worker: each takes run's steps)
        return ""
    return f", in the {env.time_budget:g} s time budget"


def _time_rows(study, f) -> list[tuple[str, str]]:
    """What a run on a simulated cluster adds to the table ([environment])."""
    if f.sim_time is None:
        return []
    env = study.environment
    rows = [("simulated time", f"{f.sim_time:.4g} s"), ("idle (last round)", f"{f.idle_fraction:.1%}"),
            ("staleness (last round)", f"{f.staleness:.3g} s")]
    if study.target is not None:
        reached = f.time_to_target <= (env.time_budget or f.sim_time)
        what = {"val_accuracy": "val acc", "mean_worker_accuracy": "mean worker acc", "val_loss": "val loss",
                "val_perplexity": "val perplexity"}.get(study.target_metric, study.target_metric)
        rows.append((f"time to {study.target:g} {what}", f"{f.time_to_target:.4g} s" if reached else
                     f"not reached (ranked as {f.time_to_target:.4g} s)"))
    at = "the " + (f"{env.time_budget:g} s budget" if env.time_budget else "end")
    at_time = [("accuracy", f.accuracy_at_time), ("perplexity", f.perplexity_at_time), ("loss", f.loss_at_time)]
    # the study's own objective first (a language model's perplexity_at_time study showed its accuracy at the budget)
    at_time.sort(key=lambda x: f"{x[0]}_at_time" not in study.objectives)
    for name, v in at_time:
        if v is not None:
            rows.append((f"{name} at {at}", f"{v:.4f}"))
            break
    return rows


def _reevaluate(study, setup, policy, args, run_fn) -> int:
    import statistics

    from .search.baselines import fresh_seeds
    from .search.results import missed, objective_label, spread

    seeds = fresh_seeds(study, args.reevaluate)
    results = []
    for s in seeds:
        results.append(run_fn(setup, policy, s, device=args.device, evaluate_test=True))
    from rich.table import Table

    def ms(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "n/a"
        if len(vals) == 1:  # one seed has no spread
            return f"{vals[0]:.4f}"
        return f"{statistics.fmean(vals):.4f} ± {spread(vals):.4f}"

    from .engine.judge import perplexity

    ok = [r for r in results if r.status == "ok"]
    lm = setup.model.task.classification and setup.model.task.per_position  # (labels per position)
    t = Table(title=f"{study.name}: {policy.name or args.policy} re-evaluated on fresh seeds {seeds}", caption=policy.describe())
    t.add_column("metric")
    t.add_column("mean ± sd" if len(seeds) > 1 else "value (one seed)", justify="right")
    rows = []
    finals = [r.metrics() for r in results]
    for o in study.objectives:  # the study's own objectives first, where the rows below do not show them
        if o not in ("val_accuracy", "mean_worker_accuracy", "val_loss", "bytes"):  # (a timed study's time to
            # target was in --json only); "(missed)" where any seed missed the target
            vals = [float(f[o]) for f in finals if f.get(o) is not None]
            rows.append((f"{objective_label(o)}, the study's objective",
                         ms(vals) + (missed(study, o, max(vals)) if vals else "")))
    if setup.model.task.classification:  # no accuracy rows for a task without classes (regression)
        rows += [("test accuracy (consensus)", ms([r.test_accuracy for r in ok]) if ok else "n/a"),
                 ("val accuracy (consensus)", ms([r.final.val_accuracy for r in results])),
                 ("mean worker val accuracy" + _worker_samples(study, setup, short=True),
                  ms([r.final.mean_worker_accuracy for r in results]))]
    if lm:  # a language model's test figure in the unit of its objective
        rows.append(("test perplexity (consensus)", ms([perplexity(r.test_loss) for r in ok]) if ok else "n/a"))
    rows += [("test loss (consensus)", ms([r.test_loss for r in ok]) if ok else "n/a"),
             ("val loss (consensus)", ms([r.final.val_loss for r in results])),
             ("bytes sent (MB)", ms([r.final.bytes / 1e6 for r in results])),
             ("diverged runs", f"{len(results) - len(ok)} of {len(results)}")]
    for name, v in rows:
        t.add_row(name, v)
    _console().print(t)
    if args.json_out:
        _write_json(args.json_out, json.dumps({"study": study.name, "seeds": seeds, "policy": policy.to_dict(),
                                                   "runs": [r.to_dict() | {k: v for k in ("test_accuracy", "test_loss")
                                                                                   if (v := getattr(r, k)) is not None}
                                                            | ({"test_perplexity": perplexity(r.test_loss)}
                                                               if lm and r.test_loss is not None else {})
                                                            for r in results]}, indent=2))
    return 0 if len(ok) == len(results) else 1


def _load_stored(args, ref: str | None = None):
    """The study of a command that reads results: a file, a shipped name, or the name of a study stored under
    --runs-dir (or in --storage) wherever its file lives. The definition stored with the trials wins; when the
    file on disk differs, one line says so."""
    from .search.results import is_path, storage_names, stored_names, stored_study
    from .search.storage import default_storage
    from .study import known_studies, load, study_hint

    ref = args.study if ref is None else ref
    try:
        study, missing = load(ref), None
    except ConfigError as e:
        if is_path(ref):
            raise  # a path that cannot be read is that path's error
        study, missing = None, e
    name = study.name if study is not None else str(ref)
    got = stored_study(name, args.storage or default_storage(Path(args.runs_dir) / name))
    if got is None:
        if study is None:
            from .dburls import shown

            # the stored studies where this command looks: --storage's, else the runs folder's
            where = shown(args.storage) if args.storage else _runs_dir_said(args.runs_dir)
            stored = storage_names(args.storage) if args.storage else stored_names(args.runs_dir)
            if str(ref) in stored:  # its trials are there, its definition is not (an older evomerge, or Optuna alone)
                raise ConfigError("--study", f"{str(ref)!r} is stored in {where} without its study file's text "
                                             "(searched by an older evomerge); allowed: the path to its .toml file")
            raise ConfigError("--study", f"unknown study {str(ref)!r}; known: {', '.join(known_studies()) or 'none'}; "
                                         f"stored in {where}: {', '.join(stored) or 'none'} "
                                         "(or give a path to a .toml file)"
                                         + study_hint(str(ref), [*known_studies(), *stored])) from None
        return study
    stored, definition = got
    # the file given, or (a name given) the file the search read: one line when it has changed since
    on_disk = Path(study.path) if study is not None and study.path is not None else Path(definition["path"])
    try:
        changed = on_disk.read_text(encoding="utf-8") != definition["toml"]
    except (OSError, UnicodeDecodeError):  # the searched file moved or went: the stored definition is all there is
        changed = False
    if changed and study is not None:
        print(f"note: {on_disk} differs from the definition of {name!r} stored with its trials "
              f"({definition['path']}); using the stored one", file=sys.stderr)
    elif changed:
        print(f"note: {on_disk}, the file {name!r} was searched from, has changed since; using the definition stored "
              "with its trials", file=sys.stderr)
    _note_files_changed(name, stored, definition.get("fingerprint"))
    return stored


def _note_files_changed(name: str, stored, then: dict | None) -> None:
    """One line when a file the stored definition reads (a cluster file under environment.from, the user's model,
    loader or loss module) has changed since the trials ran: the definition is the trials', those files are read as
    they are now (status, export and the dashboard said nothing of a recalibrated cluster)."""
    if not then or not isinstance(then.get("summary"), dict):
        return
    from .search import fingerprint

    try:  # (not the corpus of a text study: it need not be on this machine, and is not read whole to say this)
        now = fingerprint.summary(stored, corpus=False)
    except ConfigError:  # a file beside the study that cannot be read now: the commands that need it say so
        return
    before = {k: v for k, v in then["summary"].items() if k != "data.text_digest"}
    shown = fingerprint.changed_since(before, now, stored)
    if shown:
        print(f"note: study {name!r} changed since its trials ran: {shown}; its trials' figures are from before",
              file=sys.stderr)


def _search_study(args):
    """``search --study``: a file or a shipped name; else the name of a study searched under --runs-dir (or in
    --storage) whose file is not here any more, resumed with the definition stored with its trials (status, export
    and run took the name; search refused it); else _load_stored's line with the known and the stored ones."""
    from .search.results import load_or_stored

    def said(path):
        print(f"note: no study file {str(args.study)!r} here; searching on with the definition stored with its "
              f"trials (from {path})", file=sys.stderr)

    return load_or_stored(args.study, args.runs_dir, args.storage, on_stored=said) or _load_stored(args)


def _load_target(args):
    """``transfer --target``: a file, a shipped name, or a study stored under --runs-dir by name (its file moved); its
    errors name --target."""
    from .search.results import load_or_stored, stored_names
    from .study import known_studies, study_hint

    try:
        target = load_or_stored(args.target, args.runs_dir)
    except ConfigError as e:  # a file's own error, named as the flag that gave it (load says --study)
        raise ConfigError("--target", e.message if e.field in (str(args.target), "--study") else str(e)) from None
    if target is None:
        stored = stored_names(args.runs_dir)
        raise ConfigError("--target", f"unknown study {str(args.target)!r}; known: {', '.join(known_studies())}; "
                                      f"stored in {_runs_dir_said(args.runs_dir)}: {', '.join(stored) or 'none'} (or give a path to a "
                                      ".toml file)" + study_hint(str(args.target), [*known_studies(), *stored]))
    return target


def _storage_url(study, args) -> str:
    from .search.storage import default_storage

    return args.storage or default_storage(Path(args.runs_dir) / study.name)


class _LostConnection:
    """A logging filter that drops Optuna's "Caught an error from sqlalchemy ... Falling back to a slower
    alternative" where the error is a lost connection (its fallback for too long a query fails too, and the command
    ends in one line of its own: the warning printed the SQL first)."""

    def filter(self, record) -> bool:
        text = str(record.msg)
        return not (text.startswith("Caught an error from sqlalchemy") and "connection" in text.lower())


def _quiet_libraries(mlflow: bool = True) -> None:
    """The command line is the application: it sets the libraries' log levels (Optuna's and
    MLflow's INFO lines repeat what evomerge prints, or speak of table creation)."""
    import logging

    import optuna  # each library sets its own level when imported: ours must come after

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage_log = logging.getLogger("optuna.storages._rdb.storage")
    if not any(isinstance(f, _LostConnection) for f in storage_log.filters):
        storage_log.addFilter(_LostConnection())
    if mlflow:  # only for commands that use it: importing mlflow takes seconds
        import mlflow as _mlflow  # noqa: F401

        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _policy_ref(study, name: str) -> str:
    """How a training loop names the study's policy ``name``: a shipped policy by its name (``Merger("diloco")``),
    the study's own by its file."""
    from .registry import shipped_studies_dir

    for d in study.policy_dirs():
        f = d / f"{name}.json"
        if f.is_file():
            return name if d.resolve() == (shipped_studies_dir() / "policies").resolve() else str(f)
    return name


def cmd_search(args) -> int:
    from .procs import apply_threads, signals_raise
    from .search.config import make_config
    from .search.loop import run_search
    from .search.options import from_args
    from .study import load

    _quiet_libraries(mlflow=False)
    study = _search_study(args)
    cfg = make_config(study, **from_args(args))  # every flag checked before seconds of importing MLflow and torch
    if cfg.default_store:  # a new study here, whose search ran beside its file: it would start anew, unsaid
        from .search.results import runs_beside

        beside = runs_beside(study, cfg.storage)
        if beside:
            print(f"note: the runs folder beside the study file holds a search of {study.name!r}; this one starts "
                  f"anew in {shown(cfg.storage)} (--runs-dir {beside} resumes that one)", file=sys.stderr)
    began = False

    def progress(event: str, **info) -> None:
        nonlocal began
        began = began or event == "start"
        view.event(event, **info)

    try:
        _quiet_libraries()
        apply_threads()  # trials in this process (--jobs 1); --jobs N workers take a share each
        from .report.search_view import SearchView

        view = SearchView(cfg, quiet=args.quiet)
        with view, signals_raise() as stop:  # SIGTERM and SIGHUP stop it as Ctrl-C does: the running trial failed, the rest kept
            result = run_search(cfg, progress=progress, stop=stop)
    except KeyboardInterrupt:  # before the search started (imports, data, stores), or a second one while it ended
        print("interrupted: finished trials are kept; run the same command again to resume" if began else
              "interrupted before the first trial; run the same command again to start the search", file=sys.stderr)
        return 130
    view.summary(result)
    if not args.quiet and not result.interrupted and not result.fatal and result.counts.get("COMPLETE"):
        # what to do with the results: the search said where they are stored, not how to see them
        where, me = _stored_at(args, args.study), _prog()
        deploy, first = "the policy to deploy", ""
        beaten_by = (result.verdict or {}).get("beaten_by") or []
        if (result.verdict or {}).get("none_reached"):  # (it named a baseline to deploy, ranked on penalty times)
            deploy = ("the search's best; no policy reached the target on the verdict's seeds: a longer "
                      "study.environment.time_budget or an easier study.objectives.target first")
        elif beaten_by:  # (the verdict said diloco beats every pick; the next line still called the export the one,
            # and then named the baseline after it: a user who ran the line's first command deployed the loser)
            lrs = {b.get("name"): b.get("lr") for b in result.verdict.get("baselines") or ()}
            ways = " or ".join(f"evomerge.Merger({_policy_ref(study, n)!r}, ...)"
                               + (f" at lr {lrs[n]:g}" if isinstance(lrs.get(n), (int, float)) else "")
                               for n in beaten_by)
            first = (f"deploy {' or '.join(beaten_by)}, which the verdict found better than every pick: {ways}; ")
            deploy = "the search's best, which lost"
        print(f"next: {first}{me} export --study {_stored_at(args, args.study, tracking=False)} -o best.json ({deploy}); "
              f"{me} ui --study {where} (its runs in MLflow); {me} dashboard --study {where}", file=sys.stderr)
    if args.json_out:
        _write_json(args.json_out, json.dumps({"study": study.name, "counts": result.counts, "best": result.best,
                                                   "interrupted": result.interrupted, "errors": result.errors}, indent=2))
    if result.interrupted:
        print("interrupted: finished trials are kept; run the same command again to resume", file=sys.stderr)
        return 130
    if result.fatal:  # a worker process (--jobs N) stopped: as one process would (error: ..., exit 1 or 2)
        print(f"error: {result.fatal[0][0]}", file=sys.stderr)
        return max(code for _, code in result.fatal)
    return 0


def cmd_transfer(args) -> int:
    from .study import load
    from .report.tracking import Tracker, check_reachable, resolve_tracking_uri
    from .search.transfer import _transfer as transfer, verdict  # (the flags in its errors)

    _quiet_libraries()
    source, target = _load_stored(args), _load_target(args)
    if source.name == target.name:  # (before the tracking store is looked at; transfer() refuses it as well)
        raise ConfigError("--target", f"is the study itself ({source.name}); name another study")
    study_dir = Path(args.runs_dir) / source.name
    uri = resolve_tracking_uri(args.tracking_uri, study_dir)
    check_reachable(uri)
    from .procs import apply_threads

    apply_threads()
    kw = dict(top=args.top, seeds=args.seeds, storage=args.storage, runs_dir=args.runs_dir, data_dir=args.data_dir,
              device=args.device, backend=args.backend, procs=args.procs)
    ran = [0]  # runs done (kept or made): a policy's are kept once all its seeds ran

    def counted(tell=None):
        def on_run(done, total):
            ran[0] = done
            if tell is not None:
                tell(done, total)
        return on_run

    try:
        if args.quiet or not _console_err().is_terminal:  # a bar is for a person at a terminal
            result = transfer(source, target, on_run=counted(), **kw)
        else:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn(f"{target.name} runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          transient=True, console=_console_err()) as bar:
                task = bar.add_task("runs", total=None)
                result = transfer(source, target, on_run=counted(lambda d, n: bar.update(task, completed=d, total=n)),
                                  **kw)
    except KeyboardInterrupt:
        kept = ran[0] // args.seeds
        print(f"note: the runs of {kept} polic{'y' if kept == 1 else 'ies'} are kept with the study; run the same "
              "command again to go on from them" if kept else
              "note: no policy had all its runs yet: nothing of this transfer was kept", file=sys.stderr)
        raise
    run_id, logged = Tracker(uri, source.name, study_dir / "mlartifacts", study=source).log_transfer(result)
    _print_transfer(result)
    for x in result.get("left_out", []):
        print(f"note: trial {x['trial']} left out: {x['why']}")
    if result.get("reused"):  # an interrupted transfer's runs, or an earlier one's of the same target and seeds
        print(f"note: the runs of {result['reused']} of the {result['top']} policies were kept from an earlier "
              f"transfer to {result['target']} on the same seeds; {result['top'] - result['reused']} ran now")
    rho = result["spearman"]

    def fig(v, fmt: str) -> str:  # none where scipy has none (nan: two policies, or tied values)
        return "n/a" if v is None or v != v else format(v, fmt)
    print(f"Spearman rho {fig(rho, '.3f')} (p {fig(result['spearman_p'], '.3g')}), Kendall tau "
          f"{fig(result['kendall'], '.3f')} (p {fig(result['kendall_p'], '.3g')}) over {result['top']} policies: "
          f"{verdict(rho, result['top'], result['spearman_p'])}")
    print(f"logged to MLflow run {run_id} ({shown(uri)}{'' if logged else ', by an earlier transfer with the same results'});"
          f" `evomerge dashboard --study {_stored_at(args, args.study)}` shows it")
    if args.json_out:
        _write_json(args.json_out, json.dumps(result | {"mlflow_run_id": run_id}, indent=2))
    return 0


def _stored_at(args, study, tracking: bool = True) -> str:
    """``study`` and the flags that find its stores as this command was given them, for a command it suggests (the
    default runs folder said by none; an address that holds a password with it masked, ``user:***@host``: which
    store, not its password (a line of ``...`` did not say which host and database); ``tracking``: with
    --tracking-uri, for a command that takes it: not export)."""
    import shlex

    from .dburls import shown
    from .search.options import BY_NAME

    def address(url) -> str:
        return shlex.quote(shown(str(url)))

    runs_dir = getattr(args, "runs_dir", None)
    runs_dir = runs_dir if runs_dir != BY_NAME["runs_dir"].cli_default() else None
    storage, uri = getattr(args, "storage", None), getattr(args, "tracking_uri", None) if tracking else None
    return (shlex.quote(str(study)) + (f" --runs-dir {shlex.quote(str(runs_dir))}" if runs_dir else "")
            + (f" --storage {address(storage)}" if storage else "")
            + (f" --tracking-uri {address(uri)}" if uri else ""))


def _console_err():
    from .report.search_view import console

    return console(stderr=True)


def _print_transfer(result: dict) -> None:
    from rich.table import Table

    from .search.results import objective_label

    label = objective_label(result["metric"])
    seeds = result["seeds"]
    t = Table(title=f"{result['source']} -> {result['target']}: its top {result['top']}, {label} on the target's fresh "
                    f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
    for col in ("rank on source", "trial", f"source {label}", f"target {label}", "rank on target", "policy"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in sorted(result["rows"], key=lambda r: r["source_rank"]):
        t.add_row(f"{r['source_rank']:g}", str(r["trial"]), f"{r['source_value']:.4f}", f"{r['target_value']:.4f}"
                  + (" (diverged)" if r["diverged"] else ""), f"{r['target_rank']:g}", r["description"])
    _console().print(t)
    t2 = Table(title=f"ranking on {result['target']}")
    for col in ("rank on target", "trial", f"target {label}", "rank on source"):
        t2.add_column(col, justify="right")
    for r in sorted(result["rows"], key=lambda r: r["target_rank"]):
        t2.add_row(f"{r['target_rank']:g}", str(r["trial"]), f"{r['target_value']:.4f}", f"{r['source_rank']:g}")
    _console().print(t2)


def cmd_status(args) -> int:
    from .search.results import best_trials, count_line, diverged, load_study
    from .report.search_view import best_table, diverged_line, missed_line, no_best_line

    _quiet_libraries(mlflow=False)
    study = _load_stored(args)
    url = _storage_url(study, args)
    ostudy = load_study(study, url)
    trials = ostudy.get_trials(deepcopy=False)
    print(f"{study.name}: {count_line(trials)}  ({shown(url)})")
    for note in study.notes:  # what loading the study changed to fit its workers
        print(f"note: {note}")
    gone = [t.number for t in trials if t.state.name == "COMPLETE" and diverged(t)]
    if gone:
        print(diverged_line(gone))
    best = best_trials(ostudy, study, 5)
    if not best:
        print(no_best_line(len(gone)))
        return 0
    title = (f"{study.name}: top {len(best)}" if len(study.objectives) == 1
             else f"{study.name}: the {len(best)} Pareto-optimal trial{'s' if len(best) > 1 else ''}")
    _console().print(best_table(study, best, [], title=title))
    said = missed_line(study, best)
    if said:
        print(said)
    stored = ostudy.user_attrs.get("verdict")  # the last search's verdict (search/verdict.py)
    if stored:
        from .search.verdict import render

        render(stored, _console(), complete=sum(1 for t in trials if t.state.name == "COMPLETE"))
    return 0


def cmd_calibrate(args) -> int:
    from . import calibrate

    if args.from_trace is not None:
        d = calibrate.DEFAULTS  # what times a live calibration: taken in silence with --from-trace, which ignored it
        for flag, value, default in (("--study", args.study, None), ("--procs", args.procs, None),
                                     ("--steps", args.steps, d["steps"]), ("--repeats", args.repeats, d["repeats"]),
                                     ("--all-pairs-up-to", args.all_pairs_up_to, d["all_pairs_up_to"]),
                                     ("--seed", args.seed, d["seed"]), ("--timeout", args.timeout, d["timeout"]),
                                     ("--step-sleep", args.step_sleep, d["step_sleep"]),
                                     ("--slow-rank", args.slow_rank, d["slow_rank"]),
                                     ("--slow-factor", args.slow_factor, d["slow_factor"]),
                                     ("--data-dir", args.data_dir, None)):
            if value != default:
                raise ConfigError(flag, f"{value} is for calibrating live (--study and --procs); --from-trace fits the "
                                        "traces as they were written; allowed: leave it out with --from-trace (which "
                                        "takes -o, --warmup and --fit)")
        return calibrate.from_trace_command(args)
    if not args.study:
        raise ConfigError("--study", "is required (the model, batch size and optimiser to time), or --from-trace DIR")
    return calibrate.launch(args)


IN_STEP_SAID = 0.05  # run --against: a share of the job's time inside merger.step() said beside the clock's error
SHORT_SAID = 0.10  # ... where the clock is at least this much short of the job (within it: the clock's usual error)
STEP_SAID = 1.5  # run --against: the job's step against the cluster's step_time said beyond this ratio either way


def _runs_dir_said(runs_dir) -> str:
    """The runs folder as an unknown study's line names it: a relative one is said to be the current folder's (a
    command run from another folder found "runs: none" and did not say where it looked)."""
    return str(runs_dir) if Path(runs_dir).is_absolute() else f"{runs_dir} (--runs-dir, from the current folder)"


def cmd_export(args) -> int:
    if args.trial is not None:
        if args.trial < 0:
            raise ConfigError("--trial", f"{args.trial} is out of range; allowed: a trial number >= 0")
        for flag, given in (("--pareto", args.pareto), ("--limit", args.limit), ("--tolerance", args.tolerance)):
            if given:
                raise ConfigError("--trial", f"given with {flag}; allowed: one of --trial (one trial), {flag}")
    if args.pareto:  # (taken without a word, doing nothing: the whole set is written)
        for flag, given in (("--tolerance", args.tolerance), ("--limit", args.limit)):
            if given:
                raise ConfigError(flag, "given with --pareto, which writes every Pareto-optimal trial; allowed: "
                                        f"{flag} to pick one (without --pareto)")
    study = _load_stored(args)
    url = _storage_url(study, args)
    out = Path(args.output)
    if not args.pareto and out.is_dir():
        raise ConfigError("--output", f"{str(out)!r} is a folder; allowed: a file to write the policy to (e.g. "
                                      f"{out / 'best.json'}), or a folder with --pareto")
    if args.pareto and out.exists() and not out.is_dir():
        raise ConfigError("--output", f"{str(out)!r} is a file; allowed: a folder for --pareto's files")
    if args.pareto and not out.exists() and out.suffix.lower() == ".json":  # (a new user's -o p.json made a folder)
        raise ConfigError("--output", f"{str(out)!r} names a JSON file; allowed: a folder for --pareto's files, one "
                                      f"per trial (e.g. {out.with_suffix('')})")
    folder = out if args.pareto else out.parent
    missing = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)  # the first to make
    replaced = None if args.pareto else _other_studys_export(out, study.name)
    try:
        code = _export(args, study, url, out)
        if missing is not None and missing.is_dir():  # as mkdir -p: made, and said
            print(f"note: made the folder {missing}", file=sys.stderr)
        if replaced:  # (the printed `next:` export of a second study in the same folder replaced the first's unsaid)
            print(f"note: {out} held {replaced}; replaced (-o FILE writes elsewhere)", file=sys.stderr)
        return code
    except OSError as e:  # a folder that cannot be made or a file that cannot be written: nothing was written
        raise ConfigError("--output", f"cannot write {e.filename or out}: {e.strerror or e}") from None


def _other_studys_export(out: Path, name: str) -> str | None:
    """What ``out`` holds where it is an export of another study than ``name`` ("study my-gru's trial 0"); else
    None (no file, not an export, or this study's own)."""
    try:
        doc = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("study"), str) or doc["study"] == name or \
            "policy" not in doc:
        return None
    return f"study {doc['study']}'s" + (f" trial {doc['trial']}" if isinstance(doc.get("trial"), int) else " export")


def _files(paths) -> str:
    names = [p.name for p in paths]
    return f"{names[0]}" if len(names) == 1 else \
        f"{len(names)} files ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"


def _export(args, study, url, out: Path) -> int:
    from .report.export import export_best, export_pareto, export_trial

    if args.trial is not None:
        from .policy import MergePolicy

        doc = export_trial(study, url, out, args.trial)
        values = _values_text(doc["objectives"], study)
        print(f"wrote trial {doc['trial']} ({values}) to {out}")
        if doc.get("verdict_note"):
            print(f"note: {doc['verdict_note']}", file=sys.stderr)
        _policy_notes(doc, study)
        _merger_note(MergePolicy.from_dict(doc["policy"]), study)
    elif args.pareto:
        paths, removed, others = export_pareto(study, url, out)
        print(f"wrote {len(paths)} Pareto-optimal {'policy' if len(paths) == 1 else 'policies'} to {out}/"
              + (" (one objective: the best trial)" if len(study.objectives) == 1 else ""))
        if removed:
            print(f"removed {_files(removed)} an earlier export of {study.name} wrote there: "
                  f"{'its trial is' if len(removed) == 1 else 'their trials are'} no longer Pareto-optimal")
        if others:
            print(f"note: {out}/ also holds {_files(others)} not exported from {study.name}, left as "
                  f"{'it is' if len(others) == 1 else 'they are'}", file=sys.stderr)
    else:
        if args.tolerance is not None:
            from .search.results import read_tolerance

            read_tolerance(args.tolerance)  # before the study is read
        limits = {}
        for item in args.limit or ():
            name, eq, value = item.partition("=")
            try:
                limits[name.strip()] = float(value)
            except ValueError:
                raise ConfigError("--limit", f"{item!r} is not OBJECTIVE=VALUE (e.g. bytes=1e8)") from None
            if not eq:
                raise ConfigError("--limit", f"{item!r} is not OBJECTIVE=VALUE (e.g. bytes=1e8)")
        doc = export_best(study, url, out, args.tolerance, limits)
        values = _values_text(doc["objectives"], study)
        print(f"wrote trial {doc['trial']} ({values}), picked as {doc['picked_by']}, to {out}")
        if args.tolerance is not None and len(study.objectives) == 1:  # (taken without a word, doing nothing)
            print(f"note: --tolerance picks among the Pareto-optimal trials of several objectives; {study.name} has "
                  "one, so the best trial is written", file=sys.stderr)
        from .policy import MergePolicy

        if doc.get("verdict_note"):
            print(f"note: {doc['verdict_note']}", file=sys.stderr)
        _policy_notes(doc, study)
        _merger_note(MergePolicy.from_dict(doc["policy"]), study)
    return 0


def _policy_notes(doc: dict, study) -> None:
    """A line each (stderr, as evomerge run says them) for what the exported trial's runs show
    (:func:`results.policy_notes`): it merged on none of its seeds (what it was judged as is no merging), or it sent
    more than its simulated links carry."""
    from .policy import MergePolicy
    from .search.results import policy_notes

    finals = list((doc.get("metrics_per_seed") or {}).values())
    for words in policy_notes(MergePolicy.from_dict(doc["policy"]), finals, study).values():
        print(f"note: trial {doc['trial']} {words}", file=sys.stderr)
    from .search.results import missed

    ttt = (doc.get("objectives") or {}).get("time_to_target")
    if ttt is not None and missed(study, "time_to_target", ttt):  # (only "(missed)" said so)
        from .engine.judge import penalty_words

        seeds = doc.get("metrics_per_seed") or {}
        out = [s for s, m in seeds.items() if missed(study, "time_to_target", (m or {}).get("time_to_target") or 0)]
        where = (f"on seed {out[0]}" if len(seeds) == 1 else f"on {len(out)} of its {len(seeds)} seeds "
                 f"({', '.join(out)})") if out else "on its seeds"
        print(f"note: trial {doc['trial']} did not reach {study.target_metric} {study.target:g} within the time budget "
              f"({study.environment.time_budget:g} s) {where}: its time to target is a penalty past the budget, not "
              f"a time ({penalty_words(study.target_metric)})", file=sys.stderr)


def _values_text(objectives: dict, study=None) -> str:
    """An exported trial's objective values as the terminal says them: bytes in their unit, the rest to 6 digits
    (a time to target over the budget marked as missed)."""
    from .search.results import missed
    from .units import size

    return ", ".join(f"{k} {size(v) if k == 'bytes' else format(v, '.6g') + missed(study, k, v)}"
                     for k, v in objectives.items())


def _check_out_folder(out: Path) -> None:
    """``dashboard --out``: a folder there, or one that can be made (its first existing parent a folder this user
    may write in); else one line naming --out."""
    from .userdirs import cannot_write_in

    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a file; allowed: a folder for index.html (made if missing)")
    if not out.exists() and out.suffix.lower() in (".html", ".htm"):  # (it made a folder dash.html/, index.html in it)
        raise ConfigError("--out", f"{str(out)!r} names a page; allowed: a folder for index.html and plotly.min.js "
                                   f"(made if missing), e.g. {str(out.with_suffix(''))!r}")
    refused = cannot_write_in(out)
    if refused is not None:
        raise ConfigError("--out", f"cannot write in {str(refused[0])!r} ({refused[1]}); allowed: a folder this user "
                                   "can write in, for index.html")


def cmd_dashboard(args) -> int:
    from .report import dashboard
    from .report.tracking import resolve_tracking_uri

    _quiet_libraries()
    study = _load_stored(args)
    url = _storage_url(study, args)
    uri = resolve_tracking_uri(args.tracking_uri, Path(args.runs_dir) / study.name)
    out = Path(args.out) if args.out else Path("dashboards") / study.name
    _check_out_folder(out)  # before the page's work (baselines run for it): a traceback at its end
    try:
        page = dashboard.build(study, url, uri, out, data_dir=args.data_dir, compute_baselines=not args.no_baselines,
                               warn=lambda text: print(f"note: {text.rstrip('.')}", file=sys.stderr, flush=True))
    except OSError as e:
        if e.filename is None or not Path(e.filename).resolve().is_relative_to(out.resolve()):
            raise
        raise ConfigError("--out", f"cannot write {e.filename}: {e.strerror or e}") from None
    print(f"wrote {page}")
    if args.open:
        import webbrowser

        if not webbrowser.open(page.resolve().as_uri()):  # no browser here (a server, a container): say so
            print(f"note: --open: no web browser found here; open {page.resolve().as_uri()} where there is one",
                  file=sys.stderr)
    return 0


# what `mlflow server` says of its own --host and --allowed-hosts as it starts: options `evomerge ui` does not have
# (it serves on 127.0.0.1 only), so not relayed
_SERVER_START_LINES = ("[MLflow] Security middleware enabled with default settings",)


def _relay_server_log(stream) -> None:
    """The MLflow server's output to stderr as it comes, less :data:`_SERVER_START_LINES`."""
    for line in stream:
        if not line.startswith(_SERVER_START_LINES):
            sys.stderr.write(line)
            sys.stderr.flush()


def cmd_ui(args) -> int:
    import socket
    import subprocess
    import threading

    from .procs import ProcessGroup, Terminated
    from .report.tracking import resolve_tracking_uri

    study = _load_stored(args)
    study_dir = Path(args.runs_dir) / study.name
    uri = resolve_tracking_uri(args.tracking_uri, study_dir)
    if uri.startswith(("http://", "https://")):  # already served: the study's review there, or one line if it is not
        return _ui_on_server(uri, study.name)
    if args.port and not 0 < args.port < 65536:
        raise ConfigError("--port", f"{args.port} is out of range; allowed: 1 to 65535, or 0 for a free one")
    port = args.port
    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    else:  # (a port taken by another server: its address was printed as this study's, and answered with its runs)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as e:
                raise ConfigError("--port", f"{port} is in use ({e.strerror or e}); allowed: a free port, or 0 for a "
                                            "free one") from None
    from .report.tracking import check_reachable

    check_reachable(uri)  # one line for a store the server could not open (it would retry a database for minutes)
    from .report.tracking import Tracker

    # the study's experiment as a search makes it (model training, its saved view), so that the address is its runs
    # list before any search: MLflow's experiments list led to the experiment a search made later in the GenAI view
    Tracker(uri, study.name, study_dir / "mlartifacts", study=study)
    # the server's warnings and errors, not its start-up and access log (MLflow's and uvicorn's INFO lines)
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
               MLFLOW_LOGGING_LEVEL=os.environ.get("MLFLOW_LOGGING_LEVEL", "WARNING"),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore:starlette.middleware.wsgi is deprecated"),
               # the store in the server's environment, not on its command line, which every user's `ps` shows (with
               # a database's password)
               MLFLOW_BACKEND_STORE_URI=uri, MLFLOW_REGISTRY_STORE_URI=uri)
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--uvicorn-opts", "--log-level warning"]
    url = f"http://127.0.0.1:{port}"
    try:
        # the server and its uvicorn workers run in their own session: stopped together however this command ends
        with ProcessGroup(grace=15) as group:
            # the server's log on stderr (stdout is the address), less its line on `mlflow server`'s own options
            proc = group.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")
            threading.Thread(target=_relay_server_log, args=(proc.stdout,), daemon=True).start()
            if not _wait_until_answering(url, proc, timeout=180):
                print(f"error: mlflow server did not answer on {url} (exit status {proc.poll()})", file=sys.stderr)
                return 1
            # the review first on its line (a terminal makes it a link): the study's runs in the model-training view
            address, logged = _review_address(url, study.name)
            print(f"{address}  MLflow UI for {study.name} (store {shown(uri)}; Ctrl-C stops it)", flush=True)
            if not logged:  # a mistyped --runs-dir shows an empty list: say so, and how it fills
                print(f"note: no search of {study.name} is logged in this store yet; a search with the same "
                      "--runs-dir (or --tracking-uri) fills the list as it runs", file=sys.stderr, flush=True)
            return proc.wait() or 1
    except Terminated as t:
        print("MLflow UI stopped", file=sys.stderr)
        return 128 + t.signum
    except KeyboardInterrupt:  # as every command stopped by Ctrl-C: 130 (SIGTERM and SIGHUP: 128 + the signal)
        print("MLflow UI stopped", file=sys.stderr)
        return 130


def _ui_on_server(uri: str, study_name: str) -> int:
    """``evomerge ui`` for a study tracked on an MLflow server: nothing to start; the address of its review there
    (without the user and password a browser would not take), or one line naming --tracking-uri if it does not answer."""
    import urllib.parse

    from .report.tracking import check_reachable

    _quiet_libraries()
    check_reachable(uri, reading=True)
    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    server = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    try:
        address, logged = _review_address(server, study_name, client_uri=uri)
    except Exception as e:  # noqa: BLE001 (answers /health, not the tracking API: a password it refuses, a proxy)
        from .dburls import first_line

        raise ConfigError("--tracking-uri", f"{shown(uri)} answers, but not as an MLflow tracking server "
                                            f"({first_line(e)})") from None
    print(f"{address}  MLflow UI for {study_name} (tracked on the server {shown(uri)})",
          flush=True)
    if not logged:
        print(f"note: no search of {study_name} is logged on {shown(uri)} yet; a search with the same --tracking-uri "
              "fills the list as it runs", file=sys.stderr)
    return 0


def _review_address(server: str, study_name: str, client_uri: str | None = None) -> tuple[str, bool]:
    """The address that opens the study's review: its runs list, flat and sorted by the objective, in MLflow's
    model-training view (MLflow 3's home is the GenAI view); the experiments list where the study has no experiment
    (on a tracking server, before any search). With whether the study has a run there (asked of ``client_uri``, the
    server with its credentials; ``server`` by default)."""
    from mlflow import MlflowClient

    from .report.tracking import review_url

    client = MlflowClient(tracking_uri=client_uri or server)
    exp = client.get_experiment_by_name(study_name)
    if exp is None:
        return f"{server.rstrip('/')}/#/experiments?workflowType=machine_learning", False
    return review_url(server, exp.experiment_id), bool(client.search_runs([exp.experiment_id], max_results=1))


def _wait_until_answering(url: str, proc, timeout: float) -> bool:
    """Poll ``url``/health until it answers HTTP 200; False if ``proc`` ends or ``timeout`` passes first."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    return False


def _searched(study, args, create: bool = False):
    """The Optuna study a search of ``study`` stored under --runs-dir (or in --storage), whose baselines' step sizes
    ``evomerge baselines`` takes rather than tuning them again (and keeps its own for the search); None when there
    is none (nothing is created to find out, unless ``create``: the study a search would create, holding no trial,
    where the baselines' step sizes are kept for it; not for a study with nothing to search)."""
    from .search.results import load_study
    from .search.storage import default_storage

    try:
        return load_study(study, args.storage or default_storage(Path(args.runs_dir) / study.name))
    except ConfigError:  # never searched there
        if not create:
            return None
    from .search.config import make_config
    from .search.storage import load_or_create, open_storage

    try:
        cfg = make_config(study, runs_dir=Path(args.runs_dir), storage=args.storage)
    except ConfigError:  # (nothing to search: no search to keep them for)
        return None
    if cfg.default_store:  # (the study's own SQLite file; another storage keeps nothing in the runs folder here)
        cfg.study_dir.mkdir(parents=True, exist_ok=True)
    _quiet_libraries(mlflow=False)  # (Optuna's "A new study created in RDB" line: the note below says it)
    created = load_or_create(cfg, open_storage(cfg.storage))
    from .dburls import shown

    print(f"note: the baselines' step sizes are kept for a search of {study.name} in {shown(cfg.storage)}",
          file=sys.stderr)
    return created


def _worker_samples(study, setup, short: bool = False) -> str:
    """How many of the validation samples a worker's accuracy is taken on, where ``run.eval_samples`` makes them
    fewer than the consensus model's ("on 2000 of the 5000 validation samples (run.eval_samples)", ``short``:
    " (2000 of 5000 val samples)"); else ""."""
    n, total = study.run.eval_samples, len(setup.data.val_y)
    if not 0 < n < total:
        return ""
    return f" ({n} of {total} val samples)" if short else \
        f"on {n} of the {total} validation samples (run.eval_samples)"


def cmd_baselines(args) -> int:
    from .backends import run_inputs
    from .search.results import load_or_stored

    def said(path):
        print(f"note: no study file {str(args.study)!r} here; running the baselines of the definition stored with "
              f"its trials (from {path})", file=sys.stderr)

    # as run and search: a file or a shipped name, else a study searched from a file that has moved, as stored
    study = load_or_stored(args.study, args.runs_dir, args.storage, on_stored=said) or _load_stored(args)
    seed = study.run.seeds[0] if args.seed is None else args.seed
    _run_notes(study)
    policies = []
    for name in study.baselines:
        try:
            policies.append((name, run_inputs(study, name, seed, backend=args.backend, procs=args.procs)[0]))
        except ConfigError as e:  # a rule this backend does not run (streamed or asynchronous DiLoCo): left out, said
            if args.backend == "inprocess":
                raise
            print(f"note: baseline {name} left out: {e}")
    run_fn = _runner(args, study)
    setup = _prepare(study, args)
    _setup_notes(study, setup)
    lrs, setups, ties = {}, {None: setup}, {}
    if study.baseline_lr:  # [baselines] lr: each baseline at its best step size, found on the study's seeds
        from .search.baselines import tuned_lrs

        def announce(runs: int, tuning: bool = True) -> None:
            print(f"tuning: each baseline's step size of lr {list(study.baseline_lr)} on the study's seeds "
                  f"{list(study.run.seeds)}, {runs} runs in process", file=sys.stderr)

        searched, told = _searched(study, args, create=True), []  # (kept for the search, as it keeps its own)
        lrs = tuned_lrs(study, data=setup.data, data_dir=args.data_dir, device=args.device,
                        announce=lambda runs, tuning=True: (told.append(runs), announce(runs)), setups=setups,
                        storage_study=searched, keep_or_not=True, ties=ties)
        if not told:
            print(f"tuning: each baseline's step size as chosen on the study's seeds {list(study.run.seeds)} and "
                  f"kept with the trials of {study.name}", file=sys.stderr)

    def setup_at(name):
        from .search.baselines import lr_setup

        return lr_setup(study, lrs.get(name), setups, data=setup.data)

    results = [(name, _run_with_progress(run_fn, setup_at(name), pol, seed, args.device, args.quiet, name))
               for name, pol in policies]
    from rich.table import Table

    budget = (f"{study.environment.time_budget:g} simulated s" if study.environment and study.environment.time_budget
              else f"{setup.total_steps} local steps")  # a time budget ends a timed study's runs, not the steps
    from .backends import ran_on
    from .engine.setup import resolve_device

    # where the sums ran: a search's table of the same baselines, run with another number of torch threads (the
    # cores idle when each command starts), can differ in the last digits
    here = ran_on(args.backend, args.procs, study.run.workers, str(resolve_device(args.device).type))
    t = Table(title=f"{study.name}: baselines (seed {seed}, {budget}, {study.run.workers} workers)",
              caption=f"ran {here}")
    timed = study.environment is not None
    acc = setup.model.task.classification  # a regression's table has no accuracy columns (own-model.md)
    cols = ["policy", *(["lr (its best)"] if lrs else []), "status",
            *(["val acc", "mean worker", "worst worker"] if acc else []), "val loss"]
    lm = any(r.final.val_perplexity is not None for _, r in results)
    cols += (["val ppl"] if lm else []) + ["consensus dist", "bytes", "merges"]
    if timed:
        cols += ["sim time", "idle (last round)"] + ([f"time to {study.target:g}"] if study.target is not None else [])
    for col in cols + ["wall"]:
        # the names whole: squeezed, three rows read "allreduce-…" on a 165-column screen
        width = max(len(col), *(len(n) for n, _ in results)) if col == "policy" and results else None
        t.add_column(col, justify="left" if col in ("policy", "status") else "right", min_width=width,
                     no_wrap=col == "policy")
    for name, r in results:
        f = r.final
        row = [name, *([f"{lrs[name]:g}"] if lrs else []), r.status,
               *([_num(f.val_accuracy), _num(f.mean_worker_accuracy), _num(f.worst_worker_accuracy)] if acc else []),
               _num(f.val_loss), *([_num(f.val_perplexity, ".3f")] if lm else []),
               f"{f.consensus_distance:.3g}", _mb(f.bytes), f"{f.merges}"]
        if timed:
            row += [f"{f.sim_time:.4g} s", f"{f.idle_fraction:.0%}"]
            if study.target is not None:
                budget = study.environment.time_budget or f.sim_time
                row.append(f"{f.time_to_target:.4g} s" if f.time_to_target <= budget else "not reached")
        t.add_row(*row, f"{r.wall_time:.2f} s")
    _console().print(t)
    from .search.results import policy_notes

    for (name, r), (_, pol) in zip(results, policies):  # (fedavg's row the same as no-merging's, with no word)
        for words in (policy_notes(pol, [r.metrics()], study) if r.status == "ok" else {}).values():
            print(f"note: {name} {words}", file=sys.stderr)
    if acc and _worker_samples(study, setup):  # (a worker's accuracy above the consensus's read as a bug)
        print(f"note: mean and worst worker {_worker_samples(study, setup)}; val acc on all of them", file=sys.stderr)
    if lrs:
        from .search.baselines import edge_note

        edge = edge_note(study, lrs, ties=ties)
        if edge:
            print(f"note: {edge}", file=sys.stderr)
    else:  # (the search's verdict says it; the table had no word of which step size its rules ran at)
        print(f"note: the baselines ran at the study's step size (lr {study.run.lr:g}), not tuned for each ([baselines] "
              "lr = [...] tunes it)", file=sys.stderr)
    if args.json_out:
        _write_json(args.json_out, json.dumps({"study": study.name, "seed": seed,
                                               "baselines": {n: r.to_dict() | ({"lr": lrs[n]} if lrs else {})
                                                             for n, r in results}}, indent=2))
    return 0 if all(r.status == "ok" for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
