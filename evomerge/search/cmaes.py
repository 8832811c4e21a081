"""CMA-ES (the ``cma`` package) driven through its ask/tell interface against an
Optuna study, with no pickled state.

Each trial that CMA-ES proposes carries JSON user attributes ``cma_restart``,
``cma_generation`` and ``cma_index``. Whoever needs the next candidate rebuilds the
optimiser by replaying the study: the same seed gives the same ``ask()``, and each
finished generation is told its stored values. So a resumed search, or any of
several processes, continues exactly where the state was, and the state lives only
in the Optuna storage that people keep.

Values told to CMA-ES: a complete trial's objective; a pruned trial's last
intermediate value; a trial that failed with an error gets the generation's worst
value (a penalty). Interrupted trials are asked again. With ``restarts`` > 0, IPOP:
when CMA-ES stops, it restarts with twice the population.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ATTR_RESTART, ATTR_GEN, ATTR_INDEX = "cma_restart", "cma_generation", "cma_index"


@dataclass(frozen=True)
class Candidate:
    restart: int
    generation: int
    index: int
    x: list[float]  # in [0, 1]^d


def default_popsize(dim: int) -> int:
    """pycma's generation size for ``dim`` coordinates: 4 + 3 ln d."""
    return 4 + int(3 * np.log(dim))


class CmaDriver:
    def __init__(self, dim: int, *, seed: int = 0, sigma0: float = 0.3, popsize: int | None = None,
                 restarts: int = 0, maximize: bool = True, x0: list[float] | None = None, stds: list[float] | None = None):
        """``x0``, ``sigma0`` and ``stds`` (per-coordinate multipliers of ``sigma0``): where the search starts,
        the centre of [0, 1]^d and 0.3 unless a warm start (search/warmstart.py) says otherwise."""
        if dim < 1:
            raise ValueError("CMA-ES needs at least one numeric field in the search space")
        for name, v in (("x0", x0), ("stds", stds)):
            if v is not None and len(v) != dim:
                raise ValueError(f"{name} has {len(v)} coordinates; the search space has {dim} numeric fields")
        self.dim, self.seed, self.sigma0 = dim, seed, sigma0
        self.x0, self.stds = list(x0) if x0 is not None else [0.5] * dim, stds
        self.popsize = popsize or default_popsize(dim)
        self.restarts, self.sign = restarts, -1.0 if maximize else 1.0

    def _es(self, restart: int):
        import cma

        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0xC3A, restart])))
        opts = {"seed": np.nan, "randn": lambda *shape: rng.standard_normal(shape), "bounds": [0, 1],
                "popsize": self.popsize * 2 ** restart, "verbose": -9, "verb_log": 0, "verb_disp": 0}
        # one numeric field: pycma's bounds fail in one dimension (its tell raised "not yet initialized (dimension
        # needed)"), so a second coordinate rides along, drawn and never used (next_many keeps the first)
        pad = [0.5] if self.dim == 1 else []
        if self.stds is not None:
            opts["CMA_stds"] = list(self.stds) + [1.0] * len(pad)
        return cma.CMAEvolutionStrategy(list(self.x0) + pad, self.sigma0, opts)

    def categoricals(self, c: Candidate) -> np.random.Generator:
        """Where candidate ``c``'s categorical fields are drawn from (``--cmaes-categoricals independent``): its seed
        and place (restart, generation, index), so a resumed search, another process, or the candidate asked again
        after a failure draws what it drew. (From the sampler's one stream, they came out otherwise after a resume.)"""
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0xCA7, c.restart, c.generation,
                                                                           c.index])))

    def next(self, trials) -> Candidate | None:
        """The next candidate to evaluate, or None while the current generation's last
        candidates are still running elsewhere (the caller waits and asks again)."""
        cands = self.next_many(trials, 1)
        return cands[0] if cands else None

    def next_many(self, trials, k: int) -> list[Candidate]:
        """Up to ``k`` candidates to evaluate, from one replay of ``trials``: the current generation's first free
        ones (what ``k`` calls of :meth:`next` give, each candidate running before the next call); fewer, or
        none, while its other candidates are still running."""
        from optuna.trial import TrialState

        by_key: dict[tuple[int, int, int], list] = {}
        for t in trials:
            a = t.user_attrs
            if ATTR_GEN in a:
                by_key.setdefault((a[ATTR_RESTART], a[ATTR_GEN], a[ATTR_INDEX]), []).append(t)
        restart = 0
        es = self._es(restart)
        gen = 0
        while True:
            xs = es.ask()
            values: list[float | None] = []
            free = []
            for i in range(len(xs)):
                ts = by_key.get((restart, gen, i), [])
                v, running = _value(ts, TrialState)
                values.append(v)
                if v is None and not running:
                    free.append(i)
            if any(v is None for v in values):
                return [Candidate(restart, gen, i, [float(c) for c in xs[i][:self.dim]]) for i in free[:k]]
            finite = [v for v in values if v != "penalty"]
            worst = max((self.sign * v for v in finite), default=0.0)
            es.tell(xs, [worst if v == "penalty" else self.sign * v for v in values])
            gen += 1
            if es.stop() and restart < self.restarts:
                restart += 1
                es = self._es(restart)
                gen = 0

    def state(self, trials) -> dict:
        """Where the replayed optimiser stands (for the output and for tests)."""
        done = [t for t in trials if ATTR_GEN in t.user_attrs]
        last = max(((t.user_attrs[ATTR_RESTART], t.user_attrs[ATTR_GEN]) for t in done), default=(0, 0))
        return {"restart": last[0], "generation": last[1], "popsize": self.popsize * 2 ** last[0]}


def _value(ts, TrialState):
    """(value or 'penalty' or None, whether one is running) for the trials of one candidate."""
    running = False
    for t in ts:
        if t.state == TrialState.COMPLETE:
            return t.values[0], False
        if t.state == TrialState.PRUNED:
            iv = t.intermediate_values
            return (iv[max(iv)] if iv else t.user_attrs.get("last_value", 0.0)), False
        if t.state == TrialState.FAIL and t.user_attrs.get("failure") == "error":
            return "penalty", False
        if t.state == TrialState.RUNNING:
            running = True
    return None, running
