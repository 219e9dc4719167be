"""The value checks of every configuration section's ``validate()``: each raises :class:`ConfigError` naming the key."""

from __future__ import annotations

import math

from p2p_diloco.config.errors import ConfigError


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def positive(value: float, key: str) -> None:
    require(value > 0 and math.isfinite(value), key, f"must be a positive number, got {value!r}")


def non_negative(value: float, key: str) -> None:
    require(value >= 0 and math.isfinite(value), key, f"must be >= 0, got {value!r}")
