"""``benchmarks/sim_vs_real.py`` end to end, small: real ranks under netlab with the Merger, calibrated from their
own traces, against the simulated clock's prediction (issue 29 part 4). The benchmark's full run (4 policies, two
scenarios, 20 s each) gives the table in benchmarks/RESULTS.md; here two policies and 10 s keep it to a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_calibrate import need_netlab

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.system
@pytest.mark.timeout(600)
def test_the_clock_calibrated_from_a_real_run_predicts_its_time_to_target(tmp_path, data_dir):
    """50 Mbit/s links and one rank 3x slower: all-reduce every step reaches the target in the real run and in the
    simulation on the environment calibrated from the ring-gossip run's trace, the prediction within 25% of the
    measured time (within 5% in the full benchmark; with the links fitted on raw transfer durations it was 56%
    too slow). All-reduce's accuracy per step is the same real and simulated, so the time is the clock's alone;
    gossip's time to target also depends on when each payload landed, and near a plateau it spreads by a third
    between runs, so here it is only required to reach the target. Each real run has 14 s: all-reduce's 8.9 s
    predicted to target took more than the 10 s it had in a full suite on a loaded machine (57 steps, short of it)."""
    need_netlab()
    out = tmp_path / "figures.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_vs_real.py"), "--scenarios", "network",
                        "--policies", "allreduce", "ring-gossip", "--budget", "14", "--dt", "0.25",
                        "--data-dir", str(data_dir), "--out", str(tmp_path / "runs"), "--json", str(out)],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| network | allreduce |" in p.stdout and (tmp_path / "runs" / "network" / "cluster.toml").is_file()
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"allreduce", "ring-gossip"}
    for name, r in rows.items():
        print(f"{name}: measured {r['measured']}, predicted {r['predicted']}, error {r['error']}")
    assert rows["ring-gossip"]["measured"] is not None, rows["ring-gossip"]["real"]["accuracy"]
    ar = rows["allreduce"]
    assert ar["measured"] is not None and ar["predicted"] is not None, (ar["real"]["accuracy"], ar["simulated"])
    assert abs(ar["error"]) <= 0.25, (ar["measured"], ar["predicted"])
