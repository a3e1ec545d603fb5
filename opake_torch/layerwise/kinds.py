"""The layers the engine serves: the layer kinds it recognizes, and where each trainable parameter is used.

A layer is recognized by its type and its stock ``forward`` (for Hugging Face's norms: a ``forward`` that compiles to
exactly the code the engine's arithmetic assumes). A trainable parameter outside every recognized layer, or a module
that mixes examples (batch normalization in training mode), makes the model unserved
(:func:`unsupported_parameters`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opake_core.errors import InputTypeError
from opake_torch.layerwise.experts import moe_kind
from opake_torch.layerwise.uses import uses_kind

__all__ = ["NORMS", "mixes", "owners", "unsupported_parameters"]

NORMS = ("layer_norm", "rms_norm", "llama_rms_norm", "gpt_oss_rms_norm", "zero_centered_rms_norm", "gated_rms_norm")
"""The normalization kinds: their weight multiplies the normalized input (:func:`_kind`)."""


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _llama_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _gpt_oss_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _zero_centered_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _zero_centered_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


# never called: the code of the gated delta-net's ``*RMSNormGated.forward``, compared by :func:`_same_code`
def _gated_rms_norm(self: Any, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))  # noqa: F821
    return hidden_states.to(input_dtype)


def _same_code(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions compile to the same code (same source up to their names and modules)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def _kind(module: nn.Module) -> str | None:
    """The layer kind this engine knows, for a module whose ``forward`` is the stock one; otherwise None.

    RMSNorm: ``nn.RMSNorm``, and Hugging Face's Llama-style ``*RMSNorm`` (Llama, Mistral, Qwen2, Qwen3, ...), whose
    ``forward`` must compile to exactly :func:`_llama_rms_norm`, or to :func:`_gpt_oss_rms_norm` (gpt-oss: the weight
    multiplies the float32 normalized input, then the cast), or, with ``_norm``, to :func:`_zero_centered_rms_norm`
    (``1 + weight``: Gemma, Qwen3-Next, Qwen3.5-MoE); the gated delta-net's ``*RMSNormGated``
    (:func:`_gated_rms_norm`: ``weight * norm(x) * silu(gate)``). The gated delta-net's own ``A_log`` and ``dt_bias``
    and its depthwise ``nn.Conv1d``: see :mod:`opake_torch.layerwise.uses`.
    Attention sinks: a Hugging Face attention layer's own ``sinks`` parameter (gpt-oss), see
    :class:`~opake_torch.layerwise.hooks.BroadcastTap`. MoE routers and experts: see
    :func:`~opake_torch.layerwise.experts.moe_kind`.
    """
    conv1d = _conv1d_type()
    bases = (("linear", nn.Linear), ("embedding", nn.Embedding), ("layer_norm", nn.LayerNorm), ("rms_norm", nn.RMSNorm))
    for kind, base in bases:
        if isinstance(module, base) and type(module).forward is base.forward:
            if kind == "embedding" and (module.max_norm is not None or module.sparse or module.scale_grad_by_freq):
                return None  # renormalized rows, sparse gradients, or a batch-frequency scale that couples examples
            return kind
    if conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward:
        return "conv1d"
    if hasattr(module, "variance_epsilon") and _same_code(type(module).forward, _llama_rms_norm):
        return "llama_rms_norm"
    if hasattr(module, "variance_epsilon") and _same_code(type(module).forward, _gpt_oss_rms_norm):
        return "gpt_oss_rms_norm"
    forward, norm = type(module).forward, getattr(type(module), "_norm", None)
    zero_centered = _same_code(forward, _zero_centered_rms_norm) and _same_code(norm, _zero_centered_norm)
    if hasattr(module, "eps") and zero_centered:
        return "zero_centered_rms_norm"
    if getattr(module, "activation", None) == "silu" and _same_code(forward, _gated_rms_norm):
        return "gated_rms_norm"
    if (kind := uses_kind(module)) is not None:
        return kind
    sinks = module._parameters.get("sinks")
    if type(module).__module__.startswith("transformers.") and isinstance(sinks, nn.Parameter):
        return "attention_sinks"
    return moe_kind(module)


def owners(model: nn.Module, names: set[str]) -> tuple[dict[str, list[tuple[nn.Module, str, str]]], list[str]]:
    """For every trainable name, in the model's parameter order, the ``(module, attribute, kind)`` places it is used;
    and the names without one."""
    canonical = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in names:
            canonical[id(param)] = name
    # in the model's order, not the set's (which string hashing reorders from one process to the next): the traced
    # pass follows this order, and a graph that differs between runs misses the compilers' caches
    ordered = [*canonical.values(), *sorted(names - set(canonical.values()))]
    places: dict[str, list[tuple[nn.Module, str, str]]] = {name: [] for name in ordered}
    orphans = set()
    for module in model.modules():
        kind = _kind(module)
        for attr, param in module.named_parameters(recurse=False):
            name = canonical.get(id(param))
            if name is None:
                continue
            if kind is None:
                orphans.add(name)
            else:
                places[name].append((module, attr, kind))
    missing = sorted(orphans | {name for name, where in places.items() if not where})
    return places, missing


def unsupported_parameters(model: nn.Module, params: dict[str, torch.Tensor]) -> list[str]:
    """Trainable names the layerwise engine cannot serve (empty when
    :class:`~opake_torch.layerwise.LayerwiseGradients` applies).

    Each entry says which parameter and why: it lives outside a supported layer, or the model mixes examples.
    """
    if not isinstance(params, dict):
        raise InputTypeError(f"params must be a dict of name -> tensor, got {type(params).__name__}.")
    reasons = [f"{type(m).__name__} mixes examples in training mode" for m in model.modules() if mixes(m)]
    _, missing = owners(model, set(params))
    owner = dict(model.named_modules())
    for name in missing:
        parent = owner.get(name.rpartition(".")[0])
        reasons.append(f"{name} (in {type(parent).__name__ if parent is not None else 'the model'})")
    return reasons


def mixes(module: nn.Module) -> bool:
    """Whether ``module`` mixes the examples of a batch (batch normalization in training mode)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm | nn.SyncBatchNorm) and module.training
