"""Each optimizer, fed Noised trees with noise_std=0, matches the corresponding torch.optim optimizer."""

from __future__ import annotations

import pytest
import torch

from opake_core import optim
from opake_core.optim import schedules
from opake_core.tree import Noised

STEPS = 5


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(4, generator=g),
        "scale": torch.randn((), generator=g),
    }


def _grads(step: int) -> dict[str, torch.Tensor]:
    return {k: v * 0.5 for k, v in _params(100 + step).items()}


def _run_ours(opt: optim.Optimizer) -> dict[str, torch.Tensor]:
    params = _params()
    state = opt.init(params)
    for step in range(STEPS):
        updates, state = opt.update(Noised(_grads(step), 1.0, 0.0), state, params=params)
        params = optim.apply_updates(params, updates)
    return params


def _run_torch(make) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    opt = make(list(params.values()))
    for step in range(STEPS):
        grads = _grads(step)
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


CASES = {
    "sgd": (lambda: optim.sgd(0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_wd": (
        lambda: optim.sgd(0.1, weight_decay=0.05),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05),
    ),
    "momentum": (lambda: optim.momentum(0.1, 0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "nesterov_wd": (
        lambda: optim.momentum(0.1, 0.8, nesterov=True, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01),
    ),
    "adam": (lambda: optim.adam(1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "adam_betas": (
        lambda: optim.adam(1e-2, (0.8, 0.99), 1e-6),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    ),
    "adamw": (
        lambda: optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
    "adam_bc_sigma0": (
        lambda: optim.adam(1e-2, noise_bias_correction=True),
        lambda p: torch.optim.Adam(p, lr=1e-2),
    ),
    "adamw_bc_sigma0": (
        lambda: optim.adamw(1e-2, weight_decay=0.1, noise_bias_correction=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim(case: str) -> None:
    ours, theirs = CASES[case]
    got, want = _run_ours(ours()), _run_torch(theirs)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)


def test_schedule_matches_lambda_lr() -> None:
    sched = schedules.with_warmup(schedules.cosine(0.1, 0.01, 4), 2, init_value=0.5)

    def make(p):
        opt = torch.optim.SGD(p, lr=1.0, momentum=0.9)
        # LambdaLR multiplies the base lr (1.0) by sched(epoch), stepping after each update like our counter.
        make.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, sched)
        return opt

    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    torch_opt = make(list(params.values()))
    for step in range(STEPS):
        for k, p in params.items():
            p.grad = _grads(step)[k].clone()
        torch_opt.step()
        make.scheduler.step()
    got = _run_ours(optim.momentum(sched, 0.9))
    for k in params:
        torch.testing.assert_close(got[k], params[k].detach(), atol=1e-6, rtol=0)
