"""Under bf16 the layerwise engine keeps the inputs of the layers that ran in bfloat16 rounded to bf16 (what their
weight gradients multiply): half the bytes of the float32 inputs under autocast, and the same norms and clipped sums
as keeping them in float32 and rounding at use."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import pytest
import torch
from tiny_hf import VOCAB, token_data
from transformers import LlamaConfig, LlamaForCausalLM

import opake_torch.layerwise.engine as engine
import opake_torch.layerwise.precision as precision
from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss

HIDDEN, INTERMEDIATE, LAYERS = 32, 64, 2


def _llama(checkpointing: bool) -> LlamaForCausalLM:
    """A two-layer Llama, float32 weights, every weight trainable; its layers checkpointed for the engine."""
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    if checkpointing:
        enable_vmap_checkpointing(model)
    return model.train()


def _losses(model: LlamaForCausalLM, autocast: bool) -> tuple:
    apply, params, frozen = functional_model(model)
    precision_of = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def loss(p, example):
        with precision_of():
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        with precision_of():
            return batch_losses(apply, p, frozen, b, task="causal_lm")

    return params, loss, batch_loss


def _batch() -> dict:
    return language_modeling_labels(collate(token_data(6), pad_token_id=0))


def _float32_kept(self, kind, x, output):
    """The engine before its inputs were kept rounded: every input kept as the layer received it."""
    return x.detach()


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("advantage", [1e6, 1e-6])  # every weight instantiated; every weight (used once) ghost
def test_rounded_inputs_give_the_same_norms_and_clipped_sum_bit_for_bit(monkeypatch, checkpointing, advantage):
    """bf16 autocast, a full fine-tune, with and without checkpointing: the squared norms and the clipped sum are
    bit for bit those of the engine that keeps the float32 inputs and rounds them where it reads them."""
    batch = _batch()
    results = []
    for keep in (None, _float32_kept):
        if keep is not None:
            monkeypatch.setattr(precision.Bf16Inputs, "keep", keep)
        model = _llama(checkpointing)
        params, loss, batch_loss = _losses(model, autocast=True)
        gradients = LayerwiseGradients(model, batch_loss, ghost_advantage=advantage)
        with torch.no_grad():
            norms = gradients(None, (params, batch), (1,))[0].squared_norms()
        grad_fn, state = clipped_grad(loss, clipping_norm=0.05, batch_argnums=1, engine=Engine(gradients=gradients))
        clipped, _ = grad_fn(params, batch, state=state)
        results.append((norms, clipped.value))
    (norms, sums), (norms_then, sums_then) = results
    assert (norms.sum(dim=0) > 0.05**2).all()  # every example clipped: the scales depend on the norms
    assert torch.equal(norms, norms_then)
    for name in sums:
        assert torch.equal(sums[name], sums_then[name]), name


class _Recorded(engine.ChunkPass):
    """The engine's hooks, each pass's instance noted, so that the test reads the calls it keeps."""

    passes: ClassVar[list[engine.ChunkPass]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passes.append(self)


def _kept_linear_bytes(calls) -> tuple[int, set[torch.dtype]]:
    """The bytes of the distinct storages that the linear calls keep as inputs, and their dtypes."""
    storages = {}
    for call in calls:
        if call.kind == "linear" and call.inputs is not None:
            storage = call.inputs.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), call.inputs.dtype)
    return sum(n for n, _ in storages.values()), {dtype for _, dtype in storages.values()}


def _expected_bytes(tokens: int, autocast: bool) -> int:
    """The memory model of docs/memory.md: per token and layer, the inputs of q/k/v (one tensor), o, gate/up (one
    tensor) and down, plus the head's. Under autocast o and down read bf16 activations (2 bytes), and the normalized
    residual streams are kept rounded (2 bytes instead of 4); without it all are float32."""
    if autocast:
        return tokens * (LAYERS * (2 * HIDDEN + 2 * HIDDEN + 2 * HIDDEN + 2 * INTERMEDIATE) + 2 * HIDDEN)
    return tokens * (LAYERS * (4 * HIDDEN + 4 * HIDDEN + 4 * HIDDEN + 4 * INTERMEDIATE) + 4 * HIDDEN)


@pytest.mark.parametrize("autocast", [True, False])
def test_the_linear_calls_keep_half_the_bytes_under_bf16_autocast(monkeypatch, autocast):
    """After the forward (no checkpointing) the linear calls' inputs are held by the engine: under bf16 autocast
    they are all bf16, q/k/v and gate/up each share one copy, and they hold the bytes of the memory model (the
    float32 normalized inputs halved); without autocast, float32 as received. Under checkpointing the same holds at
    the end of the backward, where the ghost calls of every layer keep their inputs until the clipped sum."""
    monkeypatch.setattr(engine, "ChunkPass", _Recorded)
    monkeypatch.setattr(_Recorded, "passes", [])
    batch = _batch()
    tokens = batch["input_ids"].numel()
    params, _, batch_loss = _losses(model := _llama(checkpointing=False), autocast)
    after_forward = []

    def measured(p, b):
        losses = batch_loss(p, b)
        after_forward.append(_kept_linear_bytes(_Recorded.passes[-1].calls))
        return losses

    with torch.no_grad():
        LayerwiseGradients(model, measured)(None, (params, batch), (1,))
    dtype = torch.bfloat16 if autocast else torch.float32
    assert after_forward == [(_expected_bytes(tokens, autocast), {dtype})] * 2  # the coupling check's pass too

    params, _, batch_loss = _losses(model := _llama(checkpointing=True), autocast)
    with torch.no_grad():
        grads, _ = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6)(None, (params, batch), (1,))
    assert _kept_linear_bytes(call for call, _ in grads.ghost.values()) == (_expected_bytes(tokens, autocast), {dtype})


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_bf16_product_equals_its_out_of_place_form(kind):
    """The clipped sum of a layer with bf16 factors, formed in place (the scaled factor overwritten by its truncation,
    then by its remainder, the parts written into one buffer), is bit for bit the out-of-place form: ``c'_i g_it``
    (``c'_i``: the scale rounded down to bf16) split into two bf16 parts by truncation toward zero and subtraction,
    times the bf16 input, the two products added; a dropped example (scale 0) adds nothing even with an infinite
    output gradient."""
    from torch import nn

    from opake_torch.layerwise.calls import Call

    torch.manual_seed(0)
    m, positions, width, out = 4, 5, 8, 6
    grad = (torch.randn(m, positions, out) * 3).to(torch.bfloat16)
    grad[2, 1, 0] = float("inf")
    inputs = torch.randn(m, positions, width).to(torch.bfloat16)
    scale = torch.tensor([0.3, 1.0, 0.0, 1e-3]).reshape(m, 1, 1)
    drop = scale == 0
    call = Call(kind, nn.Identity(), {}, inputs, positions, grad=grad)
    shape = (out, width) if kind == "linear" else (width, out)
    total = torch.randn(shape)
    expected = total.clone()
    precision.add_bf16_product(call, drop, scale, total)

    spacing = torch.exp2(torch.floor(torch.log2(scale.double())) - 7)  # of bf16 numbers in the scale's binade
    rounded = torch.where(drop, 0.0, torch.floor(scale.double() / spacing) * spacing).float()
    g = torch.where(drop, 0.0, grad.double() * rounded.double())  # exact: 8 times 8 significand bits
    exponent = torch.floor(torch.log2(g.abs().clamp(min=2.0**-126)))
    spacing = torch.exp2(exponent - 7)  # of bf16 numbers in the binade of each value
    high = (torch.sign(g) * torch.floor(g.abs() / spacing) * spacing).to(torch.bfloat16)
    low = (g - high.double()).to(torch.bfloat16)
    parts = torch.cat([high, low], dim=-1).reshape(-1, 2 * out).float()
    a = torch.where(drop, 0.0, inputs).reshape(-1, width).float()
    if kind == "linear":
        p_high, p_low = torch.mm(parts.T, a).view(2, out, -1).unbind(0)
    else:
        p_high, p_low = torch.mm(a.T, parts).view(-1, 2, out).unbind(1)
    expected.add_(p_low + p_high)
    assert torch.isfinite(total).all()
    assert torch.equal(total, expected)


def _largest_allocation(fn) -> int:
    """The largest single CPU allocation while ``fn`` runs, in bytes (the profiler's memory events: a CPU stand-in
    for the peak of a transient copy)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def test_instantiated_norms_read_a_bounded_float64_copy(monkeypatch):
    """vector_norm with dtype=float64 converts its whole input first: the norms of a group of instantiated gradients
    read ``NORM_NUMEL`` elements at a time (here two names' ``[m, numel]``), so the transient float64 copy is two
    names', not the group's buffer (four names); the squared norms are the float64 sums of squares."""
    from opake_torch.layerwise import gradients
    from opake_torch.layerwise.gradients import Gradients

    torch.manual_seed(0)
    names, m, shape = ["a", "b", "c", "d"], 3, (64, 128)
    monkeypatch.setattr(gradients, "NORM_NUMEL", 2 * m * 64 * 128)
    out = Gradients(names, dict.fromkeys(names, torch.Size(shape)), dict.fromkeys(names, torch.float32), m,
                    torch.device("cpu"))  # fmt: skip
    out.group(names)
    for name in names:
        out.block(name).normal_()
    expected = torch.stack([out.dense[name].double().square().sum(dim=(1, 2)) for name in names])
    norms = []
    largest = _largest_allocation(lambda: norms.append(out.squared_norms()))
    torch.testing.assert_close(norms[0], expected, rtol=1e-12, atol=0)
    one_name = m * 64 * 128 * 8
    assert one_name < largest <= 2 * one_name  # two names at once in float64; the whole buffer's copy is 4 names


def test_ghost_calls_release_their_factors_once_summed():
    """The scaled sum consumes the chunk's gradients: once a ghost call's product is added, its input and output
    gradient are dropped, so that the later (larger: the head's) sums run without the earlier layers' factors. The
    sum with scales 1 is the batch gradient of plain autograd (float64)."""
    model = _llama(checkpointing=True).double()
    params, _, batch_loss = _losses(model, autocast=False)
    batch = _batch()
    with torch.no_grad():
        grads, _ = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6)(None, (params, batch), (1,))
    calls = [call for call, _ in grads.ghost.values()]
    assert len(calls) == len(params) - 2 * LAYERS - 1 and all(call.inputs is not None for call in calls)  # not norms
    sums = [torch.zeros_like(params[name]) for name in grads.names]  # the clipped sums' leaf order
    grads.squared_norms()
    grads.add_scaled({torch.float64: torch.ones(1, grads.m, dtype=torch.float64).expand(len(sums), -1)}, sums)
    assert all(call.inputs is None and call.grad is None for call in calls)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    expected = torch.autograd.grad(batch_loss(leaves, batch).sum(), [leaves[name] for name in grads.names])
    for name, total, reference in zip(grads.names, sums, expected, strict=True):
        torch.testing.assert_close(total, reference, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_experts_under_bf16_autocast_take_the_rounded_input(model_type):
    """Under bf16 autocast an expert's projection multiplies its input rounded to bf16; its per-example gradients,
    summed over the batch, equal the float64 sum over the routed rows of ``g^T bf16(x)`` from a plain autograd pass
    through the same experts function (rows and output gradients read by its taps), to float32 accumulation; the
    first projection's float32 input is kept in bf16."""
    import functools

    from tiny_hf import tiny_moe

    from opake_torch.layerwise.experts import moe_kind, replace_forward, tapped_experts_forward

    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float32).eval()
    params, _, batch_loss = _losses(model, autocast=True)
    batch = _batch()
    m = batch["input_ids"].shape[0]
    kept = []

    def measured(p, b):
        losses = batch_loss(p, b)
        kept.extend(call.inputs.dtype for call in _Recorded.passes[-1].calls if call.kind == "experts")
        return losses

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "ChunkPass", _Recorded)
        grads, _ = LayerwiseGradients(model, measured)._run(params, (batch,), instantiate=True)
    assert kept and set(kept) == {torch.bfloat16}  # the first projection's input is float32: rounded

    names = {module: name for name, module in model.named_modules() if moe_kind(module) == "experts"}
    factors = []

    def tap(module, attr, x, routing, y):
        entry = [f"{names[module]}.{attr}", x.detach(), routing, None, module.is_transposed]
        factors.append(entry)
        y.register_hook(lambda g: entry.__setitem__(3, g))
        return y

    forward = functools.partial(tapped_experts_forward, examples=m)
    handles = [replace_forward(module, forward, tap) for module in names]
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    batch_loss(leaves, batch).sum().backward()
    for handle in handles:
        handle.remove()
    assert len(factors) == 2 * len(names)
    for name, x, routing, g, transposed in factors:
        expected = torch.zeros_like(grads.dense[name][0], dtype=torch.float64)
        a, g = x.to(torch.bfloat16).double(), g.double()
        for e in routing.experts.unique().tolist():  # the rows each expert got, read from the routing itself
            rows = (routing.experts == e).nonzero().squeeze(1)
            product = g[rows].T @ a[rows]  # [out, in]
            expected[e] += product.T if transposed else product
        ours = grads.dense[name].double().sum(dim=0)
        assert (ours - expected).norm() <= 1e-6 * expected.norm(), name  # float32 input: 2e-3 off
