"""Decisions from what the workers publish (schema 10, ``publish_every``): peers and examples by similarity and swaps
by the peer's confidence read every worker's last publication instead of its state at the decision's instant, in the
lockstep world (after every k-th local step, before its merges) and on a simulated clock (at every k-th nominal step
time), on real MNIST."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import tiny_study
from test_timed import lockstep_part
from evomerge import simulate
from evomerge.backends.inprocess import InProcess
from evomerge.engine import clock, run as run_mod, similarity
from evomerge.engine.timed import Timed
from evomerge.policy import MergePolicy, switch_off_inapplicable
from evomerge.study import EnvSpec

P = MergePolicy
W, T = 5, 40


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=W, rounds=3, steps=T), data=mnist)


class Recording(InProcess):
    """The in-process backend, recording the step of each publication, what it published, and the similarity matrix
    each peer was drawn with."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.now, self.published, self.drawn = 0, {}, []

    def train(self, start, end, after_step):
        def at(step):
            self.now = step
            after_step(step)
        return super().train(start, end, at)

    def publish(self):
        super().publish()
        self.published[self.now] = self._published

    def _draw_peer(self, ev, step, sims):
        self.drawn.append((step, sims(step).copy()))
        return super()._draw_peer(ev, step, sims)


def test_lockstep_decisions_read_the_last_publication_and_its_bytes_are_charged(setup):
    k = 3
    policy = P(topology="complete", similarity_bias=0.8, mean_interval=1.5, swap_p=0.5, swap_confidence=0.9,
               publish_every=k)
    backend = Recording(setup, policy, 2, torch.device("cpu"))
    res = run_mod.execute(setup, policy, 2, backend, keep_params=True)
    assert sorted(backend.published) == list(range(0, T + 1, k))  # the start, then after every k-th step
    sims0, conf0 = backend.published[0]
    assert np.all(sims0 == 1.0) and conf0 == [None] * W  # nothing has moved or trained yet
    assert all(None not in backend.published[s][1] for s in range(k, T + 1, k))
    assert len(backend.drawn) > 30
    for step, used in backend.drawn:
        assert np.array_equal(used, backend.published[k * (step // k)][0])
    assert len({backend.published[s][0].tobytes() for s in range(k, T + 1, k)}) == T // k  # each one new
    # every publication sends each worker's sketch and confidence to every other; no decision gathers sketches
    instant = simulate.simulate(setup, policy.replace(publish_every=0), 2, device="cpu", keep_params=True)
    sketch = 4 * similarity.SKETCH_DIM
    assert res.final.merges == instant.final.merges
    assert res.final.bytes - instant.final.bytes == (T // k) * W * (W - 1) * (sketch + 4) \
        - instant.final.merges * (W - 1) * sketch
    assert not torch.equal(res.params, instant.params)  # the decisions read other states


class Watched(Timed):
    """On a clock: which publication each decision read."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked = []

    def peer(self, e, w, k, t):
        j = super().peer(e, w, k, t)
        self.asked.append((t, self._published))
        return j


class Publishing(InProcess):
    """The in-process backend, recording its replay's state (``driver``'s) at each publication."""

    driver = None

    def publish(self):
        super().publish()
        if self.driver is not None:
            self.driver.publications.append((self.driver.done.copy(), list(self.driver.ptr)))


def test_on_a_clock_a_decision_reads_the_last_publication_and_the_replay_stops_only_there(setup):
    """Uneven speeds, slow links: the replay is brought up to a publication's instant (every step that ended by it,
    every action before it) once, and the decisions until the next one read it."""
    from evomerge.engine.judge import Judge

    env = EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.5, latency=0.03, bandwidth=4e6)
    k = 4
    policy = P(topology="complete", similarity_bias=0.8, mean_interval=2.0, exchange="push_pull", publish_every=k)
    s = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env))
    backend = Publishing(s, policy, 1, torch.device("cpu"))
    backend.start(Judge(s, policy, 1, torch.device("cpu"), backend.train_x, 0.0))  # publishes the start
    driver = Watched(s, policy, 1, backend)
    driver.publications = [(np.zeros(W, dtype=np.int64), [0] * W)]
    backend.driver = driver
    for r in range(driver.rounds):
        driver.train_round(r)
    live, tl = driver.live, driver.timeline
    assert live.nominal_step == 0.25 * np.median(clock.speed_factors(env, W, 1)) != 0.25
    assert len(driver.asked) > 3 * len(driver.publications) > 15  # many decisions per stop of the replay
    for n, (done, ptr) in enumerate(driver.publications[1:], 1):
        t = live.publication_time(n)
        assert t == pytest.approx(n * k * live.nominal_step)  # the median worker's step time
        for w in range(W):
            assert done[w] == int((np.asarray(live.completions[w]) <= t).sum())
            assert ptr[w] == sum(1 for a in tl.actions[w] if a.time < t)
    assert len(driver.publications) - 1 == live.publications_by(tl.round_ends[-1])  # none skipped, none twice
    for t, n in driver.asked:
        assert live.publication_time(n) <= t < live.publication_time(n + 1)
    assert not np.array_equal(tl.peers, tl.schedule.peer)  # peers drawn from the published state


def test_publish_every_is_switched_off_where_nothing_is_decided_by_the_state():
    fixed = P()
    assert switch_off_inapplicable({"publish_every": 5}, fixed)["publish_every"] == 0
    no_swaps = {"publish_every": 5, "swap_confidence": 0.5}  # swaps by confidence without swaps
    assert switch_off_inapplicable(no_swaps, fixed)["publish_every"] == 0
    on = switch_off_inapplicable({"publish_every": 5, "similarity_bias": -0.3}, fixed)
    assert on["publish_every"] == 5 and "publish every 5 steps" in P(**on).describe()
    assert "publish" not in P(publish_every=5).describe()


def test_a_free_cluster_at_any_one_speed_publishes_as_the_lockstep_run(setup):
    """Publications fall at every k-th step of the median worker: on a homogeneous free cluster of speed 2 (step
    time 0.1 s, not a binary fraction) they are the lockstep run's, with the replay at its steps (waves) too."""
    policy = P(topology="complete", similarity_bias=0.8, mean_interval=1.5, swap_p=0.4, swap_confidence=0.6,
               publish_every=4)
    lockstep = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    env = EnvSpec(step_time=0.1, speeds=(2.0,) * W)
    s = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env))
    for waves in (False, True):
        timed = simulate.simulate(s, policy, 3, device="cpu", keep_params=True, waves=waves)
        assert lockstep_part(timed) == lockstep_part(lockstep) and torch.equal(timed.params, lockstep.params)


def test_on_a_clock_each_publication_is_charged_and_no_decision_gathers(setup):
    """Uneven speeds (the median worker at speed 1), push gossip that never waits: both runs send the same payloads;
    one charges a gather per decision (its payloads leave once the sketches are in), the other every publication
    up to the end."""
    env = EnvSpec(step_time=0.25, speeds=(1.0, 1.0, 1.0, 0.5, 0.5), latency=0.01, bandwidth=1e7)
    policy = P(topology="complete", similarity_bias=0.8, mean_interval=2.0, exchange="push", publish_every=3)
    s = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env))
    published = simulate.simulate(s, policy, 0, device="cpu")
    instant = simulate.simulate(s, policy.replace(publish_every=0), 0, device="cpu")
    end = published.final.sim_time
    # the run ends when its last payload is applied: a decision that gathers first sends it later
    assert end <= instant.final.sim_time and published.final.merges == instant.final.merges > 20
    sketch = 4 * similarity.SKETCH_DIM
    publications = int(end // (3 * 0.25))  # at 0.75 s, 1.5 s, ... up to the end
    assert publications >= 5
    assert published.final.bytes - instant.final.bytes == publications * W * (W - 1) * sketch \
        - instant.final.merges * (W - 1) * sketch
