"""No trial spent twice (issue 28, part 4): a policy the sampler proposes again takes the stored results of the
trial that ran it, is marked as reused and is not trained; a sampler that only proposes known policies stops the
search in one line. Real SQLite, MLflow and runs."""

import pytest

import evomerge
from conftest import write_study
from evomerge import study
from searchutil import cli


def _two_policies(tmp_path, name="reuse", choices='["ring", "complete"]'):
    f = write_study(tmp_path, name=name)
    text = f.read_text()
    start = text.index("[search.space]\n") + len("[search.space]\n")
    end = text.index("[objectives]")
    f.write_text(text[:start] + f'topology = {{ kind = "categorical", choices = {choices} }}\n\n' + text[end:])
    return f


@pytest.mark.system
def test_a_repeated_proposal_takes_the_stored_results_and_is_not_trained(tmp_path, data_dir):
    from mlflow.tracking import MlflowClient

    f = _two_policies(tmp_path)
    res = evomerge.search(study.load(f), n_trials=6, sampler="random", runs_dir=tmp_path / "runs", seed=0,
                          data_dir=data_dir, prune=False)
    assert res.counts == {"COMPLETE": 6}
    trials = res.optuna_study.get_trials()
    first = {}
    for t in trials:
        key = t.user_attrs["policy_key"]
        if key not in first:
            first[key] = t
            assert "reused_from" not in t.user_attrs
        else:
            src = first[key]
            assert t.user_attrs["reused_from"] == src.number and t.values == src.values
            assert t.user_attrs["metrics"] == src.user_attrs["metrics"]
    assert len(first) == 2 and sum("reused_from" in t.user_attrs for t in trials) == 4
    # what was trained: only the first trial of each policy logged its rounds to MLflow
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'reuse' / 'mlflow.db'}")
    runs = [r for r in client.search_runs([client.get_experiment_by_name("reuse").experiment_id])
            if "optuna.trial_number" in r.data.tags]
    trained = [r for r in runs if len(client.get_metric_history(r.info.run_id, "val_accuracy")) > 1]
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in trained) == sorted(t.number for t in first.values())
    assert sum("evomerge.reused_from" in r.data.tags for r in runs) == 4


@pytest.mark.system
def test_a_batch_takes_the_stored_results_of_earlier_batches(tmp_path, data_dir):
    """--batch: the study's complete trials are read once per batch; a proposal of a policy an earlier batch ran
    takes its results, and trials of one batch (none complete when it starts) are all trained."""
    f = _two_policies(tmp_path, name="reusebatch")
    res = evomerge.search(study.load(f), n_trials=6, sampler="random", runs_dir=tmp_path / "runs", seed=0,
                          data_dir=data_dir, prune=False, batch=3, verdict=False)
    assert res.counts == {"COMPLETE": 6}
    trials = sorted(res.optuna_study.get_trials(), key=lambda t: t.number)
    assert all("reused_from" not in t.user_attrs for t in trials[:3])  # the first batch: nothing to take from
    first = {}
    for t in trials[:3]:
        first.setdefault(t.user_attrs["policy_key"], t)
    for t in trials[3:]:
        src = first[t.user_attrs["policy_key"]]  # two policies: the first batch ran both (seed 0's draws)
        assert t.user_attrs["reused_from"] == src.number and t.values == src.values


@pytest.mark.system
def test_a_converged_sampler_stops_the_search_in_one_line(tmp_path, data_dir):
    f = _two_policies(tmp_path, name="one", choices='["ring"]')
    p = cli("search", "--no-verdict", "--study", str(f), "--n-trials", "20", "--sampler", "random", "--no-prune", cwd=tmp_path,
            data_dir=data_dir)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "error: search stopped: the sampler proposed 10 policies in a row that were already evaluated (the last: "
        "trial 0's), so it has converged; finished trials are kept; widen [search.space] or search with another --seed")
    from searchutil import states

    assert states(tmp_path / "runs" / "one" / "optuna.db") == {"COMPLETE": 11}  # 1 trained, 10 reused, then stopped


@pytest.mark.unit
def test_policies_apart_only_in_fields_that_take_no_effect_share_a_key():
    """(NSGA-II bred a trial apart from an earlier one only in p_intra on a complete graph, and an all-reduce apart
    only in its topology's p_intra: both were trained again, and shown as two Pareto points.) The fields that take no
    effect in a policy (evomerge.policy.no_effect, checked bit for bit by runs) do not part two keys."""
    from evomerge.policy import MergePolicy
    from evomerge.search.trial import policy_key

    def key(**fields):
        return policy_key(MergePolicy(**fields).to_dict(), {}, [0])

    assert key(topology="complete", p_intra=0.66) == key(topology="complete", p_intra=0.99)
    assert key(scheme="allreduce", topology="communities", p_intra=0.86) == key(scheme="allreduce", p_intra=0.93)
    assert key(topology="communities", p_intra=0.66) != key(topology="communities", p_intra=0.99)
    assert key(topology="complete", mixing_weight=0.5) != key(topology="complete", mixing_weight=0.6)
    assert policy_key(MergePolicy().to_dict(), {"lr": 0.1}, [0]) != policy_key(MergePolicy().to_dict(), {}, [0])
