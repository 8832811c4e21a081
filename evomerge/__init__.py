"""evomerge: search for the best way for data-parallel workers to merge their models.

Importing this package is cheap; torch is imported by the modules that need it.
"""

__version__ = "0.1.0"

from .errors import ConfigError  # noqa: E402
from .policy import MergePolicy  # noqa: E402

__all__ = ["ConfigError", "MergePolicy", "__version__", "run"]


def run(study, policy, seed: int = 0, *, data_dir=None, device=None, callback=None, evaluate_test: bool = False):
    """Run one merge run of ``policy`` on ``study`` (names, paths or objects) and return its :class:`RunResult`."""
    from . import simulate
    from .study import Study, load

    st = study if isinstance(study, Study) else load(study)
    pol = policy if isinstance(policy, MergePolicy) else st.resolve_policy(policy)
    setup = simulate.prepare(st, data_dir=data_dir)
    return simulate.simulate(setup, pol, seed, callback=callback, device=device, evaluate_test=evaluate_test)
