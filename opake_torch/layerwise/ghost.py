"""Ghost norms and book-keeping sums: per-example norms of a layer's weight gradients from its inputs and output
gradients, and its clipped sum as one matmul, without keeping a per-example gradient.

A linear or Conv1D call takes its norms by one of two routes (:data:`NORM_ROUTES`), chosen per call by their cost
(:func:`norm_route`):

* ``"gram"``, the ghost norm (Li et al. 2022, arXiv 2110.05679, section 4.2):
  ``||G_i||^2 = sum_{t,s} (a_it . a_is)(g_it . g_is)`` in float64 from two ``T x T`` Gram matrices, ``2 T^2 (in +
  out)`` float64 flops per example, which the chunk's calls form together after the backward, a batch of calls with
  inputs of one shape at a time (:func:`gram_squares`);
* ``"product"``: the example's gradient ``G~_i = sum_t g_t a_t^T`` formed at the matmul rate for its norm only
  (``2 T in out`` flops: bf16 factors on tensor cores with float32 accumulation), a few examples at a time and freed
  at once, its norm plus the rounding margin ``gamma S_i`` (:func:`~opake_torch.layerwise.precision.product_norm_error`,
  ``S_i = sum_t ||g_t|| ||a_t||``), so the reported norm bounds ``||G_i||`` from above (:func:`product_norms`).

The clipped sum is then ``sum_i c_i G_i = g^T (c * a)``, one matmul, the same as a non-private weight gradient
("book-keeping", Bu et al. 2023, arXiv 2210.00038), whichever route gave the norms; the scaled input ``c * a`` is
formed once for the layers that read the same input (q, k and v). A layer that ran in bf16 adds two exact bf16
parts, or, where the Triton kernel runs, takes one pass whose rounding its norms carry (:func:`one_pass_sum`). A
weight takes this path where its factors hold less memory than its instantiated gradients (:func:`prefers_ghost`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from opake_torch.layerwise.calls import Call, by_example, cast, live_ids
from opake_torch.layerwise.experts import grouped_sums, padded
from opake_torch.layerwise.kinds import NORMS
from opake_torch.layerwise.precision import (
    add_bf16_product,
    bf16_factors,
    bmm_accumulated,
    float32_matmuls,
    input_factor,
    matmul_precision,
    norm_rounding,
    product_norm_error,
    product_sum_error,
)
from opake_torch.layerwise.uses import DEPTHWISE
from opake_torch.patches.kernels.expert_products import (
    expert_product_sum,
    expert_products_supported,
    pair_norm_rounding,
    pair_squared_norms,
)
from opake_torch.patches.kernels.product_norms import (
    product_kernel_runs,
    product_norm_rounding,
    product_squared_norms,
    product_squared_norms_supported,
)
from opake_torch.patches.kernels.product_sums import clipped_product_sum, clipped_product_sum_supported

if TYPE_CHECKING:
    from opake_torch.layerwise.gradients import Gradients

__all__ = [
    "GRAM_BATCH_BYTES",
    "GRAM_COPY_BYTES",
    "NORM_ROUTES",
    "PRODUCT_CAP_BYTES",
    "Bound",
    "GramSquares",
    "InputGrams",
    "ScaledInputs",
    "add_ghost",
    "finish",
    "finished",
    "frobenius",
    "ghost_names",
    "ghost_norms",
    "gram",
    "gram_squares",
    "norm_route",
    "one_pass_sum",
    "prefers_ghost",
    "product_norms",
    "route_costs",
    "tied_names",
    "tied_norms",
]

NORM_ROUTES = ("auto", "gram", "product")
"""How a ghost linear or Conv1D call takes its per-example norms: ``"auto"`` (:func:`norm_route`), or one route
forced."""

GRAM_COPY_BYTES = 256 * 2**20
"""The most bytes of float64 copy :func:`gram` forms at once: a wide factor (a language-model head's output gradient
over a vocabulary of 50k, 3.3 GB in float64 for 16 x 512 positions) is taken a few examples at a time, so that its
copy stays below what the kept factor itself holds."""

GRAM_BATCH_BYTES = 256 * 2**20
"""The most bytes of float64 factor copies and Gram matrices :func:`gram_squares` forms for one batch of calls (one
call at least)."""

PRODUCT_CAP_BYTES = 64 * 2**20
"""The product route forms ``[m_c, out, in]`` accumulated gradients at a time, ``m_c`` examples chosen so that they hold
at most the larger of this and what the call's two factors hold (:func:`product_norms`)."""

# Matmul rates relative to the device's fastest (CUDA: bf16 tensor cores; CPU: float32), per dtype of the
# accumulated factors and float32 matmul precision; CUDA fp64 and IEEE fp32 ~1/15 of bf16 (H100: 67 against 990
# TFLOP/s dense); TF32 counts as IEEE: on an H100 the product route of float32 factors under TF32 ran at about 40
# TFLOP/s, formed or through the norm kernel, and lost to the Gram route on every GPT-2 and BERT shape measured
# (benchmarks/product_norms_bench.py, 2026-12-07); CPU fp64 ~1/2 of fp32. Bytes: the flops one byte of memory
# traffic costs (H100: 990 TFLOP/s against 3.35 TB/s; a CPU: about 10).
_RATES = {
    "cuda": {"bf16": 1.0, "ieee": 1 / 15, "tf32": 1 / 15, "float64": 1 / 15},
    "cpu": {"bf16": 1.0, "ieee": 1.0, "tf32": 1.0, "float64": 1 / 2},
}
_FLOPS_PER_BYTE = {"cuda": 300.0, "cpu": 10.0}
_FLOAT32_SAFE = torch.finfo(torch.float32).max / 2  # a bound on the partial sums of a float32 accumulation


def gram(x: torch.Tensor) -> torch.Tensor:
    """float64 ``[m, T, T]`` Gram matrices of ``x`` ``[m, T, d]``, its float64 copy formed at most
    :data:`GRAM_COPY_BYTES` at a time (one example at least; a single launch below that)."""
    m, positions = x.shape[0], x.shape[1]
    step = max(1, GRAM_COPY_BYTES // max(1, 8 * math.prod(x.shape[1:])))  # (no indexing: no operator dispatched)
    if x.dtype == torch.float64 or step >= m:
        x = x.to(torch.float64)
        return torch.bmm(x, x.transpose(1, 2))
    out = torch.empty(m, positions, positions, dtype=torch.float64, device=x.device)
    for start in range(0, m, step):
        part = x[start : start + step].to(torch.float64)
        torch.bmm(part, part.transpose(1, 2), out=out[start : start + step])
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class GramSquares:
    """A linear or Conv1D call's squared norms by the Gram route, ``sum_{s,t} (a_s . a_t)(g_s . g_t)``, left to
    :func:`gram_squares`, so that the chunk's calls form their Gram matrices a batch at a time: a few operators for
    each batch of calls whose inputs have one shape, where each call would dispatch about ten. A :class:`Bound` holds
    it as both its ``squares`` and its ``spread`` until then."""

    call: Call


def _deferrable(call: Call, m: int) -> bool:
    """Whether the Gram-route squares of a linear or Conv1D call may wait for :func:`gram_squares`: its float64
    factor copies fit :data:`GRAM_COPY_BYTES` (a wider factor, a language-model head's output gradient, forms its Gram
    matrix at once, a few examples at a time: :func:`gram`)."""
    rows = call.inputs.numel() // max(1, call.inputs.shape[-1])  # m T
    return 8 * rows * max(call.inputs.shape[-1], call.grad.shape[-1]) <= GRAM_COPY_BYTES


def gram_squares(
    pending: Sequence[GramSquares], wanted: Sequence[bool], m: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """For each of ``pending``, float64 ``[m]`` squared norms (the sums :func:`ghost_norms` would form call by call)
    and, where a call of its output shape wants one (``wanted``, a margin's; else None), spreads ``sum_t
    sqrt(||g_t||^2 ||a_t||^2)`` from the Gram matrices' diagonals (:func:`_gram_spread_rounding` bounds their
    rounding): the calls whose input factors have one shape and dtype taken in batches (in their order,
    at most :data:`GRAM_BATCH_BYTES` of copies and Gram matrices each); a batch stacks its distinct inputs into one
    float64 copy and one batched matmul, its output gradients of each shape likewise, then takes a few operators for
    each output shape."""
    factors = [(input_factor(p.call, m), by_example(p.call.grad, m)) for p in pending]
    keys = [(p.call.input_key, bf16_factors(p.call)) for p in pending]
    rows: list[Any] = [None] * len(pending)
    by_input: dict[tuple[Any, ...], list[int]] = {}
    for k, (a, _) in enumerate(factors):
        by_input.setdefault((tuple(a.shape), a.dtype), []).append(k)
    for members in by_input.values():
        batch: list[int] = []
        size = 0
        for k in members:
            a, g = factors[k]
            need = 8 * m * a.shape[1] * (a.shape[-1] + g.shape[-1] + 3 * a.shape[1])  # copies, two Grams, a product
            if batch and size + need > GRAM_BATCH_BYTES:
                _batch_squares(rows, batch, factors, keys, wanted)
                batch, size = [], 0
            batch.append(k)
            size += need
        _batch_squares(rows, batch, factors, keys, wanted)
    return rows


def _batch_squares(
    rows: list[Any],
    batch: list[int],
    factors: list[tuple[torch.Tensor, torch.Tensor]],
    keys: list[tuple[Any, ...]],
    wanted: Sequence[bool],
) -> None:
    """Sets ``rows[k]`` (squares, spread or None) for ``k`` in ``batch`` (calls whose input factors have one shape;
    ``factors[k]``: input and output gradient ``[m, T, d]``, ``keys[k]``: the input's identity, ``wanted[k]``: whether
    its spread is read): one Gram matmul for their distinct inputs, one for their output gradients of each shape."""
    first: dict[tuple[Any, ...], int] = {}
    inputs, slot = [], {}
    for k in batch:
        if keys[k] not in first:
            first[keys[k]] = len(inputs)
            inputs.append(factors[k][0])
        slot[k] = first[keys[k]]
    input_grams = _stacked_grams(inputs)  # [n_in, m, T, T]
    by_output: dict[tuple[Any, ...], list[int]] = {}
    for k in batch:
        g = factors[k][1]
        by_output.setdefault((tuple(g.shape), g.dtype), []).append(k)
    for members in by_output.values():
        output_grams = _stacked_grams([factors[k][1] for k in members])  # [n, m, T, T]
        index = [slot[k] for k in members]
        if len(set(index)) == 1:  # one input (q, k and v): broadcast, no copy
            matched = input_grams[index[0]]
        else:  # stacked views: no index tensor copied from the host (a CUDA graph may capture this)
            matched = torch.stack([input_grams[i] for i in index])
        spreads: Sequence[Any] = [None] * len(members)
        if any(wanted[k] for k in members):  # from the diagonals, before the Gram matrices are overwritten below
            diagonals = output_grams.diagonal(dim1=2, dim2=3) * matched.diagonal(dim1=-2, dim2=-1)  # [n, m, T]
            spreads = diagonals.sqrt_().sum(dim=2).unbind(0)
        squares = output_grams.mul_(matched).sum(dim=(2, 3)).unbind(0)
        for k, row, spread in zip(members, squares, spreads, strict=True):
            rows[k] = (row, spread)


def _gram_spread_rounding(call: Call, m: int) -> float:
    """``f >= 1`` with ``S_i <= f s~_i`` for the spreads :func:`gram_squares` returns: each ``||g_t||^2`` a diagonal
    entry of a float64 Gram matrix of float32, float16 or bf16 numbers (exact squares, then at most ``out`` roundings on
    any path of the matmul's sum, as for :func:`~opake_torch.layerwise.precision.norm_rounding`; ``||a_t||^2``
    likewise), their product and its square root (two roundings) and the float64 sum over the ``T`` positions."""
    eps = torch.finfo(torch.float64).eps
    out, width = call.grad.shape[-1], call.inputs.shape[-1]
    positions = by_example(call.inputs, m).shape[1]
    return norm_rounding(out, torch.float64) * norm_rounding(width, torch.float64) / (1 - eps) ** (positions + 2)


def _stacked_grams(xs: list[torch.Tensor]) -> torch.Tensor:
    """float64 ``[n, m, T, T]``: the Gram matrices of the ``n`` tensors ``xs`` (each ``[m, T, d]``, one shape), from
    one float64 copy of them all and one batched matmul."""
    m, positions, width = xs[0].shape
    if len(xs) == 1:
        flat = cast(xs[0], torch.float64)
    else:
        copy = torch.empty(len(xs), m, positions, width, dtype=torch.float64, device=xs[0].device)
        flat = torch.stack(xs, out=copy).view(-1, positions, width)
    return torch.bmm(flat, flat.transpose(1, 2)).view(len(xs), m, positions, positions)


def frobenius(a: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``[m]`` inner products ``sum_{t,s} a_its own_its`` of two ``[m, T, T]`` tensors. ``own``, a temporary of the
    caller's, is overwritten with the products: an elementwise product and a sum, bound by memory and with no other
    temporary (as a batched float64 matrix-vector product, the same sums ran at about a fifteenth of an H100's
    memory rate: 23.8 ms a step of the 1.1B Llama)."""
    return own.mul_(a).sum(dim=(1, 2))


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
            self.key, self.value = key, (cast(by_example(call.inputs, self.m), dtype) * scale).masked_fill_(drop, 0.0)
        return self.value


def one_pass_sum(call: Call, total: torch.dtype) -> bool:
    """Whether the clipped sum of a call into a sum of dtype ``total`` may run in one pass
    (:func:`~opake_torch.patches.kernels.product_sums.clipped_product_sum`): a linear or Conv1D layer that ran in
    bf16, a float32 sum, a device where the kernel runs. The norms of such a call must carry that sum's margin
    (:func:`ghost_norms` with ``one_pass``) before :func:`add_ghost` may take it. An experts call likewise, where its
    norms and sum take the kernels of its sorted rows (:func:`_expert_kernels`)."""
    if call.kind == "experts":
        return total == torch.float32 and _expert_kernels(call)
    if not bf16_factors(call) or total != torch.float32:
        return False
    return product_kernel_runs(call.grad.device, torch.bfloat16, "ieee")


def add_ghost(
    call: Call,
    scale: torch.Tensor,
    drop: torch.Tensor,
    total: torch.Tensor,
    inputs: ScaledInputs,
    *,
    one_pass: bool = False,
) -> None:
    """``total += sum_i scale_i G_i`` from the call's input and output gradient; ``scale`` and ``drop`` (whether the
    scale is 0) are ``[m, 1, 1]``; an example with scale 0 adds exactly 0 whatever its values. A layer that ran in
    bf16 adds to a float32 sum in one pass where ``one_pass`` (its norms carry that pass's margin,
    :func:`one_pass_sum`) and the kernel takes the tensors, else in two exact bf16 parts
    (:func:`~opake_torch.layerwise.precision.add_bf16_product`). An experts call with ``one_pass`` adds its rows
    sorted by pair in one pass too (:func:`~opake_torch.patches.kernels.expert_products.expert_product_sum`)."""
    m = scale.shape[0]
    if call.kind == "experts" and one_pass:
        routing = call.routing
        g, a = (t.index_select(0, routing.order) for t in (call.grad, call.inputs))
        left, right = (a, g) if call.transposed else (g, a)
        if expert_products_supported(left, right, routing.pair_ends.shape[0], total):
            expert_product_sum(left, right, routing.pair_ends, scale.reshape(m), total)
            return
    if bf16_factors(call) and total.dtype == torch.float32:
        if one_pass:
            g, a = by_example(call.grad, m), input_factor(call, m)
            left, right = (g, a) if call.kind == "linear" else (a, g)  # conv1d: weight [in, out]
            if clipped_product_sum_supported(left, right, scale, total):
                clipped_product_sum(left, right, scale, total)
                return
        add_bf16_product(call, drop, scale, total)
        return
    g = cast(by_example(call.grad, m), total.dtype)
    if call.kind in ("linear", "conv1d"):  # sum_i scale_i g_i^T a_i = g^T (scale a)
        a = inputs(call, scale, drop, total.dtype).reshape(-1, call.inputs.shape[-1])
        g = g.masked_fill(drop, 0.0).reshape(-1, g.shape[-1])
        if call.kind == "linear":
            _add_product(total, g.T, a)
        else:  # conv1d: weight [in, out]
            _add_product(total, a.T, g)
        return
    g = (g * scale).masked_fill_(drop, 0.0)
    if call.kind == "experts":  # their norms carry no margin for reduced-precision products
        a = cast(by_example(call.inputs, m), total.dtype).masked_fill(drop, 0.0)
        with float32_matmuls(total.device, highest=True):
            _add_expert_products(call, g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]), total)
        return
    # embedding
    ids, live = live_ids(call, m)
    g = torch.where(live[..., None], g, 0.0)
    total.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Bound:
    """A call's per-example norm bounds, left unfinished so that the calls of a chunk finish theirs together
    (:func:`finish`: a few operators for each layer shape, where each call would take as many): ``N_i = rounding
    sqrt(squares_i) + (alpha + margin) S_i`` with ``S_i <= spread_i spread_rounding`` (the raw sums of
    :func:`_spread`), reported as ``N_i^2``, and infinite where ``S_i`` reaches ``limit``. ``alpha S_i`` bounds the
    rounding of the norm's own products (``rounding sqrt(squares_i) + alpha S_i >= ||G_i||``), ``margin S_i`` that of
    the layer's clipped sum (the stored contribution is within ``margin S_i`` of ``G_i``): a weight that a second call
    also writes (:func:`tied_norms`) adds the margin after the other call's part. ``squares`` and ``spread``: float64
    ``[m]`` (both a :class:`GramSquares` until the chunk forms them)."""

    squares: torch.Tensor | GramSquares
    rounding: float
    spread: torch.Tensor | GramSquares
    spread_rounding: float
    alpha: float
    limit: float = math.inf
    margin: float = 0.0


def finish(bounds: Sequence[Bound]) -> list[torch.Tensor]:
    """float64 ``[m]`` for each of ``bounds``: the squared norms it reports (:class:`Bound`; NaN stays NaN, so its
    example is dropped, as any non-finite one). The bounds with the same numbers (the calls of a layer shape) are
    finished together, a few operators for each such group, with no number copied to the device (a CUDA graph may
    capture it)."""
    groups: dict[tuple[float, float, float], list[int]] = {}
    for k, b in enumerate(bounds):
        groups.setdefault(
            (b.rounding, (b.alpha + b.margin) * b.spread_rounding, b.limit / b.spread_rounding), []
        ).append(k)
    rows: list[Any] = [None] * len(bounds)
    for (rounding, alpha, limit), members in groups.items():
        squares = torch.stack([bounds[k].squares for k in members])
        spread = torch.stack([bounds[k].spread for k in members])
        norms = squares.sqrt_().mul_(rounding).add_(spread, alpha=alpha)
        if limit < math.inf:
            norms.masked_fill_(spread >= limit, torch.inf)
        for k, row in zip(members, norms.square_().unbind(0), strict=True):
            rows[k] = row
    return rows


def finished(norms: torch.Tensor | Bound) -> torch.Tensor:
    """float64 ``[m]``: the squared norms :func:`ghost_norms` gave, a :class:`Bound` finished alone."""
    return finish([norms])[0] if isinstance(norms, Bound) else norms


def ghost_norms(
    call: Call,
    m: int,
    input_gram: Callable[[Call], torch.Tensor],
    *,
    error: float = 0.0,
    route: str = "gram",
    one_pass: bool = False,
    defer: bool = False,
) -> torch.Tensor | Bound | GramSquares:
    """float64 ``[m]`` squared norms of the call's per-example weight gradients, or a :class:`Bound` of them left to
    :func:`finish` (an upper bound by the product route, or with a rounding margin); ``route`` (:data:`NORM_ROUTES`)
    says how a linear or Conv1D call takes them: from Gram matrices (the input's from ``input_gram``, which shares one
    among the calls that read the same tensor), from the per-example products (:func:`product_norms`), or the cheaper
    (``"auto"``: :func:`norm_route`, with the share of a shared input Gram matrix that ``input_gram``, an
    :class:`InputGrams`, says the call pays). Embeddings and experts keep their own paths. ``error``: the relative
    error of the products of the layer's float32 scaled sum (:func:`~opake_torch.layerwise.precision.product_error`):
    a linear or Conv1D layer with float32 or float16 factors (which its sum casts to float32) then reports
    ``(||G_i|| + error S_i)^2``, ``S_i = sum_t ||g_t|| ||a_t||``, the bound of the norm of the gradient its sum forms.
    ``one_pass`` (:func:`one_pass_sum`): a layer that ran in bf16 reports ``(||G_i|| + eps S_i)^2`` with ``eps`` the
    one-pass sum's (:func:`~opake_torch.layerwise.precision.product_sum_error`), and an infinite norm (the example is
    dropped) where ``S_i`` could overflow that sum's float32 accumulation. ``defer`` (with an :class:`InputGrams`):
    the Gram route's squares are left as a :class:`GramSquares` for the chunk to form in batches (:func:`gram_squares`),
    in place of the tensor or of the :class:`Bound`'s ``squares`` and ``spread``."""
    g = by_example(call.grad, m)
    if call.kind == "embedding":
        ids, live = live_ids(call, m)
        same = (ids[:, :, None] == ids[:, None, :]) & live[:, :, None] & live[:, None, :]
        return frobenius(same.to(torch.float64), gram(g))
    if call.kind == "experts":
        return _expert_norms(call, m, one_pass=one_pass)
    # the sum's products run in float32 at the run's precision (float16 factors too, cast up): a margin for their
    # rounding; bf16 factors take the exact two-part sum, or one pass with its margin; float64 ones a float64 sum
    if bf16_factors(call):
        margin = product_sum_error(g.shape[1]) if one_pass else 0.0
    else:
        margin = error if g.dtype != torch.float64 else 0.0
    if route == "auto":
        share = input_gram.share(call) if isinstance(input_gram, InputGrams) else 1.0
        width, precision = call.inputs.shape[-1], matmul_precision(g.device)
        route = norm_route(g.shape[1], width, g.shape[-1], _factors(call), g.device, precision, share)
    shared = isinstance(input_gram, InputGrams)  # it keeps the input's row norms for the calls that read it
    if route == "product":
        bound = product_norms(call, m, matmul_precision(g.device), input_gram.rows(call) if shared else None)
    else:
        if defer and shared and _deferrable(call, m):  # squares and spread from the chunk's batched Gram matrices
            input_gram.defer(call)
            pending = GramSquares(call)
            if not margin:
                return pending
            bound = Bound(pending, 1.0, pending, _gram_spread_rounding(call, m), 0.0)
        else:
            squares = frobenius(input_gram(call), gram(g))
            if not margin:
                return squares
            input_rows = input_gram.rows(call) if shared else _row_norms(input_factor(call, m))
            spread, rounding = _spread(_row_norms(g), input_rows, g.shape[-1], call.inputs.shape[-1])
            bound = Bound(squares, 1.0, spread, rounding, 0.0)
    return _with_margin(bound, margin, one_pass=one_pass)


def _with_margin(bound: Bound, margin: float, *, one_pass: bool) -> Bound:
    """``bound`` carrying the clipped sum's margin; with ``one_pass`` also the limit of that sum's float32
    accumulation: every partial sum of a one-pass ``G~_i`` is at most ``(1 + eps) S_i``, and beyond float32 the
    example is dropped."""
    limit = _FLOAT32_SAFE / (1 + margin) if one_pass else math.inf
    return dataclasses.replace(bound, margin=margin, limit=limit)


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """``[m, T]``: the norms of the rows of ``x`` ``[m, T, d]``, taken in float32 (float64 for float64 ``x``) with
    no float64 copy of ``x``; :func:`_spread` accounts for their rounding."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


def _spread(g_rows: torch.Tensor, a_rows: torch.Tensor, out: int, width: int) -> tuple[torch.Tensor, float]:
    """``(sums, f)``: float64 ``[m]`` sums with ``S_i = sum_t ||g_t|| ||a_t|| <= f sums_i`` (``S_i`` bounds ``sum_t
    |g_t| |a_t|^T`` in Frobenius norm), from the ``[m, T]`` row norms (:func:`_row_norms`) of the output gradient
    (``out`` numbers a row) and of the input (``width``): their products formed in the rows' dtype and summed in
    float64. ``f`` covers the rounding of the two norms (:func:`~opake_torch.layerwise.precision.norm_rounding`), of
    the products (one rounding) and of the float64 sum and its scaling (``T + 1`` roundings)."""
    product = torch.float64 if torch.float64 in (g_rows.dtype, a_rows.dtype) else torch.float32
    rounding = norm_rounding(out, g_rows.dtype) * norm_rounding(width, a_rows.dtype) / (1 - torch.finfo(product).eps)
    rounding /= (1 - torch.finfo(torch.float64).eps) ** (g_rows.shape[-1] + 1)
    return (g_rows * a_rows).sum(dim=1, dtype=torch.float64), rounding


def _factors(call: Call) -> torch.dtype:
    """The dtype the product route multiplies a linear or Conv1D call's factors in: bf16 for a layer that ran in
    bfloat16, float64 for float64 ones, else float32 (a float16 layer's factors are float32 numbers)."""
    if bf16_factors(call):
        return torch.bfloat16
    return torch.float64 if torch.float64 in (call.grad.dtype, call.inputs.dtype) else torch.float32


def product_norms(call: Call, m: int, precision: str, input_rows: torch.Tensor | None = None) -> Bound:
    """The :class:`Bound` ``N_i >= ||G_i||`` of a linear or Conv1D call, from the example's gradient formed by a
    matmul (``precision``: the run's float32 matmul setting,
    :func:`~opake_torch.layerwise.precision.matmul_precision`), with ``S_i = sum_t ||g_t|| ||a_t||``.

    ``G~_i = g_i^T a_i`` (``[out, in]``, the input as the weight gradient reads it,
    :func:`~opake_torch.layerwise.precision.input_factor`) is accumulated in float32 (float64 for float64 factors):
    bf16 factors on tensor cores, float32 ones at ``precision``. Its rounding is bounded entry by entry, so
    ``||G_i|| <= ||G~_i|| + gamma S_i`` (:func:`~opake_torch.layerwise.precision.product_norm_error`, ``gamma``
    about ``T 2^-23``: a relative margin about ``gamma sqrt(T)``, 1e-3 at ``T = 512``, where cancelling positions can
    make ``||G~_i||`` smaller than ``||G_i||``). ``||G~_i||`` is the float64 norm of its rows' norms, each taken in
    the accumulation dtype with no float64 copy of the gradient and raised by its rounding bound
    (:func:`~opake_torch.layerwise.precision.norm_rounding`). A gradient whose float32 squares overflow (entries
    beyond about ``1e19``) reports an infinite norm: the example is dropped, as any non-finite one.

    On CUDA (compute capability 8 or more) with Triton, bf16 factors and float32 ones under TF32 take a kernel that
    forms each tile of ``G~_i`` in registers and keeps only its sum of squares
    (:func:`~opake_torch.patches.kernels.product_norms.product_squared_norms`, whose rounding bound replaces the row
    norms'): the same bound, with no gradient written to memory. Elsewhere the gradients are formed:
    ``m_c`` examples at a time, their ``[m_c, out, in]`` gradients holding at most the larger of
    :data:`PRODUCT_CAP_BYTES` and the bytes of the call's two factors, freed before the next ``m_c``, and their
    float32 row norms. ``S`` (:func:`_spread`) from the row norms of the factors, the input's given by ``input_rows``
    (:func:`_row_norms` of the input factor, shared by the calls that read it) or taken here."""
    factors = _factors(call)
    g, a = by_example(call.grad, m), input_factor(call, m)
    positions, width, out = g.shape[1], a.shape[-1], g.shape[-1]
    spread, spread_rounding = _spread(_row_norms(g), _row_norms(a) if input_rows is None else input_rows, out, width)
    accumulated = torch.float64 if factors == torch.float64 else torch.float32
    gamma = product_norm_error(positions, factors=factors, precision=precision)
    if product_kernel_runs(g.device, factors, precision):  # the gradients never stored
        g, a = cast(g, factors), cast(a, factors)
        if product_squared_norms_supported(g, a, precision):
            squares = product_squared_norms(g, a)
            return Bound(squares, product_norm_rounding(out, width), spread, spread_rounding, gamma)
    rounding = norm_rounding(width, accumulated)
    factor_bytes = g.numel() * g.element_size() + a.numel() * a.element_size()
    per_example = out * width * accumulated.itemsize
    step = max(1, max(PRODUCT_CAP_BYTES, factor_bytes) // per_example)

    def chunk(gc: torch.Tensor, ac: torch.Tensor) -> torch.Tensor:
        gc, ac = cast(gc, factors), cast(ac, factors)  # a chunk at a time: one chunk's copy
        rows = torch.linalg.vector_norm(bmm_accumulated(gc.transpose(1, 2), ac), dim=-1)  # [m_c, out]; gradient freed
        return torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64).square_()

    if step >= m:  # the usual case: one chunk, without slices and concatenations
        squares = chunk(g, a)
    else:
        squares = torch.cat([chunk(g[start : start + step], a[start : start + step]) for start in range(0, m, step)])
    return Bound(squares, rounding, spread, spread_rounding, gamma)


def route_costs(
    positions: int,
    width_in: int,
    width_out: int,
    factors: torch.dtype,
    device: torch.device | str,
    precision: str,
    input_share: float = 1.0,
) -> dict[str, float]:
    """The time of each norm route for one example of a linear or Conv1D call, in flops of the device's fastest
    matmul (:data:`_RATES`; a device other than CUDA counts as a CPU), ``T = positions`` (grouped: ``k T``), ``s``
    the bytes of a factor's number (bf16 2, float32 4, float64 8):

    * ``"gram"``: two float64 Gram matrices and their inner product, ``2 T^2 (in + out + 1)`` flops at the float64
      rate, and its memory traffic: the factors read, written in float64 and read again (``T (in + out) (s + 16)``
      bytes), the Gram matrices written and read (``32 T^2``). The input's Gram matrix is shared by the calls that
      read the same tensor (q, k and v; gate and up), so a call pays ``input_share`` of its flops and bytes: 0 when
      an earlier call formed it, ``1 / r`` when ``r`` calls still to come read it;
    * ``"product"``: the gradient's matmul, ``2 T in out`` flops at the rate of its factors (bf16: tensor cores;
      float32: the run's ``precision``; float64), and its memory traffic: the ``[out, in]`` gradient written and read
      once (8 bytes a number, 16 in float64), and the factors read twice (the matmul, their row norms). Where the
      norm kernel runs (:func:`product_norms`) the gradient never reaches memory, but the model still prices it
      (it leaves out the host work per call, where the Gram route dispatches fewer operators). Measured on an H100
      (``benchmarks/product_norms_bench.py``, docs/performance.md): at ``T = 512`` the kernel beat the Gram route
      on every bf16 shape of the 1.1B Llama, where the model picks the product route; shorter ``T``, where the
      kernel could move the choice, is not measured.
    """
    kind = torch.device(device).type
    rates, per_byte = _RATES.get(kind, _RATES["cpu"]), _FLOPS_PER_BYTE.get(kind, _FLOPS_PER_BYTE["cpu"])
    if factors == torch.float64:
        rate, size = rates["float64"], 8
    elif factors == torch.bfloat16:
        rate, size = rates["bf16"], 2
    else:
        rate, size = rates.get(precision, rates["ieee"]), 4
    factor_numbers, weight_numbers = positions * (width_in + width_out), width_in * width_out
    input_flops, input_bytes = 2 * positions**2 * width_in, positions * width_in * (size + 16) + 16 * positions**2
    gram_flops = 2 * positions**2 * (width_out + 1) + input_share * input_flops
    gram_bytes = positions * width_out * (size + 16) + 16 * positions**2 + input_share * input_bytes
    product_flops = 2 * positions * weight_numbers
    product_bytes = weight_numbers * (16 if factors == torch.float64 else 8) + 2 * factor_numbers * size
    return {
        "gram": gram_flops / rates["float64"] + gram_bytes * per_byte,
        "product": product_flops / rate + product_bytes * per_byte,
    }


def norm_route(
    positions: int,
    width_in: int,
    width_out: int,
    factors: torch.dtype,
    device: torch.device | str,
    precision: str,
    input_share: float = 1.0,
) -> str:
    """``"gram"`` or ``"product"``, whichever :func:`route_costs` finds cheaper (a tie keeps ``"gram"``): a pure
    function of the shapes, the factors' dtype, the device, the float32 matmul precision and the share of the input's
    Gram matrix the call pays (``input_share``, :meth:`InputGrams.share`). On CUDA with bf16
    factors the product route wins once ``T`` is a few hundred against widths of a few thousand (the 1.1B Llama at
    ``T = 512``: every projection and the head), the Gram route where ``T`` is small against the widths; grouped
    examples (``k T`` positions) favour the product route."""
    costs = route_costs(positions, width_in, width_out, factors, device, precision, input_share)
    return "product" if costs["product"] < costs["gram"] else "gram"


class InputGrams:
    """The float64 Gram matrices of layer inputs, and the norms of their rows that the rounding margins read
    (:func:`_row_norms`), each formed once for the calls that read the same tensor and kept until the last of those
    calls has been recorded (``readers`` counts them as the forward registers them)."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.readers: dict[tuple[Any, ...], int] = {}
        self.grams: dict[tuple[Any, ...], tuple[bool, torch.Tensor]] = {}  # key -> (bf16-rounded, Gram)
        self.row_norms: dict[tuple[Any, ...], tuple[bool, torch.Tensor]] = {}  # key -> (bf16-rounded, [m, T])
        self.deferred: set[tuple[Any, ...]] = set()  # (key, bf16-rounded) of the inputs whose Gram gram_squares forms

    def read_by(self, call: Call) -> None:
        self.readers[call.input_key] = self.readers.get(call.input_key, 0) + 1

    def __call__(self, call: Call) -> torch.Tensor:
        return self._shared(self.grams, call, gram)

    def rows(self, call: Call) -> torch.Tensor:
        """``[m, T]``: :func:`_row_norms` of the call's input factor."""
        return self._shared(self.row_norms, call, _row_norms)

    def _shared(self, kept: dict, call: Call, form: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        rounded = bf16_factors(call)
        rounded_then, value = kept.get(call.input_key, (rounded, None))
        if value is None or rounded_then != rounded:
            value = form(input_factor(call, self.m))
            if self.readers.get(call.input_key, 0) > 1:
                kept[call.input_key] = (rounded, value)
        return value

    def defer(self, call: Call) -> None:
        """Note that :func:`gram_squares` forms the Gram matrix of the call's input (the later readers pay none)."""
        self.deferred.add((call.input_key, bf16_factors(call)))

    def share(self, call: Call) -> float:
        """The share of the input's Gram matrix that ``call`` would pay (:func:`route_costs`): 0 when an earlier call
        formed it (and keeps it for this one) or left it to :func:`gram_squares`, ``1 / r`` for the ``r`` calls still
        to read it, this one included."""
        rounded_then, matrix = self.grams.get(call.input_key, (None, None))
        if matrix is not None and rounded_then == bf16_factors(call):
            return 0.0
        if (call.input_key, bf16_factors(call)) in self.deferred:
            return 0.0
        return 1.0 / max(1, self.readers.get(call.input_key, 1))

    def done(self, call: Call) -> None:
        left = self.readers.get(call.input_key, 0) - 1
        self.readers[call.input_key] = left
        if left <= 0:
            self.grams.pop(call.input_key, None)
            self.row_norms.pop(call.input_key, None)


def _expert_kernels(call: Call) -> bool:
    """Whether an experts call's norms and clipped sum take the kernels of its rows sorted by pair
    (:mod:`~opake_torch.patches.kernels.expert_products`): bf16 rows and output gradients (the layer ran in
    bfloat16) where they run, and few enough pairs."""
    g, x = call.grad, call.inputs
    return expert_products_supported(g, x, call.routing.pair_ends.shape[0])


def _expert_norms(call: Call, m: int, *, one_pass: bool = False) -> torch.Tensor | Bound:
    """float64 ``[m]`` squared norms of an experts call's per-example gradients. Rows routed to different experts
    meet different weights, so they have no cross term: the sum over the (expert, example) pairs of the Frobenius
    products of their rows' Gram matrices, the rows sorted by pair and padded in runs of similar widths
    (:func:`~opake_torch.layerwise.experts.padded`): about ``(T k / E)^2`` entries per pair instead of the
    ``(T k)^2`` of all an example's rows, in a few batched launches whatever ``E``; the pairs' sizes are read on the
    host.

    Where the kernels run (:func:`_expert_kernels`), a :class:`Bound` instead, as a linear call's product route
    gives: each pair's gradient formed tile by tile on tensor cores for its norm only, from the pairs' offsets on
    the device (no host sync, no float64 copy), with the margin ``gamma S_i`` of its products over the example's
    ``R = k T`` rows, and with ``one_pass`` the one-pass sum's (:func:`one_pass_sum`)."""
    routing = call.routing
    if _expert_kernels(call):
        g, x = call.grad, call.inputs
        rows, out, width = g.shape[0] // m, g.shape[-1], x.shape[-1]
        spread, spread_rounding = _spread(
            _row_norms(g.reshape(m, rows, out)), _row_norms(x.reshape(m, rows, width)), out, width
        )
        squares = pair_squared_norms(g.index_select(0, routing.order), x.index_select(0, routing.order),
                                     routing.pair_ends, m)  # fmt: skip
        gamma = product_norm_error(rows, factors=torch.bfloat16, precision="ieee")
        bound = Bound(squares, pair_norm_rounding(out, width, routing.pair_ends.shape[0] // m), spread,
                      spread_rounding, gamma)  # fmt: skip
        return _with_margin(bound, product_sum_error(rows) if one_pass else 0.0, one_pass=one_pass)
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


def tied_names(calls: list[Call], out: Gradients, advantage: float) -> dict[str, tuple[Call, Call]]:
    """The weights a model ties (an embedding and its language-model head, which reads the same ``[V, d]`` matrix):
    used by exactly one embedding call and one linear call, where the linear call would take ghost norms
    (:func:`prefers_ghost` with ``advantage``), as ``name -> (linear call, embedding call)``. Such a weight's norms
    are :func:`tied_norms` and its clipped sum both calls' (:func:`add_ghost`), so its ``[m, V, d]`` per-example
    gradients (a GiB an example for a 128k vocabulary at width 2048) are never formed."""
    users: dict[str, list[Call]] = {}
    for call in calls:
        for name in call.names.values():
            users.setdefault(name, []).append(call)
    tied = {}
    for name, pair in users.items():
        if len(pair) != 2 or sorted(call.kind for call in pair) != ["embedding", "linear"]:
            continue
        head, embedding = pair if pair[0].kind == "linear" else pair[::-1]
        if all(call.names.get("weight") == name for call in pair) and prefers_ghost(
            head, out.shapes[name], out.m, advantage
        ):
            tied[name] = (head, embedding)
    return tied


def tied_norms(
    head: Call, head_norms: torch.Tensor | Bound, embedding: Call, embedding_norms: torch.Tensor, m: int
) -> torch.Tensor:
    """float64 ``[m]`` squared norms of a tied weight's per-example gradients ``G_i = E_i + H_i``: the embedding's
    part ``E_i = sum_t e_{id_t} u_t^T`` (``embedding_norms``: ``||E_i||^2``, :func:`ghost_norms`) and the head's
    ``H_i = sum_s g_s a_s^T`` (``head_norms``, any route, a :class:`Bound` or exact), so that ``||G_i||^2 = ||E_i||^2
    + ||H_i||^2 + 2 <E_i, H_i>`` with the cross term ``<E_i, H_i> = sum_{s,t} g_s[id_t] (a_s . u_t)`` over the
    embedding's live positions ``t`` (not ``padding_idx``): two ``[T, T]`` matrices an example, in float64.

    A bound's own rounding stays inside (``||H_i||`` replaced by its upper bound, which can only raise the root), and
    the head's sum margin is added outside, ``N_i = sqrt(||E_i||^2 + N_H,i^2 + 2 <E_i, H_i>) + margin S_i``, since the
    stored contribution ``E_i + H~_i`` is within ``||H~_i - H_i|| <= margin S_i`` of ``G_i`` (the margin of ``H`` alone
    would not cover ``||E_i + H~_i||``). A head the backward did not reach adds nothing."""
    if head.grad is None:
        return finished(head_norms) + embedding_norms
    ids, live = live_ids(embedding, m)
    u = by_example(embedding.grad, m).to(torch.float64)  # [m, Te, d]
    g, a = by_example(head.grad, m), input_factor(head, m)  # [m, Th, V], [m, Th, d]
    picked = torch.gather(g, 2, ids[:, None, :].expand(-1, g.shape[1], -1))  # [m, Th, Te]: g_s[id_t], exact values
    inner = torch.bmm(a.to(torch.float64), u.transpose(1, 2))  # [m, Th, Te]: a_s . u_t
    cross = frobenius(inner, picked.to(torch.float64).masked_fill_(~live[:, None, :], 0.0))
    other = embedding_norms + 2 * cross
    if not isinstance(head_norms, Bound):
        return (head_norms + other).clamp_(min=0.0)
    inside = finished(dataclasses.replace(head_norms, margin=0.0))  # infinite where the sum could overflow
    outside = head_norms.spread * (head_norms.margin * head_norms.spread_rounding)
    return (inside + other).clamp_(min=0.0).sqrt_().add_(outside).square_()
