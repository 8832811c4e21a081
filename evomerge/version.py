"""The package's version, in the lowest layer: every module that records it (exports, the dashboard, the study
store, the command line) reads it here."""

__version__ = "0.1.0"
