"""Asking Optuna for a batch's trials at a cost that does not grow with the trials already running.

``Study.ask`` first looks for a waiting (enqueued) trial, and Optuna's cached storage answers that by reading every
trial that is still running again, with its parameters and attributes; then it writes each parameter in a
transaction of its own. With ``--batch N`` that is N reads of up to N running trials, and one write per parameter.

For the samplers whose values do not depend on the study's trials, evomerge asks the same thing in fewer steps:

- the random sampler (``--sampler random``);
- CMA-ES (``--sampler cmaes``), whose candidates come from its own replay (:mod:`.cmaes`) and whose categoricals
  the random sampler draws.

For them:

- the waiting trials (a warm start's, a dead trial's retry) are found by their state alone, and taken first, as
  ``Study.ask`` takes them;
- a new trial is created running, with its parameters (and CMA-ES's attributes) in one transaction.

The values are the ones ``Study.ask(fixed_distributions=...)`` gives: the random sampler draws them in the same
order from the same generator. Other samplers (TPE, NSGA-II, one registered by a user) read the study to choose, and
are asked through ``Study.ask``.
"""

from __future__ import annotations

from typing import Any


def independent(ostudy) -> bool:
    """Whether the study's sampler draws without reading the study (asked here rather than by ``Study.ask``)."""
    import optuna

    return type(ostudy.sampler) is optuna.samplers.RandomSampler


def ask_batch(ostudy, storage, dists: dict, k: int, into: list, *, trials, driver=None, space=None) -> None:
    """Append up to ``k`` running trials to ``into`` (appended one by one, so that a Ctrl-C in between leaves
    every trial created so far in the caller's hands). ``storage``: the study's RDB storage; ``trials``: the study's
    trials as read before (CMA-ES's replay); ``driver``: CMA-ES's (fewer than ``k`` while its generation's last
    candidates run)."""
    import optuna

    study_id = storage.get_study_id_from_name(ostudy.study_name)
    popped = False
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
        if len(into) >= k:
            return
        if not _claim(storage, t._trial_id):
            continue  # another process took it
        trial = optuna.Trial(ostudy, t._trial_id)
        for name, d in dists.items():  # as Study.ask(fixed_distributions=dists): the enqueued values, the rest drawn
            _suggest(trial, name, d)
        storage.record_heartbeat(t._trial_id)  # Optuna only ever fails as stale trials that have one
        into.append(trial)
        popped = True
    if driver is None:
        wanted: list[tuple[dict, dict]] = [({}, {}) for _ in range(k - len(into))]
    else:
        from . import space as space_mod
        from .cmaes import ATTR_GEN, ATTR_INDEX, ATTR_RESTART

        if popped:
            trials = ostudy.get_trials(deepcopy=False)
        wanted = [({k_: v for k_, v in space_mod.decode(space, c.x).items() if k_ in dists},
                   {ATTR_RESTART: c.restart, ATTR_GEN: c.generation, ATTR_INDEX: c.index})
                  for c in driver.next_many(trials, k - len(into))]
    for fixed, attrs in wanted:
        template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=draw(ostudy, dists, fixed),
                                             distributions=dists, user_attrs=attrs)
        trial_id = storage.create_new_trial(study_id, template_trial=template)
        storage.record_heartbeat(trial_id)
        into.append(optuna.Trial(ostudy, trial_id))


def draw(ostudy, dists: dict, fixed: dict[str, Any]) -> dict[str, Any]:
    """The parameters ``Study.ask(fixed_distributions=dists)`` gives a trial enqueued with ``fixed``: in the
    distributions' order, a fixed value as it is, a single-valued distribution's value, else the sampler's draw."""
    params = {}
    for name, d in dists.items():
        if name in fixed:
            params[name] = fixed[name]
        elif d.single():
            params[name] = d.choices[0] if hasattr(d, "choices") else d.low
        else:
            params[name] = ostudy.sampler.sample_independent(ostudy, None, name, d)
    return params


def _claim(storage, trial_id: int) -> bool:
    """Set a waiting trial running, as ``Study.ask`` does; False where another process was first."""
    import optuna

    try:
        return storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.RUNNING)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False


def _suggest(trial, name: str, d) -> Any:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(name, d.choices)
    if isinstance(d, IntDistribution):
        return trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
