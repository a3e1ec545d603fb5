"""Argument checks shared by the whole core: each takes ``(name, value, ...)``, returns the value in its canonical
type, and refuses with :class:`~opake_core.errors.InputTypeError` (wrong type) or
:class:`~opake_core.errors.ConfigurationError` (wrong value), naming the argument, the value seen and the fix."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "MIN_NOISE_MULTIPLIER",
    "decay",
    "delta",
    "epsilon",
    "in_range",
    "integer",
    "noise_multiplier",
    "non_negative",
    "number",
    "positive",
    "rate",
    "real",
]


def number(name: str, value: Any) -> float:
    """``value`` as a float: any real number but a bool or NaN (infinities pass)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    value = float(value)
    if math.isnan(value):
        raise ConfigurationError(f"{name} must be a number, got {value!r}.")
    return value


def real(name: str, value: Any) -> float:
    """``value`` as a finite float."""
    value = number(name, value)
    if not math.isfinite(value):
        raise ConfigurationError(f"{name} must be finite, got {value!r}; pass a finite number.")
    return value


def positive(name: str, value: Any, *, allow_inf: bool = False) -> float:
    """A float ``> 0``, finite unless ``allow_inf``."""
    value = number(name, value)
    if not (value > 0 and (allow_inf or math.isfinite(value))):
        raise ConfigurationError(f"{name} must be positive{'' if allow_inf else ' and finite'}, got {value!r}.")
    return value


def non_negative(name: str, value: Any) -> float:
    """A finite float ``>= 0``."""
    value = number(name, value)
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigurationError(f"{name} must be non-negative and finite, got {value!r}.")
    return value


def integer(name: str, value: Any, *, minimum: int) -> int:
    """``value`` as an int ``>= minimum``; anything with ``__index__`` (NumPy ints, 0-d integer tensors) counts,
    bools and floats are refused."""
    if isinstance(value, bool):
        raise InputTypeError(f"{name} must be an int, got bool {value!r}.")
    try:
        value = operator.index(value)
    except TypeError:
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.") from None
    if value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value}.")
    return value


def in_range(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``value`` as a float inside the interval; the message spells the interval out."""
    v = real(name, value)
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigurationError(f"{name} must lie in {interval}, got {value!r}.")
    return v


def decay(name: str, value: Any) -> float:
    """A decay rate in ``[0, 1)`` (betas, momentum)."""
    return in_range(name, value, 0.0, 1.0, low_open=False, high_open=True)


def rate(name: str, value: Any) -> float:
    """A sampling probability in ``(0, 1]``."""
    value = real(name, value)
    if not 0.0 < value <= 1.0:
        raise ConfigurationError(
            f"{name} must be in (0, 1], got {value!r}; use batch_size / dataset_size for an expected batch size."
        )
    return value


def delta(name: str, value: Any) -> float:
    """A delta in ``(0, 1)``."""
    value = real(name, value)
    if not 0.0 < value < 1.0:
        raise ConfigurationError(f"{name} must be in (0, 1), got {value!r}; a common choice is 1 / N**1.1.")
    return value


def epsilon(name: str, value: Any) -> float:
    """A finite epsilon ``>= 0``."""
    return non_negative(name, value)


MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER = 1e-6, 1e6
"""The range of a non-zero noise multiplier. Below 1e-6 a run's epsilon is astronomically large (non-private in all
but name), its noise underflows float32 next to a small clipping bound, and dp-accounting's RDP accountant answers
epsilon = 0 from about 1e-160 (its variance underflows): a wrong epsilon, not a large one. Above 1e6 every epsilon is
0 to many digits and dp-accounting's variance overflows from about 1e154."""


def noise_multiplier(name: str, value: Any) -> float:
    """A noise multiplier: 0 (an explicitly non-private release) or in
    [:data:`MIN_NOISE_MULTIPLIER`, :data:`MAX_NOISE_MULTIPLIER`]."""
    value = real(name, value)
    if value < 0.0:
        raise ConfigurationError(f"{name} must be >= 0, got {value!r}; use 0 for an explicitly non-private run.")
    if value and not MIN_NOISE_MULTIPLIER <= value <= MAX_NOISE_MULTIPLIER:
        raise ConfigurationError(
            f"{name} must be 0 (non-private) or in [{MIN_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}], got "
            f"{value!r}: outside that range the accountants and the float32 noise lose their meaning (a multiplier "
            "near 1e-160 reads as epsilon 0). Use 0.0 for a non-private run."
        )
    return value
