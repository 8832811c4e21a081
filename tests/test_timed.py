"""Runs on a simulated cluster ([environment]): the lockstep world kept exactly, staleness, determinism,
the time objectives, and what a user sees from the command."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, tiny_study
from evomerge import simulate
from evomerge import study as study_mod
from evomerge.backends.inprocess import InProcess
from evomerge.engine.timed import Timed
from evomerge.policy import MergePolicy
from evomerge.study import EnvSpec

P = MergePolicy
TIME_FIELDS = ("sim_time", "steps_min", "steps_mean", "steps_max", "idle_fraction", "staleness", "time_to_target",
               "accuracy_at_time", "loss_at_time", "perplexity_at_time", "wall_time")
GOSSIP = {
    "push-pull-winner-examples": P(exchange="push_pull", winner_bias=0.5, weighting="examples", mean_interval=2.0),
    "push-delta-adaptive-random": P(exchange="push", payload="delta", topk_fraction=0.2, quantize_bits=4,
                                    weighting="adaptive", lerp="random", topology="complete", mean_interval=1.5),
    # swaps and data that travels (issue 24 part 1): a swap is two model-sized transfers, the examples ride with
    # the initiator's payload
    "swaps-delta-adaptive": P(topology="complete", swap_p=0.5, weighting="adaptive", payload="delta",
                              topk_fraction=0.5, mean_interval=1.5),
    "swaps-recency-push-pull-winner": P(topology="ring", swap_p=0.9, swap_recency=5.0, mean_interval=1.2,
                                        winner_bias=0.5, exchange="push_pull"),
    "data-travels-retires": P(topology="complete", data_exchange_k=4, retire_threshold=0.9, reserve_rate=0.3,
                              mean_interval=1.5),
    "data-unseen-first-swaps-examples": P(topology="complete", data_exchange_k=6, data_unseen_first=True, swap_p=0.4,
                                          weighting="examples", mean_interval=1.5),
    # decided with the state at the event: the clock runs beside the replay (waves), or the lockstep path
    "similarity-bias-sketch-push-pull": P(topology="complete", similarity_bias=0.8, mean_interval=1.5, winner_bias=0.3,
                                          exchange="push_pull"),
    "regroup-cka-converging": P(topology="communities", n_communities=2, similarity="cka", regroup_every=1,
                                similarity_bias=-0.5, p_intra=0.9, p_intra_final=0.1, p_intra_schedule="cosine",
                                mean_interval=2),
    "slowmo-push-pull": P(topology="ring", exchange="push_pull", mean_interval=2.0, outer_optimizer="nesterov",
                          outer_lr=0.7, outer_momentum=0.9, outer_every=6),
    "data-by-similarity-swaps-by-confidence": P(topology="complete", data_exchange_k=6, data_similarity_sign=-0.7,
                                                swap_p=0.6, swap_confidence=-0.8, swap_recency=10.0,
                                                mean_interval=1.5),
    # decided from what the workers publish every few steps (publish_every): the replay catches up at publications
    "similarity-bias-published": P(topology="complete", similarity_bias=0.8, mean_interval=1.5, winner_bias=0.3,
                                   exchange="push_pull", publish_every=3),
    "cka-published-data-by-similarity-swaps-by-confidence": P(
        topology="complete", similarity="cka", similarity_bias=-0.6, data_exchange_k=6, data_similarity_sign=0.7,
        swap_p=0.6, swap_confidence=0.8, mean_interval=1.5, publish_every=4),
}


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=5, rounds=3, steps=40), data=mnist)


def with_env(setup, env, target=None):
    return dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env, target=target))


def lockstep_part(res):
    return [{k: v for k, v in dataclasses.asdict(h).items() if k not in TIME_FIELDS} for h in res.history]


@pytest.mark.parametrize("name", ["no-merging", "fedavg", "allreduce", "allreduce-backup", "ring-gossip", *GOSSIP])
def test_a_homogeneous_free_cluster_gives_the_lockstep_results_bit_for_bit(setup, name):
    policy = GOSSIP.get(name) or setup.study.resolve_policy(name)
    lockstep = simulate.simulate(setup, policy, 7, device="cpu", keep_params=True)
    timed = simulate.simulate(with_env(setup, EnvSpec(step_time=0.25)), policy, 7, device="cpu", keep_params=True)
    assert lockstep_part(timed) == lockstep_part(lockstep)
    assert torch.equal(timed.params, lockstep.params)
    # the same one wave at a time (the replay any cluster takes; a free one takes the lockstep run's path)
    waves = simulate.simulate(with_env(setup, EnvSpec(step_time=0.25)), policy, 7, device="cpu", keep_params=True,
                              waves=True)
    assert lockstep_part(waves) == lockstep_part(lockstep) and torch.equal(waves.params, lockstep.params)
    assert timed.final.sim_time == pytest.approx(40 * 0.25) and timed.final.idle_fraction == 0
    assert timed.final.steps_min == timed.final.steps_max == 40 and timed.final.staleness == 0
    assert lockstep.final.sim_time is None and "sim_time" not in lockstep.metrics()


def test_backup_workers_average_without_the_late_ones(setup):
    """The late workers' rows are left out of the average, and every row takes it; on a cluster with one worker
    4x slower, one backup worker makes the same steps take a third of the time or less."""
    policy = P(scheme="allreduce", mean_interval=1.0, mixing_weight=1.0, backup_workers=1)
    backend = InProcess(setup, policy, 0, torch.device("cpu"))
    st = backend.state
    rows = [st.params.row(w) + w for w in range(5)]
    for w, r in enumerate(rows):
        st.params.set_row(w, r)
    backend.allreduce(0, 1, 1.0, dropped=(4,))
    for w in range(5):
        torch.testing.assert_close(st.params.row(w), torch.stack(rows[:4]).mean(0))
    slow = with_env(setup, EnvSpec(step_time=0.1, speeds=(1.0, 1.0, 1.0, 1.0, 0.25)))
    sync = simulate.simulate(slow, policy.replace(backup_workers=0), 0, device="cpu")
    backup = simulate.simulate(slow, policy, 0, device="cpu")
    assert backup.final.sim_time <= sync.final.sim_time / 3
    assert [h.steps_min for h in backup.history] == [h.steps_max for h in backup.history]  # dropped steps count


def test_the_applied_payload_is_the_senders_state_when_it_was_sent(setup):
    policy = P(exchange="push", mixing_weight=1.0)  # the receiver takes the incoming model whole
    backend = InProcess(setup, policy, 0, torch.device("cpu"))
    st = backend.state
    st.params.set_row(0, torch.randn(st.P, generator=torch.Generator().manual_seed(1)))
    payload = backend.snapshot(0, 0, 0)
    at_send = st.params.row(0)
    st.params.set_row(0, at_send + 1.0)  # the sender moves on before the payload lands
    backend.land(0, 1, payload, 1.0, 0.5, initiator=0)
    assert torch.equal(st.params.row(1), at_send) and not torch.equal(st.params.row(1), st.params.row(0))


def test_latency_makes_payloads_stale_and_changes_the_run(setup):
    policy = P(exchange="push", mean_interval=2.0)
    free = simulate.simulate(with_env(setup, EnvSpec(step_time=0.1)), policy, 0, keep_params=True)
    slow = simulate.simulate(with_env(setup, EnvSpec(step_time=0.1, latency=0.35)), policy, 0, keep_params=True)
    assert free.final.staleness == 0
    # sent at a step's end, landed 0.35 s later, applied at the receiver's next step end: 0.4 s old; those in flight
    # when the work is done land on idle workers at the run's end, 0.35 s old
    assert all(h.staleness == pytest.approx(0.4) for h in slow.history[:-1])
    assert 0.35 <= slow.final.staleness < 0.4 and slow.final.sim_time == pytest.approx(free.final.sim_time + 0.35)
    assert not torch.equal(free.params, slow.params)
    assert slow.final.merges == free.final.merges  # the same events, applied later


def test_same_seed_same_times_and_results_on_an_uneven_cluster(setup):
    env = EnvSpec(step_time=0.1, speeds="lognormal", sigma=0.5, jitter=0.1, latency=0.02, bandwidth=2e6,
                  overlap="blocking", time_budget=3.0)
    s = with_env(setup, env, target=0.5)
    policy = P(exchange="push_pull", winner_bias=0.3, mean_interval=3.0)
    a, b = (simulate.simulate(s, policy, 3, keep_params=True) for _ in range(2))
    assert [dataclasses.asdict(h) | {"wall_time": 0} for h in a.history] == \
           [dataclasses.asdict(h) | {"wall_time": 0} for h in b.history]
    assert torch.equal(a.params, b.params)
    f = a.final
    assert f.sim_time == pytest.approx(3.0) and f.steps_min < f.steps_max and 0 < f.idle_fraction < 1
    assert [h.sim_time for h in a.history] == pytest.approx([1.0, 2.0, 3.0])
    assert f.accuracy_at_time == f.val_accuracy


def test_time_to_target_interpolates_and_ranks_a_miss_after_every_hit(setup):
    env = EnvSpec(step_time=0.1, time_budget=4.0)
    res = simulate.simulate(with_env(setup, env, target=0.3), P(), 0)
    acc = [h.val_accuracy for h in res.history]
    t = [h.sim_time for h in res.history]
    k = next(i for i, a in enumerate(acc) if a >= 0.3)
    want = t[0] if k == 0 else t[k - 1] + (0.3 - acc[k - 1]) / (acc[k] - acc[k - 1]) * (t[k] - t[k - 1])
    assert res.final.time_to_target == pytest.approx(want) and res.final.time_to_target <= 4.0
    missed = simulate.simulate(with_env(setup, env, target=0.999), P(), 0)
    best = max(h.val_accuracy for h in missed.history)
    assert missed.final.time_to_target == pytest.approx(4.0 * (2 - best / 0.999)) and missed.final.time_to_target > 4.0


def test_a_run_that_diverges_after_reaching_the_target_gets_the_worst_time(setup):
    env = EnvSpec(step_time=0.1, time_budget=4.0)
    s = with_env(setup, env, target=0.0)  # reached at the first round
    s = dataclasses.replace(s, study=dataclasses.replace(s.study, run=dataclasses.replace(s.study.run, lr=1e6)))
    res = simulate.simulate(s, P(), 0)
    assert res.status == "diverged" and res.final.time_to_target == 8.0


def test_examples_in_transit_are_nobodys_until_their_payload_lands_and_swaps_wait(setup):
    """On slow links with uneven speeds: at every round's end, exactly the examples of the payloads sent and not yet
    landed are in transit (k per payload: the receiver cannot draw them before it takes the payload), every other
    example is held by one worker, the bytes are the clock's, and the swaps' initiators waited for the other model."""
    from evomerge.engine import clock, datapool, run as run_mod
    from evomerge.engine.timed import build_timeline

    env = EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.5, latency=0.05, bandwidth=4e6)
    policy = P(topology="complete", swap_p=0.3, data_exchange_k=8, mean_interval=2.0)
    s = with_env(setup, env)
    backend = InProcess(s, policy, 3, torch.device("cpu"))
    tl = build_timeline(s, policy, 3, len(backend.state.optim.stacks()))
    sends = {a.event: a.time for acts in tl.actions for a in acts if a.kind == clock.SEND}
    landed = {a.event: a.time for acts in tl.actions for a in acts if a.kind == clock.LAND}
    pool, seen = backend.pool, []

    def check(rm):
        t = tl.round_ends[rm.round - 1]
        flying = sum(1 for e, sent in sends.items() if sent <= t and landed.get(e, np.inf) > t)
        transit = int((pool.holder == datapool.IN_TRANSIT).sum())
        held = sum(len(h) for h in pool.holdings())
        seen.append((flying, transit))
        assert transit == 8 * flying and held + transit == len(np.flatnonzero(pool.holder != -1))

    res = run_mod.execute(s, policy, 3, backend, callback=check)
    assert res.status == "ok" and len(seen) == 3 and sum(f for f, _ in seen) > 0  # some were in flight at an end
    assert res.final.bytes == tl.bytes[-1] and res.final.examples_moved == pool.moved > 0
    assert tl.swaps and all(tl.idle[:, int(tl.schedule.initiator[e])].sum() > 0 for e in tl.swaps)


def test_a_model_given_away_in_a_swap_is_in_one_place_only(setup):
    """Slow links, many swaps: a worker waiting for the other model takes no payload meanwhile (a merge lands just
    after the other model; a swap reaching it is cancelled, its sender's model going back), so no model is ever in two
    places: at the end every model is at one worker, but for the swaps still in flight (their initiator's row is the
    model it gave away)."""
    from evomerge.engine import clock
    from evomerge.engine.judge import Judge

    env = EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.4, latency=0.2, bandwidth=4e6)
    policy = P(topology="complete", swap_p=0.9, mean_interval=1.5)
    s = with_env(setup, env)
    backend = InProcess(s, policy, 2, torch.device("cpu"))
    backend.start(Judge(s, policy, 2, torch.device("cpu"), backend.train_x, 0.0))
    driver = Timed(s, policy, 2, backend, waves=True)
    for r in range(driver.rounds):
        driver.train_round(r)
    tl = driver.timeline
    sent = {a.event for acts in tl.actions for a in acts if a.kind == clock.SEND and a.event in tl.swaps}
    back = {a.event for acts in tl.actions for a in acts if a.kind == clock.REPLY}
    flying = len(sent - back)
    assert len(sent) > 20 and tl.cancelled  # many swaps, and some met a worker that had given its model away
    assert len(set(backend.state.model_at.tolist())) >= 5 - flying


def test_a_push_run_deciding_with_the_state_keeps_no_answer_and_moves_p_intra_over_the_run(setup):
    """Push gossip (no answers): the replay keeps only the payloads still in flight; regrouped communities whose
    p_intra moves reach its final value at the run's last step, not at the end of the longer schedule the clock
    draws for an uneven cluster."""
    from evomerge.engine import clock
    from evomerge.engine.judge import Judge
    from evomerge.engine.topology import Communities

    env = EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.5, latency=0.03, bandwidth=4e6)
    policy = P(topology="communities", n_communities=2, regroup_every=1, p_intra=1.0, p_intra_final=0.0,
               p_intra_schedule="linear", similarity_bias=0.5, exchange="push", payload="delta", mean_interval=2.0)
    s = with_env(setup, env)
    backend = InProcess(s, policy, 4, torch.device("cpu"))
    backend.start(Judge(s, policy, 4, torch.device("cpu"), backend.train_x, 0.0))
    driver = Timed(s, policy, 4, backend)
    for r in range(driver.rounds):
        driver.train_round(r)
        backend.end_round(r)
    tl = driver.timeline
    landed = {a.event for acts in tl.actions for a in acts if a.kind == clock.LAND}
    assert len(driver.snaps) <= sum(1 for acts in tl.actions for a in acts if a.kind == clock.SEND) - len(landed)
    # every action the clock recorded was applied: a landing due at a step the work's end dropped too (the clock
    # moved it to the boundary before after the replay had taken it in, and it was never applied)
    assert driver.ptr == [len(acts) for acts in tl.actions], (driver.ptr, [len(acts) for acts in tl.actions])
    assert all(kind == clock.LAND for _, kind in driver.snaps)
    T = s.total_steps
    assert backend.sched.total_steps > T
    want = Communities(5, 2, 1.0, groups=backend.groups, p_intra_final=0.0, schedule="linear").probabilities(1.0)
    assert np.allclose(backend._peer_p(T), want)


class Watched(Timed):
    """The replay as the clock finds it at each decision it asks for: every worker's steps and actions done."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked = []

    def peer(self, e, w, k, t):
        j = super().peer(e, w, k, t)
        self.asked.append((t, self.done.copy(), list(self.ptr)))
        b = self.backend  # the sketches kept per row are every row's now (after steps, merges, exact averages)
        assert torch.allclose(b._sketches, b.sim.sketcher(b.state.params.blocks), atol=1e-5)
        return j


def test_a_decision_with_the_state_sees_every_step_and_action_before_its_instant_and_none_after(setup):
    """On an uneven cluster with slow links, a similarity-drawn peer is decided by the clock at the initiator's
    boundary: the replay has done then exactly the steps that ended by that instant and the actions before it."""
    env = EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.5, latency=0.03, bandwidth=4e6)
    policy = P(topology="complete", similarity_bias=0.8, mean_interval=2.0, exchange="push_pull",
               outer_optimizer="sgd", outer_every=7)  # with SlowMo's exact averages among the events
    s = with_env(setup, env)
    from evomerge.engine.judge import Judge

    backend = InProcess(s, policy, 1, torch.device("cpu"))
    backend.start(Judge(s, policy, 1, torch.device("cpu"), backend.train_x, 0.0))  # its similarity
    driver = Watched(s, policy, 1, backend)
    assert driver.live is not None and driver.merger is None
    for r in range(driver.rounds):
        driver.train_round(r)
    tl = driver.timeline
    assert len(driver.asked) > 20
    moved = 0
    for t, done, ptr in driver.asked:
        for w in range(5):
            ends = np.asarray(driver.live.completions[w])
            assert done[w] == int((ends <= t).sum())
            assert ptr[w] == sum(1 for a in tl.actions[w] if a.time < t)
        moved += int(np.ptp(done) > 0)
    assert moved > 10  # the workers were at different steps when asked: not the lockstep world
    assert not np.array_equal(tl.peers, tl.schedule.peer)  # peers drawn from the state, not the schedule's


# -- the command -----------------------------------------------------------------------------------
TIMED_STUDY = """
[study]
name = "tiny-timed"
[data]
dataset = "mnist"
val_size = 500
train_size = 2000
[model]
name = "mlp"
hidden = [16]
[run]
workers = 4
batch_size = 16
steps = 30
rounds = 3
score_samples = 8
[environment]
{env}
[search]
n_trials = 3
[search.space]
mean_interval = {{ kind = "log-float", low = 1.0, high = 30.0 }}
scheme = {{ kind = "categorical", choices = ["gossip", "allreduce"] }}
[objectives]
metrics = ["time_to_target"]
target = 0.5
[baselines]
policies = ["no-merging", "allreduce", "ring-gossip"]
"""


def cli(*args, cwd, data_dir, process=False):
    """The command in this process (``cli.main``, as the other tests' commands that get no signal), or with
    ``process`` in a process of its own with a bare environment (a home of its own, no MLflow variables)."""
    if not process:
        from searchutil import cli as in_process

        return in_process(*args, cwd=cwd, data_dir=data_dir)
    env = {"EVOMERGE_DATA_DIR": str(data_dir), "PATH": "/usr/bin:/bin", "HOME": str(cwd), "EVOMERGE_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "evomerge.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=900)


ENV = {"step_time": "0.05", "speeds": "[1.0, 1.0, 1.0, 0.25]", "latency": "0.001", "bandwidth": "1e7", "time_budget": "2.0"}


def write(tmp_path, name="tiny-timed", **changes):
    f = tmp_path / f"{name}.toml"
    env = {k: v for k, v in (ENV | changes).items() if v is not None}  # None: the key left out
    f.write_text(TIMED_STUDY.format(env="\n".join(f"{k} = {v}" for k, v in env.items())))
    return f


def test_baselines_whose_step_sizes_tie_are_said_tied_not_tuned_to_the_grids_lowest(tmp_path, data_dir):
    """(A new user's rivals all reached the target at the first evaluation: each "best" step size was the grid's
    first of a tie, and the note said "at the grid's lowest (0.05); a wider grid may find a better one".) A target
    every run reaches at its first evaluation: the ties are said, and no end of the grid."""
    f = write(tmp_path)
    f.write_text(f.read_text().replace("target = 0.5", "target = 0.02").replace(
        'policies = ["no-merging", "allreduce", "ring-gossip"]', 'policies = ["allreduce"]\nlr = [0.05, 0.1]'))
    p = cli("baselines", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    (note,) = [ln for ln in p.stderr.splitlines() if "tied" in ln]
    assert note.startswith("note: allreduce tied at lr 0.05, 0.1 on time_to_target (the first of them taken): the "
                           "step size was not told apart, as where the target is reached at the first evaluation"), note
    assert "at an end of" not in p.stderr, p.stderr
    from evomerge.search.baselines import edge_note

    s = study_mod.load(f)  # an end of the grid, where no tie: as before
    assert edge_note(s, {"allreduce": 0.05}).startswith("best step size at an end of [baselines] lr [0.05, 0.1]: "
                                                        "allreduce at the grid's lowest (0.05)")


def test_a_comparison_where_both_sides_missed_on_every_seed_says_its_seconds_are_penalties(tmp_path):
    """("beats allreduce: 0.04 ± 0.01 s faster (time to target)" of two sides that never reached the target: a
    difference of penalty times, read as seconds.)"""
    from evomerge.search.verdict import compare

    s = study_mod.load(write(tmp_path))
    both = compare(s, [[3.0], [3.1], [3.05]], [[3.3], [3.4], [3.35]], [0, 1, 2], pick_missed=[0, 1, 2],
                   base_missed=[0, 1, 2])["text"]
    assert both.endswith("(the difference is of penalty times, how close each came, not of seconds)"), both
    one = compare(s, [[1.0], [1.1], [1.05]], [[3.3], [3.4], [3.35]], [0, 1, 2], base_missed=[0, 1, 2])["text"]
    assert one.endswith("(a miss counts as its penalty time)"), one


@pytest.mark.system
def test_run_and_baselines_print_simulated_time(tmp_path, data_dir):
    f = write(tmp_path)
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", "--json", str(tmp_path / "r.json"),
            cwd=tmp_path, data_dir=data_dir, process=True)
    assert p.returncode == 0, p.stderr
    assert "simulated time" in p.stdout and "time to 0.5 val acc" in p.stdout and "accuracy at the 2 s budget" in p.stdout
    assert "time_budget" not in p.stderr  # 40 steps of a worker at step_time: about the step budget's 30
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["final"]["sim_time"] == pytest.approx(2.0) and "time_to_target" in out["final"]
    p = cli("baselines", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "sim time" in p.stdout and "time to 0.5" in p.stdout and "allreduce" in p.stdout
    assert "baselines (seed 0, 2 simulated s, 4 workers)" in p.stdout, p.stdout  # the budget that ends the runs
    # re-evaluated on fresh seeds: the study's objective too, its mean over the seeds (it was in --json only)
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", "--reevaluate", "2", "--json", str(tmp_path / "re.json"),
            "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    times = [r["final"]["time_to_target"] for r in json.loads((tmp_path / "re.json").read_text())["runs"]]
    row = next(ln for ln in p.stdout.splitlines() if "the study's objective" in ln)
    assert "time to target, s (min)" in row and f"{sum(times) / 2:.4f} ± " in row, (row, times)


@pytest.mark.system
def test_a_time_budget_many_times_the_step_budgets_work_is_said_by_run_and_search(tmp_path, data_dir):
    """(A user calibrated a step of 0.6 ms and wrote the docs' time_budget = 600 beside it: a million steps a run,
    196 s for one `run`, and a search's first trial never ended, with nothing said.)"""
    f = write(tmp_path, time_budget="16.0")
    note = ("note: study.environment.time_budget: 16 s is about 320 local steps of a worker at step_time 0.05 s, 11x "
            "the study's step budget (30 steps), and every run takes them; 1.5 s is the step budget's time")
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and note + "\n" in p.stderr, p.stderr
    assert "simulated time" in p.stdout and "16 s" in p.stdout  # the run still takes the budget it was given
    p = cli("search", "--study", str(f), "--n-trials", "1", "--no-verdict", "--sampler", "random", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert " ".join(note.split()) in " ".join(p.stderr.split()), p.stderr  # the start screen wraps to its width
    # a budget shorter than one step: said so, and no one is said to have waited (it read "the slowest worker did 0
    # local steps, and the others waited for it at the barrier")
    f = write(tmp_path, name="short", time_budget="0.01")
    p = cli("run", "--study", str(f), "--policy", "allreduce", "--quiet", cwd=tmp_path, data_dir=data_dir)
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("note: ")]
    assert p.returncode == 0 and notes == [
        "note: study.environment.time_budget: 0.01 s is shorter than one local step of a worker at step_time 0.05 s: a "
        "worker of speed 1 trains no step in it",
        "note: allreduce never merged: the time ran out before any worker's first local step (all workers average "
        "every step, a=1, uniform weighting)"], p.stderr
    # a search of it: nothing reaches the target, so its next line names no policy to deploy (it named a baseline
    # the verdict ranked by penalty times), and the verdict says why
    p = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--reevaluate", "1", "--runs-dir",
            str(tmp_path / "short-runs"), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    flat = " ".join(p.stderr.split())
    assert "(the search's best; no policy reached the target on the verdict's seeds: a longer " \
           "study.environment.time_budget or an easier study.objectives.target first)" in flat, p.stderr
    assert "no side reached the target" in " ".join(p.stdout.split()), p.stdout


@pytest.mark.system
def test_a_users_timed_study_searches_the_asynchronous_training_ideas(tmp_path, data_dir):
    """A user's own study file with an [environment] whose space holds swaps, data that travels, peers by similarity
    and regrouping: the search runs them all on the simulated clock, and a found policy runs from its file."""
    import optuna

    f = tmp_path / "ideas.toml"
    space = "\n".join([
        'topology = { kind = "categorical", choices = ["complete", "communities"] }',
        'swap_p = { kind = "float", low = 0.0, high = 0.5 }',
        'similarity_bias = { kind = "float", low = -1.0, high = 1.0 }',
        'data_exchange_k = { kind = "int", low = 0, high = 16 }',
        'regroup_every = { kind = "int", low = 0, high = 2 }'])
    text = write(tmp_path).read_text().replace("name = \"tiny-timed\"", "name = \"ideas\"")
    start = text.index("[search.space]") + len("[search.space]\n")
    end = text.index("[objectives]")
    f.write_text(text[:start] + space + "\n" + text[end:])
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "4", "--sampler", "random", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr + p.stdout
    study = optuna.load_study(study_name="ideas", storage=f"sqlite:///{tmp_path / 'runs/ideas/optuna.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4 and all(np.isfinite(t.values[0]) for t in done)
    assert any(t.params["swap_p"] > 0 and t.params["similarity_bias"] != 0 and t.params["data_exchange_k"] > 0
               for t in done)
    pol = tmp_path / "p.json"
    pol.write_text(json.dumps({"topology": "communities", "regroup_every": 1, "similarity_bias": 0.5, "swap_p": 0.3,
                               "data_exchange_k": 8}))
    p = cli("run", "--study", str(f), "--policy", str(pol), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "simulated time" in p.stdout and "time to 0.5 val acc" in p.stdout


@pytest.mark.system
def test_a_search_minimises_time_to_target_and_logs_time_per_round(tmp_path, data_dir):
    import optuna

    f = write(tmp_path)
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "3", "--sampler", "random", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr + p.stdout
    db = next(tmp_path.glob("runs/tiny-timed/optuna.db"))
    study = optuna.load_study(study_name="tiny-timed", storage=f"sqlite:///{db}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3 and all(np.isfinite(t.values[0]) and t.values[0] > 0 for t in done)
    for t in done:  # what the pruner compares each round: never rising, ending at the trial's value
        steps = sorted(t.intermediate_values)
        vals = [t.intermediate_values[k] for k in steps]
        assert len(vals) == 3 and all(b <= a for a, b in zip(vals, vals[1:])) and vals[-1] == pytest.approx(t.values[0])
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs/tiny-timed/mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-timed")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name.startswith("trial-")]
    assert runs and all("final_time_to_target" in r.data.metrics for r in runs)
    history = client.get_metric_history(runs[0].info.run_id, "sim_time")
    assert [m.value for m in history] == pytest.approx([2 / 3, 4 / 3, 2.0])
    # the dashboard draws the learning curves against simulated seconds
    p = cli("dashboard", "--study", str(f), "--out", str(tmp_path / "dash"), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert '"title":{"text":"simulated seconds"}' in (tmp_path / "dash" / "index.html").read_text()


@pytest.mark.system
def test_a_target_never_reached_is_marked_missed_where_the_search_status_and_export_show_it(tmp_path, data_dir):
    """(A trial that never reached its target showed its penalty time as if it were a time: '8.9001' against an 8 s
    budget, in the tables and in export's line; only `run` said 'not reached'.)"""
    f = write(tmp_path)
    f.write_text(f.read_text().replace("target = 0.5", "target = 0.999"))
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "1", "--sampler", "random", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr + p.stdout
    assert "(missed)" in p.stdout, p.stdout
    st = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert st.returncode == 0 and "(missed)" in st.stdout, st.stdout
    # every trial in the table missed: the search and status say so once, and what tells them apart by time (a new
    # user's search of 3 trials, each "(missed)", said nothing of it)
    budget = study_mod.load(f).environment.time_budget
    said = (f"note: no trial in the table reached val_accuracy 0.999 within the time budget ({budget:g} s) on every "
            "seed: each is ranked by its penalty time (budget x (2 - best / target)), how close it came; a longer "
            "study.environment.time_budget or an easier study.objectives.target tells them apart by time")
    for out in (p.stdout, st.stdout):
        assert " ".join(out.split()).count(said) == 1, out
    e = cli("export", "--study", str(f), "-o", str(tmp_path / "best.json"), cwd=tmp_path, data_dir=data_dir)
    assert e.returncode == 0 and re.search(r"wrote trial 0 \(time_to_target [\d.]+ \(missed\)\)", e.stdout), e.stdout
    budget = study_mod.load(f).environment.time_budget
    seeds = study_mod.load(f).run.seeds
    on = f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} of its {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    assert (f"note: trial 0 did not reach val_accuracy 0.999 within the time budget ({budget:g} s) on {on}: its "
            "time to target is a penalty past the budget, not a time (budget x (2 - best / target))") in e.stderr, \
        e.stderr
    # the replay of the export says the trial's value is a miss, as the table does
    r = cli("run", "--study", str(f), "--policy", str(tmp_path / "best.json"), cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0 and re.search(r"^time to target matches trial 0 of \S+ \(seed \d+: [\d.]+ \(missed\)\)$",
                                           r.stdout, re.M), r.stdout
    for args in (["--trial", "0"], []):  # --trial and the best alike, said once
        e = cli("export", "--study", str(f), "-o", str(tmp_path / "t.json"), *args, cwd=tmp_path, data_dir=data_dir)
        assert e.returncode == 0 and e.stderr.count("did not reach val_accuracy 0.999") == 1, e.stderr
    ok = write(tmp_path, name="reached")  # a target reached is a time, unmarked
    from evomerge.search.results import missed

    s = study_mod.load(ok)
    assert missed(s, "time_to_target", 1.5) == "" and missed(s, "time_to_target", 2.5) == " (missed)"
    assert missed(s, "bytes", 2.5) == ""
    from evomerge.report.search_view import missed_line

    assert missed_line(s, [{"values": [2.5]}, {"values": [1.5]}]) == ""  # one reached it: no note
    assert missed_line(s, [{"values": [2.5]}, {"values": [3.0]}]).startswith("note: no trial in the table reached")


@pytest.mark.system
def test_an_allreduce_whose_straggler_never_reaches_it_sent_nothing_and_is_not_called_no_merging(tmp_path, data_dir):
    """(On a clock, an all-reduce the straggler never reached before the budget counted the bytes of the workers
    waiting at its barrier, and the note said the policy 'ran as no-merging', though they idled there.)"""
    f = write(tmp_path)  # 2 s budget of 0.05 s steps: the straggler (speed 0.25) does 10 steps, the others 20 first
    (tmp_path / "late.json").write_text(json.dumps({"scheme": "allreduce", "mean_interval": 20}))
    p = cli("run", "--study", str(f), "--policy", str(tmp_path / "late.json"), "--json", str(tmp_path / "r.json"),
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    final = json.loads((tmp_path / "r.json").read_text())["final"]
    assert final["merges"] == 0 and final["bytes"] == 0, final
    assert re.search(r"note: \S*late.json never merged: the time ran out before its first merge \(.*\); the slowest worker "
                     r"did \d+ local steps, and the others waited for it at the barrier", p.stderr), p.stderr
    assert "no-merging" not in p.stderr


BAD = [
    ("step_time", "-1.0", "out of range"),
    ("speeds", '"gauss"', "allowed: equal, lognormal, pareto"),
    ("speeds", "[1.0, 2.0]", "needs 4 positive speeds"),
    ("speeds", "[1.0, -1.0, 0.8, 1.2]", "speeds[1]: -1.0 is out of range; allowed: a speed > 0"),
    ("frm", '"cluster.toml"', "unknown key; did you mean from? allowed: "),  # (23 keys: the nearest first)
    ("latency_matrix", "[[0.0, 1.0], [1.0, 0.0]]", "must be 4 x 4"),
    ("overlap", '"sometimes"', "allowed: nonblocking, blocking"),
    ("step_budget", '"each"', "allowed: shared, per_worker"),
    ("slow_workers", "[9]", "allowed: 0..3"),
    ("speeds_file", '"nowhere.txt"', "cannot read speeds"),
    ("time_budget", "0.0", "is required by time_to_target"),
    ("sigma", "0.3", 'applies with speeds = "lognormal"; speeds is a list: it would be ignored; remove it'),
    ("latency_inter", "0.02", "is the latency between sites, and there is one site (sites = 1): it would be ignored"),
]


def test_a_key_the_environment_would_ignore_is_refused_but_a_calibrated_files_is_not(tmp_path):
    """A study's own key that its environment would ignore is one line naming it; the same key in a file the study
    reads with `from` (calibrate's, overridden beside `from`) is that file's business and is not refused."""
    from evomerge import study as study_mod
    from evomerge.errors import ConfigError

    (tmp_path / "speeds.txt").write_text("1.0\n1.0\n1.0\n0.5\n")
    for changes, field in [({"speeds_file": '"speeds.txt"'}, "speeds_file"),
                           ({"speeds": '"equal"', "alpha": "3.0"}, "alpha"),
                           ({"slow_factor": "2.0"}, "slow_factor"),
                           ({"straggle_length": "5.0"}, "straggle_length")]:
        with pytest.raises(ConfigError) as e:
            study_mod.load(write(tmp_path, "bad", **changes))
        assert e.value.field == f"study.environment.{field}"
    with pytest.raises(ConfigError, match="gives the speeds, and so does speeds"):  # said before the file is read
        study_mod.load(write(tmp_path, "bad", speeds_file='"no-such-file.txt"'))
    (tmp_path / "cluster.toml").write_text('[environment]\nstep_time = 0.05\nspeeds = "lognormal"\nsigma = 0.3\n')
    f = write(tmp_path, "ok")
    text = f.read_text().replace("[environment]\n", '[environment]\nfrom = "cluster.toml"\n', 1)
    f.write_text(text)  # the study's own speeds list overrides the file's model; the file's sigma goes unused
    s = study_mod.load(f)
    assert s.environment.speeds == (1.0, 1.0, 1.0, 0.25)


def test_a_study_searched_with_a_key_now_refused_still_reads_and_resumes_once_the_key_is_gone(tmp_path):
    """A study stored before ignored keys were refused: its stored definition still reads (as `dashboard` and `run`
    read it), and once the user takes the ignored key out of the file, the search resumes: a key its environment
    ignores is no change of the study."""
    import tomllib

    import optuna

    from evomerge import study as study_mod
    from evomerge.errors import ConfigError
    from evomerge.search import fingerprint
    from evomerge.search.config import make_config

    old = write(tmp_path, "tiny-timed", sigma="0.3")
    with pytest.raises(ConfigError, match="study.environment.sigma"):
        study_mod.load(old)
    before = study_mod.from_dict(tomllib.loads(old.read_text()), path=old, default_name="tiny-timed")  # as stored
    assert before.environment.sigma == 0.3
    ostudy = optuna.create_study(study_name="tiny-timed", storage=f"sqlite:///{tmp_path / 'o.db'}")
    ostudy.set_user_attr(fingerprint.ATTR, fingerprint.of(before))
    now = study_mod.load(write(tmp_path, "tiny-timed"))  # the key taken out: the default sigma, unused
    fingerprint.check(ostudy, make_config(now, runs_dir=tmp_path / "runs"), 3)
    changed = study_mod.load(write(tmp_path, "tiny-timed", step_time="0.07"))  # a used key is still a change
    with pytest.raises(ConfigError, match="environment.step_time changed"):
        fingerprint.check(ostudy, make_config(changed, runs_dir=tmp_path / "runs"), 3)


@pytest.mark.system
@pytest.mark.parametrize("key, value, why", BAD)
def test_bad_environment_values_exit_2_naming_the_field(tmp_path, key, value, why):
    f = write(tmp_path, "bad", **{key: value, **({"speeds": None} if key == "speeds_file" else {})})  # one of them
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", cwd=tmp_path, data_dir=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"study.environment.{key}" in lines[0] and why in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_runs_steps_on_the_clock_are_said_to_be_the_time_budgets(tmp_path, data_dir):
    """(A new user's study said steps = 60; on the clock its workers took 42 to 72, nothing said why, and the user
    guessed which number to give a Merger's total_steps.) The table's row says the budget gave them."""
    f = write(tmp_path)
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", "--json", str(tmp_path / "r.json"), cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    fin = json.loads((tmp_path / "r.json").read_text())["final"]
    assert (fin["steps_min"], fin["steps_max"]) != (30, 30)
    said = " ".join(p.stdout.split())
    assert f"{fin['steps_min']} / {fin['steps_mean']:.1f} / {fin['steps_max']} (slowest / mean / fastest worker, in " \
           "the 2 s time budget)" in said.replace("│ │", ""), p.stdout
    # each worker takes its steps and no more: nothing to say
    f.write_text(f.read_text().replace("time_budget = 2.0", 'time_budget = 2.0\nstep_budget = "per_worker"'))
    p = cli("run", "--study", str(f), "--policy", "ring-gossip", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "time budget)" not in p.stdout, p.stdout


def test_run_shows_the_studys_own_metric_at_the_time_budget():
    """(A language model's perplexity_at_time study showed its next-token accuracy at the budget, not perplexity.)"""
    from types import SimpleNamespace

    from evomerge import study as study_mod
    from evomerge.cli import _time_rows

    raw = tomllib.loads((study_mod.shipped_studies_dir() / "tiny-lm.toml").read_text())
    raw["environment"], raw["objectives"] = {"time_budget": 1.0}, {"metrics": ["perplexity_at_time", "bytes"]}
    s = study_mod.from_dict(raw)
    f = SimpleNamespace(sim_time=1.0, idle_fraction=0.1, staleness=0.0, time_to_target=None, accuracy_at_time=0.31,
                        perplexity_at_time=7.25, loss_at_time=1.98)
    assert _time_rows(s, f)[-1] == ("perplexity at the 1 s budget", "7.2500")
    raw["objectives"] = {"metrics": ["accuracy_at_time"]}
    assert _time_rows(study_mod.from_dict(raw), f)[-1] == ("accuracy at the 1 s budget", "0.3100")


@pytest.mark.system
def test_a_target_outside_0_1_and_a_retired_objective_exit_2(tmp_path):
    for old, new, field in [("target = 0.5", "target = 1.5", "study.objectives.target"),
                            ('metrics = ["time_to_target"]', 'metrics = ["wall_time"]', "study.objectives.metrics")]:
        f = write(tmp_path, "bad")
        f.write_text(f.read_text().replace(old, new))
        p = cli("run", "--study", str(f), "--policy", "ring-gossip", cwd=tmp_path, data_dir=ROOT)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and field in p.stderr, p.stderr


@pytest.mark.system
def test_emulated_time_needs_the_distributed_backend_and_an_environment_and_says_which_is_missing(tmp_path, data_dir):
    from conftest import write_study

    p = cli("run", "--study", str(write(tmp_path)), "--policy", "ring-gossip", "--emulate-time", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == \
        "error: --emulate-time: needs --backend distributed (the backend is 'inprocess')\n", p.stderr
    p = cli("run", "--study", str(write_study(tmp_path)), "--policy", "ring-gossip", "--backend", "distributed",
            "--emulate-time", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == ("error: --emulate-time: needs a study with an [environment] ('tiny' has "
                                              "none: its steps have no simulated time to emulate)\n"), p.stderr


@pytest.mark.parametrize("name", ["mnist-stragglers", "mnist-two-sites"])
def test_the_shipped_timed_studies_load(name):  # (they run in the README's benchmarks)
    s = study_mod.load(name)
    assert s.environment is not None and s.run.workers == 16 and s.objectives == ("time_to_target",)
    assert s.environment.time_budget > 0 and s.target is not None


def test_speeds_from_a_file_beside_the_study(tmp_path):
    (tmp_path / "speeds.txt").write_text("1.0\n0.5\n2.0\n1.0\n")
    f = write(tmp_path, speeds_file='"speeds.txt"')
    f.write_text(f.read_text().replace("speeds = [1.0, 1.0, 1.0, 0.25]\n", ""))
    assert study_mod.load(f).environment.speeds == (1.0, 0.5, 2.0, 1.0)


def test_a_speeds_file_named_in_a_from_file_is_read_beside_that_file_from_any_folder(tmp_path, monkeypatch):
    """(A study given as b/s.toml, whose cluster file named speeds.txt, read b/b/speeds.txt.)"""
    b = tmp_path / "b"
    b.mkdir()
    (b / "speeds.txt").write_text("1.0\n0.5\n2.0\n1.0\n")
    (b / "cluster.toml").write_text('[environment]\nstep_time = 0.05\nspeeds_file = "speeds.txt"\n')
    f = write(b, speeds=None, step_time=None)
    f.write_text(f.read_text().replace("[environment]\n", '[environment]\nfrom = "cluster.toml"\n'))
    monkeypatch.chdir(tmp_path)
    assert study_mod.load(f"b/{f.name}").environment.speeds == (1.0, 0.5, 2.0, 1.0)


# -- the distributed backend replays the same clock ----------------------------------------------------
UNEVEN = EnvSpec(step_time=0.1, speeds=(1.0, 0.7, 1.3, 0.25), jitter=0.1, latency=0.03, bandwidth=2e6, overlap="blocking")


@pytest.fixture(scope="module")
def setup4(mnist):
    return simulate.prepare(tiny_study(workers=4, rounds=3, steps=30), data=mnist)


@pytest.mark.system
@pytest.mark.parametrize("name, procs", [("push-pull-winner-examples", 4), ("allreduce-examples", 2),
                                         ("allreduce-alpha", 2), ("push-pull-per-worker", 2)])
def test_distributed_ranks_replay_the_clock_and_agree_with_in_process(setup4, name, procs):
    """(A searched policy of one fragment with an alpha, nothing streamed, was refused on the clock: "fragments are
    not streamed between ranks on a simulated clock yet".)"""
    from evomerge.backends import launch as distributed

    policy = {"push-pull-winner-examples": P(exchange="push_pull", winner_bias=0.5, weighting="examples", mean_interval=2.0),
              "push-pull-per-worker": P(exchange="push_pull", winner_bias=0.5, mean_interval=2.0),
              "allreduce-examples": P(scheme="allreduce", mean_interval=3.0, weighting="examples"),
              "allreduce-alpha": P(scheme="allreduce", mean_interval=3.0, fragment_alpha=0.25, outer_optimizer="sgd",
                                   outer_lr=0.7)}[name]
    each = name.endswith("per-worker")  # every worker its own 30 steps, as a job's ranks (run --against)
    s = with_env(setup4, dataclasses.replace(UNEVEN, step_budget="per_worker") if each else UNEVEN)
    a = simulate.simulate(s, policy, 1, keep_params=True)
    b = distributed.simulate(s, policy, 1, keep_params=True, procs=procs, device="cpu")
    assert len(a.history) == len(b.history) == 3
    for x, y in zip(a.history, b.history):
        x, y = dataclasses.asdict(x), dataclasses.asdict(y)
        for key in x:
            if key != "wall_time" and x[key] is not None:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), key  # simulated time included
    assert a.final.idle_fraction > 0  # blocking merges, or barriers: both wait on the slow worker
    assert (a.final.steps_min < a.final.steps_max) == (policy.scheme == "gossip" and not each)
    assert torch.allclose(a.params, b.params, atol=1e-5)


@pytest.mark.system
def test_distributed_refuses_delta_payloads_on_a_clock_in_one_line(tmp_path, data_dir):
    (tmp_path / "delta.json").write_text(json.dumps({"payload": "delta", "topk_fraction": 0.1}))
    p = cli("run", "--study", str(write(tmp_path)), "--policy", str(tmp_path / "delta.json"), "--backend", "distributed",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "policy.payload" in p.stderr, p.stderr


@pytest.mark.system
def test_emulated_time_paces_the_ranks_to_the_simulated_clock(setup4):
    from evomerge.backends import launch as distributed

    env = EnvSpec(step_time=0.05, speeds=(1.0, 1.0, 1.0, 0.5), latency=0.01, time_budget=1.5)
    s = with_env(setup4, env)
    policy = P(exchange="push", mean_interval=3.0)
    paced = distributed.simulate(s, policy, 0, procs=2, device="cpu", emulate_time=True)
    free = distributed.simulate(s, policy, 0, procs=2, device="cpu")
    assert paced.final.sim_time == free.final.sim_time == pytest.approx(1.5)
    assert paced.wall_time - paced.eval_time >= 1.5 * 0.9  # it waited for the simulated clock (evaluation aside)
    assert [h.val_accuracy for h in paced.history] == [h.val_accuracy for h in free.history]


# -- a user's model and optimiser on the clock ---------------------------------------------------------
@pytest.fixture(scope="module")
def bn_setup(setup):
    from test_generic import small_bn

    from evomerge.models.generic import GenericModel

    study = dataclasses.replace(setup.study, run=dataclasses.replace(setup.study.run, optimizer="adamw", lr=0.01,
                                                                     weight_decay=0.01, steps=20))
    return dataclasses.replace(setup, model=GenericModel(small_bn, (28, 28), 10), study=study, total_steps=20)


@pytest.mark.parametrize("policy", [P(exchange="push_pull", winner_bias=0.5, optimizer_state="average", mean_interval=2.0),
                                    P(exchange="push", optimizer_state="reset", buffers="local", mean_interval=2.0),
                                    P(scheme="allreduce", mean_interval=4.0, optimizer_state="average")],
                         ids=["push-pull-average", "push-reset-local", "allreduce-average"])
def test_batchnorm_adamw_and_optimizer_state_on_a_free_clock_equal_lockstep(bn_setup, policy):
    lockstep = simulate.simulate(bn_setup, policy, 5, keep_params=True)
    timed = simulate.simulate(with_env(bn_setup, EnvSpec(step_time=0.1)), policy, 5, keep_params=True)
    assert lockstep_part(timed) == lockstep_part(lockstep)
    assert torch.equal(timed.params, lockstep.params)


def test_a_user_model_steps_unevenly_with_its_optimizer_state(bn_setup):
    env = EnvSpec(step_time=0.1, speeds=(1.0, 0.5, 1.0, 2.0, 1.0), latency=0.02)
    res = simulate.simulate(with_env(bn_setup, env), P(optimizer_state="average", mean_interval=2.0), 0, keep_params=True)
    assert res.status == "ok" and res.final.steps_min < res.final.steps_max
    assert torch.isfinite(res.params).all()


# -- supports that pass the rescale limit: merge-heavy policies whose events collide within a step ---------
def _unscaled_max_examples(policy, workers: int, steps: int, seed: int, batch: int) -> float:
    """The largest example counter the run would reach without rescaling: counters are a function of the
    schedule alone (batch per step, summed on merge), replayed here in float64."""
    from evomerge.engine import schedule as schedule_mod

    s = schedule_mod.build(policy, workers, steps, seed)
    ex, top = np.zeros(workers), 0.0
    for step in range(1, steps + 1):
        ex += batch
        evs = s.events_at(step)
        for ev in range(evs.start, evs.stop):
            i, j = int(s.initiator[ev]), int(s.peer[ev])
            ex[j] = ex[i] + ex[j]
            if policy.exchange == "push_pull":
                ex[i] = ex[j]
        top = max(top, float(ex.max()))
    return top


HEAVY_PAYLOADS = {"weights": {}, "delta-topk": {"payload": "delta", "topk_fraction": 0.3},
                  "delta-quantised": {"payload": "delta", "quantize_bits": 6}}


@pytest.fixture(scope="module")
def long_setup(mnist):
    return simulate.prepare(tiny_study(workers=4, rounds=3, steps=100), data=mnist)


@pytest.mark.parametrize("weighting, payload", [("uniform", "delta-quantised"), ("examples", "weights"),
                                                 ("examples", "delta-topk"), ("adaptive", "weights"),
                                                 ("adaptive", "delta-quantised")])  # every weighting and payload
def test_a_free_clock_equals_lockstep_when_supports_pass_the_rescale_limit(long_setup, weighting, payload):
    """The issue's bug: the clock's landings summed supports but never rescaled them, so adaptive weighting's
    float32 accumulators overflowed (the run diverged) where lockstep ran fine."""
    from evomerge.engine.kernel import SUPPORT_LIMIT

    policy = P(topology="complete", exchange="push", mean_interval=1.0, weighting=weighting, winner_bias=0.5,
               **HEAVY_PAYLOADS[payload])
    run = long_setup.study.run
    assert _unscaled_max_examples(policy, run.workers, long_setup.total_steps, 7, run.batch_size) > SUPPORT_LIMIT**2
    lockstep = simulate.simulate(long_setup, policy, 7, device="cpu", keep_params=True)
    timed = simulate.simulate(with_env(long_setup, EnvSpec(step_time=0.25)), policy, 7, device="cpu", keep_params=True)
    assert lockstep.status == timed.status == "ok"
    assert lockstep_part(timed) == lockstep_part(lockstep)
    assert torch.equal(timed.params, lockstep.params)


def test_a_free_clock_takes_the_lockstep_path_and_an_uneven_one_the_waves(setup):
    from evomerge.engine.timed import Timed

    policy = P(exchange="push_pull", topology="complete", mean_interval=2.0)
    for env, fast in ((EnvSpec(step_time=0.25), True), (EnvSpec(step_time=0.25, latency=0.01), False),
                      (EnvSpec(step_time=0.25, speeds="lognormal", sigma=0.5), False)):
        s = with_env(setup, env)
        driver = Timed(s, policy, 0, InProcess(s, policy, 0, torch.device("cpu")))
        assert (driver.merger is not None) == fast, env
    s = with_env(setup, EnvSpec(step_time=0.25))
    assert Timed(s, policy, 0, InProcess(s, policy, 0, torch.device("cpu")), waves=True).merger is None


def test_the_time_budgets_step_estimate_counts_slow_spells_and_jitter():
    """(On a calibrated cluster with slow spells the note counted the steps at step_time alone: 10,000 here, 3.4x
    the steps a run takes.) A step is in a spell with the chain's stationary chance p L / (1 + p L)."""
    import math

    from evomerge import study as study_mod

    env = {"step_time": 0.01, "time_budget": 100.0, "straggle_p": 0.25, "straggle_length": 12.5,
           "straggle_factor": 4.0, "jitter": 0.3}
    s = study_mod.from_dict({"study": {"name": "t"}, "environment": env})
    pl = 0.25 * 12.5
    steps = 100.0 / (0.01 * (1 + pl / (1 + pl) * 3) * math.exp(0.3 ** 2 / 2))
    note = s.budget_note(30)
    assert note.startswith(f"study.environment.time_budget: 100 s is about {steps:,.0f} local steps of a worker at "
                           "step_time 0.01 s with its slow spells and jitter, "), note
    assert 2800 < steps < 3000 and s.budget_note(round(steps / 10) + 1) is None  # within 10x: nothing said


@pytest.mark.system
def test_a_policy_that_sends_more_than_its_links_carry_is_said_so(tmp_path, data_dir):
    """(A search on a calibrated 50 Mbit/s cluster picked a gossip every step: its payloads shared the links so
    thinly that none landed before the run's end, so it cost no time and merged nothing, a tie with no merging; its
    real run under netlab took 60x the simulated time, finish() waiting for every payload.) 51 kB payloads every
    step of 50 ms on links of 100 kB/s: a run says so (and the verdict's and the export's notes); a policy the
    links carry does not."""
    f = write(tmp_path, bandwidth="1e5")
    (tmp_path / "flood.json").write_text(json.dumps({"scheme": "gossip", "topology": "ring", "mean_interval": 1.0}))
    p = cli("run", "--study", str(f), "--policy", "flood.json", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    said = [ln for ln in p.stderr.splitlines() if "what its links carry" in ln]
    assert len(said) == 1 and re.match(r"note: flood\.json sent [\d.,]+ (kB|MB) in 2 simulated s, [\d,]+x what its "
                                       r"links carry in that time \(400\.0 kB/s\): most of its payloads were still in "
                                       r"flight at the time budget", said[0]), p.stderr
    p = cli("run", "--study", str(f), "--policy", "fedavg", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "what its links carry" not in p.stderr, p.stderr  # an all-reduce waits for its bytes
    # the verdict's notes and the export's line take the same words from each seed's final metrics
    from evomerge import study as study_mod
    from evomerge.search.verdict import _idle

    s = study_mod.load(f)
    side = _idle({"scheme": "gossip", "mean_interval": 1.0}, [{"bytes": 8e6, "sim_time": 2.0, "merges": 40}], s)
    assert side["saturated"].startswith("sent 8.0 MB in 2 simulated s, 10x what its links carry"), side
    assert _idle({"scheme": "gossip"}, [{"bytes": 1e6, "sim_time": 2.0, "merges": 4}], s) == {}


@pytest.mark.parametrize("name", ["push-pull-winner-examples", "similarity-bias-published", "async"])
def test_a_per_worker_step_budget_runs_every_worker_the_runs_steps(setup4, name):
    """``[environment] step_budget = "per_worker"``: on an uneven cluster every worker takes the run's 30 steps (a
    job's ranks, each taking total_steps), the fast ones idle at the end (gossip, a run deciding with what the workers
    publish, asynchronous DiLoCo); the same seed gives the same run, and the shared budget (W x T of work) lets the
    fast workers take more."""
    policy = GOSSIP.get(name) or {"ring-gossip": P(topology="ring", mean_interval=2.0),
                                  "async": P(scheme="async", mean_interval=3.0, mixing_weight=1.0,
                                             outer_optimizer="nesterov")}[name]
    each = with_env(setup4, dataclasses.replace(UNEVEN, step_budget="per_worker"))
    a, b = (simulate.simulate(each, policy, 2, keep_params=True) for _ in range(2))
    f = a.final
    assert f.steps_min == f.steps_max == 30 and f.steps_mean == 30 and 0 < f.idle_fraction < 1
    assert [dataclasses.asdict(h) | {"wall_time": 0} for h in a.history] == \
           [dataclasses.asdict(h) | {"wall_time": 0} for h in b.history] and torch.equal(a.params, b.params)
    shared = simulate.simulate(with_env(setup4, UNEVEN), policy, 2).final
    assert shared.steps_min < 30 < shared.steps_max and shared.sim_time < f.sim_time
