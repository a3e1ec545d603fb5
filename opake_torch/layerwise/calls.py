"""One call of a supported layer as the engine records it, and the views of its tensors the layer arithmetic reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opake_torch.layerwise.experts import Routing

__all__ = ["Call", "by_example", "cast", "live_ids", "same_tensor"]


@dataclass
class Call:
    """One call of a supported layer: its input, and the gradient of its output once the backward reached it."""

    kind: str
    module: nn.Module
    names: dict[str, str]  # attribute -> trainable name
    inputs: torch.Tensor | None  # None for the forward of a checkpointed layer, which keeps nothing
    positions: int  # T: the positions of one example the layer runs on
    grad: torch.Tensor | None = None
    input_key: tuple[Any, ...] | None = None  # the identity of ``inputs`` (:func:`same_tensor`)
    routing: Routing | None = None  # kind "experts": which rows went to which expert
    transposed: bool = False  # kind "experts": weights stored ``[E, in, out]`` instead of ``[E, out, in]``
    gate: torch.Tensor | None = None  # kind "gated_rms_norm": the gate input
    version: int | None = None  # ``inputs._version`` when recorded: an in-place change since then is refused


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is: no dispatch for a no-op conversion)."""
    return x if x.dtype == dtype else x.to(dtype)


def by_example(x: torch.Tensor, m: int) -> torch.Tensor:
    """``[m, ..., d]`` as ``[m, T, d]`` (``T = 1`` for a layer applied once per example); the ``[m k, T, d]`` rows
    of grouped examples (example-major) as ``[m, k T, d]``: an example's rows as one example of ``k T`` positions.
    ``x`` itself where it is ``[m, T, d]`` already (no operator dispatched: this runs several times per layer call)."""
    if x.dim() == 3 and x.shape[0] == m:
        return x
    return x.reshape(m, -1, x.shape[-1])


def live_ids(call: Call, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding call's ids ``[m, T]`` and which of them get a gradient (not ``padding_idx``)."""
    ids = call.inputs.reshape(m, -1)
    pad = call.module.padding_idx
    return ids, (ids != pad) if pad is not None else torch.ones_like(ids, dtype=torch.bool)


def same_tensor(x: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a layer input among the calls of one pass (q, k and v read the same hidden states)."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
