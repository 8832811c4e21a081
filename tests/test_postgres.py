"""Several `evomerge search` processes on one PostgreSQL study, one killed with SIGKILL mid-trial."""

import json
import re
import socket
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import write_study


def trials(url):
    import sqlalchemy

    eng = sqlalchemy.create_engine(url + "/optuna", poolclass=sqlalchemy.pool.NullPool)
    try:  # one snapshot: a trial created between two reads would otherwise have attributes but no row
        with eng.connect().execution_options(isolation_level="REPEATABLE READ") as c, c.begin():
            rows = c.execute(sqlalchemy.text("select trial_id, number, state from trials")).fetchall()
            attrs = c.execute(sqlalchemy.text("select trial_id, key, value_json from trial_user_attributes")).fetchall()
            params = c.execute(sqlalchemy.text("select trial_id, param_name, param_value from trial_params")).fetchall()
    except sqlalchemy.exc.ProgrammingError:
        return []  # tables not created yet
    finally:
        eng.dispose()
    out = {tid: {"number": n, "state": st, "attrs": {}, "params": {}} for tid, n, st in rows}
    for tid, k, v in attrs:
        out[tid]["attrs"][k] = json.loads(v)
    for tid, k, v in params:
        out[tid]["params"][k] = v
    return list(out.values())


@pytest.mark.system
def test_three_search_processes_one_killed_end_with_exactly_the_asked_trials(tmp_path, data_dir, postgres_url):
    # trials of 3 s (the model sleeps 10 ms a forward, tests/slowmlp.py): the kill lands well inside one, and three
    # processes share two cores for little CPU
    f = write_study(tmp_path, steps=300, slow=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"EVOMERGE_DATA_DIR": str(data_dir),
                                                                                "SLOWMLP_DELAY": "0.01"}
    procs = []
    for i in range(3):  # separate runs folders, as on separate machines: only the database is shared
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "evomerge.cli", "search", "--study", str(f), "--storage", postgres_url + "/optuna",
             "--tracking-uri", postgres_url + "/mlflow", "--runs-dir", f"runs-{i}", "--n-trials", "4", "--no-prune",
             "--sampler", "random", "--seed", str(i), "--grace-period", "5", "--no-verdict", "--quiet"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    victim = procs[0]
    try:
        deadline, killed = time.time() + 240, None
        while time.time() < deadline and killed is None and victim.poll() is None:
            for t in trials(postgres_url):
                if t["state"] == "RUNNING" and t["attrs"].get("worker", "").endswith(f":{victim.pid}"):
                    time.sleep(0.5)  # well inside the trial
                    victim.send_signal(signal.SIGKILL)
                    killed = t
                    break
            time.sleep(0.2)
        assert killed is not None, f"the first process never ran a trial: {victim.communicate(timeout=30)[1][-2000:]}"
        victim.wait(timeout=30)
        outs = [p.communicate(timeout=300) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs[1:], outs):
        assert p.returncode == 0, err
        assert "database is locked" not in err
    final = trials(postgres_url)
    states = [t["state"] for t in final]
    assert states.count("COMPLETE") == 4
    numbers = [t["number"] for t in final]
    assert len(numbers) == len(set(numbers))
    dead = next(t for t in final if t["number"] == killed["number"])
    assert dead["state"] == "FAIL"
    retries = [t for t in final if t["attrs"].get("retry_of") == killed["number"]]
    assert len(retries) == 1 and retries[0]["state"] == "COMPLETE" and retries[0]["params"] == dead["params"]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=postgres_url + "/mlflow")
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags}
    nested = [r for r in runs if "mlflow.parentRunId" in r.data.tags and r.data.tags.get("evomerge.kind") != "baseline"]
    assert len(parents) == 3  # one per process, all in the study's one experiment
    # the study's baselines logged once, by one of the processes that ended the search together
    rivals = sorted(r.info.run_name for r in runs if r.data.tags.get("evomerge.kind") == "baseline")
    assert rivals == ["baseline-no-merging", "baseline-ring-gossip"]
    complete = [r for r in nested if r.data.tags["optuna.trial_state"] == "COMPLETE"]
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in complete) == sorted(
        t["number"] for t in final if t["state"] == "COMPLETE")
    assert len({r.data.tags["mlflow.parentRunId"] for r in complete}) == 2  # both survivors ran trials
    # the best trial's consensus model logged once, however many processes ended the search (two ending together
    # each logged one)
    models = client.search_logged_models([exp.experiment_id], filter_string="model_type = 'consensus'")
    assert len(models) == 1, [m.name for m in models]


@pytest.mark.system
def test_a_database_that_is_not_there_is_one_line_in_seconds(tmp_path, data_dir, postgres_url):
    """A PostgreSQL server that is up but lacks the database, and one that is not listening: `search` ends in
    one line naming --tracking-uri (or --storage) before any trial or store, not after MLflow's minutes of connection
    retries (or Optuna's table-making retried)."""
    from searchutil import cli

    f = write_study(tmp_path)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on (kept bound so no other test takes it meanwhile)
    try:
        for uri, why in ((postgres_url + "/nosuchdb", 'database "nosuchdb" does not exist'),
                         (f"postgresql://postgres@127.0.0.1:{closed.getsockname()[1]}/mlflow", "Connection refused")):
            t0 = time.time()
            p = cli("search", "--study", f, "--tracking-uri", uri, "--n-trials", "1", "--no-verdict", "--quiet",
                    cwd=tmp_path, data_dir=data_dir)
            assert time.time() - t0 < 60
            assert p.returncode == 2, p.stderr
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: --tracking-uri: cannot reach the database at ")
            assert why in lines[0]
            assert not (tmp_path / "runs").exists()  # nothing stored before the check
            # the same address as the trials' store: one line naming --storage, in seconds (not retried as a race of
            # two processes making the tables would be), and no runs folder left behind
            t0 = time.time()
            p = cli("search", "--study", f, "--storage", uri, "--n-trials", "1", "--no-verdict", "--quiet",
                    cwd=tmp_path, data_dir=data_dir)
            assert time.time() - t0 < 30 and p.returncode == 2, p.stderr
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: --storage: cannot reach the database at ")
            assert why in lines[0] and not (tmp_path / "runs").exists()
            # what to do, by the reason (a missing database was told to start it)
            assert lines[0].endswith("; create it (createdb nosuchdb) or pass another --storage" if "nosuchdb" in uri
                                     else "; start it or pass another --storage"), lines[0]
    finally:
        closed.close()


@pytest.mark.system
def test_a_password_in_the_addresses_is_never_shown(tmp_path, data_dir, postgres_url):
    """Stores given with a password (the test server trusts any): the search's screen, its MLflow parameters and
    `status` show `***` where the password was."""
    from mlflow import MlflowClient

    from searchutil import cli

    with_pw = postgres_url.replace("postgres@", "postgres:hunter2@")
    storage, tracking = with_pw + "/optuna", with_pw + "/mlflow"
    f = write_study(tmp_path, name="pw")
    p = cli("search", "--study", f, "--storage", storage, "--tracking-uri", tracking, "--n-trials", "1",
            "--no-verdict", "--no-prune", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "hunter2" not in p.stdout + p.stderr and "postgres:***@" in p.stdout + p.stderr
    # its next: line says which store (it said `--storage ...`: not which host, nor which database)
    (nxt,) = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    assert f"--storage '{storage.replace('hunter2', '***')}' -o best.json" in nxt, nxt
    runs = MlflowClient(tracking_uri=tracking).search_runs(
        [MlflowClient(tracking_uri=tracking).get_experiment_by_name("pw").experiment_id])
    parent = [r for r in runs if "storage" in r.data.params]
    assert parent and all("hunter2" not in r.data.params["storage"] for r in parent)
    p = cli("status", "--study", f, "--storage", storage, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "hunter2" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "postgres:***@" in p.stdout
    p = cli("status", "--study", f, "--storage", storage, "--tracking-uri", tracking, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and "hunter2" not in p.stderr and "--tracking-uri postgresql+psycopg://postgres:***@" in p.stderr
    # a misspelt name lists the studies that storage holds (it listed the runs folder's: "stored in runs: none")
    p = cli("status", "--study", "pww", "--storage", storage, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and "hunter2" not in p.stderr, p.stderr
    assert re.search(r"unknown study 'pww'; .*; stored in postgresql\S*://postgres:\*\*\*@\S+/optuna: (\S+, )*pw\b.*"
                     r"did you mean pw\?", p.stderr), p.stderr


RACE = """
import os, sys, time
from evomerge.report.tracking import Tracker
from evomerge.search.storage import retry_setup
uri, ready, go = sys.argv[1:]
retry_setup(lambda: Tracker(uri, f"warm-{os.getpid()}"))  # MLflow's lazy imports and first connection: before the races
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
start = float(open(go).read())
for i in range(20):
    while time.time() < start + 0.4 * i:
        time.sleep(0.0005)
    print(retry_setup(lambda: Tracker(uri, f"race-{i}")).experiment_id, flush=True)  # as the search makes it
"""


@pytest.mark.system
def test_two_machines_that_start_a_study_at_the_same_moment_share_one_experiment(tmp_path, postgres_url):
    """Two searches of a new study on one tracking database, started together: both looked for the experiment, found
    none, and made it; the second ended in a 105-line traceback (MlflowException: ... already exists). Twenty races,
    each at a moment both processes wait for: both use the one experiment."""
    uri = postgres_url + "/mlflow"
    ready = [tmp_path / f"ready-{k}" for k in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", RACE, uri, str(ready[k]), str(tmp_path / "go")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    deadline = time.time() + 120
    while not all(r.exists() for r in ready) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    (tmp_path / "go.tmp").write_text(repr(time.time() + 0.5))  # both have imported MLflow and connected: the start
    (tmp_path / "go.tmp").rename(tmp_path / "go")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    ids = [o.split() for o, _ in outs]
    assert ids[0] == ids[1] and len(set(ids[0])) == 20, ids


@pytest.mark.system
def test_a_database_stopped_under_a_search_ends_it_in_one_line(tmp_path, data_dir):
    """An administrator stops the study's PostgreSQL server while a search runs: the search ended in 282 lines of
    traceback whose last blamed "invalid data in the commit". Now one line with the driver's words, exit status 1,
    and the trial that finished before is stored."""
    from conftest import postgres_cluster

    f = write_study(tmp_path, steps=300, slow=True)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"EVOMERGE_DATA_DIR": str(data_dir),
                                                                                "SLOWMLP_DELAY": "0.01"}
    with postgres_cluster() as (url, stop):
        p = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "search", "--study", str(f), "--storage",
                              url + "/optuna", "--n-trials", "6", "--no-prune", "--sampler", "random", "--no-verdict",
                              "--quiet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and p.poll() is None and not any(
                    t["state"] == "COMPLETE" for t in trials(url)):
                time.sleep(0.3)
            done = [t["number"] for t in trials(url) if t["state"] == "COMPLETE"]
            assert done, p.communicate(timeout=30)[1][-2000:]
            stop("fast")
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 1 and "Traceback" not in err and lines[-1].startswith("error:"), err[-3000:]
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], lines  # the search's header, then one line
    assert lines[-1].startswith("error: the database connection failed (") and lines[-1].endswith(
        "); what finished before it is stored: run the same command again once the database answers"), lines


@pytest.mark.system
def test_a_search_whose_stores_are_both_servers_leaves_no_runs_folder(tmp_path, data_dir, postgres_url):
    """(An empty runs/STUDY/ folder appeared in the folder a search ran from, its stores a PostgreSQL database and
    an MLflow server.) Nothing of it is kept on this machine."""
    from searchutil import cli
    from test_tracking import start_server, stop

    d = tmp_path / "server"
    d.mkdir()
    server, url = start_server(d)
    try:
        work = tmp_path / "work"
        f = write_study(work, name="servers")
        p = cli("search", "--study", str(f), "--storage", postgres_url + "/optuna", "--tracking-uri", url,
                "--n-trials", "1", "--no-verdict", cwd=work, data_dir=data_dir)
        assert p.returncode == 0, p.stderr
    finally:
        stop(server)
    assert not (work / "runs").exists(), sorted(str(x) for x in (work / "runs").rglob("*"))
