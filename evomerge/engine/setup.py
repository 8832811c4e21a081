"""What a merge run is made of, before any policy: the study's data split into shards and validation slices, the
model, the budget in local steps and rounds (:class:`Setup`, :func:`prepare`), the minibatches each worker draws
(:func:`batch_indices`), the inputs' normalisation, and the result types every run returns (:class:`RoundMetrics`,
:class:`RunResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .. import data as data_mod
from .. import models as models_mod
from .. import task as task_mod
from ..errors import ConfigError
from . import schedule as schedule_mod
from ..study import ACCURACY_OBJECTIVES, TARGET_METRICS, TIMED_OBJECTIVES, Study

TAG_BATCHES, TAG_SLICES = schedule_mod.STREAMS["batches"], schedule_mod.STREAMS["slices"]


@dataclass
class RoundMetrics:
    round: int
    step: int  # local steps done by each worker
    val_accuracy: float | None  # consensus model on the validation split (None: the task has no classes)
    val_loss: float
    mean_worker_accuracy: float | None
    worst_worker_accuracy: float | None
    consensus_distance: float
    bytes: int  # cumulative bytes on the wire
    update_norm: float  # norm of the consensus model's change per local step in this round
    train_loss: float  # mean local minibatch loss over the round
    merges: int  # cumulative merge events
    wall_time: float
    local_update_norm: float = 0.0  # mean over workers of |change made by local steps| per step, this round
    merge_update_norm: float = 0.0  # mean over workers of |change made by merges and swaps| per step, this round
    similarity_mean: float = 1.0  # pairwise model similarity (policy.similarity): mean over pairs
    similarity_min: float = 1.0
    label_skew: float = 0.0  # of the data the workers hold now (it changes when data travels)
    examples_moved: int = 0  # cumulative training examples sent between workers
    travel_visitors: float | None = None  # mean distinct workers that trained on each example that has travelled
    # simulated time ([environment] only; None in the lockstep world)
    sim_time: float | None = None  # simulated seconds at the end of this round
    steps_min: int | None = None  # local steps done by the slowest / mean / fastest worker
    steps_mean: float | None = None
    steps_max: int | None = None
    idle_fraction: float | None = None  # of the workers' time in this round spent waiting (barriers, blocking merges)
    staleness: float | None = None  # mean age (simulated seconds) of the payloads applied in this round
    time_to_target: float | None = None  # see Judge.timing (running value: what it would be if accuracy stalled here)
    accuracy_at_time: float | None = None  # consensus validation accuracy at this round's simulated time
    loss_at_time: float | None = None  # consensus validation loss at this round's simulated time
    perplexity_at_time: float | None = None  # and perplexity (labels per position)
    val_perplexity: float | None = None  # exp(val_loss), for labels per position (a language model)


@dataclass
class RunResult:
    """One run of a policy (``evomerge.run``, ``simulate.simulate``): ``status`` ("ok", or "diverged" where the loss
    went non-finite), ``history`` (one :class:`RoundMetrics` per round: ``step``, ``val_accuracy``, ``val_loss``,
    ``bytes``, ``consensus_distance``, ``sim_time`` on a simulated cluster, ...), ``final`` (the last round's),
    ``test_accuracy`` and ``test_loss`` (with ``evaluate_test=True``), and ``metrics()``, the final metrics flat as
    the tables and MLflow show them."""

    status: str  # "ok" or "diverged"
    seed: int
    policy: dict
    history: list[RoundMetrics]
    total_steps: int
    wall_time: float
    label_skew: float
    workers: int
    test_accuracy: float | None = None  # the consensus model's on the test set (evaluate_test; a task with classes)
    test_loss: float | None = None  # and its loss there (evaluate_test)
    eval_time: float = 0.0  # seconds of wall_time spent evaluating (the rest is training and merging)
    params: torch.Tensor | None = None  # final [W, P] parameters, with keep_params=True
    converged_step: int | None = None  # the step at which the convergence stop ended the run
    communities: list[int] | None = None  # the last self-formed communities (policy.regroup_every)
    model_at: list[int] | None = None  # which starting worker's model each worker holds (swaps move them)

    @property
    def final(self) -> RoundMetrics:
        return self.history[-1]

    def metrics(self) -> dict[str, Any]:
        """Final metrics, flat: what tables, MLflow and the search read."""
        out = {k: v for k, v in asdict(self.final).items() if v is not None}
        out.update(status=self.status, wall_time=self.wall_time, local_steps=self.final.step)
        if self.converged_step is not None:
            out["converged_step"] = self.converged_step
        if self.test_accuracy is not None:
            out["test_accuracy"] = self.test_accuracy
        if self.test_loss is not None:
            out["test_loss"] = self.test_loss
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "seed": self.seed, "policy": self.policy, "workers": self.workers,
            "total_steps": self.total_steps, "wall_time": self.wall_time, "label_skew": self.label_skew,
            "final": self.metrics(),  # a field a task or world has none of (a regression's accuracy) left out, as there
            "history": [{k: v for k, v in asdict(h).items() if v is not None} for h in self.history],
            "converged_step": self.converged_step, "communities": self.communities, "model_at": self.model_at,
        }


def total_steps(study: Study, shard_sizes: list[int]) -> int:
    """The budget in local steps: ``run.steps``, or ``run.epochs`` passes over the mean shard."""
    if study.run.steps:
        return study.run.steps
    return max(1, round(study.run.epochs * float(np.mean(shard_sizes)) / study.run.batch_size))


@dataclass
class Setup:
    """What a run needs besides the policy and the seed; built once per study and reused."""

    study: Study
    data: data_mod.Data
    model: models_mod.StackedModel
    shards: list[np.ndarray]  # training positions per worker
    slices: list[np.ndarray]  # local validation slices per worker (for the winner-biased lerp)
    total_steps: int
    label_skew: float


def prepare(study: Study, data: data_mod.Data | None = None, data_dir=None) -> Setup:
    base_dir = study.path.parent if study.path is not None else None  # a user's loader / factory lives there
    if data is None:
        data = data_mod.load_spec(study.data, data_dir, base_dir)
    task = task_mod.of(study)
    task.check_labels(data.train_y)
    task.note_held_out(data.val_y)
    model = models_mod.build_spec(study.model, data.input_shape, data.n_classes, base_dir, task)
    if hasattr(model, "check"):  # a user's model: refused in one line before any trial if it cannot run
        model.check(normalise(data.train_x[:4], data.spec), data.train_y[:4], study.run.workers, study.run.batch_size)
    elif not task.classification or task.per_position:
        raise ConfigError("study.run.loss", f"{study.run.loss!r} with labels of shape {list(data.train_y.shape[1:])} "
                                            f"per example needs a [model] factory; the named model {study.model.name!r} "
                                            "gives one logit per class; allowed: cross_entropy on one class per input")
    check_task(study, task)
    check_token_ids(study, data, model)
    labels = data.train_y.numpy()
    run = study.run
    parts = data_mod.partition(labels, run.workers, study.data.partition, alpha=study.data.alpha, groups=data.groups,
                               seed=study.data.seed, min_size=run.score_samples + 1)
    rng = schedule_mod.rng_for(study.data.seed, TAG_SLICES)
    shards, slices = [], []
    for p in parts:
        p = rng.permutation(p)
        slices.append(np.sort(p[:run.score_samples]))
        shards.append(np.sort(p[run.score_samples:]))
    skew = data_mod.label_skew(labels, shards, data.n_classes)
    return Setup(study, data, model, shards, slices, total_steps(study, [len(s) for s in shards]), skew)


def check_token_ids(study: Study, data, model) -> None:
    """Integer inputs (token ids) against the model's embeddings: an id past the largest ``nn.Embedding`` (a
    vocabulary one short), or a negative one, on which the model fails is one line naming the model, not an
    IndexError at the first batch that holds it (the start-up check runs a few examples only)."""
    from torch import nn

    if not len(data.train_x) or normalise(data.train_x[:1], data.spec).is_floating_point():
        return  # (images, features: no module is built to find out)
    try:
        with torch.random.fork_rng():  # (building the module draws its initial weights: the run's draws stay)
            module = model.module()
    except NotImplementedError:
        return
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    if not sizes:
        return
    n = max(sizes)
    for name, x in (("training", data.train_x), ("validation", data.val_x)):
        if not len(x):
            continue
        hi, lo = int(x.max()), int(x.min())
        if hi < n and lo >= 0:
            continue
        bad = hi if hi >= n else lo
        row = int((x == bad).reshape(len(x), -1).any(1).nonzero()[0, 0])
        try:  # the model may map ids itself (a hashing trick, an offset): only its failure on them is refused
            with torch.random.fork_rng(), torch.no_grad():
                module.eval()(normalise(x[row:row + 1], data.spec))
            continue
        except IndexError:  # (nn.Embedding's "index out of range in self")
            pass
        field = "study.model.factory" if study.model.factory else "study.model"
        fix = f"an embedding of at least {hi + 1} entries" if bad >= n else "no negative id"
        raise ConfigError(field, f"the {name} inputs hold token id {bad} (example {row} of {len(x)}), and the model's "
                                 f"largest nn.Embedding has {n} entries (ids 0..{n - 1}); allowed: ids in 0..{n - 1}, "
                                 f"or {fix}")


#: the metrics that mean something only for some tasks
NEEDS_CLASSES = ACCURACY_OBJECTIVES
NEEDS_POSITIONS = ("val_perplexity", "perplexity_at_time")
CONFIDENCE_FIELDS = ("data_exchange_k", "retire_threshold", "swap_confidence")  # built on exp(-loss): the model's confidence


def check_task(study: Study, task) -> None:
    """Refuse, in one line, objectives and policy fields that do not fit the study's task (:mod:`evomerge.task`)."""
    asked = list(study.objectives) + ([study.target_metric] if study.target is not None else [])
    for m in asked:
        if (m in NEEDS_CLASSES and not task.classification) or (m in NEEDS_POSITIONS and not task.per_position):
            def fit(o: str) -> bool:
                return not ((o in NEEDS_CLASSES and not task.classification) or
                            (o in NEEDS_POSITIONS and not task.per_position))

            fits = [o for o in ("val_loss", *NEEDS_POSITIONS, *NEEDS_CLASSES, "bytes") if fit(o)
                    and o not in TIMED_OBJECTIVES]
            timed = [o for o in TIMED_OBJECTIVES if fit(o)]
            field = "study.objectives.target_metric" if m not in study.objectives else "study.objectives.metrics"
            if field.endswith("target_metric"):  # (the target is a metric of the model, not a time or bytes)
                fits, timed = [o for o in fits if o in TARGET_METRICS], []
            what = ("needs labels per position (a language model)" if m in NEEDS_POSITIONS
                    else f"needs class labels; the study's loss is {study.run.loss!r}")
            raise ConfigError(field, f"{m!r} {what}; allowed here: {', '.join(fits)}"
                                     + (f", and with an [environment] {', '.join(timed)}" if timed else ""))
    refuse_confidence(study.policy, task, "study.policy")
    for p in study.search.space:
        if p.name in CONFIDENCE_FIELDS:
            task.refuse(f"study.search.space.{p.name}", p.name)


def refuse_confidence(policy, task, where: str = "policy") -> None:
    """One line naming ``where.field`` for a field of ``policy`` that reads exp(-loss) as a confidence, where the
    task's loss is no likelihood (a regression): the study's own policy, a run's (a file, a named baseline, the
    Python API's), each run's on every backend."""
    for f in CONFIDENCE_FIELDS:
        if getattr(policy, f):
            task.refuse(f"{where}.{f}", getattr(policy, f))


def batch_indices(shard: np.ndarray, batch: int, start: int, n_steps: int, seed: int, worker: int) -> np.ndarray:
    """Positions ``[n_steps, batch]`` of worker ``worker``'s minibatches for local steps ``start..start+n_steps``.

    The worker walks through its shard in passes, each a fresh permutation drawn from
    ``(seed, worker, pass)``; a pure function of its arguments, so any backend (or a
    reference model in a test) draws the same samples.
    """
    n = len(shard)
    lo, hi = start * batch, (start + n_steps) * batch
    out = []
    for e in range(lo // n, (hi - 1) // n + 1):
        perm = shard[schedule_mod.rng_for(seed, TAG_BATCHES, worker, e).permutation(n)]
        a, b = max(lo - e * n, 0), min(hi - e * n, n)
        out.append(perm[a:b])
    return np.concatenate(out).reshape(n_steps, batch)


def normalise(x_uint8: torch.Tensor, spec: data_mod.DatasetSpec) -> torch.Tensor:
    """A minibatch as the model takes it: the named datasets' uint8 images scaled by their mean and deviation;
    integer token ids unchanged (int64); anything else float32 (the one rule of :func:`evomerge.data.input_type`)."""
    if x_uint8.dtype == torch.int64:
        return x_uint8
    if x_uint8.dtype != torch.uint8:  # a loader's data (study.data.loader) are used as it gave them
        return x_uint8.float()
    return x_uint8.float().mul_(1.0 / (255.0 * spec.std)).sub_(spec.mean / spec.std)


def round_bounds(total: int, rounds: int) -> list[int]:
    rounds = min(rounds, total)
    return [round(total * (r + 1) / rounds) for r in range(rounds)]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a run uses: the one asked for, else CUDA when present, else the CPU (every backend). One that
    torch does not know, another kind than the CPU and CUDA (``mps``, ``meta``: never run), or CUDA where torch has
    none, is one line naming ``--device``."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("--device", f"{device!r} is not a torch device; allowed: cpu, cuda, cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("--device", f"{device!r}: evomerge runs on the CPU or CUDA; allowed: cpu, cuda, cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{device!r}, but this torch has no CUDA device; allowed: cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError("--device", f"{device!r}, but there are {torch.cuda.device_count()} CUDA device(s); "
                                      f"allowed: cpu, cuda, cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev
