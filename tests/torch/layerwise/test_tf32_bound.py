"""Reduced-precision float32 matmuls (TF32, bf16) in the layerwise engine's ghost sums: every example's contribution
stays within the clipping bound.

The CPU has no TF32, so the matmul of a ghost layer's scaled sum is replaced by one that rounds both of its factors to
TF32's 10 significand bits (to nearest) before an exact float64 product: what a TF32 tensor core does, up to the
rounding direction. The adversarial example has two positions whose inputs straddle a TF32 rounding boundary and
whose output gradients cancel: its true gradient is 50 times smaller than the gradient of its rounded factors.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, engine, ghost, matmul_precision, product_error

WIDTH = 64  # T (in + out) = 256 < in * out = 4096: the weight takes ghost norms


def _round(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``x`` rounded to ``bits`` explicit significand bits, to nearest (ties away from zero)."""
    drop = 23 - bits
    i = x.contiguous().view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def _tf32_product(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    total.add_((_round(x, 10).double() @ _round(y, 10).double()).float())


def _case() -> tuple:
    """A bias-free linear layer and a loss whose output gradient at position ``t`` is ``v_t``: example ``i``'s
    weight gradient is ``sum_t v_t x_t^T``."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH, bias=False)
    apply, params, frozen = functional_model(model)

    def batch_loss(p, x, v):
        return (apply(p, frozen, x) * v).sum(dim=(1, 2))

    def loss(p, x, v):
        return batch_loss(p, x[None], v[None])[0]

    ulp = 2.0**-10  # TF32's spacing in [1, 2)
    grid = 1 + ulp * torch.randint(0, 1000, (WIDTH,)).float()
    x = torch.stack([grid + 0.49 * ulp, grid + 0.51 * ulp])[None]  # round down, and up
    g = torch.randint(1, 8, (WIDTH,)).float()  # exact in TF32
    v = torch.stack([g, -g])[None]
    true = (v[0].T.double() @ x[0].double()).norm().item()
    rounded = (v[0].T.double() @ _round(x[0], 10).double()).norm().item()
    return model, params, loss, batch_loss, (x, v), true, rounded


def _contribution(monkeypatch, bound: float, *, margin: bool) -> float:
    """The norm of the one example's clipped contribution under emulated TF32 products."""
    model, params, loss, batch_loss, batch, _, _ = _case()
    monkeypatch.setattr(ghost, "_add_product", _tf32_product)
    monkeypatch.setattr(engine, "matmul_precision", lambda device: "tf32")
    if not margin:
        monkeypatch.setattr(engine, "product_error", lambda precision: 0.0)
    hooks = Engine(gradients=LayerwiseGradients(model, batch_loss))
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), normalize_by=1.0, engine=hooks)
    clipped, _ = grad_fn(params, *batch, state=state)
    return clipped.value["weight"].double().norm().item()


def test_the_adversarial_example_is_what_it_claims():
    *_, true, rounded = _case()
    assert rounded > 40 * true  # TF32 rounding of the factors makes the gradient 50 times larger


def test_tf32_products_keep_every_contribution_within_the_bound(monkeypatch):
    *_, true, rounded = _case()
    bound = rounded / 2  # above the true norm (unclipped without a margin), below the rounded one
    assert true < bound
    assert _contribution(monkeypatch, bound, margin=True) <= bound


def test_without_the_margin_tf32_products_exceed_the_bound(monkeypatch):
    *_, rounded = _case()
    bound = rounded / 2
    assert _contribution(monkeypatch, bound, margin=False) > 1.5 * bound  # the engine's sum would break the bound


def _float16_case(clip_factor: float) -> tuple:
    """A float16 linear layer and an example of two positions whose inputs differ by one float16 step and whose output
    gradients cancel: the true gradient is ``v (x_2 - x_1)^T``, each entry ``2^-10 v``. The inputs are chosen so
    that, scaled by ``clip_factor`` in float32 and rounded to TF32 (what the sum multiplies), they lie two TF32
    steps apart where the true distance is 1.1 steps."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH, bias=False).half()
    apply, params, frozen = functional_model(model)

    def batch_loss(p, x, v):
        return (apply(p, frozen, x).float() * v).sum(dim=(1, 2))

    def loss(p, x, v):
        return batch_loss(p, x[None], v[None])[0]

    step = 2.0**-10  # float16's spacing in [1, 2)
    low = 1 + step * torch.arange(1023.0)
    apart = (_round(low * clip_factor + clip_factor * step, 10) - _round(low * clip_factor, 10)) / 2.0**-11
    chosen = low[apart == 2]
    x1 = chosen[torch.randint(0, len(chosen), (WIDTH,))]
    x = torch.stack([x1, x1 + step])[None].half()
    g = torch.randint(1, 8, (WIDTH,)).float()
    v = torch.stack([g, -g])[None]
    true = (v[0].T.double() @ x[0].double()).norm().item()
    return model, params, loss, batch_loss, (x, v), true


@pytest.mark.parametrize("margin", [True, False])
def test_float16_layers_carry_the_margin_under_tf32(monkeypatch, margin):
    """A float16 layer's sum casts its factors to float32 and multiplies them at the run's precision: its norms carry
    the margin as a float32 layer's do. Without it the example below (clip factor 0.55) contributes about 1.45 times
    the bound."""
    model, params, loss, batch_loss, batch, true = _float16_case(0.55)
    monkeypatch.setattr(ghost, "_add_product", _tf32_product)
    monkeypatch.setattr(engine, "matmul_precision", lambda device: "tf32")
    if not margin:
        monkeypatch.setattr(engine, "product_error", lambda precision: 0.0)
    bound = 0.55 * true
    hooks = Engine(gradients=LayerwiseGradients(model, batch_loss))
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), normalize_by=1.0, engine=hooks)
    clipped, _ = grad_fn(params, *batch, state=state)
    contribution = clipped.value["weight"].double().norm().item()
    if margin:
        assert contribution <= bound
    else:
        assert contribution > 1.3 * bound  # the case breaks the bound unless the margin is there


def test_product_error_bounds_the_rounding_of_both_factors():
    assert product_error("ieee") == 0.0
    assert product_error("tf32") == pytest.approx(2 * 2.0**-10, rel=1e-3)
    assert product_error("bf16") == pytest.approx(2 * 2.0**-7, rel=1e-2)
    assert product_error("something new") == product_error("bf16")  # an unknown setting is taken as the coarsest
    gen = torch.Generator().manual_seed(1)
    a, g = torch.rand(10_000, generator=gen) + 1, torch.rand(10_000, generator=gen) + 1
    exact = a.double() * g.double()
    for bits, name in ((10, "tf32"), (7, "bf16")):
        truncated = (a.view(torch.int32) & ~((1 << (23 - bits)) - 1)).view(torch.float32)  # the worst rounding
        low = (truncated.double() * g.double()).sub(exact).abs().div(exact).max().item()
        assert low <= product_error(name)


def test_ieee_sums_are_unchanged_and_the_precision_is_read_from_either_torch_api():
    """The per-backend setting answers both of PyTorch's APIs; transformers sets the new one, after which the legacy
    getter raises (the engine must not call it). Run in a subprocess: the setting is process-wide."""
    assert matmul_precision(torch.device("cpu")) == "ieee"
    script = (
        "import torch\n"
        "from torch import nn\n"
        "from opake_torch.layerwise import LayerwiseGradients, matmul_precision\n"
        "from opake_core.clipping import Engine, clipped_grad\n"
        "from opake_torch.functional import functional_model\n"
        "torch.backends.fp32_precision = 'tf32'\n"
        "model = nn.Linear(64, 64)\n"
        "apply, params, frozen = functional_model(model)\n"
        "bl = lambda p, x: apply(p, frozen, x).square().sum(dim=(1, 2))\n"
        "l = lambda p, x: bl(p, x[None])[0]\n"
        "f, s = clipped_grad(l, clipping_norm=1.0, engine=Engine(gradients=LayerwiseGradients(model, bl)))\n"
        "f(params, torch.randn(3, 2, 64), state=s)\n"
        "print(matmul_precision(torch.device('cpu')), torch.backends.mkldnn.matmul.fp32_precision)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["tf32", "tf32"]  # read, and restored after the sum


@pytest.mark.cuda
def test_real_tf32_products_keep_the_adversarial_contribution_within_the_bound():
    """On a GPU with TF32 matmuls: the ghost sum runs at TF32 (its product differs from the IEEE one) and the
    adversarial example's contribution stays within the bound."""
    model, params, loss, batch_loss, batch, _, rounded = _case()
    model, bound = model.cuda(), rounded / 2
    params = {k: v.cuda() for k, v in params.items()}
    batch = tuple(x.cuda() for x in batch)
    engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
    previous = torch.backends.cuda.matmul.fp32_precision
    norms = {}
    try:
        for precision in ("ieee", "tf32"):
            torch.backends.cuda.matmul.fp32_precision = precision
            grad_fn, state = clipped_grad(
                loss, clipping_norm=bound, batch_argnums=(1, 2), normalize_by=1.0, engine=engine
            )
            clipped, _ = grad_fn(params, *batch, state=state)
            norms[precision] = clipped.value["weight"].double().norm().item()
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    assert norms["ieee"] <= bound and norms["tf32"] <= bound
