"""Functional optimizers built on torchopt, and learning-rate schedules.

Every factory returns an :class:`Optimizer` with ``init(params) -> state`` and
``update(updates, state, *, params=None) -> (updates, new_state)``; :func:`apply_updates` adds the updates to
the parameters. Nothing is modified in place. ``update`` takes a :class:`~opake_core.tree.Noised` tree; it
refuses a clipped tree that was not noised, and a plain tree unless the optimizer was built with
``non_private=True``. See ``docs/optimizers.md``.
"""

from opake_core.optim import schedules
from opake_core.optim._apply import apply_updates
from opake_core.optim._guard import Optimizer
from opake_core.optim.adafactor import adafactor
from opake_core.optim.adam import adam, adamw
from opake_core.optim.bias_correction import VARIANCE_FLOOR
from opake_core.optim.sgd import momentum, sgd

__all__ = [
    "VARIANCE_FLOOR",
    "Optimizer",
    "adafactor",
    "adam",
    "adamw",
    "apply_updates",
    "momentum",
    "schedules",
    "sgd",
]
