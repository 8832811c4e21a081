"""evomerge search --batch N (search/trial.run_batch): N trials asked at once and trained as one
population, each an ordinary Optuna trial with an ordinary MLflow run and its one-at-a-time values."""

import signal
import sqlite3
import time

import pytest

import evomerge
from conftest import write_study
from evomerge import study
from searchutil import cli, cma_points, states, wait_for


def _trials(res):
    return {t.number: (t.state.name, t.params, t.values) for t in res.optuna_study.get_trials()}


def test_a_batch_gives_every_trial_the_values_it_gets_alone(tmp_path, data_dir, mnist):
    s = study.load(write_study(tmp_path, steps=60))
    kw = dict(n_trials=6, sampler="random", seed=3, data_dir=data_dir, prune=False)
    alone = evomerge.search(s, verdict=False, runs_dir=tmp_path / "one", **kw)
    batched = evomerge.search(s, verdict=False, runs_dir=tmp_path / "four", batch=4, **kw)
    assert not batched.errors and not batched.interrupted
    assert _trials(batched) == _trials(alone)  # same asks (a seeded sampler), same values, bit for bit
    assert len(batched.records) == 6 and all(r["mlflow_run_id"] and r["state"] == "COMPLETE" for r in batched.records)
    assert {t.user_attrs["batch"] for t in batched.optuna_study.get_trials()} == {4}
    # the trials' runs are in MLflow as for any search
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'four' / 'tiny' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{batched.parent_run_id}' and "
                                                   "tags.`optuna.trial_number` != ''")
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in runs) == list(range(6))
    assert client.get_run(batched.parent_run_id).data.params["batch"] == "4"


def test_a_random_batch_takes_the_enqueued_trials_first_then_draws_what_optunas_ask_draws(tmp_path, data_dir, mnist):
    """The random sampler's batch is asked without ``Study.ask`` (search/asking.py): a warm start's enqueued
    trials are taken first, and the rest have the values that Optuna's own ask gives with the same sampler."""
    import optuna

    from evomerge.search import space as space_mod

    src = study.load(write_study(tmp_path, name="src"))
    evomerge.search(src, verdict=False, n_trials=3, sampler="random", seed=5, runs_dir=tmp_path / "runs",
                    data_dir=data_dir, prune=False)
    s = study.load(write_study(tmp_path, name="tgt"))
    res = evomerge.search(s, verdict=False, n_trials=7, sampler="random", seed=8, batch=4, warm_start_from="src",
                          runs_dir=tmp_path / "runs", data_dir=data_dir, prune=False)
    assert not res.errors and res.counts == {"COMPLETE": 7}
    got = res.optuna_study.get_trials()
    assert [t.user_attrs.get("warm_start_of", "").split(":")[0] for t in got] == ["src"] * 3 + [""] * 4
    assert {t.user_attrs["batch"] for t in got} == {4}
    # Optuna's own asks, in memory, with the sampler the search made (it found 3 enqueued trials when it started)
    mem = optuna.create_study(sampler=res.config.make_sampler(0, 3), directions=s.directions)
    for t in got[:3]:
        mem.enqueue_trial(t.params)
    dists = space_mod.distributions(s.search.space)
    assert [t.params for t in got] == [mem.ask(fixed_distributions=dists).params for _ in range(7)]
    assert [t.distributions for t in got] == [dists] * 7


@pytest.mark.parametrize("objectives", [("val_accuracy",), ("val_accuracy", "bytes")])
def test_a_tpe_batch_asks_what_optunas_ask_asks(tmp_path, data_dir, mnist, objectives):
    """TPE's batch is asked against an in-memory copy of the study (search/asking.py): replayed with Optuna's own
    ``Study.ask`` and the search's sampler (each batch asked, then told what the search stored), every trial has
    the same values, past TPE's 10 random start-up trials."""
    import optuna

    from evomerge.search import space as space_mod

    s = study.load(write_study(tmp_path, steps=40, objectives=objectives))
    res = evomerge.search(s, verdict=False, n_trials=16, sampler="tpe", seed=4, batch=4, runs_dir=tmp_path / "runs",
                          data_dir=data_dir)
    assert not res.errors and sum(res.counts.values()) == 16
    got = res.optuna_study.get_trials()
    mem = optuna.create_study(sampler=res.config.make_sampler(0, 0), directions=s.directions)
    dists = space_mod.distributions(s.search.space)
    for b in range(0, 16, 4):
        asked = [mem.ask(fixed_distributions=dists) for _ in range(4)]
        assert [a.params for a in asked] == [t.params for t in got[b:b + 4]], f"batch {b // 4}"
        for a, t in zip(asked, got[b:b + 4]):
            for step, v in t.intermediate_values.items():
                a.report(v, step)
            mem.tell(a, t.values if t.state.name == "COMPLETE" else None, state=t.state)
    assert len({tuple(sorted(t.params.items())) for t in got}) == 16


@pytest.mark.parametrize("sampler", ["tpe", "cmaes"])
def test_samplers_ask_a_batch_and_finish_the_study(tmp_path, data_dir, mnist, sampler):
    s = study.load(write_study(tmp_path, steps=60))
    res = evomerge.search(s, verdict=False, n_trials=8, sampler=sampler, runs_dir=tmp_path / "runs", seed=2, data_dir=data_dir,
                          batch=4)
    assert not res.errors and res.counts.get("COMPLETE", 0) + res.counts.get("PRUNED", 0) == 8
    if sampler == "cmaes":  # --batch 4 makes a generation of 4 (the population size)
        gens = [r["cma"]["cma_generation"] for r in sorted(res.records, key=lambda r: r["number"])]
        assert gens == [0, 0, 0, 0, 1, 1, 1, 1]
    else:  # TPE's constant liar: four different asks while the first four run
        first = [tuple(sorted(r["params"].items())) for r in res.records if r["number"] < 4]
        assert len(set(first)) == 4


def test_a_trial_that_fails_fails_alone_and_the_batch_goes_on(tmp_path, data_dir, mnist):
    """An objective (registered from outside) that cannot read a round of a trial that merges a lot: that
    trial fails as an error; the other trials of its batch complete."""
    import optuna

    from evomerge import study as study_mod
    from evomerge.search import config

    def picky(m):  # an objective is a metric of the run's results: this one refuses some runs' rounds
        if m.merges > 40:
            raise ValueError(f"picky: {m.merges} merges")
        return m.consensus_distance

    config.register_objective("consensus_distance", config.Objective("minimize", "picky", picky))
    try:
        s = study.load(write_study(tmp_path, steps=60, objectives=("consensus_distance",)))
        storage = f"sqlite:///{tmp_path / 'opt.db'}"
        st = optuna.create_study(study_name="tiny", storage=storage, direction="minimize")
        for interval in (30.0, 1.0, 30.0):  # about 3, 80 and 3 merges a round
            st.enqueue_trial({"mean_interval": interval, "mixing_weight": 0.5, "topology": "ring"})
        res = evomerge.search(s, verdict=False, n_trials=3, sampler="random", storage=storage, runs_dir=tmp_path / "runs", seed=0,
                              data_dir=data_dir, batch=3)
    finally:
        del config.OBJECTIVES["consensus_distance"]
        del study_mod.OBJECTIVES["consensus_distance"]
    by = {r["number"]: r for r in res.records}
    assert by[1]["state"] == "FAIL" and by[1]["failure"] == "error" and "picky" in by[1]["error"]
    assert by[0]["state"] == "COMPLETE" and by[2]["state"] == "COMPLETE"
    assert res.counts["COMPLETE"] == 3  # a failed trial does not count: more were asked until three completed


@pytest.mark.system
@pytest.mark.timeout(900)  # several searches in processes: 1.5-4 min on 2 busy cores
def test_batched_cmaes_interrupted_and_resumed_proposes_what_an_uninterrupted_one_does(tmp_path, data_dir):
    # the interrupted search's populations last 4.5 s (the model's delay, 30 ms a forward): the signal lands inside
    # one; the others run the same arithmetic without the delay (150 steps: a third of the CPU of 450 at 10 ms)
    f = write_study(tmp_path, steps=150, slow=True)
    args = ["search", "--no-log-model", "--study", str(f), "--sampler", "cmaes", "--batch", "2", "--cmaes-popsize", "2",
            "--n-trials", "6", "--seed", "4", "--no-verdict"]  # the verdict: a minute; categoricals drawn, independent
    a = cli(*args, "--runs-dir", "runs-a", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert a.returncode == 0, a.stderr
    db_b = tmp_path / "runs-b" / "tiny" / "optuna.db"
    proc = cli(*args, "--runs-dir", "runs-b", cwd=tmp_path, data_dir=data_dir, wait=False,
               env_extra={"SLOWMLP_DELAY": "0.03"})

    def second_generation_running():
        try:
            st = states(db_b)
        except sqlite3.Error:
            return False
        if st.get("COMPLETE", 0) != 2 or st.get("RUNNING", 0) != 2:
            return False
        time.sleep(1.0)
        return states(db_b).get("RUNNING", 0) == 2

    assert wait_for(second_generation_running, timeout=900, proc=proc), proc.communicate(timeout=5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    st = states(db_b)
    assert st["FAIL"] == 2 and "RUNNING" not in st  # the whole batch failed as interrupted, nothing left running
    b = cli(*args, "--runs-dir", "runs-b", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert b.returncode == 0, b.stderr
    pa, pb = cma_points(tmp_path / "runs-a" / "tiny" / "optuna.db"), cma_points(db_b)
    assert len(pa) == len(pb) == 6
    assert pa == pb  # the interrupted generation asked again, the third proposed from the told state


@pytest.mark.parametrize("batch", [1, 3])
def test_a_search_whose_every_trial_fails_stops_in_one_line(tmp_path, data_dir, mnist, batch):
    """Failed trials do not count toward n_trials: without a stop, a search whose every trial fails (a user's
    objective or model that always raises) would ask again forever."""
    from evomerge import study as study_mod
    from evomerge.errors import RunError
    from evomerge.search import config
    from evomerge.search.loop import MAX_ERRORS

    def broken(m):
        raise ValueError("broken objective")

    config.register_objective("consensus_distance", config.Objective("minimize", "broken", broken))
    try:
        s = study.load(write_study(tmp_path, steps=30, objectives=("consensus_distance",)))
        with pytest.raises(RunError, match=f"the last {MAX_ERRORS} trials failed with an error .*broken objective"):
            evomerge.search(s, verdict=False, n_trials=3, sampler="random", runs_dir=tmp_path / "runs", data_dir=data_dir, batch=batch)
    finally:
        del config.OBJECTIVES["consensus_distance"]
        del study_mod.OBJECTIVES["consensus_distance"]
    st = states(tmp_path / "runs" / "tiny" / "optuna.db")
    assert st == {"FAIL": MAX_ERRORS + (2 if batch == 3 else 0)}  # whole batches: 3 + 3 + 3 + 3


@pytest.mark.integration
@pytest.mark.parametrize("execution", ["stacked", "auto"])
def test_a_batch_of_a_forced_stacked_model_with_dropout_says_its_trials_differ(tmp_path, data_dir, execution):
    """A user's module with dropout forced 'stacked' draws its masks for the population's rows together: the search
    says so (a new user found a trial that `evomerge run` replayed otherwise); under 'auto' (a loop) it says nothing."""
    import warnings

    f = write_study(tmp_path, name="drop", steps=10)
    (tmp_path / "dropnet.py").write_text(
        "import torch.nn as nn\n\n\ndef net():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))\n")
    f.write_text(f.read_text().replace('name = "mlp"\nhidden = [16]',
                                       f'factory = "dropnet:net"\nexecution = "{execution}"'))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        res = evomerge.search(study.load(f), verdict=False, n_trials=2, sampler="random", seed=0, batch=2,
                              runs_dir=tmp_path / "runs", data_dir=data_dir, prune=False)
    assert not res.errors and len(res.records) == 2
    said = [str(w.message) for w in got if str(w.message).startswith("--batch: the model has random layers")]
    assert len(said) == (1 if execution == "stacked" else 0), said


@pytest.mark.system
def test_a_cmaes_study_resumed_with_another_batch_keeps_its_generations(tmp_path, data_dir):
    """(A user's CMA-ES search of 6 trials at the default generation of 7, resumed with --batch 4: the generations
    were replayed at 4 candidates, and trials' scores credited to points never run.) The study keeps its first CMA-ES
    search's generation size and seed: a resume with --batch 2 draws what one search without it draws, and says so;
    an explicit other --cmaes-popsize is one line."""
    f = write_study(tmp_path, steps=20)
    base = ["search", "--study", str(f), "--sampler", "cmaes", "--seed", "4", "--no-prune", "--no-verdict",
            "--no-baselines"]
    a = cli(*base, "--n-trials", "8", "--runs-dir", "runs-a", "--quiet", cwd=tmp_path, data_dir=data_dir)
    assert a.returncode == 0, a.stderr
    b = cli(*base, "--n-trials", "3", "--runs-dir", "runs-b", cwd=tmp_path, data_dir=data_dir)  # 2 fields: 6 a generation
    assert b.returncode == 0, b.stderr
    assert "note: cmaes: --n-trials 3 is less than one generation of 6 candidates" in b.stderr, b.stderr
    b = cli(*base, "--n-trials", "8", "--batch", "2", "--runs-dir", "runs-b", cwd=tmp_path, data_dir=data_dir)
    assert b.returncode == 0, b.stderr
    assert ("note: cmaes: study tiny's generations are of 6 candidates, as its first CMA-ES search drew them (its "
            "trials hold their places in them), asked 2 at a time") in b.stderr, b.stderr
    pa, pb = cma_points(tmp_path / "runs-a" / "tiny" / "optuna.db"), cma_points(tmp_path / "runs-b" / "tiny" / "optuna.db")
    assert len(pa) == len(pb) == 8 and max(pa)[0] == 1  # into the second generation: told the first's values
    assert pa == pb
    c = cli(*base, "--n-trials", "9", "--cmaes-popsize", "3", "--runs-dir", "runs-b", cwd=tmp_path, data_dir=data_dir)
    assert c.returncode == 2 and c.stderr.strip().splitlines() == [
        "error: --cmaes-popsize: 3; study tiny's CMA-ES generations are of 6 candidates (its first CMA-ES search's: "
        "its trials hold their places in them); allowed: 6 or 0, or another [study] name or --runs-dir to start "
        "afresh"], c.stderr


@pytest.mark.system
def test_the_search_says_how_its_workers_steps_run_and_on_how_many_threads(tmp_path, data_dir):
    """(A user's dropout model under --batch: nothing the search printed said whether its workers' steps ran as a
    loop, whose masks are each worker's own, or on how many torch threads, on which a replay's match depends.)"""
    f = write_study(tmp_path, name="drop", steps=10)
    (tmp_path / "dropnet.py").write_text(
        "import torch.nn as nn\n\n\ndef net():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))\n")
    f.write_text(f.read_text().replace('name = "mlp"\nhidden = [16]', 'factory = "dropnet:net"'))
    p = cli("search", "--no-log-model", "--study", str(f), "--n-trials", "2", "--batch", "2", "--no-verdict", "--no-baselines",
            cwd=tmp_path, data_dir=data_dir, env_extra={"EVOMERGE_THREADS": "1"}, process=True)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[1].startswith("  workers' steps: loop (random layers") and \
        lines[1].endswith("; trials in process on cpu with 1 torch thread"), lines[:3]
