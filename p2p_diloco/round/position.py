"""Where a stage stands in the run: the round it trains, its inner step and the last round it applied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """Where a stage process stands in the run: what its progress record tells the swarm."""

    round: int
    inner_step: int
    applied_round: int
