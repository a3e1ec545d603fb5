"""Scaling by the negative learning rate, with one host-side step counter per optimizer."""

from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.optim.schedules import Schedule

LearningRate = float | Schedule
"""A positive float, or a schedule ``step -> float`` (step = number of updates already applied)."""


class LearningRateState(NamedTuple):
    """``count``: the number of updates applied so far, a 0-d int64 tensor on the CPU."""

    count: torch.Tensor


def check_lr(lr: LearningRate) -> LearningRate:
    """A callable as is; a number must be positive and finite."""
    return lr if callable(lr) else validate.positive("lr", lr)


def lr_at(lr: LearningRate, step: int) -> float:
    """The learning rate of update ``step`` (0 for the first): ``lr`` itself, or ``lr(step)`` checked to be finite
    and >= 0 (ConfigurationError naming the step otherwise)."""
    if not callable(lr):
        return lr
    rate = float(lr(step))
    if not (rate >= 0 and math.isfinite(rate)):
        raise ConfigurationError(
            f"the learning-rate schedule returned {rate!r} at step {step}; it must be finite and >= 0."
        )
    return rate


def scale_by_neg_lr(lr: LearningRate) -> GradientTransformation:
    """Multiply every update by ``-lr`` (``-lr(count)`` for a schedule).

    With ``inplace=True`` the updates' own tensors are scaled. Unlike ``torchopt.transform.scale_by_schedule``, which
    keeps one counter per leaf on the leaf's device, the counter lives on the host, so the schedule runs once per
    update as plain Python and never syncs the device.
    """

    def init_fn(params: object) -> LearningRateState:
        return LearningRateState(count=torch.zeros((), dtype=torch.int64))

    def update_fn(updates, state, *, params=None, inplace=False):
        rate = lr_at(lr, int(state.count))
        leaves, treedef = optree.tree_flatten(updates)
        if inplace:
            torch._foreach_mul_(leaves, -rate)
        else:
            updates = optree.tree_unflatten(treedef, torch._foreach_mul(leaves, -rate))
        return updates, LearningRateState(count=state.count + 1)

    return GradientTransformation(init_fn, update_fn)
