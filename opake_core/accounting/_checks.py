"""Argument checks for accounting and sampling; messages name the argument, value and fix."""

from __future__ import annotations

import math
import numbers

from opake_core.errors import ConfigurationError, InputTypeError


def real(name: str, value: object) -> float:
    """``value`` as a finite float; NaN, infinities and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigurationError(f"{name} must be finite, got {value!r}; pass a finite number.")
    return value


def integer(name: str, value: object, *, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    value = int(value)
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}; pass a count of at least {minimum}.")
    return value


def rate(name: str, value: object) -> float:
    """A sampling probability in (0, 1]."""
    value = real(name, value)
    if not 0.0 < value <= 1.0:
        raise ConfigurationError(
            f"{name} must be in (0, 1], got {value!r}; use batch_size / dataset_size for an expected batch size."
        )
    return value


def delta(value: object) -> float:
    """A delta in (0, 1)."""
    value = real("delta", value)
    if not 0.0 < value < 1.0:
        raise ConfigurationError(f"delta must be in (0, 1), got {value!r}; a common choice is 1 / N**1.1.")
    return value


def epsilon(name: str, value: object) -> float:
    """A finite epsilon >= 0."""
    value = real(name, value)
    if value < 0.0:
        raise ConfigurationError(f"{name} must be >= 0, got {value!r}.")
    return value


def noise_multiplier(value: object) -> float:
    """A noise multiplier >= 0 (0 means a non-private release)."""
    value = real("noise_multiplier", value)
    if value < 0.0:
        raise ConfigurationError(
            f"noise_multiplier must be >= 0, got {value!r}; use 0 for an explicitly non-private run."
        )
    return value
