"""Arguments of Lion, AdEMAMix, RMSprop, Adagrad, RAdam, Adadelta and Schedule-Free AdamW are validated with errors
that name the argument and the value."""

from __future__ import annotations

import math

import pytest

from opake_core import optim
from opake_core.errors import ConfigurationError, InputTypeError


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: optim.lion(0.0), "lr must be positive and finite, got 0.0"),
        (lambda: optim.lion(betas=(0.9,)), r"betas must be a pair \(b1, b2\), got \(0.9,\)"),
        (lambda: optim.lion(betas=(0.9, 1.0)), r"betas\[1\] must lie in \[0, 1\), got 1.0"),
        (lambda: optim.lion(weight_decay=-0.1), "weight_decay must be non-negative and finite, got -0.1"),
        (lambda: optim.ademamix(-1e-3), "lr must be positive and finite, got -0.001"),
        (lambda: optim.ademamix(betas=(0.9, 0.999)), r"betas must be a triple \(b1, b2, b3\), got \(0.9, 0.999\)"),
        (lambda: optim.ademamix(betas=(0.9, 0.999, 1.0)), r"betas\[2\] must lie in \[0, 1\), got 1.0"),
        (lambda: optim.ademamix(alpha=-1.0), "alpha must be non-negative and finite, got -1.0"),
        (lambda: optim.ademamix(alpha=math.inf), "alpha must be non-negative and finite, got inf"),
        (lambda: optim.ademamix(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.ademamix(t_alpha=0), "t_alpha must be an int >= 1, got 0"),
        (lambda: optim.ademamix(t_beta3=-5), "t_beta3 must be an int >= 1, got -5"),
        (lambda: optim.rmsprop(math.inf), "lr must be positive and finite, got inf"),
        (lambda: optim.rmsprop(alpha=1.0), r"alpha must lie in \[0, 1\), got 1.0"),
        (lambda: optim.rmsprop(eps=-1e-8), "eps must be positive and finite, got -1e-08"),
        (lambda: optim.rmsprop(momentum=1.5), r"momentum must lie in \[0, 1\), got 1.5"),
        (lambda: optim.rmsprop(weight_decay=-1.0), "weight_decay must be non-negative and finite, got -1.0"),
        (lambda: optim.adagrad(lr_decay=-0.1), "lr_decay must be non-negative and finite, got -0.1"),
        (
            lambda: optim.adagrad(initial_accumulator_value=-1.0),
            "initial_accumulator_value must be non-negative and finite, got -1.0",
        ),
        (lambda: optim.adagrad(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.adagrad(weight_decay=math.inf), "weight_decay must be non-negative and finite, got inf"),
        (lambda: optim.radam(betas=(-0.1, 0.999)), r"betas\[0\] must lie in \[0, 1\), got -0.1"),
        (lambda: optim.radam(betas=[0.9, 0.99, 0.9]), r"betas must be a pair \(b1, b2\)"),
        (lambda: optim.radam(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.adadelta(0.0), "lr must be positive and finite, got 0.0"),
        (lambda: optim.adadelta(rho=1.0), r"rho must lie in \[0, 1\), got 1.0"),
        (lambda: optim.adadelta(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.schedule_free_adamw(betas=(0.9, 1.0)), r"betas\[1\] must lie in \[0, 1\), got 1.0"),
        (lambda: optim.schedule_free_adamw(betas=(0.0, 0.99)), r"betas\[0\] must lie in \(0, 1\).*use b1 > 0"),
        (lambda: optim.schedule_free_adamw(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.schedule_free_adamw(warmup_steps=-1), "warmup_steps must be an int >= 0, got -1"),
        (lambda: optim.schedule_free_adamw(r=-1.0), "r must be non-negative and finite, got -1.0"),
        (lambda: optim.schedule_free_adamw(weight_lr_power=-2.0), "weight_lr_power must be non-negative"),
        (lambda: optim.schedule_free_adamw(weight_decay=-0.1), "weight_decay must be non-negative"),
    ],
)
def test_configuration_errors(build, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        build()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: optim.lion("1e-4"), "lr must be a number, got str"),
        (lambda: optim.ademamix(t_alpha=10.0), "t_alpha must be an int, got float 10.0"),
        (lambda: optim.rmsprop(alpha=True), "alpha must be a number, got bool"),
        (lambda: optim.schedule_free_adamw(warmup_steps=2.5), "warmup_steps must be an int, got float 2.5"),
    ],
)
def test_type_errors(build, match: str) -> None:
    with pytest.raises(InputTypeError, match=match):
        build()
