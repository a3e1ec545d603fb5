"""The precision of the engine's products: the run's float32 matmul setting and the margin the norms carry for it,
the rounding bounds of the product norm route and of the one-pass bf16 sum, and the layers that ran in bfloat16,
whose factors are rounded as their forward rounded them and whose clipped sums split the scaled factor into two exact
bf16 parts (or take one pass, :func:`product_sum_error`).

Reduced-precision float32 matmuls (TF32, bf16) round the factors of a ghost layer's scaled sum; :func:`product_error`
bounds that rounding, and the ghost norms of those layers carry it as a margin
(:func:`~opake_torch.layerwise.ghost.ghost_norms`), so that every example's contribution stays within the clipping
bound. A linear layer that ran in bfloat16 (bf16 weights or bf16 autocast: its output gradient is bf16) has the
weight gradient ``g^T bf16(a)``, a product of bf16 factors: its norms are taken from the bf16-rounded input
(:func:`input_factor`) and its clipped sum runs on bf16 tensor cores with float32 accumulation
(:func:`add_bf16_product`). The engine keeps such a layer's input rounded from the start (:class:`Bf16Inputs`): half
the bytes of a float32 input, and the same factor. The product norm route forms each example's gradient by a matmul
and bounds its rounding (:func:`product_norm_error`, :func:`summation_error`, :func:`norm_rounding`).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from opake_torch.layerwise.calls import Call, by_example, cast, same_tensor
from opake_torch.layerwise.uses import DEPTHWISE

__all__ = [
    "Bf16Inputs",
    "add_bf16_product",
    "bf16_factors",
    "bf16_floor",
    "bf16_scaled_parts",
    "bmm_accumulated",
    "float32_matmuls",
    "input_factor",
    "matmul_precision",
    "norm_rounding",
    "product_error",
    "product_norm_error",
    "product_sum_error",
    "summation_error",
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
    as its forward rounded it; the hooks keep such an input rounded already, :class:`Bf16Inputs`)."""
    x = by_example(call.inputs, m)
    return cast(x, torch.bfloat16) if bf16_factors(call) else x


_MATMUL_KINDS = ("linear", "conv1d", "experts", DEPTHWISE)  # weight gradient: output gradient times input


class Bf16Inputs:
    """The inputs the engine keeps of the layer calls that ran in bfloat16, rounded to bf16 when they are recorded.

    A call of a linear, Conv1D, experts or depthwise-conv layer whose output is bf16 (bf16 weights or bf16
    autocast) multiplied its input rounded to bf16: its weight gradient is ``g^T bf16(a)``, and its norms and sums
    read that factor (:func:`input_factor`, :func:`~opake_torch.layerwise.uses.add_conv_gradient`). Under autocast
    its input is often float32 (a normalized residual stream): kept rounded, it holds 2 bytes a number instead of 4,
    and the factor is the same (rounding is idempotent). The layers whose gradient reads the float32 input (the
    norms) keep it as it is.

    The calls that read one tensor (q, k and v; gate and up) keep one rounded copy: the last copy made serves the
    next call whose input is that tensor, unchanged (same storage, layout and version, its source still alive).
    """

    def __init__(self) -> None:
        self._source: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._rounded: torch.Tensor | None = None

    def keep(self, kind: str, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """What a call of ``kind`` with input ``x`` and output ``output`` keeps of ``x`` (detached): rounded to bf16
        where the call ran in bfloat16 (its output, hence its output gradient, is bf16) on a float32 input, else
        ``x`` itself."""
        if kind not in _MATMUL_KINDS or output.dtype != torch.bfloat16 or x.dtype != torch.float32:
            return x.detach()
        source = self._source() if self._source is not None else None
        if source is None or self._version != x._version or same_tensor(source) != same_tensor(x):
            self._rounded = None  # the previous copy lives on only in the calls that keep it
            self._source, self._version = weakref.ref(x), x._version
            self._rounded = x.detach().to(torch.bfloat16)
        return self._rounded

    def release(self) -> None:
        """Drop the last copy (the calls that keep it still do)."""
        self._source = self._rounded = None


def summation_error(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma_n = n u / (1 - n u)``: a bound on the relative error of a sum of ``n`` products accumulated in ``dtype``
    in any order (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, lemma 3.1 and section 3.1):
    ``|fl(sum_k x_k) - sum_k x_k| <= gamma_n sum_k |x_k|``. ``u`` is ``dtype``'s machine epsilon (``2^-23`` for
    float32), twice the unit roundoff, so that accumulators that truncate (tensor cores, Fasi et al. 2021, "Numerical
    behavior of NVIDIA tensor cores") are covered too. Infinite where ``n u >= 1``."""
    nu = n * torch.finfo(dtype).eps
    return nu / (1 - nu) if nu < 1 else math.inf


def product_norm_error(positions: int, *, factors: torch.dtype, precision: str) -> float:
    """``gamma``: the relative error, entry by entry, of one example's weight gradient ``G~_i = sum_t g_t a_t^T``
    formed by a matmul over its ``positions`` (``n = T``; grouped: ``k T``) with factors of dtype ``factors``:
    ``|G~_i - G_i| <= gamma sum_t |g_t| |a_t|^T``, so ``||G~_i - G_i||_F <= gamma S_i``, ``S_i = sum_t ||g_t||
    ||a_t||``, and ``||G_i|| <= ||G~_i|| + gamma S_i``.

    bf16 factors: exact products (16 significand bits) accumulated in float32, ``gamma = gamma_n`` whatever the float32
    matmul setting (a bf16 number is a TF32 one). float32 factors: products at the run's ``precision``, each with
    relative error ``eps`` (:func:`product_error`; IEEE: one rounding, ``2^-23``), then the float32 sum:
    ``gamma = (1 + eps)(1 + gamma_n) - 1``. float64 factors: the same in float64."""
    accumulation = torch.float64 if factors == torch.float64 else torch.float32
    gamma = summation_error(positions, accumulation)
    if factors == torch.bfloat16:
        return gamma
    eps = torch.finfo(accumulation).eps if factors == torch.float64 or precision == "ieee" else product_error(precision)
    return (1 + eps) * (1 + gamma) - 1


def product_sum_error(positions: int) -> float:
    """``eps``: the relative error, entry by entry, of one example's contribution ``fl(c_i G~_i)`` to a bf16 layer's
    clipped sum formed in one pass (:func:`~opake_torch.patches.kernels.product_sums.clipped_product_sum`): ``G~_i``
    accumulates the exact products of ``positions`` bf16 rows in float32 (``gamma_n``, :func:`summation_error`), and
    the product by ``c_i`` rounds once (``2^-24``): ``|fl(c_i G~_i) - c_i G_i| <= c_i eps sum_t |g_t| |a_t|^T`` with
    ``eps = (1 + gamma_n)(1 + 2^-24) - 1``, so the contribution's norm is at most ``c_i (||G_i|| + eps S_i)``."""
    return (1 + summation_error(positions)) * (1 + 2.0**-24) - 1


def norm_rounding(width: int, dtype: torch.dtype) -> float:
    """``f >= 1`` with ``||x|| <= f r~`` for the 2-norm ``r~`` of ``width`` numbers ``x`` of ``dtype`` that
    ``torch.linalg.vector_norm`` returns in ``dtype``: the sum of squares, formed in any order, has at most ``width``
    roundings on any path (a square, then the additions), so it is at least ``(1 - u)^width`` of the exact one, and the
    square root loses one more: ``f = (1 - u)^-(width / 2 + 1)`` (``u``: machine epsilon, as in
    :func:`summation_error`)."""
    return (1 - torch.finfo(dtype).eps) ** -(width / 2 + 1)


def bmm_accumulated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched (``[c, n, k] @ [c, k, p]``), accumulated in float32 (float64 for float64 factors): bf16
    factors on tensor cores with a float32 result on CUDA (``out_dtype``, torch >= 2.8), as float32 matmuls elsewhere
    (the same sums of exact products); float32 factors at the run's matmul precision."""
    if a.dtype != torch.bfloat16:
        return torch.bmm(a, b)
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError, TypeError):
            pass
    return torch.bmm(a.float(), b.float())


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices with a float32 result (:func:`bmm_accumulated` of one pair)."""
    return bmm_accumulated(a[None], b[None])[0]


def bf16_floor(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x >= 0`` rounded down to a bf16 value (still float32): its 16 low bits cleared, which for a
    non-negative float rounds toward zero. ``0 <= bf16_floor(x) <= x``, within ``2^-7`` of ``x`` relatively (above
    float32's subnormals)."""
    return _truncate_(x.clone())


def _truncate_(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` (contiguous) truncated toward zero to bf16 values, in place: its 16 low bits cleared. Integer
    arithmetic, so a compiler cannot fold it away as it may fold a round trip through bf16."""
    x.view(torch.int32).bitwise_and_(-65536)
    return x


def bf16_scaled_parts(g: torch.Tensor, scale: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``[..., 2 d]``: two bf16 parts, concatenated on the last dimension, whose exact sum is ``c' g`` for bf16 ``g``
    ``[m, T, d]`` and ``c' = bf16_floor(scale)`` (``scale`` ``[m, 1, 1]`` float32, ``>= 0``); zero where ``drop``.

    Exactness: ``c'`` and ``g`` hold 8 significand bits each, so ``p = c' g`` holds at most 16 and is exact in float32:
    a multiple of ``2^(L - 15)`` for ``|p|`` in ``[2^L, 2^(L+1))``. Its truncation ``h`` to bf16 is a multiple of
    ``2^(L - 7)`` with ``|p - h| < 2^(L - 7)``, so ``p - h`` is ``k 2^(L - 15)`` with ``|k| < 2^8``: at most 8
    significand bits, a bf16 number, and ``h + (p - h) = p`` exactly. The limit is bf16's smallest subnormal: the low
    part is exact while ``2^(L - 15) >= 2^-133``, which holds for ``|p| >= 2^-118``; below, it loses the bits under
    ``2^-133``. Every value is formed exactly in float32 and converted exactly (no rounding to bf16 happens), so a
    compiler that skips intermediate roundings forms the same parts. Temporaries: the float32 ``p`` (overwritten by
    ``h``, then by ``p - h``) and the parts, 8 bytes a number."""
    d = g.shape[-1]
    factor = bf16_floor(scale)
    rest = _truncate_((g * factor).masked_fill_(drop, 0.0))  # h: bf16 times float32 is float32, exact, truncated
    parts = torch.empty(*rest.shape[:-1], 2 * d, dtype=torch.bfloat16, device=rest.device)
    parts[..., :d].copy_(rest)
    parts[..., d:].copy_(rest.neg_().addcmul_(g, factor).masked_fill_(drop, 0.0))  # p - h, exact
    return parts


def add_bf16_product(call: Call, drop: torch.Tensor, scale: torch.Tensor, total: torch.Tensor) -> None:
    """``total += sum_i c'_i G_i`` for a layer with bf16 factors (float32 ``total``), ``c'_i`` the clip factor
    ``scale_i`` rounded down to a bf16 value (:func:`bf16_floor`): ``c'_i g_it`` in two exact bf16 parts
    (:func:`bf16_scaled_parts`) times the bf16 input, one matmul on tensor cores with float32 accumulation, then the
    two parts' products added. ``drop`` (``[m, 1, 1]``) masks the examples with scale 0.

    Rounding the factor down, never up, keeps every contribution within the bound: ``c'_i <= c_i``, so
    ``||c'_i G_i|| <= ||c_i G_i|| <= C``. An unclipped example (scale 1, a bf16 value) is unchanged; a clipped one
    contributes ``c'_i G_i``, at most ``2^-7`` (relatively) under the bound ``c_i G_i`` reaches. The norms reported
    stay those of ``G_i``. Temporaries: the scaled factor (4 bytes a number of the output gradient) and its parts (4),
    then the ``[2, out, in]`` products."""
    m, out = scale.shape[0], call.grad.shape[-1]
    g = by_example(call.grad, m)
    parts = bf16_scaled_parts(g, scale, drop).reshape(-1, 2 * out)
    a = input_factor(call, m).masked_fill(drop, 0.0).reshape(m * g.shape[1], -1)
    if call.kind == "linear":
        high, low = _mm_float32(parts.T, a).view(2, out, -1).unbind(0)
    else:  # conv1d: weight [in, out]
        high, low = _mm_float32(a.T, parts).view(-1, 2, out).unbind(1)
    total.add_(low.add_(high))
