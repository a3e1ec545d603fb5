"""Schedule values at several steps, and their validation."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.optim import schedules


def test_constant() -> None:
    s = schedules.constant(0.1)
    assert [s(0), s(1), s(10**6)] == [0.1, 0.1, 0.1]


def test_linear() -> None:
    s = schedules.linear(1.0, 0.2, transition_steps=4, transition_begin=2)
    got = [s(step) for step in range(8)]
    want = [1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert got == pytest.approx(want, abs=1e-15)


def test_cosine() -> None:
    s = schedules.cosine(1.0, 0.0, transition_steps=4)
    got = [s(step) for step in range(6)]
    want = [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0.0, 0.0]
    assert got == pytest.approx(want, abs=1e-15)


def test_warmup_multiplies_the_unshifted_schedule() -> None:
    s = schedules.with_warmup(schedules.linear(1.0, 0.0, 10), 4, init_value=0.2)
    assert s(0) == pytest.approx(0.2 * 1.0)
    assert s(2) == pytest.approx((0.2 + 0.8 * 0.5) * 0.8)
    assert s(4) == pytest.approx(0.6)
    assert s(12) == 0.0


def test_warmup_of_a_float_and_collapse() -> None:
    s = schedules.with_warmup(0.5, 2)
    assert [s(0), s(1), s(2), s(3)] == [0.0, 0.25, 0.5, 0.5]
    inner = schedules.cosine(1.0, 0.1, 5)
    collapsed = schedules.with_warmup(inner, 3, init_value=1.0)
    assert [collapsed(i) for i in range(7)] == [inner(i) for i in range(7)]


def test_accepts_integer_tensor_steps_and_is_pure() -> None:
    s = schedules.linear(1.0, 0.0, 4)
    assert s(torch.tensor(2)) == s(2) == 0.5
    assert s(2) == s(2)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: schedules.constant(float("nan")), ConfigurationError, "value must be a number, got nan"),
        (lambda: schedules.constant(-1.0), ConfigurationError, "value must be non-negative"),
        (lambda: schedules.linear(1.0, 0.0, 0), ConfigurationError, "transition_steps must be an int >= 1"),
        (lambda: schedules.cosine(1.0, 0.0, -3), ConfigurationError, "transition_steps must be an int >= 1"),
        (lambda: schedules.linear(1.0, 0.0, 2.5), InputTypeError, "transition_steps must be an int"),
        (
            lambda: schedules.linear(1.0, 0.0, 4, -1),
            ConfigurationError,
            "transition_begin must be an int >= 0",
        ),
        (
            lambda: schedules.cosine(float("inf"), 0.0, 4),
            ConfigurationError,
            "init_value must be non-negative and",
        ),
        (lambda: schedules.linear(1.0, float("nan"), 4), ConfigurationError, "end_value must be a number, got nan"),
        (lambda: schedules.with_warmup(1.0, 0), ConfigurationError, "warmup_steps must be an int >= 1"),
        (
            lambda: schedules.with_warmup(1.0, 3, init_value=1.5),
            ConfigurationError,
            r"init_value .* \[0, 1\]",
        ),
        (lambda: schedules.with_warmup(1.0, 3, init_value=-0.1), ConfigurationError, "got -0.1"),
        (lambda: schedules.with_warmup("cosine", 3), InputTypeError, "schedule must be a number"),
        (lambda: schedules.constant(1.0)(-1), ConfigurationError, "step must be an int >= 0"),
    ],
)
def test_validation(build, error, match) -> None:
    with pytest.raises(error, match=match):
        build()
