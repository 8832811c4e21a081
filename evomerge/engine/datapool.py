"""Data that travels: which worker holds which training example, and how confident it is on it.

Every training position of the partition belongs to exactly one worker at any time, in
its active shard or its reserve. Workers walk their data in passes: each pass is a
permutation (from the seed, the worker and the pass number) of the active shard plus
each reserve example with probability ``reserve_rate``. An example that moved away
during a pass is skipped by its former holder.

Confidence is the probability the holder's model gave the true label when it last
trained on the example (it comes free from the training step's forward pass). An
example whose confidence was at least ``retire_threshold`` the last two times it was
trained on (by whichever models) retires to its holder's reserve. On a merge event the
initiator sends ``k`` of its active examples to the peer: its least confident, or some of its
most confident (:meth:`DataPool.send`, ``most``); those the peer has never trained on first if
asked (``unseen_first``). Each example keeps which workers have trained on it (its history).
All of this is numpy on index arrays; no Python loop runs over examples.
"""

from __future__ import annotations

import numpy as np

from . import schedule as schedule_mod

TAG_PASSES = schedule_mod.STREAMS["passes"]
UNSEEN = 2.0  # confidence of an example no model has trained on yet: never "least confident", never retired
IN_TRANSIT = -2  # the holder of an example on its way between two workers (a simulated clock's link)


def first_k(key: np.ndarray, k: int, later: np.ndarray | None = None) -> np.ndarray:
    """The first ``k`` positions of ``np.lexsort((key, later))`` (``later``: positions that go after the others;
    ties by position; NaN last in its group), without sorting them all: the selection's value, then the few below
    it and at it."""
    if later is not None:
        head, tail = np.flatnonzero(~later), np.flatnonzero(later)
        out = head[first_k(key[head], k)]
        return out if len(out) >= k else np.concatenate([out, tail[first_k(key[tail], k - len(out))]])
    if k >= len(key):
        return np.argsort(key, kind="stable")
    v = np.partition(key, k - 1)[k - 1]
    if not np.isfinite(v):  # non-finite keys (a diverged model): the whole stable sort, as lexsort orders them
        return np.argsort(key, kind="stable")[:k]
    below = np.flatnonzero(key < v)
    idx = np.concatenate([below, np.flatnonzero(key == v)[:k - len(below)]])
    return idx[np.argsort(key[idx], kind="stable")]


def most_confident_share(sign: float, sims: np.ndarray, i: int, j: int) -> float:
    """The share of the examples ``i`` sends ``j`` that are its most confident (policy.data_similarity_sign ``sign``):
    ``j``'s dissimilarity d among ``i``'s others (``sims``: ``i``'s row of the similarity matrix; d = 0 for its most
    similar, 1 for its least), then ``sign d`` for a positive sign and ``|sign| (1 - d)`` for a negative one."""
    others = np.delete(np.asarray(sims, dtype=float), i)
    hi, lo = others.max(), others.min()
    d = float((hi - sims[j]) / (hi - lo)) if hi > lo else 0.0
    return sign * d if sign > 0 else -sign * (1.0 - d)


class DataPool:
    def __init__(self, shards: list[np.ndarray], n_train: int, seed: int, *, retire_threshold: float = 0.0,
                 reserve_rate: float = 1.0):
        self.W = len(shards)
        self.seed = seed
        self.retire_threshold, self.reserve_rate = retire_threshold, reserve_rate
        self.holder = np.full(n_train, -1, dtype=np.int64)  # -1: not a training example of any worker
        self.reserved = np.zeros(n_train, dtype=bool)
        for w, s in enumerate(shards):
            self.holder[s] = w
        self.conf = np.full(n_train, UNSEEN, dtype=np.float32)
        self.prev_conf = np.full(n_train, UNSEEN, dtype=np.float32)
        self.queue = [np.zeros(0, dtype=np.int64) for _ in range(self.W)]
        self.passes = [0] * self.W
        self.moved = 0  # examples sent between workers
        self.retired = 0
        self.seen = np.zeros((n_train, self.W), dtype=bool)  # which workers have trained on each example
        self.travelled = np.zeros(n_train, dtype=bool)  # examples that have moved at least once

    # -- what each worker holds --------------------------------------------------------
    def active(self, w: int) -> np.ndarray:
        return np.flatnonzero((self.holder == w) & ~self.reserved)

    def reserve(self, w: int) -> np.ndarray:
        return np.flatnonzero((self.holder == w) & self.reserved)

    def holdings(self) -> list[np.ndarray]:
        """Active shard and reserve of each worker, together (what its label skew is measured on)."""
        order = np.argsort(self.holder, kind="stable")
        counts = np.bincount(self.holder[self.holder >= 0], minlength=self.W)
        start = int((self.holder < 0).sum())
        out, pos = [], start
        for c in counts:
            out.append(np.sort(order[pos:pos + c]))
            pos += c
        return out

    # -- minibatches ---------------------------------------------------------------------
    def _new_pass(self, w: int) -> np.ndarray:
        rng = schedule_mod.rng_for(self.seed, TAG_PASSES, w, self.passes[w])
        self.passes[w] += 1
        reserve = self.reserve(w)
        if len(reserve):
            reserve = reserve[rng.random(len(reserve)) < self.reserve_rate]
        pool = np.concatenate([self.active(w), reserve])
        if len(pool) == 0:  # everything retired and none drawn: the whole reserve
            pool = self.reserve(w)
        if len(pool) == 0:
            raise RuntimeError(f"worker {w} holds no training example")
        return pool[rng.permutation(len(pool))]

    def batches(self, batch: int) -> np.ndarray:
        """The next minibatch of every worker, ``[W, batch]`` training positions."""
        return np.stack([self.batch(w, batch) for w in range(self.W)])

    def batch(self, w: int, batch: int) -> np.ndarray:
        """Worker ``w``'s next minibatch: a function of its own sends, receipts and training only (a simulated
        clock's replay draws each worker's at its own step)."""
        got = np.zeros(0, dtype=np.int64)
        while len(got) < batch:
            if len(self.queue[w]) == 0:
                self.queue[w] = self._new_pass(w)
            q = self.queue[w]
            take = q[:batch - len(got)]
            self.queue[w] = q[len(take):]
            got = np.concatenate([got, take[self.holder[take] == w]])  # moved away meanwhile: skip
        return got

    # -- confidence, retirement, exchange ------------------------------------------------------
    def record(self, positions: np.ndarray, confidence: np.ndarray, workers=None) -> None:
        """Confidences ``[W, B]`` of the holders' models on the examples they just trained on (``workers``: the
        rows' workers, if not all of them in order)."""
        rows = np.arange(self.W) if workers is None else np.asarray(workers, dtype=np.int64)
        self.seen[positions, rows[:, None]] = True
        pos = positions.reshape(-1)
        self.prev_conf[pos] = self.conf[pos]
        self.conf[pos] = confidence.reshape(-1)
        if self.retire_threshold > 0:
            t = self.retire_threshold
            ready = pos[(self.conf[pos] >= t) & (self.prev_conf[pos] >= t) & ~self.reserved[pos]]
            ready = np.unique(ready)
            self.reserved[ready] = True
            self.retired += len(ready)

    def send(self, src: int, dst: int, k: int, *, most: float = 0.0, unseen_first: bool = False) -> int:
        """Move ``k`` of ``src``'s active examples to ``dst``'s active shard; returns how many. ``round(most * k)`` of
        them are its most confident (among those a model has trained on), the rest its least confident. With
        ``unseen_first`` the examples ``dst`` has never trained on come first in both orders."""
        return len(self.leave(src, dst, k, most=most, unseen_first=unseen_first, to=dst))

    def arrive(self, dst: int, positions: np.ndarray) -> None:
        """Examples sent with :meth:`leave` (``to=IN_TRANSIT``) reach ``dst``'s active shard."""
        self.holder[positions] = dst

    def leave(self, src: int, dst: int, k: int, *, most: float = 0.0, unseen_first: bool = False,
              to: int = IN_TRANSIT) -> np.ndarray:
        """The examples :meth:`send` chooses for ``dst``, taken from ``src`` and given to ``to`` (on a simulated
        clock: in transit, nobody's, until :meth:`arrive`); their positions."""
        act = self.active(src)
        k = min(k, max(0, len(act) - 1))  # a worker keeps at least one example
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        c = self.conf[act]
        later = self.seen[act, dst] if unseen_first else None  # the examples dst has trained on go after the others
        least = act[first_k(c, k, later)]  # the k least confident, stable: ties keep the shard's order
        n_most = int(round(most * k))
        if n_most:
            trained = np.where(c >= UNSEEN, -1.0, c)  # an example no model trained on is not confident
            top = act[first_k(-trained, n_most, later)]
            taken = set(top.tolist())  # a few examples: a set, not np.isin's sort
            rest = np.fromiter((x for x in least.tolist() if x not in taken), dtype=np.int64)
            chosen = np.concatenate([top, rest[:k - n_most]])
        else:
            chosen = least
        self.holder[chosen] = to
        self.travelled[chosen] = True
        self.moved += len(chosen)
        return chosen

    def confidence(self, w: int) -> float | None:
        """The mean confidence of worker ``w``'s model on its active examples it has trained on (None before any)."""
        c = self.conf[self.active(w)]
        c = c[c < UNSEEN]
        return float(c.mean()) if len(c) else None

    def visitors(self) -> float | None:
        """The mean number of distinct workers that have trained on each example that has travelled (None before
        any has)."""
        if not self.travelled.any():
            return None
        return float(self.seen[self.travelled].sum(1).mean())
