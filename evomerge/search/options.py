"""A search's options, defined once.

This table drives ``evomerge search``'s flags (name, type, default, help), the keywords and defaults of
``evomerge.search()`` and of :func:`evomerge.search.config.make_config`, and :data:`DEFAULTS`. The options
marked ``common`` are flags of other commands too (``run``, ``status``, ...): the command line's shared helpers
add them from here. It imports nothing heavy, so the command line can build its parsers from it.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

REEVALUATE = 3  # the verdict's fresh seeds where --reevaluate is not given (None: not given, so that a count
# given beside --no-verdict is told from the default)
GRACE_PERIOD = 30  # seconds without a heartbeat before another process fails a running trial and retries it


@dataclass(frozen=True)
class Option:
    """One option: ``name`` is the keyword (and ``SearchConfig`` field); the flag is ``--name-with-dashes``, or
    ``--no-name`` for a switch that is on by default (``negate``). ``shown``: how the help states the default when
    it is not the value itself; ``cli_default``: the flag's default when it differs from the keyword's (read when
    the parser is built)."""
    name: str
    default: Any
    help: str
    type: Callable | None = None
    shown: str | None = None
    metavar: str | None = None
    negate: bool = False
    common: bool = False
    cli_default: Callable[[], Any] | None = None

    @property
    def flag(self) -> str:
        return "--" + ("no-" if self.negate else "") + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return ("no_" if self.negate else "") + self.name

    def add_to(self, parser, why: str = "") -> None:
        """Add this option's flag to an argparse ``parser`` (``why``: words after the help, for one command)."""
        if self.negate:
            parser.add_argument(self.flag, action="store_true", help=f"{self.help}{why} (default: off)")
            return
        shown = self.shown if self.shown is not None else ("none" if self.default is None else self.default)
        kw = {"type": self.type} if self.type is not None else {}
        if self.metavar:
            kw["metavar"] = self.metavar
        default = self.cli_default() if self.cli_default is not None else self.default
        parser.add_argument(self.flag, default=default, help=f"{self.help}{why} (default: {shown})", **kw)

    def value(self, args) -> Any:
        """This option's keyword value from parsed command-line ``args``."""
        v = getattr(args, self.dest)
        return not v if self.negate else v


OPTIONS: tuple[Option, ...] = (
    Option("n_trials", None, "total finished trials the study should hold", int, shown="the study's [search] n_trials"),
    Option("sampler", None, "tpe, random, nsga2 or cmaes",
           shown="the study's [search] sampler, which defaults to tpe"),
    Option("storage", None, "Optuna storage URL, e.g. postgresql+psycopg://host/db to share a study",
           shown="sqlite:///RUNS_DIR/STUDY/optuna.db", common=True),
    Option("tracking_uri", None, "MLflow tracking URI",
           shown="$MLFLOW_TRACKING_URI, else sqlite:///RUNS_DIR/STUDY/mlflow.db", common=True),
    Option("runs_dir", None, "where default stores live: RUNS_DIR/STUDY/optuna.db and mlflow.db",
           shown="$EVOMERGE_RUNS_DIR, else ./runs", common=True,
           cli_default=lambda: os.environ.get("EVOMERGE_RUNS_DIR", "runs")),
    Option("jobs", 1, "trials at once, in separate processes", int),
    Option("batch", 1, "trials asked at once and trained as one stacked computation in each process (a population: "
                       "N trials x W workers as N*W rows; cmaes asks a generation, its population size defaults to "
                       "N; tpe asks with its constant liar); in-process backend only; it pays on a GPU, not on a CPU", int),
    Option("seed", 0, "sampler seed", int),
    Option("reevaluate", None, "fresh seeds on which the verdict runs the search's picks and the baselines again "
                               "(paired by seed); 0: the verdict uses the search's own seeds", int, metavar="N",
           shown=str(REEVALUATE)),
    Option("verdict", True, "end without the verdict (the picks against the baselines)", negate=True),
    Option("baselines", True, "end without the baselines: no rows beside the best trials, no baseline runs in "
                              "MLflow, and so no verdict (it judges the picks against them)", negate=True),
    Option("log_model", True, "end without logging the best trial's consensus model to MLflow (its values and policy "
                               "are logged; the model is an MLflow pytorch model, saved with torch.export, which takes "
                               "seconds to import); a later search without it logs the model", negate=True),
    Option("data_dir", None, "where the dataset's IDX files are", shown="$EVOMERGE_DATA_DIR, else the user cache",
           common=True),
    Option("device", None, "torch device", shown="cuda when present, else cpu", common=True),
    Option("prune", True, "run every trial to the end", negate=True),
    Option("pruner", "median", "median, hyperband or successive-halving (Optuna's, over the rounds), or wilcoxon (over "
                               "the seeds, for studies with 5 or more seeds); one objective only, multi-objective "
                               "studies keep evomerge's dominance rule"),
    Option("warm_start_from", None, "start from another study's completed trials: a study name in --runs-dir, or "
                                    "STORAGE_URL#NAME; cmaes starts from their best solutions, other samplers evaluate "
                                    "them first", metavar="STUDY"),
    Option("cmaes_categoricals", "independent", "cmaes: 'independent' (sampled at random) or 'fixed' (study values)"),
    Option("cmaes_restarts", 0, "cmaes: IPOP restarts with doubled population", int),
    Option("cmaes_popsize", 0, "cmaes: population size", int, shown="0, meaning --batch N's N, else 4 + 3 ln d for d numeric fields"),
    Option("nsga2_population", 0, "nsga2: generation size", int,
           shown="0, meaning a third of the first search's --n-trials, 4 to 20; a study keeps its first search's"),
    Option("grace_period", GRACE_PERIOD, "seconds without a heartbeat before another process fails a running trial "
                                         "and retries it", int),
    Option("backend", "inprocess", "inprocess (all workers in one process) or distributed (one process per worker, "
                                   "torch.distributed on 127.0.0.1)", common=True),
    Option("procs", None, "distributed backend: number of processes, each running workers/procs workers", int,
           shown="one per worker", common=True),
)
BY_NAME = {o.name: o for o in OPTIONS}
#: keyword -> default of make_config(), evomerge.search() and `evomerge search` (None: from the study / the environment)
DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS}


def from_args(args) -> dict[str, Any]:
    """The keywords of ``make_config`` from ``evomerge search``'s parsed arguments."""
    return {o.name: o.value(args) for o in OPTIONS}


def check_keywords(fn: str, given: dict) -> None:
    """A keyword that is not an option is a TypeError, as Python says it for a plain signature; a value of the
    wrong type (``n_trials="5"``, ``n_trials=2.5``, ``verdict="no"``) is one ConfigError naming its flag (the Python
    call's :func:`evomerge.errors.keyword_names` names the keyword): the command line's parser converts them."""
    from ..errors import ConfigError, did_you_mean

    for name, value in given.items():
        if name not in DEFAULTS:  # (with the keyword it most likely is: Python's own line names none)
            switch = BY_NAME.get(name.removeprefix("no_"))  # no_verdict=True, spelt as the flag --no-verdict
            hint = f"; did you mean {switch.name}=False?" if name.startswith("no_") and switch is not None \
                and switch.negate else did_you_mean(name, DEFAULTS)
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}" + hint)
        o = BY_NAME[name]
        if value is None and o.default is None:
            continue
        flag = "--" + name.replace("_", "-")  # (a switch's --no-NAME is the keyword NAME)
        if o.type is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(flag, f"{value!r} is not an integer; allowed: an integer")
        if o.negate and not isinstance(value, bool):
            raise ConfigError(flag, f"{value!r} is not True or False; allowed: True, False")


def signature(fn: Callable, *extra: inspect.Parameter) -> inspect.Signature:
    """``fn``'s signature with the options as keyword-only parameters and their defaults (for ``help()`` and
    ``inspect``): its own positional parameters first, then the options, then ``extra``."""
    own = [p for p in inspect.signature(fn).parameters.values()
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kw = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default) for o in OPTIONS]
    return inspect.Signature(own + kw + list(extra))
