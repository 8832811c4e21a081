"""The CMA-ES driver against a real (in-memory) Optuna study and a known function."""

import numpy as np
import optuna
import pytest

from evomerge.search.cmaes import ATTR_GEN, ATTR_INDEX, ATTR_RESTART, CmaDriver

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sphere(x):
    return -float(np.sum((np.asarray(x) - 0.7) ** 2))  # maximised at 0.7


def step(study, driver, f=sphere, state=None):
    cand = driver.next(study.get_trials(deepcopy=False))
    if cand is None:
        return None
    study.enqueue_trial({"x0": cand.x[0], "x1": cand.x[1]},
                        user_attrs={ATTR_RESTART: cand.restart, ATTR_GEN: cand.generation, ATTR_INDEX: cand.index})
    t = study.ask({"x0": optuna.distributions.FloatDistribution(0, 1), "x1": optuna.distributions.FloatDistribution(0, 1)})
    if state is None:
        study.tell(t, f([t.params["x0"], t.params["x1"]]))
    else:
        study.tell(t, state=state)
    return cand


def test_converges_on_a_known_function():
    study = optuna.create_study(direction="maximize")
    driver = CmaDriver(2, seed=1, popsize=6)
    for _ in range(90):
        step(study, driver)
    assert study.best_value > -1e-3
    assert driver.state(study.trials)["generation"] == 14


def test_a_fresh_driver_continues_exactly_where_the_stored_trials_left_off():
    a = optuna.create_study(direction="maximize")
    for _ in range(20):
        step(a, CmaDriver(2, seed=3, popsize=5))  # a new driver every time: the state lives in the study only
    b = optuna.create_study(direction="maximize")
    one = CmaDriver(2, seed=3, popsize=5)
    for _ in range(20):
        step(b, one)
    xa = [(t.params["x0"], t.params["x1"]) for t in a.trials]
    xb = [(t.params["x0"], t.params["x1"]) for t in b.trials]
    assert xa == xb


def test_interrupted_candidates_are_asked_again_and_running_ones_wait():
    study = optuna.create_study(direction="maximize")
    driver = CmaDriver(2, seed=0, popsize=4)
    first = step(study, driver, state=optuna.trial.TrialState.FAIL)  # interrupted (no 'failure: error')
    again = step(study, driver)
    assert (again.generation, again.index, again.x) == (first.generation, first.index, first.x)
    for _ in range(2):
        step(study, driver)
    t = study.ask()  # a candidate taken by another process, still running
    cand = driver.next(study.get_trials(deepcopy=False))
    study.enqueue_trial({}, user_attrs={ATTR_RESTART: 0, ATTR_GEN: cand.generation, ATTR_INDEX: cand.index})
    running = study.ask()
    study.tell(t, 0.0)
    assert driver.next(study.get_trials(deepcopy=False)) is None  # the generation waits for it
    study.tell(running, -1.0)
    assert driver.next(study.get_trials(deepcopy=False)).generation == 1


def test_failed_with_error_gets_the_generations_worst_value():
    study = optuna.create_study(direction="maximize")
    driver = CmaDriver(2, seed=0, popsize=4)
    cand = driver.next([])
    study.enqueue_trial({}, user_attrs={ATTR_RESTART: 0, ATTR_GEN: 0, ATTR_INDEX: 0, "failure": "error"})
    t = study.ask()
    t.set_user_attr("failure", "error")
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    for _ in range(3):
        step(study, driver)
    nxt = driver.next(study.get_trials(deepcopy=False))
    assert nxt.generation == 1 and cand.index == 0


def test_ipop_restarts_double_the_population():
    study = optuna.create_study(direction="maximize")
    driver = CmaDriver(2, seed=2, popsize=4, restarts=1)
    flat = lambda x: 0.0  # nothing to learn: CMA-ES stops on its flat-fitness rule and restarts  # noqa: E731
    for _ in range(80):
        step(study, driver, f=flat)
    restarts = {t.user_attrs[ATTR_RESTART] for t in study.trials}
    assert restarts == {0, 1}
    gen0_of_restart1 = [t for t in study.trials if t.user_attrs[ATTR_RESTART] == 1 and t.user_attrs[ATTR_GEN] == 0]
    assert len(gen0_of_restart1) == 8


def test_needs_a_dimension():
    with pytest.raises(ValueError):
        CmaDriver(0)


def test_one_numeric_field_converges():
    """(pycma's bounds fail in one dimension: the second generation's tell raised "not yet initialized (dimension
    needed)", a traceback from `evomerge search --sampler cmaes` on a study that searches one field.)"""
    study = optuna.create_study(direction="maximize")
    driver = CmaDriver(1, seed=1, popsize=4)
    for _ in range(60):
        cand = driver.next(study.get_trials(deepcopy=False))
        assert cand is not None and len(cand.x) == 1
        study.enqueue_trial({"x0": cand.x[0]}, user_attrs={ATTR_RESTART: cand.restart, ATTR_GEN: cand.generation,
                                                           ATTR_INDEX: cand.index})
        t = study.ask({"x0": optuna.distributions.FloatDistribution(0, 1)})
        study.tell(t, -(t.params["x0"] - 0.7) ** 2)
    assert study.best_value > -1e-4 and driver.state(study.trials)["generation"] == 14


@pytest.mark.system
def test_a_users_study_of_one_numeric_field_searches_with_cmaes(tmp_path, data_dir):
    from conftest import write_study
    from searchutil import cli

    f = write_study(tmp_path)
    text = f.read_text()
    for line in ('mixing_weight = { kind = "float", low = 0.1, high = 1.0 }\n',
                 'topology = { kind = "categorical", choices = ["ring", "complete"] }\n'):
        assert line in text
        text = text.replace(line, "")
    f.write_text(text)
    p = cli("search", "--study", str(f), "--sampler", "cmaes", "--n-trials", "6", "--cmaes-popsize", "2",
            "--no-verdict", cwd=tmp_path, data_dir=data_dir)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    said = " ".join((p.stdout + p.stderr).split())
    assert "cmaes searches 1 numeric field" in said and "categoricals" not in said, said  # (none in this space)
    import sqlite3

    with sqlite3.connect(tmp_path / "runs" / "tiny" / "optuna.db") as c:
        assert c.execute("select count(*) from trials where state = 'COMPLETE'").fetchone() == (6,)


def test_a_study_whose_cmaes_trials_came_before_the_kept_size_is_given_the_size_they_show(tmp_path):
    """(The generation size was not kept with a study: one resumed with another --batch replayed its generations at
    that size.) A study whose CMA-ES trials predate the kept size gets the size its trials show; one with no trial
    yet binds nothing until it has one."""
    from types import SimpleNamespace

    import optuna

    from conftest import write_study
    from evomerge import study as study_mod
    from evomerge.search.loop import CMA_ATTR, cmaes_fixed

    st = study_mod.load(write_study(tmp_path))  # 2 numeric fields: 6 a generation by default
    o = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}", study_name="tiny")

    def cfg(batch=1, popsize=0):
        return SimpleNamespace(study=st, cmaes_popsize=popsize, batch=batch, seed=0, n_trials=20)

    assert cmaes_fixed(cfg(batch=4), o) == [] and o.user_attrs[CMA_ATTR]["popsize"] == 4
    assert cmaes_fixed(cfg(batch=3), o) == [] and o.user_attrs[CMA_ATTR]["popsize"] == 3  # no trial yet: rebound
    o.set_user_attr(CMA_ATTR, None)
    for i in range(5):  # the first search's trials, placed in a generation of 6 (before the size was kept)
        t = o.ask()
        for k, v in (("cma_restart", 0), ("cma_generation", 0), ("cma_index", i)):
            t.set_user_attr(k, v)
        o.tell(t, 0.5)
    notes = cmaes_fixed(cfg(batch=2), o)
    assert o.user_attrs[CMA_ATTR] == {"popsize": 6, "seed": 0}
    assert notes == ["cmaes: study tiny's trials are placed in generations of 6 candidates (taken from them; the seed "
                     "taken as --seed 0)"], notes
