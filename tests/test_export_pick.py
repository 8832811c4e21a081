"""`evomerge export` on a study with several objectives writes one policy by a stated rule (issue 28, part 3): the
best second objective among the Pareto-optimal trials within a tolerance of the best first, under the user's
limits; real SQLite, a real NSGA-II search, the command as a user runs it."""

import json

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


@pytest.mark.system
def test_export_picks_the_cheapest_close_to_the_best_accuracy_and_says_so(searched, data_dir):
    d, f, ostudy = searched
    front = pareto_trials(ostudy, study.load(f))
    assert len(front) >= 2  # a trade-off to pick from
    most_accurate = max(front, key=lambda t: t.values[0])
    tol = most_accurate.values[0] - min(t.values[0] for t in front)  # every front trial is close enough
    p = cli("export", "--study", str(f), "-o", "best.json", "--tolerance", str(tol), cwd=d, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((d / "best.json").read_text())
    cheapest = min(front, key=lambda t: t.values[1])
    assert doc["trial"] == cheapest.number != most_accurate.number  # not the first objective's best
    assert doc["picked_by"] == (f"the best bytes among the Pareto-optimal trials within {tol:g} of the best "
                                "val_accuracy")
    assert f"wrote trial {cheapest.number} (" in p.stdout and "picked as the best bytes" in p.stdout
    p = cli("export", "--study", str(f), "-o", "tight.json", "--tolerance", "0", cwd=d, data_dir=data_dir)
    assert json.loads((d / "tight.json").read_text())["trial"] == most_accurate.number
    limit = sorted(t.values[1] for t in front)[1]  # the two cheapest meet it; the most accurate may not
    p = cli("export", "--study", str(f), "-o", "lim.json", "--tolerance", "0", "--limit", f"bytes={limit}", cwd=d,
            data_dir=data_dir)
    got = json.loads((d / "lim.json").read_text())
    meets = [t for t in front if t.values[1] <= limit]
    assert got["trial"] == max(meets, key=lambda t: (t.values[0], -t.number)).number


@pytest.mark.system
def test_a_limit_nothing_meets_is_one_line_naming_the_option(searched, data_dir):
    d, f, _ = searched
    for args, line in [(["--limit", "bytes=1"], "error: --limit: bytes=1: no Pareto-optimal trial meets it"),
                       (["--limit", "nope=3"], "error: --limit: 'nope' is not an objective of two; allowed: "
                                               "val_accuracy, bytes"),
                       (["--limit", "bytes"], "error: --limit: 'bytes' is not OBJECTIVE=VALUE (e.g. bytes=1e8)")]:
        p = cli("export", "--study", str(f), "-o", "x.json", *args, cwd=d, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.strip() == line, p.stderr
    assert not (d / "x.json").exists()  # nothing written


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
                                           f"trial that did not diverge ({n}, from 0 to {max(t.number for t in trials)})"),
                       (["--trial", "1", "--pareto"], "error: --trial: given with --pareto; allowed: one of --trial "
                                                      "(one trial), --pareto"),
                       (["--trial", "-2"], "error: --trial: -2 is out of range; allowed: a trial number >= 0")]:
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
    ok = "allowed: the number of a complete trial that did not diverge (2, from 0 to 4)"
    for number, what in [(1, "trial 1 was pruned"), (2, "trial 2 failed"), (3, "trial 3 diverged (its values are not "
                                                                                 "finite)"), (7, "'tiny' has no trial 7")]:
        with pytest.raises(ConfigError) as e:
            export_trial(s, url, tmp_path / "x.json", number)
        assert str(e.value) == f"--trial: {what}; {ok}"
    assert not (tmp_path / "x.json").exists()
    doc = export_trial(s, url, tmp_path / "x.json", 4)
    assert doc["trial"] == 4 and doc["objectives"] == {"val_accuracy": 0.8}
