"""Sizes as people read them: one definition for every command that prints bytes."""

from __future__ import annotations


def size(n: float) -> str:
    """``n`` bytes in the unit that shows it: ``512 B``, ``20.5 kB``, ``1,234.5 MB`` (decimal units, as MLflow's
    and the dashboard's figures). A small model's payloads are kilobytes; in megabytes they would read ``0.0 MB``."""
    if abs(n) < 1e3:
        return f"{n:,.0f} B"
    if abs(n) < 1e6:
        return f"{n / 1e3:,.1f} kB"
    return f"{n / 1e6:,.1f} MB"
