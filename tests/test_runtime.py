"""``evomerge.Merger``: a found policy in a user's own training loop, on real gloo processes.

The loop is tests/merger_loop.py, a plain PyTorch loop (the study's model as an ``nn.Module``,
``torch.optim.SGD``), launched as separate processes that set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as
torchrun does. Its results are held against evomerge's in-process engine on the same study, policy and seed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import free_port
from evomerge.engine import schedule
from evomerge import simulate, study as study_mod
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy
from forkranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
# The device of the loop's model and of the engine it is held against. CI has no GPU: cpu. On a machine with one,
# EVOMERGE_TEST_DEVICE=cuda runs these tests on the Merger's CUDA path (every rank on cuda:0, gloo between them,
# payloads staged through host memory) against the engine on CUDA.
DEVICE = os.environ.get("EVOMERGE_TEST_DEVICE", "cpu")
LOOP = Path(__file__).resolve().parent / "merger_loop.py"

USER_MLP = """
import torch.nn as nn


def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))
def bn_mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))
"""

STUDY = """
[study]
name = "merger-test"
[data]
dataset = "mnist"
val_size = 500
train_size = 2000
partition = "dirichlet"
alpha = 0.5
[model]
factory = "user_mlp:mlp"
[run]
workers = 4
batch_size = 16
steps = 40
lr = 0.1
rounds = 2
score_samples = 8
"""

POLICIES = {
    "fedavg": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0},
    "diloco": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
               "outer_lr": 0.7, "outer_momentum": 0.9},
    # DiLoCo as a search that varies the scheme exports it: carrying gossip-only values it never uses
    "diloco-as-searched": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                           "outer_lr": 0.7, "outer_momentum": 0.9, "winner_bias": 0.59, "score": "holdout",
                           "similarity_bias": 0.5},
    "snoo": {"scheme": "none", "mean_interval": 5, "outer_optimizer": "nesterov", "outer_lr": 0.7,
             "outer_momentum": 0.9},  # Lookahead / SNOO: each rank's own outer step, nothing sent
    "ring-push-pull": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3},
    "communities-push": {"scheme": "gossip", "topology": "communities", "n_communities": 2, "exchange": "push",
                         "mean_interval": 2, "mixing_weight": 0.6, "lerp": "random", "mixing_schedule": "linear",
                         "mixing_weight_final": 0.2, "p_intra": 1.0, "p_intra_final": 0.0,
                         "p_intra_schedule": "linear"},  # communities that converge
    "complete-push-examples": {"scheme": "gossip", "topology": "complete", "exchange": "push", "mean_interval": 1.5,
                               "weighting": "examples"},
    "ring-adaptive": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                      "weighting": "adaptive"},
    "allreduce-adaptive": {"scheme": "allreduce", "mean_interval": 4, "mixing_weight": 0.5, "weighting": "adaptive"},
    "ring-winner": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                    "winner_bias": 0.6, "score": "running"},
    "ring-winner-holdout": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                            "winner_bias": 0.6},  # score "holdout", the default: as mnist-gossip searches it
    "complete-push-winner-holdout": {"scheme": "gossip", "topology": "complete", "exchange": "push",
                                     "mean_interval": 1.5, "winner_bias": 0.8, "score": "holdout",
                                     "lerp": "random", "weighting": "examples"},
    "complete-push-winner": {"scheme": "gossip", "topology": "complete", "exchange": "push", "mean_interval": 1.5,
                             "winner_bias": 0.5, "score": "running", "weighting": "adaptive"},
    # Streaming DiLoCo: the user's MLP has 4 parameter tensors; fragments in flight while the loop trains
    "streaming-diloco": {"scheme": "allreduce", "mean_interval": 8, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                         "fragments": 2, "fragment_delay": 2, "fragment_alpha": 0.25},
    "streaming-strided": {"scheme": "allreduce", "mean_interval": 8, "mixing_weight": 1.0, "fragments": 2,
                          "fragment_pattern": "strided", "fragment_delay": 1, "outer_optimizer": "nesterov"},
    "streaming-4": {"scheme": "allreduce", "mean_interval": 8, "mixing_weight": 1.0, "fragments": 4,
                    "fragment_delay": 1},
    # delta payloads: each rank's compressed change since its public copy goes to every rank that keeps that copy
    "ring-topk-delta": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 2,
                        "payload": "delta", "topk_fraction": 0.1},
    "complete-push-delta-4bit": {"scheme": "gossip", "topology": "complete", "exchange": "push", "mean_interval": 1.5,
                                 "payload": "delta", "topk_fraction": 0.25, "quantize_bits": 4,
                                 "weighting": "examples"},
    "regular-delta-winner": {"scheme": "gossip", "topology": "random_regular", "degree": 2, "exchange": "push_pull",
                             "mean_interval": 2, "payload": "delta", "topk_fraction": 0.5, "winner_bias": 0.5,
                             "score": "running", "weighting": "adaptive"},
    # uncompressed deltas (the whole change sent): the weightings and the winner test on public copies, exactly
    "complete-push-delta-examples": {"scheme": "gossip", "topology": "complete", "exchange": "push",
                                     "mean_interval": 1.5, "payload": "delta", "topk_fraction": 1.0,
                                     "weighting": "examples"},
    "regular-delta-winner-whole": {"scheme": "gossip", "topology": "random_regular", "degree": 2,
                                   "exchange": "push_pull", "mean_interval": 2, "payload": "delta",
                                   "topk_fraction": 1.0, "winner_bias": 0.5, "score": "running",
                                   "weighting": "adaptive"},
    # the all-reduce scheme with deltas: each rank's compressed change all-gathered, the public copies averaged
    "fedavg-delta-whole": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 0.5, "payload": "delta",
                           "topk_fraction": 1.0},
    "fedavg-topk-delta": {"scheme": "allreduce", "mean_interval": 4, "mixing_weight": 1.0, "payload": "delta",
                          "topk_fraction": 0.2, "quantize_bits": 8},
    # DiLoCo's outer gradients compressed (MuLoCo): each rank's change since its public copy (the anchor less what it
    # owes), all-gathered; uncompressed it is DiLoCo
    "diloco-delta-whole": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                           "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "delta", "topk_fraction": 1.0},
    "diloco-topk-4bit": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                         "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "delta", "topk_fraction": 0.3,
                         "quantize_bits": 4},
    # SlowMo over a gossip base: push-pull ring gossip, and every 10 steps an exact average and a heavy-ball step
    "slowmo-ring": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                    "mixing_weight": 0.5, "outer_optimizer": "sgd", "outer_lr": 0.8, "outer_momentum": 0.6,
                    "outer_every": 10},
    # asynchronous DiLoCo: rank 0 serves the pushes (the server at worker 0's node, as on the simulated clock)
    "async-diloco": {"scheme": "async", "mean_interval": 5, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                     "outer_lr": 0.7, "outer_momentum": 0.9},
    "async-by-speed": {"scheme": "async", "mean_interval": 8, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                       "outer_lr": 0.5, "outer_momentum": 0.8, "momentum_every": 2, "local_steps_by_speed": True},
    # the synchronous rival compressed to scaled signs (EF-signSGD's compressor on each rank's change)
    "allreduce-sign": {"scheme": "allreduce", "mean_interval": 1, "mixing_weight": 1.0, "payload": "delta",
                       "quantize_bits": 1},
}
# Compressed payloads are discontinuous in the model (which coordinates are the top k, where stochastic rounding
# falls): float noise moves them, and the run amplifies it. The engine itself moves as much when its lr changes by
# one part in a million; their mechanics are checked exactly without training (the by-hand replay below).
COMPRESSED = ["ring-topk-delta", "complete-push-delta-4bit", "regular-delta-winner", "fedavg-topk-delta",
              "allreduce-sign", "diloco-topk-4bit"]
# the optimiser's state averaged with the parameters: the study's optimiser is SGD with momentum, or AdamW
STATE_POLICIES = {
    "ring-state": {"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                   "optimizer_state": "average"},
    "complete-push-state-adaptive": {"scheme": "gossip", "topology": "complete", "exchange": "push",
                                     "mean_interval": 1.5, "optimizer_state": "average", "weighting": "adaptive"},
    "fedavg-state": {"scheme": "allreduce", "mean_interval": 5, "mixing_weight": 0.5, "optimizer_state": "average",
                     "weighting": "examples"},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("merger")
    (d / "user_mlp.py").write_text(USER_MLP)
    (d / "study.toml").write_text(STUDY)
    for name, p in POLICIES.items():
        (d / f"{name}.json").write_text(json.dumps(p))
    return d


@pytest.fixture(scope="module")
def setup(folder, data_dir):
    return simulate.prepare(study_mod.load(folder / "study.toml"), data_dir=data_dir)


def launch(folder: Path, data_dir, out: Path, *args, world: int = 4, timeout: float = 240,
           env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
    """The loop on ``world`` processes, as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ... set; forked
    from one interpreter that imported torch once, tests/forkranks.py); each rank's exit status and output."""
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--study", folder / "study.toml", "--data-dir", data_dir, "--out", out, "--device", DEVICE, *args]
    return run_ranks(LOOP, [argv] * world, logs=out, timeout=timeout,
                     env=dict(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(env_extra or {})),
                     rank_env=[dict(RANK=r, LOCAL_RANK=r) for r in range(world)])


def policies(folder, names):
    return [a for n in names for a in ("--policy", folder / f"{n}.json")]


def lockstep_run_of(tmp_path: Path, data_dir, study_text: str, names: list[str], pols: dict):
    """A study of the user's MLP file (``study_text``) with the policies ``names`` (from ``pols``) in a folder of
    its own, the loop run on them lockstep on 4 ranks (every rank checked to end well): its output folder, and the
    engine's setup of the same study."""
    d = tmp_path / "study"
    d.mkdir()
    (d / "user_mlp.py").write_text(USER_MLP)
    (d / "study.toml").write_text(study_text)
    for name in names:
        (d / f"{name}.json").write_text(json.dumps(pols[name]))
    out = tmp_path / "out"
    ranks = launch(d, data_dir, out, *policies(d, names), "--overlap", "lockstep")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    return out, simulate.prepare(study_mod.load(d / "study.toml"), data_dir=data_dir)


def result(out: Path, i: int, rank: int = 0) -> dict:
    return torch.load(out / f"result-{i}-{rank}.pt", weights_only=False)


FREE_CLOCK = study_mod.EnvSpec(step_time=0.05)  # equal speeds, free links: every push of a step arrives together


def engine_consensus(setup, name: str, seed: int = 0) -> torch.Tensor:
    if POLICIES[name]["scheme"] == "async":  # asynchronous DiLoCo runs on a simulated clock only
        setup = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=FREE_CLOCK))
    res = simulate.simulate(setup, MergePolicy.from_dict(POLICIES[name]), seed, device=DEVICE, keep_params=True)
    return res.params.mean(0).cpu()


def trace(out: Path, i: int, rank: int) -> list[dict]:
    return [json.loads(ln) for ln in (out / f"trace-{i}" / f"rank-{rank}.jsonl").read_text().splitlines()]


# -- identity with the engine -------------------------------------------------------------------------
IDENTITY = ["fedavg", "diloco", "diloco-as-searched", "snoo", "ring-push-pull", "communities-push", "complete-push-examples", "ring-adaptive",
            "allreduce-adaptive", "ring-winner", "ring-winner-holdout", "complete-push-winner-holdout", "complete-push-winner", "streaming-diloco", "streaming-4", "streaming-strided",
            "ring-topk-delta", "complete-push-delta-4bit", "regular-delta-winner", "complete-push-delta-examples",
            "regular-delta-winner-whole", "fedavg-delta-whole", "fedavg-topk-delta", "async-diloco",
            "diloco-delta-whole", "diloco-topk-4bit", "slowmo-ring"]


@pytest.fixture(scope="module")
def lockstep_run(folder, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    ranks = launch(folder, data_dir, out, *policies(folder, IDENTITY), "--overlap", "lockstep")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    return out


@pytest.mark.xdist_group("merger-lockstep-run")  # one worker computes the module fixture they share
@pytest.mark.system
def test_merger_in_a_users_loop_gives_the_engines_consensus(setup, lockstep_run):
    """SGD, the study's data order, equal speeds: the 4 ranks' consensus is the in-process run's, for FedAvg,
    DiLoCo's outer step, push and push-pull gossip, random lerps on a mixing schedule, every weighting, and the
    winner-biased lerp on the running score (from the losses the loop passes to step())."""
    for i, name in enumerate(IDENTITY):
        got = result(lockstep_run, i)["consensus"]
        want = engine_consensus(setup, name)
        if name in COMPRESSED:  # as close as the engine is to itself at lr x (1 + 1e-6)
            nudged = dataclasses.replace(setup.study, run=dataclasses.replace(setup.study.run,
                                                                              lr=setup.study.run.lr * (1 + 1e-6)))
            other = simulate.simulate(simulate.prepare(nudged, data=setup.data), MergePolicy.from_dict(POLICIES[name]),
                                      0, device=DEVICE, keep_params=True).params.mean(0).cpu()
            spread = float((other - want).abs().mean())
            assert float((got - want).abs().mean()) <= 3 * spread + 1e-6, (name, float((got - want).abs().mean()), spread)
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        for r in range(1, 4):  # finish() leaves the same consensus on every rank
            torch.testing.assert_close(result(lockstep_run, i, r)["consensus"], got, rtol=0, atol=0)
    # the runs differ from each other: the comparison can fail
    assert not torch.allclose(result(lockstep_run, 0)["consensus"], result(lockstep_run, 1)["consensus"], atol=1e-3)


def replay_async(setup, policy: dict, batches: list[list[int]], local: list[int], seed: int = 0) -> torch.Tensor:
    """Asynchronous DiLoCo by hand, in one process: W torch modules, each with the study's torch optimiser and data
    order, pushing (each after its next ``local[w]`` steps) to a server written out here (Liu et al. 2024's delayed
    Nesterov) in ``batches``, each served at once (every worker of a batch pulls the model after all of its
    pushes); returns the workers' mean at the end."""
    import torch.nn.functional as F

    from evomerge import reference
    from evomerge.engine.setup import batch_indices, normalise
    from evomerge.engine.state import initial_row

    run, T, W = setup.study.run, setup.total_steps, setup.study.run.workers
    row = initial_row(setup.model, seed)
    models, opts, idx = [], [], []
    @torch.no_grad()
    def put(m: torch.nn.Module, vec: torch.Tensor) -> None:  # copies (vector_to_parameters would share storage)
        o = 0
        for p in m.parameters():
            p.copy_(vec[o:o + p.numel()].view_as(p))
            o += p.numel()

    for w in range(W):
        m = setup.model.builder()
        put(m, row)
        models.append(m)
        opts.append(reference.optimizer(m, run))
        idx.append(batch_indices(setup.shards[w], run.batch_size, 0, T, seed, w))
    flat = lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).detach().clone()  # noqa: E731
    done = [0] * W

    def train(w: int, steps: int) -> None:
        for t in range(done[w], min(T, done[w] + steps)):
            bi = torch.as_tensor(idx[w][t])
            x, y = normalise(setup.data.train_x[bi], setup.data.spec), setup.data.train_y[bi]
            F.cross_entropy(models[w](x), y).backward()
            opts[w].step()
            opts[w].zero_grad()
        done[w] = min(T, done[w] + steps)

    lr, mu, N = policy["outer_lr"], policy["outer_momentum"], policy.get("momentum_every") or W
    glob = flat(models[0])
    pulled = [glob.clone() for _ in range(W)]
    momentum, buffer = torch.zeros_like(glob), torch.zeros_like(glob)
    n = 0
    for batch in batches:
        for w in batch:
            train(w, local[w])
            d = pulled[w] - flat(models[w])
            glob.add_(d, alpha=-lr / N)  # each pseudo-gradient at once
            buffer.add_(d)
            n += 1
            if n % N == 0:  # every N arrivals, the momentum of their mean
                momentum.mul_(mu).add_(buffer, alpha=1.0 / N)
                glob.add_(momentum, alpha=-lr * mu)
                buffer.zero_()
        for w in batch:
            pulled[w] = glob.clone()
            put(models[w], glob)
    for w in range(W):
        train(w, T)
    return torch.stack([flat(m) for m in models]).mean(0)


@pytest.mark.system
def test_asynchronous_diloco_in_a_users_loop_is_the_servers_order_replayed_by_hand(folder, data_dir, setup, tmp_path):
    """Real gloo ranks, rank 3 four times slower, non-blocking: rank 0 serves each push as it comes, so the fast
    ranks never wait for the slow one, and the consensus is what a by-hand loop gives when it replays the pushes in
    the order rank 0 served them. With dynamic local updates (``speeds``), the slow rank pushes after a quarter of
    the others' local steps."""
    from evomerge.engine import plan

    ranks = launch(folder, data_dir, tmp_path, *policies(folder, ["async-diloco", "async-by-speed"]), "--overlap",
                   "nonblocking", "--step-sleep", 0.01, "--slow-rank", 3, "--slow-factor", 4, "--speeds", 1, 1, 1, 0.25)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    T = setup.total_steps
    for i, name in enumerate(["async-diloco", "async-by-speed"]):
        pol = POLICIES[name]
        H = round(pol["mean_interval"])
        local = plan.steps_by_speed(H, [1, 1, 1, 4]) if pol.get("local_steps_by_speed") else [H] * 4
        assert [result(tmp_path, i, r)["merges"] for r in range(4)] == [T // h for h in local]
        batches = result(tmp_path, i)["arrivals"]
        arrivals = [w for b in batches for w in b]
        assert sorted(arrivals) == sorted(w for w in range(4) for _ in range(T // local[w]))
        if name == "async-diloco":  # rank 1 did all its pushes before the slow rank 3 did all of its
            assert arrivals[:max(k for k, w in enumerate(arrivals) if w == 1)].count(3) < T // H, arrivals
        else:
            assert local == [8, 8, 8, 2]
        got = result(tmp_path, i)["consensus"]
        want = replay_async(setup, pol, batches, local)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        for r in range(1, 4):
            torch.testing.assert_close(result(tmp_path, i, r)["consensus"], got, rtol=0, atol=0)
    # another order gives another model: the comparison can fail
    order = [[w] for b in result(tmp_path, 0)["arrivals"] for w in b]
    assert not torch.allclose(replay_async(setup, POLICIES["async-diloco"], sorted(order, key=lambda b: b == [3]),
                                           [5] * 4), result(tmp_path, 0)["consensus"], atol=1e-4)


@pytest.mark.system
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_merger_averages_the_optimizers_state_as_the_engine(folder, data_dir, tmp_path, optimizer):
    """optimizer_state = "average": the loop's own torch optimiser (SGD with momentum, AdamW) has its state lerped
    with the parameters' weights (per coordinate under adaptive weighting; Adam's step counts by the move) in gossip
    and all-reduce, lockstep: the consensus is the engine's; and it differs from keeping the state (the test can
    fail)."""
    run = "optimizer = \"sgd\"\nmomentum = 0.9" if optimizer == "sgd" else "optimizer = \"adamw\"\nweight_decay = 0.01"
    names = list(STATE_POLICIES) + ["ring-state-keep"]
    pols = dict(STATE_POLICIES, **{"ring-state-keep": dict(STATE_POLICIES["ring-state"], optimizer_state="keep")})
    out, st = lockstep_run_of(tmp_path, data_dir, STUDY.replace("lr = 0.1", "lr = 0.05\n" + run if optimizer == "sgd"
                                                                else "lr = 0.003\n" + run), names, pols)
    for i, name in enumerate(names):
        got = result(out, i)["consensus"]
        res = simulate.simulate(st, MergePolicy.from_dict(pols[name]), 0, device=DEVICE, keep_params=True)
        want = res.params.mean(0).cpu()
        # Adam divides by the root of its second moment, which amplifies float noise on a few coordinates. The
        # engine multiplies a plain nn.Sequential feature-major (W @ h^T, models.generic.sequential_plan), torch's
        # nn.Linear batch-major: the same sums in another order, whose last bits momentum carries (measured: 1.7e-5
        # on 4 of 12730 coordinates for fedavg-state; the mean, checked first, stays under 1e-6)
        tol = (5e-5 if DEVICE == "cpu" else 1e-4) if optimizer == "sgd" else 2e-3
        assert (got - want).abs().mean() < (1e-6 if optimizer == "sgd" else 2e-5), name
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    assert (result(out, 0)["consensus"] - result(out, 3)["consensus"]).abs().max() > 1e-3  # averaged != kept


@pytest.mark.system
def test_a_model_with_batchnorm_merges_its_buffers_and_sums_its_counters_as_the_engine(folder, data_dir, tmp_path):
    """A user's model with BatchNorm: its running statistics merge as the parameters do and its int64
    num_batches_tracked is summed, as the engine sums its rows' (gossip crashed: `result type Float can't be cast to
    the desired output type long int`; a scaled-sign all-reduce of deltas sent the counter compressed and left it
    at 0)."""
    names = ["ring-push-pull", "fedavg", "complete-push-delta-examples", "allreduce-sign", "fedavg-topk-delta"]
    out, st = lockstep_run_of(tmp_path, data_dir, STUDY.replace('factory = "user_mlp:mlp"', 'factory = "user_mlp:bn_mlp"'),
                              names, POLICIES)
    at = dict(zip([name for name, _ in st.model.layout], st.model.offsets))["2.num_batches_tracked"][0]
    for i, name in enumerate(names):
        res = simulate.simulate(st, MergePolicy.from_dict(POLICIES[name]), 0, device=DEVICE, keep_params=True)
        want, got = res.params.mean(0).cpu(), result(out, i)["consensus"]
        # the counter's change is left out of a compressed delta: it set the scaled sign's scale, and the engine's
        # run diverged at step 20
        assert res.status == "ok" and torch.isfinite(got).all(), name
        assert got[at] == want[at] > st.total_steps, (name, float(got[at]), float(want[at]))  # summed, not averaged
        if name not in COMPRESSED:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.xdist_group("merger-lockstep-run")  # one worker computes the module fixture they share
@pytest.mark.system
def test_the_clock_charges_the_bytes_the_merger_sends(setup, lockstep_run):
    """The simulated clock times a gossip message and an all-reduce by the engine's bytes (``plan.Bytes``): they
    are what the Merger puts on the wire, to within its few bytes of counters and metadata. The adaptive weighting's
    supports go with each payload (2x a plain one), and a weighted all-reduce sums three rows; charged as a plain
    payload, the complete-graph adaptive policy of sim_vs_real was predicted 38% early."""
    from evomerge.engine import plan

    checked = set()
    for i, name in enumerate(IDENTITY):
        p = MergePolicy.from_dict(POLICIES[name])
        if p.payload == "delta" or p.fragments > 1 or p.scheme == "none":
            continue
        cost = plan.Bytes(p, setup.model.n_params, [1] * 4)
        for r in range(4):
            for x in trace(lockstep_run, i, r):
                if x.get("kind") == "send":
                    want = cost.message(r)
                elif x.get("kind") == "allreduce":
                    want = cost.allreduce_sizes(None)[1]  # the dense rows an all-reduce sums
                else:
                    continue
                assert want <= x["bytes"] <= want + 256, (name, x, want)
                checked.add((name, p.weighting, x["kind"]))
    assert {("ring-adaptive", "adaptive", "send"), ("allreduce-adaptive", "adaptive", "allreduce"),
            ("ring-push-pull", "uniform", "send"), ("fedavg", "uniform", "allreduce")} <= checked, checked


@pytest.mark.xdist_group("merger-lockstep-run")  # one worker computes the module fixture they share
@pytest.mark.system
def test_merger_performs_the_schedules_events(setup, lockstep_run):
    """Each rank sends and receives exactly the events ``schedule.build`` draws for it, in order."""
    T = setup.total_steps
    for i, name in enumerate(IDENTITY):
        p = MergePolicy.from_dict(POLICIES[name])
        s = schedule.build(p, 4, T, 0)
        if s.scheme == "async":  # each rank's pushes to the server (rank 0), and the server's answer to each
            for r in range(1, 4):
                pushes = [x["step"] for x in trace(lockstep_run, i, r) if x.get("kind") == "send"]
                assert pushes == [int(t) for t, w in zip(s.step.tolist(), s.initiator.tolist()) if w == r], name
            answers = [x["peer"] for x in trace(lockstep_run, i, 0) if x.get("kind") == "send"]
            assert sorted(answers) == sorted(w for w in s.initiator.tolist() if w != 0) and answers
            continue
        if s.scheme != "gossip":
            for r in range(4):
                recs = [rec for rec in trace(lockstep_run, i, r) if rec.get("kind") == "allreduce"]
                # a streamed fragment lands fragment_delay steps after its event; one that would land past the
                # run's end never does (as in the engine)
                assert [x["step"] for x in recs] == [e for e in s.step.tolist() if e + p.fragment_delay <= T]
                if p.fragments > 1:
                    assert [x["fragment"] for x in recs] == s.fragment.tolist()[:len(recs)]
                    assert all(x["landed_step"] == x["step"] + p.fragment_delay for x in recs)
            continue
        push_pull = p.exchange == "push_pull"
        for r in range(4):
            recs = trace(lockstep_run, i, r)
            sent = [(x["event"], x["peer"]) for x in recs if x.get("kind") == "send"]
            got = [(x["event"], x["peer"], x["step"]) for x in recs if x.get("kind") == "recv"]
            want_sent = [(e, int(s.peer[e])) for e in range(len(s)) if s.initiator[e] == r]
            if push_pull:
                want_sent += [(e, int(s.initiator[e])) for e in range(len(s)) if s.peer[e] == r]
            want_got = [(e, int(s.initiator[e]), int(s.step[e])) for e in range(len(s)) if s.peer[e] == r]
            if push_pull:
                want_got += [(e, int(s.peer[e]), int(s.step[e])) for e in range(len(s)) if s.initiator[e] == r]
            if p.payload == "delta":  # every message also goes to the sender's other neighbours (its public copy)
                nb = [set(s.topology.neighbours(q).tolist()) for q in range(4)]
                fan = [nb[q] | {int(x) for e in range(len(s)) for x in (s.peer[e],) if s.initiator[e] == q}
                       for q in range(4)]
                assert {(ev, peer) for ev, peer in sent} == {(e, q) for e, _ in want_sent for q in fan[r] - {r}}
                got = [g for g in got if (g[0], g[1]) in {(e, x) for e, x, _ in want_got}]
            else:
                assert sorted(sent) == sorted(want_sent)
            assert sorted(got) == sorted(want_got)  # received at the event's own step (lockstep)
            averages = [x["step"] for x in recs if x.get("kind") == "allreduce"]  # SlowMo's exact averages
            assert averages == list(range(p.outer_every, T + 1, p.outer_every)) if p.outer_every else not averages
            assert result(lockstep_run, i, r)["merges"] == len(want_got) + len(averages)


@pytest.mark.system
def test_merger_mixes_exactly_as_predicted(folder, data_dir, tmp_path):
    """torch's model-averaging test: every parameter starts at the rank, nothing trains, and after each step every
    rank holds exactly what replaying the schedule by hand predicts."""
    names = ["ring-push-pull", "communities-push"]
    ranks = launch(folder, data_dir, tmp_path, *policies(folder, names), "--mixing")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    T = 40
    for i, name in enumerate(names):
        p = MergePolicy.from_dict(POLICIES[name])
        s = schedule.build(p, 4, T, 0)
        x = [torch.tensor(float(r)) for r in range(4)]
        want = []
        for step in range(1, T + 1):
            for e in s.events_at(step):
                a, b = int(s.initiator[e]), int(s.peer[e])
                w = p.mixing_weight + (p.mixing_weight_final - p.mixing_weight) * step / T \
                    if p.mixing_schedule == "linear" else p.mixing_weight
                m = w * float(s.u[e]) if p.lerp == "random" else w
                xa, xb = x[a], x[b]
                x[b] = torch.lerp(xb, xa, torch.tensor(m))
                if p.exchange == "push_pull":
                    x[a] = torch.lerp(xa, xb, torch.tensor(m))
            want.append(list(x))
        moved = 0
        for r in range(4):
            values = result(tmp_path, i, r)["values"]
            assert len(values) == T
            for k in range(T):
                assert torch.equal(values[k], torch.full_like(values[k], float(want[k][r]))), (name, r, k)
            moved += float(values[-1][0]) != float(r)
        assert moved == 4


@pytest.mark.system
def test_merger_sends_compressed_deltas_exactly_as_predicted(folder, data_dir, tmp_path):
    """Delta payloads, nothing trained: every parameter starts at distinct values, and after each step every rank
    holds exactly what replaying the schedule by hand predicts: each sender's change since its public copy, top-k
    (and 4-bit stochastic rounding with the schedule's noise), moves its public copy, which every neighbour keeps
    and the receiver merges with (error feedback: what was not sent stays in the model's distance to the copy)."""
    from evomerge.engine import ops
    from evomerge.engine import plan as plan_mod

    names = ["ring-topk-delta-uniform", "complete-push-delta-4bit-uniform", "fedavg-topk-delta-half",
             "allreduce-sign-top-half"]
    pols = {names[0]: dict(POLICIES["ring-topk-delta"], topk_fraction=0.25),
            names[1]: dict(POLICIES["complete-push-delta-4bit"], weighting="uniform"),
            names[2]: dict(POLICIES["fedavg-topk-delta"], mixing_weight=0.5, topk_fraction=0.25),
            names[3]: dict(POLICIES["allreduce-sign"], topk_fraction=0.5)}
    for name in names:
        (tmp_path / f"{name}.json").write_text(json.dumps(pols[name]))
    ranks = launch(folder, data_dir, tmp_path, *[a for n in names for a in ("--policy", tmp_path / f"{n}.json")],
                   "--mixing", "--ramp")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    T = 40
    for i, name in enumerate(names):
        p = MergePolicy.from_dict(pols[name])
        s = schedule.build(p, 4, T, 0)
        ramp = 0.37 * torch.arange(8, dtype=torch.float32)
        x = [r + ramp * (r + 1) for r in range(4)]
        pub = [x[0].clone() for _ in range(4)]  # every rank starts from rank 0's model: the public copies

        def send(w, e, side):
            gen = plan_mod.quant_generator(0, e, side) if p.quantize_bits else None
            pub[w] = pub[w] + ops.compress(x[w] - pub[w], p.topk_fraction, p.quantize_bits, gen)

        want = []
        for step in range(1, T + 1):
            for e in s.events_at(step):
                if s.scheme == "allreduce":  # every rank sends (side: its rank) and moves to the copies' mean
                    for w in range(4):
                        send(w, e, w)
                    avg = torch.stack(pub).sum(0) / 4
                    x = [torch.lerp(v, avg, p.mixing_weight) for v in x]
                    continue
                a, b = int(s.initiator[e]), int(s.peer[e])
                send(a, e, 0)
                if p.exchange == "push_pull":
                    send(b, e, 1)
                    x[a], x[b] = torch.lerp(x[a], pub[b], p.mixing_weight), torch.lerp(x[b], pub[a], p.mixing_weight)
                else:
                    x[b] = torch.lerp(x[b], pub[a], p.mixing_weight)
            want.append([v.clone() for v in x])
        for r in range(4):
            values = result(tmp_path, i, r)["values"]
            assert len(values) == T
            for k in range(T):
                if p.scheme == "allreduce" or DEVICE != "cpu":  # the copies' sum is a running total there; CUDA's
                    # kernels round differently from the CPU's replay
                    torch.testing.assert_close(values[k], want[k][r], rtol=1e-5, atol=1e-5)
                else:
                    assert torch.equal(values[k], want[k][r]), (name, r, k, values[k], want[k][r])
        assert not torch.equal(want[-1][1], x[0] * 0 + (1 + ramp * 2))  # it moved


# -- time, faults, resume ---------------------------------------------------------------------------------------
@pytest.mark.system
def test_merger_with_a_slow_rank_blocking_and_nonblocking(folder, data_dir, tmp_path):
    """One rank 4x slower (it sleeps): the run completes under both overlaps (SlowMo's exact averages too, after
    the merges due), and the slow rank merges less often per second than every other rank."""
    names = ["ring-push-pull", "ring-push-pull", "ring-topk-delta", "complete-push-delta-4bit", "slowmo-ring"]
    ranks = launch(folder, data_dir, tmp_path, *policies(folder, names), "--overlap", "nonblocking", "--overlap",
                   "blocking", "--overlap", "nonblocking", "--overlap", "blocking", "--overlap", "nonblocking",
                   "--step-sleep", 0.01, "--slow-rank", 3, "--slow-factor", 4)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    for i in range(len(names)):
        rates = [result(tmp_path, i, r)["merges"] / result(tmp_path, i, r)["seconds"] for r in range(4)]
        if names[i] != "slowmo-ring":  # SlowMo's exact averages hold every rank to the slow one
            assert rates[3] < min(rates[:3]), rates
        c = [result(tmp_path, i, r)["consensus"] for r in range(4)]
        assert all(torch.equal(c[0], x) for x in c[1:])
        # the payloads were applied as they came: a staleness the lockstep world never has
        late = [x for r in range(4) for x in trace(tmp_path, i, r) if x.get("kind") == "recv" and x["step"] != x["event_step"]]
        assert late


def without_waiting_notes(stderr: str) -> str:
    """A rank's stderr less the Merger's notes of a wait that outlasts the timeout for ranks still stepping (the
    warning and the line of the loop it points at)."""
    return re.sub(r".*UserWarning: rank \d+ has waited .*\n.*\n", "", stderr)


@pytest.mark.system
def test_a_rank_far_behind_at_the_end_or_a_checkpoint_is_waited_for_while_it_steps_and_a_hung_one_is_named(
        folder, data_dir, tmp_path):
    """Gossip and asynchronous DiLoCo let a slow rank fall behind. Rank 1, 12x slower, ends its 40 steps seconds
    after rank 0, more than two timeouts (1.5 s) later: rank 0 said `rank 1 did not answer` at the end (finish())
    and at a checkpoint (state_dict()). Now it waits while rank 1 steps (each rank tells its steps through the
    process group's store), and the run ends with one consensus; ranks that end otherwise (one close(), one
    finish()) are told so in one line."""
    slow = ("--overlap", "nonblocking", "--step-sleep", 0.01, "--slow-rank", 1, "--slow-factor", 12, "--timeout", 1.5)
    from concurrent.futures import ThreadPoolExecutor

    # the three jobs at once: their ranks mostly sleep (the slow one's steps), so one after the other took 36 s
    with ThreadPoolExecutor(3) as pool:
        end = pool.submit(launch, folder, data_dir, tmp_path / "end", *policies(folder, ["ring-push-pull", "async-diloco"]),
                          *slow, world=2, timeout=120)
        checkpoint = pool.submit(launch, folder, data_dir, tmp_path / "checkpoint", *policies(folder, ["ring-push-pull"]),
                                 *slow, "--stop-at", 39, world=2, timeout=120)
        # one rank closes (a checkpoint) where the other finishes: they met at one meeting, then in different
        # collectives
        mixed = pool.submit(launch, folder, data_dir, tmp_path / "mixed", *policies(folder, ["ring-push-pull"]), *slow,
                            "--stop-at", 20, "--stop-rank", 1, world=2, timeout=120,
                            env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    out, ranks = tmp_path / "end", end.result()
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    # rank 0 says once per finish() why it waits past the timeout (it waited in silence), at the loop's line
    waited = re.findall(r"merger_loop\.py:\d+: UserWarning: rank 0 has waited \d+ s at the end of the run for rank 1, "
                        r"still stepping \(step (\d+) of 40\): it waits on while it steps; a rank silent for the "
                        r"timeout \(1\.5 s\) is named and stops the run\n +merger\.finish\(\)", ranks[0].stderr)
    # (one per finish(), the two runs' alike once: Python shows a warning's same text from the same line once)
    assert 1 <= len(waited) <= 2 and all(0 < int(k) < 40 for k in waited), ranks[0].stderr[-2000:]
    assert "has waited" not in ranks[1].stderr, ranks[1].stderr[-2000:]
    for i in range(2):
        seconds = [result(out, i, r)["seconds"] for r in range(2)]
        assert seconds[1] - seconds[0] > 2 * 1.5, seconds
        c = [result(out, i, r)["consensus"] for r in range(2)]
        assert torch.equal(c[0], c[1])
    out, ranks = tmp_path / "checkpoint", checkpoint.result()
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert [torch.load(out / f"ck-0-{r}.pt", weights_only=False)["merger"]["step"] for r in range(2)] == [39, 39]
    for r in mixed.result():
        lines = [ln for ln in without_waiting_notes(r.stderr).splitlines() if ln.strip()]
        assert r.returncode == 1 and lines == ["error: rank 1 called close(); rank 0 called finish(): every rank ends "
                                               "its Merger the same way (finish() at the run's end, close() to stop "
                                               "and resume); stopped"], r.stderr[-2000:]


@pytest.mark.system
def test_a_rank_that_stops_stepping_is_named_a_timeout_after_the_others_need_it_with_or_without_a_with_block(
        folder, data_dir, tmp_path):
    """A rank asleep at step 20 is named by the one that waits for it at the end; inside `with merger:` the error
    reaches the caller no later (__exit__ waited one more timeout for the hung rank's stop message after the roll
    call had: 3 x timeout from needing it, where deploy.md says 2)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    out = tmp_path / "hung-with"
    with ThreadPoolExecutor(2) as pool:  # both jobs at once: their ranks mostly sleep (one after the other: 29 s)
        plain = pool.submit(launch, folder, data_dir, tmp_path / "hung", *policies(folder, ["ring-push-pull"]),
                            "--overlap", "nonblocking", "--step-sleep", 0.01, "--hang-rank", 1, "--hang-at", 20,
                            "--hang-for", 8, "--timeout", 1.5, world=2, timeout=120,
                            env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
        within = pool.submit(launch, folder, data_dir, out, *policies(folder, ["ring-push-pull"]), "--overlap",
                             "nonblocking", "--step-sleep", 0.01, "--hang-rank", 1, "--hang-at", 20, "--hang-for", 14,
                             "--timeout", 4, "--with", world=2, timeout=120, env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    ranks = plain.result()
    lines = [ln for ln in ranks[0].stderr.splitlines() if ln.strip()]
    assert ranks[0].returncode == 1 and lines == ["error: rank 1 did not answer for 1.5 s (the end of the run, rank 0 "
                                                  "at local step 40); stopped"], ranks[0].stderr[-2000:]
    assert ranks[1].returncode == 1, ranks[1].stderr[-2000:]
    assert time.time() - t0 < 60
    ranks = within.result()
    assert ranks[0].returncode == 1 and "rank 1 did not answer" in ranks[0].stderr, ranks[0].stderr[-2000:]
    took = json.loads((out / "error-0.json").read_text())
    assert took["error"] - took["loop_end"] < 2 * 4 + 2 + 1, took  # two timeouts, the exit's grace, some slack


@pytest.mark.system
def test_a_worker_of_two_ranks_with_ddp_inside_merges_as_one(folder, data_dir, tmp_path):
    """4 ranks as 2 workers of 2 (dist.new_subgroups), DDP inside each worker, Merger(worker_group=...): the two
    ranks of a worker train on the worker's batches, so DDP keeps them identical, and the merges between the
    leaders give the in-process engine's run of the same study with 2 workers (FedAvg, DiLoCo's outer step and
    push-pull gossip, lockstep); gossip with the payloads applied as they come (nonblocking) completes too."""
    d = tmp_path / "two"
    d.mkdir()
    (d / "user_mlp.py").write_text(USER_MLP)
    (d / "study.toml").write_text(STUDY.replace("workers = 4", "workers = 2"))
    names = ["fedavg", "diloco", "ring-push-pull", "ring-push-pull"]
    for name in names:
        (d / f"{name}.json").write_text(json.dumps(POLICIES[name]))
    out = tmp_path / "out"
    ranks = launch(d, data_dir, out, *policies(d, names), "--worker-size", 2, "--overlap", "lockstep",
                   "--overlap", "lockstep", "--overlap", "lockstep", "--overlap", "nonblocking")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    two = simulate.prepare(study_mod.load(d / "study.toml"), data_dir=data_dir)
    for i, name in enumerate(names):
        got = [result(out, i, r)["consensus"] for r in range(4)]
        assert all(torch.equal(got[0], g) for g in got[1:]), name
        if i < 3:
            res = simulate.simulate(two, MergePolicy.from_dict(POLICIES[name]), 0, device=DEVICE, keep_params=True)
            torch.testing.assert_close(got[0], res.params.mean(0).cpu(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert result(out, i, 0)["merges"] > 0 and result(out, i, 1)["merges"] == 0  # the leaders merge
    # one Merger per worker: the traces are the leaders', as ranks 0 and 1 of 2 workers
    assert sorted(p.name for p in (out / "trace-0").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]


@pytest.mark.system
def test_a_rank_slower_than_the_timeout_at_an_all_reduce_is_named_late_by_every_rank(folder, data_dir, tmp_path):
    """3 ranks, DiLoCo's all-reduce every 5 steps; rank 1 takes over a second a step, so the others wait for it
    longer than the timeout (5 s). It came to the roll call after all, so no rank was missing, and every rank said
    `rank ? did not answer` (rank 1 too); a rank told by the other while both waited was named in its stead. Now
    every rank names rank 1, and says it was late, not gone. (Rank 1 answers the roll call at its next step, 1.6 s,
    and a loaded machine starts it later than the others: at a 2 s or 3 s timeout a full suite's run found its
    answer after the others' roll call, and named it as gone.)"""
    ranks = launch(folder, data_dir, tmp_path / "late", *policies(folder, ["diloco"]), "--overlap", "lockstep",
                   "--step-sleep", 0.02, "--slow-rank", 1, "--slow-factor", 80, "--timeout", 5, world=3, timeout=120,
                   env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    for r in range(3):
        lines = [ln for ln in ranks[r].stderr.splitlines() if ln.strip()]
        assert ranks[r].returncode == 1 and len(lines) == 1, (r, ranks[r].stderr[-2000:])
        assert re.fullmatch(r"error: rank 1 did not answer for 5 s \(.*rank \d at local step \d+\) and answered later: slower "
                            r"than the timeout allows, not gone \(a longer timeout lets it finish\); stopped",
                            lines[0]), (r, lines[0])


@pytest.mark.system
def test_a_frozen_rank_holding_the_store_is_named_by_the_others_within_the_timeout(folder, data_dir, tmp_path):
    """Under init_process_group with MASTER_ADDR (no torchrun agent) rank 0's process holds the key-value store the
    ranks tell their progress through. Rank 0 frozen (SIGSTOP: its store's thread too) at step 10: rank 1 blocked in
    a store call for ever. Now it names rank 0 within a few timeouts (3 s), before rank 0 wakes (17 s: just past the
    time it is held to, so a rank 1 that names it late fails the same, not by its waking)."""
    out = tmp_path / "frozen"
    ranks = launch(folder, data_dir, out, *policies(folder, ["ring-push-pull"]), "--overlap", "nonblocking",
                   "--step-sleep", 0.05, "--freeze-rank", 0, "--freeze-at", 10, "--freeze-for", 17, "--timeout", 3,
                   world=2, timeout=180, env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    lines = [ln for ln in ranks[1].stderr.splitlines() if ln.strip()]
    assert ranks[1].returncode == 1 and len(lines) == 1 and re.fullmatch(
        r"error: rank 0 did not answer.*; stopped", lines[0]), ranks[1].stderr[-2000:]
    frozen = json.loads((out / "frozen-0.json").read_text())["at"]
    took = json.loads((out / "error-1.json").read_text())["error"] - frozen
    assert took < 30 * 0.05 + 5 * 3, took  # its steps left, then a wait, a store call and a roll call (a timeout each)
    assert ranks[0].returncode == 1, ranks[0].stderr[-2000:]  # awake: it learns the run stopped


@pytest.mark.system
def test_a_workers_other_rank_waits_for_its_leader_while_the_leader_waits_for_a_slow_worker(folder, data_dir,
                                                                                            tmp_path):
    """2 workers of 2 ranks; worker 1 (ranks 2 and 3, DDP inside) 16x slower, so worker 0's leader waits for it at
    finish() for more than two timeouts (2.5 s), as long as it steps. Its other rank, rank 1, waited for its leader
    at most one timeout and said `the ranks of worker [0, 1] did not all answer`; now it waits while its leader does
    (the leader tells the store it is waiting), and all four ranks end with one consensus. (At 12x and 1.5 s, a slow
    step under a loaded machine's contention outlasted the timeout once.)"""
    d = tmp_path / "two"
    d.mkdir()
    (d / "user_mlp.py").write_text(USER_MLP)
    (d / "study.toml").write_text(STUDY.replace("workers = 4", "workers = 2"))
    (d / "ring-push-pull.json").write_text(json.dumps(POLICIES["ring-push-pull"]))
    out = tmp_path / "out"
    ranks = launch(d, data_dir, out, *policies(d, ["ring-push-pull"]), "--worker-size", 2, "--overlap", "nonblocking",
                   "--step-sleep", 0.01, "--slow-rank", 2, "--slow-factor", 16, "--timeout", 2.5, timeout=180,
                   env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    assert [r.returncode for r in ranks] == [0] * 4, [r.stderr[-2000:] for r in ranks]
    seconds = [result(out, 0, r)["seconds"] for r in range(4)]
    assert min(seconds[2:]) - max(seconds[:2]) > 2 * 2.5, seconds  # worker 0 waited that long at the end
    got = [result(out, 0, r)["consensus"] for r in range(4)]
    assert all(torch.equal(got[0], g) for g in got[1:])


@pytest.mark.system
@pytest.mark.parametrize("name", ["fedavg", "streaming-diloco"])
def test_a_rank_whose_data_ran_out_first_is_named_with_its_step_and_an_early_stop_everywhere_ends(
        folder, data_dir, tmp_path, name):
    """Uneven data under merges that wait for every rank: rank 1 calls finish() after 20 of 40 steps. Every rank
    ends in one line naming it and its step (all said "rank ? did not answer"; Streaming DiLoCo's final average met
    a fragment's all-reduce and gloo aborted rank 0). Every rank stopping at the same step ends as a run of 20."""
    ranks = launch(folder, data_dir, tmp_path / "uneven", *policies(folder, [name]), "--short-rank", 1, "--short-at",
                   20, "--timeout", 20, world=2, timeout=120, env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    lines = [[ln for ln in r.stderr.splitlines() if ln.strip()] for r in ranks]
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-2000:] for r in ranks]
    assert len(lines[0]) == 1 and lines[0][0].startswith("error: rank 1 called finish() after 20 of 40 steps, and this "
                                                         "rank is at local step "), lines[0]
    assert lines[1] == ["error: this rank called finish() after 20 of 40 steps, rank 0 did not stop there: under this policy "
                        "every rank calls step() as many times (total_steps), since each merge waits for every rank "
                        "(give every rank as many batches); stopped"], lines[1]
    ranks = launch(folder, data_dir, tmp_path / "early", *policies(folder, [name]), "--short-rank", -2, "--short-at", 20,
                   world=2, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    got = [result(tmp_path / "early", 0, r)["consensus"] for r in range(2)]
    assert torch.equal(got[0], got[1])


@pytest.mark.system
@pytest.mark.parametrize("name,overlap", [("ring-push-pull", "nonblocking"), ("fedavg", "lockstep"),
                                           ("async-diloco", "nonblocking")])
def test_a_killed_rank_ends_every_other_rank_with_one_line_naming_it(folder, data_dir, tmp_path, name, overlap):
    t0 = time.time()
    # torch's own start-up warnings left out (TORCH_CPP_LOG_LEVEL): under load rank 0's store can be slow to answer
    # a rank's first ping, which torch logs with a C++ stack and then retries; the lines asserted are the failure's
    ranks = launch(folder, data_dir, tmp_path, *policies(folder, [name]), "--overlap", overlap, "--step-sleep", 0.01,
                   "--die-rank", 2, "--die-at", 10, "--timeout", 5, timeout=120,
                   env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    assert time.time() - t0 < 60
    assert ranks[2].returncode == -9
    for r in (0, 1, 3):
        assert ranks[r].returncode == 1, ranks[r].stderr[-2000:]
        lines = [ln for ln in ranks[r].stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: rank 2 did not answer"), ranks[r].stderr[-2000:]
        assert lines[0].endswith("; stopped")
        # the trace so far is kept (written by line; opened before the first collective, so a rank that fails at
        # the start leaves one too: under load a rank can be more than the 5 s timeout late there); a rank that
        # trained recorded its steps
        step = int(re.search(r"local step (\d+)", lines[0]).group(1))
        recs = [json.loads(ln) for ln in (tmp_path / "trace-0" / f"rank-{r}.jsonl").read_text().splitlines()]
        assert sum("compute_s" in x for x in recs) == step, (lines[0], recs[-3:])  # one record per step() call


@pytest.mark.system
def test_a_killed_leader_of_a_worker_of_two_ranks_is_named_by_its_rank_and_worker_everywhere(folder, data_dir, tmp_path):
    """4 ranks as 2 workers of 2 (Merger(worker_group=...)); rank 2, worker 1's leader, is killed. Rank 0 named
    "rank 1" (worker 1's rank among the leaders; rank 1 was alive), and rank 1, waiting for its leader, said that
    a rank of its own worker was gone. Now the one line names rank 2 and its worker, and rank 0's line reaches
    rank 1 from its leader."""
    t0 = time.time()
    ranks = launch(folder, data_dir, tmp_path, *policies(folder, ["fedavg"]), "--overlap", "lockstep", "--step-sleep",
                   0.01, "--die-rank", 2, "--die-at", 10, "--timeout", 5, "--worker-size", 2, timeout=120,
                   env_extra={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    assert time.time() - t0 < 60
    assert ranks[2].returncode == -9
    lines = {r: [ln for ln in ranks[r].stderr.splitlines() if ln.strip()] for r in (0, 1)}
    assert [ranks[r].returncode for r in (0, 1)] == [1, 1], lines
    said = re.fullmatch(r"error: (rank 2 \(worker 1\) did not answer \(rank 0 \(worker 0\) at local step \d+\); stopped)", lines[0][0])
    assert len(lines[0]) == 1 and said, lines[0]
    assert lines[1] == [f"error: rank 0, this worker's leader, stopped: {said[1]}"], lines[1]


@pytest.mark.system
def test_merger_resumes_from_its_state_dict_as_if_never_stopped(folder, data_dir, setup, tmp_path):
    names = ["ring-winner", "complete-push-examples", "streaming-diloco", "complete-push-delta-examples",
             "async-diloco"]  # at 17 a fragment is in flight; the delta payload's public copies and message numbers
    # are carried over, and asynchronous DiLoCo's server (rank 0's)
    args = [*policies(folder, names), "--overlap", "lockstep", "--overlap", "nonblocking", "--overlap", "lockstep",
            "--overlap", "lockstep"]
    ranks = launch(folder, data_dir, tmp_path, *args, "--stop-at", 17)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert not (tmp_path / "result-0-0.pt").exists() and (tmp_path / "ck-0-3.pt").exists()
    ranks = launch(folder, data_dir, tmp_path, *args, "--resume", tmp_path)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    # lockstep: exactly the uninterrupted run's (the accumulators, counters and schedule position carried over)
    torch.testing.assert_close(result(tmp_path, 0)["consensus"], engine_consensus(setup, names[0]), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(result(tmp_path, 1)["consensus"]).all()
    torch.testing.assert_close(result(tmp_path, 2)["consensus"], engine_consensus(setup, names[2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result(tmp_path, 3)["consensus"], engine_consensus(setup, names[3]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result(tmp_path, 4)["consensus"], engine_consensus(setup, names[4]), rtol=1e-5, atol=1e-5)


@pytest.mark.system
def test_asynchronous_diloco_resumes_at_a_push_with_a_slow_rank(folder, data_dir, setup, tmp_path):
    """Non-blocking, rank 3 three times slower, stopped after step 15, where every rank pushes: rank 0's checkpoint
    holds the pushes due by then and no other (the fast ranks' empty messages as they leave are not pushes), and
    the resumed run serves the rest."""
    args = [*policies(folder, ["async-diloco"]), "--overlap", "nonblocking", "--step-sleep", 0.01, "--slow-rank", 3,
            "--slow-factor", 3, "--timeout", 20]
    ranks = launch(folder, data_dir, tmp_path, *args, "--stop-at", 15)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    ck = torch.load(tmp_path / "ck-0-0.pt", weights_only=False)["merger"]
    assert ck["server"]["arrivals"] == 4 * 3  # three pushes of each rank (after steps 5, 10 and 15)
    ranks = launch(folder, data_dir, tmp_path, *args, "--resume", tmp_path)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    T = setup.total_steps
    later = [w for b in result(tmp_path, 0)["arrivals"] for w in b]
    assert sorted(later) == sorted(w for w in range(4) for _ in range(T // 5 - 3))
    assert [result(tmp_path, 0, r)["merges"] for r in range(4)] == [T // 5] * 4
    assert torch.isfinite(result(tmp_path, 0)["consensus"]).all()


@pytest.mark.system
def test_the_deploy_example_runs_a_found_policy_under_torchrun(folder, data_dir, tmp_path):
    """examples/deploy/train.py, a plain loop (CNN, Fashion-MNIST, AdamW), launched by torchrun with one rank 3x
    slower: it ends with the consensus model's accuracy, and each rank's trace holds every step. The gossip policy
    scores its winner test on held-out examples (as mnist-gossip searches it): the example keeps them out of training."""
    import re

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(ROOT / "examples" / "deploy" / "train.py"), "--data-dir", str(data_dir), "--train-size", "2000",
            "--steps", "40", "--batch-size", "32"]
    # as `evomerge export` writes it: with the optimiser and step size it was found with, which the example trains at
    # searched with another model and 8 workers: said once, by rank 0, not by every rank
    (tmp_path / "best.json").write_text(json.dumps({"trial": 3, "study": "s", "policy": POLICIES["ring-winner-holdout"],
                                                    "run": {"optimizer": "sgd", "lr": 0.05, "weight_decay": 0.0},
                                                    "model_bytes": 407_000,
                                                    "fingerprint": {"summary": {"run.workers": 8}}}))
    r = subprocess.run(base + ["--policy", str(tmp_path / "best.json"), "--slow-rank", "1", "--slow-factor",
                               "3", "--trace", str(tmp_path / "trace")], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"consensus val accuracy (0\.\d+) after 40 steps per rank, (\d+) merges on rank 0, .* \(sgd, lr "
                  r"0\.05(; \d+ torch threads? per rank)?\)$", r.stdout, re.M)
    assert m and float(m[1]) > 0.4 and int(m[2]) > 0, r.stdout
    assert "this optimizer's lr" not in r.stderr  # trained at the found step size: no warning
    assert r.stderr.count("UserWarning: policy: trial 3 of s was searched with a model of 407.0 kB") == 1, r.stderr
    assert r.stderr.count("UserWarning: policy: trial 3 of s was searched with 8 workers (run.workers); this job has "
                          "2.") == 1, r.stderr
    for rank in (0, 1):
        recs = [json.loads(ln) for ln in (tmp_path / "trace" / f"rank-{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in recs if "compute_s" in x] == list(range(1, 41))
        assert all(x["bytes"] > 0 for x in recs if x.get("kind") in ("send", "recv"))
    # the job held to the clock as the example's job.toml says (a copy beside its train.py): calibrated from its own
    # traces, its model the example's CNN (a user had to write a study and wrap the CNN to get there)
    ex = tmp_path / "ex"
    ex.mkdir()
    for name in ("train.py", "job.toml"):
        shutil.copy(ROOT / "examples" / "deploy" / name, ex / name)
    from searchutil import cli  # (the commands' own code in this process: no Python start-up per command)

    r = cli("calibrate", "--from-trace", tmp_path / "trace", "-o", ex / "cluster.toml", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0 and "merge_time = " in (ex / "cluster.toml").read_text(), r.stderr
    r = cli("run", "--study", ex / "job.toml", "--policy", tmp_path / "best.json", "--data-dir", data_dir, "--quiet",
            "--against", tmp_path / "trace", cwd=tmp_path, data_dir=data_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"^against .*: the job took ([\d.]+) s for 40 steps a rank on 2 ranks .* the clock says ([\d.]+) s, "
                  r"([+-][\d.]+)% off$", r.stdout, re.M)
    assert m and abs(float(m[3])) < 60, r.stdout  # (its own calibration: far off is a wrong clock, not load)
    # asynchronous DiLoCo found with dynamic local updates: the same example, each rank's speed on the command line;
    # found with SGD at 0.05 and trained with --optimizer adamw: AdamW's own default step size, not SGD's
    (tmp_path / "async.json").write_text(json.dumps({"trial": 4, "study": "s", "policy": POLICIES["async-diloco"] | {
        "mean_interval": 10, "local_steps_by_speed": True}, "run": {"optimizer": "sgd", "lr": 0.05}}))
    r = subprocess.run(base + ["--policy", str(tmp_path / "async.json"), "--slow-rank", "1", "--slow-factor", "3",
                               "--speeds", "1", "0.333", "--optimizer", "adamw"], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"consensus val accuracy (0\.\d+) after 40 steps per rank, (\d+) merges on rank 0, .* \(adamw, "
                  r"lr 0\.001(; \d+ torch threads? per rank)?\)$", r.stdout, re.M)
    assert m and float(m[1]) > 0.4 and int(m[2]) == 4, r.stdout  # rank 0 pushes after every 10 of its steps
    # Ctrl-C, which torchrun passes to every rank: one line from rank 0 and status 130 from each, no rank's traceback
    # (torchrun's own report of the signal follows)
    import signal

    endless = [a if a != "40" else "100000" for a in base]  # --steps 100000
    job = subprocess.Popen(endless + ["--policy", str(tmp_path / "best.json"), "--trace", str(tmp_path / "ctrl-c")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        from searchutil import wait_for

        def stepping(k):  # two steps in the rank's trace: its first step() returned (the trace's record of a step
            # is written within it, and a loaded machine's SIGINT came while rank 0's first one waited: "local step 0")
            f = tmp_path / "ctrl-c" / f"rank-{k}.jsonl"
            return f.exists() and f.read_text().count('"compute_s"') >= 2

        assert wait_for(lambda: stepping(0) and stepping(1), timeout=120, proc=job), "the ranks never stepped"
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    said = re.findall(r"^interrupted at local step (\d+) of 100000; stopped$", err, re.M)
    assert len(said) == 1 and 0 < int(said[0]) < 100000, err[-3000:]
    assert "KeyboardInterrupt" not in err and "[rank" not in err, err[-3000:]
    assert job.returncode != 0
    (tmp_path / "bad.json").write_text(json.dumps({"scheme": "gossip", "swap_p": 0.5}))
    bad = [a if a != "2" else "1" for a in base[:6]] + base[6:]  # one process is enough to be refused
    r = subprocess.run(bad + ["--policy", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode != 0
    assert re.search(r"^error: policy\.swap_p: 0\.5 cannot run in a training loop .*; allowed: 0\.0$", r.stderr, re.M)


@pytest.mark.system
def test_the_deploy_example_says_what_is_wrong_in_one_line_and_never_waits_without_end(data_dir, tmp_path):
    """examples/deploy/train.py as a user may misuse it: started without torchrun (was torch's traceback); a shard
    smaller than one batch with --steps (the loop waited for a batch that never came, at 100% CPU, without end); a
    rank that never starts (rank 0 waited torch's 30 minutes in init_process_group, whatever --timeout said)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = [sys.executable, str(ROOT / "examples" / "deploy" / "train.py"), "--data-dir", str(data_dir),
              "--policy", "ring-gossip"]
    r = subprocess.run(script, capture_output=True, text=True, timeout=120, env={k: v for k, v in env.items()
                                                                                  if k != "RANK"})
    assert r.returncode == 2 and r.stderr.startswith("error: RANK: not set: start this script with torchrun"), r.stderr
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *script[1:]]
    r = subprocess.run(run + ["--train-size", "100", "--steps", "10"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode != 0 and ("error: --batch-size: 64 is more than a rank's shard (50 examples to train on); "
                                  "allowed: at most 50, or more --train-size") in r.stderr, r.stderr[-2000:]
    t0 = time.time()
    alone = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()))
    r = subprocess.run(script + ["--timeout", "3"], capture_output=True, text=True, timeout=120, env=alone)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert r.returncode == 1 and lines and lines[-1].startswith("error: the ranks did not all start within --timeout "
                                                                "3 s ("), r.stderr[-2000:]
    assert time.time() - t0 < 60
    # started as netlab starts ranks (RANK and WORLD_SIZE, no LOCAL_WORLD_SIZE): the two share the machine's cores
    # (each took them all: under netlab four ranks on two cores stepped 10x slower and missed their timeout)
    bare = {k: v for k, v in env.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    bare.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = [subprocess.Popen(script + ["--train-size", "200", "--steps", "4", "--batch-size", "16"],
                              env=dict(bare, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [e[-2000:] for _, e in outs]
    n = max(1, (os.cpu_count() or 1) // 2)
    assert f"; {n} torch thread{'s' * (n != 1)} per rank)" in outs[0][0], outs[0][0]


# -- bad input, at construction --------------------------------------------------------------------------------
def test_read_policy_takes_objects_dicts_policy_files_and_exports(tmp_path):
    from evomerge.runtime import read_policy

    p = MergePolicy(scheme="allreduce", mean_interval=7)
    (tmp_path / "p.json").write_text(json.dumps(p.to_dict()))
    (tmp_path / "best.json").write_text(json.dumps({"policy": p.to_dict(), "trial": 3, "study": "s"}))
    for src in (p, p.to_dict(), tmp_path / "p.json", str(tmp_path / "best.json")):
        assert read_policy(src) == p
    with pytest.raises(ConfigError, match=r"^policy: .*nope.json: no such file or shipped policy; allowed: [^?]*$"):
        read_policy(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"^policy: .*bad.json' is not JSON"):
        read_policy(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=r"^policy.topology: .*allowed"):
        read_policy({"topology": "star"})
    with pytest.raises(ConfigError, match=r"^policy: got int"):
        read_policy(3)
    # a shipped policy by name, as evomerge run --policy takes it
    assert read_policy("streaming-diloco") == MergePolicy.load(ROOT / "studies" / "policies" / "streaming-diloco.json")
    with pytest.raises(ConfigError, match=r"^policy: streaming-dilco: no such file or shipped policy; allowed: .*"
                                          r"shipped policy's name \(.*"
                                          r"streaming-diloco\).*; did you mean streaming-diloco\?$"):
        read_policy("streaming-dilco")
    # a mistyped file: the file beside it (Merger and evomerge.run() said it in two ways, and neither named it)
    (tmp_path / "found.json").write_text(json.dumps(p.to_dict()))
    with pytest.raises(ConfigError, match=rf"^policy: {re.escape(str(tmp_path))}/fuond.json: no such file or shipped "
                                          rf"policy; .*; did you mean {re.escape(str(tmp_path))}/found.json\?$"):
        read_policy(str(tmp_path / "fuond.json"))
    (tmp_path / "dir.json").mkdir()  # a folder named like a file: not offered as what it meant
    with pytest.raises(ConfigError) as e:
        read_policy(str(tmp_path / "dir.json"))
    assert "did you mean" not in str(e.value), e.value
    import evomerge
    from conftest import write_study

    st = study_mod.load(write_study(tmp_path / "st"))
    with pytest.raises(ConfigError, match=rf"^policy: {re.escape(str(tmp_path))}/fuond.json: no such file or named "
                                          rf"policy; named: .*; did you mean {re.escape(str(tmp_path))}/found.json\?$"):
        evomerge.run(st, str(tmp_path / "fuond.json"))  # (refused before any data is read)
    with pytest.raises(ConfigError, match=r"^policy: cannot read '': an empty name; allowed: a policy or an exported"):
        read_policy("")  # (it said "cannot read '.': Is a directory")
    # an exported file whose 'policy' key has a typo: it was read as a policy, and 'format' named as its unknown key
    (tmp_path / "typo.json").write_text(json.dumps({"format": 2, "trial": 3, "study": "s", "polciy": p.to_dict()}))
    said = ("an exported file (it has 'trial' and 'study') with no 'policy' key; allowed: the policy under 'policy', "
            "as evomerge export writes it; did you mean 'policy' for 'polciy'?")
    with pytest.raises(ConfigError) as e:
        read_policy(tmp_path / "typo.json")
    assert str(e.value) == f"policy: {said}"
    with pytest.raises(ConfigError) as e:  # evomerge run --policy, evomerge policy validate
        MergePolicy.load(tmp_path / "typo.json")
    assert str(e.value) == f"{tmp_path / 'typo.json'}: {said}"


@pytest.mark.unit
@pytest.mark.parametrize("run, line", [
    ({"optimizer": "lion", "lr": 0.1}, "run.optimizer: unknown 'lion'; allowed: sgd, adam, adamw"),
    ({"optimizer": "sgd", "lr": "fast"}, 'run.lr: must be a number, got str "fast"; allowed: [0, inf)'),
    ({"optimizer": "sgd", "lr": -1}, "run.lr: -1 is out of range; allowed: [0, inf)"),
    ({"optimizer": "adamw", "lr": 0.01, "betas": [0.9, 1.5]}, "run.betas: [0.9, 1.5] is out of range; allowed: two "
                                                             "numbers in [0, 1)"),
    ({"optimizer": "sgd", "learning_rate": 0.1}, "run.learning_rate: unknown key; allowed: optimizer, lr, "
                                                 "weight_decay, momentum, betas, eps; did you mean lr?"),
    ("fast", "run: must be a table, got str"),
])
def test_an_exports_run_edited_by_hand_is_refused_in_one_line_by_validate_run_and_the_merger(tmp_path, run, line):
    """(An export's "run" was never checked: policy validate said ok, run replayed it, the Merger took lr 'fast'.)"""
    from evomerge import cli
    from evomerge.runtime import read_policy_and_run

    f = tmp_path / "best.json"
    f.write_text(json.dumps({"policy": MergePolicy().to_dict(), "trial": 1, "study": "s", "run": run}))
    with pytest.raises(ConfigError) as e:
        read_policy_and_run(str(f))
    assert str(e.value) == line
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "policy", "validate", str(f)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (p.returncode, p.stderr.strip(), p.stdout) == (2, f"error: {line}", "")
    ok = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    f.write_text(json.dumps({"policy": MergePolicy().to_dict(), "trial": 1, "study": "s", "run": ok}))
    assert read_policy_and_run(str(f))[1] == ok and cli.main(["policy", "validate", str(f)]) == 0


@pytest.mark.parametrize("field,value,why", [
    ("swap_p", 0.2, "model swaps"), ("data_exchange_k", 4, "cannot travel"), ("similarity_bias", 0.5, "similarity"),
    ("stop_tol", 0.1, "the loop decides"), ("backup_workers", 1, "backup workers"),
])
def test_merger_refuses_what_a_loop_cannot_run_in_one_line(field, value, why):
    from evomerge.runtime import check_policy

    with pytest.raises(ConfigError, match=rf"^policy\.{field}: .*{why}.*; allowed: ") as e:
        extra = {"scheme": "allreduce", "mean_interval": 1, "mixing_weight": 1.0} if field == "backup_workers" else {}
        check_policy(MergePolicy(**{field: value}, **extra), 4)
    assert "\n" not in str(e.value)
    check_policy(MergePolicy(optimizer_state="reset"), 4)  # what it runs passes
    # the shipped allreduce-backup (2 backups) on 2 ranks: refused as no loop runs it, not sent to "allowed: 0..1"
    with pytest.raises(ConfigError, match=r"^policy\.backup_workers: 2 cannot run in a training loop .*; allowed: 0$"):
        check_policy(MergePolicy.load("allreduce-backup"), 2)
    check_policy(MergePolicy(optimizer_state="average", payload="delta", topk_fraction=0.1), 4)
    check_policy(MergePolicy(winner_bias=0.5, score="running"), 4)
    check_policy(MergePolicy(scheme="allreduce", payload="delta"), 4)
    # values of a gossip pair's merge that another scheme carries unused (a search varying the scheme draws them)
    check_policy(MergePolicy(scheme="allreduce", winner_bias=0.5, similarity_bias=0.5), 4)
    with pytest.raises(ConfigError, match=r"^policy\.swap_p: 0\.2 cannot run in a training loop"):  # not inert
        check_policy(MergePolicy(scheme="allreduce", swap_p=0.2, swap_confidence=0.5), 4)
    check_policy(MergePolicy(scheme="none", winner_bias=0.5, outer_optimizer="nesterov", outer_momentum=0.9), 4)
    with pytest.raises(ConfigError, match=r"^policy.weighting: 'examples' with a delta payload on the all-reduce "
                                          r"scheme .*; allowed: 'uniform'$"):
        check_policy(MergePolicy(scheme="allreduce", payload="delta", weighting="examples"), 4)
    check_policy(MergePolicy(winner_bias=0.5, score="holdout"), 4)  # runs, given the loop's held-out examples


ASYNC = {"scheme": "async", "mean_interval": 2, "mixing_weight": 1.0, "outer_optimizer": "nesterov"}
BY_SPEED = ASYNC | {"local_steps_by_speed": True}


def test_merger_checks_its_arguments_before_it_communicates(tmp_path):
    import torch.distributed as dist

    import evomerge

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^group: torch.distributed is not initialised"):
        evomerge.Merger({"scheme": "allreduce"}, model, seed=0, total_steps=10)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cases = [
            (dict(policy={"mixing_weight": 2}), r"^policy.mixing_weight: "),
            (dict(model="model"), r"^model: got str"),
            (dict(seed=-1), r"^seed: -1; allowed: an integer >= 0"),
            (dict(total_steps=0), r"^total_steps: 0"),
            (dict(overlap="async"), r"^overlap: 'async'; allowed: nonblocking, blocking, lockstep"),
            (dict(timeout=0), r"^timeout: 0"),
            (dict(timeout=float("inf")), r"^timeout: inf; allowed: seconds in \(0, 1e\+06\]$"),  # (OverflowError at the end)
            (dict(policy={"weighting": "adaptive"}), r"^optimizer: None, but weighting 'adaptive'"),
            (dict(policy={"winner_bias": 0.3}), r"^holdout: None, but policy.score 'holdout' with winner_bias 0.3 "
                                                 r"scores both models of a gossip pair on the two ranks' held-out "
                                                 r"examples; allowed: \(x, y\), .* or a policy with score 'running'$"),
            (dict(policy={"winner_bias": 0.3}, holdout=torch.zeros(4, 2)),
             r"^holdout: got Tensor; allowed: \(x, y\), two tensors with the same number of examples \(at least one\)$"),
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))),
             r"^holdout: got tensors of shapes \[\[4, 2\], \[3\]\]; allowed: \(x, y\), two tensors with the same "),
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 2), torch.zeros(4)), loss_fn="mse"),
             r"^loss_fn: got str; allowed: a function \(output, y\) -> loss, or None$"),
            # (regression targets scored by the default cross-entropy: -0 for both models, every pair tied, silently)
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 2), torch.zeros(4, 1))),
             r"^holdout: its labels are float32, and loss_fn None scores them with cross-entropy, which takes integer "
             r"classes; allowed: integer class labels, or loss_fn=a function \(output, y\) -> loss "),
            # a loss that cannot take the model's outputs: one line at once (it raised at the first merge, on one rank)
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 2), torch.zeros(4, 3, dtype=torch.long))),
             r"^holdout: scoring its first example raised \w+: .* \(the default cross-entropy; the model's "
             r"outputs \[1, 2\] for labels \[1, 3\]\); allowed: examples the model takes, and a loss_fn \(output, y\) "),
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long))),
             r"^holdout: scoring its first example raised \w+: .* \(the default cross-entropy; the model's "
             r"inputs \[1, 5\]\); allowed: "),
            (dict(policy={"winner_bias": 0.3}, holdout=(torch.zeros(4, 2), torch.zeros(4, 3)),
              loss_fn=torch.nn.functional.mse_loss), r"^holdout: scoring its first example raised \w+: .* "
                                                     r"\(mse_loss; the model's outputs \[1, 2\] for labels \[1, 3\]\)"),
            # a regression's labels [B] for outputs [B, 1]: torch's mse_loss broadcasts them to [B, B] with a warning,
            # and the run went on scoring every pair on that (the study's named losses refuse it)
            (dict(policy={"winner_bias": 0.3}, model=torch.nn.Linear(2, 1), holdout=(torch.zeros(4, 2), torch.zeros(4)),
              loss_fn=torch.nn.functional.mse_loss),
             r"^holdout: its labels have shape \[B\] and the model's outputs \[B, 1\]: mse_loss broadcasts them \(torch "
             r"warns 'Using a target size that is different to the input size'\), so the pairs would be scored on a "
             r"broadcast loss; allowed: labels of the outputs' shape \(y.unsqueeze\(1\)\)$"),
            (dict(worker_group="ranks 0-1"), r"^worker_group: 'ranks 0-1' is not a process group holding this rank"),
            (dict(group="world"), r"^group: 'world' is not a process group holding this rank; allowed: None "),
            (dict(trace=__file__), r"^trace: cannot make the folder '.*test_runtime.py': File exists; allowed: a "
                                   r"folder for the ranks' trace files"),
            (dict(worker_group=dist.group.WORLD, group=dist.group.WORLD), r"^group: set with worker_group; "),
            # asynchronous DiLoCo: speeds for dynamic local updates, one process per worker, no buffers yet
            (dict(policy=BY_SPEED, speeds=[1, 2]), r"^speeds: \[1, 2\]; allowed: 1 positive numbers, one per rank$"),
            (dict(policy=BY_SPEED, speeds=[0.0]), r"^speeds: \[0.0\]; allowed: "),
            (dict(policy=ASYNC, speeds=[1.0]), r"^speeds: given, but policy.local_steps_by_speed is false"),
            (dict(policy=BY_SPEED),
             r"^speeds: None, but policy.local_steps_by_speed scales each rank's local steps by its speed; allowed: "),
            (dict(speeds=[1.0]), r"^speeds: given, but scheme 'gossip' does not use them; allowed: None"),
            (dict(policy=ASYNC, worker_group=dist.group.WORLD), r"^worker_group: set with scheme 'async'"),
            (dict(policy=ASYNC, model=torch.nn.BatchNorm1d(2)), r"^model: has buffers \('running_mean'\); scheme "),
            # (a model cast to bfloat16 or float64 ran until its first merge, then torch's lerp raised on every rank)
            (dict(model=torch.nn.Linear(2, 2).to(torch.bfloat16)), r"^model: 'weight' is bfloat16; allowed: float32 "
                                                                   r"parameters and buffers, as the search ran them"),
            (dict(model=torch.nn.Linear(2, 2).double()), r"^model: 'weight' is float64; allowed: float32 "),
            (dict(policy=ASYNC | {"scheme": "allreduce", "payload": "delta", "quantize_bits": 4},
                  model=torch.nn.BatchNorm1d(2)), r"^policy.payload: 'delta' with an outer step on a model with buffers"),
        ]
        for kw, pattern in cases:
            args = dict(policy={"scheme": "gossip"}, model=model, seed=0, total_steps=10) | kw
            pol = args.pop("policy")
            mdl = args.pop("model")
            with pytest.raises(ConfigError, match=pattern):
                evomerge.Merger(pol, mdl, **args)
        m = evomerge.Merger({"scheme": "allreduce", "mean_interval": 2}, model, seed=0, total_steps=4)
        for _ in range(4):
            m.step()
        assert m.merges == 0 and m.finish() is model  # one worker: nothing to merge with
        m = evomerge.Merger({"scheme": "allreduce", "mean_interval": 2}, model, seed=0, total_steps=4,
                            holdout="unused")  # a holdout for a policy that does not score on one: unused, allowed
        assert m._hx is None and m.finish() is model
        x, y = torch.randn(5, 2), torch.tensor([0, 1, 1, 0, 1])
        m = evomerge.Merger({"winner_bias": 0.3}, model, seed=0, total_steps=4, holdout=(x, y))
        assert torch.equal(m._hx, x.unsqueeze(0)) and torch.equal(m._hy, y.unsqueeze(0))  # every rank's: this one's
        with torch.no_grad():  # the winner test's side: this model's cross-entropy on both ranks' holdouts, eval mode
            want = float(torch.nn.functional.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])))
            task = evomerge.task.Task()  # the engine's, as a search scored the pair
            task.ignores = True
            ours = float(task.module_loss(model(torch.cat([x, x])), torch.cat([y, y])))
        model.train()
        assert m._holdout_loss(0, 0) == ours == pytest.approx(want, rel=1e-6) and model.training
        for _ in range(4):
            m.step()  # no loss needed: the holdout scores the models
        net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        net[1].eval()  # a loop that freezes its BatchNorm: the winner test leaves it in eval mode
        b = evomerge.Merger({"winner_bias": 0.3}, net, seed=0, total_steps=4, holdout=(x, y))
        stats = net[1].running_mean.clone()
        b._holdout_loss(0, 0)
        assert net.training and net[0].training and not net[1].training
        assert torch.equal(net[1].running_mean, stats)
        b.close()
        # a language model's holdout (a label per position, logits [N, T, C]): the default loss scores it as the
        # engine does, -100 left out (torch's cross_entropy raised "Expected target size" at the first merge)
        lm = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11))
        tx = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
        ty = tx.roll(-1, 1)
        ty[:, -1] = -100
        c = evomerge.Merger({"winner_bias": 0.3}, lm, seed=0, total_steps=4, holdout=(tx, ty))
        with torch.no_grad():
            logits = lm(torch.cat([tx, tx]))
            want = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11),
                                                           torch.cat([ty, ty])[:, :-1].reshape(-1)))
        assert c._holdout_loss(0, 0) == pytest.approx(want, rel=1e-6)
        c.close()
        # classes on dimension 1 ([N, C, L] against [N, L]), as torch's cross_entropy takes them: scored as before
        seg = torch.nn.Conv1d(2, 3, 1)
        sx, sy = torch.randn(4, 2, 5), torch.randint(0, 3, (4, 5), generator=torch.Generator().manual_seed(1))
        c = evomerge.Merger({"winner_bias": 0.3}, seg, seed=0, total_steps=4, holdout=(sx, sy))
        with torch.no_grad():
            want = float(torch.nn.functional.cross_entropy(seg(torch.cat([sx, sx])), torch.cat([sy, sy])))
        assert c._holdout_loss(0, 0) == pytest.approx(want, rel=1e-6)
        c.close()
        # a forward that draws random numbers in eval mode too: the check at construction leaves the loop's
        # generator where it was (a seeded run drew one number more than before)
        class Noisy(torch.nn.Linear):
            def forward(self, v):
                return super().forward(v) + torch.rand_like(v[:, :1])

        noisy = Noisy(2, 2)
        torch.manual_seed(5)
        c = evomerge.Merger({"winner_bias": 0.3}, noisy, seed=0, total_steps=4, holdout=(x, y))
        got = torch.rand(1)
        torch.manual_seed(5)
        assert torch.equal(got, torch.rand(1))
        c.close()
        with pytest.raises(ConfigError, match=r"^loss: 'high'; allowed: this step's loss, a tensor or a number, or "
                                              r"None$"):  # (float()'s ValueError)
            m.step(loss="high")
        with pytest.warns(UserWarning, match=r"^step: called more than total_steps \(4\) times; the policy's merges "
                                             r"stop there .*: give Merger\(total_steps=\) the loop's iterations$") as w:
            m.step()
        assert w[0].filename == __file__  # the loop's line (it pointed at torch's no_grad wrapper)
        m.step()  # said once
        assert m.finish() is model
        # after finish(): said so, once (it said total_steps was too small); a step's count is a number >= 0
        with pytest.warns(UserWarning, match=r"^step: called after finish\(\); the run's merges are over and this "
                                             r"step merges nothing$"):
            m.step()
        m.step()
        m = evomerge.Merger({"scheme": "allreduce", "mean_interval": 2}, model, seed=0, total_steps=4)
        for bad in (-3, float("nan"), "32"):
            with pytest.raises(ConfigError, match=r"^examples: .*; allowed: a number >= 0 \(the examples this step "
                                                  r"trained on\)$"):
                m.step(examples=bad)
        m.step(examples=torch.tensor(32))  # a count as a tensor, too
        m.close()
        m = evomerge.Merger({"scheme": "allreduce", "mean_interval": 2}, model, seed=0, total_steps=4,
                            worker_group=dist.group.WORLD)  # a worker of one rank, its own leader
        for _ in range(4):
            m.step()
        assert m.W == 1 and m.finish() is model
        m = evomerge.Merger(BY_SPEED, model, seed=0, total_steps=4, speeds=[3.0])  # one worker: its server, no pushes
        for _ in range(4):
            m.step()
        assert m.merges == 0 and m.finish() is model
        # a checkpoint: of this model and this rank (a model of other sizes failed in torch's copy_; another rank's
        # state was taken in silence); the policy's name is no difference
        diloco = {"scheme": "allreduce", "mean_interval": 2, "mixing_weight": 1.0, "outer_optimizer": "nesterov",
                  "name": "mine"}
        m = evomerge.Merger(diloco, model, seed=0, total_steps=4)
        m.step()
        st = m.state_dict()
        assert st["rank"] == 0 and st["model"] == [["weight", [2, 2]], ["bias", [2]]]
        m.load_state_dict(st | {"policy": st["policy"] | {"name": "exported", "description": "as found"}})
        m.load_state_dict(st | {"model": [["module." + n, s] for n, s in st["model"]]})  # DDP's, compile's names
        with pytest.raises(ConfigError, match=r"^state_dict.rank: the checkpoint is rank 1's; this is rank 0; allowed: "
                                              r"each rank's own checkpoint"):
            m.load_state_dict(st | {"rank": 1})
        m.close()
        other = evomerge.Merger(diloco, torch.nn.Linear(3, 2), seed=0, total_steps=4)
        with pytest.raises(ConfigError, match=r"^state_dict.model: the checkpoint's model differs from this Merger's: "
                                              r"'weight' \(2, 2\) in the checkpoint, 'weight' \(2, 3\) here; allowed: "
                                              r"a checkpoint of this model$"):
            other.load_state_dict(st)
        with pytest.raises(ConfigError, match=r"^state_dict.model: .*: 6 numbers in the checkpoint, 8 here"):
            other.load_state_dict({k: v for k, v in st.items() if k != "model"})  # saved before it said its model
        other.close()
    finally:
        dist.destroy_process_group()


def three_ranks(tmp_path: Path, script: str, case: str):
    """``script`` on three gloo ranks (a file store in ``tmp_path``; forked from one interpreter that imported torch
    once, tests/forkranks.py): each one's result (exit status, stdout, stderr), and the seconds from the last
    rank's joining the process group (the file it writes then) until all ended: not their imports, which a loaded
    machine can make longer than a Merger's timeout."""
    (tmp_path / "ranks.py").write_text(script)
    store = tmp_path / "store"
    ranks = run_ranks(tmp_path / "ranks.py", [[store, r, case] for r in range(3)], logs=tmp_path, cwd=tmp_path,
                      timeout=120)
    ended = time.time()
    joined = max(float(Path(f"{store}.joined{r}").read_text()) for r in range(3))
    return ranks, [(r.stdout, r.stderr) for r in ranks], ended - joined


@pytest.mark.integration
def test_a_loop_that_runs_every_step_but_never_calls_finish_is_warned(tmp_path):
    """(Each rank kept its own model, not the consensus, and the first to end said nothing.) The rank whose loop
    ends first warns and ends; the others, still in their last steps, stop naming it."""
    procs, outs, seconds = three_ranks(tmp_path, LEAVER, "forgot")
    assert seconds < 25, "a rank waited for the timeout"
    assert not any("terminate called" in e for _, e in outs), [e[-1500:] for _, e in outs]
    warned = [r for r, (_, e) in enumerate(outs) if
              f"RuntimeWarning: rank {r}'s Merger ran its 40 steps but was neither finished nor closed: this rank's "
              "model is its own, not the consensus; call merger.finish() after the loop" in e]
    assert warned and all(procs[r].returncode == 0 for r in warned), [e[-1500:] for _, e in outs]
    # at the loop's line that built the Merger (it pointed at evomerge's own runtime.py)
    for r in warned:
        (line,) = [ln for ln in outs[r][1].splitlines() if "neither finished nor closed" in ln]
        assert line.startswith(f"{tmp_path / 'ranks.py'}:") and "evomerge" not in line.split(": RuntimeWarning")[0], line
    for r, (o, e) in enumerate(outs):
        if r not in warned:
            m = re.fullmatch(r"error: rank ([\d, ]+) left the run without finish\(\) or close\(\) \(rank \d at local step \d+\); "
                             r"stopped", o.strip())  # the ranks that ended first, one or several
            assert procs[r].returncode == 1 and m and {int(x) for x in m[1].split(", ")} <= set(warned), (o, e[-1500:])


LONG = """
import datetime, sys, time, torch, torch.distributed as dist, evomerge
store, rank, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# a process group's timeout of 2 s (deploy.md's snippet gives one, to bound the start), a run of 4-5 s
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=3,
                        timeout=datetime.timedelta(seconds=2))
open(f"{store}.joined{rank}", "w").write(repr(time.time()))
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
policy = {"scheme": case, "topology": "ring", "mean_interval": 3}
merger = evomerge.Merger(policy, model, opt, seed=0, total_steps=40, timeout=30)
try:
    for t in range(40):
        loss = model(torch.randn(3, 4)).sum()
        loss.backward(); opt.step(); opt.zero_grad()
        time.sleep(0.1)
        merger.step(loss=loss)
    merger.finish()
    print("finished", merger.merges)
except evomerge.MergerError as e:
    print(f"error: {e}")
    import os; os._exit(1)
"""


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["gossip", "allreduce"])
def test_a_run_longer_than_the_process_groups_timeout_finishes(tmp_path, scheme):
    """(The Merger's standing receives waited under gloo's own bound, the process group's timeout: every run longer
    than it stopped, naming a healthy rank: `rank 0 did not answer (local step 4465)` after 60 s of a deploy run.)"""
    procs, outs, seconds = three_ranks(tmp_path, LONG, scheme)
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all(o.startswith("finished ") for o, _ in outs) and seconds > 4, (outs, seconds)


DISAGREE = """
import sys, time, torch, torch.distributed as dist, evomerge
store, rank, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=3)
open(f"{store}.joined{rank}", "w").write(repr(time.time()))  # for the test: when the run began
model = torch.nn.Linear(4, 3 if case == "model" and rank == 1 else 2)  # "model": rank 1 builds a wider one
x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
kw = dict(seed=0, total_steps=10, timeout=60, holdout=(x, y))
if case == "holdout":  # one rank forgets its held-out examples
    kw["holdout"] = None if rank == 1 else (x, y)
elif case == "steps":  # each rank counts its own shard's steps
    kw["total_steps"] = 10 + rank
try:
    if case in ("resume", "resume-policy"):  # "resume": rank 2's checkpoint is of a later step than the others'
        policy = {"scheme": "allreduce", "mean_interval": 5}  # (a file saved after theirs); "resume-policy": every
        merger = evomerge.Merger(policy, model, seed=0, total_steps=10, timeout=60)  # rank resumes another policy
        for t in range(3 if rank == 2 and case == "resume" else 2):
            merger.step()
        saved = merger.state_dict()
        merger.close()
        other = dict(policy, mean_interval=4) if case == "resume-policy" else policy
        evomerge.Merger(other, model, seed=0, total_steps=10, timeout=60).load_state_dict(saved)
    elif case == "resume-early":  # torch's habit: the model's state loaded first, then the Merger built (which
        policy = {"scheme": "allreduce", "mean_interval": 5}  # starts every rank from rank 0's model: the resumed
        merger = evomerge.Merger(policy, model, seed=0, total_steps=10, timeout=60)  # run went otherwise, in silence)
        with torch.no_grad():
            model.weight.fill_(float(rank))  # each rank's own model by its checkpoint (no merge due yet)
        for t in range(2):
            merger.step()
        saved, weights = merger.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
        merger.close()
        model.load_state_dict(weights)
        evomerge.Merger(policy, model, seed=0, total_steps=10, timeout=60).load_state_dict(saved)
    elif case == "worker-group":  # every rank builds the group of ranks 0 and 2, and passes it: rank 1 is outside
        group = dist.new_group([0, 2])
        evomerge.Merger({"scheme": "allreduce"}, model, seed=0, total_steps=10, timeout=60, worker_group=group)
    elif case == "policy":  # rank 1 read another policy file (and one of another name only: no difference)
        policy = {"scheme": "gossip", "winner_bias": 0.3 if rank == 1 else 0.5, "name": f"file-{rank}"}
        evomerge.Merger(policy, model, **kw)
    else:
        evomerge.Merger({"scheme": "gossip", "winner_bias": 0.5}, model, **kw)
    print("built")
except evomerge.ConfigError as e:  # as deploy.md's loop does: one line, exit 2
    print(f"error: {e}")
    sys.exit(2)
"""


@pytest.mark.integration
@pytest.mark.parametrize("case, lines", [
    ("holdout", ["error: holdout: rank 1's is unusable (its own error says why); allowed: (x, y) on every rank, two "
                 "tensors with as many examples",
                 "error: holdout: None, but policy.score 'holdout' with winner_bias 0.5 scores both models of a gossip "
                 "pair on the two ranks' held-out examples; allowed: (x, y), examples this rank does not train on (as "
                 "many on every rank), or a policy with score 'running'",
                 "error: holdout: rank 1's is unusable (its own error says why); allowed: (x, y) on every rank, two "
                 "tensors with as many examples"]),
    ("steps", [f"error: total_steps: rank {o}'s is {10 + o}, this rank's {10 + r}; allowed: the same on every rank "
               "(each rank draws the merge schedule from the policy, seed and total_steps)"
               for r, o in ((0, 1), (1, 0), (2, 0))]),
    # (the start's broadcast of models of other sizes aborted gloo, or left the larger one half overwritten)
    ("model", ["error: model: the ranks' models differ at 'weight' (parameters then buffers, in order; ranks 0, 2: "
               "[2, 4]; rank 1: [3, 4]); allowed: the same model on every rank (every rank builds it with the same "
               "sizes)"] * 3),
    # (each rank went on from its own step: merge events paired that were not the same)
    ("resume", ["error: state_dict.step: the checkpoints are of different steps (ranks 0, 1 at step 2; rank 2 at step "
                "3); allowed: the state_dicts every rank saved at the same step"] * 3),
    ("resume-early", ["error: state_dict: ranks 1, 2 refused their checkpoints (its own line says why); allowed: the "
                      "state_dict each rank saved, on every rank"]
     + [f"error: load_state_dict: rank {r}'s model is rank 0's as the Merger made it when it was built, not the one "
        "this rank saved: its state was loaded before the Merger was built (which starts every rank from rank 0's "
        "model), or not yet; allowed: build the Merger, then load the model's, the optimiser's and the Merger's "
        "state dicts, in that order" for r in (1, 2)]),
    # (the line held both policies whole: 2 kB of two dicts)
    ("resume-policy", ["error: state_dict.policy: the checkpoint's policy differs from this Merger's: mean_interval "
                       "5.0 in the checkpoint, 4.0 here; allowed: the policy the checkpoint was saved with"] * 3),
    # (it said "rank 1's is another policy": which field, the user had to find)
    ("policy", [f"error: policy: rank {o}'s is another policy (winner_bias {w[o]} there, {w[r]} here); allowed: the "
                "same on every rank (each rank draws the merge schedule from the policy, seed and total_steps)"
                for r, o, w in ((0, 1, {0: 0.5, 1: 0.3}), (1, 0, {0: 0.5, 1: 0.3}), (2, 1, {1: 0.3, 2: 0.5}))]),
    # (rank 1 said "worker_group: -100 is not a process group holding this rank", and gloo aborted the others)
    ("worker-group", ["error: worker_group: rank 1 passed a group that does not hold it (dist.new_group gives a rank "
                      "outside the group GroupMember.NON_GROUP_MEMBER); allowed: on every rank, the group of its own "
                      "worker (dist.new_subgroups, or dist.new_group of that worker's ranks)"] * 3),
])
def test_a_rank_that_disagrees_at_construction_stops_every_rank_at_once_in_one_line(tmp_path, case, lines):
    """(One rank's bad holdout was raised on that rank alone: the others waited the whole timeout, then named it as
    dead; ranks with different total_steps drew different schedules.) Every rank says why, well within the timeout."""
    procs, outs, seconds = three_ranks(tmp_path, DISAGREE, case)
    assert seconds < 40, "a rank waited for the timeout"
    assert [o.strip() for o, _ in outs] == lines, outs
    # nothing left waiting that aborts the process at its exit ("terminate called without an active exception")
    assert [p.returncode for p in procs] == [2, 2, 2], [e[-2000:] for _, e in outs]


LEAVER = """
import contextlib, os, sys, time, torch, torch.distributed as dist, evomerge
store, rank, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=3)
open(f"{store}.joined{rank}", "w").write(repr(time.time()))  # for the test: when the run began
leaver = 0 if case == "close" else 1


def main():  # the Merger lives in here: under "dropped" it is gone when the error reaches the caller
    g = torch.Generator().manual_seed(rank)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = {"scheme": "allreduce", "mean_interval": 5} if case == "close" else \\
        {"scheme": "gossip", "topology": "ring", "mean_interval": 2}
    merger = evomerge.Merger(policy, model, opt, seed=0, total_steps=40, timeout=30)
    with merger if case == "with" else contextlib.nullcontext():
        loop(merger, g, model, opt)


def loop(merger, g, model, opt):
    try:
        for t in range(40):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            time.sleep(0.01)
            merger.step(loss=loss)
            if t == (39 if case == "close" else 15) and (rank == leaver or case == "all") and case != "forgot":
                raise ValueError(f"a bug in rank {rank}'s own loop")
        if case != "forgot":  # a loop that runs every step and forgets the end
            merger.close() if case == "close" else merger.finish()
    except evomerge.MergerError as e:
        print(f"error: {e}", flush=True)
        if case in ("caught", "close", "with"):  # as deploy.md says: print the line and leave
            os._exit(1)
        raise


if case == "dropped":
    try:
        main()
    except (ValueError, evomerge.MergerError) as e:
        print(f"rank {rank}: {e}", file=sys.stderr)
        sys.exit(1)
elif case == "with":  # the process group destroyed before the process ends: the with block told the others
    try:
        main()
    finally:
        dist.destroy_process_group()
else:
    main()
"""


@pytest.mark.integration
@pytest.mark.parametrize("case", ["caught", "uncaught", "all", "dropped", "close", "with"])
def test_an_error_in_a_users_loop_ends_every_rank_without_an_abort(tmp_path, case):
    """(A rank whose own loop raised left its receives posted: the process aborted at its exit, status 134 and
    'terminate called without an active exception', and so did the others when their MergerError went uncaught.)
    The rank that leaves tells the others, which name it in one line, and every process ends with status 1: also
    where the caller dropped the Merger before the process ended, where the others were already in close(), and
    where a ``with`` block told the others before a ``finally`` destroyed the process group."""
    procs, outs, seconds = three_ranks(tmp_path, LEAVER, case)
    assert seconds < 25, "a rank waited for the timeout"
    assert [p.returncode for p in procs] == [1, 1, 1], [e[-1500:] for _, e in outs]
    assert not any("terminate called" in e for _, e in outs), [e[-1500:] for _, e in outs]
    assert not any("neither finished nor closed" in e for _, e in outs)  # the loop's error is what is said
    if case == "all":  # every rank leaves; one may first learn that another left (within the same step)
        assert all(re.search(r"(ValueError: a bug in rank \d's own loop|MergerError: rank [\d, ]+ left the run without"
                             r" finish\(\) or close\(\) \(.*\); stopped)\n$", e)
                   for _, e in outs), [e[-500:] for _, e in outs]
        return
    leaver = 0 if case == "close" else 1
    for r, (o, e) in enumerate(outs):
        if r == leaver:
            said = "rank 1: a bug in rank 1's own loop" if case == "dropped" else f"ValueError: a bug in rank {r}'s own loop"
            assert said in e and o == "", e
        else:
            assert o.splitlines() == [o.splitlines()[0]] and re.fullmatch(
                rf"error: rank {leaver} left the run without finish\(\) or close\(\) \((the end of the run, )?rank \d at local "
                r"step \d+\); stopped", o.strip()), o


@pytest.mark.unit
def test_a_model_of_another_size_than_the_exports_is_a_warning_naming_both(tmp_path):
    from evomerge.models import module_float32_bytes
    from evomerge.runtime import _read_policy, model_size_warning

    m = torch.nn.Linear(4, 3)  # 15 floats: 60 B
    p = MergePolicy(scheme="allreduce", mean_interval=7)
    (tmp_path / "best.json").write_text(json.dumps({"policy": p.to_dict(), "trial": 3, "study": "s",
                                                    "model_bytes": 4000}))
    _, _, where = _read_policy(str(tmp_path / "best.json"))
    assert where == {"study": "s", "trial": 3, "model_bytes": 4000}
    assert model_size_warning(where, m) == (
        "policy: trial 3 of s was searched with a model of 4.0 kB (float32 parameters and buffers); this model is "
        "60 B. The search judged its merges by that model's bytes and steps: search a study of this model ([model] "
        "factory, docs/own-model.md) for a policy found for it")
    assert model_size_warning(where | {"model_bytes": module_float32_bytes(m)}, m) is None  # the same size
    assert model_size_warning({"study": "s", "trial": 3}, m) is None  # an export of an older evomerge: no size
    assert model_size_warning({"model_bytes": True}, m) is None and _read_policy(p)[2] == {}
    # another count of workers than the trial's (its fingerprint's run.workers): said, as the model's size is
    from evomerge.runtime import workers_warning

    (tmp_path / "w.json").write_text(json.dumps({"policy": p.to_dict(), "trial": 3, "study": "s",
                                                 "fingerprint": {"hash": "x", "summary": {"run.workers": 8}}}))
    _, _, where = _read_policy(str(tmp_path / "w.json"))
    assert where == {"study": "s", "trial": 3, "workers": 8} and workers_warning(where, 8) is None
    assert workers_warning(where, 2) == (
        "policy: trial 3 of s was searched with 8 workers (run.workers); this job has 2. How far a merge reaches and "
        "the topology's shape change with the workers: search a study of 2 workers for a policy found for this job")
    assert workers_warning({}, 2) is None
    # a causal mask (a non-persistent buffer) is neither merged nor sent: the same size; a running mean is state
    m.register_buffer("mask", torch.ones(16, 16), persistent=False)
    assert module_float32_bytes(m) == 60 and module_float32_bytes(m, every_buffer=True) == 60 + 4 * 256
    # an export of an evomerge that counted the mask too is the same model
    assert model_size_warning({"study": "s", "trial": 3, "model_bytes": 60 + 4 * 256}, m) is None
    m.register_buffer("running", torch.zeros(3))
    assert module_float32_bytes(m) == 72
