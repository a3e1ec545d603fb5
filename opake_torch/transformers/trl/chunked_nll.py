"""Fused linear cross-entropy: token log-probabilities from hidden states without the full ``[T, V]`` logits.

A causal LM computes ``logits = hidden @ W.T (+ b)`` and then a log-softmax over the vocabulary ``V``. For a large
vocabulary the ``[T, V]`` logits (and their gradient) dominate the memory of one example, and ``vmap`` over a
microbatch multiplies that by the microbatch size. :func:`chunked_token_logps` walks the sequence in chunks of
``chunk_size`` positions: the forward keeps only the ``[T]`` log-probabilities and log-normalizers, the backward
recomputes each chunk's logits, so the peak is ``O(chunk_size * V)`` instead of ``O(T * V)``.

Ignored positions are not compacted (that would make shapes depend on the data, which ``vmap`` cannot batch): the
caller multiplies their log-probability by a zero weight, which also gives them a zero gradient.

Notation: ``h`` hidden states ``[T, H]``, ``W`` output embedding ``[V, H]``, ``b`` optional bias ``[V]``,
``y`` targets ``[T]``, ``z = h W^T + b`` logits, ``lse = logsumexp(z)``; ``d log p_y / d z = onehot(y) - softmax(z)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["chunked_nll", "chunked_token_logps"]


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 weights accumulate in float32; float64 stays float64 for tests)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = _wide(hidden) @ _wide(weight).T
    return logits if bias is None else logits + _wide(bias)


class _ChunkedTokenLogps(torch.autograd.Function):
    """``log softmax(h W^T + b)[y]`` per position, recomputing chunk logits in the backward pass."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lses = [], []
        length = hidden.shape[-2]
        for start in range(0, length, chunk_size):
            logits = _chunk_logits(hidden[..., start : start + chunk_size, :], weight, bias)
            lse = torch.logsumexp(logits, dim=-1)
            target = torch.gather(logits, -1, targets[..., start : start + chunk_size, None]).squeeze(-1)
            logps.append(target - lse)
            lses.append(lse)
        return torch.cat(logps, dim=-1), torch.cat(lses, dim=-1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        hidden, weight, bias, targets, chunk_size = inputs
        ctx.save_for_backward(hidden, weight, bias, targets, output[1])
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad_logps: torch.Tensor, _grad_lse: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk_size
        grad_hidden, grad_weight, grad_bias = [], torch.zeros_like(_wide(weight)), None
        if bias is not None:
            grad_bias = torch.zeros_like(_wide(bias))
        for start in range(0, hidden.shape[-2], chunk):
            stop = start + chunk
            h = hidden[..., start:stop, :]
            probs = torch.exp(_chunk_logits(h, weight, bias) - lse[..., start:stop, None])
            vocab = torch.arange(probs.shape[-1], device=probs.device)
            onehot = (vocab == targets[..., start:stop, None]).to(probs.dtype)  # one_hot is not vmap-safe
            grad_logits = (onehot - probs) * grad_logps[..., start:stop, None].to(probs.dtype)  # [c, V]
            grad_hidden.append((grad_logits @ _wide(weight)).to(hidden.dtype))
            grad_weight = grad_weight + grad_logits.transpose(-1, -2) @ _wide(h)
            if grad_bias is not None:
                grad_bias = grad_bias + grad_logits.sum(-2)
        grad_weight = grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return torch.cat(grad_hidden, dim=-2), grad_weight, grad_bias, None, None


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Log-probability of each target token, ``log softmax(hidden @ weight.T + bias)[t, targets[t]]``.

    Args:
        hidden: ``[T, H]`` final hidden states (what the LM head consumes).
        weight: ``[V, H]`` output embedding (the LM head weight).
        targets: ``[T]`` integer token ids in ``[0, V)``; put any valid id (e.g. 0) at ignored positions and give
            them weight zero in the caller.
        bias: optional ``[V]`` LM head bias.
        chunk_size: positions per chunk; memory is ``O(chunk_size * V)``.

    Returns:
        ``[T]`` log-probabilities (float32, or float64 for float64 inputs). Differentiable in ``hidden``,
        ``weight`` and ``bias``; works under ``torch.func.vmap`` and ``grad``.
    """
    logps, _ = _ChunkedTokenLogps.apply(hidden, weight, bias, targets, int(chunk_size))
    return logps


def chunked_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 256,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy of **one** sequence, equal to ``causal_lm_loss(hidden @ weight.T, labels)``.

    Position ``t`` predicts ``labels[t + 1]``; positions whose label is ``ignore_index`` get weight zero (they stay in
    the computation, so shapes do not depend on the data). Returns a float32 scalar, 0 without target tokens.
    """
    targets = labels[1:]
    mask = targets != ignore_index
    safe = torch.where(mask, targets, torch.zeros_like(targets))
    logps = chunked_token_logps(hidden[:-1], weight, safe, bias=bias, chunk_size=chunk_size)
    return -(logps * mask).sum() / mask.sum().clamp(min=1)
