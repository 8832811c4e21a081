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


def test_a_slow_ask_beats_its_trials_again_so_another_process_does_not_fail_them_as_stale(tmp_path):
    """A real SQLite study with a 2 s grace period: four trials created running with their first heartbeat (as a
    batch's asks create them), then an ask that took 2.6 s: ``beat_if_slow`` beats the three given to it, so the
    stale-trial check another process runs once it takes the lock (1.6 s later, 4.2 s after the creation) fails only
    the fourth. An ask quicker than a third of the grace period beats nothing. (SQLite's heartbeats are in whole
    seconds: the margins are over a second either side of the grace period.)"""
    import time

    import optuna

    from evomerge.search import asking
    from evomerge.search.storage import open_storage, quiet_optuna

    storage = open_storage(f"sqlite:///{tmp_path / 'o.db'}", grace_period=2)
    with quiet_optuna():
        study = optuna.create_study(storage=storage, study_name="s")
        sid = storage.get_study_id_from_name("s")
        trials = [asking._create(study, storage, sid, params={}, distributions={}) for _ in range(4)]
        since = time.monotonic()
        assert not trial.beat_if_slow(storage, trials[:3], since, 2)  # quick: nothing to do
        time.sleep(2.6)
        assert trial.beat_if_slow(storage, trials[:3], since, 2)
        time.sleep(1.6)
        optuna.storages.fail_stale_trials(study)
    states = [storage.get_trial(t._trial_id).state.name for t in trials]
    assert states == ["RUNNING", "RUNNING", "RUNNING", "FAIL"]
