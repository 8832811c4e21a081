"""What ``evomerge search`` shows: a start line, a progress bar (done, pruned, failed,
best so far), and a table of the best trials next to the baselines."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from ..dburls import shown
from ..policy import describe_policy
from ..search.results import DIVERGED, RUN_STATUS, format_counts, missed, objective_label
from ..study import Study

if TYPE_CHECKING:
    from ..search.config import SearchConfig
    from ..search.loop import SearchResult


def console(stderr: bool = False):
    """Rich console; off a terminal, wide enough that tables are not squeezed into 80 columns. A reader that
    leaves (``evomerge status | head``) ends the command as every other command's output does (status 141, quiet):
    rich's own way exited 1."""
    from rich.console import Console as Rich

    class Console(Rich):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    if stderr:  # off a terminal as wide as stdout's: lines are not broken mid-phrase at 80 columns
        return Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
    return Console() if sys.stdout.isatty() else Console(width=160)


def mb(n: float) -> str:
    from ..units import size

    return size(n)


def _fmt(study: Study, name: str, v: float) -> str:
    return mb(v) if name == "bytes" else f"{v:.4f}{missed(study, name, v)}"


def best_table(study: Study, best: list[dict], baselines: list[dict], title: str):
    """The best trials (a ``search.results.trial_summary`` each) and ``baselines`` (rows of
    ``search.baselines.baseline_rows``): their objectives, the first objective's spread over seeds (a column only
    where a row has one: one seed has none) and what each policy does."""
    from rich.table import Table

    key = f"{study.objectives[0]}_std"
    spreads = [b["spread"].get(key) for b in best] + [r.get(key) for r in baselines]
    with_spread = any(v is not None for v in spreads)
    t = Table(title=title)
    t.add_column("trial / baseline" if baselines else "trial")
    for o in study.objectives:
        t.add_column(objective_label(o), justify="right")
    if with_spread:
        t.add_column("spread (sd)", justify="right")
    t.add_column("policy")

    def spread(v) -> list[str]:
        return [f"{v:.4f}" if v is not None else "-"] if with_spread else []

    for b, v in zip(best, spreads):
        t.add_row(f"trial {b['number']}", *[_fmt(study, o, x) for o, x in zip(study.objectives, b["values"])],
                  *spread(v), describe_policy(b["policy"], b.get("run")))
    for r, v in zip(baselines, spreads[len(best):]):
        name = r["name"] + (f" ({DIVERGED})" if r.get(RUN_STATUS) == DIVERGED else "")
        t.add_row(f"[dim]{name}[/dim]", *[_fmt(study, o, x) for o, x in zip(study.objectives, r["values"])],
                  *spread(v),
                  f"[dim]baseline{f' (lr {lr:g}, its best)' if (lr := r.get('lr')) is not None else ''}[/dim]")
    return t


def seeds_said(seeds) -> str:
    """The seeds a table's figures are over: "means over seeds [0, 1]", or "seed 0" for one."""
    seeds = list(seeds)
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"means over seeds {seeds}"


def diverged_line(numbers: list[int]) -> str:
    return (f"{DIVERGED}: trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))} "
            "(a loss went non-finite; kept off the best trials and the Pareto set)")


def missed_line(study: Study, best: list[dict]) -> str:
    """A note where every best trial's time to target is past the budget (the table's "(missed)" on each): ranked by
    how close they came, and how to tell them apart by time; '' otherwise."""
    if "time_to_target" not in study.objectives or not best:
        return ""
    at = study.objectives.index("time_to_target")
    if not all(missed(study, "time_to_target", b["values"][at]) for b in best):
        return ""
    from ..engine.judge import penalty_words

    return (f"note: no trial in the table reached {study.target_metric} {study.target:g} within the time budget "
            f"({study.environment.time_budget:g} s) on every seed: each is ranked by its penalty time "
            f"({penalty_words(study.target_metric)}), how close it came; a longer study.environment.time_budget or "
            "an easier study.objectives.target tells them apart by time")


def dominated_line(study: Study, best: list[dict], baselines: list[dict]) -> str:
    """A note for each trial of the Pareto set that a baseline in the table does at least as well as on every
    objective, and better on one (a new user asked why a trial that no-merging beat on loss and bytes was "Pareto-
    optimal": the set is of the trials alone); '' where none is."""
    if len(study.objectives) < 2:
        return ""
    from ..search.results import dominated_count

    said = []
    for b in best:
        by = [r["name"] for r in baselines if r.get(RUN_STATUS) != DIVERGED and r.get("values") is not None
              and dominated_count(tuple(b["values"]), [tuple(r["values"])], study.directions)]
        if by:
            said.append(f"trial {b['number']} by {', '.join(by)}")
    if not said:
        return ""
    return (f"note: a baseline in the table does as well on every objective and better on one: {'; '.join(said)} "
            "(the Pareto set is of the trials alone)")


def no_best_line(n_diverged: int) -> str:
    return "no completed trial yet" + (f" that did not diverge ({n_diverged} {DIVERGED})" if n_diverged else "")


class SearchView:
    def __init__(self, cfg: "SearchConfig", quiet: bool = False):
        self.cfg, self.quiet = cfg, quiet
        self.err = console(stderr=True)
        self.bar = None
        self.task = None
        self.end = None  # the runs at the search's end (the verdict's, the table's baselines): [task, what, total, done, start]
        self.done = self.pruned = self.failed = 0
        self.best: float | None = None

    def __enter__(self):
        if not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.err)
        return self  # the bar shows from the search's start: a search refused before it (a bad store) prints one line

    def __exit__(self, *exc):
        if self.task is not None:
            self.bar.__exit__(*exc)
        return False

    def event(self, kind: str, **info) -> None:
        cfg = self.cfg
        if kind == "start":
            b = info["before"]
            self.done = b.get("COMPLETE", 0) + b.get("PRUNED", 0)
            self.best = info.get("best")  # the study's, where it resumes (the bar showed its new trials' best only)
            self.pruned, self.failed = b.get("PRUNED", 0), b.get("FAIL", 0)
            extra = ""
            if cfg.sampler == "cmaes":
                d = len([p for p in cfg.study.search.space if p.kind != "categorical"])
                extra = f"; cmaes searches {d} numeric field{'s' * (d != 1)}"
                if d < len(cfg.study.search.space):  # (it spoke of categoricals where the space had none)
                    extra += (", categoricals " + ("sampled independently at random" if cfg.cmaes_categoricals ==
                                                   "independent" else "fixed at the study values"))
            if cfg.prunes_by_optuna and cfg.pruner != "median":
                extra += f"; pruner {cfg.pruner}"
            if cfg.batch > 1:
                extra += f"; {cfg.batch} trials at a time trained as one population"
            from ..search.warmstart import describe

            warm = describe(info.get("warm_start"))
            done = (f"{self.done} of {cfg.n_trials} trials already finished" if self.done < cfg.n_trials else
                    f"{self.done} trials already finished, {cfg.n_trials} asked: none to run")
            ran = "; ".join(x for x in (f"workers' steps: {info['steps']}" if info.get("steps") else None,
                                        f"trials {info['where']}" if info.get("where") else None) if x)
            msg = (f"{cfg.study.name}: {done}; sampler {cfg.sampler}"
                   f"{extra}; {cfg.jobs} job(s)\n" + (f"  {warm}\n" if warm else "") + (f"  {ran}\n" if ran else "") +
                   f"  optuna: {shown(info['storage'])}\n  mlflow: {shown(info['tracking_uri'])}" +
                   "".join(f"\n  note: {n}" for n in [*cfg.study.notes, *info.get("notes", ())]))  # ranges clamped
            self.err.print(msg, highlight=False, soft_wrap=True)  # (a log broke a long line of it at 160 columns)
            if self.bar is not None:
                self.bar.__enter__()
                self.task = self.bar.add_task("trials", total=cfg.n_trials, completed=min(self.done, cfg.n_trials), info="")
        elif kind == "verdict":
            n = info["reevaluate"]
            study = cfg.study
            tune = (f"each baseline's step size of lr {list(study.baseline_lr)} on the study's seeds, then "
                    if study.baseline_lr else "")
            self.err.print(f"judging: {tune}the picks and {len(study.baselines)} baselines on "
                           + (f"{n} fresh seed{'s' if n > 1 else ''} (runs already made are reused)" if n else
                              "the search's own seeds"), highlight=False)
        elif kind == "baselines":  # the table's baselines, at the search's end (those not kept already)
            study, runs = cfg.study, info["runs"]
            what = (f"each one's step size of lr {list(study.baseline_lr)}" if info["tuning"] else "for the table")
            self.err.print(f"baselines: {len(study.baselines)} on the study's seeds {list(study.run.seeds)} "
                           f"{what}, {runs} run{'s' * (runs != 1)} (kept with the study for the next time)",
                           highlight=False)
        elif kind == "runs" and self.bar is not None and self.task is not None:  # runs at the end, counted on a bar
            what, runs = info["what"], info["runs"]
            more = self.end is not None and self.end[1] == what
            if more:  # (the verdict's picks, then its baselines: one count)
                self.end[2] += runs
            else:
                self.end = [self.bar.add_task(what, total=runs, info=""), what, runs, 0, time.monotonic()]
            self.bar.update(self.end[0], total=self.end[2])
            if not self.err.is_terminal and what == "judging":  # (a log: the bars show only at the end; the count
                part = f" ({info['part']})" if info.get("part") else ""  # (6, 12 more, 12 more: of what, unsaid)
                self.err.print(f"judging: {runs}{' more' if more else ''} run{'s' * (runs != 1)} to make{part}, each "
                               "about as long as one seed of a trial", highlight=False)  # now; the baselines' line
                # says theirs)
        elif kind == "ran" and self.end is not None:
            task, _, total, done, start = self.end
            self.end[3] = done = done + 1
            per = (time.monotonic() - start) / done
            left = max(0, total - done) * per
            self.bar.update(task, completed=done, info=f"about {_duration(left)} left" if done < total else "")
        elif kind == "study":  # the whole study, read at the search's end
            self._take_study(info["study"])
            if self.task is not None:
                self._show()
        elif kind == "trial":
            r = info["record"]
            if r["state"] in ("COMPLETE", "PRUNED"):
                self.done += 1
            if r["state"] == "PRUNED":
                self.pruned += 1
            if r["state"] == "FAIL":
                self.failed += 1
            if r["state"] == "COMPLETE" and r.get("run_status") != DIVERGED:
                v = r["values"][0]
                better = self.best is None or (v > self.best if cfg.study.directions[0] == "maximize" else v < self.best)
                self.best = v if better else self.best
            self._take_study(info.get("study"))
            if self.bar is not None:
                self._show()
            elif r.get("run_status") == DIVERGED:
                self.err.print(f"trial {r['number']} {DIVERGED}", highlight=False)
            elif r["state"] == "FAIL" and r.get("failure") == "error":
                self.err.print(f"trial {r['number']} failed: {r['error'].splitlines()[0]}", highlight=False)

    def _take_study(self, now: dict | None) -> None:
        """The whole study's count and best (read where other processes share it), over this process's own."""
        if now is not None:
            self.done = max(self.done, now["done"])
            if now["best"] is not None:
                self.best = now["best"]

    def _show(self) -> None:
        if self.bar is None:
            return
        best = f"best {self.best:.4f}" if self.best is not None else "best -"
        self.bar.update(self.task, completed=min(self.done, self.cfg.n_trials),
                        info=f"pruned {self.pruned}  failed {self.failed}  {best}")

    def summary(self, result: "SearchResult") -> None:
        study = self.cfg.study
        out = console()
        out.print(f"{study.name}: {format_counts(result.counts, result.diverged)}", highlight=False)
        for e in result.errors[:3]:
            out.print(f"  failure: {e}", highlight=False)
        diverged = sorted(r["number"] for r in result.records if r.get("run_status") == DIVERGED)
        if diverged:
            out.print(diverged_line(diverged), highlight=False)
        if not result.best:
            out.print(no_best_line(result.diverged), highlight=False)
            return
        baselines = result.baselines or []  # run at the search's end (search.loop.table_baselines)
        kind = "best trials" if len(study.objectives) == 1 else "Pareto set"
        out.print(best_table(study, result.best, baselines, f"{study.name}: {kind} ({seeds_said(study.run.seeds)})"))
        for said in (missed_line(study, result.best), dominated_line(study, result.best, baselines)):
            if said:
                out.print(said, highlight=False)
        if result.verdict:
            from ..search.verdict import render

            render(result.verdict, out)


def _duration(seconds: float) -> str:
    """``45 s``, ``3 min``, ``1 h 20 min``: a time left, as a person reads it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)  # (rounded once: 7190 s is 2 h 0 min, not 1 h 60 min)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"
