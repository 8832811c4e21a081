"""The layer order: each module imports only modules of its own layer or below, read with ``ast`` (function-level
imports included). The imports that still break it are listed by name below; a new one fails, and so does a
listed one that is gone (take it off the list): the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

import evomerge

ROOT = Path(evomerge.__file__).resolve().parent

# lowest first; a module belongs to the first layer whose prefix it matches (the longest prefix wins)
LAYERS = [
    ("foundations", ["errors", "settings", "registry", "userref", "engine.ops", "engine.topology", "procs",
                     "version", "sqlitefiles", "userdirs", "units", "dburls"]),
    ("what a run is made of", ["engine.schedule", "policy", "data", "models", "engine.similarity", "engine.datapool",
                               "study", "studies", "dashboards", "task", "text"]),
    ("engine", ["engine"]),
    ("backends", ["backends"]),
    ("entry points of a run, and their logging", ["simulate", "dist", "reference", "report.tracking", "runtime"]),
    ("search", ["search"]),
    ("report", ["report"]),
    ("commands and the package", ["cli", ""]),
]

# imports that break the order today (importer -> imported): the backend that the driver (engine/run.py) and the
# step merger (engine/merger.py) are typed with, under TYPE_CHECKING only
KNOWN = {("engine.run", "backends.base"), ("engine.merger", "backends.base")}


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") or p == "") and len(p) > best:
                best, rank = len(p), i
    return rank


def _imports():
    out = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        module = ".".join(parts)
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                else:
                    if not (node.module or "").startswith("evomerge"):
                        continue
                    base = (node.module or "").split(".")[1:]
                if node.level:
                    base = base + (node.module.split(".") if node.module else [])
                for alias in node.names:
                    cand = base + [alias.name]
                    target = cand if (ROOT.joinpath(*cand).with_suffix(".py").exists()
                                      or ROOT.joinpath(*cand).is_dir()) else base
                    out.add((module, ".".join(target)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("evomerge"):
                        out.add((module, ".".join(alias.name.split(".")[1:])))
    return {(a, b) for a, b in out if a != b}


def test_every_module_has_a_layer():
    for path in ROOT.rglob("*.py"):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        assert _layer(".".join(parts)) is not None, path


def test_no_module_imports_a_higher_layer_beyond_the_known_list():
    upward = {(a, b) for a, b in _imports() if _layer(b) > _layer(a)}
    new = upward - KNOWN
    assert not new, f"lower layers import higher ones: {sorted(new)}"
    gone = KNOWN - upward
    assert not gone, f"fixed, take them off KNOWN: {sorted(gone)}"
