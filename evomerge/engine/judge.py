"""The round's end, the same on every backend: the judge evaluates the consensus model and the workers on the
validation split, measures similarity and the update norms, builds the round's metrics, computes time to target
(:func:`crossing`, the one interpolation) and applies the convergence stop; at the end, the test set."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .. import models as models_mod
from . import ops
from . import similarity
from ..policy import MergePolicy
from .setup import RoundMetrics, Setup, normalise
from .state import Workers, initial_row


def crossing(prev: tuple[float, float] | None, t: float, acc: float, target: float) -> float:
    """When the accuracy reached ``target``, given that it is ``acc >= target`` at time ``t`` and was
    ``prev = (t0, a0)`` (below the target) at the point before: linear between the two, at ``t`` without a
    point before. The one definition of time to target: the engine's rounds and ``benchmarks/sim_vs_real.py``'s
    real runs use it."""
    if prev is None:
        return t
    t0, a0 = prev
    return t0 + (target - a0) / (acc - a0) * (t - t0) if acc > a0 else t


def maximized(metric: str) -> bool:
    """Whether a target metric is reached at or above the target (accuracy), else at or below (loss, perplexity)."""
    return metric.endswith("accuracy")


def penalty_words(metric: str) -> str:
    """How a run that missed the target gets its time to target (:meth:`Judge.timing`), in words."""
    return "budget x (2 - best / target)" if maximized(metric) else "budget x (2 - target / best)"


class Judge:
    """What every backend does with all workers' parameters at the end of a round: evaluate
    the consensus model and the workers on the validation split, measure similarity, build
    the round's :class:`RoundMetrics` and apply the convergence stop; at the end, the test set."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, dev: torch.device, train_x: torch.Tensor, t0: float,
                 val: tuple[torch.Tensor, torch.Tensor] | None = None, curves: bool = True):
        """``val``: the normalised validation inputs and labels on ``dev``, if already there (a population shares them).
        ``curves``: evaluate every round on the validation split; False: only the run's last round (the others'
        validation metrics are NaN), for runs of which only the final values are read (the verdict's fresh seeds)."""
        data, run, model = setup.data, setup.study.run, setup.model
        self.curves = curves
        self.model, self.data, self.policy, self.dev, self.t0 = model, data, policy, dev, t0
        self.val_x, self.val_y = val if val is not None else validation(setup, dev)
        self.n_eval = run.eval_samples or len(self.val_y)
        start = initial_row(model, seed).to(dev)
        self.similarity = Similarity(model, policy, seed, start, data, train_x)
        self.prev_center = start
        self.eval_time, self.calm, self.finite = 0.0, 0, True
        self.target = setup.study.target
        self.metric = setup.study.target_metric  # what time_to_target waits for (maximised or minimised)
        self.maximize = maximized(self.metric)
        self.reached: float | None = None  # simulated time at which the target was reached
        self.best, self.prev_point = (0.0 if self.maximize else math.inf), None

    def round(self, r: int, end: int, steps: float, stack: models_mod.Stack, loss_sum: float, local: float, merged: float,
              sent: int, merges: int, label_skew: float, moved: int, timing: dict | None = None,
              horizon: float = 0.0, visitors: float | None = None, evaluated: tuple | None = None,
              last: bool = True) -> RoundMetrics:
        """``evaluated``: the consensus model's and the workers' validation results, if already taken with other
        runs' (:func:`evaluate_many`: a population's members in one forward). ``last``: the run ends with this round
        (a judge without ``curves`` evaluates only then)."""
        te = time.perf_counter()
        train_loss = loss_sum / (stack.W * steps)
        # a sum is non-finite iff an entry is
        self.finite = finite = math.isfinite(train_loss) and math.isfinite(stack.total())
        center = stack.mean()
        if finite and not last and not self.curves:  # not evaluated: NaN
            metrics = _untaken(self.model, float("nan"))
        else:
            metrics = _evaluate(self.model, stack, center, self.val_x, self.val_y, self.n_eval, finite, evaluated)
        sim_mean, sim_min = self.similarity.summary(stack) if finite else (float("nan"), float("nan"))
        n = self.model.n_train
        update = float((center[:n] - self.prev_center[:n]).norm()) / steps if finite else float("nan")
        self.prev_center = center
        self.eval_time += time.perf_counter() - te
        timing = dict(timing or {})
        if timing:
            timing.update(self.timing(timing["sim_time"], metrics, horizon))
            if not finite and self.target is not None:  # a diverged run is no run to copy, whenever it got there
                timing["time_to_target"] = 2.0 * horizon
        return RoundMetrics(
            round=r + 1, step=end, train_loss=train_loss, update_norm=update, bytes=sent, merges=merges,
            wall_time=time.perf_counter() - self.t0, local_update_norm=local, merge_update_norm=merged,
            similarity_mean=sim_mean, similarity_min=sim_min, label_skew=label_skew, examples_moved=moved, travel_visitors=visitors,
            **metrics,
            **timing,
        )

    def timing(self, t: float, metrics: dict, horizon: float) -> dict[str, float]:
        """Time to target and accuracy at time after a round that ended at simulated time ``t``.

        Time to target is the first time the consensus model's ``target_metric`` (validation accuracy by
        default) reaches the target (at or above it; at or below for a minimised metric such as ``val_loss``),
        interpolated linearly between the two rounds around the crossing (at round resolution when the first
        round already reaches it). Not reached (yet): ``horizon x (2 - best / target)`` with the best value so far
        (``2 - target / best`` for a minimised metric), which ranks after every reached value (at most the
        horizon, the time budget) and orders the runs that missed by how close they came. A run that diverged
        gets the worst value, ``2 x horizon``, even if it reached the target first."""
        # the metric at time objectives (the run ends at the time budget, so the last round's value is the one)
        out = {"loss_at_time": metrics["val_loss"]}
        for key, at in (("val_accuracy", "accuracy_at_time"), ("val_perplexity", "perplexity_at_time")):
            if metrics.get(key) is not None:
                out[at] = metrics[key]
        if self.target is None:
            return out
        v = metrics.get(self.metric)
        if v is None or not math.isfinite(v):
            v = 0.0 if self.maximize else math.inf
        # the crossing is taken on a maximised scale: a minimised metric by its negative
        s, goal = (v, self.target) if self.maximize else (-v, -self.target)
        if self.reached is None and s >= goal:
            self.reached = crossing(self.prev_point, t, s, goal)
        self.best = max(self.best, v) if self.maximize else min(self.best, v)
        self.prev_point = (t, s)
        if self.reached is not None:
            out["time_to_target"] = self.reached
        elif self.maximize:
            out["time_to_target"] = horizon * (2.0 - self.best / self.target) if self.target > 0 else horizon
        else:
            out["time_to_target"] = horizon * (2.0 - self.target / self.best) if math.isfinite(self.best) and \
                self.best > 0 else 2.0 * horizon
        return out

    def converged(self, local: float, merged: float, step: int, total: int) -> bool:
        """The convergence stop, after the round that ended at local step ``step``: its local and merge updates
        (per step) below ``stop_tol`` for ``stop_patience`` rounds."""
        tol = self.policy.stop_tol
        self.calm = self.calm + 1 if tol and local < tol and merged < tol else 0
        return bool(tol) and self.calm >= self.policy.stop_patience and step < total

    def test_metrics(self, stack: models_mod.Stack) -> tuple[float | None, float]:
        """The consensus model's accuracy (None where the task has no classes) and loss on the test set."""
        tx, ty = self.data.test()
        center = stack.mean().unsqueeze(0)
        acc, loss = _accuracy(self.model, self.model.views(center), normalise(tx.to(self.dev), self.data.spec),
                              ty.to(self.dev))
        return (acc[0] if acc is not None else None), loss[0]


def validation(setup: Setup, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split on ``dev``, inputs normalised."""
    data = setup.data
    return normalise(data.val_x.to(dev), data.spec), data.val_y.to(dev)


def update_norms(st: Workers, round_start: torch.Tensor, steps: int, runs: int | None = None) -> tuple[float, float] | list:
    """Per-step norms of what local steps and what merges changed this round, means over workers.
    ``runs``: the rows are that many runs' workers, consecutive ranges (a population's members), and each run's pair
    comes back in a list, from one computation over all rows (each row's norm is its own; the tests hold them bit for bit)."""
    model = st.params.model
    k = model.n_trained_blocks  # buffers (running statistics, counters) are not updates
    merged = st.merge_change.row_norms(k)
    local = torch.stack([(p - s - m).pow(2).sum(1) for p, s, m in
                         zip(st.params.blocks[:k], round_start.blocks[:k], st.merge_change.blocks[:k])]).sum(0).sqrt()
    n = runs or 1
    means = torch.stack([local.view(n, -1).mean(1), merged.view(n, -1).mean(1)], 1).tolist()  # one read
    out = [(a / steps, b / steps) for a, b in means]
    return out if runs else out[0]


class Similarity:
    """A run's model-similarity measure (``policy.similarity``): sketches or linear CKA."""

    def __init__(self, model, policy: MergePolicy, seed: int, start_row: torch.Tensor, data, train_x):
        self.model, self.kind = model, policy.similarity
        trained = model.offsets[:model.n_trained_blocks]  # the parameters' change, not the buffers'
        self.sketcher = similarity.Sketcher(trained, start_row, seed) if self.kind == "sketch" else None
        self.probe = None
        if self.kind == "cka":
            pos = torch.as_tensor(similarity.probe_positions(len(train_x), seed), device=train_x.device)
            self.probe = normalise(train_x[pos], data.spec)

    @torch.no_grad()
    def matrix(self, stack: models_mod.Stack) -> torch.Tensor:
        if self.sketcher is not None:
            return similarity.cosine_matrix(self.sketcher(stack.blocks))
        return similarity.linear_cka(self.model.logits(stack.params, self.probe))

    def summary(self, stack: models_mod.Stack) -> tuple[float, float]:
        return similarity.summary(self.matrix(stack))


@torch.no_grad()
def slice_losses(model, params: list[torch.Tensor], rows: list[int], x, y) -> torch.Tensor:
    """Loss (the task's, :mod:`evomerge.task`) of each of the given rows of stacked ``params`` on the same
    examples (normalised ``x``)."""
    views = [p[rows] for p in params]
    out = model.forward(views, x.unsqueeze(0).expand(len(rows), *x.shape))
    return model.task.example_losses(out, y.unsqueeze(0).expand(len(rows), *y.shape)).mean(1)


def eval_chunk(y: torch.Tensor) -> int:
    """Examples per evaluation forward: 2048, fewer when each example has many labels (a language model's
    ``[N, T]``), so that the outputs ``[W, chunk, T, C]`` stay small."""
    per = max(1, y[0].numel()) if len(y) else 1
    return 2048 if per == 1 else max(8, 4096 // per)


@torch.no_grad()
def _accuracy(model, params: list[torch.Tensor], x, y) -> tuple[list[float] | None, list[float]]:
    """Per row of ``params``: accuracy (None where the task has no classes) and mean loss, over positions for
    labels per position."""
    task = model.task
    if task.classification and not task.per_position and not task.ignores:  # one class per input: in one piece
        logits = model.logits(params, x)
        acc = (logits.argmax(-1) == y).float().mean(1)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.expand(len(logits), -1), reduction="none")
        return acc.tolist(), loss.mean(1).tolist()
    c = eval_chunk(y)
    loss = correct = count = None
    for xc, yc in zip(x.split(c), y.split(c)):
        l, k, n = model.task.summary(model.logits(params, xc), yc)
        loss, count = (l, n) if loss is None else (loss + l, count + n)
        if k is not None:
            correct = k if correct is None else correct + k
    count = count.clamp(min=1).double()
    acc = (correct.double() / count).tolist() if correct is not None else None
    return acc, (loss.double() / count).tolist()


@torch.no_grad()
def evaluate_many(model, params: list[torch.Tensor], runs: int, val_x, val_y, n_eval: int,
                  max_rows: int | None = None) -> list[tuple]:
    """What :meth:`Judge.round` evaluates, for ``runs`` runs whose workers are the consecutive row ranges of the
    stacked ``params`` (a population's state): each run's consensus model (the mean of its rows) on the validation
    split and every worker on its first ``n_eval`` examples, in forwards of at most ``max_rows`` rows (of several
    runs) instead of one per run; on the CPU each consensus model in a forward of its own. Each row's numbers are
    those of its run's own forward: bit for bit on the CPU, to float tolerance on a GPU.
    ``max_rows`` defaults to 256 on a GPU and 32 on the CPU, where a forward's activations of many rows leave the
    caches: at 32 members of 8 workers, 32 rows took 0.91-1.01x the time of 256, 0.93-0.96x in three runs of four
    (``benchmarks/bench_evaluate_many.py``).
    Returns per run ``(consensus accuracy, consensus loss, worker accuracies)``."""
    if max_rows is None:
        max_rows = 32 if params[0].device.type == "cpu" else 256
    W = params[0].shape[0] // runs
    per = max(1, max_rows // W)
    out = []
    for lo in range(0, runs, per):
        hi = min(runs, lo + per)
        rows = [p[lo * W:hi * W] for p in params]
        centers = [p.reshape(hi - lo, W, *p.shape[1:]).mean(1) for p in rows]
        wacc, _ = _accuracy(model, rows, val_x[:n_eval], val_y[:n_eval])
        if centers[0].device.type == "cpu":
            # each consensus model in a forward of its own, as Judge.round takes it: on the CPU a batched matrix
            # product of one row runs multithreaded and of several rows one thread per row, which round differently
            # (the workers' forwards have several rows either way); on a GPU (float tolerance) in one forward
            each = [_accuracy(model, [c[k:k + 1] for c in centers], val_x, val_y) for k in range(hi - lo)]
            acc = None if each[0][0] is None else [a[0] for a, _ in each]
            loss = [l[0] for _, l in each]
        else:
            acc, loss = _accuracy(model, centers, val_x, val_y)
        for k in range(hi - lo):
            out.append((acc[k] if acc is not None else None, loss[k],
                        wacc[k * W:(k + 1) * W] if wacc is not None else None))
    return out


def perplexity(loss: float) -> float:
    """A language model's perplexity from its token-weighted mean negative log-likelihood (capped: exp of 700)."""
    return math.exp(min(loss, 700.0))


def _untaken(model, accuracy: float) -> dict[str, float | None]:
    """A round's validation metrics where no forward gave them: every accuracy ``accuracy`` (None where the task has
    no classes), the loss, perplexity and consensus distance NaN."""
    classes, lm = model.task.classification, model.task.classification and model.task.per_position
    nan, acc = float("nan"), (accuracy if classes else None)
    return dict(val_accuracy=acc, val_loss=nan, mean_worker_accuracy=acc, worst_worker_accuracy=acc,
                consensus_distance=nan, val_perplexity=nan if lm else None)


def _evaluate(model, stack, center, val_x, val_y, n_eval, finite, evaluated=None) -> dict[str, float | None]:
    """The round's validation metrics. Accuracies are None (absent from every table) where the task has no
    classes; ``val_perplexity`` is given for labels per position (a language model)."""
    classes, lm = model.task.classification, model.task.classification and model.task.per_position
    if not finite:  # a diverged round: accuracy 0
        return _untaken(model, 0.0)
    if evaluated is not None:
        a, l, wacc = evaluated
        acc, loss = [a], [l]
    else:
        acc, loss = _accuracy(model, model.views(center.unsqueeze(0)), val_x, val_y)
        wacc, _ = _accuracy(model, stack.params, val_x[:n_eval], val_y[:n_eval])
    return dict(val_accuracy=acc[0] if classes else None, val_loss=loss[0],
                mean_worker_accuracy=float(np.mean(wacc)) if classes else None,
                worst_worker_accuracy=float(np.min(wacc)) if classes else None,
                val_perplexity=perplexity(loss[0]) if lm else None,
                consensus_distance=ops.consensus_distance(stack.rows()[:, :model.n_train], center[:model.n_train]))
