"""Where evomerge keeps what it may reuse across studies: the user cache."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/evomerge``, else ``~/.cache/evomerge``: downloaded datasets (:mod:`evomerge.data`) and the
    blank MLflow store new studies copy (:mod:`evomerge.sqlitefiles`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evomerge"
