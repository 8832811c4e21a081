"""The small interface a backend implements: where the workers' rows live and how tensors move.

The engine (:func:`evomerge.engine.run.execute`) owns what a run means: the schedule,
the plan of each step's merges, counters, bytes, the round loop and the judge. A
backend holds the rows of the workers it owns (:attr:`state`), trains them, and applies
the planned merges: :meth:`pairs` for a set of disjoint gossip pairs, :meth:`allreduce`
for a complete average. The hooks with defaults are what a backend may add (peers drawn
during the run, data that travels, regrouping).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from .. import registry
from ..engine import kernel, plan as plan_mod
from ..engine import judge as judge_mod, run as run_mod, setup as setup_mod
from ..engine.plan import PairSet
from ..engine.state import Workers
from ..policy import MergePolicy
from ..engine.schedule import Schedule, build


def device_tensors(setup: setup_mod.Setup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The study's training data and validation slices (``[W, score_samples]``) on ``device``."""
    data = setup.data
    return (data.train_x.to(device), data.train_y.to(device),
            torch.as_tensor(np.stack(setup.slices), device=device))


class Backend(ABC):
    """One backend's share of a run (all of it in one process, one rank's in ``torch.distributed``)."""

    #: whether this backend (this rank) sees every row at the end of a round, evaluates and decides
    judges: bool = True
    #: bytes of regrouping self-forming communities so far (every sketch to one worker, the groups back)
    regroup_bytes: int = 0

    def __init__(self, setup: setup_mod.Setup, policy: MergePolicy, seed: int, device: torch.device, own: list[int],
                 public: bool = True, state: Workers | None = None, tensors: tuple | None = None):
        """``state``: the rows' state, if not a fresh one (a population's member); ``tensors``: the
        study's ``(train_x, train_y, slices)`` on ``device``, if already there (shared by a population)."""
        run = setup.study.run
        self.setup, self.p, self.seed, self.dev, self.own = setup, policy, seed, device, own
        self.sched: Schedule = build(policy, run.workers, setup.total_steps, seed)
        self.state = state if state is not None else Workers(
            setup.model, run, policy, seed, device, rows=None if len(own) == run.workers else len(own), public=public)
        self.train_x, self.train_y, self.slices = tensors if tensors is not None else device_tensors(setup, device)
        self.weighting = registry.WEIGHTINGS.get_object(policy.weighting)()
        self.payload = registry.PAYLOADS.get_object(policy.payload)()
        self.rules = kernel.block_rules(setup.model, policy.buffers)  # what a merge does to each parameter block
        self.pos = {w: i for i, w in enumerate(own)}  # a worker's row in this backend's state
        # Streaming DiLoCo (policy.fragments): each fragment's blocks, and fragments in flight by event
        self.fragments = plan_mod.fragments_of(policy, setup.model) if policy.fragments > 1 else None
        self._in_flight: dict[int, dict] = {}
        self._sending: dict[int, dict] = {}
        self._owing: dict[int, dict] = {}  # compressed outer gradients of fragments in flight: what each worker owes
        # DiLoCo's outer gradients compressed (payload delta with an outer step): each worker sends its change since
        # its public copy, which is the anchor less what it has not sent yet (error feedback)
        self.outer_delta = plan_mod.compressed_outer(policy)
        plan_mod.refuse_compressed_outer_buffers(policy, [n for n, _ in setup.model.layout[setup.model.n_trained_blocks:]])
        if policy.payload == "gradient" and setup.model.n_trained_blocks < len(setup.model.offsets):
            from ..errors import ConfigError

            raise ConfigError("policy.payload", "'gradient' with a model that has buffers is not built yet (their "
                                                "running statistics would drift apart); allowed: weights, delta")
        self.server = None  # asynchronous DiLoCo's server (kernel.AsyncServer), from the workers' common start
        if policy.scheme == "async":
            if setup.model.n_trained_blocks < len(setup.model.offsets):
                from ..errors import ConfigError

                raise ConfigError("policy.scheme", "'async' with a model that has buffers is not built yet; allowed: "
                                                   "a model without buffers, or scheme allreduce")
            self.server = kernel.AsyncServer(self.state.params.row(0), run.workers, policy.outer_lr,
                                             policy.outer_momentum, policy.outer_optimizer == "nesterov",
                                             policy.momentum_every)

    def fragment(self, event: int) -> list[int] | None:
        """The blocks an all-reduce event syncs (None: every block)."""
        if self.fragments is None or self.sched.fragment is None:
            return None
        return self.fragments[int(self.sched.fragment[event])]

    # -- what every backend does ------------------------------------------------------------------
    def start(self, judge: "judge_mod.Judge | None") -> None:
        """Called once before the first step, with the judge where this backend judges."""

    def train(self, start: int, end: int, after_step: Callable[[int], None]) -> torch.Tensor:
        """Local steps ``start+1..end`` of the own workers; ``after_step(step)`` merges. Returns the summed loss."""
        return run_mod.train_steps(self.setup, self.state, self.own, self.seed, start, end, self.train_x, self.train_y,
                                   after_step)

    def outer_each(self, rows: list[int] | None = None) -> None:
        """Lookahead / SNOO (``scheme = "none"`` with an outer step): the rows ``rows`` (positions in this backend's
        state; None: all it holds) each take their own outer step. Local to each worker: no backend sends anything."""
        st = self.state
        kernel.outer_each_(st.params.blocks, st.merge_change.blocks, st.outer, self.setup.model.offsets, rows)

    @abstractmethod
    def pairs(self, ps: PairSet) -> None:
        """Apply a set of gossip events on disjoint pairs (merges and swaps) to the rows this backend holds."""

    @abstractmethod
    def allreduce(self, event: int, step: int, weight: float) -> None:
        """Every worker moves ``weight`` of the way towards the (support-weighted) average of all (of the
        event's fragment, with Streaming DiLoCo's ``fragments``)."""

    def allreduce_start(self, event: int) -> None:
        """Streaming DiLoCo with ``fragment_delay``: the event's average, taken now and kept in flight."""
        raise NotImplementedError(f"{type(self).__name__} does not stream fragments")

    def allreduce_finish(self, event: int, weight: float) -> None:
        """The fragment in flight since :meth:`allreduce_start` lands: every worker moves ``weight`` towards it."""
        raise NotImplementedError(f"{type(self).__name__} does not stream fragments")

    def totals(self, loss_sum: float, local: float, merged: float) -> tuple[float, float, float]:
        """The run-wide summed loss and mean update norms from this backend's share."""
        return loss_sum, local, merged

    @abstractmethod
    def gather(self):
        """Every worker's parameters (a :class:`models.Stack`) where this backend judges, else None."""

    def agree(self, go: bool) -> bool:
        """The judge's decision to go on, known everywhere."""
        return go

    # -- a timed run ([environment]): one side of a merge at a time ---------------------------------
    def snapshot(self, event: int, w: int, side: int) -> dict:
        """What worker ``w`` (a row of this backend) sends in ``event``, as it is now (side 0: the
        initiator; 1: a push-pull answer): the payload, the model (for the winner test), its counter
        and its accumulators."""
        st, k = self.state, self.pos[w]
        sent = self.payload.outgoing(st, self.p, self.seed, np.array([k]), np.array([event]), side)
        params = st.params.row(k)
        return {"worker": w, "sent": params if sent is None else sent[0], "params": params,
                "examples": float(st.examples[w]), "epoch": st.support_epoch, "score": float(st.score[k]),
                "accum": [blk[k].clone().unsqueeze(0) for blk in st.accum.blocks] if st.accum is not None else None,
                "optim": st.optim.row_state(k) if self.p.optimizer_state == "average" else None}

    def land(self, event: int, r: int, payload, weight: float, u: float, initiator: int, winner: int | None = None):
        """Worker ``r`` merges a payload from :meth:`snapshot`; returns the winner of the winner test."""
        return self.land_many([(event, r, payload, weight, u, initiator, winner)])[0]

    @torch.no_grad()
    def land_many(self, items: list[tuple]) -> list[int | None]:
        """Workers of this backend merge payloads from :meth:`snapshot` (each worker at most once):
        ``(event, r, payload, weight, u, initiator, winner)`` each. The peer of an event merging the
        initiator's payload does the winner test (one batched forward for all of them); the initiator
        merging a push-pull answer gets the winner the peer found. The arithmetic of the in-process
        backend's :meth:`pairs` on one pair at a time. Returns the winners."""
        p, st, model = self.p, self.state, self.setup.model
        winners = [it[6] for it in items]
        test = [k for k, it in enumerate(items) if it[1] != it[5] and p.winner_bias > 0 and it[6] is None]
        running = p.score == "running"
        if test and running:  # the running training losses: the initiator's (sent with its payload), then the peer's
            for k in test:
                winners[k] = plan_mod.winner(items[k][2]["score"], float(st.score[self.pos[items[k][1]]]))
        elif test:
            pairs = []
            for k in test:
                _, r, payload, *_ = items[k]
                pairs.append(([v[0] for v in model.views(payload["params"].unsqueeze(0))],
                              [q[self.pos[r]] for q in st.params.params]))
            params = [torch.stack([t for theirs, mine in pairs for t in (theirs[b], mine[b])])
                      for b in range(len(st.params.params))]
            loss = self._pair_losses(np.array([items[k][5] for k in test]), np.array([items[k][1] for k in test]), params)
            for n, k in enumerate(test):
                winners[k] = plan_mod.winner(loss[2 * n], loss[2 * n + 1])
        for (event, r, payload, weight, u, initiator, _), winner in zip(items, winners):
            ma, mb = plan_mod.moves(p, weight, u, winner)
            move = mb if r != initiator else ma
            row = self.pos[r]
            # the sender's supports on this state's scale: it may have been scaled down since the payload left
            scale = kernel.support_factor(st.support_epoch - payload["epoch"])
            examples_in = payload["examples"] * scale
            accum_in = payload["accum"] if payload["accum"] is None or scale == 1.0 else [a * scale for a in payload["accum"]]
            w_in = self.weighting.incoming_weights(st, [move], np.array([row]), [examples_in], accum_in, examples_of=[r])
            sent, params = payload["sent"], payload["params"]
            kernel.receive_(st.params.blocks, st.merge_change.blocks, self.rules, model.offsets, [row],
                            lambda k, o, n: [sent[o:o + n]], w_in, models=lambda k, o, n: [params[o:o + n]])
            st.optim.merge_row(p.optimizer_state, row, payload.get("optim"), w_in, move, model.offsets)
            if st.accum is not None:  # summed, not averaged
                for blk, acc in zip(st.accum.blocks, accum_in):
                    kernel.sum_rows_(blk, [row], acc)
            st.examples[r] = st.examples[r] + examples_in
            if running:
                st.score[row] = kernel.merged_score(float(st.score[row]), payload["score"], move)
        return winners

    # payloads between backends (ranks): a backend that holds every worker never sends one
    def send_payload(self, event: int, kind: int, payload: dict, to: int) -> None:
        raise NotImplementedError(f"worker {to} is not held by this {type(self).__name__} backend")

    def poll_payload(self, event: int, kind: int, sender: int) -> dict | None:
        raise NotImplementedError(f"worker {sender} is not held by this {type(self).__name__} backend")

    def wait_payload(self, event: int, kind: int, sender: int) -> dict:
        raise NotImplementedError(f"worker {sender} is not held by this {type(self).__name__} backend")

    def sum_examples(self) -> float:
        """Every worker's example counter, summed (an all-reduce of a timed run)."""
        return float(self.state.examples.sum())

    @torch.no_grad()
    def _pair_losses(self, a: np.ndarray, b: np.ndarray, params: list[torch.Tensor] | None = None) -> list[float]:
        """Each pair's two losses on the pair's two validation slices (initiator's first), in one
        batched forward: ``[loss(a_0), loss(b_0), loss(a_1), ...]``. ``params``: the pairs' rows in
        that order, if not the current ones."""
        st, model = self.state, self.setup.model
        dev = st.params.device
        rows = torch.as_tensor(np.stack([a, b], axis=1).reshape(-1), device=dev)
        x, y = kernel.pair_examples(self.train_x, self.train_y, self.slices, a, b, self.setup.data.spec)
        if params is None:
            params = [q.index_select(0, rows) for q in st.params.params]
        return kernel.pair_losses(model, params, x, y)

    # -- hooks: what a backend may add ------------------------------------------------------------
    def peers(self, events: np.ndarray, step: int) -> np.ndarray:
        """The peers of ``events`` (the schedule's, unless drawn during the run)."""
        return self.sched.peer[events]

    def after_events(self, events: np.ndarray, a: np.ndarray, b: np.ndarray, step: int) -> int:
        """After step ``step``'s gossip events: anything else they do (data that travels); returns its bytes."""
        return 0

    def swap_chances(self, a: np.ndarray, b: np.ndarray, step: int) -> np.ndarray | float:
        """The chance that each event (initiator ``a``, peer ``b``) swaps the two models (plan.swap_chance)."""
        return self.p.swap_p

    def touched(self, workers) -> None:
        """Workers whose rows a timed run's replay has just changed (a backend that caches per row hears it here)."""

    def end_round(self, r: int) -> None:
        """After round ``r`` was judged and reported (self-forming communities regroup here)."""

    def label_skew(self) -> float:
        return self.setup.label_skew

    def moved(self) -> int:
        return 0

    def visitors(self) -> float | None:
        """The mean number of distinct workers that trained on each travelled example (data that travels)."""
        return None

    def communities(self) -> list[int] | None:
        return None

    def model_at(self) -> list[int]:
        return list(range(self.setup.study.run.workers))
