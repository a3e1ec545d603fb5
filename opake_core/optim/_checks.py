"""Argument checks shared by the optimizer factories (messages name the argument, the value and the fix)."""

from __future__ import annotations

from typing import Any

from opake_core import validate
from opake_core.errors import ConfigurationError

_SHAPES = {2: "a pair (b1, b2)", 3: "a triple (b1, b2, b3)"}


def betas(value: Any, count: int) -> tuple[float, ...]:
    """``value`` as ``count`` decay rates, each in [0, 1)."""
    if not isinstance(value, tuple | list) or len(value) != count:
        raise ConfigurationError(f"betas must be {_SHAPES[count]}, got {value!r}.")
    return tuple(validate.decay(f"betas[{i}]", b) for i, b in enumerate(value))
