"""The product route's norm kernel (``product_squared_norms``) against the float64 loop over examples.

For each example, ``sqrt(s~_i)`` times the kernel's rounding factor plus the route's margin ``gamma S_i`` must bound
the exact norm of ``g_i^T a_i`` (float64, from the factors as the kernel reads them) from above, and exceed it by at
most twice the margin. Shapes are not multiples of the tiles, the factors are strided views, and one case cancels
across positions, where a float32 accumulator loses the small terms.

All ``@pytest.mark.cuda``; ``OPAKE_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs them through the Triton
interpreter on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_device import DEVICE, kernel_device  # noqa: F401 (kernel_device: an autouse fixture)

from opake_torch.layerwise import ghost
from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.precision import product_norm_error
from opake_torch.patches.kernels.product_norms import (
    product_norm_rounding,
    product_squared_norms,
    product_squared_norms_supported,
)

pytestmark = pytest.mark.cuda

CASES = {  # (m, T, out, in)
    "odd": (3, 70, 200, 130),
    "short": (2, 5, 129, 257),
    "wide": (2, 96, 64, 384),
}


def _factors(case: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` ``[m, T, out]`` and ``a`` ``[m, T, in]`` as strided views (the last two dimensions stored transposed),
    with rows of very different sizes."""
    m, positions, out, width = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, out, positions, generator=gen).transpose(1, 2)
    a = torch.randn(m, width, positions, generator=gen).transpose(1, 2)
    a = a * torch.exp2(torch.randint(-6, 6, (m, positions, 1), generator=gen))
    return g.to(DEVICE, dtype), a.to(DEVICE, dtype)


def _cancelling(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One example whose large terms cancel: position 0 adds ``1`` to every entry of the gradient, the last position
    subtracts it, and the positions between add ``2^-24`` each (a tie that rounds back to 1 in a float32 accumulator
    that adds them after the first). Exact gradient: ``(T - 2) 2^-24`` in every entry, far below the margin."""
    positions, out, width = 96, 80, 136
    g, a = torch.full((1, positions, out), 2.0**-12), torch.full((1, positions, width), 2.0**-12)
    g[0, 0], a[0, 0], g[0, -1], a[0, -1] = 1.0, 1.0, -1.0, 1.0
    return g.to(DEVICE, dtype), a.to(DEVICE, dtype)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to TF32's 10 explicit significand bits (to nearest), as the tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def _reported_and_exact(g: torch.Tensor, a: torch.Tensor, precision: str) -> tuple[list[float], list[float], float]:
    """The route's reported norms, the exact float64 norms (a loop over examples) and the largest margin."""
    m, positions, out = g.shape
    gamma = product_norm_error(positions, factors=g.dtype, precision=precision)
    squares = product_squared_norms(g, a).cpu()
    spread = (g.double().norm(dim=-1) * a.double().norm(dim=-1)).sum(dim=1).cpu()
    reported = squares.sqrt() * product_norm_rounding(out, a.shape[-1]) + gamma * spread
    exact = []
    for i in range(m):  # the factors as the kernel reads them: bf16 numbers, or float32 ones rounded to TF32 or not
        gi, ai = g[i].double().cpu(), a[i].double().cpu()
        exact.append((gi.T @ ai).norm().item())
    return reported.tolist(), exact, (gamma * spread).max().item()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_bounds_the_float64_norms(case, dtype):
    precision = "tf32" if dtype == torch.float32 else "ieee"
    g, a = _factors(case, dtype)
    assert product_squared_norms_supported(g, a, precision)
    reported, exact, margin = _reported_and_exact(g, a, precision)
    for i, (r, e) in enumerate(zip(reported, exact, strict=True)):
        assert r >= e, f"example {i}: reported {r} below the exact norm {e}"
        assert r <= e * (1 + 1e-3) + 2 * margin, f"example {i}: reported {r} too far above {e}"
    if dtype == torch.float32:  # the factors are rounded to TF32 inside: the bound is for the float32 products
        rounded = [(_tf32(g[i]).double().T @ _tf32(a[i]).double()).norm().item() for i in range(g.shape[0])]
        assert all(r >= e for r, e in zip(reported, rounded, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_bounds_a_cancelling_example(dtype):
    precision = "tf32" if dtype == torch.float32 else "ieee"
    g, a = _cancelling(dtype)
    reported, exact, margin = _reported_and_exact(g, a, precision)
    assert exact[0] < margin  # the margin, not the accumulated sum, carries the bound here
    assert exact[0] <= reported[0] <= exact[0] * (1 + 1e-3) + 2 * margin


def test_a_non_finite_example_reports_a_non_finite_sum_and_leaves_the_others():
    g, a = _factors("odd", torch.bfloat16)
    g = g.clone()
    g[1, 3, 7] = float("nan")
    squares = product_squared_norms(g, a).cpu()
    assert not math.isfinite(squares[1].item())
    clean = product_squared_norms(*_factors("odd", torch.bfloat16)).cpu()
    assert torch.equal(squares[[0, 2]], clean[[0, 2]])


def test_the_kernel_takes_only_what_it_bounds():
    g, a = _factors("odd", torch.bfloat16)
    assert not product_squared_norms_supported(g.float(), a.float(), "ieee")  # IEEE float32: the gradients are formed
    assert not product_squared_norms_supported(g.double(), a.double(), "tf32")
    assert not product_squared_norms_supported(g, a.float(), "tf32")  # mixed factors
    assert not product_squared_norms_supported(g[:0], a[:0], "ieee")  # no example
    assert not product_squared_norms_supported(g, a[:, :3], "ieee")  # positions disagree


def test_the_route_with_the_kernel_reports_the_route_without_it(monkeypatch):
    """``product_norms`` through the kernel and through formed gradients: both bound the exact norms, within the
    rounding of one another."""
    g, a = _factors("odd", torch.bfloat16)
    m = g.shape[0]
    call = Call("linear", torch.nn.Linear(1, 1), {}, a.reshape(-1, a.shape[-1]), g.shape[1], g.reshape(-1, g.shape[-1]))
    fused = ghost.product_norms(call, m, "ieee")
    monkeypatch.setattr(ghost, "product_squared_norms_supported", lambda *args: False)
    formed = ghost.product_norms(call, m, "ieee")
    torch.testing.assert_close(ghost.finish([fused])[0], ghost.finish([formed])[0], rtol=2e-3, atol=0)
