"""Functional optimizers built on torchopt, and learning-rate schedules.

Every factory returns an :class:`Optimizer` with ``init(params) -> state`` and
``update(updates, state, *, params=None) -> (updates, new_state)``; :func:`apply_updates` adds the updates to
the parameters. Nothing is modified in place. ``update`` takes a :class:`~opake_core.tree.Noised` tree; it
refuses a clipped tree that was not noised, and a plain tree unless the optimizer was built with
``non_private=True``. ``Optimizer.eval_params(state, params)`` gives the weights to evaluate and publish: the
parameters themselves, except for :func:`schedule_free_adamw` and :func:`schedule_free` (the averaged iterate).
See ``docs/optimizers.md``.
"""

from opake_core.optim import schedules
from opake_core.optim._apply import apply_updates
from opake_core.optim._guard import Optimizer
from opake_core.optim.adadelta import adadelta
from opake_core.optim.adafactor import adafactor
from opake_core.optim.adagrad import adagrad
from opake_core.optim.adam import adam, adamw
from opake_core.optim.ademamix import ademamix
from opake_core.optim.lion import lion
from opake_core.optim.private_moments import MomentsOptimizer, private_moments_adam
from opake_core.optim.radam import radam
from opake_core.optim.rmsprop import rmsprop
from opake_core.optim.schedule_free import schedule_free, schedule_free_adamw
from opake_core.optim.sgd import momentum, sgd
from opake_core.optim.stable_adamw import stable_adamw

__all__ = [
    "MomentsOptimizer",
    "Optimizer",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamw",
    "ademamix",
    "apply_updates",
    "lion",
    "momentum",
    "private_moments_adam",
    "radam",
    "rmsprop",
    "schedule_free",
    "schedule_free_adamw",
    "schedules",
    "sgd",
    "stable_adamw",
]
