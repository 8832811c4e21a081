"""Asynchronous DiLoCo (Liu et al. 2024, arXiv 2401.09135) on the simulated clock: workers push pseudo-gradients
to a server as they finish, the server's delayed Nesterov step, dynamic local updates; against synchronous
DiLoCo where they must agree, against a straggler where they must not, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_study
from evomerge import simulate, study as study_mod
from evomerge.engine import clock, kernel
from evomerge.engine.timed import Timed, async_local_steps
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy
from evomerge.study import EnvSpec

P = MergePolicy
H = 8
SYNC = dict(scheme="allreduce", mean_interval=H, mixing_weight=1.0, outer_optimizer="nesterov", outer_lr=0.7,
            outer_momentum=0.9)
ASYNC = SYNC | {"scheme": "async"}
STRAGGLER = EnvSpec(step_time=0.1, slow_workers=(3,), slow_factor=4.0, bandwidth=1e7, latency=0.001)


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(workers=4, steps=64), data=mnist)


def on(setup, env):
    return dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=env))


@pytest.mark.parametrize("outer", ["nesterov", "sgd"])
def test_simultaneous_arrivals_with_momentum_every_w_are_synchronous_diloco(setup, outer):
    free = on(setup, EnvSpec(step_time=0.1))  # equal speeds, free links: all W pushes land together
    sync = simulate.simulate(free, P(**SYNC | {"outer_optimizer": outer}), 3, device="cpu", keep_params=True)
    asyn = simulate.simulate(free, P(**ASYNC | {"outer_optimizer": outer}), 3, device="cpu", keep_params=True)
    torch.testing.assert_close(asyn.params, sync.params, rtol=1e-5, atol=1e-5)  # W sums against one mean
    assert asyn.final.val_accuracy == pytest.approx(sync.final.val_accuracy, abs=2e-3)
    # a push and a pull per worker per round, the all-reduce's bytes, but worker 0's are local (the server is its)
    assert asyn.final.bytes == sync.final.bytes * 3 // 4
    plain = simulate.simulate(free, P(**SYNC | {"outer_optimizer": "none"}), 3, device="cpu", keep_params=True)
    assert float((asyn.params - plain.params).abs().max()) > 1e-2  # the server's step is not the plain mean


def test_the_delayed_nesterov_step_by_hand():
    """N = 2: each pseudo-gradient moves the model by lr d / N at once; every second arrival the momentum takes
    the buffer's mean and the model its momentum step (Nesterov: with the new momentum)."""
    g = torch.tensor([1.0, -2.0])
    srv = kernel.AsyncServer(g, workers=3, lr=0.5, momentum=0.9, nesterov=True, every=2)
    rows = [torch.tensor([0.0, 0.0]), torch.tensor([2.0, -1.0]), torch.tensor([1.0, 1.0])]
    want, pulled, m, buf, n = g.clone(), [g.clone()] * 3, torch.zeros(2), torch.zeros(2), 0
    for w in (0, 1, 2, 0):
        got = srv.push_(rows[w].unsqueeze(0), [w]).clone()
        d = pulled[w] - rows[w]
        want = want - 0.5 * d / 2
        buf, n = buf + d, n + 1
        if n % 2 == 0:
            m = 0.9 * m + buf / 2
            want = want - 0.5 * 0.9 * m
            buf = torch.zeros(2)
        pulled[w] = want.clone()
        torch.testing.assert_close(got, want)


def test_dynamic_local_updates_give_a_4x_slower_worker_a_quarter_of_the_local_steps(setup):
    pol = P(**ASYNC, local_steps_by_speed=True)
    assert async_local_steps(pol, STRAGGLER, 4, 0) == [8, 8, 8, 2]
    assert async_local_steps(P(**ASYNC), STRAGGLER, 4, 0) == [8, 8, 8, 8]
    from evomerge.backends.inprocess import InProcess

    slow = on(setup, STRAGGLER)
    tl = Timed(slow, pol, 0, InProcess(slow, pol, 0, torch.device("cpu"))).timeline
    pushes = [[a.boundary for a in acts if a.kind == clock.ASYNC] for acts in tl.actions]
    assert pushes[3][:4] == [2, 4, 6, 8] and pushes[0][:3] == [8, 16, 24]  # the slow one's rounds are a quarter
    # arrivals line up: the slow worker's pushes are served within one of worker 0's steps of the others' (the
    # server is worker 0's: it serves at its step boundaries)
    times = [[a.time for a in acts if a.kind == clock.ASYNC] for acts in tl.actions]
    step = STRAGGLER.step_time
    assert abs(times[3][0] - times[0][0]) <= step + 1e-9
    # and at about the others' rate (each push of the slow one also waits for a transfer each way and for the server)
    assert (times[3][2] - times[3][0]) / (times[0][2] - times[0][0]) < 1.25


def test_a_straggler_stalls_synchronous_diloco_but_not_the_asynchronous_one(setup):
    slow = on(setup, STRAGGLER)
    sync = simulate.simulate(slow, P(**SYNC), 0, device="cpu").final
    asyn = simulate.simulate(slow, P(**ASYNC, local_steps_by_speed=True), 0, device="cpu").final
    assert asyn.sim_time < 0.5 * sync.sim_time and asyn.idle_fraction < 0.5 * sync.idle_fraction
    assert asyn.val_accuracy > 0.5 and asyn.steps_max > asyn.steps_min  # the fast ones did more of the work


BAD = {
    "gossip field": ({"momentum_every": 3}, "policy.momentum_every: 3 applies to scheme 'async' only; this is 'gossip'"),
    "no server step": ({"scheme": "async", "mixing_weight": 1.0},
                       "policy.outer_optimizer: 'none' with scheme 'async'"),
    "partial mix": (ASYNC | {"mixing_weight": 0.5}, "policy.mixing_weight: 0.5 cannot take an outer step"),
    "weighting": (ASYNC | {"weighting": "examples"}, "policy.weighting: 'examples' with scheme 'async'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_forbidden_combinations_are_one_line_naming_the_field(case):
    fields, words = BAD[case]
    with pytest.raises(ConfigError) as e:
        MergePolicy.from_dict(fields)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_without_a_clock_it_is_refused_in_one_line(setup, tmp_path):
    with pytest.raises(ConfigError, match=r"^policy.scheme: 'async' \(asynchronous DiLoCo\) runs on a simulated "
                                          r"cluster only"):
        simulate.simulate(setup, P(**ASYNC), 0)
    from evomerge import backends, runtime

    with pytest.raises(ConfigError, match=r"^policy.scheme: 'async' is not supported by the distributed backend"):
        backends.check_policy("distributed", P(**ASYNC))
    runtime.check_policy(P(**ASYNC), 4)  # a user's loop runs it: rank 0 is the server (tests/test_runtime.py)
    text = (study_mod.shipped_studies_dir() / "mnist-gossip.toml").read_text()
    f = tmp_path / "lockstep.toml"
    f.write_text(text.replace('choices = ["gossip", "allreduce"]', 'choices = ["gossip", "allreduce", "async"]'))
    with pytest.raises(ConfigError, match=r"^study.search.space.scheme: 'async'"):
        study_mod.load(f)
    f.write_text(text.replace('"diloco"]', '"diloco", "async-diloco"]'))
    with pytest.raises(ConfigError, match=r"^study.baselines.policies: async-diloco: 'async'"):
        study_mod.load(f)


def test_a_distributed_search_refuses_a_space_that_samples_async(tmp_path):
    from evomerge.search.config import make_config

    s = study_mod.load("mnist-stragglers")
    space = tuple(p for p in s.search.space if not p.name.startswith("fragment"))  # only the scheme is the problem
    s = dataclasses.replace(s, search=dataclasses.replace(s.search, space=space))
    with pytest.raises(ConfigError, match=r"^study.search.space.scheme: choice 'async' is not supported by the "
                                          r"distributed backend; allowed: gossip, allreduce, none"):
        make_config(s, backend="distributed", runs_dir=tmp_path)


@pytest.mark.system
def test_transfer_to_a_study_without_a_clock_leaves_out_the_async_policies_and_says_so(tmp_path, data_dir):
    import json

    import evomerge
    from conftest import write_study
    from searchutil import cli

    src = write_study(tmp_path, name="timed")
    text = src.read_text()
    text = text.replace("[search.space]\n", "[search.space]\n"
                        'scheme = { kind = "categorical", choices = ["gossip", "async"] }\n'
                        'outer_optimizer = { kind = "categorical", choices = ["nesterov"] }\n')
    src.write_text(text.replace("[objectives]", "[environment]\nstep_time = 0.1\n\n[objectives]"))
    res = evomerge.search(study_mod.load(src), n_trials=6, sampler="random", runs_dir=tmp_path / "runs", seed=2,
                          data_dir=data_dir, prune=False)
    schemes = [t.user_attrs["policy"]["scheme"] for t in res.optuna_study.get_trials()]
    assert "async" in schemes and schemes.count("gossip") >= 2
    dst = write_study(tmp_path, name="plain")
    p = cli("transfer", "--study", str(src), "--target", str(dst), "--top", "6", "--quiet", "--json", "t.json",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["rows"]) == schemes.count("gossip") and len(doc["left_out"]) == schemes.count("async")
    assert p.stdout.count("left out: policy.scheme: 'async' (asynchronous DiLoCo) runs on a simulated cluster") == \
        schemes.count("async")
