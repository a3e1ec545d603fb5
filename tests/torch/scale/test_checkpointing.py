"""Vmap-safe gradient checkpointing: per-example clipped gradients equal those without checkpointing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_hf import tiny_model
from torch.func import grad, vmap

from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.activation_checkpointing import check_memory_knobs, checkpoint_layer, enable_vmap_checkpointing
from opake_torch.transformers.loss import per_example_loss


def batch(n: int = 4, length: int = 9) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 48, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def llama(layers: int = 2, *, lora: bool = False) -> torch.nn.Module:
    model = tiny_model("llama")
    if layers != 1:
        config = model.config
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = type(model)(config)
    model.config._attn_implementation = "sdpa"
    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        for name, p in model.named_parameters():  # non-zero B so that every adapter has a gradient
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    return model.train()


def clipped(model: torch.nn.Module, *, bf16: bool = False, norms: bool = False) -> tuple[dict, torch.Tensor]:
    apply, params, frozen = functional_model(model)

    def loss(p: dict, example: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    grad_fn, state = clipped_grad(loss, clipping_norm=0.3, microbatch_size=2, return_diagnostics=True)
    (out, diagnostics), _ = grad_fn(params, batch(), state=state)
    return out.value, diagnostics.norms


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_clipped_grads_equal_plain(lora: bool) -> None:
    apply_runtime_patches()
    model = llama(lora=lora)
    plain, plain_norms = clipped(model)
    assert enable_vmap_checkpointing(model) == 2
    assert enable_vmap_checkpointing(model) == 2  # idempotent
    checkpointed, norms = clipped(model)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(norms, plain_norms, atol=1e-6, rtol=0)
    assert (plain_norms > 0.3).any(), "the test must exercise clipping"


def test_checkpointing_recomputes_the_layer() -> None:
    apply_runtime_patches()
    model = llama(layers=1)
    layer = model.model.layers[0]
    calls = []
    layer.mlp.register_forward_hook(lambda *a: calls.append(1))
    clipped(model)
    plain_calls = len(calls)
    enable_vmap_checkpointing(model)
    calls.clear()
    clipped(model)
    assert len(calls) == 2 * plain_calls  # forward plus one recompute per chunk


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_checkpointing_under_bf16_autocast(attention: str) -> None:
    """SDPA included: autocast does not cast its inputs under torch.func (a float query after the rotary embedding
    meets a bf16 value); the compat patch casts them as autocast would, in the pass and in the recompute."""
    apply_runtime_patches()
    model = llama()
    model.config._attn_implementation = attention
    plain, _ = clipped(model, bf16=True)
    enable_vmap_checkpointing(model)
    checkpointed, _ = clipped(model, bf16=True)
    for name in plain:  # the recompute re-enters the same autocast state: identical bf16 roundings
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=0, msg=name)


def test_dropout_masks_are_replayed() -> None:
    apply_runtime_patches()

    def run(checkpoint: bool) -> tuple[dict, torch.Tensor]:
        torch.manual_seed(0)
        model = tiny_model("gpt2")
        model.config.resid_pdrop = model.config.attn_pdrop = 0.3
        torch.manual_seed(0)
        model = type(model)(model.config).train()
        if checkpoint:
            enable_vmap_checkpointing(model)
        torch.manual_seed(1)
        out = clipped(model)[0]
        return out, torch.rand(1)

    (plain, after), (checkpointed, after_ckpt) = run(False), run(True)
    assert torch.equal(after, after_ckpt)  # the recompute does not advance the generator
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=0, msg=name)


def test_function_composes_with_plain_autograd_and_vmap_grad() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def f(w: torch.Tensor, b: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(layer, {"weight": w, "bias": b}):
            return checkpoint_layer(layer, lambda h: torch.tanh(layer(h)), xi).square().sum()

    w, b = layer.weight.detach(), layer.bias.detach()
    ours = vmap(grad(f, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)

    def g(w: torch.Tensor, b: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        return torch.tanh(xi @ w.T + b).square().sum()

    ref = vmap(grad(g, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=0)
    h = x.clone().requires_grad_(True)
    checkpoint_layer(layer, lambda t: torch.tanh(layer(t)), h).sum().backward()
    assert layer.weight.grad is not None and h.grad is not None


def test_enable_refuses_models_without_layers() -> None:
    with pytest.raises(ConfigurationError, match=r"no transformers GradientCheckpointingLayer.*microbatch_size"):
        enable_vmap_checkpointing(torch.nn.Linear(2, 2))


def test_memory_knob_rules() -> None:
    quiet = llama()
    noisy = tiny_model("gpt2")
    noisy.config.resid_pdrop = 0.1
    noisy = type(noisy)(noisy.config).train()
    args = SimpleNamespace(gradient_checkpointing=True, torch_compile=True, cuda_graphs=0)
    with pytest.raises(ConfigurationError, match="gradient_checkpointing=True is incompatible with torch_compile"):
        check_memory_knobs(quiet, args)
    args = SimpleNamespace(gradient_checkpointing=True, torch_compile=False, cuda_graphs=4)
    check_memory_knobs(quiet, args)
    with pytest.raises(ConfigurationError, match="cuda_graphs=4 needs a model without active dropout"):
        check_memory_knobs(noisy, args)
    check_memory_knobs(noisy.eval(), args)
    check_memory_knobs(noisy, SimpleNamespace(gradient_checkpointing=False, torch_compile=True, cuda_graphs=4))
