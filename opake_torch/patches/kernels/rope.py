"""Rotary position embedding as a Triton kernel: :func:`opake_rope`.

With ``x = (x1, x2)`` the two halves of the head dimension, the rotation is ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``. It
is linear in ``x`` and its transpose is the inverse rotation ``(d1 c1 + d2 s2, d2 c2 - d1 s1)``, so the backward is
the same kernel with ``INVERSE`` set (and the backward of that is the forward again: any order of derivatives).
``cos``/``sin`` come from positions, never from parameters: they get no gradient.

Layout: ``x [Z, H, S, D]`` with ``cos``/``sin`` ``[Zc, S, D]``, ``Zc`` 1 or ``Z`` (broadcast by a zero stride).
Under ``vmap`` the example dimension folds into ``Z``.
"""

from __future__ import annotations

from typing import Any

import torch

from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, next_power_of_2, tl
from opake_torch.patches.kernels._vmap import fold, front

__all__ = ["opake_rope"]


@jit
def _rope_kernel(X, COS, SIN, Y, H, S, stride_cz, stride_cs, HALF, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z = row // (H * S)
    s = row % S
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = row * 2 * HALF
    c_base = z * stride_cz + s * stride_cs
    x1 = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + c_base + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + c_base + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + c_base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + base + cols, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + base + HALF + cols, y2.to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    z, h, s, d = x.shape
    y = torch.empty_like(x)
    if x.numel():
        stride_cz = 0 if cos.shape[0] == 1 else cos.stride(0)
        _rope_kernel[(z * h * s,)](
            x, cos, sin, y, h, s, stride_cz, cos.stride(1), d // 2, INVERSE=inverse, BLOCK=next_power_of_2(d // 2)
        )
    return y


class _Rope(torch.autograd.Function):
    """``(x [Z, H, S, D], cos, sin [Zc, S, D], inverse) -> rotated x``."""

    @staticmethod
    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        return _rotate(x, cos, sin, inverse)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _, cos, sin, inverse = inputs
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        cos, sin = ctx.saved_tensors
        return _Rope.apply(dy, cos, sin, not ctx.inverse), None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse):
        size, (x_dim, c_dim, s_dim, _) = info.batch_size, in_dims
        x = front(x, x_dim, size)
        z = x.shape[1]
        if c_dim is None and s_dim is None and cos.shape[0] == 1:
            cos_f, sin_f = cos, sin  # shared by every example and row group: stays broadcast
        else:
            cos_f = fold(front(cos, c_dim, size).expand(size, z, *cos.shape[-2:]))
            sin_f = fold(front(sin, s_dim, size).expand(size, z, *sin.shape[-2:]))
        y = _Rope.apply(fold(x), cos_f, sin_f, inverse)
        return y.reshape(size, z, *y.shape[1:]), 0


def opake_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to ``q`` and ``k`` (``apply_rotary_pos_emb`` of the Llama family).

    Args:
        q: ``[B, Hq, S, D]``.
        k: ``[B, Hk, S, D]``.
        cos: ``[B or 1, S, D]``, from the model's rotary embedding.
        sin: same shape as ``cos``.
        unsqueeze_dim: the head dimension of ``q``/``k``; the kernel serves ``1`` (the Llama layout), others use the
            torch reference.
    """
    with torch.profiler.record_function("opake::rope"):
        if (
            unsqueeze_dim != 1
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or cos.shape != sin.shape
            or q.shape[-1] % 2
            or cos.shape[-1] != q.shape[-1]
            or cos.shape[-2] != q.shape[-2]
            or cos.shape[0] not in (1, q.shape[0])
            or not can_launch(q, k, cos, sin)
        ):
            return reference.rope(q, k, cos, sin, unsqueeze_dim)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return _Rope.apply(q, cos, sin, False), _Rope.apply(k, cos, sin, False)
