"""A merge run, whatever executes it: the local steps, the merges due after each step (:mod:`.merger`), the
round loop and the round-end judge (:mod:`.judge`), and the result; what a run is made of is :mod:`.setup`.

The round loop (:func:`execute`) is the one every backend runs: the in-process backend
holds all workers' rows, the distributed backend one rank's, and only the rank that
judges (the one that can gather every row) evaluates, calls the callback and decides
whether the run goes on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from . import datapool
from ..policy import MergePolicy
from . import kernel
from . import schedule as schedule_mod
from .judge import Judge, update_norms
from .merger import StepMerger
from .setup import RoundMetrics, RunResult, Setup, batch_indices, normalise, round_bounds
from .state import Workers

if TYPE_CHECKING:
    from ..backends.base import Backend


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
        keys = schedule_mod.layer_keys(seed, workers, start + i + 1) if model.random else None
        losses = local_step(setup, st, x, y, keys=keys)
        loss_sum += losses.mean(1).sum()
        if pool is not None:
            pool.record(pos, torch.exp(-losses).cpu().numpy())
        after_step(start + i + 1)
    return loss_sum


def local_step(setup: Setup, st: Workers, x: torch.Tensor, y: torch.Tensor,
               segments: list[tuple[int, int]] | None = None, keys: list[int] | None = None) -> torch.Tensor:
    """One local step of every row of ``st`` on its minibatch (``x`` normalised); the per-example losses.
    ``segments``: the row ranges of separate runs (a population's members; see ``Optimizer.step``); ``keys``:
    one per row, for a model with random layers (:func:`.schedule.layer_keys`)."""
    model, run = setup.model, setup.study.run
    losses = model.sgd_step_(st.params.params, x, y, run.lr) if st.fused else None
    if losses is None:
        if st.grad is None:  # rows taken for a fused step (Workers.take) whose model has no fused step here
            st.grad = st.params.like()
        losses = (model.loss_and_grad(st.params.params, x, y, st.grad.params, keys=keys) if keys is not None
                  else model.loss_and_grad(st.params.params, x, y, st.grad.params))
        if not getattr(st, "deferred", False):  # payload "gradient": the all-reduce updates (update())
            update(setup, st, segments)
    kernel.score_step_(st.score, st.score_weight, losses.mean(1))
    return losses


def update(setup: Setup, st: Workers, segments: list[tuple[int, int]] | None = None) -> None:
    """Every row's optimiser step on the gradients in ``st.grad`` (parameters the user froze stay as they are)."""
    frozen = getattr(setup.model, "frozen", None)  # parameters the user froze: weight decay must not move them either
    kept = [st.params.params[i].clone() for i in frozen] if frozen else None
    st.optim.step(st.params, st.grad, st.accum, segments=segments)
    for i, t in zip(frozen or [], kept or []):
        st.params.params[i].copy_(t)


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
        return self.merger.bytes + self.backend.regroup_bytes

    @property
    def merges(self) -> int:
        return self.merger.count

    def timing(self, r: int) -> dict:
        return {}


def close_round(judge: Judge | None, backend: "Backend", round_start, r: int, end: int, steps: int, loss_sum,
                sent: int, merges: int, timing: dict, horizon: float, total: int,
                callback: Callable[[RoundMetrics], Any] | None,
                evaluated: tuple | None = None,
                norms: tuple[float, float] | None = None,
                last: bool = False) -> tuple[RoundMetrics | None, Any, str | None]:
    """The end of round ``r`` on one backend: update norms, the run-wide totals and the gathered rows, then
    where the backend judges the round's metrics, the callback (which may raise) and the decision. Returns
    ``(metrics, stack, outcome)``: metrics None where the backend does not judge; outcome None to go on,
    else ``diverged``, ``stopped`` (the callback returned False) or ``converged`` (the convergence stop).
    ``last``: the run's last round (a judge without curves evaluates it, and a round the convergence stop ends
    the run at)."""
    # ``norms``: the update norms, if already taken with other runs' (a population's members at once)
    local, merged = norms if norms is not None else update_norms(backend.state, round_start, steps)
    loss, local, merged = backend.totals(float(loss_sum), local, merged)
    stack = backend.gather()
    if judge is None:
        return None, stack, None
    # the convergence stop reads only the update norms: decided first, so that a judge without curves knows the
    # run's last round (where a run diverges or its callback stops it, the decision is not used)
    converged = judge.converged(local, merged, end, total)
    rm = judge.round(r, end, steps, stack, loss, local, merged, sent, merges, backend.label_skew(), backend.moved(),
                     timing, horizon, visitors=backend.visitors(), evaluated=evaluated, last=last or converged)
    if not judge.finite:
        return rm, stack, "diverged"
    if callback is not None and callback(rm) is False:
        return rm, stack, "stopped"
    backend.end_round(r)
    return rm, stack, "converged" if converged else None


def execute(setup: Setup, policy: MergePolicy, seed: int, backend: "Backend", *,
            callback: Callable[[RoundMetrics], Any] | None = None, evaluate_test: bool = False,
            keep_params: bool = False, t0: float | None = None, emulate_time: bool = False,
            waves: bool = False, curves: bool = True) -> RunResult | None:
    """Run one merge run on ``backend``; returns the result where the backend judges, else None.

    ``callback`` gets each round's metrics where the backend judges: it may raise (the
    exception propagates) or return False (the run ends with status ``stopped``).
    ``curves=False``: the validation split is evaluated at the run's last round only (the rounds before carry NaN
    there), for a run of which only the final metrics are read; they are those of the run with curves. Ignored
    (every round evaluated) with a callback, which reads each round, and on a simulated cluster, whose time to
    target is read off every round.
    """
    from .setup import refuse_confidence

    refuse_confidence(policy, setup.model.task)  # (a policy from a file or the API: the study's own are checked)
    t0 = time.perf_counter() if t0 is None else t0
    run, T = setup.study.run, setup.total_steps
    st = backend.state
    curves = curves or callback is not None or setup.study.environment is not None
    judge = Judge(setup, policy, seed, st.params.device, backend.train_x, t0, curves=curves) if backend.judges else None
    backend.start(judge)
    if setup.study.environment is not None:
        from .timed import Timed

        driver = Timed(setup, policy, seed, backend, emulate=emulate_time, waves=waves)
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
                                         driver.horizon if driver.timeline is not None else 0.0, T, callback,
                                         last=r == driver.rounds - 1)
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
    test_acc, test_loss = judge.test_metrics(stack) if evaluate_test and status == "ok" else (None, None)
    return RunResult(
        status=status, seed=seed, policy=policy.to_dict(), history=history, total_steps=T,
        wall_time=time.perf_counter() - t0, label_skew=setup.label_skew, workers=run.workers,
        test_accuracy=test_acc, test_loss=test_loss, eval_time=judge.eval_time,
        params=stack.rows().cpu() if keep_params else None, converged_step=converged,
        communities=backend.communities(), model_at=backend.model_at(),
    )


