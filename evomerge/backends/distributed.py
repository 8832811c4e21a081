"""The distributed backend: one process per worker (or per group of workers) over ``torch.distributed``.

Every rank replays the same event schedule as the in-process backend (``schedule.build``
is a function of the policy and the seed) and draws the same minibatches
(``simulate.batch_indices``). A gossip merge is a point-to-point exchange between the
ranks of the two workers involved, while every other rank keeps training; a complete
average (``scheme = "allreduce"``) is a collective. Delta payloads travel encoded
(positions, integer levels and a scale: ``ops.encode``) to every rank that holds a
topology neighbour of the sender, since neighbours keep the sender's public copy
(CHOCO-style, as in the in-process backend). At the end of each round the workers'
parameters are gathered to rank 0, which evaluates and reports through the callback
(so a search can prune), and tells the others whether to go on.

Launch: :func:`simulate` spawns the processes on this machine (gloo on CPU, NCCL on
CUDA), rendezvous on a free 127.0.0.1 port. Across hosts, run ``python -m evomerge.dist``
under ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.

Deadlock freedom: all ranks walk the events in the same global order and post every
send and receive of an event without blocking before waiting on any, so the earliest
unfinished event always has all its ranks at it.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import queue as queue_mod
import signal
import tempfile
import time
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .. import ops
from ..engine import kernel, plan as plan_mod
from ..engine.plan import PairSet
from ..engine.run import execute
from ..engine.setup import RoundMetrics, RunResult, Setup, prepare, resolve_device
from ..engine.state import initial_row
from ..errors import ConfigError, RunError
from ..policy import MergePolicy
from ..procs import ProcessGroup
from . import check, check_model, check_policy
from .base import Backend
from .pending import Pending

class DistributedRunError(RunError):
    """A rank of a distributed run died or raised; the message names the rank."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} {message}")
        self.rank = rank


def groups(workers: int, world: int) -> list[list[int]]:
    """Contiguous groups of workers, one per rank; every rank gets the same number."""
    check("distributed", world, workers)
    n = workers // world
    return [list(range(r * n, (r + 1) * n)) for r in range(world)]


# -- one rank ---------------------------------------------------------------------------------------
class Distributed(Backend):
    """One rank's share of a run: its own workers' rows, and what it knows about everyone
    (every worker's example counters; for delta payloads, the public copies it must keep)."""

    def __init__(self, setup: Setup, policy: MergePolicy, seed: int, rank: int, world: int, device: torch.device):
        W = setup.study.run.workers
        own = groups(W, world)[rank]
        super().__init__(setup, policy, seed, device, own, public=False)
        model = setup.model
        self.rank, self.world, self.W, self.P = rank, world, W, model.n_params
        self.judges = rank == 0
        self.groups = groups(W, world)
        self.st = self.state  # short: the rank code reads it on every event
        self.owner = np.repeat(np.arange(world), len(own))
        self.pos = {w: i for i, w in enumerate(own)}
        self.delta = self.payload.public  # payloads travel encoded, and neighbours keep public copies
        self.public = initial_row(model, seed).to(device).repeat(W, 1) if self.delta else None
        self.neighbours = None
        if self.sched.topology is not None:
            self.neighbours = [self.sched.topology.neighbours(i).tolist() for i in range(W)]
        self.spec = ops.wire_spec(self.P, policy.topk_fraction, policy.quantize_bits) if self.delta else [((self.P,), torch.float32)]
        self._outbox: list = []  # sends of a timed run still in flight (their tensors must live until done)
        self._inbox: dict = {}  # receives of a timed run posted, not yet applied

    # -- helpers ---------------------------------------------------------------------------
    def _encode(self, w: int, ev: int, side: int) -> list[torch.Tensor]:
        """Worker ``w``'s wire tensors; for deltas also moves its public copy (error feedback stays local)."""
        row = self.st.params.row(self.pos[w])
        if not self.delta:
            return [row]
        p = self.p
        gen = plan_mod.quant_generator(self.seed, ev, side) if p.quantize_bits else None
        parts = ops.encode(ops.delta(row, self.public[w]), p.topk_fraction, p.quantize_bits, gen)
        self._receive_delta(w, parts)
        return parts

    def _receive_delta(self, w: int, parts: list[torch.Tensor]) -> None:
        p = self.p
        self.public[w] = ops.apply_delta(self.public[w], ops.decode(parts, self.P, p.topk_fraction, p.quantize_bits))

    def _empty(self) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=self.dev) for shape, dtype in self.spec]

    def _dests(self, w: int) -> list[int]:
        """Ranks that keep worker ``w``'s public copy: those of its topology neighbours (delta payloads)."""
        return sorted({int(self.owner[n]) for n in self.neighbours[w]} - {int(self.owner[w])})

    def _loss(self, w: int, a: int, b: int) -> torch.Tensor:
        """Worker ``w``'s winner-test loss on the pair ``(a, b)``'s slices, as the kernel scores pairs."""
        x, y = kernel.pair_examples(self.train_x, self.train_y, self.slices, [a], [b], self.setup.data.spec)
        params = [q[[self.pos[w]]] for q in self.st.params.params]
        return torch.tensor(kernel.pair_losses(self.setup.model, params, x[:1], y[:1]), device=self.dev)

    # -- what the engine asks of a backend -----------------------------------------------------
    def pairs(self, ps: PairSet) -> None:
        """The set's events in order; each is a point-to-point exchange between the ranks involved
        (every rank walks every event, so the earliest unfinished one has all its ranks at it)."""
        for ev, a, b, u in zip(ps.events.tolist(), ps.a.tolist(), ps.b.tolist(), ps.u.tolist()):
            self._pair(ev, ps.weight, a, b, u)

    def _pair(self, ev: int, weight: float, a: int, b: int, u: float) -> None:
        p, r = self.p, self.rank
        oa, ob = int(self.owner[a]), int(self.owner[b])
        push_pull = p.exchange == "push_pull"
        biased = p.winner_bias > 0
        dests_a = self._dests(a) if self.delta else ([ob] if ob != oa else [])
        dests_b = (self._dests(b) if self.delta else ([oa] if oa != ob else [])) if push_pull else []
        if r not in (oa, ob) and r not in dests_a and r not in dests_b:
            return
        # 1. what this rank's participants compute before anything moves
        loss = {}
        if biased:  # both on the initiator-first pair of slices, as the in-process backend scores them
            for w, o in ((a, oa), (b, ob)):
                if r == o:
                    loss[w] = self._loss(w, a, b)
        out = {}
        if r == oa:
            out[a] = self._encode(a, ev, 0)
        if r == ob and push_pull:
            out[b] = self._encode(b, ev, 1)
        # 2. messages, in one canonical order on every rank: losses a->b, b->a, payload a, payload b
        ops_, recv = [], {}
        if biased and oa != ob:
            if r == oa:
                ops_.append(dist.P2POp(dist.isend, loss[a], ob))
            elif r == ob:
                loss[a] = torch.empty(1, device=self.dev)
                ops_.append(dist.P2POp(dist.irecv, loss[a], oa))
            if push_pull:
                if r == ob:
                    ops_.append(dist.P2POp(dist.isend, loss[b], oa))
                elif r == oa:
                    loss[b] = torch.empty(1, device=self.dev)
                    ops_.append(dist.P2POp(dist.irecv, loss[b], ob))
        for w, src, dests in ((a, oa, dests_a), (b, ob, dests_b)):
            if r == src:
                ops_ += [dist.P2POp(dist.isend, t, d) for d in dests for t in out[w]]
            elif r in dests:
                recv[w] = self._empty()
                ops_ += [dist.P2POp(dist.irecv, t, src) for t in recv[w]]
        # adaptive weighting: the movers need the other side's accumulator (before the merge)
        accum = {}
        if self.st.accum is not None:
            for w, o in ((a, oa), (b, ob)):
                if r == o:
                    accum[w] = self.st.accum.row(self.pos[w])
            pairs = [(a, oa, ob)] + ([(b, ob, oa)] if push_pull else [])
            for w, src, dst in pairs:
                if src == dst:
                    continue
                if r == src:
                    ops_.append(dist.P2POp(dist.isend, accum[w], dst))
                elif r == dst:
                    accum[w] = torch.empty(self.P, device=self.dev)
                    ops_.append(dist.P2POp(dist.irecv, accum[w], src))
        if ops_:
            for req in dist.batch_isend_irecv(ops_):
                req.wait()
        for w, parts in recv.items():
            if self.delta:
                self._receive_delta(w, parts)
        # 3. the merge itself, on the rows this rank owns
        incoming = {}
        for w in (a, b):
            if self.delta:
                incoming[w] = self.public[w]
            elif w in out:
                incoming[w] = out[w][0]
            elif w in recv:
                incoming[w] = recv[w][0]
        if r == ob or (r == oa and push_pull):  # push: the initiator does not move
            winner = plan_mod.winner(float(loss[a][0]), float(loss[b][0])) if biased else None
            move_a, move_b = plan_mod.moves(p, weight, u, winner)
            if r == ob:
                self._merge(b, move_b, a, incoming[a], accum.get(a))
            if r == oa and push_pull:
                self._merge(a, move_a, b, incoming[b], accum.get(b))
            if self.st.accum is not None:  # accumulators are summed, not averaged (VW's merge)
                for w, other in ((b, a), (a, b)):
                    if r == self.owner[w] and (w == b or push_pull):
                        for blk, (o, n) in zip(self.st.accum.blocks, self.setup.model.offsets):
                            kernel.sum_rows_(blk, [self.pos[w]], [accum[other][o:o + n]])

    def _merge(self, w: int, move: float, sender: int, incoming: torch.Tensor, accum_in: torch.Tensor | None) -> None:
        """Worker ``w`` (a row of this rank) merges ``sender``'s model ``incoming`` (a flat row) by the kernel,
        with the weights its weighting gives; ``accum_in``: the sender's accumulators (a flat row)."""
        st, model = self.st, self.setup.model
        row = self.pos[w]
        acc = None if accum_in is None else [accum_in[o:o + n].unsqueeze(0) for o, n in model.offsets]
        w_in = self.weighting.incoming_weights(st, [move], np.array([row]), [float(st.examples[sender])], acc,
                                               examples_of=[w])
        kernel.receive_(st.params.blocks, st.merge_change.blocks, self.rules, model.offsets, [row],
                        lambda k, o, n: [incoming[o:o + n]], w_in)

    def allreduce(self, event: int, step: int, weight: float) -> None:
        p, own = self.p, self.own
        if self.delta:
            # each worker's compressed delta goes to every rank, which rebuilds all public copies
            mine = [self._encode(w, event, w) for w in own]
            parts: dict[int, list[torch.Tensor]] = {}
            for k in range(len(self.spec)):
                local = torch.stack([m[k] for m in mine])
                gathered = [torch.empty_like(local) for _ in self.groups]
                dist.all_gather(gathered, local)
                for g, ws in zip(gathered, self.groups):
                    for i, w in enumerate(ws):
                        parts.setdefault(w, []).append(g[i])
            for w, wire in parts.items():
                if w not in self.pos:
                    self._receive_delta(w, wire)
            # every rank now holds all public copies: average them here, as the in-process backend does
            support = None
            if self.weighting.by_examples:
                support = self.st.examples.to(self.dev)
            elif self.weighting.accumulators:
                acc = self.st.accum.rows()
                gathered = [torch.empty_like(acc) for _ in self.groups]
                dist.all_gather(gathered, acc)
                support = torch.cat(gathered)
            avg, merged = ops.weighted_average(self.public, support)
            if merged is not None and self.weighting.accumulators:
                self.st.accum.set_rows(merged.unsqueeze(0).expand(len(own), -1))
        else:
            avg = self._average(self.st.params.rows())
        outer = self.st.outer
        if outer is not None:  # every rank takes the same outer step on the same average
            outer.step_flat_(avg, self.setup.model.offsets)
        rows = list(range(len(own)))
        kernel.receive_(self.st.params.blocks, self.st.merge_change.blocks, self.rules, self.setup.model.offsets, rows,
                        lambda k, o, n: [avg[o:o + n]] * len(rows), torch.full((len(rows), 1), float(weight), device=self.dev))

    def _average(self, models: torch.Tensor) -> torch.Tensor:
        """The weighted average over all ranks of the own workers' ``models``, by all-reduce."""
        own, s = self.own, None
        if self.weighting.accumulators:
            s = self.st.accum.rows()
        elif self.weighting.by_examples:
            s = self.st.examples[own].to(models.dtype).to(self.dev).unsqueeze(1).expand_as(models)
        avg, total, _ = kernel.reduced_average(models, s, dist.all_reduce, self.W)
        if self.weighting.accumulators:  # summed, not averaged
            self.st.accum.set_rows(total.unsqueeze(0).expand(len(own), -1))
        return avg

    def totals(self, loss_sum: float, local: float, merged: float) -> tuple[float, float, float]:
        n = len(self.own)
        t = torch.tensor([loss_sum, local * n, merged * n], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t)
        return float(t[0]), float(t[1]) / self.W, float(t[2]) / self.W

    def gather(self):
        rows = self.st.params.rows().contiguous()
        gathered = [torch.empty_like(rows) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(rows, gathered, dst=0)
        if self.rank != 0:
            return None
        stack = self.setup.model.stack(self.W, self.dev)
        stack.set_rows(torch.cat(gathered))
        return stack

    # -- a timed run: payloads between ranks as tagged messages -------------------------------------
    def _tag(self, event: int, kind: int, part: int) -> int:
        return (event * 4 + kind) * 4 + part

    def _wire(self, payload: dict | None = None) -> list[torch.Tensor]:
        """A payload's tensors: the model row, its counter (float64, exact), winner and support epoch (the scale of
        its supports), its accumulators."""
        if payload is None:
            out = [torch.empty(self.P, device=self.dev), torch.empty(3, dtype=torch.float64, device=self.dev)]
            return out + ([torch.empty(self.P, device=self.dev)] if self.st.accum is not None else [])
        win = payload.get("winner")
        out = [payload["sent"].contiguous(),
               torch.tensor([payload["examples"], -1.0 if win is None else float(win), float(payload["epoch"])],
                            dtype=torch.float64, device=self.dev)]
        if payload["accum"] is not None:
            out.append(torch.cat([a[0] for a in payload["accum"]]))
        return out

    def send_payload(self, event: int, kind: int, payload: dict, to: int) -> None:
        dst = int(self.owner[to])
        tensors = self._wire(payload)
        works = [Pending(dist.isend(t, dst, tag=self._tag(event, kind, k))) for k, t in enumerate(tensors)]
        self._outbox.append((works, tensors))
        self._outbox = [(w, t) for w, t in self._outbox if not all(x.done() for x in w)]

    def _posted(self, event: int, kind: int, sender: int):
        key = (event, kind)
        if key not in self._inbox:
            src = int(self.owner[sender])
            tensors = self._wire()
            self._inbox[key] = ([Pending(dist.irecv(t, src, tag=self._tag(event, kind, k))) for k, t in enumerate(tensors)],
                                tensors)
        return self._inbox[key]

    def _received(self, event: int, kind: int) -> dict:
        _, tensors = self._inbox.pop((event, kind))
        row, meta = tensors[0], tensors[1]
        accum = None
        if len(tensors) > 2:
            accum = [tensors[2][o:o + n].unsqueeze(0) for o, n in self.setup.model.offsets]
        win = int(meta[1])
        return {"sent": row, "params": row, "examples": float(meta[0]), "accum": accum,
                "winner": None if win < 0 else win, "epoch": int(meta[2])}

    def poll_payload(self, event: int, kind: int, sender: int) -> dict | None:
        works, _ = self._posted(event, kind, sender)
        if all(w.done() for w in works):
            return self._received(event, kind)
        return None

    def wait_payload(self, event: int, kind: int, sender: int) -> dict:
        works, _ = self._posted(event, kind, sender)
        for w in works:
            w.wait()
        return self._received(event, kind)

    def sum_examples(self) -> float:
        t = self.st.examples[self.own].to(torch.float64).sum().reshape(1).to(self.dev)
        dist.all_reduce(t)
        return float(t[0])

    def agree(self, go: bool) -> bool:
        flag = torch.ones(1, device=self.dev) if go else torch.zeros(1, device=self.dev)
        dist.broadcast(flag, src=0)
        return bool(float(flag[0]))


def run_rank(setup: Setup, policy: MergePolicy, seed: int, *, rank: int, world: int,
             report: Callable[[RoundMetrics], bool] | None = None, device: str | torch.device | None = None,
             evaluate_test: bool = False, keep_params: bool = False, emulate_time: bool = False) -> RunResult | None:
    """This rank's part of one run, inside an initialised process group. ``report`` (rank 0 only)
    gets each round's metrics and returns False to stop the run. Rank 0 returns the result."""
    check_policy("distributed", policy)
    check_model("distributed", setup.model)
    t0 = time.perf_counter()
    backend = Distributed(setup, policy, seed, rank, world, resolve_device(device))
    try:
        return execute(setup, policy, seed, backend, callback=report, evaluate_test=evaluate_test,
                       keep_params=keep_params, t0=t0, emulate_time=emulate_time)
    finally:
        for works, _ in backend._outbox:  # a timed run's last sends
            for w in works:
                w.wait()


# -- local launch --------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launcher dies, however it dies (no orphaned ranks)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the launcher died before we got here
        os._exit(1)


def _rank_main(rank: int, world: int, store_path: str, setup, policy, seed, up, down, device: str,
               evaluate_test: bool, keep_params: bool, threads: int, emulate_time: bool = False) -> None:
    """Entry point of a spawned rank: join the group, run, send rank 0's rounds and result up."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; a Ctrl-C reaches it too
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    # rendezvous through a file: nothing listens on a network port but gloo's own 127.0.0.1 pairs
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=store,
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        def report(rm):
            up.put(("round", rm))
            return down.get()

        res = run_rank(setup, policy, seed, rank=rank, world=world, report=report if rank == 0 else None,
                       device=dev, evaluate_test=evaluate_test, keep_params=keep_params, emulate_time=emulate_time)
        if rank == 0:
            up.put(("result", res))
    finally:
        dist.destroy_process_group()


def simulate(setup: Setup, policy: MergePolicy, seed: int = 0, *, callback=None, device: str | None = None,
             evaluate_test: bool = False, keep_params: bool = False, procs: int | None = None,
             emulate_time: bool = False, _entry=None) -> RunResult:
    """Like :func:`evomerge.simulate.simulate`, on ``procs`` processes (default: one per worker)
    spawned on this machine. ``callback`` runs here, in the caller's process; if it raises, the
    ranks stop at the end of that round and the exception propagates. A rank that dies or raises
    ends the run with :class:`DistributedRunError` naming it, and no rank is left running."""
    import torch.multiprocessing as mp

    check_policy("distributed", policy)
    check_model("distributed", setup.model)
    world = procs or setup.study.run.workers
    groups(setup.study.run.workers, world)  # a clear error before anything starts
    device = str(resolve_device(device))
    if torch.device(device).type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError("--procs", f"{world} processes on {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per "
                                     f"process; allowed: at most {torch.cuda.device_count()}, or --device cpu (gloo)")
    ctx = mp.get_context("spawn")
    up, down = ctx.Queue(), ctx.Queue()
    threads = max(1, int(os.environ.get("EVOMERGE_THREADS") or os.cpu_count() or 1) // world)  # procs.apply_threads
    tmp = tempfile.TemporaryDirectory(prefix="evomerge-dist-")
    args = (world, os.path.join(tmp.name, "store"), setup, policy, seed, up, down, device, evaluate_test, keep_params, threads,
            emulate_time)
    result, error = None, None
    # one supervisor for every process evomerge starts: each rank leads its own process group, and
    # leaving the block (normally, on an error, Ctrl-C, SIGTERM or SIGHUP) stops every group
    with ProcessGroup(grace=3) as ranks:
        for rank in range(world):
            ranks.spawn(_rank_process, (_entry or _rank_main, rank, os.path.join(tmp.name, f"error-{rank}"), args), ctx=ctx)
        try:
            while True:
                try:
                    kind, payload = up.get(timeout=0.05)
                except queue_mod.Empty:
                    kind = None
                if kind == "round":
                    go = True
                    if error is None and callback is not None:
                        try:
                            callback(payload)
                        except BaseException as e:  # noqa: BLE001 - re-raised once the ranks have stopped
                            error, go = e, False
                    down.put(go)
                elif kind == "result":
                    result = payload
                if kind is None:
                    multiprocessing.connection.wait([p.sentinel for p in ranks.processes], timeout=0.05)
                _raise_if_failed(ranks.processes, tmp.name)
                if all(p.exitcode == 0 for p in ranks.processes):
                    break
        finally:
            ranks.stop()
            tmp.cleanup()
    while result is None:  # the result may still sit in the queue after every rank exited
        try:
            kind, payload = up.get(timeout=5)
        except queue_mod.Empty:
            raise DistributedRunError(0, "ended without a result") from None
        if kind == "result":
            result = payload
    if error is not None:
        raise error
    return result


def _rank_process(entry, rank: int, error_path: str, args: tuple) -> None:
    """A spawned rank: ``entry(rank, *args)``; if it raises, its last traceback line goes to
    ``error_path`` for the launcher's one-line message, and the process exits with code 1."""
    try:
        entry(rank, *args)
    except BaseException:  # noqa: BLE001 - reported by the launcher
        import traceback

        with open(error_path, "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)


def _raise_if_failed(processes, error_dir: str) -> None:
    """The first rank that exited non-zero, as a one-line error naming it (the others are stopped
    by the caller's ``finally``)."""
    for rank, p in enumerate(processes):
        if p.exitcode is None or p.exitcode == 0:
            continue
        if p.exitcode < 0:
            try:
                why = f"was killed by {signal.Signals(-p.exitcode).name}"
            except ValueError:
                why = f"was killed by signal {-p.exitcode}"
            raise DistributedRunError(rank, f"(pid {p.pid}) {why}; the run was stopped")
        last = f"exited with code {p.exitcode}"
        path = os.path.join(error_dir, f"error-{rank}")
        if os.path.exists(path):
            with open(path) as fh:
                lines = [ln.strip() for ln in fh.read().strip().splitlines() if ln.strip()]
            if lines:
                last = f"raised {lines[-1]}"
        raise DistributedRunError(rank, f"(pid {p.pid}) {last}")


# -- torchrun entry point ----------------------------------------------------------------------------------
def main(argv=None) -> int:
    """``python -m evomerge.dist --study S --policy P`` under torchrun (or any launcher setting the env)."""
    import argparse
    import json

    from ..errors import ConfigError as _CE
    from ..study import load

    ap = argparse.ArgumentParser(prog="python -m evomerge.dist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--json", dest="json_out", default=None, help="rank 0 writes the result here")
    args = ap.parse_args(argv)
    try:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise _CE(var, "is not set; launch with torchrun (or use `evomerge run --backend distributed`)")
        study = load(args.study)
        policy = study.resolve_policy(args.policy)
        check_policy("distributed", policy)
        from . import found_with
        from ..policy import read_export

        study, note = found_with(study, read_export(args.policy) if os.path.isfile(args.policy) else None)
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(note, flush=True)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        groups(study.run.workers, world)
    except _CE as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2
    dev = resolve_device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://")
    try:
        setup = prepare(study, data_dir=args.data_dir)
        seed = study.run.seeds[0] if args.seed is None else args.seed

        def report(rm):
            print(f"round {rm.round}: step {rm.step}, val accuracy {rm.val_accuracy:.4f}, "
                  f"{rm.bytes / 1e6:.1f} MB", flush=True)
            return True

        res = run_rank(setup, policy, seed, rank=rank, world=world, report=report if rank == 0 else None, device=dev)
        if rank == 0:
            print(f"{res.status}: val accuracy {res.final.val_accuracy:.4f}, {res.final.bytes / 1e6:.1f} MB, "
                  f"{res.wall_time:.1f} s on {world} processes", flush=True)
            if args.json_out:
                with open(args.json_out, "w") as fh:
                    json.dump(res.to_dict(), fh, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
