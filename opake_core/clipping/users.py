"""Group clipping for user-level privacy: one user's rows as one example.

:func:`user_loss` turns a per-row loss into the loss of one user's slots (``[k, ...]`` rows and a ``[k]`` mask of
the real ones, as :func:`opake_core.sampling.filled_slots` lays a user-level batch out). Given to
:func:`~opake_core.clipping.clipped_grad` with the batch over users, each "example" is a user, so the per-example
gradient that is clipped to ``C`` is the user's summed gradient ``sum_r grad loss(row r)`` (``reduction="sum"``) or
their mean ``sum_r grad loss(row r) / n_u`` over the user's ``n_u`` real rows (``"mean"``). Either way one user moves
the clipped sum by at most ``C``, whatever the number of rows it has: the sensitivity of the Gaussian mechanism on the
sum is ``C`` per user.

The empty slots hold a copy of one of the user's own rows (so a batch never mixes users) and count for nothing: their
loss is replaced by an exact 0 (``torch.where``, not a product), so their gradient is exactly 0 wherever their forward
is finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake_core.errors import ConfigurationError

__all__ = ["REDUCTIONS", "user_loss", "user_total", "user_weights"]

REDUCTIONS = ("sum", "mean")


def user_weights(live: torch.Tensor, reduction: str) -> torch.Tensor:
    """The weight of each slot ``[..., k]`` (float32): 1 for a real row under ``"sum"``, ``1 / n_u`` under ``"mean"``
    (``n_u``: the user's real rows), 0 for an empty slot."""
    if reduction not in REDUCTIONS:
        raise ConfigurationError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    live = live.to(torch.float32)
    if reduction == "sum":
        return live
    return live / live.sum(dim=-1, keepdim=True).clamp(min=1.0)


def user_total(losses: torch.Tensor, live: torch.Tensor, reduction: str) -> torch.Tensor:
    """``[..., k]`` row losses -> ``[...]`` user losses: the empty slots' losses replaced by an exact 0 (their
    gradient is then exactly 0 wherever their forward is finite), the others weighted by :func:`user_weights`."""
    kept = torch.where(live, losses, torch.zeros_like(losses))
    return (kept * user_weights(live, reduction).to(kept.dtype)).sum(dim=-1)


def user_loss(row_loss: Callable[..., torch.Tensor], *, reduction: str = "sum") -> Callable[..., torch.Tensor]:
    """``loss(params, live, *rows) -> scalar``: the loss of one user's slots for :func:`clipped_grad`.

    Args:
        row_loss: ``row_loss(params, *row) -> scalar``, the per-example loss of record-level training.
        reduction: ``"sum"`` clips the user's summed gradient, ``"mean"`` the mean over its real rows.

    The returned function takes ``live`` ``[k]`` (bool: which slots are real rows) and the user's rows, each leaf
    ``[k, ...]``; give it to ``clipped_grad(..., batch_argnums=(1, 2, ...))`` with ``live`` ``[U, k]`` and rows
    ``[U, k, ...]``.

    Example: the user with two rows counts them both; the clipped contribution of each user is at most C = 1.

        >>> import torch
        >>> from opake_core import clipped_grad
        >>> from opake_core.clipping import user_loss
        >>> loss = user_loss(lambda w, x: x @ w)  # gradient of a row: the row itself
        >>> rows = torch.tensor([[[0.3, 0.0], [0.4, 0.0]], [[0.0, 0.5], [9.0, 9.0]]])  # 2 users x 2 slots
        >>> live = torch.tensor([[True, True], [True, False]])  # the second user has one row
        >>> grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2))
        >>> clipped, _ = grad_fn(torch.zeros(2), live, rows, state=state)
        >>> clipped.value  # (0.3 + 0.4, 0) + (0, 0.5): both below C, and the empty slot adds nothing
        tensor([0.7000, 0.5000])
    """
    if not callable(row_loss):
        raise ConfigurationError(f"row_loss must be callable, got {type(row_loss).__name__}.")
    user_weights(torch.ones(1, dtype=torch.bool), reduction)  # refuses an unknown reduction now

    def loss(params: Any, live: torch.Tensor, *rows: Any) -> torch.Tensor:
        return user_total(torch.vmap(row_loss, in_dims=(None, *[0] * len(rows)))(params, *rows), live, reduction)

    return loss
