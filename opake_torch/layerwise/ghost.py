"""Ghost norms and book-keeping sums: per-example norms of a layer's weight gradients from Gram matrices of its
inputs and output gradients, and its clipped sum as one matmul, without forming a per-example gradient.

Ghost norm (Li et al. 2022, arXiv 2110.05679, section 4.2): ``||G_i||^2 = sum_{t,s} (a_it . a_is)(g_it . g_is)``,
taken in float64 from two ``T x T`` Gram matrices; the clipped sum is then ``sum_i c_i G_i = g^T (c * a)``, one matmul,
the same as a non-private weight gradient ("book-keeping", Bu et al. 2023, arXiv 2210.00038); the scaled input
``c * a`` is formed once for the layers that read the same input (q, k and v). A weight takes this path where its
factors hold less memory than its instantiated gradients (:func:`prefers_ghost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from opake_torch.layerwise.calls import Call, by_example, cast, live_ids
from opake_torch.layerwise.experts import grouped_sums, padded
from opake_torch.layerwise.kinds import NORMS
from opake_torch.layerwise.precision import add_bf16_product, bf16_factors, float32_matmuls, input_factor
from opake_torch.layerwise.uses import DEPTHWISE

if TYPE_CHECKING:
    from opake_torch.layerwise.gradients import Gradients

__all__ = [
    "InputGrams",
    "ScaledInputs",
    "add_ghost",
    "frobenius",
    "ghost_names",
    "ghost_norms",
    "gram",
    "prefers_ghost",
]


def gram(x: torch.Tensor) -> torch.Tensor:
    """float64 ``[m, T, T]`` Gram matrices of ``x`` ``[m, T, d]``."""
    x = x.to(torch.float64)
    return torch.bmm(x, x.transpose(1, 2))


def frobenius(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[m]`` inner products ``sum_{t,s} a_its b_its`` of two ``[m, T, T]`` tensors, in one launch."""
    m = a.shape[0]
    return torch.bmm(a.reshape(m, 1, -1), b.reshape(m, -1, 1)).reshape(m)


def _add_product(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``total += x @ y``: the one matmul of a ghost linear or Conv1D layer's scaled sum."""
    total.addmm_(x, y)


class ScaledInputs:
    """The scaled input factor ``scale_i a_it`` (zero rows for dropped examples) of a ghost linear or Conv1D call,
    formed once for consecutive calls that read the same input with the same scales (q, k and v, in the forward's
    order). Only the last one is kept, so that the scaled copies of the layer inputs never pile up."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.key: tuple[Any, ...] | None = None
        self.value: torch.Tensor | None = None

    def __call__(self, call: Call, scale: torch.Tensor, drop: torch.Tensor, dtype: torch.dtype) -> Any:
        key = (call.input_key, dtype, scale.data_ptr())
        if key != self.key:
            self.key = self.value = None  # the previous copy is freed before the next is made
            self.key, self.value = key, torch.where(drop, 0.0, cast(by_example(call.inputs, self.m), dtype) * scale)
        return self.value


def add_ghost(call: Call, scale: torch.Tensor, drop: torch.Tensor, total: torch.Tensor, inputs: ScaledInputs) -> None:
    """``total += sum_i scale_i G_i`` from the call's input and output gradient; ``scale`` and ``drop`` (whether the
    scale is 0) are ``[m, 1, 1]``; an example with scale 0 adds exactly 0 whatever its values."""
    m = scale.shape[0]
    if bf16_factors(call) and total.dtype == torch.float32:
        add_bf16_product(call, drop, scale, total)
        return
    g = cast(by_example(call.grad, m), total.dtype)
    if call.kind in ("linear", "conv1d"):  # sum_i scale_i g_i^T a_i = g^T (scale a)
        a = inputs(call, scale, drop, total.dtype).reshape(-1, call.inputs.shape[-1])
        g = torch.where(drop, 0.0, g).reshape(-1, g.shape[-1])
        if call.kind == "linear":
            _add_product(total, g.T, a)
        else:  # conv1d: weight [in, out]
            _add_product(total, a.T, g)
        return
    g = torch.where(drop, 0.0, g * scale)
    if call.kind == "experts":  # their norms carry no margin for reduced-precision products
        a = torch.where(drop, 0.0, cast(by_example(call.inputs, m), total.dtype))
        with float32_matmuls(total.device, highest=True):
            _add_expert_products(call, g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]), total)
        return
    # embedding
    ids, live = live_ids(call, m)
    g = torch.where(live[..., None], g, 0.0)
    total.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]))


def ghost_norms(call: Call, m: int, input_gram: Callable[[Call], torch.Tensor], *, error: float = 0.0) -> torch.Tensor:
    """float64 ``[m]`` squared norms of the call's per-example weight gradients, from Gram matrices (the input's
    from ``input_gram``, which shares one among the calls that read the same tensor). ``error``: the relative error
    of the products of the layer's float32 scaled sum (:func:`~opake_torch.layerwise.precision.product_error`): a
    linear or Conv1D layer with float32 factors then reports ``(||G_i|| + error S_i)^2``,
    ``S_i = sum_t ||g_t|| ||a_t||``, the bound of the norm of the gradient its sum forms."""
    g = by_example(call.grad, m)
    if call.kind == "embedding":
        ids, live = live_ids(call, m)
        same = (ids[:, :, None] == ids[:, None, :]) & live[:, :, None] & live[:, None, :]
        return frobenius(same.to(torch.float64), gram(g))
    if call.kind == "experts":
        return _expert_norms(call, m)
    squares = frobenius(input_gram(call), gram(g))
    if not error or bf16_factors(call) or g.dtype != torch.float32:  # bf16 factors: exact products (three parts)
        return squares
    row_norms = lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)  # noqa: E731
    spread = (row_norms(g) * row_norms(by_example(call.inputs, m))).sum(dim=1)
    return (squares.sqrt() + error * spread).square()


class InputGrams:
    """The float64 Gram matrices of layer inputs, each formed once for the calls that read the same tensor and kept
    until the last of those calls has been recorded (``readers`` counts them as the forward registers them)."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.readers: dict[tuple[Any, ...], int] = {}
        self.grams: dict[tuple[Any, ...], tuple[bool, torch.Tensor]] = {}  # key -> (bf16-rounded, Gram)

    def read_by(self, call: Call) -> None:
        self.readers[call.input_key] = self.readers.get(call.input_key, 0) + 1

    def __call__(self, call: Call) -> torch.Tensor:
        rounded = bf16_factors(call)
        rounded_then, matrix = self.grams.get(call.input_key, (rounded, None))
        if matrix is None or rounded_then != rounded:
            matrix = gram(input_factor(call, self.m))
            if self.readers.get(call.input_key, 0) > 1:
                self.grams[call.input_key] = (rounded, matrix)
        return matrix

    def done(self, call: Call) -> None:
        left = self.readers.get(call.input_key, 0) - 1
        self.readers[call.input_key] = left
        if left <= 0:
            self.grams.pop(call.input_key, None)


def _expert_norms(call: Call, m: int) -> torch.Tensor:
    """float64 ``[m]`` squared norms of an experts call's per-example gradients. Rows routed to different experts
    meet different weights, so they have no cross term: the sum over the (expert, example) pairs of the Frobenius
    products of their rows' Gram matrices, the rows sorted by pair and padded in runs of similar widths
    (:func:`~opake_torch.layerwise.experts.padded`): about ``(T k / E)^2`` entries per pair instead of the
    ``(T k)^2`` of all an example's rows, in a few batched launches whatever ``E``."""
    routing = call.routing
    x, g = (t.index_select(0, routing.order) for t in (call.inputs, call.grad))  # [m R, in], [m R, out]
    total = torch.zeros(m, dtype=torch.float64, device=x.device)
    for pairs, _, (xb, gb) in padded((x, g), routing.pair_ends, routing.pair_sizes):
        total.index_add_(0, pairs % m, frobenius(gram(xb), gram(gb)))  # pair e m + i
    return total


def _add_expert_products(call: Call, g: torch.Tensor, a: torch.Tensor, total: torch.Tensor) -> None:
    """``total[e] += g_e^T a_e`` (``a_e^T g_e`` transposed) over the rows ``g`` ``[S, out]``, ``a`` ``[S, in]``
    routed to each expert ``e``: the rows sorted by expert, one grouped product."""
    routing = call.routing
    g, a = g.index_select(0, routing.order), a.index_select(0, routing.order)
    left, right = (a, g) if call.transposed else (g, a)
    for experts, product in grouped_sums(left, right, routing):
        total.add_(product) if experts is None else total.index_add_(0, experts, product)


def prefers_ghost(call: Call, shape: torch.Size, m: int, advantage: float) -> bool:
    """Ghost norm when its Gram factors, ``T (in + out)`` numbers per example, times ``advantage`` hold less than
    instantiating ``[m, *shape]`` (experts: than the ``E * in * out`` of all experts; Li et al. 2022); see
    :class:`~opake_torch.layerwise.LayerwiseGradients`'s ``ghost_advantage``."""
    if call.kind == "embedding":
        return True
    if call.kind == DEPTHWISE:  # C K numbers per example, against T x T Gram matrices per channel
        return False
    if call.kind == "experts":  # [E, out, in]: one example's T rows against E instantiated experts
        return call.positions * sum(shape[1:]) * advantage < math.prod(shape)
    return call.positions * sum(shape) * advantage < math.prod(shape)


def ghost_names(calls: list[Call], out: Gradients, advantage: float) -> dict[str, tuple[Call, torch.Tensor]]:
    """The weights whose norms come from Gram matrices (zero until the backward reaches their call): used by one
    call, of a linear, Conv1D or embedding layer, where that costs less than instantiating them
    (:func:`prefers_ghost` with ``advantage``)."""
    uses: dict[str, int] = {}
    for call in calls:
        for name in call.names.values():
            uses[name] = uses.get(name, 0) + 1
    zeros = torch.zeros(out.m, dtype=torch.float64, device=out.device)
    return {
        name: (call, zeros)
        for call in calls
        if call.kind not in NORMS
        if (name := call.names.get("weight")) is not None and uses[name] == 1
        if prefers_ghost(call, out.shapes[name], out.m, advantage)
    }
