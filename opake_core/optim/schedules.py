"""Learning-rate schedules: pure ``step -> float`` callables.

``step`` is the number of optimizer updates already applied (0 for the first update), an ``int`` or anything
with ``__index__`` (a 0-d integer tensor). Values are learning rates in the units of the optimizer's ``lr``.
Every schedule is a frozen dataclass, validated at construction (ConfigurationError naming the argument),
holds no state, and returns the same float for the same step.

Conventions (shared with optax): a schedule returns ``init_value`` while ``step < transition_begin``; the
transition takes ``transition_steps`` steps; after it the schedule stays at ``end_value``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "ConstantSchedule",
    "CosineSchedule",
    "LinearSchedule",
    "Schedule",
    "WarmupSchedule",
    "constant",
    "cosine",
    "linear",
    "with_warmup",
]

Schedule = Callable[[int], float]
"""A learning-rate schedule: the number of updates already applied -> learning rate."""


def _step(step: int) -> int:
    return validate.integer("step", step, minimum=0)


def _progress(step: int, transition_begin: int, transition_steps: int) -> float:
    """The fraction of the transition done at ``step``, in [0, 1]."""
    return min(max(step - transition_begin, 0), transition_steps) / transition_steps


@dataclass(frozen=True)
class ConstantSchedule:
    """``value`` at every step."""

    value: float

    def __post_init__(self) -> None:
        validate.non_negative("value", self.value)

    def __call__(self, step: int) -> float:
        _step(step)
        return float(self.value)


@dataclass(frozen=True)
class LinearSchedule:
    """``init_value + (end_value - init_value) * p`` with ``p = clip((step - transition_begin) /
    transition_steps, 0, 1)``."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __post_init__(self) -> None:
        _check_transition(self.init_value, self.end_value, self.transition_steps, self.transition_begin)

    def __call__(self, step: int) -> float:
        p = _progress(_step(step), self.transition_begin, self.transition_steps)
        return float(self.init_value + (self.end_value - self.init_value) * p)


@dataclass(frozen=True)
class CosineSchedule:
    """Half-cosine decay (Loshchilov & Hutter 2017, SGDR, without restarts):
    ``end_value + (init_value - end_value) * (1 + cos(pi * p)) / 2``, ``p`` as in :class:`LinearSchedule`."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __post_init__(self) -> None:
        _check_transition(self.init_value, self.end_value, self.transition_steps, self.transition_begin)

    def __call__(self, step: int) -> float:
        p = _progress(_step(step), self.transition_begin, self.transition_steps)
        return float(self.end_value + (self.init_value - self.end_value) * 0.5 * (1.0 + math.cos(math.pi * p)))


@dataclass(frozen=True)
class WarmupSchedule:
    """``schedule(step)`` times a linear ramp from ``init_value`` (a fraction of the schedule, in [0, 1]) at
    step 0 to 1 at ``warmup_steps``; from ``warmup_steps`` on, exactly ``schedule(step)``.

    The inner schedule is not shifted: to start a decay after the warm-up, give it
    ``transition_begin=warmup_steps``. ``init_value=1`` collapses to the inner schedule.
    """

    schedule: Schedule
    warmup_steps: int
    init_value: float = 0.0

    def __post_init__(self) -> None:
        if not callable(self.schedule):
            raise InputTypeError(
                f"schedule must be a float or a step -> float callable, got {type(self.schedule).__name__}."
            )
        validate.integer("warmup_steps", self.warmup_steps, minimum=1)
        init = validate.number("init_value", self.init_value)
        if not 0 <= init <= 1:
            raise ConfigurationError(
                f"init_value is the fraction of the schedule at step 0 and must lie in [0, 1], got {init!r}."
            )

    def __call__(self, step: int) -> float:
        step = _step(step)
        value = float(self.schedule(step))
        if step >= self.warmup_steps:
            return value
        ramp = self.init_value + (1.0 - self.init_value) * step / self.warmup_steps
        return ramp * value


def _check_transition(init_value: float, end_value: float, transition_steps: int, transition_begin: int) -> None:
    validate.non_negative("init_value", init_value)
    validate.non_negative("end_value", end_value)
    validate.integer("transition_steps", transition_steps, minimum=1)
    validate.integer("transition_begin", transition_begin, minimum=0)


def constant(value: float) -> ConstantSchedule:
    """A constant learning rate ``value`` (finite, >= 0).

    Example:

        >>> from opake_core import optim
        >>> optim.schedules.constant(0.1)(0), optim.schedules.constant(0.1)(10_000)
        (0.1, 0.1)
    """
    return ConstantSchedule(value)


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> LinearSchedule:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps`` (>= 1) updates,
    starting after ``transition_begin`` (>= 0) updates. Values finite and >= 0.

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.linear(1.0, 0.0, transition_steps=4, transition_begin=2)
        >>> [schedule(step) for step in range(8)]
        [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    return LinearSchedule(init_value, end_value, transition_steps, transition_begin)


def cosine(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> CosineSchedule:
    """Half-cosine decay from ``init_value`` to ``end_value`` over ``transition_steps`` (>= 1) updates,
    starting after ``transition_begin`` (>= 0) updates. Values finite and >= 0.

    Example: an optimizer takes a schedule as its learning rate.

        >>> from opake_core import optim
        >>> schedule = optim.schedules.cosine(1.0, 0.0, transition_steps=4)
        >>> [round(schedule(step), 4) for step in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
        >>> optimizer = optim.adam(lr=schedule)
    """
    return CosineSchedule(init_value, end_value, transition_steps, transition_begin)


def with_warmup(schedule: Schedule | float, warmup_steps: int, *, init_value: float = 0.0) -> WarmupSchedule:
    """``schedule`` (a callable, or a float for a constant) with a linear warm-up over ``warmup_steps`` (>= 1)
    updates that starts at ``init_value * schedule(0)``, ``init_value`` in [0, 1].

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.with_warmup(0.1, warmup_steps=4)
        >>> [round(schedule(step), 3) for step in range(6)]
        [0.0, 0.025, 0.05, 0.075, 0.1, 0.1]
    """
    if not callable(schedule):
        schedule = constant(validate.number("schedule", schedule))
    return WarmupSchedule(schedule, warmup_steps, init_value)
