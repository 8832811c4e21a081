"""MLflow tracking against a real `mlflow server` on 127.0.0.1, read back through the MLflow client."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import evomerge
from conftest import ROOT, free_port, write_study
from evomerge import study


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


def start_server(d) -> tuple[subprocess.Popen, str]:
    """A real `mlflow server` on 127.0.0.1 and a free port, its store a SQLite file in ``d``: the process (stopped
    by :func:`stop`) and its address, once it answers."""
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}"],
                            cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    proc, url = start_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield url
    finally:
        stop(proc)
    assert proc.poll() is not None


@pytest.mark.parametrize("rounds", [3, 80])
def test_a_trial_run_holds_every_round_param_and_final_value(tmp_path, rounds):
    """A trial's run in a real local MLflow store: its params, each round's metrics and its final values, written
    in one batch where MLflow's limits allow (3 rounds) and in several where they do not (80 rounds x 14 metrics)."""
    from mlflow import MlflowClient

    from evomerge.report.tracking import ROUND_METRICS, Tracker, default_tracking_uri

    s = study.load(write_study(tmp_path, name="marks"))
    uri = default_tracking_uri(tmp_path)
    tracker = Tracker(uri, "marks", tmp_path / "art", study=s)
    tracker.start_parent("search", {}, {})
    keys = ROUND_METRICS[:14]
    history = [{"step": 10 * (r + 1), **{k: 0.5 + r / 1000 + i / 100 for i, k in enumerate(keys)}} for r in range(rounds)]
    # (a count of bytes was rounded to 7 digits: 924885760 read 924885800, beside the last round's exact value)
    rid = tracker.log_trial(_record(0, "COMPLETE", histories=[history], final={"val_accuracy": 0.8125, "bytes": 924885760},
                                    run_status="ok", policy={"topology": "ring", "mixing_weight": 0.25},
                                    run={"lr": 0.1}))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(rid)
    assert run.data.params == {"topology": "ring", "mixing_weight": "0.25", "run.lr": "0.1", "seeds": "0"}
    assert run.data.metrics["final_val_accuracy"] == 0.8125 and run.data.metrics["final_bytes"] == 924885760
    for i, k in enumerate(keys):
        h = sorted((m.step, m.value) for m in client.get_metric_history(rid, k))
        assert h == [(10 * (r + 1), pytest.approx(0.5 + r / 1000 + i / 100)) for r in range(rounds)]
    assert run.info.status == "FINISHED"


@pytest.mark.xdist_group("tracking-mlflow-server")  # one worker computes the module fixture they share
@pytest.mark.system
def test_search_logs_parent_and_nested_runs_to_a_real_server(tmp_path, data_dir, mlflow_server):
    from mlflow import MlflowClient

    from evomerge.policy import MergePolicy

    s = study.load(write_study(tmp_path, seeds=(0, 1)))
    res = evomerge.search(s, verdict=False, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", tracking_uri=mlflow_server,
                          data_dir=data_dir, prune=False)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == res.parent_run_id]
    children = [r for r in nested if r.data.tags.get("evomerge.kind") != "baseline"]
    assert [p.info.run_id for p in parents] == [res.parent_run_id]
    assert parents[0].data.params["sampler"] == "random" and parents[0].info.status == "FINISHED"
    assert parents[0].data.params["pruner"] == "none"  # --no-prune
    # the study's baselines beside the trials: the end screen's rows, under the trial runs' metric names
    baselines = {r.data.tags["evomerge.baseline"]: r for r in nested if r.data.tags.get("evomerge.kind") == "baseline"}
    assert sorted(baselines) == ["no-merging", "ring-gossip"] == sorted(b["name"] for b in res.baselines)
    for row in res.baselines:
        b = baselines[row["name"]]
        assert b.info.run_name == f"baseline-{row['name']}" and b.info.status == "FINISHED"
        assert b.data.metrics["final_val_accuracy"] == pytest.approx(row["val_accuracy"], rel=1e-6)
        assert b.data.metrics["final_val_accuracy"] == pytest.approx(row["values"][0], rel=1e-6)
        assert b.data.metrics["final_bytes"] == row["bytes"] and "final_val_accuracy_std" in b.data.metrics
        assert b.data.params["run.lr"] == str(s.run.lr) and b.data.params["seeds"] == "0,1"
        assert b.data.params["scheme"] == row["policy"]["scheme"]
        # the policy in words: which of its params take effect
        assert b.data.tags["evomerge.policy"] == MergePolicy.from_dict(row["policy"]).describe()
        # the first seed's rounds, at their local steps, as the trial runs log theirs
        assert [m.step for m in sorted(client.get_metric_history(b.info.run_id, "val_accuracy"), key=lambda m: m.step)] \
            == [10, 20, 30]
    assert baselines["no-merging"].data.metrics["final_bytes"] == 0
    assert baselines["no-merging"].data.tags["evomerge.policy"].startswith("no merging")
    assert baselines["ring-gossip"].data.metrics["final_bytes"] > 0
    # the same search again (nothing left to run) logs no second copy, but logs again a baseline whose run was cut
    # short (marked KILLED by a later search)
    client.set_terminated(baselines["ring-gossip"].info.run_id, status="KILLED")
    evomerge.search(s, verdict=False, n_trials=3, sampler="random", runs_dir=tmp_path / "runs",
                    tracking_uri=mlflow_server, data_dir=data_dir, prune=False)
    now = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("evomerge.kind") == "baseline"]
    assert sorted((r.info.run_name, r.info.status) for r in now) == [
        ("baseline-no-merging", "FINISHED"), ("baseline-ring-gossip", "FINISHED"), ("baseline-ring-gossip", "KILLED")]
    assert sorted(int(c.data.tags["optuna.trial_number"]) for c in children) == [0, 1, 2]
    for c in children:
        assert c.data.tags["optuna.trial_state"] == "COMPLETE" and c.info.status == "FINISHED"
        assert c.data.tags["evomerge.kind"] == "trial"  # (a filter for the trials alone: tags.`evomerge.kind` = 'trial')
        assert c.data.tags["evomerge.execution"] == "stacked (the named model)"  # how the workers' steps ran
        assert c.data.tags["evomerge.ran_on"].startswith("in process on ")  # and where their sums ran
        assert c.data.params["topology"] in ("ring", "complete") and c.data.params["seeds"] == "0,1"
        hist = client.get_metric_history(c.info.run_id, "val_accuracy")
        # 3 rounds per seed, seed k logged at k * total_steps + step (total_steps = 30)
        assert sorted(m.step for m in hist) == [10, 20, 30, 40, 50, 60]
        assert 0 < c.data.metrics["final_val_accuracy"] <= 1 and "final_val_accuracy_std" in c.data.metrics
        local = client.download_artifacts(c.info.run_id, "policy.json", str(tmp_path))
        policy = json.loads(open(local).read())
        assert policy["topology"] == c.data.params["topology"]
        assert c.data.tags["evomerge.policy"] == MergePolicy.from_dict(policy).describe()
        assert f"gossip on {policy['topology']} every" in c.data.tags["evomerge.policy"]
        number = int(c.data.tags["optuna.trial_number"])
        rec = next(r for r in res.records if r["number"] == number)
        assert c.data.metrics["final_val_accuracy"] == pytest.approx(rec["values"][0])


@pytest.mark.xdist_group("tracking-mlflow-server")  # one worker computes the module fixture they share
@pytest.mark.system
def test_a_search_on_a_tracking_server_prints_its_own_links_not_mlflows(tmp_path, data_dir, mlflow_server):
    """(With --tracking-uri http://..., every trial's end printed MLflow's own "View run ... at:" and "View
    experiment at:" lines, under --quiet too, addresses that open MLflow's GenAI view.) The search's output holds
    the addresses evomerge makes, which open the runs list."""
    from searchutil import cli

    f = write_study(tmp_path, name="links")
    p = cli("search", "--no-log-model", "--study", str(f), "--n-trials", "2", "--sampler", "random", "--no-verdict", "--tracking-uri",
            mlflow_server, cwd=tmp_path, data_dir=data_dir, process=True)
    assert p.returncode == 0, p.stderr
    assert "View run" not in p.stdout + p.stderr and "View experiment" not in p.stdout + p.stderr, p.stdout
    # its next: line's commands run as printed (export took --tracking-uri it refuses, and addresses were "...")
    import re
    import shlex

    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("next: ")]
    # (each command's words after the program, which is `python -m evomerge` where no evomerge is on the PATH)
    export, ui, _ = ((t := shlex.split(re.sub(r" \(.*\)$", "", c)))[next(i for i, w in enumerate(t) if w in
                                                                          ("export", "ui", "dashboard")):]
                     for c in line.removeprefix("next: ").split("; "))
    assert "--tracking-uri" not in export and ui[-2:] == ["--tracking-uri", mlflow_server], line
    q = cli(*export, cwd=tmp_path, data_dir=data_dir)
    assert q.returncode == 0 and (tmp_path / "best.json").is_file(), q.stderr
    q = cli(*ui, cwd=tmp_path, data_dir=data_dir)
    out = q.stdout + q.stderr
    assert q.returncode == 0 and f"{mlflow_server}/#/experiments/" in out and "workflowType=machine_learning" in out, out


@pytest.mark.system
def test_a_tracking_server_that_stops_mid_search_ends_it_in_one_line(tmp_path, data_dir):
    """(A server stopped mid-search froze the progress bar for minutes, then ended the search in 125 lines of
    MLflow's traceback.) After MLflow's own retries (here none, as MLFLOW_HTTP_REQUEST_MAX_RETRIES sets them), one
    line; the trials finished before it are in the study's Optuna store."""
    import sqlite3

    from searchutil import cli

    d = tmp_path / "server"
    d.mkdir()
    server, url = start_server(d)
    search = None
    try:
        f = write_study(tmp_path, slow=True)  # trials of seconds (each forward sleeps), cheap in CPU
        search = cli("search", "--study", str(f), "--n-trials", "30", "--sampler", "random", "--no-verdict", "--quiet",
                     "--tracking-uri", url, cwd=tmp_path, data_dir=data_dir, wait=False,
                     env_extra={"SLOWMLP_DELAY": "0.02", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                                "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"})
        db = tmp_path / "runs" / "tiny" / "optuna.db"
        deadline = time.time() + 300
        while time.time() < deadline and search.poll() is None:  # the first trial finished: the server goes
            if db.is_file():
                with contextlib.closing(sqlite3.connect(db)) as c:
                    try:
                        if c.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]:
                            break
                    except sqlite3.OperationalError:  # (its tables not made yet)
                        pass
            time.sleep(0.2)
        stop(server)
        out, err = search.communicate(timeout=300)
    finally:
        stop(server)
        if search is not None and search.poll() is None:
            search.kill()
    assert search.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: the MLflow tracking server stopped answering \(a request to {re.escape(url)}/api/\S+ "
                        r"failed: .+\); the trials finished before it are stored with the study: run the same command "
                        r"again once the server answers", last), err[-3000:]
    with contextlib.closing(sqlite3.connect(db)) as c:
        assert c.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0] >= 1


@pytest.mark.system
def test_the_dashboards_ui_command_opens_the_store_the_study_is_tracked_in(tmp_path, data_dir):
    """A study tracked with --tracking-uri in a store of the user's choosing: the page's `evomerge ui` command names
    it, and run as printed it serves the study's runs (it said `evomerge ui --study ...` alone, which opened the
    default store, empty)."""
    import html
    import re

    from searchutil import cli

    f = write_study(tmp_path)
    store = f"sqlite:///{tmp_path / 'elsewhere' / 'ml.db'}"
    p = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--no-verdict", "--quiet",
            "--tracking-uri", store, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    p = cli("dashboard", "--study", str(f), "--tracking-uri", store, "--no-baselines", "--out", "dash", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    page = html.unescape((tmp_path / "dash" / "index.html").read_text())
    command = re.search(r"open it with <code>(evomerge ui [^<]*)</code>", page)[1]
    assert command == f"evomerge ui --study {f} --tracking-uri {store}", command
    # a search without its verdict: the page says so where the verdict goes, and how to have one, which holds
    assert "No verdict yet: the search of these trials ended before it (--no-verdict, or stopped)" in page
    again = cli("search", "--study", str(f), "--n-trials", "1", "--sampler", "random", "--reevaluate", "0",
                "--tracking-uri", store, cwd=tmp_path, data_dir=data_dir)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "1 trials already finished, 1 asked: none to run" in said and "verdict: " in said, said
    # nothing ran: the verdict went to the search run that ran the trial, and no empty search run was added
    from mlflow import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    searches = [r for r in runs if r.info.run_name.startswith("search-")]
    assert len(searches) == 1 and searches[0].data.tags.get("evomerge.verdict"), [r.info.run_name for r in runs]
    assert searches[0].info.status == "FINISHED" and searches[0].data.tags["evomerge.best_trial"] == "0"
    assert [r.data.tags["mlflow.parentRunId"] for r in runs if r.info.run_name == "trial-0"] == [searches[0].info.run_id]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "evomerge.cli", *command.split()[1:], "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        assert "MLflow UI for tiny" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "note: no search" not in err, err  # the store holds the study's runs
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.system
def test_evomerge_ui_serves_the_study_store_and_stops_on_ctrl_c(tmp_path, data_dir):
    """Opened before the search, as reviewing.md suggests to watch one: the address it printed then opens the
    study's runs (it was MLflow's experiments list, whose link to the experiment a search made opened the GenAI
    view)."""
    f = write_study(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.Popen([sys.executable, "-m", "evomerge.cli", "ui", "--study", str(f), "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        line = proc.stdout.readline()  # what the command prints, the address first
        evomerge.search(study.load(f), n_trials=1, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir)
        req = urllib.request.Request(url + "/api/2.0/mlflow/experiments/search", method="POST",
                                     data=json.dumps({"max_results": 10}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            experiments = {e["name"]: e["experiment_id"] for e in json.loads(r.read())["experiments"]}
        assert "tiny" in experiments
        printed = line.split()[0]
        assert printed == (f"{url}/#/experiments/{experiments['tiny']}/runs"
                           "?workflowType=machine_learning&viewStateShareKey=evomerge"), line
        assert "MLflow UI for tiny" in line
        _open_review(printed, tmp_path)  # the printed address opens the trials table with the objective column
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "MLflow UI stopped" in err
        assert "Security middleware" not in err and "--allowed-hosts" not in err, err  # `mlflow server`'s options
        assert "note: no search of tiny is logged in this store yet" in err  # (none was when it started)
        assert not healthy(url)
    finally:
        stop(proc)


def _open_review(address: str, tmp_path) -> None:
    """Headless Chromium on ``address``: the study's trials listed with the objective's column, not the GenAI view."""
    from playwright.sync_api import sync_playwright

    from test_dashboard import ARGS, CHROMIUM

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        text, visible, _, _, _ = _read_review(browser, address, tmp_path / "ui-review.png")
        browser.close()
    assert visible, "the objective's column is not shown"
    assert "Token Usage" not in text and "Traces\n0" not in text  # not the GenAI overview


def _read_review(browser, address: str, shot) -> tuple[str, bool, dict | None, list[str], dict | None]:
    """The MLflow runs list at ``address`` as a person sees it: the page's text, whether the objective's column header
    is visible and where, the rows' texts, and where the policy-in-words column's header is (a screenshot goes to
    ``shot``)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.goto(address)
    page.wait_for_selector("text=trial-", timeout=60_000)
    page.wait_for_timeout(1500)
    page.screenshot(path=str(shot))
    text = page.inner_text("body")
    header = page.locator(".ag-header-cell", has_text="final_val_accuracy").first
    words = page.locator(".ag-header-cell", has_text="evomerge.policy").first
    return (text, header.is_visible(), header.bounding_box(), page.locator(".ag-row").all_inner_texts(),
            words.bounding_box() if words.count() else None)


def _record(number, state, **extra):
    now = time.time()
    return {"number": number, "study": "marks", "sampler": "random", "seeds": [0], "start": now, "end": now,
            "histories": [], "final": {}, "total_steps": 30, "params": {}, "policy": {"topology": "ring"}, "cma": {},
            "state": state, **extra}


def test_a_text_studys_runs_name_its_corpus_as_their_dataset(tmp_path):
    """(Every text study's runs named https://example.invalid/text as their data, with one digest for any corpus.)
    A real local MLflow store: each study's runs name its own corpus (a file:// address) and differ in digest."""
    import re
    import shutil

    from mlflow import MlflowClient

    from evomerge.report.tracking import Tracker, default_tracking_uri

    text = (ROOT / "studies" / "tiny-lm.toml").read_text()
    seen = {}
    for name in ("lm-a", "lm-b"):
        folder = tmp_path / name
        (folder / "corpus").mkdir(parents=True)
        (folder / "corpus" / "one.txt").write_text(f"def {name.replace('-', '_')}():\n    return 1\n" * 400)
        shutil.copy(ROOT / "studies" / "tinylm.py", folder)
        f = folder / f"{name}.toml"
        f.write_text(re.sub(r'(?m)^sha256 = .*\n', "", text.replace('name = "tiny-lm"', f'name = "{name}"')
                            .replace('path = "data/pystdlib/text"', 'path = "corpus"')))
        s = study.load(f)
        uri = default_tracking_uri(tmp_path / "store")
        tracker = Tracker(uri, name, tmp_path / "art", study=s)
        tracker.start_parent("search", {}, {})
        run = MlflowClient(tracking_uri=uri).get_run(tracker.log_trial(_record(0, "COMPLETE", study=name,
                                                                               final={"val_perplexity": 9.0})))
        inputs = {d.dataset.name: d.dataset for d in run.inputs.dataset_inputs}
        assert set(inputs) == {"text-training", "text-validation"}
        assert {json.loads(d.source)["url"] for d in inputs.values()} == {(folder / "corpus").resolve().as_uri()}
        seen[name] = {k: d.digest for k, d in inputs.items()}
    assert seen["lm-a"]["text-training"] != seen["lm-b"]["text-training"]


def test_pruned_failed_and_diverged_trials_are_told_apart_in_the_runs_list(tmp_path):
    """A real local MLflow store: the run status and name a person sees in the list, and the tag."""
    from mlflow import MlflowClient

    from evomerge.report.tracking import Tracker, default_tracking_uri

    s = study.load(write_study(tmp_path, name="marks"))
    uri = default_tracking_uri(tmp_path)
    tracker = Tracker(uri, "marks", tmp_path / "art", study=s)
    tracker.start_parent("search", {}, {})
    records = [_record(0, "COMPLETE", final={"val_accuracy": 0.8}, run_status="ok"),
               _record(1, "PRUNED", pruned_at=10),
               _record(2, "FAIL", failure="error", error="ValueError: boom"),
               _record(3, "COMPLETE", final={"val_accuracy": 0.0}, run_status="diverged"),
               _record(4, "COMPLETE", final={"val_accuracy": 0.0}, status="diverged"),
               _record(5, "FAIL", failure="interrupted")]
    ids = [tracker.log_trial(r) for r in records]
    client = MlflowClient(tracking_uri=uri)
    runs = [client.get_run(i) for i in ids]
    assert [r.info.run_name for r in runs] == ["trial-0", "trial-1 (pruned)", "trial-2 (failed)", "trial-3 (diverged)",
                                              "trial-4 (diverged)", "trial-5 (interrupted)"]
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED", "FAILED", "FAILED", "FAILED", "KILLED"]
    assert [r.data.tags["evomerge.status"] for r in runs] == ["complete", "pruned", "failed", "diverged", "diverged",
                                                             "interrupted"]
    assert runs[1].data.tags["evomerge.pruned_at_step"] == "10"
    # every run names the study's data (training and validation splits) and its source
    for r in runs:
        contexts = sorted(t.value for d in r.inputs.dataset_inputs for t in d.tags if t.key == "mlflow.data.context")
        assert contexts == ["training", "validation"]
        assert {d.dataset.name for d in r.inputs.dataset_inputs} == {"mnist-training", "mnist-validation"}
        assert r.data.tags["mlflow.source.name"].endswith("marks.toml")
    exp = client.get_experiment(tracker.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(exp.tags["mlflow.sharedViewState.evomerge"])
    assert view["orderByKey"] == "metrics.`final_val_accuracy`" and view["orderByAsc"] is False
    assert view["selectedColumns"][0] == "metrics.`final_val_accuracy`"
    assert "params.`mixing_weight`" in view["selectedColumns"]


@pytest.mark.xdist_group("tracking-mlflow-server")  # one worker computes the module fixture they share
@pytest.mark.system
def test_the_mlflow_ui_lists_the_trials_with_their_validation_accuracy(tmp_path, data_dir, mlflow_server):
    """The review the product promises, in headless Chromium against the real server: the study's runs list
    (not MLflow's GenAI view) shows every trial and its validation accuracy without "Show more columns"; the
    parent carries the best trial's values; the best trial's consensus model is logged and is that model."""
    import mlflow.artifacts
    import mlflow.pytorch
    import torch
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    from evomerge import data as data_mod
    from evomerge import simulate
    from evomerge.report.tracking import review_url
    from test_dashboard import ARGS, CHROMIUM

    s = study.load(write_study(tmp_path, name="review", seeds=(0,)))
    res = evomerge.search(s, verdict=False, n_trials=8, sampler="random", runs_dir=tmp_path / "runs", tracking_uri=mlflow_server,
                          data_dir=data_dir)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("review")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    parent = client.get_run(res.parent_run_id)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == res.parent_run_id and
                r.data.tags.get("evomerge.kind") != "baseline"]
    by_state = {}
    for c in children:
        by_state.setdefault(c.data.tags["optuna.trial_state"], []).append(c)
    assert len(by_state["COMPLETE"]) >= 5 and by_state.get("PRUNED"), "this seeded search prunes a trial"
    assert all(c.info.status == "KILLED" and c.info.run_name.endswith("(pruned)") for c in by_state["PRUNED"])
    best = max(by_state["COMPLETE"], key=lambda c: c.data.metrics["final_val_accuracy"])
    # the parent carries the best trial's values under the same names, and points at it
    assert parent.data.metrics["final_val_accuracy"] == pytest.approx(best.data.metrics["final_val_accuracy"])
    assert parent.data.metrics["final_bytes"] == pytest.approx(best.data.metrics["final_bytes"])
    assert parent.data.tags["evomerge.best_run_id"] == best.info.run_id
    assert parent.data.tags["evomerge.best_trial"] == best.data.tags["optuna.trial_number"]
    assert "evomerge.model_error" not in parent.data.tags
    # the consensus model: an output of the best trial's run and of the parent, beside its policy
    model_ids = [m.model_id for m in best.outputs.model_outputs]
    assert len(model_ids) == 1 and [m.model_id for m in parent.outputs.model_outputs] == model_ids
    logged = client.get_logged_model(model_ids[0])
    assert logged.status.to_int() == logged.status.READY.to_int() and logged.source_run_id == best.info.run_id
    policy = json.loads(open(client.download_artifacts(best.info.run_id, "policy.json", str(tmp_path))).read())
    assert logged.params["topology"] == policy["topology"]
    local = mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=str(tmp_path / "model"),
                                                tracking_uri=mlflow_server)
    module = mlflow.pytorch.load_model(local)
    d = s.data
    data = data_mod.load(d.dataset, data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    x = simulate.normalise(data.val_x, data.spec).reshape(-1, *data.input_shape)
    with torch.no_grad():
        acc = (module(x).argmax(-1) == data.val_y).float().mean().item()
    # the consensus of the best policy's seed-0 run is what the trial's seed-0 validation accuracy measured
    trial = next(t for t in res.optuna_study.get_trials() if t.number == int(best.data.tags["optuna.trial_number"]))
    assert acc == pytest.approx(trial.user_attrs["metrics"]["0"]["val_accuracy"], abs=1e-6)
    # kept from the trial's own run (one search process), not trained again
    assert logged.tags["evomerge.consensus_from"] == "trial run"

    # the dashboard of a study tracked on a server links its top trials to their runs, and the study to its runs list
    from evomerge.report import dashboard
    from evomerge.search.storage import default_storage

    page_path = dashboard.build(s, default_storage(tmp_path / "runs" / "review"), mlflow_server, tmp_path / "dash",
                                compute_baselines=False)
    html_text = page_path.read_text()
    best_link = f'href="{mlflow_server}/#/experiments/{exp.experiment_id}/runs/{best.info.run_id}?workflowType=machine_learning"'
    assert best_link in html_text and f'href="{review_url(mlflow_server, exp.experiment_id)}"'.replace("&", "&amp;") in html_text
    assert "evomerge ui --study" not in html_text

    # the address `evomerge ui` prints for a study tracked on a server (given with a user and password: not shown)
    from searchutil import cli

    with_user = mlflow_server.replace("http://", "http://someone:secret@")
    ui = cli("ui", "--study", str(s.path), "--runs-dir", str(tmp_path / "runs"), "--tracking-uri", with_user,
             cwd=tmp_path, data_dir=data_dir)
    assert ui.returncode == 0 and "secret" not in ui.stdout + ui.stderr and "someone" not in ui.stdout.split()[0]
    url = ui.stdout.split()[0]
    assert url == review_url(mlflow_server, exp.experiment_id)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        text, header_visible, box, cells, words_box = _read_review(browser, url, tmp_path / "mlflow-runs.png")
        run_page = browser.new_page(viewport={"width": 1600, "height": 1000})  # the dashboard's link to the best run
        run_page.goto(page_path.resolve().as_uri())
        with run_page.expect_navigation():
            run_page.click(f"a[href*='{best.info.run_id}']")
        run_page.wait_for_selector("text=Parent run", timeout=60_000)
        run_text = run_page.inner_text("body")
        browser.close()
    assert best.info.run_name in run_text and "Datasets" in run_text and "mnist-training" in run_text
    import shutil

    shutil.copy(tmp_path / "mlflow-runs.png", "/tmp/evomerge-mlflow-runs.png")  # to look at after a run
    assert "workflowType=machine_learning" in url
    assert "Token Usage" not in text and "Traces\n0" not in text  # not the GenAI overview
    assert "Show more columns" not in text or header_visible
    assert header_visible and box is not None and box["x"] + box["width"] <= 1600
    # every trial is listed (flat, not collapsed under the parent), with its validation accuracy
    for c in children:
        assert c.info.run_name in text
    shown = " ".join(cells)
    assert str(best.data.metrics["final_val_accuracy"]) in shown  # 7 significant digits, as logged
    assert words_box is not None and words_box["width"] >= 400  # wide enough to read the words' start
    for c in children:  # each trial's policy in words: which of the param columns take effect
        assert c.data.tags["evomerge.policy"] in shown, (c.data.tags["evomerge.policy"], cells)
    worst = min(by_state["COMPLETE"], key=lambda c: c.data.metrics["final_val_accuracy"])
    assert text.index(best.info.run_name + "\n") < text.index(worst.info.run_name + "\n")  # sorted by accuracy
    # the study's baselines are listed among the trials, sorted by the same accuracy
    rivals = [r for r in runs if r.data.tags.get("evomerge.kind") == "baseline"]
    assert sorted(r.info.run_name for r in rivals) == ["baseline-no-merging", "baseline-ring-gossip"]
    at = {r.info.run_name: (r.data.metrics["final_val_accuracy"], text.index(r.info.run_name + "\n"))
          for r in rivals + by_state["COMPLETE"]}
    for b in rivals:
        acc, pos = at[b.info.run_name]
        for other, (acc2, pos2) in at.items():
            assert acc2 == acc or (acc2 > acc) == (pos2 < pos), (b.info.run_name, other)


def _schema(db) -> tuple:
    """A SQLite file's tables, indexes and revision; each statement as its sorted lines: the order of a table's
    constraints differs between stores MLflow makes in different processes (its migrations rebuild tables)."""
    import sqlite3

    with sqlite3.connect(db) as c:
        tables = sorted(sorted(line.strip().rstrip(",") for line in r[0].splitlines())
                        for r in c.execute("select sql from sqlite_master where sql is not null"))
        return tables, c.execute("select version_num from alembic_version").fetchall()


def _blank(cache):
    import mlflow

    return cache / "evomerge" / f"mlflow-{mlflow.__version__}-blank.db"


def test_a_new_studys_store_is_a_copy_of_the_blank_one_mlflow_made_and_holds_what_mlflows_own_does(
        tmp_path, data_dir, monkeypatch):
    """MLflow makes a new SQLite store by running its migrations (1.5-2 s); the first search on this machine keeps
    the blank store in the user cache, and every new study's store after is a copy: the same tables at the same
    revision as a store MLflow makes, the same default experiment, and the search's runs in it."""
    from mlflow import MlflowClient

    from evomerge.sqlitefiles import new_mlflow_store
    from searchutil import cli

    cache = tmp_path / "cache"
    f = write_study(tmp_path)
    for name in ("a", "b"):
        p = cli("search", "--study", f, "--n-trials", "2", "--sampler", "random", "--no-verdict", "--runs-dir",
                tmp_path / name, cwd=tmp_path, data_dir=data_dir, env_extra={"XDG_CACHE_HOME": str(cache)})
        assert p.returncode == 0, p.stderr
        assert _blank(cache).is_file()
    monkeypatch.chdir(tmp_path)
    ref = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'ref.db'}")  # MLflow's own, made here
    ours = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b' / 'tiny' / 'mlflow.db'}")
    assert {(e.experiment_id, e.name, e.artifact_location) for e in ref.search_experiments()} < {
        (e.experiment_id, e.name, e.artifact_location) for e in ours.search_experiments()}
    assert _schema(tmp_path / "b" / "tiny" / "mlflow.db") == _schema(tmp_path / "ref.db")
    exp = ours.get_experiment_by_name("tiny")
    assert len(ours.search_runs([exp.experiment_id])) == 5  # the search's parent, its 2 trials and 2 baselines
    # a store that exists is left alone; a new one is copied (the same file MLflow's migrations would give)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert not new_mlflow_store(f"sqlite:///{tmp_path / 'ref.db'}")
    assert new_mlflow_store(f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}")
    assert _schema(tmp_path / "c" / "mlflow.db") == _schema(tmp_path / "ref.db")
    # a log left by a store's process that ended there (kill -9) would be read into a copy: MLflow makes that one
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mlflow.db-wal").write_bytes(b"left by a killed process")
    assert not new_mlflow_store(f"sqlite:///{tmp_path / 'd' / 'mlflow.db'}")
    assert not (tmp_path / "d" / "mlflow.db").exists()


def test_a_cache_file_that_is_not_a_blank_store_is_made_again(tmp_path, data_dir):
    """A cache file that is not a blank store (cut short by a full disk, another tool's file): the search makes it
    again from MLflow's own store, and the study's store is a copy of that."""
    from mlflow import MlflowClient

    from searchutil import cli

    cache = tmp_path / "cache"
    _blank(cache).parent.mkdir(parents=True)
    _blank(cache).write_bytes(b"SQLite format 3\0 cut short")
    f = write_study(tmp_path)
    p = cli("search", "--study", f, "--n-trials", "2", "--sampler", "random", "--no-verdict", "--runs-dir",
            tmp_path / "a", cwd=tmp_path, data_dir=data_dir, env_extra={"XDG_CACHE_HOME": str(cache)})
    assert p.returncode == 0, p.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'a' / 'tiny' / 'mlflow.db'}")
    assert len(client.search_runs([client.get_experiment_by_name("tiny").experiment_id])) == 5  # + 2 baselines
    assert _schema(_blank(cache))[1] == _schema(tmp_path / "a" / "tiny" / "mlflow.db")[1]  # MLflow's revision


def _installed(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("uri, said", [
    ("foo://me:secret@bar", "foo://me:***@bar: MLflow does not store runs at foo:// addresses (nor does an installed "
                            "MLflow plugin); allowed: http(s)://HOST:PORT"),
    ("sqlite:////proc/nowhere/mlflow.db", "cannot write in /proc/nowhere, the folder of sqlite:////proc/nowhere/mlflow.db "
                                          "(No such file or directory)"),
    ("postgresql+psycopg://me:s3cr3t@127.0.0.1:notaport/runs", "postgresql+psycopg://me:***@127.0.0.1:notaport/runs is "
                                                                 "not a database address"),
    ("postgresql+psycopg://me:s3cr@t@127.0.0.1:5432/runs", "postgresql+psycopg://me:***@127.0.0.1:5432/runs: the password "
                                                           "holds an '@', which an address must encode"),
    ("http://me:secret@127.0.0.1:1", "cannot reach the MLflow server at http://me:***@127.0.0.1:1 ("),
    ("mysql+pymysql://me:secret@127.0.0.1:1/runs",
     "cannot reach the database at mysql+pymysql://me:***@127.0.0.1:1/runs (" if _installed("pymysql") else
     "cannot open mysql+pymysql://me:***@127.0.0.1:1/runs: its database driver is not installed (no module named "
     "'pymysql'); pip install it"),
    ("postgresql+psycopg2://me:secret@127.0.0.1:1/runs",
     "cannot reach the database at postgresql+psycopg2://me:***@127.0.0.1:1/runs (" if _installed("psycopg2") else
     "cannot open postgresql+psycopg2://me:***@127.0.0.1:1/runs: the driver psycopg2 that the address names is not "
     "installed (no module named 'psycopg2'); pip install it, or write postgresql:// to use psycopg 3 (pip install "
     "\"evomerge[postgres]\")"),
])
def test_a_tracking_store_mlflow_could_not_use_is_one_line_naming_the_flag(tmp_path, uri, said):
    """Every refusal names --tracking-uri and says why; none prints the password (even one holding an '@')."""
    from evomerge.errors import ConfigError
    from evomerge.report.tracking import check_reachable

    with pytest.raises(ConfigError) as e:
        check_reachable(uri)
    assert e.value.field == "--tracking-uri" and said in str(e.value), str(e.value)
    assert "secret" not in str(e.value) and "s3cr" not in str(e.value)


def test_a_folder_is_refused_where_mlflow_will_not_write_it_and_no_check_writes_anything(tmp_path, monkeypatch):
    """MLflow 3 keeps its file store in maintenance mode and raises on a folder; the check says so in one line (and
    how to opt in). Checking a SQLite store in folders not made yet, or a folder store MLflow takes, makes nothing."""
    import mlflow

    from evomerge.errors import ConfigError
    from evomerge.report.tracking import check_reachable

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if int(mlflow.__version__.split(".")[0]) >= 3:
        with pytest.raises(ConfigError, match=r"MLflow cannot store runs in the folder .*MLFLOW_ALLOW_FILE_STORE=true"):
            check_reachable(str(tmp_path / "mlruns"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_reachable(str(tmp_path / "mlruns"))
    check_reachable(f"file://{tmp_path}/mlruns2")
    check_reachable(f"sqlite:///{tmp_path}/a/b/mlflow.db")
    assert list(tmp_path.iterdir()) == []
    for uri in ("databricks", "databricks://profile", "sqlite:///:memory:"):  # left to MLflow
        check_reachable(uri)


def test_ui_for_a_server_that_does_not_answer_is_one_line(tmp_path, data_dir):
    from searchutil import cli

    port = free_port()  # nothing listens there
    p = cli("ui", "--study", write_study(tmp_path), "--tracking-uri", f"http://me:pw@127.0.0.1:{port}",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith(f"error: --tracking-uri: cannot reach the MLflow server at http://me:***@127.0.0.1:{port} (")
    assert p.stderr.count("\n") == 1


def test_ui_on_a_port_in_use_is_one_line_before_any_server_starts(tmp_path, data_dir):
    """(Another server on --port answered the new one's health check: its address was printed as this study's, with
    a note that the study had no search logged, and it served the other store's runs.)"""
    import socket

    from searchutil import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = cli("ui", "--study", write_study(tmp_path), "--runs-dir", str(tmp_path / "runs"), "--port", str(port),
                cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stdout == "", p.stdout
    assert p.stderr.startswith(f"error: --port: {port} is in use (") and p.stderr.endswith(
        "); allowed: a free port, or 0 for a free one\n") and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "runs").exists()  # no store made for a server that never started


def test_ui_for_a_server_that_refuses_the_tracking_api_is_one_line(tmp_path, data_dir):
    """A server that answers /health but turns the tracking API away (a password it refuses, a proxy): one line."""
    from conftest import refusing_server
    from searchutil import cli

    with refusing_server() as uri:
        p = cli("ui", "--study", write_study(tmp_path), "--tracking-uri", uri, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (f"error: --tracking-uri: {uri} answers, but not as an MLflow tracking server "
                        "(PERMISSION_DENIED: not for you)\n")


@pytest.mark.system
def test_search_with_a_tracking_address_mlflow_does_not_know_ends_in_one_line(tmp_path, data_dir):
    from searchutil import cli

    p = cli("search", "--study", write_study(tmp_path), "--tracking-uri", "foo://bar", "--n-trials", "1",
            "--no-verdict", cwd=tmp_path, data_dir=data_dir, process=True)  # as a user's shell runs it, with its screen
    assert p.returncode == 2
    assert p.stderr.startswith("error: --tracking-uri: foo://bar: MLflow does not store runs at foo:// addresses (")
    assert p.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


@pytest.mark.system
def test_a_search_with_nothing_left_to_run_links_the_best_model_it_already_logged(tmp_path, data_dir):
    """The same search again once its trials are all done: its parent run gets the best trial's consensus model,
    the one the first search logged (not trained and saved again: one model in the experiment)."""
    from mlflow import MlflowClient

    from evomerge.report.tracking import default_tracking_uri

    s = study.load(write_study(tmp_path, name="again", seeds=(0,)))
    first = evomerge.search(s, verdict=False, n_trials=2, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir)
    second = evomerge.search(s, verdict=False, n_trials=2, sampler="random", runs_dir=tmp_path / "runs",
                             data_dir=data_dir)
    assert not second.records and second.counts == first.counts  # nothing ran the second time
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path / "runs" / "again"))
    exp = client.get_experiment_by_name("again")
    (model,) = client.search_logged_models([exp.experiment_id])
    for parent in (first.parent_run_id, second.parent_run_id):
        outputs = client.get_run(parent).outputs
        assert [o.model_id for o in outputs.model_outputs] == [model.model_id]
    assert client.get_run(second.parent_run_id).data.tags["evomerge.best_trial"] == model.tags["evomerge.trial"]


@pytest.mark.integration
def test_the_line_for_a_tracking_server_gone_masks_a_password_in_its_address(monkeypatch):
    """(MLflow's request address keeps user:password@: the line printed it.) A real client's failed request."""
    from mlflow import MlflowClient

    from evomerge.cli import _tracking_gone

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (MLflow's own setting: no retries against port 9)
    with pytest.raises(Exception) as e:
        MlflowClient(f"http://alice:s3cret@127.0.0.1:{free_port()}/").search_experiments()
    said = _tracking_gone(e.value)
    assert said is not None and "s3cret" not in said and "alice:***@127.0.0.1" in said, said
    assert said.endswith("failed: Connection refused"), said
    assert _tracking_gone(ValueError("API request to http://x failed with exception Max retries exceeded")) is None


def test_the_review_shows_a_searched_step_size_beside_the_objectives():
    """(A new user found run.lr past the 420 px of the policy's words, off the screen.) The searched run values
    come right after the metrics, before the words; the policy's fields after them."""
    from evomerge import study as study_mod
    from evomerge.report.tracking import review_view

    s = study_mod.from_dict({"search": {"space": {
        "mean_interval": {"kind": "float", "low": 1.0, "high": 8.0},
        "run.lr": {"kind": "log-float", "low": 0.01, "high": 0.5}}}})
    cols = review_view(s)["selectedColumns"]
    assert cols.index("params.`run.lr`") < cols.index("tags.`evomerge.policy`") < cols.index("params.`mean_interval`")
    assert all(c.startswith("metrics.") for c in cols[:cols.index("params.`run.lr`")])


@pytest.mark.integration
def test_a_tracking_server_that_does_not_answer_is_said_while_mlflow_retries(tmp_path, capfd, monkeypatch):
    """(A tracking server stopped mid-search froze the bar for 8 minutes of MLflow's retries, without a word.) A
    server that takes the connection and never answers: a note once the call has waited, then MLflow's own error."""
    import socket

    from evomerge.report.tracking import Tracker

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections are taken into the backlog; nothing ever answers them
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # this test's own process: MLflow's settings
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    try:
        with pytest.raises(Exception):  # MLflow's own, after its timeout (the command says it in one line)
            Tracker(url, "s", slow_after=0.5)
    finally:
        silent.close()
    err = capfd.readouterr().err
    assert err.count("note: the MLflow tracking server at") == 1 and \
        f"at {url} has not answered for 0.5 s; MLflow retries a request for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES and " \
        "MLFLOW_HTTP_REQUEST_TIMEOUT set them) before it gives up; Ctrl-C stops the command now (a search keeps its " \
        "finished trials)" \
        in err, err


def test_an_address_at_fault_is_told_to_be_checked_not_its_server_started(tmp_path):
    """(A host no name server knows, and a port where something else answers, were both told "start it"; a
    `postgresq://` storage got no hint where `postgres://` got one.)"""
    import socket
    import threading

    from evomerge.errors import ConfigError
    from evomerge.report.tracking import check_reachable
    from evomerge.search import storage

    other = socket.socket()  # something that is no MLflow server: it takes a request and hangs up
    other.bind(("127.0.0.1", 0))
    other.listen(4)

    def hang_up():
        while True:
            try:
                c, _ = other.accept()
            except OSError:
                return
            c.recv(1000)
            c.close()
    threading.Thread(target=hang_up, daemon=True).start()
    cases = [("http://nosuchhost.invalid:5000", "; check the host name in the address or pass another --tracking-uri"),
             (f"http://127.0.0.1:{other.getsockname()[1]}",
              "; something else answers at that port: check the address's port or pass another --tracking-uri")]
    try:
        for uri, said in cases:
            with pytest.raises(ConfigError) as e:
                check_reachable(uri)
            assert str(e.value).startswith(f"--tracking-uri: cannot reach the MLflow server at {uri} (") and \
                str(e.value).endswith(said), str(e.value)
    finally:
        other.close()
    with pytest.raises(ConfigError) as e:
        storage.open_storage("postgresq://me@127.0.0.1:1/evo")
    assert str(e.value).startswith("--storage: postgresq://me@127.0.0.1:1/evo is not a database address") and \
        str(e.value).endswith("; did you mean postgresql://?"), str(e.value)


def test_a_search_told_not_to_log_the_model_says_so_on_its_run_and_the_next_search_logs_it(tmp_path, data_dir):
    """`--no-log-model` (as `mlflow.autolog(log_models=False)`): the parent run has the best's values and policy and a
    tag saying why it holds no model; the same search without the flag, nothing left to run, takes that run up again
    and logs the model (its tag read as "held already" would have left it without one)."""
    from mlflow import MlflowClient

    from searchutil import cli

    f = write_study(tmp_path)
    args = ("search", "--study", f, "--n-trials", "2", "--sampler", "random", "--no-verdict", "--quiet")
    p = cli(*args, "--no-log-model", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny").experiment_id
    (parent,) = client.search_runs([exp], filter_string="attributes.run_name LIKE 'search-%'")
    assert "--no-log-model" in parent.data.tags["evomerge.model_not_logged"], parent.data.tags
    assert "evomerge.best_trial" in parent.data.tags and "final_val_accuracy" in parent.data.metrics
    assert not parent.outputs.model_outputs and not client.search_logged_models([exp])
    p = cli(*args, cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    again = client.get_run(parent.info.run_id)
    assert "evomerge.model_not_logged" not in again.data.tags and len(again.outputs.model_outputs) == 1
    (model,) = client.search_logged_models([exp])
    assert model.tags["evomerge.trial"] == again.data.tags["evomerge.best_trial"]
    # a third search, one trial more, told again, its trial a copy of the worse one (the best stays): a new run, to
    # which the best's model, already logged, is linked (it said "not logged" beside a model that was)
    import optuna

    ostudy = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'optuna.db'}")
    worse = min(ostudy.trials, key=lambda t: t.values[0])
    assert str(worse.number) != again.data.tags["evomerge.best_trial"], [t.values for t in ostudy.trials]
    ostudy.enqueue_trial(worse.params)
    p = cli(*[a if a != "2" else "3" for a in args], "--no-log-model", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    (third,) = [r for r in client.search_runs([exp], filter_string="attributes.run_name LIKE 'search-%'")
                if r.info.run_id != parent.info.run_id]
    assert third.data.tags["evomerge.best_trial"] == model.tags["evomerge.trial"], third.data.tags
    assert "evomerge.model_not_logged" not in third.data.tags
    assert [o.model_id for o in third.outputs.model_outputs] == [model.model_id]
    assert len(client.search_logged_models([exp])) == 1
    with pytest.raises(evomerge.ConfigError, match=r"^log_model: 'no' is not True or False; allowed: True, False$"):
        evomerge.search(str(f), log_model="no", runs_dir=tmp_path / "runs", data_dir=data_dir)
