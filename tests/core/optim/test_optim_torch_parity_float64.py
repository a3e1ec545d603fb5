"""RMSprop, Adagrad, RAdam and Adadelta match torch.optim in float64 over many steps, with gradients that depend on
the parameters (a noisy quadratic), so that every step's input depends on every earlier step's output."""

from __future__ import annotations

import pytest
import torch

from opake_core import optim
from opake_core.optim import schedules
from opake_core.tree import Noised

STEPS = 60
TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}  # float64: only summation-order rounding may differ


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "layer.bias": torch.randn(5, generator=g, dtype=torch.float64),
        "scale": torch.randn((), generator=g, dtype=torch.float64),
    }


def _curvature() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.rand(v.shape, generator=g, dtype=torch.float64) + 0.1 for k, v in _params().items()}


def _noise(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {k: 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in _params().items()}


def _grads(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The gradient of ``sum(h * p^2) / 2`` plus fixed per-step noise."""
    h, z = _curvature(), _noise(step)
    return {k: h[k] * params[k] + z[k] for k in params}


def _run_ours(opt: optim.Optimizer) -> dict[str, torch.Tensor]:
    params = _params()
    state = opt.init(params)
    for step in range(STEPS):
        updates, state = opt.update(Noised(_grads(params, step), 1.0, 0.0), state, params=params)
        params = optim.apply_updates(params, updates)
    return params


def _run_torch(make, schedule=None) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    opt = make(list(params.values()))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    for step in range(STEPS):
        grads = _grads({k: v.detach() for k, v in params.items()}, step)
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
        if lr_scheduler:
            lr_scheduler.step()
    return {k: v.detach() for k, v in params.items()}


SCHEDULE = schedules.with_warmup(schedules.cosine(1.0, 0.1, STEPS), 5, init_value=0.2)

CASES = {
    "rmsprop": (lambda: optim.rmsprop(1e-2), lambda p: torch.optim.RMSprop(p, lr=1e-2)),
    "rmsprop_all_options": (
        lambda: optim.rmsprop(5e-3, alpha=0.9, eps=1e-6, weight_decay=0.05, momentum=0.8, centered=True),
        lambda p: torch.optim.RMSprop(p, lr=5e-3, alpha=0.9, eps=1e-6, weight_decay=0.05, momentum=0.8, centered=True),
    ),
    "rmsprop_momentum": (
        lambda: optim.rmsprop(1e-3, momentum=0.9),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9),
    ),
    "adagrad": (lambda: optim.adagrad(0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adagrad_all_options": (
        lambda: optim.adagrad(0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.5, eps=1e-6),
        lambda p: torch.optim.Adagrad(
            p, lr=0.1, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.5, eps=1e-6
        ),
    ),
    "radam": (lambda: optim.radam(1e-2), lambda p: torch.optim.RAdam(p, lr=1e-2)),
    "radam_l2": (
        lambda: optim.radam(1e-2, (0.8, 0.99), 1e-6, weight_decay=0.1),
        lambda p: torch.optim.RAdam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "radam_decoupled": (
        lambda: optim.radam(1e-2, weight_decay=0.1, decoupled_weight_decay=True),
        lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    "adadelta": (lambda: optim.adadelta(), lambda p: torch.optim.Adadelta(p)),
    "adadelta_all_options": (
        lambda: optim.adadelta(0.5, rho=0.8, eps=1e-4, weight_decay=0.05),
        lambda p: torch.optim.Adadelta(p, lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.05),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim_in_float64(case: str) -> None:
    ours, theirs = CASES[case]
    got, want = _run_ours(ours()), _run_torch(theirs)
    assert not torch.equal(got["layer.weight"], _params()["layer.weight"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOLERANCE)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda lr: optim.rmsprop(lr, momentum=0.5), lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5)),
        (lambda lr: optim.adagrad(lr, lr_decay=0.05), lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.05)),
        (lambda lr: optim.radam(lr), lambda p: torch.optim.RAdam(p, lr=1e-2)),
        (lambda lr: optim.adadelta(lr), lambda p: torch.optim.Adadelta(p, lr=1e-2)),
    ],
    ids=["rmsprop", "adagrad", "radam", "adadelta"],
)
def test_schedule_matches_lambda_lr_in_float64(ours, theirs) -> None:
    """A schedule ``step -> lr`` equals LambdaLR stepping the base rate after each update."""
    got = _run_ours(ours(lambda step: 1e-2 * SCHEDULE(step)))
    want = _run_torch(theirs, SCHEDULE)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOLERANCE)


def test_radam_takes_momentum_steps_until_rho_exceeds_five() -> None:
    """The first five updates with b2 = 0.999 (rho_t = 1, 2, ..., 4.996) are -lr * m_hat exactly."""
    params = {"w": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)}
    opt = optim.radam(0.1, (0.5, 0.999))
    state, m = opt.init(params), torch.zeros(3, dtype=torch.float64)
    for step in range(6):
        g = {"w": torch.tensor([0.5, 1.0, -2.0], dtype=torch.float64) * (step + 1)}
        updates, state = opt.update(Noised(g, 1.0, 0.0), state, params=params)
        m = 0.5 * m + 0.5 * g["w"]
        sgd_step = -0.1 * m / (1 - 0.5 ** (step + 1))
        if step < 5:
            torch.testing.assert_close(updates["w"], sgd_step, rtol=1e-15, atol=0)
        else:
            assert not torch.allclose(updates["w"], sgd_step)
