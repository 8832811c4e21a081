"""A merge run, whatever executes it: the study's data and model, the local steps, the
merges due after each step (planned by :mod:`.plan`, moved by a backend), the round loop
and the round-end judge, and the result.

The round loop (:func:`execute`) is the one every backend runs: the in-process backend
holds all workers' rows, the distributed backend one rank's, and only the rank that
judges (the one that can gather every row) evaluates, calls the callback and decides
whether the run goes on.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .. import data as data_mod
from .. import datapool
from .. import models as models_mod
from .. import ops
from .. import schedule as schedule_mod
from .. import similarity
from ..policy import MergePolicy
from ..study import Study
from . import kernel, plan as plan_mod
from .state import Workers, initial_row

if TYPE_CHECKING:
    from ..backends.base import Backend

TAG_BATCHES, TAG_SLICES = schedule_mod.STREAMS["batches"], schedule_mod.STREAMS["slices"]


@dataclass
class RoundMetrics:
    round: int
    step: int  # local steps done by each worker
    val_accuracy: float  # consensus model on the validation split
    val_loss: float
    mean_worker_accuracy: float
    worst_worker_accuracy: float
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
    # simulated time ([environment] only; None in the lockstep world)
    sim_time: float | None = None  # simulated seconds at the end of this round
    steps_min: int | None = None  # local steps done by the slowest / mean / fastest worker
    steps_mean: float | None = None
    steps_max: int | None = None
    idle_fraction: float | None = None  # of the workers' time in this round spent waiting (barriers, blocking merges)
    staleness: float | None = None  # mean age (simulated seconds) of the payloads applied in this round
    time_to_target: float | None = None  # see Judge.timing (running value: what it would be if accuracy stalled here)
    accuracy_at_time: float | None = None  # consensus validation accuracy at this round's simulated time


@dataclass
class RunResult:
    status: str  # "ok" or "diverged"
    seed: int
    policy: dict
    history: list[RoundMetrics]
    total_steps: int
    wall_time: float
    label_skew: float
    workers: int
    test_accuracy: float | None = None
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
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status, "seed": self.seed, "policy": self.policy, "workers": self.workers,
            "total_steps": self.total_steps, "wall_time": self.wall_time, "label_skew": self.label_skew,
            "final": self.metrics(), "history": [asdict(h) for h in self.history],
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
    model = models_mod.build_spec(study.model, data.input_shape, data.n_classes, base_dir)
    if hasattr(model, "check"):  # a user's model: refused in one line before any trial if it cannot run
        model.check(normalise(data.train_x[:4], data.spec), data.train_y[:4])
    labels = data.train_y.numpy()
    run = study.run
    parts = data_mod.partition(labels, run.workers, study.data.partition, alpha=study.data.alpha,
                               seed=study.data.seed, min_size=run.score_samples + 1)
    rng = schedule_mod.rng_for(study.data.seed, TAG_SLICES)
    shards, slices = [], []
    for p in parts:
        p = rng.permutation(p)
        slices.append(np.sort(p[:run.score_samples]))
        shards.append(np.sort(p[run.score_samples:]))
    skew = data_mod.label_skew(labels, shards, data.n_classes)
    return Setup(study, data, model, shards, slices, total_steps(study, [len(s) for s in shards]), skew)


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
    if x_uint8.dtype != torch.uint8:  # a loader's data (study.data.loader) are used as it gave them
        return x_uint8.float()
    return x_uint8.float().mul_(1.0 / (255.0 * spec.std)).sub_(spec.mean / spec.std)


def round_bounds(total: int, rounds: int) -> list[int]:
    rounds = min(rounds, total)
    return [round(total * (r + 1) / rounds) for r in range(rounds)]


def crossing(prev: tuple[float, float] | None, t: float, acc: float, target: float) -> float:
    """When the accuracy reached ``target``, given that it is ``acc >= target`` at time ``t`` and was
    ``prev = (t0, a0)`` (below the target) at the point before: linear between the two, at ``t`` without a
    point before. The one definition of time to target: the engine's rounds and ``benchmarks/sim_vs_real.py``'s
    real runs use it."""
    if prev is None:
        return t
    t0, a0 = prev
    return t0 + (target - a0) / (acc - a0) * (t - t0) if acc > a0 else t


class Judge:
    """What every backend does with all workers' parameters at the end of a round: evaluate
    the consensus model and the workers on the validation split, measure similarity, build
    the round's :class:`RoundMetrics` and apply the convergence stop; at the end, the test set."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, dev: torch.device, train_x: torch.Tensor, t0: float,
                 val: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``val``: the normalised validation inputs and labels on ``dev``, if already there (a population shares them)."""
        data, run, model = setup.data, setup.study.run, setup.model
        self.model, self.data, self.policy, self.dev, self.t0 = model, data, policy, dev, t0
        self.val_x, self.val_y = val if val is not None else validation(setup, dev)
        self.n_eval = run.eval_samples or len(self.val_y)
        start = initial_row(model, seed).to(dev)
        self.similarity = Similarity(model, policy, seed, start, data, train_x)
        self.prev_center = start
        self.eval_time, self.calm, self.finite = 0.0, 0, True
        self.target = setup.study.target
        self.reached: float | None = None  # simulated time at which the target was reached
        self.best, self.prev_point = 0.0, None

    def round(self, r: int, end: int, steps: float, stack: models_mod.Stack, loss_sum: float, local: float, merged: float,
              sent: int, merges: int, label_skew: float, moved: int, timing: dict | None = None,
              horizon: float = 0.0) -> RoundMetrics:
        te = time.perf_counter()
        train_loss = loss_sum / (stack.W * steps)
        # a sum is non-finite iff an entry is
        self.finite = finite = math.isfinite(train_loss) and math.isfinite(stack.total())
        center = stack.mean()
        metrics = _evaluate(self.model, stack, center, self.val_x, self.val_y, self.n_eval, finite)
        sim_mean, sim_min = self.similarity.summary(stack) if finite else (float("nan"), float("nan"))
        n = self.model.n_train
        update = float((center[:n] - self.prev_center[:n]).norm()) / steps if finite else float("nan")
        self.prev_center = center
        self.eval_time += time.perf_counter() - te
        timing = dict(timing or {})
        if timing:
            timing.update(self.timing(timing["sim_time"], metrics["val_accuracy"], horizon))
            if not finite and self.target is not None:  # a diverged run is no run to copy, whenever it got there
                timing["time_to_target"] = 2.0 * horizon
        return RoundMetrics(
            round=r + 1, step=end, train_loss=train_loss, update_norm=update, bytes=sent, merges=merges,
            wall_time=time.perf_counter() - self.t0, local_update_norm=local, merge_update_norm=merged,
            similarity_mean=sim_mean, similarity_min=sim_min, label_skew=label_skew, examples_moved=moved, **metrics,
            **timing,
        )

    def timing(self, t: float, acc: float, horizon: float) -> dict[str, float]:
        """Time to target and accuracy at time after a round that ended at simulated time ``t``.

        Time to target is the first time the consensus validation accuracy reaches the target,
        interpolated linearly between the two rounds around the crossing (at round resolution
        when the first round already reaches it). Not reached (yet): ``horizon x (2 - best / target)``
        with the best accuracy so far, which ranks after every reached value (at most the
        horizon, the time budget) and orders the runs that missed by how close they came. A run
        that diverged gets the worst value, ``2 x horizon``, even if it reached the target first."""
        out = {"accuracy_at_time": acc}
        if self.target is None:
            return out
        if self.reached is None and acc >= self.target:
            self.reached = crossing(self.prev_point, t, acc, self.target)
        self.best = max(self.best, acc)
        self.prev_point = (t, acc)
        if self.reached is not None:
            out["time_to_target"] = self.reached
        else:
            out["time_to_target"] = horizon * (2.0 - self.best / self.target) if self.target > 0 else horizon
        return out

    def converged(self, rm: RoundMetrics, total: int) -> bool:
        """The convergence stop: local and merge updates below ``stop_tol`` for ``stop_patience`` rounds."""
        tol = self.policy.stop_tol
        self.calm = self.calm + 1 if tol and rm.local_update_norm < tol and rm.merge_update_norm < tol else 0
        return bool(tol) and self.calm >= self.policy.stop_patience and rm.step < total

    def test_accuracy(self, stack: models_mod.Stack) -> float:
        tx, ty = self.data.test()
        center = stack.mean().unsqueeze(0)
        return _accuracy(self.model, self.model.views(center), normalise(tx.to(self.dev), self.data.spec), ty.to(self.dev))[0][0]


def validation(setup: Setup, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split on ``dev``, inputs normalised."""
    data = setup.data
    return normalise(data.val_x.to(dev), data.spec), data.val_y.to(dev)


def update_norms(st: Workers, round_start: torch.Tensor, steps: int) -> tuple[float, float]:
    """Per-step norms of what local steps and what merges changed this round, means over workers."""
    model, W = st.params.model, st.W
    k = model.n_trained_blocks  # buffers (running statistics, counters) are not updates
    merged = st.merge_change.row_norms(k)
    local = torch.stack([(p - s - m).pow(2).sum(1) for p, s, m in
                         zip(st.params.blocks[:k], round_start.blocks[:k], st.merge_change.blocks[:k])]).sum(0).sqrt()
    return float(local.mean()) / steps, float(merged.mean()) / steps


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


def train_steps(setup: Setup, st: Workers, workers, seed: int, start: int, end: int, train_x, train_y,
                after_step: Callable[[int], None], pool: datapool.DataPool | None = None) -> torch.Tensor:
    """Local steps ``start+1..end`` for ``workers`` (the rows of ``st``, in order), each step one
    batched forward/backward; ``after_step(step)`` applies the merges due. Returns the summed loss.

    Minibatches come from :func:`batch_indices` over the static shards, or, when data
    travels, from ``pool``, which also records each example's true-label probability."""
    model, run, B = setup.model, setup.study.run, setup.study.run.batch_size
    dev = st.params.device
    idx_t = None
    if pool is None:
        idx = np.stack([batch_indices(setup.shards[w], B, start, end - start, seed, w) for w in workers], axis=1)
        idx_t = torch.as_tensor(idx, device=dev)  # [steps, rows, B]
    loss_sum = torch.zeros((), device=dev)
    for i in range(end - start):
        if pool is None:
            bi = idx_t[i]
        else:
            pos = pool.batches(B)
            bi = torch.as_tensor(pos, device=dev)
        x, y = normalise(train_x[bi], setup.data.spec), train_y[bi]
        losses = local_step(setup, st, x, y)
        loss_sum += losses.mean(1).sum()
        if pool is not None:
            pool.record(pos, torch.exp(-losses).cpu().numpy())
        after_step(start + i + 1)
    return loss_sum


def local_step(setup: Setup, st: Workers, x: torch.Tensor, y: torch.Tensor,
               segments: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """One local step of every row of ``st`` on its minibatch (``x`` normalised); the per-example losses.
    ``segments``: the row ranges of separate runs (a population's members; see ``Optimizer.step``)."""
    model, run = setup.model, setup.study.run
    losses = model.sgd_step_(st.params.params, x, y, run.lr) if st.fused else None
    if losses is None:
        losses = model.loss_and_grad(st.params.params, x, y, st.grad.params)
        st.optim.step(st.params, st.grad, st.accum, segments=segments)
    kernel.score_step_(st.score, st.score_weight, losses.mean(1))
    return losses


@torch.no_grad()
def slice_losses(model, params: list[torch.Tensor], rows: list[int], x, y) -> torch.Tensor:
    """Loss of each of the given rows of stacked ``params`` on the same examples (normalised ``x``)."""
    views = [p[rows] for p in params]
    logits = model.forward(views, x.unsqueeze(0).expand(len(rows), *x.shape))
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.expand(len(rows), -1), reduction="none").mean(1)


@torch.no_grad()
def _accuracy(model, params: list[torch.Tensor], x, y) -> tuple[list[float], list[float]]:
    logits = model.logits(params, x)
    acc = (logits.argmax(-1) == y).float().mean(1)
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.expand(len(logits), -1), reduction="none").mean(1)
    return acc.tolist(), loss.tolist()


def _evaluate(model, stack, center, val_x, val_y, n_eval, finite) -> dict[str, float]:
    if not finite:
        return dict(val_accuracy=0.0, val_loss=float("nan"), mean_worker_accuracy=0.0,
                    worst_worker_accuracy=0.0, consensus_distance=float("nan"))
    acc, loss = _accuracy(model, model.views(center.unsqueeze(0)), val_x, val_y)
    wacc, _ = _accuracy(model, stack.params, val_x[:n_eval], val_y[:n_eval])
    return dict(val_accuracy=acc[0], val_loss=loss[0], mean_worker_accuracy=float(np.mean(wacc)),
                worst_worker_accuracy=float(np.min(wacc)),
                consensus_distance=ops.consensus_distance(stack.rows()[:, :model.n_train], center[:model.n_train]))




# -- merges after each local step -------------------------------------------------------------------
class StepMerger:
    """Applies the merges due after each local step through a backend, a set of disjoint
    pairs at a time (:func:`plan.group_disjoint`), and keeps what every backend agrees on:
    the example counters (summed on merge), the bytes on the wire and the merge count."""

    def __init__(self, setup: Setup, policy: MergePolicy, sched: schedule_mod.Schedule, backend: "Backend"):
        self.p, self.sched, self.backend = policy, sched, backend
        self.T, self.B = setup.total_steps, setup.study.run.batch_size
        self.st = backend.state
        neighbours = None
        if sched.topology is not None:
            neighbours = [len(sched.topology.neighbours(i)) for i in range(setup.study.run.workers)]
        self.cost = plan_mod.Bytes(policy, setup.model.n_params, neighbours, len(self.st.optim.stacks()),
                                   setup.model)
        self.bytes = 0
        self.count = 0
        self.landing: dict[int, list[int]] = {}  # Streaming DiLoCo: step -> all-reduce events that land after it

    def after_step(self, step: int) -> None:
        plan = self.plan(step)
        if plan is None:
            return
        for ps in plan[3]:
            self.apply_set(ps)
        self.finish(plan)

    def plan(self, step: int):
        """After local step ``step``: count the examples and plan the step's gossip as sets of disjoint
        pairs ``(events, a, b, sets)``, for :meth:`apply_set` in order and then :meth:`finish`. None
        when nothing is left to do (no event; an all-reduce, applied here)."""
        ex = self.st.examples
        ex += self.B
        s, p = self.sched, self.p
        for ev in self.landing.pop(step, ()):  # fragments sent fragment_delay steps ago land first
            self.backend.allreduce_finish(ev, plan_mod.allreduce_weight(p, int(s.step[ev]), self.T, float(s.u[ev])))
        evs = self.sched.events_at(step)
        if not len(evs):
            return None
        if s.scheme == "allreduce":
            for ev in evs:
                frag = None if s.fragment is None else int(s.fragment[ev])
                if p.fragment_delay:
                    self.backend.allreduce_start(ev)
                    self.landing.setdefault(step + p.fragment_delay, []).append(ev)
                else:
                    self.backend.allreduce(ev, step, plan_mod.allreduce_weight(p, step, self.T, float(s.u[ev])))
                if s.syncs_whole_model(ev):  # counters are summed, not averaged (with the last
                    ex.fill_(float(ex.sum()))  # fragment, which holds the buffers, when the model is streamed)
                self.bytes += self.cost.allreduce(len(ex), frag)
                self._rescale()
            self.count += len(evs)
            return None
        events = np.arange(evs.start, evs.stop)
        a = s.initiator[events]
        b = self.backend.peers(events, step)
        swap = (s.u_swap[events] < p.swap_p) if p.swap_p else np.zeros(len(events), dtype=bool)
        weight = plan_mod.scheduled_weight(p, step, self.T)
        sets = []
        for members in plan_mod.group_disjoint(a, b):
            m = np.asarray(members)
            sets.append(plan_mod.PairSet(step, events[m], a[m], b[m], s.u[events[m]], swap[m], weight))
        return events, a, b, sets

    def finish(self, plan) -> None:
        events, a, b, _ = plan
        self.bytes += self.backend.after_events(events, a, b)
        self.count += len(events)

    def apply_set(self, ps: plan_mod.PairSet) -> None:
        """One set of disjoint gossip events: the backend moves the tensors; counters and bytes here."""
        self.backend.pairs(ps)
        self.account(ps)

    def account(self, ps: plan_mod.PairSet) -> None:
        """The counters and bytes of a set of disjoint gossip events the tensors of which were moved."""
        ex, push_pull = self.st.examples, self.p.exchange == "push_pull"
        for i, j, sw in zip(ps.a.tolist(), ps.b.tolist(), ps.swap.tolist()):
            if sw:
                ex[[i, j]] = ex[[j, i]]
                self.bytes += self.cost.swap()
            else:
                total = ex[i] + ex[j]
                ex[j] = total
                if push_pull:
                    ex[i] = total
                self.bytes += self.cost.pair(i, j)
        self._rescale()

    def _rescale(self) -> None:
        self.st.rescale_supports()


# -- the round loop -----------------------------------------------------------------------------------
class Lockstep:
    """The lockstep world: every worker does the same local steps, the merges drawn for a step
    are applied after it, merges cost no time (no ``[environment]``)."""

    timeline = None

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, backend: "Backend"):
        self.backend = backend
        self.merger = StepMerger(setup, policy, backend.sched, backend)
        self.bounds = round_bounds(setup.total_steps, setup.study.run.rounds)
        self.start = 0

    @property
    def rounds(self) -> int:
        return len(self.bounds)

    def train_round(self, r: int) -> tuple[torch.Tensor, int, float]:
        """Round ``r``'s local steps and merges: (summed loss, local steps done, local steps in this round)."""
        start, end = self.start, self.bounds[r]
        loss = self.backend.train(start, end, self.merger.after_step)
        self.start = end
        return loss, end, end - start

    @property
    def sent(self) -> int:
        return self.merger.bytes

    @property
    def merges(self) -> int:
        return self.merger.count

    def timing(self, r: int) -> dict:
        return {}


def close_round(judge: Judge | None, backend: "Backend", round_start, r: int, end: int, steps: int, loss_sum,
                sent: int, merges: int, timing: dict, horizon: float, total: int,
                callback: Callable[[RoundMetrics], Any] | None) -> tuple[RoundMetrics | None, Any, str | None]:
    """The end of round ``r`` on one backend: update norms, the run-wide totals and the gathered rows, then
    where the backend judges the round's metrics, the callback (which may raise) and the decision. Returns
    ``(metrics, stack, outcome)``: metrics None where the backend does not judge; outcome None to go on,
    else ``diverged``, ``stopped`` (the callback returned False) or ``converged`` (the convergence stop)."""
    local, merged = update_norms(backend.state, round_start, steps)
    loss, local, merged = backend.totals(float(loss_sum), local, merged)
    stack = backend.gather()
    if judge is None:
        return None, stack, None
    rm = judge.round(r, end, steps, stack, loss, local, merged, sent, merges, backend.label_skew(), backend.moved(),
                     timing, horizon)
    if not judge.finite:
        return rm, stack, "diverged"
    if callback is not None and callback(rm) is False:
        return rm, stack, "stopped"
    backend.end_round(r)
    return rm, stack, "converged" if judge.converged(rm, total) else None


def execute(setup: Setup, policy: MergePolicy, seed: int, backend: "Backend", *,
            callback: Callable[[RoundMetrics], Any] | None = None, evaluate_test: bool = False,
            keep_params: bool = False, t0: float | None = None, emulate_time: bool = False) -> RunResult | None:
    """Run one merge run on ``backend``; returns the result where the backend judges, else None.

    ``callback`` gets each round's metrics where the backend judges: it may raise (the
    exception propagates) or return False (the run ends with status ``stopped``).
    """
    t0 = time.perf_counter() if t0 is None else t0
    run, T = setup.study.run, setup.total_steps
    st = backend.state
    judge = Judge(setup, policy, seed, st.params.device, backend.train_x, t0) if backend.judges else None
    backend.start(judge)
    if setup.study.environment is not None:
        from .timed import Timed

        driver = Timed(setup, policy, seed, backend, emulate=emulate_time)
    else:
        if policy.scheme == "async":
            from ..errors import ConfigError
            from ..policy import ASYNC_NEEDS_CLOCK

            raise ConfigError("policy.scheme", ASYNC_NEEDS_CLOCK)
        driver = Lockstep(setup, policy, seed, backend)
    history: list[RoundMetrics] = []
    status, converged, stack = "ok", None, None
    for r in range(driver.rounds):
        round_start = st.params.clone()
        st.merge_change.zero_()
        loss_sum, end, steps = driver.train_round(r)
        rm, stack, outcome = close_round(judge, backend, round_start, r, end, steps, loss_sum, driver.sent,
                                         driver.merges, driver.timing(r),
                                         driver.horizon if driver.timeline is not None else 0.0, T, callback)
        if rm is not None:
            history.append(rm)
            if outcome in ("diverged", "stopped"):
                status = outcome
            elif outcome == "converged":
                converged = end
        if not backend.agree(outcome is None):
            break
    if judge is None:
        return None
    test_acc = judge.test_accuracy(stack) if evaluate_test and status == "ok" else None
    return RunResult(
        status=status, seed=seed, policy=policy.to_dict(), history=history, total_steps=T,
        wall_time=time.perf_counter() - t0, label_skew=setup.label_skew, workers=run.workers,
        test_accuracy=test_acc, eval_time=judge.eval_time,
        params=stack.rows().cpu() if keep_params else None, converged_step=converged,
        communities=backend.communities(), model_at=backend.model_at(),
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a run uses: the one asked for, else CUDA when present, else the CPU (every backend)."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
