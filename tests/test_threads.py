"""Threads: as many as there are idle cores, or $EVOMERGE_THREADS; a bad value is one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evomerge import procs
from evomerge.errors import ConfigError


def test_an_explicit_thread_count_wins_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("EVOMERGE_THREADS", "3")
    assert procs.default_threads() == 3
    monkeypatch.setenv("EVOMERGE_THREADS", "many")
    with pytest.raises(ConfigError, match="EVOMERGE_THREADS: 'many' is not a number of threads; allowed: an integer >= 1"):
        procs.default_threads()


@pytest.mark.system
def test_idle_cores_drop_while_another_process_keeps_a_core_busy(monkeypatch):
    monkeypatch.delenv("EVOMERGE_THREADS", raising=False)
    cores = os.cpu_count() or 1
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = procs.idle_cores(0.5)
    finally:
        hog.kill()
        hog.wait()
    assert busy <= cores - 0.5  # one core was taken
    assert 1 <= procs.default_threads() <= cores
