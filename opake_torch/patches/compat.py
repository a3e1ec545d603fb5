"""Compatibility patches for running Hugging Face models per example under ``torch.func.vmap``.

Transformers skips building an attention mask when it can prove from the *values* of the padding mask that none
is needed (``padding_mask.all()``). Under vmap that test is data-dependent control flow and fails. Transformers
already turns the shortcut off while a graph is being traced; :func:`apply_compat_patches` extends its
``is_tracing`` test in ``transformers.masking_utils`` to also answer True inside a ``torch.func`` transform, so the
mask is always materialized there. Outside ``torch.func`` nothing changes.

FlashAttention-2 unpads sequences with ``torch.nonzero`` (data-dependent shapes) and cannot run under vmap:
:func:`check_attention_implementation` refuses it with the fix.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from opake_core.errors import ConfigurationError

__all__ = ["apply_compat_patches", "check_attention_implementation", "inside_functorch"]

SUPPORTED_ATTENTION = ("eager", "sdpa")


def inside_functorch() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (vmap, grad, ...)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def apply_compat_patches() -> list[str]:
    """Apply the vmap compatibility patches (idempotent); returns the names of the patches in effect."""
    masking = importlib.import_module("transformers.masking_utils")
    original = masking.is_tracing
    if not getattr(original, "_opake_patched", False):

        @functools.wraps(original)
        def is_tracing(tensor: Any = None) -> bool:
            return inside_functorch() or original(tensor)

        is_tracing._opake_patched = True  # type: ignore[attr-defined]
        masking.is_tracing = is_tracing
    return ["transformers.masking_utils.is_tracing"]


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
