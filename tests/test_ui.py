"""`evomerge ui` through the real command: the address is printed once the MLflow server answers, and
SIGTERM or SIGHUP leaves no process of the server's session (mlflow server, uvicorn workers) and a free port."""

import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from conftest import free_port, write_study
from procutil import children, in_session, port_free, wait_gone



def _ui(tmp_path, stderr=subprocess.PIPE) -> tuple[subprocess.Popen, int]:
    """`evomerge ui` on a study of its own in ``tmp_path``, on a free port, as a user starts it; and the port."""
    f = write_study(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "EVOMERGE_RUNS_DIR")}
    return subprocess.Popen([sys.executable, "-m", "evomerge.cli", "ui", "--study", str(f), "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True), port


@pytest.mark.system
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_ui_stops_the_whole_server_session(tmp_path, sig):
    ui, port = _ui(tmp_path)
    members = []
    try:
        url = f"http://127.0.0.1:{port}"
        line = ui.stdout.readline()  # stdout holds our line alone (the server logs on stderr), once it answers
        # no search logged yet: the address is the study's runs list (its experiment made as a search makes it),
        # in the model-training view, first on the line
        assert line.startswith(f"{url}/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=evomerge  "
                               "MLflow UI for tiny"), line + ui.communicate(timeout=30)[1][-3000:]
        note, before = ui.stderr.readline(), []  # before it, the server's warnings (on stderr too), if any
        while note and not note.startswith("note: "):
            before.append(note)
            note = ui.stderr.readline()
        assert note.startswith("note: no search of tiny is logged in this store yet"), note
        # not the server's start-up and access log: MLflow's and uvicorn's INFO lines, a library's deprecation
        assert not any(" INFO" in ln or "Warning" in ln or "GET /" in ln for ln in before), before
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        (server,) = children(ui.pid)
        assert os.getsid(server) == server  # the server leads a session of its own
        # the store is not on its command line, which every user's `ps` shows (a database's password with it)
        cmdline = open(f"/proc/{server}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        assert "mlflow server" in cmdline and "sqlite" not in cmdline and "store-uri" not in cmdline, cmdline
        members = in_session(server)
        assert len(members) >= 2  # mlflow server and its uvicorn process(es)
        ui.send_signal(sig)
        _, err = ui.communicate(timeout=90)
        assert ui.returncode == 128 + sig and "MLflow UI stopped" in err and " INFO" not in err, err
        assert wait_gone(members, timeout=10) == []
        assert in_session(server) == []
        assert port_free(port)
    finally:
        members += [p for c in children(ui.pid) for p in in_session(c)] if ui.poll() is None else []
        if ui.poll() is None:
            ui.kill()
            ui.wait()
        for p in members:  # never leave a server behind, even when an assertion failed
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.system
def test_ui_killed_outright_takes_its_server_with_it(tmp_path):
    """SIGKILL (or the kernel's out-of-memory killer) gives `ui` no chance to stop its server, which ran on, holding
    the port and serving the store, in a session of its own. The server's watcher ends that session when `ui` is
    gone."""
    import time

    ui, port = _ui(tmp_path, stderr=subprocess.DEVNULL)
    members = []
    try:
        assert f"http://127.0.0.1:{port}/" in ui.stdout.readline()  # serving
        (server,) = children(ui.pid)
        members = in_session(server)
        assert len(members) >= 3  # the watcher, mlflow server and its uvicorn process(es)
        ui.kill()
        ui.wait()
        assert wait_gone(members, timeout=30) == []
        deadline = time.monotonic() + 10
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_free(port)
    finally:
        for p in members:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
