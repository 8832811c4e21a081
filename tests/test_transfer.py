"""evomerge transfer (evomerge/search/transfer.py): a small study's top policies re-run on a bigger one, both rankings and
their correlations printed, logged to MLflow and drawn on the dashboard; real SQLite, MLflow and runs."""

import json
import math
import re
import shlex

import pytest
from scipy.stats import kendalltau, spearmanr

import evomerge
from conftest import write_study
from evomerge.report import dashboard
from evomerge import study
from evomerge.search import transfer
from evomerge.errors import ConfigError
from searchutil import cli


@pytest.fixture
def small(tmp_path, data_dir):
    f = write_study(tmp_path, name="small")
    res = evomerge.search(study.load(f), n_trials=5, sampler="random", runs_dir=tmp_path / "runs", seed=7,
                          data_dir=data_dir, prune=False)
    assert res.counts == {"COMPLETE": 5}
    return f, res


@pytest.mark.system
def test_transfer_prints_both_rankings_and_the_correlations(tmp_path, data_dir, small):
    f, res = small
    big = write_study(tmp_path, name="big", workers=8, steps=40)
    p = cli("transfer", "--study", str(f), "--target", str(big), "--top", "4", "--quiet", "--json", "t.json",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    top4 = sorted(res.optuna_study.get_trials(), key=lambda t: -t.values[0])[:4]
    assert [r["trial"] for r in sorted(doc["rows"], key=lambda r: r["source_rank"])] == [t.number for t in top4]
    assert doc["seeds"] == [1000]  # fresh: past the target's own seed 0
    src = [r["source_value"] for r in doc["rows"]]
    tgt = [r["target_value"] for r in doc["rows"]]
    assert doc["spearman"] == pytest.approx(spearmanr(src, tgt)[0], nan_ok=True)
    assert doc["kendall"] == pytest.approx(kendalltau(src, tgt)[0], nan_ok=True)
    # both rankings and the correlations, as printed
    out = p.stdout
    assert "small -> big: its top 4" in out and "ranking on big" in out
    for r in doc["rows"]:
        assert f"{r['source_value']:.4f}" in out and f"{r['target_value']:.4f}" in out
    assert f"Spearman rho {doc['spearman']:.3f}" in out and f"Kendall tau {doc['kendall']:.3f}" in out
    # four policies: no ranking is judged from so few, whatever the correlation came out as
    assert "over 4 policies: 4 policies are too few to judge" in out and "sound proxy" not in out
    # the target values are real runs of the policies on the target, on the fresh seed
    row = doc["rows"][0]
    again = evomerge.run(study.load(big), evomerge.MergePolicy.from_dict(row["policy"]), 1000, data_dir=data_dir)
    assert again.final.val_accuracy == pytest.approx(row["target_value"], abs=1e-6)
    # logged to the source study's MLflow experiment
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'small' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("small")
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.`evomerge.kind` = 'transfer'")
    assert run.info.run_name == "transfer-to-big" and run.data.params["top"] == "4"
    if not math.isnan(doc["spearman"]):
        assert run.data.metrics["spearman"] == pytest.approx(doc["spearman"])
    # and drawn on the source study's dashboard
    from evomerge.search.storage import default_storage

    page = dashboard.build(study.load(f), default_storage(tmp_path / "runs" / "small"),
                           f"sqlite:///{tmp_path / 'runs' / 'small' / 'mlflow.db'}", tmp_path / "dash",
                           compute_baselines=False).read_text()
    assert 'id="transfer-big"' in page and 'id="plot-transfer-big"' in page and "Kendall tau" in page
    assert page.count("<tr><td>") >= 4  # one row per re-run policy
    # two policies: no p-value (scipy's nan is not printed); from another folder, the stores named by --runs-dir:
    # the dashboard command it prints finds them (it left out --runs-dir, and said "unknown study" there)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p2 = cli("transfer", "--study", "small", "--runs-dir", str(tmp_path / "runs"), "--target", str(big), "--top", "2",
             "--quiet", cwd=elsewhere, data_dir=data_dir)
    assert p2.returncode == 0 and "(p n/a)" in p2.stdout and "nan" not in p2.stdout, p2.stdout
    (shows,) = re.findall(r"`evomerge (dashboard [^`]*)` shows it", p2.stdout)
    p3 = cli(*shlex.split(shows), "--no-baselines", "--out", str(elsewhere / "dash"), cwd=elsewhere, data_dir=data_dir)
    assert p3.returncode == 0, p3.stderr[-2000:]
    assert 'id="transfer-big"' in (elsewhere / "dash" / "index.html").read_text()


@pytest.mark.system
def test_transfer_refuses_what_cannot_be_ranked(tmp_path, data_dir, small):
    f, _ = small
    s = study.load(f)
    with pytest.raises(ConfigError) as e:
        transfer.transfer(s, study.load("mnist-gossip"), top=1, runs_dir=tmp_path / "runs")
    # the call's errors name its keywords (they named the command's flags: --top)
    assert e.value.field == "top" and str(e.value).startswith("top: 1 is out of range; allowed: [2, inf)")
    # (the command refused a study as its own target; a call ran it, and the page showed its "transfer")
    with pytest.raises(ConfigError, match=r"^target: is the study itself"):
        transfer.transfer(s, s, top=3, runs_dir=tmp_path / "runs")
    # a name or a path, as evomerge.search takes (an AttributeError: 'str' object has no attribute 'name')
    with pytest.raises(ConfigError, match=r"^target: is the study itself"):
        transfer.transfer(str(f), f, top=3, runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"^target: unknown study 'nope'"):
        transfer.transfer(str(f), "nope", top=3, runs_dir=tmp_path / "runs")
    p = cli("transfer", "--study", str(f), "--target", str(f), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.startswith("error: --target: is the study itself")
    p = cli("transfer", "--study", str(f), "--target", "mnist-gossip", "--top", "1", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.startswith("error: --top: 1 is out of range"), p.stderr


def test_rank_helpers():
    from scipy.stats import spearmanr

    assert transfer.average_ranks([0.9, 0.7, 0.9, 0.1], maximize=True) == [1.5, 3.0, 1.5, 4.0]
    assert transfer.average_ranks([5.0, 1.0, 3.0], maximize=False) == [3.0, 1.0, 2.0]
    c = transfer.correlations([1, 2, 3, 4], [10, 20, 40, 30])
    assert c["spearman"] == pytest.approx(0.8) and c["kendall"] == pytest.approx(4 / 6)
    assert math.isnan(transfer.correlations([1, 2, 3], [5, 5, 5])["spearman"])  # no ranking on the target
    # p-values over every pairing of few policies: 3 in the same order are so by chance 1 time in 3 (either order);
    # scipy's t approximation said 0. Of 4, 8 pairings in 24 have |rho| >= 0.8 (1 and 0.8 three ways, each sign)
    assert c["spearman_p"] == pytest.approx(8 / 24)
    assert transfer.correlations([1, 2, 3], [7, 8, 9])["spearman_p"] == pytest.approx(1 / 3)
    assert transfer.correlations([0.9, 0.8, 0.8], [0.5, 0.6, 0.7])["spearman_p"] == pytest.approx(2 / 3)  # ties
    import random

    rng = random.Random(0)
    x, y = [rng.random() for _ in range(12)], [rng.random() for _ in range(12)]
    assert transfer.correlations(x, y)["spearman_p"] == pytest.approx(spearmanr(x, y).pvalue)  # many: scipy's


def test_the_shipped_64_worker_study_is_mnist_gossip_with_64_workers_and_4x_the_budget():
    small, big = study.load("mnist-gossip"), study.load("mnist-gossip-64")
    assert big.name == "mnist-gossip-64" and big.run.workers == 64 and small.run.workers == 8
    # the same data, model, policy and search space, so warm starts and transfer checks compare like with like
    assert big.search.space == small.search.space and big.policy == small.policy and big.data == small.data
    assert big.objectives[0] == small.objectives[0]  # the big run is judged on accuracy alone
    # 4x the samples trained on in all: passes over each shard times the workers' share of the data
    assert big.run.epochs == 4 * small.run.epochs and big.run.batch_size == small.run.batch_size


def test_a_ranking_is_judged_only_over_enough_policies():
    """Two policies always correlate perfectly (p nan): that said 'a sound proxy'."""
    from evomerge.search.transfer import MIN_RANKED, verdict

    assert verdict(1.0, 2).startswith("2 policies are too few to judge")
    assert verdict(1.0, MIN_RANKED - 1).startswith(f"{MIN_RANKED - 1} policies are too few")
    assert verdict(0.9, MIN_RANKED).endswith("searching it is a sound proxy")
    assert verdict(0.1, 10).startswith("the source study does not rank policies")
    # 5 policies at rho 0.7 have p 0.23: chance gives that often ("a sound proxy", it said)
    assert verdict(0.7, 5, 0.233) == ("the rankings look alike, but over 5 policies chance alone would give this "
                                      "often (p 0.23): --top more to tell")
    assert verdict(0.9, 5, 0.0167).endswith("searching it is a sound proxy")
    # and a low rho over few policies is no disagreement either (6 at rho 0.14, p 0.8: "does not rank as the target")
    assert verdict(0.143, 6, 0.803) == ("the rankings do not agree over 6 policies, but so few tell little either way "
                                        "(p 0.8; an agreement of 0.7 over 6 is often missed): --top more, or more "
                                        "--seeds, to tell")
    assert verdict(0.1, 12, 0.76).startswith("the source study does not rank policies")


def test_a_target_that_does_not_measure_the_source_objective_is_named():
    """(A language model's perplexity or a time to target ranked on an MNIST study: every run ran, then KeyError.)"""
    from evomerge.search.transfer import unmeasured
    from evomerge.task import Task

    plain = study.from_dict({"study": {"name": "t"}})
    timed = study.from_dict({"study": {"name": "c"}, "environment": {"step_time": 0.1, "time_budget": 30.0},
                             "objectives": {"metrics": ["accuracy_at_time"]}})
    lm = Task()
    lm.per_position = True
    assert unmeasured("time_to_target", plain, Task()) == "it has no [environment], no simulated clock"
    assert unmeasured("time_to_target", timed, Task()) == "it has no [objectives] target"
    assert unmeasured("accuracy_at_time", timed, Task()) is None
    assert unmeasured("val_perplexity", plain, Task()) == "it is not a language model (labels per position)"
    assert unmeasured("val_perplexity", plain, lm) is None
    assert unmeasured("val_accuracy", plain, Task("mse")) == "its loss 'mse' has no classes to be accurate on"
    assert unmeasured("val_loss", plain, Task("mse")) is None


@pytest.mark.system
def test_an_interrupted_transfer_goes_on_from_the_policies_it_ran(tmp_path, data_dir, small):
    """Ctrl-C in a transfer threw away every run (the results were stored only at its end): now each policy's runs
    are kept with the source study as they finish, and the same command goes on from there, to the same result."""
    f, _ = small
    big = write_study(tmp_path, name="big", workers=8, steps=40)
    s, b = study.load(f), study.load(big)
    seen = []

    def stop_after_two(done, total):
        seen.append(done)
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        transfer.transfer(s, b, top=4, seeds=2, runs_dir=tmp_path / "runs", data_dir=data_dir, on_run=stop_after_two)
    again = []
    result = transfer.transfer(s, b, top=4, seeds=2, runs_dir=tmp_path / "runs", data_dir=data_dir,
                               on_run=lambda d, n: again.append(d))
    assert seen == [1, 2] and again == [2, 3, 4, 5, 6, 7, 8]  # the first policy's 2 runs were not run again
    row = min(result["rows"], key=lambda r: r["source_rank"])
    ran = evomerge.run(b, evomerge.MergePolicy.from_dict(row["policy"]), result["seeds"][1], data_dir=data_dir)
    assert ran.final.val_accuracy == pytest.approx(row["target_values"][1], abs=1e-6)
    p = cli("transfer", "--study", str(f), "--target", str(big), "--top", "4", "--seeds", "2", "--quiet",
            cwd=tmp_path, data_dir=data_dir)  # all kept: said, where nothing else would show it
    assert p.returncode == 0 and ("note: the runs of 4 of the 4 policies were kept from an earlier transfer to big on "
                                  "the same seeds; 0 ran now") in p.stdout, p.stdout + p.stderr
    first = re.search(r"logged to MLflow run (\w+) \(", p.stdout)[1]
    # once more: the same results, the same MLflow run (each re-run added a copy)
    p = cli("transfer", "--study", str(f), "--target", str(big), "--top", "4", "--seeds", "2", "--quiet",
            cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and f"logged to MLflow run {first} (" in p.stdout, p.stdout + p.stderr
    assert "by an earlier transfer with the same results" in p.stdout
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'small' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("small").experiment_id],
                              filter_string="tags.`evomerge.kind` = 'transfer'")
    assert [r.info.run_id for r in runs] == [first]
    p = cli("transfer", "--study", str(f), "--target", str(tmp_path / "nope.toml"), cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr == f"error: --target: {tmp_path / 'nope.toml'}: no such file\n", p.stderr
    p = cli("transfer", "--study", str(f), "--target", "no-such-study", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.startswith("error: --target: unknown study 'no-such-study'; "), p.stderr
