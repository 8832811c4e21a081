"""Golden runs: the per-round metrics and final parameters of the shipped baselines and the reference
policies, committed before the merge code was rewritten as one kernel, checked bit for bit on the CPU
with one torch thread (the thread count changes how kernels sum, so the bits), in process, on a free
simulated clock and in a population (the distributed backend is held against the in-process one by its
own tests).

The bits depend on the CPU too (its BLAS and vector kernels: an AVX-512 Xeon and the machine that first recorded
them differ in the last bits of a step, and policies that decide by similarity flip decisions from there). So the
runs are recorded per arithmetic: each file ``golden/runs*.json`` holds one machine's, known by a probe of torch
alone (``_probe``: a few SGD steps of a small MLP on one thread, hashed; the first file predates it and is known by
its no-merging run's hash). On a machine whose arithmetic has a record every run is checked bit for bit against it,
and a record whose probe matches but whose no-merging run does not fails every test (the numbers changed); on a
machine without one, each run is checked against what must hold on any machine: the free clock and the population
give the in-process run's numbers bit for bit, and the in-process run's accuracies and losses stay near a recorded
machine's (they differ by 0.007 and 0.9% between the two recorded CPUs).

``python tests/test_golden.py --write`` records this machine's arithmetic again (into the file of its canary);
do that only for a change that is meant to change the numbers, on every recorded arithmetic, and say why in the
commit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import DATA_DIR, tiny_study  # noqa: E402
from test_backends_inprocess import POLICIES as REFERENCE  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden" / "runs.json"  # the first machine's arithmetic
CLOCK_FIELDS = ("sim_time", "steps_min", "steps_mean", "steps_max", "idle_fraction", "staleness", "time_to_target",
                "accuracy_at_time", "loss_at_time", "perplexity_at_time")
NEAR = 0.02  # an arithmetic without a record: its in-process accuracies within this of a recorded machine's
NEAR_LOSS = 0.03  # and its losses within this fraction
BASELINES = ["no-merging", "fedavg", "allreduce", "ring-gossip"]
SEED = 3


def _setup(mnist):
    from evomerge import simulate

    return simulate.prepare(tiny_study(workers=6, rounds=4), data=mnist)


def _policies(setup):
    out = {name: setup.study.resolve_policy(name) for name in BASELINES}
    out.update(REFERENCE)
    return out


def _record(res) -> dict:
    hist = [{k: v for k, v in dataclasses.asdict(h).items() if k != "wall_time" and v is not None} for h in res.history]
    return {"status": res.status, "history": hist,
            "params": hashlib.sha256(res.params.contiguous().numpy().tobytes()).hexdigest()}


def _timed(policy) -> bool:
    from evomerge.policy import TIMED_UNSUPPORTED

    return not any(getattr(policy, f) for f in TIMED_UNSUPPORTED)


def _run(setup, policy, mode: str) -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_on_one_thread(setup, policy, mode)
    finally:
        torch.set_num_threads(threads)


def _run_on_one_thread(setup, policy, mode: str) -> dict:
    from evomerge import simulate
    from evomerge.backends.population import Member, run_population
    from evomerge.study import EnvSpec

    if mode == "inprocess":
        return _record(simulate.simulate(setup, policy, SEED, device="cpu", keep_params=True))
    if mode == "clock":
        env = dataclasses.replace(setup, study=dataclasses.replace(setup.study, environment=EnvSpec(step_time=0.25)))
        rec = _record(simulate.simulate(env, policy, SEED, device="cpu", keep_params=True))
        for h in rec["history"]:  # the clock's own fields; the rest must be the lockstep run's
            for k in CLOCK_FIELDS:
                h.pop(k, None)
        return rec
    if mode == "population":
        return _record(run_population(setup, [Member(policy, SEED)], device="cpu", keep_params=True)[0])
    raise ValueError(mode)


MODES = ("inprocess", "clock", "population")


def _cases(policies):
    return [(name, mode) for name, pol in policies.items() for mode in MODES if mode != "clock" or _timed(pol)]


def _names():
    from evomerge.policy import MergePolicy  # noqa: F401  (imported lazily at collection)

    return [n for n in BASELINES] + list(REFERENCE)


def recorded() -> dict[Path, dict]:
    """Every recorded arithmetic's runs, by file (``_probe``: its probe, where recorded)."""
    return {f: json.loads(f.read_text()) for f in sorted(GOLDEN.parent.glob("runs*.json"))}


def runs_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("_")}


def probe() -> str:
    """This machine's arithmetic, by torch alone (no evomerge code, so that a change of evomerge's numbers cannot
    change it): five SGD steps of a 784-64-10 MLP on fixed random data, on one thread, hashed."""
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)
        ps = [(torch.randn(*shape, generator=g) * 0.05).requires_grad_() for shape in ((64, 784), (64,), (10, 64),
                                                                                      (10,))]
        opt = torch.optim.SGD(ps, lr=0.1)
        for _ in range(5):
            F.cross_entropy(F.linear(F.relu(F.linear(x, ps[0], ps[1])), ps[2], ps[3]), y).backward()
            opt.step()
            opt.zero_grad()
        return hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in ps]).numpy().tobytes()).hexdigest()
    finally:
        torch.set_num_threads(threads)


def canary(setup) -> str:
    """The hash of this machine's no-merging run's final parameters."""
    return _run(setup, _policies(setup)["no-merging"], "inprocess")["params"]


def mine(setup) -> tuple[Path | None, dict | None]:
    """This machine's record (its file and runs), or (None, None) where its arithmetic has none; fails where the
    record of its probe holds another no-merging run (evomerge's numbers changed)."""
    here, nm = probe(), canary(setup)
    for f, record in recorded().items():
        if record["no-merging/inprocess"]["params"] == nm and record.get("_probe") in (None, here):
            return f, runs_of(record)
    for f, record in recorded().items():
        if record.get("_probe") == here:
            pytest.fail(f"{f.name} records this machine's arithmetic (probe {here[:12]}), and its no-merging run is "
                        "not this one's: the numbers changed; if that is meant, record them again with "
                        "`python tests/test_golden.py --write` on every recorded arithmetic")
    return None, None


@pytest.fixture(scope="module")
def setup(mnist):
    return _setup(mnist)


@pytest.fixture(scope="module")
def golden(setup):
    """This machine's recorded runs, or None where its arithmetic has no record."""
    return mine(setup)[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", _names())
def test_runs_keep_their_golden_numbers(setup, golden, name, mode):
    policy = _policies(setup)[name]
    key = f"{name}/{mode}"
    if mode == "clock" and not _timed(policy):
        assert all(key not in record for record in recorded().values())
        return
    got = _run(setup, policy, mode)
    if golden is not None:
        want = golden[key]
        assert got["status"] == want["status"]
        assert got["history"] == want["history"], key  # exact: floats written by json round-trip
        assert got["params"] == want["params"], key
        return
    # an arithmetic without a record: the invariants any machine keeps
    if mode != "inprocess":  # (the clock's own fields are left out of its record)
        assert got == _run(setup, policy, "inprocess"), key
        return
    for record in recorded().values():
        want = record[key]
        assert got["status"] == want["status"]
        assert len(got["history"]) == len(want["history"])
        for a, b in zip(got["history"], want["history"]):
            assert abs(a["val_accuracy"] - b["val_accuracy"]) <= NEAR, (key, a["round"], a["val_accuracy"],
                                                                       b["val_accuracy"])
            assert abs(a["val_loss"] - b["val_loss"]) <= NEAR_LOSS * abs(b["val_loss"]), (key, a["round"])


def test_a_free_clock_keeps_every_lockstep_golden():
    """A homogeneous cluster with free links is the lockstep world: its golden run is the lockstep one, on every
    recorded arithmetic."""
    for record in recorded().values():
        runs = runs_of(record)
        clocked = [k for k in runs if k.endswith("/clock")]
        assert len(clocked) >= 12
        for key in clocked:
            assert runs[key] == runs[key.replace("/clock", "/inprocess")], key


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    from evomerge import data

    mnist = data.load("mnist", DATA_DIR, val_size=1000, train_size=4000, split_seed=0)
    s = _setup(mnist)
    out = {f"{n}/{m}": _run(s, p, m) for n, p in _policies(s).items() for m in MODES if m != "clock" or _timed(p)}
    here, nm = probe(), out["no-merging/inprocess"]["params"]
    # the file of this probe, else the first file where it is this machine's (known by its no-merging run), else a new
    # one; a record of another arithmetic is left as it is (record it again on such a machine)
    records = recorded()
    path = next((f for f, r in records.items() if r.get("_probe") == here), None) or next(
        (f for f, r in records.items() if "_probe" not in r and r["no-merging/inprocess"]["params"] == nm), None) or \
        GOLDEN.with_name(f"runs-{here[:12]}.json")
    path.write_text(json.dumps(out | {"_probe": here}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(out)} runs to {path}")
