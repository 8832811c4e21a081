"""search/asking.py's copy of a study (TPE's batches) against real SQLite studies: it keeps in step with what the
study holds, starts again when another writer got in between, and steps aside for trials it cannot hold."""

import optuna
import pytest

from evomerge.search import asking
from evomerge.search.storage import open_storage

DISTS = {"x": optuna.distributions.FloatDistribution(0.0, 1.0),
         "k": optuna.distributions.IntDistribution(1, 5),
         "c": optuna.distributions.CategoricalDistribution(["a", "b"])}


def _study(tmp_path, seed=0):
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    st = optuna.create_study(study_name="s", storage=storage, sampler=optuna.samplers.TPESampler(
        seed=seed, multivariate=True, constant_liar=True, n_startup_trials=3))
    return st, storage


def _finish(st, trials):
    for t in trials:
        st.tell(t, t.params["x"] + 0.1 * t.params["k"])


def _same(mirror, st):
    """The copy holds the study's trials, number for number."""
    mine = mirror.storage.get_all_trials(mirror.study_id, deepcopy=False)
    theirs = st.get_trials(deepcopy=False)
    assert [(t.number, t.state, t.params) for t in mine] == [(t.number, t.state, t.params) for t in theirs]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Optuna: heartbeats are meant for Study.optimize
def test_the_copy_starts_again_when_another_writer_got_in_between(tmp_path):
    import copy

    st, storage = _study(tmp_path)
    mirror = asking.Mirror(st, copy.deepcopy(st.sampler))
    asked: list = []
    mirror.ask(storage, DISTS, 4, asked, trials=st.get_trials(deepcopy=False))
    assert [t.number for t in asked] == [0, 1, 2, 3]
    _finish(st, asked)
    trials = st.get_trials(deepcopy=False)  # read under the lock ...
    other = st.ask(DISTS)  # ... and another process's trial (number 4) created behind the copy's back
    more: list = []
    mirror.ask(storage, DISTS, 3, more, trials=trials)
    assert [t.number for t in more] == [5, 6, 7]  # the first ask took number 5 where the copy said 4: started again
    _same(mirror, st)
    assert other.number == 4 and mirror.usable


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_waiting_trial_taken_elsewhere_and_one_failed_by_hand_keep_the_copy_in_step(tmp_path):
    import copy

    st, storage = _study(tmp_path)
    st.enqueue_trial({"x": 0.5, "k": 2, "c": "a"})
    st.enqueue_trial({"x": 0.25, "k": 3, "c": "b"})
    st.enqueue_trial({"x": 0.75, "k": 4, "c": "a"})
    waiting = st.get_trials(deepcopy=False)
    storage.set_trial_state_values(waiting[2]._trial_id, optuna.trial.TrialState.FAIL)  # failed without a start
    trials = st.get_trials(deepcopy=False)
    storage.set_trial_state_values(waiting[0]._trial_id, optuna.trial.TrialState.RUNNING)  # taken by another process
    mirror = asking.Mirror(st, copy.deepcopy(st.sampler))
    asked: list = []
    mirror.ask(storage, DISTS, 2, asked, trials=trials)
    assert mirror.usable and [t.number for t in asked] == [1, 3]
    assert asked[0].params == {"x": 0.25, "k": 3, "c": "b"}  # the enqueued values, taken as Study.ask takes them
    assert set(asked[1].params) == set(DISTS)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_trial_the_copy_cannot_hold_sends_the_search_back_to_study_ask(tmp_path):
    import copy

    st, storage = _study(tmp_path)
    with pytest.warns(UserWarning, match="out of range"):  # Optuna keeps an enqueued value outside its range
        st.enqueue_trial({"x": 1.5, "k": 2, "c": "a"})
        t = st.ask(DISTS)
    st.tell(t, 1.0)
    mirror = asking.Mirror(st, copy.deepcopy(st.sampler))
    asked: list = []
    mirror.ask(storage, DISTS, 2, asked, trials=st.get_trials(deepcopy=False))
    assert asked == [] and not mirror.usable
