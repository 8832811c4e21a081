"""The suite's own machinery, as the installed pytest and pytest-xdist run it.

Tests that share an expensive module fixture (a 4-rank run of 27 policies, a searched study, an MLflow server) are
marked with one ``xdist_group`` so that one worker computes it once. With pytest 9.2 and pytest-xdist 3.8 the mark was
silently ignored (pytest-xdist issue 1386): the group's tests went to both workers, each computed the fixture, and the
full suite took a minute longer. Nothing failed; this test does.
"""

import os
import subprocess
import sys

import pytest

GROUPED = """
import os, pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["FIXTURE_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")

@pytest.mark.xdist_group("shared")
def test_a(shared): pass

def test_b(): pass

def test_c(): pass

@pytest.mark.xdist_group("shared")
def test_d(shared): pass

def test_e(): pass

@pytest.mark.xdist_group("shared")
def test_f(shared): pass
"""


@pytest.mark.system
def test_an_xdist_group_runs_on_one_worker_and_computes_its_module_fixture_once(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings: only what is asked below
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_other.py").write_text("def test_x(): pass\ndef test_y(): pass\ndef test_z(): pass\n")
    log = tmp_path / "fixture.log"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                        "loadgroup", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, env={**os.environ, "FIXTURE_LOG": str(log)}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "9 passed" in p.stdout, p.stdout
    assert len(log.read_text().split()) == 1, "the group's module fixture was computed by more than one worker"


def test_free_ports_are_below_the_ephemeral_range_and_never_twice_in_one_process():
    """(Ports picked with bind(0) and released came from the kernel's ephemeral range, which every test process and
    every outgoing connection draws from: a test's `evomerge ui` was answered by another test's MLflow server. Three
    launches of one test, in threads, once got one port.)"""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from conftest import free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    with ThreadPoolExecutor(4) as pool:
        ports = list(pool.map(lambda _: free_port(), range(40)))
    assert len(set(ports)) == 40 and all(10000 <= p < low for p in ports), ports
    for port in ports[:5]:  # free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
