import functools
import gzip
import hashlib
import http.server
import shutil
import struct
import threading

import numpy as np
import pytest

from evomerge import data
from evomerge.errors import ConfigError, DataNotFoundError


def _write_idx(path, array, compress):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(raw)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_reader_plain_and_gzip(tmp_path, compress):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    f = tmp_path / "x.idx"
    _write_idx(f, a, compress)
    np.testing.assert_array_equal(data.read_idx(f), a)


def test_idx_reader_rejects_truncated_and_garbage(tmp_path):
    f = tmp_path / "t.idx"
    _write_idx(f, np.zeros((10, 5), np.uint8), compress=False)
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(ConfigError, match="truncated"):
        data.read_idx(f)
    f.write_bytes(b"hello world")
    with pytest.raises(ConfigError, match="magic"):
        data.read_idx(f)


def test_real_mnist_has_the_documented_shape_and_first_labels(data_dir):
    spec = data.get_spec("mnist")
    d = data.locate(spec, data_dir, allow_download=False)
    labels = data.read_idx(d / "train-labels-idx1-ubyte.gz")
    images = data.read_idx(d / "train-images-idx3-ubyte.gz")
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_validation_split_is_carved_from_train_and_disjoint(data_dir):
    full = data.load("mnist", data_dir, val_size=5000, split_seed=0)
    assert len(full.val_y) == 5000 and len(full.train_y) == 55000
    again = data.load("mnist", data_dir, val_size=5000, split_seed=0)
    assert np.array_equal(full.train_index, again.train_index)
    other = data.load("mnist", data_dir, val_size=5000, split_seed=1)
    assert not np.array_equal(full.train_index, other.train_index)
    val_positions = np.setdiff1d(np.arange(60000), full.train_index)
    assert len(val_positions) == 5000  # the rest of the file is the validation split, nothing shared


def test_test_set_accesses_are_counted(mnist):
    before = mnist.test_accesses
    x, y = mnist.test()
    assert len(y) == 10000 and mnist.test_accesses == before + 1


def test_fashion_mnist_from_debian_package():
    f = data.load("fashion-mnist", val_size=1000, allow_download=False)
    assert f.train_x.shape == (59000, 28, 28)
    assert f.spec.name == "fashion-mnist"


def test_data_dir_named_after_the_dataset_is_used_directly_but_not_for_another(data_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("EVOMERGE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = data.get_spec("mnist")
    assert data.locate(spec, data_dir / "mnist", allow_download=False) == data_dir / "mnist"
    fake_fashion = data.DatasetSpec(name="fashion-like", files=spec.files)
    with pytest.raises(DataNotFoundError):
        data.locate(fake_fashion, data_dir / "mnist", allow_download=False)


def test_missing_files_give_one_line_naming_files_and_place(tmp_path, monkeypatch):
    monkeypatch.delenv("EVOMERGE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = data.DatasetSpec(name="mnist", files=data.get_spec("mnist").files, urls=("http://127.0.0.1:9/",))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataNotFoundError) as e:
        data.locate(spec, tmp_path / "empty", allow_download=True)
    msg = str(e.value)
    assert "train-images-idx3-ubyte.gz" in msg and str(tmp_path / "empty") in msg and "--data-dir" in msg
    assert "\n" not in msg


@pytest.fixture
def mnist_server(data_dir):
    """A real HTTP server on 127.0.0.1 serving the shared MNIST files."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(data_dir / "mnist"))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


def test_download_verifies_checksums(tmp_path, monkeypatch, data_dir, mnist_server):
    monkeypatch.delenv("EVOMERGE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    files = data.get_spec("mnist").files
    good = {f: "sha256:" + hashlib.sha256((data_dir / "mnist" / f).read_bytes()).hexdigest() for f in files.values()}
    spec = data.DatasetSpec(name="mnist", files=files, checksums=good, urls=(mnist_server,))
    (tmp_path / "nothing-here").mkdir()
    d = data.locate(spec, tmp_path / "nothing-here")
    assert d == tmp_path / "cache" / "evomerge" / "mnist"
    assert data.read_idx(d / "train-labels-idx1-ubyte.gz")[:3].tolist() == [5, 0, 4]

    shutil.rmtree(d)
    bad = dict(good, **{"train-labels-idx1-ubyte.gz": "sha256:" + "0" * 64})
    spec = data.DatasetSpec(name="mnist", files=files, checksums=bad, urls=(mnist_server,))
    with pytest.raises(DataNotFoundError, match="checksum mismatch for train-labels"):
        data.locate(spec, tmp_path / "nothing-here")
    assert not (d / "train-labels-idx1-ubyte.gz").exists()
    assert not list(d.glob("*.part"))


def test_iid_partition_is_equal_seeded_and_complete():
    labels = np.random.default_rng(0).integers(0, 10, 1000)
    parts = data.partition(labels, 4, "iid", seed=3)
    assert [len(p) for p in parts] == [250] * 4
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))
    assert all(np.array_equal(a, b) for a, b in zip(parts, data.partition(labels, 4, "iid", seed=3)))


def test_dirichlet_partition_is_complete_and_skew_grows_as_alpha_shrinks():
    labels = np.random.default_rng(0).integers(0, 10, 5000)
    skews = []
    for alpha in (100.0, 1.0, 0.1):
        parts = data.partition(labels, 8, "dirichlet", alpha=alpha, seed=0)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(5000))
        skews.append(data.label_skew(labels, parts, 10))
    assert skews[0] < 0.1 < skews[1] < skews[2]
    assert data.label_skew(labels, data.partition(labels, 8, "iid"), 10) < 0.1


def test_partition_errors_name_the_field():
    with pytest.raises(ConfigError, match="study.data.partition"):
        data.partition(np.zeros(10, int), 2, "zipf")
    with pytest.raises(ConfigError, match="study.run.workers"):
        data.partition(np.zeros(10, int), 11)


@pytest.mark.unit
def test_an_iid_split_too_thin_for_the_score_slices_is_refused_naming_the_most_workers_that_fit():
    """(25 workers of 800 samples, 32 each, all of it the score slice: a ZeroDivisionError inside a trial.)"""
    labels = np.arange(800) % 10
    shards = data.partition(labels, 24, "iid", min_size=33)
    assert min(len(s) for s in shards) == 33
    with pytest.raises(data.ConfigError) as e:
        data.partition(labels, 25, "iid", min_size=33)
    assert e.value.field == "study.run.workers"
    assert "get 32 each; each needs at least 33" in str(e.value) and "allowed: [1, 24]" in str(e.value)
