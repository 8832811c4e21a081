"""A population: N merge runs of one study (members, each a policy and a seed) trained as one
stacked computation of N x W rows, the engine's per-step batching one level up.

Every member keeps what makes it a run of its own: its schedule, mixing weights, payloads,
example counters, public copies, judge and callback (its own in-process backend, whose state
is a view of its rows of the population's state). After each local step every member applies
its own merges to its own rows; each local step is one batched forward/backward (and optimiser
update) over the rows of every member still running. Members whose local step is a different
computation (adaptive weighting gathers squared gradients, so its SGD is not fused) form a group
of their own: one stacked computation per group.

A member ends on its own (it diverged, its callback raised or returned False, the convergence
stop, the last round); at the end of that round the rows of the members still running are
packed into a smaller state (masking by compaction), so the finished ones cost nothing more.

Each member's result equals its one-at-a-time run (:func:`evomerge.simulate.simulate`): on the
CPU bit for bit (batched matrix products compute every row alone; elementwise updates do not
depend on the rows beside them), on CUDA to float tolerance. Runs on a simulated clock
(``[environment]``) run one at a time: their workers step at different times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .. import models as models_mod, registry
from ..engine import datapool, judge as judge_mod, kernel, run as run_mod, setup as setup_mod
from ..engine.judge import Judge
from ..engine.merger import StepMerger
from ..engine.run import local_step
from ..engine.schedule import layer_keys
from ..engine.setup import RoundMetrics, RunResult, Setup, batch_indices, normalise, round_bounds
from ..engine.state import Workers, initial_row
from ..policy import MergePolicy


@dataclass
class Member:
    """One run of a population: ``callback`` gets each round's metrics, as :func:`execute`'s does
    (it may return False to stop the run, or raise: the exception is the member's outcome)."""

    policy: MergePolicy
    seed: int
    callback: Callable[[RoundMetrics], Any] | None = None


class _Run:
    """A member while it runs."""

    def __init__(self, m: Member, setup: Setup, state: Workers, dev, tensors, val, t0: float):
        from .inprocess import InProcess

        self.m = m
        self.backend = InProcess(setup, m.policy, m.seed, dev, state=state, tensors=tensors)
        self.st = state
        self.judge = Judge(setup, m.policy, m.seed, dev, tensors[0], t0, val=val)
        self.backend.start(self.judge)
        self.merger = StepMerger(setup, m.policy, self.backend.sched, self.backend)
        self.cross = cross_mergeable(m.policy, setup.model, state)
        self.history: list[RoundMetrics] = []
        self.status, self.converged, self.error = "ok", None, None
        self.done = False
        self.loss = None
        self.round_start = None
        self.idx = None  # this round's minibatch positions [steps, W, B] (static shards)


class _Group:
    """Members whose local step is the same computation, stacked as one state."""

    def __init__(self, runs: list[_Run], state: Workers):
        self.runs, self.state = runs, state
        self.idx = self.loss = None  # this round's (begin_round)
        self.start = None  # the rows at this round's start (a copy)
        self.pending: list = []  # this step's collected all-reduces (collect_allreduces): (backend, weight, supports)

    def collect_allreduces(self, setup: Setup) -> None:
        """The members whose all-reduces are plain averages of weights (:func:`cross_allreducible`) leave them to
        the group, which applies every member's at once after the step's planning (:meth:`_allreduces`)."""
        for r in self.runs:
            if cross_allreducible(r.m.policy, setup.model, r.st):
                r.backend.collect = self.pending

    def live(self) -> list[_Run]:
        return [r for r in self.runs if not r.done]

    def compact(self, W: int) -> None:
        """Pack the rows of the members still running into a new, smaller state (exact copies)."""
        keep = self.live()
        if len(keep) == len(self.runs):
            return
        for r in self.runs:  # a finished member keeps a copy of its parameters (the result), not the population's rows
            if r.done:
                r.st.params = r.st.params.clone()
                r.st.grad = r.st.accum = r.st.optim = r.st.momentum = r.st.merge_change = None
        if not keep:
            self.runs, self.state = [], None
            return
        rows = np.concatenate([np.arange(i * W, (i + 1) * W) for i, r in enumerate(self.runs) if not r.done])
        new = self.state.take(rows.tolist())  # what a step touches, gathered
        new.merge_change = new.params.like()  # zeroed at every round's start: nothing to carry
        new.examples = new.base = new.model_at = None
        for i, r in enumerate(keep):
            r.st.point_at(new, i * W, (i + 1) * W)
        self.runs, self.state = keep, new

    def begin_round(self, dev) -> None:
        """This round's minibatch positions of every member at once (when none draws from a data pool) and the
        members' loss sums, one number each: a step then indexes once and adds once, whatever the members."""
        self.idx = torch.cat([r.idx for r in self.runs], dim=1) if all(r.idx is not None for r in self.runs) else None
        self.loss = torch.zeros(len(self.runs), device=dev)

    def end_round(self) -> None:
        """Each member's loss sum, for its round's metrics."""
        for k, r in enumerate(self.runs):
            r.loss = self.loss[k]
        self.idx = None

    def step(self, setup: Setup, i: int, train_x, train_y, step: int) -> None:
        """Local step ``i`` of the round (the run's ``step``-th) for every member of the group: one batched step."""
        W, B = setup.study.run.workers, setup.study.run.batch_size
        if self.idx is not None:
            bi = self.idx[i]
        else:
            parts, pools = [], [None] * len(self.runs)
            for k, r in enumerate(self.runs):
                if r.backend.pool is None:
                    parts.append(r.idx[i])
                else:
                    pools[k] = r.backend.pool.batches(B)
                    parts.append(torch.as_tensor(pools[k], device=train_x.device))
            bi = torch.cat(parts) if len(parts) > 1 else parts[0]
        x, y = normalise(train_x[bi], setup.data.spec), train_y[bi]
        W_all = self.state.W
        segments = [(k * W, (k + 1) * W) for k in range(W_all // W)]
        keys = ([k for r in self.runs for k in layer_keys(r.m.seed, range(W), step)] if setup.model.random else None)
        losses = local_step(setup, self.state, x, y, segments, keys=keys)
        # each member's mean loss per worker, summed over its workers (the sum its run alone takes, bit for bit)
        self.loss.add_(losses.mean(1).reshape(len(self.runs), -1).sum(1))
        if self.idx is None:  # the members that draw from a data pool record what their examples cost
            for k, (r, pos) in enumerate(zip(self.runs, pools)):
                if pos is not None:
                    r.backend.pool.record(pos, torch.exp(-losses[k * W:(k + 1) * W]).cpu().numpy())

    def merge(self, setup: Setup, step: int, cross: bool, train_x, train_y, slices) -> None:
        """The merges due after local step ``step``, each member's planned by its own merger. Members whose
        merges are plain lerps of weights (:func:`cross_mergeable`) have their k-th sets of disjoint pairs
        applied together, all members at once (``cross``); the others apply their own."""
        together = []
        for r in self.runs:
            plan = r.merger.plan(step)
            if plan is None:
                continue
            if cross and r.cross:
                together.append((r, plan))
                continue
            for ps in plan[3]:
                r.merger.apply_set(ps)
            r.merger.finish(plan)
        W = setup.study.run.workers
        offset = {id(r): k * W for k, r in enumerate(self.runs)}
        layer = 0
        while True:
            items = [(r, plan[3][layer], offset[id(r)]) for r, plan in together if layer < len(plan[3])]
            if not items:
                break
            self._pairs(setup, items, train_x, train_y, slices)
            for r, ps, _ in items:
                r.merger.account(ps)
            layer += 1
        for r, plan in together:
            r.merger.finish(plan)
        if self.pending:
            self._allreduces(W, setup.model.offsets)

    @torch.no_grad()
    def _allreduces(self, W: int, offsets) -> None:
        """The all-reduces the members left to the group this step (:meth:`collect_allreduces`) in one piece: per
        parameter block one gather of their rows, the average of each member's rows (:func:`ops.weighted_average` over
        the workers, with each member's supports where it weighs by examples),
        each member's outer step on its average where it has one (DiLoCo: its own anchor and momentum, block by
        block, :meth:`kernel.Outer.step_`), and one lerp with each member's weight and scatter
        (:func:`kernel.lerp_rows_gathered_`). The arithmetic of :func:`kernel.average_all_` row by row (the tests
        hold them bit for bit)."""
        from ..engine import ops

        st = self.state
        dev = st.params.device
        offset = {id(r.backend): k * W for k, r in enumerate(self.runs)}
        pending = list(self.pending)
        self.pending.clear()  # the members' backends hold this list
        # one all-reduce per member: cross_allreducible takes one fragment, whose schedule has an event per step at most
        for items in ([x for x in pending if x[2] is None], [x for x in pending if x[2] is not None]):
            if not items:
                continue
            M = len(items)
            rows = torch.as_tensor(np.concatenate([np.arange(offset[id(b)], offset[id(b)] + W) for b, _, _ in items]),
                                   device=dev)
            weight = torch.tensor([w for _, w, _ in items], dtype=torch.float32, device=dev).view(M, 1, 1)
            support = None if items[0][2] is None else torch.stack([s for _, _, s in items])  # [M, W]
            outers = [(m, b.state.outer) for m, (b, _, _) in enumerate(items) if b.state.outer is not None]
            for k, (blk, chg) in enumerate(zip(st.params.blocks, st.merge_change.blocks)):
                rows3 = blk.index_select(0, rows).view(M, W, -1)
                avg, _ = ops.weighted_average(rows3, support, dim=1)  # [M, n]: each member's average
                for m, outer in outers:  # the outer step on the average: the new anchor is the target
                    if k < outer.blocks:
                        avg[m].copy_(outer.step_(avg[m], *offsets[k]))
                kernel.lerp_rows_gathered_(blk, rows, avg.unsqueeze(1), weight, chg, before=rows3)

    @torch.no_grad()
    def _pairs(self, setup: Setup, items, train_x, train_y, slices) -> None:
        """Sets of disjoint pairs of several members, ``(run, PairSet, row offset)`` each, applied as one:
        one winner-test forward for every pair that needs it, then per parameter block one gather, lerp and
        scatter for all pairs. The arithmetic of :meth:`InProcess.pairs` (the tests hold them bit for bit)."""
        from ..engine import plan as plan_mod
        from ..engine.weighting import Adaptive

        st, model = self.state, setup.model
        dev = st.params.device
        winners: dict[int, list] = {}
        test = [(k, r, ps, off) for k, (r, ps, off) in enumerate(items) if r.m.policy.winner_bias > 0]
        if test:
            a = np.concatenate([ps.a + off for _, _, ps, off in test])
            b = np.concatenate([ps.b + off for _, _, ps, off in test])
            rows = torch.as_tensor(np.stack([a, b], axis=1).reshape(-1), device=dev)
            x, y = kernel.pair_examples(train_x, train_y, slices, np.concatenate([ps.a for _, _, ps, _ in test]),
                                        np.concatenate([ps.b for _, _, ps, _ in test]), setup.data.spec)
            loss = kernel.pair_losses(model, [q.index_select(0, rows) for q in st.params.params], x, y)
            n = 0
            for k, _, ps, _ in test:
                winners[k] = [plan_mod.winner(loss[2 * (n + i)], loss[2 * (n + i) + 1]) for i in range(len(ps))]
                n += len(ps)
        B, A, WB, A_pp, pos_pp, WA = [], [], [], [], [], []
        move_b, move_a = [], []  # per-coordinate weightings (accumulators): the moves, weighed for all members at once
        per_coordinate = st.accum is not None
        n = 0
        for k, (r, ps, off) in enumerate(items):
            p, mst = r.m.policy, r.st
            moves = [plan_mod.moves(p, ps.weight, float(u), w)
                     for u, w in zip(ps.u.tolist(), winners.get(k, [None] * len(ps)))]
            weighting = r.backend.weighting
            B.append(ps.b + off)
            A.append(ps.a + off)
            if per_coordinate:
                move_b += [m[1] for m in moves]
            else:
                WB += weighting.pair_column(mst, [m[1] for m in moves], ps.b, ps.a)
            if p.exchange == "push_pull":
                if per_coordinate:
                    move_a += [m[0] for m in moves]
                else:
                    WA += weighting.pair_column(mst, [m[0] for m in moves], ps.a, ps.b)
                A_pp.append(ps.a + off)
                pos_pp.append(np.arange(n, n + len(ps)))
            n += len(ps)
        # every row index of the layer in one copy to the device (B, A, then push-pull's A and positions)
        B_np, A_np = np.concatenate(B), np.concatenate(A)
        App_np = np.concatenate(A_pp) if A_pp else B_np[:0]
        index = torch.as_tensor(np.concatenate([B_np, A_np, App_np, np.concatenate(pos_pp) if A_pp else App_np]),
                                device=dev)
        B_t, A_t, App_t, sel = index.split([n, n, len(App_np), len(App_np)])
        if per_coordinate:  # every member's weights from the supports before this set, as its own backend takes them
            weighting = Adaptive()  # the one rule with accumulators applied together (_weighed_together)
            WB_t = weighting.incoming_weights(st, move_b, B_t, [], [q.index_select(0, A_t) for q in st.accum.blocks])
            if A_pp:
                Bpp_t = B_t.index_select(0, sel)
                WA_t = weighting.incoming_weights(st, move_a, App_t, [],
                                                  [q.index_select(0, Bpp_t) for q in st.accum.blocks])
        else:  # one column for every member's pairs (both sides), in one copy
            both = torch.tensor(WB + WA, dtype=torch.float32, device=dev).unsqueeze(1)
            WB_t, WA_t = both[:n], both[n:]
        for k, (blk, chg) in enumerate(zip(st.params.blocks, st.merge_change.blocks)):
            old_a = blk.index_select(0, A_t)
            old_b = blk.index_select(0, B_t)
            kernel.lerp_rows_gathered_(blk, B_t, old_a, WB_t[k] if per_coordinate else WB_t, chg, before=old_b)
            if A_pp:
                kernel.lerp_rows_gathered_(blk, App_t, old_b.index_select(0, sel), WA_t[k] if per_coordinate else WA_t,
                                           chg, before=old_a.index_select(0, sel))
        if per_coordinate:  # the supports are summed, not averaged (all members' pairs at once)
            kernel.sum_pairs_gathered_(st.accum.blocks, A_t, B_t, App_t, sel)


def cross_mergeable(policy: MergePolicy, model, st: Workers) -> bool:
    """Whether a member's gossip is a plain lerp of weights that :meth:`_Group.merge` may apply together with
    other members': weights on the wire, no swaps, a column of weights (uniform or examples) or per-coordinate
    weights from accumulators (adaptive: the group's members all have them, weighed at once), no optimiser
    state merged, no buffers, the holdout score (the running one moves with the models). Everything else is applied by the member's own backend."""
    return (policy.scheme == "gossip" and not registry.PAYLOADS.get_object(policy.payload).public
            and not policy.swap_p and policy.score == "holdout" and _weighed_together(policy)
            and (policy.optimizer_state == "keep" or not st.optim.stacks())
            and model.n_trained_blocks == len(model.offsets))


def cross_allreducible(policy: MergePolicy, model, st: Workers) -> bool:
    """Whether a member's all-reduces are averages of weights that :meth:`_Group._allreduces` may apply together
    with other members': the all-reduce scheme, weights on the wire (with or without DiLoCo's outer step on the
    average), the whole model at once (no fragments), a plain mean or weighted by examples, no optimiser state
    merged, no buffers."""
    from ..engine.weighting import Examples, Payload, Weighting

    rule = registry.WEIGHTINGS.get_object(policy.weighting)
    payload = registry.PAYLOADS.get_object(policy.payload)
    return (policy.scheme == "allreduce" and payload.models and not payload.public
            and payload.outgoing is Payload.outgoing and policy.fragments <= 1
            and not policy.fragment_delay and not policy.fragment_alpha
            and not rule.accumulators and rule.supports in (Weighting.supports, Examples.supports)
            and (policy.optimizer_state == "keep" or (not st.optim.stacks() and st.optim.steps is None))
            and model.n_trained_blocks == len(model.offsets))


def _weighed_together(policy: MergePolicy) -> bool:
    """Whether :meth:`_Group._pairs` may weigh a member's pairs with the others': a column rule that gives its weights
    as numbers (:meth:`Weighting.column`, not its own ``incoming_weights``), or the adaptive rule itself (its
    per-coordinate weights from the group's accumulators). A rule of a user's that overrides ``incoming_weights``
    is applied by the member's own backend."""
    from ..engine.weighting import Adaptive, Weighting

    rule = registry.WEIGHTINGS.get_object(policy.weighting)
    if rule.accumulators:
        return not rule.by_examples and rule.incoming_weights is Adaptive.incoming_weights
    return rule.incoming_weights is Weighting.incoming_weights


def run_population(setup: Setup, members: list[Member], device: str | torch.device | None = None, *,
                   evaluate_test: bool = False, keep_params: bool = False,
                   cross: bool | None = None) -> list[RunResult | BaseException]:
    """Run every member; returns, in order, each member's :class:`RunResult`, or the exception its
    callback raised (a KeyboardInterrupt is not caught: it ends the population). ``cross``: apply the
    members' plain gossip merges together (:meth:`_Group.merge`); default: on CUDA, where it saves kernel
    launches, not on the CPU, where gathering rows costs more than the launches it saves."""
    from .base import device_tensors

    dev = setup_mod.resolve_device(device)
    cross = dev.type == "cuda" if cross is None else cross
    if not members:
        return []
    for m in members:  # (a policy from a file or the API: the study's own are checked)
        setup_mod.refuse_confidence(m.policy, setup.model.task)
    if (setup.study.environment is not None or any(m.policy.payload == "gradient" for m in members)
            or setup.study.run.workers == 1):
        # members on simulated clocks, or all-reducing gradients (their update waits for the average): one at a time;
        # so with one worker each, whose run alone multiplies one row at a time (multithreaded on the CPU, rounding
        # otherwise than the population's rows, one thread each)
        return [_alone(setup, m, dev, evaluate_test, keep_params) for m in members]
    for m in members:
        if m.policy.scheme == "async":
            from ..errors import ConfigError
            from ..policy import ASYNC_NEEDS_CLOCK

            raise ConfigError("policy.scheme", ASYNC_NEEDS_CLOCK)
    t0 = time.perf_counter()
    run, W, T = setup.study.run, setup.study.run.workers, setup.total_steps
    tensors = device_tensors(setup, dev)
    val = judge_mod.validation(setup, dev)
    groups: list[_Group] = []
    runs: list[_Run | None] = [None] * len(members)
    by_key: dict[bool, list[int]] = {}
    for k, m in enumerate(members):
        by_key.setdefault(registry.WEIGHTINGS.get_object(m.policy.weighting).accumulators, []).append(k)
    for accumulators, ks in by_key.items():
        whole = Workers.population(setup.model, run, [initial_row(setup.model, members[k].seed) for k in ks],
                                   accumulators, dev)
        group = []
        for i, k in enumerate(ks):
            st = whole.member(i * W, (i + 1) * W, members[k].policy, run)
            runs[k] = _Run(members[k], setup, st, dev, tensors, val, t0)
            group.append(runs[k])
        groups.append(_Group(group, whole))
        if cross:
            groups[-1].collect_allreduces(setup)
    bounds = round_bounds(T, run.rounds)
    start = 0
    for r, end in enumerate(bounds):
        steps = end - start
        idx_cache: dict[int, torch.Tensor] = {}
        for g in groups:
            # the round's start, one copy for all members (each reads its rows), and the merges' changes zeroed at once
            g.start = g.state.params.clone()
            g.state.merge_change.zero_()
            for k, x in enumerate(g.runs):
                x.round_start = models_mod.Stack.view(g.start, k * W, (k + 1) * W)
                if x.backend.pool is None:
                    if x.m.seed not in idx_cache:  # the minibatches are a function of the seed alone
                        idx = np.stack([batch_indices(setup.shards[w], run.batch_size, start, steps, x.m.seed, w)
                                        for w in range(W)], axis=1)
                        idx_cache[x.m.seed] = torch.as_tensor(idx, device=dev)
                    x.idx = idx_cache[x.m.seed]
            g.begin_round(dev)
        for i in range(steps):
            for g in groups:
                g.step(setup, i, tensors[0], tensors[1], start + i + 1)
            for g in groups:
                g.merge(setup, start + i + 1, cross, *tensors)
        for g in groups:
            g.end_round()
            # every member's consensus model and workers on the validation split, in forwards over members
            te = time.perf_counter()
            judge = g.runs[0].judge
            evaluated = judge_mod.evaluate_many(setup.model, g.state.params.params, len(g.runs), judge.val_x,
                                                judge.val_y, judge.n_eval)
            share = (time.perf_counter() - te) / len(g.runs)
            # every member's update norms, from one computation over the group's rows
            norms = judge_mod.update_norms(g.state, g.start, steps, runs=len(g.runs))
            for x, ev, nm in zip(g.runs, evaluated, norms):
                x.judge.eval_time += share
                _judge_round(x, r, end, steps, T, last=r == len(bounds) - 1, evaluated=ev, norms=nm)
                x.idx = None
        start = end
        for g in groups:
            g.compact(W)
        groups = [g for g in groups if g.runs]
        if not groups:
            break
    return [_result(x, setup, evaluate_test, keep_params, t0) for x in runs]


def _judge_round(x: _Run, r: int, end: int, steps: int, T: int, last: bool, evaluated: tuple | None = None,
                 norms: tuple[float, float] | None = None) -> None:
    """What :func:`execute` does at the end of a round (:func:`run.close_round`), for one member (``evaluated``: its
    validation results, taken with the other members')."""
    try:
        sent = x.merger.bytes + x.backend.regroup_bytes
        rm, _, outcome = run_mod.close_round(x.judge, x.backend, x.round_start, r, end, steps, x.loss, sent,
                                             x.merger.count, {}, 0.0, T, x.m.callback, evaluated=evaluated,
                                             norms=norms, last=last)
    except Exception as e:  # its callback raised: this member's outcome; the others go on
        x.error, x.done = e, True
        return
    x.round_start = None
    x.history.append(rm)
    if outcome in ("diverged", "stopped"):
        x.status = outcome
    elif outcome == "converged":
        x.converged = end
    x.done = outcome is not None or last


def _result(x: _Run, setup: Setup, evaluate_test: bool, keep_params: bool, t0: float) -> RunResult | BaseException:
    if x.error is not None:
        return x.error
    stack = x.backend.gather()
    test_acc, test_loss = x.judge.test_metrics(stack) if evaluate_test and x.status == "ok" else (None, None)
    return RunResult(
        status=x.status, seed=x.m.seed, policy=x.m.policy.to_dict(), history=x.history, total_steps=setup.total_steps,
        wall_time=time.perf_counter() - t0, label_skew=setup.label_skew, workers=setup.study.run.workers,
        test_accuracy=test_acc, test_loss=test_loss, eval_time=x.judge.eval_time,
        params=stack.rows().cpu() if keep_params else None, converged_step=x.converged,
        communities=x.backend.communities(), model_at=x.backend.model_at(),
    )


def _alone(setup: Setup, m: Member, dev, evaluate_test: bool, keep_params: bool) -> RunResult | BaseException:
    from .inprocess import run as simulate

    try:
        return simulate(setup, m.policy, m.seed, callback=m.callback, device=dev, evaluate_test=evaluate_test,
                        keep_params=keep_params)
    except Exception as e:
        return e
