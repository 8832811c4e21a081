"""Griffe extension for the API page: ``evomerge.search`` is the function that ``evomerge/__init__.py`` defines
after importing the subpackage of the same name (see the comment there), so ``::: evomerge.search`` documents the
function, as ``import evomerge; evomerge.search`` gives it. Griffe's static analysis would otherwise keep the
subpackage under that name. Its keywords come from one table (``evomerge/search/options.py``) through
``**options``; the page shows them as the signature ``inspect.signature(evomerge.search)`` gives, with defaults."""

from __future__ import annotations

import griffe


class FunctionOverPackage(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self.function = None

    def on_function_instance(self, *, func, **kwargs) -> None:
        if func.name == "search" and func.parent is not None and func.parent.path == "evomerge":
            from evomerge.search.options import OPTIONS

            params = [p for p in func.parameters if p.kind is not griffe.ParameterKind.var_keyword]
            at = next(i for i, p in enumerate(params) if p.kind is griffe.ParameterKind.keyword_only)
            params[at:at] = [griffe.Parameter(o.name, kind=griffe.ParameterKind.keyword_only, default=repr(o.default))
                             for o in OPTIONS]
            func.parameters = griffe.Parameters(*params)
            self.function = func

    def on_package(self, *, pkg, **kwargs) -> None:
        if pkg.path == "evomerge" and self.function is not None:
            pkg.set_member("search", self.function)
