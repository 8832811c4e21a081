"""Warm start: a new search begins from another study's completed trials (``--warm-start-from``).

The source is a study name, whose default store is ``RUNS_DIR/NAME/optuna.db``, or ``STORAGE_URL#NAME``
(``STORAGE_URL`` alone when that storage holds one study). Its COMPLETE trials are what is carried over:

- CMA-ES starts from their best solutions, as WS-CMA-ES does (Nomura et al., AAAI 2021; Optuna's
  ``CmaEsSampler(source_trials=...)``): the best ``GAMMA`` of them, at least one, mapped to
  [0, 1]^d in this study's space, give the initial mean; their spread plus ``ALPHA``\\ ² the initial
  step size and per-coordinate scales (the diagonal of WS-CMA-ES' covariance; ``cma`` takes it as
  ``CMA_stds``).
- The other samplers evaluate them first: each is enqueued (best first; a multi-objective source's trials by
  Pareto layer, then its first objective) with its values for this
  study's searched fields (a field the source did not search, or a value outside this study's
  range, is left to the sampler), marked with the user attribute ``warm_start_of``
  (``"SOURCE:NUMBER"``). They are ordinary trials of this study, judged on its own runs, so the
  sampler learns from values that mean what this study's values mean.

A warm start is applied once, to a study that holds no trials yet, and recorded in the study's user
attribute ``warm_start`` (source, how many trials, and for CMA-ES its start as JSON), so that a
resumed search continues from the same start: CMA-ES replays its generations from the stored
start, and nothing is enqueued twice. Naming another source later is refused in one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dburls import shown
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..study import Study
    from .config import SearchConfig

ATTR, ATTR_OF = "warm_start", "warm_start_of"
GAMMA, ALPHA = 0.1, 0.1
FIELD = "--warm-start-from"


def parse_source(spec: str, runs_dir: Path) -> tuple[str, str | None]:
    """``(storage URL, study name or None)`` of ``NAME`` or ``URL#NAME`` or ``URL``."""
    from .storage import default_storage, normalise_url

    if "://" in spec:
        url, _, name = spec.partition("#")
        return normalise_url(url), name or None
    if not spec or "/" in spec or "#" in spec:
        raise ConfigError(FIELD, f"{shown(spec)!r} is neither a study name nor STORAGE_URL#NAME")
    return default_storage(Path(runs_dir) / spec), spec


def check_source(spec: str, study: "Study", runs_dir: Path) -> None:
    """Before any trial: the source names a study other than this one, stored where it says."""
    url, name = parse_source(spec, runs_dir)
    if "://" not in spec and name == study.name:
        raise ConfigError(FIELD, f"{spec!r} is this study; name another study")
    from ..sqlitefiles import sqlite_file
    from .results import _sqlite_studies

    db = sqlite_file(url)
    if db is None:
        return
    if not Path(db).is_file():
        raise ConfigError(FIELD, f"no study {spec!r}: {db} does not exist "
                                 "(a study name in --runs-dir, or STORAGE_URL#NAME)")
    names = _sqlite_studies(db)  # read without writing: an empty file is no study, and stays empty
    if names is not None and (not names or (name is not None and name not in names)):
        raise ConfigError(FIELD, f"no study {name or spec!r} in {db}; allowed: "
                                 f"{', '.join(sorted(names)) or 'none (no study stored)'}")


def source_trials(spec: str, runs_dir: Path) -> tuple[str, list, list[str]]:
    """The source's name, its COMPLETE trials best first (``results.rank_trials``: several objectives by Pareto
    layer, then the first objective) and its directions."""
    import optuna

    from .storage import open_storage

    url, name = parse_source(spec, runs_dir)
    storage = open_storage(url)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if name is None:
        if len(names) != 1:
            raise ConfigError(FIELD, f"{shown(url)} holds {len(names)} studies ({', '.join(names) or 'none'}); "
                                     "name one as STORAGE_URL#NAME")
        name = names[0]
    if name not in names:
        raise ConfigError(FIELD, f"no study {name!r} in {shown(url)}; allowed: {', '.join(names) or 'none (no study stored)'}")
    src = optuna.load_study(study_name=name, storage=storage)
    done = src.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not done:
        raise ConfigError(FIELD, f"study {name!r} has no completed trials to start from")
    from .results import diverged, rank_trials

    directions = [d.name.lower() for d in src.directions]
    # diverged trials last: one that blew up early sent few bytes and would look Pareto-optimal
    return name, rank_trials([t for t in done if not diverged(t)], directions) + [t for t in done if diverged(t)], \
        directions


def fitting_params(params: dict[str, Any], dists: dict[str, Any]) -> dict[str, Any]:
    """The values of ``params`` that this study searches and whose range holds them."""
    out = {}
    for k, dist in dists.items():
        if k in params:
            try:
                if dist._contains(dist.to_internal_repr(params[k])):
                    out[k] = params[k]
            except (ValueError, TypeError):
                pass
    return out


def cma_start(trials: list, space) -> dict[str, Any]:
    """WS-CMA-ES' start (diagonal) from the source trials, best first: mean, step size, per-coordinate scales."""
    import numpy as np

    from . import space as space_mod

    names = [p.name for p in space_mod.numeric(space)]
    xs = [np.clip(space_mod.encode(space, t.params), 0.0, 1.0) for t in trials if all(n in t.params for n in names)]
    if not xs:
        raise ConfigError(FIELD, f"no completed trial of the source searched every numeric field of this study's "
                                 f"space ({', '.join(names)}), which a CMA-ES start is made of; allowed: a source that "
                                 "searched them all, or --sampler tpe, random or nsga2 (they take the trials they can "
                                 "use)")
    top = np.array(xs[:max(1, math.floor(GAMMA * len(xs)))])
    mean = top.mean(axis=0)
    var = ALPHA ** 2 + ((top - mean) ** 2).mean(axis=0)
    sigma0 = float(np.exp(0.5 * np.log(var).mean()))  # det(Sigma)^(1/2d) of the diagonal Sigma
    return {"x0": [float(v) for v in mean], "sigma0": sigma0, "stds": [float(v) for v in np.sqrt(var) / sigma0],
            "solutions": len(top)}


def apply(cfg: "SearchConfig", ostudy) -> dict[str, Any] | None:
    """Apply ``cfg.warm_start_from`` to the study, once; return the study's warm start (None: it has none).
    The caller holds the search lock."""
    from . import space as space_mod

    stored = ostudy.user_attrs.get(ATTR)
    if cfg.warm_start_from is None:
        return stored
    if stored:
        if stored["spec"] != cfg.warm_start_from:
            raise ConfigError(FIELD, f"study {cfg.study.name} started from {shown(stored['spec'])!r}; it cannot start "
                                     f"again from {shown(cfg.warm_start_from)!r} (use another [study] name or --runs-dir)")
        return stored
    n_have = len(ostudy.get_trials(deepcopy=False))
    if n_have:
        raise ConfigError(FIELD, f"study {cfg.study.name} already holds {n_have} trials; a warm start begins a study "
                                 "(use another [study] name or --runs-dir)")
    name, trials, _ = source_trials(cfg.warm_start_from, cfg.runs_dir)
    info: dict[str, Any] = {"spec": cfg.warm_start_from, "source": name, "trials": len(trials),
                            "numbers": [t.number for t in trials]}
    if cfg.sampler == "cmaes":
        info.update(how="cmaes", **cma_start(trials, cfg.study.search.space))
    else:
        dists = space_mod.distributions(cfg.study.search.space)
        for t in trials:
            ostudy.enqueue_trial(fitting_params(t.params, dists), user_attrs={ATTR_OF: f"{name}:{t.number}"})
        info["how"] = "enqueued"
    ostudy.set_user_attr(ATTR, info)
    return info


def describe(info: dict[str, Any] | None) -> str:
    """How the output says where a study started."""
    if not info:
        return ""
    n, src = info["trials"], info["source"]
    if info["how"] == "cmaes":
        return (f"warm start from {n} completed trials of {src}: CMA-ES starts at the mean of the best "
                f"{info['solutions']} (sigma {info['sigma0']:.3f})")
    return f"warm start from {n} completed trials of {src}: enqueued, best first"
