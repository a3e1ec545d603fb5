"""Fused clip-and-sum of per-example gradients: :func:`clip_and_sum`, the Triton backend of the clipping engine.

Same result as the torch engine (``opake_core.clipping._ClipRule``, mirrored by
:func:`~opake_torch.patches.kernels.reference.clip_and_sum`): for examples ``i`` and groups ``k``,

    total_l += sum_i  scale_i,k(l) * g_i,l,      scale_i,k = min(1, C_k (1 - 4u) / ||g_i||_k),

squared norms in float64, ``scale = 0`` for an example whose norm is not finite (its NaN/inf entries contribute 0),
the scale cast to the accumulator dtype (float32, float64 for float64 leaves) before the product, so each stored
contribution satisfies ``||fl(scale * g_i)|| <= C``. Two passes, and never a clipped copy of the gradients:

1. norms: one launch per gradient dtype over a table of tiles ``(leaf, example, offset)``; each program writes the
   float64 sum of squares of its tile into a slot ordered by ``(group, example)``; a segment kernel sums the slots
   (fixed order: the norms are deterministic). The scales are computed from ``[G, m]`` norms with torch.
2. scale-and-reduce: one launch per gradient dtype over tiles ``(leaf, columns)``; each program walks the ``m``
   examples of its columns, accumulates ``scale_i * g_i`` in the accumulator dtype and adds it to the accumulator.

The leaves are reached through a table of base addresses (the multi-tensor pattern), so the launch count does not
depend on the number of leaves. Tile plans are cached by the shapes (an LRU of 64).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from opake_core.clipping import clip_scales
from opake_torch.patches.kernels import reference
from opake_torch.patches.kernels._triton import can_launch, jit, tl

__all__ = ["clip_and_sum", "fused_supported"]

_NORM_BLOCK = 1024
_NORM_ITERS = 8  # a norm tile is _NORM_BLOCK * _NORM_ITERS elements of one example
_SUM_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@jit
def _sq_norm_kernel(TABLE, PTRS, NUMEL, PARTIAL, BLOCK: tl.constexpr, ITERS: tl.constexpr, DTYPE: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    leaf = tl.load(TABLE + tile * 4)
    example = tl.load(TABLE + tile * 4 + 1)
    start = tl.load(TABLE + tile * 4 + 2)
    slot = tl.load(TABLE + tile * 4 + 3)
    n = tl.load(NUMEL + leaf)
    base = tl.load(PTRS + leaf).to(tl.pointer_type(DTYPE)) + example * n
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for it in range(ITERS):
        idx = start + it * BLOCK + offs
        x = tl.load(base + idx, mask=idx < n, other=0.0).to(tl.float64)
        acc += x * x
    tl.store(PARTIAL + slot, tl.sum(acc, axis=0))


@jit
def _segment_sum_kernel(PARTIAL, STARTS, OUT, BLOCK: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    start = tl.load(STARTS + seg)
    stop = tl.load(STARTS + seg + 1)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for first in range(start, stop, BLOCK):
        acc += tl.load(PARTIAL + first + offs, mask=first + offs < stop, other=0.0)
    tl.store(OUT + seg, tl.sum(acc, axis=0))


@jit
def _scale_sum_kernel(
    TABLE, PTRS, ACC_PTRS, NUMEL, GROUP, SCALES, m, DTYPE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    tile = tl.program_id(0).to(tl.int64)
    leaf = tl.load(TABLE + tile * 2)
    start = tl.load(TABLE + tile * 2 + 1)
    n = tl.load(NUMEL + leaf)
    group = tl.load(GROUP + leaf)
    grads = tl.load(PTRS + leaf).to(tl.pointer_type(DTYPE))
    total_ptr = tl.load(ACC_PTRS + leaf).to(tl.pointer_type(ACC))
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n
    acc = tl.zeros([BLOCK], dtype=ACC)
    for i in range(m):
        scale = tl.load(SCALES + group * m + i)
        v = tl.load(grads + i * n + idx, mask=mask, other=0.0).to(ACC) * scale
        acc += tl.where((v == v) & (tl.abs(v) != float("inf")), v, 0.0)
    total = tl.load(total_ptr + idx, mask=mask, other=0.0)
    tl.store(total_ptr + idx, total + acc, mask=mask)


def fused_supported(per_example_grads: list[torch.Tensor], accumulators: list[torch.Tensor]) -> bool:
    """Whether :func:`clip_and_sum` runs the Triton kernels for these tensors (else the torch reference)."""
    tensors = [*per_example_grads, *accumulators]
    return (
        bool(per_example_grads)
        and can_launch(*tensors)
        and all(g.dtype in _DTYPES for g in per_example_grads)
        and all(a.dtype in (torch.float32, torch.float64) and a.is_contiguous() for a in accumulators)
        and all(a.dtype == (torch.float64 if g.dtype == torch.float64 else torch.float32)
                for g, a in zip(per_example_grads, accumulators, strict=True))
    )  # fmt: skip


def clip_and_sum(
    per_example_grads: list[torch.Tensor],
    *,
    group_index: list[int],
    bounds: list[float],
    accumulators: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip each example's gradient to its bound(s) and add the sum over examples to the accumulators, in place.

    Args:
        per_example_grads: one tensor ``[m, ...]`` per leaf, ``m`` examples (the same ``m`` for all).
        group_index: the clipping group of each leaf, an index into ``bounds``.
        bounds: the L2 bound ``C_k`` of each group (``math.inf``: no clipping for that group).
        accumulators: one tensor per leaf with the leaf's shape without ``m``: float32 (float64 for float64
            leaves); updated in place.

    Returns:
        ``(norms [m], group_norms [G, m])`` in float64: each example's total and per-group L2 norm before clipping
        (not finite for a non-finite example). Diagnostics only: outside the privacy guarantee.

    The Triton kernels run when every tensor is on one CUDA device (see :func:`fused_supported`); otherwise this is
    the torch reference, which is also the definition the kernels are tested against.
    """
    if len(per_example_grads) != len(accumulators) or len(group_index) != len(per_example_grads):
        raise ValueError(
            f"per_example_grads ({len(per_example_grads)}), group_index ({len(group_index)}) and accumulators "
            f"({len(accumulators)}) must have one entry per leaf."
        )
    with torch.profiler.record_function("opake::clip_and_sum"):
        if not fused_supported(per_example_grads, accumulators) or per_example_grads[0].shape[0] == 0:
            return reference.clip_and_sum(
                per_example_grads, group_index=group_index, bounds=bounds, accumulators=accumulators
            )
        return _fused(per_example_grads, group_index, bounds, accumulators)


_TL_DTYPES: dict[torch.dtype, Any] = {}


def _tl_dtype(dtype: torch.dtype) -> Any:
    if not _TL_DTYPES:
        _TL_DTYPES.update(
            {
                torch.float32: tl.float32,
                torch.bfloat16: tl.bfloat16,
                torch.float16: tl.float16,
                torch.float64: tl.float64,
            }
        )
    return _TL_DTYPES[dtype]


@functools.lru_cache(maxsize=64)
def _plan(m: int, leaves: tuple[tuple[int, torch.dtype, int], ...], groups: int) -> dict[str, Any]:
    """Tile tables (CPU int64) for leaves ``(numel per example, dtype, group)``; slots ordered by (group, example)."""
    tile = _NORM_BLOCK * _NORM_ITERS
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, (_, dtype, _) in enumerate(leaves):
        by_dtype.setdefault(dtype, []).append(index)
    # norm tiles of each (group, example) segment, across dtypes, in a fixed order
    segment_tiles: list[list[tuple[torch.dtype, int, int, int]]] = [[] for _ in range(groups * m)]
    for dtype, members in by_dtype.items():
        for local, index in enumerate(members):
            numel, _, group = leaves[index]
            for example in range(m):
                for start in range(0, numel, tile):
                    segment_tiles[group * m + example].append((dtype, local, example, start))
    norm_tables: dict[torch.dtype, list[list[int]]] = {dtype: [] for dtype in by_dtype}
    starts, slot = [0], 0
    for tiles in segment_tiles:
        for dtype, local, example, start in tiles:
            norm_tables[dtype].append([local, example, start, slot])
            slot += 1
        starts.append(slot)
    plan: dict[str, Any] = {"slots": slot, "starts": torch.tensor(starts, dtype=torch.int64), "dtypes": {}}
    for dtype, members in by_dtype.items():
        sum_table = [
            [local, start] for local, index in enumerate(members) for start in range(0, leaves[index][0], _SUM_BLOCK)
        ]
        plan["dtypes"][dtype] = {
            "members": members,
            "numel": torch.tensor([leaves[i][0] for i in members], dtype=torch.int64),
            "group": torch.tensor([leaves[i][2] for i in members], dtype=torch.int64),
            "norm_table": torch.tensor(norm_tables[dtype] or [[0, 0, 0, 0]], dtype=torch.int64)[
                : len(norm_tables[dtype])
            ],
            "sum_table": torch.tensor(sum_table or [[0, 0]], dtype=torch.int64)[: len(sum_table)],
        }
    return plan


def _device_plan(plan: dict[str, Any], device: torch.device) -> dict[str, Any]:
    cache = plan.setdefault("on_device", {})
    if device not in cache:
        cache[device] = {
            "starts": plan["starts"].to(device),
            "dtypes": {
                dtype: {key: value.to(device) for key, value in entry.items() if key != "members"}
                for dtype, entry in plan["dtypes"].items()
            },
        }
    return cache[device]


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device``; on CUDA copied from pinned memory, so the copy does not wait for the queued GPU
    work (a copy from pageable memory would stall the host at every call)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _fused(
    grads: list[torch.Tensor], group_index: list[int], bounds: list[float], accumulators: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    m, device, groups = grads[0].shape[0], grads[0].device, len(bounds)
    grads = [g.detach() if g.is_contiguous() else g.detach().contiguous() for g in grads]
    leaves = tuple((g.numel() // m, g.dtype, k) for g, k in zip(grads, group_index, strict=True))
    plan = _plan(m, leaves, groups)
    on_device = _device_plan(plan, device)
    partial = torch.empty(plan["slots"], dtype=torch.float64, device=device)
    pointers = {}
    for dtype, entry in plan["dtypes"].items():
        members = entry["members"]
        pointers[dtype] = _on_device([grads[i].data_ptr() for i in members], device)
        table = on_device["dtypes"][dtype]["norm_table"]
        if table.shape[0]:
            _sq_norm_kernel[(table.shape[0],)](
                table, pointers[dtype], on_device["dtypes"][dtype]["numel"], partial,
                BLOCK=_NORM_BLOCK, ITERS=_NORM_ITERS, DTYPE=_tl_dtype(dtype),
            )  # fmt: skip
    group_sq = torch.empty(groups * m, dtype=torch.float64, device=device)
    _segment_sum_kernel[(groups * m,)](partial, on_device["starts"], group_sq, BLOCK=256)
    group_sq = group_sq.reshape(groups, m)
    group_norms = group_sq.sqrt()
    norms = group_sq.sum(dim=0).sqrt()
    acc_dtypes = {a.dtype for a in accumulators}
    scales = {dtype: scale.contiguous() for dtype, scale in clip_scales(group_norms, norms, bounds, acc_dtypes).items()}
    for dtype, entry in plan["dtypes"].items():
        members = entry["members"]
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        acc_pointers = _on_device([accumulators[i].data_ptr() for i in members], device)
        table = on_device["dtypes"][dtype]["sum_table"]
        if table.shape[0]:
            _scale_sum_kernel[(table.shape[0],)](
                table, pointers[dtype], acc_pointers, on_device["dtypes"][dtype]["numel"],
                on_device["dtypes"][dtype]["group"], scales[acc_dtype], m,
                DTYPE=_tl_dtype(dtype), ACC=_tl_dtype(acc_dtype), BLOCK=_SUM_BLOCK,
            )  # fmt: skip
    return norms, group_norms
