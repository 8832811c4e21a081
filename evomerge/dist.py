"""``python -m evomerge.dist``: the distributed backend's entry point under torchrun.

The backend itself is :mod:`evomerge.backends.distributed`; this module keeps the
command and the names (``simulate``, ``DistributedRunError``, ...) users already call.
"""

from __future__ import annotations

from .backends.distributed import DistributedRunError, groups, main, run_rank, simulate  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
