"""--warm-start-from (search/warmstart.py): a search begins from another study's completed trials, with real
SQLite studies side by side in one runs folder."""

import optuna
import pytest

import evomerge
from conftest import write_study
from evomerge.search import space as space_mod
from evomerge import study
from evomerge.errors import ConfigError
from evomerge.search import config, warmstart
from evomerge.search.cmaes import ATTR_GEN, ATTR_INDEX, CmaDriver
from evomerge.search.storage import open_storage
from searchutil import cli


def _source(tmp_path, data_dir, n=5):
    """Study ``src``: ``n`` complete trials, then one pruned and one failed (neither is carried over)."""
    s = study.load(write_study(tmp_path, name="src"))
    res = evomerge.search(s, verdict=False, n_trials=n, sampler="random", runs_dir=tmp_path / "runs", seed=5, data_dir=data_dir,
                          prune=False)
    assert res.counts == {"COMPLETE": n}
    o = optuna.load_study(study_name="src", storage=open_storage(res.config.storage))
    dists = space_mod.distributions(s.search.space)
    for state in (optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL):
        o.tell(o.ask(dists), state=state)
    best_first = sorted(o.get_trials(states=(optuna.trial.TrialState.COMPLETE,)), key=lambda t: -t.values[0])
    return best_first


@pytest.mark.system
def test_warm_start_evaluates_exactly_the_source_completed_trials_first(tmp_path, data_dir):
    src = _source(tmp_path, data_dir)
    f = write_study(tmp_path, name="tgt")
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "6", "--warm-start-from", "src", "--quiet", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 0, p.stderr
    assert "warm start from 5 completed trials of src: enqueued, best first" in p.stderr
    tgt = optuna.load_study(study_name="tgt", storage=open_storage(f"sqlite:///{tmp_path / 'runs' / 'tgt' / 'optuna.db'}"))
    trials = tgt.get_trials()
    assert len(trials) == 6 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    # the first five are the source's complete trials, best first, judged on this study's own runs
    assert [t.params for t in trials[:5]] == [t.params for t in src]
    assert [t.user_attrs["warm_start_of"] for t in trials[:5]] == [f"src:{t.number}" for t in src]
    assert "warm_start_of" not in trials[5].user_attrs
    assert tgt.user_attrs["warm_start"]["trials"] == 5
    # resumed with the same source: nothing enqueued twice; another source is refused in one line
    s = study.load(f)
    again = evomerge.search(s, verdict=False, n_trials=6, warm_start_from="src", runs_dir=tmp_path / "runs", data_dir=data_dir)
    assert again.records == [] and again.warm_start["trials"] == 5 and len(tgt.get_trials()) == 6
    _source_named(tmp_path, data_dir, "other")
    with pytest.raises(ConfigError, match="warm_start_from: study tgt started from 'src'; it cannot start again"):
        evomerge.search(s, verdict=False, n_trials=6, warm_start_from="other", runs_dir=tmp_path / "runs", data_dir=data_dir)


def _source_named(tmp_path, data_dir, name):
    s = study.load(write_study(tmp_path, name=name))
    evomerge.search(s, verdict=False, n_trials=1, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir, prune=False)


def test_cmaes_starts_from_the_best_source_solutions(tmp_path, data_dir):
    src = _source(tmp_path, data_dir, n=10)
    s = study.load(write_study(tmp_path, name="tgt"))
    kw = dict(sampler="cmaes", cmaes_popsize=4, cmaes_categoricals="fixed", runs_dir=tmp_path / "runs", seed=3,
              data_dir=data_dir)
    res = evomerge.search(s, verdict=False, n_trials=4, warm_start_from="src", **kw)
    warm = res.warm_start
    assert warm["how"] == "cmaes" and warm["trials"] == 10 and warm["solutions"] == 1
    space = s.search.space
    assert warm["x0"] == pytest.approx(space_mod.encode(space, src[0].params))  # the best solution is the mean
    assert warm["sigma0"] == pytest.approx(warmstart.ALPHA)  # one solution: no spread but ALPHA's
    # the stored start is what a resumed search replays: generation 0 as the search asked it
    trials = res.optuna_study.get_trials()
    dim = len(space_mod.numeric(space))
    started = CmaDriver(dim, seed=3, popsize=4, **{k: warm[k] for k in ("x0", "sigma0", "stds")})
    cold = CmaDriver(dim, seed=3, popsize=4)
    first = next(t for t in trials if t.user_attrs[ATTR_GEN] == 0 and t.user_attrs[ATTR_INDEX] == 0)
    x = space_mod.encode(space, first.params)
    assert started.next([]).x == pytest.approx(x, abs=1e-9)
    assert cold.next([]).x != pytest.approx(x, abs=1e-3)
    # resumed without the option, it still starts where it started: 4 more trials, one generation on
    more = evomerge.search(s, verdict=False, n_trials=8, **kw)
    assert more.warm_start == warm and {r["cma"]["cma_generation"] for r in more.records} == {1}


@pytest.mark.system
def test_bad_sources_are_refused_in_one_line_before_any_trial(tmp_path, data_dir):
    f = write_study(tmp_path, name="tgt")
    p = cli("search", "--no-verdict", "--study", str(f), "--warm-start-from", "elsewhere", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 2 and p.stderr.startswith("error: --warm-start-from: no study 'elsewhere'")
    assert p.stderr.count("\n") == 1 and not (tmp_path / "runs" / "tgt").exists()
    s = study.load(f)
    for spec, words in [("tgt", "is this study"), ("nowhere", "no study 'nowhere'"), ("a/b", "neither a study name")]:
        with pytest.raises(ConfigError) as e:
            config.make_config(s, warm_start_from=spec, runs_dir=tmp_path / "runs")
        assert e.value.field == "--warm-start-from" and words in str(e.value)
    _source(tmp_path, data_dir, n=2)
    url = f"sqlite:///{tmp_path / 'runs' / 'src' / 'optuna.db'}"
    with pytest.raises(ConfigError, match="no study 'x' in .*allowed: src"):
        warmstart.source_trials(url + "#x", tmp_path / "runs")
    name, trials, _ = warmstart.source_trials(url, tmp_path / "runs")  # one study in the storage: that one
    assert name == "src" and len(trials) == 2
