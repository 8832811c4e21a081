"""Where a merge run executes: backends by name.

A backend holds the workers' rows and moves tensors between them; what a run means
is the engine's (:mod:`evomerge.engine`). The interface is :class:`base.Backend`;
``inprocess`` (:mod:`.inprocess`) and ``distributed`` (:mod:`.distributed`) are
registered in :data:`BACKENDS`, which code outside the package can extend with
:func:`register`.

Cheap to import (the CLI checks flags with it before torch is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import policy as policy_mod
from ..errors import ConfigError, unknown
from ..policy import MergePolicy

# name -> "module:function" of the run function, imported when used (torch is heavy)
BACKENDS: dict[str, str] = {
    "inprocess": "evomerge.backends.inprocess:run",
    "distributed": "evomerge.backends.launch:simulate",
}


def register(name: str, target: str, capabilities: "Capabilities | None" = None) -> None:
    """Add a backend: ``target`` is ``"module:function"``, a function called as
    ``fn(setup, policy, seed, callback=..., device=..., evaluate_test=..., keep_params=...)``
    that returns a ``RunResult`` (build it on :class:`base.Backend` and :func:`engine.run.execute`);
    ``capabilities`` says what it runs (default: everything), and the refusals follow from it."""
    BACKENDS[name] = target
    CAPABILITIES[name] = capabilities or Capabilities(name=name)


def check(backend: str, procs: int | None, workers: int) -> None:
    """One-line errors for a bad ``--backend`` / ``--procs`` pair."""
    if backend not in BACKENDS:
        raise ConfigError("--backend", unknown(backend, BACKENDS))
    if procs is not None:
        if backend != "distributed":
            raise ConfigError("--procs", "applies to --backend distributed only")
        if procs < 1:
            raise ConfigError("--procs", f"{procs} is out of range; allowed: a divisor of {workers} (the workers)")
        if workers % procs:
            raise ConfigError("--procs", f"{procs} processes cannot split {workers} workers evenly; "
                                         f"allowed: a divisor of {workers}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs, declared once; every refusal (``check_policy``, ``check_model``, ``check_space``,
    ``run_inputs``) is generated from it, in one line naming the field.

    ``rules``: per registered-rule field (``weighting``, ``payload``), the names it runs (None: every registered
    one). ``refuses``: fields that must stay off (0), and why. ``only``: fields it runs with one value, and
    why. ``buffers``: whether it merges a model's buffers. ``timed_payloads``: the payloads it runs on a
    simulated clock (None: every one it runs)."""

    rules: dict = field(default_factory=dict)
    refuses: dict = field(default_factory=dict)
    only: dict = field(default_factory=dict)
    buffers: bool = True
    timed_payloads: tuple | None = None
    outer_payloads: tuple | None = None  # the payloads it runs with an outer step (None: every one it runs)
    timed_only: dict = field(default_factory=dict)  # as ``only``, on a simulated clock
    name: str = "this"

    def check_policy(self, policy, timed: bool = False) -> None:
        inert = () if policy.scheme == "gossip" else policy_mod.GOSSIP_ONLY  # carried unused by another scheme
        for name, known in self.rules.items():  # rules registered later run elsewhere until this backend knows them
            value = getattr(policy, name)
            if value not in known:
                raise ConfigError(f"policy.{name}", f"{value!r} is not supported by the {self.name} backend; "
                                                    f"allowed: {', '.join(known)}, or --backend inprocess")
        for name, why in self.refuses.items():
            value = getattr(policy, name)
            if value and name not in inert:
                raise ConfigError(f"policy.{name}", f"{value} is not supported by the {self.name} backend ({why}); "
                                                    "allowed: 0, or --backend inprocess")
        for name, (only, why) in (self.only | (self.timed_only if timed else {})).items():
            value = getattr(policy, name)
            if value != only and name not in inert:
                raise ConfigError(f"policy.{name}", f"{value!r} is not supported by the {self.name} backend ({why}); "
                                                    f"allowed: {only!r}, or --backend inprocess")
        if policy.outer_optimizer != "none" and self.outer_payloads is not None and \
                policy.payload not in self.outer_payloads:
            raise ConfigError("policy.payload", f"{policy.payload!r} with an outer step (compressed outer gradients) "
                                                f"is not supported by the {self.name} backend yet; allowed: "
                                                f"{', '.join(self.outer_payloads)}, or --backend inprocess")
        if timed and self.timed_payloads is not None and policy.payload not in self.timed_payloads:
            raise ConfigError("policy.payload", f"{policy.payload!r} is not supported by the {self.name} backend with "
                                                f"an [environment] yet; allowed: {', '.join(self.timed_payloads)}, "
                                                "or --backend inprocess")

    def check_model(self, model) -> None:
        buffers = [name for name, _ in model.layout[model.n_trained_blocks:]]
        if buffers and not self.buffers:
            shown = ", ".join(buffers[:3]) + (f" and {len(buffers) - 3} more" if len(buffers) > 3 else "")
            raise ConfigError("study.model.factory", f"the model has buffers ({shown}), which the {self.name} backend "
                                                     "does not merge (nor sum its counters); allowed: a model without "
                                                     "buffers (e.g. no BatchNorm), or --backend inprocess")

    def check_space(self, names, timed: bool = False) -> None:
        only = self.only | (self.timed_only if timed else {})
        for name in names:
            why = self.refuses.get(name) or only.get(name, (None, None))[1]
            if why:
                raise ConfigError(f"study.search.space.{name}", f"is not supported by the {self.name} backend "
                                                                f"({why}); remove it or use --backend inprocess")


#: what each backend runs (a backend registered without a declaration is taken to run everything)
CAPABILITIES: dict[str, Capabilities] = {
    "inprocess": Capabilities(name="inprocess"),
    "distributed": Capabilities(
        name="distributed",
        # the rank code merges by the rules' classes, and its all-reduce knows these rules' supports
        rules={"weighting": ("uniform", "examples", "adaptive"), "payload": ("weights", "delta"),
               "scheme": ("gossip", "allreduce", "none")},  # async: the server is in process only
        # each of these needs every worker's state at every event
        refuses={
            "similarity_bias": "peers are chosen by similarity, which needs all workers' models at every event",
            "regroup_every": "communities are regrouped from all workers' models",
            "data_exchange_k": "training examples travel between workers",
            "retire_threshold": "examples are retired by confidence (with data exchange)",
            "swap_p": "models are swapped between workers",
            "backup_workers": "the late workers are left out of the clock's all-reduce in process only",
        },
        only={"optimizer_state": ("keep", "the optimiser's state is not sent between ranks"),
              "score": ("holdout", "the running score is not sent between ranks yet")},
        # Streaming DiLoCo runs between ranks in the lockstep world; on a simulated clock in process only (an alpha
        # with one fragment and no delay streams nothing: it scales the all-reduce's move, plan.allreduce_weight)
        timed_only={"fragments": (1, "fragments are not streamed between ranks on a simulated clock yet"),
                    "fragment_delay": (0, "fragments are not streamed between ranks on a simulated clock yet")},
        buffers=False,
        timed_payloads=("weights",),
        outer_payloads=("weights",),
    ),
}


def capabilities(backend: str) -> Capabilities:
    return CAPABILITIES.get(backend) or Capabilities(name=backend)


def check_policy(backend: str, policy, timed: bool = False) -> None:
    """Refuse, naming the field, a policy the backend cannot run (``timed``: on a simulated clock)."""
    capabilities(backend).check_policy(policy, timed)


def check_model(backend: str, model) -> None:
    """Refuse, naming the field, a model the backend cannot run (called once the model is built)."""
    capabilities(backend).check_model(model)


def check_launch(backend: str) -> None:
    """Before a search stores its study and launches the distributed backend's ranks on this machine (not under
    torchrun): refuse, naming ``TMPDIR``, a temporary folder they cannot start through
    (:func:`evomerge.backends.launch.check_socket_folder`, which every local launch calls itself)."""
    if backend == "distributed":
        from .launch import check_socket_folder

        check_socket_folder()


def check_space(backend: str, names, space=(), timed: bool = False) -> None:
    """Refuse a search space that would sample fields the backend cannot run, or choices of a field whose
    values it runs only some of (``space``: the study's params, for their choices; ``timed``: the study has an
    ``[environment]``)."""
    caps = capabilities(backend)
    caps.check_space(names, timed)
    for p in space:
        known = caps.rules.get(p.name)
        bad = [c for c in p.choices if known is not None and c not in known]
        if bad:
            raise ConfigError(f"study.search.space.{p.name}", f"choice {bad[0]!r} is not supported by the {caps.name} "
                                                              f"backend; allowed: {', '.join(known)}, or --backend "
                                                              "inprocess")


def check_emulate_time(backend: str, study) -> None:
    """``--emulate-time`` sleeps a distributed run's simulated times: it needs both, and says which is missing."""
    from ..errors import ConfigError

    if backend != "distributed":
        raise ConfigError("--emulate-time", f"needs --backend distributed (the backend is {backend!r})")
    if study.environment is None:
        raise ConfigError("--emulate-time", f"needs a study with an [environment] ({study.name!r} has none: its steps "
                                            "have no simulated time to emulate)")


def runner(backend: str = "inprocess", procs: int | None = None, workers: int | None = None) -> Callable:
    """The run function of a backend, called as ``fn(setup, policy, seed, callback=..., device=..., ...)``
    and returning a ``RunResult``; the distributed one runs on ``procs`` processes (default one per worker)."""
    import importlib
    from functools import partial

    if workers is not None:
        check(backend, procs, workers)
    if backend not in BACKENDS:
        raise ConfigError("--backend", unknown(backend, BACKENDS))
    module, name = BACKENDS[backend].split(":")
    fn = getattr(importlib.import_module(module), name)
    return partial(fn, procs=procs) if backend == "distributed" else fn


def ran_on(backend: str, procs: int | None, workers: int, device_type: str) -> str:
    """Where a run's arithmetic ran, in words (``in process on cpu with 2 torch threads``, ``on the distributed
    backend (2 processes) on cpu``): kept with a search's trials, so that a replay is held to match bit for bit only
    where it runs the same sums in the same order. In process on the CPU the thread count splits the sums too (a
    replay with the machine's other core busy said DIFFERS)."""
    where = "in process" if backend == "inprocess" else f"on the {backend} backend ({procs or workers} processes)"
    if backend == "inprocess" and device_type == "cpu":
        import torch

        n = torch.get_num_threads()
        return f"{where} on cpu with {n} torch thread{'s' * (n != 1)}"
    return f"{where} on {device_type}"


def found_with(study, exported: dict | None, given: tuple[str, ...] = ()):
    """The study a replay of an exported policy runs: with the step size the search chose for it (the keys in
    the export's ``run_searched``: ``run.lr``, ``run.weight_decay``) where the study's differs, and a line saying
    what changed (None when nothing did). A searched step size belongs to the policy: the trial's value was
    judged with it. It is applied only with the optimiser it was found with; otherwise the line says it is not.
    ``given``: keys the caller sets itself next (``--lr``): left out of the line, which would say otherwise."""
    from ..study import RUN_SEARCHABLE, with_run

    run = (exported or {}).get("run") or {}
    searched = set((exported or {}).get("run_searched") or ())
    differ = {k: run[k] for k in RUN_SEARCHABLE if k in searched and k in run and run[k] != getattr(study.run, k)}
    if not differ:
        return study, None
    said = ", ".join(f"run.{k} {v:g} (the study says {getattr(study.run, k):g})" for k, v in differ.items()
                     if k not in given)
    if run.get("optimizer", study.run.optimizer) != study.run.optimizer:
        return study, (f"note: the exported policy was found with {run['optimizer']} and {said}; this study trains "
                       f"with {study.run.optimizer}, so its own values are used" if said else None)
    if not said:  # (the given key's own line names the trial's value)
        return with_run(study, differ), None
    return with_run(study, differ), f"note: the exported policy was found with {said}; this run uses the found values"


def given_lr(lr: float, study, exported: dict | None, changed: str):
    """``run --lr`` (``evomerge.run(lr=)``): the study with that step size, the note saying so, and (a replay of an
    exported trial at another step size) what differs from the trial, so that its figures are not held to the
    trial's."""
    import math

    from ..study import with_run

    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise ConfigError("--lr", f"{lr!r}; allowed: a step size > 0")
    if not (math.isfinite(lr) and lr > 0):
        raise ConfigError("--lr", f"{lr:g}; allowed: a step size > 0")
    was = study.run.lr
    if lr == was:
        return study, None, changed
    found = (exported or {}).get("run") or {}  # the trial's own step size, where the replay took it (found_with)
    whose = "the exported trial's" if "lr" in ((exported or {}).get("run_searched") or ()) and found.get("lr") == was \
        else "the study's"
    if exported:
        changed = ", ".join(x for x in (changed, f"run.lr {lr:g} by --lr, {whose} {was:g}") if x)
    return with_run(study, {"lr": lr}), f"note: run.lr {lr:g} (--lr), where {whose} is {was:g}", changed


def found_trial(study, trial: dict) -> dict:
    """What a replay takes from a search's trial as ``SearchResult.best`` holds it (``number``, ``policy``, the searched
    ``run`` values) or from an export's document: the export's form (:func:`found_with` reads its searched step size);
    an export's document as it is."""
    from ..study import check_found_run

    if "trial" in trial:
        if "run" in trial:
            check_found_run(trial["run"], "policy.run")
        return trial
    run = check_found_run(trial.get("run") or {}, "policy.run")
    return {"trial": trial.get("number"), "policy": trial["policy"], "run": {"optimizer": study.run.optimizer} | run,
            "run_searched": sorted(run)}


def run_inputs(study, policy: MergePolicy | dict | str | Path, seed: int | None = None, *,
               backend: str = "inprocess", procs: int | None = None) -> tuple[MergePolicy, int, dict | None]:
    """What one run of ``evomerge run`` / ``evomerge.run()`` needs, checked before any data is read:
    the policy (an object, its fields as a dict, a file or a named policy), the seed (given, else an exported file's
    first seed, else the study's first seed) and the exported file's metadata (None for a plain policy);
    the backend must be able to run the policy on the study's workers."""
    exported = None
    if isinstance(policy, dict) and isinstance(policy.get("policy"), dict):  # a search's trial (found.best[0]), or
        exported = found_trial(study, policy)            # an export read: the policy at the step size it was found with
        policy = MergePolicy.from_dict(policy["policy"], "policy.policy")
    elif isinstance(policy, dict):  # as Merger takes it
        policy = MergePolicy.from_dict(policy)
    elif not isinstance(policy, (MergePolicy, str, Path)):
        raise ConfigError("policy", f"must be a MergePolicy, a dict of its fields, a file or a named policy, got "
                                    f"{type(policy).__name__}")
    if not isinstance(policy, MergePolicy):
        exported = policy_mod.read_export(policy) if Path(policy).is_file() else None
        policy = study.resolve_policy(policy)
    policy_mod.check_workers(policy, study.run.workers)
    if study.environment is not None:
        policy_mod.check_timed(policy)
    elif policy.scheme == "async":
        raise ConfigError("policy.scheme", policy_mod.ASYNC_NEEDS_CLOCK)
    check(backend, procs, study.run.workers)
    check_policy(backend, policy, timed=study.environment is not None)
    from .. import task as task_mod
    from ..engine.setup import refuse_confidence

    refuse_confidence(policy, task_mod.of(study))  # (before the data are read)
    if seed is None:
        seed = exported["seeds"][0] if exported and exported.get("seeds") else study.run.seeds[0]
    return policy, seed, exported
