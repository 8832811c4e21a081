"""A user's own model, data and optimiser through the evomerge command: a factory and a loader
living in a folder outside the project (the digits example, copied), and every error of
study.model.factory / study.data.loader as one line with exit status 2."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import ROOT
from test_cli import evomerge

EXAMPLE = ROOT / "examples" / "digits"
TINY = """
[study]
name = "{name}"
[data]
loader = "{loader}"
val_size = 300
train_size = 600
partition = "iid"
[model]
factory = "{factory}"
options = {options}
[run]
workers = 4
batch_size = 16
steps = 24
rounds = 2
score_samples = 8
optimizer = "adamw"
lr = 0.01
[search]
n_trials = 3
[search.space]
mixing_weight = {{ kind = "float", low = 0.2, high = 1.0 }}
optimizer_state = {{ kind = "categorical", choices = ["keep", "average", "reset"] }}
"""


def user_study(folder, name="mine", loader="digits_models:load", factory="digits_models:classifier",
               options="{ hidden = 16 }"):
    folder.mkdir(exist_ok=True)
    shutil.copy(EXAMPLE / "digits_models.py", folder / "digits_models.py")
    f = folder / f"{name}.toml"
    f.write_text(TINY.format(name=name, loader=loader, factory=factory, options=options))
    return f


COUNTED = '''
import os
from pathlib import Path

import digits_models


def load():
    with open(Path(__file__).with_name("loads.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return digits_models.load()
'''


@pytest.mark.system
def test_user_factory_and_loader_outside_the_project_run_search_and_export(tmp_path):
    """The loader runs once per command: a search calls it once for its trials, the best model, the verdict and
    the end screen's baselines."""
    study = user_study(tmp_path / "elsewhere", loader="counted:load")
    (tmp_path / "elsewhere" / "counted.py").write_text(COUNTED)
    work = tmp_path / "cwd"  # neither the project nor the study's folder: the study's folder is looked in first
    work.mkdir()
    out = tmp_path / "run.json"
    p = evomerge("run", "--study", str(study), "--policy", "ring-gossip", "--quiet", "--json", str(out), cwd=work)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["final"]["step"] == 24 and r["final"]["val_accuracy"] > 0.5
    runs = tmp_path / "runs"
    p = evomerge("search", "--study", str(study), "--runs-dir", str(runs), "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    p = evomerge("status", "--study", str(study), "--runs-dir", str(runs), cwd=work)
    assert p.returncode == 0 and "3 complete" in p.stdout, p.stdout + p.stderr
    best = tmp_path / "best.json"
    p = evomerge("export", "--study", str(study), "--runs-dir", str(runs), "-o", str(best), cwd=work)
    assert p.returncode == 0, p.stderr
    assert json.loads(best.read_text())["policy"]["optimizer_state"] in ("keep", "average", "reset")
    loads = (tmp_path / "elsewhere" / "loads.txt").read_text().split()
    assert len(loads) == len(set(loads)) >= 2  # run and search, once each


SIGNALLED = '''
import os
import signal
import weakref
from pathlib import Path

import digits_models


def _stop():
    flag = Path(__file__).with_name("signalled")
    if not flag.exists():
        flag.write_text("")
        os.kill(os.getpid(), signal.SIGTERM)


def classifier(hidden=16):
    """A model whose finaliser sends the process SIGTERM once: the handler runs inside a callback of Python's own,
    whose exceptions Python prints as ignored and drops."""
    model = digits_models.classifier(hidden)
    weakref.finalize(model, _stop)
    return model
'''


@pytest.mark.system
def test_a_stop_signal_that_lands_in_a_callback_still_stops_the_search(tmp_path):
    """(A SIGTERM that arrived while Python ran a garbage collector's callback was printed as ignored, and the search
    went on to its verdict.) The signal is kept and the search stops at the next trial as interrupted, exit 130."""
    study = user_study(tmp_path / "elsewhere", factory="signalled:classifier")
    (tmp_path / "elsewhere" / "signalled.py").write_text(SIGNALLED)
    runs = tmp_path / "runs"
    p = evomerge("search", "--study", str(study), "--runs-dir", str(runs), "--quiet", cwd=tmp_path)
    assert (tmp_path / "elsewhere" / "signalled").exists()  # the signal was sent
    assert p.returncode == 130, p.stdout + p.stderr
    assert "interrupted: finished trials are kept" in p.stderr and "judging" not in p.stdout + p.stderr, p.stderr


BAD_MODULE = '''
import torch
from torch import nn

def not_a_module():
    return 3

def wants_ten_features():
    return nn.Linear(10, 10)

def float_labels():
    x = torch.rand(2000, 64)
    return x, torch.rand(2000), x[:10], torch.rand(10)

def a_dict():
    return {"x": 1}

class WithState(nn.Module):  # a recurrent habit: the outputs and the state
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x), x.mean()

def with_state():
    return WithState()

def column_labels():  # labels [N, 1], as a CSV's column comes
    x = torch.rand(2000, 64)
    y = torch.randint(0, 10, (2000, 1))
    return x, y, x[:10], y[:10]

def byte_tokens():  # token ids read as bytes (uint8)
    x = torch.randint(0, 256, (2000, 8), dtype=torch.uint8)
    return x, torch.randint(0, 10, (2000,)), x[:10], torch.randint(0, 10, (10,))

def embedding():
    return nn.Sequential(nn.Embedding(256, 8), nn.Flatten(), nn.Linear(64, 10))

def int_tokens():  # token ids up to 255, as int64
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2000, 8), generator=g)
    return x, torch.randint(0, 10, (2000,), generator=g), x[:10], torch.randint(0, 10, (10,), generator=g)

def small_embedding():  # a vocabulary of 16 for ids up to 255
    return nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(64, 10))

def broken():
    raise RuntimeError("the disk is gone\\nsecond line")

NOT_CALLABLE = 3
'''

CASES = {
    "factory not importable": (dict(factory="nosuchmodule:f"),
                               "error: study.model.factory: cannot import 'nosuchmodule' (looked in"),
    "factory missing function": (dict(factory="digits_models:nope"),
                                 "error: study.model.factory: module 'digits_models' ("),
    "factory wrong return type": (dict(factory="bad:not_a_module", options="{}"),
                                  "error: study.model.factory: bad:not_a_module returned int; expected a torch.nn.Module"),
    "factory not a function": (dict(factory="bad:NOT_CALLABLE", options="{}"), "error: study.model.factory: bad:NOT_CALLABLE is a int"),
    "factory bad format": (dict(factory="digits_models.classifier"),
                           "error: study.model.factory: 'digits_models.classifier' must be 'module:function'"),
    "factory options": (dict(options="{ depth = 3 }"),
                        "error: study.model.options: digits_models:classifier does not take 'depth'; allowed: hidden, batchnorm"),
    "inputs the model rejects": (dict(factory="bad:wants_ten_features", options="{}"),
                                 "error: study.model.factory: bad:wants_ten_features rejects the data's inputs of shape "
                                 "[4, 64]: RuntimeError: "),
    "forward returns a tuple": (dict(factory="bad:with_state", options="{}"),
                                "error: study.model.factory: bad:with_state's forward returns a tuple; expected one "
                                "tensor, the outputs the loss takes (return the logits alone)\n"),
    "labels [N, 1]": (dict(loader="bad:column_labels"),
                      "error: study.model.factory: digits_models:classifier returns outputs of shape [4, 10] for labels "
                      "of shape [4, 1]; cross-entropy expects [4, 1, C] (one logit per class); labels [N, 1] are one "
                      "class each: give them as [N] (y.squeeze(1))\n"),
    "byte token ids": (dict(loader="bad:byte_tokens", factory="bad:embedding", options="{}"),
                       "error: study.model.factory: bad:embedding rejects the data's inputs of shape [4, 8]: "
                       "RuntimeError: Expected tensor for argument #1 'indices'"),
    # (it said "IndexError: index out of range in self", not why)
    "vocabulary too small": (dict(loader="bad:int_tokens", factory="bad:small_embedding", options="{}"),
                             "error: study.model.factory: bad:small_embedding rejects the data's inputs of shape [4, 8]: "
                             "IndexError: index out of range in self (this batch holds token ids up to "),
    "loader not importable": (dict(loader="nosuchmodule:load"),
                              "error: study.data.loader: cannot import 'nosuchmodule' (looked in"),
    "loader missing function": (dict(loader="digits_models:nope"), "error: study.data.loader: module 'digits_models' ("),
    # (it said "'bad' is not a package")
    "loader named by its file": (dict(loader="bad.py:a_dict"),
                                 "error: study.data.loader: 'bad.py:a_dict' names a file; allowed: the module's name, as "
                                 "Python imports it (bad:a_dict), beside the study file or on sys.path\n"),
    "loader wrong return type": (dict(loader="bad:a_dict"),
                                 "error: study.data.loader: bad:a_dict returned dict; expected (train_x, train_y, "
                                 "test_x, test_y) tensors or (train_dataset, test_dataset)"),
    "float labels with cross-entropy": (dict(loader="bad:float_labels"),
                                        "error: study.run.loss: 'cross_entropy' takes integer class labels; the data's "
                                        "labels are torch.float32; allowed: integer labels (one per input, or one per "
                                        "position), or loss 'mse' or 'module:function' for float targets"),
    "loader raises": (dict(loader="bad:broken"),
                      "error: study.data.loader: bad:broken raised RuntimeError: the disk is gone"),
}


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    (folder / "bad.py").write_text(BAD_MODULE)
    return folder


# as a user's shell runs them, in a process of their own (what the process writes to its stderr outside Python's
# sys.stderr too); the others in this process (cli.main), where every warning is recorded, not once per place
IN_A_PROCESS = {"inputs the model rejects", "loader raises"}


@pytest.mark.system
@pytest.mark.parametrize("case", list(CASES))
def test_user_code_errors_are_one_line_exit_2_before_any_trial(bad_folder, case, tmp_path):
    import warnings

    from searchutil import cli

    change, line = CASES[case]
    study = user_study(bad_folder, name=case.replace(" ", "-"), **change)
    args = ("run", "--study", str(study), "--policy", "ring-gossip", "--quiet")
    if case in IN_A_PROCESS:
        p = evomerge(*args, cwd=tmp_path)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = cli(*args, cwd=tmp_path, data_dir=tmp_path)
        assert [str(w.message) for w in caught] == []
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith(line), p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    if case == "byte token ids":  # torch's own words, then why
        assert p.stderr.endswith(" (token ids must be integers: give them as int16, int32 or int64; inputs of uint8 "
                                 "are read as float32 images)\n")
    if case == "vocabulary too small":
        assert re.search(r"up to (\d+): an embedding needs at least (\d+) rows\)\n$", p.stderr), p.stderr


@pytest.mark.system
def test_a_search_on_a_broken_factory_stops_before_storing_and_the_fixed_file_searches(bad_folder, tmp_path):
    """The factory's mistake is one line before the study is stored (no header, no progress bar, no store): the
    fixed file then searches under the same name, as a new study."""
    study = user_study(bad_folder, name="broken-search", factory="bad:wants_ten_features", options="{}")
    runs = tmp_path / "runs"
    p = evomerge("search", "--study", str(study), "--runs-dir", str(runs), "--quiet", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: study.model.factory: bad:wants_ten_features rejects"), \
        p.stderr
    assert p.stderr.count("\n") == 1 and p.stdout == ""
    assert not (runs / "broken-search").exists()
    user_study(bad_folder, name="broken-search")  # the factory fixed
    from searchutil import cli  # the searches that follow in this process (cli.main): a Python start-up less each

    p = cli("search", "--study", str(study), "--runs-dir", str(runs), "--quiet", "--n-trials", "1", "--no-verdict",
            cwd=tmp_path, data_dir=tmp_path)
    assert p.returncode == 0, p.stderr
    # the end table's baselines run without a verdict too, and say so (they sat silent for minutes); kept after
    assert re.search(r"^baselines: 4 on the study's seeds \[0\] for the table, 4 runs \(kept with the study for the "
                     r"next time\)$", p.stderr, re.M), p.stderr
    p = cli("search", "--study", str(study), "--runs-dir", str(runs), "--quiet", "--n-trials", "1", "--no-verdict",
            cwd=tmp_path, data_dir=tmp_path)
    assert p.returncode == 0 and "baselines:" not in p.stderr and "ring-gossip" in p.stdout, p.stderr
