"""The numeric limits of the settings a user gives Opake: :class:`~opake_torch.transformers.TrainingArguments` and
the ``opake`` command line.

Each limit lies far from any working value and keeps the arithmetic of a run inside the types that carry it: a
training step forms products such as ``learning_rate * noise_multiplier * clipping_norm * (a normal draw)`` in
float32 (largest finite value 3.4e38), the accountants work in float64 and square the noise multiplier, and counts
reach torch's int32 index arithmetic. With every scale at most 1e6 such a product stays below 1e19, and a step's
weight decay cannot grow the weights (``learning_rate * weight_decay <= 1``). A value outside its limit is refused
when the arguments are built, before any budget is spent.
"""

from __future__ import annotations

import math
from typing import Any

from opake_core.errors import ConfigurationError
from opake_core.validate import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER  # the core's range, with its reasons

__all__ = [
    "MAX_COUNT",
    "MAX_NOISE_MULTIPLIER",
    "MAX_SCALE",
    "MAX_SEED",
    "MAX_WORKERS",
    "MIN_CLIPPING_NORM",
    "MIN_NOISE_MULTIPLIER",
    "MIN_TOLERANCE",
    "check_number",
    "is_real",
]

# Sizes, lengths, step counts and intervals: torch indexes tensors and kernels (attention offsets, cross-entropy
# targets) with int32 arithmetic, and no run approaches two billion steps or tokens per example.
MAX_COUNT = 2**31 - 1
# transformers.set_seed seeds numpy's legacy generator, which takes [0, 2**32).
MAX_SEED = 2**32 - 1
# Data-loader worker processes: more than any host has cores.
MAX_WORKERS = 1024
# Learning rate, weight decay, Adam's epsilon, clipping bounds, loss coefficients and temperatures, epochs.
MAX_SCALE = 1e6
# A clipping bound below 1e-12 underflows float32 once scaled by the noise multiplier and divided by the batch.
MIN_CLIPPING_NORM = 1e-12
# Relative tolerance of noise calibration: below 1e-9 the search runs into float64 rounding of epsilon itself.
MIN_TOLERANCE = 1e-9


def is_real(value: Any) -> bool:
    """A Python ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_number(
    value: Any,
    name: str,
    low: float | None,
    high: float | None,
    *,
    integer: bool = False,
    open_low: bool = False,
    open_high: bool = False,
    why: str = "",
    error: type[ConfigurationError] = ConfigurationError,
) -> int | float:
    """``value`` if it is a finite number (an ``int`` when ``integer``) in ``[low, high]`` (a side is open with
    ``open_low`` / ``open_high``, absent when ``None``), else ``error`` naming ``name``, the value, the range and
    ``why``. Huge ints are compared exactly, never converted to float."""
    ok = (isinstance(value, int) and not isinstance(value, bool)) if integer else is_real(value)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if open_low else value >= low
    if ok and high is not None:
        ok = value < high if open_high else value <= high
    if ok:
        return value
    if low is not None and high is not None:
        span = f"in {'(' if open_low else '['}{_show(low)}, {_show(high)}{')' if open_high else ']'} "
    elif low is not None:
        span = f"{'>' if open_low else '>='} {_show(low)} "
    elif high is not None:
        span = f"{'<' if open_high else '<='} {_show(high)} "
    else:
        span = ""
    kind = "an integer" if integer else "a finite number"
    seen = f"{value!r} (a bool, not a number)" if isinstance(value, bool) else repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and len(seen) > 24:
        seen = f"an int of {len(seen.lstrip('-'))} digits"
    what = f"{span}({kind}{'; ' + why if why else ''})" if span else f"{kind}{' (' + why + ')' if why else ''}"
    raise error(f"{name} must be {what}, got {seen}.")


def _show(bound: float) -> str:
    if bound == MAX_COUNT:
        return "2**31 - 1"
    if bound == MAX_SEED:
        return "2**32 - 1"
    return f"{bound:g}"
