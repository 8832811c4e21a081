"""Datasets in standard IDX files, the validation split, and worker partitions.

Files are looked up in ``data_dir`` (``--data-dir``), then ``$EVOMERGE_DATA_DIR``,
then the user cache (``$XDG_CACHE_HOME/evomerge`` or ``~/.cache/evomerge``), then
system places (Debian's ``/usr/share/datasets``); a ``data_dir`` given that is no folder is refused (it
fell through to the next places in silence). In each directory ``D`` a dataset
``name`` is read from ``D/name/`` or, when ``D`` itself is called ``name``, from
``D``. Missing files are downloaded into the user cache with checksum checks when the
network allows; otherwise a one-line error says which files to put where.

Everything is preloaded once as uint8 tensors; the test set is only reachable
through :meth:`Data.test`, which counts its uses, so a search can assert it never
looked.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import struct
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError, DataNotFoundError, unknown
from .userdirs import user_cache_dir

SPLITS = ("train", "test")
PARTS = ("images", "labels")


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    files: dict[tuple[str, str], str]  # (split, part) -> file name (gzip)
    checksums: dict[str, str] = field(default_factory=dict)  # file name -> "algo:hexdigest", for downloads
    urls: tuple[str, ...] = ()  # base URLs tried in order
    system_dirs: tuple[str, ...] = ()
    mean: float = 0.1307
    std: float = 0.3081
    n_classes: int = 10


def _mnist_files(prefix: str = "") -> dict[tuple[str, str], str]:
    return {
        ("train", "images"): f"{prefix}train-images-idx3-ubyte.gz",
        ("train", "labels"): f"{prefix}train-labels-idx1-ubyte.gz",
        ("test", "images"): f"{prefix}t10k-images-idx3-ubyte.gz",
        ("test", "labels"): f"{prefix}t10k-labels-idx1-ubyte.gz",
    }


DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        name="mnist",
        files=_mnist_files(),
        # Digests of the canonical files, as torchvision checks them.
        checksums={
            "train-images-idx3-ubyte.gz": "md5:f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "md5:d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "md5:9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "md5:ec29112dd5afa0611ce80d1b7f02629c",
        },
        urls=("https://ossci-datasets.s3.amazonaws.com/mnist/",),
        mean=0.1307, std=0.3081,
    ),
    "fashion-mnist": DatasetSpec(
        name="fashion-mnist",
        files=_mnist_files(),
        checksums={
            "train-images-idx3-ubyte.gz": "md5:8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "md5:25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "md5:bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "md5:bb300cfdad3c16e7a12a480ee83cd310",
        },
        urls=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        system_dirs=("/usr/share/datasets/fashion-mnist",),
        mean=0.2860, std=0.3530,
    ),
}


def get_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ConfigError("study.data.dataset", unknown(name, DATASETS))
    return DATASETS[name]


# -- IDX ----------------------------------------------------------------------
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip or plain) into a numpy array."""
    path = Path(path)
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as e:
        raise ConfigError(str(path), f"cannot read IDX file: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(str(path), "not an IDX file (bad magic number)")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims)) if dims else 1
    body = raw[4 + 4 * ndim:]
    if len(body) != count * dtype.itemsize:
        raise ConfigError(str(path), f"IDX file is truncated: expected {count * dtype.itemsize} bytes of data, found {len(body)}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=False)


# -- locating and downloading ------------------------------------------------
def candidate_dirs(spec: DatasetSpec, data_dir: str | Path | None = None) -> list[Path]:
    roots: list[Path] = []
    if data_dir:
        roots.append(Path(data_dir))
    if os.environ.get("EVOMERGE_DATA_DIR"):
        roots.append(Path(os.environ["EVOMERGE_DATA_DIR"]))
    roots.append(user_cache_dir())
    out: list[Path] = []
    for r in roots:
        out.append(r / spec.name)
        if r.name == spec.name:
            out.append(r)
    out.extend(Path(d) for d in spec.system_dirs)
    return out


def _find(spec: DatasetSpec, dirs: list[Path]) -> Path | None:
    for d in dirs:
        if all(_file_in(d, f) for f in spec.files.values()):
            return d
    return None


def _file_in(d: Path, gz_name: str) -> Path | None:
    """The file or its uncompressed twin, if present."""
    for name in (gz_name, gz_name.removesuffix(".gz")):
        if (d / name).is_file():
            return d / name
    return None


def digest_of(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(spec: DatasetSpec, dest: Path, timeout: float = 20.0) -> Path:
    """Fetch the dataset's files into ``dest``, each checked against its checksum.

    A file whose digest does not match is deleted and reported; nothing half
    written is left behind.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for fname in spec.files.values():
        target = dest / fname
        if target.is_file():
            continue
        last_error = "no download address"
        for base in spec.urls:
            url = base + fname
            try:
                with urllib.request.urlopen(url, timeout=timeout) as resp, tempfile.NamedTemporaryFile(
                    dir=dest, delete=False, suffix=".part"
                ) as tmp:
                    shutil.copyfileobj(resp, tmp)
                    tmp_path = Path(tmp.name)
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                last_error = f"{url}: {getattr(e, 'reason', e)}"
                continue
            want = spec.checksums.get(fname)
            if want:
                algo, _, hexdigest = want.partition(":")
                got = digest_of(tmp_path, algo)
                if got != hexdigest:
                    tmp_path.unlink(missing_ok=True)
                    raise DataNotFoundError(
                        f"data.{spec.name}", f"checksum mismatch for {fname} from {url}: got {algo} {got}, expected {hexdigest}")
            tmp_path.replace(target)
            break
        else:
            raise DataNotFoundError(f"data.{spec.name}", f"cannot download {fname} ({last_error})")
    return dest


def locate(spec: DatasetSpec, data_dir: str | Path | None = None, allow_download: bool = True) -> Path:
    if data_dir and not Path(data_dir).is_dir():  # (a mistyped folder fell through to $EVOMERGE_DATA_DIR in silence)
        raise ConfigError("--data-dir", f"{data_dir}: no such folder; allowed: a folder holding {spec.name}/ (or "
                                        "leave it out: $EVOMERGE_DATA_DIR, the user cache, then system places)")
    dirs = candidate_dirs(spec, data_dir)
    found = _find(spec, dirs)
    if found is not None:
        return found
    names = ", ".join(spec.files.values())
    if allow_download and spec.urls:
        try:
            return download(spec, user_cache_dir() / spec.name)
        except DataNotFoundError as e:
            reason = e.message
    else:
        reason = "download disabled"
    raise DataNotFoundError(
        f"data.{spec.name}",
        f"files not found ({names}); put them in {dirs[0]} or pass --data-dir=DIR / set EVOMERGE_DATA_DIR "
        f"(looked in: {', '.join(str(d) for d in dirs)}; {reason})",
    )


# -- the loaded data ----------------------------------------------------------
class Data:
    """A dataset preloaded as uint8 tensors, with a validation split carved from
    the training set. The test set is reachable only through :meth:`test`."""

    def __init__(self, spec: DatasetSpec, train_x, train_y, val_x, val_y, test_x, test_y, train_index):
        self.spec = spec
        self.train_x, self.train_y = train_x, train_y  # uint8 [N, 28, 28], int64 [N]
        self.val_x, self.val_y = val_x, val_y
        self._test = (test_x, test_y)
        self.train_index = train_index  # positions in the original training file
        self.groups = None  # the file each training example comes from (dataset "text"; partition "by_file")
        self.test_accesses = 0

    @property
    def n_classes(self) -> int:
        return self.spec.n_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def test(self):
        """The test set (images, labels). Each call is counted in ``test_accesses``."""
        self.test_accesses += 1
        return self._test


def load(
    name: str = "mnist",
    data_dir: str | Path | None = None,
    *,
    val_size: int = 5000,
    train_size: int = 0,
    split_seed: int = 0,
    allow_download: bool = True,
) -> Data:
    """Load a dataset and carve a validation split from its training set.

    ``train_size`` > 0 keeps only that many training samples (after the split),
    for small studies; the choice is seeded by ``split_seed``.
    """
    import torch

    spec = get_spec(name)
    d = locate(spec, data_dir, allow_download)
    arrays = {}
    for (split, part), fname in spec.files.items():
        arrays[split, part] = read_idx(_file_in(d, fname))
    for split in SPLITS:
        n_img, n_lab = len(arrays[split, "images"]), len(arrays[split, "labels"])
        if n_img != n_lab:
            raise ConfigError(str(d), f"{split}: {n_img} images but {n_lab} labels")
    val_idx, train_idx = carve(len(arrays["train", "labels"]), val_size, train_size, split_seed)
    tx, ty = arrays["train", "images"], arrays["train", "labels"].astype(np.int64)

    def t(a):
        return torch.from_numpy(np.array(a, copy=True, order="C"))

    return Data(
        spec,
        t(tx[train_idx]), t(ty[train_idx]),
        t(tx[val_idx]), t(ty[val_idx]),
        t(arrays["test", "images"]), t(arrays["test", "labels"].astype(np.int64)),
        train_idx,
    )


def carve(n: int, val_size: int, train_size: int, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions of the validation split and of the training samples kept, of ``n``."""
    if not 0 < val_size < n:
        raise ConfigError("study.data.val_size", f"{val_size} is out of range; allowed: [1, {n - 1}]")
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([split_seed, 0x5EED]))).permutation(n)
    val_idx, train_idx = np.sort(perm[:val_size]), perm[val_size:]
    if train_size:
        if not 0 < train_size <= len(train_idx):
            raise ConfigError("study.data.train_size", f"{train_size} is out of range; allowed: [0, {len(train_idx)}]")
        train_idx = train_idx[:train_size]
    return val_idx, np.sort(train_idx)


# -- a user's data (study.data.loader) ------------------------------------------
LOADER = "study.data.loader"


def load_spec(d, data_dir: str | Path | None = None, base_dir: str | Path | None = None) -> Data:
    """The data of a study's ``[data]``: a user's loader, or a named dataset's files."""
    if getattr(d, "loader", ""):
        return load_user(d.loader, base_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)
    if d.dataset == "text":
        from .text import load_text

        return load_text(d, base_dir)
    return load(d.dataset, data_dir, val_size=d.val_size, train_size=d.train_size, split_seed=d.seed)


def load_study(study, data_dir: str | Path | None = None) -> Data:
    """The data a study's runs read, split as they split it, for a loop of your own that deploys its policy:
    ``study`` is a name, a path or a Study (``evomerge.study.load``); ``train_x`` and ``train_y`` are its training
    examples (a named dataset's raw images, a user's loader's tensors, a text corpus's windows: ``train_x`` the
    inputs, ``train_y`` the next bytes), ``val_x`` and ``val_y`` the validation examples its runs are judged by,
    ``test()`` its test set. A user's loader and a corpus are found relative to the study's file, as a search finds
    them; ``data_dir`` (or ``EVOMERGE_DATA_DIR``) where a named dataset's files are."""
    from .study import Study, check_given, load as load_study_file

    check_given(study)  # a name, a path or a Study: else one line naming `study`
    st = study if isinstance(study, Study) else load_study_file(study)
    return load_spec(st.data, data_dir, st.path.parent if st.path is not None else None)


def _is_dataset(obj) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not hasattr(obj, "shape")


def _materialise(ds, which: str, ref: str):
    """A torch ``Dataset`` of ``(x, y)`` items as two tensors (read once)."""
    import torch

    xs, ys = [], []
    try:
        for i in range(len(ds)):
            x, y = ds[i]
            xs.append(torch.as_tensor(x))
            ys.append(torch.as_tensor(y))
        return torch.stack(xs), torch.stack(ys)
    except Exception as e:  # noqa: BLE001 - the user's data: one line naming the field
        from .userref import one_line

        raise ConfigError(LOADER, f"{ref}: the {which} dataset's items must be (input, label) pairs of one shape: "
                                  f"{one_line(e)}") from None


def load_user(ref: str, base_dir: str | Path | None = None, *, val_size: int = 5000, train_size: int = 0,
              split_seed: int = 0) -> Data:
    """A user's data: ``ref`` names a function returning ``(train_x, train_y, test_x, test_y)``
    (tensors or arrays; labels integer classes) or ``(train_dataset, test_dataset)`` (torch
    Datasets of ``(x, y)``, read once). Inputs keep their kind (:func:`input_type`: integer token ids as int64,
    anything else as float32, as the loader gave them: it normalises). Labels are integer classes, one per input
    ``[N]`` or one per position ``[N, T]`` (``-100``: ignored), or float targets for a loss that takes them
    (``[run] loss``, checked by :mod:`evomerge.task`); the validation split is carved from the training set as for
    the named datasets."""
    import torch

    from .userref import raised, resolve

    fn = resolve(ref, LOADER, base_dir, "mydata:load")
    try:
        out = fn()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming the field
        raise ConfigError(LOADER, f"{ref} raised {raised(e, base_dir)}") from None
    want = "(train_x, train_y, test_x, test_y) tensors or (train_dataset, test_dataset)"
    if isinstance(out, (tuple, list)) and len(out) == 2 and all(_is_dataset(o) for o in out):
        out = (*_materialise(out[0], "training", ref), *_materialise(out[1], "test", ref))
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        got = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else type(out).__name__
        loaders = [type(o).__name__ for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if hasattr(o, "dataset") and hasattr(o, "batch_size")]  # (a 2-tuple of DataLoaders read as right)
        if loaders:
            got += (f" of {loaders[0]}s" if len(loaders) > 1 else f" holding a {loaders[0]}") \
                if isinstance(out, (tuple, list)) else ""  # (a bare one: "returned DataLoader")
            want += "; a DataLoader's .dataset is its Dataset (the runs batch the examples themselves)"
        raise ConfigError(LOADER, f"{ref} returned {got}; expected {want}")
    names = ("train_x", "train_y", "test_x", "test_y")
    ts = []
    for name, v in zip(names, out):
        try:
            ts.append(torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v))
        except Exception:  # noqa: BLE001
            raise ConfigError(LOADER, f"{ref} returned {type(v).__name__} as {name}; expected a tensor or an array") from None
    tx, ty, sx, sy = ts
    for name, x, y in (("train", tx, ty), ("test", sx, sy)):
        if y.is_complex() or y.dtype == torch.bool or y.dim() == 0:
            raise ConfigError(LOADER, f"{ref}: {name}_y are {y.dtype} of shape {list(y.shape)}; labels must be integer "
                                      "classes (int64, one per input or one per position) or float targets")
        if len(x) != len(y):
            raise ConfigError(LOADER, f"{ref}: {name}_y has shape {list(y.shape)} for {name}_x of shape {list(x.shape)}; "
                                      "expected one label (or one row of labels) per input")
        if not (x.dtype.is_floating_point or x.dtype in (torch.uint8, *_integers())):
            raise ConfigError(LOADER, f"{ref}: {name}_x are {x.dtype}; expected numbers")
        if len(y) and not y.dtype.is_floating_point and int(y.min()) < IGNORE_LABEL:
            raise ConfigError(LOADER, f"{ref}: {name}_y holds {int(y.min())}; labels must be classes 0, 1, ... "
                                      f"(or {IGNORE_LABEL}: a position the loss ignores)")
        if len(y) and not y.dtype.is_floating_point and bool(((y < 0) & (y != IGNORE_LABEL)).any()):
            bad = int(y[(y < 0) & (y != IGNORE_LABEL)][0])
            raise ConfigError(LOADER, f"{ref}: {name}_y holds {bad}; labels must be classes 0, 1, ... "
                                      f"(or {IGNORE_LABEL}: a position the loss ignores)")
    if tuple(sx.shape[1:]) != tuple(tx.shape[1:]):
        raise ConfigError(LOADER, f"{ref}: test_x inputs have shape {list(sx.shape[1:])}, train_x {list(tx.shape[1:])}")
    if tuple(sy.shape[1:]) != tuple(ty.shape[1:]) or sy.dtype.is_floating_point != ty.dtype.is_floating_point:
        raise ConfigError(LOADER, f"{ref}: test_y are {sy.dtype} {list(sy.shape[1:])} per input, train_y "
                                  f"{ty.dtype} {list(ty.shape[1:])}")
    if len(ty) < 2:
        raise ConfigError(LOADER, f"{ref}: {len(ty)} training examples; need at least 2")
    n_classes = 0 if ty.dtype.is_floating_point else int(ty.max()) + 1  # for the label skew; the model's output decides
    if ty.dim() == 1 and n_classes and len(sy) and int(sy.max()) >= n_classes:
        raise ConfigError(LOADER, f"{ref}: test_y holds class {int(sy.max())}, which the training labels never use "
                                  f"(classes 0..{n_classes - 1})")
    spec = DatasetSpec(name=ref, files={}, mean=0.0, std=1.0, n_classes=n_classes)
    val_idx, train_idx = carve(len(ty), val_size, train_size, split_seed)
    tx, ty, sx, sy = input_type(tx), label_type(ty), input_type(sx), label_type(sy)
    for name, t in (("train_x", tx), ("train_y", ty), ("test_x", sx), ("test_y", sy)):
        # (a NaN in the validation rows made every run's loss NaN with status ok, one in the training rows every
        # policy's run diverged, and the search blamed the policies)
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).reshape(len(t), -1).any(dim=1).nonzero()
            raise ConfigError(LOADER, f"{ref}: {name} holds {float(t[~torch.isfinite(t)][0])} in {len(bad)} of its "
                                      f"{len(t)} rows (the first: row {int(bad[0])}, as float32); allowed: finite "
                                      "numbers")
    vi, ti = torch.as_tensor(val_idx), torch.as_tensor(train_idx)
    return Data(spec, tx[ti].contiguous(), ty[ti].contiguous(), tx[vi].contiguous(), ty[vi].contiguous(),
                sx.contiguous(), sy.contiguous(), train_idx)


#: the one rule for the types of a loader's inputs (data.load_user) and of every minibatch (engine.setup.normalise):
#: integer inputs (token ids) stay integers, as int64, so an embedding receives them unchanged; float inputs
#: become float32; uint8 from a loader becomes float32 as the loader gave it (the named datasets' uint8 images
#: are scaled by their mean and deviation in normalise)
IGNORE_LABEL = -100


def _integers():
    import torch

    return (torch.int8, torch.int16, torch.int32, torch.int64)


def input_type(x):
    """A loader's inputs: integer ids as int64, everything else as float32."""
    import torch

    return x.to(torch.int64) if x.dtype in _integers() else x.to(torch.float32)


def label_type(y):
    """Labels: integer classes as int64, float targets as float32."""
    import torch

    return y.to(torch.float32) if y.dtype.is_floating_point else y.to(torch.int64)


# -- partitions ---------------------------------------------------------------
PARTITIONS = ("iid", "dirichlet", "by_file")


def partition(labels: np.ndarray, workers: int, kind: str = "iid", *, alpha: float = 0.5, seed: int = 0,
              min_size: int = 1, groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Split sample positions over workers: ``iid`` (equal shards, shuffled) or
    ``dirichlet`` (label-skewed: each class is divided by proportions drawn from
    Dirichlet(alpha); smaller alpha, more skew). Seeded; every sample is used once."""
    labels = np.asarray(labels)
    n = len(labels)
    by_class = labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer)  # what dirichlet splits by
    if kind == "by_file":
        if groups is None:
            raise ConfigError("study.data.partition", "'by_file' needs a corpus of files (dataset 'text'); allowed "
                                                      f"here: iid{', dirichlet' if by_class else ''}")
        return _by_file(groups, workers, min_size)
    if kind == "dirichlet" and not by_class:
        raise ConfigError("study.data.partition", f"'dirichlet' splits by class and needs one class label per "
                                                  f"example; the labels are {labels.dtype} of shape "
                                                  f"{list(labels.shape[1:]) or 'one'} per example; allowed: iid"
                                                  + (", by_file" if groups is not None else ""))
    if workers < 1 or workers > n:
        raise ConfigError("study.run.workers", f"{workers} is out of range; allowed: [1, {n}] for {n} samples")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xDA7A])))
    if kind == "iid":
        if n // workers < min_size:  # the smallest of an even split
            raise ConfigError("study.run.workers", f"{workers} workers of {n} training samples get {n // workers} "
                                                   f"each; each needs at least {min_size} (run.score_samples and one "
                                                   f"to train on); allowed: [1, {n // min_size}], or a smaller "
                                                   "run.score_samples")
        return [np.sort(s) for s in np.array_split(rng.permutation(n), workers)]
    if kind != "dirichlet":
        raise ConfigError("study.data.partition", unknown(kind, PARTITIONS))
    if not alpha > 0:
        raise ConfigError("study.data.alpha", f"{alpha} is out of range; allowed: (0, inf)")
    classes = np.unique(labels)
    for _attempt in range(100):
        shards: list[list[np.ndarray]] = [[] for _ in range(workers)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(workers, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for w, part in enumerate(np.split(idx, cuts)):
                shards[w].append(part)
        out = [np.sort(np.concatenate(s)) for s in shards]
        if min(len(s) for s in out) >= min_size:
            return out
    raise ConfigError("study.data.alpha", f"{alpha}: could not give every one of {workers} workers at least {min_size} samples; raise alpha or lower workers")


def _by_file(groups: np.ndarray, workers: int, min_size: int) -> list[np.ndarray]:
    """Whole files to workers (text's natural non-IID split): the largest file first, each to the worker holding
    the fewest examples so far (ties to the lowest worker); deterministic, no seed needed."""
    files, counts = np.unique(groups, return_counts=True)
    if len(files) < workers:
        raise ConfigError("study.data.partition", f"'by_file' gives whole files to workers, but the training split holds "
                                                  f"{len(files)} file{'s' * (len(files) != 1)} for {workers} workers; "
                                                  "allowed: iid, or more files")
    held = np.zeros(workers, dtype=np.int64)
    owner = {}
    for f in files[np.argsort(-counts, kind="stable")]:
        w = int(np.argmin(held))
        owner[int(f)] = w
        held[w] += counts[files == f][0]
    who = np.array([owner[int(g)] for g in groups])
    out = [np.flatnonzero(who == w) for w in range(workers)]
    if min(len(s) for s in out) < min_size:
        raise ConfigError("study.data.partition", f"'by_file' leaves a worker {min(len(s) for s in out)} windows; need "
                                                  f"at least {min_size}; allowed: iid, or fewer workers")
    return out


def label_skew(labels: np.ndarray, shards: list[np.ndarray], n_classes: int) -> float | None:
    """Mean total-variation distance between each shard's label histogram and the global one (0 = IID); None
    where it means nothing (labels that are not one class per example)."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
        return None
    glob = np.bincount(labels, minlength=n_classes) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[s], minlength=n_classes) / max(len(s), 1) - glob).sum() for s in shards]
    return float(np.mean(tv))
