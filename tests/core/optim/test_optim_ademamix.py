"""AdEMAMix against a float64 loop written from Algorithm 1 of Pagliardini, Ablin, Grangier 2024 ("The AdEMAMix
Optimizer: Better, Faster, Older"), with its schedulers in the authors' half-life form; alpha = 0 against AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from noisy_quadratic import flat, gradient, run, start

from opake_core import optim
from opake_core.optim.ademamix import alpha_at, beta3_at
from opake_core.tree import Noised

STEPS = 80


def _half_life(beta: float) -> float:
    """The EMA's half-life minus one, ``ln(1/2) / ln(beta) - 1`` (-1 for beta = 0, the limit)."""
    return -1.0 if beta == 0 else math.log(0.5) / math.log(beta) - 1


def _reference_beta3(t: int, b1: float, b3: float, warmup: int | None) -> float:
    """The authors' scheduler: the half-life grows linearly from b1's to b3's."""
    if warmup is None or t >= warmup:
        return b3
    a = t / warmup
    return 0.5 ** (1 / ((1 - a) * _half_life(b1) + a * _half_life(b3) + 1))


def _reference_alpha(t: int, alpha: float, warmup: int | None) -> float:
    return alpha if warmup is None or t >= warmup else t / warmup * alpha


def _paper(lr, b1, b2, b3, alpha, eps, weight_decay, t_alpha, t_beta3) -> dict[str, list[float]]:
    theta = {k: v.flatten().tolist() for k, v in start().items()}
    m1 = {k: [0.0] * len(v) for k, v in theta.items()}
    m2 = {k: [0.0] * len(v) for k, v in theta.items()}
    nu = {k: [0.0] * len(v) for k, v in theta.items()}
    for t in range(1, STEPS + 1):
        beta3 = _reference_beta3(t, b1, b3, t_beta3)
        alpha_t = _reference_alpha(t, alpha, t_alpha)
        for k in theta:
            g = gradient(k, theta[k], t - 1)
            for i, gi in enumerate(g):
                m1[k][i] = b1 * m1[k][i] + (1 - b1) * gi
                m2[k][i] = beta3 * m2[k][i] + (1 - beta3) * gi
                nu[k][i] = b2 * nu[k][i] + (1 - b2) * gi * gi
                m1_hat = m1[k][i] / (1 - b1**t)
                nu_hat = nu[k][i] / (1 - b2**t)
                step = (m1_hat + alpha_t * m2[k][i]) / (math.sqrt(nu_hat) + eps) + weight_decay * theta[k][i]
                theta[k][i] = theta[k][i] - lr * step
    return theta


def _ours(opt: optim.Optimizer) -> dict[str, list[float]]:
    return flat(run(opt, STEPS)[0])


@pytest.mark.parametrize(
    ("lr", "betas", "alpha", "eps", "weight_decay", "t_alpha", "t_beta3"),
    [
        (1e-2, (0.9, 0.999, 0.9999), 5.0, 1e-8, 0.0, None, None),
        (1e-2, (0.8, 0.99, 0.999), 8.0, 1e-6, 0.1, 50, 60),
        (5e-3, (0.0, 0.99, 0.995), 4.0, 1e-8, 0.0, 30, 100),  # b1 = 0: the scheduler's limit
    ],
    ids=["no_warmup", "warmups_and_decay", "b1_zero"],
)
def test_matches_algorithm_1(lr, betas, alpha, eps, weight_decay, t_alpha, t_beta3) -> None:
    opt = optim.ademamix(lr, betas, alpha, eps, weight_decay, t_alpha=t_alpha, t_beta3=t_beta3)
    got = _ours(opt)
    want = _paper(lr, *betas, alpha, eps, weight_decay, t_alpha, t_beta3)
    for k in want:
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(got[k], want[k], strict=True)), k


@pytest.mark.parametrize(("b1", "b3"), [(0.9, 0.9999), (0.5, 0.999), (0.0, 0.99), (0.95, 0.9)])
def test_beta3_scheduler_is_the_half_life_interpolation(b1: float, b3: float) -> None:
    for t in range(1, 130):
        got, want = beta3_at(t, b1, b3, 120), _reference_beta3(t, b1, b3, 120)
        assert math.isclose(got, min(want, b3), rel_tol=1e-13), t
    assert beta3_at(1, b1, b3, None) == b3


def test_alpha_scheduler_is_linear() -> None:
    assert [alpha_at(t, 6.0, 4) for t in (1, 2, 3, 4, 5)] == [1.5, 3.0, 4.5, 6.0, 6.0]
    assert alpha_at(1, 6.0, None) == 6.0


def test_alpha_zero_is_adamw() -> None:
    """Without the slow EMA the update is AdamW's (torch.optim.AdamW, float64)."""
    params = start()
    torch_params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    reference = torch.optim.AdamW(list(torch_params.values()), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    opt = optim.ademamix(1e-2, (0.8, 0.99, 0.9999), alpha=0.0, eps=1e-7, weight_decay=0.05)
    state = opt.init(params)
    for t in range(STEPS):
        grads = {k: torch.tensor(gradient(k, v.flatten().tolist(), t), dtype=torch.float64).view(v.shape)
                 for k, v in params.items()}  # fmt: skip
        updates, state = opt.update(Noised(grads, 1.0, 0.0), state, params=params)
        params = optim.apply_updates(params, updates)
        for k, p in torch_params.items():
            p.grad = torch.tensor(gradient(k, p.detach().flatten().tolist(), t), dtype=torch.float64).view(p.shape)
        reference.step()
    for k, p in torch_params.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-12, atol=1e-12)
