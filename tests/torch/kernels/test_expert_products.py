"""The experts' per-example norms and clipped sum from rows sorted by (expert, example) pair
(``pair_squared_norms``, ``expert_product_sum``) against float64 loops over the rows.

* The squared norms are within the bound of their rounding of the float64 ``sum_e ||G_p||^2``, on pairs without
  rows, pairs of one row, pairs longer than a step, widths that are not multiples of the tiles and strided rows.
* The sum equals the float64 ``total + sum_i c_i G_p`` per expert within its rounding bound; an example with scale 0
  adds exactly nothing, whatever its values.
* The engine's bf16 experts calls take them: their norms bound the exact ones with the margins of the products and
  of the one-pass sum, and nothing is read on the host.

All ``@pytest.mark.cuda``; ``OPAKE_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs them through the Triton
interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE, kernel_device  # noqa: F401 (kernel_device: an autouse fixture)
from torch import nn

from opake_torch.layerwise import ghost
from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.experts import Routing
from opake_torch.layerwise.precision import product_norm_error, product_sum_error, summation_error
from opake_torch.patches.kernels.expert_products import (
    expert_product_sum,
    expert_products_supported,
    pair_norm_rounding,
    pair_squared_norms,
)

pytestmark = pytest.mark.cuda

M, T, K, E = 3, 40, 2, 5  # examples, tokens, top-k, experts: pairs of 0 to 40 rows


def _rows(out: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """bf16 rows ``g`` ``[M T K, out]`` and ``a`` ``[M T K, in]`` (stored transposed: strided), example-major, and
    their routing: expert 4 takes no row, example 0 sends every token to expert 1 first."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(M * T, E - 1, generator=gen).argsort(dim=1)[:, :K]
    chosen[:T] = torch.stack([torch.ones(T, dtype=torch.long), torch.where(chosen[:T, 1] == 1, 2, chosen[:T, 1])], 1)
    routing = Routing.of(chosen.reshape(-1).to(DEVICE), E, M)
    g = torch.randn(out, M * T * K, generator=gen).T
    a = torch.randn(width, M * T * K, generator=gen).T * torch.exp2(torch.randint(-4, 4, (M * T * K, 1), generator=gen))
    return g.to(DEVICE, torch.bfloat16), a.to(DEVICE, torch.bfloat16), routing


def _pair_grads(g: torch.Tensor, a: torch.Tensor, routing: Routing, absolute: bool = False) -> torch.Tensor:
    """float64 ``[E, M, out, in]``: each pair's ``sum_r g_r a_r^T`` (``|g_r| |a_r|^T`` with ``absolute``), a loop
    over the rows in their original order."""
    g64, a64 = g.double().cpu(), a.double().cpu()
    if absolute:
        g64, a64 = g64.abs(), a64.abs()
    experts = routing.experts.cpu()
    grads = torch.zeros(E, M, g.shape[1], a.shape[1], dtype=torch.float64)
    per_example = g.shape[0] // M
    for r in range(g.shape[0]):
        grads[experts[r], r // per_example] += torch.outer(g64[r], a64[r])
    return grads


@pytest.mark.parametrize("out,width", [(40, 24), (129, 200)])
def test_the_norms_are_within_their_rounding_of_the_float64_norms(out, width):
    g, a, routing = _rows(out, width)
    gs, as_ = g.index_select(0, routing.order), a.index_select(0, routing.order)
    assert expert_products_supported(gs, as_, E * M)
    squares = pair_squared_norms(gs, as_, routing.pair_ends, M).cpu()
    grads = _pair_grads(g, a, routing)
    exact = grads.square().sum(dim=(0, 2, 3)).sqrt()
    spread = (g.double().cpu().norm(dim=1) * a.double().cpu().norm(dim=1)).view(M, -1).sum(dim=1)  # S_i
    gamma = product_norm_error(T * K, factors=torch.bfloat16, precision="ieee")
    reported = pair_norm_rounding(out, width, E) * squares.sqrt()
    assert (exact <= reported + gamma * spread).all()  # the bound the engine uses
    assert (reported <= exact + gamma * spread + 1e-12 * exact).all()  # and it is tight to the products' rounding
    assert grads[4].abs().sum() == 0 and grads[1, 0].abs().sum() > 0  # an expert without rows, a pair of all T


def test_the_sum_equals_the_float64_sum_within_its_rounding_bound():
    out, width = 129, 72
    g, a, routing = _rows(out, width, seed=1)
    scale = torch.tensor([0.7, 0.0, 0.25], device=DEVICE)
    total = torch.randn(E, out, width, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    gs, as_ = g.index_select(0, routing.order), a.index_select(0, routing.order)
    assert expert_products_supported(gs, as_, E * M, total)
    ours = total.clone()
    expert_product_sum(gs, as_, routing.pair_ends, scale, ours)
    c64 = scale.double().cpu().view(1, M, 1, 1)
    exact = total.double().cpu() + (c64 * _pair_grads(g, a, routing)).sum(dim=1)
    spread = (c64 * _pair_grads(g, a, routing, absolute=True)).sum(dim=1)  # sum_i c_i sum_t |g_t| |a_t|^T
    eps = product_sum_error(T * K)
    bound = eps * spread + summation_error(M + 1) * (total.double().cpu().abs() + (1 + eps) * spread)
    error = (ours.double().cpu() - exact).abs()
    assert (error <= bound).all(), (error / bound).max().item()

    g_bad = g.clone()
    g_bad[T * K + 3, 5] = float("nan")  # a row of example 1, whose scale is 0
    bad = total.clone()
    expert_product_sum(g_bad.index_select(0, routing.order), as_, routing.pair_ends, scale, bad)
    assert torch.equal(bad, ours)


def test_transposed_experts_take_the_factors_swapped():
    """gpt-oss stores ``[E, in, out]``: the sum of ``a^T g`` is the transpose of the sum of ``g^T a``."""
    g, a, routing = _rows(48, 32, seed=3)
    scale = torch.tensor([1.0, 0.5, 0.125], device=DEVICE)
    gs, as_ = g.index_select(0, routing.order), a.index_select(0, routing.order)
    straight = torch.zeros(E, 48, 32, device=DEVICE)
    swapped = torch.zeros(E, 32, 48, device=DEVICE)
    expert_product_sum(gs, as_, routing.pair_ends, scale, straight)
    expert_product_sum(as_, gs, routing.pair_ends, scale, swapped)
    torch.testing.assert_close(swapped, straight.transpose(1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_the_engine_takes_the_kernels_for_bf16_experts_without_reading_the_host(transposed, monkeypatch):
    """An experts call with bf16 rows and output gradients: its norms are a bound of the product route with the
    one-pass sum's margin (at least ``||G_i|| + eps S_i``, at most that plus the products' margin), its clipped sum
    is the kernel's (an example with scale 0 and a NaN row adds nothing), and the pairs' sizes are never read on the
    host."""
    out, width = 40, 24
    g, a, routing = _rows(out, width, seed=4)
    call = Call("experts", nn.Module(), {"weight": "w"}, a, a.shape[0] // M, grad=g, routing=routing,
                transposed=transposed)  # fmt: skip
    assert ghost.one_pass_sum(call, torch.float32)
    norms = ghost.ghost_norms(call, M, None, one_pass=True)
    assert isinstance(norms, ghost.Bound)
    reported = ghost.finished(norms).sqrt().cpu()
    grads = _pair_grads(g, a, routing)
    exact = grads.square().sum(dim=(0, 2, 3)).sqrt()
    spread = (g.double().cpu().norm(dim=1) * a.double().cpu().norm(dim=1)).view(M, -1).sum(dim=1)
    eps, gamma = product_sum_error(T * K), product_norm_error(T * K, factors=torch.bfloat16, precision="ieee")
    assert (reported >= exact + eps * spread).all()
    assert (reported <= (exact + (gamma + eps) * spread) * (1 + 1e-9)).all()

    scale = torch.tensor([0.5, 0.0, 0.25], device=DEVICE).view(M, 1, 1)
    call.grad = g.clone()
    call.grad[T * K + 1] = float("nan")  # a row of example 1, whose scale is 0
    total = torch.zeros(E, *((width, out) if transposed else (out, width)), device=DEVICE)
    sums = []
    monkeypatch.setattr(ghost, "expert_product_sum", lambda *a, add=ghost.expert_product_sum: sums.append(add(*a)))
    ghost.add_ghost(call, scale, scale == 0, total, ghost.ScaledInputs(M), one_pass=True)
    assert len(sums) == 1
    summed = (scale.double().cpu().view(1, M, 1, 1) * grads).sum(dim=1)
    reference = summed.transpose(1, 2) if transposed else summed
    assert (total.double().cpu() - reference).norm() <= 1e-5 * reference.norm()
    assert "pair_sizes" not in vars(routing)  # no host sync


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_bf16_moe_model_clips_alike_through_the_kernels_and_the_gram_matrices(model_type, monkeypatch):
    """A tiny MoE model under bf16 autocast (experts without biases: gpt-oss adds its float32 biases to the bf16
    products, so its output gradients are float32), every weight trained, every example clipped: the engine's norms
    through the kernels of sorted rows bound those of the float64 Gram matrices from above by at most their margins
    (about 1e-4 of the norm here), and the clipped sums agree to the clip factors' difference; the kernels ran."""
    from tiny_hf import tiny_moe, token_data

    from opake_core.clipping import Engine, clipped_grad
    from opake_torch.functional import functional_model
    from opake_torch.layerwise import LayerwiseGradients
    from opake_torch.patches import apply_runtime_patches
    from opake_torch.transformers.data import collate, language_modeling_labels
    from opake_torch.transformers.loss import batch_losses, per_example_loss

    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float32).to(DEVICE)
    apply, params, frozen = functional_model(model)
    autocast = lambda: torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16)  # noqa: E731

    def loss(p, example):
        with autocast():
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        with autocast():
            return batch_losses(apply, p, frozen, b, task="causal_lm")

    batch = language_modeling_labels(collate(token_data(4, seed=5), pad_token_id=0))
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    launched = []
    for name in ("pair_squared_norms", "expert_product_sum"):
        kernel = getattr(ghost, name)
        monkeypatch.setattr(ghost, name, lambda *a, kernel=kernel, name=name: launched.append(name) or kernel(*a))

    def run():
        grad_fn, state = clipped_grad(loss, clipping_norm=1e-3, batch_argnums=1, return_diagnostics=True,
                                      engine=Engine(gradients=LayerwiseGradients(model, batch_loss)))  # fmt: skip
        torch.manual_seed(0)
        (clipped, diagnostics), _ = grad_fn(params, batch, state=state)
        return clipped.value, diagnostics.norms.double().cpu()

    kernels, kernel_norms = run()
    assert launched.count("expert_product_sum") == 4  # two layers, two weights each
    assert launched.count("pair_squared_norms") == 8  # and their norms in two passes (the check of independence)
    monkeypatch.setattr(ghost, "_expert_kernels", lambda call: False)
    grams, gram_norms = run()
    assert (kernel_norms >= gram_norms).all() and (kernel_norms <= gram_norms * (1 + 1e-3)).all()
    for name, value in grams.items():
        assert (kernels[name].double() - value.double()).norm() <= 2e-3 * value.double().norm(), name
