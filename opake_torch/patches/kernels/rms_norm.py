"""RMSNorm as a Triton kernel with autograd and per-example (vmap) gradients: :func:`opake_rms_norm`.

Forward: one program per row; the row statistic ``rstd = 1 / sqrt(mean(x^2) + eps)`` in float32 is kept for the
backward. Backward: ``dx = rstd * (dn - n * mean(dn * n))`` with ``n = x * rstd`` and ``dn = dy * w`` (plus ``dh``, the
gradient that reaches the normalized input directly, for the residual add of
:mod:`~opake_torch.patches.kernels.fused_add_rms_norm`, which shares this backward), and the weight gradient
``dw = sum_rows dy * n`` reduced **per group**. Under ``vmap`` over examples the batch becomes more rows in
the forward, and in the backward the shared weight is broadcast to one group per example, so each program writes
partial sums of its own example and ``dw`` comes out as ``[B, D]``, the per-example gradient, without any Python loop.
"""

from __future__ import annotations

from typing import Any

import torch

from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, next_power_of_2, tl
from opake_torch.patches.kernels._vmap import fold, front

__all__ = ["opake_rms_norm"]

_MAX_D = 65536
_PARTIALS = 32  # programs per group in the backward; each writes one partial dw row


@jit
def _rms_fwd_kernel(X, W, Y, RSTD, rows_per_group, stride_wg, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = row // rows_per_group
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + group * stride_wg + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * D + cols, (w * n).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@jit
def _rms_bwd_kernel(
    DY, DH, X, W, RSTD, DX, DW, rows_per_group, stride_wg, D,
    BLOCK: tl.constexpr, PARTS: tl.constexpr, HAS_DH: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(W + group * stride_wg + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(part, rows_per_group, PARTS):
        row = group * rows_per_group + r
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        dn = dy * w
        dx = rstd * (dn - n * (tl.sum(dn * n, axis=0) / D))
        if HAS_DH:
            dx = tl.load(DH + row * D + cols, mask=mask, other=0.0).to(tl.float32) + dx
        tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
    tl.store(DW + (group * PARTS + part) * D + cols, dw, mask=mask)


def _groups(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """``(groups, rows per group)``: a ``[G, D]`` weight pairs with ``x [G, ..., D]``."""
    d = x.shape[-1]
    groups = w.shape[0] if w.dim() == 2 else 1
    return groups, x.numel() // (d * groups) if groups else 0


def _forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    d = x.shape[-1]
    groups, rows = _groups(x, w)
    y = torch.empty(x.shape, dtype=torch.result_type(x, w), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel():
        stride_wg = w.stride(0) if w.dim() == 2 else 0
        _rms_fwd_kernel[(groups * rows,)](
            x, w, y, rstd, rows, stride_wg, d, eps, BLOCK=next_power_of_2(d), num_warps=_warps(d)
        )
    return y, rstd


def _backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` of ``y = rms_norm(x) * w`` from ``dy``, plus ``dh`` (None: none) added to ``dx``."""
    dy, x, rstd = dy.contiguous(), x.contiguous(), rstd.contiguous()
    dh = None if dh is None else dh.contiguous()
    d = x.shape[-1]
    groups, rows = _groups(x, w)
    dx = torch.empty_like(x)
    parts = max(1, min(_PARTIALS, rows))
    partial = torch.zeros(groups, parts, d, dtype=torch.float32, device=x.device)
    if x.numel():
        stride_wg = w.stride(0) if w.dim() == 2 else 0
        _rms_bwd_kernel[(groups, parts)](
            dy, dy if dh is None else dh, x, w, rstd, dx, partial, rows, stride_wg, d,
            BLOCK=next_power_of_2(d), PARTS=parts, HAS_DH=dh is not None, num_warps=_warps(d),
        )  # fmt: skip
    dw = partial.sum(dim=1).to(w.dtype)
    return dx, dw if w.dim() == 2 else dw[0]


def _warps(d: int) -> int:
    return 4 if d <= 2048 else 8 if d <= 8192 else 16


class _RMSNorm(torch.autograd.Function):
    """``(x [G?, ..., D], w [D] or [G, D], eps) -> (y, rstd)``; a 2-D weight holds one row per leading group."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(x, w, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, w, _ = inputs
        ctx.save_for_backward(x, w, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor) -> tuple[Any, ...]:
        x, w, rstd = ctx.saved_tensors
        dx, dw = RMSNormBackward.apply(dy, x, w, rstd, None)
        return dx, dw, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: torch.Tensor, w: torch.Tensor, eps: float) -> Any:
        size, (x_dim, w_dim, _) = info.batch_size, in_dims
        grouped = w.dim() - (w_dim is not None) == 2
        x = front(x, x_dim, size)
        if w_dim is not None or grouped:  # a per-example weight: one group per example
            w = front(w, w_dim, size)
        if grouped:
            x, w = fold(x), fold(w)
        y, rstd = _RMSNorm.apply(x, w, eps)
        if grouped:
            y, rstd = y.reshape(size, -1, *y.shape[1:]), rstd.reshape(size, -1, *rstd.shape[1:])
        return (y, rstd), (0, 0)


class RMSNormBackward(torch.autograd.Function):
    """``(dy, x, w, rstd, dh or None) -> (dx, dw)``, the backward of RMSNorm (and, with ``dh``, of the residual add
    before it), as a function of its own so that ``vmap`` over examples turns a shared weight into one group per
    example (per-example ``dw``)."""

    @staticmethod
    def forward(
        dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _backward(dy, x, w, rstd, dh)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        raise NotImplementedError("the RMSNorm kernels support first-order gradients only (no double backward).")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], dy: Any, x: Any, w: torch.Tensor, rstd: Any, dh: Any) -> Any:
        size = info.batch_size
        dy, x, rstd = front(dy, in_dims[0], size), front(x, in_dims[1], size), front(rstd, in_dims[3], size)
        dh = None if dh is None else front(dh, in_dims[4], size)
        grouped = w.dim() - (in_dims[2] is not None) == 2  # one weight row per group: the batch multiplies them
        w = front(w, in_dims[2], size)  # a shared weight becomes one group per example: per-example dw
        if grouped:
            dy, x, rstd, w = fold(dy), fold(x), fold(rstd), fold(w)
            dh = None if dh is None else fold(dh)
        dx, dw = RMSNormBackward.apply(dy, x, w, rstd, dh)
        if grouped:
            dx, dw = dx.reshape(size, -1, *dx.shape[1:]), dw.reshape(size, -1, *dw.shape[1:])
        return (dx, dw), (0, 0)


def opake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension (``LlamaRMSNorm``): ``weight * (x * rstd).to(x.dtype)``.

    Runs the Triton kernel on CUDA (differentiable, per-example gradients under ``vmap``); elsewhere, or for a
    non-1-D weight, :func:`~opake_torch.patches.kernels.reference.rms_norm`.

    Args:
        x: ``[..., D]`` activations.
        weight: ``[D]``.
        eps: added to the mean square.
    """
    with torch.profiler.record_function("opake::rms_norm"):
        if weight.dim() != 1 or x.shape[-1] != weight.shape[0] or x.shape[-1] > _MAX_D or not can_launch(x, weight):
            return reference.rms_norm(x, weight, eps)
        return _RMSNorm.apply(x, weight, eps)[0]
