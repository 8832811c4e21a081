"""Errors a user can fix: one line, naming the field and what is allowed.

The CLI prints ``error: <message>`` for these and exits with status 2; any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input from a user: a policy, a study, a path or a flag.

    ``field`` is the dotted name of what is wrong (``policy.topology``,
    ``study.run.workers``); the message says what is allowed.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class DataNotFoundError(ConfigError):
    """Dataset files are missing and could not be downloaded."""


class RunError(RuntimeError):
    """A merge run could not finish (e.g. a process of a distributed run died); the message says why."""
