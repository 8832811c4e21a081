"""evomerge: search for the best way for data-parallel workers to merge their models.

Importing this package is cheap; torch is imported by the modules that need it.
"""

from .version import __version__  # noqa: E402,F401

from .errors import ConfigError  # noqa: E402

__all__ = ["ConfigError", "MergePolicy", "Merger", "MergerError", "__version__", "export", "rank_device",
           "ranks_on_this_machine", "run", "search"]


def __getattr__(name: str):
    """``evomerge.MergePolicy`` on first use: the policy model imports pydantic, which the command line
    loads only where it needs it."""
    if name == "MergePolicy":
        from .policy import MergePolicy

        return MergePolicy
    if name in ("Merger", "MergerError"):  # a found policy in the user's own loop (imports torch)
        from . import runtime

        return getattr(runtime, name)
    if name in ("rank_device", "ranks_on_this_machine"):  # a rank's device and backend; its machine's rank count
        from . import procs

        return getattr(procs, name)
    raise AttributeError(f"module 'evomerge' has no attribute {name!r}")


def _check_seed_and_device(seed, device) -> None:
    """What every command and its Python call check before anything is read: a seed is an integer >= 0
    (``--seed``), a device one this torch can run on (``--device``; torch is imported only when one is given)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError("--seed", f"{seed!r} is not an integer; allowed: an integer >= 0")
    if seed is not None and seed < 0:
        raise ConfigError("--seed", f"{seed} is out of range; allowed: an integer >= 0")
    if device:
        from .engine.setup import resolve_device

        resolve_device(device)


def run(study, policy, seed: int | None = None, *, data_dir=None, device=None, backend: str = "inprocess",
        procs: int | None = None, callback=None, evaluate_test: bool = False, emulate_time: bool = False,
        runs_dir=None, storage: str | None = None, lr: float | None = None):
    """Run one merge run of ``policy`` on ``study`` and return its :class:`RunResult`; ``evomerge run`` in Python.

    ``study`` is a name, a path or a Study (a name a search stored under ``runs_dir``, or in ``storage``, from a
    file elsewhere too); ``policy`` a MergePolicy, a dict of its fields (as ``Merger`` takes), a policy or exported
    JSON file, or a named policy (the study's ``policies/``, else the shipped ones). ``seed`` defaults to an exported
    file's first seed, else the study's first seed. ``backend="distributed"`` runs it on ``procs``
    processes (default one per worker) over ``torch.distributed``; call it under
    ``if __name__ == "__main__":`` (the processes are spawned); ``emulate_time`` paces its ranks to the
    simulated clock of a study with an ``[environment]``; ``lr`` runs it at that step size (default: an exported
    file's searched one, else the study's ``run.lr``). The keywords are the options of ``evomerge run`` that make
    its one run, with the same names and defaults (tests/test_cli.py holds them together); the command's
    ``--reevaluate``, ``--against``, ``--json`` and ``--quiet`` are the command's alone, and ``evaluate_test`` adds
    the test set's accuracy and loss to the result.
    """
    import inspect

    from .errors import keyword_names

    with keyword_names(inspect.signature(run).parameters):  # a bad keyword is named as the caller wrote it
        from .engine.setup import prepare
        from .backends import runner
        from .backends import found_with, given_lr, run_inputs
        from .search.results import load_or_stored
        from .study import Study, load

        _check_seed_and_device(seed, device)  # as `evomerge run` checks them: before anything is read
        from .study import check_given

        check_given(study)  # a name, a path or a Study: else one line naming `study`
        # an unknown name: load's own line
        st = study if isinstance(study, Study) else load_or_stored(study, runs_dir, storage) or load(study)
        pol, seed, exported = run_inputs(st, policy, seed, backend=backend, procs=procs)  # checked before data is read
        # an exported policy runs with the step size it was found with (lr's own line says the trial's)
        st, note = found_with(st, exported, ("lr",) if lr is not None else ())
        given = None
        if lr is not None:
            st, given, _ = given_lr(lr, st, exported, "")
        for line in (note, given):
            if line:
                import warnings

                warnings.warn(line.removeprefix("note: "), stacklevel=2)
        run_fn = runner(backend, procs, st.run.workers)
        extra = {}
        if emulate_time:
            from .backends import check_emulate_time

            check_emulate_time(backend, st)
            extra["emulate_time"] = True
        setup = prepare(st, data_dir=data_dir)
        return run_fn(setup, pol, seed, callback=callback, device=device, evaluate_test=evaluate_test, **extra)


# ``evomerge.search`` names the function below, not the subpackage: the subpackage is imported
# first (it is cheap), so that defining the function afterwards wins and later imports of
# ``evomerge.search.<module>`` find the package in sys.modules without resetting this attribute.
from . import search as _search_package  # noqa: E402,F401


def search(study, *, data=None, **options):
    """Search merge policies for ``study`` (a name, path or Study) and return a ``SearchResult``.

    The keywords are ``evomerge search``'s options, with the same defaults, from one table
    (:mod:`evomerge.search.options`; ``help(evomerge.search)`` lists them): the study's sampler
    and ``n_trials``, SQLite at ``RUNS_DIR/<study>/optuna.db``, MLflow at ``RUNS_DIR/<study>/mlflow.db``
    (or ``$MLFLOW_TRACKING_URI``), ``RUNS_DIR`` = ``$EVOMERGE_RUNS_DIR`` or ``runs``. ``data``: already
    loaded data (tests). Calling it again resumes the study; ``n_trials`` is the total of finished
    trials the study should hold. ``reevaluate=None`` is the command's default, 3 fresh seeds for the verdict (a
    number other than 0 beside ``verdict=False`` is refused, as ``--reevaluate N --no-verdict`` is). A search that
    ends with a best trial also runs the study's baselines on its seeds, as the command's end screen shows them
    (``result.baselines``, kept in the study: run once), and logs them in MLflow beside the trials
    (``baselines=False``: none, and no verdict). Optuna's own
    logging is left as the caller set it.
    """
    from .errors import keyword_names
    from .search.config import make_config
    from .search.loop import run_search
    from .search.options import DEFAULTS, check_keywords
    from .study import Study, load

    with keyword_names([*DEFAULTS, "study"]):  # a bad keyword is named as the caller wrote it (n_trials, not --n-trials)
        check_keywords("search", options)
        _check_seed_and_device(options.get("seed"), options.get("device"))  # as `evomerge search`: before any read
        from .study import check_given

        check_given(study)  # a name, a path or a Study: else one line naming `study`
        st = study if isinstance(study, Study) else load(study)
        return run_search(make_config(st, **options), data=data)


def export(study, path="best.json", *, trial: int | None = None, runs_dir=None, storage: str | None = None) -> dict:
    """Write the policy to deploy to ``path`` as ``evomerge export`` does and return the document written: the
    trial its rule picks (the rule under ``"picked_by"``), or trial number ``trial``; with the step size the policy
    was found with. It is the file ``Merger(path, ...)``, ``evomerge.run(study, path)`` and ``evomerge run
    --policy`` take. ``study``: what ``evomerge.search`` returned (its stores), or a study's name, path or Study
    whose search stored its trials under ``runs_dir`` (default ``$EVOMERGE_RUNS_DIR`` or ``runs``) or in
    ``storage``. A folder that does not exist is made."""
    from pathlib import Path

    from .errors import ConfigError, keyword_names

    with keyword_names(["trial", "study", "storage", "runs_dir"]):  # (export's lines name --trial, --study)
        from .report.export import export_best, export_trial
        from .search.config import default_runs_dir
        from .search.loop import SearchResult
        from .search.results import load_or_stored, stored_study
        from .search.storage import default_storage
        from .study import Study, check_given, load

        if isinstance(study, SearchResult):
            st, url = study.config.study, study.config.storage
        else:
            check_given(study)
            st = study if isinstance(study, Study) else load_or_stored(study, runs_dir, storage) or load(study)
            url = storage or default_storage(Path(runs_dir or default_runs_dir()) / st.name)
            got = stored_study(st.name, url)  # the definition its trials were searched with, as the command reads it
            st = got[0] if got is not None else st  # (a file changed since would rank them by its new objectives)
        out = Path(path)
        if out.is_dir():
            raise ConfigError("path", f"{str(out)!r} is a folder; allowed: a file to write the policy to (e.g. "
                                      f"{out / 'best.json'})")
        if trial is not None and (not isinstance(trial, int) or isinstance(trial, bool) or trial < 0):
            raise ConfigError("trial", f"{trial!r}; allowed: a trial number >= 0")
        try:
            doc = export_trial(st, url, out, trial) if trial is not None else export_best(st, url, out)
        except OSError as e:  # a folder that cannot be made or a file that cannot be written: one line, as the command
            raise ConfigError("path", f"cannot write {e.filename or out}: {e.strerror or e}") from None
        doc.pop("verdict_note", None)  # (what the command says beside the file, not in it)
        return doc


def _search_signature():
    import inspect

    from .search.options import signature

    return signature(search, inspect.Parameter("data", inspect.Parameter.KEYWORD_ONLY, default=None))


search.__signature__ = _search_signature()


def _search_keywords() -> str:
    """The options' words for ``help(evomerge.search)``, from the one table the command's --help reads."""
    from .search.options import OPTIONS

    def default(o) -> str:
        if o.shown is not None:
            return o.shown
        return repr(o.default)

    lines = [f"    {o.name}: {'False: ' if o.negate else ''}{o.help} (default: {default(o)})" for o in OPTIONS]
    switches = [o for o in OPTIONS if o.negate]
    said = ", ".join(f"``{o.name}=False``" for o in switches[:-1]) + f" and ``{switches[-1].name}=False``"
    flags = ", ".join(f"``{o.flag}``" for o in switches[:-1]) + f" and ``{switches[-1].flag}``"
    return "\n\n    Keywords (``evomerge search``'s flags, with ``_`` for ``-``; " + said + " are " + flags + "):\n\n" \
        + "\n".join(lines) + "\n"


search.__doc__ = (search.__doc__ or "") + _search_keywords()
