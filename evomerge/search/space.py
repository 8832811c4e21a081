"""The search space: one mapping from an Optuna trial, or a CMA-ES vector, to a
validated :class:`MergePolicy`.

Fields not in the space keep the study's fixed values (``[policy]``). Numeric fields
(float, log-float, int) are what CMA-ES searches, each scaled to [0, 1] (log-floats
on a log scale, ints rounded); categoricals are left to Optuna.
"""

from __future__ import annotations

import math
from typing import Any

from ..policy import WORKER_BOUND, MergePolicy, fit_to_workers, switch_off_inapplicable
from ..study import RUN_PREFIX, Param, Study, with_run  # noqa: F401  (with_run: the trial's run)


def distributions(space: tuple[Param, ...]) -> dict[str, Any]:
    """Optuna distributions of the space, by field name."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out = {}
    for p in space:
        if p.kind == "categorical":
            out[p.name] = CategoricalDistribution(list(p.choices))
        elif p.kind == "int":
            out[p.name] = IntDistribution(int(p.low), int(p.high))
        else:
            out[p.name] = FloatDistribution(p.low, p.high, log=p.kind == "log-float")
    return out


def run_values(params: dict[str, Any]) -> dict[str, Any]:
    """The run settings among a trial's params (``run.lr`` -> ``{"lr": ...}``); empty when none is searched."""
    return {k[len(RUN_PREFIX):]: v for k, v in params.items() if k.startswith(RUN_PREFIX)}


def policy_from_params(study: Study, params: dict[str, Any]) -> MergePolicy:
    """The study's fixed policy with ``params`` (field -> value) applied, validated.

    Every point of the space makes a policy that can run on the study's workers:

    - fields sampled where they do not apply are reset to "off" rather than failing the trial
      (compression while the payload is 'weights', regrouping on a topology other than 'communities');
    - ``degree`` and ``n_communities`` go to the nearest value the workers allow (the study's load
      already clamped their ranges; this settles the parity of ``degree`` with an odd number of workers).
    """
    params = {k: v for k, v in params.items() if not k.startswith(RUN_PREFIX)}  # run settings: with_run
    values = switch_off_inapplicable(params, study.policy)
    bound = {k: getattr(study.policy, k) for k in WORKER_BOUND}  # fixed ones too: a study may be built in code
    values = fit_to_workers(bound | values, study.run.workers)
    return study.policy.replace(**values)


def suggest(trial, study: Study) -> MergePolicy:
    """Ask ``trial`` for every field of the study's space (works for Trial and FixedTrial)."""
    params = {}
    for p in study.search.space:
        if p.kind == "categorical":
            params[p.name] = trial.suggest_categorical(p.name, list(p.choices))
        elif p.kind == "int":
            params[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high))
        else:
            params[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.kind == "log-float")
    return policy_from_params(study, params)


# -- CMA-ES: numeric fields as a vector in [0, 1]^d ---------------------------------
def numeric(space: tuple[Param, ...]) -> list[Param]:
    return [p for p in space if p.kind != "categorical"]


def decode(space: tuple[Param, ...], x) -> dict[str, Any]:
    """Vector in [0, 1]^d (clipped) -> field values for the numeric fields."""
    out = {}
    for p, v in zip(numeric(space), x):
        v = min(max(float(v), 0.0), 1.0)
        if p.kind == "log-float":
            out[p.name] = math.exp(math.log(p.low) + v * (math.log(p.high) - math.log(p.low)))
        elif p.kind == "int":
            out[p.name] = min(int(p.high), max(int(p.low), int(math.floor(p.low - 0.5 + v * (p.high - p.low + 1) + 0.5))))
        else:
            out[p.name] = p.low + v * (p.high - p.low)
        if p.kind != "int":
            out[p.name] = min(max(out[p.name], p.low), p.high)
    return out


def encode(space: tuple[Param, ...], values: dict[str, Any]) -> list[float]:
    """Field values -> vector in [0, 1]^d (the inverse of :func:`decode` for floats)."""
    out = []
    for p in numeric(space):
        v = values[p.name]
        if p.kind == "log-float":
            out.append((math.log(v) - math.log(p.low)) / (math.log(p.high) - math.log(p.low)))
        elif p.kind == "int":
            out.append((v - p.low + 0.5) / (p.high - p.low + 1))
        else:
            out.append((v - p.low) / (p.high - p.low))
    return out
