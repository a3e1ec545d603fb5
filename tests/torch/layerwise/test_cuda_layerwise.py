"""Layerwise per-example gradients on CUDA: the same clipped sum as vmap(grad), with SDPA attention."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import tiny_lora, tiny_model, token_data

from opake_core.clipping import VMAP, Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    ("family", "lora", "dtype"),
    [("llama", True, torch.float32), ("llama", True, torch.bfloat16), ("bert", False, torch.float32)],
)
def test_layerwise_equals_vmap_on_cuda(family, lora, dtype):
    apply_runtime_patches()
    model = tiny_model(family)
    model.config._attn_implementation = "sdpa"
    model = model.to("cuda", dtype)
    if lora:
        model = tiny_lora(targets=("q_proj", "v_proj", "down_proj"), std=1.0, model=model)
    model.eval()
    apply, params, frozen = functional_model(model)
    task = "sequence_classification" if family == "bert" else "causal_lm"
    batch = collate(token_data(8, classes=3 if family == "bert" else None), pad_token_id=0)
    if task == "causal_lm":
        batch = language_modeling_labels(batch)
    batch = {k: v.cuda() for k, v in batch.items()}

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task=task)

    engine = Engine(gradients=LayerwiseGradients(model, lambda p, b: batch_losses(apply, p, frozen, b, task=task)))
    sums = []
    for chosen in (VMAP, engine):
        grad_fn, state = clipped_grad(loss, clipping_norm=0.1, engine=chosen)
        clipped, _ = grad_fn(params, batch, state=state)
        sums.append(torch.cat([clipped.value[k].reshape(-1) for k in sorted(params)]))
    error = ((sums[0] - sums[1]).norm() / sums[0].norm()).item()
    assert error < (3e-2 if dtype == torch.bfloat16 else 1e-5), error
