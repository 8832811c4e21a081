"""The merge kernel: what a merge does to the rows that receive it, written once.

Every path that merges calls these functions: the in-process backend's sets of disjoint pairs, the
landings of a run on a simulated clock, a population's members (one member at a time or several
together), and the distributed backend's ranks. They are functions of tensors alone (the rows, what
comes in, the weights): no process group, no schedule, no policy names.

A merge is seen from its receivers. Each receiving row moves towards one incoming model, block by
block, with the weight its weighting gave it (a ``[k, 1]`` column, or one ``[k, n]`` tensor per block
when the weights are per coordinate). What each block does is its *rule* (:func:`block_rules`):

- ``LERP``: trained parameters, and buffers merged like them: ``row <- (1 - w) * row + w * incoming``;
- ``SUM``: counting buffers (``num_batches_tracked``): summed, as VW sums counters, and capped at
  :data:`COUNTER_LIMIT` so gossip's doublings cannot overflow float32;
- ``KEEP``: buffers each worker keeps (``policy.buffers = "local"``).

What a merge changed in a row is added to its ``merge_change`` (the run's merge update norm). Supports
(example counters, per-coordinate accumulators) are summed, not averaged, and
:func:`rescale_supports` keeps them far from overflow; every path calls it after its merges.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import ops

COUNTER_LIMIT = 2.0**62  # summed counter buffers stop here (float32 holds it exactly)
SUPPORT_LIMIT = 2.0**64  # supports are scaled down by this power of two once a counter passes it

LERP, SUM, KEEP = "lerp", "sum", "keep"


def block_rules(model, buffers: str) -> list[str]:
    """Per parameter block of ``model``, what a merge does to it (see the module's docstring)."""
    out = []
    for k in range(len(model.offsets)):
        if k >= model.n_trained_blocks and (buffers == "local" or k in model.counters):
            out.append(KEEP if buffers == "local" else SUM)
        else:
            out.append(LERP)
    return out


def unsent(rules: list[str], offsets) -> list[tuple[int, int]]:
    """``(offset, size)`` of each block whose change a delta payload leaves out: counters (summed from the models
    as they are, sent uncompressed beside it) and buffers kept local (never merged)."""
    return [(o, n) for rule, (o, n) in zip(rules, offsets) if rule != LERP]


def delta_to_send(current: torch.Tensor, base: torch.Tensor, skip: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A delta payload before compression: ``current - base`` (:func:`ops.delta`) with the :func:`unsent` blocks
    zero. (With them in, a BatchNorm counter's change, summed at every merge to 1e12 and more, took a top-k's
    places and set a scaled sign's scale: every coordinate moved by it, and the run diverged.)"""
    d = ops.delta(current, base)
    for o, n in skip:
        d[..., o:o + n] = 0
    return d


# -- rows of one block ----------------------------------------------------------------------------------
def lerp_rows_(blk: torch.Tensor, rows: Sequence[int], incoming: Sequence[torch.Tensor], weight,
               change: torch.Tensor | None = None, before: Sequence[torch.Tensor] | None = None) -> None:
    """In place, ``blk[rows[r]] <- lerp(blk[rows[r]], incoming[r], weight[r])``; ``change[rows[r]]``, if
    given, accumulates what moved (``before``: copies of the rows as they are, if the caller has them).
    Rows are worked on through views: gathering and scattering whole rows with advanced indexing was
    measured 2-5x slower per row on the CPU (PERFORMANCE.md)."""
    for r, j in enumerate(rows):
        old = (blk[j].clone() if before is None else before[r]) if change is not None else None
        blk[j].lerp_(incoming[r], weight[r])
        if change is not None:
            change[j].add_(blk[j]).sub_(old)


def lerp_rows_gathered_(blk: torch.Tensor, rows: torch.Tensor, incoming: torch.Tensor, weight: torch.Tensor,
                        change: torch.Tensor | None = None, before: torch.Tensor | None = None) -> None:
    """:func:`lerp_rows_` as one gather, one lerp and one scatter over all rows (``rows`` a tensor of distinct
    indices, ``incoming`` ``[k, n]`` or what broadcasts to ``before``; ``before``: the rows already gathered, as
    ``[k, n]`` or in groups ``[g, k/g, n]`` with a weight per group): fewer kernel launches, the same
    numbers (the lerp is elementwise; ``change`` takes ``+ new`` then ``+ (-1) old``, each row once, which rounds
    as ``(change + new) - old`` does)."""
    old = blk.index_select(0, rows) if before is None else before
    new = old.lerp(incoming, weight).reshape(len(rows), -1)  # ``before`` may come grouped (``[g, k/g, n]``)
    blk.index_copy_(0, rows, new)
    if change is not None:
        change.index_add_(0, rows, new)
        change.index_add_(0, rows, old.reshape(len(rows), -1), alpha=-1)


def sum_rows_(blk: torch.Tensor, rows: Sequence[int], incoming: Sequence[torch.Tensor],
              change: torch.Tensor | None = None, limit: float | None = None) -> None:
    """In place, ``blk[rows[r]] += incoming[r]`` (capped at ``limit``): counters and supports are summed."""
    for r, j in enumerate(rows):
        old = blk[j].clone() if change is not None else None
        if limit is not None and not blk.is_floating_point():  # summed wide, then capped where its type holds it
            blk[j].copy_((blk[j].double() + incoming[r].double()).clamp_(max=counter_limit(blk, limit)))
        else:
            blk[j].add_(incoming[r])
            if limit is not None:
                blk[j].clamp_(max=limit)
        if change is not None:
            change[j].add_(blk[j]).sub_(old)


# -- a merge on every block ---------------------------------------------------------------------------
Incoming = Callable[[int, int, int], Sequence[torch.Tensor]]  # (block, offset, size) -> one tensor per receiver


def receive_(blocks: list[torch.Tensor], change: list[torch.Tensor] | None, rules: list[str], offsets,
             rows: Sequence[int], incoming: Incoming, weights, models: Incoming | None = None) -> None:
    """Rows ``rows`` of a stack (``blocks``, its ``change``) each merge one incoming model: block ``k`` of what
    the receivers got is ``incoming(k, offset, size)``, of the senders' models as they were
    ``models(k, offset, size)`` (counters are summed from those, not from a compressed payload; default:
    ``incoming``); ``weights`` a ``[k, 1]`` column or one ``[k, n]`` tensor per block. Each block follows
    its rule (:func:`block_rules`)."""
    for k, (rule, blk, (o, n)) in enumerate(zip(rules, blocks, offsets)):
        if rule == KEEP:
            continue
        chg = change[k] if change is not None else None
        if rule == SUM:
            sum_rows_(blk, rows, (models or incoming)(k, o, n), chg, COUNTER_LIMIT)
        else:
            lerp_rows_(blk, rows, incoming(k, o, n), weights[k] if isinstance(weights, list) else weights, chg)


def exchange_(blocks: list[torch.Tensor], change: list[torch.Tensor] | None, rules: list[str], offsets,
              a: Sequence[int], b: Sequence[int], in_a: Incoming | None, in_b: Incoming | None, weight_b,
              weight_a=None) -> None:
    """A set of disjoint pairs of rows of one stack: ``b[r]`` merges what ``a[r]`` sent (``in_a``; None: ``a[r]``'s
    row as it is) with ``weight_b``; with ``weight_a`` (push-pull), ``a[r]`` also merges what ``b[r]`` sent
    (``in_b``; None: ``b[r]``'s row before it moved) with ``weight_a``. Counters are summed from the rows."""
    push_pull = weight_a is not None
    for k, (rule, blk, (o, n)) in enumerate(zip(rules, blocks, offsets)):
        if rule == KEEP:
            continue
        chg = change[k] if change is not None else None
        rows_a = [blk[i] for i in a]
        old_b = [blk[j].clone() for j in b] if push_pull and (rule == SUM or in_b is None) else None
        if rule == SUM:
            sum_rows_(blk, b, rows_a, chg, COUNTER_LIMIT)
            if push_pull:
                sum_rows_(blk, a, old_b, chg, COUNTER_LIMIT)
            continue
        lerp_rows_(blk, b, rows_a if in_a is None else in_a(k, o, n),
                   weight_b[k] if isinstance(weight_b, list) else weight_b, chg, before=old_b)
        if push_pull:
            lerp_rows_(blk, a, old_b if in_b is None else in_b(k, o, n),
                       weight_a[k] if isinstance(weight_a, list) else weight_a, chg)


def columns(sent: torch.Tensor | None) -> Incoming | None:
    """What :func:`receive_` and :func:`exchange_` take for models sent as rows ``[k, P]`` (None stays None)."""
    if sent is None:
        return None
    return lambda k, o, n: sent[:, o:o + n]


def average_all_(blocks: list[torch.Tensor], change: list[torch.Tensor] | None, rules: list[str],
                 models: list[torch.Tensor], supports: list, weight: float, sum_supports: bool,
                 outer: "Outer | None" = None, offsets=None, only: Sequence[int] | None = None) -> None:
    """An all-reduce on every row of a stack: each moves ``weight`` of the way towards the average of ``models``
    (per block ``[W, n]``: the rows themselves, or what they sent), weighted by ``supports`` (per block; None:
    a plain mean); counters become their capped sum; ``sum_supports``: the supports become their sum. With
    ``outer``, the trained blocks move to the anchor after the outer step on the average instead (``offsets``:
    each block's place in the anchor's flat row). ``only``: the blocks of one fragment (Streaming DiLoCo)."""
    before = [blk.clone() for blk in blocks] if change is not None else None
    targets = average_targets_(blocks, rules, models, supports, sum_supports, outer, offsets, only)
    lerp_targets_(blocks, None, targets, weight)
    if change is not None:
        for chg, now, old in zip(change, blocks, before):
            chg.add_(now).sub_(old)


def average_targets_(blocks: list[torch.Tensor], rules: list[str], models: list[torch.Tensor], supports: list,
                     sum_supports: bool, outer: "Outer | None" = None, offsets=None,
                     only: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """The first half of :func:`average_all_`: per block (of ``only``, or all) the value every row moves
    towards, the average after the outer step where there is one (returned, block -> ``[n]``); counters and
    summed supports take their merged values here. A Streaming DiLoCo fragment in flight keeps these targets
    until it lands (:func:`lerp_targets_`)."""
    targets = {}
    for k, (rule, own, theirs, support) in enumerate(zip(rules, blocks, models, supports)):
        if rule == KEEP or (only is not None and k not in only):
            continue
        if rule == SUM:  # counters are summed, not averaged
            counters_from_sum_(own, own.sum(0, keepdim=True))
            continue
        avg, merged = ops.weighted_average(theirs, support)
        if outer is not None and k < outer.blocks:
            o, n = offsets[k]
            avg = outer.step_(avg, o, n)
        targets[k] = avg
        if sum_supports:  # summed, not averaged
            support.copy_(merged.unsqueeze(0).expand_as(support))
    return targets


def lerp_targets_(blocks: list[torch.Tensor], change: list[torch.Tensor] | None, targets: dict[int, torch.Tensor],
                  weight: float) -> None:
    """Every row of each block in ``targets`` moves ``weight`` of the way to its target (Streaming DiLoCo's
    ``lerp(global, local, alpha)`` is ``weight = 1 - alpha``); ``change`` records the move."""
    for k, avg in targets.items():
        own = blocks[k]
        if change is not None:
            change[k].sub_(own)
        own.lerp_(avg.unsqueeze(0).expand_as(own), weight)
        if change is not None:
            change[k].add_(own)


@torch.no_grad()
def gradient_average_(grad, residual, fraction: float, bits: int, generators: Sequence) -> None:
    """Payload ``"gradient"``: each row's gradient plus what it has not sent yet (error feedback) is compressed as a
    delta is (:func:`ops.compress`: top-k, stochastic rounding, or scaled sign for 1 bit), what was not sent stays in
    ``residual``, and every row's gradient becomes the plain average of what the rows sent (stacks ``[W, P]``)."""
    v = grad.rows() + residual.rows()
    if fraction < 1.0 or bits:
        sent = torch.stack([ops.compress(v[w], fraction, bits, generators[w]) for w in range(v.shape[0])])
        residual.set_rows(v - sent)
    else:
        sent = v
    grad.set_rows(sent.mean(0, keepdim=True).expand_as(sent))


def layer_ids(names: Sequence[str]) -> list[int]:
    """Which layer each tensor belongs to: neighbouring tensors of one module (``fc0.weight``, ``fc0.bias``) are
    one layer, numbered in order."""
    out, prev = [], None
    for name in names:
        module = name.rsplit(".", 1)[0] if "." in name else name
        if module != prev:
            prev = module
            out.append(out[-1] + 1 if out else 0)
        else:
            out.append(out[-1])
    return out


def fragment_blocks(sizes: Sequence[int], trained: int, k: int, pattern: str = "contiguous",
                    layers: Sequence[int] | None = None) -> list[list[int]]:
    """Streaming DiLoCo's fragments: the ``trained`` parameter blocks (of ``sizes``) in ``k`` contiguous
    non-empty groups balanced by size (the least sum of squared group sizes, so one huge tensor does not leave
    the others unbalanced), cut at layer boundaries (``layers``: each trained block's layer, :func:`layer_ids`:
    a module's weight and bias stay together) where the model has at least ``k`` layers, else at tensor
    boundaries; ``pattern = "strided"``: the paper's pattern, layer l in group l mod k, so each fragment spans
    the model's depth. The blocks after them (buffers) go with the last. Raises ValueError when there are fewer
    trained blocks (strided: layers) than ``k``."""
    n = trained
    if pattern == "strided":
        layers = list(layers if layers is not None else range(n))[:n]
        if k > len(set(layers)):
            raise ValueError(f"{k} strided fragments of a model with {len(set(layers))} layers")
        groups = [[b for b in range(n) if layers[b] % k == j] for j in range(k)]
        groups[-1].extend(range(n, len(sizes)))
        return groups
    if k > n:
        raise ValueError(f"{k} fragments of a model with {n} parameter tensors")
    starts = set(range(n))  # where a group may begin
    if layers is not None and len(set(layers[:n])) >= k:
        starts = {b for b in range(n) if b == 0 or layers[b] != layers[b - 1]}
    pre = [0]
    for x in sizes[:n]:
        pre.append(pre[-1] + int(x))
    inf = float("inf")
    # best[j][i]: the least sum of squared sizes when blocks 0..i-1 form j groups; cut[j][i] the last group's start
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for m in range(j - 1, i):
                if m not in starts:
                    continue
                v = best[j - 1][m] + (pre[i] - pre[m]) ** 2
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, m
    groups, i = [], n
    for j in range(k, 0, -1):
        m = cut[j][i]
        groups.append(list(range(m, i)))
        i = m
    groups.reverse()
    groups[-1].extend(range(n, len(sizes)))
    return groups


def counter_limit(blk: torch.Tensor, limit: float = COUNTER_LIMIT) -> float | int:
    """Where a summed counter block stops: ``limit``, or for an integer block (a module's own counter in a user's
    loop: int64, or a narrower one) an int its type holds (an int64's clamp at a float raised; an int32's sum past
    its largest value wrapped)."""
    if blk.is_floating_point():
        return limit
    return min(int(limit), torch.iinfo(blk.dtype).max)


def counters_from_sum_(blk: torch.Tensor, total: torch.Tensor) -> None:
    """After an all-reduce every row's counters are their sum over all workers, capped at :data:`COUNTER_LIMIT`
    (and where the block's type ends: :func:`counter_limit`)."""
    total = total if blk.is_floating_point() else total.double()  # (float32 rounds an int32's largest value up)
    blk.copy_(total.clamp(max=counter_limit(blk)).to(blk.dtype).expand_as(blk))


def reduced_average(models: torch.Tensor, supports: torch.Tensor | None, reduce_: Callable[[torch.Tensor], None],
                    workers: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The (support-weighted) average of every process's rows ``models`` ``[k, P]`` (``supports`` the same shape, or
    None) by one sum-all-reduce ``reduce_`` (in place) over ``workers`` rows in all: returns the average, the summed
    supports (None) and the plain sum (what counters become)."""
    if supports is None:
        total = models.sum(0)
        reduce_(total)
        return total / workers, None, total
    sums = torch.stack([(supports * models).sum(0), supports.sum(0), models.sum(0)])
    reduce_(sums)
    num, total, plain = sums
    return ops.average_from_sums(num, total, plain / workers), total, plain


class Outer:
    """The outer optimiser's state (DiLoCo, SlowMo): the anchor (the last global model) and the momentum, one
    flat row each, for the first ``blocks`` parameter blocks (the trained ones). Merge state, kept by every
    process that holds workers, and moved by :meth:`step_` alone. Lookahead / SNOO (no merging, ``scheme =
    "none"``) keeps one anchor and momentum row per worker (``[W, P]``) and steps each worker on its own."""

    def __init__(self, anchor: torch.Tensor, lr: float, momentum: float, nesterov: bool, blocks: int):
        self.anchor, self.momentum = anchor.clone(), torch.zeros_like(anchor)
        self.lr, self.mu, self.nesterov, self.blocks = lr, momentum, nesterov, blocks

    def step_(self, avg: torch.Tensor, o: int, n: int, row: int | None = None) -> torch.Tensor:
        """One outer step on coordinates ``o..o+n`` from the workers' average ``avg``; returns the new anchor
        there. As ``torch.optim.SGD(momentum=mu, nesterov=...)`` on the pseudo-gradient ``anchor - avg``:
        ``m = mu * m + d``; ``anchor -= lr * (d + mu * m)`` (Nesterov) or ``lr * m`` (heavy-ball). Per-worker
        anchors (``[W, P]``): ``avg`` is every worker's own rows ``[W, n]``, or worker ``row``'s alone."""
        anchor, m = self.anchor[..., o:o + n], self.momentum[..., o:o + n]
        if row is not None:
            anchor, m = anchor[row], m[row]
        d = anchor - avg
        m.mul_(self.mu).add_(d)
        anchor.add_(d.add(m, alpha=self.mu) if self.nesterov else m, alpha=-self.lr)
        return anchor

    def step_flat_(self, avg: torch.Tensor, offsets) -> None:
        """:meth:`step_` on every trained block of a flat average ``avg``, which becomes the new anchor there."""
        for o, n in offsets[:self.blocks]:
            avg[o:o + n] = self.step_(avg[o:o + n], o, n)


class AsyncServer:
    """Asynchronous DiLoCo's server (Liu et al. 2024): the global model (one flat row), what each worker last
    pulled, and the delayed Nesterov momentum. Each arriving pseudo-gradient ``d = pulled[w] - row`` moves the
    global model by ``lr d / N`` at once and joins a buffer; every ``N`` arrivals the momentum takes the buffer's
    mean (``m = mu m + buffer / N``) and the global model its momentum step (Nesterov: ``lr mu m`` with the new
    momentum; heavy-ball: ``lr mu m`` with the old). With N = W and the W workers' arrivals together, that is
    torch.optim.SGD's step on the mean pseudo-gradient: synchronous DiLoCo."""

    def __init__(self, start: torch.Tensor, workers: int, lr: float, momentum: float, nesterov: bool, every: int):
        self.glob = start.clone()
        self.pulled = start.unsqueeze(0).repeat(workers, 1)
        self.momentum, self.buffer = torch.zeros_like(start), torch.zeros_like(start)
        self.lr, self.mu, self.nesterov, self.N = lr, momentum, nesterov, every or workers
        self.arrivals = 0

    def push_(self, rows: torch.Tensor, who: Sequence[int]) -> torch.Tensor:
        """The workers ``who`` (together) push their rows ``[k, P]``; returns the global model they all pull."""
        for row, w in zip(rows, who):
            d = self.pulled[w] - row
            self.glob.add_(d, alpha=-self.lr / self.N)
            self.buffer.add_(d)
            self.arrivals += 1
            if self.arrivals % self.N == 0:
                if self.nesterov:
                    self.momentum.mul_(self.mu).add_(self.buffer, alpha=1.0 / self.N)
                    self.glob.add_(self.momentum, alpha=-self.lr * self.mu)
                else:
                    self.glob.add_(self.momentum, alpha=-self.lr * self.mu)
                    self.momentum.mul_(self.mu).add_(self.buffer, alpha=1.0 / self.N)
                self.buffer.zero_()
        for w in who:
            self.pulled[w] = self.glob
        return self.glob


def outer_gradient_targets(anchor: torch.Tensor, public: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """DiLoCo's outer gradients compressed (payload delta with an outer step; MuLoCo, Streaming DiLoCo's
    quantisation): what each worker sent is ``public - before`` (its compressed change since its public copy,
    which is the anchor less what it still owes, error feedback); the models averaged are the anchor plus each sent
    change, so the average is ``anchor + mean(sent)`` and its pseudo-gradient ``-mean(sent)``."""
    return anchor.unsqueeze(0) + (public - before)


def owed_public(now: torch.Tensor, rows: torch.Tensor, public: torch.Tensor) -> torch.Tensor:
    """After an outer step on compressed outer gradients: each worker's new public copy, the rows it restarts from
    (``now``) less what it did not send (``rows - public``, its rows before the merge less its public copy after the
    send), so that its next change sent carries the rest (error feedback)."""
    return now - (rows - public)


def outer_for(policy, model, start: Callable[[], torch.Tensor],
              rows: Callable[[], torch.Tensor] | None = None) -> Outer | None:
    """The outer optimiser a policy asks for (None for ``outer_optimizer = "none"``), anchored at ``start()``; with
    ``scheme = "none"`` (Lookahead / SNOO) one anchor per worker, at ``rows()`` (``[W, P]``: the workers' rows)."""
    if policy.outer_optimizer == "none" or policy.scheme == "async":  # async: the server's (AsyncServer)
        return None
    if policy.scheme == "none":
        if rows is None:
            raise ValueError("a per-worker outer step needs the workers' rows (a bug in evomerge)")
        anchor = rows()
    else:
        anchor = start()
    return Outer(anchor, policy.outer_lr, policy.outer_momentum, policy.outer_optimizer == "nesterov",
                 model.n_trained_blocks)


def outer_each_(blocks: list[torch.Tensor], change: list[torch.Tensor] | None, outer: Outer, offsets,
                rows: Sequence[int] | None = None) -> None:
    """Lookahead / SNOO, the control without merging: each row of a stack (of ``rows``, or all) takes its own outer
    step on its pseudo-gradient ``anchor_w - row`` and restarts from its new anchor (the trained blocks; buffers
    stay); ``change`` records the move. No worker reads another's row."""
    for k in range(outer.blocks):
        o, n = offsets[k]
        blk = blocks[k]
        if change is not None:
            change[k].sub_(blk)
        if rows is None:
            blk.copy_(outer.step_(blk, o, n))
        else:
            for r in rows:
                blk[r].copy_(outer.step_(blk[r], o, n, row=r))
        if change is not None:
            change[k].add_(blk)


# -- supports ---------------------------------------------------------------------------------------------
def sum_pairs_(blocks: list[torch.Tensor], a: Sequence[int], b: Sequence[int], push_pull: bool) -> None:
    """Supports of a set of disjoint pairs: ``b[r]`` gets the sum of both (push-pull: ``a[r]`` too)."""
    for blk in blocks:
        old_b = [blk[j].clone() for j in b] if push_pull else None
        sum_rows_(blk, b, [blk[i] for i in a])
        if push_pull:
            sum_rows_(blk, a, old_b)


def sum_pairs_gathered_(blocks: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor,
                        a_pp: torch.Tensor | None = None, sel: torch.Tensor | None = None) -> None:
    """:func:`sum_pairs_` as gathers and scatters over all pairs at once (``a``, ``b`` tensors of distinct rows):
    ``b[r]`` gets the sum of both; the push-pull pairs' initiators ``a_pp`` (``a[sel]``) too. The same numbers (the
    sums are elementwise: ``b`` takes ``+ a``, each row once, and the push-pull initiators copy their peer's sum,
    as ``a + b`` rounds as ``b + a``)."""
    b_pp = b.index_select(0, sel) if a_pp is not None and len(a_pp) else None
    for q in blocks:
        q.index_add_(0, b, q.index_select(0, a))
        if b_pp is not None:
            q.index_copy_(0, a_pp, q.index_select(0, b_pp))


def rescale_supports(examples: torch.Tensor, accum=None) -> bool:
    """Merges only use ratios of supports; keep them far from overflow by a common factor. Returns whether
    it scaled (the state counts these epochs, so a payload sent before one is brought to the new scale).

    Accumulators are summed on merge exactly as the example counters are, so the counters' largest
    value decides for both; a power of two leaves every ratio exact. Every path that sums supports
    calls it after its merges (lockstep after each set of pairs and each all-reduce, a simulated clock
    after each batch of landings and each all-reduce): scaling between the same local steps gives the
    same bits, so a free clock keeps the lockstep results."""
    if float(ops.counts(examples).max()) > SUPPORT_LIMIT:
        examples.mul_(1.0 / SUPPORT_LIMIT)
        if accum is not None:
            accum.mul_(1.0 / SUPPORT_LIMIT)
        return True
    return False


def support_factor(epochs: int) -> float:
    """What supports sent ``epochs`` rescales ago are multiplied by to be on the receiver's scale (exact)."""
    return SUPPORT_LIMIT ** -epochs


# -- the running score (policy.score = "running") ------------------------------------------------------
SCORE_DECAY = 0.9


def score_step_(score: torch.Tensor, weight: torch.Tensor, losses: torch.Tensor) -> None:
    """After a local step, each row's running score moves towards its minibatch loss ``losses`` ``[rows]``: the
    exponential mean with decay :data:`SCORE_DECAY`, bias-corrected as Adam's moments are (``weight`` is the
    mean's total weight, ``1 - decay**t`` without merges), so a model with few steps is not judged on a zero start."""
    weight.mul_(SCORE_DECAY).add_(1.0 - SCORE_DECAY)
    score.add_((losses.detach().to(score.dtype) - score) * (1.0 - SCORE_DECAY) / weight)


def merged_score(own: float, incoming: float, move: float) -> float:
    """A receiver's running score after it moved ``move`` of the way to the incoming model: the score travels with
    the model it describes."""
    return own + move * (incoming - own)


def merge_scores_(score: torch.Tensor, a, b, move_a, move_b, push_pull: bool) -> None:
    """:func:`merged_score` for sets of disjoint pairs of rows of ``score``: ``b[r]`` moved ``move_b[r]`` towards
    ``a[r]`` (push-pull: ``a[r]`` also ``move_a[r]`` towards ``b[r]`` as it was)."""
    A, B = torch.as_tensor(a, device=score.device), torch.as_tensor(b, device=score.device)
    sa, sb = score[A], score[B]
    score[B] = sb + torch.as_tensor(move_b, dtype=score.dtype, device=score.device) * (sa - sb)
    if push_pull:
        score[A] = sa + torch.as_tensor(move_a, dtype=score.dtype, device=score.device) * (sb - sa)


# -- the winner test -------------------------------------------------------------------
def pair_examples(train_x: torch.Tensor, train_y: torch.Tensor, slices: torch.Tensor, a, b, spec):
    """The winner test's examples for pairs ``(a[r], b[r])``: both models of a pair are scored on the pair's
    two validation slices (the initiator's, then the peer's), so ``x`` ``[2m, 2s, ...]`` (normalised) and
    ``y`` ``[2m, 2s]``, in the order of :func:`pair_losses`' models."""
    from .setup import normalise

    dev = slices.device
    idx = torch.cat([slices[torch.as_tensor(a, device=dev)], slices[torch.as_tensor(b, device=dev)]], dim=1)
    return normalise(train_x[idx], spec).repeat_interleave(2, dim=0), train_y[idx].repeat_interleave(2, dim=0)


def pair_losses(model, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The winner test: each model's loss on its own examples, in one batched forward. ``params``: one
    ``[2m, ...]`` tensor per block (the pairs' two models, initiator first); ``x`` ``[2m, s, ...]``
    (normalised) and ``y`` ``[2m, s]`` the examples each model is scored on."""
    return model.task.example_losses(model.forward(params, x), y).mean(1).tolist()
