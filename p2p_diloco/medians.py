"""Medians of small lists that pick one of the values (never an average of two): what the swarm's peers vote with.

A lower median of claims or rounds is one that at least half the values reach; with two values it is the smaller,
so one peer of a pair never moves the result up (the robust reducer, the compression policy and the sync all rely
on that).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T", int, float)


def lower_median(values: Sequence[T]) -> T:
    """The median, the lower of the two middle values for an even count (of two values: the smaller)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def upper_median(values: Sequence[T]) -> T:
    """The median, the upper of the two middle values for an even count (of two values: the larger)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
