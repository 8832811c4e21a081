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


def cannot_write_in(folder) -> tuple[Path | None, str] | None:
    """Why ``folder``, or where it is not there yet its nearest existing parent (the first write makes the rest),
    cannot take a file: (that folder, the reason); None when it can. Tried with a temporary file there, removed at
    once; nothing is made."""
    import tempfile

    folder = Path(folder)
    there = next((p for p in (folder, *folder.absolute().parents) if p.exists()), None)
    if there is None or not there.is_dir():
        return there, "not a folder"
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as e:
        return there, e.strerror or str(e).strip().splitlines()[0]
    return None


def check_writable(path, flag: str) -> Path:
    """``path`` as a file a command can write at its end (``--json FILE``, ``calibrate -o``), checked before the work
    it would hold: not a folder, in a folder that exists and takes a file, not read-only. One line naming ``flag``
    otherwise (a results file that could not be written ended a finished run with a traceback)."""
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
    refused = cannot_write_in(out.parent)
    if refused is not None:
        raise ConfigError(flag, f"cannot write {out}: its folder takes no file ({refused[1]})")
    return out
