"""The ranks' progress in torch.distributed's key-value store (evomerge/backends/progress.py), on a real TCPStore:
several Progress objects on one store stand for the ranks (each holds only its own rank's view, as in a run)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from conftest import free_port
from evomerge.backends import progress as progress_mod

pytestmark = pytest.mark.unit


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    yield s
    del s


def test_a_meeting_tells_each_rank_who_is_there_with_its_value_and_reads_nothing_new_while_no_one_came(store):
    run = progress_mod.next_run(store, 5.0)
    ranks = [progress_mod.Progress(store, run, r, 3, timeout=1.0) for r in range(3)]
    n = ranks[0].arrive(41)
    assert ranks[1].arrived(n) == {0: 41}
    assert ranks[1].arrived(n) == {}  # the count has not grown: nothing new (one read, not one per rank)
    assert ranks[1].arrive(7) == n
    assert ranks[2].arrived(n) == {0: 41, 1: 7}
    assert ranks[2].arrive(0) == n
    assert ranks[0].arrived(n) == {0: 41, 1: 7, 2: 0}
    # the next meeting starts empty; another Merger's (a new run number) does not see this one's
    m = ranks[0].arrive(5)
    assert m == n + 1 and ranks[1].arrived(m) == {0: 5}
    other = progress_mod.Progress(store, progress_mod.next_run(store, 5.0), 1, 3, timeout=1.0)
    assert other.arrived(0) == {} and other.arrive(3) == 0 and other.arrived(0) == {1: 3}


def test_a_rank_that_steps_or_waits_is_moving_and_a_silent_one_stops_moving_after_the_timeout(store):
    run = progress_mod.next_run(store, 5.0)
    timeout = 0.4
    a, b = (progress_mod.Progress(store, run, r, 2, timeout=timeout) for r in range(2))
    assert b.moving([0]) and b.moving([0], "wait")  # the first look counts as a move
    t0 = time.perf_counter()
    step = 0
    while time.perf_counter() - t0 < 3 * timeout:  # rank 0 steps: rank 1 sees it move throughout
        step += 1
        a.beat(step)
        assert b.moving([0]), step
        time.sleep(0.01)
    time.sleep(2 * b.poll_every)  # (the last beat, not waited for, has landed; rank 1 has seen it)
    assert b.moving([0])
    time.sleep(timeout + 2 * b.poll_every)  # silent since: no longer moving
    assert not b.moving([0])
    # rank 0 waits inside the Merger (a worker's leader): its waits are told apart from its steps (the first told,
    # not waited for, lands before rank 1 looks)
    a.pulse()
    time.sleep(2 * b.poll_every)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 3 * timeout:
        a.pulse()
        assert b.moving([0], "wait")
        time.sleep(0.01)
    assert not b.moving([0])  # no step all the while
    time.sleep(2 * b.poll_every)
    assert b.moving([0], "wait")
    time.sleep(timeout + 2 * b.poll_every)
    assert not b.moving([0], "wait")
    assert not b.moving([])  # no rank: nothing to wait for


SERVER = """
import sys, time, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, wait_for_workers=False)
print("up", flush=True)
time.sleep(300)
"""


def test_a_store_whose_process_stopped_does_not_block_a_step_and_a_wait_finds_it_gone_within_the_timeout(tmp_path):
    """The store of a run started by init_process_group with MASTER_ADDR is rank 0's process's: with rank 0 stopped
    (kill -STOP), a TCPStore call blocked for ever, and every other rank with it (it should name rank 0)."""
    before = set(threading.enumerate())
    port = free_port()
    (tmp_path / "server.py").write_text(SERVER)
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), str(port)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30),
                               wait_for_workers=False)
        run = progress_mod.next_run(client, 5.0)
        a, b = (progress_mod.Progress(client, run, r, 2, timeout=0.5) for r in range(2))
        a.beat(1)
        n = a.arrive(3)
        assert b.arrived(n) == {0: 3}
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        for step in range(2, 200):  # the steps go on (a beat is not waited for)
            a.beat(step)
        assert time.perf_counter() - t0 < 0.5
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="the store did not answer for 0.5 s"):
            while True:
                b.moving([0])
                b.arrived(n)
                time.sleep(0.01)
        assert time.perf_counter() - t0 < 2.0
        with pytest.raises(RuntimeError, match="the store did not answer"):  # gone: at once from here on
            b.arrive(4)
        assert progress_mod.next_run(client, 0.5) == 0  # a new Merger tells no progress
        a.close()
        b.close()
    finally:
        server.kill()
        server.wait()
        # the call still waiting on the stopped store fails as it goes, and its thread ends: torch's warning of the
        # reset connection is this test's output (it came on the terminal, after the test, in a full suite)
        for t in set(threading.enumerate()) - before:
            if t.name == "evomerge-progress":
                t.join(timeout=10)
