"""Shared fixtures: the real MNIST files from ../shared/data and small studies built on them."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("EVOMERGE_TEST_DATA_DIR", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert (DATA_DIR / "mnist" / "train-images-idx3-ubyte.gz").is_file(), f"MNIST not found under {DATA_DIR}"
    return DATA_DIR


@pytest.fixture(scope="session")
def mnist(data_dir):
    """MNIST with a 1000-sample validation split and 4000 training samples (loaded once)."""
    from evomerge import data

    return data.load("mnist", data_dir, val_size=1000, train_size=4000, split_seed=0)


def tiny_study(**run):
    """A small study: 4 workers on 4000 MNIST samples, MLP 784-32-10."""
    from evomerge import study

    raw = {
        "study": {"name": "tiny"},
        "data": {"dataset": "mnist", "val_size": 1000, "train_size": 4000, "partition": "iid", "seed": 0},
        "model": {"name": "mlp", "hidden": [32]},
        "run": {"workers": 4, "batch_size": 16, "steps": 60, "lr": 0.1, "rounds": 3, "score_samples": 8} | run,
    }
    return study.from_dict(raw)


TINY_STUDY = """
[study]
name = "{name}"
[data]
dataset = "mnist"
val_size = 500
train_size = 2000
[model]
{model}
[run]
workers = {workers}
batch_size = 16
steps = {steps}
rounds = 3
score_samples = 8
seeds = {seeds}
[policy]
degree = 3
[search]
n_trials = 6
[search.space]
mean_interval = {{ kind = "log-float", low = 1.0, high = 30.0 }}
mixing_weight = {{ kind = "float", low = 0.1, high = 1.0 }}
topology = {{ kind = "categorical", choices = {topologies} }}
[objectives]
metrics = {objectives}
[baselines]
policies = ["no-merging", "ring-gossip"]
"""


def write_study(directory: Path, name: str = "tiny", *, workers: int = 4, steps: int = 30, seeds=(0,),
                topologies=("ring", "complete"), objectives=("val_accuracy",), slow: bool = False) -> Path:
    """A tiny study file (a few hundred samples per worker) with its policies folder, for search tests. ``slow``:
    the same MLP as a user's model (``tests/slowmlp.py``, copied beside the file) whose forward sleeps
    ``SLOWMLP_DELAY`` seconds where a process has that variable: trials long in wall time, cheap in CPU."""
    import json
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    f = directory / f"{name}.toml"
    model = 'name = "mlp"\nhidden = [16]'
    if slow:
        model = 'factory = "slowmlp:make"\nexecution = "stacked"'
        shutil.copy(ROOT / "tests" / "slowmlp.py", directory)
    f.write_text(TINY_STUDY.format(name=name, workers=workers, steps=steps, seeds=json.dumps(list(seeds)), model=model,
                                   topologies=json.dumps(list(topologies)), objectives=json.dumps(list(objectives))))
    (directory / "policies").mkdir(exist_ok=True)
    for p in ("no-merging", "ring-gossip"):
        shutil.copy(ROOT / "studies" / "policies" / f"{p}.json", directory / "policies")
    return f


# this test process's next port in its range (free_port); from its pid on, so that two sessions side by side do not
# try the same ports in the same order
_PORTS = itertools.count(os.getpid())


def free_port() -> int:
    """A free port on 127.0.0.1 for a test's server or rendezvous. Taken from a range below the kernel's ephemeral
    ports, one range per xdist process, so that between this pick and the server's bind no other test's server and
    no outgoing connection's source port takes it: a port picked with bind(0) and released could be (a test's
    `evomerge ui` once answered with another test's MLflow server, on a landing's CI)."""
    import socket

    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = min(1000, (ephemeral - 10000) // max(workers, 1))
    base = 10000 + span * (int(worker) if worker.isdigit() else 0)
    # each try takes the next port: two threads of one test never try the same one (a machine whose ephemeral
    # ports start too low for a range per process: bind(0), as before)
    candidates = (base + next(_PORTS) % span for _ in range(span)) if span >= 20 else [0]
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (another pytest session beside this one)
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port in {base}-{base + span - 1}")


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server on 127.0.0.1 and a free port, in a temporary cluster (Debian's
    binaries; as the `postgres` user when the tests run as root); stopped at the end of the session."""
    with postgres_cluster() as (url, _):
        yield url


@contextlib.contextmanager
def postgres_cluster():
    """A PostgreSQL server of its own (databases optuna and mlflow): its address, and a function that stops it
    (``stop("fast")``: as an administrator stops a server under a running search)."""
    import glob
    import shutil
    import subprocess
    import tempfile

    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    assert bins, "PostgreSQL binaries not found (Debian package postgresql)"
    bindir = Path(bins[-1])
    # pytest's own temporary folders are private to root; the server's user must reach its cluster
    d = Path(tempfile.mkdtemp(prefix="evomerge-pg-"))
    as_user = []
    if os.geteuid() == 0:
        shutil.chown(d, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = d / "data"
    subprocess.run(as_user + [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True)
    subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(d / "log"), "-w",
                              "-o", f"-p {port} -h 127.0.0.1 -k {d}", "start"], check=True, capture_output=True)
    try:
        for db in ("optuna", "mlflow"):
            subprocess.run(as_user + [str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", db],
                           check=True, capture_output=True)
        def stop(mode: str = "immediate"):
            subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "stop"],
                           capture_output=True)

        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}", stop
    finally:
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


# -- test tiers ------------------------------------------------------------------------------------------
# unit: no data, no processes (milliseconds); integration: in-process runs on small real data (the MNIST
# files); system: the product end to end, marked by hand: processes (the CLI as a subprocess, ranks), servers,
# a browser, PostgreSQL, and whole searches through the command. `pytest` runs unit + integration
# (addopts: -m "not system"); `pytest -m "unit or integration or system"` runs everything, as CI does.
DATA_FIXTURES = {"data_dir", "mnist"}


def pytest_configure(config):
    """Under pytest-xdist each test process trains with one torch thread (``$EVOMERGE_THREADS``, default 1), so
    two test processes on two cores do not fight over them; the commands the tests start inherit the setting.

    A suite started in the background by a script (``bash .ci/run &``) inherits SIGINT ignored, and so would every
    command a test starts: the tests that press Ctrl-C on them (``send_signal(SIGINT)``) would see it ignored and
    fail. The suite takes SIGINT back, so the commands it starts get Python's own handling of it."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("EVOMERGE_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["EVOMERGE_THREADS"]))


@pytest.hookimpl(optionalhook=True)  # (a run without xdist, -p no:xdist, does not know the hook)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (addopts): one and a half test processes per core, not one. Many system tests spend their time
    waiting (ranks held to a timeout, a server starting, a killed process's end), and one process per core left the
    cores idle meanwhile: on the project's 2-core machine the full suite took 1006 s at 2 processes, 870 s at 3 and
    744-800 s at 4 (benchmarks/RESULTS.md), but at 4 a fresh clone's run failed two timing-bound calibrate tests
    (ranks that started too late for a 15 s timeout, a slow rank's fitted speed off by 21%): 3 keeps the cores busy
    without that load. On a larger machine at most 8 more than the cores (each process imports torch).
    ``$PYTEST_XDIST_AUTO_NUM_WORKERS`` (read by xdist's own hook) or ``-n N`` chooses otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it (and warns of a value that is no number)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores + cores // 2, cores + 8)


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(config, items):
    """Every test gets exactly one tier: ``system`` or ``integration`` where marked (a run on the shipped text
    corpus needs no data fixture), else ``integration`` where it needs the data, else ``unit``."""
    for item in items:
        if item.get_closest_marker("system") or item.get_closest_marker("integration"):
            continue
        tier = "integration" if DATA_FIXTURES & set(item.fixturenames) else "unit"
        item.add_marker(getattr(pytest.mark, tier))
    # the tests marked `first` (a minute or more each) start first: in file order the longest of them started last
    # and ran on one worker alone for its last minute while the other had nothing left (pytest-xdist hands the tests
    # out in this order); the others keep their order (the timing-bound ones were not moved together)
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


@contextlib.contextmanager
def refusing_server(message: str = "not for you"):
    """A real HTTP server on 127.0.0.1 that answers /health and turns every other request away with MLflow's
    PERMISSION_DENIED (a tracking server behind a password it refuses, a proxy); yields its address."""
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path.startswith("/health")
            self.send_response(200 if ok else 403)
            self.end_headers()
            self.wfile.write(b"OK" if ok else json.dumps({"error_code": "PERMISSION_DENIED", "message": message}).encode())

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
