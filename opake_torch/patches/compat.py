"""Compatibility patches for running Hugging Face models per example under ``torch.func.vmap``.

Transformers skips building an attention mask when it can prove from the *values* of the padding mask that none
is needed (``padding_mask.all()``). Under vmap that test is data-dependent control flow and fails. Transformers
already turns the shortcut off while a graph is being traced; :func:`vmap_is_tracing` extends its ``is_tracing``
test in ``transformers.masking_utils`` to also answer True inside a ``torch.func`` transform, so the mask is always
materialized there. Outside ``torch.func`` nothing changes.

Autocast does not reach ``scaled_dot_product_attention`` inside ``torch.func`` transforms (torch 2.9 to 2.13:
under ``vmap`` of a bf16 autocast region a float query with a bf16 value raises "Expected query, key, and value to
have the same dtype"; outside the transforms autocast casts all three to bf16). Llama-style models meet it as soon
as their rotary embedding, in float32, promotes the query and key while the value stays bf16: in the per-example
pass and in the recompute of a checkpointed layer. :func:`autocast_sdpa` is a ``"sdpa"`` attention function that,
inside a ``torch.func`` transform with autocast on, casts query, key and value to the autocast dtype itself, which is
what autocast does outside the transforms; everywhere else it is Hugging Face's own.

Both replace a function that every model of the process calls: they are the process-level patches
:data:`~opake_torch.patches.runtime.VMAP_PATCHES`, applied only for a scope
(:func:`~opake_torch.patches.runtime.apply_runtime_patches`; ``DPTrainer`` applies them while it trains).

FlashAttention-2 unpads sequences with ``torch.nonzero`` (data-dependent shapes) and cannot run under vmap:
:func:`check_attention_implementation` refuses it with the fix.

Hugging Face runs some layers through optional kernel packages when they are importable and the inputs sit on a
device they support (``use_kernel_func_from_hub_with_fallback``: fla's gated delta rule and causal-conv1d's depthwise
conv in Qwen3-Next and Qwen3.5-MoE, on CUDA), else through a torch reference function. Their custom autograd
functions have no vmap rule, and causal-conv1d's takes the conv weight out of the layerwise engine's sight.
:func:`reference_kernels` makes the torch reference path run while it is active: Hugging Face takes it whenever
``is_torchdynamo_exporting()`` answers True (its guard for ``torch.export``), and the context makes the answer True
in ``transformers.integrations.hub_kernels`` alone, for the duration of one layer's call in the private step.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from opake_core.errors import ConfigurationError

__all__ = [
    "autocast_sdpa",
    "check_attention_implementation",
    "inside_functorch",
    "reference_kernels",
    "vmap_is_tracing",
]

SUPPORTED_ATTENTION = ("eager", "sdpa")


def inside_functorch() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (vmap, grad, ...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def vmap_is_tracing(original: Any) -> Any:
    """``transformers.masking_utils.is_tracing`` (``original``) that also answers True inside a ``torch.func``
    transform, so that the mask shortcut, which reads mask values, is not taken there (module docstring)."""

    @functools.wraps(original)
    def is_tracing(tensor: Any = None) -> bool:
        return inside_functorch() or original(tensor)

    return is_tracing


def autocast_sdpa(original: Any) -> Any:
    """Hugging Face's SDPA attention (``original``), with autocast's cast of query, key and value done explicitly
    inside ``torch.func`` transforms (module docstring)."""

    @functools.wraps(original)
    def sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any) -> Any:
        device = query.device.type
        if inside_functorch() and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return original(module, query, key, value, *args, **kw)

    return sdpa


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Hugging Face's torch reference functions in place of the optional kernel packages while active (module
    docstring); nothing changes where transformers has no such switch. Restores the previous state on exit, so
    nested uses unwind in order."""
    try:
        hub = importlib.import_module("transformers.integrations.hub_kernels")
    except ImportError:  # pragma: no cover - transformers without hub kernels
        yield
        return
    previous = getattr(hub, "is_torchdynamo_exporting", None)
    if previous is None:
        yield
        return
    hub.is_torchdynamo_exporting = _reference_path
    try:
        yield
    finally:
        hub.is_torchdynamo_exporting = previous


def _reference_path() -> bool:
    return True


def check_attention_implementation(model: torch.nn.Module) -> str:
    """The model's attention implementation, refused unless it runs under vmap (``eager`` or ``sdpa``)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in SUPPORTED_ATTENTION:
        raise ConfigurationError(
            f"attention implementation {implementation!r} cannot run per example under torch.func.vmap "
            "(FlashAttention-2 unpads with data-dependent shapes). Load the model with "
            "attn_implementation='sdpa' or 'eager'."
        )
    return implementation
