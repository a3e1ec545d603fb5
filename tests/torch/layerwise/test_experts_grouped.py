"""Stacked experts in the layerwise engine, grouped: the forward, the per-example norms and the clipped sums of an
experts layer's rows sorted by expert once, equal to a float64 loop over the rows, on routings that leave experts
without rows, send all of an example's tokens to one expert, or tie (every token on the same experts); the operators
an experts layer dispatches do not grow with the number of experts, and it reads the host at most once."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_hf import tiny_moe, token_data
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import opake_torch.layerwise.experts as experts
from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, ghost
from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.dense import add_dense
from opake_torch.layerwise.experts import Routing, _expert_linear
from opake_torch.layerwise.ghost import ScaledInputs, add_ghost, ghost_norms
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss

M, T, K, IN, OUT = 4, 12, 3, 16, 8  # examples, tokens, top-k, widths (multiples of 16 bytes in float32 and bf16)
ROUTINGS = ("balanced", "empty_experts", "one_expert_per_example", "ties")


def _top_k(routing: str, experts: int, seed: int = 0) -> torch.Tensor:
    """``[M T, K]`` distinct experts per token: random; never experts 0 and E - 1; example 0's tokens all on expert
    3 first (its rows for expert 3 are all its tokens); or every token on experts ``0 ... K - 1`` (tied logits)."""
    gen = torch.Generator().manual_seed(seed)
    if routing == "ties":
        return torch.arange(K).expand(M * T, K).clone()
    pool = torch.arange(1, experts - 1) if routing == "empty_experts" else torch.arange(experts)
    chosen = pool[torch.rand(M * T, len(pool), generator=gen).argsort(dim=1)[:, :K]]
    if routing == "one_expert_per_example":
        first = chosen[:T]
        chosen[:T] = torch.where(first == 3, first[:, :1], first)  # keep the k choices distinct
        chosen[:T, 0] = 3
    return chosen


def _loop(x: torch.Tensor, g: torch.Tensor, experts: torch.Tensor, count: int) -> torch.Tensor:
    """float64 ``[M, E, out, in]``: each example's gradient of each expert, a sum of outer products over its rows."""
    x, g = x.double(), g.double()
    grads = torch.zeros(M, count, g.shape[1], x.shape[1], dtype=torch.float64)
    per_example = x.shape[0] // M
    for r in range(x.shape[0]):
        grads[r // per_example, experts[r]] += torch.outer(g[r], x[r])
    return grads


def _call(x: torch.Tensor, g: torch.Tensor, top_k: torch.Tensor, count: int, transposed: bool) -> Call:
    routing = Routing.of(top_k.reshape(-1), count, M)
    return Call("experts", nn.Module(), {"weight": "w"}, x, x.shape[0] // M, grad=g, routing=routing,
                transposed=transposed)  # fmt: skip


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_norms_sums_and_instantiated_gradients_equal_the_float64_loop(routing, dtype, transposed):
    """Squared norms (ghost), the scaled sum ``sum_i c_i G_i`` with one example dropped (scale 0: it adds exactly
    nothing, even with a non-finite row), and the instantiated ``[m, E, ...]`` gradients, against the loop over the
    rows; float32 to float32 rounding (grouped matmuls), float64 to 1e-12 (padded batched matmuls, in runs of
    groups of similar sizes: several where an example sends all its tokens to one expert)."""
    count = 16
    top_k = _top_k(routing, count)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * T * K, IN, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(M * T * K, OUT, generator=gen, dtype=torch.float64).to(dtype)
    call = _call(x, g, top_k, count, transposed)
    expected = _loop(x, g, top_k.reshape(-1), count)  # [M, E, out, in]
    rtol = 1e-12 if dtype == torch.float64 else 1e-5

    norms = ghost_norms(call, M, None)
    assert norms.dtype == torch.float64
    torch.testing.assert_close(norms, expected.square().sum(dim=(1, 2, 3)), rtol=rtol, atol=0)

    scale = torch.tensor([0.5, 0.0, 2.0, 1.5], dtype=dtype).view(M, 1, 1)
    drop = scale == 0
    call.grad = g.clone()
    call.grad[T * K] = float("nan")  # a row of the dropped example
    total = torch.zeros(count, *((IN, OUT) if transposed else (OUT, IN)), dtype=dtype)
    add_ghost(call, scale, drop, total, ScaledInputs(M))
    summed = (scale.double().view(M, 1, 1, 1) * expected).sum(dim=0)
    reference = summed.transpose(1, 2) if transposed else summed
    assert (total.double() - reference).norm() <= rtol * reference.norm()

    call.grad = g
    dense = torch.zeros(M, *total.shape, dtype=dtype)
    add_dense(call, "weight", dense, first=True)
    reference = expected.transpose(2, 3) if transposed else expected
    assert (dense.double() - reference).norm() <= rtol * reference.norm()


def _experts_module(dtype: torch.dtype, transposed: bool, bias: bool) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(2)
    shape = (16, IN, OUT) if transposed else (16, OUT, IN)
    up = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    up_bias = torch.randn(16, OUT, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    return SimpleNamespace(has_bias=bias, is_transposed=transposed, up_proj=up, up_proj_bias=up_bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_forward_and_its_input_gradient_equal_the_rows_loop(routing, dtype, transposed, bias):
    """Each row through its own expert (and bias), and the gradient of the rows, against ``F.linear`` row by row in
    float64."""
    module = _experts_module(dtype, transposed, bias)
    top_k = _top_k(routing, 16).reshape(-1)
    x = torch.randn(M * T * K, IN, dtype=torch.float64).to(dtype).requires_grad_()
    y = _expert_linear(module, "up_proj", x, Routing.of(top_k, 16, M))
    weight = module.up_proj.double()
    weights = weight.transpose(1, 2)[top_k] if transposed else weight[top_k]  # [S, out, in]
    expected = torch.einsum("soi,si->so", weights, x.double())
    if bias:
        expected = expected + module.up_proj_bias.double()[top_k]
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    assert y.dtype == dtype and (y.double() - expected).norm() <= rtol * expected.norm()
    upstream = torch.randn_like(y)
    (x_grad,) = torch.autograd.grad(y, x, upstream)
    expected_grad = torch.einsum("soi,so->si", weights, upstream.double())
    assert (x_grad.double() - expected_grad).norm() <= rtol * expected_grad.norm()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_bf16_autocast_forward_multiplies_the_rounded_factors(routing, monkeypatch):
    """Under bf16 autocast the grouped forward multiplies the bf16-rounded rows and weights (as ``F.linear`` under
    autocast does) into a bf16 output: the float64 product of the rounded factors, to one bf16 rounding of each
    entry; and the norms and sums of bf16 rows and output gradients equal the float64 loop (exact products, float64
    Gram matrices and float32 sums) where the kernels of sorted rows do not run (they have their own tests,
    ``tests/torch/kernels/test_expert_products.py``)."""
    monkeypatch.setattr(ghost, "_expert_kernels", lambda call: False)
    module = _experts_module(torch.float32, False, False)
    top_k = _top_k(routing, 16)
    x = torch.randn(M * T * K, IN, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _expert_linear(module, "up_proj", x, Routing.of(top_k.reshape(-1), 16, M))
    assert y.dtype == torch.bfloat16
    weights = module.up_proj.to(torch.bfloat16).double()[top_k.reshape(-1)]
    expected = torch.einsum("soi,si->so", weights, x.to(torch.bfloat16).double())
    assert ((y.double() - expected).abs() <= 2.0**-8 * expected.abs() + 1e-30).all()

    g = torch.randn(M * T * K, OUT).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    call = _call(xb, g, top_k, 16, False)
    loop = _loop(xb, g, top_k.reshape(-1), 16)
    torch.testing.assert_close(ghost_norms(call, M, None), loop.square().sum(dim=(1, 2, 3)), rtol=1e-12, atol=0)
    total = torch.zeros(16, OUT, IN)
    ones = torch.ones(M, 1, 1)
    add_ghost(call, ones, ones == 0, total, ScaledInputs(M))
    assert (total.double() - loop.sum(dim=0)).norm() <= 1e-6 * loop.sum(dim=0).norm()


class _Operators(TorchDispatchMode):
    """Counts the aten operators dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _layer_work(count: int, dtype: torch.dtype, monkeypatch) -> tuple[int, int, int, int]:
    """(operators, host reads) of one experts projection with ``count`` experts (top-8 of 32 tokens for 4
    examples): first the routing, the forward, the scaled sum and the instantiated gradients, then the norms."""
    reads = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original: reads.append(1) or _f(self))
    gen = torch.Generator().manual_seed(3)
    top_k = torch.rand(M * 32, count, generator=gen).argsort(dim=1)[:, :8].reshape(-1)
    x = torch.randn(M * 32 * 8, IN, generator=gen).to(dtype)
    module = SimpleNamespace(has_bias=False, is_transposed=False, up_proj=torch.randn(count, OUT, IN).to(dtype))
    scale = torch.ones(M, 1, 1, dtype=dtype)
    with _Operators() as operators:
        routing = Routing.of(top_k, count, M)
        y = _expert_linear(module, "up_proj", x, routing)
        call = Call("experts", nn.Module(), {"weight": "w"}, x, 32 * 8, grad=torch.ones_like(y), routing=routing)
        add_ghost(call, scale, scale == 0, torch.zeros(count, OUT, IN, dtype=dtype), ScaledInputs(M))
        add_dense(call, "weight", torch.zeros(M, count, OUT, IN, dtype=dtype), first=True)
    before = (operators.count, len(reads))
    with _Operators() as operators:
        ghost_norms(call, M, None)
    runs = len(list(experts._chunks(routing.pair_sizes)))
    return before[0], before[1], (operators.count, len(reads) - before[1]), runs


def test_operators_do_not_grow_with_the_experts(monkeypatch):
    """8 or 128 experts: the same operators for the forward and the sums with grouped matmuls (float32), less than
    twice as many with padded ones (float64: a few more runs; a loop over the experts dispatches 16 times as many);
    the norms' in runs of pairs of similar sizes, at most ``log2(widest pair) + 1 <= 6`` runs
    (32 tokens) of no more operators each; no host read but the norms' one (the first call tries the grouped
    matmul: left out)."""
    _layer_work(8, torch.float32, monkeypatch)
    for dtype in (torch.float32, torch.float64):
        fewer, reads, (norms_fewer, norm_reads), runs_fewer = _layer_work(8, dtype, monkeypatch)
        more, reads_more, (norms_more, norm_reads_more), runs_more = _layer_work(128, dtype, monkeypatch)
        assert more == fewer if dtype == torch.float32 else more < 2 * fewer  # float64: padded runs, a few more
        assert reads + norm_reads == reads_more + norm_reads_more == 1
        assert dtype == torch.float64 or reads == reads_more == 0
        assert 1 <= runs_fewer <= runs_more <= 6
        assert norms_more / runs_more <= norms_fewer / runs_fewer  # operators per run: not more with more experts


def _moe_losses(model: nn.Module) -> tuple:
    apply, params, frozen = functional_model(model)

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        return batch_losses(apply, p, frozen, b, task="causal_lm")

    return params, loss, batch_loss


@pytest.mark.parametrize("advantage", [1e-6, 1e6], ids=["ghost", "instantiated"])
def test_tied_router_logits_give_the_per_example_loop(advantage):
    """A Qwen3-MoE model whose routers score every expert the same (zero weights: every token on the same tied
    top-k experts, the others without rows), float64, every weight trained: the engine's per-example norms and
    clipped sum equal the float64 loop over examples of plain autograd through Hugging Face's own experts function."""
    apply_runtime_patches()
    model = tiny_moe("qwen3_moe", torch.float64).eval()
    routers = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]  # [E, d]
    assert len(routers) == 2
    with torch.no_grad():
        for p in routers:
            p.zero_()
    params, loss, batch_loss = _moe_losses(model)
    batch = language_modeling_labels(collate(token_data(5, seed=3), pad_token_id=0))
    grads, norms = [], []
    for i in range(batch["input_ids"].shape[0]):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        found = torch.autograd.grad(loss(leaves, {k: v[i] for k, v in batch.items()}), list(leaves.values()))
        grads.append(dict(zip(leaves, found, strict=True)))
        norms.append(math.sqrt(sum(float(d.square().sum()) for d in found)))
    bound = sorted(norms)[2]
    expected = {n: sum(min(1.0, bound / norm) * g[n] for g, norm in zip(grads, norms, strict=True)) for n in params}
    layerwise = LayerwiseGradients(model, batch_loss, ghost_advantage=advantage)
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=1, return_diagnostics=True,
                                  engine=Engine(gradients=layerwise))  # fmt: skip
    (clipped, diagnostics), _ = grad_fn(params, batch, state=state)
    torch.testing.assert_close(diagnostics.norms.double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-6, atol=0)
    assert any(n.endswith("experts.gate_up_proj") for n in clipped.value)
    for name, value in expected.items():
        assert (clipped.value[name].double() - value).norm() <= 1e-9 * max(value.norm(), 1e-30), name
