"""A user's data (study.data.loader): tensors or torch Datasets, the validation split carved from
the training part as for the named datasets, the test part only through Data.test()."""

from __future__ import annotations

import pytest
import torch

from evomerge import data
from evomerge.errors import ConfigError

LOADERS = '''
import torch
from torch.utils.data import TensorDataset

g = torch.Generator().manual_seed(0)
X, Y = torch.rand(120, 3, 5, generator=g), torch.randint(0, 4, (120,), generator=g)
TX, TY = torch.rand(30, 3, 5, generator=g), torch.randint(0, 4, (30,), generator=g)

def tensors():
    return X, Y.int(), TX.double(), TY

def datasets():
    return TensorDataset(X, Y), TensorDataset(TX, TY)

def unseen_test_class():
    return X, Y % 3, TX, TY

def arrays():
    return X.numpy(), Y.numpy(), TX.numpy(), TY.numpy()
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("loaders")
    (f / "user_loaders.py").write_text(LOADERS)
    return f


@pytest.mark.parametrize("fn", ["tensors", "datasets", "arrays"])
def test_tensors_arrays_and_datasets_give_the_same_data(folder, fn):
    d = data.load_user(f"user_loaders:{fn}", folder, val_size=20, train_size=50, split_seed=3)
    ref = data.load_user("user_loaders:tensors", folder, val_size=20, train_size=50, split_seed=3)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.input_shape == (3, 5) and d.n_classes == 4
    assert torch.equal(d.train_x, ref.train_x) and torch.equal(d.val_y, ref.val_y)
    assert len(d.train_y) == 50 and len(d.val_y) == 20 and d.test_accesses == 0
    val, train = data.carve(120, 20, 50, 3)  # the same split as the named datasets get
    assert set(val.tolist()).isdisjoint(train.tolist()) and list(d.train_index) == list(train)
    tx, ty = d.test()
    assert len(ty) == 30 and d.test_accesses == 1


def test_a_test_class_the_training_labels_never_use_is_refused(folder):
    with pytest.raises(ConfigError, match=r"study.data.loader: user_loaders:unseen_test_class: test_y holds class 3"):
        data.load_user("user_loaders:unseen_test_class", folder, val_size=20)
