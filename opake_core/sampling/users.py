"""User-level sampling: a sampler over users, each sampled user contributing at most ``k`` of its rows.

Record-level DP protects one row. When one person (or one document) spans many rows, the unit to protect is the
user: neighbouring datasets differ by **all** the rows of one user. :func:`by_user` turns any sampler of this package
into a user-level one:

* the wrapped sampler draws **users** (its ``dataset_size`` is the number of users ``U``), so its accountant, at its
  rate over users (``q_u = B_u / U`` for Poisson), is the run's: the accounting of a user-level run is the accounting
  of the same sampler over users, unchanged;
* each sampled user ``u`` contributes ``min(n_u, k)`` of its ``n_u`` rows, chosen uniformly at random without
  looking at their content, from ``numpy_generator(fold_in(key, TAG, step))`` (a stream of its own, so a batch
  still depends on (key, step) alone and replays on resume).

A draw is a slot array ``[U_s, k_s]`` of int64 row indices (``U_s`` sampled users in increasing order, ``k_s`` the
most rows any of them contributes, at most ``k``), ``-1`` in the slots a user does not fill. Its sensitivity is
whatever bounds one user's contribution: clip each user's summed (or averaged) gradient to ``C``
(:func:`opake_core.clipping.user_loss` turns a per-row loss into the per-user loss that :func:`clipped_grad` then
clips), and the Gaussian mechanism on the sum has sensitivity ``C`` per user. The normalizer of the clipped sum is the
expected number of users, :attr:`ByUser.expected_batch_size`.

Cost: the wrapped sampler's, plus O(rows of the sampled users) per step. Chua et al. 2024 ("Mind the Privacy Unit!
User-Level Differential Privacy for Language Model Fine-Tuning", arXiv 2406.14322) call this user-level sampling
(ULS), and compare it with example-level sampling of a dataset capped at ``k`` rows per user accounted by group
privacy (ELS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["ByUser", "by_user", "filled_slots"]

TAG = "opake.sampling.by_user"
UNIT_KEYS = ("max_rows_per_user", "num_rows", "unit")
"""The configuration entries a user-level sampler adds to its user sampler's (checked on resume)."""


@dataclass(frozen=True, eq=False)
class ByUser:
    """A user-level sampler (build it with :func:`by_user`).

    It reads as its user sampler everywhere but :meth:`sample`: ``dataset_size`` (the number of users),
    ``sample_rate``, ``expected_batch_size`` (users), :meth:`process` and the sampler's other attributes (``bands``,
    ``num_bins``, ...) are the user sampler's, so that a plan or an accountant given this sampler accounts the
    user sampler over users. ``config`` is the user sampler's with ``unit``, ``max_rows_per_user`` and ``num_rows``
    added, so that a state of a record-level run, or of another cap or dataset, is refused on resume.
    """

    users: Any
    row_users: np.ndarray = field(repr=False)  # [num_rows] int64: the user of each row, in [0, users.dataset_size)
    max_rows_per_user: int
    _order: np.ndarray = field(init=False, repr=False, compare=False)  # rows sorted by user (stable)
    _starts: np.ndarray = field(init=False, repr=False, compare=False)  # [U + 1]: user u's rows are
    # _order[_starts[u]:_starts[u + 1]]

    def __post_init__(self) -> None:
        if not hasattr(self.users, "sample") or not hasattr(self.users, "config"):
            raise InputTypeError(f"users must be an opake_core.sampling sampler, got {type(self.users).__name__}.")
        if isinstance(self.users, ByUser):
            raise ConfigurationError("by_user wraps a sampler over users, not another user-level sampler.")
        k = validate.integer("max_rows_per_user", self.max_rows_per_user, minimum=1)
        object.__setattr__(self, "max_rows_per_user", k)
        rows = np.asarray(self.row_users)
        if rows.ndim != 1 or rows.size == 0 or not np.issubdtype(rows.dtype, np.integer):
            raise InputTypeError(
                f"row_users must be a non-empty 1-D integer array (the user index of each row), got dtype "
                f"{rows.dtype} and shape {rows.shape}."
            )
        num_users = self.users.dataset_size
        if rows.min() < 0 or rows.max() >= num_users:
            raise ConfigurationError(
                f"row_users must hold user indices in [0, {num_users}) (the user sampler's dataset_size is the number "
                f"of users), got values in [{rows.min()}, {rows.max()}]."
            )
        rows = rows.astype(np.int64)
        rows.flags.writeable = False
        object.__setattr__(self, "row_users", rows)
        object.__setattr__(self, "_order", np.argsort(rows, kind="stable"))
        counts = np.bincount(rows, minlength=num_users)
        object.__setattr__(self, "_starts", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    def __getattr__(self, name: str) -> Any:
        # the user sampler's attributes (dataset_size, sample_rate, bands, ...); not for private or dunder names,
        # which must fail as usual (copy and pickle probe them before the fields exist)
        if name.startswith("_") or name == "users":
            raise AttributeError(name)
        return getattr(self.users, name)

    @property
    def num_users(self) -> int:
        """``U``, the number of users (the user sampler's ``dataset_size``)."""
        return self.users.dataset_size

    @property
    def num_rows(self) -> int:
        return len(self.row_users)

    @property
    def expected_batch_size(self) -> float:
        """The expected number of **users** in a batch: the public normalizer of the clipped sum."""
        return self.users.expected_batch_size

    @property
    def rows_per_user(self) -> np.ndarray:
        """``[U]`` int64: each user's number of rows in the dataset."""
        return np.diff(self._starts)

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        added = (("max_rows_per_user", self.max_rows_per_user), ("num_rows", self.num_rows), ("unit", "user"))
        return tuple(sorted((*self.users.config, *added)))

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The slot array ``[U_s, k_s]`` of step ``state.step`` (see the module docstring) and the next state."""
        state = check_state(state, self.config)
        users, inner = self.users.sample(key, SamplerState(state.step, self.users.config, state.carry))
        slots = self.rows_of(users, numpy_generator(fold_in(key, TAG, state.step)))
        return slots, SamplerState(inner.step, state.config, inner.carry)

    def rows_of(self, users: np.ndarray, gen: np.random.Generator) -> np.ndarray:
        """The slot array of the sorted users ``users``: up to ``k`` of each one's rows, a uniform subset drawn with
        ``gen`` (one uniform number per row of the users, so the choice never reads the rows' content), each user's
        rows in increasing order; users without rows are left out."""
        users = np.asarray(users, dtype=np.int64)
        counts = self._starts[users + 1] - self._starts[users]
        users, counts = users[counts > 0], counts[counts > 0]
        k = int(min(self.max_rows_per_user, counts.max(initial=0)))
        slots = np.full((len(users), k), -1, dtype=np.int64)
        if not len(users):
            return slots
        owner = np.repeat(np.arange(len(users)), counts)  # the sampled user (its place) of each candidate row
        offset = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)  # its place among them
        candidates = self._order[np.repeat(self._starts[users], counts) + offset]
        order = np.lexsort((gen.random(len(owner)), owner))  # each user's rows in a uniformly random order
        keep = offset < k  # owners are contiguous in both orders: place p of ``order`` is its user's offset[p]-th
        slots[owner[keep], offset[keep]] = candidates[order][keep]
        empty = np.iinfo(np.int64).max  # sorts last: each user's rows in increasing order, then its empty slots
        slots = np.sort(np.where(slots >= 0, slots, empty), axis=1)
        return np.where(slots == empty, -1, slots)

    def process(self, *args: Any, **kwargs: Any) -> Any:
        """The user sampler's accounting process: the run is accounted over users."""
        return self.users.process(*args, **kwargs)


def by_user(sampler: Any, *, row_users: Any, max_rows_per_user: int) -> ByUser:
    """The user-level version of ``sampler``, a sampler over users (its ``dataset_size`` is the number of users).

    Args:
        sampler: any sampler of :mod:`opake_core.sampling` built over ``U`` users (``dataset_size=U``, the rate per
            user: ``q_u = expected users per step / U``).
        row_users: ``[N]`` integers in ``[0, U)``: the user of each of the dataset's ``N`` rows (public to the
            sampler, not released: neighbouring datasets differ by one user and all its rows).
        max_rows_per_user: ``k``, the most rows a sampled user contributes to one step.

    Example: Poisson over 4 users at rate 1/2, at most 2 rows each; a user's rows are its own, and a draw replays.

        >>> import numpy as np
        >>> from opake_core import random, sampling
        >>> users = sampling.poisson(dataset_size=4, sample_rate=0.5)
        >>> sampler = sampling.by_user(users, row_users=np.array([0, 0, 0, 1, 2, 2, 3]), max_rows_per_user=2)
        >>> slots, state = sampler.sample(random.key(1), sampler.init())
        >>> slots.shape[1] <= 2, all(len(set(sampler.row_users[row[row >= 0]])) == 1 for row in slots)
        (True, True)
        >>> np.array_equal(slots, sampler.sample(random.key(1), sampler.init())[0])
        True
        >>> sampler.expected_batch_size, sampler.dataset_size  # users, as the accountant sees them
        (2.0, 4)
    """
    return ByUser(sampler, row_users, max_rows_per_user)


def filled_slots(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, live)``: the slot array with each empty slot (-1) holding its user's first row, and ``[U_s, k_s]``
    bool, which slots are real. A batch laid out this way never mixes users; a loss weighted by ``live``
    (:func:`opake_core.clipping.user_loss`) gives the filled slots a zero gradient.

    Example:

        >>> import numpy as np
        >>> from opake_core import sampling
        >>> rows, live = sampling.filled_slots(np.array([[3, 5], [7, -1]]))
        >>> rows.tolist(), live.tolist()
        ([[3, 5], [7, 7]], [[True, True], [True, False]])
    """
    slots = np.asarray(slots, dtype=np.int64)
    if slots.ndim != 2 or (slots.size and (slots[:, 0] < 0).any()):
        raise InputTypeError("slots must be a [users, k] array whose first slot of every user holds a row.")
    live = slots >= 0
    return np.where(live, slots, slots[:, :1]), live
