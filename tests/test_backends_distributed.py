"""The torch.distributed backend: real gloo processes on 127.0.0.1, against the in-process backend."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import tiny_study, write_study
from evomerge import dist, simulate
from evomerge.engine import ops
from evomerge.errors import ConfigError
from evomerge.policy import MergePolicy

EVOMERGE = [sys.executable, "-m", "evomerge.cli"]

AGREEMENT = {
    "no-merging": (MergePolicy(scheme="none"), None),
    "fedavg": (MergePolicy(scheme="allreduce", mean_interval=10, weighting="examples"), None),
    "ring-push-pull": (MergePolicy(scheme="gossip", topology="ring", exchange="push_pull", mean_interval=3), None),
    "communities-winner-bias": (MergePolicy(scheme="gossip", topology="communities", n_communities=2, p_intra=0.7,
                                            winner_bias=0.6, lerp="random", mean_interval=2), None),
    "topk-delta": (MergePolicy(scheme="gossip", topology="ring", payload="delta", topk_fraction=0.1, quantize_bits=4,
                               mean_interval=2), None),
    # two workers per process: pairs inside one rank and across ranks; push only; per-coordinate supports
    "push-adaptive-2procs": (MergePolicy(scheme="gossip", topology="complete", exchange="push", winner_bias=1.0,
                                         weighting="adaptive", mean_interval=1.5), 2),
    # as a search that varies the scheme exports it: values of a gossip pair's merge, carried unused
    "fedavg-as-searched": (MergePolicy(scheme="allreduce", mean_interval=10, winner_bias=0.59, score="running",
                                       similarity_bias=0.5), None),
    "allreduce-delta-adaptive": (MergePolicy(scheme="allreduce", weighting="adaptive", mean_interval=3, payload="delta",
                                             topk_fraction=0.3), None),
    "diloco-examples": (MergePolicy(scheme="allreduce", mean_interval=5, mixing_weight=1.0, weighting="examples",
                                    outer_optimizer="nesterov"), 2),
    # Lookahead / SNOO: each worker's own outer step, two workers per process
    "snoo-2procs": (MergePolicy(scheme="none", mean_interval=4, outer_optimizer="nesterov"), 2),
    # Streaming DiLoCo between ranks: fragments on staggered steps, in flight, Nesterov on each fragment
    "streaming-2procs": (MergePolicy(scheme="allreduce", mean_interval=8, mixing_weight=1.0, outer_optimizer="nesterov",
                                     fragments=2, fragment_delay=2, fragment_alpha=0.25), 2),
    "streaming-strided": (MergePolicy(scheme="allreduce", mean_interval=6, mixing_weight=1.0, fragments=2,
                                      fragment_pattern="strided"), None),
    # SlowMo over a gossip base: push-pull ring gossip, an exact average and a heavy-ball step every 6 steps
    "slowmo-ring-2procs": (MergePolicy(scheme="gossip", topology="ring", exchange="push_pull", mean_interval=3,
                                       outer_optimizer="sgd", outer_lr=0.8, outer_momentum=0.6, outer_every=6), 2),
}


@pytest.fixture(scope="module")
def setup(mnist):
    return simulate.prepare(tiny_study(), data=mnist)


def assert_same_history(a, b, rel=1e-5):
    assert len(a.history) == len(b.history) == len(simulate.round_bounds(a.total_steps, 3))
    for x, y in zip(a.history, b.history):
        x, y = asdict(x), asdict(y)
        for key in ("round", "step", "bytes", "merges"):
            assert x[key] == y[key], key
        for key, v in x.items():
            if key in ("wall_time", "round", "step", "bytes", "merges"):
                continue
            if v is None:  # simulated time: None in the lockstep world
                assert y[key] is None, key
                continue
            assert y[key] == pytest.approx(v, rel=rel, abs=1e-6), (key, x["round"])


@pytest.mark.system
@pytest.mark.parametrize("name", list(AGREEMENT))
def test_distributed_agrees_with_inprocess(setup, name):
    policy, procs = AGREEMENT[name]
    a = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    rounds = []
    b = dist.simulate(setup, policy, 3, device="cpu", procs=procs, callback=rounds.append, keep_params=True)
    assert b.status == a.status == "ok"
    assert_same_history(a, b)
    assert [r.round for r in rounds] == [1, 2, 3]  # the callback ran here, once per round
    torch.testing.assert_close(b.params, a.params, rtol=1e-4, atol=1e-5)
    if policy.scheme != "none":
        assert a.final.merges > 0 and a.final.bytes > 0


def test_encoded_payload_is_what_compress_sends():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for fraction, bits in [(1.0, 0), (0.05, 0), (1.0, 4), (0.1, 8), (0.1, 12)]:
        parts = ops.encode(x, fraction, bits, torch.Generator().manual_seed(5))
        spec = ops.wire_spec(1000, fraction, bits)
        assert [(tuple(t.shape), t.dtype) for t in parts] == spec
        dense = ops.decode(parts, 1000, fraction, bits)
        assert torch.equal(dense, ops.compress(x, fraction, bits, torch.Generator().manual_seed(5)))
        expect = ops.topk_with_feedback(x, None, fraction)[0] if fraction < 1 else x
        if bits:  # the same numbers as quantising the dense top-k tensor
            expect = ops.quantize_stochastic(expect, bits, torch.Generator().manual_seed(5))
        assert torch.equal(dense, expect)
        wire = sum(t.numel() * t.element_size() for t in parts)
        assert wire < 4000 or (fraction == 1.0 and bits == 0)


@pytest.mark.system
def test_callback_stops_the_ranks(setup):
    seen = []

    def prune_at_two(m):
        seen.append(m.round)
        if m.round == 2:
            raise KeyError("pruned")

    with pytest.raises(KeyError, match="pruned"):
        dist.simulate(setup, AGREEMENT["ring-push-pull"][0], 0, device="cpu", callback=prune_at_two)
    assert seen == [1, 2]
    assert _spawned_children(os.getpid()) == []


def _raise_on_rank_one(rank, *args):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    time.sleep(60)


@pytest.mark.system
def test_a_raising_rank_is_named_and_the_others_stopped(setup):
    t = time.monotonic()
    with pytest.raises(dist.DistributedRunError, match=r"rank 1 .*ValueError: rank one fails on purpose") as e:
        dist.simulate(setup, MergePolicy(), 0, device="cpu", _entry=_raise_on_rank_one)
    assert e.value.rank == 1
    assert time.monotonic() - t < 30  # the others were terminated, not waited for
    assert _spawned_children(os.getpid()) == []


def _raise_before_a_peer_is_killed(rank, world, store, *rest):
    if rank == 1:  # what a peer of a dead rank raises, here a moment before the death is reported
        while not os.path.exists(store + ".rank2"):  # once rank 2 is up
            time.sleep(0.01)
        raise RuntimeError("Connection closed by peer [127.0.0.1]:49804")
    if rank == 2:
        Path(store + ".rank2").touch()
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.system
def test_a_rank_killed_by_a_signal_is_named_over_a_peer_that_raised_first(setup):
    """A killed rank's peers lose their connections and raise, sometimes before the launcher hears of the kill:
    the one line names the killed rank, the cause."""
    with pytest.raises(dist.DistributedRunError, match=r"^rank 2 \(pid \d+\) was killed by SIGKILL") as e:
        dist.simulate(setup, MergePolicy(), 0, device="cpu", _entry=_raise_before_a_peer_is_killed)
    assert e.value.rank == 2
    assert _spawned_children(os.getpid()) == []


class _DiesWhenUnpickled:
    """Stands for a rank killed (by the OOM killer, a user) while it reads what the launcher sends it: the rank
    ends as it unpickles this, before the rest of its arguments."""

    def __reduce__(self):
        return os._exit, (3,)


@pytest.mark.system
@pytest.mark.parametrize("start", [None, "spawn"])
def test_a_rank_that_dies_as_it_starts_is_named_in_one_line(setup, start):
    """Ranks end before they have read their arguments, whose head (4 MB here) is more than a pipe holds: one line
    naming the rank, from the fork server and from spawn. (Sent through the start pipe, the head left the launcher
    blocked writing to a spawned rank that had died, and raised BrokenPipeError at one forked from the server.)"""
    t = time.monotonic()
    with pytest.raises(dist.DistributedRunError, match=r"^rank \d \(pid \d+\) exited with code 3$") as e:
        dist.simulate(setup, MergePolicy(), b"x" * (4 << 20), device="cpu", _entry=_DiesWhenUnpickled(),
                      _start=start)
    assert e.value.rank in range(setup.study.run.workers)  # every rank dies; the first seen is named
    assert time.monotonic() - t < 60
    assert _spawned_children(os.getpid()) == []


class _EnvironmentWhenUnpickled:
    """Stands where a user's module would be imported as a rank unpickles its setup: reads the environment then."""

    def __init__(self):
        self.mark = "in the launcher"

    def __setstate__(self, state):
        self.mark = os.environ.get("EVOMERGE_TEST_MARK")


def _raise_with_the_environment(rank, world, store, setup, policy, seed, *rest):
    if rank == 1:
        raise ValueError(f"EVOMERGE_TEST_MARK={os.environ.get('EVOMERGE_TEST_MARK')}, when unpickled {seed.mark}")
    time.sleep(60)


@pytest.mark.system
def test_a_rank_sees_the_launchers_environment_at_its_launch(setup, monkeypatch):
    """Ranks are forked from a server started at the first launch; each still gets the environment the launcher
    has when it launches them, as a spawned process would (a variable set after the server started, one unset),
    already while it unpickles its arguments (where a user's modules are imported)."""
    for mark in ("first", "second", None):
        if mark is None:
            monkeypatch.delenv("EVOMERGE_TEST_MARK")
        else:
            monkeypatch.setenv("EVOMERGE_TEST_MARK", mark)
        with pytest.raises(dist.DistributedRunError,
                           match=rf"rank 1 .*ValueError: EVOMERGE_TEST_MARK={mark}, when unpickled {mark}$"):
            dist.simulate(setup, MergePolicy(), _EnvironmentWhenUnpickled(), device="cpu",
                          _entry=_raise_with_the_environment)
    assert _spawned_children(os.getpid()) == []


@pytest.mark.system
def test_a_fork_server_that_found_another_evomerge_is_named_in_one_line(tmp_path, data_dir):
    """The fork server imports evomerge from the launcher's starting path, not from what the launcher put on
    ``sys.path`` since: where that is another copy, the ranks say so in one line instead of running other code."""
    import shutil

    root = Path(__file__).resolve().parent.parent
    other = tmp_path / "other"
    shutil.copytree(root / "evomerge", other / "evomerge", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "launch.py"
    script.write_text(f"""
import sys
sys.path[:0] = [{str(root)!r}, {str(root / "tests")!r}]  # the checkout first, at run time
import evomerge
from conftest import tiny_study
from evomerge import dist, simulate
from evomerge.policy import MergePolicy
if __name__ == "__main__":  # (a rank runs this file again, as __mp_main__, with the server's evomerge)
    assert evomerge.__file__.startswith({str(root)!r}), evomerge.__file__
    try:
        dist.simulate(simulate.prepare(tiny_study(), data_dir={str(data_dir)!r}), MergePolicy(), 0, device="cpu")
    except dist.DistributedRunError as e:
        print(e)
""")
    env = dict(os.environ, PYTHONPATH=str(other))  # where the server looks first
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.match(r"rank \d \(pid \d+\) ", r.stdout) and f"raised RuntimeError: this rank runs evomerge from {other / 'evomerge'} " in r.stdout
    assert f"its launcher from {root / 'evomerge'};" in r.stdout and r.stdout.count("\n") == 1, r.stdout


def _send_the_result_and_exit_at_once(rank, world, store, setup, policy, seed, up, *rest):
    """Rank 0 hands over a result that holds a tensor, as a run with keep_params does, and its process is gone
    before the launcher has read it (under load, rank 0's exit could win that race)."""
    if rank == 0:
        from evomerge.backends import launch
        from evomerge.engine.setup import RunResult

        launch._send(up, "result", RunResult("ok", seed, {}, [], 0, 0.0, 0.0, world,
                                             params=torch.arange(12.0).reshape(3, 4)))
        up.close()
        up.join_thread()  # the bytes are in the pipe
    os._exit(0)


@pytest.mark.system
def test_the_result_arrives_when_rank_zero_has_already_exited(setup):
    for _ in range(3):
        res = dist.simulate(setup, MergePolicy(), 7, device="cpu", _entry=_send_the_result_and_exit_at_once)
        assert res.seed == 7 and torch.equal(res.params, torch.arange(12.0).reshape(3, 4))


def test_bad_process_count_is_refused(setup):
    with pytest.raises(ConfigError, match=r"--procs: 3 processes cannot split 4 workers evenly; allowed: a divisor of 4"):
        dist.simulate(setup, MergePolicy(), 0, procs=3)
    from evomerge import backends

    with pytest.raises(ConfigError, match=r"^--procs: 0 is out of range; allowed: a divisor of 4 \(the workers\)$"):
        backends.check("distributed", 0, 4)  # (it said "0 processes cannot split 4 workers evenly")


def _spawned_children(ppid: int) -> list[int]:
    """Live rank processes of the launcher ``ppid``: forked by its fork server (its child running
    ``multiprocessing.forkserver``), or spawned by it (``spawn_main``); not the server, not the resource tracker."""
    live = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            live[int(d.name)] = (int(fields[1]), cmd)
    servers = {pid for pid, (parent, cmd) in live.items() if parent == ppid and "forkserver" in cmd}
    return sorted(pid for pid, (parent, cmd) in live.items() if parent in servers or (
        parent == ppid and "spawn_main" in cmd and "resource_tracker" not in cmd))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_ranks(proc, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = _spawned_children(proc.pid)
        if len(kids) == n:
            return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{n} ranks did not start")


@contextlib.contextmanager
def long_distributed_run(tmp_path, data_dir, env=None):
    """A 4-rank ``evomerge run --backend distributed`` far from its end; yields (process, rank pids)
    once the ranks are past the rendezvous, and kills the launcher if a test left it running."""
    study = write_study(tmp_path, workers=4, steps=200000)
    proc = subprocess.Popen([*EVOMERGE, "run", "--study", str(study), "--policy", "ring-gossip", "--backend", "distributed",
                             "--data-dir", str(data_dir), "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        ranks = _wait_for_ranks(proc, 4)
        time.sleep(2)  # past the rendezvous: the ranks are training and merging
        assert proc.poll() is None
        yield proc, ranks
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.system
def test_killed_worker_ends_the_run_naming_its_rank(tmp_path, data_dir):
    with long_distributed_run(tmp_path, data_dir) as (proc, ranks):
        os.kill(ranks[2], signal.SIGKILL)  # ranks start in order, so pids are in rank order
        t = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t
    assert proc.returncode == 1, err
    assert "error: rank 2" in err and "SIGKILL" in err, err
    assert took < 10
    assert err.strip().count("\n") == 0, err  # one line, no traceback
    time.sleep(0.5)
    assert [p for p in ranks if _alive(p)] == []


@pytest.mark.system
def test_a_launcher_killed_outright_leaves_no_rank_running(tmp_path, data_dir, request):
    """SIGKILL to the launcher gives it no chance to stop its ranks: they go with it. A rank's parent is the fork
    server, which outlives the launcher while a rank runs (each holds its end of the server's pipe), so each rank
    watches the launcher itself; the server then exits too. The run's private folder, which the launcher had no
    chance to remove, goes at the next distributed run."""
    import glob
    import shutil
    import tempfile

    # a temporary folder of its own: another test's distributed run, beside this one, would remove the orphan first
    # (short, in the system's: the fork server's socket lives there, and a Unix socket's path has at most 107 bytes)
    tmp = tempfile.mkdtemp(prefix="evt-")
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = dict(os.environ, TMPDIR=tmp)
    with long_distributed_run(tmp_path, data_dir, env) as (proc, ranks):
        server = {int(Path(f"/proc/{r}/stat").read_text().rsplit(")", 1)[1].split()[1]) for r in ranks}
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while [p for p in [*ranks, *server] if p != proc.pid and _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert [p for p in [*ranks, *server] if p != proc.pid and _alive(p)] == []
    left = glob.glob(os.path.join(tmp, f"evomerge-dist-*/launcher-{proc.pid}"))
    assert len(left) == 1, left  # (were left for good: one a killed launcher)
    study = write_study(tmp_path / "next", workers=2, steps=10)
    r = subprocess.run([*EVOMERGE, "run", "--study", str(study), "--policy", "ring-gossip", "--backend", "distributed",
                        "--data-dir", str(data_dir), "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(os.path.dirname(left[0]))


@pytest.mark.system
def test_cli_distributed_run_matches_inprocess(tmp_path, data_dir):
    study = write_study(tmp_path, workers=4, steps=60)
    outs = {}
    for backend in ("inprocess", "distributed"):
        r = subprocess.run([*EVOMERGE, "run", "--study", str(study), "--policy", "ring-gossip", "--backend", backend,
                            "--data-dir", str(data_dir), "--quiet", "--json", str(tmp_path / f"{backend}.json")],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs[backend] = json.loads((tmp_path / f"{backend}.json").read_text())
    a, b = outs["inprocess"]["history"], outs["distributed"]["history"]
    assert [h["bytes"] for h in a] == [h["bytes"] for h in b]
    assert [h["val_accuracy"] for h in a] == pytest.approx([h["val_accuracy"] for h in b], abs=1e-6)


@pytest.mark.system
def test_torchrun_launch_matches_inprocess(tmp_path, data_dir, mnist):
    """The multi-host path (``torchrun ... -m evomerge.dist``), here with 2 processes of 2 workers on one host. Its
    ranks start without multiprocessing's Unix sockets: a temporary folder too long for the local launch's
    (``TMPDIR`` over 75 bytes) is not refused here."""
    from conftest import free_port

    study = write_study(tmp_path, workers=4, steps=60)
    long = tmp_path / ("t" * max(1, 80 - len(str(tmp_path))))
    long.mkdir()
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "evomerge.dist", "--study", str(study),
                        "--policy", "ring-gossip", "--data-dir", str(data_dir), "--device", "cpu", "--json", "out.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=180, env=dict(os.environ, TMPDIR=str(long)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    from evomerge.study import load

    st = load(study)
    ref = simulate.simulate(simulate.prepare(st, data_dir=data_dir), st.resolve_policy("ring-gossip"), st.run.seeds[0], device="cpu")
    assert [h["bytes"] for h in got["history"]] == [h.bytes for h in ref.history]
    assert [h["val_accuracy"] for h in got["history"]] == pytest.approx([h.val_accuracy for h in ref.history], abs=1e-6)
    assert "round 1:" in r.stdout


@pytest.mark.system
def test_torchrun_entry_refuses_without_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "evomerge.dist", "--study", "mnist-gossip", "--policy", "fedavg"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: RANK: is not set; launch with torchrun (or use `evomerge run --backend distributed`)"


@pytest.mark.system
def test_distributed_search_proposes_and_scores_like_inprocess(tmp_path, data_dir, mnist):
    import evomerge
    from evomerge import study as study_mod

    s = study_mod.load(write_study(tmp_path, workers=4, steps=40))
    res = {}
    for backend in ("inprocess", "distributed"):
        res[backend] = evomerge.search(s, verdict=False, n_trials=3, sampler="random", runs_dir=tmp_path / backend, seed=4,
                                       data=mnist, backend=backend, prune=False)
    a, b = res["inprocess"].records, res["distributed"].records
    assert [r["state"] for r in b] == ["COMPLETE"] * 3
    assert [r["policy"] for r in a] == [r["policy"] for r in b]
    assert [r["values"][0] for r in b] == pytest.approx([r["values"][0] for r in a], abs=1e-6)


@pytest.mark.system
@pytest.mark.timeout(900)  # several searches in processes: 1.5-4 min on 2 busy cores
def test_search_marks_a_trial_whose_rank_died_failed_and_goes_on(tmp_path, data_dir):
    import sqlite3

    # its model sleeps 10 ms a forward (tests/slowmlp.py): trials of 3 s, long enough for the kill to land inside
    # the first, for little CPU; the trials after the kill, without the file, run at full speed
    study = write_study(tmp_path, workers=4, steps=300, slow=True)
    slow = tmp_path / "slow"
    slow.write_text("")
    env = dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir), SLOWMLP_DELAY="0.01", SLOWMLP_WHILE=str(slow))
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([*EVOMERGE, "search", "--no-log-model", "--study", str(study), "--backend", "distributed", "--n-trials", "1",
                             "--sampler", "random", "--no-prune", "--no-verdict", "--quiet"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = _wait_for_ranks(proc, 4, timeout=120)
        time.sleep(1.5)
        os.kill(ranks[1], signal.SIGKILL)
        slow.unlink()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    with sqlite3.connect(db) as c:
        trials = c.execute("select number, state from trials order by number").fetchall()
        errors = [json.loads(v) for (v,) in c.execute(
            "select value_json from trial_user_attributes where key = 'error'").fetchall()]
    assert [st for _, st in trials].count("COMPLETE") == 1  # the asked trial, after the failed one
    assert [st for _, st in trials].count("FAIL") == 1
    assert trials[0][1] == "FAIL"
    assert len(errors) == 1 and "DistributedRunError: rank 1" in errors[0] and "SIGKILL" in errors[0]
    assert [p for p in ranks if _alive(p)] == []


@pytest.mark.parametrize("flags, message", [
    (["--backend", "mpi"], "error: --backend: unknown 'mpi'; allowed: inprocess, distributed"),
    (["--procs", "2"], "error: --procs: applies to --backend distributed only"),
    (["--backend", "distributed", "--procs", "3"],
     "error: --procs: 3 processes cannot split 4 workers evenly; allowed: a divisor of 4"),
])
def test_bad_backend_flags_get_one_line(tmp_path, data_dir, flags, message):
    from searchutil import cli  # the command's own code in this process (refused before any rank starts)

    study = write_study(tmp_path, workers=4)
    for command in (["run", "--policy", "ring-gossip"], ["search", "--n-trials", "1"]):
        r = cli(command[0], "--study", study, *command[1:], *flags, cwd=tmp_path, data_dir=data_dir)
        assert r.returncode == 2 and r.stderr.strip() == message, r.stderr
    assert not (tmp_path / "runs").exists()  # refused before any store was made


@pytest.mark.system
def test_a_temporary_folder_too_long_for_the_ranks_sockets_is_one_line_naming_tmpdir(tmp_path, data_dir):
    """The ranks start through Unix sockets that multiprocessing makes under the temporary folder (32 bytes more),
    whose paths hold at most 107 bytes: a longer TMPDIR (pytest's folders, some clusters' scratch) was a traceback
    ending in `OSError: AF_UNIX path too long`. It is one line naming TMPDIR, before any store is made."""
    study = write_study(tmp_path, workers=4)
    long = tmp_path / ("t" * max(1, 76 - len(str(tmp_path)) - 1))
    long.mkdir()
    n = len(str(long))  # 76 but where pytest's own folder is longer already
    env = dict(os.environ, TMPDIR=str(long))
    for command in (["run", "--policy", "ring-gossip"], ["search", "--n-trials", "1"]):
        r = subprocess.run([*EVOMERGE, command[0], "--study", str(study), *command[1:], "--backend", "distributed",
                            "--data-dir", str(data_dir)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"error: TMPDIR: the temporary folder {long} is too long ({n} bytes) for the Unix sockets the ranks start "
            "through (at most 107 bytes with the 32 multiprocessing adds); allowed: a folder of at most 75 bytes, "
            "e.g. TMPDIR=/tmp"), r.stderr
    assert not (tmp_path / "runs").exists()  # refused before any store was made


@pytest.mark.system
def test_ctrl_c_stops_every_rank(tmp_path, data_dir):
    with long_distributed_run(tmp_path, data_dir) as (proc, ranks):
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip() == "interrupted", err
    time.sleep(0.5)
    assert [p for p in ranks if _alive(p)] == []


# -- a user's model (evomerge.models.generic) -----------------------------------------------------------------
USER_MODELS = '''
from torch import nn

def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))

def with_batchnorm():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
'''


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_models")
    (folder / "dist_user_models.py").write_text(USER_MODELS)
    return folder


@pytest.mark.system
def test_distributed_runs_a_users_model_with_adamw_as_inprocess(mnist, user_folder):
    """The ranks import the factory again from the study's folder (the model pickles by reference)."""
    import dataclasses

    from evomerge.models.generic import GenericModel

    s = tiny_study(optimizer="adamw", lr=0.01, weight_decay=0.01)
    s = dataclasses.replace(s, path=user_folder / "s.toml",
                            model=dataclasses.replace(s.model, name="module", factory="dist_user_models:mlp",
                                                      options={"hidden": 8}))
    setup = simulate.prepare(s, data=mnist)
    assert isinstance(setup.model, GenericModel) and setup.model.n_params == 784 * 8 + 8 + 8 * 10 + 10
    policy = MergePolicy(scheme="gossip", topology="ring", mean_interval=3)
    a = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    b = dist.simulate(setup, policy, 3, device="cpu", procs=2, keep_params=True)
    assert_same_history(a, b, rel=1e-4)
    torch.testing.assert_close(b.params, a.params, rtol=1e-4, atol=1e-4)


@pytest.mark.system
def test_distributed_refuses_buffers_and_optimizer_state_in_one_line(mnist, user_folder):
    import dataclasses

    from evomerge.backends import check_space

    s = tiny_study()
    s = dataclasses.replace(s, path=user_folder / "s.toml",
                            model=dataclasses.replace(s.model, name="module", factory="dist_user_models:with_batchnorm",
                                                      options={}))
    setup = simulate.prepare(s, data=mnist)
    with pytest.raises(ConfigError, match=r"study.model.factory: the model has buffers \(2.running_mean, "
                                          r"2.running_var, 2.num_batches_tracked\), which the distributed backend"):
        dist.simulate(setup, MergePolicy(), 0, device="cpu")
    with pytest.raises(ConfigError, match=r"policy.optimizer_state: 'average' is not supported by the distributed "
                                          r"backend \(the optimiser's state is not sent between ranks\); allowed: 'keep'"):
        dist.simulate(simulate.prepare(tiny_study(), data=mnist), MergePolicy(optimizer_state="average"), 0, device="cpu")
    with pytest.raises(ConfigError, match=r"study.search.space.optimizer_state: is not supported by the distributed"):
        check_space("distributed", ["mixing_weight", "optimizer_state"])


def _forkserver_of(pid: int) -> bool:
    """Whether process ``pid`` has started multiprocessing's fork server (a child of its own)."""
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if d.name.isdigit() and b"forkserver" in (d / "cmdline").read_bytes() and \
                    int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return True
    return False


@pytest.mark.system
def test_ctrl_c_while_the_ranks_start_is_one_line_and_leaves_no_process(tmp_path, data_dir):
    """Ctrl-C as a terminal sends it, to the whole process group, from the moment the launcher starts the fork
    server (which then imports torch) through the ranks' start: one line, `interrupted`, 130, and nothing left
    running. (10 runs in 12 printed a traceback: the server's import, or a rank forked inside `Process.start()` that
    no one stopped, which read its start after the launcher had gone.)"""
    f = write_study(tmp_path, workers=4)
    for wait in (0.0, 0.3, 0.8):  # after the fork server appears
        p = subprocess.Popen([*EVOMERGE, "run", "--study", str(f), "--policy", "ring-gossip", "--backend", "distributed",
                              "--procs", "2", "--quiet", "--data-dir", str(data_dir)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not _forkserver_of(p.pid) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(wait)
            os.killpg(p.pid, signal.SIGINT)
            out, err = p.communicate(timeout=60)
            if "consensus val" in out:  # the run ended first: nothing to say about it
                continue
            assert p.returncode == 130 and err.strip().splitlines() == ["interrupted"], (wait, p.returncode, err)
            deadline = time.monotonic() + 15  # the fork server and the resource tracker end once the launcher has
            while time.monotonic() < deadline:  # (the ranks lead groups of their own, stopped by the launcher)
                try:
                    os.killpg(p.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"a process of the run's group outlived it by 15 s (Ctrl-C after {wait} s)")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
