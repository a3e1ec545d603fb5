"""The product norm route on CUDA (bf16 tensor cores with float32 accumulation, TF32 or IEEE float32 matmuls): the
reported per-example norm bounds the exact float64 norm of the example's weight gradient from above, by at most
twice the stated margin ``gamma S``, whatever order the GPU's matmul sums in."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, hooks

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _two_part_sums(monkeypatch):
    """These tests are of the norm routes: the one-pass bf16 sum, whose margin the norms would carry where its kernel
    runs, is set aside (its tests: ``tests/torch/kernels/test_product_sums.py``)."""
    monkeypatch.setattr(hooks, "one_pass_sum", lambda call, total: False)


POSITIONS, WIDTH = 512, 256


def _inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if kind == "cancelling":  # position pairs whose terms cancel up to bf16's last bits
        x = torch.randn(1, POSITIONS // 2, WIDTH, generator=gen)
        v = torch.randn(1, POSITIONS // 2, WIDTH, generator=gen)
        x = torch.cat([x, x * (1 + 2.0**-7)], dim=1)
        v = torch.cat([v, -v], dim=1)
    else:  # rows of very different sizes
        x = torch.randn(1, POSITIONS, WIDTH, generator=gen) * torch.exp2(torch.randint(-8, 8, (1, POSITIONS, 1)))
        v = torch.randn(1, POSITIONS, WIDTH, generator=gen)
    return x.cuda(), v.cuda()


@pytest.mark.parametrize("inputs", ["cancelling", "spread"])
@pytest.mark.parametrize("setting", ["bf16_autocast", "tf32", "ieee"])
def test_the_product_route_bounds_the_exact_norm_on_cuda(inputs, setting):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = setting == "tf32"
    try:
        torch.manual_seed(0)
        model = nn.Linear(WIDTH, WIDTH, bias=False).cuda()
        apply, params, frozen = functional_model(model)
        autocast = setting == "bf16_autocast"
        scope = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

        def batch_loss(p, x, v):
            with scope():
                y = apply(p, frozen, x)
            return (y.float() * v).sum(dim=(1, 2))

        x, v = _inputs(inputs)
        engine = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6, norm_route="product")
        with torch.no_grad():
            grads, _ = engine(None, (params, x, v), (1, 2))
            reported = grads.squared_norms()[0, 0].sqrt().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    xf, vf = (x.to(torch.bfloat16), v.to(torch.bfloat16)) if autocast else (x, v)
    exact = (vf[0].double().T @ xf[0].double()).norm().item()
    spread = (xf[0].double().norm(dim=-1) * vf[0].double().norm(dim=-1)).sum().item()
    gamma = POSITIONS * 2.0**-23 / (1 - POSITIONS * 2.0**-23) + (0 if autocast else 3 * 2.0**-10)
    assert reported >= exact
    assert reported <= exact * (1 + 1e-6) + 2 * gamma * spread
