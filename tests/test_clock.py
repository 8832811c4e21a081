"""The simulated clock alone (no tensors): hand-computed transfers, uplinks, barriers and stragglers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from evomerge.engine import schedule as schedule_mod
from evomerge.engine import clock, plan
from evomerge.policy import MergePolicy
from evomerge.errors import ConfigError
from evomerge.study import EnvSpec

P_PARAMS = 1000  # a model of 1000 float32 parameters: 4000 bytes a payload


def timeline(env, policy, workers, steps, rounds=1, seed=0, events=None, example_bytes=0, similarity_bytes=0):
    """The timeline of ``policy``; ``events``: a hand-made gossip schedule [(step, initiator, peer), ...] (its swap
    uniforms 0: every event swaps when ``swap_p`` > 0)."""
    cost = plan.Bytes(policy, P_PARAMS, [1] * workers, example_bytes=example_bytes, similarity_bytes=similarity_bytes)
    if events is None:
        make = lambda horizon: schedule_mod.build(policy, workers, horizon, seed)  # noqa: E731
    else:
        s = np.array([e[0] for e in events]), np.array([e[1] for e in events]), np.array([e[2] for e in events])
        sched = schedule_mod.Schedule("gossip", steps, *s, np.zeros(len(events)), None,
                                      u_swap=np.zeros(len(events)))
        make = lambda horizon: sched  # noqa: E731
    return clock.build(env, policy, workers, steps, rounds, seed, cost, make), cost


def lands(tl, kind=clock.LAND):
    return sorted((a for acts in tl.actions for a in acts if a.kind == kind), key=lambda a: a.landed)


def test_a_transfer_lands_latency_plus_bytes_over_bandwidth_later():
    l, b = 0.3, 16000.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b)
    tl, cost = timeline(env, MergePolicy(exchange="push"), 2, 4, events=[(1, 0, 1)])
    (a,) = lands(tl)
    assert a.sent == 1.0 and a.landed == pytest.approx(1.0 + l + cost.sent / b, abs=1e-12)
    # worker 1 was in its second step when it landed: applied at the end of that step
    assert a.worker == 1 and a.boundary == 2 and a.time == 2.0


def test_two_concurrent_sends_from_one_node_share_its_uplink():
    """Fairly, as TCP flows do: both at half the rate, both done after twice a lone transfer."""
    l, b = 0.1, 8000.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b)
    tl, cost = timeline(env, MergePolicy(exchange="push", topology="complete"), 3, 4, events=[(1, 0, 1), (1, 0, 2)])
    first, second = lands(tl)
    tx = cost.sent / b
    assert first.landed == pytest.approx(1.0 + 2 * tx + l, abs=1e-12)
    assert second.landed == pytest.approx(1.0 + 2 * tx + l, abs=1e-12)


def test_a_transfer_that_starts_during_another_shares_the_rest_of_its_flight():
    """Worker 0 sends to 1 at 1 s (1.5 s alone) and to 2 at 2 s: the first has 0.5 s of bytes left at half the rate
    (done at 3 s), then the second, having had half the rate for 1 s, takes its last 1 s alone (done at 4 s).
    Two receivers share one downlink the same way; a pair's two directions share nothing (a link carries both ways
    at once: counted as one connection, a 2-rank push-pull gossip job under netlab came out +84% on the clock)."""
    b = 1000.0 / 1.5 * 4  # a 1000-parameter payload (4000 bytes) in 1.5 s
    env = EnvSpec(step_time=1.0, latency=0.0, bandwidth=b)
    push = MergePolicy(exchange="push", topology="complete")
    tl, cost = timeline(env, push, 3, 4, events=[(1, 0, 1), (2, 0, 2)])
    assert [a.landed for a in lands(tl)] == pytest.approx([3.0, 4.0], abs=1e-9)
    tl, _ = timeline(env, push, 3, 4, events=[(1, 1, 0), (2, 2, 0)])  # into one receiver
    assert [a.landed for a in lands(tl)] == pytest.approx([3.0, 4.0], abs=1e-9)
    tl, _ = timeline(env, push, 3, 4, events=[(1, 0, 1), (2, 1, 0)])  # both ways on one pair: each alone
    assert [a.landed for a in lands(tl)] == pytest.approx([2.5, 3.5], abs=1e-9)
    tl, _ = timeline(env, push, 4, 4, events=[(1, 0, 1), (2, 2, 3)])  # nothing shared
    assert [a.landed for a in lands(tl)] == pytest.approx([2.5, 3.5], abs=1e-9)


def test_fair_shares_fill_the_ends_progressively():
    # two from 0 share its uplink; 2 -> 3 has its ends to itself; 1 -> 0 and 0 -> 1 share nothing (both ways at once)
    assert clock.fair_shares([(0, 1), (0, 2), (2, 3)]) == pytest.approx([0.5, 0.5, 1.0])
    assert clock.fair_shares([(0, 1), (1, 0)]) == pytest.approx([1.0, 1.0])
    # 0 -> 1 and 2 -> 1 share 1's downlink; 2 -> 3 gets what 2's uplink has left: 0.5
    assert clock.fair_shares([(0, 1), (2, 1), (2, 3)]) == pytest.approx([0.5, 0.5, 0.5])
    # three into 3, two of them from 2: a third each at 3, and 2 -> 0 takes the rest of 2's uplink
    assert clock.fair_shares([(2, 3), (2, 3), (1, 3), (2, 0)]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1 / 3])
    # an equal share of the most crowded end, not max-min: 4 -> 1 gets half of 1's downlink, though 0 -> 1 (held to
    # a third at 0's uplink) leaves it two thirds
    assert clock.fair_shares([(0, 1), (0, 2), (0, 3), (4, 1)]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1 / 2])
    assert clock.fair_shares([]) == []


def test_an_allreduce_waits_for_the_slowest_then_pays_the_ring():
    l, b, W = 0.01, 40000.0, 4
    env = EnvSpec(step_time=1.0, speeds=(1.0, 1.0, 1.0, 0.5), latency=l, bandwidth=b)
    policy = MergePolicy(scheme="allreduce", mean_interval=1.0)
    tl, cost = timeline(env, policy, W, 2)
    first = [a for a in tl.actions[0] if a.kind == clock.ALLREDUCE][0]
    ring = 2 * (W - 1) * l + 2 * (W - 1) / W * cost.sent / b  # a weights payload: up and down the same size
    assert first.time == pytest.approx(2.0 + ring, abs=1e-12)  # worker 3 arrives at 2 s
    assert all([a for a in acts if a.kind == clock.ALLREDUCE][0].time == first.time for acts in tl.actions)
    # the second step starts when the all-reduce is done
    assert tl.completions[0][1] == pytest.approx(first.time + 1.0)
    assert tl.completions[3][1] == pytest.approx(first.time + 2.0)
    # worker 0 waited from 1 s until the all-reduce was done; the straggler only for the ring
    whole = tl.idle.sum(axis=0)
    assert whole[0] == pytest.approx((first.time - 1.0) + (tl.end - first.time - 1.0))
    assert whole[3] == pytest.approx(2 * ring)  # and the last all-reduce's, after step 2: the run ends after it
    assert tl.end == pytest.approx(tl.completions[3][1] + ring)


@pytest.mark.parametrize("delay", [0, 1], ids=["barrier", "streaming"])
def test_an_allreduce_that_never_takes_place_sends_nothing(delay):
    """(Each worker's share of an all-reduce was charged as it reached the barrier: one whose straggler never came
    before the budget ran out counted its bytes, with no merge.) Bytes are those of the all-reduces that ran."""
    W = 4
    env = EnvSpec(step_time=1.0, speeds=(1.0, 1.0, 1.0, 0.25), time_budget=19.5)
    policy = MergePolicy(scheme="allreduce", mean_interval=4.0, fragment_delay=delay,
                         **({"fragments": 1, "mixing_weight": 1.0, "outer_optimizer": "nesterov"} if delay else {}))
    tl, cost = timeline(env, policy, W, 1000)
    assert tl.end == pytest.approx(19.5)
    assert tl.merges[-1] == 1  # the straggler's 4th step ends at 16 s, its 8th would at 32 s
    assert tl.bytes[-1] == W * cost.allreduce(1, None if not delay else 0), tl.bytes


def test_blocking_pauses_the_initiator_until_its_payload_lands():
    l, b = 0.5, 4000.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b, overlap="blocking")
    tl, cost = timeline(env, MergePolicy(exchange="push"), 2, 3, events=[(1, 0, 1)])
    wait = l + cost.sent / b
    assert tl.completions[0][1] == pytest.approx(1.0 + wait + 1.0)
    assert tl.completions[1][1] == 2.0  # the receiver does not wait
    nonblocking, _ = timeline(EnvSpec(step_time=1.0, latency=l, bandwidth=b), MergePolicy(exchange="push"), 2, 3,
                              events=[(1, 0, 1)])
    assert nonblocking.completions[0][1] == 2.0


def test_push_pull_answers_when_the_peer_applies_the_request():
    l = 0.25
    env = EnvSpec(step_time=1.0, latency=l, overlap="blocking")
    tl, _ = timeline(env, MergePolicy(exchange="push_pull"), 2, 3, events=[(1, 0, 1)])
    (req,), (ans,) = lands(tl), lands(tl, clock.REPLY)
    assert req.landed == 1.0 + l and req.time == 2.0  # the peer was in a step: it answers at its end
    assert ans.sent == 2.0 and ans.landed == 2.0 + l and ans.worker == 0
    assert ans.time == ans.landed  # the initiator was paused, so it applies the answer at once
    assert tl.completions[0][1] == pytest.approx(2.0 + l + 1.0)


def test_merge_time_is_added_to_the_step_after_each_boundary_where_a_worker_merged():
    """A worker's own work at a merge (merge_time) delays its next step: the initiator's after its send, the
    receiver's after it applied the payload; a worker that took no part pays nothing."""
    m = 0.25
    env = EnvSpec(step_time=1.0, merge_time=m, latency=0.5)
    tl, _ = timeline(env, MergePolicy(exchange="push"), 3, 3, events=[(1, 0, 1)])
    assert tl.completions[0].tolist() == pytest.approx([1.0, 2.0 + m, 3.0 + m])  # sent at its 1st boundary
    assert tl.completions[1].tolist() == pytest.approx([1.0, 2.0, 3.0 + m])  # landed at 1.5 s: applied at its 2nd
    assert tl.completions[2].tolist() == pytest.approx([1.0, 2.0, 3.0])  # no part in it
    # landing as the receiver's step ends (no latency): applied at that boundary, and the step after it pays, once
    # for that boundary's merges (it was charged a boundary late, sharing the next merge's charge)
    env = EnvSpec(step_time=1.0, merge_time=m)
    tl, _ = timeline(env, MergePolicy(exchange="push"), 2, 4, events=[(1, 0, 1), (2, 1, 0)])
    assert tl.completions[1].tolist() == pytest.approx([1.0, 2.0 + m, 3.0 + 2 * m, 4.0 + 2 * m])
    # an all-reduce every 2 steps: every worker pays it after each average (the last one ends the run)
    ar = MergePolicy(scheme="allreduce", mean_interval=2.0)
    free, _ = timeline(EnvSpec(step_time=1.0), ar, 4, 6)
    paid, _ = timeline(env, ar, 4, 6)
    assert free.end == pytest.approx(6.0)
    assert paid.end == pytest.approx(6.0 + 3 * m)  # after steps 2 and 4, and the average after step 6 before the end
    assert all(c.tolist() == pytest.approx([1, 2, 3 + m, 4 + m, 5 + 2 * m, 6 + 2 * m]) for c in paid.completions)


def test_merge_time_charges_the_asynchronous_server_for_the_pushes_it_serves():
    """Asynchronous DiLoCo's server (worker 0) does the work of each push it serves at its step boundary, as rank 0
    of a Merger does: the step after that boundary pays merge_time (it was not charged, and ran as fast as a
    worker that serves nothing)."""
    m = 0.25
    policy = MergePolicy(scheme="async", mean_interval=2.0, mixing_weight=1.0, outer_optimizer="nesterov",
                         outer_lr=0.7, outer_momentum=0.9)
    env = EnvSpec(step_time=1.0, speeds=(1.0, 1.0 / 1.5), latency=0.01, step_budget="per_worker")
    free, _ = timeline(env, policy, 2, 6)
    paid, _ = timeline(dataclasses.replace(env, merge_time=m), policy, 2, 6)
    served = [a for a in paid.actions[1] if a.kind == clock.ASYNC]
    assert served, paid.actions
    # worker 0 pays at its own pushes before its last step's end, and at a boundary where it served worker 1's alone
    own = [a.boundary for a in paid.actions[0] if a.kind == clock.ASYNC and a.boundary < 6]
    extra = paid.completions[0][-1] - free.completions[0][-1]
    assert extra > m * len(own) + 1e-9 and extra / m == pytest.approx(round(extra / m)), (extra, own)


def test_one_straggler_slows_synchronous_allreduce_4x_but_not_nonblocking_gossip():
    W, T = 8, 60
    homo, straggler = EnvSpec(step_time=0.1), EnvSpec(step_time=0.1, slow_workers=(5,), slow_factor=4.0)
    ar = MergePolicy(scheme="allreduce", mean_interval=1.0)
    gossip = MergePolicy(mean_interval=3.0)
    t_ar = [timeline(env, ar, W, T)[0].end for env in (homo, straggler)]
    t_g = [timeline(env, gossip, W, T)[0].end for env in (homo, straggler)]
    assert t_ar[1] / t_ar[0] == pytest.approx(4.0, rel=0.02)
    assert t_g[1] / t_g[0] < 1.2
    # the step budget is the same work: W x T local steps
    tl, _ = timeline(straggler, gossip, W, T)
    assert sum(len(c) for c in tl.completions) >= W * T and len(tl.completions[5]) < T / 3


def test_a_homogeneous_free_cluster_is_the_lockstep_schedule():
    policy = MergePolicy(mean_interval=2.0)
    tl, _ = timeline(EnvSpec(step_time=0.5), policy, 6, 40, rounds=4)
    sched = schedule_mod.build(policy, 6, 40, 0)
    assert tl.end == pytest.approx(20.0) and all(len(c) == 40 for c in tl.completions)
    assert tl.steps_at.tolist() == [[10] * 6, [20] * 6, [30] * 6, [40] * 6]
    sends = sorted((a.event, a.worker, a.boundary) for acts in tl.actions for a in acts if a.kind == clock.SEND)
    assert sends == [(e, int(sched.initiator[e]), int(sched.step[e])) for e in range(len(sched))]
    assert all(a.boundary == sched.step[a.event] for acts in tl.actions for a in acts)  # applied after the same step
    assert tl.idle.sum() == 0 and all(tl.round_metrics(r)["staleness"] == 0 for r in range(4))


def test_same_seed_same_clock_and_the_seed_draws_it():
    env = EnvSpec(step_time=0.1, speeds="lognormal", sigma=0.5, jitter=0.2, straggle_p=0.05, latency=0.01,
                  bandwidth=1e6, overlap="blocking")
    policy = MergePolicy(mean_interval=3.0)
    a, b, c = (timeline(env, policy, 8, 50, rounds=3, seed=s)[0] for s in (1, 1, 2))
    assert a.end == b.end and a.actions == b.actions and all(np.array_equal(x, y) for x, y in zip(a.completions, b.completions))
    assert a.end != c.end


def test_speed_models():
    W = 400
    lognormal = clock.speed_factors(EnvSpec(speeds="lognormal", sigma=0.5), W, 0)
    assert np.std(np.log(lognormal)) == pytest.approx(0.5, rel=0.15)
    pareto = clock.speed_factors(EnvSpec(speeds="pareto", alpha=3.0), W, 0)
    assert pareto.min() >= 1.0 and np.mean(pareto) == pytest.approx(1.5, rel=0.2)  # 1 + Pareto(3): mean 1 + 1/2
    listed = clock.speed_factors(EnvSpec(speeds=(1.0, 2.0, 0.5), slow_workers=(0,), slow_factor=3.0), 3, 0)
    assert listed.tolist() == [3.0, 0.5, 2.0]


def test_slow_spells_stretch_some_steps():
    env = EnvSpec(step_time=1.0, straggle_p=0.1, straggle_factor=5.0, straggle_length=4.0)
    c = clock.Compute(env, 1, 0)
    d = np.array([c.duration(0, k) for k in range(1, 2001)])
    assert set(np.unique(d)) == {1.0, 5.0}
    slow = d == 5.0
    assert 0.1 < slow.mean() < 0.45  # stationary share 0.1 / (0.1 + 0.25) ~ 0.29
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, slow.astype(int), 0])))[::2]
    assert np.mean(runs) == pytest.approx(4.0, rel=0.3)


def test_sites_make_slow_links_between_them():
    env = EnvSpec(latency=0.001, bandwidth=1e9, sites=2, latency_inter=0.02, bandwidth_inter=1e7)
    net = clock.Network(env, 6)
    assert net.sites.tolist() == [0, 0, 0, 1, 1, 1]
    assert net.latency[0, 1] == 0.001 and net.latency[0, 4] == 0.02 and net.bandwidth[4, 0] == 1e7
    m = EnvSpec(latency_matrix=((0, 1), (2, 0)), bandwidth_matrix=((0, 5), (0, 0)))
    net = clock.Network(m, 2)
    assert net.latency[1, 0] == 2 and net.bandwidth[0, 1] == 5 and net.bandwidth[1, 0] == np.inf


@pytest.mark.parametrize("payload", ["delta", "gradient"])
def test_a_sign_compressed_allreduce_pays_its_signs_up_and_the_average_down(payload):
    """allreduce-sign (a delta all-reduce of scaled signs every step), or every step's gradient as scaled signs: 1000
    parameters go up as 1000 bits and one float32 scale (129 bytes), and the dense average (4000 bytes) comes back,
    through the ring after the barrier at the slowest worker."""
    l, b, W = 0.01, 40000.0, 4
    env = EnvSpec(step_time=1.0, speeds=(1.0, 1.0, 1.0, 0.5), latency=l, bandwidth=b)
    policy = MergePolicy(scheme="allreduce", mean_interval=1.0, payload=payload, quantize_bits=1)
    tl, cost = timeline(env, policy, W, 2)
    assert (cost.sent, cost.dense) == (129, 4000)
    first = [a for a in tl.actions[0] if a.kind == clock.ALLREDUCE][0]
    assert first.time == pytest.approx(2.0 + 2 * (W - 1) * l + (W - 1) / W * (129 + 4000) / b, abs=1e-12)
    assert cost.allreduce(W) == W * (129 + 4000)  # the bytes charged: each worker's signs up, the average down
    assert tl.bytes[0] >= W * (129 + 4000)


def test_backup_workers_leave_the_late_ones_out_of_the_allreduce():
    """Worker 3 is 4x slower. All-reduce every step: without backups every step waits 4 s for it; with one backup
    worker the barrier opens when the first three arrive (1 s a step), and worker 3's step is dropped each time
    (it counts as done at the barrier and takes the average). On a homogeneous cluster nobody is late."""
    env = EnvSpec(step_time=1.0, speeds=(1.0, 1.0, 1.0, 0.25))
    sync = MergePolicy(scheme="allreduce", mean_interval=1.0, mixing_weight=1.0)
    tl, _ = timeline(env, sync, 4, 3)
    assert [a.time for a in tl.actions[0]] == [4.0, 8.0, 12.0] and tl.dropped == {}
    tl, _ = timeline(env, sync.replace(backup_workers=1), 4, 3)
    assert all([(a.boundary, a.time) for a in acts] == [(1, 1.0), (2, 2.0), (3, 3.0)] for acts in tl.actions)
    assert tl.dropped == {0: (3,), 1: (3,), 2: (3,)}
    assert list(tl.completions[3]) == [1.0, 2.0, 3.0]  # its dropped steps end at the barriers
    same = EnvSpec(step_time=1.0)
    a, _ = timeline(same, sync, 4, 3)
    b, _ = timeline(same, sync.replace(backup_workers=2), 4, 3)
    assert b.dropped == {} and [[x.time for x in acts] for acts in a.actions] == [[x.time for x in acts] for acts in b.actions]
    with pytest.raises(ConfigError, match="policy.backup_workers: 4 with 4 workers; allowed: 0..3"):
        timeline(env, sync.replace(backup_workers=4), 4, 3)


def test_a_swap_sends_two_models_and_its_initiator_waits_for_the_other():
    """Worker 0 sends its model at 1 s (4000 bytes: 0.25 s at 16 kB/s, plus 0.3 s latency); worker 1 is in its
    second step when it lands, so it takes it at 2 s and sends its own back, which lands at 2.55 s. Worker 0 has
    given its model away: it waits from 1 s to 2.55 s. The swap costs two models, 8000 bytes."""
    l, b = 0.3, 16000.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b)
    tl, cost = timeline(env, MergePolicy(exchange="push", swap_p=1.0), 2, 4, events=[(1, 0, 1)])
    assert tl.swaps == {0} and cost.swap() == 2 * 4000
    (req,), (ans,) = lands(tl), lands(tl, clock.REPLY)
    assert req.landed == pytest.approx(1.0 + l + 0.25) and (req.worker, req.time) == (1, 2.0)
    assert ans.sent == 2.0 and ans.landed == pytest.approx(2.0 + l + 0.25) and ans.worker == 0
    assert ans.time == ans.landed  # worker 0 was waiting: it takes the other model at once
    assert tl.completions[0][1] == pytest.approx(2.55 + 1.0)
    assert tl.idle[0, 0] == pytest.approx(1.55) and tl.idle[0, 1] == 0.0
    assert tl.bytes[-1] == 8000
    # the same event without a swap: one payload, and nobody waits
    plain, _ = timeline(env, MergePolicy(exchange="push"), 2, 4, events=[(1, 0, 1)])
    assert plain.swaps == frozenset() and plain.bytes[-1] == 4000 and plain.completions[0][1] == 2.0


def test_examples_that_travel_ride_with_the_payload_and_are_charged_their_bytes():
    """data_exchange_k = 10 examples of 785 bytes (784 pixels and a label) go with the initiator's 4000-byte payload:
    11850 bytes, landing latency + 11850 / bandwidth after the send; a push-pull answer carries no examples."""
    l, b = 0.1, 23700.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b)
    tl, cost = timeline(env, MergePolicy(exchange="push_pull", data_exchange_k=10), 2, 4, events=[(1, 0, 1)],
                        example_bytes=785)
    assert cost.data == 7850
    (req,), (ans,) = lands(tl), lands(tl, clock.REPLY)
    assert req.landed == pytest.approx(1.0 + l + 0.5)
    assert ans.landed == pytest.approx(2.0 + l + 4000 / b)
    assert tl.bytes[-1] == 2 * 4000 + 7850
    # a swap carries them too: its initiator's model and the examples, then the peer's model back
    tl, _ = timeline(env, MergePolicy(exchange="push", data_exchange_k=10, swap_p=1.0), 2, 4, events=[(1, 0, 1)],
                     example_bytes=785)
    (req,), (ans,) = lands(tl), lands(tl, clock.REPLY)
    assert req.landed == pytest.approx(1.0 + l + 0.5) and ans.landed == pytest.approx(2.0 + l + 4000 / b)
    assert tl.bytes[-1] == 2 * 4000 + 7850


def test_a_peer_drawn_by_similarity_waits_for_the_others_sketches():
    """similarity_bias on 3 workers: at its boundary the initiator takes the other two workers' sketches (4096 bytes
    each: 0.1 s latency, then one after the other through its downlink at 40960 B/s, 0.2 s); its payload, taken at
    1 s, leaves at 1.3 s and lands 0.1 + 4000 / 40960 s later. The bytes: the payload and the two sketches."""
    l, b = 0.1, 40960.0
    env = EnvSpec(step_time=1.0, latency=l, bandwidth=b)
    policy = MergePolicy(exchange="push", topology="complete", similarity_bias=0.5)
    tl, cost = timeline(env, policy, 3, 4, events=[(1, 0, 1)], similarity_bytes=4096)
    assert cost.gather(3) == 2 * 4096 and cost.regroup(3) == 2 * (4096 + 24)
    (a,) = lands(tl)
    assert a.sent == 1.0 and a.landed == pytest.approx(1.0 + l + 2 * 4096 / b + l + 4000 / b, abs=1e-12)
    assert tl.bytes[-1] == 4000 + 2 * 4096
    # free links: no wait (the lockstep world)
    free, _ = timeline(EnvSpec(step_time=1.0), policy, 3, 4, events=[(1, 0, 1)], similarity_bytes=4096)
    assert lands(free)[0].landed == 1.0 and free.bytes[-1] == 4000 + 2 * 4096


def test_slowmo_s_exact_average_is_a_barrier_over_the_gossip():
    """SlowMo every 2 steps on 2 workers, worker 1 twice as slow, no gossip event: both wait for worker 1 at step 2
    (4 s), then the ring (2 latencies, half of the 4000 bytes up and the 4000 down over the link); counted as one
    merge of 2 x 8000 bytes."""
    l, b = 0.05, 16000.0
    env = EnvSpec(step_time=1.0, speeds=(1.0, 0.5), latency=l, bandwidth=b, time_budget=12.0)
    policy = MergePolicy(outer_optimizer="sgd", outer_every=2, mean_interval=100.0)
    tl, cost = timeline(env, policy, 2, 4, events=[])
    ring = 2 * l + 0.5 * (4000 + 4000) / b
    (first, second) = [a for a in tl.actions[0] if a.kind == clock.ALLREDUCE]
    assert first.boundary == 2 and first.time == pytest.approx(4.0 + ring)
    assert [a.time for a in tl.actions[1] if a.kind == clock.ALLREDUCE] == [first.time, second.time]
    assert second.time == pytest.approx(first.time + 4.0 + ring)
    assert tl.merges[-1] == 2 and tl.bytes[-1] == 2 * cost.allreduce(2) == 2 * 2 * 8000


def test_a_run_ends_when_its_merges_in_flight_are_applied_and_sends_no_more_than_its_links_carry():
    """(The clock dropped the transfers in flight when the work was done: push-pull gossip every step on slow links
    sent many times what its links carry in the run's time, none of it landed, and the run looked as fast as no
    merging. Merger.finish() waits for every merge due and applies it.) The run now ends when the last merge in flight
    is applied, each worker idle from the work's end, so every byte it sent crossed an uplink within its time."""
    W, T, b = 4, 40, 4000.0  # a payload (4000 bytes) takes 1 s alone; a step 0.01 s
    env = EnvSpec(step_time=0.01, bandwidth=b)
    policy = MergePolicy(exchange="push_pull", topology="complete", mean_interval=1.0)
    tl, cost = timeline(env, policy, W, T)
    work = max(c[-1] for c in tl.completions)
    assert work == pytest.approx(T * 0.01) and tl.round_ends[-1] == tl.end
    assert tl.end >= tl.bytes[-1] / (W * b) > 10 * work  # every byte through one of W uplinks in the run's time
    # every request sent was applied, and every answer to it
    applied = {(a.event, a.kind) for acts in tl.actions for a in acts if a.kind in (clock.LAND, clock.REPLY)}
    sent = {a.event for acts in tl.actions for a in acts if a.kind == clock.SEND}
    assert applied == {(e, k) for e in sent for k in (clock.LAND, clock.REPLY)}
    assert tl.end == max(a.time for acts in tl.actions for a in acts)
    assert tl.idle[-1].sum() == pytest.approx(W * tl.end - sum(len(c) for c in tl.completions) * 0.01, rel=1e-9)


@pytest.mark.parametrize("policy, env, W, T", [
    # asynchronous DiLoCo on slow links: the last global models come back after the last push is served
    (MergePolicy(scheme="async", mean_interval=2.0, mixing_weight=1.0, outer_optimizer="nesterov"),
     EnvSpec(step_time=0.1, speeds=(1.0, 1.0, 1.0, 0.2), bandwidth=4000.0, latency=0.01), 4, 12),
    # backup workers: the work done as a backup barrier opens
    (MergePolicy(scheme="allreduce", mean_interval=4.0, mixing_weight=1.0, backup_workers=1),
     EnvSpec(step_time=1.0, speeds=(1.0, 1.0, 1 / 3.5), bandwidth=4000.0, latency=0.1), 3, 3),
    (MergePolicy(scheme="allreduce", mean_interval=6.0, mixing_weight=1.0, fragments=2, fragment_delay=2),
     EnvSpec(step_time=0.1, speeds=(1.0, 0.5, 1.0, 1.0), bandwidth=2000.0), 4, 12),
    (MergePolicy(exchange="push_pull", topology="complete", mean_interval=1.5),
     EnvSpec(step_time=0.1, speeds="lognormal", sigma=0.5, jitter=0.2, bandwidth=8000.0, overlap="blocking"), 4, 12),
], ids=["async", "backups", "streaming", "push-pull-blocking"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_drained_end_holds_everything_the_run_did(policy, env, W, T, seed):
    """(The drained end left out the global models pulled back after the last push was served, and a streamed
    fragment's ring still running; a worker whose step was dropped as a backup barrier opened had its wait counted
    twice and one step start too few.) Every span a worker waited or sent ends by the run's end, each completed step
    has its start, and no round holds more waiting than its length."""
    tl, _ = timeline(env, policy, W, T, rounds=2 if T > 3 else 1, seed=seed)
    for w in range(W):
        assert all(b <= tl.end + 1e-9 for _, b in tl.idle_spans[w] + tl.send_spans[w]), (w, tl.end)
        assert len(tl.step_starts[w]) == len(tl.completions[w]), w
    lengths = np.diff([0.0, *tl.round_ends])
    assert (tl.idle <= lengths[:, None] + 1e-9).all(), (tl.idle, lengths)
    assert tl.round_ends[-1] == tl.end


@pytest.mark.parametrize("policy", [
    MergePolicy(mean_interval=3.0),  # gossip: each worker at its own pace
    MergePolicy(exchange="push_pull", topology="complete", mean_interval=2.0),
    MergePolicy(scheme="async", mean_interval=2.0, mixing_weight=1.0, outer_optimizer="nesterov"),
    MergePolicy(scheme="allreduce", mean_interval=5.0, mixing_weight=1.0, fragments=2, fragment_delay=2),
    MergePolicy(scheme="allreduce", mean_interval=7.0),  # T not a multiple: the last 5 steps each at its pace
], ids=["gossip", "push-pull", "async", "streaming", "allreduce"])
def test_a_per_worker_step_budget_gives_every_worker_its_own_steps_and_ends_with_the_slowest(policy):
    """``step_budget = "per_worker"`` (a real job's ranks, each taking total_steps): a straggler 4x slower takes
    as many steps as the others, who idle after theirs, their merges still landing; the run ends when the slowest
    is done and what it sent has landed. The shared budget (the same W x T of work) lets the fast workers do the
    straggler's share."""
    W, T = 4, 40
    env = EnvSpec(step_time=0.01, slow_workers=(2,), slow_factor=4.0, bandwidth=40_000.0)
    tl, _ = timeline(dataclasses.replace(env, step_budget="per_worker"), policy, W, T, rounds=2)
    assert [len(c) for c in tl.completions] == [T] * W
    slowest = tl.completions[2][-1]
    assert slowest >= T * 0.04 and tl.end >= slowest and tl.round_ends[-1] == tl.end
    for w in range(W):
        assert all(b <= tl.end + 1e-9 for _, b in tl.idle_spans[w] + tl.send_spans[w]), w
    # every payload a worker sent landed (the fast ones idle, taking them at their last boundary)
    if policy.scheme == "gossip":
        sent = {a.event for acts in tl.actions for a in acts if a.kind == clock.SEND}
        assert sent and sent <= {a.event for acts in tl.actions for a in acts if a.kind == clock.LAND}
    shared, _ = timeline(env, policy, W, T, rounds=2)
    if policy.scheme == "gossip":  # the fast workers took the straggler's share
        assert len(shared.completions[2]) < T < len(shared.completions[0])
