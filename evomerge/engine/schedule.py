"""The event schedule: every random choice about merging, drawn from the seed alone.

Gossip: each worker's timer draws ``K = 1 + Poisson(mean_interval - 1)`` local steps
until its next merge; at each firing the topology picks a peer and a uniform ``u``
is drawn for the random lerp. Allreduce: every worker averages with all every
``round(mean_interval)`` steps. Any backend that replays a schedule performs exactly
the same merges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import topology as topo_mod


def rng_for(seed: int, *tags: int) -> np.random.Generator:
    """A numpy generator for one purpose of one run: ``seed``, the purpose's tag (:data:`STREAMS`), and the
    purpose's own arguments (a worker, a pass, an event)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *tags])))


#: Every random stream of a run, by purpose: its tag, the first word after the seed. Each purpose has its own:
#: numpy's SeedSequence pads its entropy with zeros, so ``(seed, t)`` and ``(seed, t, 0, 0)`` are one stream,
#: and two purposes sharing a tag would share numbers whatever their other arguments (the simulated clock's
#: speeds and the data pool's first pass once did). Every call of :func:`rng_for` names its tag from here.
STREAMS = {
    "topology": 11, "timers": 12, "peers": 13, "lerp": 14, "peer_u": 15, "swap": 16,  # the event schedule
    "init": 21, "batches": 22, "slices": 23, "quant": 24,  # a run's start, minibatches, scoring slices, rounding
    "layers": 25,  # random layers (dropout): a key per worker and local step
    "sketch": 31, "probe": 32,  # model similarity
    "speeds": 41, "jitter": 42, "spells": 43,  # the simulated clock
    "passes": 45,  # the data pool's passes over each worker's data
}

def layer_keys(seed: int, workers, steps) -> list[int]:
    """The keys that seed random layers (dropout) for local step ``steps[i]`` of worker ``workers[i]`` (``steps``
    may be one step for all): a function of (seed, worker, step) alone, so every backend, population batch and
    rank draws the same masks for a worker (:mod:`evomerge.models.generic`)."""
    if isinstance(steps, (int, np.integer)):
        steps = [int(steps)] * len(workers)
    return [int(np.random.SeedSequence([seed, STREAMS["layers"], int(w), int(k)]).generate_state(2, np.uint64)[0] >> 1)
            for w, k in zip(workers, steps)]


TAG_TOPOLOGY, TAG_TIMERS, TAG_PEERS, TAG_LERP, TAG_PEER_U, TAG_SWAP = (
    STREAMS[k] for k in ("topology", "timers", "peers", "lerp", "peer_u", "swap"))


@dataclass(frozen=True)
class Schedule:
    scheme: str
    total_steps: int
    step: np.ndarray  # [E] events happen after this many completed local steps (1..total_steps)
    initiator: np.ndarray  # [E]
    peer: np.ndarray  # [E] (-1 for an allreduce: everybody)
    u: np.ndarray  # [E] uniform draws for the random lerp
    topology: topo_mod.Topology | None
    u_peer: np.ndarray | None = None  # [E] uniforms for peers drawn during the run (similarity, regrouping)
    u_swap: np.ndarray | None = None  # [E] uniforms deciding model swaps
    fragment: np.ndarray | None = None  # [E] the fragment an all-reduce syncs (policy.fragments; None: the whole model)
    fragments: int = 1  # how many fragments the model is synced in

    def __len__(self) -> int:
        return len(self.step)

    def syncs_whole_model(self, event: int) -> bool:
        """Whether an all-reduce event completes a sync of the whole model (the last of its fragments): where the
        example counters are summed, once per sync, on every path."""
        return self.fragment is None or int(self.fragment[event]) == self.fragments - 1

    def events_at(self, step: int) -> range:
        lo, hi = np.searchsorted(self.step, [step, step + 1])
        return range(int(lo), int(hi))


def build(policy, workers: int, total_steps: int, seed: int, local_steps: list[int] | None = None,
          run_steps: int | None = None) -> Schedule:
    """``local_steps``: asynchronous DiLoCo's local steps per round of each worker (default round(mean_interval));
    ``run_steps``: the run's local steps, where ``total_steps`` is a longer horizon (a simulated clock's): a
    moving p_intra reaches its final value there, as the mixing weight does."""
    empty = np.zeros(0, dtype=np.int64)
    if policy.scheme == "none" or workers < 2:
        return Schedule(policy.scheme, total_steps, empty, empty, empty, np.zeros(0), None)
    if policy.scheme == "async":  # worker w pushes to the server after every local_steps[w] of its own steps
        every = local_steps or [max(1, round(policy.mean_interval))] * workers
        steps = np.concatenate([np.arange(h, total_steps + 1, h, dtype=np.int64) for h in every])
        inits = np.concatenate([np.full(len(range(h, total_steps + 1, h)), w, dtype=np.int64)
                                for w, h in enumerate(every)])
        order = np.lexsort((inits, steps))
        steps, inits = steps[order], inits[order]
        u = rng_for(seed, TAG_LERP).random(len(steps))
        return Schedule("async", total_steps, steps, inits, np.full_like(steps, -1), u, None)
    if policy.scheme == "allreduce":
        every = max(1, round(policy.mean_interval))
        k = policy.fragments
        if k == 1:
            steps = np.arange(every, total_steps + 1, every, dtype=np.int64)
            frag = None
        else:  # Streaming DiLoCo: fragment j after local steps (j + 1) H // k + m H, staggered
            steps, frag = [], []
            for j in range(k):
                s_j = np.arange((j + 1) * every // k, total_steps + 1, every, dtype=np.int64)
                steps.append(s_j)
                frag.append(np.full(len(s_j), j, dtype=np.int64))
            steps, frag = np.concatenate(steps), np.concatenate(frag)
            order = np.lexsort((frag, steps))
            steps, frag = steps[order], frag[order]
        u = rng_for(seed, TAG_LERP).random(len(steps))
        return Schedule("allreduce", total_steps, steps, np.zeros_like(steps), np.full_like(steps, -1), u, None,
                        fragment=frag, fragments=k)

    topology = topo_mod.build(policy, workers, rng_for(seed, TAG_TOPOLOGY))
    timers = rng_for(seed, TAG_TIMERS)
    steps, inits = [], []
    lam = policy.mean_interval - 1.0
    for w in range(workers):
        # enough gaps to pass the end, drawn in blocks; each worker's draws are in order
        t, fired = 0, []
        while t <= total_steps:
            gaps = 1 + timers.poisson(lam, size=max(16, int(2 * total_steps / policy.mean_interval) + 1))
            times = t + np.cumsum(gaps)
            fired.append(times[times <= total_steps])
            t = int(times[-1])
        f = np.concatenate(fired)
        steps.append(f)
        inits.append(np.full(len(f), w, dtype=np.int64))
    step = np.concatenate(steps).astype(np.int64)
    init = np.concatenate(inits)
    order = np.lexsort((init, step))  # by step, then initiator
    step, init = step[order], init[order]
    peer = topology.sample(init, rng_for(seed, TAG_PEERS), progress=step / (run_steps or total_steps)).astype(np.int64)
    u = rng_for(seed, TAG_LERP).random(len(step))
    # separate streams: policies that do not use them draw exactly what they drew before
    u_peer = rng_for(seed, TAG_PEER_U).random(len(step))
    u_swap = rng_for(seed, TAG_SWAP).random(len(step))
    return Schedule("gossip", total_steps, step, init, peer, u, topology, u_peer, u_swap)
