"""Looking at processes the way the kernel sees them (/proc), for the supervision tests."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return s[s.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...


def live_pids() -> dict[int, list[str]]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[0] != "Z":  # a zombie runs nothing and holds no port
                out[int(d)] = st
    return out


def in_session(sid: int) -> list[int]:
    return [p for p, st in live_pids().items() if int(st[3]) == sid]


def in_group(pgid: int) -> list[int]:
    return [p for p, st in live_pids().items() if int(st[2]) == pgid]


def children(pid: int) -> list[int]:
    return [p for p, st in live_pids().items() if int(st[1]) == pid]


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def wait_gone(pids, timeout: float = 30) -> list[int]:
    deadline = time.time() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = [p for p in left if alive(p)]
    return left


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections left in TIME_WAIT by a closed server do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True
