"""Per-family support for running Hugging Face causal LMs per example under ``torch.func.vmap(grad(...))``.

:data:`FAMILIES` is the support matrix: every entry was checked on a tiny random config of transformers 5.24 by
``tests/torch/scale/test_families.py`` (one clipped ``vmap(grad)`` step through ``opake_core.clipping.clipped_grad``,
with padding and a sliding window of 4 where the family has one, compared with a per-example ``grad`` loop; and the
same with :func:`~opake_torch.patches.activation_checkpointing.enable_vmap_checkpointing`). :func:`support_matrix`
renders it for ``docs/memory.md``; :func:`opake_torch.transformers.model_setup.probe_vmap` runs the same check on
any model.

Family patches (:func:`apply_family_patches`) change one model instance, never a class, so two models in a process
do not affect each other (:func:`~opake_torch.patches.runtime.applied_patches` lists them):

* ``bloom_gelu``: Bloom's MLP runs its GeLU through a legacy ``autograd.Function`` without ``setup_context``, which
  functorch refuses. The patch calls the same tanh-approximation formula (``bloom_gelu_forward``) directly; autograd
  differentiates it, which matches the hand-written backward up to rounding.
* ``gated_deltanet``: a gated delta-net layer (Qwen3-Next, Qwen3.5-MoE) writes its conv state into the KV cache in
  place (``copy_`` into a buffer that is not batched), which vmap refuses, and on CUDA runs fla's and causal-conv1d's
  kernels when they are installed, whose autograd functions have no vmap rule. Inside a ``torch.func`` transform
  (the private step: a training forward, which keeps no cache) the patched layer runs without the cache and on
  Hugging Face's torch reference path (:func:`~opake_torch.patches.compat.reference_kernels`); everywhere else
  (generation) it is the layer's own forward.

The mask patch that every family needs lives in :mod:`opake_torch.patches.compat`; it is process-level, applied only
for a scope (:mod:`opake_torch.patches.runtime`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from opake_torch.patches.compat import inside_functorch, reference_kernels
from opake_torch.patches.runtime import mark, marked

__all__ = ["FAMILIES", "Family", "apply_family_patches", "family_of", "support_matrix"]


@dataclass(frozen=True)
class Family:
    """One supported model family: its ``config.model_type``, attention implementations and patches."""

    model_type: str
    name: str
    attention: str = "sdpa, eager"
    patches: tuple[str, ...] = ()
    note: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama (Llama 2/3, DeepSeek-Coder)"),
    Family("mistral", "Mistral", note="sliding window"),
    Family("ministral", "Ministral", note="sliding window"),
    Family("mixtral", "Mixtral (MoE)", note="HF v5 stacked experts"),
    Family("qwen2", "Qwen2", note="sliding window"),
    Family("qwen3", "Qwen3", note="sliding window"),
    Family("qwen3_moe", "Qwen3-MoE", note="HF v5 stacked experts"),
    Family(
        "qwen3_next",
        "Qwen3-Next (MoE, gated delta-net)",
        patches=("gated_deltanet",),
        note="layerwise engine; HF v5 stacked experts, shared expert; delta-net on the torch path in the private step",
    ),
    Family(
        "qwen3_5_moe_text",
        "Qwen3.5-MoE (text, gated delta-net)",
        patches=("gated_deltanet",),
        note="layerwise engine; HF v5 stacked experts, shared expert; delta-net on the torch path in the private step",
    ),
    Family(
        "gpt_oss",
        "gpt-oss (MoE)",
        attention="eager",
        note="HF v5 stacked experts; attention sinks (layerwise: eager attention only); no SDPA in transformers 5.24",
    ),
    Family("gemma", "Gemma"),
    Family("gemma2", "Gemma2", attention="eager", note="no SDPA in transformers 5.24; softcapping"),
    Family("gemma3_text", "Gemma3 (text)", note="sliding window"),
    Family("phi3", "Phi-3", note="fused qkv_proj"),
    Family("phi", "Phi-1/2"),
    Family("gpt2", "GPT-2"),
    Family("gpt_neox", "GPT-NeoX / Pythia"),
    Family("opt", "OPT"),
    Family("bloom", "Bloom", attention="eager", patches=("bloom_gelu",)),
    Family("falcon", "Falcon"),
    Family("olmo", "OLMo"),
    Family("olmo2", "OLMo2"),
    Family("olmo3", "OLMo3", note="sliding window"),
    Family("granite", "Granite"),
    Family("cohere", "Cohere"),
    Family("cohere2", "Cohere2", note="sliding window"),
    Family("smollm3", "SmolLM3"),
    Family("glm4", "GLM4"),
    Family("starcoder2", "StarCoder2", note="sliding window"),
    Family("stablelm", "StableLM"),
    Family("exaone4", "EXAONE 4", note="sliding window"),
    Family("helium", "Helium"),
)

_BY_TYPE = {family.model_type: family for family in FAMILIES}


def family_of(model: nn.Module) -> Family | None:
    """The supported family of a (possibly PEFT-wrapped) model, from ``config.model_type``; None if not listed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    return _BY_TYPE.get(model_type)


def _bloom_gelu(model: nn.Module) -> bool:
    try:
        from transformers.models.bloom.modeling_bloom import BloomGelu, bloom_gelu_forward
    except ImportError:  # pragma: no cover - an older transformers without Bloom
        return False
    for module in model.modules():
        if isinstance(module, BloomGelu) and not marked(module, "bloom_gelu"):
            module.forward = types.MethodType(lambda self, x: bloom_gelu_forward(x), module)
            mark(module, "bloom_gelu")
    return any(marked(m, "bloom_gelu") for m in model.modules())


def _gated_deltanet(model: nn.Module) -> bool:
    for module in model.modules():
        kind = type(module)
        deltanet = kind.__module__.startswith("transformers.") and kind.__name__.endswith("GatedDeltaNet")
        if deltanet and not marked(module, "gated_deltanet"):
            module.forward = types.MethodType(_deltanet_forward, module)
            mark(module, "gated_deltanet")
    return any(marked(m, "gated_deltanet") for m in model.modules())


def _deltanet_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A gated delta-net's forward; inside a ``torch.func`` transform without its cache, on the torch reference
    path (module docstring)."""
    forward = type(self).forward
    if not inside_functorch():
        return forward(self, *args, **kwargs)
    with reference_kernels():
        return forward(self, *args, **{**kwargs, "cache": None})


_PATCHES = {"bloom_gelu": _bloom_gelu, "gated_deltanet": _gated_deltanet}


def apply_family_patches(model: nn.Module) -> list[str]:
    """Apply the vmap patches of ``model``'s family to this instance (idempotent); returns the names in effect.

    A family without patches, or a model outside :data:`FAMILIES`, returns ``[]``: use
    :func:`opake_torch.transformers.model_setup.probe_vmap` to find out whether an unlisted model runs.
    """
    family = family_of(model)
    if family is None:
        return []
    return [name for name in family.patches if _PATCHES[name](model)]


def support_matrix() -> str:
    """The support matrix as a markdown table (embedded in ``docs/memory.md``)."""
    rows = [
        "| Family | `model_type` | Attention | Family patches | Checkpointing under vmap | Notes |",
        "|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        patches = ", ".join(f"`{p}`" for p in f.patches) or "none"
        rows.append(f"| {f.name} | `{f.model_type}` | {f.attention} | {patches} | yes | {f.note or ''} |")
    return "\n".join(rows) + "\n"
