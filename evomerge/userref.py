"""The user's own code named in a study file: ``"module:function"`` references.

A reference is imported from the study file's folder first (``mymodels.py`` or a package
``mymodels/`` beside the study), then from ``sys.path``. The module is registered under its
name in ``sys.modules`` (so what it defines pickles by reference, for worker processes, which
import it the same way); a module of that name loaded from another folder is replaced.
Every failure is a one-line :class:`ConfigError` naming the study field.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError


def check_format(ref: Any, field: str, example: str, allowed: str = "") -> str:
    """``ref`` is a ``"module:function"`` string (checked when the study is read, before any import); ``allowed``
    names the other values the field takes, ahead of the reference (``"mse or "``)."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(p.strip() for p in ref.split(":")):
        if allowed:
            raise ConfigError(field, f"unknown {ref!r}; allowed: {allowed}'module:function', e.g. {example!r}")
        raise ConfigError(field, f"{ref!r} must be 'module:function', e.g. {example!r}")
    module, attr = ref.split(":")
    if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
        raise ConfigError(field, f"{ref!r} must be 'module:function' with Python names, e.g. {example!r}")
    return ref


def one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def raised(e: BaseException, base_dir: str | Path | None) -> str:
    """:func:`one_line` for an error the user's function raised; for a module it imports in its body that sits beside
    the study, why it was not found (the study's folder is on ``sys.path`` only while the study's module loads)."""
    text = one_line(e)
    top = (getattr(e, "name", None) or "").split(".")[0]
    if isinstance(e, ModuleNotFoundError) and top and base_dir is not None and _local_file(Path(base_dir), top):
        text += (f" ({top} is beside the study, but its folder is importable only while the study's module loads: "
                 f"import {top} at the top of that module)")
    return text


def _local_file(base_dir: Path, top: str) -> Path | None:
    for p in (base_dir / f"{top}.py", base_dir / top / "__init__.py"):
        if p.is_file():
            return p
    return None


def _module_files(base_dir: Path, top: str) -> tuple[Path, list[Path]] | None:
    """``top``'s files where it sits beside the study: (the folder they are named from, the ``.py`` files: the one
    file, or a package's); None for a module from ``sys.path``."""
    local = _local_file(base_dir, top)
    if local is None:
        return None
    root = local.parent
    files = sorted(f for f in root.rglob("*.py") if not any(part.startswith(".") for part in f.relative_to(root).parts)
                   ) if local.name == "__init__.py" else [local]  # (an editor's lock file .#x.py, a .venv inside)
    return root, files


def _digest(root: Path, files: list[Path]) -> str:
    import hashlib

    h = hashlib.sha256()
    for f in files:
        try:
            text = f.read_bytes().replace(b"\r\n", b"\n")  # a checkout's line ends are not a change of the code
        except OSError:  # a dangling link, a file gone meanwhile
            continue
        h.update(str(f.relative_to(root)).encode() + b"\0" + text + b"\0")
    return h.hexdigest()


def source_digest(ref: str, base_dir: str | Path | None) -> str | None:
    """The sha256 of the source of ``ref``'s module where it sits beside the study (a file, or a package's ``.py``
    files), so that a study's fingerprint changes with the user's own code; None for a module from ``sys.path``
    (an installed package: its version is not read here)."""
    if base_dir is None or not isinstance(ref, str) or ":" not in ref:
        return None
    found = _module_files(Path(base_dir), ref.split(":")[0].split(".")[0])
    return None if found is None else _digest(*found)


def source_file(ref: str, base_dir: str | Path | None) -> str | None:
    """The file (or package folder) of ``ref``'s module beside the study, as a line names it; None where it is not
    there."""
    if base_dir is None or not isinstance(ref, str) or ":" not in ref:
        return None
    return _shown(Path(base_dir), ref.split(":")[0].split(".")[0])


def _shown(base_dir: Path, top: str) -> str | None:
    """Module ``top``'s file beside the study as a line names it (a package by its folder); None if not there."""
    local = _local_file(base_dir, top)
    return None if local is None else (local.name if local.name != "__init__.py" else f"{local.parent.name}/")


def neighbours(ref: str, base_dir: str | Path | None) -> tuple[list[str], str] | None:
    """The other modules beside the study that ``ref``'s module imports (``import helpers``, ``from helpers import
    f``, anywhere in its code, and theirs in turn), read from their source without running it: their names and the
    digest of their files; None where there are none (an edited helper module changed the data or the model, and a
    search resumed on its old trials)."""
    import ast

    if base_dir is None or not isinstance(ref, str) or ":" not in ref:
        return None
    base, first = Path(base_dir), ref.split(":")[0].split(".")[0]
    seen, todo, found = {first}, [first], []
    while todo:
        got = _module_files(base, todo.pop())
        if got is None:
            continue
        for f in got[1]:
            try:
                tree = ast.parse(f.read_bytes())
            except (OSError, SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in seen and _local_file(base, top) is not None:
                        seen.add(top)
                        todo.append(top)
                        found.append(top)
    if not found:
        return None
    import hashlib

    h = hashlib.sha256()
    for top in sorted(found):
        root, files = _module_files(base, top)
        h.update(top.encode() + b"\0" + _digest(root, files).encode())
    return sorted(_shown(base, t) for t in found), h.hexdigest()


def _import(module: str, base_dir: Path | None):
    top = module.split(".")[0]
    local = _local_file(base_dir, top) if base_dir is not None else None
    if local is None:
        return importlib.import_module(module)
    loaded = sys.modules.get(top)
    if loaded is None or Path(getattr(loaded, "__file__", "") or "").resolve() != local.resolve():
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]  # a module of that name from another folder
        spec = importlib.util.spec_from_file_location(
            top, local, submodule_search_locations=[str(local.parent)] if local.name == "__init__.py" else None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[top] = mod
        sys.path.insert(0, str(base_dir))  # the module may import its neighbours while it loads
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[top]
            raise
        finally:
            sys.path.remove(str(base_dir))
    return importlib.import_module(module)


def resolve(ref: str, field: str, base_dir: str | Path | None, example: str) -> Callable:
    """The callable ``ref`` names; one-line errors naming ``field`` when it cannot be had."""
    check_format(ref, field, example)
    module, attr = ref.split(":")
    where = f"{base_dir} and sys.path" if base_dir is not None else "sys.path"
    try:
        mod = _import(module, Path(base_dir) if base_dir is not None else None)
    except Exception as e:  # noqa: BLE001 - the user's module: any failure is reported in one line
        if module.endswith(".py"):  # a file's name where the module's is meant ("mydata.py:load")
            raise ConfigError(field, f"{ref!r} names a file; allowed: the module's name, as Python imports it "
                                     f"({module[:-3]}:{attr}), beside the study file or on sys.path") from None
        raise ConfigError(field, f"cannot import {module!r} (looked in {where}): {one_line(e)}") from None
    if not hasattr(mod, attr):
        # its own functions and classes (not what it imported), as a misspelt name is told the others
        own = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                     and getattr(v, "__module__", None) == mod.__name__)
        from .errors import did_you_mean

        listed = (f"; allowed: {', '.join(own[:12])}{', ...' if len(own) > 12 else ''}" if own else "")
        raise ConfigError(field, f"module {module!r} ({getattr(mod, '__file__', '?')}) has no {attr!r}{listed}"
                                 + (did_you_mean(attr, own) if own else ""))
    fn = getattr(mod, attr)
    if not callable(fn):
        raise ConfigError(field, f"{ref} is a {type(fn).__name__}, not a function")
    return fn
