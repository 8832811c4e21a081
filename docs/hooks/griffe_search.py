"""Griffe extension for the API page: ``evomerge.search`` is the function that ``evomerge/__init__.py`` defines
after importing the subpackage of the same name (see the comment there), so ``::: evomerge.search`` documents the
function, as ``import evomerge; evomerge.search`` gives it. Griffe's static analysis would otherwise keep the
subpackage under that name."""

from __future__ import annotations

import griffe


class FunctionOverPackage(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self.function = None

    def on_function_instance(self, *, func, **kwargs) -> None:
        if func.name == "search" and func.parent is not None and func.parent.path == "evomerge":
            self.function = func

    def on_package(self, *, pkg, **kwargs) -> None:
        if pkg.path == "evomerge" and self.function is not None:
            pkg.set_member("search", self.function)
