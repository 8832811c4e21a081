"""Shared fixtures: the real MNIST files from ../shared/data and small studies built on them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("EVOMERGE_TEST_DATA_DIR", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert (DATA_DIR / "mnist" / "train-images-idx3-ubyte.gz").is_file(), f"MNIST not found under {DATA_DIR}"
    return DATA_DIR


@pytest.fixture(scope="session")
def mnist(data_dir):
    """MNIST with a 1000-sample validation split and 4000 training samples (loaded once)."""
    from evomerge import data

    return data.load("mnist", data_dir, val_size=1000, train_size=4000, split_seed=0)


def tiny_study(**run):
    """A small study: 4 workers on 4000 MNIST samples, MLP 784-32-10."""
    from evomerge import study

    raw = {
        "study": {"name": "tiny"},
        "data": {"dataset": "mnist", "val_size": 1000, "train_size": 4000, "partition": "iid", "seed": 0},
        "model": {"name": "mlp", "hidden": [32]},
        "run": {"workers": 4, "batch_size": 16, "steps": 60, "lr": 0.1, "rounds": 3, "score_samples": 8} | run,
    }
    return study.from_dict(raw)
