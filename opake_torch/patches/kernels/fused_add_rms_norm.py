"""Residual add then RMSNorm as one Triton kernel with autograd and per-example (vmap) gradients:
:func:`opake_fused_add_rms_norm`.

A Llama-style decoder layer adds the attention output to the residual stream and normalizes the sum
(``h = x + residual``, ``y = rms_norm(h) * w``); both ``h`` (the next residual) and ``y`` (the MLP input) are used.
Forward: one program per row reads ``x`` and ``residual`` once, writes ``h`` in the input dtype (rounded as the
unfused add rounds it) and ``y``, and keeps the float32 row statistic ``rstd``. Backward: with ``dh`` the gradient
reaching ``h`` directly (through the residual path), ``dx = dresidual = dh + rstd * (dn - n * mean(dn * n))``, with
``n = h * rstd`` and ``dn = dy * w``, and the weight gradient ``dw = sum_rows dy * n`` reduced **per group**: the
backward of :mod:`~opake_torch.patches.kernels.rms_norm` with ``dh`` added, its kernel and function shared; under
``vmap`` over examples the shared weight becomes one group per example and ``dw`` comes out ``[B, D]``, the
per-example gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, next_power_of_2, tl
from opake_torch.patches.kernels._vmap import fold, front
from opake_torch.patches.kernels.rms_norm import _MAX_D, RMSNormBackward, _groups, _warps

__all__ = ["opake_fused_add_rms_norm"]


@jit
def _add_rms_fwd_kernel(X, R, W, Y, H, RSTD, rows_per_group, stride_wg, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = row // rows_per_group
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + row * D + cols, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    n = (h * rstd).to(H.dtype.element_ty).to(tl.float32)
    w = tl.load(W + group * stride_wg + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * D + cols, (w * n).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


def _forward(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = x.contiguous(), residual.contiguous()
    d = x.shape[-1]
    groups, rows = _groups(x, w)
    h = torch.empty_like(x)
    y = torch.empty(x.shape, dtype=torch.result_type(x, w), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel():
        stride_wg = w.stride(0) if w.dim() == 2 else 0
        _add_rms_fwd_kernel[(groups * rows,)](
            x, residual, w, y, h, rstd, rows, stride_wg, d, eps, BLOCK=next_power_of_2(d), num_warps=_warps(d)
        )
    return y, h, rstd


def _unfold(t: torch.Tensor, size: int) -> torch.Tensor:
    return t.reshape(size, -1, *t.shape[1:])


class _FusedAddRMSNorm(torch.autograd.Function):
    """``(x, residual [G?, ..., D], w [D] or [G, D], eps) -> (y, h, rstd)``; a 2-D weight holds one row per
    leading group."""

    @staticmethod
    def forward(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> Any:
        return _forward(x, residual, w, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        _, _, w, _ = inputs
        _, h, rstd = output
        ctx.save_for_backward(h, w, rstd)
        ctx.mark_non_differentiable(rstd)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dh: torch.Tensor, _drstd: torch.Tensor) -> tuple[Any, ...]:
        h, w, rstd = ctx.saved_tensors
        dx, dw = RMSNormBackward.apply(dy, h, w, rstd, dh)
        return dx, dx, dw, None  # h = x + residual: both receive the same gradient

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> Any:
        size, (x_dim, r_dim, w_dim, _) = info.batch_size, in_dims
        grouped = w.dim() - (w_dim is not None) == 2
        x, residual = front(x, x_dim, size), front(residual, r_dim, size)
        if w_dim is not None or grouped:  # a per-example weight: one group per example
            w = front(w, w_dim, size)
        if grouped:
            x, residual, w = fold(x), fold(residual), fold(w)
        y, h, rstd = _FusedAddRMSNorm.apply(x, residual, w, eps)
        if grouped:
            y, h, rstd = _unfold(y, size), _unfold(h, size), _unfold(rstd, size)
        return (y, h, rstd), (0, 0, 0)


def opake_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add then RMSNorm of a decoder layer: ``h = x + residual``, ``y = rms_norm(h, weight, eps)``.

    Runs the Triton kernel on CUDA (differentiable in ``x``, ``residual`` and ``weight``; per-example gradients under
    ``vmap``); elsewhere, or for mismatched shapes or dtypes or a non-1-D weight,
    :func:`~opake_torch.patches.kernels.reference.fused_add_rms_norm`.

    Args:
        x: ``[..., D]`` (the attention output).
        residual: ``[..., D]``, same shape and dtype as ``x``.
        weight: ``[D]``.
        eps: added to the mean square.

    Returns:
        ``(y, h)``, both ``[..., D]``: the normalized sum (the MLP input) and the sum (the next residual).
    """
    with torch.profiler.record_function("opake::fused_add_rms_norm"):
        if (
            weight.dim() != 1
            or x.shape != residual.shape
            or x.dtype != residual.dtype
            or x.shape[-1] != weight.shape[0]
            or x.shape[-1] > _MAX_D
            or not can_launch(x, residual, weight)
        ):
            return reference.fused_add_rms_norm(x, residual, weight, eps)
        y, h, _ = _FusedAddRMSNorm.apply(x, residual, weight, eps)
        return y, h
