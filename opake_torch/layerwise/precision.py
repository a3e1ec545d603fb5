"""The precision of the engine's products: the run's float32 matmul setting and the margin the norms carry for it,
and the layers that ran in bfloat16, whose factors are rounded as their forward rounded them and whose clipped sums
split the scaled factor into exact bf16 parts.

Reduced-precision float32 matmuls (TF32, bf16) round the factors of a ghost layer's scaled sum; :func:`product_error`
bounds that rounding, and the ghost norms of those layers carry it as a margin
(:func:`~opake_torch.layerwise.ghost.ghost_norms`), so that every example's contribution stays within the clipping
bound. A linear layer that ran in bfloat16 (bf16 weights or bf16 autocast: its output gradient is bf16) has the
weight gradient ``g^T bf16(a)``, a product of bf16 factors: its norms are taken from the bf16-rounded input
(:func:`input_factor`) and its clipped sum runs on bf16 tensor cores with float32 accumulation
(:func:`add_bf16_product`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from opake_torch.layerwise.calls import Call, by_example, cast

__all__ = [
    "add_bf16_product",
    "bf16_factors",
    "bf16_parts",
    "float32_matmuls",
    "input_factor",
    "matmul_precision",
    "product_error",
]


def _matmul_backend(device: torch.device) -> Any:
    """The settings object of ``device``'s float32 matmuls (``torch.backends.<backend>.matmul``)."""
    return torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul


def matmul_precision(device: torch.device) -> str:
    """The precision of ``device``'s float32 matmuls: ``"ieee"``, ``"tf32"`` or ``"bf16"``. Read through the
    per-backend setting, which answers whichever of PyTorch's two APIs set it (``torch.backends.fp32_precision``, as
    ``transformers`` does, or ``allow_tf32`` / ``set_float32_matmul_precision``); ``"none"`` is IEEE."""
    precision = _matmul_backend(device).fp32_precision
    return "ieee" if precision == "none" else precision


@contextlib.contextmanager
def float32_matmuls(device: torch.device, *, highest: bool) -> Iterator[None]:
    """The matmuls of the ghost layers' scaled sums on ``device``: float32 ones in IEEE arithmetic with ``highest``
    (else at the precision the run set, which :func:`product_error` accounts for in the norms), and bf16 ones reduced
    in float32 (no reduced-precision split-K reduction). Set and restored through the per-backend setting, which
    leaves either API's later reads working."""
    backend, cuda_matmul = _matmul_backend(device), torch.backends.cuda.matmul
    previous, reduced = backend.fp32_precision, cuda_matmul.allow_bf16_reduced_precision_reduction
    if highest:
        backend.fp32_precision = "ieee"
    cuda_matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        backend.fp32_precision = previous
        cuda_matmul.allow_bf16_reduced_precision_reduction = reduced


_FACTOR_BITS = {"tf32": 10, "bf16": 7}  # explicit significand bits of a reduced-precision float32 matmul's factors


def product_error(precision: str) -> float:
    """``eps``: a bound on the relative error of one product ``(c_i a_t)_k (g_t)_o`` inside a float32 matmul at
    ``precision`` (:func:`matmul_precision`), beyond the IEEE product: 0 for ``"ieee"``; under ``"tf32"`` each factor
    is rounded to 10 explicit significand bits, under ``"bf16"`` to 7 (an unknown setting counts as bf16), by
    truncation at worst (relative error ``2^-b``), and the scaled input ``c_i a_t`` was rounded to float32 before,
    so ``eps = (1 + 2^-b)^2 (1 + 2^-24) - 1``; the rounded factors' product is exact in the float32 accumulator.

    Then each example's contribution to the sum is ``c_i G~_i`` with ``G~_i = sum_t g~_t a~_t^T`` and, entry by
    entry, ``|G~_i - G_i| <= eps sum_t |g_t| |a_t|^T``, so ``||G~_i - G_i||_F <= eps S_i`` with
    ``S_i = sum_t ||g_t|| ||a_t||`` (:func:`~opake_torch.layerwise.ghost.ghost_norms` clips by ``||G_i|| + eps S_i``,
    which bounds ``||c_i G~_i||`` by the clipping bound, as the IEEE sum's contributions are)."""
    if precision == "ieee":
        return 0.0
    bits = _FACTOR_BITS.get(precision, _FACTOR_BITS["bf16"])
    return (1 + 2.0**-bits) ** 2 * (1 + 2.0**-24) - 1


def bf16_factors(call: Call) -> bool:
    """Whether a linear or Conv1D call ran in bfloat16 (its output gradient is bf16: bf16 weights or bf16 autocast),
    so that its weight gradient is the product of bf16 factors, the output gradient and the bf16-rounded input."""
    return call.kind in ("linear", "conv1d") and call.grad is not None and call.grad.dtype == torch.bfloat16


def input_factor(call: Call, m: int) -> torch.Tensor:
    """``[m, T, in]``: the input the call's weight gradient multiplies (rounded to bf16 where the layer ran in bf16,
    as its forward rounded it)."""
    x = by_example(call.inputs, m)
    return cast(x, torch.bfloat16) if bf16_factors(call) else x


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 ``[..., d]``) as three bfloat16 parts concatenated on the last dimension (``[..., 3d]``) whose
    sum in exact arithmetic is ``x``: each part rounds what the previous ones left to 8 significand bits, and the
    remainders shrink by ``2^-8`` at least, so three parts hold a 24-bit float32 significand. Exact for ``|x| >=
    2^-110``; below, the last part loses the bits under ``2^-133`` (bf16's smallest subnormal). Products with a bf16
    factor accumulate in float32 as ``x``'s would."""
    high = x.to(torch.bfloat16)
    rest = x - high.float()
    mid = rest.to(torch.bfloat16)
    low = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([high, mid, low], dim=-1)


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices with a float32 result: on tensor cores with float32 accumulation on CUDA
    (``out_dtype``, torch >= 2.8), as float32 matmuls elsewhere or where that overload is missing (the same sums of
    exact products)."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError, TypeError):
            pass
    return torch.mm(a.float(), b.float())


def add_bf16_product(call: Call, drop: torch.Tensor, scale: torch.Tensor, total: torch.Tensor) -> None:
    """``total += sum_i scale_i G_i`` for a layer with bf16 factors (float32 ``total``): the float32 scaled factor
    ``fl32(scale_i g_it)`` in three exact bf16 parts times the bf16 input, one matmul, then the parts' three
    products added, smallest first. ``drop`` (``[m, 1, 1]``) masks the examples with scale 0. So the contribution of
    every example is the float32 one: three bf16 tensor-core products in place of one float32 matmul without tensor
    cores (:func:`bf16_parts`)."""
    m, out = scale.shape[0], call.grad.shape[-1]
    g = torch.where(drop, 0.0, cast(by_example(call.grad, m), torch.float32) * scale)
    parts = bf16_parts(g).reshape(-1, 3 * out)
    a = torch.where(drop, 0.0, input_factor(call, m)).reshape(m * g.shape[1], -1)
    if call.kind == "linear":
        high, mid, low = _mm_float32(parts.T, a).view(3, out, -1).unbind(0)
    else:  # conv1d: weight [in, out]
        high, mid, low = _mm_float32(a.T, parts).view(-1, 3, out).unbind(1)
    total.add_(high + (mid + low))
