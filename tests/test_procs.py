"""evomerge.procs: every child's process group is stopped however the supervising process ends
(normal exit, exception, Ctrl-C, SIGTERM, SIGHUP), grandchildren included. Real processes, real signals."""

import os
import signal
import subprocess
import sys
import time

import pytest

from procutil import alive, in_group, wait_gone

# a supervising process: one command child (a shell with a background grandchild) and one spawned
# Python child that starts its own grandchild; prints their pids, then ends as argv[1] says
PARENT = r"""
import os, signal, subprocess, sys, time
from evomerge.procs import ProcessGroup, Terminated

def spawned_child():
    subprocess.Popen(["sleep", "300"])
    time.sleep(300)

if __name__ == "__main__":
    how = sys.argv[1]
    try:
        with ProcessGroup(grace=3) as group:
            sh = group.popen(["sh", "-c", "sleep 300 & sleep 300"])
            py = group.spawn(spawned_child)
            while os.getpgid(py.pid) != py.pid:
                time.sleep(0.05)  # the spawned child leads its own group
            time.sleep(1.0)  # the grandchildren have started
            print(sh.pid, py.pid, flush=True)
            sys.stdin.readline()  # the test has looked at the processes (or sends a signal meanwhile)
            if how == "raise":
                raise RuntimeError("boom")
    except Terminated as t:
        print("terminated", t.signum, flush=True)
        sys.exit(128 + t.signum)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.mark.system
@pytest.mark.parametrize("how, sig, rc", [("exit", None, 0), ("raise", None, 1), ("wait", signal.SIGTERM, 143),
                                          ("wait", signal.SIGHUP, 129), ("wait", signal.SIGINT, 130)])
def test_every_group_is_stopped_however_the_parent_ends(tmp_path, how, sig, rc):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = parent.stdout.readline()
        assert line, parent.communicate(timeout=60)[1]
        sh, py = map(int, line.split())
        members = in_group(sh) + in_group(py)
        assert len(in_group(sh)) >= 2 and len(in_group(py)) >= 2, members  # each child with its grandchild(ren)
        if sig is not None:
            parent.send_signal(sig)
        out, err = parent.communicate("go\n", timeout=60)
        assert parent.returncode == rc, err
        if sig in (signal.SIGTERM, signal.SIGHUP):
            assert f"terminated {int(sig)}" in out
        assert wait_gone(members, timeout=10) == []
        assert in_group(sh) == [] and in_group(py) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.system
def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    # the child ignores SIGTERM: only SIGKILL after the grace period stops it; a second SIGTERM to the
    # parent meanwhile must not leave it running
    script = tmp_path / "parent.py"
    script.write_text(r"""
import sys, time
from evomerge.procs import ProcessGroup, Terminated
try:
    with ProcessGroup(grace=3) as group:
        p = group.popen(["sh", "-c", "trap '' TERM; sleep 300 & wait"])
        time.sleep(0.5)
        print(p.pid, flush=True)
        time.sleep(300)
except Terminated:
    sys.exit(143)
""")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pid = int(parent.stdout.readline())
        members = in_group(pid)
        parent.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert alive(pid)  # ignoring SIGTERM, within the grace period
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
        assert parent.returncode == 143
        assert wait_gone(members, timeout=10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_handlers_are_restored_and_untouched_outside_the_main_thread():
    import threading

    from evomerge.procs import ProcessGroup, signals_raise

    before = signal.getsignal(signal.SIGTERM)
    with ProcessGroup():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []

    def in_thread():
        with signals_raise():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert seen == [before]


@pytest.mark.integration
def test_a_commands_exit_status_and_death_by_a_signal_come_through_its_watcher():
    """A command runs under a watcher (ProcessGroup.popen): its exit status, and its death by a signal, read as its
    own (a rank killed for memory read "exit 137", not "killed by SIGKILL"); a stop sent to the group just as it
    starts reaches it (the watcher's handlers took it before the command existed)."""
    from evomerge.procs import ProcessGroup

    with ProcessGroup(grace=10) as group:
        assert group.popen([sys.executable, "-c", "import sys; sys.exit(3)"]).wait(timeout=60) == 3
        killed = group.popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
        assert killed.wait(timeout=60) == -signal.SIGKILL
        for delay in (0.0, 0.05, 0.1, 0.2, 0.4):  # before, while and after the watcher starts its command
            p = group.popen([sys.executable, "-c", "import time; time.sleep(60)"])
            time.sleep(delay)
            t0 = time.monotonic()
            group.send(signal.SIGTERM)
            assert p.wait(timeout=30) == -signal.SIGTERM and time.monotonic() - t0 < 5, delay


@pytest.mark.system
def test_a_parent_killed_outright_leaves_its_watchers_no_longer_than_the_group_lives(tmp_path):
    """SIGKILL to the supervisor: each command's watcher sends its group SIGTERM, then SIGKILL after the grace. A
    group that obeys SIGTERM is gone at once, and its watcher with it (the watcher waited the whole grace, 15 s for
    `evomerge ui`'s server); one that ignores SIGTERM still lives within the grace and is killed after it."""
    script = tmp_path / "parent.py"
    script.write_text(r"""
import time
from evomerge.procs import ProcessGroup
with ProcessGroup(grace=6) as group:
    obeys = group.popen(["sh", "-c", "sleep 300 & wait"])
    ignores = group.popen(["sh", "-c", "trap '' TERM; sleep 300 & wait"])
    time.sleep(0.5)
    print(obeys.pid, ignores.pid, flush=True)
    time.sleep(300)
""")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    obeys = ignores = []
    try:
        a, b = map(int, parent.stdout.readline().split())  # the watchers' pids (a command runs under one)
        obeys, ignores = in_group(a), in_group(b)
        assert len(obeys) >= 3 and len(ignores) >= 3  # the watcher, the shell, its sleep
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        assert wait_gone(obeys, timeout=30) == []
        assert time.monotonic() - t0 < 3, "the watcher waited out the grace of a group already gone"
        time.sleep(max(0.0, 2 - (time.monotonic() - t0)))
        assert any(alive(p) for p in ignores)  # within the grace
        assert wait_gone(ignores, timeout=30) == []
        assert time.monotonic() - t0 > 5
    finally:
        for p in obeys + ignores:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
