"""A found policy in your own training loop: :class:`Merger`, one worker per process under ``torch.distributed``.

```python
dist.init_process_group("gloo")     # launched by torchrun: one worker per process
merger = evomerge.Merger("best.json", model, optimizer, seed=0, total_steps=len(loader) * epochs)
for x, y in loader:
    loss = F.cross_entropy(model(x), y)
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    merger.step(loss=loss)          # this rank's merges for this local step, by the policy
consensus = merger.finish()         # every rank's model averaged: the model to keep
```

**What it replays.** The event schedule is ``schedule.build(policy, W, total_steps, seed)``, a pure function
of its arguments, so every rank knows in advance which peer sends to it after which of *their* local steps,
and with which uniform draw. The merges are the one merge kernel's (:mod:`evomerge.engine.kernel`): the
weightings of :mod:`evomerge.engine.weighting` (``uniform``, ``examples``, ``adaptive``), the moves of
:func:`evomerge.engine.plan.moves`, the mixing schedule over ``total_steps``, the buffer rules (counters
summed), the all-reduce scheme every ``round(mean_interval)`` steps and the outer optimiser (DiLoCo, SlowMo)
of :class:`evomerge.engine.kernel.Outer`. The step counter counts calls to :meth:`Merger.step` (the loop's
iterations), not optimiser steps, since a GradScaler may skip one on one rank.

**When a payload is applied** (``overlap``):

- ``"lockstep"``: the lockstep world (a study without ``[environment]``). A receiver applies the payload of
  an event at its own step boundary with the event's step, waiting for it if need be: the results are the
  in-process engine's, whatever the ranks' speeds, and a slow rank holds up its peers.
- ``"nonblocking"`` (default) and ``"blocking"``: the simulated clock's meaning. A payload is the sender's
  state when it sent it; the receiver applies it at its first step boundary after it arrived (in push-pull
  it answers with its state before merging). Non-blocking, the initiator trains on while its payload
  travels; blocking, it waits until its merge is done (push: its payload was received; push-pull: the answer
  arrived and was merged). While it waits, a rank keeps answering its peers.

**How it communicates.** Point-to-point messages (``torch.distributed.isend`` / ``irecv``, tagged with the
event) and async collectives, on the caller's thread: nothing blocks the training thread except where the
policy says wait. Receives for the next :data:`WINDOW` incoming events are posted ahead (memory: that many
payloads per sender); a payload sent later is taken when the window reaches it. A payload is one flat float32
tensor: the parameters, then the buffers (delta payloads: the encoded change since the sender's public copy), then
the scalars (examples seen and their scale, running score, winner, the sender's message number, as float64 bits),
then (delta payloads) the sender's counters as they are, then the squared-gradient accumulators under
``adaptive`` weighting, then the optimiser's state
under ``optimizer_state = "average"``. With delta payloads every rank that receives from a sender keeps its
public copy, so the sender's messages go to all of them, and each applies them in the order they were sent.

**Faults.** Every wait is bounded by ``timeout`` (and the roll call after it by ``timeout`` more): a rank that died
or hangs ends every rank that needs it with
:class:`MergerError`, one line naming it (``rank 2 did not answer for 30 s (merge event 1234); stopped``).

**Asynchronous DiLoCo** (``scheme = "async"``): rank 0 holds the server (:class:`evomerge.engine.kernel.AsyncServer`)
and serves the pushes that have arrived at its own step boundaries and while it waits; the other ranks push after
their local steps and wait for the global model. ``speeds`` (one per rank) scale the local steps under
``local_steps_by_speed``.

**What it refuses**, at construction, in one line naming the field (:data:`REFUSED`): the fields that need
every worker's state at an event or data that travels, and those the runtime does not run yet.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from .engine import ops, schedule as schedule_mod
from . import registry
from .backends.pending import Pending as _Pending
from .backends import progress as progress_mod
from .engine import kernel, plan as plan_mod
from .errors import ConfigError, RunError
from .policy import GOSSIP_ONLY, STREAMING_OFF, MergePolicy, check_workers

OVERLAPS = ("nonblocking", "blocking", "lockstep")
WINDOW = 4  # incoming payloads whose receives are posted ahead
REQUEST, REPLY = 0, 1  # a gossip event's two messages: the initiator's payload, the peer's answer (push-pull)
STOP_TAG = 2**30 - 1  # each rank's standing message to every other: 1 = stop (a rank failed), 0 = done, LEFT
LEFT = 2.0  # the stop message of a rank whose process is ending without finish() or close() (_leave_at_exit)
EARLY = 10.0  # EARLY + t: the stop message of a rank that calls finish() after t < total_steps steps (_end_early)
# the stop message of a rank whose own wait ran out: TIMED_OUT (a collective: every rank waited for), or
# TIMED_OUT - 1 - r (rank r); a rank that answered the roll call after all was late, not gone (_fail names it)
TIMED_OUT = -1.0
TOLD_STEPPING, TOLD_WAITING = 1.0, 1.5  # the stop message of a rank told to stop while it stepped, or waited


def _timed_out(peer: int | None) -> float:
    """The stop message of a rank whose wait for ``peer`` (None: a collective, every rank) ran out."""
    return TIMED_OUT if peer is None else TIMED_OUT - 1 - peer
WORKER_STOPPED = -1.0  # the flag a worker's leader broadcasts to its other ranks when it stops; its line follows
LINE_BYTES = 1024  # the longest stop line a leader sends its worker's other ranks (UTF-8)
EXIT_GRACE = 2.0  # seconds a rank ending without finish() waits for a lower rank that is ending too
MAX_TIMEOUT = 1e6  # seconds (11 days): a thread's join takes no more than the platform's time_t from now
EVERY_STEP = ("under this policy every rank calls step() as many times (total_steps), since each merge waits for "
              "every rank (give every rank as many batches)")
META = 10  # float32 slots of a payload's scalars (five float64): examples, their scale epoch, running score, winner,
# and the sender's message number (delta payloads: its neighbours apply its deltas in the order it sent them)

#: policy fields a user's loop cannot honour (or the runtime does not run yet), and why; each must stay at its default
REFUSED = {
    "similarity_bias": "peers drawn from the models' similarity need every worker's model at each event",
    "regroup_every": "regrouping needs every worker's model",
    "data_exchange_k": "the loop owns its data; training examples cannot travel between ranks",
    "retire_threshold": "the loop owns its data; examples cannot be retired",
    "swap_p": "model swaps would move the loop's data to another model",
    "stop_tol": "the loop decides when to stop",
    "backup_workers": "backup workers are not built into the loop's all-reduce yet (the simulated clock runs them)",
    "payload": "a gradient all-reduce belongs in the loop's backward pass (DDP's communication hooks), not after "
               "its step",
}
_ALLOWED: dict[str, tuple] = {"payload": ("weights", "delta")}


_MAX_DIMS = 8  # of a holdout's inputs and labels (their shapes travel in a fixed-size descriptor)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]


class MergerError(RunError):
    """A peer died or hung: the message, one line, names the rank."""


def read_policy(policy) -> MergePolicy:
    """A :class:`MergePolicy` from an object, a dict, a path to a policy or an exported file (``best.json``), or a
    shipped policy's name (``"diloco"``)."""
    return read_policy_and_run(policy)[0]


def read_policy_and_run(policy) -> tuple[MergePolicy, dict]:
    """The policy and, for an exported file, the run settings it was found with (``run``: optimizer, lr,
    weight_decay; empty for a plain policy)."""
    return _read_policy(policy)[:2]


def _read_policy(policy) -> tuple[MergePolicy, dict, dict]:
    """:func:`read_policy_and_run`, and where an exported policy was found (``study``, ``trial``, ``model_bytes``)."""
    if isinstance(policy, MergePolicy):
        return policy, {}, {}
    run, found = {}, {}
    if isinstance(policy, (str, os.PathLike)):
        path = Path(policy)
        shipped = registry.shipped_studies_dir() / "policies"
        if not path.exists() and isinstance(policy, str) and (shipped / f"{policy}.json").is_file():
            path = shipped / f"{policy}.json"  # a shipped policy by name, as evomerge run --policy takes it
        try:
            if not str(policy).strip():  # Path("") is the current folder: it said "cannot read '.': Is a directory"
                raise OSError(0, "an empty name")
            data = json.loads(path.read_text())
        except OSError as e:
            from .policy import policy_hint

            named = sorted(f.stem for f in shipped.glob("*.json"))
            what = f"{policy}: no such file or shipped policy" if isinstance(e, FileNotFoundError) else \
                f"cannot read {str(policy)!r}: {e.strerror or e}"  # (as evomerge.run() and run --policy say it)
            raise ConfigError("policy", f"{what}; allowed: a policy or an exported JSON file, a shipped policy's name "
                                        f"({', '.join(named)}), a dict or a MergePolicy"
                                        + policy_hint(policy, named)) from None
        except ValueError as e:
            raise ConfigError("policy", f"{str(path)!r} is not JSON ({e})") from None
        policy = data
    from .policy import check_not_a_broken_export

    check_not_a_broken_export(policy, "policy")
    if isinstance(policy, dict) and "trial" in policy and "policy" in policy:  # an exported file
        from .study import check_found_run

        run = check_found_run(policy["run"]) if "run" in policy else {}
        found = {k: policy[k] for k in ("study", "trial", "model_bytes") if k in policy}
        workers = ((policy.get("fingerprint") or {}).get("summary") or {}).get("run.workers") \
            if isinstance(policy.get("fingerprint"), dict) else None
        if isinstance(workers, int) and not isinstance(workers, bool):  # how many workers its trials ran
            found["workers"] = workers
        policy = policy["policy"]
    if not isinstance(policy, dict):
        raise ConfigError("policy", f"got {type(policy).__name__}; allowed: a MergePolicy, a dict, or a path to a "
                                    "policy or exported JSON file")
    return MergePolicy.from_dict(policy), run, found


def model_size_warning(found: dict, model: torch.nn.Module) -> str | None:
    """What to tell a user whose model is not of the size the exported policy was searched with (None: it is, or
    the file does not say): the search judged the merges by that model's bytes and steps."""
    from .models import module_float32_bytes
    from .units import size

    theirs = found.get("model_bytes")
    if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs <= 0:
        return None
    mine = module_float32_bytes(model)
    if theirs in (mine, module_float32_bytes(model, every_buffer=True)):  # (an export that counted a causal mask)
        return None
    trial = f"trial {found['trial']} of {found['study']}" if "trial" in found and "study" in found else "it"
    return (f"policy: {trial} was searched with a model of {size(theirs)} (float32 parameters and buffers); this "
            f"model is {size(mine)}. The search judged its merges by that model's bytes and steps: search a study "
            "of this model ([model] factory, docs/own-model.md) for a policy found for it")


def workers_warning(found: dict, workers: int) -> str | None:
    """What to tell a user whose job has another number of workers than the exported policy was searched with (None:
    the same, or the file does not say): a merge's reach, a topology's shape and the data a worker holds change with
    it."""
    theirs = found.get("workers")
    if not isinstance(theirs, int) or theirs == workers:
        return None
    trial = f"trial {found['trial']} of {found['study']}" if "trial" in found and "study" in found else "it"
    return (f"policy: {trial} was searched with {theirs} workers (run.workers); this job has {workers}. How far a "
            "merge reaches and the topology's shape change with the workers: search a study of "
            f"{workers} worker{'s' * (workers != 1)} for a policy found for this job")


_OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}  # a study's run.optimizer -> torch.optim's class


def step_size_warning(run: dict, optimizer) -> str | None:
    """What to tell a user whose optimiser is not the kind, or its lr not the one, the exported policy was found with
    (None: they are, or nothing says). The best merge policy depends on the step size (issue: DiLoCo's outer step,
    tuned rivals), and on the optimiser that takes it."""
    lr = run.get("lr")
    if optimizer is None or not isinstance(lr, (int, float)) or not optimizer.param_groups:
        return None
    mine = optimizer.param_groups[0].get("lr")
    mine = float(mine.item() if isinstance(mine, torch.Tensor) else mine)
    kind, theirs = type(optimizer).__name__, _OPTIMIZERS.get(run.get("optimizer"))
    if theirs is not None and kind != theirs:
        return (f"policy: found with {run['optimizer']} at lr {lr:g}; this optimizer is {kind} at lr {mine:g}. The "
                f"best merge policy depends on the optimiser and its step size: train with torch.optim.{theirs} at lr "
                f"{lr:g}, or search with yours (study.run.optimizer, and run.lr in [search.space])")
    if abs(mine - lr) <= 1e-9 * max(abs(lr), 1.0):
        m, theirs_m = optimizer.param_groups[0].get("momentum"), run.get("momentum")
        if kind == "SGD" and isinstance(theirs_m, (int, float)) and isinstance(m, (int, float)) and \
                abs(m - theirs_m) > 1e-9:  # SGD's momentum scales its steps by 1 / (1 - momentum)
            return (f"policy: found with sgd at lr {lr:g} and momentum {theirs_m:g}; this optimizer's momentum is "
                    f"{m:g}. The best merge policy depends on the step size: train with momentum {theirs_m:g}")
        return None
    how = f" with {run['optimizer']}" if run.get("optimizer") else ""
    return (f"policy: found{how} at lr {lr:g}; this optimizer's lr is {mine:g}. The best merge policy depends on the "
            f"step size: train at lr {lr:g}, or search with run.lr in [search.space] at yours")


def check_policy(policy: MergePolicy, workers: int | None = None) -> None:
    """Refuse, in one line naming the field, a policy a user's loop cannot run (on ``workers`` ranks, where given:
    the topology's rules for that many: after what no loop runs, so a line never points to a value refused next)."""
    if registry.PAYLOADS.get_object(policy.payload).public and policy.scheme == "allreduce" and \
            policy.weighting != "uniform":
        raise ConfigError("policy.weighting", f"{policy.weighting!r} with a delta payload on the all-reduce scheme "
                                              "would need every rank's public copy on every rank, which the runtime "
                                              "does not keep (it keeps their sum); allowed: 'uniform'")
    if plan_mod.compressed_outer(policy):  # streamed fragments' compressed sends are simulated in process only
        for name, off in STREAMING_OFF.items():
            if getattr(policy, name) != off:
                raise ConfigError(f"policy.{name}", f"{getattr(policy, name)!r} with compressed outer gradients "
                                                    "(payload 'delta' with an outer step) cannot run in a training "
                                                    f"loop yet; allowed: {off!r}, or payload 'weights'")
    defaults = MergePolicy()
    for name, why in REFUSED.items():
        if name in GOSSIP_ONLY and policy.scheme != "gossip":  # carried (a search's draw), never used
            continue
        value = getattr(policy, name)
        allowed = _ALLOWED.get(name, (getattr(defaults, name),))
        if value not in allowed:
            raise ConfigError(f"policy.{name}", f"{value!r} cannot run in a training loop ({why}); "
                                                f"allowed: {', '.join(repr(a) for a in allowed)}")
    if workers is not None:
        check_workers(policy, workers)


def _in_worker_error(line: str) -> "MergerError":
    """A failure of a collective inside a worker of several ranks (marked: the leader does not tell its worker)."""
    e = MergerError(line)
    e.in_worker = True
    return e


def _holdout_scored(policy: MergePolicy) -> bool:
    """Whether the policy's winner test scores both models of a pair on the pair's held-out examples
    (``score = "holdout"``): the Merger then needs the loop's ``holdout``."""
    return _winner_biased(policy) and policy.score == "holdout"


def default_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The winner test's loss where the loop gives no ``loss_fn``: the engine's cross-entropy (:mod:`evomerge.task`,
    as a search scored the pair) where the logits' last dimension is the classes, labels ``[N]`` or one per position
    ``[N, T]`` (a language model's ``[N, T, C]``); else torch's ``cross_entropy``, classes on dimension 1 (a
    segmentation's ``[N, C, H, W]``); positions labelled -100 left out."""
    from .task import IGNORE, Task

    task = Task("cross_entropy")
    task.ignores = True  # (-100 counted out wherever it appears)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.dim() == y.dim() + 1 and tuple(out.shape[:-1]) == tuple(y.shape):  # classes last: a search's models
            return task.module_loss(out, y)
        # classes on dim 1 ([N, C, H, W] against [N, H, W]), as torch's cross_entropy takes them (and its error)
        return torch.nn.functional.cross_entropy(out, y, ignore_index=IGNORE)
    return loss


@contextlib.contextmanager
def _in_eval(model: torch.nn.Module):
    """``model`` in eval mode inside, each module's own mode after (a frozen BatchNorm stays in eval)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _check_holdout(holdout, policy: MergePolicy, loss_fn=None, model=None) -> tuple[
        tuple[torch.Tensor, torch.Tensor] | None, str | None]:
    """This rank's held-out examples ``(x, y)`` when the policy scores on them, else None (a holdout given for a policy
    that does not is unused), and what is wrong with them, if anything (one line for ``holdout``): every rank learns
    of it at the gather (:meth:`Merger._gather_holdouts`) before this one raises it, so none waits on it. With
    ``model``, its loss on the first example is taken once here (a loss that cannot take the model's outputs
    raised at the first merge, with a traceback, on one rank)."""
    if not _holdout_scored(policy):
        return None, None
    if holdout is None:
        return None, (f"None, but policy.score 'holdout' with winner_bias {policy.winner_bias:g} scores both models of "
                      "a gossip pair on the two ranks' held-out examples; allowed: (x, y), examples this rank does not "
                      "train on (as many on every rank), or a policy with score 'running'")
    ok = isinstance(holdout, (tuple, list)) and len(holdout) == 2 and all(isinstance(t, torch.Tensor) for t in holdout)
    if not ok or holdout[0].dim() == 0 or holdout[1].dim() == 0 or len(holdout[0]) != len(holdout[1]) or \
            len(holdout[0]) == 0:
        got = (f"tensors of shapes {[list(t.shape) for t in holdout]}" if ok else type(holdout).__name__)
        return None, (f"got {got}; allowed: (x, y), two tensors with the same number of examples (at least one)")
    if holdout[0].dim() > _MAX_DIMS or holdout[1].dim() > _MAX_DIMS:
        return None, (f"inputs of {holdout[0].dim()} and labels of {holdout[1].dim()} dimensions; allowed: at most "
                      f"{_MAX_DIMS}")
    if loss_fn is None and holdout[1].is_floating_point():  # cross-entropy on float targets: every pair tied at -0
        return None, (f"its labels are {str(holdout[1].dtype).replace('torch.', '')}, and loss_fn None scores them "
                      "with cross-entropy, which takes integer classes; allowed: integer class labels, or "
                      "loss_fn=a function (output, y) -> loss (torch.nn.functional.mse_loss for regression)")
    if model is not None and (loss_fn is None or callable(loss_fn)):  # (a loss_fn that is not: its own line)
        fn = loss_fn if loss_fn is not None else default_loss()
        x, y, out = holdout[0][:1], holdout[1][:1], None
        try:
            dev = next(iter(model.parameters()), torch.empty(0)).device
            # (a forward that draws random numbers in eval mode too leaves the loop's generators as they were)
            with torch.no_grad(), _in_eval(model), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                out = model(x.to(dev))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    float(torch.as_tensor(fn(out, y.to(dev))).float().mean())
            # torch's regression losses broadcast outputs [B, 1] against labels [B] to [B, B] with only a warning (the
            # study's named losses refuse it: task.check_output): every pair would be scored on that
            broadcast = [w for w in caught if "different to the input size" in str(w.message)]
            for w in caught:  # the loss's other warnings are the user's to see, as without the check
                if w not in broadcast:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            if isinstance(out, torch.Tensor) and broadcast:
                def batch(t):
                    return "[" + ", ".join(["B", *map(str, t.shape[1:])]) + "]"

                name = getattr(loss_fn, "__name__", "loss_fn")
                return None, (f"its labels have shape {batch(holdout[1])} and the model's outputs {batch(out)}: "
                              f"{name} broadcasts them (torch warns 'Using a target size that is different to the "
                              "input size'), so the pairs would be scored on a broadcast loss; allowed: labels of "
                              "the outputs' shape" + (" (y.unsqueeze(1))" if out.dim() == 2 and out.shape[1] == 1 and
                                                      holdout[1].dim() == 1 else
                                                      " (y.view_as(outputs))" if out[0].numel() == holdout[1][0].numel()
                                                      else ""))
        except Exception as e:  # noqa: BLE001 - the user's model or loss: one line
            from .userref import one_line

            shapes = (f"outputs {list(out.shape)} for labels {list(y.shape)}" if isinstance(out, torch.Tensor)
                      else f"inputs {list(x.shape)}")
            name = "the default cross-entropy" if loss_fn is None else getattr(loss_fn, "__name__", "loss_fn")
            return None, (f"scoring its first example raised {one_line(e)} ({name}; the model's {shapes}); allowed: "
                          "examples the model takes, and a loss_fn (output, y) -> loss that takes its outputs")
    return (holdout[0], holdout[1]), None


def _winner_biased(policy: MergePolicy) -> bool:
    """Whether the policy's merges compare the two models (``winner_bias`` moves only a gossip pair's lerp; the
    other schemes carry it without using it)."""
    return policy.scheme == "gossip" and policy.winner_bias > 0


def _checksum(blocks) -> tuple[float, float]:
    """A model's numbers told apart cheaply (their sum and sum of squares, in float64, block by block): not a copy of
    the model."""
    s1 = s2 = 0.0
    with torch.no_grad():
        for b in blocks:
            s1 += float(b.sum(dtype=torch.float64))
            x = b if b.is_floating_point() else b.double()  # (a step counter: an integer buffer)
            s2 += float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)
    return s1, s2


def _async_local_steps(policy: MergePolicy, workers: int, speeds, worker_group) -> list[int] | None:
    """Asynchronous DiLoCo's local steps per push of each rank: round(mean_interval), or with dynamic local updates
    (``local_steps_by_speed``) scaled by the ranks' ``speeds`` (:func:`plan.steps_by_speed`, as the clock scales
    them by the configured ones). Refuses, in one line, what the loop cannot run."""
    if speeds is not None and policy.scheme != "async":
        raise ConfigError("speeds", f"given, but scheme {policy.scheme!r} does not use them; allowed: None, or a "
                                    "policy with scheme 'async'")
    if policy.scheme != "async":
        return None
    if worker_group is not None:
        raise ConfigError("worker_group", "set with scheme 'async' (asynchronous DiLoCo), which runs one process per "
                                          "worker; allowed: None")
    if speeds is not None and not policy.local_steps_by_speed:
        raise ConfigError("speeds", "given, but policy.local_steps_by_speed is false (every rank pushes after "
                                    "round(mean_interval) steps); allowed: None, or local_steps_by_speed true")
    if speeds is None:
        if policy.local_steps_by_speed:
            raise ConfigError("speeds", "None, but policy.local_steps_by_speed scales each rank's local steps by its "
                                        f"speed; allowed: a list of {workers} speeds (steps per second in any common "
                                        "unit, or the speeds evomerge calibrate writes), or local_steps_by_speed "
                                        "false")
        return None
    try:
        values = [float(x) for x in speeds]
    except (TypeError, ValueError):
        values = []
    if len(values) != workers or not all(np.isfinite(x) and x > 0 for x in values):
        raise ConfigError("speeds", f"{speeds!r}; allowed: {workers} positive numbers, one per rank")
    return plan_mod.steps_by_speed(max(1, round(policy.mean_interval)), [1.0 / x for x in values])


def _group_by(values: list) -> dict:
    """Each distinct value (in order of first sight) -> the indices holding it."""
    out: dict = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return out


def _differences(theirs: dict, mine: dict, where: str) -> str:
    """The fields in which two policies (dicts) differ, the first three in words: ``mean_interval 5.0 {where}, 4.0
    here``; the scheme and the topology first (what tells two rules apart: they came last of three, or not at
    all), and not the fields that take effect in neither (:func:`evomerge.policy.no_effect`)."""
    from .policy import no_effect

    first = ("scheme", "topology", "exchange")
    fields = sorted((k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k)),
                    key=lambda k: (first.index(k) if k in first else len(first), k))
    idle = no_effect(theirs) & no_effect(mine)  # a field neither policy reads (an all-reduce's degree) is not named
    fields = [k for k in fields if k not in idle] or fields  # (unless it is all they differ in)
    return ", ".join(f"{k} {theirs.get(k)!r} {where}, {mine.get(k)!r} here" for k in fields[:3]) + \
        (f" (and {len(fields) - 3} more)" if len(fields) > 3 else "")


def _users_frame(skip: int = 2):
    """(the first frame outside evomerge and torch, whose no_grad wrapper a Merger's methods go through, and its
    ``stacklevel`` counted from the caller of this function's caller): the user's line that called in."""
    inside = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], torch))
    f, level = sys._getframe(skip), 1
    while f is not None and f.f_code.co_filename.startswith(inside):
        f, level = f.f_back, level + 1
    return f, level


def _callers_level() -> int:
    """The ``stacklevel`` of a warning raised where the caller of this function stands that points at the user's
    line."""
    return _users_frame()[1]


def _user_line() -> tuple[str, int] | None:
    """(file, line) of the user's line that called in."""
    f = _users_frame()[0]
    return (f.f_code.co_filename, f.f_lineno) if f is not None else None


def _done_by(work: _Pending, deadline: float, tick=None) -> bool:
    """Poll ``work`` until it is done (True) or ``deadline`` (``time.perf_counter()``) passes or its connection closes
    (False); ``tick()`` between polls, if given."""
    while True:
        if tick is not None:
            tick()
        try:
            if work.done():
                return True
        except RuntimeError:  # its connection closed
            return False
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.005)


def _completes_by(work, deadline: float) -> bool:
    """Poll a collective's ``work`` until it completes (True) or ``deadline`` passes or it fails (False)."""
    while True:
        try:
            if work.is_completed():
                return True
        except RuntimeError:
            return False
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.002)


def _leave_at_exit(self: "Merger", ending: BaseException | None = None) -> None:
    """At the interpreter's exit, for a :class:`Merger` never finished or closed (an error in the user's loop, a loop
    that left early, or a :class:`MergerError` not followed by ``os._exit``): its message threads would end during
    the shutdown, as their peers' processes end, when a thread can no longer take the GIL, and the process would
    abort (``terminate called without an active exception``). So a rank that has not stopped yet tells every other
    rank it is leaving (:data:`LEFT`: they stop, naming it) and waits for their stop messages; then every such rank
    waits until its message threads have ended, as their peers' processes end. It does not wait for a lower rank that
    is leaving this way (that one waits for it), and waits for a lower one that stopped on a failure only
    :data:`EXIT_GRACE` seconds (time for one that leaves at once, by ``os._exit``): the highest goes first, and no
    connection closes while a rank shuts down. A wait still open after that (a message from a rank that stopped, which
    will not come, or one that outlived the grace) is cut (:meth:`Pending.cut`: gloo closes this rank's connections,
    as its process's end would), so that no thread waits when the process ends. Within one ``timeout`` in all; never
    raises. It warns where the loop ran every step and never finished (:func:`_unfinished_warning`)."""
    try:
        _unfinished_warning(self, ending or getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
        if not dist.is_initialized():  # the caller destroyed the process group: nothing left to tell or wait for
            return
        self._closing = True
        now = time.perf_counter()
        deadline, grace = now + self.timeout, now + min(EXIT_GRACE, self.timeout)
        stopped = bool(self._stop_out)  # it stopped on a failure: its roll call has waited for every rank already
        if not stopped:  # the others learn that it leaves
            self._stop_out = self._send_stops(LEFT)
        for work in self._stop_out:
            _done_by(work, deadline)
        for work, _ in self._stop_in.values():  # (after a roll call, a rank that did not answer it will not now)
            _done_by(work, grace if stopped else deadline)
        flags = {}
        for r, (work, buf) in self._stop_in.items():
            try:
                if work.done():
                    flags[r] = float(buf[0])
            except RuntimeError:  # its connection closed: its process has ended
                pass
        for x in self._pending:
            if x.peer is not None and x.peer < self.rank and flags.get(x.peer, 0.0) != 0.0:
                if flags[x.peer] == LEFT:  # in this hook too, waiting for this rank
                    continue
                x.join(max(0.0, grace - time.perf_counter()))  # stopped on a failure: left at once, or waits here
            elif stopped and x.peer is not None and x.peer not in flags:  # silent through the roll call: hung
                x.join(max(0.0, grace - time.perf_counter()))
            else:
                x.join(max(0.0, deadline - time.perf_counter()))
        for x in self._pending:  # still waiting: a message from a rank that stopped, which will not come
            x.cut()
    except Exception:  # noqa: BLE001 - the interpreter is ending: nothing to report to
        pass


def _unfinished_warning(self: "Merger", ending: BaseException | None) -> None:
    """A loop that ran all its steps and ended without :meth:`Merger.finish` (or :meth:`Merger.close`) leaves each
    rank with its own model, not the consensus, and nothing else would say so. Not where the process ends on an
    error (``ending``: the loop's error is the story) or after a stop on a failure (the failure was said)."""
    if ending is None and self.t >= self.T and not self._stop_out:
        said = (f"rank {self.rank}'s Merger ran its {self.T} steps but was neither finished nor closed: this rank's "
                "model is its own, not the consensus; call merger.finish() after the loop (or merger.close() to leave "
                "without the final average)")
        where = getattr(self, "_built_at", None)
        if where is None:
            warnings.warn(said, RuntimeWarning, stacklevel=2)
        else:  # at the exit no frame of the loop is left: the line that built the Merger (it showed evomerge's own)
            warnings.warn_explicit(said, RuntimeWarning, *where)


def _holds_this_rank(group) -> bool:
    """Whether ``group`` is a process group that holds this rank (a string, or a group of others', is not)."""
    try:
        return dist.get_rank(group) >= 0
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return False


def _leaders(worker_group, group) -> tuple[Any, bool, int, int]:
    """For ``Merger(worker_group=...)``: the group of the workers' leaders (every rank builds it, collectively),
    whether this rank follows its leader, its leader's global rank, and the number of workers."""
    if group is not None:
        raise ConfigError("group", "set with worker_group; allowed: None (merges run between one leader rank per "
                                   "worker, over a group of the leaders built from the world)")
    holds = _holds_this_rank(worker_group)
    if not holds and not isinstance(worker_group, dist.ProcessGroup) and \
            worker_group is not dist.GroupMember.NON_GROUP_MEMBER:  # (not a group at all: the same on every rank)
        raise ConfigError("worker_group", f"{worker_group!r} is not a process group holding this rank; allowed: "
                                          "the group of this rank's worker (dist.new_subgroups or dist.new_group)")
    # every rank says whether its group holds it before any waits on the others (a rank that refused alone left
    # the others in this gather, and gloo aborted them)
    leader = dist.get_global_rank(worker_group, 0) if holds else -1
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor([leader], dtype=torch.int64))
    bad = [r for r, t in enumerate(every) if int(t[0]) < 0]
    if bad:
        raise ConfigError("worker_group", f"rank{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} passed a group that "
                                          "does not hold it (dist.new_group gives a rank outside the group "
                                          "GroupMember.NON_GROUP_MEMBER); allowed: on every rank, the group of its "
                                          "own worker (dist.new_subgroups, or dist.new_group of that worker's ranks)")
    leaders = sorted({int(t[0]) for t in every})
    leaders_group = dist.new_group(leaders)  # collective over the world: every rank calls it
    return leaders_group, dist.get_rank() != leader, leader, len(leaders)


def _state_keys(optimizer: torch.optim.Optimizer) -> tuple[list[str], bool]:
    """For ``optimizer_state = "average"``: the per-parameter state tensors of ``optimizer`` that merges lerp as the
    parameters, and whether it counts steps (Adam's ``step``, lerped by the move, as the engine does)."""
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return (["momentum_buffer"] if any(g.get("momentum", 0) for g in groups) else []), False
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(g.get("amsgrad") for g in groups) else []), True
    raise ConfigError("optimizer", f"{type(optimizer).__name__}: optimizer_state 'average' merges the state of "
                                   "torch.optim.SGD, Adam and AdamW; allowed: one of those, or optimizer_state 'keep' "
                                   "or 'reset'")


class _Layout:
    """What the kernel reads from a model, for one ``nn.Module``: its parameters then its buffers, flat."""

    def __init__(self, tensors: list[torch.Tensor], n_params: int, names: list[str] | None = None):
        # (name, shape) per tensor, as a stacked model's layout: strided fragments group tensors by module
        self.layout = [(n, tuple(t.shape)) for n, t in zip(names or [str(i) for i in range(len(tensors))], tensors)]
        self.offsets, o = [], 0
        for t in tensors:
            self.offsets.append((o, t.numel()))
            o += t.numel()
        self.n_params, self.n_trained_blocks = o, n_params
        self.counters = frozenset(k for k, t in enumerate(tensors) if k >= n_params and not t.is_floating_point())


class Merger:
    """A merge policy applied in the caller's training loop; one worker per process of ``group``.

    ``policy``: a :class:`MergePolicy`, a dict, or a path to a policy or exported JSON file. ``model``: this
    rank's ``nn.Module`` (its parameters and buffers are merged in place; at construction every rank takes rank
    0's, as DDP does). ``optimizer``: needed by ``weighting = "adaptive"`` (its step hook gathers the squared
    gradients) and ``optimizer_state = "reset"``. ``seed`` draws the schedule (the same on every rank);
    ``total_steps`` is the number of :meth:`step` calls of the run (the mixing schedule spans it). ``group``:
    the process group (default: the world). ``timeout``: seconds any wait may last before the run stops with
    :class:`MergerError` (at the end and at a checkpoint: seconds a rank waited for may go without a step, so a
    slow rank far behind is waited for and a hung one named). ``trace``: a directory for one JSON Lines file per rank (each local step's compute
    time, each transfer's bytes, peer and duration). ``overlap``: see the module's docstring.

    ``worker_group``: the process group of this rank's worker, when a worker is several ranks (a node whose GPUs
    train one replica with DDP inside: ``dist.new_subgroups``). Merges then run between one leader per worker (the
    group's rank 0, over a group of the leaders that every rank builds here, so every rank must pass its own
    worker's group), and after each step the leader's model is broadcast inside its worker when a merge changed it
    (a one-float flag, then the model); the other ranks reset their optimiser's state where the leader's was.
    W is the number of workers; schedule, traces and ``merges`` are the leaders'. ``group`` must then be None.

    ``speeds``: asynchronous DiLoCo with ``local_steps_by_speed`` only: each rank's speed (steps per second, any
    common unit), which scales its local steps per push against the fastest rank's.

    ``holdout``: ``(x, y)``, examples this rank does not train on (as many on every rank, inputs as the model takes
    them), for a gossip policy whose winner-biased lerp scores on held-out examples (``winner_bias > 0`` with
    ``score = "holdout"``, as evomerge's studies search it: each worker's ``score_samples`` examples carved from its
    shard). Both models of a pair are scored on the pair's two holdouts (the initiator's, then the peer's) by
    ``loss_fn(model(x), y)`` (default: the engine's cross-entropy, :func:`default_loss`), in eval mode: the initiator sends its
    model's loss with its payload, the peer compares its own. Every rank's holdout is gathered once, here. Unused
    (and allowed) for any other policy.
    """

    def __init__(self, policy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, seed: int,
                 total_steps: int, group=None, timeout: float = 60.0, trace: str | os.PathLike | None = None,
                 overlap: str = "nonblocking", worker_group=None, speeds=None, holdout=None, loss_fn=None):
        p, found, where = _read_policy(policy)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("model", f"got {type(model).__name__}; allowed: a torch.nn.Module")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("optimizer", f"got {type(optimizer).__name__}; allowed: a torch.optim.Optimizer or None")
        for name, value, low in (("seed", seed, 0), ("total_steps", total_steps, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"{value!r}; allowed: an integer >= {low}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_TIMEOUT:
            # (inf was taken, and every join at the end raised OverflowError after the whole run)
            raise ConfigError("timeout", f"{timeout!r}; allowed: seconds in (0, {MAX_TIMEOUT:g}]")
        if overlap not in OVERLAPS:
            raise ConfigError("overlap", f"{overlap!r}; allowed: {', '.join(OVERLAPS)}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("group", "torch.distributed is not initialised; call dist.init_process_group first "
                                       "(one process per worker, e.g. under torchrun)")
        said = step_size_warning(found, optimizer)  # this rank's optimiser: said by each rank whose differs
        if said:
            warnings.warn(said, stacklevel=2)
        self.worker_group, self._follower, self._version, self._synced = worker_group, False, 0, 0
        self._ended, self._said_ended = None, False  # "finish" or "close" once called
        # seconds waited on peers and the network (collectives, payloads, answers) since the last step's record: the
        # trace's wait_s, which calibrate --from-trace takes from a step's time inside merger.step() (merge_time)
        self._wait_s = 0.0
        self._wait_in_step = 0.0  # _wait_s as the last step() ended (waits after it, a checkpoint's drain, are out)
        self._built_at = _user_line()  # the loop's line that built it: where a warning at the exit points
        self.arrivals: list[list[int]] = []  # asynchronous DiLoCo, rank 0: the ranks of each batch of pushes it served
        if worker_group is not None:
            group, self._follower, self._leader, n_workers = _leaders(worker_group, group)
        elif group is not None and not _holds_this_rank(group):  # (a string read "AttributeError: 'str' object ...")
            raise ConfigError("group", f"{group!r} is not a process group holding this rank; allowed: None (the "
                                           "world), or a group from dist.new_group that holds it")
        self.group = group
        if self._follower:
            self.W, self.rank = n_workers, -1
        else:
            self.W = n_workers if worker_group is not None else dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        check_policy(p, self.W)
        if self.rank == 0:  # the same on every rank (merged models have one size): said once, by rank 0
            for said in (model_size_warning(where, model), workers_warning(where, self.W)):
                if said:
                    warnings.warn(said, stacklevel=2)
        held, held_why = (None, None) if self._follower else _check_holdout(holdout, p, loss_fn, model)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError("loss_fn", f"got {type(loss_fn).__name__}; allowed: a function (output, y) -> loss, or None")
        from .models import state_buffers

        named_buffers = state_buffers(model)  # a non-persistent buffer (a causal mask) is the module's own, not merged
        if p.scheme == "async" and named_buffers:  # (before its speeds: said first, as what the loop must change)
            raise ConfigError("model", f"has buffers ({named_buffers[0][0]!r}); scheme 'async' (asynchronous DiLoCo) "
                                       "with buffers is not built yet; allowed: a model without buffers, or scheme "
                                       "allreduce")
        local_steps = _async_local_steps(p, self.W, speeds, worker_group)

        params = [t for t in model.parameters()]
        buffers = [t for _, t in named_buffers]
        for name, t in list(model.named_parameters()) + named_buffers:
            if not t.is_contiguous():
                raise ConfigError("model", f"{name!r} is not contiguous; allowed: contiguous parameters and buffers")
            if not t.is_floating_point() and (t.is_complex() or t.dtype == torch.bool):
                raise ConfigError("model", f"buffer {name!r} is {t.dtype}; allowed: floating point or integer counters")
            if t.is_floating_point() and t.dtype != torch.float32:  # (it crashed at the first merge, in torch's lerp)
                raise ConfigError("model", f"{name!r} is {str(t.dtype).replace('torch.', '')}; allowed: float32 "
                                           "parameters and buffers, as the search ran them (for bfloat16 or float16 "
                                           "arithmetic keep them float32 and train under torch.autocast)")
        self.weighting = registry.WEIGHTINGS.get_object(p.weighting)()
        if self.weighting.accumulators and optimizer is None:
            raise ConfigError("optimizer", f"None, but weighting {p.weighting!r} gathers squared gradients at each "
                                           "optimiser step; allowed: the loop's torch.optim.Optimizer")
        if p.optimizer_state in ("reset", "average") and optimizer is None:
            raise ConfigError("optimizer", f"None, but optimizer_state {p.optimizer_state!r} changes its state on a "
                                           "merge; allowed: the loop's torch.optim.Optimizer")
        self._opt_keys, self._opt_steps = _state_keys(optimizer) if p.optimizer_state == "average" else ([], False)
        self.p, self.model, self.optimizer = p, model, optimizer
        self.seed, self.T, self.timeout, self.overlap = int(seed), int(total_steps), float(timeout), overlap
        self.tensors = params + buffers
        self.layout = _Layout(self.tensors, len(params),
                              [n for n, _ in list(model.named_parameters()) + named_buffers])
        self.P = self.layout.n_params
        self.blocks = [t.data.view(1, -1) for t in self.tensors]  # one-row views: the kernel's rows of one worker
        self.rules = kernel.block_rules(self.layout, p.buffers)
        plan_mod.refuse_compressed_outer_buffers(p, [n for n, _ in named_buffers])
        self.dev = params[0].device if params else torch.device("cpu")
        # payloads cross gloo through host memory
        self.wire_dev = torch.device("cpu") if dist.get_backend(worker_group if self._follower else group) == "gloo" \
            else self.dev
        if self._follower:  # merges are the leader's: this rank takes its worker's model when it changes
            self.accum, self._hook, self._trace, self.t, self.merges = None, None, None, 0, 0
            self._share_progress()
            self._sync_worker(force=True)
            return
        self.accum = [torch.zeros_like(b, dtype=torch.float32) for b in self.blocks] \
            if self.weighting.accumulators else None
        self._hook = None
        if self.accum is not None:
            self._hook = optimizer.register_step_post_hook(self._gather_squares)
        self.examples = torch.zeros(1, dtype=torch.float64, device=self.dev)
        # the running score of this rank's model (policy.score), on the loss's device: no sync per step
        self.score = torch.zeros(1, dtype=torch.float64, device=self.dev)
        self.score_weight = torch.zeros(1, dtype=torch.float64, device=self.dev)
        self.epoch = 0  # how many times this rank scaled its supports down (kernel.rescale_supports)
        self.t = 0  # local steps done (calls of step())
        self.merges = 0
        self._trace = None  # before the first collective: a rank that dies during the start leaves a trace
        if trace is not None:
            d = Path(trace)
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # (a file of that name was FileExistsError's traceback)
                raise ConfigError("trace", f"cannot make the folder {str(d)!r}: {e.strerror or e}; allowed: a folder "
                                           "for the ranks' trace files (rank-N.jsonl)") from None
            self._trace = open(d / f"rank-{self.rank}.jsonl", "a", buffering=1)  # by line: kept if the process dies
            # the model's float32 bytes, as evomerge calibrate counts them: a cluster fitted from the trace says what
            # it timed, and a study of another model is told (Study.model_note)
            from .models import module_float32_bytes

            # and the policy and seed it runs (run --against replays them on the clock)
            self._write({"model_bytes": module_float32_bytes(model), "policy": p.to_dict(), "seed": self.seed,
                         "overlap": self.overlap, "ranks": self.W, "t": time.time(),
                         **({"local_steps": [int(k) for k in local_steps]} if local_steps is not None else {})})
        # a standing receive from every other rank: how a failure reaches ranks that are not waiting on the dead one
        self._pending: list[_Pending] = []  # the work handles' waiting threads (joined at the end)
        self._stop_in = {}
        for r in range(self.W):
            if r != self.rank:
                self._post_stop(r)
        self._stop_out: list = []
        self._closing = False
        self._progress: progress_mod.Progress | None = None  # every rank's step count, told through the store
        # a process that ends with receives still posted (an error in the user's loop) is aborted when one of them
        # completes during the interpreter's shutdown: before it, tell the others and wait for them (_leave_at_exit)
        self._hook_off = False  # finished, closed or left: the exit hook is off
        self._exit_hook = functools.partial(_leave_at_exit, self)  # held until _let_go: a Merger the caller dropped
        atexit.register(self._exit_hook)
        self._last: torch.Tensor | None = None  # every rank's last step, once the run drained
        self._hx = self._hy = None  # every rank's held-out examples (policy.score = "holdout"), [W, n, ...] each
        self.loss_fn = default_loss() if loss_fn is None else loss_fn
        # the checks every rank makes on what all of them gathered: each refuses at the same point (a ConfigError
        # raised here must be raised on every rank: _abandon)
        try:
            self._same_run_on_every_rank()  # (first: a start broadcast of models of other sizes aborts gloo)
            self._broadcast_start()
            if _holdout_scored(p):
                self._gather_holdouts(held, held_why)
            # every rank must draw the same pushes: refuse, on every rank, ranks that differ
            if local_steps is not None:
                self._same_on_every_rank(local_steps)
        except ConfigError:
            self._abandon()
            raise
        self.outer = kernel.outer_for(p, self.layout, self._flat, lambda: self._flat().unsqueeze(0))
        self.own_outer = plan_mod.own_outer_every(p)  # Lookahead / SNOO: this rank's own outer step, no merging
        self.local_steps = local_steps
        self.sched = schedule_mod.build(p, self.W, self.T, self.seed, local_steps)
        # asynchronous DiLoCo: the server (the global model and its delayed Nesterov momentum) is rank 0's; it
        # serves each push at rank 0's step boundaries (and while rank 0 waits), so no thread runs beside the loop
        self.server, self._served, self._cap, self._left = None, {}, None, set()
        if p.scheme == "async" and self.rank == 0:
            self.server = kernel.AsyncServer(self._flat(), self.W, p.outer_lr, p.outer_momentum,
                                             p.outer_optimizer == "nesterov", p.momentum_every)
            self._pushes = {q: [int(e) for e in np.flatnonzero(self.sched.initiator == q)] for q in range(1, self.W)}
            self._served = {q: 0 for q in self._pushes}
        # Streaming DiLoCo: each fragment's blocks; all-reduces in flight (event -> work, buffer, blocks, t0)
        # and the step after which each lands
        self.streaming = any(getattr(p, k) != off for k, off in STREAMING_OFF.items())
        self.fragments = plan_mod.fragments_of(p, self.layout) if p.fragments > 1 else None
        self._in_flight: dict[int, tuple] = {}
        self._landing: dict[int, list[int]] = {}
        s, r = self.sched, self.rank
        # delta payloads (policy.payload): what a rank sends is its change since its public copy, compressed, and
        # every rank that ever receives from it keeps that copy (the engine's public copies), so each of its
        # messages goes to all of them (its fan-out), and they apply its deltas in the order it sent them
        self.delta = registry.PAYLOADS.get_object(p.payload).public
        self._counter_blocks = [k for k, rule in enumerate(self.rules) if rule == kernel.SUM]
        self._unsent = kernel.unsent(self.rules, self.layout.offsets)  # left out of a delta payload
        self._n_counters = sum(self.layout.offsets[k][1] for k in self._counter_blocks) if self.delta else 0
        if self.delta:
            self._spec = ops.wire_spec(self.P, p.topk_fraction, p.quantize_bits)
            self._spec_bytes = [int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in self._spec]
            self._nw = -(-sum(self._spec_bytes) // 4)  # float32 slots of the encoded delta
        self._fan = self._fan_out() if s.scheme == "gossip" else [set() for _ in range(self.W)]
        # per sender, the messages this rank receives from it (event, kind) in event order; replies to this rank's
        # own events are posted when it starts them
        self._expect = {q: self._messages(q, r) for q in range(self.W) if q != r} if s.scheme == "gossip" else {}
        self._cursor = {q: 0 for q in self._expect}  # where each sender's list has nothing received before it
        self._posted: dict[tuple[int, int], tuple[Any, torch.Tensor, float]] = {}  # (event, kind) -> work, buffer, t0
        self._done_in: set[tuple[int, int]] = set()  # incoming messages (event, kind) applied
        self._came: set[tuple[int, int]] = set()  # incoming messages received (applied, or held for an earlier one)
        self._seq = 0  # messages this rank has sent (delta payloads)
        self._next = {q: 0 for q in self._expect}  # per sender, the number of its next message to apply
        self._held: dict[int, dict[int, tuple]] = {q: {} for q in self._expect}  # per sender, arrived early
        self.public = None
        if self.delta and s.scheme == "gossip":  # the start model, as every rank holds it now
            start = self._flat()
            self.public = {q: start.clone() for q in sorted({r} | {q for q in self._expect if r in self._fan[q]})}
        elif self.delta and s.scheme == "allreduce":  # this rank's public copy, and the sum of everyone's (key -1)
            start = self._flat()
            self.public = {r: start.clone(), -1: start * self.W}
        self._await_reply: dict[int, float] = {}  # push-pull events started, answer not merged yet -> time sent
        self._sending: list[tuple[Any, torch.Tensor, int, float, int]] = []  # sends in flight
        self._t_last = time.perf_counter()
        # at one step, waits for ranks that may be far behind: [the step, every rank's step at the first look, said,
        # the seconds waited in them]
        self._waited: list | None = None
        if worker_group is not None:
            self._share_progress()
            self._sync_worker(force=True)

    @staticmethod
    def needs_holdout(policy) -> bool:
        """Whether ``policy`` (as :class:`Merger` takes it) scores a gossip pair's models on held-out examples, so that
        the loop must keep some of each rank's data out of training and pass them as ``holdout``."""
        return _holdout_scored(read_policy(policy))

    # -- the loop's calls ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, loss=None, examples: float = 1) -> None:
        """After this rank's local step: apply the merges the policy has for it. ``loss`` is recorded in the
        trace; ``examples`` is what ``examples`` weighting counts (default 1: steps, which gives the same
        weights when every rank's batches are equally large)."""
        if self._ended is not None:  # (it warned that total_steps was too small, after the loop's finish())
            if not self._said_ended:
                self._said_ended = True
                warnings.warn(f"step: called after {self._ended}(); the run's merges are over and this step merges "
                              "nothing", stacklevel=3)
            return
        if isinstance(examples, torch.Tensor):  # one number; its value is not read here (on a GPU: a sync a step)
            ok = examples.numel() == 1
        else:
            ok = isinstance(examples, (int, float, np.number)) and not isinstance(examples, bool) and \
                math.isfinite(float(examples)) and float(examples) >= 0
        if not ok:  # (a negative or NaN count went into the examples weighting's sums)
            raise ConfigError("examples", f"{examples!r}; allowed: a number >= 0 (the examples this step trained on)")
        if loss is not None and not isinstance(loss, torch.Tensor) and \
                not (isinstance(loss, (int, float, np.integer, np.floating)) and not isinstance(loss, bool)):
            raise ConfigError("loss", f"{loss!r}; allowed: this step's loss, a tensor or a number, or None")
        if self._follower:
            self.t += 1
        else:
            self._leading(self._step, loss, examples)
        if self.worker_group is not None:
            self._sync_worker()

    def _step(self, loss, examples) -> None:
        now = time.perf_counter()
        if loss is None and _winner_biased(self.p) and self.p.score == "running":
            raise ConfigError("loss", "None, but winner_bias compares the models' running training losses; allowed: "
                                      "this step's loss (merger.step(loss=loss))")
        self.t += 1
        self.examples += examples
        if loss is not None and self.p.score == "running":
            value = loss.detach().float().mean().reshape(1) if isinstance(loss, torch.Tensor) else \
                torch.tensor([float(loss)], device=self.dev)
            kernel.score_step_(self.score, self.score_weight, value.to(self.dev))
        if self._trace is not None:  # (t: the wall clock as the loop's compute ended, for run --against)
            rec = {"step": self.t, "compute_s": now - self._t_last, "t": time.time(),
                   "wait_s": round(self._wait_in_step, 7)}  # (the waits inside the last step(), whose time ends at _t_last)
            if loss is not None:
                rec["loss"] = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
            self._write(rec)
        self._wait_s = self._wait_in_step = 0.0
        self._check_stops("", waiting=False)
        if self._progress is not None:  # (a rank waiting for this one at the end or a checkpoint sees it move)
            self._progress.beat(self.t)
        if self.t > self.T:
            if self.t == self.T + 1:  # once: the loop runs longer than the Merger was told
                warnings.warn(f"step: called more than total_steps ({self.T}) times; the policy's merges stop there "
                              "(its schedule spans total_steps): give Merger(total_steps=) the loop's iterations",
                              stacklevel=5)  # the loop's line (_step, _leading, step, torch.no_grad's wrapper)
            self._t_last, self._wait_in_step = time.perf_counter(), self._wait_s
            return
        s = self.sched
        if s.scheme == "allreduce" and self.streaming:
            for ev in self._landing.pop(self.t, ()):  # fragments sent fragment_delay steps ago land first
                self._stream_land(ev)
            for ev in s.events_at(self.t):
                self._stream_start(ev)
                if not self.p.fragment_delay:
                    self._stream_land(ev)
        elif s.scheme == "allreduce":
            for ev in s.events_at(self.t):
                self._allreduce(ev)
        elif s.scheme == "async":
            self._async_step(self.t)
        elif self.own_outer and self.t % self.own_outer == 0:  # scheme none with an outer step: nothing is sent
            rows = [b.to(torch.float32) for b in self.blocks]
            kernel.outer_each_(rows, None, self.outer, self.layout.offsets)
            for blk, new in zip(self.blocks, rows):
                if new is not blk:
                    blk.copy_(new.to(blk.dtype))
        elif s.scheme == "gossip":
            if self.overlap == "lockstep":
                self._lockstep(self.t)
            else:
                self._service()
                for ev in s.events_at(self.t):
                    if int(s.initiator[ev]) == self.rank:
                        self._start(ev)
                self._post_window()
            if plan_mod.slowmo_due(self.p, self.t):  # SlowMo: after this step's gossip, the
                self._drain(final=False, meet=False)  # merges due by now done on every rank, an exact average and the outer step
                self._allreduce(plan_mod.OUTER_AVERAGE, self.t, 1.0)
        self._t_last, self._wait_in_step = time.perf_counter(), self._wait_s

    @torch.no_grad()
    def finish(self) -> torch.nn.Module:
        """Complete every merge of the run (answering the peers that are still at it), then average every rank's
        model into the consensus model, in place on ``model``, which it returns; the same on every rank."""
        self._ended = "finish"
        if self._follower:
            self._sync_worker(force=True)
            self._let_lead_go()
            return self.model
        return self._leading(self._finish)

    def _finish(self) -> torch.nn.Module:
        if self.t < self.T and self._waits_for_every_rank():
            self._end_early()
        self._drain(final=True)
        self._settle_streams()
        if self._trace is not None:  # the job's end: its merges done, as the clock ends a run (run --against)
            self._write({"end": time.time(), "step": self.t, "total_steps": self.T})
        flat = self._flat().to(self.wire_dev)
        self._collective(lambda: dist.all_reduce(flat, group=self.group, async_op=True), "the final average")
        flat /= self.W
        for k, (blk, (o, n)) in enumerate(zip(self.blocks, self.layout.offsets)):
            blk.copy_(flat[o:o + n].view(1, -1).to(blk.dtype))
        self._release()
        if self.worker_group is not None:
            self._sync_worker(force=True)
        return self.model

    def _waits_for_every_rank(self) -> bool:
        """Whether a merge of this policy waits for every rank (an all-reduce, SlowMo's exact averages, lockstep
        gossip): then every rank calls step() as often as the others."""
        return self.sched.scheme == "allreduce" or self.overlap == "lockstep" or bool(self.p.outer_every)

    def _end_early(self) -> None:
        """finish() before total_steps, under a policy whose merges wait for every rank: the ranks tell each other
        at which step they end (their stop messages, :data:`EARLY` + step). All at this one: the run ends here on
        every rank (an early stop every rank takes), with new standing receives for the end. Otherwise one line
        naming the ranks and their steps, where a rank whose loader ran out first left the others at their next
        all-reduce, and every rank said "rank ? did not answer", or gloo aborted the process."""
        self._stop_out = self._send_stops(EARLY + self.t)
        deadline = time.perf_counter() + self.timeout
        missing = {r for r, (work, _) in self._stop_in.items() if not _done_by(work, deadline, self._waiting)}
        told = {r: float(buf[0]) for r, (work, buf) in self._stop_in.items() if r not in missing}
        if not missing and all(v == EARLY + self.t for v in told.values()):
            for work in self._stop_out:
                _done_by(work, deadline)
            self._stop_out = []
            for r in list(self._stop_in):  # the messages are spent: the end's own, as at the start
                self._post_stop(r)
            return
        for work in self._stop_out:
            _done_by(work, deadline)
        others = [f"rank {self._ranks([r])} after {int(v - EARLY)}" for r, v in sorted(told.items())
                  if v >= EARLY and v != EARLY + self.t]
        went_on = sorted(r for r, v in told.items() if v < EARLY)
        if went_on:
            others.append(f"rank{'s' * (len(went_on) > 1)} {self._ranks(went_on)} did not stop there")
        if missing:
            others.append(f"rank{'s' * (len(missing) > 1)} {self._ranks(missing)} did not answer")
        raise MergerError(f"this rank called finish() after {self.t} of {self.T} steps, {'; '.join(others)}: "
                          f"{EVERY_STEP}; stopped")

    def state_dict(self) -> dict:
        """The merge state at this step (after every merge due by now is done): with the model's and the optimiser's
        own state dicts, what a resumed run needs to go on as if it had never stopped. Call it on every rank at the
        same step."""
        if self._follower:
            return {"format": 1, "step": self.t, "follower": True}
        self._drain(final=False, meet=False)  # (not a meeting: a rank may save alone; waited for as it steps)
        self._settle_streams()
        return {"format": 1, "step": self.t, "rank": self.rank,
                "model": [[name, list(shape)] for name, shape in self.layout.layout],
                "streams": {int(ev): {"sum": self._in_flight[ev][1].clone().cpu(), "lands": land,
                                      "sent": {k: v.clone().cpu() for k, v in self._in_flight[ev][4].items()}}
                            for land, evs in self._landing.items() for ev in evs}, "world": self.W, "seed": self.seed, "total_steps": self.T,
                "policy": self.p.to_dict(), "examples": float(self.examples[0]), "epoch": self.epoch,
                "merges": self.merges, "score": float(self.score[0]), "score_weight": float(self.score_weight[0]),
                "accum": None if self.accum is None else [a.clone().cpu() for a in self.accum],
                "outer": None if self.outer is None else {"anchor": self.outer.anchor.clone().cpu(),
                                                          "momentum": self.outer.momentum.clone().cpu()},
                "public": None if self.public is None else {q: v.clone().cpu() for q, v in self.public.items()},
                "seq": self._seq, "next": dict(self._next),
                "local_steps": self.local_steps,
                "server": None if self.server is None else {
                    "global": self.server.glob.clone().cpu(), "pulled": self.server.pulled.clone().cpu(),
                    "momentum": self.server.momentum.clone().cpu(), "buffer": self.server.buffer.clone().cpu(),
                    "arrivals": self.server.arrivals}}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (on a Merger built with the same policy, seed, total_steps and world)."""
        if self._follower:
            self.t = int(state["step"])
            self._sync_worker(force=True)
            return
        self._leading(self._load_state_dict, state)

    def _load_state_dict(self, state: dict) -> None:
        try:  # this rank's checks; every rank learns of any rank's refusal (one refusing alone left the others on)
            self._same_as_saved(state)
            refused = None
        except ConfigError as e:
            refused = e
        self._same_step_on_every_rank(int(state["step"]), refused)
        self.t, self.epoch, self.merges = int(state["step"]), int(state["epoch"]), int(state["merges"])
        self._load_rest(state)

    def _same_as_saved(self, state: dict) -> None:
        """The checkpoint was saved by a Merger like this one: its world, seed, total_steps and policy (its name and
        description aside), its model's tensors, and this rank."""
        from .policy import what_merges

        for key, mine in (("world", self.W), ("seed", self.seed), ("total_steps", self.T),
                          ("policy", what_merges(self.p.to_dict()))):
            theirs = state.get(key)
            if key == "policy" and isinstance(theirs, dict):
                theirs = what_merges(theirs)
            if theirs == mine:
                continue
            if key == "policy" and isinstance(theirs, dict):  # name the fields, not two whole policies
                said = _differences(theirs, mine, "in the checkpoint")
                raise ConfigError("state_dict.policy", f"the checkpoint's policy differs from this Merger's: {said}; "
                                                       "allowed: the policy the checkpoint was saved with")
            raise ConfigError(f"state_dict.{key}", f"{theirs!r} differs from this Merger's {mine!r}; allowed: the "
                                                   f"{key} the checkpoint was saved with")
        self._same_model_as_saved(state)
        if getattr(self, "_start_sum", None) is not None and int(state.get("step", 0)) > 0 and \
                _checksum(self.blocks) == self._start_sum:
            raise ConfigError("load_state_dict", f"rank {self._ranks([self.rank])}'s model is rank 0's as the Merger "
                                                 "made it when it was built, not the one this rank saved: its state "
                                                 "was loaded before the Merger was built (which starts every rank from "
                                                 "rank 0's model), or not yet; allowed: build the Merger, then load "
                                                 "the model's, the optimiser's and the Merger's state dicts, in that "
                                                 "order")
        if state.get("rank", self.rank) != self.rank:  # (another rank's ran on with its public copies and counters)
            raise ConfigError("state_dict.rank", f"the checkpoint is rank {self._ranks([state['rank']])}'s; this is "
                                                 f"rank {self._ranks([self.rank])}; allowed: each rank's own "
                                                 "checkpoint (every rank saves its own state_dict, e.g. to "
                                                 "ck-{rank}.pt)")

    def _load_rest(self, state: dict) -> None:
        self.examples.fill_(float(state["examples"]))
        self.score.fill_(float(state["score"]))
        self.score_weight.fill_(float(state["score_weight"]))
        if self.accum is not None:
            for a, saved in zip(self.accum, state["accum"]):
                a.copy_(saved)
        if self.outer is not None:
            self.outer.anchor.copy_(state["outer"]["anchor"])
            self.outer.momentum.copy_(state["outer"]["momentum"])
        if state.get("local_steps", self.local_steps) != self.local_steps:
            raise ConfigError("state_dict.local_steps", f"{state.get('local_steps')!r} differs from this Merger's "
                                                        f"{self.local_steps!r} (its speeds)")
        if self.server is not None:  # asynchronous DiLoCo's server, and the pushes it has served by this step
            saved = state.get("server")
            if not isinstance(saved, dict):
                raise ConfigError("state_dict.server", "missing: not rank 0's state of an asynchronous DiLoCo run; "
                                                       "allowed: the state_dict rank 0 saved")
            for name, key in (("glob", "global"), ("pulled", "pulled"), ("momentum", "momentum"), ("buffer", "buffer")):
                getattr(self.server, name).copy_(saved[key])
            self.server.arrivals = int(saved["arrivals"])
            self._served = {q: sum(1 for ev in evs if int(self.sched.step[ev]) <= self.t)
                            for q, evs in self._pushes.items()}
        for ev, saved in (state.get("streams") or {}).items():  # fragments in flight at the checkpoint
            ev = int(ev)
            frag = self.fragments[int(self.sched.fragment[ev])] if self.fragments is not None else \
                list(range(len(self.blocks)))
            self._in_flight[ev] = (None, saved["sum"].to(self.wire_dev), frag, time.perf_counter(),
                                   {int(k): v.to(self.dev) for k, v in saved.get("sent", {}).items()})
            self._landing.setdefault(int(saved["lands"]), []).append(ev)
        self._done_in = {key for msgs in self._expect.values() for key in msgs if int(self.sched.step[key[0]]) <= self.t}
        self._came = set(self._done_in)
        if self.public is not None:  # delta payloads: the public copies, and where each sender's messages are
            for q, saved in state["public"].items():
                self.public[int(q)].copy_(saved)
            self._seq = int(state["seq"])
            self._next.update({int(q): int(n) for q, n in state["next"].items()})
        if self.overlap != "lockstep":
            self._post_window()
        if self.worker_group is not None:
            self._sync_worker(force=True)

    def _same_model_as_saved(self, state: dict) -> None:
        """The checkpoint's model is this Merger's, its tensors' shapes in order, as the start compares the ranks'
        (a model of other sizes failed in torch's copy_ with "The size of tensor a (9098) must match ..."); the
        names only word the line (torch.compile's and DDP's wrappers rename them)."""
        mine = [[name, list(shape)] for name, shape in self.layout.layout]
        saved = state.get("model")
        if saved is None:  # a checkpoint from before the model was saved with it: its sizes, where it has them
            flat = [(state.get("outer") or {}).get("anchor")] + list((state.get("public") or {}).values())
            sizes = {int(t.numel()) for t in flat if isinstance(t, torch.Tensor)}
            if not sizes or sizes == {self.P}:
                return
            said = f"{max(sizes - {self.P})} numbers in the checkpoint, {self.P} here"
        elif [list(shape) for _, shape in saved] == [shape for _, shape in mine]:
            return
        else:
            first = next(((a, b) for a, b in zip(saved, mine) if list(a[1]) != b[1]), None)
            said = (f"{first[0][0]!r} {tuple(first[0][1])} in the checkpoint, {first[1][0]!r} {tuple(first[1][1])} "
                    "here" if first is not None else f"{len(saved)} tensors in the checkpoint, {len(mine)} here")
        raise ConfigError("state_dict.model", f"the checkpoint's model differs from this Merger's: {said}; allowed: "
                                              "a checkpoint of this model")

    # -- a worker of several ranks -------------------------------------------------------------------------
    def _leading(self, call, *args):
        """``call`` on a worker's leader: if the run stops there, the worker's other ranks, which wait for the
        leader's flag, are told why (:meth:`_tell_worker`) before the leader raises."""
        if self.worker_group is None:
            return call(*args)
        try:
            return call(*args)
        except (MergerError, ConfigError) as e:
            if not getattr(e, "in_worker", False):  # a broadcast inside the worker failed: its ranks know already,
                self._tell_worker(str(e))         # and one more would meet another (the model's) on theirs
            raise

    def _tell_worker(self, line: str) -> None:
        """The leader's stop to its worker's other ranks: the flag :data:`WORKER_STOPPED`, then its line."""
        g, src = self.worker_group, self._leader
        text = torch.zeros(LINE_BYTES, dtype=torch.uint8)
        said = line.encode()[:LINE_BYTES] or b"?"
        text[:len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
        try:
            flag = torch.tensor([WORKER_STOPPED], device=self.wire_dev)
            self._in_worker(lambda: dist.broadcast(flag, src=src, group=g, async_op=True))
            text = text.to(self.wire_dev)
            self._in_worker(lambda: dist.broadcast(text, src=src, group=g, async_op=True))
        except MergerError:  # they are gone too: the leader's own line stands
            pass

    def _share_progress(self) -> None:
        """Inside this rank's worker, once: the leader tells its other ranks where it says that it waits (its Merger's
        keys in the store and its place among the leaders, :meth:`backends.progress.Progress.pulse`; 0: nowhere), so
        that they wait for its broadcast as long as it waits inside the Merger (at the end, for a slow worker), and
        name it once it has done neither for ``timeout``."""
        pr = None if self._follower else self._progress
        said = torch.tensor([0 if pr is None else pr.run, max(self.rank, 0)], dtype=torch.int64, device=self.wire_dev)
        self._in_worker(lambda: dist.broadcast(said, src=self._leader, group=self.worker_group, async_op=True))
        self._lead = None  # a follower's view of its leader's waits, and the leader's place
        if self._follower and int(said[0]):
            store = progress_mod.default_store()
            if store is not None:
                self._lead = (progress_mod.Progress(store, int(said[0]), -1, self.W, self.timeout), int(said[1]))

    def _let_lead_go(self) -> None:
        """A worker's other rank at its end: its view of its leader's waits is done (its store calls' thread ends)."""
        if getattr(self, "_lead", None) is not None:
            self._lead[0].close()
            self._lead = None

    def _waiting(self) -> None:
        """A worker's leader waits inside the Merger (a bounded wait): told to the store at most every beat, for its
        worker's other ranks (:meth:`_share_progress`)."""
        if self.worker_group is not None and self._progress is not None:
            self._progress.pulse()

    def _leader_waits(self) -> bool:
        """On a worker's other rank, waiting for its leader's broadcast: whether the leader has said within the last
        ``timeout`` that it waits inside the Merger (its waits are bounded: one that ends badly is told to this rank;
        the store is read at its pace)."""
        lead = getattr(self, "_lead", None)  # (None before the leader said where, and without a store)
        if lead is None:
            return False
        try:
            return lead[0].moving([lead[1]], "wait")
        except RuntimeError:  # the store is gone (with the process that held it)
            return False

    def _sync_worker(self, force: bool = False) -> None:
        """Inside this rank's worker: the leader says whether a merge changed its model since the last time (a
        one-float flag: 1 with ``force``; :data:`WORKER_STOPPED` when the leader stopped, its line after it), and if
        so broadcasts it; the others take it (and reset their optimiser's state where the policy resets the
        leader's on a merge). Within ``timeout``."""
        g, src = self.worker_group, self._leader
        flag = torch.tensor([float(force or self._version != self._synced)], device=self.wire_dev)
        self._in_worker(lambda: dist.broadcast(flag, src=src, group=g, async_op=True))
        if flag.item() == WORKER_STOPPED:
            text = torch.zeros(LINE_BYTES, dtype=torch.uint8, device=self.wire_dev)
            self._in_worker(lambda: dist.broadcast(text, src=src, group=g, async_op=True))
            line = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            raise MergerError(f"rank {src}, this worker's leader, stopped: {line}")
        if not flag.item():
            return
        self._synced = self._version
        flat = self._flat().to(self.wire_dev)
        self._in_worker(lambda: dist.broadcast(flat, src=src, group=g, async_op=True))
        if self._follower:
            for blk, (o, n) in zip(self.blocks, self.layout.offsets):
                blk.copy_(flat[o:o + n].view(1, -1).to(blk.dtype))
        if not force and (self._opt_keys or self._opt_steps):  # averaged state: the leader's, as its model
            opt = self._opt_flat().to(self.wire_dev)
            self._in_worker(lambda: dist.broadcast(opt, src=src, group=g, async_op=True))
            if self._follower:
                self._set_opt_flat(opt.to(self.dev))
        if self._follower:
            if not force and self.p.optimizer_state == "reset":
                for t in self.tensors[:self.layout.n_trained_blocks]:
                    self.optimizer.state.pop(t, None)

    def _in_worker(self, start) -> None:
        """A collective inside this rank's worker, to completion within ``timeout``, else one line naming the
        worker's ranks."""
        try:
            work = start()
            t0 = time.perf_counter()
            while not work.is_completed():
                waits = self._follower and self._leader_waits()  # (its leader waits for others: so does it)
                if time.perf_counter() - t0 > self.timeout and not waits:
                    ranks = dist.get_process_group_ranks(self.worker_group)
                    raise _in_worker_error(f"the ranks of worker {ranks} did not all answer for {self.timeout:g} s "
                                           f"(step {self.t}); stopped")
                time.sleep(0.0005)
            work.wait()
        except MergerError:  # (its own line above: not wrapped in "is gone (...)" again)
            raise
        except RuntimeError as e:
            ranks = dist.get_process_group_ranks(self.worker_group)
            raise _in_worker_error(f"a rank of worker {ranks} is gone (step {self.t}: {str(e).splitlines()[0]}); "
                                   "stopped") from None

    # -- state ---------------------------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([b.reshape(-1).to(torch.float32) for b in self.blocks])

    # the optimiser's state, with optimizer_state = "average": its tensors, then its step counts (float64 bits)
    def _state(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """The optimiser's ``key`` state of parameter ``t``, made (zeros, as a fresh optimiser's) if missing."""
        st = self.optimizer.state[t]
        if not st:  # before its first step (e.g. a GradScaler skipped it): a fresh state
            if self._opt_steps:
                st["step"] = torch.zeros((), dtype=torch.float32)
            for k in self._opt_keys:
                st[k] = torch.zeros_like(t, memory_format=torch.preserve_format)
        if st.get(key) is None:
            st[key] = torch.zeros_like(t, memory_format=torch.preserve_format)
        return st[key]

    def _opt_size(self) -> int:
        n_tr = self.layout.n_trained_blocks
        return len(self._opt_keys) * sum(n for _, n in self.layout.offsets[:n_tr]) + (2 * n_tr if self._opt_steps else 0)

    def _opt_flat(self) -> torch.Tensor:
        trained = self.tensors[:self.layout.n_trained_blocks]
        parts = [self._state(t, k).reshape(-1).to(torch.float32) for k in self._opt_keys for t in trained]
        if self._opt_steps:
            steps = torch.tensor([float(self._state(t, "step")) for t in trained], dtype=torch.float64)
            parts.append(steps.view(torch.float32).to(self.dev))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.dev)

    def _opt_merge(self, flat: torch.Tensor, weights, move: float) -> None:
        """Lerp the optimiser's state towards ``flat`` (another's :meth:`_opt_flat`) with the parameters' weights
        (a column, or one tensor per block); step counts by the weight, or by the move when the weights are per
        coordinate (the engine's ``Optimizer.merge_pairs``)."""
        trained, at = self.tensors[:self.layout.n_trained_blocks], 0
        for key in self._opt_keys:
            for k, t in enumerate(trained):
                n = t.numel()
                kernel.lerp_rows_(self._state(t, key).view(1, -1), [0], [flat[at:at + n].to(t.dtype)],
                                  weights[k] if isinstance(weights, list) else weights)
                at += n
        if self._opt_steps:
            w = move if isinstance(weights, list) else float(weights.reshape(-1)[0])
            theirs = flat[at:at + 2 * len(trained)].contiguous().view(torch.float64).tolist()
            for t, x in zip(trained, theirs):
                step = self._state(t, "step")
                step.fill_(float(step) + w * (x - float(step)))

    def _opt_average(self, supports: torch.Tensor | None, weight: float, reduce_) -> None:
        """All-reduce: the optimiser's state moves ``weight`` towards every rank's (support-weighted) average, its
        step counts towards their mean (the engine's ``Optimizer.merge_all``)."""
        trained = self.tensors[:self.layout.n_trained_blocks]
        n = sum(t.numel() for t in trained)
        w = torch.full((1, 1), float(weight), device=self.dev)
        for key in self._opt_keys:
            x = torch.cat([self._state(t, key).reshape(-1).to(torch.float32) for t in trained]).unsqueeze(0)
            avg = kernel.reduced_average(x, None if supports is None else supports[:, :n], reduce_, self.W)[0]
            at = 0
            for t in trained:
                kernel.lerp_rows_(self._state(t, key).view(1, -1), [0], [avg[at:at + t.numel()].to(t.dtype)], w)
                at += t.numel()
        if self._opt_steps:
            steps = torch.tensor([float(self._state(t, "step")) for t in trained], dtype=torch.float64,
                                 device=self.dev)
            total = steps.clone()
            reduce_(total)
            for t, old, mean in zip(trained, steps.tolist(), (total / self.W).tolist()):
                self._state(t, "step").fill_(old + weight * (mean - old))

    def _delta_average(self, ev: int, sent: list) -> tuple[torch.Tensor, None, torch.Tensor]:
        """All-reduce with delta payloads (uniform weighting): this rank's change since its public copy, compressed
        (the engine's noise: side = the rank), moves its copy; every rank's encoded change is all-gathered and
        added to the sum of the copies. Returns their average, and what counters become: the sum of every rank's
        counters as they are, which go with the change uncompressed (as the engine sums its rows', and a gossip
        payload carries them; they went through the compression, and scaled sign left BatchNorm's at 0)."""
        p, mine, total = self.p, self.public[self.rank], self.public[-1]
        gen = plan_mod.quant_generator(self.seed, ev, self.rank) if p.quantize_bits else None
        enc = ops.encode(kernel.delta_to_send(self._flat(), mine, self._unsent), p.topk_fraction, p.quantize_bits, gen)
        own = ops.decode(enc, self.P, p.topk_fraction, p.quantize_bits)
        mine += own
        counters = [self.blocks[k].reshape(-1).to(torch.float32) for k in self._counter_blocks]
        packed = torch.cat([self._pack(enc).to(self.dev), *counters]).to(self.wire_dev)
        every = [torch.empty_like(packed) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, packed, group=self.group, async_op=True), f"merge event {ev}")
        if self.outer is not None:  # compressed outer gradients: the anchor plus the mean of what every rank sent
            total = torch.zeros_like(mine)  # (kernel.outer_gradient_targets, averaged)
        for q in range(self.W):  # in rank order; this rank's own change is decoded once
            total += own if q == self.rank else ops.decode(self._unpack(every[q]), self.P, p.topk_fraction,
                                                            p.quantize_bits)
        sent[0] += packed.numel() * packed.element_size()
        counts = torch.zeros_like(mine)  # only the counters' places are read
        if counters:
            summed, at = torch.stack([e[self._nw:] for e in every]).to(self.dev).sum(0), 0
            for k in self._counter_blocks:
                o, n = self.layout.offsets[k]
                counts[o:o + n], at = summed[at:at + n], at + n
        if self.outer is not None:
            return self.outer.anchor + total / self.W, None, counts
        return total / self.W, None, counts

    def _set_opt_flat(self, flat: torch.Tensor) -> None:
        """Take another's optimiser state as it is (inside a worker, from its leader)."""
        trained, at = self.tensors[:self.layout.n_trained_blocks], 0
        for key in self._opt_keys:
            for t in trained:
                self._state(t, key).view(-1).copy_(flat[at:at + t.numel()])
                at += t.numel()
        if self._opt_steps:
            for t, x in zip(trained, flat[at:].contiguous().view(torch.float64).tolist()):
                self._state(t, "step").fill_(x)

    def _broadcast_start(self) -> None:
        before = _checksum(self.blocks) if self.rank != 0 else None  # (on the model's own device, block by block)
        flat = self._flat().to(self.wire_dev)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._collective(lambda: dist.broadcast(flat, src=src, group=self.group, async_op=True), "the start")
        for blk, (o, n) in zip(self.blocks, self.layout.offsets):
            blk.copy_(flat[o:o + n].view(1, -1).to(blk.dtype))
        # where the start replaced this rank's model with rank 0's: the model as it made it, for a resume to tell a
        # model restored before the Merger was built (replaced here in silence: the resumed run went otherwise)
        after = _checksum(self.blocks) if before is not None else None
        self._start_sum = after if after is not None and after != before else None

    def _gather_squares(self, optimizer, args, kwargs) -> None:
        """The optimiser's step hook (``adaptive`` weighting): the squared gradients it just used, summed."""
        for a, t in zip(self.accum, self.tensors):
            if t.grad is not None:
                a.addcmul_(t.grad.view(1, -1).float(), t.grad.view(1, -1).float())

    def _payload(self, ev: int, kind: int, winner: int | None = None) -> torch.Tensor:
        """This rank's message for ``(ev, kind)`` as one flat float32 tensor (a snapshot: later steps do not change
        it): its model, or with delta payloads its encoded change since its public copy (which moves by what is
        sent: error feedback keeps the rest) and its counters as they are; then the scalars; then the
        accumulators. ``winner``: the winner the peer found, sent with a push-pull answer."""
        score = float(self.score[0])
        if self._hx is not None and kind == REQUEST:  # the winner test: this model's loss on the pair's holdouts
            score = self._holdout_loss(self.rank, int(self.sched.peer[ev]))
        meta = torch.tensor([float(self.examples[0]), float(self.epoch), score,
                             -1.0 if winner is None else float(winner), float(self._seq)], dtype=torch.float64,
                            device=self.dev)
        if self.delta:
            p, mine = self.p, self.public[self.rank]
            gen = plan_mod.quant_generator(self.seed, ev, 0 if kind == REQUEST else 1) if p.quantize_bits else None
            enc = ops.encode(kernel.delta_to_send(self._flat(), mine, self._unsent), p.topk_fraction, p.quantize_bits, gen)
            mine += ops.decode(enc, self.P, p.topk_fraction, p.quantize_bits)
            parts = [self._pack(enc).to(self.dev), meta.view(torch.float32)]
            parts += [self.blocks[k].reshape(-1).to(torch.float32) for k in self._counter_blocks]
        else:
            parts = [b.reshape(-1).to(torch.float32) for b in self.blocks] + [meta.view(torch.float32)]
        if self.accum is not None:
            parts += [a.reshape(-1) for a in self.accum]
        if self._opt_keys or self._opt_steps:
            parts.append(self._opt_flat())
        self._seq += 1
        return torch.cat(parts).to(self.wire_dev)  # one copy (and one transfer to the host under gloo)

    def _size(self) -> int:
        return self._at_meta() + META + self._n_counters + (self.P if self.accum is not None else 0) + \
            (self._opt_size() if self._opt_keys or self._opt_steps else 0)

    def _at_meta(self) -> int:
        return self._nw if self.delta else self.P

    def _meta(self, buf: torch.Tensor) -> list[float]:
        o = self._at_meta()
        return buf[o:o + META].clone().view(torch.float64).tolist()

    def _take_request(self, ev: int, buf: torch.Tensor) -> None:
        """This rank is the peer of ``ev`` and its initiator's payload came: the winner test on the running scores
        (or both models' losses on the pair's holdouts), the answer (push-pull: this rank's state before it moves, with
        the winner), the merge."""
        a = int(self.sched.initiator[ev])
        winner = None
        if self.p.winner_bias > 0:
            mine = self._holdout_loss(a, self.rank) if self._hx is not None else float(self.score[0])
            winner = plan_mod.winner(self._meta(buf)[2], mine)
        if self.p.exchange == "push_pull":
            self._send(ev, REPLY, winner)
        self._merge(ev, buf, self._moves(ev, winner)[1], a)

    def _take_reply(self, ev: int, buf: torch.Tensor) -> None:
        """This rank started ``ev`` (push-pull) and the answer came, with the winner its peer found."""
        w = self._meta(buf)[3]
        self._merge(ev, buf, self._moves(ev, None if w < 0 else int(w))[0], int(self.sched.peer[ev]))

    def _merge(self, ev: int, buf: torch.Tensor, move: float, src: int) -> None:
        """Merge the payload ``buf`` of event ``ev`` from rank ``src`` with move ``move``, by the kernel and the
        policy's weighting (delta payloads: with ``src``'s public copy, and its counters as they were)."""
        P, lay = self.P, self.layout
        at = self._at_meta() + META
        if self.delta:
            row = self.public[src].clone()
            for k in self._counter_blocks:
                o, n = lay.offsets[k]
                row[o:o + n] = buf[at:at + n].to(self.dev)
                at += n
        else:
            row = buf[:P].to(self.dev)
        ex_in, ep_in, score_in = self._meta(buf)[:3]
        if self.p.score == "running":
            self.score[0] = kernel.merged_score(float(self.score[0]), score_in, move)
        factor = kernel.support_factor(self.epoch - int(ep_in))  # the sender's supports on this rank's scale
        ex_in *= factor
        acc_in = None
        if self.accum is not None:
            flat = buf[at:at + P].to(self.dev) * factor
            acc_in = [flat[o:o + n].view(1, -1) for o, n in lay.offsets]
        st = SimpleNamespace(examples=self.examples, params=SimpleNamespace(device=self.dev),
                             accum=SimpleNamespace(blocks=self.accum))
        weights = self.weighting.incoming_weights(st, [move], np.array([0]), [ex_in], acc_in)
        blocks = self.blocks
        kernel.receive_(blocks, None, self.rules, lay.offsets, [0],
                        lambda k, o, n: [row[o:o + n].to(blocks[k].dtype)], weights)
        if self._opt_keys or self._opt_steps:  # optimizer_state = "average": the state moves as the parameters did
            o = at + (P if self.accum is not None else 0)
            self._opt_merge(buf[o:o + self._opt_size()].to(self.dev), weights, move)
        self.examples += ex_in  # supports are summed on merge (VW), as the engine's counters
        if acc_in is not None:
            for a, s in zip(self.accum, acc_in):
                a.add_(s)
        if kernel.rescale_supports(self.examples, None):
            self.epoch += 1
            if self.accum is not None:
                for a in self.accum:
                    a.mul_(1.0 / kernel.SUPPORT_LIMIT)
        if self.p.optimizer_state == "reset":
            for t in self.tensors[:lay.n_trained_blocks]:
                self.optimizer.state.pop(t, None)  # a fresh state at the next step, as a new optimiser's
        self.merges += 1
        self._version += 1

    def _moves(self, ev: int, winner: int | None) -> tuple[float, float]:
        step = int(self.sched.step[ev])
        return plan_mod.moves(self.p, plan_mod.scheduled_weight(self.p, step, self.T), float(self.sched.u[ev]), winner)

    # -- messages ------------------------------------------------------------------------------------------
    def _fan_out(self) -> list[set[int]]:
        """Per rank, the ranks its messages go to: with delta payloads every rank that ever receives from it (its
        topology neighbours, which hold its public copy); with weights only the event's receiver (see _dests)."""
        s, W = self.sched, self.W
        fan = [set() for _ in range(W)]
        for a, b in zip(s.initiator.tolist(), s.peer.tolist()):
            fan[a].add(b)
            if self.p.exchange == "push_pull":
                fan[b].add(a)
        if self.delta and s.topology is not None:
            for q in range(W):
                fan[q] |= {int(n) for n in s.topology.neighbours(q)}
        for q in range(W):
            fan[q].discard(q)
        return fan

    def _dests(self, ev: int, kind: int) -> list[int]:
        """Where this rank's message of ``(ev, kind)`` goes."""
        s = self.sched
        if self.delta:
            return sorted(self._fan[self.rank])
        return [int(s.peer[ev]) if kind == REQUEST else int(s.initiator[ev])]

    def _messages(self, src: int, dst: int) -> list[tuple[int, int]]:
        """The messages ``(event, kind)`` that rank ``src`` sends to rank ``dst``, in event order, without the
        answers to ``dst``'s own events (those are posted when ``dst`` starts them)."""
        s = self.sched
        if self.delta:
            if dst not in self._fan[src]:
                return []
            req = s.initiator == src
            rep = (s.peer == src) & (s.initiator != dst) if self.p.exchange == "push_pull" else np.zeros(len(s), bool)
        else:
            req, rep = (s.initiator == src) & (s.peer == dst), np.zeros(len(s), bool)
        out = [(int(e), REQUEST) for e in np.flatnonzero(req)] + [(int(e), REPLY) for e in np.flatnonzero(rep)]
        return sorted(out)

    def _src(self, ev: int, kind: int) -> int:
        return int(self.sched.initiator[ev]) if kind == REQUEST else int(self.sched.peer[ev])

    def _pack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """A delta's encoded parts (``ops.encode``) as float32 slots: their bytes, padded."""
        raw = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in parts])
        pad = 4 * self._nw - raw.numel()
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        return raw.view(torch.float32)

    def _unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`_pack`'s parts again, on this rank's device (only the encoded slots of a message move there)."""
        raw = buf[:self._nw].to(self.dev).contiguous().view(torch.uint8)
        out, at = [], 0
        for (shape, dt), n in zip(self._spec, self._spec_bytes):
            out.append(raw[at:at + n].clone().view(dt).view(shape))
            at += n
        return out

    def _tag(self, ev: int, kind: int) -> int:
        return (ev * 2 + kind) % STOP_TAG

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _ranks(self, rs) -> str:
        """Ranks ``rs`` of the merges' group as a line names them: their global ranks (torchrun's), and with
        ``worker_group`` the worker each leads (``2 (worker 1)``)."""
        return ", ".join(f"{self._global(r)}{f' (worker {r})' if self.worker_group is not None else ''}"
                         for r in sorted(rs)) or "?"

    def _send(self, ev: int, kind: int, winner: int | None = None) -> None:
        """This rank's message of ``(ev, kind)`` to where it goes (:meth:`_dests`)."""
        buf = self._payload(ev, kind, winner)
        for to in self._dests(ev, kind):
            sent_at = time.time()  # before the message can go (the trace's wall clock)
            try:
                work = self._pend(dist.isend(buf, self._global(to), group=self.group, tag=self._tag(ev, kind)), peer=to)
            except RuntimeError as e:
                raise self._gone(to, ev, e) from None
            self._sending.append((work, buf, ev, time.perf_counter(), to))
            self._trace_transfer("send", ev, to, buf, t=sent_at)

    def _post(self, ev: int, kind: int, src: int, size: int | None = None) -> None:
        if (ev, kind) not in self._posted:
            buf = torch.empty(self._size() if size is None else size, dtype=torch.float32, device=self.wire_dev)
            try:
                work = self._pend(dist.irecv(buf, self._global(src), group=self.group, tag=self._tag(ev, kind)),
                                  peer=src)
            except RuntimeError as e:
                raise self._gone(src, ev, e) from None
            self._posted[(ev, kind)] = (work, buf, time.perf_counter())

    def _post_window(self) -> None:
        """Post the receives of each sender's next :data:`WINDOW` messages not applied yet."""
        for q, msgs in self._expect.items():
            i = self._cursor[q]
            while i < len(msgs) and msgs[i] in self._came:
                i += 1
            self._cursor[q] = i
            n = 0
            for key in msgs[i:]:
                if key in self._came:
                    continue
                self._post(key[0], key[1], q)
                n += 1
                if n >= WINDOW:
                    break

    def _arrived(self, ev: int, kind: int, src: int, buf: torch.Tensor) -> None:
        """A message has come: with weights, applied now; with delta payloads, applied in its sender's order (each
        delta moves the sender's public copy here, and the receiver of the event merges with that copy)."""
        self._came.add((ev, kind))
        if not self.delta:
            self._apply(ev, kind, buf)
            return
        self._held[src][int(self._meta(buf)[4])] = (ev, kind, buf)
        while self._next[src] in self._held[src]:
            e, k, b = self._held[src].pop(self._next[src])
            self._next[src] += 1
            self.public[src] += ops.decode(self._unpack(b), self.P, self.p.topk_fraction, self.p.quantize_bits)
            self._apply(e, k, b)

    def _apply(self, ev: int, kind: int, buf: torch.Tensor) -> None:
        s, r = self.sched, self.rank
        if kind == REQUEST and int(s.peer[ev]) == r:
            self._take_request(ev, buf)
        elif kind == REPLY and int(s.initiator[ev]) == r:
            self._take_reply(ev, buf)
            self._await_reply.pop(ev, None)
        self._done_in.add((ev, kind))

    def _ready(self, ev: int, kind: int, peer: int) -> torch.Tensor | None:
        """The payload of ``(ev, kind)`` if it has arrived (raises MergerError if the peer is gone)."""
        work, buf, t0 = self._posted[(ev, kind)]
        try:
            if not work.done():
                return None
        except RuntimeError as e:
            raise self._gone(peer, ev, e) from None
        del self._posted[(ev, kind)]
        if self._trace is not None:  # wall-clock times: when the receive was posted and when the payload came
            seconds = time.perf_counter() - t0
            self._trace_transfer("recv", ev, peer, buf, seconds, posted=time.time() - seconds, arrived=work.finished_at)
        return buf

    def _wait(self, ready, what: tuple, awaited=None) -> Any:
        """Call ``ready()`` until it returns something, answering peers meanwhile (not in lockstep); at most
        ``timeout`` seconds. ``what``: (what is waited on, the rank that must answer: a callable is asked when
        the time is up), for the error. ``awaited``: a callable giving the ranks waited for, where they may be far
        behind (the run's end, a checkpoint): then the wait goes on while each of them still steps (has told a new
        step within the last ``timeout``, :mod:`backends.progress`)."""
        t0, pause = time.perf_counter(), 0.0
        pr = self._progress if awaited is not None else None
        t_watch, t_prev = -float("inf"), t0
        served = 0.0  # (the payloads applied meanwhile: this rank's own work, not a wait)
        while True:
            out = ready()
            if out is not None:
                self._wait_s += time.perf_counter() - t0 - served
                return out
            if self.overlap != "lockstep" and not self._closing:
                t_s = time.perf_counter()
                self._service()
                served += time.perf_counter() - t_s
            self._check_stops(what[0])
            self._waiting()
            try:
                now = time.perf_counter()
                if pr is not None and now - t_watch >= pr.poll_every:  # (the ranks waited for, at the store's pace)
                    pr.watch(awaited())
                    t_watch = now
                    if self._waited is None or self._waited[0] != self.t:  # (the ranks' steps when this rank's waits
                        self._waited = [self.t, {r: pr.told(r) for r in range(self.W)}, False, 0.0]  # at it began)
                late = now - t0 > self.timeout and not (pr is not None and pr.moving(awaited()))
            except RuntimeError:  # the store is gone (with the process that held it)
                raise self._fail(what[0]) from None
            if pr is not None:  # the seconds this rank has waited for ranks far behind, at this step
                self._waited[3] += now - t_prev
                t_prev = now
                if not late and not self._waited[2] and self._waited[3] > self.timeout:
                    self._waited[2] = self._note_waiting(what[0], self._waited[3], awaited(), self._waited[1])
            if late:
                out = ready()  # (what the service above applied may have been the last of it)
                if out is not None:
                    self._wait_s += time.perf_counter() - t0 - served
                    return out
                # a pair's peer; else (the end, a checkpoint, a collective) every rank: the late are those still stepping
                peer = what[1]() if callable(what[1]) else what[1]
                raise self._fail(what[0], f"for {self.timeout:g} s", said=_timed_out(peer))
            pause = min(0.002, pause + 0.0001)
            time.sleep(pause)

    def _note_waiting(self, where, waited: float, ranks, first: dict) -> bool:
        """Once where this rank's waits at one step for ranks far behind (at the end, a checkpoint) add up to more
        than ``timeout`` because those ranks still step: a warning naming them and their steps, at the line of the
        user's loop that called in (the rank waited in silence for as long as the slowest took). Said only of ranks
        seen stepping since this rank's waits at this step began."""
        pr, ranks = self._progress, sorted(ranks)
        now = {r: pr.told(r) for r in ranks}
        if not ranks or any(now[r] is None or first.get(r) is None or now[r] <= first[r] for r in ranks):
            return False
        steps = ", ".join(f"{now[r]}" for r in ranks)
        many = len(ranks) > 1
        warnings.warn(f"rank {self._global(self.rank)} has waited {waited:.0f} s at {where} for rank{'s' * many} "
                      f"{self._ranks(ranks)}, still stepping (step{'s' * many} {steps} of {self.T}): it waits on while "
                      f"{'they step' if many else 'it steps'}; a rank silent for the timeout ({self.timeout:g} s) "
                      "is named and stops the run", stacklevel=_callers_level())
        return True

    def _gone(self, peer: int, ev, e: Exception) -> MergerError:
        """A message to or from ``peer`` failed (its connection closed): find who is gone, tell the others."""
        return self._fail(ev)

    def _stopped(self) -> dict[int, float | None]:
        """The ranks that sent their stop message (what it said) or whose connection closed (None)."""
        out: dict[int, float | None] = {}
        for r, (work, buf) in self._stop_in.items():
            try:
                # it stopped, or its process is ending (LEFT), or it ended early at a step this rank has gone past
                # (EARLY + that step: up to it, it took part in every merge this rank waits for)
                said = float(buf[0]) if work.done() else 0.0
                if said != 0.0 and not (said >= EARLY and self.t <= said - EARLY):
                    out[r] = said
            except RuntimeError:
                out[r] = None
        return out

    def _check_stops(self, where, waiting: bool = True) -> None:
        """Raise (after the roll call) if another rank sent its stop message or its connection closed."""
        if self._stopped():
            raise self._fail(where, said=TOLD_WAITING if waiting else TOLD_STEPPING)

    def _fail(self, where, how: str = "", said: float = TOLD_WAITING) -> MergerError:
        """A rank died or hangs: every rank that finds out sends its stop message to all others (which makes them
        find out too), then waits, at most ``timeout``, for every other rank's; those that never send it, or whose
        connection closed, are the ones named. ``where``: a merge event, or words. ``how``: this rank's own wait ran
        out. ``said``: its stop message (:func:`_timed_out`, or told while it waited or stepped); where every rank
        answers the roll call after all, the ranks waited for are named as late (slower than the timeout allows),
        not as gone ("rank ? did not answer" on every rank)."""
        if not self._stop_out:
            self._said_stop = said
            self._stop_out = self._send_stops(said)
        deadline = time.perf_counter() + self.timeout
        # those that never sent theirs, or whose connection closed
        missing = {r for r, (work, _) in self._stop_in.items() if not _done_by(work, deadline, self._waiting)}
        left = {r for r, (work, buf) in self._stop_in.items() if r not in missing and float(buf[0]) == LEFT}
        # the stop messages out before this rank leaves: a caller that ends its process at once (os._exit, as a
        # broken process group asks) would otherwise drop a message still queued, and a rank that is alive would be
        # named by the others' roll calls
        for work in self._stop_out:
            _done_by(work, deadline)
        who = self._ranks(missing | left)
        place = where if isinstance(where, str) else f"merge event {where}"
        early = {r: int(float(buf[0]) - EARLY) for r, (work, buf) in self._stop_in.items()
                 if r not in missing and float(buf[0]) >= EARLY}
        if early and not missing:  # a rank's loader ran out first: it called finish() (_end_early)
            said = ", ".join(f"rank {self._ranks([r])} called finish() after {n}" for r, n in sorted(early.items()))
            return MergerError(f"{said} of {self.T} steps, and this rank is at local step {self.t}"
                               f"{f' ({place})' if place else ''}: {EVERY_STEP}; stopped")
        # (the step of the rank that says it, named: the named rank's is not known here; "local step 42" read as where
        # rank 1 left, and a leader's line is passed on word for word to its worker's other ranks)
        me = f"rank {self._ranks([self.rank])} at local step {self.t}"
        place = f"{place}, {me}" if place else me
        if left and not missing:
            return MergerError(f"rank {who} left the run without finish() or close() ({place}); stopped")
        if not missing:  # every rank answered: a wait ran out for ranks that came after all
            late = self._late({r: float(buf[0]) for r, (work, buf) in self._stop_in.items()})
            if late:
                return MergerError(f"rank {self._ranks(late)} did not answer for {self.timeout:g} s ({place}) and "
                                   "answered later: slower than the timeout allows, not gone (a longer timeout lets "
                                   "it finish); stopped")
            if how or any(float(buf[0]) <= TIMED_OUT for _, buf in self._stop_in.values()):  # (it came just after)
                return MergerError(f"a rank did not answer for {self.timeout:g} s ({place}), and every rank answered "
                                   "later: one slower than the timeout allows, not gone (a longer timeout lets it "
                                   "finish); stopped")
        return MergerError(f"rank {who} did not answer{' ' + how if how else ''} ({place}); stopped")

    def _late(self, said: dict[int, float]) -> set[int]:
        """From every rank's stop message (``said``, and this rank's own): the ranks some rank's wait ran out for, where
        all of them answered the roll call. A wait for one rank names it; a collective's wait names the ranks told to
        stop while they stepped (they had not come to it yet)."""
        said = {**said, self.rank: getattr(self, "_said_stop", TOLD_WAITING)}
        late = {int(TIMED_OUT - 1 - v) for v in said.values() if v < TIMED_OUT}
        if any(v == TIMED_OUT for v in said.values()):
            late |= {r for r, v in said.items() if v == TOLD_STEPPING}
        late = {r for r in late if 0 <= r < self.W}
        stepping = {r for r in late if said.get(r) == TOLD_STEPPING}  # (a rank named that itself waited for one behind it)
        return stepping or late

    def _sent(self, work: _Pending, ev: int, to: int) -> bool | None:
        try:
            return True if work.done() else None
        except RuntimeError as e:
            raise self._gone(to, ev, e) from None

    def _reap_sends(self) -> None:
        keep = []
        for work, buf, ev, t0, to in self._sending:
            try:
                done = work.done()
            except RuntimeError as e:
                raise self._gone(to, ev, e) from None
            if not done:
                keep.append((work, buf, ev, t0, to))
        self._sending = keep

    # -- gossip ----------------------------------------------------------------------------------------------
    def _lockstep(self, step: int) -> None:
        """The lockstep world: this rank's events at ``step``, in schedule order, each waited for."""
        s, r = self.sched, self.rank
        push_pull = self.p.exchange == "push_pull"
        for ev in s.events_at(step):
            a, b = int(s.initiator[ev]), int(s.peer[ev])
            if r == a:
                if push_pull:
                    self._post(ev, REPLY, b)
                self._send(ev, REQUEST)
                if push_pull:
                    self._take(ev, REPLY, b)
                continue
            if r == b:
                self._take(ev, REQUEST, a)  # which answers first in push-pull
            elif self.delta:  # a rank that keeps the public copies of a (and b): their fan-out
                if r in self._fan[a]:
                    self._take(ev, REQUEST, a)
                if push_pull and r in self._fan[b]:
                    self._take(ev, REPLY, b)
        self._reap_sends()

    def _take(self, ev: int, kind: int, src: int) -> None:
        """Lockstep: wait for the message of ``(ev, kind)`` from ``src`` and apply it."""
        self._post(ev, kind, src)
        self._arrived(ev, kind, src, self._wait(lambda: self._ready(ev, kind, src), (ev, src)))

    def _start(self, ev: int) -> None:
        """This rank starts event ``ev`` (it is the initiator): its payload goes out; blocking, it waits."""
        b = int(self.sched.peer[ev])
        push_pull = self.p.exchange == "push_pull"
        if push_pull:
            self._post(ev, REPLY, b)
            self._await_reply[ev] = time.perf_counter()
        self._send(ev, REQUEST)
        if self.overlap == "blocking":
            if push_pull:
                self._wait(lambda: None if ev in self._await_reply else True, (ev, b))
            else:
                work = self._sending[-1][0]
                self._wait(lambda: self._sent(work, ev, b), (ev, b))

    def _service(self) -> None:
        """Apply every payload that has arrived: requests (answered first in push-pull) and answers; under
        asynchronous DiLoCo, rank 0 serves the pushes that have arrived."""
        if self.sched.scheme == "async":
            if self.server is not None and not self._closing:
                self._serve_arrived(self._cap)
            self._reap_sends()
            return
        for (ev, kind) in sorted(self._posted):
            if (ev, kind) not in self._posted:
                continue
            src = self._src(ev, kind)
            buf = self._ready(ev, kind, src)
            if buf is not None:
                self._arrived(ev, kind, src, buf)
        self._post_window()
        self._reap_sends()

    def _drain(self, final: bool, meet: bool = True) -> None:
        """Wait until every gossip event of this rank due by now is done, answering peers meanwhile. At the end
        (``final``), the ranks first tell each other how many steps they did: events after a rank's last step
        never happen."""
        s = self.sched
        if s.scheme == "async":
            self._async_drain(final, meet)
            return
        if s.scheme != "gossip" or self.overlap == "lockstep":
            self._flush_sends()
            return
        last = self._last = self._last_steps(final, meet)
        due = [(q, key) for q, msgs in self._expect.items() for key in msgs if key not in self._came
               and int(s.step[key[0]]) <= int(last[int(s.initiator[key[0]])])]
        for q, (ev, kind) in due:
            self._post(ev, kind, q)
        pending = {key for _, key in due} | {(e, k) for held in self._held.values() for e, k, _ in held.values()}
        s_peer = s.peer

        def senders() -> set[int]:  # the ranks still to answer: a slow one is waited for while it steps
            return ({self._src(ev, kind) for ev, kind in pending - self._done_in}
                    | {int(s_peer[ev]) for ev in self._await_reply})

        self._wait(lambda: True if not (pending - self._done_in) and not self._await_reply else None,
                   (f"merges due by step {self.t}", None), awaited=senders)
        self._flush_sends()

    def _last_steps(self, final: bool, meet: bool = True) -> torch.Tensor:
        """Every rank's last step: at the end (``final``) the ranks tell each other (answering peers while the
        others get there); otherwise every rank is at this one. With the ranks' progress told (``_progress``) they
        meet in the store, at the end and at a checkpoint (``meet``), waiting for a slow rank as long as it steps."""
        if self._progress is not None and (final or meet):
            steps = self._meet("the end of the run" if final else f"the checkpoint at step {self.t}", final)
            if final:
                return torch.tensor(steps, dtype=torch.int64)
        if not final:
            return torch.full((self.W,), self.t, dtype=torch.int64)
        mine = torch.tensor([self.t], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.W)]
        work = dist.all_gather(out, mine, group=self.group, async_op=True)
        self._wait(lambda: True if work.is_completed() else None, ("the end of the run", None))
        try:
            work.wait()
        except RuntimeError:  # a rank's connection closed
            raise self._fail("the end of the run") from None
        return torch.cat(out)

    def _meet(self, what: str, final: bool) -> list[int]:
        """Every rank's step, once every rank has said it in the store (:meth:`backends.progress.Progress.arrive`),
        answering peers meanwhile; a rank not there yet is waited for while it steps, and named once it has not for
        ``timeout``. Each says how it ends (``final``: finish(), else close()): ranks that end otherwise than this one,
        or close() at other steps, stop every rank with one line (they paired at one meeting, then met in different
        collectives)."""
        pr, got, polled = self._progress, {}, [0.0, 0.001]  # (when the store was last read, the pause before the next)
        try:
            n = pr.arrive(2 * self.t + int(final))
        except RuntimeError:
            raise self._fail(what) from None
        missing = lambda: [r for r in range(self.W) if r not in got]  # noqa: E731

        def ready():
            now = time.perf_counter()
            if now - polled[0] >= polled[1]:  # the store read at most every 1 ms, growing to every 0.1 s
                polled[0], polled[1] = now, min(0.1, polled[1] * 1.5)
                try:
                    got.update(pr.arrived(n))
                except RuntimeError:
                    raise self._fail(what) from None
            return True if len(got) == self.W else None

        failed = None
        try:
            self._wait(ready, (what, None), awaited=missing)
        except MergerError as e:  # a rank that found the ranks ending otherwise may have left before this one read it
            failed = e
            try:
                got.update(pr.arrived(n))
            except RuntimeError:
                pass
            if len(got) < self.W:
                raise
        steps, finals = [got[r] // 2 for r in range(self.W)], [got[r] % 2 for r in range(self.W)]
        wrong = len(set(finals)) > 1 or (not final and len(set(steps)) > 1)
        if failed is None:  # this rank has read every rank's: one that found them wrong leaves only once all have
            try:           # (it left at once, and a rank still to read its store, rank 0's, said "did not answer")
                pr.read(n)
                if wrong:
                    deadline = time.perf_counter() + self.timeout
                    while pr.readers(n) < self.W and time.perf_counter() < deadline:
                        time.sleep(0.005)
            except RuntimeError:
                pass
        if len(set(finals)) > 1:
            said = "; ".join(f"rank{'s' * (len(rs) > 1)} {self._ranks(rs)} called {'finish' if f else 'close'}()"
                             for f, rs in sorted(_group_by(finals).items()))
            raise MergerError(f"{said}: every rank ends its Merger the same way (finish() at the run's end, close() "
                              "to stop and resume); stopped")
        if not final and len(set(steps)) > 1:
            said = "; ".join(f"rank{'s' * (len(rs) > 1)} {self._ranks(rs)} at step {k}"
                             for k, rs in sorted(_group_by(steps).items()))
            raise MergerError(f"the ranks called close() at different steps ({said}): every rank closes at the same "
                              "step (after its state_dict() there); stopped")
        if failed is not None:
            raise failed
        return steps

    def _cancel_window(self) -> None:
        """After the last drain: the receives posted ahead for events that will not happen now (a rank's first
        :data:`WINDOW` events not done, the same set on every rank's reckoning) get an empty message from their
        initiator, so that no receive is left waiting when the process ends."""
        s, last = self.sched, self._last
        if s.scheme == "async":
            self._async_cancel()
            return
        if s.scheme != "gossip" or self.overlap == "lockstep" or last is None:
            return
        self._post_window()
        self._closing = True  # from here on, what arrives is an empty message, not a payload to merge
        # every rank has drained (none will take an empty message for a payload) before any is sent
        flag = torch.zeros(1)
        self._collective(lambda: dist.all_reduce(flag, group=self.group, async_op=True), "the end of the run")
        later = s.step > last.numpy()[s.initiator]  # events that will not happen
        voids = []
        for b in range(self.W):
            if b == self.rank:
                continue
            # b's window of this rank's messages: its first WINDOW not applied, i.e. of those that will not happen
            window = [key for key in self._messages(self.rank, b) if later[key[0]]][:WINDOW]
            for ev, kind in window:
                buf = torch.zeros(self._size(), device=self.wire_dev)
                try:
                    voids.append((self._pend(dist.isend(buf, self._global(b), group=self.group,
                                                      tag=self._tag(ev, kind)), peer=b), buf, ev, b))
                except RuntimeError as e:
                    raise self._gone(b, ev, e) from None
        for (ev, kind), (work, buf, t0) in list(self._posted.items()):
            peer = self._src(ev, kind)
            self._wait(lambda: self._sent(work, ev, peer), (ev, peer))
        self._posted.clear()
        for work, buf, ev, b in voids:
            self._wait(lambda: self._sent(work, ev, b), (ev, b))

    def _flush_sends(self) -> None:
        for work, buf, ev, t0, to in self._sending:
            self._wait(lambda: self._sent(work, ev, to), (ev, to))
        self._reap_sends()

    # -- asynchronous DiLoCo ------------------------------------------------------------------------------------
    def _async_step(self, step: int) -> None:
        """After local step ``step``: a rank other than 0 whose push is due sends its model to rank 0 and takes the
        global model back; rank 0 serves. ``lockstep`` overlap: rank 0 waits for every push due at ``step`` and serves
        them (its own with them) as one batch, as the simulated clock does with pushes that arrive together (a
        homogeneous cluster); otherwise it serves what has arrived, in rank order, then its own push."""
        s = self.sched
        evs = [int(e) for e in s.events_at(step)]
        if self.server is None:
            for ev in evs:
                if int(s.initiator[ev]) == self.rank:
                    self._push(ev)
            return
        if self.overlap == "lockstep":
            rows = {}
            for ev in evs:
                q = int(s.initiator[ev])
                if q == 0:
                    continue
                self._post(ev, REQUEST, q, self.P + 1)
                rows[q] = (ev, self._wait(lambda: self._ready(ev, REQUEST, q), (ev, q))[:self.P])
            if any(int(s.initiator[ev]) == 0 for ev in evs):
                rows[0] = (None, self._flat())
            if rows:
                self._serve({q: rows[q] for q in sorted(rows)})
            return
        own = any(int(s.initiator[ev]) == 0 for ev in evs)
        self._serve_arrived(own=self._flat() if own else None)

    def _push(self, ev: int) -> None:
        """This rank's push of ``ev``: its model to the server (rank 0), then it waits for the global model."""
        flat = torch.cat([self._flat(), torch.ones(1, device=self.dev)]).to(self.wire_dev)  # last slot 1: a push
        self._post(ev, REPLY, 0, self.P)
        sent_at = time.time()
        try:
            work = self._pend(dist.isend(flat, self._global(0), group=self.group, tag=self._tag(ev, REQUEST)), peer=0)
        except RuntimeError as e:
            raise self._gone(0, ev, e) from None
        self._sending.append((work, flat, ev, time.perf_counter(), 0))
        self._trace_transfer("send", ev, 0, flat, t=sent_at)
        glob = self._wait(lambda: self._ready(ev, REPLY, 0), (ev, 0))
        self._take_global(glob)
        self.merges += 1
        self._reap_sends()

    def _gather_holdouts(self, held: tuple[torch.Tensor, torch.Tensor] | None, why: str | None) -> None:
        """Every rank's held-out examples, on every rank (once: a pair's winner test scores on both of its holdouts).
        A rank whose own are unusable (``why``) says so first, and every rank stops with one line naming
        ``holdout``; so do shapes and dtypes that differ between ranks."""
        w = 2 + _MAX_DIMS  # one tensor's descriptor: dims, shape (padded), dtype
        n = 1 + 2 * w  # a flag (this rank's are unusable), then x's and y's descriptors

        def desc(t: torch.Tensor) -> list[int]:
            return [t.dim(), *t.shape, *[-1] * (_MAX_DIMS - t.dim()), _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -2]

        mine = torch.tensor([1, *[0] * (n - 1)] if why else [0, *desc(held[0]), *desc(held[1])], dtype=torch.int64,
                            device=self.wire_dev)
        every = [torch.zeros_like(mine) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group, async_op=True), "the start")
        if why:
            raise ConfigError("holdout", why)
        bad = [r for r, theirs in enumerate(every) if int(theirs[0])]
        if bad:
            raise ConfigError("holdout", f"rank {bad[0]}'s is unusable (its own error says why); allowed: (x, y) on "
                                         "every rank, two tensors with as many examples")
        def show(d: list[int]) -> str:
            dt = _DTYPES[d[-1]] if 0 <= d[-1] < len(_DTYPES) else "another dtype"
            return f"{d[1:1 + d[0]]} {str(dt).replace('torch.', '')}"

        for r, theirs in enumerate(every):
            if not torch.equal(theirs, mine):
                t, m = theirs.tolist()[1:], mine.tolist()[1:]
                raise ConfigError("holdout", f"rank {r}'s is x {show(t[:w])}, y {show(t[w:])}; rank {self.rank}'s x "
                                             f"{show(m[:w])}, y {show(m[w:])}; allowed: the same shapes and dtypes on "
                                             "every rank")
        gathered = []
        for t in held:
            t = t.detach().to(self.wire_dev).contiguous()
            got = [torch.empty_like(t) for _ in range(self.W)]
            self._collective(lambda: dist.all_gather(got, t, group=self.group, async_op=True), "the start")
            gathered.append(torch.stack(got).to(self.dev))
        self._hx, self._hy = gathered

    @torch.no_grad()
    def _holdout_loss(self, a: int, b: int) -> float:
        """This rank's model's loss on ranks ``a``'s and ``b``'s held-out examples (in that order), in eval mode:
        one side of a pair's winner test (as the engine scores a pair on its two validation slices)."""
        x, y = torch.cat([self._hx[a], self._hx[b]]), torch.cat([self._hy[a], self._hy[b]])
        with _in_eval(self.model):
            loss = self.loss_fn(self.model(x), y)
        return float(loss.detach().float().mean() if isinstance(loss, torch.Tensor) else loss)

    def _same_run_on_every_rank(self) -> None:
        """Every rank must draw the same schedule: refuse, on every rank, a seed, total_steps or policy that differs
        between ranks (e.g. total_steps from each rank's own shard size), naming the first that does."""
        import hashlib

        from .policy import what_merges

        merging = what_merges(self.p.to_dict())  # (a name changes nothing)
        digest = hashlib.sha256(json.dumps(merging, sort_keys=True).encode()).digest()
        shapes = hashlib.sha256(json.dumps([list(shape) for _, shape in self.layout.layout]).encode()).digest()
        # and the progress keys (backends.progress): rank 0 draws this Merger's number; every rank says whether it
        # reaches the store (progress is told only where all do)
        store = progress_mod.default_store()
        run = progress_mod.next_run(store, self.timeout) if self.rank == 0 else 0
        mine = torch.tensor([self.seed, self.T, int.from_bytes(digest[:7], "big"), run, int(store is not None),
                             len(self.layout.layout), int.from_bytes(shapes[:7], "big")],
                            dtype=torch.int64, device=self.wire_dev)
        every = [torch.zeros_like(mine) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group, async_op=True), "the start")
        run = int(every[0][3])
        if any(int(x[5]) != int(mine[5]) or int(x[6]) != int(mine[6]) for x in every):
            self._same_model_on_every_rank(max(int(x[5]) for x in every))
        if run and all(int(x[4]) for x in every):
            self._progress = progress_mod.Progress(store, run, self.rank, self.W, self.timeout)
        policies = None
        if len({int(x[2]) for x in every}) > 1:  # (every rank sees it): the fields that differ, not "another policy"
            policies = [None] * self.W
            dist.all_gather_object(policies, merging, group=self.group)
        for r, theirs in enumerate(every):
            for k, name in enumerate(("seed", "total_steps", "policy")):
                if int(theirs[k]) != int(mine[k]):
                    what = f"{int(theirs[k])}, this rank's {int(mine[k])}"
                    if name == "policy":
                        what = f"another policy ({_differences(policies[r], merging, 'there')})"
                    raise ConfigError(name, f"rank {r}'s is {what}; allowed: the same on every rank (each rank draws "
                                            "the merge schedule from the policy, seed and total_steps)")

    def _same_model_on_every_rank(self, most: int) -> None:
        """The ranks' models differ in their tensors' shapes (a width from each rank's own setting): every rank
        gathers every rank's shapes and refuses, naming the first tensor that differs (a start broadcast of models
        of other sizes aborted gloo's process, or left a larger model half overwritten until a merge crashed)."""
        dims = 8  # its size, then a shape's first dims, padded with -1; a missing tensor is all -2
        mine = torch.full((most, dims + 1), -2, dtype=torch.int64, device=self.wire_dev)
        for k, (_, shape) in enumerate(self.layout.layout):
            mine[k] = -1
            mine[k, 0] = math.prod(shape)
            mine[k, 1:1 + min(len(shape), dims)] = torch.tensor(shape[:dims], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group, async_op=True), "the start")

        def shape(row: torch.Tensor) -> str:
            if int(row[0]) == -2:
                return "no such tensor"
            return "[" + ", ".join(str(int(v)) for v in row[1:] if int(v) >= 0) + "]"

        for k in range(most):
            rows = [every[r][k] for r in range(self.W)]
            if all(torch.equal(x, rows[0]) for x in rows[1:]):
                continue
            name = self.layout.layout[k][0] if k < len(self.layout.layout) else f"tensor {k}"
            said = "; ".join(f"rank{'s' * (len(rs) > 1)} {self._ranks(rs)}: {s}" for s, rs in _group_by(
                [shape(x) for x in rows]).items())
            raise ConfigError("model", f"the ranks' models differ at {name!r} (parameters then buffers, in order; "
                                       f"{said}); allowed: the same model on every rank (every rank builds it with "
                                       "the same sizes)")
        raise ConfigError("model", "the ranks' models differ in their tensors' shapes beyond their first 8 dimensions; "
                                   "allowed: the same model on every rank (every rank builds it with the same sizes)")

    def _same_step_on_every_rank(self, step: int, refused: ConfigError | None = None) -> None:
        """A resume from checkpoints of different steps (one rank's file saved later) paired merge events that are
        not the same: refused on every rank, before anything is loaded; so is a checkpoint this rank or another
        ``refused`` (its own line here, the rank's number on the others)."""
        mine = torch.tensor([step, int(refused is not None)], dtype=torch.int64, device=self.wire_dev)
        every = [torch.zeros_like(mine) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group, async_op=True), "the resume")
        if refused is not None:
            raise refused
        others = [r for r, x in enumerate(every) if int(x[1])]
        if others:
            raise ConfigError("state_dict", f"rank{'s' * (len(others) > 1)} {self._ranks(others)} refused "
                                            f"{'their checkpoints' if len(others) > 1 else 'its checkpoint'} (its own "
                                            "line says why); allowed: the state_dict each rank saved, on every rank")
        steps = [int(x[0]) for x in every]
        if len(set(steps)) > 1:
            said = "; ".join(f"rank{'s' * (len(rs) > 1)} {self._ranks(rs)} at step {s}"
                             for s, rs in sorted(_group_by(steps).items()))
            raise ConfigError("state_dict.step", f"the checkpoints are of different steps ({said}); allowed: the "
                                                 "state_dicts every rank saved at the same step")

    def _same_on_every_rank(self, local_steps: list[int]) -> None:
        mine = torch.tensor(local_steps, dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.W)]
        self._collective(lambda: dist.all_gather(every, mine, group=self.group, async_op=True), "the start")
        for r, theirs in enumerate(every):
            if not torch.equal(theirs, every[0]):
                raise ConfigError("speeds", f"rank {r}'s give local steps {theirs.tolist()}, rank 0's "
                                            f"{every[0].tolist()}; allowed: the same speeds on every rank")

    def _take_global(self, glob: torch.Tensor) -> None:
        for blk, (o, n) in zip(self.blocks, self.layout.offsets):
            blk.copy_(glob[o:o + n].view(1, -1).to(blk.dtype))

    def _serve_arrived(self, due: dict | None = None, own: torch.Tensor | None = None) -> None:
        """Rank 0: serve every push that has arrived (one receive is posted for each rank's next push: a rank
        cannot push again before it has the answer) as one batch, with rank 0's own model ``own`` when it pushes at
        this boundary (as the simulated clock serves at worker 0's step boundaries); ``due``: at most this many
        pushes a rank."""
        got = {}
        for q, evs in self._pushes.items():
            k = self._served[q]
            if q in self._left or k >= (len(evs) if due is None else due[q]):
                continue
            ev = evs[k]
            self._post(ev, REQUEST, q, self.P + 1)
            buf = self._ready(ev, REQUEST, q)
            if buf is None:
                continue
            if float(buf[self.P]) == 0.0:  # its empty message: the rank has left (close or finish), no push comes
                self._left.add(q)
                continue
            got[q] = (ev, buf[:self.P])
        if own is not None:
            got[0] = (None, own)
        if got:
            self._serve({q: got[q] for q in sorted(got)})

    def _serve(self, pushes: dict) -> None:
        """Rank 0: the server takes ``pushes`` (rank -> (event, its model), in rank order) as one batch (:class:`kernel.AsyncServer`),
        and every rank of it takes the new global model (rank 0 in place, the others as the answer)."""
        who = list(pushes)
        rows = torch.stack([pushes[q][1].to(self.server.glob.device, torch.float32) for q in who])
        glob = self.server.push_(rows, who).clone()
        self.arrivals.append(who)
        for q in who:
            if q == 0:
                self._take_global(glob)
                self.merges += 1
                continue
            ev = pushes[q][0]
            out = glob.to(self.wire_dev)
            sent_at = time.time()
            try:
                work = self._pend(dist.isend(out, self._global(q), group=self.group, tag=self._tag(ev, REPLY)), peer=q)
            except RuntimeError as e:
                raise self._gone(q, ev, e) from None
            self._sending.append((work, out, ev, time.perf_counter(), q))
            self._trace_transfer("send", ev, q, out, t=sent_at)
            self._served[q] += 1
            if self.overlap != "lockstep" and self._served[q] < len(self._pushes[q]):
                nxt = self._pushes[q][self._served[q]]
                self._post(nxt, REQUEST, q, self.P + 1)  # the next push's receive, posted ahead

    def _async_drain(self, final: bool, meet: bool = True) -> None:
        """Rank 0 serves every push due by each rank's last step (at the end, the ranks first tell each other how
        many steps they did; otherwise every rank is at this step)."""
        last = self._last = self._last_steps(final, meet)
        if self.server is not None:
            s = self.sched
            due = {q: sum(1 for ev in evs if int(s.step[ev]) <= int(last[q])) for q, evs in self._pushes.items()}
            late = lambda: next((q for q in sorted(due) if self._served[q] < due[q]), None)  # noqa: E731
            # serve no push after the ranks' last steps here: at a checkpoint a rank may push again, or leave (its
            # empty message then fills the receive posted for its next push, and must not be served)
            self._cap = due
            try:
                self._wait(lambda: True if late() is None else None, (f"pushes due by step {self.t}", late),
                           awaited=lambda: [q] if (q := late()) is not None else [])
                self._flush_sends()  # still capped: a flush's waits serve too
            finally:
                self._cap = None
        else:
            self._flush_sends()

    def _async_cancel(self) -> None:
        """After the last drain: rank 0's receive posted ahead for a rank's next push, which will not come now, gets
        an empty message from that rank, so that no receive is left waiting when the process ends."""
        if self._last is None:
            return
        self._closing = True
        s = self.sched
        if self.server is None:
            later = [int(ev) for ev in np.flatnonzero(s.initiator == self.rank) if int(s.step[ev]) > int(self._last[self.rank])]
            if later and self.overlap != "lockstep":
                buf = torch.zeros(self.P + 1, device=self.wire_dev)  # last slot 0: not a push (this rank leaves)
                try:
                    work = self._pend(dist.isend(buf, self._global(0), group=self.group,
                                                 tag=self._tag(later[0], REQUEST)), peer=0)
                except RuntimeError as e:
                    raise self._gone(0, later[0], e) from None
                self._wait(lambda: self._sent(work, later[0], 0), (later[0], 0))
            return
        if self.overlap != "lockstep":  # every rank with a push left, and that has not said it left, has its receive
            for q, evs in self._pushes.items():  # posted, and sends it an empty one
                if self._served[q] < len(evs) and q not in self._left:
                    self._post(evs[self._served[q]], REQUEST, q, self.P + 1)
        for (ev, kind), (work, buf, t0) in list(self._posted.items()):
            peer = int(s.initiator[ev])
            self._wait(lambda: self._sent(work, ev, peer), (ev, peer))
        self._posted.clear()

    # -- all-reduce ----------------------------------------------------------------------------------------------
    def _allreduce(self, ev: int, step: int | None = None, weight: float | None = None) -> None:
        """The all-reduce scheme: every rank moves to the (weighted) average, or to the anchor after the outer step;
        counters become their sum, supports their sum. ``step`` and ``weight``: for SlowMo's exact average over a
        gossip base (``ev`` is then :data:`plan.OUTER_AVERAGE`, not a schedule event)."""
        lay = self.layout
        if step is None:
            step = int(self.sched.step[ev])
            weight = plan_mod.allreduce_weight(self.p, step, self.T, float(self.sched.u[ev]))
        x = self._flat().unsqueeze(0)
        if self.accum is not None:
            s = torch.cat([a.reshape(-1) for a in self.accum]).unsqueeze(0)
        elif self.weighting.by_examples:
            s = self.examples.to(torch.float32).expand_as(x)
        else:
            s = None
        sent = [0]

        def reduce_(t: torch.Tensor) -> None:  # through host memory under gloo, within the timeout
            wire = t.to(self.wire_dev)
            self._collective(lambda: dist.all_reduce(wire, group=self.group, async_op=True), f"merge event {ev}")
            t.copy_(wire)
            sent[0] += wire.numel() * wire.element_size()

        t0, waited = time.perf_counter(), self._wait_s
        if self._opt_keys or self._opt_steps:  # before the supports merge, with the parameters' supports
            self._opt_average(s, weight, reduce_)
        if self.delta:  # every rank's compressed change goes to all (all-gather); the average of the public copies
            avg, total, counts = self._delta_average(ev, sent)
        else:
            avg, total, counts = kernel.reduced_average(x, s, reduce_, self.W)
        if self.outer is not None:
            self.outer.step_flat_(avg, lay.offsets)
        w = torch.full((1, 1), float(weight), device=self.dev)
        mine = self.public[self.rank] if plan_mod.compressed_outer(self.p) else None
        for k, (rule, blk, (o, n)) in enumerate(zip(self.rules, self.blocks, lay.offsets)):
            if rule == kernel.LERP:
                kernel.lerp_rows_(blk, [0], [avg[o:o + n].to(blk.dtype)], w)
            elif rule == kernel.SUM:  # counters are summed, not averaged
                kernel.counters_from_sum_(blk, counts[o:o + n])
        if mine is not None:  # what this rank did not send stays owed: its public copy is the new anchor less that
            mine.copy_(kernel.owed_public(self._flat(), x[0], mine))
        if self.accum is not None:  # supports are summed
            for a, (o, n) in zip(self.accum, lay.offsets):
                a.copy_(total[o:o + n].view(1, -1))
        if self.weighting.by_examples:
            ex = self.examples.clone()
            self._collective(lambda: dist.all_reduce(ex, group=self.group, async_op=True), f"merge event {ev}")
            self.examples.copy_(ex)
        if self.p.optimizer_state == "reset":
            for t in self.tensors[:lay.n_trained_blocks]:
                self.optimizer.state.pop(t, None)
        self.merges += 1
        self._version += 1
        if self._trace is not None:
            self._write({"event": int(ev), "kind": "allreduce", "step": step, "bytes": sent[0],
                         "seconds": time.perf_counter() - t0, "wire_s": self._wait_s - waited})

    # -- Streaming DiLoCo: a fragment's all-reduce runs while the loop trains ------------------------------------
    def _stream_start(self, ev: int) -> None:
        """Start the all-reduce of the event's fragment (this rank's values now); it lands after ``fragment_delay``
        more steps (:meth:`_stream_land`)."""
        frag = self.fragments[int(self.sched.fragment[ev])] if self.fragments is not None else \
            list(range(len(self.blocks)))
        wire = torch.cat([self.blocks[k].reshape(-1).to(torch.float32) for k in frag]).to(self.wire_dev)
        try:
            work = dist.all_reduce(wire, group=self.group, async_op=True)
        except RuntimeError:
            raise self._fail(f"merge event {ev}") from None
        # counters: the engine sets them to the sum at the send and counts on from there
        sent = {k: self.blocks[k].clone() for k in frag if self.rules[k] == kernel.SUM}
        self._in_flight[ev] = (work, wire, frag, time.perf_counter(), sent)
        self.merges += 1  # a merge is counted when it starts, as the engine counts it
        if self.p.fragment_delay:
            self._landing.setdefault(self.t + self.p.fragment_delay, []).append(ev)

    def _stream_land(self, ev: int) -> None:
        """The fragment's sum has arrived (waited for here, within the timeout): its average, the outer step on it,
        and every block of the fragment moves ``1 - fragment_alpha`` of the way there; counters take the sum."""
        work, wire, frag, t0, sent = self._in_flight.pop(ev)
        waited = self._wait_s
        if work is not None:
            self._collective(lambda: work, f"merge event {ev}")
        step, lay = int(self.sched.step[ev]), self.layout
        w = torch.full((1, 1), float(plan_mod.allreduce_weight(self.p, step, self.T, float(self.sched.u[ev]))),
                       device=self.dev)
        total, at = wire.to(self.dev), 0
        for k in frag:
            o, n = lay.offsets[k]
            seg, at = total[at:at + n], at + n
            blk = self.blocks[k]
            if self.rules[k] == kernel.LERP:
                avg = seg / self.W
                if self.outer is not None and k < self.outer.blocks:
                    avg = self.outer.step_(avg, o, n)
                kernel.lerp_rows_(blk, [0], [avg.to(blk.dtype)], w)
            elif self.rules[k] == kernel.SUM:  # counters are summed, not averaged, then counted on since the send
                kernel.counters_from_sum_(blk, seg + (blk - sent[k]).to(seg.dtype).reshape(-1) if k in sent else seg)
        self._version += 1
        if self._trace is not None:
            self._write({"event": int(ev), "kind": "allreduce", "step": step, "bytes": 4 * wire.numel(),
                         "fragment": None if self.fragments is None else int(self.sched.fragment[ev]),
                         "landed_step": self.t, "seconds": time.perf_counter() - t0, "wire_s": self._wait_s - waited})

    def _settle_streams(self) -> None:
        """Wait (within the timeout) for every fragment in flight, without landing it: a checkpoint keeps the sums,
        and a fragment whose landing is past the run's end never lands (as in the simulator)."""
        for ev, (work, wire, frag, t0, sent) in list(self._in_flight.items()):
            if work is not None:
                self._collective(lambda: work, f"merge event {ev}")
            self._in_flight[ev] = (None, wire, frag, t0, sent)

    def _collective(self, start, what: str) -> None:
        """Run an async collective to completion within ``timeout``; if it fails or times out, find who is gone."""
        try:
            work = start()
        except RuntimeError:
            raise self._fail(what) from None
        t0, pause = time.perf_counter(), 0.0
        while True:
            try:
                if work.is_completed():
                    work.wait()
                    self._wait_s += time.perf_counter() - t0
                    return
            except RuntimeError:
                raise self._fail(what) from None
            stopped = self._stopped()
            if stopped and all(v == LEFT for v in stopped.values()) and _completes_by(work, time.perf_counter() + 1.0):
                # ranks that took their part in this collective, then left (their own error after it: a resume
                # refused on every rank): this rank's part lands a moment later; the next collective names them
                try:
                    work.wait()
                    self._wait_s += time.perf_counter() - t0
                    return
                except RuntimeError:
                    raise self._fail(what) from None
            if stopped:
                raise self._fail(what, said=TOLD_WAITING)
            self._waiting()
            if time.perf_counter() - t0 > self.timeout:
                raise self._fail(what, f"for {self.timeout:g} s", said=TIMED_OUT)
            pause = min(0.002, pause + 0.0001)
            time.sleep(pause)

    def __enter__(self) -> "Merger":
        return self

    def __exit__(self, *exc) -> bool:
        """The end of a ``with evomerge.Merger(...) as merger:`` block: where the loop left without ``finish()`` or
        ``close()`` (an error in it), tell the other ranks and wait for them now (what the process's exit would do,
        :func:`_leave_at_exit`), before a ``finally`` that destroys the process group. The error goes on."""
        if not getattr(self, "_hook_off", True):  # a worker's follower rank has no hook
            _leave_at_exit(self, exc[1])
            self._exit_hook_off()
        return False

    def _exit_hook_off(self) -> None:
        atexit.unregister(self._exit_hook)
        self._hook_off = True

    def close(self) -> None:
        """Leave the run without the final average (after :meth:`state_dict`, to stop and resume later): tell every
        other rank this one is done and wait until they say so too. :meth:`finish` calls it; call it on every rank
        before the process ends, so that no receive is left waiting."""
        self._ended = "close"
        if self._follower:
            self._let_lead_go()
            return
        self._drain(final=False)
        self._release()

    def _abandon(self) -> None:
        """Every rank refused the run at its start (:class:`ConfigError` from a check of what they all gathered): end
        the standing receives as :meth:`close` does, so that nothing is left waiting when the caller leaves (a
        process that exits with a receive still posted is aborted: ``terminate called without an active
        exception``). Within one ``timeout`` in all; a rank that does not answer is left to the process's end. Only
        for refusals every rank reaches at the same point (a rank that refused alone would use up the others' stop
        receives with a message that is not a stop)."""
        self._closing = True
        deadline = time.perf_counter() + self.timeout
        for work in self._send_stops(0.0) + [w for w, _ in self._stop_in.values()]:
            _done_by(work, deadline)
        self._stop_in = {}
        self._let_go(deadline)

    def _post_stop(self, r: int) -> None:
        """The standing receive of rank ``r``'s stop message (how a failure reaches ranks not waiting on the dead one)."""
        buf = torch.zeros(1)
        try:
            work = self._pend(dist.irecv(buf, self._global(r), group=self.group, tag=STOP_TAG), peer=r)
        except RuntimeError as e:  # its connection is already closed
            work = self._pend(None, e, peer=r)
        self._stop_in[r] = (work, buf)

    def _send_stops(self, value: float) -> list[_Pending]:
        """This rank's stop message to every other rank (1: it stops, 0: it is done, :data:`LEFT`: its process is
        ending), where the connection holds."""
        flag, out = torch.full((1,), value), []
        for r in self._stop_in:
            try:
                out.append(self._pend(dist.isend(flag, self._global(r), group=self.group, tag=STOP_TAG), peer=r))
            except (RuntimeError, ValueError):  # its connection is closed, or the process group is gone
                pass
        return out

    def _pend(self, work, error: BaseException | None = None, *, peer: int) -> _Pending:
        """A pollable work handle (:class:`backends.pending.Pending`), kept until its waiting thread has ended."""
        if len(self._pending) > 256:
            self._pending = [x for x in self._pending if x.alive()]
        out = _Pending(work, error, peer, unbounded=self.wire_dev.type == "cpu")  # (gloo's wire is host memory)
        self._pending.append(out)
        return out

    def _release(self) -> None:
        self._cancel_window()
        self._close()
        self._let_go()

    def _let_go(self, deadline: float | None = None) -> None:
        """Every message has gone or come by now: let each waiting thread end (by ``deadline``, default within
        ``timeout``) before the process group can go; the optimiser's hook off, the trace closed."""
        deadline = time.perf_counter() + self.timeout if deadline is None else deadline
        for x in self._pending:
            x.join(max(0.0, deadline - time.perf_counter()))
        self._pending = []
        if self._progress is not None:
            self._progress.close()
        self._exit_hook_off()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def _close(self) -> None:
        """Tell every other rank this one is done (its standing receive completes), and wait for theirs."""
        if not self._stop_in:
            return
        self._stop_out = self._send_stops(0.0)  # a failure found below sends no second stop message

        def ready(work):
            try:
                return True if work.done() else None
            except RuntimeError:  # its connection closed
                raise self._fail("the end of the run") from None

        for work in self._stop_out + [w for w, _ in self._stop_in.values()]:
            self._wait(lambda: ready(work), ("the end of the run", None))
        if any(float(buf[0]) != 0.0 for _, buf in self._stop_in.values()):  # a rank stopped or left instead
            raise self._fail("the end of the run")
        self._stop_in = {}

    # -- trace ---------------------------------------------------------------------------------------------------
    def _trace_transfer(self, kind: str, ev: int, peer: int, buf: torch.Tensor, seconds: float | None = None,
                        **wall: float | None) -> None:
        """A send (``t``: the wall-clock time just before it was posted) or a receive (``seconds`` from posting the
        receive to seeing the payload; ``posted`` and ``arrived``: wall-clock times). ``evomerge calibrate
        --from-trace`` times a transfer as the receive's arrival less the later of the send's and the receive's
        posting."""
        if self._trace is None:
            return
        rec = {"event": int(ev), "kind": kind, "step": self.t, "peer": int(peer), "bytes": 4 * buf.numel(),
               "initiator": int(self.sched.initiator[ev]), "event_step": int(self.sched.step[ev])}
        if seconds is not None:
            rec["seconds"] = seconds
        rec.update({k: v for k, v in wall.items() if v is not None})
        self._write(rec)

    def _write(self, rec: dict) -> None:
        self._trace.write(json.dumps(rec) + "\n")

