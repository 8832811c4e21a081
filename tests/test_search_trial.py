"""search/trial.py: the multi-objective prune rule, and a trial whose run diverged, through the real command."""

import json
import sqlite3

import pytest

from conftest import write_study
from evomerge.search import results, trial
from searchutil import cli, edit_study


def test_multi_objective_pruning_rule():
    d = ["maximize", "minimize"]
    assert results.dominated_count((0.5, 10.0), [(0.6, 5.0), (0.5, 10.0), (0.4, 1.0), (0.9, 10.0)], d) == 2
    curves = [{"10": [0.8, 100.0]} for _ in range(6)]
    assert trial.mo_should_prune((0.7, 200.0), 10, curves, d)
    assert not trial.mo_should_prune((0.9, 200.0), 10, curves, d)  # better accuracy: not dominated
    assert not trial.mo_should_prune((0.7, 200.0), 20, curves, d)  # no completed trial reached that step
    assert not trial.mo_should_prune((0.7, 200.0), 10, curves[:4], d)  # too few to judge


def _attrs(db):
    with sqlite3.connect(db) as c:
        rows = c.execute("""select t.number, t.state, a.key, a.value_json from trials t join trial_user_attributes a
                            on a.trial_id = t.trial_id""").fetchall()
    out = {}
    for n, state, k, v in rows:
        out.setdefault(n, {"state": state})[k] = json.loads(v)
    return out


@pytest.mark.system
def test_diverged_trials_are_marked_and_kept_off_best_and_the_pareto_set(tmp_path, data_dir):
    # a huge learning rate: every run's loss goes non-finite within the first round
    f = edit_study(write_study(tmp_path, objectives=("val_accuracy", "bytes")), "[run]\n", "[run]\nlr = 1e6\n")
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "3", "--sampler", "nsga2", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    # kept COMPLETE with the values they reached (samplers learn from them), marked run_status = diverged
    attrs = _attrs(tmp_path / "runs" / "tiny" / "optuna.db")
    assert len(attrs) == 3 and all(a["state"] == "COMPLETE" and a["run_status"] == "diverged" for a in attrs.values())
    assert "3 complete (3 diverged)" in p.stdout and "diverged: trials 0, 1, 2" in p.stdout
    assert "no completed trial yet that did not diverge (3 diverged)" in p.stdout
    s = cli("status", "--study", str(f), cwd=tmp_path, data_dir=data_dir)
    assert s.returncode == 0 and "3 complete (3 diverged)" in s.stdout and "diverged: trials 0, 1, 2" in s.stdout
    for args in (["-o", "best.json"], ["--pareto", "-o", "pareto"]):
        e = cli("export", "--study", str(f), *args, cwd=tmp_path, data_dir=data_dir)
        assert e.returncode == 2 and e.stderr.count("\n") == 1
        assert "has no completed trial yet that did not diverge (3 diverged)" in e.stderr
    assert not (tmp_path / "best.json").exists() and not list(tmp_path.glob("pareto/*.json"))
