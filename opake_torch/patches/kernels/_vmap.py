"""Helpers for the explicit ``vmap`` staticmethods: move the vmapped dimension to the front (or broadcast an
unbatched input to it), so that the batch becomes more rows (or more groups) of the same kernel."""

from __future__ import annotations

import torch


def front(x: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """``x`` with the vmapped dimension first, ``[size, ...]``; an unbatched ``x`` is expanded (a view)."""
    if x is None:
        return None
    if dim is None:
        return x.unsqueeze(0).expand(size, *x.shape)
    return x.movedim(dim, 0)


def fold(x: torch.Tensor) -> torch.Tensor:
    """Merge the first two dimensions ``[B, G, ...] -> [B * G, ...]``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
