"""The in-process backend: all workers' parameters stacked as one ``[W, P]`` tensor.

One batched forward/backward per local step for all workers, merges applied as
tensor ops on rows, in the order of the seed's event schedule. Every round it
evaluates, reports to ``callback`` (the search prunes through it), and stops with
status ``diverged`` if the loss goes non-finite.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from . import data as data_mod
from . import datapool
from . import models as models_mod
from . import ops
from . import schedule as schedule_mod
from . import similarity
from .policy import MergePolicy
from .study import Study

TAG_INIT, TAG_BATCHES, TAG_SLICES, TAG_QUANT = 21, 22, 23, 24


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
        out = asdict(self.final)
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
    if data is None:
        d = study.data
        data = data_mod.load(d.dataset, data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    model = models_mod.build(study.model.name, data.input_shape, data.n_classes, **study.model.options)
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
    return x_uint8.float().mul_(1.0 / (255.0 * spec.std)).sub_(spec.mean / spec.std)


def round_bounds(total: int, rounds: int) -> list[int]:
    rounds = min(rounds, total)
    return [round(total * (r + 1) / rounds) for r in range(rounds)]


def initial_row(model: models_mod.StackedModel, seed: int) -> torch.Tensor:
    """The parameters every worker starts from (one flat row), drawn from the run seed."""
    return model.init(torch.Generator().manual_seed(int(schedule_mod.rng_for(seed, TAG_INIT).integers(2**62))))


class _Workers:
    """Mutable state of W workers during one run (each a :class:`models.Stack` in block layout)."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, device: torch.device, count: int | None = None):
        m, run = setup.model, setup.study.run
        self.W, self.P = count or run.workers, m.n_params
        self.params = m.stack(self.W, device)
        self.params.set_rows(initial_row(m, seed).to(device).unsqueeze(0).expand(self.W, -1))
        self.grad = self.params.like()
        self.momentum = self.params.like() if run.momentum else None
        self.accum = self.params.like() if policy.weighting == "adaptive" else None
        self.examples = torch.zeros(self.W, dtype=torch.float64, device=device)
        self.base = self.params.clone() if policy.payload == "delta" and count is None else None
        self.merge_change = self.params.like()  # what merges and swaps changed in this round
        self.model_at = np.arange(self.W)  # swaps move models between workers
        # plain SGD is fused into the backward pass where the model offers it
        self.fused = not run.momentum and not run.weight_decay and self.accum is None


def simulate(
    setup: Setup,
    policy: MergePolicy,
    seed: int = 0,
    *,
    callback: Callable[[RoundMetrics], None] | None = None,
    device: str | torch.device | None = None,
    evaluate_test: bool = False,
    keep_params: bool = False,
) -> RunResult:
    """Run one merge run; ``callback`` gets each round's metrics (it may raise to stop the run).

    ``evaluate_test`` also scores the consensus model on the test set (never during a
    search); ``keep_params`` returns the workers' final ``[W, P]`` parameters.
    """
    t0 = time.perf_counter()
    study, model, data = setup.study, setup.model, setup.data
    run = study.run
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    W, B, T = run.workers, run.batch_size, setup.total_steps
    sched = schedule_mod.build(policy, W, T, seed)
    st = _Workers(setup, policy, seed, dev)

    train_x, train_y = data.train_x.to(dev), data.train_y.to(dev)
    slice_idx = [torch.as_tensor(s, device=dev) for s in setup.slices]
    neighbours = None
    if sched.topology is not None:
        neighbours = [len(sched.topology.neighbours(i)) for i in range(W)]
    judge = Judge(setup, policy, seed, dev, train_x, t0)
    pool = None
    if policy.data_exchange_k or policy.retire_threshold:
        pool = datapool.DataPool(setup.shards, len(train_y), seed, retire_threshold=policy.retire_threshold,
                                 reserve_rate=policy.reserve_rate)

    merger = _Merger(st, policy, sched, model, data.spec, train_x, train_y, slice_idx, neighbours, seed, T,
                     judge.similarity, pool)
    history: list[RoundMetrics] = []
    status, start, ev, converged = "ok", 0, 0, None
    labels = data.train_y.numpy()

    def merge_after(step: int) -> None:
        nonlocal ev
        st.examples += B
        while ev < len(sched) and sched.step[ev] == step:
            merger.apply(ev, step)
            ev += 1

    for r, end in enumerate(round_bounds(T, run.rounds)):
        round_start = st.params.buf.clone()
        st.merge_change.buf.zero_()
        loss_sum = train_steps(setup, st, range(W), seed, start, end, train_x, train_y, merge_after, pool)
        local, merged = update_norms(st, round_start, end - start)
        skew = data_mod.label_skew(labels, pool.holdings(), data.n_classes) if pool is not None else setup.label_skew
        rm = judge.round(r, end, end - start, st.params, float(loss_sum), local, merged, merger.bytes, merger.count,
                         skew, pool.moved if pool is not None else 0)
        start = end
        history.append(rm)
        if not judge.finite:
            status = "diverged"
            break
        if callback is not None:
            callback(rm)
        if policy.regroup_every and (r + 1) % policy.regroup_every == 0:
            merger.regroup()
        if judge.converged(rm, T):
            converged = end
            break
    test_acc = judge.test_accuracy(st.params) if evaluate_test and status == "ok" else None
    return RunResult(status, seed, policy.to_dict(), history, T, time.perf_counter() - t0, setup.label_skew, W, test_acc,
                     judge.eval_time, st.params.rows().cpu() if keep_params else None, converged,
                     merger.groups.tolist() if policy.regroup_every else None, st.model_at.tolist())


class Judge:
    """What every backend does with all workers' parameters at the end of a round: evaluate
    the consensus model and the workers on the validation split, measure similarity, build
    the round's :class:`RoundMetrics` and apply the convergence stop; at the end, the test set."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, dev: torch.device, train_x: torch.Tensor, t0: float):
        data, run, model = setup.data, setup.study.run, setup.model
        self.model, self.data, self.policy, self.dev, self.t0 = model, data, policy, dev, t0
        self.val_x = normalise(data.val_x.to(dev), data.spec)
        self.val_y = data.val_y.to(dev)
        self.n_eval = run.eval_samples or len(self.val_y)
        start = initial_row(model, seed).to(dev)
        self.similarity = Similarity(model, policy, seed, start, data, train_x)
        self.prev_center = start
        self.eval_time, self.calm, self.finite = 0.0, 0, True

    def round(self, r: int, end: int, steps: int, stack: models_mod.Stack, loss_sum: float, local: float, merged: float,
              sent: int, merges: int, label_skew: float, moved: int) -> RoundMetrics:
        te = time.perf_counter()
        train_loss = loss_sum / (stack.W * steps)
        # a sum is non-finite iff an entry is
        self.finite = finite = math.isfinite(train_loss) and math.isfinite(float(stack.buf.sum()))
        center = stack.mean()
        metrics = _evaluate(self.model, stack, center, self.val_x, self.val_y, self.n_eval, finite)
        sim_mean, sim_min = self.similarity.summary(stack) if finite else (float("nan"), float("nan"))
        update = float((center - self.prev_center).norm()) / steps if finite else float("nan")
        self.prev_center = center
        self.eval_time += time.perf_counter() - te
        return RoundMetrics(
            round=r + 1, step=end, train_loss=train_loss, update_norm=update, bytes=sent, merges=merges,
            wall_time=time.perf_counter() - self.t0, local_update_norm=local, merge_update_norm=merged,
            similarity_mean=sim_mean, similarity_min=sim_min, label_skew=label_skew, examples_moved=moved, **metrics,
        )

    def converged(self, rm: RoundMetrics, total: int) -> bool:
        """The convergence stop: local and merge updates below ``stop_tol`` for ``stop_patience`` rounds."""
        tol = self.policy.stop_tol
        self.calm = self.calm + 1 if tol and rm.local_update_norm < tol and rm.merge_update_norm < tol else 0
        return bool(tol) and self.calm >= self.policy.stop_patience and rm.step < total

    def test_accuracy(self, stack: models_mod.Stack) -> float:
        tx, ty = self.data.test()
        center = stack.mean().unsqueeze(0)
        return _accuracy(self.model, self.model.views(center), normalise(tx.to(self.dev), self.data.spec), ty.to(self.dev))[0][0]


def update_norms(st: _Workers, round_start: torch.Tensor, steps: int) -> tuple[float, float]:
    """Per-step norms of what local steps and what merges changed this round, means over workers."""
    model, W = st.params.model, st.W
    merged = st.merge_change.row_norms()
    local = models_mod.Stack(model, W, buf=st.params.buf - round_start - st.merge_change.buf).row_norms()
    return float(local.mean()) / steps, float(merged.mean()) / steps


class Similarity:
    """A run's model-similarity measure (``policy.similarity``): sketches or linear CKA."""

    def __init__(self, model, policy: MergePolicy, seed: int, start_row: torch.Tensor, data, train_x):
        self.model, self.kind = model, policy.similarity
        self.sketcher = similarity.Sketcher(model.offsets, start_row, seed) if self.kind == "sketch" else None
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


def train_steps(setup: Setup, st: _Workers, workers, seed: int, start: int, end: int, train_x, train_y,
                after_step: Callable[[int], None], pool: datapool.DataPool | None = None) -> torch.Tensor:
    """Local steps ``start+1..end`` for ``workers`` (the rows of ``st``, in order), each step one
    batched forward/backward; ``after_step(step)`` applies the merges due. Returns the summed loss.

    Minibatches come from :func:`batch_indices` over the static shards, or, when data
    travels, from ``pool``, which also records each example's true-label probability."""
    model, run, B = setup.model, setup.study.run, setup.study.run.batch_size
    dev = st.params.buf.device
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
        losses = model.sgd_step_(st.params.params, x, y, run.lr) if st.fused else None
        if losses is None:
            losses = model.loss_and_grad(st.params.params, x, y, st.grad.params)
            _sgd_step(st, run)
        loss_sum += losses.mean(1).sum()
        if pool is not None:
            pool.record(pos, torch.exp(-losses).cpu().numpy())
        after_step(start + i + 1)
    return loss_sum


SUPPORT_LIMIT = 2.0**64


def rescale_supports(examples: torch.Tensor, accum: torch.Tensor | None) -> None:
    """Merges only use ratios of supports; keep them far from overflow by a common factor.

    Accumulators are summed on merge exactly as the example counters are, so the counters'
    largest value (a function of the schedule alone, known to every rank of a distributed
    run) decides for both; a power of two leaves every ratio exact.
    """
    if float(examples.max()) > SUPPORT_LIMIT:
        examples.mul_(1.0 / SUPPORT_LIMIT)
        if accum is not None:
            accum.mul_(1.0 / SUPPORT_LIMIT)


@torch.no_grad()
def slice_losses(model, params: list[torch.Tensor], rows: list[int], x, y) -> torch.Tensor:
    """Loss of each of the given rows of stacked ``params`` on the same examples (normalised ``x``)."""
    views = [p[rows] for p in params]
    logits = model.forward(views, x.unsqueeze(0).expand(len(rows), *x.shape))
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y.expand(len(rows), -1), reduction="none").mean(1)


def _sgd_step(st: _Workers, run) -> None:
    """torch.optim.SGD's update (weight decay, then momentum), on the whole buffer at once."""
    g, p = st.grad.buf, st.params.buf
    if run.weight_decay:
        g.add_(p, alpha=run.weight_decay)
    if st.accum is not None:
        st.accum.buf.addcmul_(g, g)
    if st.momentum is not None:
        g = st.momentum.buf.mul_(run.momentum).add_(g)
    p.add_(g, alpha=-run.lr)


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
                worst_worker_accuracy=float(np.min(wacc)), consensus_distance=ops.consensus_distance(stack.rows(), center))


class _Merger:
    """Applies the schedule's merge events to the stacked workers and charges their bytes."""

    def __init__(self, st, policy, sched, model, spec, train_x, train_y, slice_idx, neighbours, seed, total,
                 sim: "Similarity | None" = None, pool: datapool.DataPool | None = None):
        self.st, self.p, self.sched, self.model, self.spec = st, policy, sched, model, spec
        self.train_x, self.train_y, self.slice_idx = train_x, train_y, slice_idx
        self.neighbours, self.seed, self.total = neighbours, seed, total
        self.sim, self.pool = sim, pool
        self.bytes = 0
        self.count = 0
        P = st.P
        self.dense_bytes = ops.payload_bytes(P)
        self.sent_bytes = ops.payload_bytes(P, policy.topk_fraction, policy.quantize_bits) if policy.payload == "delta" else self.dense_bytes
        self.example_bytes = train_x[0].numel() * train_x.element_size() + 1  # pixels as stored, one label byte
        # peers drawn during the run, not from the schedule: by similarity, or in regrouped communities
        self.live_peers = policy.scheme == "gossip" and bool(policy.similarity_bias or policy.regroup_every)
        self.groups = getattr(sched.topology, "groups", np.zeros(st.W, dtype=np.int64))
        self.peer_p = sched.topology.probabilities() if sched.topology is not None else None
        self._sim_at: tuple[int, np.ndarray] | None = None  # (step, similarity matrix) cache

    def weight(self, step: int) -> float:
        p = self.p
        return ops.scheduled_weight(p.mixing_weight, p.mixing_weight_final, p.mixing_schedule, step / self.total)

    def apply(self, ev: int, step: int) -> None:
        self.count += 1
        if self.sched.scheme == "allreduce":
            self._allreduce(ev, step)
        else:
            a = int(self.sched.initiator[ev])
            b = self._peer(ev, step) if self.live_peers else int(self.sched.peer[ev])
            if self.p.swap_p and float(self.sched.u_swap[ev]) < self.p.swap_p:
                self._swap(a, b)
            else:
                self._pair(ev, step, a, b)
            if self.pool is not None and self.p.data_exchange_k:
                self.bytes += self.example_bytes * self.pool.send_least_confident(a, b, self.p.data_exchange_k)
        self._rescale_supports()

    # -- peers drawn during the run ------------------------------------------------------------
    def _similarities(self, step: int) -> np.ndarray:
        """The workers' similarity matrix, recomputed at most once per step (every 10 for CKA)."""
        every = 1 if self.p.similarity == "sketch" else 10
        if self._sim_at is None or step - self._sim_at[0] >= every:
            self._sim_at = (step, self.sim.matrix(self.st.params).cpu().numpy())
        return self._sim_at[1]

    def _peer(self, ev: int, step: int) -> int:
        a = int(self.sched.initiator[ev])
        p = self.peer_p[a]
        if self.p.similarity_bias:
            p = similarity.biased_peer_probabilities(p, self._similarities(step)[a], self.p.similarity_bias)
        return similarity.draw(p, float(self.sched.u_peer[ev]))

    def regroup(self) -> None:
        """Self-forming communities: cluster the workers by similarity into ``n_communities`` groups."""
        from .topology import Communities

        self.groups = similarity.cluster(self.sim.matrix(self.st.params), self.p.n_communities)
        self.peer_p = Communities(self.st.W, self.p.n_communities, self.p.p_intra, groups=self.groups).probabilities()
        self._sim_at = None

    # -- model swap ---------------------------------------------------------------------------
    def _swap(self, a: int, b: int) -> None:
        """The two workers exchange models, with everything that belongs to a model (optimiser
        state, supports, public copy); each goes on with the other's data. Two full transfers."""
        st = self.st
        ra, rb = st.params.row(a), st.params.row(b)
        for stack in (st.params, st.momentum, st.accum, st.base):
            if stack is not None:
                stack.swap_rows_(a, b)
        st.merge_change.set_row(a, st.merge_change.row(a) + (rb - ra))
        st.merge_change.set_row(b, st.merge_change.row(b) + (ra - rb))
        st.examples[[a, b]] = st.examples[[b, a]]
        st.model_at[[a, b]] = st.model_at[[b, a]]
        self.bytes += 2 * self.dense_bytes

    # what a worker puts on the wire, and what the receiver reconstructs from it
    def _outgoing(self, w: int, ev: int, side: int) -> torch.Tensor:
        st, p = self.st, self.p
        if p.payload == "weights":
            return st.params.row(w)
        base = st.base.row(w)
        d = ops.delta(st.params.row(w), base)
        gen = None
        if p.quantize_bits:
            gen = torch.Generator().manual_seed(int(schedule_mod.rng_for(self.seed, TAG_QUANT, ev, side).integers(2**62)))
        sent = ops.compress(d, p.topk_fraction, p.quantize_bits, gen)
        # the base is the public copy peers hold: what was not sent stays in params - base (error feedback)
        public = ops.apply_delta(base, sent)
        st.base.set_row(w, public)
        return public

    def _support(self, w: int):
        if self.p.weighting == "examples":
            return float(self.st.examples[w])
        if self.p.weighting == "adaptive":
            return self.st.accum.row(w)
        return None

    def _pair(self, ev: int, step: int, a_i: int, b_i: int) -> None:
        st, p, s = self.st, self.p, self.sched
        winner = self._winner(a_i, b_i) if p.winner_bias > 0 else None
        move_a, move_b = ops.pair_moves(self.weight(step), float(s.u[ev]), p.winner_bias, p.lerp == "random", winner)
        push_pull = p.exchange == "push_pull"
        from_a = self._outgoing(a_i, ev, 0)
        from_b = self._outgoing(b_i, ev, 1) if push_pull else None
        fan = self.neighbours[a_i] if p.payload == "delta" else 1
        self.bytes += self.sent_bytes * fan
        sa, sb = self._support(a_i), self._support(b_i)
        sa = sa.clone() if isinstance(sa, torch.Tensor) else sa
        sb = sb.clone() if isinstance(sb, torch.Tensor) else sb
        st.params.lerp_row_(b_i, from_a, ops.incoming_weight(move_b, sb, sa), st.merge_change)
        if push_pull:
            self.bytes += self.sent_bytes * (self.neighbours[b_i] if p.payload == "delta" else 1)
            st.params.lerp_row_(a_i, from_b, ops.incoming_weight(move_a, sa, sb), st.merge_change)
        self._merge_supports(a_i, b_i, push_pull)

    def _merge_supports(self, a: int, b: int, push_pull: bool) -> None:
        """Counters and accumulators are summed, not averaged (VW's merge)."""
        st = self.st
        total = st.examples[a] + st.examples[b]
        st.examples[b] = total
        if push_pull:
            st.examples[a] = total
        if st.accum is not None:
            acc = st.accum.row(a) + st.accum.row(b)
            st.accum.set_row(b, acc)
            if push_pull:
                st.accum.set_row(a, acc)

    def _rescale_supports(self) -> None:
        rescale_supports(self.st.examples, self.st.accum.buf if self.st.accum is not None else None)

    @torch.no_grad()
    def _winner(self, a: int, b: int) -> int:
        """0 if the initiator has the lower loss on both workers' validation slices, else 1."""
        idx = torch.cat([self.slice_idx[a], self.slice_idx[b]])
        loss = slice_losses(self.model, self.st.params.params, [a, b], normalise(self.train_x[idx], self.spec), self.train_y[idx])
        return 0 if float(loss[0]) <= float(loss[1]) else 1

    def _allreduce(self, ev: int, step: int) -> None:
        st, p, W = self.st, self.p, self.st.W
        a = self.weight(step) * (float(self.sched.u[ev]) if p.lerp == "random" else 1.0)
        if p.payload == "delta":
            sent = torch.stack([self._outgoing(w, ev, w) for w in range(W)])
            blocks = [sent[:, o:o + n] for o, n in self.model.offsets]
        else:
            blocks = st.params.blocks
        supports: list = [st.examples] * len(blocks) if p.weighting == "examples" else (
            st.accum.blocks if p.weighting == "adaptive" else [None] * len(blocks))
        before = st.params.buf.clone()
        for own, models, support in zip(st.params.blocks, blocks, supports):
            avg, merged = ops.weighted_average(models, support)
            own.lerp_(avg.unsqueeze(0).expand_as(own), a)
            if p.weighting == "adaptive":
                support.copy_(merged.unsqueeze(0).expand_as(support))
        st.merge_change.buf.add_(st.params.buf).sub_(before)
        st.examples.fill_(float(st.examples.sum()))  # counters are summed, not averaged
        # each worker uploads its payload and downloads the dense average (parameter-server accounting)
        self.bytes += W * (self.sent_bytes + self.dense_bytes)
