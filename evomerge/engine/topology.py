"""Who may be a peer: topologies by name.

A topology is built for ``n`` workers from a policy and a seeded numpy generator;
it gives each worker's peer distribution (rows of a matrix that sum to one, zero
on the diagonal) and draws peers from it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import ConfigError, unknown


class Topology:
    name = "base"

    def __init__(self, n: int):
        self.n = n

    def probabilities(self) -> np.ndarray:
        """``[n, n]``: row i is the distribution of worker i's peer (zero diagonal, rows sum to 1)."""
        raise NotImplementedError

    def neighbours(self, i: int) -> np.ndarray:
        return np.flatnonzero(self.probabilities()[i] > 0)

    def sample(self, initiators: np.ndarray, rng: np.random.Generator, progress: np.ndarray | None = None) -> np.ndarray:
        """One peer for each initiator; ``progress``: each event's place in the run, in [0, 1] (a topology that
        changes over the run draws from its probabilities there)."""
        return _draw(self.probabilities(), initiators, rng.random(len(initiators)))


class Ring(Topology):
    name = "ring"

    def probabilities(self):
        p = np.zeros((self.n, self.n))
        for i in range(self.n):
            p[i, (i - 1) % self.n] += 0.5
            p[i, (i + 1) % self.n] += 0.5
        np.fill_diagonal(p, 0.0)
        return _normalise(p)


class Complete(Topology):
    name = "complete"

    def probabilities(self):
        p = np.ones((self.n, self.n))
        np.fill_diagonal(p, 0.0)
        return _normalise(p)


class RandomRegular(Topology):
    """A random ``degree``-regular graph drawn once per run from the seed."""

    name = "random_regular"

    def __init__(self, n: int, degree: int, rng: np.random.Generator):
        super().__init__(n)
        if n > 1 and (degree >= n or (n * degree) % 2):
            raise ConfigError("policy.degree", f"{degree} with {n} workers is impossible; allowed: degree < workers and degree * workers even")
        self.degree = degree
        self.adjacency = _random_regular(n, degree, rng) if n > 1 else np.zeros((n, n))

    def probabilities(self):
        return _normalise(self.adjacency.astype(float))


class Communities(Topology):
    """Workers in ``c`` contiguous groups; the peer is from the own group with probability ``p_intra``, which moves
    to ``p_intra_final`` over the run by ``schedule`` (constant, linear or cosine, as the mixing weight does), so
    that communities can explore apart early and converge later."""

    name = "communities"

    def __init__(self, n: int, n_communities: int, p_intra: float, groups: np.ndarray | None = None,
                 p_intra_final: float | None = None, schedule: str = "constant"):
        super().__init__(n)
        if n_communities > n:
            raise ConfigError("policy.n_communities", f"{n_communities} is out of range; allowed: [1, {n}] for {n} workers")
        self.groups = groups if groups is not None else np.concatenate(
            [np.full(len(s), g) for g, s in enumerate(np.array_split(np.arange(n), n_communities))])
        self.p_intra = p_intra
        self.p_intra_final = p_intra if p_intra_final is None else p_intra_final
        self.schedule = schedule
        same = self.groups[:, None] == self.groups[None, :]  # the groups' shape, whatever p_intra is
        np.fill_diagonal(same, False)
        other = self.groups[:, None] != self.groups[None, :]
        self._intra, self._inter = _normalise(same.astype(float)), _normalise(other.astype(float))
        self._has_intra, self._has_inter = same.any(1, keepdims=True), other.any(1, keepdims=True)

    def neighbours(self, i: int) -> np.ndarray:
        """Everyone ``i`` may draw over the run (a p_intra moving to or from 0 or 1 opens or closes a group)."""
        return np.flatnonzero((self.probabilities(0.0)[i] > 0) | (self.probabilities(1.0)[i] > 0))

    def p_intra_at(self, progress: float) -> float:
        """``p_intra`` at ``progress`` in [0, 1] of the run (the mixing weight's schedule: one definition)."""
        from .ops import scheduled_weight  # ops imports torch; the policy module imports this one

        return scheduled_weight(self.p_intra, self.p_intra_final, self.schedule, progress)

    def probabilities(self, progress: float = 0.0):
        p_intra = self.p_intra_at(progress)
        w_in = np.where(self._has_inter, p_intra, 1.0) * self._has_intra
        w_out = np.where(self._has_intra, 1.0 - p_intra, 1.0) * self._has_inter
        return _normalise(w_in * self._intra + w_out * self._inter)

    def sample(self, initiators: np.ndarray, rng: np.random.Generator, progress: np.ndarray | None = None) -> np.ndarray:
        if self.schedule == "constant" or progress is None:
            return super().sample(initiators, rng)
        u = rng.random(len(initiators))  # the same draws as a constant p_intra's
        peers = np.empty(len(initiators), dtype=np.int64)
        for at in np.unique(progress):
            m = progress == at
            peers[m] = _draw(self.probabilities(float(at)), initiators[m], u[m])
        return peers


def _draw(p: np.ndarray, initiators: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: a peer for each initiator from its row of ``p``, with the uniforms ``u``."""
    rows = np.cumsum(p, axis=1)[initiators]
    return np.minimum((u[:, None] >= rows).sum(axis=1), len(p) - 1)


def _normalise(p: np.ndarray) -> np.ndarray:
    s = p.sum(axis=1, keepdims=True)
    return np.divide(p, s, out=np.zeros_like(p), where=s > 0)


def _random_regular(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Pairing model with repair (Steger-Wormald style): shuffle stubs, keep valid pairs, retry the rest."""
    for _ in range(200):
        adj = np.zeros((n, n), dtype=bool)
        stubs = np.repeat(np.arange(n), k)
        for _ in range(50 * k + 50):
            if len(stubs) == 0:
                return adj
            stubs = rng.permutation(stubs)
            a, b = stubs[0::2], stubs[1::2]
            left = []
            for x, y in zip(a.tolist(), b.tolist()):
                if x != y and not adj[x, y]:
                    adj[x, y] = adj[y, x] = True
                else:
                    left += [x, y]
            stubs = np.array(left, dtype=int)
            if len(stubs) and all(x == stubs[0] for x in stubs):
                break
    raise ConfigError("policy.degree", f"could not draw a random {k}-regular graph on {n} workers")


TOPOLOGIES: dict[str, Callable[..., Topology]] = {
    "ring": lambda n, policy, rng: Ring(n),
    "complete": lambda n, policy, rng: Complete(n),
    "random_regular": lambda n, policy, rng: RandomRegular(n, policy.degree, rng),
    "communities": lambda n, policy, rng: Communities(n, policy.n_communities, policy.p_intra,
                                                      p_intra_final=policy.p_intra_final,
                                                      schedule=policy.p_intra_schedule),
}


def build(policy, n: int, rng: np.random.Generator) -> Topology:
    if policy.topology not in TOPOLOGIES:
        raise ConfigError("policy.topology", unknown(policy.topology, TOPOLOGIES))
    return TOPOLOGIES[policy.topology](n, policy, rng)
