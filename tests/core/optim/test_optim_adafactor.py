"""Adafactor against a float64 reference written from Shazeer & Stern (2018), Algorithms 4 and 5."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import optim
from opake_core.optim import schedules
from opake_core.tree import Noised

DECAY, EPS1, EPS2, CLIP, WD = -0.8, 1e-30, 1e-3, 0.5, 0.01


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "matrix": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "stack": torch.randn(2, 3, 5, generator=g, dtype=torch.float64),
        "vector": torch.randn(6, generator=g, dtype=torch.float64),
        "scalar": torch.tensor(1e-5, dtype=torch.float64),  # its RMS is below eps2
    }


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) * (1 + step) for k, v in _params().items()}


def _rms(x: torch.Tensor) -> float:
    return math.sqrt(float((x**2).mean()))


def _factored_v(state: dict, key: tuple, g2: torch.Tensor, beta2: float) -> torch.Tensor:
    """Algorithm 4 on one matrix, with row and column sums as in the paper."""
    n, m = g2.shape
    r, c = state.get(key, (torch.zeros(n, dtype=g2.dtype), torch.zeros(m, dtype=g2.dtype)))
    r = beta2 * r + (1 - beta2) * (g2 @ torch.ones(m, dtype=g2.dtype))
    c = beta2 * c + (1 - beta2) * (torch.ones(n, dtype=g2.dtype) @ g2)
    state[key] = (r, c)
    return torch.outer(r, c) / r.sum()


def _reference(lr_of_step) -> dict[str, torch.Tensor]:
    params, moments = _params(), {}
    for step in range(5):
        t = step + 1
        beta2 = 1 - t**DECAY
        new = {}
        for k, x in params.items():
            g2 = _grads(step)[k] ** 2 + EPS1
            if x.ndim == 2:
                v_hat = _factored_v(moments, (k,), g2, beta2)
            elif x.ndim == 3:
                v_hat = torch.stack([_factored_v(moments, (k, i), g2[i], beta2) for i in range(x.shape[0])])
            else:
                v_hat = beta2 * moments.get(k, torch.zeros_like(x)) + (1 - beta2) * g2
                moments[k] = v_hat
            u = _grads(step)[k] / v_hat.sqrt()
            u = u / max(1.0, _rms(u) / CLIP)
            alpha = lr_of_step(step) * max(EPS2, _rms(x))
            new[k] = x - alpha * u - lr_of_step(step) * WD * x
        params = new
    return params


@pytest.mark.parametrize("lr", [0.05, schedules.linear(0.1, 0.01, 4)], ids=["float", "schedule"])
def test_matches_paper_reference(lr) -> None:
    opt = optim.adafactor(lr, decay_rate=DECAY, eps=(EPS1, EPS2), clip_threshold=CLIP, weight_decay=WD)
    params = _params()
    state = opt.init(params)
    for step in range(5):
        updates, state = opt.update(Noised(_grads(step), 1.0, 0.3), state, params=params)
        params = optim.apply_updates(params, updates)
    want = _reference(lr if callable(lr) else lambda step: lr)
    for k in want:
        torch.testing.assert_close(params[k], want[k], atol=1e-12, rtol=1e-12)


def test_factored_state_is_sublinear() -> None:
    opt = optim.adafactor(non_private=True)
    state = opt.init(_params())
    rms_state = state[0]
    assert rms_state.row["matrix"].shape == (4,) and rms_state.col["matrix"].shape == (3,)
    assert rms_state.row["stack"].shape == (2, 3) and rms_state.col["stack"].shape == (2, 5)
    assert rms_state.v["matrix"].numel() == 0 and rms_state.v["vector"].shape == (6,)
