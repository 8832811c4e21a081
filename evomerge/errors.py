"""Errors a user can fix: one line, naming the field and what is allowed.

The CLI prints ``error: <message>`` for these and exits with status 2; any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib


class ConfigError(ValueError):
    """Bad input from a user: a policy, a study, a path or a flag.

    ``field`` is the dotted name of what is wrong (``policy.topology``,
    ``study.run.workers``); the message says what is allowed.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


def nearest(word: str, options) -> str | None:
    """The option most like ``word`` (a misspelt flag, command or name), if any is close."""
    import difflib

    options = [str(o) for o in options]
    same = [o for o in options if o.lower() == str(word).lower()]  # "adamW": adamw, not the nearer-looking adam
    if same:
        return same[0]
    near = difflib.get_close_matches(str(word), options, n=1)
    return near[0] if near else None


# what other tools call a field evomerge names otherwise: spelt nothing alike, so nearest() cannot find them
SYNONYMS = {"learning_rate": "lr", "num_workers": "workers", "n_workers": "workers", "batch": "batch_size",
            "bs": "batch_size", "epoch": "epochs", "num_epochs": "epochs", "optim": "optimizer",
            "optimiser": "optimizer", "wd": "weight_decay", "trials": "n_trials"}


def did_you_mean(word, options) -> str:
    """``; did you mean a?`` with the option most like ``word`` (or its :data:`SYNONYMS` entry), or nothing when
    none is close."""
    options = [str(o) for o in options]
    near = None
    if isinstance(word, str):
        near = SYNONYMS.get(word.lower()) if SYNONYMS.get(word.lower()) in options else nearest(word, options)
        if near is None and len(word) >= 4:  # a synonym misspelt ("lerning_rate": lr; "w" is none)
            alike = nearest(word.lower(), [k for k, v in SYNONYMS.items() if v in options])
            near = SYNONYMS[alike] if alike else None
    return f"; did you mean {near}?" if near else ""


def unknown(value, allowed, more: str = "", noun: str = "") -> str:
    """The message for a value that is not one of ``allowed``: ``unknown 'x'; allowed: a, b`` (``noun``: ``unknown
    key 'x'``; ``more`` after the list), with the nearest allowed value when one is close (``; did you mean a?``)."""
    return _listed(f"unknown {noun + ' ' if noun else ''}{value!r}", value, allowed, more)


LONG_LIST = 20  # allowed values past which the nearest comes first (a policy's 48 fields made it a 900-character line)


def _listed(what: str, word, allowed, more: str = "") -> str:
    """``what; allowed: a, b`` and the nearest after it, or, before a list longer than :data:`LONG_LIST`, first."""
    allowed = [str(a) for a in allowed]
    near = did_you_mean(word, allowed)
    if near and len(allowed) > LONG_LIST:  # the nearest before a long list, where it is read
        return f"{what}{near} allowed: {', '.join(allowed)}{more}"
    return f"{what}; allowed: {', '.join(allowed)}{more}{near}"


def unknown_key(key: str, allowed) -> str:
    """The message for a key that is not one of ``allowed``, when the field's name already says which:
    ``unknown key; allowed: a, b`` and the nearest (first, before a long list)."""
    return _listed("unknown key", key, allowed)


@contextlib.contextmanager
def keyword_names(names, aliases: dict[str, str] | None = None):
    """For the Python API: a :class:`ConfigError` raised inside that names one of the command's flags
    (``--n-trials``) whose keyword is in ``names`` names the keyword the caller wrote (``n_trials``) instead, in its
    field and in its words (``--no-prune``: ``prune=False``); ``aliases``: a flag's keyword where it is spelt
    otherwise (``transfer``'s ``--study`` is its ``source``). The error keeps its type and traceback; the command
    line, which calls the same code, keeps its flags."""
    import re

    aliases = aliases or {}

    def keyword(flag: str) -> str | None:
        key = flag.replace("-", "_")
        key = aliases.get(key, key)
        return key if key in names else None

    def words(text: str) -> str:
        return re.sub(r"--(no-)?([a-z][a-z0-9-]*)",
                      lambda m: m[0] if (k := keyword(m[2])) is None else f"{k}=False" if m[1] else k, text)

    try:
        yield
    except ConfigError as e:
        key = keyword(e.field.removeprefix("--")) if e.field.startswith("--") else None
        message = words(e.message)
        if key is not None or message != e.message:
            e.field, e.message = key or e.field, message
            e.args = (f"{e.field}: {e.message}" if e.field else e.message,)
        raise


class DataNotFoundError(ConfigError):
    """Dataset files are missing and could not be downloaded."""


class RunError(RuntimeError):
    """A merge run could not finish (e.g. a process of a distributed run died); the message says why."""
