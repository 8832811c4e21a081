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
order from the same generator.

TPE (the studies' own sampler) reads the study to choose, three times an ask (the waiting trials, its search space,
its constant liar's running trials). A batch of TPE asks goes to an in-memory copy of the study instead
(:class:`Mirror`): the copy holds every trial of the study (their states, values, parameters and system
attributes, without the user attributes TPE does not read) as read once a batch under the search lock, and a
sampler of its own that starts where the study's did, so each ask sees what ``Study.ask`` would have seen and draws
the same values; each trial is then written to the study in one transaction. Other samplers (NSGA-II, one registered by a user) are
asked through ``Study.ask``.
"""

from __future__ import annotations

from typing import Any


def independent(ostudy) -> bool:
    """Whether the study's sampler draws without reading the study (asked here rather than by ``Study.ask``)."""
    import optuna

    return type(ostudy.sampler) is optuna.samplers.RandomSampler


def mirrored(ostudy) -> bool:
    """Whether the study's sampler is asked against an in-memory copy of the study (:class:`Mirror`)."""
    import optuna

    return type(ostudy.sampler) is optuna.samplers.TPESampler


class _NoMemoryStudyLine:
    """A logging filter that drops Optuna's line on creating an in-memory study (:meth:`Mirror._fresh`)."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("A new study created in memory")


class Mirror:
    """An in-memory copy of a study that TPE asks a batch against (one per search process, brought up to date before
    each batch): every trial's state, values, parameters, system attributes and intermediate values, without the user
    attributes TPE does not read. ``sampler``: the copy's own, a copy of the study's made before its first ask.
    ``usable`` turns False where the copy cannot hold a trial the study holds (the caller then asks ``Study.ask``)."""

    def __init__(self, ostudy, sampler):
        self.ostudy, self.sampler, self.usable = ostudy, sampler, True
        self._fresh()

    def _fresh(self) -> None:
        import logging

        import optuna

        self.storage = optuna.storages.InMemoryStorage()
        # the copy is no study of the user's: Optuna's "A new study created in memory with name: <the study's>" would
        # read as if the search had not stored it. The line is dropped by a filter on the in-memory storage's own
        # logger for this one call (the caller's logging otherwise as it was)
        log = logging.getLogger(type(self.storage).__module__)
        quiet = _NoMemoryStudyLine()
        log.addFilter(quiet)
        try:
            self.study = optuna.create_study(storage=self.storage, study_name=self.ostudy.study_name,
                                             directions=self.ostudy.directions, sampler=self.sampler,
                                             pruner=self.ostudy.pruner)
        finally:
            log.removeFilter(quiet)
        self.study_id = self.storage.get_study_id_from_name(self.ostudy.study_name)

    def sync(self, trials) -> bool:
        """Bring the copy up to ``trials`` (all of the study's, read under the search lock): new trials are added,
        and those it holds unfinished take what the study has stored since. False where it cannot hold one."""
        mine = self.storage.get_all_trials(self.study_id, deepcopy=False)
        try:
            for t in trials:
                if t.number >= len(mine):
                    self.study.add_trial(_copy(t))
                    continue
                m = mine[t.number]
                if m.state.is_finished() or m.state == t.state:
                    continue
                for name, value in t.params.items():
                    if name not in m.params:
                        d = t.distributions[name]
                        self.storage.set_trial_param(m._trial_id, name, d.to_internal_repr(value), d)
                for key, value in t.system_attrs.items():
                    if key not in m.system_attrs:
                        self.storage.set_trial_system_attr(m._trial_id, key, value)
                for step, value in t.intermediate_values.items():
                    if step not in m.intermediate_values:
                        self.storage.set_trial_intermediate_value(m._trial_id, step, value)
                self.storage.set_trial_state_values(m._trial_id, t.state, t.values)
        except ValueError:  # e.g. a user's enqueued value outside its distribution (Optuna only warns)
            self.usable = False
        return self.usable

    def ask(self, storage, dists: dict, k: int, into: list, *, trials) -> None:
        """Append ``k`` running trials to ``into``, asked against the copy brought up to ``trials``; each is
        written to the study (``storage``) in one transaction, and a waiting trial the copy takes is taken in the
        study too. Where the study and the copy fall out of step (another process wrote to the study meanwhile), the
        copy starts again from what the study holds; fewer than ``k`` where the copy is no longer ``usable``."""
        import optuna

        State = optuna.trial.TrialState
        if not self.sync(trials):
            return
        study_id = storage.get_study_id_from_name(self.ostudy.study_name)
        waiting = {t.number: t for t in trials if t.state == State.WAITING}
        while len(into) < k:
            asked = self.study.ask(fixed_distributions=dists)
            m = self.storage.get_trial(asked._trial_id)
            if m.number in waiting:  # an enqueued trial (a warm start's, a retry's): the study's, taken as Study.ask does
                w = waiting.pop(m.number)
                taken = _claim(storage, w._trial_id)  # False: another process took it
                if taken:
                    for name, value in m.params.items():
                        if name not in w.params:
                            d = m.distributions[name]
                            storage.set_trial_param(w._trial_id, name, d.to_internal_repr(value), d)
                    for key, value in m.system_attrs.items():
                        if key not in w.system_attrs:
                            storage.set_trial_system_attr(w._trial_id, key, value)
                    into.append(optuna.Trial(self.ostudy, w._trial_id))
            else:
                taken = True
                into.append(_create(self.ostudy, storage, study_id, params=m.params, distributions=m.distributions,
                                    system_attrs=m.system_attrs))
            if not taken or into[-1].number != m.number:  # out of step: start again from the study
                self._fresh()
                trials = self.ostudy.get_trials(deepcopy=False)
                if not self.sync(trials):
                    return
                waiting = {t.number: t for t in trials if t.state == State.WAITING}


def _copy(t):
    """``t`` for the copy: without its user attributes; with the times Optuna's validation asks for (a waiting trial
    failed by hand has no start)."""
    import datetime

    import optuna

    start, end = t.datetime_start, t.datetime_complete
    if start is None and t.state != optuna.trial.TrialState.WAITING:
        start = end or datetime.datetime.now()
    if end is None and t.state.is_finished():
        end = start
    return optuna.trial.FrozenTrial(
        number=t.number, state=t.state, value=None, values=t.values, datetime_start=start, datetime_complete=end,
        params=t.params, distributions=t.distributions, user_attrs={}, system_attrs=t.system_attrs,
        intermediate_values=t.intermediate_values, trial_id=t._trial_id)


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
        into.append(trial)
        popped = True
    if driver is None:
        wanted: list[tuple[dict, dict, Any]] = [({}, {}, None) for _ in range(k - len(into))]
    else:
        from . import space as space_mod
        from .cmaes import ATTR_GEN, ATTR_INDEX, ATTR_RESTART

        if popped:
            trials = ostudy.get_trials(deepcopy=False)
        wanted = [({k_: v for k_, v in space_mod.decode(space, c.x).items() if k_ in dists},
                   {ATTR_RESTART: c.restart, ATTR_GEN: c.generation, ATTR_INDEX: c.index}, driver.categoricals(c))
                  for c in driver.next_many(trials, k - len(into))]
    for fixed, attrs, rng in wanted:
        into.append(_create(ostudy, storage, study_id, params=draw(ostudy, dists, fixed, rng), distributions=dists,
                            user_attrs=attrs))


def draw(ostudy, dists: dict, fixed: dict[str, Any], rng=None) -> dict[str, Any]:
    """The parameters ``Study.ask(fixed_distributions=dists)`` gives a trial enqueued with ``fixed``: in the
    distributions' order, a fixed value as it is, a single-valued distribution's value, else the sampler's draw
    (a categorical: uniform from ``rng`` where given, CMA-ES's candidate's own)."""
    from optuna.distributions import CategoricalDistribution

    params = {}
    for name, d in dists.items():
        if name in fixed:
            params[name] = fixed[name]
        elif d.single():
            params[name] = d.choices[0] if hasattr(d, "choices") else d.low
        elif rng is not None and isinstance(d, CategoricalDistribution):
            params[name] = d.choices[int(rng.integers(len(d.choices)))]
        else:
            params[name] = ostudy.sampler.sample_independent(ostudy, None, name, d)
    return params


def _create(ostudy, storage, study_id: int, **template):
    """A new trial, running, with its values and attributes (``template``: ``create_trial``'s keywords) in one
    transaction, and its heartbeat: Optuna only ever fails as stale the trials that have one."""
    import optuna

    trial_id = storage.create_new_trial(study_id, template_trial=optuna.trial.create_trial(
        state=optuna.trial.TrialState.RUNNING, **template))
    storage.record_heartbeat(trial_id)
    return optuna.Trial(ostudy, trial_id)


def _claim(storage, trial_id: int) -> bool:
    """Set a waiting trial running, as ``Study.ask`` does, with its heartbeat from then on; False where another
    process was first."""
    import optuna

    try:
        if not storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.RUNNING):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    storage.record_heartbeat(trial_id)
    return True


def _suggest(trial, name: str, d) -> Any:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(name, d.choices)
    if isinstance(d, IntDistribution):
        return trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
