"""Name -> object registries that code outside the package can extend.

Entries may be the object itself or a lazy ``"module:attribute"`` reference, so the
registries are cheap to import (the CLI and the settings read their names before torch
is loaded) and an entry's module is imported only when a run uses it. The policy's and
the study's allowed values are these registries' keys (``settings.Choice``), so adding
an entry here is all it takes for a new name to validate.

    from evomerge import registry
    registry.MODELS.register("my-model", "mypackage.models:MyStackedModel")
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from .errors import ConfigError, unknown


class Registry(dict):
    """A mapping from names to objects (or ``"module:attribute"`` references, resolved on use)."""

    def __init__(self, field: str, entries: dict[str, Any]):
        super().__init__(entries)
        self.field = field

    def register(self, name: str, target: Any) -> None:
        self[name] = target

    def get_object(self, name: str) -> Any:
        """The object registered as ``name``; an unknown name is a one-line error naming the field."""
        if name not in self:
            raise ConfigError(self.field, unknown(name, self))
        target = self[name]
        if isinstance(target, str) and ":" in target:
            module, attr = target.split(":")
            target = getattr(importlib.import_module(module), attr)
            self[name] = target
        return target


def shipped_studies_dir() -> Path:
    """The studies folder shipped with evomerge (the ``evomerge.studies`` package, found without importing it, or
    the source tree's ``studies/``): the shipped studies and, in its ``policies/``, the named policies."""
    spec = importlib.util.find_spec("evomerge.studies")  # mapped onto ``studies/`` by pyproject
    dirs = list(spec.submodule_search_locations or []) if spec else []
    return Path(dirs[0]).resolve() if dirs else Path(__file__).resolve().parent.parent / "studies"


#: stacked models (``study.model.name``): classes built as ``cls(input_shape, n_classes, **options)``
#: ``module`` is any ``nn.Module`` a study's ``[model] factory`` returns (:class:`evomerge.models.generic.GenericModel`)
MODELS = Registry("study.model.name", {"mlp": "evomerge.models:MLP", "cnn": "evomerge.models:CNN",
                                       "module": "evomerge.models.generic:GenericModel"})

#: how supports weight a merge (``policy.weighting``): :class:`evomerge.engine.weighting.Weighting`
WEIGHTINGS = Registry("policy.weighting", {
    "uniform": "evomerge.engine.weighting:Uniform",
    "examples": "evomerge.engine.weighting:Examples",
    "adaptive": "evomerge.engine.weighting:Adaptive",
})

#: what a worker sends (``policy.payload``): :class:`evomerge.engine.weighting.Payload`
PAYLOADS = Registry("policy.payload", {
    "weights": "evomerge.engine.weighting:Weights",
    "delta": "evomerge.engine.weighting:Delta",
    "gradient": "evomerge.engine.weighting:Gradient",
})
