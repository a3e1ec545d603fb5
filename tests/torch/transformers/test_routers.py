"""Mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss; tiny random configs): per-example clipped gradients
under ``vmap(grad)`` against a float64 per-example loop, the router statistic read from Hugging Face's own
``output_router_logits`` path, the layerwise engine on routers and stacked experts, and the trainer end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from clipped_loop import clipped_sum_loop
from tiny_hf import padded_batch, tiny_moe, token_data

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_core.router_release import load_probabilities
from opake_torch.functional import functional_model
from opake_torch.layerwise import unsupported_parameters
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.loss import batch_losses, per_example_loss
from opake_torch.transformers.routers import LOAD_KEY, moe_geometry, router_loss, router_modules, with_load

transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
C, ALPHA = 0.05, 0.3


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
    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float64)
    geometry = moe_geometry(model, max_tokens=6, mean_tokens=5.0)
    assert (geometry.top_k, geometry.num_experts, geometry.num_layers) == (2, 4, 2)
    apply, params, frozen = functional_model(model)
    losses = lambda p, b: batch_losses(apply, p, frozen, b, task="causal_lm")  # noqa: E731
    loss = router_loss(model, losses, geometry, coefficient=ALPHA)
    load = torch.tensor([0.8, 0.2, 0.6, 0.4], dtype=torch.float64)
    data = padded_batch()
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
    assert LOAD_KEY in with_load(padded_batch(), torch.zeros(4))
    probs = load_probabilities(torch.zeros(2, 3, 4))
    torch.testing.assert_close(probs, torch.full((4,), 0.25))


# every parameter: embeddings, attention (gpt-oss's sinks included), norms (gpt-oss's RMSNorm), routers, experts
TRAINED = {"mixtral": "", "qwen3_moe": "", "gpt_oss": ""}


def _assert_layerwise_equals_the_float64_loop(model: torch.nn.Module, microbatch_size: int | None = None) -> None:
    """The layerwise engine's clipped sum on :func:`tiny_hf.padded_batch` equals the float64 loop's to 1e-12 of
    each norm."""
    from opake_torch.layerwise import LayerwiseGradients

    apply, params, frozen = functional_model(model)
    assert unsupported_parameters(model, params) == []
    data = padded_batch()

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def losses(p, batch):
        return batch_losses(apply, p, frozen, batch, task="causal_lm")

    engine = Engine(gradients=LayerwiseGradients(model, losses))
    grad_fn, state = clipped_grad(loss, clipping_norm=C, batch_argnums=1, microbatch_size=microbatch_size,
                                  engine=engine)  # fmt: skip
    clipped, _ = grad_fn(params, data, state=state)
    reference = clipped_sum_loop(loss, params, data, C)
    for name, value in reference.items():
        assert float((clipped.value[name] - value).norm()) <= 1e-12 * float(value.norm()), name
    assert not any("forward" in vars(m) for m in model.modules())  # the experts' own forward is back


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "instantiated"])
def test_layerwise_engine_serves_routers_and_stacked_experts(model_type: str, ghost: bool, monkeypatch) -> None:
    """The layerwise engine gives the float64 loop's clipped sum for the routers (their logits' gradient includes
    the path through the routing weights) and the stacked ``[E, ...]`` experts (rows routed to different experts
    add no cross term), by ghost norms or by instantiated per-example gradients."""
    from opake_torch.layerwise import ghost as ghost_norms

    if not ghost:
        monkeypatch.setattr(ghost_norms, "prefers_ghost", lambda call, shape, m, advantage: call.kind == "embedding")
    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float64).eval()
    for name, p in model.named_parameters():
        p.requires_grad_(TRAINED[model_type] in name)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in names) and any("router" in n or "gate.weight" in n for n in names)
    _assert_layerwise_equals_the_float64_loop(model)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_checkpointed_moe_layers_give_the_float64_loop_sum(model_type: str) -> None:
    """Routers and experts (and gpt-oss's attention sinks) inside checkpointed decoder layers
    (``enable_vmap_checkpointing``): their forward keeps nothing, the recompute in the backward is tapped, and the
    clipped sum equals the float64 loop (whose per-example gradients run the same checkpointing under torch.func)."""
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float64)
    assert enable_vmap_checkpointing(model) > 0
    _assert_layerwise_equals_the_float64_loop(model.train(), microbatch_size=2)


def test_attention_sinks_used_other_than_by_eager_attention_are_refused(monkeypatch) -> None:
    """The sinks' tap sees their expansion over the batch in Hugging Face's eager attention; an attention function
    that uses them another way (here: through a copy) would leave their gradient unformed: refused."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    from opake_torch.layerwise import LayerwiseGradients

    original = modeling_gpt_oss.eager_attention_forward

    class WithCopiedSinks:  # the layer, but its sinks a copy the tap does not know
        def __init__(self, module):
            self.module, self.sinks = module, module.sinks.clone()

        def __getattr__(self, name):
            return getattr(self.module, name)

    def indexed_sinks(module, *args, **kwargs):
        return original(WithCopiedSinks(module), *args, **kwargs)

    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", indexed_sinks)
    model = tiny_moe("gpt_oss", torch.float64).eval()
    apply, params, frozen = functional_model(model)
    engine = Engine(
        gradients=LayerwiseGradients(model, lambda p, b: batch_losses(apply, p, frozen, b, task="causal_lm"))
    )
    grad_fn, state = clipped_grad(lambda p, e: per_example_loss(apply, p, frozen, e, task="causal_lm"),
                                  clipping_norm=C, batch_argnums=1, engine=engine)  # fmt: skip
    with pytest.raises(ConfigurationError, match="attention sinks of GptOssAttention are served with eager"):
        grad_fn(params, padded_batch(), state=state)


def test_layerwise_engine_refuses_expert_parallel_experts() -> None:
    model = tiny_moe("qwen3_moe", torch.float32)
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    _, params, _ = functional_model(model)
    reasons = unsupported_parameters(model, params)
    assert any("layers.0.mlp.experts.gate_up_proj" in r for r in reasons)
    assert not any("layers.1.mlp.experts" in r for r in reasons)


def test_layerwise_engine_serves_experts_of_releases_without_the_newer_flags() -> None:
    """transformers releases before the post-expert norm and expert parallelism (5.17, say) set neither flag on their
    experts: such experts are served, not sent to vmap."""
    model = tiny_moe("qwen3_moe", torch.float32)
    for layer in model.model.layers:
        for flag in ("has_post_expert_norm", "_is_expert_parallel"):
            if hasattr(layer.mlp.experts, flag):
                delattr(layer.mlp.experts, flag)
    _, params, _ = functional_model(model)
    assert unsupported_parameters(model, params) == []


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
    assert trainer.per_example_gradients_engine == "layerwise"  # routers and stacked experts included
    out = trainer.train()
    assert out.global_step == 2
    epsilon = out.metrics["privacy_epsilon"]
    assert 0 < epsilon < math.inf
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(after[n].detach(), before[n]) for n in before if ".experts." in n)
