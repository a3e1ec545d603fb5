"""Microbatching: a batch of ``B`` examples as chunks of at most ``microbatch_size``, each clipped and summed at once.

Per-example gradients never exist for more than one chunk; the chunks' clipped sums are added into the first chunk's
accumulators (float32, float64 for float64 parameters), so the result does not depend on the chunk size beyond float
summation order. With ``pad`` (a chunk transform that wants one shape), the last chunk is padded to the full chunk
size with copies of its last example, marked dead (``live`` False) so that they add exactly nothing; their norms,
flags and values are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["Chunked", "batch_size", "run_chunks"]


@dataclass(frozen=True)
class Chunked:
    """The chunks of one batch put together.

    Attributes:
        size: ``B``, the realized number of examples.
        sums: the clipped sum, one tensor per leaf (the first chunk's accumulators); None for an empty batch.
        norms: float32 ``[B]`` per-example norms before clipping.
        clipped: bool ``[B]``, whether an example exceeded its bound (any group).
        values: per chunk, the values the engine returned for its real rows.
    """

    size: int
    sums: list[torch.Tensor] | None
    norms: torch.Tensor | None
    clipped: torch.Tensor | None
    values: list[Any]


def batch_size(batch: Sequence[Any]) -> int:
    """The common leading dimension ``B`` of every tensor in the batched arguments."""
    sizes = {
        leaf.shape[0] if leaf.dim() else -1 for leaf in optree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)
    }
    if not sizes:
        raise InputTypeError("the batch arguments hold no tensor; per-example arguments must be tensors [B, ...].")
    if -1 in sizes or len(sizes) != 1:
        raise ConfigurationError(
            f"every batched tensor needs the same leading batch dimension, got sizes {sorted(sizes)}."
        )
    return sizes.pop()


def run_chunks(
    chunk: Callable[..., tuple[Any, ...]],
    head: tuple[Any, ...],
    args: Sequence[Any],
    batch_argnums: tuple[int, ...],
    *,
    microbatch_size: int | None,
    pad: bool,
    device: torch.device,
) -> Chunked:
    """Run ``chunk(*head, live, *chunk_args)`` on consecutive chunks of ``microbatch_size`` rows (the whole batch for
    None) of the batched arguments, the others passed whole, and put the results together.

    ``chunk`` returns ``(sums, norms [m], clipped [m], values)`` with fresh sums. ``live`` is None without ``pad``;
    with it, every chunk has ``microbatch_size`` rows and ``live`` (bool ``[microbatch_size]``) marks the real ones.
    """
    n = batch_size([args[i] for i in batch_argnums])
    chunk_size = microbatch_size or max(n, 1)
    pad = pad and microbatch_size is not None
    all_live = torch.ones(chunk_size, dtype=torch.bool, device=device) if pad else None
    sums, norms, clipped, values = None, [], [], []
    for start in range(0, n, chunk_size):
        real = min(chunk_size, n - start)
        rows = _rows(start, real, chunk_size if pad else real, device)
        sliced = [_take(a, rows) if i in batch_argnums else a for i, a in enumerate(args)]
        live = all_live
        if pad and real < chunk_size:
            live = torch.arange(chunk_size, device=device) < real
        part, chunk_norms, chunk_clipped, chunk_values = chunk(*head, live, *sliced)
        if sums is None:
            sums = part
        else:
            torch._foreach_add_(sums, part)
        norms.append(chunk_norms[:real])
        clipped.append(chunk_clipped[:real])
        values.append(optree.tree_map(lambda x, real=real: x[:real], chunk_values))
    if not norms:
        return Chunked(0, None, None, None, [])
    return Chunked(n, sums, torch.cat(norms), torch.cat(clipped), values)


def _rows(start: int, real: int, size: int, device: torch.device) -> slice | torch.Tensor:
    """The batch rows of one chunk: a slice, or (padded) the indices with the last real row repeated."""
    if size == real:
        return slice(start, start + real)
    return start + torch.arange(size, device=device).clamp(max=real - 1)


def _take(tree: Any, rows: slice | torch.Tensor) -> Any:
    if isinstance(rows, slice):
        return optree.tree_map(lambda x: x[rows] if isinstance(x, torch.Tensor) else x, tree)
    return optree.tree_map(lambda x: x[rows.to(x.device)] if isinstance(x, torch.Tensor) else x, tree)
