"""Microbatching: a batch of ``B`` examples as chunks of at most ``microbatch_size``, each clipped and summed at once.

Per-example gradients never exist for more than one chunk; the chunks' clipped sums are added into the first chunk's
accumulators (float32, float64 for float64 parameters), so the result does not depend on the chunking beyond float
summation order.

A batch of ``B`` rows runs as ``k = ceil(B / microbatch_size)`` chunks of as equal a size as possible (a Poisson draw a
little above the chunk size runs as two half chunks, not a full one and a sliver). Each chunk's rows are then rounded up
to a multiple of ``row_multiple``, and to at least ``min_rows`` (both capped at ``microbatch_size``), so that a varying
batch size meets a few shapes only: ``ceil(microbatch_size / row_multiple)`` of them (one, the full ``microbatch_size``,
when ``row_multiple >= microbatch_size``). The extra rows are copies of the chunk's last example, marked dead (``live``
False) so that they add exactly nothing; their norms, flags and values are dropped. With ``pad`` (a chunk transform,
which captures or compiles one function per shape) every chunk gets a ``live`` mask, dead rows or not, so that its
arguments have the same structure at every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["Chunked", "batch_size", "chunk_sizes", "run_chunks"]


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
    """The common leading dimension ``B`` of every tensor in the batched arguments, which hold tensors only."""
    other = next((leaf for leaf in optree.tree_leaves(batch) if not isinstance(leaf, torch.Tensor)), None)
    if other is not None:
        raise InputTypeError(
            f"the per-example (batched) arguments must hold tensors [B, ...] only, got a {type(other).__name__} "
            f"{other!r:.40}; pass values shared by every example as arguments outside batch_argnums."
        )
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


def chunk_sizes(
    n: int, microbatch_size: int | None, *, row_multiple: int = 1, min_rows: int = 1
) -> list[tuple[int, int]]:
    """``(real rows, rows run)`` of each chunk of a batch of ``n`` examples (module docstring); ``[]`` for ``n=0``."""
    if n == 0:
        return []
    if microbatch_size is None:
        return [(n, n)]
    count = -(-n // microbatch_size)
    base, extra = divmod(n, count)
    reals = [base + 1] * extra + [base] * (count - extra)
    return [(real, min(microbatch_size, max(min_rows, -(-real // row_multiple) * row_multiple))) for real in reals]


def run_chunks(
    chunk: Callable[..., tuple[Any, ...]],
    head: tuple[Any, ...],
    args: Sequence[Any],
    batch_argnums: tuple[int, ...],
    *,
    microbatch_size: int | None,
    pad: bool,
    device: torch.device,
    row_multiple: int | None = None,
    min_rows: int = 1,
) -> Chunked:
    """Run ``chunk(*head, live, *chunk_args)`` on the chunks of :func:`chunk_sizes` (the whole batch for a None
    ``microbatch_size``) of the batched arguments, the others passed whole, and put the results together.

    ``chunk`` returns ``(sums, norms [m], clipped [m], values)`` with fresh sums for the ``m`` rows it ran. ``live``
    (bool ``[m]``) marks the real rows of a chunk that has dead ones, and of every chunk with ``pad`` and a
    ``microbatch_size`` (all true where it has none); otherwise None. ``row_multiple`` None: the whole
    ``microbatch_size`` with ``pad`` (one shape), 1 without; ``min_rows``: the fewest rows a chunk runs.
    """
    n = batch_size([args[i] for i in batch_argnums])
    pad = pad and microbatch_size is not None
    if row_multiple is None:
        row_multiple = microbatch_size if pad else 1
    sizes = chunk_sizes(n, microbatch_size, row_multiple=row_multiple, min_rows=min_rows)
    sums, norms, clipped, values, start = None, [], [], [], 0
    for real, size in sizes:
        rows = _rows(start, real, size, device, gather=pad)
        sliced = [_take(a, rows) if i in batch_argnums else a for i, a in enumerate(args)]
        live = torch.arange(size, device=device) < real if (pad or real < size) else None
        part, chunk_norms, chunk_clipped, chunk_values = chunk(*head, live, *sliced)
        if sums is None:
            sums = part
        else:
            torch._foreach_add_(sums, part)
        norms.append(chunk_norms[:real])
        clipped.append(chunk_clipped[:real])
        values.append(optree.tree_map(lambda x, real=real: x[:real], chunk_values))
        start += real
    if not norms:
        return Chunked(0, None, None, None, [])
    return Chunked(n, sums, torch.cat(norms), torch.cat(clipped), values)


def _rows(start: int, real: int, size: int, device: torch.device, *, gather: bool) -> slice | torch.Tensor:
    """The batch rows of one chunk: a slice, or (padded, or ``gather``) the indices with the last real row repeated.
    ``gather`` (a chunk transform): every chunk gets copies, never views of the batch, so that a chunk with and
    without dead rows meets the same compiled function (Dynamo guards a view's base)."""
    if size == real and not gather:
        return slice(start, start + real)
    return start + torch.arange(size, device=device).clamp(max=real - 1)


def _take(tree: Any, rows: slice | torch.Tensor) -> Any:
    if isinstance(rows, slice):
        return optree.tree_map(lambda x: x[rows] if isinstance(x, torch.Tensor) else x, tree)
    return optree.tree_map(lambda x: x[rows.to(x.device)] if isinstance(x, torch.Tensor) else x, tree)
