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

def nan_inputs():
    x = X.clone()
    x[5, 1, 2] = x[9, 0, 0] = float("nan")
    return x, Y, TX, TY

def class_only_in_validation():  # class 9 in one row, which the validation split takes (val_size 20, seed 0)
    from evomerge.data import carve

    y = Y.clone()
    y[carve(120, 20, 0, 0)[0][3]] = 9
    return X, y, TX, TY

def lazy():  # a neighbour imported in the function's body, not at the top of the module
    import loader_helpers

    return loader_helpers.X, Y, TX, TY

def net():  # 4 logits: classes 0..3
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(15, 4))

def dataloaders():
    from torch.utils.data import DataLoader

    return DataLoader(TensorDataset(X, Y), batch_size=8), DataLoader(TensorDataset(TX, TY), batch_size=8)

def inf_targets():  # regression targets, one of the test set's too large for float32
    y = X.sum(dim=(1, 2))
    ty = TX.sum(dim=(1, 2)).double()
    ty[3] = 1e300
    return X, y, TX, ty
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


def test_inputs_or_targets_that_are_not_finite_are_refused_in_one_line(folder, capsys):
    """(A NaN in the validation rows gave every run a NaN loss with status ok, and the verdict failed; one in the
    training rows made every policy's run diverge: the search blamed the policies.)"""
    with pytest.raises(ConfigError, match=r"^study.data.loader: user_loaders:nan_inputs: train_x holds nan in 2 of its "
                                          r"120 rows \(the first: row 5, as float32\); allowed: finite numbers$"):
        data.load_user("user_loaders:nan_inputs", folder, val_size=20)
    with pytest.raises(ConfigError, match=r"^study.data.loader: user_loaders:inf_targets: test_y holds inf in 1 of its "
                                          r"30 rows \(the first: row 3, as float32\)"):
        data.load_user("user_loaders:inf_targets", folder, val_size=20)
    # as a user meets it: the command's one line, exit 2
    from evomerge import cli

    (folder / "nan.toml").write_text('[study]\nname = "nan"\n[data]\nloader = "user_loaders:nan_inputs"\nval_size = 20\n'
                                     '[model]\nname = "mlp"\nhidden = [8]\n[run]\nworkers = 2\nsteps = 4\n'
                                     'batch_size = 8\n')
    assert cli.main(["run", "--study", str(folder / "nan.toml"), "--policy", "ring-gossip", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: study.data.loader: user_loaders:nan_inputs: train_x holds nan") and \
        len(err.strip().splitlines()) == 1, err


def test_a_class_only_the_validation_split_holds_is_one_line_naming_the_factory(folder, capsys):
    """(The training labels were checked against the model's logits, the validation split's were not: a class only
    there ended `evomerge run` with cross-entropy's `IndexError: Target 9 is out of bounds` and 38 lines.)"""
    from evomerge import cli

    (folder / "val9.toml").write_text('[study]\nname = "val9"\n[data]\nloader = "user_loaders:class_only_in_validation"\n'
                                      'val_size = 20\n[model]\nfactory = "user_loaders:net"\n[run]\nworkers = 2\n'
                                      'steps = 4\nbatch_size = 8\n')
    assert cli.main(["run", "--study", str(folder / "val9.toml"), "--policy", "ring-gossip", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: study.model.factory: ") and "returns 4 logits but the data hold class 9; expected " \
        "at least 10" in err and len(err.strip().splitlines()) == 1, err


def test_a_neighbour_imported_inside_the_loader_is_said_to_be_importable_only_at_the_top(folder):
    """(`No module named 'loader_helpers'`, with the file beside the study: the folder is on sys.path only while the
    study's module loads.)"""
    (folder / "loader_helpers.py").write_text("import torch\nX = torch.rand(120, 3, 5)\n")
    with pytest.raises(ConfigError, match=r"^study.data.loader: user_loaders:lazy raised ModuleNotFoundError: No "
                                          r"module named 'loader_helpers' \(loader_helpers is beside the study, but its "
                                          r"folder is importable only while the study's module loads: import "
                                          r"loader_helpers at the top of that module\)$"):
        data.load_user("user_loaders:lazy", folder, val_size=20)


def test_a_studys_data_for_a_loop_of_ones_own_is_what_its_runs_read(folder, tmp_path, monkeypatch):
    """(A new user deploying tiny-lm re-implemented its corpus's split from the docs' prose, and could not reproduce
    its seeded validation windows.) `evomerge.data.load_study` gives a study's data as its runs split it: a corpus
    copied elsewhere as tiny-lm.md says, and a user's loader beside the user's study file, from another folder."""
    import shutil
    from pathlib import Path

    from evomerge import study as study_mod
    from evomerge.engine.setup import prepare

    shipped = study_mod.load("tiny-lm")
    mine = tmp_path / "my-lm"
    mine.mkdir()
    text = shipped.path.read_text().replace('name = "tiny-lm"', 'name = "my-lm"').replace(
        'path = "data/pystdlib/text"', f'path = "{shipped.path.parent / "data/pystdlib/text"}"')
    (mine / "tiny-lm.toml").write_text(text)
    shutil.copy(shipped.path.parent / "tinylm.py", mine)
    monkeypatch.chdir(tmp_path)  # (not the study's folder: the corpus and loader are found from the study file)
    for ref in ("tiny-lm", mine / "tiny-lm.toml", str(mine / "tiny-lm.toml")):
        got = data.load_study(ref)
        want = prepare(study_mod.load(ref)).data
        for k in ("train_x", "train_y", "val_x", "val_y"):
            assert torch.equal(getattr(got, k), getattr(want, k)), (ref, k)
        assert got.val_x.shape == (500, 64) and got.train_x.dtype == torch.int64
    (folder / "s.toml").write_text('[study]\nname = "u"\n[data]\nloader = "user_loaders:tensors"\nval_size = 20\n'
                                   '[model]\nfactory = "user_loaders:net"\n[run]\nworkers = 2\nsteps = 4\n')
    got, want = data.load_study(Path(folder / "s.toml")), prepare(study_mod.load(folder / "s.toml")).data
    assert torch.equal(got.val_x, want.val_x) and torch.equal(got.train_y, want.train_y) and len(got.val_y) == 20
    with pytest.raises(ConfigError) as e:
        data.load_study(3)
    assert e.value.field == "study"


def test_a_loader_that_returns_dataloaders_is_told_to_return_their_datasets(folder):
    """(A user's loader returned (DataLoader, DataLoader) and was told it "returned a 2-tuple; expected ... or
    (train_dataset, test_dataset)": two things, as asked, it read.)"""
    with pytest.raises(ConfigError) as e:
        data.load_user("user_loaders:dataloaders", folder)
    assert e.value.field == "study.data.loader" and str(e.value) == (
        "study.data.loader: user_loaders:dataloaders returned a 2-tuple of DataLoaders; expected (train_x, train_y, "
        "test_x, test_y) tensors or (train_dataset, test_dataset); a DataLoader's .dataset is its Dataset (the runs "
        "batch the examples themselves)"), str(e.value)
