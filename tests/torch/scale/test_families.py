"""The support matrix: every listed family runs a clipped per-example ``vmap(grad)`` step, with and without
vmap-safe gradient checkpointing, and matches a per-example ``grad`` loop."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch.func import grad

from opake_core.clipping import clipped_grad
from opake_core.errors import VmapCompatibilityError
from opake_torch.functional import functional_model
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing
from opake_torch.patches.families import FAMILIES, apply_family_patches, support_matrix
from opake_torch.transformers.loss import per_example_loss
from opake_torch.transformers.model_setup import probe_vmap

transformers = pytest.importorskip("transformers")

DOCS = Path(__file__).resolve().parents[3] / "docs" / "memory.md"


def tiny(model_type: str) -> torch.nn.Module:
    kwargs = {
        "vocab_size": 48,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "sliding_window": 4,
        "num_experts": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    if model_type not in ("falcon", "bloom"):
        kwargs["head_dim"] = 8
    if model_type in ("qwen3_next", "qwen3_5_moe_text"):  # hybrids: one gated delta-net and one attention layer
        kwargs.update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4)  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = True
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hasattr(config, name):
            setattr(config, name, 0)
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    attention = next(f for f in FAMILIES if f.model_type == model_type).attention.split(",")[0]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.train()


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 48, (2, 10), generator=gen)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def clipped(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    apply, params, frozen = functional_model(model)

    def loss(p: dict, example: dict) -> torch.Tensor:
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    grad_fn, state = clipped_grad(loss, clipping_norm=1e9, microbatch_size=2)
    out, _ = grad_fn(params, data, state=state)
    reference = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(data["input_ids"].shape[0]):
        g = grad(loss)(params, {k: v[i] for k, v in data.items()})
        reference = {k: reference[k] + g[k] for k in params}
    return out.value, reference


@pytest.mark.parametrize("model_type", [f.model_type for f in FAMILIES])
def test_family_runs_per_example_under_vmap(model_type: str) -> None:
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    apply_runtime_patches()
    data = batch()
    model = tiny(model_type)
    apply_family_patches(model)
    plain, reference = clipped(model, data)
    for name in plain:
        torch.testing.assert_close(plain[name], reference[name], atol=1e-6, rtol=1e-5, msg=name)
    enable_vmap_checkpointing(model)
    checkpointed, _ = clipped(model, data)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=0, msg=name)


def test_probe_names_family_and_operation() -> None:
    apply_runtime_patches()
    model = tiny("bloom")  # unpatched: its GeLU is a legacy autograd.Function
    example = {k: v[0] for k, v in batch().items()}
    with pytest.raises(
        VmapCompatibilityError, match=r"family 'Bloom'.*failing operation.*forward.*apply_family_patches"
    ):
        probe_vmap(model, example)
    assert apply_family_patches(model) == ["bloom_gelu"]
    assert apply_family_patches(model) == ["bloom_gelu"]  # idempotent
    probe_vmap(model, example)


def test_docs_embed_the_support_matrix() -> None:
    table = support_matrix()
    assert table.count("\n") == len(FAMILIES) + 2
    assert table in DOCS.read_text(), "regenerate the table in docs/memory.md from support_matrix()"
