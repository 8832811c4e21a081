"""search/results.py and what reads it: status, export (best and Pareto), diverged trials kept apart."""

import json
import re

import optuna
import pytest

import evomerge
from conftest import write_study
from evomerge import study
from evomerge.engine.setup import resolve_device
from evomerge.errors import ConfigError
from evomerge.search import results
from searchutil import cli

optuna.logging.set_verbosity(optuna.logging.WARNING)

@pytest.mark.system
def test_export_then_run_reproduces_the_trials_validation_metrics(tmp_path, data_dir):
    f = write_study(tmp_path, seeds=(3, 4))
    assert cli("search", "--no-verdict", "--study", str(f), "--n-trials", "4", "--quiet", cwd=tmp_path, data_dir=data_dir).returncode == 0
    p = cli("export", "--study", str(f), "-o", "out/new/best.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and p.stderr == "note: made the folder out\n", p.stderr  # as mkdir -p, and said
    p = cli("export", "--study", str(f), "-o", "best.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert (tmp_path / "out" / "new" / "best.json").read_text() == (tmp_path / "best.json").read_text()
    doc = json.loads((tmp_path / "best.json").read_text())
    assert doc["study"] == "tiny" and doc["seeds"] == [3, 4] and doc["evomerge_version"] == evomerge.__version__
    from evomerge.policy import MergePolicy, no_effect

    # the policy in words, beside the policy's every field (those it leaves out take no effect)
    assert doc["description"] == MergePolicy.load(tmp_path / "best.json").describe()
    assert f"gossip on {doc['policy']['topology']} every" in doc["description"]
    # and the fields that take no effect in it (a ring has no degree; no communities)
    assert doc["no_effect"] == sorted(no_effect(doc["policy"])) and {"degree", "n_communities"} <= set(doc["no_effect"])
    assert "mean_interval" not in doc["no_effect"] and "topology" not in doc["no_effect"]
    here = resolve_device(None).type
    import torch

    threads = torch.get_num_threads()  # the commands run in this process (searchutil.cli)
    assert doc["ran_on"] == (f"in process on cpu with {threads} torch thread{'s' * (threads != 1)}" if here == "cpu"
                             else f"in process on {here}")  # where the trial's sums ran
    for seed in (3, 4):
        p = cli("run", "--study", str(f), "--policy", "best.json", "--seed", str(seed), "--json", f"r{seed}.json",
                "--quiet", cwd=tmp_path, data_dir=data_dir)
        assert p.returncode == 0 and f"matches trial {doc['trial']}" in p.stdout
        final = json.loads((tmp_path / f"r{seed}.json").read_text())["final"]
        want = doc["metrics_per_seed"][str(seed)]
        for k in ("val_accuracy", "val_loss", "mean_worker_accuracy", "consensus_distance", "bytes"):
            assert final[k] == want[k], k
    # on the distributed backend the sums run in another order: both values shown, and not called a difference
    p = cli("run", "--study", str(f), "--policy", "best.json", "--backend", "distributed", "--procs", "2", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "matches" not in p.stdout and "DIFFERS" not in p.stdout, p.stdout
    line = [ln for ln in p.stdout.splitlines() if f"trial {doc['trial']} of tiny" in ln]
    assert len(line) == 1 and line[0].startswith("validation accuracy 0.") and line[0].endswith(
        f"{doc['metrics_per_seed']['3']['val_accuracy']:.4f} (seed 3): not held to match bit for bit, the trial ran "
        f"{doc['ran_on']} and this run on the distributed backend (2 processes) on {here}, whose sums run in "
        "another order"), p.stdout
    if here == "cpu":  # in process with another number of torch threads: the sums split otherwise (it said DIFFERS)
        p = cli("run", "--study", str(f), "--policy", "best.json", "--quiet", cwd=tmp_path, data_dir=data_dir,
                env_extra={"EVOMERGE_THREADS": str(threads + 1)}, process=True)
        assert p.returncode == 0 and "matches" not in p.stdout and "DIFFERS" not in p.stdout, p.stdout
        assert (f"(seed 3): not held to match bit for bit, the trial ran {doc['ran_on']} and this run in process on "
                f"cpu with {threads + 1} torch threads, whose sums run in another order") in p.stdout, p.stdout
    # the same file on another study (other workers): a note that the trial is another study's, no match or mismatch
    other = write_study(tmp_path, name="other", workers=2, seeds=(3,))
    p = cli("run", "--study", str(other), "--policy", "best.json", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "matches" not in p.stdout and "DIFFERS" not in p.stdout, p.stdout
    assert (f"note: the policy is trial {doc['trial']} of study tiny; this run is of other, so its figures are not "
            "compared with the trial's") in p.stderr
    p = cli("run", "--study", str(f), "--policy", "best.json", "--reevaluate", "2", "--json", "re.json", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "test accuracy" in p.stdout
    re = json.loads((tmp_path / "re.json").read_text())
    assert re["seeds"] == [1004, 1005] and all(0 < r["test_accuracy"] <= 1 for r in re["runs"])
    assert "mean ± sd" in p.stdout and p.stdout.count("±") >= 5
    p = cli("run", "--study", str(f), "--policy", "best.json", "--reevaluate", "1", "--quiet", cwd=tmp_path,
            data_dir=data_dir)  # one seed: its values, no spread of one
    assert p.returncode == 0 and "value (one seed)" in p.stdout and "±" not in p.stdout, p.stdout


@pytest.mark.system
def test_status_and_pareto_export(tmp_path, data_dir):
    f = write_study(tmp_path, objectives=("val_accuracy", "bytes"))
    assert cli("search", "--no-verdict", "--study", str(f), "--n-trials", "5", "--sampler", "nsga2", "--quiet", cwd=tmp_path,
               data_dir=data_dir).returncode == 0
    p = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "5 complete" in p.stdout
    assert "trial / baseline" not in p.stdout and re.search(r"┃ trial +┃", p.stdout), p.stdout  # it lists no baseline
    p = cli("export", "--study", str(f), "--pareto", "-o", "pareto", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0
    files = sorted((tmp_path / "pareto").glob("*.json"))
    docs = [json.loads(x.read_text()) for x in files]
    assert docs and all(set(d["objectives"]) == {"val_accuracy", "bytes"} for d in docs)
    pts = [(d["objectives"]["val_accuracy"], d["objectives"]["bytes"]) for d in docs]
    for a in pts:  # no exported point is dominated by another
        assert results.dominated_count(a, pts, ["maximize", "minimize"]) == 0


@pytest.mark.system
def test_status_of_an_unsearched_study_is_one_line(tmp_path, data_dir):
    f = write_study(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for command in (["status"], ["export", "-o", "best.json"]):
        p = cli(*command, "--study", str(f), cwd=tmp_path, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.endswith("; run `evomerge search` first, or say where it stored them (--runs-dir or "
                                 "$EVOMERGE_RUNS_DIR, --storage)\n"), p.stderr
    assert sorted(tmp_path.rglob("*")) == before  # (left an empty runs/tiny/optuna.db behind)


def _study_with(points, diverged_at, directions):
    """A real (in-memory) Optuna study holding COMPLETE trials at ``points``; those in ``diverged_at`` diverged."""
    ost = optuna.create_study(directions=directions)
    for i, values in enumerate(points):
        t = ost.ask()
        t.set_user_attr("run_status", "diverged" if i in diverged_at else "ok")
        ost.tell(t, list(values))
    return ost


def test_diverged_trials_are_never_best_nor_pareto_optimal(tmp_path):
    two = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    # trial 2 diverged after a few steps: it sent almost nothing, so it would be Pareto-optimal
    ost = _study_with([(0.9, 100.0), (0.8, 50.0), (0.1, 1.0), (0.7, 80.0)], {2}, ["maximize", "minimize"])
    assert [t.number for t in results.pareto_trials(ost, two)] == [0, 1]
    assert 2 in {t.number for t in ost.best_trials}  # what Optuna alone would call Pareto-optimal
    assert [b["number"] for b in results.best_trials(ost, two)] == [0, 1]
    assert results.count_line(ost.get_trials()) == "4 complete (1 diverged)"

    one = study.load(write_study(tmp_path / "one"))
    ost = _study_with([(0.5,), (0.95,), (0.6,)], {1}, ["maximize"])
    best = results.best_trials(ost, one, 5)
    assert [b["number"] for b in best] == [2, 0] and all(b["run_status"] == "ok" for b in best)


@pytest.mark.system
def test_results_do_not_import_the_search_loop():
    import subprocess
    import sys

    code = ("import sys, evomerge.search.results, evomerge.report.export; "
            "print([m for m in sys.modules if m in ('evomerge.search.loop', 'evomerge.search.trial', 'optuna', 'mlflow')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.system
def test_clamped_ranges_are_printed_by_search_and_status(tmp_path, data_dir):
    """Study.notes (what loading changed to fit the workers) reach the user: in the search's header and in status."""
    f = write_study(tmp_path, workers=3, steps=10, topologies=("ring", "random_regular"))  # degree 3 of 3: impossible
    s = study.load(f)
    assert s.notes and any("study.policy.degree" in n for n in s.notes)
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "1", "--sampler", "random", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    for n in s.notes:
        assert f"note: {n}" in p.stderr
    p = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and all(f"note: {n}" in p.stdout for n in s.notes), p.stdout


def test_a_search_run_beside_its_study_file_is_found_from_the_folder_above(tmp_path, data_dir):
    """(A new user searched in mine/, then ran `export --study mine/seq.toml` from the folder above: "no search
    results ...; run `evomerge search` first", which would have started anew.) The line names the runs folder
    beside the study file, which then works as said; a search from there says it starts anew and how to resume."""
    f = write_study(tmp_path / "mine", name="beside")
    assert cli("search", "--no-verdict", "--no-baselines", "--study", f.name, "--n-trials", "1", "--sampler", "random",
               "--quiet", cwd=f.parent, data_dir=data_dir).returncode == 0
    p = cli("export", "--study", "mine/beside.toml", "-o", "best.json", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == (
        f"error: --study: no search results for 'beside' in sqlite:///{tmp_path / 'runs' / 'beside' / 'optuna.db'}; the "
        "runs folder beside the study file holds them: --runs-dir mine/runs\n"), p.stderr
    assert not (tmp_path / "runs").exists()  # (nothing made where the command ran)
    p = cli("export", "--study", "mine/beside.toml", "--runs-dir", "mine/runs", "-o", "best.json", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0 and json.loads((tmp_path / "best.json").read_text())["study"] == "beside", p.stderr
    p = cli("search", "--no-verdict", "--no-baselines", "--study", "mine/beside.toml", "--n-trials", "1", "--sampler",
            "random", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and p.stderr.startswith(
        "note: the runs folder beside the study file holds a search of 'beside'; this one starts anew in "
        f"sqlite:///{tmp_path / 'runs' / 'beside' / 'optuna.db'} (--runs-dir mine/runs resumes that one)\n"), p.stderr


@pytest.mark.system
def test_a_study_searched_from_its_own_file_elsewhere_is_opened_by_name(tmp_path, data_dir):
    """After `search --study /elsewhere/own.toml`, status, export, dashboard and ui take --study own-study; the
    definition stored with the trials is used, and a changed file on disk is named in one line."""
    import os
    import signal
    import subprocess
    import sys

    from test_tracking import free_port, stop, wait_healthy

    f = write_study(tmp_path / "elsewhere", name="own-study")
    work = tmp_path / "work"
    work.mkdir()
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "2", "--sampler", "random", "--quiet", cwd=work, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    p = cli("status", "--study", "own-study", cwd=work, data_dir=data_dir)
    assert p.returncode == 0 and p.stdout.startswith("own-study: ") and p.stderr == "", p.stderr
    p = cli("export", "--study", "own-study", "-o", "best.json", cwd=work, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert json.loads((work / "best.json").read_text())["study"] == "own-study"
    p = cli("dashboard", "--study", "own-study", "--no-baselines", cwd=work, data_dir=data_dir)
    assert p.returncode == 0 and (work / "dashboards" / "own-study" / "index.html").is_file(), p.stderr
    # the file changes on disk: the stored definition is what the trials were judged on
    f.write_text(f.read_text().replace("n_trials = 6", "n_trials = 9"))
    p = cli("status", "--study", str(f), cwd=work, data_dir=data_dir)
    assert p.returncode == 0 and p.stderr.count("\n") == 1 and "differs from the definition of 'own-study'" in p.stderr
    p = cli("status", "--study", "own-study", cwd=work, data_dir=data_dir)  # by name: the file the search read
    assert p.returncode == 0 and p.stderr == (f"note: {f.resolve()}, the file 'own-study' was searched from, has "
                                              "changed since; using the definition stored with its trials\n"), p.stderr
    # an unknown name lists the stored studies too
    p = cli("status", "--study", "nope", cwd=work, data_dir=data_dir)
    assert p.returncode == 2 and "stored in runs (--runs-dir, from the current folder): own-study" in p.stderr
    # the UI by name, through the real command: the printed address is the study's runs list
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "EVOMERGE_RUNS_DIR")}
    proc = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "ui", "--study", "own-study", "--port", str(port)],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        line = proc.stdout.readline()
        assert line.startswith(f"http://127.0.0.1:{port}/#/experiments/") and "MLflow UI for own-study" in line, line
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        stop(proc)
    # the file gone: the search goes on by name, on the stored definition (it said "unknown study")
    f.unlink()
    p = cli("search", "--no-verdict", "--study", "own-study", "--n-trials", "3", "--sampler", "random", "--quiet",
            cwd=work, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert (f"note: no study file 'own-study' here; searching on with the definition stored with its trials (from "
            f"{f.resolve()})") in p.stderr, p.stderr
    assert "own-study: 3 complete" in p.stdout, p.stdout
    p = cli("search", "--study", "not-stored", cwd=work, data_dir=data_dir)  # a name nothing holds: as before
    assert p.returncode == 2 and p.stderr.startswith("error: --study: unknown study 'not-stored'"), p.stderr


@pytest.mark.unit
def test_a_multi_objective_ranking_takes_pareto_layers_first():
    """What a warm start enqueues first and what `transfer` re-runs: with accuracy and bytes, the trade-offs of the
    front come before a trial that bought a little accuracy at any cost only if it is on the front too; a dominated
    trial comes after every non-dominated one, whatever its accuracy."""
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}

    def t(n, acc, mb):
        tr = optuna.trial.create_trial(params={"x": 0.5}, distributions=dist, values=[acc, mb * 1e6])
        tr.number = n
        return tr

    trials = [t(0, 0.93, 2800), t(1, 0.95, 80), t(2, 0.91, 13), t(3, 0.94, 300), t(4, 0.90, 50), t(5, 0.96, 3000)]
    ranked = results.rank_trials(trials, ["maximize", "minimize"])
    assert [x.number for x in ranked] == [5, 1, 2, 3, 4, 0]  # front {5, 1, 2}; then {3, 4}; then {0}
    # one objective: by its value
    assert [x.number for x in results.rank_trials(trials, ["maximize"])] == [5, 1, 3, 0, 2, 4]


def test_a_diverged_loss_objective_is_the_worst_value_and_the_trial_stays_complete():
    """A loss or perplexity that is NaN (a diverged run) is told to Optuna as +inf: a NaN would fail the trial,
    and a diverged trial must stay COMPLETE for the sampler to learn from it. Accuracy keeps its own value."""
    import math

    import optuna

    from evomerge import study as study_mod
    from evomerge.search.results import objective_values

    st = study_mod.from_dict({"study": {"name": "t"}, "objectives": {"metrics": ["val_loss", "bytes"]}})
    assert objective_values(st, [{"val_loss": float("nan"), "bytes": 10}]) == [math.inf, 10.0]
    assert objective_values(st, [{"val_loss": 0.5, "bytes": 10}, {"val_loss": 0.7, "bytes": 20}]) == [0.6, 15.0]
    o = optuna.create_study(directions=["minimize", "minimize"])
    t = o.ask()
    o.tell(t, objective_values(st, [{"val_loss": float("nan"), "bytes": 10}]))
    assert o.trials[0].state == optuna.trial.TrialState.COMPLETE


def test_a_run_that_diverged_on_one_seed_of_several_leaves_a_spread_of_nan_not_an_error():
    """``statistics.stdev`` raises AttributeError on a NaN or an inf: a baseline whose loss was NaN on one fresh seed
    took the verdict down ('the verdict failed: AttributeError: ...'), and ``run --reevaluate`` with it."""
    import math

    out = results.summarise([{"val_loss": float("nan"), "bytes": 10}, {"val_loss": 0.5, "bytes": 30}])
    assert math.isnan(out["val_loss"]) and math.isnan(out["val_loss_std"])
    assert out["bytes"] == 20 and out["bytes_std"] == pytest.approx(math.sqrt(200))
    assert math.isnan(results.spread([math.inf, 1.0])) and results.spread([1.0, 3.0]) == pytest.approx(math.sqrt(2))


def test_counts_line_says_when_a_stored_study_has_no_trial_yet():
    from evomerge.search.results import format_counts

    assert format_counts({}) == "no trials yet"
    assert format_counts({"COMPLETE": 3, "PRUNED": 1}, n_diverged=1) == "3 complete (1 diverged), 1 pruned"


def test_a_stored_study_without_its_definition_is_named_with_what_to_give_instead(tmp_path, data_dir):
    """Trials stored without the study file's text (an older evomerge, or Optuna alone): by name, one line that
    says so and asks for the file; by the file, read."""
    runs = tmp_path / "runs"
    (runs / "tiny").mkdir(parents=True)
    optuna.create_study(study_name="tiny", storage=f"sqlite:///{runs / 'tiny' / 'optuna.db'}")
    p = cli("status", "--study", "tiny", "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == (
        f"error: --study: 'tiny' is stored in {runs} without its study file's text (searched by an older evomerge); "
        "allowed: the path to its .toml file\n")
    p = cli("status", "--study", write_study(tmp_path), "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "tiny: no trials yet" in p.stdout, p.stderr


def test_a_store_left_empty_by_an_interrupted_start_is_not_a_stored_study(tmp_path, data_dir):
    """(A search stopped as it started left runs/NAME/optuna.db empty, and status said the study was stored without
    its definition by an older evomerge.) By name: unknown, nothing stored; by the file: no search results; and the
    file is not written."""
    runs = tmp_path / "runs"
    (runs / "tiny").mkdir(parents=True)
    (runs / "tiny" / "optuna.db").write_bytes(b"")
    for command in (("status",), ("export", "-o", str(tmp_path / "best.json"))):
        p = cli(*command, "--study", "tiny", "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
        assert p.returncode == 2 and p.stderr.startswith("error: --study: unknown study 'tiny'; ") and \
            f"stored in {runs}: none " in p.stderr, p.stderr
    p = cli("status", "--study", write_study(tmp_path), "--runs-dir", runs, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.startswith("error: --study: no search results for 'tiny' in "), p.stderr
    assert (runs / "tiny" / "optuna.db").stat().st_size == 0
    # a warm start from it is refused in one line, and the file stays empty (Optuna's tables were written into it)
    from evomerge.search import warmstart

    with pytest.raises(ConfigError, match="no study 'tiny' in .*allowed: none \\(no study stored\\)"):
        warmstart.check_source("tiny", study.load(write_study(tmp_path, name="other")), runs)
    assert (runs / "tiny" / "optuna.db").stat().st_size == 0


def test_a_store_in_a_folder_whose_name_holds_a_hash_or_a_question_mark_is_read(tmp_path):
    """(The read-only look went through a file: URI built by hand: a '#' cut the path, a '?' opened another file.)"""
    import optuna

    from evomerge.search.results import _may_hold, stored_names

    for folder in ("runs#1", "runs?x=1"):
        plain = tmp_path / "plain" / "tiny" / "optuna.db"  # (SQLAlchemy's URL would take '?' for its query)
        plain.parent.mkdir(parents=True)
        optuna.create_study(study_name="tiny", storage=f"sqlite:///{plain}")
        (tmp_path / "plain").rename(tmp_path / folder)
        db = tmp_path / folder / "tiny" / "optuna.db"
        assert stored_names(tmp_path / folder) == ["tiny"]
        if "?" not in folder:  # (in a storage URL a '?' starts SQLAlchemy's query string)
            assert _may_hold(f"sqlite:///{db}", "tiny") and not _may_hold(f"sqlite:///{db}", "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs#1", "runs?x=1"]  # no other file opened or made



@pytest.mark.unit
def test_exports_tolerance_is_half_a_point_of_accuracy_and_half_a_percent_of_anything_else():
    """The export's pick among the Pareto set: a first objective in seconds was held to within 0.005 s of its
    best (the default, half a point of accuracy, in every unit), so the trade-off was never taken. The default is
    now 0.5% of the best where the first objective is not an accuracy; `2%` sets a relative tolerance; anything
    else is one line naming --tolerance."""
    from evomerge import study as study_mod
    from evomerge.errors import ConfigError

    def ostudy(directions, points):
        o = optuna.create_study(directions=directions)
        for v in points:
            o.add_trial(optuna.trial.create_trial(values=list(v)))
        return o

    timed = study_mod.from_dict({"study": {"name": "t"}, "objectives": {"metrics": ["time_to_target", "bytes"],
                                                                         "target": 0.9},
                                 "environment": {"step_time": 0.1, "time_budget": 300}})
    o = ostudy(["minimize", "minimize"], [(120.0, 5e9), (120.4, 1e8), (150.0, 1e6)])
    pick, said = results.pick_one(o, timed)
    assert pick["number"] == 1 and said == ("the best bytes among the Pareto-optimal trials within 0.5% (0.6) of the "
                                            "best time_to_target"), said
    assert results.pick_one(o, timed, "0.005")[0]["number"] == 0  # in seconds, as given
    assert results.pick_one(o, timed, "30%")[0]["number"] == 2
    # under a limit the tolerance is of the best that meets it, and the words say so (they said "the best")
    pick, said = results.pick_one(o, timed, "1%", {"bytes": 2e8})
    assert pick["number"] == 1 and said == ("the best bytes among the Pareto-optimal trials, with bytes at most 2e+08, "
                                            "within 1% (1.204) of their best time_to_target"), said
    acc = study_mod.from_dict({"study": {"name": "a"}, "objectives": {"metrics": ["val_accuracy", "bytes"]}})
    o = ostudy(["maximize", "minimize"], [(0.950, 5e9), (0.946, 1e8), (0.94, 1e6)])
    assert results.pick_one(o, acc)[0]["number"] == 1  # within half a point
    # "5" meant as points of accuracy took every trial, without a word
    assert results.pick_one(o, acc, "0.99")[0]["number"] == 2
    with pytest.raises(ConfigError, match=r"^--tolerance: 5 on val_accuracy, a fraction from 0 to 1, takes every "
                                          r"trial; allowed: a number below 1 \(0.05 is 5 points"):
        results.pick_one(o, acc, "5")
    o_timed = ostudy(["minimize", "minimize"], [(120.0, 5e9), (124.0, 1e8), (150.0, 1e6)])
    assert results.pick_one(o_timed, timed, "5")[0]["number"] == 1  # seconds: as given
    for bad in ("-1", "x%", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"^--tolerance: .*allowed: a number >= 0 .*percentage"):
            results.read_tolerance(bad)


@pytest.mark.system
def test_status_says_under_the_verdict_that_it_was_judged_on_fewer_trials(tmp_path, data_dir):
    """A verdict stored by a search of 1 trial, then a search that added one without its verdict: status shows the
    stored verdict with the note that it is older than the trials, right under its headline (it came after every
    line and note, where it read as an afterthought to a verdict of today)."""
    f = write_study(tmp_path)
    p = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--reevaluate", "0", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "verdict: " in p.stdout, p.stderr
    p = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert "verdict: " in p.stdout and "judged when" not in p.stdout, p.stdout
    p = cli("search", "--study", str(f), "--n-trials", "2", "--sampler", "random", "--no-verdict", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    p = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    lines = p.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("verdict: "))
    assert lines[at + 1] == ("note: judged when the study held 1 complete trial; it holds 2 now (a search that ends "
                             "judges again)"), lines[at:]
