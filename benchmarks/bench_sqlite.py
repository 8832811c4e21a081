"""One Optuna write on the study's SQLite file, as ``evomerge search`` opens it (write-ahead log, ``synchronous =
NORMAL``: ``evomerge/sqlitefiles.py``) against SQLite's defaults (rollback journal, ``synchronous = FULL``): the time of a
``set_trial_user_attr``, the transaction a trial pays a dozen times (its creation, heartbeats, attributes, tell).

    .venv/bin/python benchmarks/bench_sqlite.py [--writes 200] [--repeats 2] [--dir DIR]

The modes alternate, each on a fresh file in ``--dir`` (default: a temporary folder; the disk is what is measured).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def one(path: Path, evomerge_way: bool, writes: int) -> float:
    import optuna

    from evomerge.search.storage import open_storage, quiet_optuna

    url = f"sqlite:///{path}"
    storage = open_storage(url) if evomerge_way else optuna.storages.RDBStorage(url)
    with quiet_optuna():  # the heartbeat evomerge's storage is opened with: Optuna's note that it is for optimize()
        study = optuna.create_study(storage=storage, study_name="bench")
        ids = [study.ask()._trial_id for _ in range(5)]
    t = time.perf_counter()
    for i in range(writes):
        storage.set_trial_user_attr(ids[i % len(ids)], f"k{i}", {"value": i})
    return (time.perf_counter() - t) / writes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # this script's own process
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.repeats):
            for name, way in (("SQLite's defaults", False), ("as evomerge opens it", True)):
                ms = 1000 * one(Path(tmp) / f"{r}-{way}.db", way, args.writes)
                print(f"{name}: {ms:.2f} ms per set_trial_user_attr")


if __name__ == "__main__":
    main()
