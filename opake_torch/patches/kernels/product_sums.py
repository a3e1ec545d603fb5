"""The clipped sum of a bf16 layer's per-example weight gradients in one pass: :func:`clipped_product_sum`.

The layerwise engine adds ``sum_i c_i G_i`` (``G_i = g_i^T a_i``, ``g_i`` ``[T, out]`` and ``a_i`` ``[T, in]`` bf16)
to a float32 sum. As one cuBLAS matmul the clip factor must enter a factor, and ``c_i g_t`` is no bf16 number: the
engine's other form splits it into two exact bf16 parts and multiplies twice the output width
(:func:`~opake_torch.layerwise.precision.add_bf16_product`). Here one Triton program per ``BO x BK`` tile of the sum
(and group of examples) forms each example's tile ``G~_i`` in registers (tensor-core products accumulated in float32
over ``T``, :data:`STEP` positions a step, as :mod:`~opake_torch.patches.kernels.product_norms` does), multiplies it by
``c_i`` in float32 and adds it to its running tile: the flops of the layer's weight gradient once, no scaled copy of
``g`` and no per-example gradient in memory. An example with ``c_i = 0`` adds exactly nothing, whatever its values
(NaN included). The groups' tiles are added once at the end, in a fixed order (the same bits every run).

Rounding. ``G~_i`` is a float32 accumulation of exact products, ``|G~_i - G_i| <= gamma_T sum_t |g_t| |a_t|^T`` entry
by entry (:func:`~opake_torch.layerwise.precision.summation_error`), and the product by ``c_i`` rounds once more, so
each example's contribution ``fl(c_i G~_i)`` has norm at most ``c_i (||G_i|| + eps S_i)``,
``eps = (1 + gamma_T)(1 + 2^-24) - 1``, ``S_i = sum_t ||g_t|| ||a_t||``
(:func:`~opake_torch.layerwise.precision.product_sum_error`). The engine's norms of such a layer carry that margin, so
that every contribution stays within the clipping bound; at ``T = 512`` it is about ``7e-4`` of the norm for
positions that do not cancel.

Runs where the norm kernel does (:func:`~opake_torch.patches.kernels.product_norms.product_kernel_runs` for bf16: a
CUDA device of compute capability 8 or more with Triton, the CPU under the interpreter).
"""

from __future__ import annotations

import torch

from opake_torch.patches.kernels._triton import interpreting, jit, tl, triton
from opake_torch.patches.kernels.product_norms import TILE, example_tile, product_kernel_runs, tile_grid, tile_offsets

__all__ = ["STEP", "clipped_product_sum", "clipped_product_sum_supported"]

STEP = 64
"""The positions each step of the kernel multiplies (the norm kernel's ``TILE`` takes 32). With four stages of
loads in flight the one-pass sum of the 1.1B Llama's projections at 16 x 512 took 0.20 to 0.46 ms, against 0.29 to
0.73 ms at 32 positions and three stages (H100, docs/performance.md: tiles, steps, warps and stages swept)."""


@jit(do_not_specialize=["m", "T", "PER_GROUP"])  # they change with each draw: one compilation, not one per kind
def _clipped_sum_kernel(
    G,
    A,
    SCALE,
    OUT,
    m,
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
    PER_GROUP,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile, group = tl.program_id(0), tl.program_id(1)
    rows, cols = tile_offsets(tile, TILES_IN, BO, BK)
    rows_in, cols_in = rows[:, None] < D_OUT, cols[None, :] < D_IN
    out_ptrs = OUT + group.to(tl.int64) * D_OUT * D_IN + rows[:, None] * D_IN + cols[None, :]
    if ACCUMULATE:  # one group: the tiles are added to the sum in place
        total = tl.load(out_ptrs, mask=rows_in & cols_in, other=0.0)
    else:
        total = tl.zeros([BO, BK], dtype=tl.float32)
    first = group.to(tl.int64) * PER_GROUP  # 64-bit loop variable: offsets of large factors
    for example in range(first, tl.minimum(first + PER_GROUP, m)):
        c = tl.load(SCALE + example)
        acc = example_tile(
            G, A, example, rows, cols, T, D_OUT, D_IN, stride_gm, stride_gt, stride_go, stride_am, stride_at,
            stride_ai, BO=BO, BK=BK, BT=BT, TF32=False, UPCAST=UPCAST,
        )  # fmt: skip
        total += tl.where(c != 0.0, acc * c, 0.0)
    tl.store(out_ptrs, total, mask=rows_in & cols_in)


def clipped_product_sum_supported(g: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, total: torch.Tensor) -> bool:
    """Whether :func:`clipped_product_sum` runs: bf16 ``g`` ``[m, T, out]`` and ``a`` ``[m, T, in]`` (any strides),
    float32 ``scale`` with ``m`` numbers and a contiguous float32 ``total`` ``[out, in]``, all on one device where
    :func:`~opake_torch.patches.kernels.product_norms.product_kernel_runs` takes bf16 factors, and at least one
    example and one position."""
    if g.dim() != 3 or a.dim() != 3 or g.shape[:2] != a.shape[:2] or g.dtype != torch.bfloat16 or a.dtype != g.dtype:
        return False
    if scale.dtype != torch.float32 or scale.numel() != g.shape[0] or total.dtype != torch.float32:
        return False
    if total.shape != (g.shape[-1], a.shape[-1]) or not total.is_contiguous():
        return False
    if len({g.device, a.device, scale.device, total.device}) != 1:
        return False
    return g.shape[0] > 0 and g.shape[1] > 0 and product_kernel_runs(g.device, torch.bfloat16, "ieee")


def _groups(device: torch.device, tiles: int, m: int) -> int:
    """Groups of examples so that the grid holds about two programs per multiprocessor (one on a CPU)."""
    if device.type != "cuda":
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(m, triton.cdiv(2 * processors, tiles)))


def clipped_product_sum(
    g: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, total: torch.Tensor, *, groups: int | None = None
) -> None:
    """``total += sum_i fl(scale_i G~_i)`` (``G~_i = g_i^T a_i`` accumulated in float32; nothing for ``scale_i = 0``)
    for arguments that :func:`clipped_product_sum_supported` accepts; ``groups`` (default: enough to fill the GPU)
    splits the examples among programs of one tile, whose partial tiles ``[groups, out, in]`` are then summed. The
    module docstring bounds each contribution."""
    m, positions, out = g.shape
    width = a.shape[-1]
    bo, bk, _ = TILE
    tiles_out, tiles_in = tile_grid(out, width)
    tiles = tiles_out * tiles_in
    groups = _groups(g.device, tiles, m) if groups is None else max(1, min(groups, m))
    per_group = triton.cdiv(m, groups)
    groups = triton.cdiv(m, per_group)
    target = total if groups == 1 else torch.empty(groups, out, width, dtype=torch.float32, device=g.device)
    _clipped_sum_kernel[(tiles, groups)](
        g,
        a,
        scale.reshape(m).contiguous(),
        target,
        m,
        positions,
        out,
        width,
        *g.stride(),
        *a.stride(),
        tiles_in,
        per_group,
        BO=bo,
        BK=bk,
        BT=STEP,
        ACCUMULATE=groups == 1,
        UPCAST=interpreting(),
        num_warps=8,
        num_stages=4,
    )
    if groups > 1:
        total.add_(target.sum(dim=0))
