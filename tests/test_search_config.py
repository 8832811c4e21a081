"""search/config.py: options checked before any trial, one set of names and defaults for the API and
the CLI, registries that code outside the package extends."""

import argparse
import inspect
from pathlib import Path

import pytest

import evomerge
from conftest import write_study
from evomerge import cli as cli_mod
from evomerge import study
from evomerge.errors import ConfigError
from evomerge.search import config
from searchutil import cli, edit_study


@pytest.mark.parametrize("kwargs, field", [({"sampler": "annealing"}, "--sampler"), ({"n_trials": 0}, "--n-trials"),
                                            ({"jobs": 0}, "--jobs"), ({"cmaes_categoricals": "x", "sampler": "cmaes"}, "--cmaes-categoricals"),
                                            ({"grace_period": 1}, "--grace-period"), ({"batch": 0}, "--batch"),
                                            ({"batch": 4, "backend": "distributed"}, "--batch"),
                                            ({"cmaes_popsize": 1, "sampler": "cmaes"}, "--cmaes-popsize"),
                                            ({"cmaes_popsize": -2, "sampler": "cmaes"}, "--cmaes-popsize"),
                                            ({"cmaes_restarts": -1, "sampler": "cmaes"}, "--cmaes-restarts")])
def test_bad_search_options(tmp_path, kwargs, field):
    s = study.load(write_study(tmp_path))
    with pytest.raises(ConfigError) as e:
        config.make_config(s, **kwargs)
    assert e.value.field == field


def test_cmaes_refuses_multi_objective(tmp_path):
    s = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    with pytest.raises(ConfigError, match="one objective"):
        config.make_config(s, sampler="cmaes")


@pytest.mark.system
def test_nsga2_on_a_single_objective_study_is_refused_in_one_line(tmp_path, data_dir):
    f = write_study(tmp_path)
    p = cli("search", "--no-verdict", "--study", str(f), "--sampler", "nsga2", "--n-trials", "2", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2
    assert p.stderr == ("error: --sampler: nsga2 is for studies with several objectives; this study has one "
                        "(val_accuracy); allowed: tpe, random, cmaes\n")
    assert not (tmp_path / "runs").exists()  # refused before anything was created
    # a study file that names nsga2 with one objective is refused the same way
    s = study.load(edit_study(f, "[search]\n", '[search]\nsampler = "nsga2"\n'))
    with pytest.raises(ConfigError, match="nsga2 is for studies with several objectives"):
        config.make_config(s)


def _search_parser() -> argparse.ArgumentParser:
    parser = cli_mod.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["search"]


CLI_ONLY = {"study", "json_out", "quiet"}  # the API takes the study as its first argument and prints nothing
API_ONLY = {"data"}  # already loaded data (tests, notebooks)


def test_api_keywords_and_cli_options_are_one_set_with_equal_defaults(monkeypatch):
    monkeypatch.delenv("EVOMERGE_RUNS_DIR", raising=False)
    cli_opts = {a.dest: a.default for a in _search_parser()._actions if a.dest != "help"}
    cli_opts["prune"] = not cli_opts.pop("no_prune")  # --no-prune is prune=False
    cli_opts["verdict"] = not cli_opts.pop("no_verdict")  # --no-verdict is verdict=False
    cli_opts["baselines"] = not cli_opts.pop("no_baselines")  # --no-baselines is baselines=False
    cli_opts["log_model"] = not cli_opts.pop("no_log_model")  # --no-log-model is log_model=False
    api = {n: p.default for n, p in inspect.signature(evomerge.search).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY}
    make = {n: p.default for n, p in inspect.signature(config.make_config).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(api) - API_ONLY == set(cli_opts) - CLI_ONLY == set(make) == set(config.DEFAULTS)
    assert "grace_period" in api
    for name in make:
        assert api[name] == make[name] == config.DEFAULTS[name], name
        if name == "runs_dir":  # the CLI reads $EVOMERGE_RUNS_DIR when it builds its parser; the API when it runs
            assert Path(cli_opts[name]) == config.default_runs_dir() == Path("runs")
        else:
            assert cli_opts[name] == api[name], name


def test_the_options_are_one_table_and_a_keyword_outside_it_is_refused(tmp_path):
    """search/options.py drives the flags, the keywords and SearchConfig: every option is a field of the resolved
    config, every non-shared one a flag of `evomerge search` with the table's help; a keyword that is not an option
    is a TypeError naming it, from the API as from make_config."""
    import dataclasses

    from evomerge.search import options

    assert {f.name for f in dataclasses.fields(config.SearchConfig)} == set(options.DEFAULTS) | {"study"}
    helps = {a.dest: a.help for a in _search_parser()._actions}
    for o in options.OPTIONS:
        assert helps[o.dest].startswith(o.help), o.name
    s = study.load(write_study(tmp_path))
    with pytest.raises(TypeError, match="make_config\\(\\) got an unexpected keyword argument 'n_trial'; did you "
                                        "mean n_trials\\?"):
        config.make_config(s, n_trial=3)
    with pytest.raises(TypeError, match="search\\(\\) got an unexpected keyword argument 'pruners'; did you mean "
                                        "pruner\\?"):
        evomerge.search(s, verdict=False, pruners="median", runs_dir=tmp_path / "runs")
    # a switch spelt as its flag (--no-log-model): the keyword and its value
    with pytest.raises(TypeError, match="search\\(\\) got an unexpected keyword argument 'no_log_model'; did you mean "
                                        "log_model=False\\?$"):
        evomerge.search(s, no_log_model=True, runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_runs_dir_follows_the_environment_in_the_api_too(tmp_path, monkeypatch):
    s = study.load(write_study(tmp_path))
    monkeypatch.setenv("EVOMERGE_RUNS_DIR", str(tmp_path / "elsewhere"))
    cfg = config.make_config(s)
    assert cfg.runs_dir == tmp_path / "elsewhere" and "elsewhere/tiny/optuna.db" in cfg.storage
    assert config.make_config(s, runs_dir=tmp_path / "r").runs_dir == tmp_path / "r"


def test_a_sampler_registered_from_outside_runs_a_search(tmp_path, data_dir):
    import optuna

    made = []

    def qmc(cfg, seed):
        made.append(seed)
        return optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False)

    s = study.load(write_study(tmp_path))
    with pytest.raises(ConfigError, match="unknown 'qmc'"):
        config.make_config(s, sampler="qmc")
    config.register_sampler("qmc", config.Sampler(qmc))
    try:
        res = evomerge.search(s, verdict=False, n_trials=2, sampler="qmc", runs_dir=tmp_path / "runs", data_dir=data_dir)
    finally:
        del config.SAMPLERS["qmc"]
    assert made and not res.errors
    assert res.counts.get("COMPLETE", 0) + res.counts.get("PRUNED", 0) == 2
    assert {r["sampler"] for r in res.records} == {"qmc"}


def test_an_objective_registered_from_outside_is_optimised(tmp_path, data_dir):
    from evomerge import study as study_mod

    config.register_objective("merges", config.Objective("minimize", "merges", lambda m: float(m.merges)))
    try:
        f = write_study(tmp_path, objectives=("val_accuracy", "merges"))
        s = study.load(f)
        assert s.directions == ["maximize", "minimize"]
        res = evomerge.search(s, verdict=False, n_trials=2, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir, prune=False)
    finally:
        del config.OBJECTIVES["merges"]
        del study_mod.OBJECTIVES["merges"]
    assert not res.errors and res.best
    for b in res.best:
        assert b["objectives"] == ["val_accuracy", "merges"]
        assert b["values"][1] == b["metrics"]["0"]["merges"]  # one seed: the mean is that seed's count


def test_a_bad_sampler_names_where_it_was_written(tmp_path):
    """In the study file: the study's field; on the command line: the flag."""
    f = write_study(tmp_path)
    f.write_text(f.read_text().replace("[search]\n", '[search]\nsampler = "bayes"\n', 1))
    st = study.load(f)
    with pytest.raises(ConfigError, match=r"^study\.search\.sampler: unknown 'bayes'; allowed: tpe, random, "):
        config.make_config(st, runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"^--sampler: unknown 'bayse'; allowed: tpe, random, "):
        config.make_config(st, sampler="bayse", runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"^--sampler: nsga2 is for studies with several objectives"):
        config.make_config(st, sampler="nsga2", runs_dir=tmp_path / "runs")


def test_a_storage_without_its_driver_says_what_to_install():
    """(Where psycopg2 is installed the same address reaches the driver, which finds no server on port 1.)"""
    import importlib.util

    from evomerge.search.storage import open_storage

    with pytest.raises(ConfigError) as e:
        open_storage("postgresql+psycopg2://me:secret@127.0.0.1:1/optuna")
    assert e.value.field == "--storage" and "secret" not in str(e.value)
    if importlib.util.find_spec("psycopg2") is None:
        assert ("cannot open postgresql+psycopg2://me:***@127.0.0.1:1/optuna: the driver psycopg2 that the address "
                "names is not installed (no module named 'psycopg2'); pip install it, or write postgresql:// to use "
                "psycopg 3 (pip install \"evomerge[postgres]\")") in str(e.value)
    else:
        assert "Connection refused" in str(e.value) or "connection" in str(e.value).lower()


@pytest.mark.integration
def test_an_nsga2_study_keeps_its_generation_size_when_resumed_with_more_trials(tmp_path):
    """(Its generations were a third of each search's --n-trials: 4 at 10 trials, then 5 when resumed to 16, and the
    first generation's breeding took in trials drawn at the new size.) The size binds as the first trials are asked,
    in a real SQLite study; a resume with more trials breeds on at that size, and says so."""
    import optuna

    from evomerge.search import loop, storage

    s = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    first = config.make_config(s, sampler="nsga2", n_trials=4, runs_dir=tmp_path / "runs")
    first.study_dir.mkdir(parents=True)
    store = storage.open_storage(first.storage)
    ostudy = storage.load_or_create(first, store, asking=True)
    assert ostudy.user_attrs[storage.NSGA_ATTR] == {"population": 4}
    assert loop.nsga2_notes(first, ostudy) == [
        "nsga2: --n-trials 4 is at most one generation of 4 trials: NSGA-II breeds from a generation once it is done, "
        "so every trial is a random draw (more trials)"]
    dists = {"mixing_weight": optuna.distributions.FloatDistribution(0.0, 1.0)}
    for k in range(4):  # the first generation, done
        t = ostudy.ask(dists)
        ostudy.tell(t, [0.5 + 0.01 * k, 100.0 - k])
    more = config.make_config(s, sampler="nsga2", n_trials=30, runs_dir=tmp_path / "runs")  # a third of 30: 10
    again = storage.load_or_create(more, storage.open_storage(more.storage), asking=True)
    t = again.ask(dists)
    gen = again.get_trials(deepcopy=False)[t.number].system_attrs[storage.NSGA_GENERATION]
    assert gen == 1  # bred from the 4 (at 10 a generation: still the first)
    assert loop.nsga2_notes(more, again) == [
        "nsga2: study tiny's generations are of 4 trials, as its first NSGA-II search drew them (a third of its "
        "--n-trials, 4 to 20; its trials hold their places in them)"]
    # asked for another size: one line, before anything changes
    other = config.make_config(s, sampler="nsga2", n_trials=30, nsga2_population=6, runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError) as e:
        storage.load_or_create(other, storage.open_storage(other.storage), asking=True)
    assert str(e.value) == ("--nsga2-population: 6; study tiny's NSGA-II generations are of 4 trials (its first NSGA-II "
                            "search's: its trials hold their places in them); allowed: 4 or 0, or another [study] name "
                            "or --runs-dir to start afresh")
    for kwargs, line in (({"sampler": "nsga2", "nsga2_population": 1}, "--nsga2-population: 1 is out of range; "
                                                                        "allowed: 0 (a third of --n-trials, 4 to 20) "
                                                                        "or [2, inf)"),
                         ({"sampler": "random", "nsga2_population": 8}, "--nsga2-population: 8 applies with --sampler "
                                                                         "nsga2; this search's sampler is random; "
                                                                         "allowed: --sampler nsga2, or leave it out")):
        with pytest.raises(ConfigError) as e:
            config.make_config(s, **kwargs)
        assert str(e.value) == line


@pytest.mark.integration
def test_an_nsga2_study_searched_before_its_size_was_kept_is_given_the_size_its_trials_show(tmp_path):
    """A study whose NSGA-II trials came before the attribute: its first generation's complete trials (a failed one
    in it is not counted: Optuna closes a generation at that many complete trials)."""
    import optuna

    from evomerge.search import storage

    s = study.load(write_study(tmp_path, objectives=("val_accuracy", "bytes")))
    cfg = config.make_config(s, sampler="nsga2", n_trials=12, runs_dir=tmp_path / "runs")
    cfg.study_dir.mkdir(parents=True)
    url = cfg.storage
    old = optuna.create_study(study_name="tiny", storage=url, directions=["maximize", "minimize"],
                              sampler=optuna.samplers.NSGAIISampler(seed=0, population_size=4))
    dists = {"mixing_weight": optuna.distributions.FloatDistribution(0.0, 1.0)}
    t = old.ask(dists)
    old.tell(t, state=optuna.trial.TrialState.FAIL)
    for k in range(5):
        t = old.ask(dists)
        old.tell(t, [0.5 + 0.01 * k, 100.0 - k])
    trials = old.get_trials(deepcopy=False)
    assert [x.system_attrs[storage.NSGA_GENERATION] for x in trials] == [0, 0, 0, 0, 0, 1]
    assert storage.kept_population({}, trials) == 4
    assert storage.kept_population({storage.NSGA_ATTR: {"population": 7}}, trials) == 7
