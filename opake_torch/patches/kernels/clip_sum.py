"""Fused norms and scaled sums of materialized per-example gradients: :class:`FusedGradients`.

The two halves of the clipping arithmetic as Triton kernels, for ``vmap(grad)`` gradients (one tensor ``[m, ...]`` per
leaf): the clipping rule between them (the scales, their margin, the non-finite rule) stays in
:mod:`opake_core.clipping.rules`, so the result is the torch path's up to float summation order (its reference is
:class:`~opake_core.clipping.MaterializedGradients`). Use it as ``Engine(gradients=VmapGradients(FusedGradients))``.

1. :meth:`FusedGradients.squared_norms`: one launch per gradient dtype over a table of tiles ``(leaf, example,
   offset)``; each program writes the float64 sum of squares of its tile into a slot ordered by ``(leaf, example)``;
   a segment kernel sums the slots in a fixed order (the norms are deterministic): float64 ``[L, m]``.
2. :meth:`FusedGradients.add_scaled`: one launch per gradient dtype over tiles ``(leaf, columns)``; each program walks
   the ``m`` examples of its columns, accumulates ``scale_i * g_i`` in the accumulator dtype (float32, float64 for
   float64 leaves), drops non-finite products (an example with scale 0 adds nothing) and adds the total to the
   accumulator. Never a clipped copy of the gradients.

The leaves are reached through a table of base addresses (the multi-tensor pattern), so the launch count does not
depend on the number of leaves. Tile plans are cached by the shapes (an LRU of 64). Where the kernels cannot run (CPU,
no Triton, another dtype or layout, no example) the torch path runs instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from opake_core.clipping import MaterializedGradients
from opake_torch.patches.kernels._triton import can_launch, jit, tl

__all__ = ["FusedGradients", "fused_supported"]

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
    TABLE, PTRS, ACC_PTRS, NUMEL, SCALES, SCALE_STRIDE, m, DTYPE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    tile = tl.program_id(0).to(tl.int64)
    leaf = tl.load(TABLE + tile * 2)
    start = tl.load(TABLE + tile * 2 + 1)
    n = tl.load(NUMEL + leaf)
    grads = tl.load(PTRS + leaf).to(tl.pointer_type(DTYPE))
    total_ptr = tl.load(ACC_PTRS + leaf).to(tl.pointer_type(ACC))
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n
    acc = tl.zeros([BLOCK], dtype=ACC)
    for i in range(m):
        scale = tl.load(SCALES + leaf * SCALE_STRIDE + i)  # stride 0: one row shared by every leaf
        v = tl.load(grads + i * n + idx, mask=mask, other=0.0).to(ACC) * scale
        acc += tl.where((v == v) & (tl.abs(v) != float("inf")), v, 0.0)
    total = tl.load(total_ptr + idx, mask=mask, other=0.0)
    tl.store(total_ptr + idx, total + acc, mask=mask)


def fused_supported(per_example_grads: list[torch.Tensor], accumulators: list[torch.Tensor] | None = None) -> bool:
    """Whether the Triton kernels run for these gradients ``[m, ...]`` (and accumulators), else the torch path."""
    grads, sums = per_example_grads, accumulators or []
    supported = bool(grads) and grads[0].shape[0] > 0 and all(g.dtype in _DTYPES for g in grads)
    if accumulators is not None:
        supported = supported and all(
            a.is_contiguous() and a.dtype == (torch.float64 if g.dtype == torch.float64 else torch.float32)
            for g, a in zip(grads, sums, strict=True)
        )
    return supported and can_launch(*grads, *sums)


class FusedGradients(MaterializedGradients):
    """Materialized per-example gradients whose norms and scaled sums run as Triton kernels (module docstring)."""

    def squared_norms(self) -> torch.Tensor:
        if not fused_supported(self.leaves):
            return super().squared_norms()
        with torch.profiler.record_function("opake::fused_squared_norms"):
            return _squared_norms(self._layout)

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        if not fused_supported(self.leaves, sums):
            super().add_scaled(scales, sums)
            return
        with torch.profiler.record_function("opake::fused_add_scaled"):
            _add_scaled(self._layout, scales, sums)

    @functools.cached_property
    def _layout(self) -> _Layout:
        return _Layout.of(self.leaves)


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
def _plan(m: int, leaves: tuple[tuple[int, torch.dtype], ...]) -> dict[str, Any]:
    """Tile tables (CPU int64) for leaves ``(numel per example, dtype)``; norm slots ordered by (leaf, example)."""
    tile = _NORM_BLOCK * _NORM_ITERS
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, (_, dtype) in enumerate(leaves):
        by_dtype.setdefault(dtype, []).append(index)
    local = {index: i for members in by_dtype.values() for i, index in enumerate(members)}
    norm_tables: dict[torch.dtype, list[list[int]]] = {dtype: [] for dtype in by_dtype}
    starts, slot = [0], 0
    for index, (numel, dtype) in enumerate(leaves):
        for example in range(m):
            for start in range(0, numel, tile):
                norm_tables[dtype].append([local[index], example, start, slot])
                slot += 1
            starts.append(slot)
    plan: dict[str, Any] = {"slots": slot, "starts": torch.tensor(starts, dtype=torch.int64), "dtypes": {}}
    for dtype, members in by_dtype.items():
        sum_table = [[i, start] for i, index in enumerate(members) for start in range(0, leaves[index][0], _SUM_BLOCK)]
        plan["dtypes"][dtype] = {
            "members": members,
            "numel": torch.tensor([leaves[i][0] for i in members], dtype=torch.int64),
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


@dataclass
class _Layout:
    """The chunk's contiguous gradients, their tile plan on the device and one address table per gradient dtype: made
    once and shared by both passes."""

    grads: list[torch.Tensor]
    plan: dict[str, Any]
    on_device: dict[str, Any]
    pointers: dict[torch.dtype, torch.Tensor]

    @staticmethod
    def of(grads: list[torch.Tensor]) -> _Layout:
        m, device = grads[0].shape[0], grads[0].device
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        plan = _plan(m, tuple((g.numel() // m, g.dtype) for g in grads))
        pointers = {
            dtype: _on_device([grads[i].data_ptr() for i in entry["members"]], device)
            for dtype, entry in plan["dtypes"].items()
        }
        return _Layout(grads, plan, _device_plan(plan, device), pointers)


def _squared_norms(layout: _Layout) -> torch.Tensor:
    grads, plan, on_device = layout.grads, layout.plan, layout.on_device
    m, device = grads[0].shape[0], grads[0].device
    partial = torch.empty(plan["slots"], dtype=torch.float64, device=device)
    for dtype in plan["dtypes"]:
        table = on_device["dtypes"][dtype]["norm_table"]
        if table.shape[0]:
            _sq_norm_kernel[(table.shape[0],)](
                table, layout.pointers[dtype], on_device["dtypes"][dtype]["numel"], partial,
                BLOCK=_NORM_BLOCK, ITERS=_NORM_ITERS, DTYPE=_tl_dtype(dtype),
            )  # fmt: skip
    leaf_sq = torch.empty(len(grads) * m, dtype=torch.float64, device=device)
    _segment_sum_kernel[(len(grads) * m,)](partial, on_device["starts"], leaf_sq, BLOCK=256)
    return leaf_sq.reshape(len(grads), m)


def _add_scaled(layout: _Layout, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
    grads, plan, on_device = layout.grads, layout.plan, layout.on_device
    m, device = grads[0].shape[0], grads[0].device
    for dtype, entry in plan["dtypes"].items():
        table = on_device["dtypes"][dtype]["sum_table"]
        if not table.shape[0]:
            continue
        members = entry["members"]
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        rows = scales[acc_dtype]
        if rows.stride(0) != 0:  # per-leaf scales: the rows of this dtype's leaves, in their order
            rows = torch.stack([rows[i] for i in members])
        _scale_sum_kernel[(table.shape[0],)](
            table, layout.pointers[dtype], _on_device([sums[i].data_ptr() for i in members], device),
            on_device["dtypes"][dtype]["numel"], rows, rows.stride(0), m,
            DTYPE=_tl_dtype(dtype), ACC=_tl_dtype(acc_dtype), BLOCK=_SUM_BLOCK,
        )  # fmt: skip
