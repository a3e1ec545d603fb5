"""Guarded Triton import shared by the kernel modules: everything here imports on a machine without Triton.

``triton``/``tl`` are ``None``-like stubs when Triton is missing; ``jit`` then returns the function unchanged, so the
kernel definitions still parse (they are never launched: :func:`can_launch` is False).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU CI, or a platform without Triton wheels
    triton = None

    class _MissingLanguage:
        constexpr = Any

    tl = _MissingLanguage()  # type: ignore[assignment]

__all__ = ["available", "can_launch", "interpreting", "jit", "next_power_of_2", "tl", "triton"]


def jit(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``triton.jit`` with its keyword ``options`` (``@jit`` or ``@jit(do_not_specialize=[...])``); without Triton,
    the function unchanged."""
    if fn is None:
        return lambda function: jit(function, **options)
    return fn if triton is None else triton.jit(fn, **options)


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``): kernels then also run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """Whether the Triton kernels can run here: Triton importable and a CUDA (not ROCm) device present."""
    return triton is not None and torch.version.cuda is not None and torch.cuda.is_available()


def can_launch(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to a Triton kernel: all on one CUDA device (any device under the interpreter)."""
    if triton is None or not tensors:
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = devices.pop()
    if device.type == "cuda":
        return torch.version.cuda is not None
    return device.type == "cpu" and interpreting()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
