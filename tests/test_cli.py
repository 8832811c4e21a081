"""The evomerge command as a user runs it: a real subprocess for exit codes and output."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, write_study
from evomerge import cli


def evomerge(*args, data_dir=None, cwd=ROOT):
    env = dict(os.environ)
    if data_dir is not None:
        env["EVOMERGE_DATA_DIR"] = str(data_dir)
    return subprocess.run([sys.executable, "-m", "evomerge.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def tiny_study_file(tmp_path_factory):
    return write_study(tmp_path_factory.mktemp("studies"), steps=40)


@pytest.mark.system
def test_run_prints_the_table_and_writes_json(tmp_path, data_dir, tiny_study_file):
    out = tmp_path / "r.json"
    p = evomerge("run", "--study", str(tiny_study_file), "--policy", "ring-gossip", "--json", str(out), data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    for words in ("consensus val accuracy", "mean worker accuracy", "worst worker accuracy", "consensus distance",
                  "bytes sent", "local steps", "wall time"):
        assert words in p.stdout
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and len(r["history"]) == 3 and r["final"]["step"] == 40
    assert r["policy"]["name"] == "ring-gossip" and r["policy"]["mean_interval"] == 10.0
    # what the table says about how it ran (were only in the table)
    assert r["backend"] == "inprocess" and r["execution"] == "stacked (the named model)", (r["backend"], r["execution"])


@pytest.mark.integration
@pytest.mark.parametrize("command", [["run", "--policy", "ring-gossip"], ["baselines"],
                                     ["search", "--n-trials", "1", "--runs-dir", "RUNS"]])
def test_a_json_file_that_cannot_be_written_is_one_line_before_any_work(tmp_path, data_dir, tiny_study_file, command):
    """(`--json /nonexist/x.json` ran the whole command, printed its table, then ended with FileNotFoundError's
    traceback and exit 1: the results were lost.)"""
    for bad, line in ((tmp_path / "nonexist" / "x.json", f"error: --json: {tmp_path / 'nonexist'}: no such folder"),
                      (tmp_path, f"error: --json: {tmp_path} is a folder; allowed: a file to write")):
        args = [str(tmp_path / "runs") if a == "RUNS" else a for a in command[1:]]
        p = evomerge(command[0], "--study", str(tiny_study_file), *args, "--json", str(bad), data_dir=data_dir,
                     cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [line] and p.stdout == "", (p.stdout, p.stderr)
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing stored


@pytest.mark.integration
def test_a_data_dir_that_does_not_exist_is_one_line_even_where_the_environment_has_the_data(tmp_path, data_dir,
                                                                                           tiny_study_file):
    """(A mistyped --data-dir fell through to $EVOMERGE_DATA_DIR in silence: the run went on with other files than
    the user named.)"""
    p = evomerge("run", "--study", str(tiny_study_file), "--policy", "ring-gossip", "--data-dir",
                 str(tmp_path / "nosuch"), data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.strip().splitlines() == [f"error: --data-dir: {tmp_path / 'nosuch'}: no such folder; allowed: a "
                                             "folder holding mnist/ (or leave it out: $EVOMERGE_DATA_DIR, the user "
                                             "cache, then system places)"], p.stderr


@pytest.mark.system
@pytest.mark.parametrize("runs_dir", ["given", "default"])
def test_a_search_ends_with_the_commands_that_show_and_export_its_results_and_they_work(tmp_path, data_dir,
                                                                                       tiny_study_file, runs_dir,
                                                                                       monkeypatch):
    """(The search said where its stores are, not how to see them: a new user did not find `evomerge ui`. The
    default folder was repeated as `--runs-dir runs` in every command.)"""
    import shlex

    from searchutil import cli as in_process  # the command's own code, without a Python start-up per command

    monkeypatch.delenv("EVOMERGE_RUNS_DIR", raising=False)
    given = ["--runs-dir", str(tmp_path / "runs")] if runs_dir == "given" else []
    p = in_process("search", "--study", str(tiny_study_file), "--n-trials", "2", "--no-verdict", *given,
                   data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    assert line.count("--runs-dir") == (3 if given else 0), line
    commands = [re.sub(r" \(.*\)$", "", c) for c in line.removeprefix("next: ").split("; ")]
    assert [shlex.split(c)[:2] for c in commands] == [["evomerge", "export"], ["evomerge", "ui"],
                                                      ["evomerge", "dashboard"]], line
    export, _, dashboard = (shlex.split(c)[1:] for c in commands)
    q = in_process(*export, data_dir=data_dir, cwd=tmp_path)
    assert q.returncode == 0 and json.loads((tmp_path / "best.json").read_text())["policy"], q.stderr[-2000:]
    q = in_process(*dashboard, "--no-baselines", data_dir=data_dir, cwd=tmp_path)
    assert q.returncode == 0, q.stderr[-2000:]
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "runs" / "runs").exists()


@pytest.mark.system
def test_json_to_a_file_that_stands_for_a_stream_is_written(tmp_path, data_dir, tiny_study_file):
    """`--json /dev/stdout`, or a shell's `--json >(jq .)`: a file that exists in a folder that takes none (the check
    that it can be written refused them, trying a temporary file in /dev/fd)."""
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "run", "--study", str(tiny_study_file), "--policy",
                          "ring-gossip", "--quiet", "--json", f"/dev/fd/{w}"], pass_fds=(w,), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir)))
    os.close(w)
    with os.fdopen(r) as got:
        doc = json.loads(got.read())
    assert p.wait(300) == 0 and doc["status"] == "ok", p.stderr.read()


@pytest.mark.system
def test_same_command_same_numbers(tmp_path, data_dir, tiny_study_file):
    outs = []
    for i in range(2):
        f = tmp_path / f"{i}.json"
        assert evomerge("run", "--study", str(tiny_study_file), "--policy", "ring-gossip", "--seed", "5", "--json", str(f),
                        "--quiet", data_dir=data_dir).returncode == 0
        outs.append(json.loads(f.read_text())["history"])
    strip = [[{k: v for k, v in h.items() if k != "wall_time"} for h in o] for o in outs]
    assert strip[0] == strip[1]


@pytest.mark.system
def test_baselines_prints_one_row_each(data_dir, tiny_study_file):
    p = evomerge("baselines", "--study", str(tiny_study_file), "--quiet", data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["no-merging", "ring-gossip"]


@pytest.mark.system
def test_shipped_policy_runs_on_the_shipped_study_from_any_directory(tmp_path, data_dir):
    p = evomerge("run", "--study", "mnist-gossip", "--policy", "ring-gossip", "--quiet", data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    acc = float(next(l for l in p.stdout.splitlines() if "consensus val accuracy" in l).split("│")[2])
    assert acc > 0.85


@pytest.mark.system
def test_a_run_whose_output_is_redirected_prints_no_progress_bar_nor_its_empty_line(tmp_path, data_dir):
    """Without a terminal (a file, a pipe, CI's log) the bar is not drawn: stderr holds the run's notes alone."""
    f = write_study(tmp_path)
    p = evomerge("run", "--study", str(f), "--policy", "ring-gossip", data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0 and "consensus val accuracy" in p.stdout, p.stderr
    assert p.stderr == "", repr(p.stderr)


@pytest.mark.system
def test_policy_schema_is_json():
    p = evomerge("policy", "schema")
    assert p.returncode == 0 and json.loads(p.stdout)["title"] == "evomerge merge policy"


BAD_POLICIES = {
    "wrong type": ('{"mean_interval": "often"}', "policy.mean_interval"),
    "out of range": ('{"mixing_weight": 1.5}', "policy.mixing_weight"),
    "unknown key": ('{"speed": 1}', "policy.speed"),
    "unknown topology": ('{"topology": "star"}', "policy.topology"),
    "data similarity sign out of range": ('{"data_exchange_k": 4, "data_similarity_sign": 2}',
                                          "error: policy.data_similarity_sign: 2"),
    "negative swap recency": ('{"swap_p": 0.5, "swap_recency": -1}', "error: policy.swap_recency: -1"),
    "negative publish_every": ('{"similarity_bias": 0.5, "publish_every": -2}', "error: policy.publish_every: -2"),
    "publish_every in a schema 9 file": ('{"schema_version": 9, "similarity_bias": 0.5, "publish_every": 4}',
                                         "error: policy.publish_every: is a schema 10 field"),
    "unknown p_intra schedule": ('{"topology": "communities", "p_intra_schedule": "step"}',
                                 "error: policy.p_intra_schedule: unknown 'step'; allowed: constant, linear, cosine"),
    "impossible for the workers": ('{"topology": "random_regular", "degree": 4}',
                                   "error: policy.degree: 4 (the default) with 4 workers is impossible; allowed: degree < workers"),
    "gradient payload on gossip": ('{"payload": "gradient"}',
                                   "error: policy.scheme: 'gossip' cannot all-reduce gradients"),
    "gradient payload every 4 steps": ('{"scheme": "allreduce", "payload": "gradient", "mean_interval": 4}',
                                       "error: policy.mean_interval: 4.0 cannot all-reduce gradients"),
    "version 0": ('{"schema_version": 0}', "error: policy.schema_version: 0 is out of range; allowed: [1, 10]"),
    "truncated": ('{"topology": "ri', "invalid JSON: Unterminated string starting at (line 1, column 14)\n"),
    "empty": ("", "empty file"),
}


def main(capsys, *args) -> tuple[int, str, str]:
    """The command in this process (``cli.main``): its exit status, stdout and stderr."""
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", list(BAD_POLICIES))
def test_bad_policy_files_exit_2_with_one_line(tmp_path, tiny_study_file, case, capsys):
    text, words = BAD_POLICIES[case]
    f = tmp_path / "bad.json"
    f.write_text(text)
    rc, _, err = main(capsys, "run", "--study", str(tiny_study_file), "--policy", str(f))
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err
    assert "Traceback" not in err
    if case in ("truncated", "empty"):  # the file itself: named with the option that gave it (it named no option)
        assert err.startswith(f"error: --policy: {f}: "), err


def test_a_study_file_given_as_the_policy_is_named_so(tmp_path, tiny_study_file, capsys):
    rc, _, err = main(capsys, "run", "--study", str(tiny_study_file), "--policy", str(tiny_study_file))
    assert rc == 2 and err == (f"error: --policy: {tiny_study_file}: invalid JSON: Expecting value (line 2, column 2); "
                               "allowed: a policy JSON file, an exported file or a named policy (this looks like a "
                               "study file: that is --study)\n"), err


BAD_STUDIES = {
    "wrong type": ("[run]\nworkers = 'eight'\n", "study.run.workers"),
    "out of range": ("[run]\nlr = -1\n", "study.run.lr"),
    "unknown key": ("[run]\nwokers = 8\n", "study.run.wokers"),
    "unknown topology": ("[policy]\ntopology = 'star'\n", "policy.topology"),
    "truncated": ("[run\nworkers = 8", "invalid TOML"),
    "empty": ("", "empty file"),
}


@pytest.mark.parametrize("case", list(BAD_STUDIES))
def test_bad_study_files_exit_2_with_one_line(tmp_path, case, capsys):
    text, words = BAD_STUDIES[case]
    f = tmp_path / "bad.toml"
    f.write_text(text)
    rc, _, err = main(capsys, "run", "--study", str(f), "--policy", "ring-gossip")
    assert rc == 2
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


@pytest.mark.system
def test_missing_data_exits_2_naming_the_files(tmp_path, tiny_study_file):
    env_dir = tmp_path / "no-data"
    env_dir.mkdir()  # (a folder that is not there is --data-dir's own line)
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", str(tiny_study_file), "--policy", "ring-gossip",
                        "--data-dir", str(env_dir)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "EVOMERGE_DATA_DIR"} | {
                           "XDG_CACHE_HOME": str(tmp_path / "cache"), "http_proxy": "http://127.0.0.1:9",
                           "https_proxy": "http://127.0.0.1:9"})
    assert p.returncode == 2 and "train-images-idx3-ubyte.gz" in p.stderr and str(env_dir) in p.stderr


def test_validate_describes_a_good_policy(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"topology": "communities", "n_communities": 3}')
    assert cli.main(["policy", "validate", str(f)]) == 0


def test_validate_says_an_all_reduce_without_mixing_weight_moves_halfway(tmp_path, capsys):
    """(A user's {"scheme": "allreduce", "mean_interval": 10}, read as FedAvg, moved each worker halfway: the
    gossip default 0.5, described as "a=0.5" and nothing more.)"""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"scheme": "allreduce", "mean_interval": 10}))
    assert cli.main(["policy", "validate", str(f)]) == 0
    assert capsys.readouterr().err == ("note: mixing_weight is not given: 0.5, the default, moves each worker halfway "
                                       "to the average at each all-reduce; complete averaging (FedAvg, the shipped "
                                       "fedavg and allreduce) is mixing_weight 1\n")
    for given in ({"mixing_weight": 0.5}, {"mixing_weight": 1.0}, {"outer_optimizer": "sgd"}):
        f.write_text(json.dumps({"scheme": "allreduce", "mean_interval": 10} | given))
        assert cli.main(["policy", "validate", str(f)]) == 0 and capsys.readouterr().err == ""
    assert cli.main(["policy", "validate", "fedavg"]) == 0 and capsys.readouterr().err == ""


def test_validate_takes_a_shipped_policys_name_as_run_does(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    assert cli.main(["policy", "validate", "diloco"]) == 0
    assert capsys.readouterr().out.startswith("ok: all workers average every ")
    assert cli.main(["policy", "validate", "dilocoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: file: dilocoo: no such file; allowed: a policy JSON file, an exported file, or a "
                          "shipped policy's name (allreduce, ") and "did you mean diloco?" in err and err.count("\n") == 1


def test_validate_says_that_fragments_are_checked_against_the_model_when_it_runs(tmp_path, capsys):
    """(It said "ok" to 8 fragments, and to 3 strided ones, with no word that a model may have fewer; run then
    refused them.)"""
    f = tmp_path / "p.json"
    for pattern, want in (("contiguous", "8 fragments need a model of at least 8 parameter tensors"),
                          ("strided", "8 strided fragments need a model of at least 8 layers")):
        f.write_text(json.dumps({"scheme": "allreduce", "outer_optimizer": "nesterov", "fragments": 8,
                                 "fragment_pattern": pattern}))
        assert cli.main(["policy", "validate", str(f)]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("ok: ") and err == (f"note: {want}: checked against the study's model when it runs "
                                                  "(evomerge run --study S --policy FILE)\n"), err
    f.write_text(json.dumps({"scheme": "allreduce", "outer_optimizer": "nesterov"}))
    assert cli.main(["policy", "validate", str(f)]) == 0 and capsys.readouterr().err == ""


def test_an_export_of_a_newer_format_is_one_line(tmp_path, capsys):
    """As a policy of a newer schema_version is: what this evomerge reads, and that a newer one wrote it."""
    for fmt, said in ((7, "7 in {f} is newer than this evomerge reads; allowed: 1 to 2 (a newer evomerge wrote it)"),
                      ("2", '"2" in {f} is not an export format; allowed: 1 to 2')):
        f = tmp_path / "fmt.json"
        f.write_text(json.dumps({"format": fmt, "trial": 1, "policy": {"scheme": "gossip"}}))
        assert cli.main(["policy", "validate", str(f)]) == 2
        assert capsys.readouterr().err == f"error: export.format: {said.format(f=f)}\n"


def test_validate_says_where_the_merger_refuses_a_policy(tmp_path, capsys):
    """A valid policy that a training loop cannot run gets a note (exit 0: evomerge run replays it), one that needs the
    loop's held-out examples says so; an all-reduce that carries a winner bias it never uses, as a search varying the
    scheme exports it, gets none."""
    f = tmp_path / "p.json"
    f.write_text('{"scheme": "gossip", "similarity_bias": 0.5}')
    assert cli.main(["policy", "validate", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok: ") and out[1] == (
        "note: evomerge run replays it; in a training loop evomerge.Merger refuses it: policy.similarity_bias: 0.5 "
        "cannot run in a training loop (peers drawn from the models' similarity need every worker's model at each "
        "event); allowed: 0.0") and len(out) == 2
    f.write_text('{"scheme": "gossip", "winner_bias": 0.4, "score": "holdout"}')
    assert cli.main(["policy", "validate", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok: ") and out[1:] == [
        "note: its winner test (winner_bias 0.4, score 'holdout') scores models on held-out examples: in a training "
        "loop, pass evomerge.Merger(..., holdout=(x, y)) with examples each rank does not train on (and "
        "loss_fn=your loss, where it is not cross-entropy on class labels)"]
    f.write_text('{"scheme": "gossip", "topology": "random_regular", "degree": 3}')
    assert cli.main(["policy", "validate", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["note: its topology (random_regular, degree 3) runs on at least 4 workers, an even number: in a "
                       "training loop, one rank per worker"], out
    f.write_text('{"scheme": "async", "mean_interval": 4, "mixing_weight": 1.0, "outer_optimizer": "nesterov", '
                 '"local_steps_by_speed": true}')
    assert cli.main(["policy", "validate", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["note: its local steps scale by each rank's speed (local_steps_by_speed): in a training loop, "
                       "pass evomerge.Merger(..., speeds=[...]), one per rank (steps per second in any common unit, or "
                       "the speeds evomerge calibrate writes)"], out
    # exported from a study with a cluster: the speeds its search simulated, the rank-by-rank list to pass
    from evomerge import study as study_mod
    from evomerge.engine.clock import speed_factors
    from evomerge.policy import MergePolicy

    st = study_mod.load("mnist-stragglers")
    cli._merger_note(MergePolicy.from_dict(json.loads(f.read_text())), st)
    want = 1.0 / speed_factors(st.environment, st.run.workers, st.run.seeds[0])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith(f"; the study simulated [{', '.join(f'{v:.3g}' for v in want)}] (seed {st.run.seeds[0]}))")
    assert len(want) == 16 and min(want) == want[15] < 0.5  # (its straggler, 4x slower)
    f.write_text('{"scheme": "allreduce", "mean_interval": 3, "winner_bias": 0.59, "similarity_bias": 0.3}')
    assert cli.main(["policy", "validate", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["ok: all workers average every 3 steps, a=0.5, uniform weighting"], out


@pytest.mark.parametrize("args, line", [
    (["run", "--policy", "fedavg", "--seed", "-1"], "error: --seed: -1 is out of range; allowed: an integer >= 0"),
    (["search", "--seed", "-1", "--n-trials", "1"], "error: --seed: -1 is out of range; allowed: an integer >= 0"),
    (["run", "--policy", "fedavg", "--device", "tpu"],
     "error: --device: 'tpu' is not a torch device; allowed: cpu, cuda, cuda:N"),
    (["baselines", "--device", "cuda:x"], "error: --device: 'cuda:x' is not a torch device; allowed: cpu, cuda, cuda:N"),
    # devices torch knows but evomerge never runs on (were tracebacks from deep in a run)
    (["run", "--policy", "fedavg", "--device", "meta"],
     "error: --device: 'meta': evomerge runs on the CPU or CUDA; allowed: cpu, cuda, cuda:N"),
    (["search", "--device", "mps", "--n-trials", "1"],
     "error: --device: 'mps': evomerge runs on the CPU or CUDA; allowed: cpu, cuda, cuda:N"),
])
def test_a_bad_seed_or_device_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, args, line):
    """(Were numpy's and torch's tracebacks.) Nothing is written where the command runs (no runs folder)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([args[0], "--study", "mnist-gossip", *args[1:]]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, line", [
    (["search", "--study", "mnist-gossip", "--n-trails", "3"],
     "error: --n-trails: evomerge search does not take it (--n-trails 3); did you mean --n-trials?"),
    (["search", "--study", "mnist-gossip", "--n-trials", "three"],
     "error: --n-trials: must be an integer, got 'three'; see evomerge search --help"),
    (["run", "--study", "mnist-gossip", "--policy", "fedavg", "--json"],
     "error: --json: needs a value (--json FILE); see evomerge run --help"),
    (["serch", "--study", "mnist-gossip"], "error: command: unknown 'serch'; allowed: search, transfer, status, export, "
                                           "dashboard, ui, run, baselines, calibrate, policy; did you mean search?"),
    (["run", "--policy", "fedavg"], "error: --study: required; see evomerge run --help"),
    (["run", "--study", "mnist-gossip"], "error: --policy: required; see evomerge run --help"),  # (but with --against)
    (["--bogus", "search", "--study", "mnist-gossip"], "error: --bogus: evomerge does not take it (--bogus); see "
                                                        "evomerge --help"),
    # a negative percentage was taken for a flag: "--tolerance: needs a value"
    (["export", "--study", "mnist-gossip", "-o", "x.json", "--tolerance", "-1%"],
     "error: --tolerance: '-1%'; allowed: a number >= 0 in the first objective's unit (0.005), or a percentage of its "
     "best value (2%)"),
    (["--quiet", "search", "--study", "mnist-gossip"], "error: --quiet: evomerge does not take it (--quiet); a flag "
                                                       "of evomerge search goes after it (evomerge search --quiet ...)"),
    # another command's flag is not taken for a misspelling of this one's (said "did you mean --data-dir?")
    (["baselines", "--study", "mnist-gossip", "--tracking-uri", "r"],
     "error: --tracking-uri: evomerge baselines does not take it (--tracking-uri r); --tracking-uri is for evomerge "
     "search, transfer, dashboard, ui; see evomerge baselines --help"),
    (["search", "--study", "mnist-gossip", "--", "--n-trials", "3"],
     "error: --: evomerge search takes no arguments after it (-- --n-trials 3); see evomerge search --help"),
    ([], "error: command: required; see evomerge --help"),
    # (--seed was dropped in silence: the fresh seeds ran)
    (["run", "--study", "mnist-gossip", "--policy", "fedavg", "--reevaluate", "2", "--seed", "7"],
     "error: --seed: given with --reevaluate, which runs 2 fresh seeds past the study's; allowed: one of --seed (one "
     "run), --reevaluate"),
    # another command's short flag: this command's own for it (it said "see evomerge dashboard --help")
    # (dashboard takes -o for its --out now; transfer's nearest, --top, was offered for it)
    (["transfer", "--study", "mnist-gossip", "--target", "mnist-gossip-64", "-o", "d"],
     "error: -o: evomerge transfer does not take it (-o d); see evomerge transfer --help (-o is evomerge export, "
     "dashboard, calibrate's)"),
    (["policy", "validat", "p.json"], "error: command: unknown 'validat'; allowed: schema, validate; did you mean "
                                      "validate?"),
])
def test_a_bad_flag_is_one_line_with_the_nearest_good_one(tmp_path, monkeypatch, capsys, args, line):
    """(Were argparse's usage and its message, 4 to 14 lines, the top-level usage for a command's flag.)"""
    monkeypatch.chdir(tmp_path)
    try:
        rc = cli.main(args)
    except SystemExit as e:  # argparse's own errors leave through exit(), as from the command line
        rc = e.code
    assert rc == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, line", [
    (["run", "--study", "mnist-gossip", "--policy", "fedavg", "--backend", "inproces"],
     "error: --backend: unknown 'inproces'; allowed: inprocess, distributed; did you mean inprocess?"),
    (["run", "--study", "mnist-gosip", "--policy", "fedavg"],  # run takes a stored study's name too
     "error: --study: unknown study 'mnist-gosip'; known: mnist-gossip, mnist-gossip-64, mnist-skewed, mnist-stragglers, "
     "mnist-two-sites, tiny-lm; stored in runs (--runs-dir, from the current folder): none (or give a path to a .toml file); did you mean mnist-gossip?"),
    (["search", "--study", "./mnist-gossip.tom"],  # a path with a typo: its file is missing, not a study's name
     "error: --study: ./mnist-gossip.tom: no such file"),
    (["status", "--study", "studies/own"], "error: --study: studies/own: no such file"),
    (["run", "--study", "mnist-gossip", "--policy", "fedav"],
     "error: --policy: fedav: no such file or named policy; named: allreduce, allreduce-backup, allreduce-sign, "
     "allreduce-topk, async-diloco, diloco, fedavg, no-merging, ring-gossip, snoo, streaming-diloco; did you mean fedavg?"),
    (["search", "--study", "mnist-gossip", "--sampler", "tp", "--n-trials", "1"],
     "error: --sampler: unknown 'tp'; allowed: tpe, random, nsga2, cmaes; did you mean tpe?"),
])
def test_a_misspelt_name_is_one_line_with_the_nearest_good_one(tmp_path, monkeypatch, capsys, args, line):
    """Names evomerge checks itself (backends, studies, policies, samplers), as argparse's choices are."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 2
    assert capsys.readouterr().err == line + "\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("typo, line", [
    (("epochs = 2.0", "epoch = 2.0"), "error: study.run.epoch: unknown key; allowed: workers, batch_size, epochs, "),
    # (the policy's 48 fields: the nearest first, then the list; it came after a line of 900 characters)
    (("mixing_weight = 0.5", "mixing_wieght = 0.5"),
     "error: study.policy.mixing_wieght: unknown key; did you mean mixing_weight? allowed: name, "),
    (('partition = "dirichlet"', 'partition = "dirichelt"'),
     "error: study.data.partition: unknown 'dirichelt'; allowed: iid, dirichlet, by_file; did you mean dirichlet?"),
    (('name = "mlp"', 'name = "mpl"'), "error: study.model.name: unknown 'mpl'; allowed: "),
    # (another case of a name: "did you mean adam?")
    (('[run]\n', '[run]\noptimizer = "adamW"\n'),
     "error: study.run.optimizer: unknown 'adamW'; allowed: sgd, adam, adamw; did you mean adamw?\n"),
    (('hidden = [128]', 'hiden = [128]'),
     "error: study.model.hiden: unknown option of the 'mlp' model; allowed: hidden, execution; did you mean hidden?"),
    # (a misspelt [model] key was taken for an option of the default mlp: `factroy` named mlp's options alone)
    (('name = "mlp"', 'nme = "mlp"'), "error: study.model.nme: unknown key of [model]; allowed: name (a named model), "
                                      "factory (your own nn.Module: \"mymodels:build\"), options (its keywords), "),
    (('hidden = [128]', 'options = { hidden = [128] }'),
     "error: study.model.options: applies with factory (your own nn.Module's keywords); a named model takes its "
     "options as keys of [model] (hidden = [128])\n"),
])
def test_a_typo_in_a_users_study_file_names_the_key_and_the_nearest(tmp_path, monkeypatch, capsys, typo, line, data_dir):
    """A user's own study file (a copy of a shipped one with one typo): one line, the nearest key or value."""
    text = (ROOT / "studies" / "mnist-gossip.toml").read_text()
    assert typo[0] in text
    f = tmp_path / "mine.toml"
    f.write_text(text.replace(typo[0], typo[1], 1))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVOMERGE_DATA_DIR", str(data_dir))  # a model's options are checked when it is built
    assert cli.main(["run", "--study", str(f), "--policy", "fedavg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err
    if "unknown key; allowed" in line:
        assert err.endswith(f"; did you mean {typo[0].split(' ')[0]}?\n"), err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["mine.toml"]


def test_a_cuda_device_this_torch_lacks_is_one_line(capsys):
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{n}" if n else "cuda"  # one past the last, or any where there is none
    assert cli.main(["run", "--study", "mnist-gossip", "--policy", "fedavg", "--device", device]) == 2
    assert capsys.readouterr().err == (
        f"error: --device: '{device}', but there are {n} CUDA device(s); allowed: cpu, cuda, cuda:0 to cuda:{n - 1}\n"
        if n else "error: --device: 'cuda', but this torch has no CUDA device; allowed: cpu\n")


@pytest.mark.system
@pytest.mark.parametrize("args, said", [
    (["policy", "validate", "bad.json"], "invalid JSON"),
    (["search", "--study", "mnist-gossip", "--reevaluate", "-1"], "error: --reevaluate: -1 is out of range"),
    (["search", "--study", "mnist-gossip", "--backend", "mpi"], "error: --backend: unknown 'mpi'"),
])
def test_cli_does_not_import_torch_for_help_or_bad_input(tmp_path, args, said):
    """A bad flag is answered before the seconds of importing torch and MLflow (4 s for a search, now half a second)."""
    (tmp_path / "bad.json").write_text("{")
    code = ("import sys; from evomerge import cli; rc = cli.main(%r); "
            "assert not {'torch', 'mlflow'} & set(sys.modules), 'torch or mlflow imported'; sys.exit(rc)" % args)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and said in p.stderr, p.stderr


# -- a new user's own study files (issue 14) -------------------------------------------------------
@pytest.mark.system
def test_baselines_of_a_study_copied_out_of_its_folder_use_the_shipped_policies(tmp_path, data_dir):
    import shutil

    f = write_study(tmp_path / "copy", name="my-copy", steps=20)
    shutil.rmtree(f.parent / "policies")  # a study file copied alone, renamed
    f.write_text(f.read_text().replace('policies = ["no-merging", "ring-gossip"]',
                                       'policies = ["no-merging", "fedavg", "ring-gossip"]'))
    out = tmp_path / "b.json"
    p = evomerge("baselines", "--study", str(f), "--quiet", "--json", str(out), data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["no-merging", "fedavg", "ring-gossip"]
    assert json.loads(out.read_text())["baselines"]["fedavg"]["policy"]["mean_interval"] == 50.0


@pytest.mark.system
def test_a_search_says_its_intervals_past_the_runs_steps_at_the_start(tmp_path, data_dir):
    """The tiny study searches mean_interval in [1, 30]; on 20 local steps a worker, the search's start says that
    the range's end merges never (its trials said "never merged" only after they ran)."""
    f = write_study(tmp_path, name="short", steps=20)
    p = evomerge("search", "--no-log-model", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--no-verdict",
                 "--runs-dir", str(tmp_path / "runs"), data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    said = ("study.search.space.mean_interval: [1, 30] reaches past the run's 20 local steps a worker: a policy with "
            "mean_interval above 20 merges never")
    assert said in " ".join(p.stderr.split()), p.stderr  # the start screen wraps to its width


@pytest.mark.system
def test_an_unknown_baseline_is_refused_before_any_trial(tmp_path):
    f = write_study(tmp_path, name="typo")
    f.write_text(f.read_text().replace('"ring-gossip"]', '"ring-gosip"]'))
    p = evomerge("search", "--study", str(f), "--runs-dir", str(tmp_path / "runs"), "--quiet", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.startswith("error: study.baselines.policies: ring-gosip: no such file or named policy; named: ")
    assert p.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


@pytest.mark.system
def test_schema_version_zero_is_refused(tmp_path):
    f = tmp_path / "p.json"
    f.write_text('{"schema_version": 0}')
    p = evomerge("policy", "validate", str(f))
    assert p.returncode == 2
    assert p.stderr == "error: policy.schema_version: 0 is out of range; allowed: [1, 10]\n"


@pytest.mark.system
def test_a_four_worker_copy_of_the_shipped_study_runs_every_trial(tmp_path, data_dir):
    """The shipped space samples random_regular with the fixed degree 4: impossible with 4 workers
    (3 of 8 trials used to fail). The load resolves it (degree 3); every trial runs. Here the space's
    topology is narrowed to random_regular so that every trial meets the corner. The copy lives in a
    folder without policies/, and the results table still shows the baselines."""
    import optuna

    text = (ROOT / "studies" / "mnist-gossip.toml").read_text()
    for old, new in [("workers = 8", "workers = 4"), ("epochs = 2.0", "steps = 20"), ("eval_samples = 2000", "eval_samples = 200"),
                     ("val_size = 5000", "val_size = 500\ntrain_size = 2000"), ('name = "mnist-gossip"', 'name = "four"'),
                     ('choices = ["ring", "complete", "random_regular", "communities"]', 'choices = ["random_regular"]')]:
        assert old in text
        text = text.replace(old, new)
    f = tmp_path / "four.toml"
    f.write_text(text)
    out = tmp_path / "s.json"
    from searchutil import cli as in_process

    # in this process (the command's own code, as the other search tests); the verdict's runs on fresh seeds say
    # nothing of the clamp
    p = in_process("search", "--study", str(f), "--n-trials", "5", "--sampler", "random", "--no-prune", "--no-verdict",
                   "--runs-dir", str(tmp_path / "runs"), "--quiet", "--json", str(out), data_dir=data_dir, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    # the clamp is said once, as a note in the header; no trial failed on it
    lines = [line for line in (p.stdout + p.stderr).splitlines() if "policy.degree" in line]
    assert lines == ["  note: study.policy.degree: 4 (the default) is impossible with 4 workers; using 3"], lines
    for name in ("no-merging", "fedavg", "allreduce", "ring-gossip"):  # the copy has no policies/: the shipped ones
        assert name in p.stdout
    r = json.loads(out.read_text())
    assert r["counts"] == {"COMPLETE": 5} and not r["errors"]
    trials = optuna.load_study(study_name="four", storage=f"sqlite:///{tmp_path / 'runs' / 'four' / 'optuna.db'}").trials
    assert len(trials) == 5 and all(t.state.name == "COMPLETE" for t in trials)
    assert {(t.user_attrs["policy"]["topology"], t.user_attrs["policy"]["degree"]) for t in trials} == {("random_regular", 3)}


def test_run_help_names_every_shipped_policy(capsys):
    """(Listed four of the eleven.) The names `--policy` takes, as a user reads them in the help."""
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--help"])
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines (and breaks names at hyphens)
    names = sorted(f.stem for f in (ROOT / "studies" / "policies").glob("*.json"))
    assert len(names) >= 11 and "(" + ",".join(names) + ");required" in text, text


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`evomerge policy schema | head`: the pipe closes before the command has written; no traceback."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "policy", "schema"], stdout=w, stderr=subprocess.PIPE,
                       text=True, timeout=120, cwd=ROOT)
    os.close(w)
    assert p.stderr == "" and p.returncode == 141, p.stderr[-2000:]


@pytest.mark.integration
def test_a_reader_of_stderr_that_leaves_ends_the_command_quietly(tmp_path, data_dir, tiny_study_file):
    """`evomerge search ... 2>&1 | head`: the start screen (stderr) meets the closed pipe; it ended with status 1 and
    no word (rich's own handling), where stdout's closed pipe ends with 141."""
    from searchutil import cli as in_process

    args = ("search", "--no-log-model", "--study", str(tiny_study_file), "--n-trials", "1", "--no-verdict", "--runs-dir", str(tmp_path))
    assert in_process(*args, data_dir=data_dir, cwd=tmp_path).returncode == 0  # the study, searched (the one to see)
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", *args], stdout=subprocess.PIPE, stderr=w, text=True,
                       timeout=300, cwd=tmp_path, env=dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir)))
    os.close(w)
    assert p.returncode == 141 and p.stdout == "", (p.returncode, p.stdout)


def test_a_reader_that_leaves_before_a_table_ends_the_command_as_before_any_other_line():
    """(`evomerge status | head -1` exited 1: the reader had gone by the table, and rich's own handling of a broken
    pipe exits 1; `main` ends every other broken stdout with 141.) The tables' console hands the pipe to `main`."""
    from evomerge.report.search_view import console

    r, w = os.pipe()
    os.close(r)
    gone = os.fdopen(w, "w")
    out = console()
    out.file = gone
    with pytest.raises(BrokenPipeError):
        out.print("a table's first line")
    assert out.quiet  # nothing more is written to the pipe that is gone
    null = os.open(os.devnull, os.O_WRONLY)  # what is still buffered goes nowhere, as `main` sends it
    os.dup2(null, w)
    os.close(null)
    gone.close()


@pytest.mark.system
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_run_stopped_by_sigterm_or_sighup_says_interrupted_and_exits_130_as_ctrl_c_does(tmp_path, data_dir, sig):
    """(In process, `run` and `baselines` died of the signal's default: status 143 or 129 and nothing said, where
    `search` and the distributed backend said `interrupted`, 130.)"""
    import signal
    import time

    f = write_study(tmp_path, slow=True)  # each forward sleeps: a run of many seconds for little CPU
    env = dict(os.environ, EVOMERGE_DATA_DIR=str(data_dir), SLOWMLP_DELAY="0.3")
    p = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "run", "--study", str(f), "--policy", "ring-gossip",
                          "--quiet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # its handlers are in place as soon as the command's arguments are read
        assert p.poll() is None, p.communicate()
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130 and err.strip().splitlines() == ["interrupted"], (p.returncode, err)


def test_optunas_fallback_warning_on_a_lost_connection_is_left_out():
    """A database stopped under a search: Optuna warned "Caught an error from sqlalchemy ... Falling back to a slower
    alternative" with the failed SQL, lines before the command's own one-line error (seen in CI)."""
    import logging

    def record(msg):
        return logging.LogRecord("optuna.storages._rdb.storage", logging.WARNING, "", 0, msg, None, None)

    lost = cli._LostConnection()
    assert not lost.filter(record("Caught an error from sqlalchemy: (psycopg.errors.AdminShutdown) terminating "
                                  "connection due to administrator command. Falling back to a slower alternative."))
    assert lost.filter(record("Caught an error from sqlalchemy: (sqlite3.OperationalError) too many SQL variables. "
                              "Falling back to a slower alternative."))  # what the fallback is for: kept
    cli._quiet_libraries(mlflow=False)
    cli._quiet_libraries(mlflow=False)  # once, however often the commands set the levels
    assert sum(isinstance(f, cli._LostConnection)
               for f in logging.getLogger("optuna.storages._rdb.storage").filters) == 1


@pytest.mark.system
def test_the_next_commands_run_as_printed_where_evomerge_is_not_on_the_path(tmp_path, data_dir, tiny_study_file):
    """The README's quick start runs `.venv/bin/evomerge`, its environment not activated: the search's `next:` line
    said `evomerge export ...`, which the shell did not find. It names the command as it was started."""
    import shlex

    exe = Path(sys.executable).parent / "evomerge"  # the project's environment's command, as setup.sh made it
    assert exe.is_file(), exe
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "EVOMERGE_RUNS_DIR")}
    env |= {"PATH": "/usr/bin:/bin", "EVOMERGE_DATA_DIR": str(data_dir)}
    p = subprocess.run([str(exe), "search", "--study", str(tiny_study_file), "--n-trials", "1", "--no-verdict", "--no-log-model"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    export = re.sub(r" \(.*\)$", "", line.removeprefix("next: ").split("; ")[0])
    assert shlex.split(export)[:2] == [str(exe), "export"], line
    q = subprocess.run(export, shell=True, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert q.returncode == 0 and json.loads((tmp_path / "best.json").read_text())["policy"], q.stderr[-2000:]
    # started as `python -m evomerge.cli` (no script on the PATH): the line says `python -m evomerge`, which runs
    # (it said `evomerge export`, and `python -m evomerge` had no __main__)
    (tmp_path / "best.json").unlink()
    p = subprocess.run([sys.executable, "-m", "evomerge.cli", "search", "--study", str(tiny_study_file), "--n-trials",
                        "1", "--no-verdict", "--no-log-model"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    export = re.sub(r" \(.*\)$", "", line.removeprefix("next: ").split("; ")[0])
    assert shlex.split(export)[:4] == [sys.executable, "-m", "evomerge", "export"], line
    q = subprocess.run(export, shell=True, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert q.returncode == 0 and json.loads((tmp_path / "best.json").read_text())["policy"], q.stderr[-2000:]


@pytest.mark.integration
def test_the_next_line_names_the_baseline_that_beat_every_pick(tmp_path, data_dir):
    """(The verdict said "A baseline beats the search: diloco beats every pick", and the `next:` line still called
    the export "the policy to deploy".)"""
    from searchutil import cli as run_cli

    f = write_study(tmp_path, steps=60)
    text = f.read_text()
    for old, new in (('mean_interval = { kind = "log-float", low = 1.0, high = 30.0 }',
                      'mean_interval = { kind = "log-float", low = 50.0, high = 60.0 }'),
                     ('mixing_weight = { kind = "float", low = 0.1, high = 1.0 }',
                      'mixing_weight = { kind = "float", low = 0.01, high = 0.02 }'),
                     ('policies = ["no-merging", "ring-gossip"]', 'policies = ["allreduce"]')):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    f.write_text(text.replace("n_trials = 6", "n_trials = 2"))
    p = run_cli("search", "--study", f, "--reevaluate", "0", "--runs-dir", tmp_path / "runs", cwd=tmp_path,
                data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "verdict: A baseline beats the search: allreduce beats trial 0" in " ".join(p.stdout.split()), p.stdout
    nxt = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    # the baseline first (a user who ran the line's first command, export, deployed the pick that lost)
    assert len(nxt) == 1 and nxt[0].startswith(
        "next: deploy allreduce, which the verdict found better than every pick: evomerge.Merger('allreduce', ...); "
        "evomerge export --study ") and "-o best.json (the search's best, which lost); " in nxt[0], p.stderr
    # tuned by [baselines] lr, it won at its own step size: the line says which
    f.write_text(f.read_text().replace('policies = ["allreduce"]', 'policies = ["allreduce"]\nlr = [0.05, 0.1]'))
    p = run_cli("search", "--study", f, "--reevaluate", "0", "--runs-dir", tmp_path / "runs2", cwd=tmp_path,
                data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    nxt = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    assert len(nxt) == 1 and re.search(r"^next: deploy allreduce, which the verdict found better than every pick: "
                                       r"evomerge\.Merger\('allreduce', \.\.\.\) at lr 0\.(05|1); ", nxt[0]), p.stderr


def test_a_study_path_with_a_typo_names_the_file_beside_it(tmp_path, monkeypatch, capsys):
    """``--study ./own.tom`` where ``own.toml`` is: the path's own error, with the file meant."""
    (tmp_path / "own.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    for ref in ("./own.tom", "./own"):
        assert cli.main(["status", "--study", ref]) == 2
        assert capsys.readouterr().err == f"error: --study: {ref}: no such file; did you mean own.toml?\n"
