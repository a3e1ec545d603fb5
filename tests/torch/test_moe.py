"""Mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss; tiny random configs): per-example clipped gradients
under ``vmap(grad)`` against a float64 per-example loop, the router statistic read from Hugging Face's own
``output_router_logits`` path, the layerwise engine's fallback, and the trainer end to end."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import VOCAB, tiny_moe, token_data

from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError
from opake_core.moe import load_probabilities
from opake_torch.functional import functional_model
from opake_torch.layerwise import unsupported_parameters
from opake_torch.patches import apply_compat_patches
from opake_torch.transformers import DPTrainer, TrainingArguments, engines
from opake_torch.transformers.loss import batch_losses
from opake_torch.transformers.moe import LOAD_KEY, moe_geometry, router_loss, router_modules, with_load

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
C, ALPHA = 0.05, 0.3


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _reference(model: torch.nn.Module, data: dict, load: torch.Tensor, geometry) -> tuple[dict, torch.Tensor]:
    """Float64 loop over examples: Hugging Face's forward with ``output_router_logits=True`` (no vmap, no hooks),
    the loss and surrogate written out, autograd per example, clipping by hand."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    stats = []
    for i in range(data["input_ids"].shape[0]):
        real = int(data["attention_mask"][i].sum())
        ids = data["input_ids"][i : i + 1, :real]  # the example alone, without its padding
        out = model(input_ids=ids, output_router_logits=True)
        nll = F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
        logits = torch.stack([r.reshape(real, -1) for r in out.router_logits]).double()  # [L, T, E]
        k, e = geometry.top_k, geometry.num_experts
        weight = min(real, geometry.max_tokens) / geometry.mean_tokens
        probs = torch.softmax(logits, dim=-1).mean(dim=(0, 1))
        surrogate = e * weight * ((load - k / e) * probs).sum()
        grads = torch.autograd.grad(
            nll + ALPHA * (surrogate - surrogate.detach()), [model.get_parameter(n) for n in names]
        )
        norm = torch.sqrt(sum(g.double().square().sum() for g in grads))
        scale = min(1.0, C / float(norm))
        for n, g in zip(names, grads, strict=True):
            total[n] = total[n] + scale * g
        hits = torch.zeros(logits.shape[0], e, dtype=torch.float64)
        for layer in range(logits.shape[0]):
            for t in range(real):
                hits[layer, torch.topk(logits[layer, t], k).indices] += 1 / real
        stats.append(weight * (hits - k / e))
    return total, torch.stack(stats)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_moe_clipped_sum_and_router_statistic_match_a_float64_loop(model_type: str) -> None:
    apply_compat_patches()
    model = tiny_moe(model_type, torch.float64)
    geometry = moe_geometry(model, max_tokens=6, mean_tokens=5.0)
    assert (geometry.top_k, geometry.num_experts, geometry.num_layers) == (2, 4, 2)
    apply, params, frozen = functional_model(model)
    losses = lambda p, b: batch_losses(apply, p, frozen, b, task="causal_lm")  # noqa: E731
    loss = router_loss(model, losses, geometry, coefficient=ALPHA)
    load = torch.tensor([0.8, 0.2, 0.6, 0.4], dtype=torch.float64)
    data = _batch()
    grad_fn, state = clipped_grad(loss, clipping_norm=C, microbatch_size=2, has_aux=True)
    (clipped, stats), _ = grad_fn(params, with_load(data, load), state=state)
    reference, expected_stats = _reference(model, data, load, geometry)
    torch.testing.assert_close(stats, expected_stats, rtol=0, atol=1e-12)
    # Mixtral's and Qwen3-MoE's routers take their softmax in float32 (``router_logits.float()``), so every gradient
    # carries float32 rounding from the routing weights (batched and unbatched runs round differently): 8 float32
    # unit roundoffs of each tensor's largest entry
    for name, value in clipped.value.items():
        bound = 8 * torch.finfo(torch.float32).eps * float(reference[name].abs().max())
        assert float((value - reference[name]).abs().max()) <= bound, name
    assert clipped.sensitivity == C


def test_router_statistic_needs_the_load_and_the_model_is_left_unhooked() -> None:
    model = tiny_moe("mixtral", torch.float32)
    assert len(router_modules(model)) == 2
    assert all(not m._forward_hooks for m in router_modules(model))
    with pytest.raises(ConfigurationError, match=r"router_aux_loss_coef=0\.0 for a dense model"):
        moe_geometry(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8, vocab_size=16
                )
            ),
            max_tokens=8,
        )
    assert LOAD_KEY in with_load(_batch(), torch.zeros(4))
    probs = load_probabilities(torch.zeros(2, 3, 4))
    torch.testing.assert_close(probs, torch.full((4,), 0.25))


def test_layerwise_engine_falls_back_to_vmap_for_stacked_experts(caplog: pytest.LogCaptureFixture) -> None:
    """HF v5 experts are stacked ``[E, ...]`` parameters with their own forward: the layerwise engine does not serve
    them, ``'auto'`` says so and uses vmap(grad), ``'layerwise'`` refuses with the fix."""
    model = tiny_moe("qwen3_moe", torch.float32)
    _, params, _ = functional_model(model)
    reasons = unsupported_parameters(model, params)
    experts = [n for n in params if ".experts." in n]
    assert experts and all(any(n in r for r in reasons) for n in experts)
    args = SimpleNamespace(per_example_gradients="auto", device=torch.device("cpu"), bf16=False)
    with caplog.at_level(logging.INFO, logger="opake_torch.transformers.engines"):
        assert engines.layerwise_engine(model, params, args, lambda p, b: None, reasons=[]) is None
    assert any("vmap(grad)" in r.message and "experts" in r.message for r in caplog.records)
    args.per_example_gradients = "layerwise"
    with pytest.raises(ConfigurationError, match="per_example_gradients='vmap'"):
        engines.layerwise_engine(model, params, args, lambda p, b: None, reasons=[])


def test_trainer_trains_a_tiny_moe_model_privately(tmp_path) -> None:
    model = tiny_moe("qwen3_moe", torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        privacy_noise_multiplier=1.0,
        privacy_accounting=True,
        use_cpu=True,
        disable_tqdm=True,
        optim="sgd",
        learning_rate=0.1,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
    )
    trainer = DPTrainer(model, args, train_dataset=token_data(16))
    assert trainer._layerwise is None  # stacked experts: vmap(grad)
    out = trainer.train()
    assert out.global_step == 2
    epsilon = out.metrics["privacy_epsilon"]
    assert 0 < epsilon < math.inf
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(after[n].detach(), before[n]) for n in before if ".experts." in n)
