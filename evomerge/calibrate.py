"""``evomerge calibrate``: measure a cluster and write its ``[environment]`` (a TOML file a study takes with
``[environment] from = "cluster.toml"``).

On the cluster, one process per worker (torchrun, or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``)::

    torchrun --nnodes 2 --nproc-per-node 4 ... -m evomerge.calibrate --study my.toml -o cluster.toml

``evomerge calibrate --study my.toml --procs 4 -o cluster.toml`` starts the ranks on this host itself, and
``evomerge calibrate --from-trace DIR -o cluster.toml`` fits the same table from the traces a ``Merger`` wrote
(``trace=DIR``).

What is measured (every rank at once, as in the real job: ranks that share a host share its cores):

- **compute**: each rank times ``--steps`` local steps of the study's model, batch size and optimiser on its own
  device (CUDA events on a GPU), after ``--warmup`` steps that are not counted. A step's time is the time from
  one step's start to the next's (data, forward, backward, optimiser step), its samples are the rank's shard of
  the study's data.
- **links**: pairs of ranks ping-pong a one-float message and a model-sized one (the parameters and buffers as
  float32, what the ``Merger`` sends), ``--repeats`` times each way after a warm-up. Latency is the small
  message's one-way time (half the median round trip); a direction's bandwidth is the model's bytes over its
  big one-way time (the median round trip of big there, small back, less the small one-way time) less the
  latency. Pairs are measured in rounds of disjoint pairs, all pairs of a round at once (each rank has its
  own link, as on a switch). Up to ``--all-pairs-up-to`` ranks (16) every pair is measured; beyond that the
  ring (r, r + 1) and as many more pairs drawn from ``--seed``; unmeasured links get the median of the
  measured ones.
- **all-reduce**: a ring all-reduce of the model's floats (torch.distributed's), timed and written as a
  comment beside the time the fitted links predict for it.

What is written (:func:`fit`): ``step_time`` (the median step of the fastest rank, scaled by one factor so that
the ranks' steps, with what the noise adds on average, take their measured means in total), ``speeds`` (the
fastest rank's median over each rank's: the fastest is 1.0), ``jitter`` (the lognormal sigma of the per-step
noise: 1.4826 x the median absolute deviation of log(step / the rank's median), slow spells left out), ``straggle_*`` when the
step times have a clear tail (steps over :data:`SPELL` x their rank's median, in at least :data:`MIN_SPELLS`
spells, at most :data:`MAX_SLOW` of the steps; else no slow spells), and the links: ``sites`` with inside and
between values when the links form clear contiguous groups (:func:`find_sites`), else ``latency_matrix`` and
``bandwidth_matrix``. ``--fit lognormal|pareto`` writes a speed model instead of the list, and the links as
sites or single values, so that a few measured nodes can drive a study of any number of workers. Comments in
the file give the measured figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, RunError
from .userdirs import check_writable

SPELL = 2.0  # a step slower than this many times its rank's median is part of a slow spell
MIN_SPELLS = 3  # fewer spells than this are no clear tail: no straggle_* fields
MAX_SLOW = 0.3  # nor when more than this fraction of the steps are slow (the median itself is then unclear)
MEAN_OFF = 0.1  # a rank's mean step this far from its median and noise: a note on the terminal
PAUSE = 10.0  # a step over this many times its rank's median, one of fewer than MIN_SPELLS such: a pause, left out of
# the rank's mean (one 1 s pause among 50 steps of 10 ms made a rank's speed 0.34)
SITE_GAP = 1.5  # sites: every inside link this many times better than every between link (latency or bandwidth)
FITS = ("lognormal", "pareto")
LONE_ENOUGH = 3  # a link with this many transfers that had both ends to themselves is fitted on those alone
POOL_LIKE = 2.0  # else on the flows at its ends, among the links whose own fits are within this factor of its own
MIN_TRANSFER = 1e-4  # seconds: a transfer shorter than this after queueing measured its receive's posting, not its link
PEER_GONE = 3  # a rank's exit status when another rank failed (the launcher names the rank that failed first)
# under a launcher of its own, a rank ends the whole calibration this long after --timeout from its start: ranks that
# do not all join the process group within --timeout are named as such first
GRACE = 2.0
FAIL_RANK = "EVOMERGE_CALIBRATE_FAIL_RANK"  # for the tests: this rank fails after timing its steps
FIT_FROM = 4  # --fit from fewer ranks than this: a warning (a spread fitted to 2 or 3 ranks' steps)
PROGRESS = "EVOMERGE_CALIBRATE_PROGRESS"  # the launcher's folder where each rank says which collective it is at
DEFAULTS = dict(steps=50, warmup=5, repeats=5, all_pairs_up_to=16, seed=0, timeout=600.0, step_sleep=0.0,
                slow_rank=-1, slow_factor=1.0)
MIN_TIMED = 3  # timed steps a rank, at least (--steps; a trace's after --warmup): a median and a spread


# -- options ------------------------------------------------------------------------------------------------
def add_options(p: argparse.ArgumentParser, launcher: bool) -> None:
    """The options of ``python -m evomerge.calibrate`` (``launcher=False``) and ``evomerge calibrate``."""
    d = DEFAULTS
    p.add_argument("--study", default=None,
                   help="study name (studies/NAME.toml in the current folder, else the shipped studies) or path to "
                        "a .toml file: the model, batch size, optimiser and data whose steps are timed "
                        + ("(default: none; needed unless --from-trace)" if launcher else "; required"),
                   required=not launcher)
    p.add_argument("-o", "--output", required=True, help="the TOML file to write ([environment]); required")
    if launcher:
        p.add_argument("--procs", type=int, default=None,
                       help="ranks to start on this host (gloo on 127.0.0.1, a free port) (default: none; needed "
                            "with --study, unless ranks are started by a launcher: python -m evomerge.calibrate under "
                            "torchrun or netlab)")
        p.add_argument("--from-trace", default=None, metavar="DIR",
                       help="fit from a Merger's traces instead (DIR/rank-R.jsonl, trace=DIR) (default: none)")
    p.add_argument("--data-dir", default=None,
                   help="where the dataset's IDX files are (default: $EVOMERGE_DATA_DIR, else the user cache)")
    p.add_argument("--fit", default=None, choices=FITS,
                   help="write a speed model (speeds = \"lognormal\" with sigma, or \"pareto\" with alpha) and the "
                        "links as sites or single values, for a study of any number of workers (default: none: one "
                        "speed per rank and the link matrices)")
    p.add_argument("--steps", type=int, default=d["steps"], help=f"timed local steps per rank (default: {d['steps']})")
    p.add_argument("--warmup", type=int, default=d["warmup"],
                   help=f"steps not counted, before the timed ones (or first steps of each rank's trace) "
                        f"(default: {d['warmup']})")
    p.add_argument("--repeats", type=int, default=d["repeats"],
                   help=f"model-sized messages each way per pair (the small message: 4 x as many) "
                        f"(default: {d['repeats']})")
    p.add_argument("--all-pairs-up-to", type=int, default=d["all_pairs_up_to"],
                   help=f"measure every pair up to this many ranks; beyond, the ring and as many sampled pairs "
                        f"(default: {d['all_pairs_up_to']})")
    p.add_argument("--seed", type=int, default=d["seed"], help=f"draws the sampled pairs and the batches "
                                                                f"(default: {d['seed']})")
    p.add_argument("--timeout", type=float, default=d["timeout"],
                   help=f"seconds the whole calibration may take; a rank that fails or hangs stops it "
                        f"(default: {d['timeout']})")
    # emulated devices, to try calibrate on one host (and for the tests), as examples/deploy/train.py does
    p.add_argument("--step-sleep", type=float, default=d["step_sleep"], metavar="S",
                   help=f"every rank's step takes S seconds longer (it sleeps), as a device that slow (default: "
                        f"{d['step_sleep']})")
    p.add_argument("--slow-rank", type=int, default=d["slow_rank"], metavar="R",
                   help=f"this rank sleeps after each step to take --slow-factor times its step; ranks that "
                        f"share a host's cores want a --step-sleep beside it, or the sleep speeds the others up "
                        f"(default: {d['slow_rank']}, none)")
    p.add_argument("--slow-factor", type=float, default=d["slow_factor"], metavar="F",
                   help=f"see --slow-rank (default: {d['slow_factor']})")


def check_options(args, writes: bool = True) -> None:
    """The options' values, before any work; ``writes``: this process writes ``--output`` (rank 0 alone does: a
    rank on another machine need not hold its folder)."""
    for name, low in (("steps", MIN_TIMED), ("warmup", 0), ("repeats", 1), ("all_pairs_up_to", 2)):
        v = getattr(args, name)
        if v < low:
            raise ConfigError(f"--{name.replace('_', '-')}", f"{v} is out of range; allowed: [{low}, inf)")
    if not args.step_sleep >= 0:
        raise ConfigError("--step-sleep", f"{args.step_sleep} is out of range; allowed: seconds >= 0")
    if not args.slow_factor >= 1:
        raise ConfigError("--slow-factor", f"{args.slow_factor} is out of range; allowed: [1, inf)")
    if args.slow_rank != -1 and args.slow_factor == 1:
        raise ConfigError("--slow-factor", f"1 (the default) with --slow-rank {args.slow_rank} emulates nothing; "
                                           "allowed: a factor above 1, e.g. --slow-factor 3")
    if args.slow_rank == -1 and args.slow_factor > 1:
        raise ConfigError("--slow-rank", f"none, so --slow-factor {args.slow_factor:g} emulates nothing; allowed: the "
                                         "rank to slow down, e.g. --slow-rank 0")
    if not 0 < args.timeout <= 1e6:  # (as the Merger's: inf or 1e15 was a timedelta's or a timer's traceback)
        raise ConfigError("--timeout", f"{args.timeout:g} is out of range; allowed: seconds in (0, 1e+06]")
    if writes:
        check_writable(args.output, "--output")


def check_rank(args, world: int) -> None:
    """``--slow-rank`` names one of the ``world`` ranks, or none (-1)."""
    if args.slow_rank != -1 and not 0 <= args.slow_rank < world:
        raise ConfigError("--slow-rank", f"{args.slow_rank} is out of range; allowed: -1 (none) or a rank in "
                                         f"[0, {world - 1}]")


# -- what was measured --------------------------------------------------------------------------------------
@dataclass
class Measured:
    """A cluster's figures, from :func:`measure` or :func:`from_trace`; :func:`fit` makes an environment of them."""

    step_times: list[list[float]]  # per rank: seconds of each counted local step
    latency: list[list[float | None]]  # [W][W] one-way seconds of a small message (None: not measured)
    bandwidth: list[list[float | None]]  # [W][W] bytes per second i -> j (inf: too fast to tell; None: not measured)
    payload: int = 0  # bytes of the model-sized message
    source: str = ""  # what was measured, for the file's first comment
    notes: list[str] = field(default_factory=list)  # more comment lines (the all-reduce, the device, ...)
    samples: list[list[int]] | None = None  # [W][W] transfers behind each link's figures
    allreduce: tuple[float, int] | None = None  # (seconds, bytes) of a measured ring all-reduce
    links_from_allreduce: bool = False  # a trace of all-reduces only: every link the rate its all-reduces took
    merge_time: float | None = None  # a rank's own seconds at a step with a merge (from a Merger's trace)


def _median(xs) -> float:
    return float(statistics.median(xs))


def _quantile(xs, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _num(v: float, digits: int = 4) -> float:
    """``v`` to ``digits`` significant digits (what the file shows)."""
    if v == 0 or not math.isfinite(v):
        return v
    return float(f"{v:.{digits - 1}e}")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _us(s: float) -> str:
    return f"{s * 1e6:.3g} us" if s < 1e-3 else _ms(s)


def _rate(b: float) -> str:
    if not math.isfinite(b):
        return "unlimited"
    for unit, k in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.3g} B/s"


# -- fitting ------------------------------------------------------------------------------------------------
def fit_compute(step_times: list[list[float]], fit: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """``step_time``, ``speeds`` (or a speed model), ``jitter`` and ``straggle_*`` from each rank's step times."""
    import numpy as np

    W = len(step_times)
    if W == 0 or any(len(t) == 0 for t in step_times):
        bad = next((r for r, t in enumerate(step_times) if not t), 0)
        raise ConfigError("step times", f"rank {bad} has no timed steps")
    med = np.array([_median(t) for t in step_times])
    if not (med > 0).all():
        raise ConfigError("step times", f"rank {int(np.argmin(med))} has a median step time of 0")
    env: dict[str, Any] = {}
    notes = ["compute: per rank, the median step time (10th and 90th percentiles, slowest) over its timed steps"]
    for r, t in enumerate(step_times):
        notes.append(f"  rank {r}: {_ms(med[r])} ({_ms(_quantile(t, 0.1))}, {_ms(_quantile(t, 0.9))}, "
                     f"{_ms(max(t))}) over {len(t)} steps")
    # the noise first: slow spells (the steps over SPELL x their rank's median, in runs) and the jitter of the rest
    ratios = [np.asarray(t) / m for t, m in zip(step_times, med)]
    slow = [r > SPELL for r in ratios]
    n_steps = sum(len(r) for r in ratios)
    n_slow = int(sum(s.sum() for s in slow))
    spells = sum(int(s[0]) + int((s[1:] & ~s[:-1]).sum()) for s in slow if len(s))
    logs = np.concatenate([np.log(r[~s]) for r, s in zip(ratios, slow)])
    jitter = 1.4826 * float(np.median(np.abs(logs - np.median(logs)))) if len(logs) else 0.0
    clear = spells >= MIN_SPELLS and n_slow <= MAX_SLOW * n_steps and math.log(SPELL) > 3 * jitter
    noise: dict[str, Any] = {"jitter": _num(jitter)}
    if clear:
        slow_ratios = np.concatenate([r[s] for r, s in zip(ratios, slow)])
        noise["straggle_p"] = _num(spells / max(1, n_steps - n_slow))
        noise["straggle_factor"] = _num(max(1.0, float(np.median(slow_ratios))))
        noise["straggle_length"] = _num(max(1.0, n_slow / spells))
    else:
        noise["straggle_p"] = 0.0
    # each rank's step: its median, all of them scaled by one factor so that, with what the noise adds on average,
    # the ranks' steps take their measured means in total (a run's time is the sum of its steps: a rank's median x
    # exp(jitter^2 / 2) fell 38-46% short of a new user's small LSTM's mean steps, whose long steps were no clear
    # tail, and the clock 54% short of the job). One factor, not each rank's own mean: the ranks' speeds stay their
    # medians' ratios, which a loaded machine's noise moves less (each rank's own mean made a 3x slower rank 0.42)
    adds = math.exp(jitter ** 2 / 2) * (1 + (n_slow / n_steps if clear and n_steps else 0.0)
                                        * (noise.get("straggle_factor", 1.0) - 1))
    means, paused = [], []
    for r, t in enumerate(step_times):
        t = np.asarray(t)
        long_ = t > PAUSE * med[r]
        if 0 < long_.sum() < MIN_SPELLS:
            paused.append(f"rank {r}: {', '.join(_ms(x) for x in t[long_])}")
            t = t[~long_]
        means.append(float(np.mean(t)))
    means = np.array(means)
    scale = max(1e-12, float(means.sum() / (med * adds).sum()))
    step = med * scale
    fastest = float(step.min())
    if fit is None:
        env["step_time"] = _num(fastest)
        env["speeds"] = [_num(fastest / m) for m in step]
        notes.append(f"step_time: the fastest rank's ({int(np.argmin(step))}) median x {scale:.3g}; speeds: its "
                     "median over each rank's; the factor makes the ranks' steps, with what the noise below adds on "
                     "average (exp(jitter^2 / 2), and the slow spells' share at straggle_factor), take their measured "
                     "means in total")
    elif fit == "lognormal":
        logs_ = np.log(step)
        sigma = float(np.std(logs_, ddof=1)) if W > 1 else 0.0
        env["step_time"] = _num(float(np.exp(logs_.mean())))
        env["speeds"], env["sigma"] = "lognormal", _num(sigma)
        notes.append(f"speeds fitted as lognormal over {W} ranks: step_time is the geometric mean of the ranks' "
                     f"medians x {scale:.3g} (the factor above: their steps take their measured means in total), "
                     f"sigma the standard deviation of their logs; measured speeds "
                     f"{[_num(fastest / m, 3) for m in step]}")
    else:  # pareto: multipliers 1 + Pareto(alpha) over the fastest rank; log(m) ~ Exponential(alpha)
        logs_ = np.log(step / fastest)
        env["step_time"] = _num(fastest)
        if logs_.sum() > 0:
            env["speeds"], env["alpha"] = "pareto", _num(float(np.clip(W / logs_.sum(), 0.1, 100.0)))
        else:
            env["speeds"] = "equal"
        notes.append(f"speeds fitted as pareto over {W} ranks: step_time is the fastest rank's median x {scale:.3g} "
                     f"(their steps take their measured means in total), alpha the maximum-likelihood fit of "
                     f"log(median / the fastest's); measured speeds {[_num(fastest / m, 3) for m in step]}")
    if fit is not None and W < FIT_FROM:
        whose = "rank's" if W == 1 else "ranks'"
        notes.append(f"{WARNING}--fit {fit} from {W} rank{'s' * (W != 1)}: a spread fitted to {W} {whose} steps is a "
                     f"rough guess; fit from {FIT_FROM} ranks or more")
    env.update(noise)
    notes.append(f"jitter: 1.4826 x the median absolute deviation of log(step / rank median) over {len(logs)} steps")
    if clear:
        notes.append(f"slow spells: {n_slow} of {n_steps} steps over {SPELL:g} x their rank's median, in {spells} "
                     f"spells: straggle_p = spells / other steps, straggle_factor = the slow steps' median ratio, "
                     f"straggle_length = the mean spell")
    else:
        notes.append(f"slow spells: none written ({n_slow} of {n_steps} steps over {SPELL:g} x their rank's median, "
                     f"in {spells} spells; a clear tail needs {MIN_SPELLS} spells, at most {MAX_SLOW:.0%} of the "
                     f"steps, and jitter below log({SPELL:g}) / 3)")
    notes += _mean_check(means, med * adds, clear)
    if paused:
        notes.append(f"{NOTE}steps over {PAUSE:g} x their rank's median, fewer than {MIN_SPELLS} a rank, left out of "
                     f"its mean as pauses, not its steps ({'; '.join(paused)}): a run's time has them only where they "
                     "recur")
    return env, notes


def _mean_check(means, from_median, spells: bool) -> list[str]:
    """Each rank's mean step against the mean its median and the noise give (its median x exp(jitter^2 / 2), and
    its share of slow steps at straggle_factor). step_time is scaled so that the ranks' steps take their means in
    total (a run's time is the sum of its steps), so a rank whose mean is far from that has steps whose spread the
    noise does not describe. A line for the file; a note on the terminal where a rank
    is more than :data:`MEAN_OFF` off."""
    import numpy as np

    off = np.asarray(means) / np.asarray(from_median) - 1
    each = ", ".join(f"rank {r}: {_ms(a)} vs {_ms(b)} ({o:+.1%})" for r, (a, b, o) in
                     enumerate(zip(means, from_median, off)))
    out = [f"mean step, measured vs what its median and the noise above give on average: {each}; step_time is "
           "scaled by their total"]
    far = np.flatnonzero(np.abs(off) > MEAN_OFF)
    if len(far):
        why = ("the slow spells, fitted over every rank, are drawn for every rank" if spells else
               "long steps that are no clear tail of slow spells" if off[far].max() > 0 else "")
        ranks = ", ".join(f"rank {r}'s {_ms(means[r])} is {off[r]:+.0%}" for r in far)
        out.append(f"{NOTE}mean step against its median x exp(jitter^2 / 2): {ranks}{f' ({why})' if why else ''}: "
                   "step_time is scaled so that the ranks' steps take their measured means in total, with a spread "
                   "unlike theirs")
    return out


def _matrix(m, W: int, default: float = math.nan):
    import numpy as np

    a = np.full((W, W), default, dtype=np.float64)
    for i in range(W):
        for j in range(W):
            if i != j and m[i][j] is not None:
                a[i, j] = float(m[i][j])
    return a


def find_sites(latency, bandwidth) -> int | None:
    """The number of contiguous sites (split as ``np.array_split`` splits the ranks, as the simulated clock does)
    whose every inside link is :data:`SITE_GAP` times better than every between link, in latency or in bandwidth;
    the fewest sites that do, or None. ``latency`` and ``bandwidth``: [W, W] arrays (nan: not measured)."""
    import numpy as np

    W = len(latency)
    for S in range(2, W // 2 + 1):
        groups = np.concatenate([np.full(len(g), k) for k, g in enumerate(np.array_split(np.arange(W), S))])
        same = groups[:, None] == groups[None, :]
        off = ~np.eye(W, dtype=bool)
        inside, between = same & off, ~same
        for a, better_low in ((latency, True), (bandwidth, False)):
            i, b = a[inside], a[between]
            i, b = i[~np.isnan(i)], b[~np.isnan(b)]
            if not len(i) or not len(b):
                continue
            if better_low and i.max() * SITE_GAP < b.min():
                return S
            if not better_low and i.min() > b.max() * SITE_GAP:
                return S
    return None


def fit_links(m: Measured, fit: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Latency and bandwidth: sites when the links form clear groups, else the matrices (or, with ``fit``,
    the median link)."""
    import numpy as np

    W = len(m.latency)
    if W < 2:
        return {}, ["links: one rank, none measured"]
    lat, bw = _matrix(m.latency, W), _matrix(m.bandwidth, W)
    off = ~np.eye(W, dtype=bool)
    measured = off & ~np.isnan(lat) & ~np.isnan(bw)
    if not measured.any():
        return {}, ["links: none measured (free links: no latency, unlimited bandwidth)"]
    if m.links_from_allreduce:  # (it said "measured with model-sized messages", where none went point to point)
        notes = [f"links: {int(measured.sum())} of {W * (W - 1)} directed links given the rate of the all-reduces of "
                 f"{m.payload} bytes (none measured point to point)"]
    else:
        notes = [f"links: {int(measured.sum())} of {W * (W - 1)} directed links measured"
                 + (f" with model-sized messages of {m.payload} bytes" if m.payload else "")]
    for i in range(W):
        row = []
        for j in range(W):
            if measured[i, j]:
                n = f" x{m.samples[i][j]}" if m.samples else ""
                row.append(f"{j}: {_us(lat[i, j])} {_rate(bw[i, j])}{n}")
        if row:
            notes.append(f"  {i} -> " + ", ".join(row))
    lat_med = float(np.median(lat[measured]))
    bw_med = float(np.median(bw[measured]))

    def bw_value(v: float) -> float:
        return 0.0 if not math.isfinite(v) else _num(v)  # 0: unlimited

    env: dict[str, Any] = {}
    sites = find_sites(np.where(measured, lat, np.nan), np.where(measured, bw, np.nan))
    if sites:
        groups = np.concatenate([np.full(len(g), k) for k, g in enumerate(np.array_split(np.arange(W), sites))])
        same = groups[:, None] == groups[None, :]
        inside, between = measured & same, measured & ~same
        env.update(sites=sites, latency=_num(float(np.median(lat[inside]))),
                   bandwidth=bw_value(float(np.median(bw[inside]))),
                   latency_inter=_num(float(np.median(lat[between]))),
                   bandwidth_inter=bw_value(float(np.median(bw[between]))))
        notes.append(f"the links form {sites} contiguous sites (every inside link {SITE_GAP:g} x better than every "
                     f"link between, in latency or bandwidth): medians inside and between")
    elif fit:
        env.update(latency=_num(lat_med), bandwidth=bw_value(bw_med))
        notes.append("--fit: latency and bandwidth are the medians of the measured links")
    else:
        fill = ~off | measured
        latm = np.where(fill, lat, lat_med)
        bwm = np.where(fill, bw, bw_med)
        env["latency_matrix"] = [[0.0 if i == j else _num(float(latm[i, j])) for j in range(W)] for i in range(W)]
        env["bandwidth_matrix"] = [[0.0 if i == j else bw_value(float(bwm[i, j])) for j in range(W)] for i in range(W)]
        if not measured[off].all():
            notes.append(f"links not measured: the median link ({_us(lat_med)}, {_rate(bw_med)})")
    if m.allreduce:
        seconds, nbytes = m.allreduce
        ring = [(i, (i + 1) % W) for i in range(W)]
        rl = max(float(lat[i, j]) if measured[i, j] else lat_med for i, j in ring)
        rb = min(float(bw[i, j]) if measured[i, j] else bw_med for i, j in ring)
        predicted = 2 * (W - 1) * rl + 2 * (W - 1) / W * nbytes / rb
        notes.append(f"ring all-reduce of {nbytes} bytes: measured {_ms(seconds)}; the fitted links predict "
                     f"{_ms(predicted)} (2 (W-1) latency + 2 (W-1)/W bytes / bandwidth over the ring's slowest link)")
        off_by = max(predicted, seconds) / max(min(predicted, seconds), 1e-12)
        if off_by > CHECK_OFF:
            notes.append(f"{WARNING}the ring's measured links predict a ring all-reduce of {nbytes} bytes in "
                         f"{_ms(predicted)}; "
                         f"it took {_ms(seconds)} ({off_by:.1f}x off): the links' figures are unsure at this message "
                         "size, and a search on them may avoid links that are fine; calibrate from a trace of your "
                         "own job (--from-trace), whose messages are its own, or read the links in the file")
    return env, notes


CHECK_OFF = 2.0  # the fitted links' ring all-reduce this many times off the measured one: a warning
WARNING = "warning: "  # a note that starts so is also printed when the file is written
NOTE = "note: "  # so is one that starts so
SAID = (WARNING, NOTE)


def fit(m: Measured, fit: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """The ``[environment]`` keys and the comment lines for ``m``."""
    if fit is not None and fit not in FITS:
        raise ConfigError("--fit", f"{fit!r}; allowed: {', '.join(FITS)}")
    env, notes = fit_compute(m.step_times, fit)
    links, link_notes = fit_links(m, fit)
    if m.merge_time:
        links["merge_time"] = _num(m.merge_time)
    return env | links, [m.source, *m.notes, *notes, *link_notes]


# -- the file -----------------------------------------------------------------------------------------------
ORDER = ("step_time", "speeds", "sigma", "alpha", "jitter", "straggle_p", "straggle_factor", "straggle_length",
         "merge_time", "sites", "latency", "bandwidth", "latency_inter", "bandwidth_inter", "latency_matrix",
         "bandwidth_matrix")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        t = f"{v:.6g}"  # the values are rounded already (_num): short, and exact
        return t if any(c in t for c in ".en") else t + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(env: dict[str, Any], notes: list[str]) -> str:
    lines = [f"# {n}" if n else "#" for n in notes]
    lines += ["", "[environment]"]
    for k in sorted(env, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER)):
        v = env[k]
        if k.endswith("_matrix"):
            lines.append(f"{k} = [")
            lines += [f"    {_toml_value(row)}," for row in v]
            lines.append("]")
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def write(m: Measured, out: str | os.PathLike, fit_kind: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Fit ``m`` and write the file; returns the environment's keys and the warnings (notes the file also has) for
    the terminal."""
    env, notes = fit(m, fit_kind)
    out = Path(out)
    if out.exists() and not out.is_file():  # what stands for a file (/dev/stdout): written as it is
        out.write_text(to_toml(env, notes), encoding="utf-8")
    else:  # whole or not at all: a rank stopped mid-write leaves the old file, or none
        tmp = out.with_name(f".{out.name}.{os.getpid()}.new")
        try:
            tmp.write_text(to_toml(env, notes), encoding="utf-8")
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return env, [n for n in notes if n.startswith(SAID)]


def summary(env: dict[str, Any], W: int, out) -> str:
    """One line for the terminal."""
    speeds = env.get("speeds")
    sp = (f"speeds {min(speeds):.3g}-{max(speeds):.3g}" if isinstance(speeds, list) else
          f"speeds {speeds}" + (f" (sigma {env['sigma']:g})" if "sigma" in env else "")
          + (f" (alpha {env['alpha']:g})" if "alpha" in env else ""))
    if "latency_matrix" in env:
        lat = [v for i, r in enumerate(env["latency_matrix"]) for j, v in enumerate(r) if i != j]
        # 0 is an unlimited link
        bw = [v or math.inf for i, r in enumerate(env["bandwidth_matrix"]) for j, v in enumerate(r) if i != j]
        link = f"links {_us(_median(lat))}, {_rate(_median(bw))} (median)"
        if not any(lat):  # (a trace's one message size: a new user read 0 us and a few MB/s on loopback as wrong)
            link += "; latency 0: one message size cannot tell it apart, its cost is in the bandwidth"
    elif "latency" in env:
        link = f"links {_us(env['latency'])}, {_rate(env['bandwidth'] or math.inf)}"
        if "sites" in env:
            link = (f"{env['sites']} sites: inside {_us(env['latency'])}, {_rate(env['bandwidth'] or math.inf)}; "
                    f"between {_us(env['latency_inter'])}, {_rate(env['bandwidth_inter'] or math.inf)}")
    else:
        link = "no links"
    return (f"wrote {out}: {W} rank{'s' * (W != 1)}, step time {_ms(env['step_time'])}, {sp}, jitter {env['jitter']:g}, "
            f"straggle_p {env['straggle_p']:g}, {link}")


# -- from a Merger's trace ------------------------------------------------------------------------------------
def read_traces(d: Path, where: str) -> tuple[dict[int, Path], list[list[dict]]]:
    """A ``Merger`` run's traces (``DIR/rank-R.jsonl``, ranks 0..W-1): each rank's file and its records; one line
    naming ``where`` (the flag that gave the folder) when they cannot be read."""
    if d.is_file():  # (a rank's file given for its folder: "no such folder" of a path that is there)
        raise ConfigError(where, f"{d}: a file, not a folder; allowed: the folder of the job's traces "
                                 f"({d.parent})")
    if not d.is_dir():
        raise ConfigError(where, f"{d}: no such folder")
    files = {}
    for f in d.glob("rank-*.jsonl"):
        try:
            files[int(f.stem.removeprefix("rank-"))] = f
        except ValueError:
            continue
    if not files:
        raise ConfigError(where, f"{d}: no traces (rank-R.jsonl, as a Merger with trace=DIR writes them)")
    W = max(files) + 1
    missing = [r for r in range(W) if r not in files]
    if missing:
        raise ConfigError(where, f"{d}: rank-{missing[0]}.jsonl is missing (ranks 0..{W - 1} have traces)")
    recs: list[list[dict]] = []
    for r in range(W):
        rows = []
        try:
            lines = files[r].read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(where, f"{files[r]}: cannot read: {e}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):
                    continue  # a last line cut short (the process died while writing it)
                raise ConfigError(where, f"{files[r]}: line {n} is not JSON") from None
            if isinstance(rec, dict):
                rows.append(rec)
        recs.append(rows)
    return files, recs


def last_jobs(files: dict[int, Path], recs: list[list[dict]], where: str) -> tuple[list[list[dict]], int]:
    """Each rank's records of the last job in the folder (a ``Merger`` appends: each one's first record holds its
    ``model_bytes``, and, written since 2026-12-06, the job's ``ranks`` and its wall-clock ``t``), and how many
    jobs rank 0's file holds. Files of ranks past the last job's (an earlier, larger job's) are left out. A rank
    whose last records ended before the last job began wrote none of it (it died before its Merger was made): one
    line naming its file, as a job's event numbers start again at 0 and a send of one job would be paired with a
    receive of another. Traces that do not say when they began must hold as many jobs on every rank."""
    cut = [[i for i, x in enumerate(rows) if "model_bytes" in x] for rows in recs]
    last = [rows[c[-1]:] if c else rows for rows, c in zip(recs, cut)]
    head = last[0][0] if last[0] else {}
    ranks = head.get("ranks")
    if isinstance(ranks, int) and ranks > len(last):  # (fitted as a cluster of the ranks there, in silence)
        raise ConfigError(where, f"{files[0].parent}: rank-{len(last)}.jsonl is missing (the job ran {ranks} ranks; "
                                 f"ranks 0..{len(last) - 1} have traces); allowed: a folder of every rank's trace")
    if isinstance(ranks, int) and 0 < ranks <= len(last):
        last, cut = last[:ranks], cut[:ranks]
    if last and all(seg and not any("compute_s" in x for x in seg) for seg in last):  # (refused at its start: it read
        # "its last job ended before the folder's last job began" of a rank that had written its first record)
        raise ConfigError(where, f"{files[0].parent}: its last job ran no step (every rank wrote its first record "
                                 "and none a step: refused or stopped at its start); allowed: the traces of a job that "
                                 "ran (a trace= folder of its own)")
    starts = [seg[0].get("t") if seg else None for seg in last]
    if all(isinstance(t, (int, float)) for t in starts):
        began = max(starts)  # the last rank to make its Merger in the last job

        def latest(seg) -> float:
            return max((float(x[k]) for x in seg for k in ("t", "end", "arrived") if isinstance(x.get(k), (int, float))),
                       default=float("-inf"))

        for r, seg in enumerate(last):
            if latest(seg) < began:
                raise ConfigError(where, f"{files[r]}: its last job ended before the folder's last job began (rank {r} "
                                         "wrote no trace of it); allowed: a folder of one job's traces (a trace= folder "
                                         "of its own)")
        return last, max(1, len(cut[0]))
    counts = [max(1, len(c)) for c in cut]
    if len(set(counts)) > 1:
        r, q = min(range(len(counts)), key=counts.__getitem__), max(range(len(counts)), key=counts.__getitem__)
        raise ConfigError(where, f"{files[r]} holds the traces of {counts[r]} job{'s' * (counts[r] != 1)} and "
                                 f"{files[q]} of {counts[q]} (a Merger appends to rank-R.jsonl): the folder mixes jobs of different "
                                 "ranks; allowed: a folder of one job's traces (a trace= folder of its own)")
    return last, counts[0]


def job_start(directory: str | os.PathLike, where: str = "--against") -> dict:
    """Rank 0's first record of a ``Merger`` job's traces (the last job's, where a folder holds several): the
    model's bytes, the policy, the seed, the overlap and asynchronous DiLoCo's local steps, those this evomerge's
    Merger writes."""
    files, recs = read_traces(Path(directory), where)
    recs, _ = last_jobs(files, recs, where)
    return recs[0][0] if recs[0] else {}


def jobs_held(directory: str | os.PathLike) -> int:
    """How many jobs rank 0's trace in a folder holds (a ``Merger`` appends: each job's first record holds its
    ``model_bytes``); 0 where it cannot be read."""
    try:
        with open(Path(directory) / "rank-0.jsonl", encoding="utf-8") as f:
            return sum(1 for line in f if '"model_bytes"' in line)
    except OSError:
        return 0


def job_policy(first: dict) -> tuple[dict | None, int | None]:
    """The policy (its fields) and seed a ``Merger`` job ran, from its traces' first record (:func:`job_start`);
    None for a trace of an evomerge that did not write them."""
    policy, seed = first.get("policy"), first.get("seed")
    return (policy if isinstance(policy, dict) else None), (seed if isinstance(seed, int) else None)


def job_time(directory: str | os.PathLike, where: str = "--against") -> tuple[int, list[int], float]:
    """A ``Merger`` job's ranks, each rank's steps, and its seconds from the first rank's first step (the start of
    the loop's compute before it) to the last rank's ``finish()``, from its traces (the last job's, where a folder
    holds several: a Merger appends): what the simulated clock's time for the same steps is held against
    (``evomerge run --against``)."""
    import numpy as np

    d = Path(directory)
    files, recs = read_traces(d, where)
    starts, ends, steps = [], [], []
    recs, _ = last_jobs(files, recs, where)
    for r, rows in enumerate(recs):
        stepped = [x for x in rows if "compute_s" in x and "kind" not in x]
        end = next((x for x in rows if isinstance(x.get("end"), (int, float))), None)
        if not stepped or not isinstance(stepped[0].get("t"), (int, float)) or end is None:
            raise ConfigError(where, f"{files[r]}: no step times or no finish() (a trace of a job that ended with "
                                     "finish(), by this evomerge's Merger); allowed: the traces of such a job")
        if stepped[0].get("step") != 1 or end.get("total_steps", len(stepped)) != len(stepped):
            raise ConfigError(where, f"{files[r]}: a job resumed from a checkpoint, or ended before its total_steps "
                                     f"({len(stepped)} steps from step {stepped[0].get('step')}, total_steps "
                                     f"{end.get('total_steps')}); allowed: the traces of a whole job")
        # the first step's compute taken as the rank's median: the loop's start-up (loader, compile) left out, as the
        # calibration leaves out its first steps
        starts.append(float(stepped[0]["t"]) - float(np.median([float(x["compute_s"]) for x in stepped])))
        ends.append(float(end["end"]))
        steps.append(len(stepped))
    return len(recs), steps, max(ends) - min(starts)


def from_trace(directory: str | os.PathLike, warmup: int = DEFAULTS["warmup"]) -> Measured:
    """The figures of a ``Merger`` run's traces (``DIR/rank-R.jsonl``): each rank's step compute times (its first
    ``warmup`` steps left out), and per link the transfers' durations: a receive's arrival less the later of
    the send's and the receive's posting (wall-clock times, so the ranks' clocks must agree: one host, or
    synchronised hosts). With one payload size a link's latency cannot be told from its bandwidth: latency is
    0 and the bandwidth is the bytes over the median duration (what a transfer costs, per-message costs
    included). A message waits for the one before it on its link (:func:`queued`), and durations are counted as
    alone (:func:`alone_times`); a link with ``LONE_ENOUGH`` transfers that
    had both ends to themselves is fitted on those alone, since the shares the others had are a model (TCP is
    only roughly fair, and a deep queue serves first come); another link is fitted on the transfers through its
    two ends (the geometric mean of each end's bytes over its median alone-time, among the end's links whose own
    fits are within ``POOL_LIKE`` of its own), where the uneven splits cancel. With two or more sizes
    (compressed payloads) both are fitted by least squares. Without
    point-to-point transfers (all-reduce policies), every link gets the bandwidth of the fastest rank's view of
    the all-reduces: ``2 (W-1)/W bytes`` over the median of each all-reduce's shortest time."""
    d = Path(directory)
    where = "--from-trace"
    files, recs = read_traces(d, where)
    recs, jobs = last_jobs(files, recs, where)  # (event numbers start again with each job)
    W = len(recs)
    every = []
    for r, rows in enumerate(recs):
        t = [float(x["compute_s"]) for x in rows if "compute_s" in x and "kind" not in x]
        if not t:
            raise ConfigError(where, f"{files[r]}: no step records (compute_s)")
        every.append(t)
    r = min(range(len(every)), key=lambda q: len(every[q]))  # the shortest rank's, said once for every rank
    n = len(every[r])
    if n < warmup + MIN_TIMED:  # (all were kept where fewer than --warmup: a 1-step trace fitted jitter 0, under a
        # header saying the first --warmup were left out)
        raise ConfigError("--warmup" if n >= MIN_TIMED else where,
                          f"{files[r]}: {n} step record{'s' * (n != 1)}, --warmup {warmup} left out; allowed: at least "
                          f"{MIN_TIMED} timed steps a rank (a longer trace"
                          + (f", or --warmup at most {n - MIN_TIMED})" if n >= MIN_TIMED else ")"))
    steps = [t[warmup:] for t in every]
    notes_in_step = _in_step(recs)
    # point-to-point transfers: (sender, receiver, event, initiator) -> send time; receives give arrival
    sends = {}
    for r, rows in enumerate(recs):
        for x in rows:
            if x.get("kind") == "send" and "t" in x:
                sends[(r, int(x["peer"]), int(x["event"]), int(x.get("initiator", -1)))] = float(x["t"])
    per_link: dict[tuple[int, int], list[tuple[int, float]]] = {}
    transfers: list[tuple[int, int, int, float, float]] = []  # sender, receiver, bytes, start, arrival
    for r, rows in enumerate(recs):
        for x in rows:
            if x.get("kind") != "recv" or "arrived" not in x:
                continue
            key = (int(x["peer"]), r, int(x["event"]), int(x.get("initiator", -1)))
            if key not in sends:
                continue
            start = max(sends[key], float(x.get("posted", sends[key])))
            transfers.append((key[0], key[1], int(x["bytes"]), start, max(start, float(x["arrived"]))))
    transfers = queued(transfers)
    # a transfer with no time of its own left (its bytes came before its receive was posted, or while the one
    # before it on its link was still arriving) says nothing of the link: counted as alone, it fitted every link
    # "unlimited" (0 s for its bytes) where a policy sent faster than the links carry
    timeless = sum(1 for *_, t0, t1 in transfers if not t1 - t0 > MIN_TRANSFER)
    transfers = [x for x in transfers if x[4] - x[3] > MIN_TRANSFER]
    alone = alone_times(transfers)
    lone_link: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for (i, j, b, t0, t1), tau in zip(transfers, alone):
        per_link.setdefault((i, j), []).append((b, tau))
        if tau >= (t1 - t0) * (1 - 1e-9):
            lone_link.setdefault((i, j), []).append((b, tau))
    every = dict(per_link)
    n_lone_links = 0
    for k, xs in lone_link.items():
        if len(xs) >= LONE_ENOUGH and len({b for b, _ in xs}) == len({b for b, _ in per_link[k]}):
            per_link[k] = xs  # a link seen alone often enough is measured by those transfers alone
            n_lone_links += 1
    lat = [[None] * W for _ in range(W)]
    bw = [[None] * W for _ in range(W)]
    samples = [[0] * W for _ in range(W)]
    payload = 0
    for (i, j), xs in per_link.items():
        sizes = sorted({b for b, _ in xs})
        payload = max(payload, sizes[-1])
        samples[i][j] = len(xs)
        if len(sizes) >= 2 and sizes[-1] >= 2 * sizes[0]:
            import numpy as np

            a = np.array([[1.0, b] for b, _ in xs])
            y = np.array([s for _, s in xs])
            (l0, inv), *_ = np.linalg.lstsq(a, y, rcond=None)
            lat[i][j] = max(0.0, float(l0))
            bw[i][j] = 1.0 / inv if inv > 0 else math.inf
        else:
            med = _median([s for _, s in xs])
            lat[i][j] = 0.0
            bw[i][j] = sizes[-1] / med if med > 0 else math.inf
    # a link never seen alone often enough: how the time it shared splits between the flows at an end is the least
    # certain part (TCP is only roughly fair, and a deep queue serves its bytes first come), but the flows at an end
    # together are much less so: fitted per end, the bytes over the median alone-time of the transfers through it,
    # among its links that look alike (own fits within POOL_LIKE of each other: a slower site's links are not
    # pooled with a faster one's), and the link gets the geometric mean of its two ends
    own = {k: bw[k[0]][k[1]] for k in per_link}
    n_pooled = 0
    for (i, j), xs in per_link.items():
        if per_link[(i, j)] is lone_link.get((i, j)) or len({b for b, _ in xs}) > 1 or not 0 < own[(i, j)] < math.inf:
            continue  # fitted on its lone transfers, or on two sizes (latency and bandwidth), or not at all
        ends = []
        for at in (0, 1):
            ks = [k for k in every if k[at] == (i, j)[at] and 0 < own[k] < math.inf
                  and max(own[k], own[(i, j)]) <= POOL_LIKE * min(own[k], own[(i, j)])]
            t = _median([x for k in ks for _, x in every[k]]) if ks else 0.0
            if t > 0:
                ends.append(xs[0][0] / t)
        if len(ends) == 2:
            bw[i][j] = math.sqrt(ends[0] * ends[1])
            n_pooled += 1
    n_alone = sum(1 for (_, _, _, t0, t1), tau in zip(transfers, alone) if tau >= (t1 - t0) * (1 - 1e-9))
    notes = [] if not transfers and not timeless else [  # (none at all: an all-reduce job's, said below)
        f"transfers: a receive's arrival less the later of its send, its posting and the arrival of the one "
             f"before it on its link (wall clock), per link, counted as alone (the transfers in flight together share their ends as the clock shares them); {n_alone} of "
             f"{len(transfers)} had both ends to themselves; {n_lone_links} of {len(per_link)} links had "
             f"{LONE_ENOUGH} or more such and are fitted on those alone, {n_pooled} on the transfers at their two "
             f"ends (the geometric mean of each end's bytes over its median alone-time, among its links within "
             f"{POOL_LIKE:g}x of each other)"
             + (f"; {timeless} left out, with no time of their own (their bytes came before their receive was "
                f"posted, or while the one before them on their link arrived)" if timeless else "")]
    if timeless and not transfers:  # nothing left to fit the links on: said where the terminal shows it
        notes.append(f"{WARNING}all {timeless} point-to-point transfers had no time of their own: the links are not "
                     "measured from this trace; measure them with evomerge calibrate (--procs, or under your launcher)")
    allreduce = None
    events: dict[int, list[tuple[float, int]]] = {}
    streamed = 0
    for r, rows in enumerate(recs):
        for x in rows:
            if x.get("kind") == "allreduce" and "seconds" in x:
                if isinstance(x.get("landed_step"), int) and x["landed_step"] > x.get("step", x["landed_step"]):
                    streamed += 1  # a streamed fragment's time runs to its landing, steps later: no link's time
                    continue
                # the collective's own time (wire_s: its waits on the others and the wire; the rank's work around
                # it is merge_time's), or, in a trace from before wire_s, the whole merge's
                events.setdefault(int(x["event"]), []).append((float(x.get("wire_s", x["seconds"])), int(x["bytes"])))
    if streamed:
        notes.append(f"{streamed} streamed fragments' all-reduces left out (their time runs from the send to the "
                     "landing, fragment_delay steps later, the loop's compute in it)")
    # a compressed change on the all-reduce scheme is all-gathered (each rank's encoded change, `bytes` in its record,
    # goes to every other): the ring all-reduce that moves as much is of W x bytes / 2 (fitted as one of its own
    # bytes, a 4-rank job's links came out 0.36x their rate)
    policy, _ = job_policy(recs[0][0] if recs and recs[0] else {})
    gathered = bool(policy) and policy.get("scheme") == "allreduce" and _public(policy.get("payload"))
    if events:
        shortest = [min(v) for v in events.values() if len(v) == W]  # the last rank to arrive waited least
        if shortest:  # the largest messages' (fragments of other sizes, a counter's: the bandwidth is in the largest)
            nbytes = max(b for _, b in shortest)
            shortest = [(s, b) for s, b in shortest if b == nbytes]
            seconds = _median([s for s, _ in shortest])
            if gathered and W > 1:
                notes.append(f"all-gathers of each rank's encoded change (payload delta on the all-reduce scheme): "
                             f"{len(shortest)}, median of each one's shortest time {_ms(seconds)} for {nbytes} bytes "
                             f"a rank, as a ring all-reduce of {W} x {nbytes} / 2 bytes (what it moves)")
                nbytes = int(round(W * nbytes / 2))
            else:
                notes.append(f"all-reduces: {len(shortest)}, median of each one's shortest time {_ms(seconds)} for "
                             f"{nbytes} bytes")
            allreduce = (seconds, nbytes)
            if not per_link and W > 1 and seconds > 0:
                b = 2 * (W - 1) / W * nbytes / seconds
                for i in range(W):
                    for j in range(W):
                        if i != j:
                            lat[i][j], bw[i][j] = 0.0, b
                payload = nbytes
                notes.append("no point-to-point transfers: every link gets latency 0 and the bandwidth that gives "
                             "the all-reduce's time (2 (W-1)/W bytes / bandwidth)")
    if W > 1 and not per_link and allreduce is None and not timeless:  # free links: said where it is written
        why = ("its merges are streamed fragments, whose all-reduces ran behind the loop's compute" if streamed
               else "no all-reduce was recorded by every rank" if events
               else "none of its merges went over the network")
        notes.append(f"{NOTE}links: the traces measure none ({why}): the file's links are free (no latency, "
                     "unlimited bandwidth); measure them with `evomerge calibrate --study S` under your launcher and "
                     "write its link keys (latency and bandwidth, or their matrices) beside `from` in the study's "
                     "[environment] (docs/calibrate.md)")
    notes += notes_in_step
    merge_time, base, merge_notes = merge_work(recs, warmup)
    notes += merge_notes
    if base:  # the Merger's own time at every step is part of each step the job took
        steps = [[x + b for x in t] for t, b in zip(steps, base)]
    sizes = {int(x["model_bytes"]) for rows in recs for x in rows if isinstance(x.get("model_bytes"), int)}
    if len(sizes) == 1:  # (as calibrate --study says it, batch and optimiser aside: a trace does not hold them)
        notes.append(f"model: {sizes.pop()} bytes of float32 parameters and buffers")
    n_steps = sum(len(t) for t in steps)
    return Measured(steps, lat, bw, payload=payload, samples=samples if per_link else None, allreduce=allreduce,
                    links_from_allreduce=not per_link and allreduce is not None and W > 1, merge_time=merge_time,
                    source=f"evomerge calibrate --from-trace {d}: {W} rank{'s' * (W != 1)}, {n_steps} steps ("
                           + (f"{', '.join(str(len(t)) for t in steps)} a rank; " if W > 1 else "")
                           + f"the first {warmup} of each rank left out)" + (f", the last of the {jobs} jobs the traces hold (a Merger appends)"
                                                    if jobs > 1 else ""), notes=notes)


def _step_records(rows: list[dict]) -> list[dict]:
    """A rank's step records that say when the loop's compute ended (``t``)."""
    return [x for x in rows if "compute_s" in x and "kind" not in x and isinstance(x.get("t"), (int, float))]


def _gaps(st: list[dict]) -> list[tuple[dict, float]]:
    """Each step record with the rank's seconds inside ``merger.step()`` after it: from the record's ``t`` to the next
    step's start (the next record's ``t`` less its ``compute_s``)."""
    return [(a, max(0.0, (float(b["t"]) - float(b["compute_s"])) - float(a["t"]))) for a, b in zip(st, st[1:])]


def in_step(recs: list[list[dict]]) -> list[tuple[float, int, float | None]]:
    """Per rank: its seconds inside ``merger.step()`` (from a step's call, its record's ``t``, to the next step's
    start, that record's ``t`` less its ``compute_s``), over how many steps, and as a share of its time from its first
    step to its last (None where that is 0)."""
    out = []
    for rows in recs:
        st = _step_records(rows)
        gaps = [gap for _, gap in _gaps(st)]
        whole = float(st[-1]["t"]) - float(st[0]["t"]) if st else 0.0
        out.append((sum(gaps), len(gaps), sum(gaps) / whole if whole > 0 else None))
    return out


MERGE_KINDS = ("send", "recv", "allreduce")  # a trace's records of a merge (their step, or landed_step: where it was worked)


def _mean_of(xs: list[float]) -> float:
    """The mean, one or two values over :data:`PAUSE` x the median left out (pauses, as a rank's steps leave them
    out): a job's time is the sum of its steps, so the mean is what the clock must charge (the median of a gossip
    job's own time at a merge, 0.8 ms where the mean was 2.05 ms, left its clock 28% short)."""
    med = _median(xs)
    long_ = [x for x in xs if x > PAUSE * med]
    if 0 < len(long_) < MIN_SPELLS:
        xs = [x for x in xs if x <= PAUSE * med]
    return sum(xs) / len(xs)


def _public(payload) -> bool:
    """Whether a payload sends each rank's change against its public copy (the Merger all-gathers those on the
    all-reduce scheme): ``delta``, and any payload registered so."""
    from . import registry

    try:
        return bool(registry.PAYLOADS.get_object(payload).public)
    except Exception:  # (a trace of a payload this evomerge does not know)
        return False


def merge_work(recs: list[list[dict]], warmup: int = DEFAULTS["warmup"]
               ) -> tuple[float | None, list[float] | None, list[str]]:
    """A rank's own time inside ``merger.step()`` at a step (from a step's call to the next step's start,
    :func:`in_step`, less the seconds it waited there on peers and the network, the next record's ``wait_s``): its
    mean at the steps without a merge, per rank (part of every step the job took: added to the rank's steps), and
    ``merge_time``, the mean at its steps with a merge (a record of a send, a receive applied, an all-reduce) less
    that, the median over the ranks (their own work is alike; the waits, which differ, are out). Means (:func:`_mean_of`),
    since a job's time is their sum. None (with a note) where the trace has no ``wait_s`` (a Merger from before
    2026-12-07); ``merge_time`` None where too few steps had a merge."""
    per_rank, merged, plain, base, old = [], [], [], [], False
    for rows in recs:
        st = _step_records(rows)
        if not st or any("wait_s" not in x for x in st):
            old = bool(st)
            break
        at = set()
        for x in rows:
            if x.get("kind") in MERGE_KINDS:
                for key in ("step", "landed_step"):
                    if isinstance(x.get(key), int):
                        at.add(x[key])
        own = {int(a["step"]): max(0.0, gap - float(b["wait_s"]))  # (b: the next record, whose wait_s is a's step's)
               for (a, gap), b in zip(_gaps(st), st[1:]) if isinstance(a.get("step"), int) and a["step"] > warmup}
        m = [v for k, v in own.items() if k in at]
        p = [v for k, v in own.items() if k not in at]
        base.append(_mean_of(p) if len(p) >= MIN_TIMED else 0.0)
        if len(m) >= MIN_TIMED:
            per_rank.append(max(0.0, _mean_of(m) - base[-1]))
            merged.append((len(base) - 1, _mean_of(m)))
            plain.append(base[-1] if len(p) >= MIN_TIMED else None)
    if old:
        return None, None, ["merge_time not fitted: the trace has no wait_s (a Merger from before 2026-12-07: its "
                            "steps' waits on peers cannot be told from its own work); a new job's trace fits it"]
    if len(base) != len(recs):
        return None, None, []
    notes = []
    if any(base):
        notes.append("steps (step_time, speeds and jitter are fitted on them): each rank's compute_s plus its own time "
                     "inside merger.step() at a step without a merge "
                     f"(means: {', '.join(f'rank {r}: {_ms(b)}' for r, b in enumerate(base))}), as the job's steps "
                     "took them")
    if not per_rank:  # (a 60-step job averaging every 21 steps wrote no merge_time, and nothing said why)
        most = max((len([1 for x in rows if x.get("kind") in MERGE_KINDS]) for rows in recs), default=0)
        if most:
            notes.append(f"merge_time not fitted: no rank merged at {MIN_TIMED} or more timed steps (after --warmup "
                         f"{warmup}); a longer job's trace, or one that merges more often, fits it")
        return None, base, notes
    ranks = "; ".join(f"rank {r}: {_ms(m)} at a merge, " + (f"{_ms(p)} without" if p is not None else
                                                               "no step without") for (r, m), p in zip(merged, plain))
    value = _median(per_rank)
    return value, base, notes + [
        f"merge_time: a rank's own time inside merger.step() at a step with a merge (its time there less its waits "
        f"on peers and the network), less that at a step without, the median over the ranks (means per rank: "
        f"{ranks}); the clock adds it to a worker's step after each boundary where it merged"
        + ("" if value else "; 0 here, so the file has none")]


def job_figures(directory: str | os.PathLike, where: str = "--against",
                warmup: int = DEFAULTS["warmup"]) -> tuple[list[float], list[float]]:
    """From one read of the last job in a folder of traces: each rank's share of its time inside ``merger.step()``
    (:func:`in_step`), and each rank's mean compute a step (the loop's own work between two ``merger.step()``
    calls, its first ``warmup`` steps left out, as the calibration leaves them out)."""
    import numpy as np

    files, recs = read_traces(Path(directory), where)
    recs, _ = last_jobs(files, recs, where)
    shares = [share for _, n, share in in_step(recs) if n and share is not None]
    means = []
    for rows in recs:
        times = [float(x["compute_s"]) for x in rows if "compute_s" in x and "kind" not in x]
        if times:
            means.append(float(np.mean(times[warmup:] or times)))
    return shares, means


def _in_step(recs: list[list[dict]]) -> list[str]:
    """Each rank's wall time inside ``merger.step()`` (from a step's call, its record's ``t``, to the next step's
    start, that record's ``t`` less its ``compute_s``): the merges applied and sent, and the waits for peers. The
    clock charges the waits it models (barriers, blocking merges, a push's model back) itself, and the Merger's own
    work as :func:`merge_work` fits it (``merge_time`` at a merge, its time at other steps in every step)."""
    out = [f"rank {r}: {_ms(inside)} over {n} steps" + (f" ({share:.1%} of its time)" if share is not None else "")
           for r, (inside, n, share) in enumerate(in_step(recs)) if n]
    if not out:
        return []
    return [f"time inside merger.step() (merges applied and sent, waits for peers): {'; '.join(out)}; the clock "
            "charges the waits it models (barriers, blocking merges) and, for the Merger's own work at a merge, "
            "merge_time (below)"]


def queued(transfers: list[tuple[int, int, int, float, float]]) -> list[tuple[int, int, int, float, float]]:
    """Transfers ``(sender, receiver, bytes, start, arrival)`` with each one's start moved to the arrival of the
    one before it on the same link if that was still in flight: messages from one rank to another go one after the
    other (one connection per pair in gloo), so the second's wait is not a share of the link."""
    out = list(transfers)
    last: dict[tuple[int, int], float] = {}
    for k in sorted(range(len(out)), key=lambda k: (out[k][3], out[k][4])):
        i, j, b, t0, t1 = out[k]
        t0 = min(max(t0, last.get((i, j), t0)), t1)
        out[k] = (i, j, b, t0, t1)
        last[(i, j)] = max(last.get((i, j), t1), t1)
    return out


def alone_times(transfers: list[tuple[int, int, int, float, float]]) -> list[float]:
    """For each transfer ``(sender, receiver, bytes, start, arrival)``: how long it would have taken with its
    ends to itself. Transfers in flight together share their senders' uplinks and their receivers' downlinks as
    the simulated clock shares them (:func:`evomerge.engine.clock.fair_shares`: an
    equal share of the most crowded end, every end taken as equally fast), so a transfer's time alone is the integral of its share over
    its flight: its own duration when it had its ends to itself. Fitting on
    raw durations would count the sharing twice, since the simulated clock adds it by itself (measured under
    netlab: ring gossip's median transfer took 1.7x a lone one, and the all-reduce predicted from it was 56%
    too slow)."""
    from .engine import clock

    cuts = sorted({x for _, _, _, t0, t1 in transfers for x in (t0, t1)})
    order = sorted(range(len(transfers)), key=lambda k: transfers[k][3])
    out = [0.0] * len(transfers)
    active: set[int] = set()
    n = 0
    for a, b in zip(cuts, cuts[1:]):
        while n < len(order) and transfers[order[n]][3] <= a:
            active.add(order[n])
            n += 1
        active = {k for k in active if transfers[k][4] > a}
        if not active:
            continue
        ks = sorted(active)
        for k, r in zip(ks, clock.fair_shares([(transfers[k][0], transfers[k][1]) for k in ks])):
            out[k] += (b - a) * r
    return out


# -- measuring (one process per rank) -------------------------------------------------------------------------
def pair_rounds(W: int, all_up_to: int, seed: int) -> list[list[tuple[int, int]]]:
    """The pairs to measure, in rounds of disjoint pairs: every pair up to ``all_up_to`` ranks (a round-robin
    tournament: W - 1 rounds, or W for an odd W), else the ring (r, r + 1) and W pairs drawn from ``seed``."""
    import numpy as np

    if W < 2:
        return []
    if W <= all_up_to:
        n = W + (W % 2)
        ranks = list(range(n))
        rounds = []
        for _ in range(n - 1):
            rnd = [(min(ranks[k], ranks[n - 1 - k]), max(ranks[k], ranks[n - 1 - k])) for k in range(n // 2)]
            rounds.append(sorted(p for p in rnd if p[1] < W))
            ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
        return rounds
    pairs = [(min(r, (r + 1) % W), max(r, (r + 1) % W)) for r in range(W)]
    rng = np.random.default_rng(seed)
    have = set(pairs)
    while len(have) < 2 * W:
        a, b = (int(x) for x in rng.choice(W, 2, replace=False))
        p = (min(a, b), max(a, b))
        if p not in have:
            have.add(p)
            pairs.append(p)
    rounds: list[list[tuple[int, int]]] = []
    left = pairs
    while left:
        used, rnd, rest = set(), [], []
        for p in left:
            if p[0] in used or p[1] in used:
                rest.append(p)
            else:
                used.update(p)
                rnd.append(p)
        rounds.append(rnd)
        left = rest
    return rounds


def _timed_steps(setup, rank: int, args, dev) -> list[float]:
    """This rank's step times (seconds), every rank training at once."""
    import numpy as np
    import torch

    from . import models as models_mod
    from .engine.setup import batch_indices, normalise
    from .engine.state import initial_row
    from .reference import _module_input, optimizer

    st = setup.study
    module = models_mod.load_row(setup.model.module(), initial_row(setup.model, args.seed)).to(dev)
    module.train()
    opt = optimizer(module, st.run)
    n = args.warmup + args.steps
    shard = setup.shards[rank % len(setup.shards)]
    idx = batch_indices(shard, st.run.batch_size, 0, n, args.seed, rank)
    x_all, y_all = setup.data.train_x, setup.data.train_y
    cuda = dev.type == "cuda"
    marks: list[Any] = []

    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            marks.append(e)
        else:
            marks.append(time.perf_counter())

    slow = args.slow_factor if rank == args.slow_rank and args.slow_factor > 1 else 1.0
    for k in range(n):
        mark()
        t0 = time.perf_counter()
        bi = torch.as_tensor(idx[k])
        x = _module_input(setup, normalise(x_all[bi], setup.data.spec)).to(dev, non_blocking=True)
        y = y_all[bi].to(dev, non_blocking=True)
        loss = setup.model.task.module_loss(module(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if slow > 1 or args.step_sleep:  # an emulated device: S longer, the slow one F x (compute + S)
            if cuda:
                torch.cuda.synchronize(dev)
            time.sleep(args.step_sleep + (slow - 1) * (time.perf_counter() - t0 + args.step_sleep))
    mark()
    if cuda:
        torch.cuda.synchronize(dev)
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks[:-1], marks[1:])]
    else:
        times = list(np.diff(marks))
    return [float(t) for t in times[args.warmup:]]


def _links(rank: int, W: int, nbytes: int, args, dev, progress: Progress) -> tuple[dict, dict]:
    """Ping-pong with each peer of this rank's rounds; returns {(i, j): seconds} of the latency and
    {(i, j): bytes/s} of the bandwidth for the links this rank measured (it measures both directions of its
    pairs where it is the lower rank)."""
    import torch
    import torch.distributed as dist

    small = torch.zeros(1, device=dev)
    big = torch.zeros(max(1, nbytes // 4), device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    lat, bw = {}, {}
    n_small = 4 * args.repeats
    for k, rnd in enumerate(pair_rounds(W, args.all_pairs_up_to, args.seed)):
        progress.at(f"the links' round {k + 1}")
        dist.barrier()
        mine = [p for p in rnd if rank in p]
        if not mine:
            continue
        a, b = mine[0]
        me_first = rank == a
        peer = b if me_first else a

        def exchange(out: torch.Tensor, back: torch.Tensor) -> float:
            """lower rank: send ``out``, receive ``back``; the other: the mirror. The lower rank's round trip."""
            t0 = time.perf_counter()
            if me_first:
                dist.send(out, peer)
                dist.recv(back, peer)
            else:
                dist.recv(out, peer)
                dist.send(back, peer)
            sync()
            return time.perf_counter() - t0

        for _ in range(2):  # warm-up: connections, buffers
            exchange(small, small)
            exchange(big, small)
            exchange(small, big)
        rtt = [exchange(small, small) for _ in range(n_small)]
        ab = [exchange(big, small) for _ in range(args.repeats)]  # big a -> b, small back
        ba = [exchange(small, big) for _ in range(args.repeats)]  # small a -> b, big back
        if me_first:
            one_way = _median(rtt) / 2
            for (i, j), trips in (((a, b), ab), ((b, a), ba)):
                big_way = _median(trips) - one_way  # the model-sized message's one-way time
                lat[(i, j)] = one_way
                bw[(i, j)] = big.numel() * 4 / (big_way - one_way) if big_way > one_way else math.inf
    return lat, bw


def _allreduce(nbytes: int, args, dev, progress: Progress) -> float:
    import torch
    import torch.distributed as dist

    t = torch.zeros(max(1, nbytes // 4), device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    times = []
    for k in range(args.repeats + 1):
        progress.at(f"all-reduce {k + 1}")
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        sync()
        if k:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return _median(times)


class Progress:
    """Where this rank is: before each collective it writes the collective's number and name to a file of its own in
    the launcher's folder (``$EVOMERGE_CALIBRATE_PROGRESS``; nothing without it). Every rank enters the same
    collectives in the same order, so when the time is up the ranks that have not reached the furthest one are those
    the others wait for (:func:`behind`)."""

    def __init__(self, rank: int):
        folder = os.environ.get(PROGRESS)
        self.file = Path(folder) / f"at-{rank}" if folder else None
        self.n = 0
        self.what = "its start"

    def at(self, what: str) -> None:
        self.n += 1
        self.what = what
        if self.file is not None:
            tmp = self.file.with_suffix(".new")
            tmp.write_text(f"{self.n} {what}")
            os.replace(tmp, self.file)


def behind(folder: str | os.PathLike, ranks: list[int]) -> tuple[list[int], str] | None:
    """Of ``ranks`` (those still running when the time is up), the ones that have not reached the collective the
    furthest of them waits at, and its name; None if they all are at the same one (or none said)."""
    at = {}
    for r in ranks:
        try:
            n, what = (Path(folder) / f"at-{r}").read_text().split(" ", 1)
            at[r] = (int(n), what)
        except (OSError, ValueError):
            at[r] = (0, "its start")
    furthest = max(at.values())
    late = [r for r in ranks if at[r][0] < furthest[0]]
    return (late, furthest[1]) if late else None


def hung_line(codes: list[int | None], folder: str | os.PathLike, timeout: float) -> str:
    """The line when the time is up (or the ranks still running are all the others gave up waiting on, their own
    ``--timeout`` a moment before the launcher's): the ranks that have not reached the collective the others waited
    at (those still running and those that left on their own timeout, exit ``PEER_GONE``), else those unfinished."""
    hung = [r for r, c in enumerate(codes) if c is None]
    late = behind(folder, [r for r, c in enumerate(codes) if c in (None, PEER_GONE)])
    if late:  # the others wait for these at a collective they have not reached
        waiting = [r for r, c in enumerate(codes) if c in (None, PEER_GONE) and r not in late[0]]
        return (f"calibration rank{'s' if len(late[0]) > 1 else ''} {', '.join(map(str, late[0]))} did not reach "
                f"{late[1]} within --timeout {timeout:g} s (rank{'s' if len(waiting) > 1 else ''} "
                f"{', '.join(map(str, waiting))} waited there); stopped")
    return (f"calibration rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} did not finish within "
            f"--timeout {timeout:g} s; stopped")


class PeerGone(Exception):
    """A collective or message failed: another rank is gone (its own failure is what to report)."""


class _talking:
    """Within the block, a failed message (gloo and NCCL raise RuntimeError) is :class:`PeerGone`."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, RuntimeError):
            raise PeerGone(_one_line(e)) from e
        return False


def load(args):
    """The study and its setup (model, data), as this rank trains them; ConfigError if they cannot be had."""
    from .engine.setup import prepare
    from . import study as study_mod

    st = study_mod.load(args.study, calibrating=True)
    return st, prepare(st, data_dir=args.data_dir)


def refusals(refused: str | None, timeout: float) -> dict[int, str]:
    """Every rank's refusal of the calibration (its options, its study, its data), gathered once the ranks have
    joined: so that every rank leaves at once when one refuses, under a launcher that does not end the others (netlab,
    a script, srun), where the others waited for it up to --timeout and printed a C++ stack. {rank: its line}."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    with _talking():
        dist.all_gather_object(everyone, refused)
    return {r: line for r, line in enumerate(everyone) if line is not None}


def measure(args, progress: Progress, st, setup) -> Measured | None:
    """This rank's part of the calibration (the process group is initialised; ``st`` and ``setup`` from
    :func:`load`); rank 0 returns the figures."""
    import socket

    import torch
    import torch.distributed as dist

    from .models import float32_bytes

    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    nbytes = float32_bytes(setup.model)
    progress.at("the start of the timed steps")
    with _talking():
        dist.barrier()  # every rank has its data: all start training together
    times = _timed_steps(setup, rank, args, dev)
    if str(rank) == os.environ.get(FAIL_RANK):  # for the tests: a rank that fails between the measurements
        raise RuntimeError(f"rank {rank} fails on purpose (${FAIL_RANK})")
    wire = dev if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo: ranks sharing a GPU talk via host
    with _talking():
        lat, bw = _links(rank, W, nbytes, args, wire, progress) if W > 1 else ({}, {})
        ar = _allreduce(nbytes, args, wire, progress) if W > 1 else None
    host = socket.gethostname()
    mine = {"rank": rank, "times": times, "lat": list(lat.items()), "bw": list(bw.items()), "host": host,
            "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            "threads": torch.get_num_threads()}
    everyone = [None] * W
    progress.at("the gathering of the figures")
    with _talking():
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    L = [[None] * W for _ in range(W)]
    B = [[None] * W for _ in range(W)]
    for x in everyone:
        for (i, j), v in x["lat"]:
            L[i][j] = v
        for (i, j), v in x["bw"]:
            B[i][j] = v
    hosts = sorted({x["host"] for x in everyone})
    devices = sorted({x["device"] for x in everyone})
    n_pairs = sum(len(r) for r in pair_rounds(W, args.all_pairs_up_to, args.seed))
    threads = sorted({x["threads"] for x in everyone})
    notes = [f"device: {', '.join(devices)}; {dist.get_backend()}; hosts: {', '.join(hosts)}; torch threads per "
             f"rank: {', '.join(map(str, threads))}",
             f"model: {nbytes} bytes of float32 parameters and buffers; batch {st.run.batch_size}, optimiser "
             f"{st.run.optimizer}",
             f"pairs: {n_pairs} ({'all' if W <= args.all_pairs_up_to else 'the ring and sampled ones'}), "
             f"{4 * args.repeats} small and {args.repeats} model-sized round trips each way (medians)"]
    source = (f"evomerge calibrate --study {st.name}: {W} rank{'s' * (W != 1)}, {args.steps} timed steps each after "
              f"{args.warmup} warm-up steps, {time.strftime('%Y-%m-%d %H:%M')}")
    return Measured([x["times"] for x in everyone], L, B, payload=nbytes, source=source, notes=notes,
                    allreduce=(ar, nbytes) if ar is not None else None)


class _RankParser(argparse.ArgumentParser):
    """Every rank parses the same command line: rank 0 says what is wrong with it, the others leave with the same
    status in silence (not one usage per rank)."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":  # one line, as the evomerge command's (it printed argparse's usage)
            flag = re.match(r"unrecognized arguments: (-[\w-]+)", message)
            if flag and flag[1] in ("--procs", "--from-trace"):  # (the launcher's flags: "needed with --study")
                message = (f"{flag[1]}: {self.prog} is one rank under a launcher (torchrun, netlab), which starts the "
                           f"ranks; allowed: without it here, or evomerge calibrate {flag[1]} ...")
            else:
                message += f"; see {self.prog} --help"
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    """One rank of ``python -m evomerge.calibrate`` (under torchrun or ``evomerge calibrate --procs``)."""
    p = _RankParser(prog="python -m evomerge.calibrate",
                    description="One rank of a calibration: time the study's steps and the links, "
                                "and (rank 0) write the [environment].")
    add_options(p, launcher=False)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    import torch
    import torch.distributed as dist

    try:  # the values every rank reads alike: refused by every rank at once, said by rank 0
        check_options(args, writes=False)
        check_rank(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    refused = None  # this rank's own refusal (rank 0's -o, the study, the data): told to the others once joined
    if rank == 0:
        try:
            check_writable(args.output, "--output")
        except ConfigError as e:
            refused = str(e)
    try:
        from datetime import timedelta

        from .procs import apply_threads, rank_device, ranks_on_this_machine

        dev, backend = rank_device()
        told = "LOCAL_WORLD_SIZE" in os.environ  # torchrun and --procs say how many ranks share this machine
        local = int(os.environ["LOCAL_WORLD_SIZE"]) if told else 1  # the ranks on this machine (below, where untold)
        if dev.type == "cpu" and told:
            apply_threads(local)
        if "MASTER_ADDR" not in os.environ:  # one process alone
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        progress = Progress(rank)
        deadline = None
        if progress.file is None:  # under torchrun, netlab or a script: no launcher of evomerge's keeps the time
            deadline = _stop_at(args.timeout + GRACE, rank, args.timeout, progress)
        progress.at("joining the process group")
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    except ConfigError as e:  # this rank's own setting (its threads, its device)
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except torch.distributed.DistError as e:
        if refused is not None:  # (the others may have left on it already)
            if rank == 0:
                print(f"error: {refused}", file=sys.stderr, flush=True)
            return 2
        line = _one_line(e)
        if "timed out" in line.lower() or "timeout" in line.lower():  # a rank that never joined (dead or stopped)
            print(f"error: rank {rank}: the ranks did not all join the process group within --timeout "
                  f"{args.timeout:g} s ({line})", file=sys.stderr, flush=True)
            return PEER_GONE
        # this rank's own failure (rank 0's port taken, an address that is not this machine's): not another's
        print(f"error: rank {rank}: cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
              f"{os.environ.get('MASTER_PORT')} ({line})", file=sys.stderr, flush=True)
        return 1
    try:
        if dev.type == "cpu" and not told:  # a launcher that does not say (netlab, a script of one's own): before
            with _talking():                 # the data are prepared, as the steps that time them
                local = ranks_on_this_machine()
                apply_threads(local)
        if refused is None:  # the study and its data: every rank reads them alike, and each says whether it can
            try:
                st, setup = load(args)
            except ConfigError as e:
                refused = str(e)
        progress.at("the ranks' checks of the options and the study")
        said = refusals(refused, args.timeout)
        if said:  # one line, rank 0's (a rank's own where it alone refused), and every rank leaves with status 2
            if rank == 0:
                line = said.get(0) or next(f"rank {r}: {x}" for r, x in sorted(said.items()))
                print(f"error: {line}", file=sys.stderr, flush=True)
            dist.destroy_process_group()
            return 2
        m = measure(args, progress, st, setup)
        if deadline is not None:  # measured in time: the file, the last barrier (timed by --timeout) and the end
            deadline.cancel()
        if m is not None:
            env, warned = write(m, args.output, args.fit)
            print(summary(env, len(m.step_times), args.output), flush=True)
            if progress.file is None and dev.type == "cpu":  # under a launcher of the user's (--procs says its own)
                note = turns_note(local, torch.get_num_threads())
                if note:
                    print(note, file=sys.stderr, end="", flush=True)
            for w in warned:
                print(w, file=sys.stderr, flush=True)
    except ConfigError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except (PeerGone, torch.distributed.DistError) as e:  # another rank failed: the launcher names that one
        print(f"error: rank {rank}: {_peer_failed(e, args.timeout)}", file=sys.stderr, flush=True)
        os._exit(PEER_GONE)
    except Exception as e:  # noqa: BLE001 - this rank's own failure: the traceback, then one line
        import traceback

        traceback.print_exc()
        print(f"error: rank {rank}: {type(e).__name__}: {_one_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group may be broken: leave without tearing it down
    try:
        progress.at("the end (rank 0 writing the file)")
        with _talking():
            dist.barrier()  # rank 0 has written the file: every rank leaves together
    except PeerGone as e:
        print(f"error: rank {rank}: {_peer_failed(e, args.timeout)}", file=sys.stderr, flush=True)
        os._exit(PEER_GONE)
    dist.destroy_process_group()
    return 0


def turns_note(ranks: int, threads: int, more: str = "; for the job's figures, calibrate on its hosts") -> str:
    """A ``note:`` line (with its newline) where ``ranks`` ranks of ``threads`` torch threads each outnumber this
    machine's cores: they take turns on them, so their steps are timed slower and less evenly than on hosts of
    their own (a warning of steps timed long followed, with no word why); else ''."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ranks * threads <= cores:
        return ""
    return (f"note: {ranks} rank{'s' * (ranks != 1)} of {threads} torch thread{'s' * (threads != 1)} on {cores} CPU "
            f"core{'s' * (cores != 1)}: the ranks take turns on the cores, so their steps are timed slower and less "
            f"evenly than on hosts of their own{more}\n")


def _stop_at(seconds: float, rank: int, timeout: float, progress: Progress):
    """End this rank ``seconds`` from now, in one line saying where it was, unless the returned timer is cancelled
    first (once the measurements are in): what ``--timeout`` is under a launcher that does not keep the time
    (torchrun's ranks went on past it)."""
    import threading

    def stop() -> None:
        print(f"error: rank {rank}: the calibration did not finish within --timeout {timeout:g} s (at "
              f"{progress.what}); stopped (a longer --timeout lets a slow one finish)", file=sys.stderr, flush=True)
        os._exit(1)  # the process group may be mid-collective: leave without tearing it down

    t = threading.Timer(seconds, stop)
    t.daemon = True
    t.start()
    return t


def _peer_failed(e: BaseException, timeout: float) -> str:
    """What this rank saw of another's failure: gone (its connection closed), or silent for ``timeout`` (hung, or
    slower than the timeout allows), with the backend's own line."""
    line = _one_line(e)
    if "timed out" in line.lower() or "timeout" in line.lower():
        return f"another rank did not answer within --timeout {timeout:g} s ({line})"
    return f"another rank is gone ({line})"


def _one_line(e: BaseException) -> str:
    """The error's first line, less gloo's source location (``[/__w/pytorch/.../pair.cc:553] ``)."""
    s = str(e).strip().splitlines()
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", s[0]) if s else type(e).__name__


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the launcher (evomerge calibrate --procs N) ----------------------------------------------------------------
def launch(args) -> int:
    """Start ``args.procs`` ranks of :func:`main` on this host and wait for them, at most ``args.timeout``
    seconds; a rank that fails stops the others and is named in one line (:class:`RunError`, exit 1)."""
    import tempfile

    from . import study as study_mod
    from .procs import ProcessGroup, default_threads

    st = study_mod.load(args.study, calibrating=True)  # a bad study: one line, exit 2, before any process
    check_options(args)
    if args.procs is None:
        raise ConfigError("--procs", "is needed with --study (how many ranks to start on this host); under torchrun "
                                     "use python -m evomerge.calibrate")
    if args.procs < 1:
        raise ConfigError("--procs", f"{args.procs} is out of range; allowed: [1, inf)")
    N = args.procs
    check_rank(args, N)
    if st.run.workers != N and args.fit is None:
        ranks, workers = f"{N} rank{'s' * (N != 1)}", f"{N} worker{'s' * (N != 1)}"
        print(f"note: {ranks} for a study of {st.run.workers} worker{'s' * (st.run.workers != 1)}: the file's speeds "
              f"and link matrices are per rank, for a study of {workers}; --fit writes a speed model and single links, "
              "for any number",
              file=sys.stderr)
    cmd = [sys.executable, "-m", "evomerge.calibrate", "--study", str(st.path or args.study), "-o", str(args.output),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
           "--all-pairs-up-to", str(args.all_pairs_up_to), "--seed", str(args.seed), "--timeout", str(args.timeout),
           "--step-sleep", str(args.step_sleep), "--slow-rank", str(args.slow_rank),
           "--slow-factor", str(args.slow_factor)]
    if args.data_dir:
        cmd += ["--data-dir", str(args.data_dir)]
    if args.fit:
        cmd += ["--fit", args.fit]
    port = _free_port()
    threads = str(default_threads())  # (EVOMERGE_THREADS where set: a bad one is its one line)
    per = max(1, int(threads) // N)  # each rank's share (procs.apply_threads with the ranks on this host)
    # said beside the file's figures (a warning of steps timed long followed, with no word why); an error is one line
    turns = turns_note(N, per, "; for the job's figures, calibrate on its hosts (under your launcher, docs/calibrate.md)")
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="evomerge-calibrate-") as tmp, ProcessGroup(grace=3) as group:
        procs, errs, outs = [], [], []
        for r in range(N):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(N), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(N),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), EVOMERGE_THREADS=threads, **{PROGRESS: tmp},
                       PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
            out, err = open(Path(tmp) / f"out-{r}", "w+"), open(Path(tmp) / f"err-{r}", "w+")
            outs.append(out)
            errs.append(err)
            procs.append(group.popen(cmd, env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + args.timeout
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes) and failed_at is None:
                failed_at = time.monotonic()  # let the others find out and leave, briefly
            own = [r for r, c in enumerate(codes) if c not in (None, 0, PEER_GONE)]
            gave_up = not own and None in codes and PEER_GONE in codes  # the others' own timeouts, on those running
            if failed_at is not None and not gave_up and (all(c is not None for c in codes)
                                                          or time.monotonic() - failed_at > 2):
                if not own and behind(tmp, [r for r, c in enumerate(codes) if c in (None, PEER_GONE)]):
                    raise RunError(hung_line(codes, tmp, args.timeout))  # all gave up: on the ranks behind them
                r = own[0] if own else next(r for r, c in enumerate(codes) if c not in (None, 0))
                last = _last_line(errs[r]) or f"exit status {codes[r]}"
                if codes[r] == 2 and last.startswith("error: "):
                    raise ConfigError("", last.removeprefix("error: "))
                how = f"killed by signal {-codes[r]}" if codes[r] < 0 else f"exit {codes[r]}"
                last = last.removeprefix("error: ").removeprefix(f"rank {r}: ")
                raise RunError(f"calibration rank {r} failed ({how}): {last}")
            if (time.monotonic() > deadline and not own) or (gave_up and time.monotonic() - failed_at > 2):
                # (a rank's own failure in its 2 s grace at the deadline: the failure's line, just above, next)
                raise RunError(hung_line(codes, tmp, args.timeout))
            time.sleep(0.05)
        outs[0].seek(0)
        sys.stdout.write(outs[0].read())
        errs[0].seek(0)  # rank 0 wrote the file: its warnings about it
        sys.stderr.write(turns + "".join(ln for ln in errs[0].read().splitlines(keepends=True)
                                         if ln.startswith(SAID)))
        for f in outs + errs:
            f.close()
    return 0


def _last_line(f) -> str:
    f.flush()
    f.seek(0)
    lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return (errors or lines or [""])[-1]


def from_trace_command(args) -> int:
    """``evomerge calibrate --from-trace DIR -o FILE``."""
    check_options(args)
    m = from_trace(args.from_trace, args.warmup)
    env, warned = write(m, args.output, args.fit)
    print(summary(env, len(m.step_times), args.output))
    for w in warned:
        print(w, file=sys.stderr)
    return 0


if __name__ == "__main__":
    rc = main()
    # leave without the interpreter's finalisation: gloo's threads, torn down there, abort the process now and
    # then ("terminate called without an active exception", SIGABRT, seen 2 in 6 runs of 3 ranks here) after
    # the file is written; everything is flushed and closed by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
