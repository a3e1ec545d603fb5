"""Pure-torch reference implementations of the performance kernels.

These are the definitions the Triton kernels are tested against, and the fallback wherever a kernel cannot run (CPU,
no Triton, unsupported layout). They follow the Hugging Face modelling code operation by operation (same casts), so
a patched model on the fallback computes what the unpatched model computes. All are ``torch.func``-compatible: they
run under ``vmap(grad(...))``.

Shapes: ``N`` rows, ``D`` features, ``V`` vocabulary, ``r`` LoRA rank; ``...`` any leading dimensions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "LoRAProjection",
    "cross_entropy",
    "fused_add_rms_norm",
    "fused_linear_cross_entropy",
    "geglu",
    "lora_mlp",
    "lora_w",
    "rms_norm",
    "rope",
    "swiglu",
]


class LoRAProjection(NamedTuple):
    """One LoRA-adapted linear map ``y = x W^T + b + scaling * (x A^T) B^T``.

    Attributes:
        weight: frozen base weight ``W`` ``[out, in]``.
        lora_A: ``A`` ``[r, in]``.
        lora_B: ``B`` ``[out, r]``.
        bias: optional base bias ``[out]``.
    """

    weight: torch.Tensor
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    bias: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dimension, computed in float32 and cast back to
    ``x.dtype`` before the weight (``LlamaRMSNorm``)."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h, weight, eps), h)`` with ``h = residual + x`` in the input dtype: a decoder layer's residual add
    then post-attention norm."""
    h = residual + x
    return rms_norm(h, weight, eps), h


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the Llama/Mistral/Qwen2 MLP activation)."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate) * up``; ``approximate="tanh"`` for Gemma's ``gelu_pytorch_tanh``."""
    return F.gelu(gate, approximate=approximate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (``apply_rotary_pos_emb``): ``q [B, H, S, D]``, ``cos``/``sin`` ``[B, S, D]``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Token cross-entropy in float32: ``logits [..., V]``, ``target [...]``; ``mean`` is over non-ignored tokens
    (0 when there are none)."""
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat, flat_target, ignore_index=ignore_index, reduction="none").reshape(target.shape)
    return _reduce(loss, target != ignore_index, reduction)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight^T, target)`` with ``hidden [..., H]``, ``weight [V, H]``."""
    return cross_entropy(F.linear(hidden, weight), target, ignore_index=ignore_index, reduction=reduction)


def lora_w(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b + scaling * (x A^T) B^T``."""
    return F.linear(x, weight, bias) + scaling * F.linear(F.linear(x, lora_A), lora_B)


def lora_mlp(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    scaling: float,
    activation: str = "silu",
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with LoRA on all three; ``activation`` is ``silu``, ``gelu`` or ``gelu_tanh``."""
    g = lora_w(x, gate.weight, gate.lora_A, gate.lora_B, scaling, gate.bias)
    u = lora_w(x, up.weight, up.lora_A, up.lora_B, scaling, up.bias)
    h = swiglu(g, u) if activation == "silu" else geglu(g, u, "tanh" if activation == "gelu_tanh" else "none")
    return lora_w(h, down.weight, down.lora_A, down.lora_B, scaling, down.bias)
