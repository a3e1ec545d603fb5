"""The per-example gradient engine of Dirac canary runs: the canary block's gradients written down beside another
engine's gradients of the real leaves, so that a step costs in proportion to the batch, not the batch times the
canaries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core.clipping.engine import VMAP
from opake_core.clipping.engine import example_grad as opake_example_grad
from opake_core.errors import ConfigurationError
from opake_torch.auditing.canaries import CANARY_LEAF, REAL_ROW, DiracCanaries

__all__ = ["DiracGradients"]


@dataclass(frozen=True)
class DiracGradients:
    """The ``gradients`` of an :class:`~opake_core.clipping.Engine` for the loss of
    :func:`~opake_torch.auditing.canaries.with_dirac_canaries`
    (``Engine(gradients=DiracGradients(loss_fn, canaries))``): the real leaves' per-example gradients come from
    ``inner`` on the real rows' loss (``loss_fn``, zero on canary slots), and the canary block's are written down,
    ``gradient_norm * e_j`` for included canary ``j`` and zero for every other row, instead of being materialized
    ``[rows, m]`` by ``vmap(grad)``. The clipping rule, the scaled sum and everything after them are the library's
    own; the clipped sum equals the default engine's (the canary coordinates bit for bit), at a cost that grows with
    the batch, not with the batch times the number of canaries.

    Args:
        loss_fn: ``loss_fn(params, *example)`` for one real example, as given to
            :func:`~opake_torch.auditing.canaries.with_dirac_canaries`.
        canaries: the canaries of that loss.
        inner: the engine's ``gradients`` for the real leaves (default: ``vmap(grad)``).
    """

    loss_fn: Callable[..., torch.Tensor]
    canaries: DiracCanaries
    inner: Callable[..., tuple[Any, Any]] = VMAP.gradients

    def __call__(self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]) -> Any:
        params, *batch, slots = args
        if not isinstance(params, dict) or CANARY_LEAF not in params or batch_argnums != tuple(range(1, len(args))):
            raise ConfigurationError(
                "DiracGradients serves the loss of with_dirac_canaries: loss(params, *example, slot) with the "
                f"parameters (a dict holding {CANARY_LEAF!r}) first and every other argument batched."
            )
        real = {k: v for k, v in params.items() if k != CANARY_LEAF}
        real_grad = opake_example_grad(_real_rows_loss(self.loss_fn), 0, False)
        grads, values = self.inner(real_grad, (real, *batch, slots), batch_argnums)
        block = params[CANARY_LEAF]
        leaves = optree.tree_leaves(params)
        position = next(i for i, leaf in enumerate(leaves) if leaf is block)
        included = slots >= 0
        norm = self.canaries.gradient_norm
        values = values + torch.where(included, norm * block[slots.clamp(min=0)], 0.0).to(values.dtype)
        return _WithCanaryBlock(grads, position, slots, norm), values


def _real_rows_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        *inputs, slot = example
        real = loss_fn(params, *inputs)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real))

    return loss


class _WithCanaryBlock:
    """The real leaves' per-example gradients with the canary block inserted at leaf ``position``: row ``i``'s
    canary gradient is ``norm * e_{slot_i}`` for an included canary's row (``slot_i >= 0``), zero otherwise."""

    def __init__(self, real: Any, position: int, slots: torch.Tensor, norm: float) -> None:
        self.real, self.position, self.slots, self.norm = real, position, slots, norm

    def squared_norms(self) -> torch.Tensor:
        rows = self.real.squared_norms()
        canary = torch.where(self.slots >= 0, self.norm**2, 0.0).to(torch.float64)
        return torch.cat([rows[: self.position], canary[None], rows[self.position :]])

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        k = self.position
        block = sums[k]
        self.real.add_scaled({d: _without_row(s, k) for d, s in scales.items()}, sums[:k] + sums[k + 1 :])
        scale = scales[block.dtype][k]
        norm = torch.full_like(scale, self.norm)  # the canary's gradient entry in the sum's dtype, then scaled
        contribution = torch.where(self.slots >= 0, norm * scale, 0.0)  # a row holds one canary at most
        block.index_add_(0, self.slots.clamp(min=0), contribution)


def _without_row(rows: torch.Tensor, k: int) -> torch.Tensor:
    """``[L, m]`` scales without row ``k`` (still a stride-0 view when all rows are one)."""
    if not rows.stride(0):
        return rows[0].expand(rows.shape[0] - 1, -1)
    return torch.cat([rows[:k], rows[k + 1 :]])
