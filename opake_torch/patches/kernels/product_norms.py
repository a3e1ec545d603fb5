"""Per-example weight-gradient norms without the gradients: :func:`product_squared_norms`.

The product norm route of the layerwise engine (:func:`~opake_torch.layerwise.ghost.product_norms`) needs
``||G_i||`` for ``G_i = g_i^T a_i`` (``g_i`` ``[T, out]``, ``a_i`` ``[T, in]``). Formed by a batched matmul, each
example's ``[out, in]`` gradient is written to memory in float32 and read back for its norm: on a GPU that traffic
costs more than the matmul (a 2048 x 2048 projection at ``T = 512``: 34 MB moved for 4.3 GFLOP). Here one Triton
program forms a ``BO x BK`` tile of ``G_i`` in registers (tensor-core products accumulated in float32, over ``T`` in
steps of ``BT``), squares and sums it, and writes one float64 number: the gradient never reaches memory.

Rounding. The tile's accumulation is a float32 matmul like any other (its error is the route's ``gamma``,
:func:`~opake_torch.layerwise.precision.product_norm_error`). Its entries are squared in float64 (exactly: a float32
number's square has at most 48 significand bits) and summed in float64, over the ``BO BK`` entries of a tile and
then the ``n`` tiles of an example: at most ``BO BK + n`` roundings on any path, so with ``s~`` the result,
``||G~_i|| <= f sqrt(s~)`` for ``f`` = :func:`~opake_torch.layerwise.precision.norm_rounding` ``(BO BK + n,
float64)`` (:func:`product_norm_rounding`), about ``1 + 2e-12``; no float32 square can overflow.

Factors: bf16 (tensor cores, exact products), or float32 under TF32 matmuls (each factor rounded to TF32 on the way
in, as cuBLAS does under that setting). Elsewhere (CPU, no Triton, IEEE float32, float64) the caller forms the
gradients. A non-finite factor makes the example's sum non-finite, as the formed gradient's norm would be.
"""

from __future__ import annotations

import functools

import torch

from opake_torch.patches.kernels._triton import interpreting, jit, tl, triton

__all__ = [
    "TILE",
    "example_tile",
    "product_kernel_runs",
    "product_norm_rounding",
    "product_squared_norms",
    "product_squared_norms_supported",
    "tile_grid",
    "tile_offsets",
]

TILE = (128, 128, 32)
"""``(BO, BK, BT)``: the rows and columns of ``G_i`` a program forms, and the positions of each step."""


@jit
def tile_offsets(tile, TILES_IN, BO: tl.constexpr, BK: tl.constexpr):
    """The rows ``[BO]`` and columns ``[BK]`` of the weight-gradient tile ``tile`` (row-major over ``TILES_IN`` column
    tiles), as 64-bit offsets: the strides of large factors overflow 32 bits."""
    rows = ((tile // TILES_IN) * BO + tl.arange(0, BO)).to(tl.int64)
    cols = ((tile % TILES_IN) * BK + tl.arange(0, BK)).to(tl.int64)
    return rows, cols


@jit
def example_tile(
    G,
    A,
    example,
    rows,
    cols,
    T,
    D_OUT,
    D_IN,
    stride_gm,
    stride_gt,
    stride_go,
    stride_am,
    stride_at,
    stride_ai,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    TF32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The ``[BO, BK]`` tile (``rows``, ``cols``: 64-bit offsets) of ``G~_i = g_i^T a_i`` for ``example`` (64-bit),
    accumulated in float32 over the ``T`` positions, ``BT`` a step, on tensor cores (TF32 products for float32
    factors with ``TF32``; ``UPCAST``: bf16 factors multiplied as float32 numbers, for the interpreter)."""
    steps = tl.arange(0, BT)
    g_ptrs = G + example * stride_gm + steps[None, :].to(tl.int64) * stride_gt + rows[:, None] * stride_go  # g_i^T
    a_ptrs = A + example * stride_am + steps[:, None].to(tl.int64) * stride_at + cols[None, :] * stride_ai
    rows_in, cols_in = rows[:, None] < D_OUT, cols[None, :] < D_IN
    acc = tl.zeros([BO, BK], dtype=tl.float32)
    for start in range(0, T, BT):
        g = tl.load(g_ptrs, mask=(start + steps[None, :] < T) & rows_in, other=0.0)  # [BO, BT]
        a = tl.load(a_ptrs, mask=(start + steps[:, None] < T) & cols_in, other=0.0)  # [BT, BK]
        if UPCAST:  # the interpreter's bf16 dot is wrong; bf16 products are exact in float32 alike
            g, a = g.to(tl.float32), a.to(tl.float32)
        if TF32:
            acc = tl.dot(g, a, acc, input_precision="tf32")
        else:
            acc = tl.dot(g, a, acc)
        g_ptrs += BT * stride_gt
        a_ptrs += BT * stride_at
    return acc


@jit(do_not_specialize=["T"])  # the positions change with each batch: one compilation, not one per kind
def _tile_squares_kernel(
    G,
    A,
    OUT,
    T,
    D_OUT,
    D_IN,
    stride_gm,
    stride_gt,
    stride_go,
    stride_am,
    stride_at,
    stride_ai,
    TILES_IN,
    TILES,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    TF32: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)  # the first grid axis takes up to 2^31 - 1 tiles, the second 65535 examples
    example = tl.program_id(1).to(tl.int64)
    rows, cols = tile_offsets(tile, TILES_IN, BO, BK)
    acc = example_tile(
        G, A, example, rows, cols, T, D_OUT, D_IN, stride_gm, stride_gt, stride_go, stride_am, stride_at, stride_ai,
        BO=BO, BK=BK, BT=BT, TF32=TF32, UPCAST=UPCAST,
    )  # fmt: skip
    wide = acc.to(tl.float64)  # a float32 number's square is exact in float64
    tl.store(OUT + example * TILES + tile, tl.sum(tl.sum(wide * wide, axis=1), axis=0))


def product_kernel_runs(device: torch.device, factors: torch.dtype, precision: str) -> bool:
    """Whether the kernel runs for factors of dtype ``factors`` on ``device`` under the float32 matmul ``precision``
    (:func:`~opake_torch.layerwise.precision.matmul_precision`): bf16, or float32 under ``"tf32"``, on a CUDA
    device of compute capability 8 or more with Triton (the CPU under the interpreter)."""
    if not (factors == torch.bfloat16 or (factors == torch.float32 and precision == "tf32")):
        return False
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return interpreting()
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    return _tensor_cores(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _tensor_cores(index: int) -> bool:
    """Whether CUDA device ``index`` has bf16 and TF32 tensor cores (compute capability 8 or more), which the kernel's
    ``tl.dot`` needs."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def product_squared_norms_supported(g: torch.Tensor, a: torch.Tensor, precision: str) -> bool:
    """Whether :func:`product_squared_norms` runs for ``g`` ``[m, T, out]`` and ``a`` ``[m, T, in]``: factors of one
    dtype that :func:`product_kernel_runs` takes, on one device, with 1 to 65535 examples (the grid's second axis)
    and at least one position."""
    if g.dim() != 3 or a.dim() != 3 or g.shape[:2] != a.shape[:2] or g.dtype != a.dtype or g.device != a.device:
        return False
    return 0 < g.shape[0] <= 65535 and g.shape[1] > 0 and product_kernel_runs(g.device, g.dtype, precision)


def tile_grid(out: int, width: int) -> tuple[int, int]:
    """``(tiles along out, tiles along in)``: the ``TILE`` tiles that cover an ``[out, in]`` gradient."""
    bo, bk, _ = TILE
    return triton.cdiv(out, bo), triton.cdiv(width, bk)


def product_norm_rounding(out: int, width: int) -> float:
    """``f >= 1`` with ``||G~_i|| <= f sqrt(s~_i)`` for the sums :func:`product_squared_norms` returns for an
    ``[out, in]`` gradient (module docstring)."""
    from opake_torch.layerwise.precision import norm_rounding  # here: the layerwise engine imports this module

    bo, bk, _ = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    return norm_rounding(bo * bk + tiles_out * tiles_in, torch.float64)


def product_squared_norms(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """float64 ``[m]``: ``s~_i``, the sum of squares of ``G~_i = g_i^T a_i`` formed tile by tile in float32 (never
    stored), for ``g`` ``[m, T, out]`` and ``a`` ``[m, T, in]`` (any strides) that
    :func:`product_squared_norms_supported` accepts. :func:`product_norm_rounding` bounds its rounding."""
    m, positions, out = g.shape
    width = a.shape[-1]
    bo, bk, bt = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    tiles = tiles_out * tiles_in
    partial = torch.empty(m, tiles, dtype=torch.float64, device=g.device)
    _tile_squares_kernel[(tiles, m)](
        g,
        a,
        partial,
        positions,
        out,
        width,
        *g.stride(),
        *a.stride(),
        tiles_in,
        tiles,
        BO=bo,
        BK=bk,
        BT=bt,
        TF32=g.dtype == torch.float32,
        UPCAST=interpreting(),
        num_warps=8,
        num_stages=3,
    )
    return partial.sum(dim=1)
