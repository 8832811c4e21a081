"""MLflow tracking against a real `mlflow server` on 127.0.0.1, read back through the MLflow client."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import evomerge
from conftest import write_study
from evomerge import study


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(url, proc, timeout=150):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        if healthy(url):
            return
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout} s")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}"],
                            cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)
    assert proc.poll() is not None


@pytest.mark.slow
def test_search_logs_parent_and_nested_runs_to_a_real_server(tmp_path, data_dir, mlflow_server):
    from mlflow import MlflowClient

    s = study.load(write_study(tmp_path, seeds=(0, 1)))
    res = evomerge.search(s, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", tracking_uri=mlflow_server,
                          data_dir=data_dir, prune=False)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == res.parent_run_id]
    assert [p.info.run_id for p in parents] == [res.parent_run_id]
    assert parents[0].data.params["sampler"] == "random" and parents[0].info.status == "FINISHED"
    assert sorted(int(c.data.tags["optuna.trial_number"]) for c in children) == [0, 1, 2]
    for c in children:
        assert c.data.tags["optuna.trial_state"] == "COMPLETE" and c.info.status == "FINISHED"
        assert c.data.params["topology"] in ("ring", "complete") and c.data.params["seeds"] == "0,1"
        hist = client.get_metric_history(c.info.run_id, "val_accuracy")
        # 3 rounds per seed, seed k logged at k * total_steps + step (total_steps = 30)
        assert sorted(m.step for m in hist) == [10, 20, 30, 40, 50, 60]
        assert 0 < c.data.metrics["final_val_accuracy"] <= 1 and "final_val_accuracy_std" in c.data.metrics
        local = client.download_artifacts(c.info.run_id, "policy.json", str(tmp_path))
        policy = json.loads(open(local).read())
        assert policy["topology"] == c.data.params["topology"]
        number = int(c.data.tags["optuna.trial_number"])
        rec = next(r for r in res.records if r["number"] == number)
        assert c.data.metrics["final_val_accuracy"] == pytest.approx(rec["values"][0])


@pytest.mark.slow
def test_evomerge_ui_serves_the_study_store_and_stops_on_ctrl_c(tmp_path, data_dir):
    f = write_study(tmp_path)
    evomerge.search(study.load(f), n_trials=1, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "ui", "--study", str(f), "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        req = urllib.request.Request(url + "/api/2.0/mlflow/experiments/search", method="POST",
                                     data=json.dumps({"max_results": 10}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            names = [e["name"] for e in json.loads(r.read())["experiments"]]
        assert "tiny" in names
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "MLflow UI stopped" in err and f"http://127.0.0.1:{port}" in out
        assert not healthy(url)
    finally:
        stop(proc)
