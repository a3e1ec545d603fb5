"""LoRA linear maps with a hand-written backward: :func:`opake_lora_w`, :func:`opake_lora_mlp`.

``y_j = x W_j^T + b_j + s (x A_j^T) B_j^T`` for one or several projections of the same input. The forward does one
matmul ``x [A_1; A_2; ...]^T`` for all adapters (the q/k/v or gate/up fusion) and keeps ``xA`` for the backward;
the backward never forms a gradient of the frozen ``W_j`` unless it is asked for, and computes ``dA`` for all
adapters with one matmul. The matmuls stay on cuBLAS (they are compute-bound; a Triton GEMM would not beat it), so
the function is a ``torch.autograd.Function`` with ``generate_vmap_rule = True``: under ``vmap`` the reshapes and
matmuls batch natively, giving per-example ``dA``/``dB`` as batched matmuls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from opake_torch.patches.kernels.activation import opake_geglu, opake_swiglu
from opake_torch.patches.kernels.reference import LoRAProjection

__all__ = ["LoRAProjection", "opake_lora_mlp", "opake_lora_w"]


def _unpack(flat: tuple[torch.Tensor, ...], has_bias: tuple[bool, ...]) -> list[tuple[Any, ...]]:
    projections, i = [], 0
    for bias in has_bias:
        weight, lora_a, lora_b = flat[i : i + 3]
        projections.append((weight, lora_a, lora_b, flat[i + 3] if bias else None))
        i += 4 if bias else 3
    return projections


class _LoRALinears(torch.autograd.Function):
    """``(x, scaling, has_bias, *[W, A, B, (b)] per projection) -> (y_1, ..., y_k, xA)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, scaling: float, has_bias: tuple[bool, ...], *flat: torch.Tensor) -> Any:
        projections = _unpack(flat, has_bias)
        a_all = torch.cat([p[1] for p in projections]) if len(projections) > 1 else projections[0][1]
        xa = F.linear(x, a_all)
        outputs, offset = [], 0
        for weight, lora_a, lora_b, bias in projections:
            rank = lora_a.shape[0]
            outputs.append(F.linear(x, weight, bias) + scaling * F.linear(xa[..., offset : offset + rank], lora_b))
            offset += rank
        return (*outputs, xa)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, scaling, has_bias, *flat = inputs
        ctx.save_for_backward(x, output[-1], *flat)
        ctx.scaling, ctx.has_bias = scaling, has_bias
        ctx.mark_non_differentiable(output[-1])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        x, xa, *flat = ctx.saved_tensors
        projections = _unpack(tuple(flat), ctx.has_bias)
        needs = ctx.needs_input_grad[3:]
        s = ctx.scaling
        x2d = x.reshape(-1, x.shape[-1])
        dx = None
        dxa_parts, out_grads, offset, i = [], [], 0, 0
        for (weight, lora_a, lora_b, bias), dy in zip(projections, grads[:-1], strict=True):
            rank = lora_a.shape[0]
            dy2d = dy.reshape(-1, dy.shape[-1])
            dxa_parts.append(s * (dy @ lora_b))
            part = dy @ weight
            dx = part if dx is None else dx + part
            d_weight = dy2d.t() @ x2d if needs[i] else None
            d_b = s * (dy2d.t() @ xa[..., offset : offset + rank].reshape(-1, rank)) if needs[i + 2] else None
            grads_p = [d_weight, None, d_b]  # dA is filled below from the fused matmul
            if bias is not None:
                grads_p.append(dy2d.sum(0) if needs[i + 3] else None)
            out_grads.append(grads_p)
            offset += rank
            i += 4 if bias is not None else 3
        dxa = torch.cat(dxa_parts, dim=-1) if len(dxa_parts) > 1 else dxa_parts[0]
        a_all = torch.cat([p[1] for p in projections]) if len(projections) > 1 else projections[0][1]
        dx = dx + dxa @ a_all
        d_a_all = dxa.reshape(-1, dxa.shape[-1]).t() @ x2d
        offset = 0
        for grads_p, (_, lora_a, _, _) in zip(out_grads, projections, strict=True):
            rank = lora_a.shape[0]
            grads_p[1] = d_a_all[offset : offset + rank]
            offset += rank
        flat_grads = [g for grads_p in out_grads for g in grads_p]
        return (dx, None, None, *flat_grads)


def _flat(projections: tuple[LoRAProjection, ...]) -> tuple[tuple[bool, ...], list[torch.Tensor]]:
    has_bias = tuple(p.bias is not None for p in projections)
    flat = [t for p in projections for t in (p.weight, p.lora_A, p.lora_B, *(() if p.bias is None else (p.bias,)))]
    return has_bias, flat


def _lora(x: torch.Tensor, projections: tuple[LoRAProjection, ...], scaling: float) -> tuple[torch.Tensor, ...]:
    has_bias, flat = _flat(projections)
    return _LoRALinears.apply(x, float(scaling), has_bias, *flat)[:-1]


def opake_lora_w(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b + scaling * (x A^T) B^T`` with ``x [..., in]``, ``W [out, in]``, ``A [r, in]``, ``B [out, r]``."""
    with torch.profiler.record_function("opake::lora_w"):
        return _lora(x, (LoRAProjection(weight, lora_A, lora_B, bias),), scaling)[0]


def opake_lora_mlp(
    x: torch.Tensor,
    gate: LoRAProjection,
    up: LoRAProjection,
    down: LoRAProjection,
    scaling: float,
    activation: str = "silu",
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with LoRA on the three projections (gate and up fused, the activation as the
    Triton kernel); ``activation`` is ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU)."""
    if activation not in ("silu", "gelu", "gelu_tanh"):
        raise ValueError(f"activation must be 'silu', 'gelu' or 'gelu_tanh', got {activation!r}.")
    with torch.profiler.record_function("opake::lora_mlp"):
        g, u = _lora(x, (gate, up), scaling)
        if activation == "silu":
            h = opake_swiglu(g, u)
        else:
            h = opake_geglu(g, u, "tanh" if activation == "gelu_tanh" else "none")
        return _lora(h, (down,), scaling)[0]
