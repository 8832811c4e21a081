"""Where evomerge keeps what it may reuse across studies (the user cache), and the files a command is told to
write, checked before any work."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/evomerge``, else ``~/.cache/evomerge``: downloaded datasets (:mod:`evomerge.data`) and the
    blank MLflow store new studies copy (:mod:`evomerge.sqlitefiles`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evomerge"


def check_writable(path, flag: str) -> Path:
    """``path`` as a file a command can write at its end (``--json FILE``, ``calibrate -o``), checked before the work
    it would hold: not a folder, in a folder that exists and takes a file, not read-only. One line naming ``flag``
    otherwise (a results file that could not be written ended a finished run with a traceback)."""
    import tempfile

    from .errors import ConfigError

    out = Path(path)
    if out.is_dir():
        raise ConfigError(flag, f"{out} is a folder; allowed: a file to write")
    if out.exists():  # a file, or what stands for one (/dev/stdout, a shell's >(jq .)): it is written as it is
        if not os.access(out, os.W_OK):
            raise ConfigError(flag, f"cannot write {out}: permission denied")
        return out
    if not out.parent.is_dir():
        raise ConfigError(flag, f"{out.parent}: no such folder")
    try:  # the folder takes a file (tried with a temporary one, removed at once)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as e:
        raise ConfigError(flag, f"cannot write {out}: its folder takes no file ({e.strerror or e})") from None
    return out
