"""User-level privacy in the trainer (``privacy_unit="user"``): the users of the dataset, their batches and losses.

With ``privacy_unit="user"`` a neighbouring dataset adds or removes **all the rows of one user** (a person, or a
document: any value of the column ``privacy_user_column``). The run then works over users:

* :func:`read_users` reads the user of every row once per ``train()`` (every row is read anyway by the data check);
  users are numbered in order of first appearance, and the plan is built over their number ``U``: the sampler draws
  users (Poisson at ``q_u = per_device_train_batch_size / U`` by default), the accountant sees ``q_u``, the default
  delta is ``1 / U**1.1``, and an epoch is one pass over the users;
* each sampled user contributes at most ``privacy_max_rows_per_user`` of its rows
  (:func:`opake_core.sampling.by_user`), and a step's batch is laid out users x slots (:func:`user_batch`): every
  tensor ``[U_s, k, ...]``, and :data:`LIVE` ``[U_s, k]`` saying which slots hold a real row (an empty slot holds a
  copy of one of the user's own rows, so that no slot mixes users);
* the per-example loss is the user's (:func:`user_example_loss`, :func:`user_batch_losses`): the mean (default) or
  the sum of its rows' losses, so that the gradient the step clips to ``C`` is the user's whole contribution. The
  layerwise engine runs the user's rows as one example (``LayerwiseGradients(grouped=True)``), vmap runs each user.

Not combined with: the MoE router release (its statistic is released per row: refused by the settings) and
trainers that log per-example metrics (TRL's: refused by :func:`check_trainer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from opake_core import sampling
from opake_core.clipping.users import user_total
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "LIVE",
    "Users",
    "check_trainer",
    "read_users",
    "slot_array",
    "user_batch",
    "user_batch_losses",
    "user_example_loss",
    "users_of",
    "without_column",
]

LIVE = "opake_live_rows"
"""The batch key of the ``[users, k]`` bool mask of real rows (dropped before the model runs)."""


@dataclass(frozen=True, eq=False)
class Users:
    """The users of a training dataset.

    Attributes:
        row_users: ``[N]`` int64, the user (numbered from 0 in order of first appearance) of each row.
        column: the dataset column they were read from.
        max_rows: ``k``, the most rows a sampled user contributes to a step.
        reduction: ``"mean"`` or ``"sum"`` of a user's row losses.
    """

    row_users: np.ndarray = field(repr=False)
    column: str
    max_rows: int
    reduction: str

    @property
    def count(self) -> int:
        """``U``, the number of users."""
        return int(self.row_users.max()) + 1 if len(self.row_users) else 0

    def sampler(self, users: Any) -> sampling.ByUser:
        """The user-level sampler over ``users``, a sampler of the plan built over :attr:`count` users."""
        return sampling.by_user(users, row_users=self.row_users, max_rows_per_user=self.max_rows)

    def first(self, count: int) -> np.ndarray:
        """The slot array of the first ``count`` users (each with its first ``k`` rows): what the engine checks run
        on in place of the first rows."""
        rows = [np.flatnonzero(self.row_users == u)[: self.max_rows] for u in range(min(count, self.count))]
        slots = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            slots[i, : len(r)] = r
        return slots


def users_of(privacy: Any, dataset: Any) -> Users | None:
    """The users of ``dataset`` under the privacy settings ``privacy`` (``args.privacy``), None for record level."""
    if not privacy.user_level:
        return None
    return read_users(
        dataset,
        privacy.privacy_user_column,
        max_rows=privacy.privacy_max_rows_per_user,
        reduction=privacy.privacy_user_reduction,
    )


def read_users(dataset: Any, column: str, *, max_rows: int, reduction: str) -> Users:
    """The users of ``dataset`` from its column ``column``: each value must be an int or a str (a user id, a
    document id); ConfigurationError naming the first row without one (never its value: rows are private)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list | tuple) and column not in names:
        raise ConfigurationError(
            f"privacy_user_column={column!r} is not a column of the training dataset (its columns: {list(names)})."
        )
    values = list(dataset[column]) if isinstance(names, list | tuple) else None  # a datasets.Dataset: one read
    ids: dict[Any, int] = {}
    row_users = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        if values is not None:
            value = values[i]
        else:
            row = dataset[i]
            if not isinstance(row, Mapping) or column not in row:
                raise ConfigurationError(
                    f"train_dataset row {i} has no column {column!r} (privacy_user_column): every row must name its "
                    "user."
                )
            value = row[column]
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise InputTypeError(
                f"privacy_user_column={column!r} must hold an int or a str in every row (a user or document id); row "
                f"{i} holds a {type(value).__name__}."
            )
        row_users[i] = ids.setdefault(value, len(ids))
    return Users(row_users, column, max_rows, reduction)


def without_column(keep: set[str] | None, dataset: Any, column: str) -> set[str]:
    """The columns a batch keeps (``keep``; None: all the columns of ``dataset``'s first row) less ``column``."""
    if keep is None:
        names = getattr(dataset, "column_names", None)
        keep = set(names) if isinstance(names, list | tuple) else set(dataset[0]) if len(dataset) else set()
    return set(keep) - {column}


def check_trainer(trainer: Any) -> None:
    """Refuse, at construction, a trainer whose step cannot run over users."""
    if getattr(trainer, "_example_metrics", None) is not None:
        raise ConfigurationError(
            f"privacy_unit='user' is not supported by {type(trainer).__name__}, which logs per-example metrics: they "
            "are computed per row, not per user. Use DPTrainer, or privacy_unit='record'."
        )


def user_batch(fetch_rows: Callable[[np.ndarray], dict[str, torch.Tensor]], slots: np.ndarray) -> dict:
    """The batch of the slot array ``slots`` ``[U_s, k]`` (:meth:`opake_core.sampling.ByUser.sample`):
    ``fetch_rows(rows)`` collates the rows ``[U_s * k]`` (empty slots filled with their user's first row), and every
    tensor comes back ``[U_s, k, ...]``, with :data:`LIVE` ``[U_s, k]``. An empty draw is a batch of 0 users."""
    rows, live = sampling.filled_slots(slots)
    k = max(1, rows.shape[1])
    flat = fetch_rows(rows.reshape(-1))
    batch = {name: value.reshape(len(rows), k, *value.shape[1:]) for name, value in flat.items()}
    device = next(iter(flat.values())).device if flat else None
    batch[LIVE] = torch.as_tensor(live, device=device).reshape(len(rows), k)
    return batch


def slot_array(counts: Sequence[int]) -> np.ndarray:
    """The slot array of users laid out one after the other: user ``i`` holds the next ``counts[i]`` rows."""
    slots = np.full((len(counts), max(counts, default=0)), -1, dtype=np.int64)
    start = 0
    for i, count in enumerate(counts):
        slots[i, :count] = np.arange(start, start + count)
        start += count
    return slots


def _rows(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in batch.items() if name != LIVE}


def user_example_loss(row_loss: Callable[..., torch.Tensor], reduction: str) -> Callable[..., torch.Tensor]:
    """``(params, user) -> loss``: one user's loss for ``vmap(grad)`` from ``row_loss(params, row)``, the record-level
    per-example loss (``user`` holds ``[k, ...]`` tensors and :data:`LIVE` ``[k]``)."""

    def loss(params: dict[str, torch.Tensor], user: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = torch.vmap(row_loss, in_dims=(None, 0), randomness="different")(params, _rows(user))
        return user_total(losses, user[LIVE], reduction)

    return loss


def user_batch_losses(batch_losses: Callable[..., torch.Tensor], reduction: str) -> Callable[..., torch.Tensor]:
    """``(params, batch) -> [U_s]``: each user's loss from one batched forward of all the slots' rows
    (``batch_losses(params, rows) -> [U_s * k]``, the record-level batched loss), for the layerwise engine."""

    def losses(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        live = batch[LIVE]
        rows = {name: value.flatten(0, 1) for name, value in _rows(batch).items()}
        return user_total(batch_losses(params, rows).reshape(live.shape), live, reduction)

    return losses
