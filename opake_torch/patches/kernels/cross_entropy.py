"""Token cross-entropy and fused linear cross-entropy as Triton kernels: :func:`opake_cross_entropy_loss` and
:func:`opake_fused_linear_cross_entropy`.

Cross-entropy: one program per row streams the vocabulary once with an online log-sum-exp (float32), writes the
row's loss and ``lse``; the backward writes ``(softmax - onehot) * dloss`` from ``lse`` without a stored softmax.

Fused linear cross-entropy: the ``[N, V]`` logits are never materialized. Rows go in chunks; each chunk's logits
``h W^T`` live only while its losses (forward) or its gradient ``dlogits`` (backward, recomputed) are taken, then
``dh = dlogits W`` and ``dW += dlogits^T h``. Under ``vmap`` the examples fold into rows; a per-example gradient of
a shared ``W`` (an unfrozen head) is one ``[V, H]`` block per example (``[B, V, H]``: large, as any per-example
gradient of the head is).
"""

from __future__ import annotations

from typing import Any

import torch

from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, next_power_of_2, tl
from opake_torch.patches.kernels._vmap import fold, front

__all__ = ["opake_cross_entropy_loss", "opake_fused_linear_cross_entropy"]

_BLOCK_V = 4096
_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk of the fused linear cross-entropy (128 MiB in float32)


@jit
def _ce_fwd_kernel(X, T, LOSS, LSE, stride_x, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(X + row * stride_x + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(T + row)
    valid = t != ignore_index
    x_t = tl.load(X + row * stride_x + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE + row, lse)


@jit
def _ce_bwd_kernel(X, T, LSE, DLOSS, DX, stride_x, stride_dx, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    t = tl.load(T + row)
    lse = tl.load(LSE + row)
    dloss = tl.where(t != ignore_index, tl.load(DLOSS + row).to(tl.float32), 0.0)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = tl.load(X + row * stride_x + idx, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(idx == t, 1.0, 0.0)) * dloss
        tl.store(DX + row * stride_dx + idx, g.to(DX.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _ce_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, t = _rows(logits), target.reshape(-1).contiguous()
    loss = torch.empty(t.shape, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(loss)
    if t.numel():
        block = min(_BLOCK_V, next_power_of_2(x.shape[1]))
        _ce_fwd_kernel[(t.numel(),)](x, t, loss, lse, x.stride(0), x.shape[1], ignore_index, BLOCK=block, num_warps=8)
    return loss.reshape(target.shape), lse.reshape(target.shape)


def _ce_backward(
    dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int, out=None
) -> torch.Tensor:
    x, t = _rows(logits), target.reshape(-1).contiguous()
    dx = torch.empty(x.shape, dtype=logits.dtype, device=x.device) if out is None else out
    if t.numel():
        block = min(_BLOCK_V, next_power_of_2(x.shape[1]))
        _ce_bwd_kernel[(t.numel(),)](
            x, t, lse.reshape(-1).contiguous(), dloss.reshape(-1).contiguous(), dx, x.stride(0), dx.stride(0),
            x.shape[1], ignore_index, BLOCK=block, num_warps=8,
        )  # fmt: skip
    return dx.reshape(logits.shape)


class _CrossEntropy(torch.autograd.Function):
    """``(logits [..., V], target [...], ignore_index) -> (loss [...] float32, lse)``."""

    @staticmethod
    def forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _ce_forward(logits, target, ignore_index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits, target, ignore_index = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
        logits, target, lse = ctx.saved_tensors
        return _CrossEntropyBackward.apply(dloss, logits, target, lse, ctx.ignore_index), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
        size = info.batch_size
        return _CrossEntropy.apply(front(logits, in_dims[0], size), front(target, in_dims[1], size), ignore_index), (
            0,
            0,
        )


class _CrossEntropyBackward(torch.autograd.Function):
    @staticmethod
    def forward(dloss, logits, target, lse, ignore_index: int) -> torch.Tensor:
        return _ce_backward(dloss, logits, target, lse, ignore_index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        raise NotImplementedError("opake_cross_entropy_loss supports first-order gradients only.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], dloss, logits, target, lse, ignore_index: int):
        size = info.batch_size
        args = [front(t, d, size) for t, d in zip((dloss, logits, target, lse), in_dims[:4], strict=True)]
        return _CrossEntropyBackward.apply(*args, ignore_index), 0


def _reduce(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    return reference._reduce(loss, target != ignore_index, reduction)


def opake_cross_entropy_loss(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Token cross-entropy in float32: ``logits [..., V]``, ``target [...]`` (int64).

    ``reduction="mean"`` averages over the non-ignored tokens of the call (0 when there are none); called per example
    under ``vmap`` that is each example's own token mean. Triton on CUDA, else the torch reference.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    with torch.profiler.record_function("opake::cross_entropy"):
        if logits.shape[:-1] != target.shape or not can_launch(logits, target):
            return reference.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        loss, _ = _CrossEntropy.apply(logits, target, ignore_index)
        return _reduce(loss, target, ignore_index, reduction)


# --- fused linear cross-entropy --------------------------------------------------------------------------------------


def _as_groups(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``hidden`` as ``[G, R, H]``: ``G`` weight groups (1 for a shared ``[V, H]`` weight)."""
    grouped = weight.dim() == 3
    groups = weight.shape[0] if grouped else 1
    return hidden.reshape(groups, -1, hidden.shape[-1]), grouped


def _logits(h: torch.Tensor, weight: torch.Tensor, grouped: bool) -> torch.Tensor:
    if grouped and weight.stride(0) != 0:
        return torch.matmul(h, weight.transpose(1, 2))
    return torch.matmul(h, (weight[0] if grouped else weight).t())


def _chunk_rows(groups: int, vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, groups * vocab))


def _flce_forward(hidden, weight, target, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, grouped = _as_groups(hidden, weight)
    t = target.reshape(h.shape[0], -1)
    loss = torch.empty(t.shape, dtype=torch.float32, device=h.device)
    lse = torch.empty_like(loss)
    step = _chunk_rows(h.shape[0], weight.shape[-2])
    for start in range(0, h.shape[1], step):
        stop = min(start + step, h.shape[1])
        loss[:, start:stop], lse[:, start:stop] = _ce_forward(
            _logits(h[:, start:stop], weight, grouped), t[:, start:stop], ignore_index
        )
    return loss.reshape(target.shape), lse.reshape(target.shape)


def _flce_backward(dloss, hidden, weight, target, lse, ignore_index: int, weight_grad: str):
    """``weight_grad``: ``"none"``, ``"same"`` (like ``weight``) or ``"grouped"`` (one ``[V, H]`` per group of a
    shared, broadcast weight)."""
    h, grouped = _as_groups(hidden, weight)
    groups, rows = h.shape[0], h.shape[1]
    t, lse, dloss = (v.reshape(groups, rows) for v in (target, lse, dloss))
    dh = torch.empty_like(h)
    per_group = grouped and (weight_grad == "grouped" or weight.stride(0) != 0)
    dw = None
    if weight_grad != "none":
        shape = (groups, *weight.shape[-2:]) if per_group else weight.shape[-2:]
        dw = torch.zeros(shape, dtype=torch.float32, device=h.device)
    w_dh = weight if grouped and weight.stride(0) != 0 else (weight[0] if grouped else weight)
    step = _chunk_rows(groups, weight.shape[-2])
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        h_c = h[:, start:stop]
        logits = _logits(h_c, weight, grouped)
        dlogits = _ce_backward(dloss[:, start:stop], logits, t[:, start:stop], lse[:, start:stop], ignore_index,
                               out=logits.view(-1, logits.shape[-1]))  # fmt: skip
        dh[:, start:stop] = torch.matmul(dlogits, w_dh)
        if dw is not None:
            if per_group:
                dw += torch.matmul(dlogits.transpose(1, 2), h_c)
            else:
                dw += dlogits.reshape(-1, dlogits.shape[-1]).t() @ h_c.reshape(-1, h_c.shape[-1])
    dw = None if dw is None else dw.to(weight.dtype)
    return dh.reshape(hidden.shape), dw


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``(hidden [..., H], weight [V, H] or [G, V, H], target [...], ignore_index) -> (loss [...] float32, lse)``."""

    @staticmethod
    def forward(hidden, weight, target, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _flce_forward(hidden, weight, target, ignore_index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        hidden, weight, target, ignore_index = inputs
        ctx.save_for_backward(hidden, weight, target, output[1])
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor, _dlse: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, target, lse = ctx.saved_tensors
        weight_grad = "same" if ctx.needs_input_grad[1] else "none"
        dh, dw = _FusedLinearCrossEntropyBackward.apply(
            dloss, hidden, weight, target, lse, ctx.ignore_index, weight_grad
        )
        return dh, dw, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], hidden, weight, target, ignore_index: int):
        size, (h_dim, w_dim, t_dim, _) = info.batch_size, in_dims
        hidden, target = front(hidden, h_dim, size), front(target, t_dim, size)
        if w_dim is None and weight.dim() == 2:  # shared head: the examples are more rows
            loss, lse = _FusedLinearCrossEntropy.apply(hidden, weight, target, ignore_index)
            return (loss, lse), (0, 0)
        grouped = weight.dim() - (w_dim is not None) == 3
        weight = front(weight, w_dim, size)
        if grouped:
            hidden, target, weight = fold(hidden), fold(target), fold(weight)
        loss, lse = _FusedLinearCrossEntropy.apply(hidden, weight, target, ignore_index)
        if grouped:
            loss, lse = loss.reshape(size, -1, *loss.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])
        return (loss, lse), (0, 0)


class _FusedLinearCrossEntropyBackward(torch.autograd.Function):
    @staticmethod
    def forward(dloss, hidden, weight, target, lse, ignore_index: int, weight_grad: str):
        return _flce_backward(dloss, hidden, weight, target, lse, ignore_index, weight_grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        raise NotImplementedError("opake_fused_linear_cross_entropy supports first-order gradients only.")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], dloss, hidden, weight, target, lse, ignore_index, weight_grad):
        size = info.batch_size
        dloss, hidden, target, lse = (
            front(v, d, size)
            for v, d in zip((dloss, hidden, target, lse), (in_dims[0], in_dims[1], in_dims[3], in_dims[4]), strict=True)
        )
        w_dim = in_dims[2]
        grouped = weight.dim() - (w_dim is not None) == 3
        if weight_grad == "none" and w_dim is None and not grouped:
            dh, _ = _FusedLinearCrossEntropyBackward.apply(dloss, hidden, weight, target, lse, ignore_index, "none")
            return (dh, None), (0, None)
        # one weight group per example (a broadcast view of a shared weight): the head's gradient per example
        mode = weight_grad if w_dim is not None or grouped else ("grouped" if weight_grad != "none" else "none")
        weight = front(weight, w_dim, size)
        if grouped:
            dloss, hidden, target, lse, weight = (fold(v) for v in (dloss, hidden, target, lse, weight))
        dh, dw = _FusedLinearCrossEntropyBackward.apply(dloss, hidden, weight, target, lse, ignore_index, mode)
        if grouped:
            dh = dh.reshape(size, -1, *dh.shape[1:])
            dw = None if dw is None else dw.reshape(size, -1, *dw.shape[1:])
        return (dh, dw), (0, None if dw is None else 0)


def opake_fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight^T, target)`` without materializing the logits.

    Args:
        hidden: ``[..., H]`` final hidden states (already shifted against ``target``).
        weight: ``[V, H]`` output head (``lm_head.weight``); frozen or trainable.
        target: ``[...]`` int64 token ids, ``ignore_index`` for positions without a loss.
        reduction: ``"mean"`` over non-ignored tokens, ``"sum"`` or ``"none"``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    with torch.profiler.record_function("opake::fused_linear_cross_entropy"):
        if (
            weight.dim() != 2
            or hidden.shape[:-1] != target.shape
            or hidden.shape[-1] != weight.shape[1]
            or not can_launch(hidden, weight, target)
        ):
            return reference.fused_linear_cross_entropy(
                hidden, weight, target, ignore_index=ignore_index, reduction=reduction
            )
        loss, _ = _FusedLinearCrossEntropy.apply(hidden, weight.to(hidden.dtype), target, ignore_index)
        return _reduce(loss, target, ignore_index, reduction)
