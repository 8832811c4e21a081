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


def source_digest(ref: str, base_dir: str | Path | None) -> str | None:
    """The sha256 of the source of ``ref``'s module where it sits beside the study (a file, or a package's ``.py``
    files), so that a study's fingerprint changes with the user's own code; None for a module from ``sys.path``
    (an installed package: its version is not read here)."""
    import hashlib

    if base_dir is None or not isinstance(ref, str) or ":" not in ref:
        return None
    top = ref.split(":")[0].split(".")[0]
    local = _local_file(Path(base_dir), top)
    if local is None:
        return None
    root = local.parent
    files = sorted(f for f in root.rglob("*.py") if not any(part.startswith(".") for part in f.relative_to(root).parts)
                   ) if local.name == "__init__.py" else [local]  # (an editor's lock file .#x.py, a .venv inside)
    h = hashlib.sha256()
    for f in files:
        try:
            text = f.read_bytes().replace(b"\r\n", b"\n")  # a checkout's line ends are not a change of the code
        except OSError:  # a dangling link, a file gone meanwhile
            continue
        h.update(str(f.relative_to(root)).encode() + b"\0" + text + b"\0")
    return h.hexdigest()


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
        raise ConfigError(field, f"cannot import {module!r} (looked in {where}): {one_line(e)}") from None
    if not hasattr(mod, attr):
        raise ConfigError(field, f"module {module!r} ({getattr(mod, '__file__', '?')}) has no {attr!r}")
    fn = getattr(mod, attr)
    if not callable(fn):
        raise ConfigError(field, f"{ref} is a {type(fn).__name__}, not a function")
    return fn
