"""Validation helpers for the ``opake_core.mf`` dataclasses: messages name the argument and the value seen."""

from __future__ import annotations

import math
from typing import Any

from opake_core.errors import ConfigurationError, InputTypeError


def integer(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def real(name: str, value: Any) -> float:
    """``value`` as a finite float (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value):
        raise ConfigurationError(f"{name} must be finite, got {value!r}.")
    return float(value)


def in_range(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``value`` as a float inside the interval; the message spells the interval out."""
    v = real(name, value)
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigurationError(f"{name} must be in {interval}, got {value!r}.")
    return v
