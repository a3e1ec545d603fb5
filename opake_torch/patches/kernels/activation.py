"""Gated MLP activations as Triton kernels: :func:`opake_swiglu` (``silu(gate) * up``) and :func:`opake_geglu`
(``gelu(gate) * up``, exact or tanh).

Elementwise, so the ``vmap`` rule only moves the batch dimension to the front: the batch is more elements of the same
launch. Computed in float32 and cast once to the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, tl
from opake_torch.patches.kernels._vmap import front

__all__ = ["opake_geglu", "opake_swiglu"]

SILU, GELU, GELU_TANH = 0, 1, 2
_KINDS = {"silu": SILU, "none": GELU, "tanh": GELU_TANH}
_BLOCK = 1024


@jit
def _act(g, KIND: tl.constexpr):
    """``(act(g), act'(g))`` in float32."""
    if KIND == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    elif KIND == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * d_inner


@jit
def _glu_fwd_kernel(G, U, Y, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act(g, KIND)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


@jit
def _glu_bwd_kernel(DY, G, U, DG, DU, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act(g, KIND)
    tl.store(DG + offs, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (-(-n // _BLOCK),)


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(gate: torch.Tensor, up: torch.Tensor, kind: int) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate, dtype=torch.result_type(gate, up))
        if y.numel():
            _glu_fwd_kernel[_grid(y.numel())](gate, up, y, y.numel(), KIND=kind, BLOCK=_BLOCK)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        gate, up, kind = inputs
        ctx.save_for_backward(gate, up)
        ctx.kind = kind

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        gate, up = ctx.saved_tensors
        dg, du = _GLUBackward.apply(dy, gate, up, ctx.kind)
        return dg, du, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], gate: torch.Tensor, up: torch.Tensor, kind: int) -> Any:
        size = info.batch_size
        return _GLU.apply(front(gate, in_dims[0], size), front(up, in_dims[1], size), kind), 0


class _GLUBackward(torch.autograd.Function):
    @staticmethod
    def forward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: int) -> tuple[torch.Tensor, ...]:
        dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        if dg.numel():
            _glu_bwd_kernel[_grid(dg.numel())](dy, gate, up, dg, du, dg.numel(), KIND=kind, BLOCK=_BLOCK)
        return dg, du

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        raise NotImplementedError("opake_swiglu/opake_geglu support first-order gradients only (no double backward).")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, kind: int):
        size = info.batch_size
        dy, gate, up = (front(t, d, size) for t, d in zip((dy, gate, up), in_dims[:3], strict=True))
        return _GLUBackward.apply(dy, gate, up, kind), (0, 0)


def _glu(gate: torch.Tensor, up: torch.Tensor, kind: int) -> torch.Tensor:
    if gate.shape != up.shape or not can_launch(gate, up):
        return None  # type: ignore[return-value]
    return _GLU.apply(gate, up, kind)


def opake_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for same-shape ``gate`` and ``up`` (Triton on CUDA, else the torch reference)."""
    with torch.profiler.record_function("opake::swiglu"):
        out = _glu(gate, up, SILU)
        return reference.swiglu(gate, up) if out is None else out


def opake_geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate) * up``; ``approximate`` is ``"none"`` (erf) or ``"tanh"`` as in ``torch.nn.functional.gelu``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}.")
    with torch.profiler.record_function("opake::geglu"):
        out = _glu(gate, up, _KINDS[approximate])
        return reference.geglu(gate, up, approximate) if out is None else out
