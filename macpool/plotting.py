"""Plots are an optional extra: matplotlib comes with ``pip install 'macpool[plot]'``."""

from __future__ import annotations

from types import ModuleType

INSTALL = "pip install 'macpool[plot]'"


class PlotUnavailable(RuntimeError):
    """A plot was asked for and matplotlib is not installed; the message says how to install it."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only: no display, no GUI toolkit)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"plots need matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check() -> None:
    """Raise `PlotUnavailable` now, before a run whose plot could not be drawn at its end."""
    pyplot()
