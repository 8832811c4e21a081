"""--pruner (search/config.py PRUNERS, search/trial.py): each pruner end to end on a tiny study, with a real
SQLite study and MLflow store; the refusals in one line."""

import optuna
import pytest

import evomerge
from conftest import write_study
from evomerge import study
from evomerge.errors import ConfigError
from evomerge.search import config
from evomerge.search.storage import load_or_create, open_storage
from searchutil import cli

T = 30  # write_study's steps: rounds report at local steps 10, 20, 30


def _prepared(tmp_path, pruner, seeds, enqueue=()):
    """A tiny study whose first trials are ``enqueue`` (a good policy, then poor ones: something to prune)."""
    s = study.load(write_study(tmp_path, seeds=seeds))
    cfg = config.make_config(s, n_trials=6, sampler="random", runs_dir=tmp_path / "runs", pruner=pruner)
    ostudy = load_or_create(cfg, open_storage(cfg.storage))
    for params in enqueue:
        ostudy.enqueue_trial(params)
    return s


GOOD = {"mean_interval": 1.0, "mixing_weight": 0.5, "topology": "complete"}
POOR = {"mean_interval": 30.0, "mixing_weight": 0.1, "topology": "ring"}


@pytest.mark.parametrize("pruner", ["median", "hyperband", "successive-halving"])
def test_each_round_pruner_runs_a_tiny_study_end_to_end(tmp_path, data_dir, pruner):
    s = _prepared(tmp_path, pruner, (0,), enqueue=[GOOD, POOR, POOR | {"mixing_weight": 0.2}])
    res = evomerge.search(s, verdict=False, n_trials=6, sampler="random", runs_dir=tmp_path / "runs", seed=2, data_dir=data_dir,
                          pruner=pruner)
    assert not res.errors and not res.interrupted
    assert res.counts.get("COMPLETE", 0) + res.counts.get("PRUNED", 0) == 6 and set(res.counts) <= {"COMPLETE", "PRUNED"}
    trials = res.optuna_study.get_trials()
    assert {t.user_attrs["pruner"] for t in trials} == {pruner}
    for t in trials:  # every round reported at its local step
        want = {10, 20, 30} if t.state.name == "COMPLETE" else {10, 20, 30} & set(range(t.user_attrs["pruned_at_step"] + 1))
        assert set(t.intermediate_values) == want, (t.number, t.intermediate_values)
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    if pruner != "median":  # halving promotes only the best of the first trials at a rung: the poor ones stop early
        assert pruned and all(t.user_attrs["pruned_at_step"] < T for t in pruned)
        assert trials[0].state.name == "COMPLETE"  # the good policy came first and is never stopped
    parent = _parent_params(tmp_path)
    assert parent["pruner"] == pruner


def test_wilcoxon_prunes_over_seeds_a_trial_worse_than_the_best_on_every_seed(tmp_path, data_dir):
    seeds = (0, 1, 2, 3, 4)
    s = _prepared(tmp_path, "wilcoxon", seeds, enqueue=[GOOD, POOR])
    res = evomerge.search(s, verdict=False, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", seed=2, data_dir=data_dir,
                          pruner="wilcoxon")
    assert not res.errors
    good, poor, *_ = res.optuna_study.get_trials()
    # each seed reports its final value once, the seed being the step, so trials pair seed by seed
    assert good.state.name == "COMPLETE" and sorted(good.intermediate_values) == list(seeds)
    assert good.values[0] == pytest.approx(sum(good.intermediate_values.values()) / len(seeds))
    assert all(poor.intermediate_values[k] < good.intermediate_values[k] for k in poor.intermediate_values)
    # a one-sided test at p < 0.1 needs 4 paired seeds: pruned after the fourth, before the fifth ran
    assert poor.state.name == "PRUNED" and sorted(poor.intermediate_values) == [0, 1, 2, 3]
    assert poor.user_attrs["pruned_at_step"] == 4 * T


def _parent_params(tmp_path):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'tiny' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    runs = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 1
    return runs[0].data.params


@pytest.mark.system
def test_an_unknown_pruner_is_one_line_naming_the_allowed_ones(tmp_path, data_dir):
    f = write_study(tmp_path)
    p = cli("search", "--no-verdict", "--study", str(f), "--pruner", "asha", "--n-trials", "2", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr == "error: --pruner: unknown 'asha'; allowed: median, hyperband, successive-halving, wilcoxon\n"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kwargs, words", [
    ({"pruner": "wilcoxon"}, "needs at least 5 seeds in run.seeds; this study runs 1; allowed: median, hyperband, "
                             "successive-halving"),
    ({"pruner": "hyperband", "sampler": "cmaes"}, "cmaes judges each generation on complete runs"),
])
def test_a_pruner_that_cannot_judge_the_search_is_refused(tmp_path, kwargs, words):
    s = study.load(write_study(tmp_path))
    with pytest.raises(ConfigError) as e:
        config.make_config(s, **kwargs)
    assert e.value.field == "--pruner" and words in str(e.value)
    # --no-prune beside it: a contradiction, said (it was taken without a word, pruning nothing)
    with pytest.raises(ConfigError, match=rf"^--pruner: {kwargs['pruner']} given with --no-prune, which prunes "
                                          r"nothing; allowed: one of them$"):
        config.make_config(s, **kwargs, prune=False)
    config.make_config(s, **{k: v for k, v in kwargs.items() if k != "pruner"}, prune=False)


def test_fresh_seeds_for_a_verdict_that_is_not_run_are_refused(tmp_path):
    """(`--reevaluate 5 --no-verdict` was taken without a word, running no verdict; then `--reevaluate 3`, the
    default's count, still was: a whole search ran.)"""
    s = study.load(write_study(tmp_path))
    assert config.make_config(s).reevaluate == 3 and config.make_config(s, verdict=False).reevaluate == 3
    for n in (1, 3, 5):
        with pytest.raises(ConfigError, match=rf"^--reevaluate: {n} given with --no-verdict, which runs no verdict on "
                                              r"fresh seeds; allowed: one of them$"):
            config.make_config(s, reevaluate=n, verdict=False)
    config.make_config(s, verdict=False)
    config.make_config(s, verdict=False, reevaluate=0)  # no fresh seeds, as no verdict has
    config.make_config(s, reevaluate=5)
    # a Python call's line names its keywords, in its field and in its words (it said --no-verdict)
    with pytest.raises(ConfigError) as e:
        evomerge.search(s, reevaluate=5, verdict=False, runs_dir=tmp_path / "runs")
    assert str(e.value) == ("reevaluate: 5 given with verdict=False, which runs no verdict on fresh seeds; allowed: one "
                            "of them") and e.value.field == "reevaluate"
    # the command, with the default's own count: refused before anything is stored
    r = cli("search", "--study", write_study(tmp_path), "--reevaluate", "3", "--no-verdict", "--runs-dir",
            tmp_path / "cli-runs", cwd=tmp_path, data_dir=tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: --reevaluate: 3 given with --no-verdict, which runs no verdict on "
                                           "fresh seeds; allowed: one of them\n"), r.stderr
    assert not (tmp_path / "cli-runs").exists()
    # no baselines, no verdict: fresh seeds for it refused the same way, in the Python call's words too
    assert config.make_config(s, baselines=False).verdict is False
    config.make_config(s, baselines=False, reevaluate=0)
    r = cli("search", "--study", write_study(tmp_path), "--reevaluate", "2", "--no-baselines", "--runs-dir",
            tmp_path / "cli-runs", cwd=tmp_path, data_dir=tmp_path)
    assert (r.returncode, r.stderr) == (2, "error: --reevaluate: 2 given with --no-baselines, which runs no verdict on "
                                           "fresh seeds (it judges against the baselines); allowed: one of them\n")
    assert not (tmp_path / "cli-runs").exists()
    with pytest.raises(ConfigError) as e:
        evomerge.search(s, reevaluate=2, baselines=False, runs_dir=tmp_path / "runs")
    assert str(e.value).startswith("reevaluate: 2 given with baselines=False, which runs no verdict")


def test_cmaes_settings_with_another_sampler_are_one_line(tmp_path):
    """(--cmaes-popsize, --cmaes-restarts and --cmaes-categoricals were taken without a word by TPE.)"""
    s = study.load(write_study(tmp_path))
    for key, value in (("cmaes_popsize", 4), ("cmaes_restarts", 1), ("cmaes_categoricals", "fixed")):
        with pytest.raises(ConfigError, match=rf"^--{key.replace('_', '-')}: {value!r} applies with --sampler cmaes; "
                                              r"this search's sampler is tpe; allowed: --sampler cmaes, or leave it out$"):
            config.make_config(s, sampler="tpe", **{key: value})
        config.make_config(s, sampler="cmaes", **{key: value})


def test_multi_objective_studies_keep_the_dominance_rule(tmp_path):
    s = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    with pytest.raises(ConfigError, match="--pruner: successive-halving prunes studies with one objective"):
        config.make_config(s, pruner="successive-halving")
    cfg = config.make_config(s)  # median, the default, means the dominance rule here
    assert isinstance(cfg.make_pruner(T), optuna.pruners.NopPruner) and not cfg.prunes_by_optuna
    # and the MLflow parent run says so (it said "median", the pruner that did not run)
    assert cfg.pruner_used == "dominated" and config.make_config(s, prune=False).pruner_used == "none"
    one = config.make_config(study.load(write_study(tmp_path / "one")), pruner="hyperband")
    assert one.pruner_used == "hyperband" and config.make_config(one.study, sampler="cmaes").pruner_used == "none"


def test_pruners_start_judging_after_the_first_fifth_of_the_rounds(tmp_path):
    s = study.load(write_study(tmp_path, seeds=(0, 1)))
    cfg = config.make_config(s, pruner="hyperband")
    hb = cfg.make_pruner(428)
    assert isinstance(hb, optuna.pruners.HyperbandPruner)
    assert hb._min_resource == config.warmup_step(cfg, 428) == 143  # 3 rounds: the first ends at step 143
    assert hb._max_resource == 2 * 428  # both seeds' runs
    assert isinstance(config.make_config(s).make_pruner(428), optuna.pruners.MedianPruner)
    assert isinstance(cfg.make_pruner(None), optuna.pruners.NopPruner)  # a process that runs no trial


def test_a_pruner_registered_from_outside_is_used(tmp_path, data_dir):
    made = []

    def patient(cfg, total_steps):
        made.append(total_steps)
        return optuna.pruners.PatientPruner(optuna.pruners.MedianPruner(), patience=1)

    s = study.load(write_study(tmp_path))
    config.register_pruner("patient", config.Pruner(patient))
    try:
        res = evomerge.search(s, verdict=False, n_trials=2, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir,
                              pruner="patient")
    finally:
        del config.PRUNERS["patient"]
    assert made == [T] and not res.errors
