"""Lion against a float64 loop written from Algorithm 2 of Chen et al. 2023 ("Symbolic Discovery of Optimization
Algorithms"), one coordinate at a time in plain Python floats."""

from __future__ import annotations

import math

import pytest
import torch
from noisy_quadratic import flat, gradient, run, start

from opake_core import optim
from opake_core.optim import schedules

STEPS = 80


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _paper(lr, b1: float, b2: float, weight_decay: float) -> dict[str, list[float]]:
    """Algorithm 2: c_t = b1 m + (1 - b1) g; theta -= eta_t (sign(c_t) + lambda theta); m = b2 m + (1 - b2) g."""
    theta = {k: v.flatten().tolist() for k, v in start().items()}
    m = {k: [0.0] * len(v) for k, v in theta.items()}
    for t in range(STEPS):
        eta = lr(t) if callable(lr) else lr
        for k in theta:
            g = gradient(k, theta[k], t)
            for i, gi in enumerate(g):
                c = b1 * m[k][i] + (1 - b1) * gi
                theta[k][i] = theta[k][i] - eta * (_sign(c) + weight_decay * theta[k][i])
                m[k][i] = b2 * m[k][i] + (1 - b2) * gi
    return theta


def _ours(opt: optim.Optimizer) -> dict[str, list[float]]:
    return flat(run(opt, STEPS)[0])


@pytest.mark.parametrize(
    ("lr", "betas", "weight_decay"),
    [
        (1e-2, (0.9, 0.99), 0.0),
        (3e-3, (0.8, 0.95), 0.3),
        (schedules.with_warmup(schedules.linear(1e-2, 1e-3, STEPS), 10), (0.9, 0.99), 0.1),
    ],
    ids=["defaults", "weight_decay", "schedule"],
)
def test_matches_algorithm_2(lr, betas, weight_decay) -> None:
    got = _ours(optim.lion(lr, betas, weight_decay))
    want = _paper(lr, *betas, weight_decay)
    for k in want:
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(got[k], want[k], strict=True)), k


def test_every_coordinate_moves_by_lr_whatever_the_gradient_scale() -> None:
    """The sign update: scaling the gradient (or its noise) by 1000 changes nothing."""
    params = {"w": torch.zeros(5, dtype=torch.float64)}
    g = torch.tensor([1e-6, -3.0, 2.0, -1e-3, 0.0], dtype=torch.float64)
    opt = optim.lion(0.01, non_private=True)
    small, _ = opt.update({"w": g}, opt.init(params), params=params)
    large, _ = opt.update({"w": 1000 * g}, opt.init(params), params=params)
    assert torch.equal(small["w"], large["w"])
    assert small["w"].tolist() == [-0.01, 0.01, -0.01, 0.01, 0.0]  # sign(0) = 0
