"""Small argument checks shared by the optimizers and the schedules; each raises with the argument's name."""

from __future__ import annotations

import math
import operator
from typing import Any

from opake_core.errors import ConfigurationError, InputTypeError


def number(value: Any, name: str) -> float:
    """``value`` as a float; refuses bools, non-numbers and NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if math.isnan(value):
        raise ConfigurationError(f"{name} must not be NaN.")
    return float(value)


def positive_finite(value: Any, name: str) -> float:
    v = number(value, name)
    if not (v > 0 and math.isfinite(v)):
        raise ConfigurationError(f"{name} must be positive and finite, got {value!r}.")
    return v


def non_negative_finite(value: Any, name: str) -> float:
    v = number(value, name)
    if not (v >= 0 and math.isfinite(v)):
        raise ConfigurationError(f"{name} must be non-negative and finite, got {value!r}.")
    return v


def decay(value: Any, name: str) -> float:
    """A decay rate in ``[0, 1)`` (betas, momentum)."""
    v = number(value, name)
    if not 0 <= v < 1:
        raise ConfigurationError(f"{name} must lie in [0, 1), got {value!r}.")
    return v


def count(value: Any, name: str, *, minimum: int) -> int:
    """An integer count (steps) that is at least ``minimum``."""
    if isinstance(value, bool):
        raise InputTypeError(f"{name} must be an integer, got bool {value!r}.")
    try:
        v = operator.index(value)
    except TypeError:
        raise InputTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}.") from None
    if v < minimum:
        raise ConfigurationError(f"{name} must be at least {minimum}, got {v}.")
    return v
