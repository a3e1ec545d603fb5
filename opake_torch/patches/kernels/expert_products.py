"""An experts layer's per-example norms and clipped sum, each in one launch, from its rows sorted by (expert, example)
pair: :func:`pair_squared_norms` and :func:`expert_product_sum`.

The rows of a stacked experts layer (:mod:`opake_torch.layerwise.experts`) are sorted by the pair ``p = e m + i``
(expert ``e``, example ``i``) and the pairs' cumulative row counts stay on the device (``Routing.pair_ends``). The
example's gradient of expert ``e`` is ``G_p = g_p^T a_p`` over the pair's rows, and the example's norm is
``||G_i||^2 = sum_e ||G_p||^2`` (rows on different experts meet different weights). The programs here read a pair's
rows from those offsets, so nothing is read on the host (no padding to the pairs' sizes, no host sync), and each
``BO x BK`` tile of ``G_p`` is formed in registers as the kernels of
:mod:`~opake_torch.patches.kernels.product_norms` and :mod:`~opake_torch.patches.kernels.product_sums` form an
example's (bf16 tensor-core products accumulated in float32, never written to memory):

* :func:`pair_squared_norms`: one program per (tile, pair) writes the tile's float64 sum of squares; the pairs' sums
  are then added per example. A pair without rows gives 0.
* :func:`expert_product_sum`: one program per (tile, expert) adds ``fl(c_i G~_p)`` over the expert's pairs, in the
  order of the examples, to the expert's float32 tile of the sum: the flops of the experts' weight gradient once.
  An example with ``c_i = 0`` adds exactly nothing, whatever its values.

Rounding, as for a linear layer with ``T`` replaced by a pair's rows (at most the example's ``R = k T`` rows):
``|G~_p - G_p| <= gamma_R sum_{t in p} |g_t| |a_t|^T`` entry by entry, and ``fl(c_i G~_p)`` rounds once more
(:func:`~opake_torch.layerwise.precision.product_sum_error`). Over the experts, ``(sum_e (||G_p|| + gamma
S_p)^2)^(1/2) <= ||G_i|| + gamma S_i`` with ``S_i = sum_e S_p = sum_t ||g_t|| ||a_t||`` over all the example's rows,
so the engine's bounds are those of a linear call (:class:`~opake_torch.layerwise.ghost.Bound`); the float64 sum of
squares has at most ``BO BK + n + E`` roundings on any path (``n`` tiles, ``E`` experts: :func:`pair_norm_rounding`).
"""

from __future__ import annotations

import torch

from opake_torch.patches.kernels._triton import interpreting, jit, tl
from opake_torch.patches.kernels.product_norms import TILE, example_tile, product_kernel_runs, tile_grid, tile_offsets
from opake_torch.patches.kernels.product_sums import STEP

__all__ = ["expert_product_sum", "expert_products_supported", "pair_norm_rounding", "pair_squared_norms"]

MAX_GRID = 65535
"""The most programs along the grid's second axis (pairs for the norms, experts for the sum)."""


@jit
def _pair_tile(
    G, A, STARTS, pair, rows, cols, D_OUT, D_IN, stride_gt, stride_go, stride_at, stride_ai,
    BO: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The ``[BO, BK]`` tile of ``G~_p`` for ``pair`` (64-bit): its rows, read from ``STARTS``, taken as an example's
    positions by :func:`~opake_torch.patches.kernels.product_norms.example_tile`."""
    start = tl.load(STARTS + pair).to(tl.int64)
    count = tl.load(STARTS + pair + 1).to(tl.int64) - start
    return example_tile(
        G, A, start, rows, cols, count, D_OUT, D_IN, stride_gt, stride_gt, stride_go, stride_at, stride_at, stride_ai,
        BO=BO, BK=BK, BT=BT, TF32=False, UPCAST=UPCAST,
    )  # fmt: skip


@jit
def _pair_squares_kernel(
    G,
    A,
    STARTS,
    OUT,
    D_OUT,
    D_IN,
    stride_gt,
    stride_go,
    stride_at,
    stride_ai,
    TILES_IN,
    TILES,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    rows, cols = tile_offsets(tile, TILES_IN, BO, BK)
    acc = _pair_tile(
        G, A, STARTS, pair, rows, cols, D_OUT, D_IN, stride_gt, stride_go, stride_at, stride_ai,
        BO=BO, BK=BK, BT=BT, UPCAST=UPCAST,
    )  # fmt: skip
    wide = acc.to(tl.float64)  # a float32 number's square is exact in float64
    tl.store(OUT + pair * TILES + tile, tl.sum(tl.sum(wide * wide, axis=1), axis=0))


@jit(do_not_specialize=["m"])  # the examples change with each draw: one compilation
def _expert_sum_kernel(
    G,
    A,
    STARTS,
    SCALE,
    OUT,
    m,
    D_OUT,
    D_IN,
    stride_gt,
    stride_go,
    stride_at,
    stride_ai,
    TILES_IN,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.program_id(1).to(tl.int64)
    rows, cols = tile_offsets(tile, TILES_IN, BO, BK)
    inside = (rows[:, None] < D_OUT) & (cols[None, :] < D_IN)
    out_ptrs = OUT + expert * D_OUT * D_IN + rows[:, None] * D_IN + cols[None, :]
    total = tl.load(out_ptrs, mask=inside, other=0.0)
    for example in range(0, m):
        c = tl.load(SCALE + example)
        acc = _pair_tile(
            G, A, STARTS, expert * m + example, rows, cols, D_OUT, D_IN, stride_gt, stride_go, stride_at, stride_ai,
            BO=BO, BK=BK, BT=BT, UPCAST=UPCAST,
        )  # fmt: skip
        total += tl.where(c != 0.0, acc * c, 0.0)
    tl.store(out_ptrs, total, mask=inside)


def expert_products_supported(
    left: torch.Tensor, right: torch.Tensor, pairs: int, total: torch.Tensor | None = None
) -> bool:
    """Whether the kernels take the sorted rows ``left`` ``[S, p]`` and ``right`` ``[S, q]`` of ``pairs`` (expert,
    example) pairs: bf16, one device where the norm kernel runs
    (:func:`~opake_torch.patches.kernels.product_norms.product_kernel_runs`), at most :data:`MAX_GRID` pairs; and,
    for :func:`expert_product_sum`, a contiguous float32 ``total`` ``[E, p, q]`` on that device."""
    if left.dim() != 2 or right.dim() != 2 or left.shape[0] != right.shape[0] or left.device != right.device:
        return False
    if left.dtype != torch.bfloat16 or right.dtype != torch.bfloat16:
        return False
    if total is not None:
        if total.dtype != torch.float32 or not total.is_contiguous() or total.device != left.device:
            return False
        if total.dim() != 3 or total.shape[1:] != (left.shape[1], right.shape[1]) or pairs % total.shape[0]:
            return False
    return 0 < pairs <= MAX_GRID and product_kernel_runs(left.device, torch.bfloat16, "ieee")


def _starts(pair_ends: torch.Tensor) -> torch.Tensor:
    """``[P + 1]``: 0, then the pairs' cumulative row counts (pair ``p``'s rows are ``starts[p] ... starts[p + 1] -
    1``)."""
    return torch.cat([pair_ends.new_zeros(1), pair_ends])


def pair_norm_rounding(out: int, width: int, experts: int) -> float:
    """``f >= 1`` with ``||G~_i|| <= f sqrt(s~_i)`` for the sums :func:`pair_squared_norms` returns for ``[out, in]``
    expert gradients over ``experts`` experts (module docstring)."""
    from opake_torch.layerwise.precision import norm_rounding  # here: the layerwise engine imports this module

    bo, bk, _ = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    return norm_rounding(bo * bk + tiles_out * tiles_in + experts, torch.float64)


def pair_squared_norms(g: torch.Tensor, a: torch.Tensor, pair_ends: torch.Tensor, m: int) -> torch.Tensor:
    """float64 ``[m]``: ``s~_i = sum_e ||G~_p||^2`` for the rows ``g`` ``[S, out]`` and ``a`` ``[S, in]`` sorted by
    pair ``p = e m + i`` (``pair_ends``: int ``[E m]``, the pairs' cumulative row counts), for arguments that
    :func:`expert_products_supported` accepts. :func:`pair_norm_rounding` bounds the rounding."""
    out, width, pairs = g.shape[-1], a.shape[-1], pair_ends.shape[0]
    bo, bk, bt = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    tiles = tiles_out * tiles_in
    partial = torch.empty(pairs, tiles, dtype=torch.float64, device=g.device)
    _pair_squares_kernel[(tiles, pairs)](
        g,
        a,
        _starts(pair_ends),
        partial,
        out,
        width,
        *g.stride(),
        *a.stride(),
        tiles_in,
        tiles,
        BO=bo,
        BK=bk,
        BT=bt,
        UPCAST=interpreting(),
        num_warps=8,
        num_stages=3,
    )
    return partial.sum(dim=1).view(pairs // m, m).sum(dim=0)


def expert_product_sum(
    left: torch.Tensor, right: torch.Tensor, pair_ends: torch.Tensor, scale: torch.Tensor, total: torch.Tensor
) -> None:
    """``total[e] += sum_i fl(scale_i G~_p)``, ``G~_p = sum_{r in p} left_r^T right_r`` accumulated in float32 over
    the pair ``p = e m + i``'s rows (nothing for ``scale_i = 0``), for rows ``left`` ``[S, p]`` and ``right`` ``[S,
    q]`` sorted by pair (``pair_ends``: int ``[E m]``), float32 ``scale`` with ``m`` numbers and the float32 sum
    ``total`` ``[E, p, q]``, that :func:`expert_products_supported` accepts."""
    experts, out, width = total.shape
    m = scale.numel()
    bo, bk, _ = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    _expert_sum_kernel[(tiles_out * tiles_in, experts)](
        left,
        right,
        _starts(pair_ends),
        scale.reshape(m).to(torch.float32).contiguous(),
        total,
        m,
        out,
        width,
        *left.stride(),
        *right.stride(),
        tiles_in,
        BO=bo,
        BK=bk,
        BT=STEP,
        UPCAST=interpreting(),
        num_warps=8,
        num_stages=4,
    )
