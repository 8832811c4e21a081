"""Any model, any task (issue 27): a user's own models and data, each from a study file in a folder outside the
project, as a new user writes them: recurrent layers, dropout, token inputs, a language model, regression with
MSE and with the user's own loss. Each must learn (better than chance, than a bigram model, than the best
constant), and each bad input is one line naming its field."""

from __future__ import annotations

import contextlib
import json
import importlib
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import free_port
from evomerge import simulate
from evomerge.backends.population import Member, run_population
from evomerge.engine.schedule import layer_keys
from evomerge.engine.state import initial_row
from evomerge.errors import ConfigError
from evomerge.models.generic import GenericModel
from evomerge.policy import MergePolicy
from evomerge.study import load

HERE = Path(__file__).resolve().parent
LOADERS = '''
import torch
import torch.nn.functional as F

from evomerge import data

DATA_DIR = {data_dir!r}


def _mnist():
    d = data.load("mnist", DATA_DIR, val_size=1000, train_size=5000, split_seed=0)
    x = torch.cat([d.train_x, d.val_x]).float() / 255.0
    y = torch.cat([d.train_y, d.val_y])
    return x[:5000], y[:5000], x[5000:], y[5000:]


def images():
    return _mnist()


def tokens():
    """Each image as 49 token ids: its 7x7 average grey levels in 8 steps (int64)."""
    tx, ty, sx, sy = _mnist()
    tok = lambda x: (F.avg_pool2d(x.unsqueeze(1), 4).flatten(1) * 7.999).long()
    return tok(tx), ty, tok(sx), sy


def tokens_one_past():
    """tokens() with the id 8 in example 3000 on: a vocabulary one short for TokenTransformer (8)."""
    tx, ty, sx, sy = tokens()
    tx[3000:, 5] = 8
    return tx, ty, sx, sy


def tokens_hashed():
    """Ids up to 1000, which HashedTokens maps into its 8 entries itself."""
    tx, ty, sx, sy = tokens()
    return tx * 125, ty, sx * 125, sy


def halves():
    """Regression: the top half of an image -> the mean ink of its bottom half (x10), targets [N, 1]."""
    tx, _, sx, _ = _mnist()
    f = lambda x: (x[:, :14].contiguous(), x[:, 14:].mean((1, 2)).unsqueeze(1) * 10)
    return (*f(tx), *f(sx))


def flat_halves():
    """halves() with targets [N], beside a model's outputs [B, 1]."""
    tx, ty, sx, sy = halves()
    return tx, ty.squeeze(1), sx, sy.squeeze(1)


def float_labels():
    tx, ty, sx, sy = _mnist()
    return tx, ty.float(), sx, sy.float()


def two_labels():
    tx, ty, sx, sy = _mnist()
    return tx, torch.stack([ty, ty], 1).float(), sx, torch.stack([sy, sy], 1).float()


def huber(out, y):
    return F.smooth_l1_loss(out, y, reduction="none").flatten(1).mean(1)


def not_per_example(out, y):
    return F.mse_loss(out, y)


def raises(out, y):
    return out[:, 99]


def focal(out, y):
    """A loss of the user's own on class labels."""
    logp = out.log_softmax(1).gather(1, y.unsqueeze(1)).squeeze(1)
    return -(1 - logp.exp()) ** 2 * logp
'''
# real text: a fixed list of the Python standard library's sources (the test's own corpus, split by file)
CORPUS = [importlib.import_module(m).__file__ for m in ("textwrap", "string", "shlex", "glob", "fnmatch", "bisect",
                                                        "heapq", "keyword", "colorsys", "copy", "numbers", "abc")]

FAMILIES = {  # name: (data, model, options, loss, objective, what it must reach)
    "gru": ('loader = "mydata:images"', "rnn", '{ cell = "gru" }', "cross_entropy", "val_accuracy", 0.3),
    "lstm": ('loader = "mydata:images"', "rnn", '{ cell = "lstm" }', "cross_entropy", "val_accuracy", 0.3),
    "dropout-mlp": ('loader = "mydata:images"', "dropout_mlp", "{}", "cross_entropy", "val_accuracy", 0.5),
    "dropout-cnn": ('loader = "mydata:images"', "dropout_cnn", "{}", "cross_entropy", "val_accuracy", 0.3),
    "transformer": ('loader = "mydata:tokens"', "TokenTransformer", "{}", "cross_entropy", "val_accuracy", 0.3),
    "embedding-bag": ('loader = "mydata:tokens"', "Bag", "{}", "cross_entropy", "val_accuracy", 0.3),
    "language-model": ('dataset = "text"\npath = "corpus"\ncontext = 32', "TinyLM", "{}", "cross_entropy",
                       "val_perplexity", "bigram"),
    "mse": ('loader = "mydata:halves"', "regressor", "{}", "mse", "val_loss", "constant"),
    "user-loss": ('loader = "mydata:halves"', "regressor", "{}", "mydata:huber", "val_loss", "constant"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, data_dir):
    """The user's folder, outside the project: their models, their loaders and losses, their text."""
    d = tmp_path_factory.mktemp("my-project")
    shutil.copy(HERE / "user_any" / "mymodels.py", d / "mymodels.py")
    (d / "mydata.py").write_text(LOADERS.format(data_dir=str(data_dir)))
    (d / "corpus").mkdir()
    for f in CORPUS:
        shutil.copy(f, d / "corpus" / Path(f).name)
    return d


def write_study(folder: Path, name: str, data: str, factory: str, options: str = "{}", loss: str = "cross_entropy",
                metric: str = "val_accuracy", steps: int = 150, execution: str = "auto", workers: int = 4,
                extra: str = "") -> Path:
    p = folder / f"{name}.toml"
    p.write_text(f"""[study]
name = "{name}"

[data]
{data}
val_size = 300
partition = "iid"

[model]
factory = "mymodels:{factory}"
options = {options}
execution = "{execution}"

[run]
workers = {workers}
batch_size = 32
steps = {steps}
rounds = 2
optimizer = "adamw"
lr = 0.01
loss = "{loss}"
{extra}
[objectives]
metrics = ["{metric}"]
""")
    return p


def bigram_perplexity(d) -> float:
    """A bigram model of the training bytes (add-one), on the validation windows."""
    counts = torch.ones(256, 256)
    counts.index_put_((d.train_x.flatten(), d.train_y.flatten()), torch.ones(d.train_y.numel()), accumulate=True)
    logp = (counts / counts.sum(1, keepdim=True)).log()
    return math.exp(float(-logp[d.val_x.flatten(), d.val_y.flatten()].mean()))


def constant_loss(d, loss: str) -> float:
    """The best constant predictor's validation loss (the training targets' mean for MSE; the best of a scan of
    constants for the user's Huber loss)."""
    import torch.nn.functional as F

    if loss == "mse":
        return float((d.val_y - d.train_y.mean()).pow(2).mean())
    cs = torch.linspace(float(d.train_y.min()), float(d.train_y.max()), 200)
    return min(float(F.smooth_l1_loss(torch.full_like(d.train_y, float(c)), d.train_y)) for c in cs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_learns_through_the_users_own_study(folder, family):
    data, factory, options, loss, metric, reach = FAMILIES[family]
    setup = simulate.prepare(load(write_study(folder, f"my-{family}", data, factory, options, loss, metric)))
    res = simulate.simulate(setup, MergePolicy(), 0, device="cpu")  # ring gossip
    f = res.final
    assert res.status == "ok"
    if reach == "bigram":
        assert setup.data.train_x.dtype == torch.int64 and setup.data.train_y.shape[1:] == (32,)
        assert f.val_perplexity is not None and f.val_perplexity == pytest.approx(math.exp(f.val_loss), rel=1e-6)
        assert f.val_perplexity < bigram_perplexity(setup.data), (f.val_perplexity, bigram_perplexity(setup.data))
        assert 0 < f.val_accuracy < 1  # per token
    elif reach == "constant":
        assert f.val_accuracy is None and "val_accuracy" not in res.metrics()  # no meaningless argmax
        assert f.val_loss < 0.7 * constant_loss(setup.data, loss), (f.val_loss, constant_loss(setup.data, loss))
        assert res.label_skew is None
    else:
        assert f.val_accuracy > reach, f.val_accuracy  # chance is 0.1
    if family in ("gru", "lstm"):  # vmap cannot batch recurrent layers: the loop, never a refusal
        assert setup.model.execution == "loop" and "vmap cannot batch it" in setup.model.execution_reason
    if family.startswith("dropout"):
        assert setup.model.random and setup.model.execution == "loop"
    if family == "transformer":
        assert setup.data.train_x.dtype == torch.int64  # token ids reach the embedding unchanged


class Scale(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.w)


def masks(model: GenericModel, workers: list[int], step: int, execution: str) -> torch.Tensor:
    """The dropout masks each worker draws at a local step (1 kept, 0 dropped), ``[len(workers), 32, 64]``."""
    st = model.stack(len(workers))
    st.set_rows(model.init(torch.Generator().manual_seed(0)).expand(len(workers), -1))
    with torch.no_grad():
        out = model._call(st.params, torch.ones(len(workers), 32, 64), True, 0,
                          keys=layer_keys(7, workers, step), execution=execution)
    return (out != 0).float()


def test_dropout_masks_are_per_worker_and_do_not_depend_on_w_or_the_batching():
    p = 0.3
    model = GenericModel(lambda: Scale(p), (64,), 64)
    assert model.random
    m = masks(model, [0, 1, 2, 3], step=5, execution="loop")
    assert abs(float(m.mean()) - (1 - p)) < 0.02  # the keep rate
    agree = float((m[0] == m[1]).float().mean())
    assert abs(agree - (p * p + (1 - p) ** 2)) < 0.04  # two workers' masks are independent
    # worker 2's masks are a function of (seed, worker, step): the same alone, among 8, or at another position
    alone = masks(model, [2], step=5, execution="loop")
    among = masks(model, [5, 6, 7, 2, 0, 1, 3, 4], step=5, execution="loop")
    assert torch.equal(m[2], alone[0]) and torch.equal(m[2], among[3])
    assert not torch.equal(m[2], masks(model, [2], step=6, execution="loop")[0])  # a new mask each step
    # a forced stacked strategy draws different masks per worker too (vmap's randomness="different")
    s = masks(model, [0, 1, 2, 3], step=5, execution="stacked")
    assert abs(float(s.mean()) - (1 - p)) < 0.02 and not torch.equal(s[0], s[1])
    assert torch.equal(s, masks(model, [0, 1, 2, 3], step=5, execution="stacked"))  # reproducible
    # torch's own generator is left as it was
    state = torch.random.get_rng_state()
    masks(model, [0, 1], step=1, execution="loop")
    assert torch.equal(state, torch.random.get_rng_state())


def test_a_dropout_run_is_reproducible_and_the_same_in_a_population(folder):
    setup = simulate.prepare(load(write_study(folder, "my-dropout-pop", 'loader = "mydata:images"', "dropout_mlp",
                                              steps=30)))
    policy = MergePolicy()
    a = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    b = simulate.simulate(setup, policy, 3, device="cpu", keep_params=True)
    assert torch.equal(a.params, b.params)
    # two members stacked as one batch: each worker's masks are its own, whoever else is in the batch
    pop = run_population(setup, [Member(policy, 3), Member(MergePolicy(scheme="none"), 4)], device="cpu",
                         keep_params=True)
    assert torch.allclose(pop[0].params, a.params, atol=1e-5), (pop[0].params - a.params).abs().max()
    assert [h.val_accuracy for h in pop[0].history] == pytest.approx([h.val_accuracy for h in a.history], abs=2e-3)


def test_stacked_and_loop_give_the_same_run_for_a_model_without_random_layers(folder):
    runs = {}
    for execution in ("stacked", "loop"):
        setup = simulate.prepare(load(write_study(folder, f"my-bn-{execution}", 'loader = "mydata:images"',
                                                  "bn_cnn", steps=30, execution=execution)))
        assert setup.model.execution == execution and setup.model.execution_reason == "forced"
        runs[execution] = simulate.simulate(setup, MergePolicy(), 1, device="cpu", keep_params=True)
    a, b = runs["stacked"], runs["loop"]
    assert torch.allclose(a.params, b.params, atol=1e-4), (a.params - b.params).abs().max()
    for ha, hb in zip(a.history, b.history):
        assert ha.val_loss == pytest.approx(hb.val_loss, abs=1e-4)
        assert ha.val_accuracy == pytest.approx(hb.val_accuracy, abs=2e-3)
        assert ha.bytes == hb.bytes and ha.merges == hb.merges


@pytest.mark.parametrize("change, field, message", [
    (dict(loss="hinge"), "study.run.loss", r"unknown 'hinge'; allowed: cross_entropy, mse or 'module:function'"),
    (dict(loss="mydata:nowhere"), "study.run.loss", r"nowhere"),
    (dict(factory="TokenTransfomer"), "study.model.factory",
     r"has no 'TokenTransfomer'; allowed: Bag, .*HashedTokens, .*TokenTransformer.*; did you mean TokenTransformer\?$"),
    (dict(loss="mydata:not_per_example", data='loader = "mydata:halves"', factory="regressor", metric="val_loss"),
     "study.run.loss", r"returned \[\] for a batch of 4; expected per-example losses of shape \[4\]"),
    (dict(data='loader = "mydata:float_labels"'), "study.run.loss",
     r"'cross_entropy' takes integer class labels; the data's labels are torch.float32"),
    (dict(data='loader = "mydata:two_labels"', loss="mse", metric="val_loss"), "study.run.loss",
     r"the model's outputs have shape \[4, 10\] and the targets \[4, 2\]; they must match exactly"),
    # (a new user's [N] targets: the line had no allowed part, and named only the loss)
    (dict(data='loader = "mydata:flat_halves"', factory="regressor", loss="mse", metric="val_loss"), "study.run.loss",
     r"outputs have shape \[4, 1\] and the targets \[4\]; they must match exactly \(no broadcasting\); allowed: "
     r"targets from study.data of the outputs' shape, or a study.model.factory whose outputs have the targets' "
     r"\(y.unsqueeze\(1\) gives targets \[N, 1\]; out.squeeze\(1\) in the model's forward, outputs \[B\]\)$"),
    (dict(data='loader = "mydata:halves"', factory="regressor", loss="mse"), "study.objectives.metrics",
     r"'val_accuracy' needs class labels; the study's loss is 'mse'; allowed here: val_loss, bytes, and with an "
     r"\[environment\] time_to_target, loss_at_time, sim_time$"),  # (it said "and the time metrics": accuracy_at_time too)
    (dict(metric="val_perplexity"), "study.objectives.metrics", r"'val_perplexity' needs labels per position"),
    (dict(data='dataset = "text"\npath = "no-such-corpus"'), "study.data.path", r"no-such-corpus: no such file or folder"),
    (dict(factory="rnn", execution="stacked"), "study.model.execution",
     r"'stacked' cannot batch mymodels:rnn over workers with torch.func.vmap \(layer 'rnn': RuntimeError: Batching "
     r"rule not implemented for aten::gru.input.*\); allowed: auto or loop"),
    (dict(execution="fast"), "study.model.execution", r"'fast'.*auto, stacked, loop"),
    (dict(workers=200), "study.run.workers", r"200 workers of \d+ training samples get \d+ each; each needs at least "
     r"33 \(run.score_samples and one to train on\); allowed: \[1, \d+\], or a smaller run.score_samples$"),
    (dict(loss="mydata:raises"), "study.run.loss",
     r"mydata:raises raised IndexError: .* on outputs of shape \[4, 10\] and targets torch.int64 of shape \[4\]"),
    (dict(data='loader = "mydata:tokens_one_past"', factory="TokenTransformer"), "study.model.factory",
     r"the training inputs hold token id 8 \(example \d+ of \d+\), and the model's largest nn.Embedding has 8 "
     r"entries \(ids 0..7\); allowed: ids in 0..7, or an embedding of at least 9 entries$"),
    (dict(extra="[policy]\ndata_exchange_k = 4", data='loader = "mydata:halves"', factory="regressor", loss="mse",
          metric="val_loss"), "study.policy.data_exchange_k", r"needs loss 'cross_entropy'"),
])
def test_bad_input_is_one_line_naming_the_field(folder, change, field, message):
    kw = dict(data='loader = "mydata:images"', factory="dropout_mlp") | change
    with pytest.raises(ConfigError) as e:
        simulate.prepare(load(write_study(folder, "my-bad", **kw)))
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)


def test_ids_past_the_embedding_that_the_model_maps_itself_are_its_business(folder):
    """The check of token ids against the largest nn.Embedding refuses only where the model fails on them: a model
    that hashes its ids into its table runs."""
    setup = simulate.prepare(load(write_study(folder, "my-hashed", 'loader = "mydata:tokens_hashed"', "HashedTokens",
                                              steps=4)))
    assert int(setup.data.train_x.max()) > 8 and simulate.simulate(setup, MergePolicy(), 0).status == "ok"


@pytest.mark.parametrize("fields", [{"data_exchange_k": 4}, {"swap_p": 0.3, "swap_confidence": 0.5},
                                    {"retire_threshold": 0.5}])
def test_a_runs_policy_that_reads_exp_loss_as_confidence_is_refused_for_a_regression(folder, tmp_path, capsys, fields):
    """(Only the study's own [policy] and search space were checked: a policy file, the Python API, a baseline of
    the user's ran, exp(-MSE) taken as a probability, status ok.) Every way in names the field, before any data
    are read where it can."""
    import evomerge
    from evomerge import cli

    study = write_study(folder, "my-reg-conf", 'loader = "mydata:halves"', "regressor", loss="mse", metric="val_loss")
    (tmp_path / "p.json").write_text(json.dumps(fields))
    field = next(k for k in fields if k != "swap_p")
    assert cli.main(["run", "--study", str(study), "--policy", str(tmp_path / "p.json"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: policy\.{field}: .* reads exp\(-loss\) as the model's confidence in an example, "
                        r"which needs loss 'cross_entropy'; the study's loss is 'mse'; allowed: its neutral value with "
                        r"this loss", err), err
    with pytest.raises(ConfigError, match=rf"^policy\.{field}: "):
        evomerge.run(str(study), fields)
    setup = simulate.prepare(load(study))  # the engine's own entries (a baseline's run, a population's member)
    for go in (lambda: simulate.simulate(setup, MergePolicy.from_dict(fields), 0),
               lambda: run_population(setup, [Member(MergePolicy.from_dict(fields), 0)])):
        with pytest.raises(ConfigError, match=rf"^policy\.{field}: "):
            go()


def test_the_text_corpus_is_split_by_file_and_pinned_by_its_hash(folder):
    from evomerge import text

    study = load(write_study(folder, "my-text", 'dataset = "text"\npath = "corpus"\ncontext = 32', "TinyLM",
                             metric="val_perplexity"))
    root = folder / "corpus"
    parts = text.splits(root)
    files = text.files_of(root)
    assert len(files) == 12 and parts["val"] == files[8].read_bytes() and parts["test"] == files[9].read_bytes()
    assert parts["val"] not in parts["train"]  # no validation text is trained on
    digest = text.digest(root)
    pinned = write_study(folder, "my-text-pinned", f'dataset = "text"\npath = "corpus"\ncontext = 32\nsha256 = "{digest}"',
                         "TinyLM", metric="val_perplexity")
    simulate.prepare(load(pinned))
    wrong = write_study(folder, "my-text-wrong", f'dataset = "text"\npath = "corpus"\ncontext = 32\nsha256 = "{"0" * 64}"',
                        "TinyLM", metric="val_perplexity")
    with pytest.raises(ConfigError, match=r"study.data.sha256: corpus hashes to [0-9a-f]{64}, but the study pins 0+"):
        simulate.prepare(load(wrong))
    from evomerge.search import fingerprint

    assert fingerprint.of(study)["summary"]["data.text_digest"] == digest
    assert np.isclose(len(setup_windows := text.windows(parts["train"], 32)[0]), len(parts["train"]) // 33)
    assert setup_windows.dtype == torch.int64


@pytest.mark.system
def test_a_language_models_export_replays_on_its_perplexity(folder, tmp_path):
    """`evomerge run --policy best.json` of a language model's study held the replay to its per-byte accuracy; the
    study is judged on perplexity, and the line now holds that."""
    from searchutil import cli

    p = write_study(folder, "my-text-replay", 'dataset = "text"\npath = "corpus"\ncontext = 32', "TinyLM",
                    metric="val_perplexity", steps=20)
    p.write_text(p.read_text() + '\n[search.space]\nmean_interval = { kind = "log-float", low = 2.0, high = 10.0 }\n')
    r = cli("search", "--study", str(p), "--n-trials", "1", "--sampler", "random", "--no-verdict", "--quiet",
            "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path, data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    r = cli("export", "--study", str(p), "--runs-dir", str(tmp_path / "runs"), "-o", str(tmp_path / "best.json"),
            cwd=tmp_path, data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    r = cli("run", "--study", str(p), "--policy", str(tmp_path / "best.json"), "--quiet", cwd=tmp_path,
            data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^validation perplexity matches trial 0 of my-text-replay \(seed 0: \d+\.\d{4}\)$", r.stdout,
                     re.M), r.stdout


@pytest.mark.system
def test_the_merger_trains_a_users_language_model_under_torchrun(folder, tmp_path):
    """Part 5: the runtime honours the same contract. A user's LM loop (dropout, a causal-mask buffer that is the
    module's own, per-token cross-entropy) with a winner-biased gossip policy that reads the loss the loop passes."""
    import json
    import os
    import subprocess
    import sys

    from evomerge import text

    policy = tmp_path / "ring-winner.json"
    policy.write_text(json.dumps({"scheme": "gossip", "topology": "ring", "exchange": "push_pull", "mean_interval": 3,
                                  "winner_bias": 0.6, "score": "running"}))
    port = free_port()
    root = HERE.parent
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), str(HERE / "user_any" / "lm_loop.py"), "--corpus", str(folder / "corpus"),
                        "--policy", str(policy), "--steps", "60"], capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=str(root)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mask_intact"] and out["merges"] > 0
    parts = text.splits(folder / "corpus")
    counts = torch.bincount(text.windows(parts["train"], 32)[1].flatten(), minlength=256).double() + 1
    vy = text.windows(parts["val"], 32)[1].flatten()
    unigram = math.exp(float(-(counts / counts.sum()).log()[vy].mean()))
    assert out["perplexity"] < 0.8 * unigram, (out["perplexity"], unigram)


@pytest.mark.integration  # trains on the shipped corpus
def test_the_shipped_language_model_study_learns_from_its_pinned_corpus():
    """studies/tiny-lm.toml as shipped: its corpus is found beside it and matches its sha256, the causal transformer
    runs (the loop: it has dropout), and a short run beats the unigram model of the same split."""
    import dataclasses

    st = load("tiny-lm")
    assert st.data.dataset == "text" and st.data.sha256 and st.run.loss == "cross_entropy"
    assert st.objectives == ("val_perplexity", "bytes")
    short = dataclasses.replace(st, run=dataclasses.replace(st.run, steps=40, rounds=2))
    setup = simulate.prepare(short)
    assert setup.model.random and setup.model.execution == "loop"
    assert setup.data.train_x.shape[1:] == (64,) and setup.data.train_x.dtype == torch.int64
    res = simulate.simulate(setup, st.resolve_policy("ring-gossip"), 0, device="cpu")
    uni = torch.bincount(setup.data.train_y.flatten(), minlength=256).double() + 1
    unigram = math.exp(float(-(uni / uni.sum()).log()[setup.data.val_y.flatten()].mean()))
    assert res.final.val_perplexity < unigram, (res.final.val_perplexity, unigram)
    assert res.final.val_perplexity < res.history[0].val_perplexity


def test_by_file_gives_each_worker_whole_files_of_the_text(folder):
    p = write_study(folder, "my-by-file", 'dataset = "text"\npath = "corpus"\ncontext = 32', "TinyLM",
                    metric="val_perplexity")
    p.write_text(p.read_text().replace('partition = "iid"', 'partition = "by_file"'))
    setup = simulate.prepare(load(p))
    groups = setup.data.groups
    owners = {}
    for w, shard in enumerate(setup.shards):
        for f in set(groups[np.concatenate([shard, setup.slices[w]])].tolist()):
            owners.setdefault(f, set()).add(w)
    assert all(len(ws) == 1 for ws in owners.values())  # no file is split between workers
    assert len(owners) == 10  # the 12 files: 10 for training, 1 validation, 1 test
    assert {min(ws) for ws in owners.values()} == {0, 1, 2, 3}  # every worker holds some
    bad = write_study(folder, "my-by-file-bad", 'loader = "mydata:images"', "dropout_mlp")
    bad.write_text(bad.read_text().replace('partition = "iid"', 'partition = "by_file"'))
    with pytest.raises(ConfigError, match=r"study.data.partition: 'by_file' needs a corpus of files \(dataset 'text'\)"):
        simulate.prepare(load(bad))
    # text cannot be split by class: what it can be split by is named (it said "allowed: iid")
    p.write_text(p.read_text().replace('partition = "by_file"', 'partition = "dirichlet"'))
    with pytest.raises(ConfigError, match=r"^study.data.partition: 'dirichlet' splits by class .*; allowed: iid, "
                                          r"by_file$"):
        simulate.prepare(load(p))


def test_time_to_a_loss_target_and_loss_at_time_on_a_simulated_cluster(folder):
    """target_metric = "val_loss": reached at or below the target (a minimised metric), with the crossing
    interpolated as for accuracy; loss_at_time is the consensus loss at the time budget."""
    p = write_study(folder, "my-timed-mse", 'loader = "mydata:halves"', "regressor", loss="mse", metric="val_loss",
                    steps=80)
    text = p.read_text().replace('metrics = ["val_loss"]', 'metrics = ["time_to_target", "loss_at_time"]\n'
                                 'target_metric = "val_loss"\ntarget = 0.1')
    p.write_text(text.replace("rounds = 2", "rounds = 8") + "\n[environment]\nstep_time = 0.1\nspeeds = "
                 "[1.0, 1.0, 1.0, 0.5]\ntime_budget = 8.0\n")
    st = load(p)
    assert st.directions == ["minimize", "minimize"]
    res = simulate.simulate(simulate.prepare(st), MergePolicy(), 0, device="cpu")
    h = res.history
    assert h[-1].loss_at_time == h[-1].val_loss and h[-1].accuracy_at_time is None
    first = next(i for i, r in enumerate(h) if r.val_loss <= 0.1)
    assert first > 0, [r.val_loss for r in h]  # the first round is above the target: the crossing is interpolated
    t0, t1 = h[first - 1].sim_time, h[first].sim_time
    assert t0 < res.final.time_to_target <= t1
    assert res.final.time_to_target == pytest.approx(
        t0 + (h[first - 1].val_loss - 0.1) / (h[first - 1].val_loss - h[first].val_loss) * (t1 - t0))
    missed = folder / "my-timed-mse-missed.toml"
    missed.write_text(p.read_text().replace("target = 0.1", "target = 0.0001"))
    m = simulate.simulate(simulate.prepare(load(missed)), MergePolicy(), 0, device="cpu")
    best = min(x.val_loss for x in m.history)
    # not reached: ranked after every run that reached it (> the budget), by how close it came
    assert m.final.time_to_target == pytest.approx(8.0 * (2 - 0.0001 / best)) and m.final.time_to_target > 8.0


@pytest.mark.system
def test_a_language_models_final_check_reports_its_test_perplexity(folder, tmp_path):
    """(`run --reevaluate N` on a language model showed a test accuracy and a test loss, no test perplexity: the unit
    of its objective.) The row, and the JSON's ``test_perplexity``: exp of the run's test loss."""
    from searchutil import cli

    p = write_study(folder, "my-lm-final", 'dataset = "text"\npath = "corpus"\ncontext = 32', "TinyLM",
                    metric="val_perplexity", steps=20)
    r = cli("run", "--study", str(p), "--policy", "fedavg", "--reevaluate", "2", "--json", str(tmp_path / "re.json"),
            cwd=tmp_path, data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = json.loads((tmp_path / "re.json").read_text())["runs"]
    assert len(runs) == 2 and all(x["test_perplexity"] == pytest.approx(math.exp(x["test_loss"]), rel=1e-12)
                                  for x in runs), runs
    shown = re.search(r"test perplexity \(consensus\)[\s│|]+(\d+\.\d{4}) ± \d+\.\d{4}", r.stdout)
    assert shown, r.stdout
    mean = sum(x["test_perplexity"] for x in runs) / 2
    assert float(shown[1]) == pytest.approx(mean, abs=1e-4) and 1 < mean < 256  # (a byte model: below uniform)


@pytest.mark.system
def test_a_regression_study_goes_through_run_search_verdict_and_dashboard(folder, tmp_path):
    """The commands a user runs, on their own regression study: no accuracy anywhere, the loss instead. The search
    runs as the command does, in a process of its own; the others in this process (``cli.main``), a Python start-up
    less each."""
    from searchutil import cli

    def evomerge(*args, process=False):
        return cli(*args, cwd=tmp_path, data_dir=tmp_path, process=process)

    p = write_study(folder, "my-mse-cli", 'loader = "mydata:halves"', "regressor", loss="mse", metric="val_loss",
                    steps=40)
    p.write_text(p.read_text() + '\n[search.space]\nmean_interval = { kind = "log-float", low = 2.0, high = 50.0 }\n')
    r = evomerge("run", "--study", str(p), "--policy", "fedavg", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "consensus val loss (mse)" in r.stdout and "accuracy" not in r.stdout
    assert re.search(r"execution\s.*(loop|stacked) \(", r.stdout), r.stdout
    r = evomerge("baselines", "--study", str(p), "--quiet")
    assert r.returncode == 0, r.stderr
    head = next(line for line in r.stdout.splitlines() if "policy" in line and "status" in line)
    assert "val loss" in head and "acc" not in head and "worker" not in head, r.stdout
    # fedavg's row is no-merging's (its first merge after the 40 steps): said, as search and run say it
    assert re.search(r"^note: fedavg never merged: a worker's \d+ local steps ended before its first merge \(.*\), so "
                     r"it ran as no-merging$", r.stderr, re.M), r.stderr
    r = evomerge("search", "--study", str(p), "--n-trials", "2", "--reevaluate", "1", "--runs-dir", str(tmp_path / "runs"),
                 process=True)
    assert r.returncode == 0, r.stderr
    assert "val loss (min)" in r.stdout and re.search(r"^verdict: ", r.stdout, re.M), r.stdout
    assert " val loss" in r.stdout.split("verdict:")[1] and "accuracy" not in r.stdout
    # the export replays: the same strategy, the same validation loss
    r = evomerge("export", "--study", str(p), "--runs-dir", str(tmp_path / "runs"), "-o", str(tmp_path / "best.json"))
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads((tmp_path / "best.json").read_text())
    assert doc["execution"].split()[0] in ("stacked", "loop")
    r = evomerge("run", "--study", str(p), "--policy", str(tmp_path / "best.json"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^validation loss matches trial \d+ of my-mse-cli", r.stdout, re.M), r.stdout
    assert "as the exported trial ran" in r.stdout
    # the study changed since (its lr): the replay says what changed (it said a bare "DIFFERS from trial 1")
    p.write_text(p.read_text().replace("lr = 0.01", "lr = 0.008"))
    r = evomerge("run", "--study", str(p), "--policy", str(tmp_path / "best.json"), "--quiet")
    assert r.returncode == 0 and "DIFFERS" not in r.stdout and "matches" not in r.stdout, r.stdout
    assert re.search(r"^note: my-mse-cli changed since trial \d+ ran \(run\.lr changed \(0\.01 -> 0\.008\)\), so this "
                     r"run's figures are not held to the trial's$", r.stderr, re.M), r.stderr
    p.write_text(p.read_text().replace("lr = 0.008", "lr = 0.01"))
    # on another study the trial's execution is not borrowed: that model is not the one the trial timed
    other = write_study(folder, "my-mse-other", 'loader = "mydata:halves"', "regressor", loss="mse", metric="val_loss",
                        steps=20)
    r = evomerge("run", "--study", str(other), "--policy", str(tmp_path / "best.json"), "--quiet")
    assert r.returncode == 0 and "as the exported trial ran" not in r.stdout, r.stdout
    assert "note: the policy is trial" in r.stderr
    # the final check on fresh seeds reports the test set's loss (it had no test figure, and three n/a accuracy rows)
    r = evomerge("run", "--study", str(p), "--policy", str(tmp_path / "best.json"), "--reevaluate", "2", "--json",
                 str(tmp_path / "re.json"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"test loss \(consensus\)[\s│|]+\d\.\d{4} ± \d\.\d{4}", r.stdout), r.stdout
    assert "accuracy" not in r.stdout, r.stdout
    d = simulate.prepare(load(p)).data
    tx, ty = d.test()
    constant = float((ty - d.train_y.mean()).pow(2).mean())  # the best constant predictor's test loss
    runs = json.loads((tmp_path / "re.json").read_text())["runs"]
    assert len(runs) == 2 and all(0 < x["test_loss"] < 0.8 * constant for x in runs), (runs, constant)
    assert runs[0]["test_loss"] != runs[1]["test_loss"]  # two fresh seeds
    # a regression's JSON holds no accuracy keys (they were null in every round and as test_accuracy)
    assert "accuracy" not in json.dumps(runs), runs[0]["history"][0]
    r = evomerge("dashboard", "--study", str(p), "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "dash"))
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "dash" / "index.html").read_text()
    assert "validation loss" in html and "validation accuracy" not in html


def test_the_loop_writes_the_same_gradients_into_the_stack_as_vmap():
    """The loop's copies hold views of the stacked rows and of the gradient stack: one step of each strategy gives
    the same gradients in the stack (autograd accumulates into the views in place), the same BatchNorm statistics,
    and a second call on another stack of rows (a sub-stack, as the clock takes one) rebinds the copies."""
    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    model = GenericModel(build, (12,), 3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, 12, generator=g), torch.randint(0, 3, (4, 6), generator=g)
    out = {}
    for execution in ("stacked", "loop", "loop-again"):
        st = model.stack(4)
        st.set_rows(torch.stack([model.init(torch.Generator().manual_seed(w)) for w in range(4)]))
        grads = st.like()
        grads.buf.fill_(7.0)  # stale values must not leak into the result
        losses = model.loss_and_grad(st.params, x, y, grads.params, execution=execution.removesuffix("-again"))
        out[execution] = (grads.rows(), st.rows(), losses)
    for execution in ("loop", "loop-again"):
        assert torch.allclose(out[execution][0], out["stacked"][0], atol=1e-6)
        assert torch.allclose(out[execution][1], out["stacked"][1], atol=1e-6)  # running statistics, counters
        assert torch.allclose(out[execution][2], out["stacked"][2], atol=1e-6)
    assert out["loop"][0][:, :model.n_train].abs().sum() > 0


def test_a_users_loss_takes_class_labels_and_frozen_layers_stay_frozen_under_both_strategies(folder):
    setup = simulate.prepare(load(write_study(folder, "my-focal", 'loader = "mydata:images"', "dropout_mlp",
                                              loss="mydata:focal", metric="val_loss", steps=60)))
    res = simulate.simulate(setup, MergePolicy(), 0, device="cpu")
    assert res.status == "ok" and res.final.val_accuracy is None and res.final.val_loss < res.history[0].val_loss
    rows = {}
    for execution in ("stacked", "loop"):
        s = simulate.prepare(load(write_study(folder, f"my-frozen-{execution}", 'loader = "mydata:images"',
                                              "frozen_first_layer", steps=20, execution=execution,
                                              extra="weight_decay = 0.1")))  # decay must not move them either
        assert s.model.frozen == [0]
        rows[execution] = simulate.simulate(s, MergePolicy(), 0, device="cpu", keep_params=True).params
        n = 784 * 32
        assert torch.equal(rows[execution][:, :n], initial_row(s.model, 0)[:n].expand(4, -1))  # never trained
    assert torch.allclose(rows["stacked"], rows["loop"], atol=1e-5)


def test_random_numbers_drawn_in_forward_are_found_and_keyed(folder):
    setup = simulate.prepare(load(write_study(folder, "my-fdropout", 'loader = "mydata:images"', "FunctionalDropout",
                                              steps=20)))
    assert setup.model.random and setup.model.execution == "loop"
    a = simulate.simulate(setup, MergePolicy(), 0, device="cpu", keep_params=True)
    b = simulate.simulate(setup, MergePolicy(), 0, device="cpu", keep_params=True)
    assert torch.equal(a.params, b.params)


@pytest.mark.system
def test_evomerge_run_on_a_timed_regression_study_shows_the_loss_at_the_budget(folder, tmp_path):
    import os
    import subprocess
    import sys

    p = write_study(folder, "my-timed-cli", 'loader = "mydata:halves"', "regressor", loss="mse", metric="val_loss",
                    steps=40)
    p.write_text(p.read_text().replace('metrics = ["val_loss"]', 'metrics = ["time_to_target", "loss_at_time"]\n'
                                       'target_metric = "val_loss"\ntarget = 0.1')
                 + "\n[environment]\nstep_time = 0.1\ntime_budget = 4.0\n")
    r = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", str(p), "--policy", "ring-gossip",
                        "--quiet"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    assert r.returncode == 0, r.stderr
    assert re.search(r"time to 0\.1 val loss\s.*\d s", r.stdout) and re.search(r"loss at the 4 s budget\s.*0\.\d{4}", r.stdout), r.stdout
    assert "accuracy" not in r.stdout


@contextlib.contextmanager
def torch_threads(n: int):
    """``n`` torch threads, as a user's run has them (a test process has one), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_loop_on_two_threads_is_the_loop_on_one_bit_for_bit(folder):
    """With several torch threads the loop runs its workers on as many threads, each with one intra-op thread: each
    worker's arithmetic is one thread's, so the run is the one-thread run bit for bit, and within float tolerance
    of the stacked run; the process keeps its threads."""
    runs = {}
    for name, execution, threads in (("one", "loop", 1), ("two", "loop", 2), ("stacked", "stacked", 2)):
        with torch_threads(threads):
            setup = simulate.prepare(load(write_study(folder, f"my-bn-threads-{name}", 'loader = "mydata:images"',
                                                      "bn_cnn", steps=30, execution=execution)))
            runs[name] = simulate.simulate(setup, MergePolicy(topology="ring", mean_interval=3), 1, device="cpu",
                                           keep_params=True)
            assert torch.get_num_threads() == threads
            if execution == "loop":  # the threads ran the workers where there are two
                assert (setup.model._pool is not None) == (threads == 2)
    one, two, stacked = runs["one"], runs["two"], runs["stacked"]
    assert torch.equal(one.params, two.params)
    assert [(h.val_loss, h.val_accuracy, h.bytes, h.merges) for h in one.history] == \
        [(h.val_loss, h.val_accuracy, h.bytes, h.merges) for h in two.history]
    # the stacked run's grouped convolutions round otherwise, and AdamW (lr 0.01) amplifies a few coordinates'
    # differences: up to 4.6e-4 seen (an AMD EPYC without AVX-512)
    assert torch.allclose(two.params, stacked.params, atol=2e-3), (two.params - stacked.params).abs().max()


def test_a_population_of_a_users_model_on_two_threads_is_each_run_alone(folder):
    """A population's rows (members x workers) split over the threads as one run's are: each member's numbers are
    its run alone's, bit for bit; with random layers (trained in order, evaluated on the threads) too."""
    with torch_threads(2):
        for factory in ("bn_cnn", "dropout_mlp"):
            setup = simulate.prepare(load(write_study(folder, f"my-pop-threads-{factory}", 'loader = "mydata:images"',
                                                      factory, steps=20, execution="loop")))
            pols = [MergePolicy(topology="ring", mean_interval=2), MergePolicy(scheme="allreduce", mean_interval=3)]
            pop = run_population(setup, [Member(p, s) for s, p in enumerate(pols)], device="cpu", keep_params=True)
            for s, (p, got) in enumerate(zip(pols, pop)):
                alone = simulate.simulate(setup, p, s, device="cpu", keep_params=True)
                assert torch.equal(got.params, alone.params), factory
                assert [h.val_loss for h in got.history] == [h.val_loss for h in alone.history], factory


@pytest.mark.system
def test_a_search_on_a_users_recurrent_model_prints_no_warning_of_torchs_export(folder, tmp_path):
    """(Logging the best trial's consensus model with MLflow's pytorch flavour runs torch.export, which warned mid-search
    about an LSTM's ``_flat_weights``.) The search's output is its own; torch's words stay on the logged model."""
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    p = write_study(folder, "my-lstm-search", 'loader = "mydata:images"', "rnn", '{ cell = "lstm" }', steps=20)
    p.write_text(p.read_text() + '\n[search.space]\nmean_interval = { kind = "log-float", low = 2.0, high = 50.0 }\n')
    r = subprocess.run([sys.executable, "-m", "evomerge.cli", "search", "--study", str(p), "--n-trials", "1",
                        "--no-verdict", "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300, env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    assert r.returncode == 0, r.stderr
    assert "_flat_weights" not in r.stderr and "Warning:" not in r.stderr, r.stderr
    # the header's line of how the steps run is one line in a log, however long vmap's refusal (it broke at 160)
    (steps,) = [ln for ln in r.stderr.splitlines() if ln.startswith("  workers' steps: loop (vmap cannot batch it")]
    assert len(steps) > 160 and "; trials in process on cpu" in steps, r.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'my-lstm-search' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("my-lstm-search")
    models = client.search_logged_models([exp.experiment_id])
    assert len(models) == 1 and models[0].status.to_int() == models[0].status.READY.to_int()
    assert "_flat_weights" in models[0].tags.get("evomerge.save_warnings", ""), models[0].tags
    # `run` takes the study's stored name from anywhere; vmap's long refusal is cut in the table, whole in --json
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "evomerge.cli", "run", "--study", "my-lstm-search", "--policy", "fedavg",
                        "--quiet", "--runs-dir", str(tmp_path / "runs"), "--json", str(out)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300, env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    assert r.returncode == 0, r.stderr
    full = json.loads(out.read_text())["execution"]
    assert full.startswith("loop (vmap cannot batch it: ") and len(full) > 80, full
    assert f"{full[:63]}..." in r.stdout and full not in r.stdout, r.stdout
