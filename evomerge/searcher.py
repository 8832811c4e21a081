"""Moved to the package :mod:`evomerge.search`; this module only re-exports the names that code
outside it still imports from here (``dashboard.py``, ``tests/test_dashboard.py``) until they are
updated. New code imports from ``evomerge.search`` (or its modules)."""

from .search.config import SAMPLERS, SearchConfig, make_config  # noqa: F401
from .search.loop import SearchResult, run_search  # noqa: F401
from .search.results import (baseline_rows, best_trials, count_states, dominated_count, objective_label,  # noqa: F401
                             trial_summary)
from .search.storage import default_storage, load_or_create, open_storage  # noqa: F401
