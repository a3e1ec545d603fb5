"""The one-pass clipped sum of bf16 layers (``clipped_product_sum``) against float64 sums over examples.

* The sum equals the float64 sum ``total + sum_i c_i G_i`` within the bound of its rounding: each contribution's
  margin ``c_i eps sum_t |g_t| |a_t|^T`` plus the float32 additions of the contributions, on shapes that are not
  multiples of the tiles, strided factors, and examples split among programs or not.
* An example with scale 0 adds exactly nothing, whatever its values.
* An example whose positions cancel: its accumulated gradient can be about twice its exact one, and the margin the
  engine's norms carry keeps its clipped contribution within the bound (without the margin it exceeds the bound).

All ``@pytest.mark.cuda``; ``OPAKE_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs them through the Triton
interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, kernel_device  # noqa: F401 (kernel_device: an autouse fixture)
from torch import nn

from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, ghost
from opake_torch.layerwise.precision import product_sum_error, summation_error
from opake_torch.patches.kernels._triton import interpreting
from opake_torch.patches.kernels.product_sums import clipped_product_sum, clipped_product_sum_supported

pytestmark = pytest.mark.cuda

CASES = {  # (m, T, out, in)
    "odd": (5, 70, 200, 130),
    "short": (3, 5, 129, 257),
    "wide": (4, 96, 64, 384),
}


def _case(case: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``g`` ``[m, T, out]`` and ``a`` ``[m, T, in]`` as strided views (the last two dimensions stored
    transposed), rows of very different sizes; float32 scales in ``(0, 1]`` with one 0; a float32 sum to add to."""
    m, positions, out, width = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, out, positions, generator=gen).transpose(1, 2)
    a = torch.randn(m, width, positions, generator=gen).transpose(1, 2)
    a = a * torch.exp2(torch.randint(-6, 6, (m, positions, 1), generator=gen))
    scale = torch.rand(m, generator=gen) * 0.9 + 0.1
    scale[1] = 0.0
    total = torch.randn(out, width, generator=gen)
    return g.to(DEVICE, torch.bfloat16), a.to(DEVICE, torch.bfloat16), scale.to(DEVICE), total.to(DEVICE)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("groups", [None, 1, 3])
def test_the_sum_equals_the_float64_sum_within_its_rounding_bound(case, groups):
    g, a, scale, total = _case(case)
    assert clipped_product_sum_supported(g, a, scale, total)
    ours = total.clone()
    clipped_product_sum(g, a, scale, ours, groups=groups)
    m, positions = g.shape[:2]
    g64, a64, c64 = g.double().cpu(), a.double().cpu(), scale.double().cpu()
    exact = total.double().cpu() + torch.einsum("i,ito,itk->ok", c64, g64, a64)
    spread = torch.einsum("i,ito,itk->ok", c64, g64.abs(), a64.abs())  # sum_i c_i sum_t |g_t| |a_t|^T
    eps = product_sum_error(positions)
    contributions = (1 + eps) * spread  # bounds sum_i |fl(c_i G~_i)|
    bound = eps * spread + summation_error(m + 3) * (total.double().cpu().abs() + contributions)
    error = (ours.double().cpu() - exact).abs()
    assert (error <= bound).all(), (error / bound).max().item()


def test_a_dropped_example_adds_nothing_whatever_its_values():
    g, a, scale, total = _case("odd")
    clean = total.clone()
    clipped_product_sum(g, a, scale, clean, groups=2)
    for value in (float("nan"), float("inf")):
        g_bad, a_bad = g.clone(), a.clone()
        g_bad[1, 3, 7], a_bad[1, 0, 2] = value, value  # example 1 has scale 0
        ours = total.clone()
        clipped_product_sum(g_bad, a_bad, scale, ours, groups=2)
        assert torch.equal(ours, clean)


def test_the_sum_takes_only_what_it_bounds():
    g, a, scale, total = _case("odd")
    assert not clipped_product_sum_supported(g.float(), a.float(), scale, total)  # float32 factors
    assert not clipped_product_sum_supported(g, a.float(), scale, total)  # mixed factors
    assert not clipped_product_sum_supported(g, a, scale.double(), total)
    assert not clipped_product_sum_supported(g, a, scale, total.double())
    assert not clipped_product_sum_supported(g, a, scale, total.T)  # the shape [out, in]
    assert not clipped_product_sum_supported(g, a, scale, total.T.contiguous().T)  # a strided sum
    assert not clipped_product_sum_supported(g[:0], a[:0], scale[:0], total)  # no example
    assert not clipped_product_sum_supported(g, a[:, :3], scale, total)  # positions disagree


WIDTH, POSITIONS = 256, 96  # T (in + out) < in out: the weight takes ghost norms
SMALL = 2.0**-24 * (1 + 2.0**-7)  # a bf16 number just above half of float32's spacing at 1


def _cancelling_case() -> tuple:
    """A bias-free linear layer under bf16 autocast and one example whose output gradient is all ones at positions 0,
    32 and 64 (one in each of the kernel's steps of 32 positions) and 0 elsewhere, with inputs ``1``, ``SMALL`` and
    ``-1`` there: the exact gradient is ``SMALL`` in every entry. A float32 accumulator that rounds to nearest turns
    ``1 + SMALL`` into ``1 + 2^-23``, so the accumulated gradient is ``2^-23``, about twice the exact one."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH, bias=False).to(DEVICE)
    apply, params, frozen = functional_model(model)

    def batch_loss(p, x, v):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = apply(p, frozen, x)
        return (y.float() * v).sum(dim=(1, 2))

    def loss(p, x, v):
        return batch_loss(p, x[None], v[None])[0]

    x, v = torch.zeros(1, POSITIONS, WIDTH), torch.zeros(1, POSITIONS, WIDTH)
    for position, value in ((0, 1.0), (32, SMALL), (64, -1.0)):
        x[0, position], v[0, position] = value, 1.0
    exact = SMALL * WIDTH  # the Frobenius norm of SMALL in each of WIDTH^2 entries
    return model, params, loss, batch_loss, (x.to(DEVICE), v.to(DEVICE)), exact


def _contribution(monkeypatch, bound: float, *, margin: bool) -> float:
    model, params, loss, batch_loss, batch, _ = _cancelling_case()
    if not margin:
        monkeypatch.setattr(ghost, "product_sum_error", lambda positions: 0.0)
    taken = []
    kernel = ghost.clipped_product_sum
    monkeypatch.setattr(ghost, "clipped_product_sum", lambda *args: taken.append(1) or kernel(*args))
    engine = Engine(gradients=LayerwiseGradients(model, batch_loss, norm_route="gram"))  # exact norms, no margin
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), normalize_by=1.0, engine=engine)
    clipped, _ = grad_fn(params, *batch, state=state)
    assert taken  # the sum took one pass
    return clipped.value["weight"].double().norm().item()


def test_the_accumulated_gradient_of_the_cancelling_example_is_what_it_claims():
    *_, (x, v), exact = _cancelling_case()
    g, a = v.to(torch.bfloat16), x.to(torch.bfloat16)
    assert torch.equal(a.float(), x)  # the inputs are bf16 numbers
    total = torch.zeros(WIDTH, WIDTH, device=DEVICE)
    clipped_product_sum(g, a, torch.ones(1, device=DEVICE), total)
    accumulated = total.double().norm().item()
    assert accumulated <= exact + product_sum_error(POSITIONS) * 2 * WIDTH  # the margin bounds it (S = 2 WIDTH)
    if interpreting():  # NumPy's float32 rounds to nearest; a GPU's accumulator may truncate and lose SMALL instead
        assert accumulated > 1.9 * exact


@pytest.mark.parametrize("margin", [True, False])
def test_the_margin_keeps_the_cancelling_example_within_the_bound(monkeypatch, margin):
    if not margin and not interpreting():
        pytest.skip("the case breaks the bound where the accumulator rounds to nearest (NumPy's, in the interpreter)")
    *_, exact = _cancelling_case()
    bound = 0.75 * exact  # the exact norm is clipped by 0.75; twice it by 1.5 without the margin
    contribution = _contribution(monkeypatch, bound, margin=margin)
    if margin:
        assert contribution <= bound
    else:  # the test would catch a missing margin
        assert contribution > 1.4 * bound
