"""Where a merge run executes: backends by name.

A backend holds the workers' rows and moves tensors between them; what a run means
is the engine's (:mod:`evomerge.engine`). The interface is :class:`base.Backend`;
``inprocess`` (:mod:`.inprocess`) and ``distributed`` (:mod:`.distributed`) are
registered in :data:`BACKENDS`, which code outside the package can extend with
:func:`register`.

Cheap to import (the CLI checks flags with it before torch is loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .. import policy as policy_mod
from ..errors import ConfigError
from ..policy import MergePolicy

# name -> "module:function" of the run function, imported when used (torch is heavy)
BACKENDS: dict[str, str] = {
    "inprocess": "evomerge.simulate:simulate",
    "distributed": "evomerge.backends.distributed:simulate",
}


def register(name: str, target: str) -> None:
    """Add a backend: ``target`` is ``"module:function"``, a function called as
    ``fn(setup, policy, seed, callback=..., device=..., evaluate_test=..., keep_params=...)``
    that returns a ``RunResult`` (build it on :class:`base.Backend` and :func:`engine.run.execute`)."""
    BACKENDS[name] = target


def check(backend: str, procs: int | None, workers: int) -> None:
    """One-line errors for a bad ``--backend`` / ``--procs`` pair."""
    if backend not in BACKENDS:
        raise ConfigError("--backend", f"unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    if procs is not None:
        if backend != "distributed":
            raise ConfigError("--procs", "applies to --backend distributed only")
        if procs < 1 or workers % procs:
            raise ConfigError("--procs", f"{procs} processes cannot split {workers} workers evenly; "
                                         f"allowed: a divisor of {workers}")


# policy fields the distributed backend refuses unless off: each needs every worker's state at every event
DISTRIBUTED_REFUSES = {
    "similarity_bias": "peers are chosen by similarity, which needs all workers' models at every event",
    "regroup_every": "communities are regrouped from all workers' models",
    "data_exchange_k": "training examples travel between workers",
    "retire_threshold": "examples are retired by confidence (with data exchange)",
    "swap_p": "models are swapped between workers",
}


# the registered rules the distributed backend implements (its rank code names them)
DISTRIBUTED_KNOWS = {"weighting": ("uniform", "examples", "adaptive"), "payload": ("weights", "delta")}


def check_policy(backend: str, policy) -> None:
    """Refuse, naming the field, a policy the backend cannot run."""
    if backend != "distributed":
        return
    for field, known in DISTRIBUTED_KNOWS.items():  # rules registered later run in-process until taught here
        value = getattr(policy, field)
        if value not in known:
            raise ConfigError(f"policy.{field}", f"{value!r} is not supported by the distributed backend; "
                                                 f"allowed: {', '.join(known)}, or --backend inprocess")
    for field, why in DISTRIBUTED_REFUSES.items():
        value = getattr(policy, field)
        if value:
            raise ConfigError(f"policy.{field}", f"{value} is not supported by the distributed backend ({why}); "
                                                 "allowed: 0, or --backend inprocess")
    for field, (only, why) in DISTRIBUTED_ONLY.items():
        value = getattr(policy, field)
        if value != only:
            raise ConfigError(f"policy.{field}", f"{value!r} is not supported by the distributed backend ({why}); "
                                                 f"allowed: {only!r}, or --backend inprocess")


# policy fields the distributed backend runs with one value only
DISTRIBUTED_ONLY = {"optimizer_state": ("keep", "the optimiser's state is not sent between ranks")}


def check_model(backend: str, model) -> None:
    """Refuse, naming the field, a model the backend cannot run (called once the model is built)."""
    if backend != "distributed":
        return
    buffers = [name for name, _ in model.layout[model.n_trained_blocks:]]
    if buffers:
        shown = ", ".join(buffers[:3]) + (f" and {len(buffers) - 3} more" if len(buffers) > 3 else "")
        raise ConfigError("study.model.factory", f"the model has buffers ({shown}), which the distributed backend "
                                                 "does not merge (nor sum its counters); allowed: a model without "
                                                 "buffers (e.g. no BatchNorm), or --backend inprocess")


def check_space(backend: str, names) -> None:
    """Refuse a search space that would sample fields the backend cannot run."""
    if backend != "distributed":
        return
    for name in names:
        why = DISTRIBUTED_REFUSES.get(name) or DISTRIBUTED_ONLY.get(name, (None, None))[1]
        if why:
            raise ConfigError(f"study.search.space.{name}", f"is not supported by the distributed backend "
                                                            f"({why}); remove it or use --backend inprocess")


def runner(backend: str = "inprocess", procs: int | None = None, workers: int | None = None) -> Callable:
    """The run function of a backend, called as ``fn(setup, policy, seed, callback=..., device=..., ...)``
    and returning a ``RunResult``; the distributed one runs on ``procs`` processes (default one per worker)."""
    import importlib
    from functools import partial

    if workers is not None:
        check(backend, procs, workers)
    if backend not in BACKENDS:
        raise ConfigError("--backend", f"unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    module, name = BACKENDS[backend].split(":")
    fn = getattr(importlib.import_module(module), name)
    return partial(fn, procs=procs) if backend == "distributed" else fn


def run_inputs(study, policy: MergePolicy | str | Path, seed: int | None = None, *,
               backend: str = "inprocess", procs: int | None = None) -> tuple[MergePolicy, int, dict | None]:
    """What one run of ``evomerge run`` / ``evomerge.run()`` needs, checked before any data is read:
    the policy (an object, a file or a named policy), the seed (given, else an exported file's first
    seed, else the study's first seed) and the exported file's metadata (None for a plain policy);
    the backend must be able to run the policy on the study's workers."""
    exported = None
    if not isinstance(policy, MergePolicy):
        exported = policy_mod.read_export(policy) if Path(policy).is_file() else None
        policy = study.resolve_policy(policy)
    policy_mod.check_workers(policy, study.run.workers)
    if study.environment is not None:
        policy_mod.check_timed(policy)
        if backend != "inprocess" and policy.payload != "weights":
            raise ConfigError("policy.payload", f"{policy.payload!r} is not supported by the {backend} backend with an "
                                                "[environment] yet; allowed: weights, or --backend inprocess")
    check(backend, procs, study.run.workers)
    check_policy(backend, policy)
    if seed is None:
        seed = exported["seeds"][0] if exported and exported.get("seeds") else study.run.seeds[0]
    return policy, seed, exported
