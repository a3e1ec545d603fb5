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
    "WSD_SHAPES",
    "ConstantSchedule",
    "CosineRestartsSchedule",
    "CosineSchedule",
    "InverseSqrtSchedule",
    "LinearSchedule",
    "PolynomialSchedule",
    "Schedule",
    "WarmupSchedule",
    "WarmupStableDecaySchedule",
    "constant",
    "cosine",
    "cosine_restarts",
    "inverse_sqrt",
    "linear",
    "polynomial",
    "warmup_stable_decay",
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


def _cosine_factor(num_cycles: float, p: float) -> float:
    """``(1 + cos(2 pi num_cycles p)) / 2``, in the operation order of ``transformers.optimization``."""
    return 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * p))


@dataclass(frozen=True)
class CosineSchedule:
    """Cosine decay (Loshchilov & Hutter 2017, SGDR, without restarts):
    ``end_value + (init_value - end_value) * (1 + cos(2 pi num_cycles p)) / 2``, ``p`` as in :class:`LinearSchedule`.
    ``num_cycles=0.5`` (the default) is the half cosine from ``init_value`` down to ``end_value``."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0
    num_cycles: float = 0.5

    def __post_init__(self) -> None:
        _check_transition(self.init_value, self.end_value, self.transition_steps, self.transition_begin)
        validate.non_negative("num_cycles", self.num_cycles)

    def __call__(self, step: int) -> float:
        p = _progress(_step(step), self.transition_begin, self.transition_steps)
        return float(self.end_value + (self.init_value - self.end_value) * _cosine_factor(self.num_cycles, p))


@dataclass(frozen=True)
class CosineRestartsSchedule:
    """SGDR with hard restarts (Loshchilov & Hutter 2017): ``num_cycles`` half-cosine decays from ``init_value`` to 0
    over the transition, ``init_value * (1 + cos(pi * ((num_cycles * p) mod 1))) / 2``; 0 from the end of the
    transition on."""

    init_value: float
    transition_steps: int
    transition_begin: int = 0
    num_cycles: int = 1

    def __post_init__(self) -> None:
        _check_transition(self.init_value, 0.0, self.transition_steps, self.transition_begin)
        validate.integer("num_cycles", self.num_cycles, minimum=1)

    def __call__(self, step: int) -> float:
        p = _progress(_step(step), self.transition_begin, self.transition_steps)
        if p >= 1.0:
            return 0.0
        return float(self.init_value * 0.5 * (1.0 + math.cos(math.pi * ((float(self.num_cycles) * p) % 1.0))))


@dataclass(frozen=True)
class PolynomialSchedule:
    """Polynomial decay (BERT's, with ``power=1`` the linear one): ``end_value + (init_value - end_value) *
    (1 - p) ** power``, ``p`` as in :class:`LinearSchedule`; ``end_value < init_value``."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0
    power: float = 1.0

    def __post_init__(self) -> None:
        _check_transition(self.init_value, self.end_value, self.transition_steps, self.transition_begin)
        validate.positive("power", self.power)
        if not self.end_value < self.init_value:
            raise ConfigurationError(
                f"end_value must be below init_value for a polynomial decay, got end_value={self.end_value!r} and "
                f"init_value={self.init_value!r}; lower end_value (e.g. 1e-7)."
            )

    def __call__(self, step: int) -> float:
        p = _progress(_step(step), self.transition_begin, self.transition_steps)
        return float((self.init_value - self.end_value) * (1 - p) ** self.power + self.end_value)


@dataclass(frozen=True)
class InverseSqrtSchedule:
    """Inverse square-root decay (Vaswani et al. 2017): ``init_value`` until ``transition_begin``, then
    ``init_value / sqrt((step - transition_begin + timescale) / timescale)``."""

    init_value: float
    timescale: int
    transition_begin: int = 0

    def __post_init__(self) -> None:
        validate.non_negative("init_value", self.init_value)
        validate.integer("timescale", self.timescale, minimum=1)
        validate.integer("transition_begin", self.transition_begin, minimum=0)

    def __call__(self, step: int) -> float:
        step = _step(step)
        if step < self.transition_begin:
            return float(self.init_value)
        return float(self.init_value / math.sqrt((step - self.transition_begin + self.timescale) / self.timescale))


WSD_SHAPES = ("linear", "cosine", "1-sqrt")
"""The warm-up and decay shapes of :class:`WarmupStableDecaySchedule`."""


@dataclass(frozen=True)
class WarmupStableDecaySchedule:
    """Warm-up, stable, decay (Hu et al. 2024, MiniCPM): from ``min_lr_ratio * init_value`` up to ``init_value`` over
    ``warmup_steps`` (shape ``warmup_type``), ``init_value`` for ``stable_steps``, down to ``min_lr_ratio *
    init_value`` over ``decay_steps`` (shape ``decay_type``; ``"cosine"`` with ``num_cycles``), then
    ``min_lr_ratio * init_value``. Shapes of the fraction ``q`` of a phase done: ``"linear"`` ``q``, ``"cosine"``
    ``(1 - cos(pi q)) / 2``, ``"1-sqrt"`` ``1 - sqrt(1 - q)`` for the warm-up, mirrored for the decay."""

    init_value: float
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    warmup_type: str = "linear"
    decay_type: str = "cosine"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    def __post_init__(self) -> None:
        validate.non_negative("init_value", self.init_value)
        for name in ("warmup_steps", "stable_steps", "decay_steps"):
            validate.integer(name, getattr(self, name), minimum=0)
        for name in ("warmup_type", "decay_type"):
            if getattr(self, name) not in WSD_SHAPES:
                raise ConfigurationError(f"{name} must be one of {list(WSD_SHAPES)}, got {getattr(self, name)!r}.")
        ratio = validate.number("min_lr_ratio", self.min_lr_ratio)
        if not 0 <= ratio <= 1:
            raise ConfigurationError(f"min_lr_ratio is a fraction of init_value in [0, 1], got {ratio!r}.")
        validate.non_negative("num_cycles", self.num_cycles)

    def _factor(self, step: int) -> float:
        ratio = self.min_lr_ratio
        if step < self.warmup_steps:
            q = step / max(1, self.warmup_steps)
            shape = {"linear": q, "cosine": 0.5 * (1.0 - math.cos(math.pi * q)), "1-sqrt": 1.0 - math.sqrt(1.0 - q)}
            return max(0.0, shape[self.warmup_type] * (1.0 - ratio) + ratio)
        decay_begin = self.warmup_steps + self.stable_steps
        if step < decay_begin:
            return 1.0
        if step < decay_begin + self.decay_steps:
            q = (step - decay_begin) / max(1, self.decay_steps)
            shape = {"linear": 1.0 - q, "cosine": _cosine_factor(self.num_cycles, q), "1-sqrt": 1.0 - math.sqrt(q)}
            return max(0.0, shape[self.decay_type] * (1.0 - ratio) + ratio)
        return ratio

    def __call__(self, step: int) -> float:
        return float(self.init_value * self._factor(_step(step)))


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


def cosine(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0, *, num_cycles: float = 0.5
) -> CosineSchedule:
    """Half-cosine decay from ``init_value`` to ``end_value`` over ``transition_steps`` (>= 1) updates,
    starting after ``transition_begin`` (>= 0) updates (``num_cycles`` other than 0.5: that many cosine periods
    over the transition). Values finite and >= 0.

    Example: an optimizer takes a schedule as its learning rate.

        >>> from opake_core import optim
        >>> schedule = optim.schedules.cosine(1.0, 0.0, transition_steps=4)
        >>> [round(schedule(step), 4) for step in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
        >>> optimizer = optim.adam(lr=schedule)
    """
    return CosineSchedule(init_value, end_value, transition_steps, transition_begin, num_cycles)


def cosine_restarts(
    init_value: float, transition_steps: int, transition_begin: int = 0, *, num_cycles: int = 1
) -> CosineRestartsSchedule:
    """``num_cycles`` (>= 1) half-cosine decays from ``init_value`` to 0, each restarting at ``init_value``, over
    ``transition_steps`` updates after ``transition_begin``; 0 afterwards.

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.cosine_restarts(1.0, transition_steps=4, num_cycles=2)
        >>> [round(schedule(step), 4) for step in range(5)]
        [1.0, 0.5, 1.0, 0.5, 0.0]
    """
    return CosineRestartsSchedule(init_value, transition_steps, transition_begin, num_cycles)


def polynomial(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0, *, power: float = 1.0
) -> PolynomialSchedule:
    """Polynomial decay from ``init_value`` to ``end_value`` (below it) with exponent ``power`` (> 0) over
    ``transition_steps`` updates after ``transition_begin``.

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.polynomial(1.0, 0.0, transition_steps=4, power=2.0)
        >>> [schedule(step) for step in range(6)]
        [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    """
    return PolynomialSchedule(init_value, end_value, transition_steps, transition_begin, power)


def inverse_sqrt(init_value: float, timescale: int, transition_begin: int = 0) -> InverseSqrtSchedule:
    """``init_value`` until ``transition_begin``, then decay as ``1 / sqrt`` of the updates since, over
    ``timescale`` (>= 1) updates.

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.inverse_sqrt(1.0, timescale=1)
        >>> [schedule(step) for step in (0, 3, 8)]
        [1.0, 0.5, 0.3333333333333333]
    """
    return InverseSqrtSchedule(init_value, timescale, transition_begin)


def warmup_stable_decay(
    init_value: float,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> WarmupStableDecaySchedule:
    """The three phases of :class:`WarmupStableDecaySchedule` (its own warm-up: do not wrap it in
    :func:`with_warmup`).

    Example:

        >>> from opake_core import optim
        >>> schedule = optim.schedules.warmup_stable_decay(1.0, warmup_steps=2, stable_steps=2, decay_steps=2,
        ...                                                decay_type="linear")
        >>> [schedule(step) for step in range(7)]
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    return WarmupStableDecaySchedule(
        init_value, warmup_steps, stable_steps, decay_steps, warmup_type, decay_type, min_lr_ratio, num_cycles
    )


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
