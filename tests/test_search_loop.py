"""evomerge search end to end (search/loop.py): real SQLite storage, real MLflow store, real processes and signals."""

import json
import os
import re
import signal
import sqlite3
import time

import pytest

import evomerge
from conftest import write_study
from evomerge import study
from evomerge.errors import ConfigError
from evomerge.search.config import SAMPLERS
from searchutil import cli, cma_points as _cma_points, running, states, wait_for

SLOW = {"SLOWMLP_DELAY": "0.01"}  # a study written with slow=True: its model sleeps 10 ms a forward (tests/slowmlp.py)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_each_sampler_runs_a_tiny_study_end_to_end(tmp_path, data_dir, mnist, sampler):
    objectives = ("val_accuracy", "bytes") if sampler == "nsga2" else ("val_accuracy",)
    s = study.load(write_study(tmp_path, objectives=objectives))
    cma = {"cmaes_popsize": 4} if sampler == "cmaes" else {}  # (another sampler refuses CMA-ES's settings)
    res = evomerge.search(s, verdict=False, n_trials=6, sampler=sampler, runs_dir=tmp_path / "runs", seed=1, data_dir=data_dir,
                          **cma)
    assert not res.interrupted and not res.errors
    assert res.counts.get("COMPLETE", 0) + res.counts.get("PRUNED", 0) == 6
    assert "RUNNING" not in res.counts and "FAIL" not in res.counts
    assert len(res.records) == 6 and all(r["mlflow_run_id"] for r in res.records)
    assert all("failure" not in r for r in res.records if r["state"] != "FAIL")
    assert res.best and 0 < res.best[0]["values"][0] <= 1
    if sampler == "cmaes":
        assert {r["cma"]["cma_generation"] for r in res.records} == {0, 1}  # two generations of 4 asked
    # running it again asks nothing more: n_trials is a total
    again = evomerge.search(s, verdict=False, n_trials=6, sampler=sampler, runs_dir=tmp_path / "runs", seed=1, data_dir=data_dir,
                            **cma)
    assert again.records == []


def test_search_never_touches_the_test_set(tmp_path, mnist):
    s = study.load(write_study(tmp_path))
    before = mnist.test_accesses
    evomerge.search(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", data=mnist)  # the verdict too
    assert mnist.test_accesses == before


def test_a_bad_trial_fails_alone_and_the_search_goes_on(tmp_path, data_dir):
    # a user's weighting rule that raises: every trial that samples it fails, the others run
    from evomerge import registry
    from evomerge.engine.weighting import Uniform

    class Broken(Uniform):
        def pair_weights(self, st, move, own, incoming):
            raise RuntimeError("the broken rule raised")

    f = write_study(tmp_path)
    f.write_text(f.read_text().replace("[objectives]", 'weighting = { kind = "categorical", choices = ["uniform", "broken"] }\n[objectives]'))
    registry.WEIGHTINGS.register("broken", Broken)
    try:
        s = study.load(f)
        res = evomerge.search(s, verdict=False, n_trials=4, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir, seed=3)
    finally:
        del registry.WEIGHTINGS["broken"]
    assert res.counts.get("COMPLETE", 0) + res.counts.get("PRUNED", 0) == 4
    assert res.counts.get("FAIL", 0) >= 1
    failed = [r for r in res.records if r["state"] == "FAIL"]
    assert failed and all("the broken rule raised" in r["error"] for r in failed)


@pytest.mark.system
def test_unreachable_tracking_server_is_reported_before_any_trial(tmp_path, data_dir):
    s = study.load(write_study(tmp_path))
    with pytest.raises(ConfigError, match="cannot reach the MLflow server"):
        evomerge.search(s, verdict=False, n_trials=2, runs_dir=tmp_path / "runs", tracking_uri="http://127.0.0.1:9", data_dir=data_dir)
    assert not (tmp_path / "runs" / "tiny" / "optuna.db").exists()


def running_number(db):
    try:
        with sqlite3.connect(db) as c:
            rows = c.execute("select number from trials where state = 'RUNNING'").fetchall()
    except sqlite3.Error:
        return None
    return rows[0][0] if len(rows) == 1 else None


def interrupt_mid_trial(proc, db, after_complete, slow_file=None):
    """SIGINT once a trial has been running for a while (so the signal lands inside it, not between trials). With
    ``slow_file`` (the process's SLOWMLP_WHILE), the model's delay starts once ``after_complete - 1`` trials are
    complete: the trials before run fast, the ones the signal is for slow."""
    def settled_in_a_trial():
        try:
            st = states(db)
        except sqlite3.Error:
            return False
        if slow_file is not None and st.get("COMPLETE", 0) >= after_complete - 1:
            slow_file.touch()
        n = running_number(db)
        if st.get("COMPLETE", 0) < after_complete or n is None:
            return False
        time.sleep(0.5)
        return running_number(db) == n
    # a loaded machine: minutes; a search that ended before a trial settled fails at once, with its output
    assert wait_for(settled_in_a_trial, timeout=900, proc=proc), proc.communicate(timeout=5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


@pytest.mark.system
def test_ctrl_c_mid_trial_then_resume_ends_with_exactly_the_asked_trials(tmp_path, data_dir):
    f = write_study(tmp_path, steps=300, slow=True)  # with the delay, trials of 3 s: the signal lands inside one
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    slow = tmp_path / "slow"
    proc = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "5", "--no-prune", "--sampler", "random", cwd=tmp_path,
               data_dir=data_dir, wait=False, env_extra=SLOW | {"SLOWMLP_WHILE": str(slow)})
    rc, out, err = interrupt_mid_trial(proc, db, after_complete=2, slow_file=slow)
    assert rc == 130 and "run the same command again to resume" in err
    st = states(db)
    assert st.get("RUNNING", 0) == 0 and st["FAIL"] == 1 and st["COMPLETE"] >= 2
    # the stopped search's MLflow run holds its best so far (it held none until a resumed search ended)
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'mlflow.db'}")
    (parent,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                   filter_string="attributes.run_name LIKE 'search-%'")
    with sqlite3.connect(db) as c:
        values = dict(c.execute("select t.number, v.value from trial_values v join trials t using (trial_id) "
                                "where t.state = 'COMPLETE'"))
    assert parent.info.status == "KILLED"
    # named by its process too (two machines' searches that started in the same second had one name)
    assert re.fullmatch(rf"search-random-\d{{8}}-\d{{6}}-{proc.pid}", parent.info.run_name), parent.info.run_name
    assert values[int(parent.data.tags["evomerge.best_trial"])] == max(values.values())  # (the first of equals)
    assert parent.data.metrics["final_val_accuracy"] == pytest.approx(max(values.values()))
    assert "evomerge.model_pending" in parent.data.tags and not parent.outputs.model_outputs
    # ended there (--n-trials as many as completed): the run is taken up again and gets its model (it kept the best's
    # tag, which read as "held already", and the model was never logged)
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", str(len(values)), "--sampler", "random",
            "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    again = client.get_run(parent.info.run_id)
    assert "evomerge.model_pending" not in again.data.tags and len(again.outputs.model_outputs) == 1
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "5", "--no-prune", "--sampler", "random", "--quiet", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    st = states(db)
    assert st["COMPLETE"] == 5 and st["FAIL"] == 1 and "RUNNING" not in st
    with sqlite3.connect(db) as c:
        numbers = [n for (n,) in c.execute("select number from trials")]
    assert len(numbers) == len(set(numbers)) == 6


@pytest.mark.system
@pytest.mark.timeout(900)  # several searches in processes: 1.5-4 min on 2 busy cores
def test_cmaes_resumes_from_its_state_not_from_scratch(tmp_path, data_dir):
    # the interrupted search's trials last 3 s (the model's delay, 30 ms a forward): the signal lands inside one, or
    # between two (resumed the same); the others run the same arithmetic without the delay (100 steps: a third of
    # the CPU of 300 at 10 ms)
    f = write_study(tmp_path, steps=100, slow=True)
    # --no-prune: a pruned trial can end within the half second the signal waits for (it then never lands)
    # --no-verdict: the verdict judges picks and baselines on fresh seeds, a minute here, and says nothing of CMA-ES
    # the categoricals drawn too (independent, the default): each candidate's from its own place, so they resume as the
    # numbers do (from the sampler's one stream, the resumed run drew other topologies)
    args = ["search", "--no-log-model", "--study", str(f), "--sampler", "cmaes", "--cmaes-popsize", "3",
            "--n-trials", "7", "--seed", "4", "--no-prune", "--no-verdict"]
    a = cli(*args, "--runs-dir", "runs-a", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert a.returncode == 0, a.stderr
    db_b = tmp_path / "runs-b" / "tiny" / "optuna.db"
    slow = tmp_path / "slow"
    proc = cli(*args, "--runs-dir", "runs-b", cwd=tmp_path, data_dir=data_dir, wait=False,
               env_extra={"SLOWMLP_DELAY": "0.03", "SLOWMLP_WHILE": str(slow)})
    rc, _, _ = interrupt_mid_trial(proc, db_b, after_complete=4, slow_file=slow)  # inside the second generation
    assert rc == 130
    b = cli(*args, "--runs-dir", "runs-b", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert b.returncode == 0, b.stderr
    pa, pb = _cma_points(tmp_path / "runs-a" / "tiny" / "optuna.db"), _cma_points(db_b)
    assert len(pa) == len(pb) == 7
    assert pa == pb  # the third generation was proposed from the told state, as if never interrupted


@pytest.mark.system
@pytest.mark.parametrize("flags", [["--sampler", "random"], ["--sampler", "tpe", "--batch", "3"]])
def test_parallel_jobs_share_one_sqlite_study(tmp_path, data_dir, flags):
    """Two processes on one SQLite study; with TPE's batches each asks against its copy of the study, which must
    take in the other process's trials (search/asking.py)."""
    import optuna

    f = write_study(tmp_path, steps=60)
    n = 8 if "--batch" not in flags else 16
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", str(n), "--jobs", "2", *flags, "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "database is locked" not in p.stderr + p.stdout
    st = states(tmp_path / "runs" / "tiny" / "optuna.db")
    assert st.get("COMPLETE", 0) + st.get("PRUNED", 0) == n and set(st) <= {"COMPLETE", "PRUNED"}
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'optuna.db'}").trials
    assert len({tuple(sorted(t.params.items())) for t in trials}) == n and {len(t.params) for t in trials} == {3}
    assert len({t.user_attrs["worker"] for t in trials}) == 2




@pytest.mark.system
def test_sigterm_stops_parallel_jobs_keeps_finished_trials_and_leaves_no_worker(tmp_path, data_dir):
    from procutil import children, in_group, wait_gone

    f = write_study(tmp_path, steps=300, slow=True)  # with the delay, trials of 12 s: the signal lands inside both
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    proc = cli("search", "--no-log-model", "--no-verdict", "--study", str(f), "--n-trials", "6", "--jobs", "2", "--no-prune", "--sampler", "random",
               "--quiet", cwd=tmp_path, data_dir=data_dir, wait=False, env_extra={"SLOWMLP_DELAY": "0.04"})
    try:
        assert wait_for(lambda: running(db) == 2, timeout=900, proc=proc), proc.communicate(timeout=5)
        time.sleep(1.0)
        workers = [p for p in children(proc.pid) if in_group(p) and p in in_group(p)]  # each leads its own group
        members = [m for w in workers for m in in_group(w)]
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "run the same command again to resume" in err
    assert wait_gone(members, timeout=30) == []
    st = states(db)
    assert "RUNNING" not in st and st["FAIL"] == 2  # both running trials failed as interrupted, the rest kept
    with sqlite3.connect(db) as c:
        failures = [json.loads(v) for (v,) in c.execute("select value_json from trial_user_attributes where key = 'failure'")]
    assert failures == ["interrupted", "interrupted"]


def _ctrl_c_once(proc, ready, timeout: float) -> tuple[str, str]:
    """Ctrl-C ``proc`` the moment ``ready()`` holds; its output. Killed, whatever failed, if it is still running."""
    try:
        assert wait_for(ready, timeout=timeout, proc=proc, every=0.02), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.system
def test_ctrl_c_before_the_first_trial_says_how_to_start_again(tmp_path, data_dir):
    """Ctrl-C while the command still loads (torch imported; MLflow, the data and the stores to come): one line that
    says no trial ran and how to start, exit status 130, no traceback."""
    f = write_study(tmp_path)
    proc = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "2", cwd=tmp_path, data_dir=data_dir,
               wait=False)

    def torch_loaded():
        try:
            with open(f"/proc/{proc.pid}/maps") as fh:
                return "libtorch_cpu" in fh.read()
        except OSError:
            return False
    out, err = _ctrl_c_once(proc, torch_loaded, timeout=300)
    assert proc.returncode == 130, err
    assert err == "interrupted before the first trial; run the same command again to start the search\n", err
    assert "trial" not in out


@pytest.mark.system
def test_ctrl_c_while_parallel_jobs_start_ends_quietly_and_leaves_no_worker(tmp_path, data_dir):
    """Ctrl-C the moment the --jobs workers exist, while they are still importing (the study, torch): the command
    ends with the interrupted line and 130, no worker prints a traceback, and none is left running."""
    from procutil import children, wait_gone

    f = write_study(tmp_path)
    proc = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "4", "--jobs", "2", "--quiet",
               cwd=tmp_path, data_dir=data_dir, wait=False)

    def workers():  # spawned workers (multiprocessing's resource tracker is a child too)
        out = []
        for pid in children(proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if b"spawn_main" in fh.read():
                        out.append(pid)
            except OSError:
                pass
        return out
    started = []

    def two_workers():
        started[:] = workers()
        return len(started) == 2
    _, err = _ctrl_c_once(proc, two_workers, timeout=600)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "run the same command again to resume" in err
    assert wait_gone(started, timeout=30) == []


@pytest.mark.integration
def test_a_resumed_searchs_bar_starts_from_the_studys_best(tmp_path, data_dir):
    """(A resumed search's bar said "best 10.0000", its new trials' best, where the study's was 6.4615.)"""
    from evomerge.report.search_view import SearchView
    from evomerge.search.config import make_config
    from evomerge.search.loop import run_search

    s = study.load(write_study(tmp_path))
    first = run_search(make_config(s, n_trials=2, sampler="random", runs_dir=tmp_path / "runs", verdict=False,
                                   data_dir=data_dir))
    best = first.best[0]["values"][0]
    cfg = make_config(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", verdict=False, seed=1,
                      data_dir=data_dir)
    view = SearchView(cfg, quiet=True)
    seen = []

    def progress(kind, **info):
        view.event(kind, **info)
        seen.append((kind, view.best))

    run_search(cfg, progress=progress)
    assert seen[0] == ("start", best)  # the study's best before this search's first trial
    assert all(b is not None and b >= best for _, b in seen)  # never below the study's best (accuracy: maximised)


@pytest.mark.system
def test_a_trial_left_running_with_no_heartbeat_is_failed_and_asked_again(tmp_path, data_dir):
    """(A search killed between Optuna's ask and the trial's first heartbeat left a RUNNING trial with neither
    heartbeat nor process; Optuna never fails such a trial, and a search whose last trial it was slept for ever.) Long
    after it was asked, it is failed and its policy asked again."""
    import datetime

    import optuna
    from optuna.trial import FrozenTrial, TrialState

    f = write_study(tmp_path)
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    args = ["search", "--no-log-model", "--no-verdict", "--study", str(f), "--sampler", "random", "--quiet"]
    assert cli(*args, "--n-trials", "1", cwd=tmp_path, data_dir=data_dir).returncode == 0
    st = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}")
    asked = datetime.datetime.now() - datetime.timedelta(minutes=5)
    st._storage.create_new_trial(st._study_id, template_trial=FrozenTrial(
        number=-1, state=TrialState.RUNNING, value=None, datetime_start=asked, datetime_complete=None, params={},
        distributions={}, user_attrs={}, system_attrs={}, intermediate_values={}, trial_id=-1))
    proc = cli(*args, "--n-trials", "2", cwd=tmp_path, data_dir=data_dir, wait=False)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert [(t.state.name, t.user_attrs.get("failure"), t.user_attrs.get("retry_of")) for t in trials] == [
        ("COMPLETE", None, None), ("FAIL", "its process never started it", None), ("COMPLETE", None, 1)]


def _has_process(db) -> bool:
    try:
        with sqlite3.connect(db) as c:
            return c.execute("select count(*) from trial_user_attributes where key = 'process'").fetchone()[0] > 0
    except sqlite3.Error:
        return False


@pytest.mark.system
def test_a_killed_searchs_mlflow_run_is_marked_killed_by_the_next_search(tmp_path, data_dir):
    """kill -9 gives a search no chance to end its MLflow parent run: it said RUNNING for ever in the MLflow UI.
    The next search on this host marks it KILLED (and says why in a tag); a search still running is left alone."""
    import mlflow

    f = write_study(tmp_path, steps=300, slow=True)
    db = tmp_path / "runs" / "tiny" / "optuna.db"
    proc = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--quiet",
               cwd=tmp_path, data_dir=data_dir, wait=False, env_extra={"SLOWMLP_DELAY": "0.04"})
    try:
        # running, and past its start (its heartbeat and its process recorded: killed between Optuna's ask and
        # those, a trial has neither, and nothing can tell it from a live one)
        assert wait_for(lambda: running(db) == 1 and _has_process(db), timeout=600, proc=proc), \
            proc.communicate(timeout=5)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny").experiment_id
    (killed,) = client.search_runs([exp])
    assert killed.info.status == "RUNNING" and killed.data.tags["evomerge.pid"] == str(proc.pid)
    # a search still running on this host (here: this test's own process) is not taken for a dead one, nor one of
    # another machine or container sharing the host name; a pid running again as another process is dead
    from evomerge.procs import process_tag

    mine = process_tag()
    host = {"evomerge.host": killed.data.tags["evomerge.host"], "evomerge.pid": str(os.getpid())}
    alive = client.create_run(exp, run_name="search-random-alive", tags=host | {"evomerge.process": mine})
    elsewhere = client.create_run(exp, run_name="search-random-elsewhere",
                                  tags=host | {"evomerge.process": "another-boot-id/" + mine.split("/", 1)[1]})
    reused = client.create_run(exp, run_name="search-random-reused",
                               tags=host | {"evomerge.process": mine.rsplit("/", 1)[0] + "/1"})
    # a trial's run whose search ended before its logging did (a tracking server that stopped answering between the
    # run's start and its end): left RUNNING for ever; one under a search still running is left as it is
    ended = client.create_run(exp, run_name="search-random-ended", tags=host | {"evomerge.process": mine})
    client.set_terminated(ended.info.run_id, status="FAILED")
    cut = client.create_run(exp, run_name="trial-7", tags={"mlflow.parentRunId": ended.info.run_id})
    cut_rival = client.create_run(exp, run_name="baseline-fedavg", tags={"mlflow.parentRunId": ended.info.run_id,
                                                                         "evomerge.kind": "baseline"})
    under_alive = client.create_run(exp, run_name="trial-8", tags={"mlflow.parentRunId": alive.info.run_id})
    t0 = time.monotonic()
    p = cli("search", "--no-baselines", "--study", str(f), "--n-trials", "1", "--sampler", "random",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    # its trial, left RUNNING, is failed at once and its policy asked again (it waited out the 30 s grace period of
    # the heartbeats, saying nothing)
    assert (f"note: trial 0 was left running by a search process that is gone (pid {proc.pid}); failed, and its "
            "policy asked again") in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30
    import optuna

    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert [(t.state.name, t.user_attrs.get("failure"), t.user_attrs.get("retry_of")) for t in trials] == [
        ("FAIL", "its process was gone", None), ("COMPLETE", None, 0)]
    assert trials[1].params == trials[0].params
    run = client.get_run(killed.info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["evomerge.ended"] == (
        f"its process ({proc.pid} on {killed.data.tags['evomerge.host']}) was gone; marked by a later search")
    assert client.get_run(alive.info.run_id).info.status == "RUNNING"
    assert client.get_run(elsewhere.info.run_id).info.status == "RUNNING"
    assert client.get_run(reused.info.run_id).info.status == "KILLED"
    run = client.get_run(cut.info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["evomerge.ended"].startswith(
        "its search ended before this run's logging did")
    run = client.get_run(cut_rival.info.run_id)  # a baseline's run cut short the same way
    assert run.info.status == "KILLED" and run.data.tags["evomerge.ended"] == (
        "its search ended before this run's logging did (the next search logs this baseline again); marked by a "
        "later search")
    assert client.get_run(under_alive.info.run_id).info.status == "RUNNING"
    # --no-baselines: no baseline run of its own, and no verdict
    assert not [r for r in client.search_runs([exp]) if r.data.tags.get("evomerge.kind") == "baseline" and
                r.info.run_id != cut_rival.info.run_id]
    assert "verdict" not in p.stdout and "baselines:" not in p.stderr, p.stdout
    parents = [r for r in client.search_runs([exp]) if r.info.run_name.startswith("search-random-2")]
    assert [r.info.status for r in parents if r.info.run_id != killed.info.run_id] == ["FINISHED"]


@pytest.mark.integration
def test_the_runs_at_a_searchs_end_are_counted_on_its_bar(tmp_path, data_dir, capsys):
    """(A 6-trial search of tiny-lm spent 26 of its 31 minutes on the verdict's runs and the table's baselines after
    its bar stood at 6/6, with no word of how many or how long.) Each phase announces its runs, is told each one, and
    its bar ends full; a search with every run kept announces none."""
    from evomerge.report.search_view import SearchView
    from evomerge.search.config import make_config
    from evomerge.search.loop import run_search

    s = study.load(write_study(tmp_path, seeds=(0, 1)))
    cfg = make_config(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", reevaluate=2, data_dir=data_dir)
    events = []
    with SearchView(cfg) as view:
        def progress(kind, **info):
            view.event(kind, **info)
            events.append((kind, info.get("what"), info.get("runs")))

        res = run_search(cfg, progress=progress)
        tasks = {t.description: t for t in view.bar.tasks}
    phases = [(what, runs) for kind, what, runs in events if kind == "runs"]
    ran = {}
    current = None
    for kind, what, _ in events:
        current = what if kind == "runs" else current
        if kind == "ran":
            ran[current] = ran.get(current, 0) + 1
    picks = len({c["pick"] for c in res.verdict["comparisons"]})
    assert picks >= 1
    # the picks and the baselines, each on the 2 fresh seeds
    assert sum(r for w, r in phases if w == "judging") == ran["judging"] == 2 * (picks + len(s.baselines)), phases
    assert sum(r for w, r in phases if w == "baselines") == ran["baselines"] == len(s.baselines) * 2
    for what in ("judging", "baselines"):
        assert tasks[what].completed == tasks[what].total == ran[what]
    # not a terminal (a log): the bars show at the end only, so the verdict's counts are said as they come
    judging = [r for w, r in phases if w == "judging"]
    said = [ln for ln in capsys.readouterr().err.splitlines() if re.match(r"judging: \d", ln)]
    # each count says what it is of (a new user's log read "6 runs to make", "12 more", "12 more")
    parts = ["the picks", "the baselines"]
    assert said == [f"judging: {r}{' more' if k else ''} run{'s' * (r != 1)} to make ({parts[k]}), each about as long "
                    "as one seed of a trial" for k, r in enumerate(judging)], said
    # the same search again: every run kept, none announced
    again = []
    run_search(make_config(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", reevaluate=2,
                           data_dir=data_dir), progress=lambda kind, **info: again.append(kind))
    assert "runs" not in again and "ran" not in again


def test_the_time_left_reads_as_a_person_says_it():
    from evomerge.report.search_view import _duration

    assert [_duration(s) for s in (45, 100, 3000, 5400, 7190, 7300)] == \
        ["45 s", "2 min", "50 min", "1 h 30 min", "2 h 0 min", "2 h 2 min"]  # (7190 s read "1 h 60 min")


def test_a_ctrl_c_after_the_study_was_told_keeps_the_trial_complete_in_its_record(tmp_path):
    """(Under --jobs 2 a Ctrl-C came between a trial's `tell` and its record's update: the study held it COMPLETE,
    MLflow logged it as interrupted, KILLED, with its final metrics.) The record keeps what the study holds; a trial
    still running fails as interrupted."""
    from types import SimpleNamespace

    import optuna

    from evomerge.report.tracking import trial_status
    from evomerge.search.trial import TrialRun

    ostudy = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}", study_name="s",
                                 directions=["maximize"])
    cfg = SimpleNamespace(study=SimpleNamespace(name="s", run=SimpleNamespace(seeds=[0])), sampler="tpe")
    told, running_ = ostudy.ask(), ostudy.ask()
    runs = [TrialRun(t, ostudy, SimpleNamespace(total_steps=10), cfg, None) for t in (told, running_)]
    ostudy.tell(told, [0.9])  # as TrialRun.complete tells it, before its record says so
    for r in runs:
        r.interrupted()
    assert runs[0].record["state"] == "COMPLETE" and runs[0].record["values"] == [0.9]
    assert trial_status(runs[0].record)[0] != "interrupted"
    assert runs[1].record["state"] == "FAIL" and trial_status(runs[1].record) == ("interrupted", "KILLED")
    states_ = {t.number: t.state.name for t in ostudy.get_trials()}
    assert states_ == {0: "COMPLETE", 1: "FAIL"}
    assert ostudy.get_trials()[1].user_attrs["failure"] == "interrupted"


@pytest.mark.unit
def test_a_pareto_trial_that_a_baseline_in_the_table_dominates_is_said_to_be():
    """(A new user asked why a trial that no-merging beat on loss and bytes was listed as Pareto-optimal.)"""
    from evomerge import study
    from evomerge.report.search_view import dominated_line

    s = study.load("mnist-gossip")  # val_accuracy (max), bytes (min)
    best = [{"number": 2, "values": [0.80, 3.7e6]}, {"number": 5, "values": [0.95, 9e7]}]
    bases = [{"name": "no-merging", "values": [0.85, 0]}, {"name": "fedavg", "values": [0.90, 5e7]},
             {"name": "allreduce", "values": [0.99, 1e6], "run_status": "diverged"}]
    assert dominated_line(s, best, bases) == (
        "note: a baseline in the table does as well on every objective and better on one: trial 2 by no-merging "
        "(the Pareto set is of the trials alone)")
    assert dominated_line(s, best[1:], bases) == ""  # better on accuracy than each: no note
    assert dominated_line(s, [{"number": 2, "values": [0.85, 0]}], bases[:1]) == ""  # the same values: not beaten
    assert dominated_line(study.load("mnist-skewed"), [{"number": 1, "values": [0.5]}], [
        {"name": "fedavg", "values": [0.9]}]) == ""  # one objective: the verdict says it
