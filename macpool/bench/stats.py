"""Percentiles, rounding and the order of measurements the benches report."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar


def pct(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ms(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value * 1000.0, digits)


def shares(total: int, parts: int) -> list[int]:
    """``total`` (clients, streams) in ``parts`` shares as equal as can be."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


_T = TypeVar("_T")


def take_turns(names: Sequence[str], rounds: int, measure: Callable[[str], _T]) -> list[dict[str, _T]]:
    """``measure`` each of ``names`` in turn, ``rounds`` times, the order reversed every other round: a drift
    of the machine during the run falls on every path alike, where measuring each path's whole share in one
    go let it fall on one. One dict (name -> result) per round."""
    turns: list[dict[str, _T]] = []
    for turn in range(max(rounds, 1)):
        order = list(names) if turn % 2 == 0 else list(reversed(names))
        turns.append({name: measure(name) for name in order})
    return turns
