"""What settings models share: pydantic v2 dataclasses whose errors are one :class:`ConfigError` line.

The policy (:mod:`evomerge.policy`) and the study sections (:mod:`evomerge.study`) are declared
with :func:`model`: a frozen pydantic dataclass (so ``dataclasses.replace``, ``fields`` and
``asdict`` keep working, and every construction validates), strict types (a string is not a
number; ints given for floats become floats), unknown keys refused, non-finite floats refused.
Bounds are ``Field(ge=..., le=...)``, choices are :class:`Choice` over a name -> object registry,
cross-field rules are ``model_validator``\\ s that raise :class:`ConfigError` naming the field.
A pydantic ``ValidationError`` never reaches a user: :func:`translate` turns its first error into
``<prefix>.<field>: <what is wrong>; allowed: <values>``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from .errors import ConfigError, unknown, unknown_key

CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Invalid(ValueError):
    """Raised inside a field validator: the message only; the field is where pydantic found it."""


class Choice:
    """A string field whose allowed values are the keys of a registry (a mapping or a sequence of names),
    read when a value is checked, so a name added to the registry later is accepted, and the JSON
    Schema's ``enum`` lists what the registry holds when the schema is written."""

    def __init__(self, registry: Mapping[str, Any] | tuple[str, ...]):
        self.registry = registry

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.registry)

    def check(self, value: str) -> str:
        if value not in self.registry:
            raise Invalid(unknown(value, self.names))
        return value

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        out = handler(schema)
        out["enum"] = list(self.names)
        return out


def model(prefix: str | Callable[[dict], str]):
    """Class decorator: a frozen, strict pydantic dataclass whose constructor raises :class:`ConfigError`.

    ``prefix`` names the object in error lines (``policy``, ``study.run``); a callable gets the
    constructor's arguments by field name (a search-space parameter is named by its field).
    """

    def wrap(cls):
        cls = _pydantic_dataclass(frozen=True, config=CONFIG)(cls)
        init = cls.__init__
        names = list(cls.__pydantic_fields__)

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            if len(args) > len(names):
                raise TypeError(f"{cls.__name__} takes at most {len(names)} positional arguments")
            given = dict(zip(names, args))  # by name, so that errors name the field
            if set(given) & set(kwargs):
                raise TypeError(f"{cls.__name__} got {sorted(set(given) & set(kwargs))[0]!r} twice")
            kwargs = given | kwargs
            try:
                init(self, **kwargs)
            except ValidationError as e:
                where = prefix(kwargs) if callable(prefix) else prefix
                raise translate(e, where, cls) from None

        cls.__init__ = __init__
        return cls

    return wrap


def build(cls, data: Any, where: str):
    """``cls(**data)`` for a table read from a file, naming ``where`` if it is not a table."""
    if not isinstance(data, dict):
        raise ConfigError(where, f"must be a table, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(where, f"keys must be strings, got {show(bad[0])}")
    return cls(**data)


# -- errors --------------------------------------------------------------------------
_TYPES = {"float_type": "must be a number", "int_type": "must be an integer", "string_type": "must be a string",
          "bool_type": "must be true or false", "tuple_type": "must be a list", "list_type": "must be a list",
          "dict_type": "must be a table", "dataclass_type": "must be a table", "dataclass_args_type": "must be a table"}
_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def translate(error: ValidationError, prefix: str, cls) -> ConfigError:
    """The first error of ``error`` as one line naming the field (``prefix.loc``)."""
    e = error.errors()[0]
    loc = [str(x) for x in e["loc"] if not isinstance(x, int)]  # an item of a list is reported as the list
    kind, value = e["type"], e.get("input")
    field = ".".join([prefix, *loc]) if loc else prefix
    if kind == "value_error" or kind == "assertion_error":
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, ConfigError):
            return err
        return ConfigError(field, err.args[0] if isinstance(err, Invalid) else str(err or e["msg"]))
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        owner = _owner(cls, loc[:-1])
        return ConfigError(field, unknown_key(loc[-1] if loc else "", owner.__pydantic_fields__))
    if kind == "missing_argument" or kind == "missing":
        return ConfigError(field, "is required")
    if kind in _TYPES:
        allowed = _allowed(cls, loc)
        if not allowed and kind in ("float_type", "int_type") and isinstance(value, str):
            try:  # a number in quotes (epochs = "3"): TOML's string, said how to write it
                v = float(value)
                if kind == "float_type" and math.isfinite(v):
                    allowed = f"; allowed: a number without quotes ({v:g})"
                elif kind == "int_type" and math.isfinite(v) and v.is_integer():
                    allowed = f"; allowed: an integer without quotes ({int(v)})"
            except ValueError:
                pass
        return ConfigError(field, f"{_TYPES[kind]}, got {show(value)}{allowed}")
    if kind == "finite_number":
        return ConfigError(field, f"must be finite, got {value}")
    if kind in _RANGE:
        info = _owner(cls, loc[:-1]).__pydantic_fields__[loc[-1]]
        return ConfigError(field, f"{value} is out of range; allowed: {range_text(info)}")
    if kind == "too_short":
        return ConfigError(field, "must not be empty")
    return ConfigError(field, e["msg"])


def _allowed(cls, loc: list[str]) -> str:
    """``; allowed: ...`` for the field at ``loc`` below ``cls`` where it has a list of names or a range, else ''."""
    if not loc:
        return ""
    info = getattr(_owner(cls, loc[:-1]), "__pydantic_fields__", {}).get(loc[-1])
    if info is None:
        return ""
    choice = choice_of(info)
    if choice is not None:
        return f"; allowed: {', '.join(choice.names)}"
    if any(b is not None for b in bounds(info)[:2]):
        return f"; allowed: {range_text(info)}"
    return ""


def _owner(cls, path: list[str]):
    """The settings class that holds the field at ``path`` below ``cls``."""
    for name in path:
        ann = cls.__pydantic_fields__[name].annotation
        if not hasattr(ann, "__pydantic_fields__"):
            break
        cls = ann
    return cls


def bounds(info) -> tuple[Any, Any, bool, bool]:
    """(low, high, low_open, high_open) of a pydantic field (None where unbounded)."""
    low = high = None
    low_open = high_open = False
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            low = m.ge
        if getattr(m, "gt", None) is not None:
            low, low_open = m.gt, True
        if getattr(m, "le", None) is not None:
            high = m.le
        if getattr(m, "lt", None) is not None:
            high, high_open = m.lt, True
    return low, high, low_open, high_open


def range_text(info) -> str:
    low, high, low_open, high_open = bounds(info)
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    return f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"


def choice_of(info) -> Choice | None:
    return next((m for m in info.metadata if isinstance(m, Choice)), None)


def show(value: Any) -> str:
    """A value as error lines show it: its type and its JSON form (``str "x"``, ``bool true``)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = ""
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return f"{type(value).__name__} {text}".strip()

