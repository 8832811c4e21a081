"""``evomerge calibrate`` (issue 29): a cluster measured into an ``[environment]`` that a study takes with
``from = "cluster.toml"``.

The fits are checked on made-up figures (no processes); the measurement on real gloo ranks: a rank slowed by
sleeping, links shaped by netlab (its own network namespace and tbf link per rank), a Merger's traces, a rank
that fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port
from evomerge import calibrate, cli
from evomerge import study as study_mod
from evomerge.errors import ConfigError
from evomerge.search import fingerprint

ROOT = Path(__file__).resolve().parent.parent
NETLAB = ROOT.parent / "shared" / "netlab" / "netlab.sh"
LOOP = Path(__file__).resolve().parent / "merger_loop.py"

STUDY = """
[study]
name = "calibrated"
[data]
dataset = "mnist"
val_size = 500
train_size = 2000
partition = "iid"
[model]
{model}
[run]
workers = {workers}
batch_size = {batch}
steps = 20
rounds = 2
score_samples = 8
{environment}
"""


def study_text(workers: int = 3, model: str = 'name = "mlp"\nhidden = [16]', batch: int = 16,
               environment: str = "") -> str:
    return STUDY.format(workers=workers, model=model, batch=batch, environment=environment)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- the fits, on made-up figures -------------------------------------------------------------------------
def made_up(speeds, n=400, jitter=0.05, spells=None, seed=0):
    """Step times of ranks with these speeds (step 10 ms at speed 1), lognormal jitter, and slow spells
    (rank, start, length, factor)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in speeds:
        out.append(0.01 / s * np.exp(jitter * rng.standard_normal(n)))
    for r, start, length, factor in spells or []:
        out[r][start:start + length] *= factor
    return [list(map(float, t)) for t in out]


def draw_steps(env: dict, W: int, n: int = 20000, seed: int = 3) -> list[np.ndarray]:
    """Each worker's first ``n`` step times as the clock draws them from an environment's fields."""
    from types import SimpleNamespace

    from evomerge.engine.clock import Compute

    e = SimpleNamespace(**({"slow_workers": (), "straggle_length": 1.0, "straggle_factor": 1.0} | env))
    e.speeds = tuple(e.speeds)
    drawn = Compute(e, W, seed=seed)
    return [np.array([drawn.duration(w, k) for k in range(1, n + 1)]) for w in range(W)]


def drawn_means(env: dict, W: int, n: int = 20000, seed: int = 3) -> np.ndarray:
    """Each worker's mean step as the clock draws them from fitted fields."""
    return np.array([t.mean() for t in draw_steps(env, W, n, seed)])


def test_compute_fit_gives_speeds_jitter_and_slow_spells():
    env, notes = calibrate.fit_compute(made_up([1.0, 1.0, 0.5, 0.25]))
    assert env["step_time"] == pytest.approx(0.01, rel=0.03)
    np.testing.assert_allclose(env["speeds"], [1.0, 1.0, 0.5, 0.25], rtol=0.03)
    spells = [(1, 20 + 60 * k, 3, 5.0) for k in range(6)]
    times = made_up([1.0, 1.0, 0.5, 0.25], spells=spells)
    env, notes = calibrate.fit_compute(times)
    # the speeds are the medians' ratios; step_time is scaled so that the clock's steps take the ranks' measured
    # means in total (the slow spells, fitted over every rank, are drawn for every rank)
    np.testing.assert_allclose(env["speeds"], [1.0, 1.0, 0.5, 0.25], rtol=0.03)
    assert drawn_means(env, 4).sum() == pytest.approx(sum(np.mean(t) for t in times), rel=0.02)
    assert env["jitter"] == pytest.approx(0.05, rel=0.2)
    assert env["straggle_factor"] == pytest.approx(5.0, rel=0.1)
    assert env["straggle_length"] == pytest.approx(3.0)
    assert env["straggle_p"] == pytest.approx(6 / (1600 - 18), rel=0.01)  # spells / other steps
    assert any(n.strip().startswith("rank 3: ") and n.endswith("over 400 steps") for n in notes)


def test_no_clear_tail_no_slow_spells():
    env, notes = calibrate.fit_compute(made_up([1.0, 1.0], spells=[(0, 10, 2, 5.0)]))  # one spell: not clear
    assert env["straggle_p"] == 0 and "straggle_factor" not in env
    assert any("none written" in n for n in notes)


def test_speed_models_for_another_number_of_workers():
    times = made_up([1.0, 0.8, 0.5, 0.4])
    env, _ = calibrate.fit_compute(times, "lognormal")
    logs = np.log([1.0, 0.8, 0.5, 0.4])
    assert env["speeds"] == "lognormal" and env["sigma"] == pytest.approx(np.std(logs, ddof=1), rel=0.05)
    env, _ = calibrate.fit_compute(times, "pareto")
    assert env["speeds"] == "pareto" and env["step_time"] == pytest.approx(0.01, rel=0.03)
    assert env["alpha"] == pytest.approx(4 / -logs.sum(), rel=0.05)
    env, _ = calibrate.fit_compute(made_up([1.0, 1.0], jitter=0.0), "pareto")
    assert env["speeds"] == "equal"


def test_a_speed_model_fitted_from_few_ranks_is_a_warning(tmp_path):
    """The warnings are what the command prints, and the file keeps them as comments."""
    for speeds, fit in (([1.0, 0.6], "lognormal"), ([1.0, 0.8, 0.5], "pareto")):
        lat, bw = links(len(speeds), lambda i, j: 1e-4, lambda i, j: 1e8)
        m = calibrate.Measured(made_up(speeds, n=50), lat, bw, source="made up")
        _, warned = calibrate.write(m, tmp_path / "c.toml", fit)
        line = (f"warning: --fit {fit} from {len(speeds)} ranks: a spread fitted to {len(speeds)} ranks' steps is a rough "
                "guess; fit from 4 ranks or more")
        assert line in warned and "# " + line in (tmp_path / "c.toml").read_text()
    lat, bw = links(4, lambda i, j: 1e-4, lambda i, j: 1e8)
    _, warned = calibrate.write(calibrate.Measured(made_up([1.0, 0.8, 0.5, 0.4], n=50), lat, bw, source="made up"),
                                tmp_path / "c.toml", "lognormal")
    assert not any(w.startswith("warning: --fit") for w in warned)


def links(W, lat, bw):
    """Matrices from a function of (i, j)."""
    return ([[None if i == j else lat(i, j) for j in range(W)] for i in range(W)],
            [[None if i == j else bw(i, j) for j in range(W)] for i in range(W)])


def test_links_in_clear_groups_give_sites_else_matrices():
    same = lambda i, j: i // 2 == j // 2  # noqa: E731 - two hosts of two ranks
    lat, bw = links(4, lambda i, j: 2e-5 if same(i, j) else 1e-3, lambda i, j: 5e9 if same(i, j) else 1.2e8 + i)
    env, notes = calibrate.fit_links(calibrate.Measured([[0.01]] * 4, lat, bw))
    assert env == {"sites": 2, "latency": 2e-5, "bandwidth": 5e9, "latency_inter": 1e-3,
                   "bandwidth_inter": pytest.approx(1.2e8, rel=1e-4)}
    # uneven links without groups: the matrices, as measured
    lat, bw = links(3, lambda i, j: 1e-4 * (1 + i + j), lambda i, j: 1e8 * (1 + i))
    env, _ = calibrate.fit_links(calibrate.Measured([[0.01]] * 3, lat, bw))
    assert "sites" not in env and env["latency_matrix"][0] == [0.0, 2e-4, 3e-4]
    assert env["bandwidth_matrix"][2] == [3e8, 3e8, 0.0]
    env, _ = calibrate.fit_links(calibrate.Measured([[0.01]] * 3, lat, bw), "lognormal")  # --fit: the median link
    assert env == {"latency": 3e-4, "bandwidth": 2e8}
    # a link too fast to tell is unlimited (0)
    lat, bw = links(2, lambda i, j: 1e-5, lambda i, j: float("inf"))
    env, _ = calibrate.fit_links(calibrate.Measured([[0.01]] * 2, lat, bw))
    assert env["bandwidth_matrix"] == [[0.0, 0.0], [0.0, 0.0]]


def test_the_summary_line_counts_unlimited_links_as_the_fastest(tmp_path):
    """(0 is how the file writes an unlimited link; the line's median took it as the slowest: 648 kB/s for links of
    which half were unlimited and the others 1.3 MB/s to 1 GB/s.)"""
    rates = {(0, 1): float("inf"), (1, 0): float("inf"), (0, 2): 1.3e6, (1, 2): 1.3e6, (2, 0): 1.3e9, (2, 1): 1.3e9}
    lat, bw = links(3, lambda i, j: 1e-4, lambda i, j: rates[i, j])
    env, _ = calibrate.write(calibrate.Measured(made_up([1.0, 1.0, 1.0], n=50), lat, bw), tmp_path / "c.toml")
    assert env["bandwidth_matrix"] == [[0.0, 0.0, 1.3e6], [0.0, 0.0, 1.3e6], [1.3e9, 1.3e9, 0.0]]
    line = calibrate.summary(env, 3, tmp_path / "c.toml")
    assert line.endswith("links 100 us, 1.3 GB/s (median)"), line


def test_links_that_miss_the_measured_all_reduce_are_a_warning(tmp_path):
    """The fitted links' ring all-reduce against the one measured: more than 2x apart is printed, and written."""
    lat, bw = links(3, lambda i, j: 1e-4, lambda i, j: 1e8)  # predicts 4e-4 + 4/3 * 4e5 / 1e8 = 5.7 ms
    for seconds, warns in ((6e-3, False), (3e-3, False), (11e-3, False), (2e-3, True), (20e-3, True)):
        m = calibrate.Measured(made_up([1.0, 1.0, 1.0], n=50), lat, bw, allreduce=(seconds, 400_000))
        _, warned = calibrate.write(m, tmp_path / "c.toml", None)
        assert bool(warned) == warns, (seconds, warned)
        if warns:
            assert warned[0].startswith("warning: the ring's measured links predict a ring all-reduce of 400000 "
                                        "bytes in ")
            assert "# " + warned[0] in (tmp_path / "c.toml").read_text()


def test_a_slow_rank_out_of_range_is_one_line(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(study_text())
    assert cli.main(["calibrate", "--study", str(tmp_path / "s.toml"), "--procs", "2", "--slow-rank", "5",
                     "--slow-factor", "3", "-o", str(tmp_path / "c.toml")]) == 2
    assert one_line_error(capsys) == "error: --slow-rank: 5 is out of range; allowed: -1 (none) or a rank in [0, 1]"
    for flags, line in ((["--slow-rank", "1"], "error: --slow-factor: 1 (the default) with --slow-rank 1 emulates "
                                               "nothing; allowed: a factor above 1, e.g. --slow-factor 3"),
                        (["--slow-factor", "3"], "error: --slow-rank: none, so --slow-factor 3 emulates nothing; "
                                                 "allowed: the rank to slow down, e.g. --slow-rank 0")):
        assert cli.main(["calibrate", "--study", str(tmp_path / "s.toml"), "--procs", "2", *flags, "-o",
                         str(tmp_path / "c.toml")]) == 2
        assert one_line_error(capsys) == line
    assert not (tmp_path / "c.toml").exists()


def test_a_slow_rank_out_of_range_under_a_launcher_is_one_line_from_rank_0(tmp_path):
    """Ranks started as torchrun starts them (RANK, WORLD_SIZE): the flag every rank reads alike is refused before
    any measuring, in one line from rank 0, exit status 2 on every rank."""
    (tmp_path / "s.toml").write_text(study_text())
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "evomerge.calibrate", "--study", str(tmp_path / "s.toml"), "-o",
                               str(tmp_path / "c.toml"), "--slow-rank", "5", "--slow-factor", "3"],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs == ["error: --slow-rank: 5 is out of range; allowed: -1 (none) or a rank in [0, 1]\n", ""]
    assert not (tmp_path / "c.toml").exists()


def test_written_file_loads_as_a_studys_environment(tmp_path):
    lat, bw = links(3, lambda i, j: 1e-4, lambda i, j: 1e8 * (1 + i))
    m = calibrate.Measured(made_up([1.0, 0.5, 0.5], n=50), lat, bw, source="made up")
    env, warned = calibrate.write(m, tmp_path / "cluster.toml")
    assert warned == []
    text = (tmp_path / "cluster.toml").read_text()
    assert text.startswith("# made up\n") and "# compute:" in text
    assert tomllib.loads(text)["environment"] == env
    (tmp_path / "s.toml").write_text(study_text(environment='[environment]\nfrom = "cluster.toml"\n'
                                                            'time_budget = 3.0\noverlap = "blocking"'))
    st = study_mod.load(tmp_path / "s.toml")
    e = st.environment
    assert e.speeds == tuple(env["speeds"]) and e.step_time == env["step_time"] and e.jitter == env["jitter"]
    assert e.bandwidth_matrix == tuple(map(tuple, env["bandwidth_matrix"]))
    assert (e.time_budget, e.overlap) == (3.0, "blocking")  # the keys beside from
    # the same file's content is the same fingerprint; another content is another
    before = fingerprint.of(st)["hash"]
    assert fingerprint.of(study_mod.load(tmp_path / "s.toml"))["hash"] == before
    (tmp_path / "cluster.toml").write_text(text.replace(f"jitter = {env['jitter']}", "jitter = 0.5"))
    after = study_mod.load(tmp_path / "s.toml")
    assert after.environment.jitter == 0.5 and fingerprint.of(after)["hash"] != before
    # keys beside from override the file's
    (tmp_path / "s.toml").write_text(study_text(environment='[environment]\nfrom = "cluster.toml"\njitter = 0.1'))
    jittered = study_mod.load(tmp_path / "s.toml")
    assert jittered.environment.jitter == 0.1
    # one bandwidth or latency beside from, for every link: over the file's measured matrix (a new user's "what if my
    # links were 8 Mbit/s" was refused: "is overridden by bandwidth_matrix: it would be ignored; remove it")
    (tmp_path / "s.toml").write_text(study_text(environment='[environment]\nfrom = "cluster.toml"\njitter = 0.1\n'
                                                            'bandwidth = 1e6\nlatency = 0.05'))
    slower = study_mod.load(tmp_path / "s.toml")
    e = slower.environment
    assert (e.bandwidth, e.latency, e.bandwidth_matrix, e.latency_matrix) == (1e6, 0.05, (), ())
    assert e.speeds == tuple(env["speeds"])  # the rest is the file's
    # a search stored before: the keys beside from are the change, not the file (which did not change)
    said = fingerprint.changed_since(fingerprint.of(jittered)["summary"], fingerprint.of(slower)["summary"], slower)
    assert "environment.bandwidth changed" in said and "environment.latency changed" in said, said
    assert "cluster.toml changed" not in said and "matrix" not in said, said


def test_a_fitted_file_drives_any_number_of_workers(tmp_path):
    lat, bw = links(4, lambda i, j: 1e-4, lambda i, j: 1e8)
    calibrate.write(calibrate.Measured(made_up([1.0, 0.8, 0.5, 0.4], n=50), lat, bw), tmp_path / "c.toml", "lognormal")
    (tmp_path / "s.toml").write_text(study_text(workers=16, environment='[environment]\nfrom = "c.toml"'))
    e = study_mod.load(tmp_path / "s.toml").environment
    assert e.speeds == "lognormal" and e.sigma > 0 and (e.latency, e.bandwidth) == (1e-4, 1e8)


@pytest.mark.parametrize("case, content, field, words", [
    ("missing", None, "study.environment.from", "no such file"),
    ("malformed", "[environment\nstep_time = ", "study.environment.from", "invalid TOML"),
    ("unknown key", "[environment]\nstep_tme = 0.1", "study.environment.from", "unknown key 'step_tme'"),
    ("empty", "", "study.environment.from", "no environment keys"),
    ("another table", "[cluster]\nstep_time = 0.1", "study.environment.from",
     "holds a [cluster] table; expected an [environment] table"),
    ("bad value", "[environment]\njitter = -1.0", "study.environment.jitter", "(from "),
    ("other workers", "[environment]\nspeeds = [1.0, 0.5]", "study.environment.speeds", "measured on 2 ranks"),
    ("edited", "# evomerge calibrate --study cal: 4 ranks, 30 timed steps\n[environment]\nspeeds = [1.0, 0.5]",
     "study.environment.speeds", "whose speeds holds 2, though it says it measured 4 ranks"),  # (said "on 2 ranks")
])
def test_bad_from_files_are_one_line_naming_the_field(tmp_path, capsys, case, content, field, words):
    if content is not None:
        (tmp_path / "cluster.toml").write_text(content)
    (tmp_path / "s.toml").write_text(study_text(environment='[environment]\nfrom = "cluster.toml"'))
    with pytest.raises(ConfigError) as e:
        study_mod.load(tmp_path / "s.toml")
    assert e.value.field == field and words in e.value.message
    assert cli.main(["run", "--study", str(tmp_path / "s.toml"), "--policy", "ring-gossip"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {field}: ") and words in err


def test_from_trace_of_a_folder_without_traces_is_one_line(tmp_path, capsys):
    assert cli.main(["calibrate", "--from-trace", str(tmp_path), "-o", str(tmp_path / "c.toml")]) == 2
    err = one_line_error(capsys)
    assert err.startswith("error: --from-trace: ") and "no traces" in err
    assert not (tmp_path / "c.toml").exists()
    assert cli.main(["calibrate", "-o", str(tmp_path / "c.toml")]) == 2
    assert "--study" in one_line_error(capsys)


def test_from_trace_refuses_a_trace_with_too_few_timed_steps_naming_what_to_change(tmp_path, capsys):
    """(A trace shorter than --warmup was fitted whole, under a header saying its first --warmup steps were left out;
    one step a rank wrote jitter 0, where calibrating live refuses fewer than 3 steps.)"""
    write_trace(tmp_path / "short", [], steps=1)
    assert cli.main(["calibrate", "--from-trace", str(tmp_path / "short"), "-o", str(tmp_path / "c.toml")]) == 2
    assert one_line_error(capsys) == (f"error: --from-trace: {tmp_path / 'short' / 'rank-0.jsonl'}: 1 step record, "
                                      "--warmup 5 left out; allowed: at least 3 timed steps a rank (a longer trace)")
    write_trace(tmp_path / "ok", [], steps=20)
    assert cli.main(["calibrate", "--from-trace", str(tmp_path / "ok"), "-o", str(tmp_path / "c.toml"),
                     "--warmup", "500"]) == 2
    assert one_line_error(capsys) == (f"error: --warmup: {tmp_path / 'ok' / 'rank-0.jsonl'}: 20 step records, "
                                      "--warmup 500 left out; allowed: at least 3 timed steps a rank (a longer trace, "
                                      "or --warmup at most 17)")
    assert not (tmp_path / "c.toml").exists()
    assert cli.main(["calibrate", "--from-trace", str(tmp_path / "ok"), "-o", str(tmp_path / "c.toml"),
                     "--warmup", "17"]) == 0
    assert "3 timed steps" not in capsys.readouterr().err and "9 steps (3, 3, 3 a rank; the first 17 of each rank left out)" in \
        (tmp_path / "c.toml").read_text()
    # what times a live calibration is refused with --from-trace (--steps, --slow-rank ... were ignored in silence)
    for extra in (["--steps", "80"], ["--slow-rank", "1", "--slow-factor", "3"], ["--study", "mnist-gossip"],
                  ["--procs", "3"], ["--step-sleep", "0.01"]):
        assert cli.main(["calibrate", "--from-trace", str(tmp_path / "ok"), "-o", str(tmp_path / "d.toml"), *extra]) == 2
        assert one_line_error(capsys).startswith(f"error: {extra[0]}: {extra[1]} is for calibrating live (--study and "
                                                 "--procs); --from-trace fits the traces as they were written; "
                                                 "allowed: leave it out with --from-trace")
    assert not (tmp_path / "d.toml").exists()


def test_a_transfer_counts_as_alone_for_the_time_it_had_its_ends_to_itself():
    # sender, receiver, bytes, start, arrival
    t = [(0, 1, 8, 0.0, 1.0),   # shares receiver 1 with the next from 0.5 to 1.0: 0.5 + 0.5 / 2
         (2, 1, 8, 0.5, 1.5),   # the same from 0.5 to 1.0, then alone: 0.25 + 0.5
         (0, 2, 8, 1.2, 2.0),   # sender 0 and receiver 2 are free then (0 -> 1 ended at 1.0; 2 -> 1 sends)
         (3, 0, 8, 2.5, 3.0),   # shares sender 3 with the next from 2.9: 0.4 + 0.1 / 2
         (3, 2, 8, 2.9, 3.5),   # 0.1 / 2 + 0.5
         (1, 0, 8, 3.0, 3.2),   # starts as 3 -> 0 arrives: touching is not sharing
         (2, 3, 8, 4.0, 5.0),   # three at once into receiver 3, and two of them from sender 2: the busier end
         (2, 3, 8, 4.0, 5.0),   # (3 at the receiver) counts
         (1, 3, 8, 4.0, 5.0)]
    got = calibrate.alone_times(t)
    assert got == pytest.approx([0.75, 0.75, 0.8, 0.45, 0.55, 0.2, 1 / 3, 1 / 3, 1 / 3])
    assert calibrate.alone_times([]) == []


def write_trace(d: Path, transfers, steps: int = 20) -> None:
    """Made-up Merger traces (rank-R.jsonl) of 3 ranks: ``steps`` 10 ms steps each, and the point-to-point
    transfers ``(sender, receiver, bytes, start, arrival)`` as a send on the sender and a receive on the receiver."""
    d.mkdir()
    rows = {r: [{"step": k + 1, "compute_s": 0.01} for k in range(steps)] for r in range(3)}
    for ev, (i, j, b, t0, t1, *posted) in enumerate(transfers):  # (a sixth: when the receive was posted)
        p = posted[0] if posted else t0 - 1.0
        rows[i].append({"event": ev, "kind": "send", "peer": j, "bytes": b, "initiator": i, "t": t0})
        rows[j].append({"event": ev, "kind": "recv", "peer": i, "bytes": b, "initiator": i, "posted": p,
                        "arrived": max(t1, p), "seconds": max(t1, p) - p})
    for r, xs in rows.items():
        (d / f"rank-{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in xs))


def merge_steps_trace(d: Path, wait_s: bool = True, every: int = 4) -> None:
    """Made-up traces of 2 ranks, 40 steps of 10 ms: at every 4th step an all-reduce, where a rank spends 3 ms of
    its own and waits (rank 0: 5 ms, rank 1: 1 ms); 0.5 ms inside merger.step() at the other steps."""
    d.mkdir()
    for r in range(2):
        rows, t = [], 100.0
        for k in range(1, 41):
            t += 0.01
            rec = {"step": k, "compute_s": 0.01, "t": t}
            if wait_s:
                rec["wait_s"] = (0.005 if r == 0 else 0.001) if k > 1 and (k - 1) % every == 0 else 0.0
            rows.append(rec)
            merge = k % every == 0
            if merge:
                rows.append({"event": k // every, "kind": "allreduce", "step": k, "bytes": 4000, "seconds": 0.004,
                             "wire_s": 0.001})
            t += (0.0035 + (0.005 if r == 0 else 0.001)) if merge else 0.0005
        (d / f"rank-{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def test_from_trace_fits_merge_time_the_ranks_own_work_at_a_merge_less_their_waits(tmp_path):
    """merge_time: a rank's own time inside merger.step() at a step with a merge (3.5 ms here, its waits of 5 ms or
    1 ms out) less that at a step without (0.5 ms): 3 ms on both ranks, whatever each waited. The file says it, a
    study takes it, and its clock adds it to the step after each merge."""
    merge_steps_trace(tmp_path / "tr")
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.merge_time == pytest.approx(0.003, rel=1e-6)
    # the time at a step without a merge is part of every step: each rank's compute plus its median there
    assert all(x == pytest.approx(0.0105) for t in m.step_times for x in t), m.step_times
    assert "steps (step_time, speeds and jitter are fitted on them): each rank's compute_s plus its own time inside " \
           "merger.step() at a step without a merge (means: " \
           "rank 0: 0.5 ms, rank 1: 0.5 ms), as the job's steps took them" in m.notes, m.notes
    env, notes = calibrate.fit(m)
    assert env["merge_time"] == pytest.approx(0.003)
    assert any(n.startswith("merge_time: a rank's own time inside merger.step() at a step with a merge") and
               "(means per rank: rank 0: 3.5 ms at a merge, 0.5 ms without; rank 1: 3.5 ms at a merge, 0.5 ms without)"
               in n for n in notes), notes
    # the all-reduces' links are fitted on their time on the wire (wire_s), not the merge's whole time
    assert m.allreduce == (0.001, 4000)
    out = tmp_path / "cluster.toml"
    calibrate.write(m, out)
    assert re.search(r"^merge_time = 0\.003$", out.read_text(), re.M), out.read_text()
    (tmp_path / "user_mlp.py").write_text(USER_MLP)
    (tmp_path / "run.toml").write_text(TRACE_STUDY.format(workers=2, batch=16, environment=(
        f'[environment]\nfrom = "{out.name}"')))
    study = study_mod.load(tmp_path / "run.toml")
    assert study.environment.merge_time == pytest.approx(0.003)
    # a trace from before wait_s: not fitted, and the file says why
    merge_steps_trace(tmp_path / "old", wait_s=False)
    m = calibrate.from_trace(tmp_path / "old")
    assert m.merge_time is None
    assert any(n.startswith("merge_time not fitted: the trace has no wait_s") for n in m.notes), m.notes
    assert "merge_time" not in calibrate.fit(m)[0]
    # two merges a rank (a new user's 60-step job averaging every 21): not fitted, and why
    merge_steps_trace(tmp_path / "few", every=20)
    m = calibrate.from_trace(tmp_path / "few")
    assert m.merge_time is None and "merge_time not fitted: no rank merged at 3 or more timed steps (after --warmup " \
        "5); a longer job's trace, or one that merges more often, fits it" in m.notes, m.notes


def test_from_trace_fits_links_on_the_time_transfers_would_take_alone(tmp_path):
    """1 MB at 1e7 B/s takes 0.1 s alone, and two at once into the same receiver 0.2 s each: both give the link's
    rate (the clock adds the sharing itself); fitted on their durations, the links would be 1.5x too slow."""
    mb, t = 1_000_000, []
    for k in range(6):  # 0 -> 1 and 2 -> 1 alone, one after the other
        t += [(0, 1, mb, 10.0 * k, 10.0 * k + 0.1), (2, 1, mb, 10.0 * k + 1, 10.0 * k + 1.1)]
    for k in range(6):  # and at once, sharing receiver 1
        t += [(0, 1, mb, 100.0 + k, 100.2 + k), (2, 1, mb, 100.0 + k, 100.2 + k)]
    for k in range(4):  # 1 -> 2 only ever while 0 -> 2 also arrives at 2, at 4e6 B/s
        t += [(1, 2, mb, 200.0 + k, 200.5 + k), (0, 2, mb, 200.0 + k, 200.5 + k)]
    write_trace(tmp_path / "tr", t)
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.bandwidth[0][1] == pytest.approx(1e7) and m.bandwidth[2][1] == pytest.approx(1e7)
    assert m.bandwidth[1][2] == pytest.approx(4e6) and m.bandwidth[0][2] == pytest.approx(4e6)
    assert any("12 of 32 had both ends to themselves" in n for n in m.notes), m.notes


def test_pairs_every_pair_up_to_16_ranks_else_the_ring_and_a_sample():
    import itertools

    for W in (2, 3, 4, 7, 16):
        rounds = calibrate.pair_rounds(W, 16, 0)
        got = [p for r in rounds for p in r]
        assert sorted(got) == list(itertools.combinations(range(W), 2))
        assert all(len({k for p in r for k in p}) == 2 * len(r) for r in rounds)  # disjoint pairs in a round
    rounds = calibrate.pair_rounds(20, 16, 0)
    got = {p for r in rounds for p in r}
    assert {(min(r, (r + 1) % 20), max(r, (r + 1) % 20)) for r in range(20)} <= got and len(got) == 40
    assert calibrate.pair_rounds(20, 16, 0) == rounds


# -- real ranks ------------------------------------------------------------------------------------------
SLOW_MODEL = 'name = "mlp"\nhidden = [32]'


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, data_dir):
    """3 gloo ranks started by the command; rank 2 is a device 3x slower (every rank's step padded with 20 ms
    of sleep, as a device that takes that long; rank 2 sleeps to take 3x its own step). The study already names
    the file the command writes, as the docs pair them (``from = "cluster.toml"`` before it exists)."""
    d = tmp_path_factory.mktemp("calibrated")
    out = d / "cluster.toml"
    (d / "s.toml").write_text(study_text(model=SLOW_MODEL, environment=f'[environment]\nfrom = "{out.name}"\n'
                                                                         'time_budget = 1.0'))
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "calibrate", "--study", str(d / "s.toml"), "--procs", "3",
                        "-o", str(out), "--data-dir", str(data_dir), "--steps", "25", "--warmup", "3", "--repeats", "3",
                        "--step-sleep", "0.02", "--slow-rank", "2", "--slow-factor", "3", "--timeout", "120"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    # 3 ranks on this host's cores: where they must take turns (each at least one torch thread), the steps it timed
    # are said to be slower than on hosts of their own
    turns = re.search(r"^note: 3 ranks of (\d+) torch threads? on (\d+) CPU cores?: the ranks take turns on the cores",
                      p.stderr, re.M)
    cores = len(os.sched_getaffinity(0))
    if turns:  # (each rank's share of the threads: at least one)
        assert int(turns[1]) >= 1 and 3 * int(turns[1]) > int(turns[2]) == cores, p.stderr
    else:  # (unsaid only where 3 ranks of their share fit)
        assert 3 <= cores, p.stderr
    return d, out, p.stdout


def test_calibrate_reads_its_study_without_the_file_it_writes(tmp_path):
    """Missing, stale (measured on other ranks) or broken: the file a study's ``from`` names is calibrate's output,
    not its input; any other command still reads it (and refuses it in one line)."""
    f = tmp_path / "s.toml"
    f.write_text(study_text(workers=4, environment='[environment]\nfrom = "cluster.toml"\ntime_budget = 2.0'))
    for content in (None, "[environment]\nspeeds = [1.0, 0.5, 0.9]\n", "[environment\n"):
        if content is not None:
            (tmp_path / "cluster.toml").write_text(content)
        env = study_mod.load(f, calibrating=True).environment
        assert env.time_budget == 2.0 and env.speeds == "equal"
        with pytest.raises(ConfigError, match=r"^study\.environment\.(from|speeds): "):
            study_mod.load(f)
    # a study that needs its cluster (searching asynchronous DiLoCo, timed objectives) before it has one: calibrate
    # reads it for its model, data and batch (it was refused: `'async' ... runs on a simulated cluster only`)
    f.write_text(study_text(workers=4) + '[policy]\nscheme = "async"\nouter_optimizer = "nesterov"\nmixing_weight = 1.0\n'
                                        '[objectives]\nmetrics = ["time_to_target"]\ntarget = 0.8\n')
    assert study_mod.load(f, calibrating=True).run.workers == 4
    with pytest.raises(ConfigError, match=r"^study\.policy\.scheme: 'async' \(asynchronous DiLoCo\) runs on a "):
        study_mod.load(f)  # any other command: not without its cluster


@pytest.mark.xdist_group("calibrate-calibrated")  # one worker computes the module fixture they share
@pytest.mark.system
def test_a_slow_rank_gets_a_third_of_the_speed(calibrated):
    d, out, stdout = calibrated
    assert stdout.startswith(f"wrote {out}: 3 ranks")
    env = tomllib.loads(out.read_text())["environment"]
    s = env["speeds"]
    ratio = s[2] / np.mean(s[:2])
    print(f"speeds {s}: the slow rank at {ratio:.3f} of the others")
    assert abs(ratio - 1 / 3) <= 0.2 / 3, s
    assert len(env["latency_matrix"]) == 3 and len(env["bandwidth_matrix"]) == 3
    assert all(v > 0 for i, row in enumerate(env["latency_matrix"]) for j, v in enumerate(row) if i != j)


@pytest.mark.xdist_group("calibrate-calibrated")  # one worker computes the module fixture they share
@pytest.mark.system
def test_a_calibrated_file_runs_as_a_studys_environment(calibrated, data_dir, capsys):
    d, out, _ = calibrated
    assert cli.main(["run", "--study", str(d / "s.toml"), "--policy", "ring-gossip", "--data-dir", str(data_dir),
                     "--quiet"]) == 0
    got = capsys.readouterr()
    assert "simulated time" in got.out and "slowest / mean / fastest" in got.out
    assert "study.environment.from" not in got.err  # measured with the study's own batch and optimiser
    # the same file for a study that trains another batch: a note, as the run starts
    (d / "big.toml").write_text((d / "s.toml").read_text().replace("batch_size = 16", "batch_size = 64"))
    assert cli.main(["run", "--study", str(d / "big.toml"), "--policy", "ring-gossip", "--data-dir", str(data_dir),
                     "--quiet"]) == 0
    assert f"note: study.environment.from: {out} timed steps of batch 16 with sgd; this study trains batch 64 with " \
           "sgd: its step times are another training's (calibrate with this study)\n" in capsys.readouterr().err
    # and for a study with a wider model: a note as the run starts and on the search's start screen
    timed = int(re.search(r"^# model: (\d+) bytes", out.read_text(), re.MULTILINE)[1])
    assert timed == 4 * (784 * 32 + 32 + 32 * 10 + 10)  # the study's MLP (hidden 32), parameters alone
    (d / "wide.toml").write_text((d / "s.toml").read_text().replace("hidden = [32]", "hidden = [64]")
                                 + '[search.space]\nmixing_weight = { kind = "float", low = 0.1, high = 0.5 }\n')
    note = (f"note: study.environment.from: {out} timed steps of a model of {timed:,} bytes; this study's model has "
            f"{4 * (784 * 64 + 64 + 64 * 10 + 10):,} bytes: its step times are another model's (calibrate with this "
            "study)")
    assert cli.main(["run", "--study", str(d / "wide.toml"), "--policy", "ring-gossip", "--data-dir", str(data_dir),
                     "--quiet"]) == 0
    assert note + "\n" in capsys.readouterr().err
    assert cli.main(["search", "--study", str(d / "wide.toml"), "--n-trials", "1", "--no-verdict", "--quiet",
                     "--runs-dir", str(d / "runs"), "--data-dir", str(data_dir)]) == 0
    err = capsys.readouterr().err
    assert " ".join(note.split()) in " ".join(err.split()), err  # (the start screen wraps to the terminal's width)


@pytest.mark.system
def test_a_rank_that_fails_is_named_in_one_line(tmp_path, data_dir):
    (tmp_path / "s.toml").write_text(study_text())
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "calibrate", "--study", str(tmp_path / "s.toml"),
                        "--procs", "3", "-o", str(tmp_path / "c.toml"), "--data-dir", str(data_dir), "--steps", "5",
                        "--timeout", "60"], env=dict(os.environ, **{calibrate.FAIL_RANK: "1"}),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: calibration rank 1 failed"), err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.system
def test_ranks_of_a_launcher_that_does_not_say_how_many_share_the_machine_share_its_threads(tmp_path, data_dir):
    """netlab and a user's own script set RANK and WORLD_SIZE, not torchrun's LOCAL_WORLD_SIZE: the ranks count
    those on their machine, and three of them given 2 threads take 1 each (each took both: four ranks on two cores
    measured two of them 55x slower). Where they outnumber the cores, rank 0 says so beside the file, as --procs
    does (3 ranks on 2 cores under netlab said nothing of it)."""
    (tmp_path / "s.toml").write_text(study_text(workers=3))
    out = tmp_path / "c.toml"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    env.update(EVOMERGE_THREADS="2", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "evomerge.calibrate", "--study", str(tmp_path / "s.toml"), "-o",
                               str(out), "--data-dir", str(data_dir), "--steps", "5", "--warmup", "1", "--repeats",
                               "2", "--timeout", "90"], env=dict(env, RANK=str(r)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    assert "torch threads per rank: 1\n" in out.read_text(), out.read_text()
    cores = len(os.sched_getaffinity(0))
    said = [ln for ln in outs[0][1].splitlines() if "take turns on the cores" in ln]
    assert said == ([f"note: 3 ranks of 1 torch thread on {cores} CPU core{'s' * (cores != 1)}: the ranks take "
                     "turns on the cores, so their steps are timed slower and less evenly than on hosts of their "
                     "own; for the job's figures, calibrate on its hosts"] if 3 > cores else []), outs[0][1]
    assert outs[0][0].startswith(f"wrote {out}: 3 ranks")  # (the file's line first, the note beside it)


def _child_rank(parent: int, rank: int) -> int | None:
    """The pid of the calibration rank ``rank`` that process ``parent`` started, if it is there yet."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent and \
                    f"RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def test_the_rank_the_others_gave_up_on_is_named_whichever_timeout_came_first(tmp_path):
    """Ranks 0 and 2 left on their own --timeout (exit PEER_GONE) at the process group a moment before the
    launcher's time was up, rank 1 (stopped) still running: the line names rank 1, as when all three are still
    running (it said "rank 1 did not finish" in a loaded CI run)."""
    for r in (0, 2):
        (tmp_path / f"at-{r}").write_text("1 joining the process group")
    want = ("calibration rank 1 did not reach joining the process group within --timeout 30 s (ranks 0, 2 waited "
            "there); stopped")
    assert calibrate.hung_line([calibrate.PEER_GONE, None, calibrate.PEER_GONE], tmp_path, 30) == want
    assert calibrate.hung_line([None, None, None], tmp_path, 30) == want
    assert calibrate.hung_line([calibrate.PEER_GONE] * 3, tmp_path, 30) == want  # rank 1 gave up too, stopped late
    assert calibrate.hung_line([0, None, 0], tmp_path, 30) == \
        "calibration rank 1 did not finish within --timeout 30 s; stopped"


@pytest.mark.system
def test_a_rank_that_hangs_is_named_when_the_time_is_up(tmp_path, data_dir):
    """Rank 1 stopped (SIGSTOP) as it starts: the others wait for it at a collective, and the line names rank 1, not
    every rank still running. (Each step sleeps 1 s: on a loaded machine the ranks had finished their 5 steps before
    the test found rank 1 to stop, and the line said it did not finish.)"""
    import signal
    import time

    (tmp_path / "s.toml").write_text(study_text())
    p = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "calibrate", "--study", str(tmp_path / "s.toml"),
                          "--procs", "3", "-o", str(tmp_path / "c.toml"), "--data-dir", str(data_dir), "--steps", "5",
                          "--step-sleep", "1", "--timeout", "30"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 20
        while (pid := _child_rank(p.pid, 1)) is None and time.monotonic() < end:
            time.sleep(0.02)
        assert pid is not None, "rank 1 did not start"
        os.kill(pid, signal.SIGSTOP)
        out, err = p.communicate(timeout=90)
    finally:
        p.kill()
    assert p.returncode == 1
    err = err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: calibration rank 1 did not reach ") and \
        err.endswith(" within --timeout 30 s (ranks 0, 2 waited there); stopped"), err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.system
def test_ranks_started_by_hand_name_a_rank_that_never_joins_in_one_line(tmp_path, data_dir):
    """Two ranks started by a user's own launcher, rank 1 stopped as it starts: rank 0 ends at its --timeout with one
    line (was a traceback of the store's error)."""
    import signal

    (tmp_path / "s.toml").write_text(study_text(workers=2))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "evomerge.calibrate", "--study", str(tmp_path / "s.toml"), "-o",
                               str(tmp_path / "c.toml"), "--data-dir", str(data_dir), "--timeout", "4"],
                              env=dict(env, RANK=str(r)), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == calibrate.PEER_GONE, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and err.startswith(
        "error: rank 0: the ranks did not all join the process group within --timeout 4 s ("), err[-2000:]
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.system
def test_under_a_launcher_of_its_own_the_whole_calibration_ends_at_the_timeout(tmp_path, data_dir):
    """(Under torchrun or netlab `--timeout` bounded each wait for another rank, not the whole: 30 steps of 0.5 s
    went on to 22 s with --timeout 10.) Each rank ends at its own deadline, in one line saying where it was."""
    import time

    (tmp_path / "s.toml").write_text(study_text(workers=2))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "evomerge.calibrate", "--study", str(tmp_path / "s.toml"), "-o",
                               str(tmp_path / "c.toml"), "--data-dir", str(data_dir), "--timeout", "6",
                               "--step-sleep", "0.5", "--steps", "30"],
                              env=dict(env, RANK=str(r)), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - t0
    assert took < 6 + calibrate.GRACE + 20, took  # 30 steps of 0.5 s: over 15 s; the start: a few s on a busy machine
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        lines = err.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, err[-2000:]
        assert lines[0].startswith(f"error: rank {r}: the calibration did not finish within --timeout 6 s (at ") and \
            lines[0].endswith("); stopped (a longer --timeout lets a slow one finish)"), err
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.system
@pytest.mark.parametrize("bad, line", [
    (["--bogus"], "error: unrecognized arguments: --bogus; see python -m evomerge.calibrate --help"),
    # (a new user passed the launcher's --procs under netlab: argparse's usage, then "unrecognized arguments")
    (["--procs", "2"], "error: --procs: python -m evomerge.calibrate is one rank under a launcher (torchrun, netlab), "
                       "which starts the ranks; allowed: without it here, or evomerge calibrate --procs ..."),
    (["--steps", "1"], "error: --steps: 1 is out of range; allowed: [3, inf)"),
    (["--timeout", "nan"], "error: --timeout: nan is out of range; allowed: seconds in (0, 1e+06]"),
    (["--timeout", "inf"], "error: --timeout: inf is out of range; allowed: seconds in (0, 1e+06]"),
    (["-o", "{tmp}/no/such/c.toml"], "error: --output: {tmp}/no/such: no such folder"),
    (["--study", "{tmp}/nosuch.toml"], "error: --study: {tmp}/nosuch.toml: no such file"),
], ids=["unknown-option", "launchers-option", "bad-value", "bad-timeout", "endless-timeout", "output-in-no-folder", "missing-study"])
def test_a_bad_option_is_said_once_not_once_per_rank_and_every_rank_leaves_at_once(tmp_path, bad, line):
    """Every rank reads the same command line: rank 0 says what is wrong, the others leave with the same status
    in silence (a launcher's 4 or 8 ranks printed 4 or 8 usages). Under a launcher that does not end the others
    (netlab, a script), a value only rank 0 checks (its -o) left rank 1 waiting to join for --timeout (600 s), then
    a C++ stack; a missing study was said by every rank."""
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(ROOT))
    argv = ["--study", "mnist-gossip", "-o", str(tmp_path / "c.toml")] + [a.format(tmp=tmp_path) for a in bad]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "evomerge.calibrate", *argv], env=dict(env, RANK=str(r)),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    (out0, err0), (out1, err1) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [2, 2]
    assert time.monotonic() - t0 < 60  # (not the default --timeout's 600 s)
    lines = err0.strip().splitlines()
    assert lines[-1] == line.format(tmp=tmp_path), err0
    assert len(lines) == 1, err0
    assert (err1, out1) == ("", ""), err1
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.system
def test_rank_0_whose_port_is_taken_says_so_not_that_another_rank_is_gone(tmp_path):
    """(A taken MASTER_PORT was reported as 'the ranks did not all join ... within --timeout', exit 3: another
    rank's failure to a launcher.) It is this rank's own, exit 1, at once."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, "-m", "evomerge.calibrate", "--study", "mnist-gossip", "-o",
                            str(tmp_path / "c.toml"), "--timeout", "60"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        f"error: rank 0: cannot join the process group at 127.0.0.1:{port} ("), p.stderr[-2000:]
    assert not (tmp_path / "c.toml").exists()


def test_an_output_that_cannot_be_written_is_one_line_before_any_rank_starts(tmp_path, capsys):
    """A folder that takes no file (/proc), and a file that is read-only: refused before the calibration's minutes."""
    (tmp_path / "s.toml").write_text(study_text())
    ro = tmp_path / "ro.toml"
    ro.write_text("")
    ro.chmod(0o444)
    cases = [("/proc/c.toml", "error: --output: cannot write /proc/c.toml: its folder takes no file (")]
    if not os.access(ro, os.W_OK):  # (root may write a read-only file)
        cases.append((str(ro), f"error: --output: cannot write {ro}: permission denied"))
    for out, line in cases:
        assert cli.main(["calibrate", "--study", str(tmp_path / "s.toml"), "--procs", "2", "-o", out]) == 2
        assert one_line_error(capsys).startswith(line)


def test_only_the_rank_that_writes_needs_the_output_folder(tmp_path):
    """Rank 0 writes the file: a rank on another machine, whose working folder may lack the output's, is not
    stopped by it."""
    p = __import__("argparse").ArgumentParser()
    calibrate.add_options(p, launcher=False)
    args = p.parse_args(["--study", "mnist-gossip", "-o", str(tmp_path / "no" / "such" / "c.toml")])
    with pytest.raises(ConfigError, match="--output"):
        calibrate.check_options(args)
    calibrate.check_options(args, writes=False)  # rank 1's view: the other checks only
    args.steps = 1
    with pytest.raises(ConfigError, match="--steps"):
        calibrate.check_options(args, writes=False)


def need_netlab() -> None:
    """Fail, in one line naming what is missing, where netlab cannot run: its tests are the project's only check of
    real shaped links (CI has unshare, ip and tc; a machine without them fails these tests rather than pass them
    unrun)."""
    why = _netlab_usable()
    if why:
        pytest.fail(f"netlab cannot run here: {why} (it needs root, unshare from util-linux, ip and tc from "
                    f"iproute2)", pytrace=False)


def _netlab_usable() -> str:
    """Why netlab cannot run here ('' if it can)."""
    if not NETLAB.is_file():
        return f"{NETLAB} not found"
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    p = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"unshare -n is not permitted here ({p.stderr.strip() or p.returncode})"
    return ""


@pytest.mark.system
def test_links_under_netlab_give_the_tbf_rate(tmp_path, data_dir):
    """2 ranks, each in its own network namespace with its own 50 Mbit/s link (tbf both ways): the fitted
    bandwidth is within 25% of 6.25e6 bytes/s."""
    need_netlab()
    (tmp_path / "s.toml").write_text(study_text(model='name = "mlp"\nhidden = [128]'))  # 407 KB of parameters
    out = tmp_path / "net.toml"
    env = dict(os.environ, EVOMERGE_THREADS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([str(NETLAB), "2", "50mbit", "--", sys.executable, "-m", "evomerge.calibrate", "--study",
                        str(tmp_path / "s.toml"), "-o", str(out), "--data-dir", str(data_dir), "--steps", "5",
                        "--warmup", "1", "--repeats", "3", "--timeout", "90"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    bw = tomllib.loads(out.read_text())["environment"]["bandwidth_matrix"]
    rate = 50e6 / 8
    print(f"netlab 50mbit ({rate:.3g} B/s): fitted {bw[0][1]:.4g} (0 -> 1) and {bw[1][0]:.4g} B/s (1 -> 0)")
    for v in (bw[0][1], bw[1][0]):
        assert abs(v - rate) <= 0.25 * rate, bw


TRACE_STUDY = STUDY.replace("[model]\n{model}", '[model]\nfactory = "user_mlp:mlp"')
USER_MLP = """
import torch.nn as nn


def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))
"""


def merger_job(tmp_path: Path, data_dir, policy: str, world: int, slow_rank: int, overlap: str | None = None,
               step_sleep: float = 0.01) -> None:
    """The user's loop (tests/merger_loop.py) on ``world`` ranks, as torchrun starts them, on the study
    ``tmp_path/s.toml`` with the policy file ``tmp_path/policy``: every rank's step sleeps ``step_sleep``,
    ``slow_rank``'s 3x as long; traces in ``tmp_path/out/trace-0``. Every rank must end well."""
    port, procs = free_port(), []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(LOOP), "--study", str(tmp_path / "s.toml"), "--data-dir",
                                       str(data_dir), "--policy", str(tmp_path / policy), "--out",
                                       str(tmp_path / "out"), "--step-sleep", str(step_sleep), "--slow-rank", str(slow_rank),
                                       "--slow-factor", "3", *(["--overlap", overlap] if overlap else [])],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.system
def test_from_trace_fits_a_merger_runs_traces(tmp_path, data_dir, capsys):
    """A Merger job of 3 ranks (ring gossip, push-pull), rank 2 a device 3x slower (the loop's sleep): its
    traces give the slow rank about a third of the speed, measured links, and a file a study runs on. The slow
    rank sleeps to take 3 x (its compute + the sleep), as `evomerge calibrate` emulates a device: it slept 3 x the
    sleep only, the ratio was (sleep + c) / (3 sleep + c), and a busy machine's few ms of c gave 0.418 (CI,
    2026-11-28), out of 1/3 +- 20%. Each step sleeps 20 ms: at 10 ms, 3 ranks on CI's 2 busy cores gave 0.396
    (2026-12-06), the fast ranks' compute stretched by their turns on the cores while the slow one slept."""
    (tmp_path / "user_mlp.py").write_text(USER_MLP)
    (tmp_path / "s.toml").write_text(TRACE_STUDY.format(workers=3, batch=16, environment="").replace(
        "steps = 20", "steps = 40"))
    (tmp_path / "ring.json").write_text(json.dumps({"scheme": "gossip", "topology": "ring", "exchange": "push_pull",
                                                    "mean_interval": 3}))
    merger_job(tmp_path, data_dir, "ring.json", world=3, slow_rank=2, overlap="nonblocking", step_sleep=0.02)
    trace = tmp_path / "out" / "trace-0"
    out = tmp_path / "cluster.toml"
    assert cli.main(["calibrate", "--from-trace", str(trace), "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 3 ranks")
    env = tomllib.loads(out.read_text())["environment"]
    s = env["speeds"]
    print(f"from the trace: speeds {s}, the slow rank at {s[2] / np.mean(s[:2]):.3f} of the others")
    assert abs(s[2] / np.mean(s[:2]) - 1 / 3) <= 0.2 / 3, s
    ring = [(0, 1), (1, 2), (2, 0)]
    assert all(env["bandwidth_matrix"][i][j] >= 0 and env["bandwidth_matrix"][j][i] >= 0 for i, j in ring)
    assert "# transfers:" in out.read_text()
    # the time each rank spent inside merger.step(), which the clock charges only as the waits it models
    assert re.search(r"^# time inside merger\.step\(\) \(merges applied and sent, waits for peers\): rank 0: [\d.]+ "
                     r"(us|ms|s) over 39 steps \([\d.]+% of its time\); rank 1: .*; rank 2: ", out.read_text(), re.M), \
        out.read_text()
    # the Merger's own work at a merge (a gossip step's send, an applied payload), its waits out: charged by the clock
    assert 0 < env["merge_time"] < 0.05, env
    assert re.search(r"^# merge_time: a rank's own time inside merger\.step\(\) at a step with a merge .*\(means per "
                     r"rank: rank 0: [\d.]+ (us|ms) at a merge, [\d.]+ (us|ms) without; ", out.read_text(), re.M), \
        out.read_text()
    # the model it timed, as the Merger's trace says it: a study of another model is told (it was not)
    timed = re.search(r"^# model: (\d+) bytes of float32 parameters and buffers$", out.read_text(), re.MULTILINE)
    assert timed, out.read_text()
    (tmp_path / "run.toml").write_text(TRACE_STUDY.format(workers=3, batch=16, environment=(
        f'[environment]\nfrom = "{out.name}"\ntime_budget = 0.5')))
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", "ring-gossip", "--data-dir",
                     str(data_dir), "--quiet"]) == 0
    assert "study.environment.from" not in capsys.readouterr().err  # the model the trace timed
    (tmp_path / "wide.toml").write_text((tmp_path / "run.toml").read_text().replace(
        '"user_mlp:mlp"', '"user_mlp:mlp"\noptions = { hidden = 64 }'))
    assert cli.main(["run", "--study", str(tmp_path / "wide.toml"), "--policy", "ring-gossip", "--data-dir",
                     str(data_dir), "--quiet"]) == 0
    assert f"note: study.environment.from: {out} timed steps of a model of {int(timed[1]):,} bytes; this study's " \
           "model has " in capsys.readouterr().err
    # the job against the clock: gossip lets each rank step at its own pace, and the clock gives every worker the
    # job's steps (step_budget "per_worker"), the slow one's time the job's
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ring.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == 0
    got = capsys.readouterr().out
    m = re.search(r"the job took ([\d.]+) s for 40 steps a rank on 3 ranks .*; the clock says ([\d.]+) s, "
                  r"([+-][\d.]+)% off$", got, re.M)
    assert m, got
    with capsys.disabled():
        print(f"ring gossip, 3 ranks: job {m[1]} s, clock {m[2]} s, {m[3]}%")
    assert abs(float(m[3])) < 50, got  # (the job's own calibration: far off is a wrong clock)
    # the trace says how the job's Merger overlapped its merges: the clock takes it, or refuses what it cannot model
    first = json.loads((trace / "rank-0.jsonl").read_text().splitlines()[0])
    assert first["overlap"] == "nonblocking" and first["ranks"] == 3 and first["policy"]["topology"] == "ring"
    for overlap, rc, said in (("blocking", 0, "note: --against: the job's Merger ran overlap 'blocking'; the clock "
                                              "takes it (the study's [environment] has 'nonblocking', the default)"),
                              ("lockstep", 2, "error: --against: the job's Merger ran overlap 'lockstep' (every "
                                              "rank merges at the same steps, waiting for the others), which the "
                                              "clock does not model for scheme 'gossip'")):
        rows = (trace / "rank-0.jsonl").read_text().splitlines()
        rows[0] = json.dumps(first | {"overlap": overlap})
        (trace / "rank-0.jsonl").write_text("\n".join(rows) + "\n")
        assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ring.json"),
                         "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == rc
        assert said in capsys.readouterr().err


@pytest.mark.system
@pytest.mark.timeout(420)  # (two jobs of up to 150 s each, where the first is off)
def test_a_gossip_jobs_trace_under_netlab_gives_the_tbf_rate(tmp_path, data_dir):
    """4 ranks of a Merger job (push-pull ring gossip every 10 steps, rank 3 a device 3x slower), each in its own
    network namespace with its own 50 Mbit/s link: the links fitted from the job's own trace are at the tbf rate,
    their median within 10% and each within 35% (6.25e6 bytes/s). The transfers share senders and receivers (a
    rank answers one peer while its own request travels): fitted on their durations the median link came out
    40% too slow, which made the all-reduce's prediction 56% too slow (benchmarks/sim_vs_real.py). Messages on
    one link go one after the other, and the links never seen alone are fitted on the transfers at their two
    ends: before those two, their fits ranged over 0.58x to 1.79x the rate, and 1 run in 4 failed here (15 runs,
    a busy second core); with them, 0.76x to 1.13x (29 traces). With the clock's shares (an equal share of the
    most crowded of the sender's uplink, the receiver's downlink and the pair's connection) taken out of each
    transfer, 0.94x to 1.16x (7 traces, 4 with the fast tests beside them), and one link at 1.26x in a full
    suite's run (CI, 2026-11-25): each link is held to 35%, the median to 10%."""
    need_netlab()
    (tmp_path / "user_mlp.py").write_text(USER_MLP)
    (tmp_path / "s.toml").write_text(TRACE_STUDY.format(workers=4, batch=16, environment="").replace(
        "steps = 20", "steps = 120").replace('"user_mlp:mlp"', '"user_mlp:mlp"\noptions = { hidden = 128 }'))  # 407 KB
    (tmp_path / "ring.json").write_text(json.dumps({"scheme": "gossip", "topology": "ring", "exchange": "push_pull",
                                                    "mean_interval": 10}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rate = 50e6 / 8
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def fitted(run: int) -> list[float]:
        p = subprocess.run([str(NETLAB), "4", "50mbit", "--", sys.executable, str(LOOP), "--study",
                            str(tmp_path / "s.toml"), "--data-dir", str(data_dir), "--policy",
                            str(tmp_path / "ring.json"), "--out", str(tmp_path / f"out{run}"), "--step-sleep", "0.02",
                            "--slow-rank", "3", "--slow-factor", "3", "--overlap", "nonblocking"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
        assert p.returncode == 0, p.stderr[-3000:]
        m = calibrate.from_trace(tmp_path / f"out{run}" / "trace-0")
        got = [m.bandwidth[i][j] for i, j in ring] + [m.bandwidth[j][i] for i, j in ring]
        print(f"netlab 50mbit ({rate:.3g} B/s), fitted from a gossip job's trace: {[f'{v:.3g}' for v in got]}; "
              f"{m.notes[0]}")
        return got

    def near(got: list[float]) -> bool:
        return abs(np.median(got) - rate) <= 0.1 * rate and all(abs(v - rate) <= 0.35 * rate for v in got)

    got = fitted(0)
    if not near(got):  # a busy core delays a rank's wake-up and the transfers it times (one link came out 0.615x the
        # rate beside a full suite's other worker): the job again, held to the same bounds
        got = fitted(1)
    assert abs(np.median(got) - rate) <= 0.1 * rate, got
    for v in got:
        assert abs(v - rate) <= 0.35 * rate, got


def test_from_trace_fits_a_link_never_alone_on_the_transfers_at_its_ends(tmp_path):
    """0 -> 1 and 2 -> 1 (1 MB, 1e7 B/s) share receiver 1 and split it unevenly, first come first served: 0 -> 1
    arrives after 0.125 s and 2 -> 1 after 0.2 s, so counted as fair shares 0 -> 1 looks 1.23x too fast and 2 -> 1
    1.19x too slow, each seen alone only twice (fewer than LONE_ENOUGH). The transfers through their ends (the
    lone 0 -> 2 and 2 -> 0 too) give both the rate."""
    mb, t = 1_000_000, []
    for k in range(2):  # alone, one after the other
        t += [(0, 1, mb, 10.0 * k, 10.0 * k + 0.1), (2, 1, mb, 10.0 * k + 1, 10.0 * k + 1.1)]
    for k in range(2):  # at once, first come first served
        t += [(0, 1, mb, 100.0 + k, 100.125 + k), (2, 1, mb, 100.0 + k, 100.2 + k)]
    for k in range(3):  # the senders' other links, alone
        t += [(0, 2, mb, 200.0 + k, 200.1 + k), (2, 0, mb, 300.0 + k, 300.1 + k)]
    write_trace(tmp_path / "tr", t)
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.bandwidth[0][1] == pytest.approx(1e7) and m.bandwidth[2][1] == pytest.approx(1e7), m.bandwidth
    assert m.bandwidth[0][2] == pytest.approx(1e7) and m.bandwidth[2][0] == pytest.approx(1e7)
    assert any("2 of 4 links had 3 or more such and are fitted on those alone, 2 on the transfers at their two ends"
               in n for n in m.notes), m.notes


def test_from_trace_counts_messages_queued_on_one_link_one_after_the_other(tmp_path):
    """Two 1 MB messages from 0 to 1 sent 1 ms apart (a push-pull answer, then the rank's own request) go one
    after the other on the pair's connection, at 1e7 B/s: 0.1 s each. Counted as sharing the link, the first
    would look 2x too fast and the second 1.5x too slow."""
    mb, t = 1_000_000, []
    for k in range(3):
        t += [(0, 1, mb, 10.0 * k, 10.0 * k + 0.1), (0, 1, mb, 10.0 * k + 0.001, 10.0 * k + 0.2)]
    assert calibrate.queued(t)[1] == (0, 1, mb, 0.1, 0.2) and calibrate.queued(t)[0] == t[0]
    write_trace(tmp_path / "tr", t)
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.bandwidth[0][1] == pytest.approx(1e7)
    assert any("6 of 6 had both ends to themselves" in n for n in m.notes), m.notes


def test_a_trace_of_all_reduces_only_says_its_links_were_not_measured_point_to_point(tmp_path):
    """(Its file said "12 of 12 directed links measured with model-sized messages", where no message went from one
    rank to another alone.) 3 ranks, 400 KB all-reduces of 0.1 s at the last rank in: 2 (W-1)/W x bytes / 0.1 s."""
    write_trace(tmp_path / "tr", [])
    for r in range(3):
        with open(tmp_path / "tr" / f"rank-{r}.jsonl", "a") as f:
            for ev in range(4):
                f.write(json.dumps({"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": 400_000,
                                    "seconds": 0.1 + 0.05 * r}) + "\n")
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.links_from_allreduce and m.bandwidth[0][1] == pytest.approx(2 * 2 / 3 * 400_000 / 0.1)
    _, notes = calibrate.fit(m)
    assert "links: 6 of 6 directed links given the rate of the all-reduces of 400000 bytes (none measured point " \
           "to point)" in notes, notes
    assert not any("model-sized messages" in n for n in notes)


def test_a_compressed_diloco_jobs_all_gathers_fit_links_on_the_bytes_they_move(tmp_path):
    """(A compressed DiLoCo job's records hold one rank's encoded change, 26 kB, which the Merger all-gathers: fitted
    as a ring all-reduce of 26 kB, a 4-rank job's 50 Mbit/s links came out 0.36x their rate.) 4 ranks, 100 kB each,
    0.048 s at the last rank in: (W - 1) x 100 kB reach each rank in that time."""
    write_trace(tmp_path / "tr", [])
    for r in range(3):
        f = tmp_path / "tr" / f"rank-{r}.jsonl"
        rows = f.read_text().splitlines()
        head = {"model_bytes": 400_000, "policy": {"scheme": "allreduce", "payload": "delta", "topk_fraction": 0.1,
                                                   "outer_optimizer": "nesterov"}, "seed": 0, "ranks": 3}
        recs = [json.dumps({"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": 100_000,
                            "seconds": 0.05 + 0.02 * r, "wire_s": 0.048 + 0.02 * r}) for ev in range(4)]
        f.write_text("\n".join([json.dumps(head), *rows, *recs]) + "\n")
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.allreduce == (0.048, 150_000)  # 3 x 100 kB / 2: the ring all-reduce that moves as much
    assert m.bandwidth[0][1] == pytest.approx(2 * 100_000 / 0.048)  # (W - 1) x 100 kB in 0.048 s
    assert any(n.startswith("all-gathers of each rank's encoded change (payload delta on the all-reduce scheme): 4, "
                            "median of each one's shortest time 48 ms for 100000 bytes a rank, as a ring all-reduce of "
                            "3 x 100000 / 2 bytes") for n in m.notes), m.notes


def test_a_streaming_jobs_trace_fits_links_on_its_all_reduces_not_its_fragments_flights(tmp_path):
    """(A Streaming DiLoCo job's fragments record their time from the send to the landing, fragment_delay steps
    later: taken for all-reduces, and their sizes mixed, the links came out 15-30x too slow.) Fragments that land
    later are left out; of all-reduces of several sizes, the largest give the rate."""
    write_trace(tmp_path / "tr", [])
    for r in range(3):
        with open(tmp_path / "tr" / f"rank-{r}.jsonl", "a") as f:
            for ev in range(4):  # a streamed fragment: 0.02 s of bytes, 1.5 s to its landing two steps later
                f.write(json.dumps({"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": 200_000,
                                    "fragment": ev % 2, "landed_step": 5 * ev + 7, "seconds": 1.5 + 0.05 * r}) + "\n")
            for ev in range(4, 8):  # fragments that land at once (fragment_delay 0), of two sizes
                nbytes = 400_000 if ev % 2 else 2_600
                f.write(json.dumps({"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": nbytes,
                                    "fragment": ev % 2, "landed_step": 5 * ev + 5,
                                    "seconds": (0.1 if ev % 2 else 0.001) + 0.05 * r}) + "\n")
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.allreduce == (0.1, 400_000) and m.bandwidth[0][1] == pytest.approx(2 * 2 / 3 * 400_000 / 0.1)
    assert any(n.startswith("12 streamed fragments' all-reduces left out") for n in m.notes), m.notes


def test_a_trace_of_streamed_fragments_alone_says_on_the_terminal_that_its_links_are_free(tmp_path, capsys):
    """(A new user's Streaming DiLoCo job: the terminal said "no links" and the search on the file charged its
    merges nothing for the network.) One note says why and where measured links go; the file has no link keys."""
    write_trace(tmp_path / "tr", [])
    for r in range(3):
        with open(tmp_path / "tr" / f"rank-{r}.jsonl", "a") as f:
            for ev in range(4):
                f.write(json.dumps({"event": ev, "kind": "allreduce", "step": 4 * ev + 3, "bytes": 200_000,
                                    "fragment": ev % 2, "landed_step": 4 * ev + 4, "seconds": 0.03}) + "\n")
    assert cli.main(["calibrate", "--from-trace", str(tmp_path / "tr"), "-o", str(tmp_path / "c.toml")]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("no links"), out
    assert err.count("\n") == 1 and err.startswith(
        "note: links: the traces measure none (its merges are streamed fragments, whose all-reduces ran behind the "
        "loop's compute): the file's links are free"), err
    env = tomllib.loads((tmp_path / "c.toml").read_text())["environment"]
    assert not {"latency", "bandwidth", "latency_matrix", "bandwidth_matrix"} & env.keys(), env
    write_trace(tmp_path / "tr2", [(0, 1, 100_000, 1.0, 1.01)] * 3)  # a trace with a link: no such note
    assert cli.main(["calibrate", "--from-trace", str(tmp_path / "tr2"), "-o", str(tmp_path / "c2.toml")]) == 0
    out, err = capsys.readouterr()
    assert "measure none" not in err  # and its one size's links say why their latency is 0 (read as wrong)
    assert out.rstrip().endswith("(median); latency 0: one message size cannot tell it apart, its cost is in the "
                                 "bandwidth"), out


def test_from_trace_leaves_out_transfers_that_came_before_their_receive_was_posted(tmp_path):
    """A policy that sends faster than its link carries (gossip every step on 50 Mbit/s): a rank posts its receives
    a few events ahead, and a message whose bytes came before its receive was posted "arrives" at the posting, in no
    time. Counted as alone, those fitted every link "unlimited" (0 s for 400 KB). 1 MB at 1e7 B/s, 8 messages sent
    at once, the last 4 received only after they came."""
    mb = 1_000_000
    t = [(0, 1, mb, 0.0, 0.1 * (k + 1)) for k in range(4)]
    t += [(0, 1, mb, 0.0, 0.1 * (k + 1), 0.1 * (k + 1) + 0.5) for k in range(4, 8)]  # posted 0.5 s after it came
    write_trace(tmp_path / "tr", t)
    m = calibrate.from_trace(tmp_path / "tr")
    assert m.bandwidth[0][1] == pytest.approx(1e7)  # (2e7 with them: half the transfers in no time)
    assert any("; 4 left out, with no time of their own (their bytes came before their receive was posted" in n
               for n in m.notes), m.notes
    # all of them so: no link measured, and the terminal says so (the file's links are free)
    write_trace(tmp_path / "all", [x for x in t if len(x) == 6])
    _, warnings = calibrate.write(calibrate.from_trace(tmp_path / "all"), tmp_path / "c.toml")
    assert warnings == ["warning: all 4 point-to-point transfers had no time of their own: the links are not measured "
                        "from this trace; measure them with evomerge calibrate (--procs, or under your launcher)"]


@pytest.mark.system
def test_ranks_that_are_not_the_studys_workers_get_a_note(tmp_path, data_dir):
    (tmp_path / "s.toml").write_text(study_text(workers=4))
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "calibrate", "--study", str(tmp_path / "s.toml"), "--procs",
                        "2", "-o", str(tmp_path / "c.toml"), "--data-dir", str(data_dir), "--steps", "3", "--warmup",
                        "0", "--repeats", "1", "--timeout", "120"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.splitlines()[0] == ("note: 2 ranks for a study of 4 workers: the file's speeds and link matrices are "
                                        "per rank, for a study of 2 workers; --fit writes a speed model and single "
                                        "links, for any number"), p.stderr
    text = (tmp_path / "c.toml").read_text()
    assert len(tomllib.loads(text)["environment"]["speeds"]) == 2
    # rank 0's warnings about the file it wrote reach the terminal (a model this small often draws one)
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("warning: ")] == \
        [ln[2:] for ln in text.splitlines() if ln.startswith("# warning: ")], (p.stderr, text)


def test_a_gone_ranks_line_leaves_out_gloos_source_location():
    """(A rank killed under netlab: `another rank is gone ([/__w/pytorch/pytorch/third_party/gloo/gloo/transport/
    tcp/pair.cc:553] Connection closed by peer ...)`.)"""
    e = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                     "peer [10.77.0.4]:27834\nmore")
    assert calibrate._peer_failed(e, 60) == "another rank is gone (Connection closed by peer [10.77.0.4]:27834)"


@pytest.mark.integration
def test_a_recalibrated_cluster_file_is_named_in_one_short_line_by_search_status_and_export(tmp_path, data_dir,
                                                                                           monkeypatch, capsys):
    """A study reads its cluster with environment.from; the file is recalibrated after the search. `search` refused
    in a line of 900 characters that listed the matrices and never named the file; `status`, `export` and the
    dashboard said nothing (the stored definition reads the file as it is now)."""
    from conftest import write_study

    monkeypatch.setenv("EVOMERGE_DATA_DIR", str(data_dir))
    f = write_study(tmp_path, name="calnet", workers=3, steps=20)
    f.write_text(f.read_text() + '[environment]\nfrom = "cluster.toml"\ntime_budget = 0.5\n')
    lat, bw = links(3, lambda i, j: 1e-4, lambda i, j: 1e8)
    calibrate.write(calibrate.Measured(made_up([1.0, 1.0, 0.5], n=50), lat, bw, source="made up"),
                    tmp_path / "cluster.toml")
    runs = str(tmp_path / "runs")
    assert cli.main(["search", "--study", str(f), "--n-trials", "2", "--runs-dir", runs, "--quiet"]) == 0
    capsys.readouterr()
    lat, bw = links(3, lambda i, j: 2e-3, lambda i, j: 6e6 + i)  # recalibrated: slower links, another slow rank
    calibrate.write(calibrate.Measured(made_up([0.4, 1.0, 1.0], n=50, seed=1), lat, bw, source="made up again"),
                    tmp_path / "cluster.toml")
    assert cli.main(["search", "--study", str(f), "--n-trials", "4", "--runs-dir", runs, "--quiet"]) == 2
    line = one_line_error(capsys)
    assert re.fullmatch(r"error: study calnet: environment\.from cluster\.toml changed \((\w+, ){3}\w+ and \d+ more\) "
                        r"since its 2 stored trials; use another \[study\] name or --runs-dir to start afresh", line), line
    assert len(line) < 250 and "[[" not in line
    for command in (["status"], ["export", "-o", str(tmp_path / "best.json")]):
        assert cli.main([*command, "--study", str(f), "--runs-dir", runs]) == 0
        notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: study 'calnet' changed")]
        assert len(notes) == 1 and notes[0].startswith(
            "note: study 'calnet' changed since its trials ran: environment.from cluster.toml changed ("), notes
        assert notes[0].endswith("; its trials' figures are from before"), notes
    # the [environment] written out in the study file instead, and (another study) the other way round: said so (it
    # said "environment.from cluster.toml changed" of a study whose trials never read that file)
    inline = f.read_text().replace('from = "cluster.toml"\n', "step_time = 0.01\n")
    f.write_text(inline)
    assert cli.main(["search", "--study", str(f), "--n-trials", "4", "--runs-dir", runs, "--quiet"]) == 2
    line = one_line_error(capsys)
    assert line.startswith("error: study calnet: [environment] is now written in the study file, not from "
                           "cluster.toml ("), line
    f.write_text(inline[:inline.index("[environment]")])  # none at all: not "written in the study file"
    assert cli.main(["search", "--study", str(f), "--n-trials", "4", "--runs-dir", runs, "--quiet"]) == 2
    line = one_line_error(capsys)
    assert "written in the study file" not in line and "-> absent)" in line, line
    g = tmp_path / "other.toml"
    g.write_text(inline.replace('name = "calnet"', 'name = "calnet2"'))
    assert cli.main(["search", "--study", str(g), "--n-trials", "1", "--runs-dir", runs, "--quiet"]) == 0
    g.write_text(g.read_text().replace("step_time = 0.01\n", 'from = "cluster.toml"\n'))
    capsys.readouterr()
    assert cli.main(["search", "--study", str(g), "--n-trials", "2", "--runs-dir", runs, "--quiet"]) == 2
    line = one_line_error(capsys)
    assert re.fullmatch(r"error: study calnet2: \[environment\] is now from cluster\.toml, not written in the study "
                        r"file \((\w+, ){3}\w+ and \d+ more differ\) since its 1 stored trial; use another \[study\] "
                        r"name or --runs-dir to start afresh", line), line


def test_each_ranks_fields_give_its_measured_mean_step_and_a_far_one_is_said(tmp_path, capsys):
    """(A 2-rank job's run was simulated 4-5% short, and a new user's small LSTM 54% short, calibrated from its own
    traces: the file wrote each rank's median step, and long steps that are no clear tail raised the means a run's
    time is made of, by 38-46% there.) step_time is scaled so that the clock's steps take the ranks' measured means
    in total (the speeds stay the medians' ratios: each rank's own mean made a 3x slower rank 0.42 on a loaded
    machine); the file says each rank's mean against its median and noise, and the terminal a note where one is more
    than 10% off."""
    even = [0.01] * 20
    tail = [0.01] * 18 + [0.03] * 2  # two long steps: fewer spells than a clear tail takes
    env, notes = calibrate.fit_compute([even, tail])
    assert env["straggle_p"] == 0.0 and env["jitter"] == 0.0
    assert env["step_time"] == 0.011 and env["speeds"] == [1.0, 1.0]
    (said,) = [n for n in notes if n.startswith("mean step")]
    assert "rank 0: 10 ms vs 10 ms (+0.0%), rank 1: 12 ms vs 10 ms (+20.0%)" in said, said
    (noted,) = [n for n in notes if n.startswith(("note: ", "warning: "))]
    assert noted == ("note: mean step against its median x exp(jitter^2 / 2): rank 1's 12 ms is +20% (long steps "
                     "that are no clear tail of slow spells): step_time is scaled so that the ranks' steps take their "
                     "measured means in total, with a spread unlike theirs"), noted
    _, notes = calibrate.fit_compute([even, even])
    assert not any(n.startswith(("note: ", "warning: ")) for n in notes)
    # one pause among a calibration's steps is no rank's speed (one 1 s pause among 50 steps of 10 ms made it 0.34);
    # three or more recur, and count
    paused = [0.01] * 49 + [1.0]
    env, notes = calibrate.fit_compute([[0.01] * 50, paused])
    assert env["speeds"] == [1.0, 1.0], env
    assert [n for n in notes if n.startswith("note: ")] == [
        "note: steps over 10 x their rank's median, fewer than 3 a rank, left out of its mean as pauses, not its steps "
        "(rank 1: 1 s): a run's time has them only where they recur"]
    assert env["step_time"] == 0.01
    env, _ = calibrate.fit_compute([[0.01] * 50, [0.01] * 47 + [0.5] * 3])
    assert env["step_time"] == pytest.approx((0.01 + 0.01 * 47 / 50 + 0.5 * 3 / 50) / 0.02 * 0.01, rel=0.01), env
    # steps as the clock draws them from fitted fields (jitter, slow spells): fitted again, their means are what
    # the fields give, and the clock's steps from the refit take those means
    env = {"step_time": 0.01, "speeds": (1.0, 0.5), "jitter": 0.2, "straggle_p": 0.02, "straggle_length": 3.0,
           "straggle_factor": 4.0}
    steps = [list(drawn_times) for drawn_times in draw_steps(env, 2, 20000)]
    fitted, notes = calibrate.fit_compute(steps)
    (said,) = [n for n in notes if n.startswith("mean step")]
    offs = [float(x) for x in re.findall(r"\(([+-][\d.]+)%\)", said)]
    assert len(offs) == 2 and all(abs(o) < 3 for o in offs), said
    assert drawn_means(fitted, 2).sum() == pytest.approx(sum(np.mean(t) for t in steps), rel=0.02)
    # from a trace, as a user runs it: the note on the terminal, the per-rank figures in the file, the means kept
    d = tmp_path / "tr"
    write_trace(d, [], steps=25)
    rows = (d / "rank-1.jsonl").read_text().splitlines()
    rows[-2:] = [json.dumps({"step": 24, "compute_s": 0.03}), json.dumps({"step": 25, "compute_s": 0.03})]
    (d / "rank-1.jsonl").write_text("\n".join(rows) + "\n")
    assert cli.main(["calibrate", "--from-trace", str(d), "-o", str(tmp_path / "c.toml")]) == 0
    assert "note: mean step against its median x exp(jitter^2 / 2): rank 1's 12 ms is +20%" in capsys.readouterr().err
    text = (tmp_path / "c.toml").read_text()
    assert "# mean step, measured vs what its median and the noise above give on average: rank 0: 10 ms vs 10 ms " \
           "(+0.0%)" in text
    assert "step_time = 0.01067\nspeeds = [1.0, 1.0, 1.0]" in text, text


@pytest.mark.system
def test_run_against_a_merger_jobs_traces_states_the_clocks_error(tmp_path, data_dir, capsys):
    """The simulator held against a real run, by a user: a Merger job of 2 ranks (all-reduce every 2 steps, rank 1
    a device 3x slower), calibrated from its own traces; `run --against` runs the job's steps on that clock and
    prints its time beside the job's, with the error. A policy other than the one the job ran is refused."""
    (tmp_path / "user_mlp.py").write_text(USER_MLP)
    (tmp_path / "s.toml").write_text(TRACE_STUDY.format(workers=2, batch=16, environment="").replace(
        "steps = 20", "steps = 60"))
    policy = {"scheme": "allreduce", "mean_interval": 2}
    (tmp_path / "ar.json").write_text(json.dumps(policy))
    merger_job(tmp_path, data_dir, "ar.json", world=2, slow_rank=1)
    trace = tmp_path / "out" / "trace-0"
    W, steps, seconds = calibrate.job_time(trace)
    assert W == 2 and steps == [60, 60] and 60 * 0.03 < seconds < 60, (steps, seconds)  # rank 1's sleeps at least
    assert cli.main(["calibrate", "--from-trace", str(trace), "-o", str(tmp_path / "cluster.toml")]) == 0
    # a study that searches time to target (which needs a time budget, set aside here): the user's own
    (tmp_path / "run.toml").write_text(TRACE_STUDY.format(workers=2, batch=16, environment=(
        '[environment]\nfrom = "cluster.toml"\ntime_budget = 0.5\n[objectives]\nmetrics = ["time_to_target"]\n'
        'target = 0.5')))
    capsys.readouterr()
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ar.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace), "--json",
                     str(tmp_path / "r.json")]) == 0
    got = capsys.readouterr()
    out = got.out
    doc = json.loads((tmp_path / "r.json").read_text())["against"]
    assert doc["ranks"] == 2 and doc["steps"] == 60 and doc["job_seconds"] == pytest.approx(seconds)
    assert doc["error"] == pytest.approx(doc["clock_seconds"] / seconds - 1)
    m = re.search(rf"^against {re.escape(str(trace))}: the job took ([\d.]+) s for 60 steps a rank on 2 ranks \(its "
                  r"first step to its last finish\(\)\); the clock says ([\d.]+) s, ([+-][\d.]+)% off$", out, re.M)
    assert m, out
    job, clock, off = float(m[1]), float(m[2]), float(m[3])
    assert job == pytest.approx(seconds, rel=1e-3) and off == pytest.approx((clock / job - 1) * 100, abs=0.1)
    with capsys.disabled():
        print(f"job {job} s, clock {clock} s, {off:+.1f}%")
    assert abs(off) < 50, out  # (the same steps, on the job's own calibration: far off is a wrong clock, not load)
    # the Merger's own share of the job's time (the least of the ranks', read from the traces here): said beside a
    # clock that is 10% short or more, where it is 5% or more
    def least_share(folder) -> float:
        shares = []
        for f in sorted(folder.glob("rank-*.jsonl")):
            st = [r for r in map(json.loads, f.read_text().splitlines()) if "compute_s" in r and "kind" not in r]
            inside = sum(max(0.0, b["t"] - b["compute_s"] - a["t"]) for a, b in zip(st, st[1:]))
            shares.append(inside / (st[-1]["t"] - st[0]["t"]))
        return min(shares)

    said = [ln for ln in got.err.splitlines() if "inside merger.step()" in ln]
    assert "computed" not in got.err  # (calibrated from this job: its step is the file's)
    short = doc["clock_seconds"] < 0.9 * doc["job_seconds"]  # (unrounded, as the command compares them: 10% short)
    assert said == [] if least_share(trace) < 0.05 or not short else len(said) == 1, got.err
    # the same job with half of each step's compute spent inside merger.step() instead, and finished 10 s later (the
    # clock short): the least share of the ranks said
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in trace.glob("rank-*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        for r in rows:
            if "compute_s" in r and "kind" not in r:
                r["compute_s"] /= 2
            if isinstance(r.get("end"), (int, float)):
                r["end"] += 10.0
        (edited / f.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # without --policy: the one the traces name (a new user gave --policy the file the traces already held)
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--data-dir", str(data_dir), "--quiet",
                     "--against", str(edited)]) == 0
    got = capsys.readouterr()
    assert ": the job's policy (seed 0)" in got.out and f"against {edited}: the job took" in got.out, got.out
    # traces that do not name it (an older Merger's), or name a field this evomerge does not read: one line each
    for change, said in (({"policy": None}, "error: --policy: required; the traces of --against do not name the job's "
                                            "policy (an older evomerge's Merger); see evomerge run --help"),
                         ({"policy": {"scheme": "allreduce", "bogus_field": 1}},
                          "error: --against: the job's policy, as its traces say, is not one this evomerge reads "
                          "(policy.bogus_field: unknown key; allowed: ")):
        other = tmp_path / f"other-{len(said)}"
        other.mkdir()
        for f in trace.glob("rank-*.jsonl"):
            rows = [json.loads(line) for line in f.read_text().splitlines()]
            rows[0] = {k: v for k, v in (rows[0] | change).items() if v is not None}
            (other / f.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--data-dir", str(data_dir), "--quiet",
                         "--against", str(other)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(said) and len(err.splitlines()) == 1, err
    # its compute halved: half the step the file says, and said (a job on a file of another device was +99%, and
    # nothing said why)
    step_time = tomllib.loads((tmp_path / "cluster.toml").read_text())["environment"]["step_time"]
    # the Merger's own work at a merge, fitted from the job's trace (its records' wait_s): the clock charges it
    merge_time = tomllib.loads((tmp_path / "cluster.toml").read_text())["environment"]["merge_time"]
    assert 0 < merge_time < 0.05, merge_time
    assert re.search(r"^note: --against: the job's ranks computed [\d.]+ ms a step on average, the clock's "
                     rf"workers [\d.]+ ms \(the study's \[environment\], step_time {step_time * 1e3:.3g} ms; "
                     rf"0\.[3-6]\dx\): the clock times steps other than this job's: another device or "
                     rf"model, or another job's load on the machine \(`evomerge calibrate --from-trace {re.escape(str(edited))}` fits this job's\)$",
                     got.err, re.M), (got.err, step_time)
    assert least_share(edited) >= 0.05
    assert [ln for ln in got.err.splitlines() if "inside merger.step()" in ln] == [
        f"note: --against: every rank spent at least {least_share(edited):.0%} of its time inside merger.step() "
        "(merges applied and sent, the transfers, waits for peers); the clock charges the transfers and waits it "
        f"models and merge_time ({calibrate._ms(merge_time)} at a step where a worker merged), so a job whose steps "
        "are short beside that work comes out short (docs/calibrate.md, How well it predicts)"], got.err
    # refused, one line each: a policy other than the job's (its trace says it), no clock
    (tmp_path / "h7.json").write_text(json.dumps({"scheme": "allreduce", "mean_interval": 7}))
    for policy_arg, study_file, words in [
            # the scheme first, what tells the rules apart (it came past the three fields shown: "(and 1 more)")
            ("ring-gossip", "run.toml", "error: --against: the job ran another policy (scheme 'allreduce' in the job, "
                                        "'gossip' here, "),
            (str(tmp_path / "h7.json"), "run.toml", "error: --against: the job ran another policy (mean_interval 2.0 in "
                                                    "the job, 7.0 here): its time is not the job's; allowed: --policy "
                                                    "the policy the job ran"),
            (str(tmp_path / "ar.json"), "s.toml", "error: --against: test has no [environment]")]:
        assert cli.main(["run", "--study", str(tmp_path / study_file), "--policy", policy_arg, "--data-dir",
                         str(data_dir), "--quiet", "--against", str(trace)]) == 2
        err = one_line_error(capsys)
        assert err.startswith(words.replace("test", err.split()[2]) if "test has" in words else words), err
    # a study of another model (a wider MLP): the clock would time its merges, not the job's (it printed a figure)
    (tmp_path / "wide.toml").write_text((tmp_path / "run.toml").read_text().replace(
        'factory = "user_mlp:mlp"', 'factory = "user_mlp:mlp"\noptions = { hidden = 32 }'))
    assert cli.main(["run", "--study", str(tmp_path / "wide.toml"), "--policy", str(tmp_path / "ar.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after the study's own note: its cluster file's model)
    assert err.startswith("error: --against: the job's model is 50.9 kB (float32 parameters and buffers, its traces "
                          "say), ") and "the clock would time another model's merges; allowed: the study of the " \
        "job's model" in err, err
    # a folder missing the last rank's trace: one line (it was fitted as a job of the ranks there)
    part = tmp_path / "part"
    part.mkdir()
    (part / "rank-0.jsonl").write_text((trace / "rank-0.jsonl").read_text())
    for argv in (["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ar.json"), "--data-dir",
                  str(data_dir), "--quiet", "--against", str(part)],
                 ["calibrate", "--from-trace", str(part), "-o", str(tmp_path / "part.toml")]):
        assert cli.main(argv) == 2
        err = one_line_error(capsys)
        assert err.endswith(f"{part}: rank-1.jsonl is missing (the job ran 2 ranks; ranks 0..0 have traces); "
                            "allowed: a folder of every rank's trace"), err
    assert not (tmp_path / "part.toml").exists()
    # a folder a second job appended to: the last job's (here the same records again, an hour later)
    for r in range(2):
        f = trace / f"rank-{r}.jsonl"
        again = [json.loads(ln) for ln in f.read_text().splitlines()]
        later = [{k: (v + 3600 if k in ("t", "end") else v) for k, v in x.items()} for x in again]
        f.write_text(f.read_text() + "".join(json.dumps(x) + "\n" for x in later))
    assert calibrate.job_time(trace) == (2, [60, 60], pytest.approx(seconds))
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ar.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == 0
    assert f"note: --against: {trace} holds 2 jobs (a Merger appends): the last one is held to the clock" in \
        capsys.readouterr().err
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", "ring-gossip", "--data-dir",
                     str(data_dir), "--quiet", "--against", str(trace)]) == 2
    assert one_line_error(capsys).startswith("error: --against: the job (the folder holds 2 jobs, a Merger appending: "
                                             "the last one's) ran another policy (scheme 'allreduce' in the job")
    (trace / "rank-1.jsonl").write_text("".join(ln + "\n" for ln in (trace / "rank-1.jsonl").read_text().splitlines()
                                                if '"end"' not in ln))
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ar.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == 2
    assert "no step times or no finish()" in one_line_error(capsys)
    # a job resumed from a checkpoint (its trace starts past step 1): not a whole job
    f = trace / "rank-0.jsonl"
    f.write_text("".join(ln + "\n" for ln in f.read_text().splitlines() if '"step": 1,' not in ln))
    assert cli.main(["run", "--study", str(tmp_path / "run.toml"), "--policy", str(tmp_path / "ar.json"),
                     "--data-dir", str(data_dir), "--quiet", "--against", str(trace)]) == 2
    assert "a job resumed from a checkpoint, or ended before its total_steps" in one_line_error(capsys)


def test_from_trace_of_a_folder_two_jobs_appended_to_reads_the_last(tmp_path):
    """A Merger appends to rank-R.jsonl, and each job's event numbers start at 0: read together, a receive of the
    first job was paired with a send of the second (the all-reduces' ranks counted twice, so none was fitted). The
    first job 1e6 B/s all-reduces of 0.5 s, the second 2e6 B/s: the links are the second's."""
    d = tmp_path / "tr"
    d.mkdir()
    for seconds in (0.5, 0.25):  # two jobs, one after the other, into the same folder
        for r in range(2):
            with open(d / f"rank-{r}.jsonl", "a") as f:
                rows = [{"model_bytes": 400_000}] + [{"step": k + 1, "compute_s": 0.01} for k in range(20)]
                rows += [{"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": 500_000,
                          "seconds": seconds + 0.1 * r} for ev in range(4)]
                f.write("".join(json.dumps(x) + "\n" for x in rows))
    m = calibrate.from_trace(d)
    assert m.allreduce == (0.25, 500_000) and m.bandwidth[0][1] == pytest.approx(2 * 1 / 2 * 500_000 / 0.25)
    assert sum(len(t) for t in m.step_times) == 2 * 15 and m.source.endswith(", the last of the 2 jobs the traces hold "
                                                                         "(a Merger appends)"), m.source
    # a rank whose file holds another count of jobs: a folder of mixed jobs, one line naming the flag
    with open(d / "rank-1.jsonl", "a") as f:
        f.write(json.dumps({"model_bytes": 400_000}) + "\n")
    with pytest.raises(ConfigError, match=r"^--from-trace: .*rank-0.jsonl holds the traces of 2 jobs and "
                                          r".*rank-1.jsonl of 3 \(a Merger appends to rank-R.jsonl\): the folder "
                                          r"mixes jobs"):
        calibrate.from_trace(d)


def _job(d: Path, ranks: int, t0: float, seconds: float, steps: int = 20, write=range(10**6)) -> None:
    """A made-up Merger job of ``ranks`` ranks appended to ``d`` (as this evomerge writes its first record: the
    job's ranks and when it began), its all-reduces ``seconds`` long at the last rank in; ranks not in ``write``
    wrote nothing (died before their Merger was made)."""
    d.mkdir(exist_ok=True)
    for r in range(ranks):
        if r not in write:
            continue
        rows = [{"model_bytes": 400_000, "ranks": ranks, "t": t0 + 0.01 * r}]
        rows += [{"step": k + 1, "compute_s": 0.01, "t": t0 + 1 + 0.01 * k} for k in range(steps)]
        rows += [{"event": ev, "kind": "allreduce", "step": 5 * ev + 5, "bytes": 500_000,
                  "seconds": seconds + 0.1 * r} for ev in range(4)]
        rows.append({"end": t0 + 2, "step": steps, "total_steps": steps})
        with open(d / f"rank-{r}.jsonl", "a") as f:
            f.write("".join(json.dumps(x) + "\n" for x in rows))


def test_a_trace_folder_of_jobs_of_other_sizes_reads_the_last_and_names_a_rank_that_wrote_none_of_it(tmp_path):
    """(The folder of a 3-rank job, then a 2-rank one, was refused for its files' counts of jobs; one of a 2-rank
    job then a 3-rank one too.) The last job's ranks are read; a rank file whose records all came before the last
    job began (that rank died before its Merger was made) is one line naming it."""
    d = tmp_path / "shrunk"
    _job(d, 3, 1000.0, 0.5)
    _job(d, 2, 2000.0, 0.25)
    m = calibrate.from_trace(d)
    assert len(m.step_times) == 2 and m.allreduce == (0.25, 500_000)
    assert calibrate.job_time(d)[:2] == (2, [20, 20])
    grown = tmp_path / "grown"
    _job(grown, 2, 1000.0, 0.5)
    _job(grown, 3, 2000.0, 0.25)
    assert len(calibrate.from_trace(grown).step_times) == 3 and calibrate.job_time(grown)[:2] == (3, [20, 20, 20])
    dead = tmp_path / "dead"
    _job(dead, 3, 1000.0, 0.5)
    _job(dead, 3, 2000.0, 0.25, write=(0, 1))  # rank 2 died before its Merger: its file holds the first job only
    with pytest.raises(ConfigError, match=r"^--against: .*rank-2.jsonl: its last job ended before the folder's last "
                                          r"job began \(rank 2 wrote no trace of it\)"):
        calibrate.job_time(dead)


def test_a_trace_folder_of_a_refused_job_or_a_file_given_for_it_says_so(tmp_path):
    """(A job whose ranks ran other policies was refused at its start, each rank's Merger having written its first
    record: `run --against` said "its last job ended before the folder's last job began (rank 0 wrote no trace of
    it)". A rank's file given for the folder said "no such folder".)"""
    d = tmp_path / "trx"
    d.mkdir()
    for r in range(2):
        (d / f"rank-{r}.jsonl").write_text(json.dumps({"model_bytes": 1000, "ranks": 2, "t": 100.0 + r}) + "\n")
    with pytest.raises(ConfigError) as e:
        calibrate.job_time(d)
    assert str(e.value) == (f"--against: {d}: its last job ran no step (every rank wrote its first record and none a "
                            "step: refused or stopped at its start); allowed: the traces of a job that ran (a trace= "
                            "folder of its own)")
    with pytest.raises(ConfigError) as e:
        calibrate.job_time(d / "rank-0.jsonl")
    assert str(e.value) == f"--against: {d / 'rank-0.jsonl'}: a file, not a folder; allowed: the folder of the job's " \
                           f"traces ({d})"
