"""`evomerge export` on a study with several objectives writes one policy by a stated rule (issue 28, part 3): the
best second objective among the Pareto-optimal trials within a tolerance of the best first, under the user's
limits; real SQLite, a real NSGA-II search, the command as a user runs it."""

import json
import re

import pytest

import evomerge
from conftest import write_study
from evomerge import study
from evomerge.search.results import diverged, pareto_trials
from searchutil import cli


@pytest.fixture(scope="module")
def searched(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("pick")
    f = write_study(d, name="two", objectives=("val_accuracy", "bytes"))
    res = evomerge.search(study.load(f), n_trials=10, sampler="nsga2", runs_dir=d / "runs", seed=4,
                          data_dir=data_dir, prune=False)
    return d, f, res.optuna_study


@pytest.mark.xdist_group("export-pick-searched")  # one worker computes the module fixture they share
@pytest.mark.system
def test_export_picks_the_cheapest_close_to_the_best_accuracy_and_says_so(searched, data_dir):
    d, f, ostudy = searched
    front = pareto_trials(ostudy, study.load(f))
    assert len(front) >= 2  # a trade-off to pick from
    most_accurate = max(front, key=lambda t: t.values[0])
    tol = most_accurate.values[0] - min(t.values[0] for t in front)  # every front trial is close enough
    # another study's export in the same file (the `next:` line's -o best.json of two studies searched in one folder)
    (d / "best.json").write_text(json.dumps({"format": 2, "study": "my-gru", "trial": 3, "policy": {}}))
    p = cli("export", "--study", str(f), "-o", "best.json", "--tolerance", str(tol), cwd=d, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "note: best.json held study my-gru's trial 3; replaced (-o FILE writes elsewhere)\n" in p.stderr, p.stderr
    doc = json.loads((d / "best.json").read_text())
    again = cli("export", "--study", str(f), "-o", "best.json", "--tolerance", str(tol), cwd=d, data_dir=data_dir)
    assert again.returncode == 0 and "held" not in again.stderr, again.stderr  # its own export: replaced unsaid
    cheapest = min(front, key=lambda t: t.values[1])
    assert doc["trial"] == cheapest.number != most_accurate.number  # not the first objective's best
    assert doc["picked_by"] == (f"the best bytes among the Pareto-optimal trials within {tol:g} of the best "
                                "val_accuracy")
    assert f"wrote trial {cheapest.number} (" in p.stdout and "picked as the best bytes" in p.stdout
    # 5 points meant, 5 given: one line, exit 2 (as any bad value), the file exported before kept
    p = cli("export", "--study", str(f), "-o", "best.json", "--tolerance", "5", cwd=d, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --tolerance: 5 on val_accuracy, a fraction from 0 to 1, takes every trial; allowed: a number below 1 "
        "(0.05 is 5 points of accuracy) or a percentage of its best value (5%)"], p.stderr
    assert json.loads((d / "best.json").read_text()) == doc
    p = cli("export", "--study", str(f), "-o", "tight.json", "--tolerance", "0", cwd=d, data_dir=data_dir)
    assert json.loads((d / "tight.json").read_text())["trial"] == most_accurate.number
    limit = sorted(t.values[1] for t in front)[1]  # the two cheapest meet it; the most accurate may not
    p = cli("export", "--study", str(f), "-o", "lim.json", "--tolerance", "0", "--limit", f"bytes={limit}", cwd=d,
            data_dir=data_dir)
    got = json.loads((d / "lim.json").read_text())
    meets = [t for t in front if t.values[1] <= limit]
    assert got["trial"] == max(meets, key=lambda t: (t.values[0], -t.number)).number


@pytest.mark.xdist_group("export-pick-searched")  # one worker computes the module fixture they share
@pytest.mark.system
def test_a_limit_nothing_meets_is_one_line_naming_the_option(searched, data_dir):
    d, f, _ = searched
    for args, line in [(["--limit", "bytes=1"], "error: --limit: bytes=1: no Pareto-optimal trial meets it"),
                       (["--limit", "nope=3"], "error: --limit: 'nope' is not an objective of two; allowed: "
                                               "val_accuracy, bytes"),
                       (["--limit", "bytes"], "error: --limit: 'bytes' is not OBJECTIVE=VALUE (e.g. bytes=1e8)")]:
        p = cli("export", "--study", str(f), "-o", "x.json", *args, cwd=d, data_dir=data_dir)
        if line.endswith("meets it"):  # and what the best has (it said nothing of how far off the limit was)
            assert p.returncode == 2 and re.fullmatch(re.escape(line) + r" \(the best has bytes [\d.e+]+\)",
                                                      p.stderr.strip()), p.stderr
            continue
        assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (d / "x.json").exists()  # nothing written


@pytest.mark.xdist_group("export-pick-searched")  # one worker computes the module fixture they share
@pytest.mark.system
def test_export_trial_writes_the_trial_a_user_chose_and_run_replays_it(searched, data_dir):
    """A user who picked a trial in the dashboard or the MLflow UI exports it by its number."""
    d, f, ostudy = searched
    trials = [t for t in ostudy.get_trials() if t.state.name == "COMPLETE" and not diverged(t)]
    default = json.loads((d / "best.json").read_text())["trial"] if (d / "best.json").exists() else None
    chosen = next(t for t in reversed(trials) if t.number != default)
    p = cli("export", "--study", str(f), "-o", "mine.json", "--trial", str(chosen.number), cwd=d, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((d / "mine.json").read_text())
    assert doc["trial"] == chosen.number and doc["picked_by"] == f"--trial {chosen.number}"
    assert list(doc["objectives"].values()) == chosen.values
    assert doc["policy"] == chosen.user_attrs["policy"] | {"name": doc["policy"]["name"]}
    assert p.stdout.startswith(f"wrote trial {chosen.number} (val_accuracy {chosen.values[0]:.6g}, ")
    p = cli("run", "--study", str(f), "--policy", "mine.json", "--json", "replay.json", "--quiet", cwd=d,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    replay = json.loads((d / "replay.json").read_text())
    assert replay["final"]["val_accuracy"] == pytest.approx(chosen.values[0], abs=1e-9)
    # the study's storage as a URL with a query string (SQLAlchemy's form), as a user may give --storage
    url = f"sqlite:///{d / 'runs' / 'two' / 'optuna.db'}?timeout=30"
    p = cli("export", "--study", str(f), "--storage", url, "-o", "q.json", "--trial", str(chosen.number), cwd=d,
            data_dir=data_dir)
    assert p.returncode == 0 and json.loads((d / "q.json").read_text())["trial"] == chosen.number, p.stderr
    n = len(trials)
    for args, line in [(["--trial", "99"], f"error: --trial: 'two' has no trial 99; allowed: the number of a complete "
                                           f"trial that did not diverge: {', '.join(str(t.number) for t in trials)}"),
                       (["--trial", "1", "--pareto"], "error: --trial: given with --pareto; allowed: one of --trial "
                                                      "(one trial), --pareto"),
                       (["--trial", "-2"], "error: --trial: -2 is out of range; allowed: a trial number >= 0"),
                       # (both were taken without a word, doing nothing)
                       (["--trial", "1", "--tolerance", "0.1"], "error: --trial: given with --tolerance; allowed: one "
                                                                "of --trial (one trial), --tolerance"),
                       (["--pareto", "--tolerance", "0.1"], "error: --tolerance: given with --pareto, which writes "
                                                            "every Pareto-optimal trial; allowed: --tolerance to pick "
                                                            "one (without --pareto)")]:
        p = cli("export", "--study", str(f), "-o", "x.json", *args, cwd=d, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (d / "x.json").exists()


def test_export_trial_refuses_a_trial_that_did_not_complete_or_diverged(tmp_path):
    """In one line naming --trial (a diverged trial's values are not finite: no policy to deploy), and no file."""
    import optuna

    from evomerge.errors import ConfigError
    from evomerge.report.export import export_trial
    from evomerge.search.results import DIVERGED, RUN_STATUS

    s = study.load(write_study(tmp_path))
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    o = optuna.create_study(study_name=s.name, storage=url, direction="maximize")
    policy = {"scheme": "gossip", "mean_interval": 3.0}
    for state, attrs, value in [("COMPLETE", {}, 0.9), ("PRUNED", {}, None), ("FAIL", {}, None),
                                ("COMPLETE", {RUN_STATUS: DIVERGED}, float("-inf")), ("COMPLETE", {}, 0.8)]:
        t = o.ask()
        t.set_user_attr("policy", policy)
        for k, v in attrs.items():
            t.set_user_attr(k, v)
        o.tell(t, value, state=getattr(optuna.trial.TrialState, state)) if state != "COMPLETE" else o.tell(t, value)
    ok = "allowed: the number of a complete trial that did not diverge: 0, 4"
    for number, what in [(1, "trial 1 was pruned"), (2, "trial 2 failed"), (3, "trial 3 diverged (its values are not "
                                                                                 "finite)"), (7, "'tiny' has no trial 7")]:
        with pytest.raises(ConfigError) as e:
            export_trial(s, url, tmp_path / "x.json", number)
        assert str(e.value) == f"--trial: {what}; {ok}"
    assert not (tmp_path / "x.json").exists()
    doc = export_trial(s, url, tmp_path / "x.json", 4)
    assert doc["trial"] == 4 and doc["objectives"] == {"val_accuracy": 0.8} and doc["verdict_note"] is None
    # what the search's verdict said of the trial is said with it (an export a baseline beat said nothing of it),
    # not written into the policy file
    o.set_user_attr("verdict", {"headline": "A baseline beats the search: fedavg beats trial 4 on ...", "seeds": [0, 1],
                                "fresh": False, "beaten_by": ["fedavg"],
                                "comparisons": [{"pick": 4, "baseline": "fedavg", "outcome": "worse"},
                                                {"pick": 4, "baseline": "no-merging", "outcome": "better"},
                                                {"pick": 0, "baseline": "fedavg", "outcome": "tie"}]})
    doc = export_trial(s, url, tmp_path / "x.json", 4)
    assert doc["verdict_note"] == ("the search's verdict on trial 4 (the search's own seeds 0, 1): it loses to fedavg; "
                                   "beats no-merging")
    assert "verdict_note" not in json.loads((tmp_path / "x.json").read_text())
    assert export_trial(s, url, tmp_path / "x.json", 0)["verdict_note"].endswith(": it ties with fedavg")


def _one_objective(tmp_path):
    """A stored single-objective study: trial 0 at 0.9, trial 1 pruned, trial 2 at 0.8."""
    import optuna

    f = write_study(tmp_path)
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    o = optuna.create_study(study_name="tiny", storage=url, direction="maximize")
    for value in (0.9, None, 0.8):
        t = o.ask()
        t.set_user_attr("policy", {"scheme": "gossip", "mean_interval": 3.0})
        o.tell(t, value) if value is not None else o.tell(t, state=optuna.trial.TrialState.PRUNED)
    return f, url


def test_one_objective_export_honours_limit_and_says_what_pareto_wrote(tmp_path, data_dir):
    """--limit was ignored where the study has one objective: now the best trial that meets it, or one line."""
    f, url = _one_objective(tmp_path)
    base = ["export", "--study", str(f), "--storage", url]
    p = cli(*base, "-o", "lim.json", "--limit", "val_accuracy=0.85", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "lim.json").read_text())
    assert doc["trial"] == 0 and doc["picked_by"] == "the best val_accuracy, with val_accuracy at least 0.85"
    for args, line in [(["--limit", "val_accuracy=0.95"], "error: --limit: val_accuracy=0.95: no complete trial meets it"),
                       (["--limit", "foo=1"], "error: --limit: 'foo' is not an objective of tiny; allowed: val_accuracy"),
                       (["--limit", "val_accuracy=95"], "error: --limit: val_accuracy=95 is out of range; allowed: "
                                                        "[0, 1] for val_accuracy, a fraction (0.95, not 95)")]:
        p = cli(*base, "-o", "x.json", *args, cwd=tmp_path, data_dir=data_dir)
        if line.endswith("meets it"):
            assert p.returncode == 2 and re.fullmatch(re.escape(line) + r" \(the best has val_accuracy 0\.\d+\)",
                                                      p.stderr.strip()), p.stderr
            continue
        assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (tmp_path / "x.json").exists()
    # --tolerance picks among a Pareto set: with one objective it does nothing, and says so (it was taken silently)
    p = cli(*base, "-o", "tol.json", "--tolerance", "5", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and json.loads((tmp_path / "tol.json").read_text())["trial"] == 0
    assert p.stderr.strip() == ("note: --tolerance picks among the Pareto-optimal trials of several objectives; tiny has "
                                "one, so the best trial is written"), p.stderr
    p = cli(*base, "--pareto", "-o", "front", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and p.stdout.strip() == "wrote 1 Pareto-optimal policy to front/ (one objective: the best " \
                                                     "trial)", p.stdout
    assert [x.name for x in (tmp_path / "front").iterdir()] == ["trial-0000.json"]
    # a trial an earlier export wrote that is no longer on the front is removed, and said (a folder of "the Pareto
    # set" kept a dominated trial's policy); another study's file and the user's own are left, and said
    stale = json.loads((tmp_path / "front" / "trial-0000.json").read_text()) | {"trial": 9}
    (tmp_path / "front" / "trial-0009.json").write_text(json.dumps(stale))
    (tmp_path / "front" / "trial-0003.json").write_text(json.dumps(stale | {"study": "another"}))
    (tmp_path / "front" / "notes.json").write_text("{}")
    # the user's own --trial export there, and a --pareto file of another definition of the name: left, and said
    (tmp_path / "front" / "trial-0007.json").write_text(json.dumps(stale | {"trial": 7, "picked_by": "--trial 7"}))
    (tmp_path / "front" / "trial-0008.json").write_text(json.dumps(stale | {"trial": 8, "fingerprint": {"hash": "x"}}))
    p = cli(*base, "--pareto", "-o", "front", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and p.stdout.splitlines()[1:] == [
        "removed trial-0009.json an earlier export of tiny wrote there: its trial is no longer Pareto-optimal"], p.stdout
    assert p.stderr.strip() == ("note: front/ also holds 3 files (trial-0003.json, trial-0007.json, trial-0008.json) "
                                "not exported from tiny, left as they are"), p.stderr
    assert sorted(x.name for x in (tmp_path / "front").iterdir()) == ["notes.json", "trial-0000.json", "trial-0003.json",
                                                                     "trial-0007.json", "trial-0008.json"]


def test_export_to_a_folder_or_an_unwritable_path_is_one_line_naming_output(tmp_path, data_dir):
    f, url = _one_objective(tmp_path)
    base = ["export", "--study", str(f), "--storage", url]
    (tmp_path / "afile").write_text("x")
    for out, extra, line in [
        (str(tmp_path), [], f"error: --output: {str(tmp_path)!r} is a folder; allowed: a file to write the policy to "
                            f"(e.g. {tmp_path / 'best.json'}), or a folder with --pareto"),
        (str(tmp_path / "afile"), ["--pareto"], f"error: --output: {str(tmp_path / 'afile')!r} is a file; allowed: a "
                                                f"folder for --pareto's files"),
        (str(tmp_path / "afile" / "x.json"), [], None),  # under a file: the folder cannot be made
        (str(tmp_path / "p.json"), ["--pareto"], f"error: --output: {str(tmp_path / 'p.json')!r} names a JSON file; "
                                                 f"allowed: a folder for --pareto's files, one per trial (e.g. "
                                                 f"{tmp_path / 'p'})"),  # (it made a folder p.json/)
    ]:
        p = cli(*base, "-o", out, *extra, cwd=tmp_path, data_dir=data_dir)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0] == line if line else lines[0].startswith("error: --output: cannot write "), p.stderr
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "p.json").exists()  # nothing lost or made


@pytest.mark.integration
def test_the_dashboard_shows_the_policy_export_writes(data_dir, tmp_path):
    """The dashboard's policy section named the best first objective while export wrote another trial: here trial
    0 is the most accurate, and trial 1, within 0.005 of it and sending a fifth of the bytes, is what export writes."""
    import optuna

    from evomerge.report import dashboard

    f = write_study(tmp_path, name="two", objectives=("val_accuracy", "bytes"))
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    o = optuna.create_study(study_name="two", storage=url, directions=["maximize", "minimize"])
    for values, interval in (([0.900, 5e6], 1.0), ([0.898, 1e6], 5.0), ([0.7, 2e6], 3.0)):
        t = o.ask()
        t.set_user_attr("policy", {"scheme": "gossip", "mean_interval": interval})
        o.tell(t, values)
    p = cli("export", "--study", str(f), "--storage", url, "-o", "default.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "default.json").read_text())
    assert doc["trial"] == 1
    page = dashboard.build(study.load(f), url, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "dash",
                           compute_baselines=False).read_text()
    assert "The best policy: trial 1<" in page
    assert f"The policy evomerge export writes: {doc['picked_by']}. push_pull gossip on ring every ~5 steps" in page
    # `status` titles the Pareto set as such (it said "top 2" where its help and docs said "top 5")
    p = cli("status", "--study", str(f), "--storage", url, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "two: the 2 Pareto-optimal trials" in p.stdout, p.stdout


@pytest.mark.system
def test_a_merger_given_a_model_of_another_size_than_the_search_had_says_so(tmp_path, data_dir):
    """(A policy found for the study's MLP deployed on the loop's CNN ran with no word: the search had judged its
    merges by the MLP's bytes and steps.) The search keeps its model's size, the export carries it, the Merger
    compares it with the loop's model."""
    import warnings

    import torch
    import torch.distributed as dist

    from evomerge import simulate
    from evomerge.models import float32_bytes

    f = write_study(tmp_path)
    p = cli("search", "--study", str(f), "--n-trials", "1", "--no-verdict", "--quiet", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert cli("export", "--study", str(f), "-o", "best.json", cwd=tmp_path, data_dir=data_dir).returncode == 0
    doc = json.loads((tmp_path / "best.json").read_text())
    setup = simulate.prepare(study.load(f), data_dir=data_dir)
    assert doc["model_bytes"] == float32_bytes(setup.model) > 0
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
        with pytest.warns(UserWarning, match=rf"^policy: trial {doc['trial']} of tiny was searched with a model of "
                                             r"[\d.,]+ kB \(float32 parameters and buffers\); this model is 31\.4 kB\. "
                                             r"The search judged its merges by that model's bytes and steps"):
            evomerge.Merger(str(tmp_path / "best.json"), other, seed=0, total_steps=4).close()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")  # the study's own model: nothing to say of its size
            evomerge.Merger(str(tmp_path / "best.json"), setup.model.module(), seed=0, total_steps=4).close()
        # (one rank here: the study's 4 workers are said)
        assert [str(w.message) for w in said] == [
            f"policy: trial {doc['trial']} of tiny was searched with 4 workers (run.workers); this job has 1. How far a "
            "merge reaches and the topology's shape change with the workers: search a study of 1 worker for a "
            "policy found for this job"], [str(w.message) for w in said]
    finally:
        dist.destroy_process_group()
