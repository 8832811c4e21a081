"""The outer optimiser (DiLoCo, SlowMo's slow momentum) at each all-reduce: against a loop written by hand
with torch modules and torch's own optimisers, against FedAvg, and its refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_study
from evomerge import models as models_mod
from evomerge import reference, simulate
from evomerge.errors import ConfigError
from evomerge.policy import SCHEMA_VERSION, MergePolicy
from evomerge.simulate import batch_indices, initial_row, normalise

P = MergePolicy
H = 6  # inner steps between outer steps: 10 outer steps in the run's 60
# the largest difference of one coordinate from its hand-written loop that float noise makes: AdamW batched over
# workers against torch's per module rounds differently, and Adam's small second moments amplify a few coordinates'
# differences (a bug moves whole layers, by far more): up to 5.3e-3 seen (an AMD EPYC without AVX-512), about
# 1e-3 on an Intel CPU with it
NOISE_MAX = 1e-2


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=4, steps=60, optimizer="adamw", lr=0.01, weight_decay=0.01), data=mnist)


def by_hand(setup, seed: int, every: int, outer_step):
    """W modules from the run's start, each with its own torch.optim.AdamW, on the merge run's minibatches
    (batch_indices); after every ``every`` inner steps ``outer_step(workers)`` (under no_grad). The workers' rows."""
    run, data = setup.study.run, setup.data
    start = initial_row(setup.model, seed)
    workers = [models_mod.load_row(setup.model.module(), start) for _ in range(run.workers)]
    inner = [reference.optimizer(m, run) for m in workers]
    idx = [batch_indices(s, run.batch_size, 0, setup.total_steps, seed, w) for w, s in enumerate(setup.shards)]
    for t in range(setup.total_steps):
        for w, (m, opt) in enumerate(zip(workers, inner)):
            bi = torch.as_tensor(idx[w][t])
            loss = F.cross_entropy(m(normalise(data.train_x[bi], data.spec)), data.train_y[bi])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if (t + 1) % every == 0:
            with torch.no_grad():
                outer_step(workers)
    return torch.stack([models_mod.module_row(m) for m in workers])


def diloco_by_hand(setup, seed: int, every: int, outer_lr: float, momentum: float, nesterov: bool):
    """DiLoCo as a user writes it: ``every`` inner steps, then torch.optim.SGD on the anchor with the
    pseudo-gradient anchor - mean(workers); every worker restarts from the anchor."""
    anchor = models_mod.load_row(setup.model.module(), initial_row(setup.model, seed))
    outer = torch.optim.SGD(anchor.parameters(), lr=outer_lr, momentum=momentum, nesterov=nesterov)

    return by_hand(setup, seed, every, lambda workers: restart_from_outer_step(anchor, outer, workers))


def restart_from_outer_step(anchor, outer, workers) -> None:
    """The outer step on the anchor with the pseudo-gradient anchor - mean(workers); every worker restarts from it."""
    for a, *ws in zip(anchor.parameters(), *(m.parameters() for m in workers)):
        a.grad = a - torch.stack(ws).mean(0)
    outer.step()
    for m in workers:
        for p, a in zip(m.parameters(), anchor.parameters()):
            p.copy_(a)


@pytest.mark.parametrize("kind", ["nesterov", "sgd"])
def test_diloco_equals_a_hand_written_loop_with_torch_optimisers(setup, kind):
    policy = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer=kind, outer_lr=0.7,
               outer_momentum=0.9)
    res = simulate.simulate(setup, policy, 2, device="cpu", keep_params=True)
    ref = diloco_by_hand(setup, 2, H, 0.7, 0.9, kind == "nesterov")
    assert res.status == "ok"
    # AdamW batched over workers against torch's per module: the mean difference stays at float noise (~1e-7)
    # while training moved the parameters ~0.16 on average; Adam's small second moments amplify a few
    # coordinates' differences to 1e-3 to 5e-3 (NOISE_MAX; plain FedAvg against the same loop: 2e-4)
    diff = (res.params - ref).abs()
    assert float(diff.mean()) < 1e-6 and float(diff.max()) < NOISE_MAX, (float(diff.mean()), float(diff.max()))
    # the outer step is not the plain average: it moved the workers elsewhere than FedAvg did
    fedavg = simulate.simulate(setup, P(scheme="allreduce", mean_interval=H, mixing_weight=1.0), 2, device="cpu",
                               keep_params=True)
    assert float((res.params - fedavg.params).abs().max()) > 1e-2


def test_outer_sgd_with_lr_1_and_no_momentum_is_fedavg(setup):
    fedavg = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0)
    plain = simulate.simulate(setup, fedavg, 5, device="cpu", keep_params=True)
    outer = simulate.simulate(setup, dataclasses.replace(fedavg, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0),
                              5, device="cpu", keep_params=True)
    assert torch.allclose(outer.params, plain.params, atol=1e-5)
    assert outer.final.bytes == plain.final.bytes and outer.final.merges == plain.final.merges
    assert outer.final.val_accuracy == pytest.approx(plain.final.val_accuracy, abs=2e-3)


def test_a_free_clock_and_a_population_keep_diloco_bit_for_bit(setup):
    from evomerge.backends.population import Member, run_population
    from evomerge.study import EnvSpec

    policy = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer="nesterov")
    lockstep = simulate.simulate(setup, policy, 1, device="cpu", keep_params=True)
    free = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.1)))
    timed = simulate.simulate(free, policy, 1, device="cpu", keep_params=True)
    member = run_population(setup, [Member(policy, 1), Member(P(), 1)], device="cpu", keep_params=True)[0]
    assert torch.equal(timed.params, lockstep.params) and torch.equal(member.params, lockstep.params)


def compressed_diloco_by_hand(setup, seed: int, every: int, fraction: float, bits: int):
    """DiLoCo with its outer gradients compressed and error feedback (MuLoCo; Streaming DiLoCo's quantisation),
    written out: at each outer step each worker sends ``C(worker - anchor + owed)`` (``ops.compress``, the noise of
    ``plan.quant_generator(seed, outer step, worker)``) and keeps what it did not send owed; torch.optim.SGD
    (Nesterov 0.7 / 0.9) takes the pseudo-gradient ``-mean(sent)``; every worker restarts from the anchor."""
    from evomerge.engine import ops, plan

    anchor = models_mod.load_row(setup.model.module(), initial_row(setup.model, seed))
    outer = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    owed = [torch.zeros(setup.model.n_params) for _ in range(setup.study.run.workers)]
    k = [0]

    def step(workers):
        a = models_mod.module_row(anchor)
        sent = []
        for w, m in enumerate(workers):
            d = models_mod.module_row(m) - a + owed[w]
            gen = plan.quant_generator(seed, k[0], w) if bits else None
            sent.append(ops.compress(d, fraction, bits, gen))
            owed[w] = d - sent[-1]
        g = -torch.stack(sent).mean(0)
        o = 0
        for p in anchor.parameters():
            p.grad = g[o:o + p.numel()].view_as(p).clone()
            o += p.numel()
        outer.step()
        for m in workers:
            for p, q in zip(m.parameters(), anchor.parameters()):
                p.copy_(q)
        k[0] += 1

    return by_hand(setup, seed, every, step)


@pytest.mark.parametrize("fraction,bits", [(0.25, 0)])
def test_compressed_outer_gradients_equal_a_hand_written_loop_with_error_feedback(setup, fraction, bits):
    """payload delta with an outer step: each worker's change since its public copy (the anchor less what it owes)
    compressed, the outer step on the anchor plus their mean; against the loop above, with top-k. (Stochastic
    rounding flips with float noise, which training amplifies: its mechanics are checked exactly below.)"""
    policy = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer="nesterov", outer_lr=0.7,
               outer_momentum=0.9, payload="delta", topk_fraction=fraction, quantize_bits=bits)
    res = simulate.simulate(setup, policy, 2, device="cpu", keep_params=True)
    ref = compressed_diloco_by_hand(setup, 2, H, fraction, bits)
    diff = (res.params - ref).abs()
    plain = simulate.simulate(setup, dataclasses.replace(policy, payload="weights", topk_fraction=1.0,
                                                         quantize_bits=0), 2, device="cpu", keep_params=True)
    moved = float((res.params - plain.params).abs().mean())  # what compression moved: a mean of 5e-2
    # float noise of AdamW batched against per module, as the uncompressed DiLoCo's, and top-k then sends another of
    # two nearly equal coordinates, which error feedback carries on: a mean of 7e-6 seen on an AMD EPYC, 1.9e-3 on
    # an AVX-512 Xeon (whose kernels round otherwise); a rule of the engine's that the loop lacks moves it by about
    # as much as compression does
    assert float(diff.mean()) < 0.1 * moved, (float(diff.mean()), float(diff.max()), moved)
    assert res.final.bytes < plain.final.bytes


def test_compressed_outer_gradients_mechanics_by_hand(setup):
    """Two outer steps on rows set by hand, top-k and 4-bit stochastic rounding: what each worker sends is
    ``C(row - anchor + owed)`` with the engine's noise, what it did not send stays owed, and every row restarts
    from the anchor after torch's Nesterov step on ``-mean(sent)``, to float precision."""
    from evomerge.backends.inprocess import InProcess
    from evomerge.engine import ops, plan

    policy = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer="nesterov", outer_lr=0.7,
               outer_momentum=0.9, payload="delta", topk_fraction=0.5, quantize_bits=4)
    b = InProcess(setup, policy, 3, torch.device("cpu"))
    st, W, n = b.state, setup.study.run.workers, setup.model.n_params
    anchor = torch.nn.Parameter(st.params.row(0).clone())
    outer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    owed, g = torch.zeros(W, n), torch.Generator().manual_seed(0)
    for ev in range(3):
        rows = anchor.detach() + 0.01 * torch.randn(W, n, generator=g)
        st.params.set_rows(rows.clone())
        b.allreduce(ev, (ev + 1) * H, 1.0)
        d = rows - anchor.detach() + owed
        sent = torch.stack([ops.compress(d[w], 0.5, 4, plan.quant_generator(3, ev, w)) for w in range(W)])
        owed = d - sent
        anchor.grad = -sent.mean(0)
        outer.step()
        torch.testing.assert_close(st.params.rows(), anchor.detach().expand(W, -1), rtol=0, atol=2e-6)
        assert float((sent - d).abs().max()) > 1e-3  # the compression dropped something, which is now owed


def test_uncompressed_outer_gradients_are_diloco_and_a_free_clock_and_population_keep_them(setup):
    from evomerge.backends.population import Member, run_population
    from evomerge.study import EnvSpec

    diloco = P(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer="nesterov")
    plain = simulate.simulate(setup, diloco, 1, device="cpu", keep_params=True)
    whole = simulate.simulate(setup, dataclasses.replace(diloco, payload="delta"), 1, device="cpu", keep_params=True)
    torch.testing.assert_close(whole.params, plain.params, rtol=1e-5, atol=1e-5)
    assert whole.final.bytes == plain.final.bytes
    compressed = dataclasses.replace(diloco, payload="delta", topk_fraction=0.3, quantize_bits=4)
    lockstep = simulate.simulate(setup, compressed, 1, device="cpu", keep_params=True)
    free = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.1)))
    timed = simulate.simulate(free, compressed, 1, device="cpu", keep_params=True)
    member = run_population(setup, [Member(compressed, 1), Member(P(), 1)], device="cpu", keep_params=True)[0]
    assert torch.equal(timed.params, lockstep.params) and torch.equal(member.params, lockstep.params)
    from evomerge import backends

    with pytest.raises(ConfigError, match=r"^policy.payload: 'delta' with an outer step \(compressed outer gradients\) "
                                          r"is not supported by the distributed backend"):
        backends.check_policy("distributed", compressed)


def slowmo_by_hand(setup, seed: int, policy):
    """SlowMo over a gossip base as a user writes it (Wang et al. 2020): W modules with their own torch optimisers;
    after each local step the schedule's push-pull events of that step in order (both move ``mixing_weight`` of the
    way to the other's model as it was), and after every ``outer_every`` steps the exact average of all, then
    torch.optim.SGD (heavy-ball, as SlowMo's slow momentum) on the anchor with ``anchor - mean``, every worker
    restarting from it."""
    from evomerge.engine import schedule

    sched = schedule.build(policy, setup.study.run.workers, setup.total_steps, seed)
    anchor = models_mod.load_row(setup.model.module(), initial_row(setup.model, seed))
    outer = torch.optim.SGD(anchor.parameters(), lr=policy.outer_lr, momentum=policy.outer_momentum)
    m, t = policy.mixing_weight, [0]

    def step(workers):  # after every local step
        t[0] += 1
        for ev in sched.events_at(t[0]):
            a, b = workers[int(sched.initiator[ev])], workers[int(sched.peer[ev])]
            for pa, pb in zip(a.parameters(), b.parameters()):
                old_a = pa.clone()
                pa.lerp_(pb, m)
                pb.lerp_(old_a, m)
        if t[0] % policy.outer_every == 0:
            restart_from_outer_step(anchor, outer, workers)

    return by_hand(setup, seed, 1, step)


SLOWMO = P(scheme="gossip", topology="ring", exchange="push_pull", mean_interval=3, mixing_weight=0.5,
           outer_optimizer="sgd", outer_lr=0.8, outer_momentum=0.6, outer_every=6)


def test_slowmo_over_gossip_equals_a_hand_written_loop(setup):
    res = simulate.simulate(setup, SLOWMO, 2, device="cpu", keep_params=True)
    ref = slowmo_by_hand(setup, 2, SLOWMO)
    diff = (res.params - ref).abs()
    assert float(diff.mean()) < 1e-6 and float(diff.max()) < NOISE_MAX, (float(diff.mean()), float(diff.max()))
    gossip = simulate.simulate(setup, dataclasses.replace(SLOWMO, outer_optimizer="none", outer_every=0), 2,
                               device="cpu", keep_params=True)
    assert float((res.params - gossip.params).abs().mean()) > 100 * float(diff.mean())  # the slow momentum moved it
    # ten exact averages more than the gossip alone, each charged as an all-reduce
    assert res.final.merges == gossip.final.merges + setup.total_steps // SLOWMO.outer_every
    assert res.final.bytes > gossip.final.bytes


def test_slowmo_without_gossip_is_diloco_and_a_population_keeps_it(setup):
    from evomerge.backends.population import Member, run_population

    quiet = dataclasses.replace(SLOWMO, mean_interval=1e6)  # no gossip event in the run
    slowmo = simulate.simulate(setup, quiet, 1, device="cpu", keep_params=True)
    diloco = simulate.simulate(setup, P(scheme="allreduce", mean_interval=6, mixing_weight=1.0, outer_optimizer="sgd",
                                        outer_lr=0.8, outer_momentum=0.6), 1, device="cpu", keep_params=True)
    assert torch.equal(slowmo.params, diloco.params)
    lockstep = simulate.simulate(setup, SLOWMO, 1, device="cpu", keep_params=True)
    member = run_population(setup, [Member(SLOWMO, 1), Member(P(), 1)], device="cpu", keep_params=True)[0]
    assert torch.equal(member.params, lockstep.params)


def test_slowmo_on_a_clock_waits_for_every_worker_at_its_exact_average(setup):
    """On a cluster with one worker 4x slower, SlowMo's exact average every 6 steps is a barrier: each one waits for
    the slow worker (its 6 steps take 6 s against 1.5 s), while plain gossip between the averages does not; a free
    cluster is the lockstep run (tests/test_timed.py holds it bit for bit)."""
    from evomerge.study import EnvSpec

    env = EnvSpec(step_time=0.25, speeds=(1.0, 1.0, 1.0, 0.25), latency=0.001, bandwidth=1e8)
    s = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env))
    slow = simulate.simulate(s, SLOWMO, 1, device="cpu")
    gossip = simulate.simulate(s, SLOWMO.replace(outer_every=0, outer_optimizer="none"), 1, device="cpu")
    assert slow.status == gossip.status == "ok"
    assert slow.final.idle_fraction > 0.3 > gossip.final.idle_fraction
    assert slow.final.steps_min == slow.final.steps_max or slow.final.steps_max - slow.final.steps_min < 6
    # blocking merges across the barrier: a worker never starts a step before its last one ended
    from evomerge.engine.timed import build_timeline

    blocking = dataclasses.replace(env, overlap="blocking", latency=0.05, bandwidth=2e6)
    s = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=blocking))
    tl = build_timeline(s, SLOWMO, 1, 0)
    for starts, ends in zip(tl.step_starts, tl.completions):
        assert all(b >= a for a, b in zip(ends, starts[1:])) and len(starts) <= len(ends) + 1


def lookahead_by_hand(setup, seed: int, every: int, outer_lr: float, momentum: float, nesterov: bool):
    """The control without merging (Lookahead, SNOO) as a user writes it: each worker has its own anchor module
    under torch.optim.SGD; every ``every`` inner steps each anchor takes the pseudo-gradient anchor - its worker,
    and the worker restarts from its anchor. Nothing is averaged."""
    start = initial_row(setup.model, seed)
    anchors = [models_mod.load_row(setup.model.module(), start) for _ in range(setup.study.run.workers)]
    outer = [torch.optim.SGD(a.parameters(), lr=outer_lr, momentum=momentum, nesterov=nesterov) for a in anchors]

    def step(workers):
        for m, a, o in zip(workers, anchors, outer):
            for pa, pm in zip(a.parameters(), m.parameters()):
                pa.grad = pa - pm
            o.step()
            for pm, pa in zip(m.parameters(), a.parameters()):
                pm.copy_(pa)

    return by_hand(setup, seed, every, step)


@pytest.mark.parametrize("kind", ["nesterov", "sgd"])
def test_snoo_each_worker_its_own_outer_step_equals_a_hand_written_loop(setup, kind):
    """scheme none with an outer step: the control that tells the outer optimiser's gain from the merging's."""
    policy = P(scheme="none", mean_interval=H, outer_optimizer=kind, outer_lr=0.7, outer_momentum=0.9)
    res = simulate.simulate(setup, policy, 2, device="cpu", keep_params=True)
    ref = lookahead_by_hand(setup, 2, H, 0.7, 0.9, kind == "nesterov")
    assert res.status == "ok" and res.final.bytes == 0 and res.final.merges == 0
    diff = (res.params - ref).abs()
    assert float(diff.mean()) < 1e-6 and float(diff.max()) < NOISE_MAX, (float(diff.mean()), float(diff.max()))
    # the workers stay apart (nothing is averaged) and the outer step moved them off plain no-merging
    alone = simulate.simulate(setup, P(scheme="none"), 2, device="cpu", keep_params=True)
    assert float((res.params - alone.params).abs().max()) > 1e-2
    assert float((res.params[0] - res.params[1]).abs().max()) > 1e-2
    assert "each worker takes its own outer" in policy.describe()


def test_lookahead_with_lr_1_and_no_momentum_is_no_merging(setup):
    plain = simulate.simulate(setup, P(scheme="none"), 5, device="cpu", keep_params=True)
    outer = simulate.simulate(setup, P(scheme="none", mean_interval=H, outer_optimizer="sgd", outer_lr=1.0,
                                       outer_momentum=0.0), 5, device="cpu", keep_params=True)
    assert torch.allclose(outer.params, plain.params, atol=1e-5)


def test_a_free_clock_and_a_population_keep_snoo_bit_for_bit(setup):
    """Each worker's own outer step after its own H-th steps: the same on a free clock (each worker's steps and
    outer steps at its own times) and in a population beside another member."""
    from evomerge.backends.population import Member, run_population
    from evomerge.study import EnvSpec

    policy = P(scheme="none", mean_interval=H, outer_optimizer="nesterov")
    lockstep = simulate.simulate(setup, policy, 1, device="cpu", keep_params=True)
    free = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.1)))
    timed = simulate.simulate(free, policy, 1, device="cpu", keep_params=True)
    member = run_population(setup, [Member(P(), 1), Member(policy, 1)], device="cpu", keep_params=True)[1]
    assert torch.equal(timed.params, lockstep.params) and torch.equal(member.params, lockstep.params)


BAD = {
    "gossip": ({"outer_optimizer": "nesterov"}, "policy.outer_every: 0 with outer_optimizer 'nesterov' over a gossip base"),
    "slowmo off gossip": ({"scheme": "allreduce", "mixing_weight": 1.0, "outer_optimizer": "sgd", "outer_every": 4},
                          "policy.outer_every: 4 applies to scheme 'gossip' with an outer_optimizer"),
    "slowmo without outer": ({"outer_every": 4}, "policy.outer_every: 4 applies to scheme 'gossip'"),
    "slowmo delta": ({"outer_optimizer": "sgd", "outer_every": 4, "payload": "delta"},
                     "policy.payload: 'delta' cannot take an outer step over a gossip base"),
    "snoo without momentum": ({"scheme": "none", "outer_optimizer": "nesterov", "outer_momentum": 0.0},
                              "policy.outer_momentum: 0 with outer_optimizer 'nesterov'"),
    "partial mix": ({"scheme": "allreduce", "mixing_weight": 0.5, "outer_optimizer": "sgd"}, "policy.mixing_weight"),
    "random lerp": ({"scheme": "allreduce", "mixing_weight": 1.0, "lerp": "random", "outer_optimizer": "sgd"},
                    "policy.lerp"),
    "delta weighted": ({"scheme": "allreduce", "mixing_weight": 1.0, "payload": "delta", "outer_optimizer": "sgd",
                        "weighting": "examples"}, "policy.weighting: 'examples' cannot take an outer step"),
    "delta gossip": ({"payload": "delta", "outer_optimizer": "sgd"}, "policy.outer_every: 0 with"),
    "nesterov without momentum": ({"scheme": "allreduce", "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                                   "outer_momentum": 0.0}, "policy.outer_momentum: 0 with outer_optimizer 'nesterov'"),
    "unknown": ({"outer_optimizer": "adam"}, "policy.outer_optimizer"),
    "lr": ({"outer_lr": 0}, "policy.outer_lr"),
    "old schema": ({"schema_version": 3, "outer_lr": 0.5}, "policy.outer_lr: is a schema 4 field"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_forbidden_combinations_are_one_line_naming_the_field(case):
    fields, words = BAD[case]
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        MergePolicy.from_dict(fields)
    assert "\n" not in str(e.value)


def test_older_policy_files_mean_what_they_meant():
    old = MergePolicy.from_dict({"schema_version": 3, "scheme": "allreduce", "mean_interval": 50})
    assert old.outer_optimizer == "none" and old.schema_version == SCHEMA_VERSION


def test_the_shipped_diloco_baseline_reads_and_says_what_it_does():
    from evomerge import study

    s = study.load("mnist-gossip")
    assert "diloco" in s.baselines
    pol = s.resolve_policy("diloco")
    assert (pol.outer_optimizer, pol.outer_lr, pol.outer_momentum) == ("nesterov", 0.7, 0.9)
    assert pol.describe() == ("all workers average every 14 steps, then an outer nesterov step (lr 0.7, momentum 0.9), "
                              "uniform weighting")


@pytest.mark.system
def test_cmaes_searches_the_outer_step_with_the_step_size(tmp_path, data_dir):
    """A user's study whose space holds the outer optimiser's fields and the inner lr: CMA-ES encodes the
    numbers, the trials run them, and off the all-reduce scheme the outer step is switched off, not failed."""
    import evomerge
    from conftest import write_study
    from evomerge import study

    f = write_study(tmp_path, name="outer")
    text = f.read_text().replace("[search.space]\n", "[search.space]\n"
                                 'scheme = { kind = "categorical", choices = ["gossip", "allreduce"] }\n'
                                 'outer_optimizer = { kind = "categorical", choices = ["none", "nesterov"] }\n'
                                 'outer_lr = { kind = "log-float", low = 0.1, high = 2.0 }\n'
                                 'outer_momentum = { kind = "float", low = 0.0, high = 0.95 }\n'
                                 'run.lr = { kind = "log-float", low = 0.02, high = 0.5 }\n')
    f.write_text(text)
    res = evomerge.search(study.load(f), n_trials=6, sampler="cmaes", runs_dir=tmp_path / "runs", seed=1,
                          data_dir=data_dir, prune=False)
    assert res.counts == {"COMPLETE": 6}
    trials = res.optuna_study.get_trials()
    assert all(t.user_attrs.get("cma_generation") is not None for t in trials)  # CMA-ES's own candidates
    for t in trials:
        pol = t.user_attrs["policy"]
        assert pol["outer_lr"] == pytest.approx(t.params["outer_lr"]) and t.user_attrs["run"]["lr"] == t.params["run.lr"]
        on = t.params["scheme"] == "allreduce" and t.params["outer_optimizer"] == "nesterov"
        assert (pol["outer_optimizer"] != "none") == on and (not on or pol["mixing_weight"] == 1.0)
    assert len({t.params["outer_lr"] for t in trials}) == 6
    assert any(t.user_attrs["policy"]["outer_optimizer"] == "nesterov" for t in trials)  # both branches ran
    assert any(t.user_attrs["policy"]["outer_optimizer"] == "none" for t in trials)


@pytest.mark.parametrize("scheme", ["allreduce", "async"])
def test_an_outer_step_after_an_average_takes_the_whole_average_where_the_file_leaves_mixing_weight_out(scheme):
    """A DiLoCo policy as one writes it (`{"scheme": "allreduce", "outer_optimizer": "nesterov", ...}`) was refused
    for mixing_weight 0.5, the gossip default, which it never named; and that line hid the file's own mistake."""
    diloco = {"scheme": scheme, "mean_interval": 10, "outer_optimizer": "nesterov", "outer_lr": 0.7,
              "outer_momentum": 0.9}
    assert MergePolicy.from_dict(diloco).mixing_weight == 1.0
    assert MergePolicy(**diloco).mixing_weight == 1.0
    with pytest.raises(ConfigError, match=r"^policy\.outer_momentum: 0 with outer_optimizer 'nesterov'"):
        MergePolicy.from_dict(diloco | {"outer_momentum": 0.0})  # the file's mistake, named first
    with pytest.raises(ConfigError, match=r"^policy\.mixing_weight: 0\.5 cannot take an outer step"):
        MergePolicy.from_dict(diloco | {"mixing_weight": 0.5})  # one the file names is its own
    assert MergePolicy.from_dict({"mean_interval": 10}).mixing_weight == 0.5  # gossip, no outer step
    if scheme == "allreduce":  # Streaming DiLoCo as one writes it, and one fragment with an alpha: the same
        assert MergePolicy.from_dict(diloco | {"fragments": 2, "fragment_delay": 1}).mixing_weight == 1.0
        assert MergePolicy.from_dict({"scheme": scheme, "mean_interval": 10, "fragment_alpha": 0.3}).mixing_weight == 1.0
        assert MergePolicy.from_dict({"scheme": scheme, "mean_interval": 10}).mixing_weight == 0.5  # plain averaging
