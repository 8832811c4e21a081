"""``[data] dataset = "text"``: a byte-level language-modelling corpus from the user's text.

``path`` is a text file or a folder of them (every file under it, hidden ones skipped, in sorted order), relative
to the study file. Tokens are the text's bytes (vocabulary 256). The corpus is split **by file**, so that no
validation or test text is ever trained on, not even a neighbouring window: of the files in sorted order, every
tenth from the ninth is validation and every tenth from the tenth is test (a corpus of fewer than 10 files, or a
single file, is split into contiguous 80/10/10 byte ranges instead). Each split's files are joined and cut into
non-overlapping windows of ``context + 1`` bytes: the inputs are a window's first ``context`` bytes and the labels
the next byte at each position (``[N, context]`` int64 each). ``val_size`` and ``train_size`` cap how many windows
are used (a seeded choice), as for the image datasets. ``partition = "by_file"`` gives whole training files to
workers (each window belongs to the file it starts in): text's natural non-IID split.

``sha256`` pins the corpus: :func:`digest` over the files' relative names and bytes; a corpus that differs is one
line naming ``study.data.sha256``. The digest is part of the study's fingerprint whether pinned or not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .errors import ConfigError

VOCAB = 256


def root_of(d, base_dir) -> Path:
    p = Path(d.path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    if not p.exists():
        raise ConfigError("study.data.path", f"{d.path}: no such file or folder"
                                             f"{f' (relative to {base_dir})' if base_dir is not None else ''}")
    return p


def files_of(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = sorted(f for f in root.rglob("*") if f.is_file()
                   and not any(part.startswith(".") for part in f.relative_to(root).parts))
    if not files:
        raise ConfigError("study.data.path", f"{root}: the folder holds no files")
    return files


def digest(root: Path) -> str:
    """sha256 over every file's name relative to ``root`` and its bytes, in sorted order."""
    h = hashlib.sha256()
    for f in files_of(root):
        h.update(str(f.relative_to(root) if root.is_dir() else f.name).encode() + b"\0")
        data = f.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def splits(root: Path, lengths: dict | None = None) -> dict[str, bytes]:
    """The corpus's bytes per split (``train``, ``val``, ``test``), split by file; ``lengths`` (when given) gets
    the byte length of each file in each split, in order (the training split's files are ``partition = "by_file"``'s
    units)."""
    files = files_of(root)
    if len(files) >= 10:
        parts = {"train": [], "val": [], "test": []}
        for i, f in enumerate(files):
            parts["val" if i % 10 == 8 else "test" if i % 10 == 9 else "train"].append(f.read_bytes())
        if lengths is not None:
            lengths.update({k: [len(b) for b in v] for k, v in parts.items()})
        return {k: b"".join(v) for k, v in parts.items()}
    data = b"".join(f.read_bytes() for f in files)
    a, b = int(len(data) * 0.8), int(len(data) * 0.9)
    if lengths is not None:
        lengths.update(train=[a], val=[b - a], test=[len(data) - b])
    return {"train": data[:a], "val": data[a:b], "test": data[b:]}


def windows(data: bytes, context: int):
    """Non-overlapping windows: inputs and next-byte labels, ``[N, context]`` int64 each."""
    import torch

    n = len(data) // (context + 1)
    if n == 0:
        return torch.zeros(0, context, dtype=torch.int64), torch.zeros(0, context, dtype=torch.int64)
    w = torch.frombuffer(bytearray(data[:n * (context + 1)]), dtype=torch.uint8).view(n, context + 1).to(torch.int64)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def load_text(d, base_dir=None):
    """The :class:`evomerge.data.Data` of a ``dataset = "text"`` study's ``[data]``."""
    import torch

    from .data import Data, DatasetSpec

    root = root_of(d, base_dir)
    if d.sha256:
        got = digest(root)
        if got != d.sha256:
            raise ConfigError("study.data.sha256", f"{d.path} hashes to {got}, but the study pins {d.sha256}: the text "
                                                   "differs from the one the study was written for; allowed: the "
                                                   "corpus's own digest (evomerge.text.digest), or leave sha256 out")
    lengths: dict = {}
    parts = splits(root, lengths)
    wins = {k: windows(v, d.context) for k, v in parts.items()}
    # the training file each window starts in
    starts = np.arange(len(wins["train"][0])) * (d.context + 1)
    files = np.searchsorted(np.cumsum(lengths["train"]), starts, side="right")
    for k in ("train", "val"):
        if len(wins[k][0]) < 2:
            raise ConfigError("study.data.path", f"{d.path}: its {k} split holds {len(wins[k][0])} windows of "
                                                 f"{d.context + 1} bytes; need at least 2 (more text, or a smaller "
                                                 "context)")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([d.seed, 0x7E47])))
    (tx, ty), (vx, vy), (sx, sy) = wins["train"], wins["val"], wins["test"]
    vi = np.sort(rng.permutation(len(vx))[:d.val_size])
    ti = np.arange(len(tx)) if not d.train_size else np.sort(rng.permutation(len(tx))[:d.train_size])
    spec = DatasetSpec(name=f"text:{d.path}", files={}, mean=0.0, std=1.0, n_classes=VOCAB)
    vi_t, ti_t = torch.as_tensor(vi), torch.as_tensor(ti)
    out = Data(spec, tx[ti_t].contiguous(), ty[ti_t].contiguous(), vx[vi_t].contiguous(), vy[vi_t].contiguous(),
               sx, sy, ti)
    out.groups = files[ti]
    return out
