"""The precision of the engine's products: the run's float32 matmul setting and the margin the norms carry for it,
and the layers that ran in bfloat16, whose factors are rounded as their forward rounded them and whose clipped sums
split the scaled factor into exact bf16 parts.

Reduced-precision float32 matmuls (TF32, bf16) round the factors of a ghost layer's scaled sum; :func:`product_error`
bounds that rounding, and the ghost norms of those layers carry it as a margin
(:func:`~opake_torch.layerwise.ghost.ghost_norms`), so that every example's contribution stays within the clipping
bound. A linear layer that ran in bfloat16 (bf16 weights or bf16 autocast: its output gradient is bf16) has the
weight gradient ``g^T bf16(a)``, a product of bf16 factors: its norms are taken from the bf16-rounded input
(:func:`input_factor`) and its clipped sum runs on bf16 tensor cores with float32 accumulation
(:func:`add_bf16_product`). The engine keeps such a layer's input rounded from the start (:class:`Bf16Inputs`): half
the bytes of a float32 input, and the same factor.
"""

from __future__ import annotations

import contextlib
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


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 ``[..., d]``) as three bfloat16 parts concatenated on the last dimension (``[..., 3d]``) whose
    sum in exact arithmetic is ``x``: each part rounds what the previous ones left to 8 significand bits, and the
    remainders shrink by ``2^-8`` at least, so three parts hold a 24-bit float32 significand. Exact for ``|x| >=
    2^-110``; below, the last part loses the bits under ``2^-133`` (bf16's smallest subnormal). Products with a bf16
    factor accumulate in float32 as ``x``'s would."""
    return _split(x.clone())


def _split(rest: torch.Tensor) -> torch.Tensor:
    """:func:`bf16_parts` of ``rest``, which it overwrites with the remainders: the parts are written in place,
    so that no more than ``rest`` and the parts (10 bytes a number) are alive at once."""
    d = rest.shape[-1]
    parts = torch.empty(*rest.shape[:-1], 3 * d, dtype=torch.bfloat16, device=rest.device)
    for k in range(3):
        part = parts[..., k * d : (k + 1) * d]
        part.copy_(rest)
        if k < 2:
            rest.sub_(part)  # exact: the bf16 part is a float32 number
    return parts


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
    cores (:func:`bf16_parts`). Temporaries: the scaled factor (4 bytes a number of the output gradient) and its
    parts (6), then the ``[3, out, in]`` products."""
    m, out = scale.shape[0], call.grad.shape[-1]
    g = by_example(call.grad, m)
    parts = _split((g * scale).masked_fill_(drop, 0.0)).reshape(-1, 3 * out)  # bf16 times float32: float32
    a = torch.where(drop, 0.0, input_factor(call, m)).reshape(m * g.shape[1], -1)
    if call.kind == "linear":
        high, mid, low = _mm_float32(parts.T, a).view(3, out, -1).unbind(0)
    else:  # conv1d: weight [in, out]
        high, mid, low = _mm_float32(a.T, parts).view(-1, 3, out).unbind(1)
    total.add_(mid.add_(low).add_(high))
