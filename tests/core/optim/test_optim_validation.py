"""Factory arguments are validated with errors that name the value."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import optim
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import Noised


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: optim.sgd(0.0), "lr must be positive and finite, got 0.0"),
        (lambda: optim.sgd(-0.1), "lr must be positive and finite, got -0.1"),
        (lambda: optim.adam(math.inf), "lr must be positive and finite, got inf"),
        (lambda: optim.adam(math.nan), "lr must be a number, got nan"),
        (
            lambda: optim.sgd(0.1, weight_decay=-1e-4),
            "weight_decay must be non-negative and finite, got -0.0001",
        ),
        (lambda: optim.momentum(0.1, 1.0), r"momentum must lie in \[0, 1\), got 1.0"),
        (lambda: optim.momentum(0.1, -0.5), r"momentum must lie in \[0, 1\), got -0.5"),
        (lambda: optim.adam(betas=(1.0, 0.999)), r"betas\[0\] must lie in \[0, 1\), got 1.0"),
        (lambda: optim.adamw(betas=(0.9, -0.1)), r"betas\[1\] must lie in \[0, 1\), got -0.1"),
        (lambda: optim.adam(betas=(0.9,)), r"betas must be a pair"),
        (lambda: optim.adam(eps=0.0), "eps must be positive and finite, got 0.0"),
        (lambda: optim.adamw(weight_decay=-0.01), "weight_decay must be non-negative and finite, got -0.01"),
        (lambda: optim.adafactor(decay_rate=0.8), r"decay_rate must lie in \[-1, 0\), got 0.8"),
        (lambda: optim.adafactor(eps=(0.0, 1e-3)), r"eps\[0\] must be positive and finite, got 0.0"),
        (lambda: optim.adafactor(eps=1e-3), "eps must be a pair"),
        (lambda: optim.adafactor(clip_threshold=0.0), "clip_threshold must be positive, got 0.0"),
        (
            lambda: optim.adafactor(weight_decay=-1.0),
            "weight_decay must be non-negative and finite, got -1.0",
        ),
    ],
)
def test_configuration_errors(build, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        build()


def test_type_errors() -> None:
    with pytest.raises(InputTypeError, match="lr must be a number, got str"):
        optim.sgd("0.1")
    with pytest.raises(InputTypeError, match="momentum must be a number, got bool"):
        optim.momentum(0.1, True)


def test_bad_schedule_value_is_reported_at_update() -> None:
    opt = optim.sgd(lambda step: -1.0)
    params = {"w": torch.zeros(2)}
    with pytest.raises(ConfigurationError, match=r"schedule returned -1\.0 at step 0"):
        opt.update(Noised({"w": torch.ones(2)}, 1.0, 0.0), opt.init(params))
