"""Audit canaries and how they enter a run: input-space canaries (examples with random inputs and labels) and Dirac
gradient canaries (a parameter block of their own, a coordinate per canary), each with its fair coins.

Dirac canary ``j``'s gradient is ``gradient_norm * e_j`` on a parameter block that the real loss never touches
(:data:`CANARY_LEAF`), so the canaries do not interfere. Slots of excluded canaries stay in the data with a zero
gradient (the zero-out neighbour, which for Poisson sampling is the same as removing the example), so the data set,
and with it the sampler, does not depend on the coins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from opake_core import random
from opake_core.auditing import coin_flips
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "CANARY_FIELD",
    "CANARY_LEAF",
    "CANARY_WEIGHT",
    "Canaries",
    "DiracCanaries",
    "canary_rows",
    "dirac_canaries",
    "make_canaries",
    "with_canary_block",
    "with_dirac_canaries",
]

CANARY_STREAM = "opake.audit.canaries"


@dataclass(frozen=True)
class Canaries:
    """Canary examples and their coins.

    Attributes:
        inputs: ``[m, ...]`` float tensor.
        labels: ``[m]`` int64 tensor.
        included: ``[m]`` bool array, the coins (True = in the training set).
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    included: np.ndarray

    def __len__(self) -> int:
        return len(self.included)


def make_canaries(
    *, key: random.Key, num_canaries: int, num_features: int, num_classes: int, scale: float = 1.0
) -> Canaries:
    """Memorizable canaries: Gaussian inputs (std ``scale``) with uniformly random labels, and their coins.

    Inputs and labels come from ``fold_in(key, CANARY_STREAM)``, the coins from
    :func:`opake_core.auditing.one_run.coin_flips` with the same ``key``.
    """
    for name, value in (("num_canaries", num_canaries), ("num_features", num_features), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}.")
    gen = random.numpy_generator(random.fold_in(key, CANARY_STREAM))
    inputs = torch.as_tensor(gen.normal(0.0, scale, (num_canaries, num_features)), dtype=torch.float32)
    labels = torch.as_tensor(gen.integers(0, num_classes, num_canaries), dtype=torch.long)
    return Canaries(inputs, labels, coin_flips(key, num_canaries))


CANARY_LEAF = "opake_audit_canaries"
"""The name of the parameter block of Dirac canaries: ``[m]`` coordinates, one per canary, that real data never
touch."""
CANARY_WEIGHT = f"{CANARY_LEAF}.weight"
"""The trainable name of the canary block in a :func:`~opake_torch.auditing.trainer_runs.audit_trainer_dirac` run: an
``nn.Embedding`` of ``m + 1`` rows of width 1 on the model (row ``j`` is canary ``j``; row ``m``, the padding index,
takes the other rows)."""
CANARY_FIELD = "opake_canary"
"""The dataset column (trainer) or last example tensor (core step) that marks a row: :data:`REAL_ROW` for a real
example, :data:`EMPTY_SLOT` for an excluded canary's slot, ``j >= 0`` for included canary ``j``."""
REAL_ROW = -1
EMPTY_SLOT = -2


@dataclass(frozen=True)
class DiracCanaries:
    """Dirac gradient canaries: canary ``j``'s gradient is ``gradient_norm * e_j`` on :data:`CANARY_LEAF`.

    Attributes:
        included: ``[m]`` bool, the coins.
        gradient_norm: the L2 norm of a canary's gradient before clipping (at least the clipping bound, so that a
            correct run clips it to exactly the bound; a much larger norm makes a skipped clip visible).
    """

    included: np.ndarray
    gradient_norm: float

    def __len__(self) -> int:
        return len(self.included)

    @property
    def slots(self) -> np.ndarray:
        """``[m]`` int64: ``j`` for included canary ``j``, :data:`EMPTY_SLOT` for an excluded one."""
        return np.where(self.included, np.arange(len(self.included)), EMPTY_SLOT).astype(np.int64)


def dirac_canaries(*, key: random.Key, num_canaries: int, gradient_norm: float) -> DiracCanaries:
    """``num_canaries`` Dirac gradient canaries with coins from :func:`opake_core.auditing.one_run.coin_flips` (same
    ``key``)."""
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 2:
        raise ConfigurationError(f"num_canaries must be an int >= 2, got {num_canaries!r}; use 1,000 or more.")
    if isinstance(gradient_norm, bool) or not isinstance(gradient_norm, int | float) or not gradient_norm > 0:
        raise ConfigurationError(f"gradient_norm must be a positive number, got {gradient_norm!r}.")
    return DiracCanaries(coin_flips(key, num_canaries), float(gradient_norm))


def with_canary_block(params: dict[str, torch.Tensor], canaries: DiracCanaries) -> dict[str, torch.Tensor]:
    """``params`` plus the zero-initialized canary block ``[m]`` under :data:`CANARY_LEAF` (dtype and device of the
    first parameter)."""
    if not isinstance(params, dict) or not params:
        raise InputTypeError(f"params must be a non-empty dict of tensors, got {type(params).__name__}.")
    if CANARY_LEAF in params:
        raise ConfigurationError(f"params already hold {CANARY_LEAF!r}; pass the parameters without the canary block.")
    first = next(iter(params.values()))
    return {**params, CANARY_LEAF: torch.zeros(len(canaries), dtype=first.dtype, device=first.device)}


def with_dirac_canaries(loss_fn: Callable[..., torch.Tensor], canaries: DiracCanaries) -> Callable[..., torch.Tensor]:
    """The per-example loss with Dirac canaries: ``loss(params, *example, slot)``.

    ``slot`` (an int64 scalar, the last element of an example) is :data:`REAL_ROW` for a real example, whose loss is
    ``loss_fn(params, *example)`` and whose gradient on the canary block is zero; :data:`EMPTY_SLOT` for an excluded
    canary (loss and gradient zero); ``j`` for included canary ``j``, whose loss is ``gradient_norm *
    params[CANARY_LEAF][j]`` (gradient ``gradient_norm * e_j``, zero elsewhere). Runs under ``vmap(grad)``.
    """
    m, scale = len(canaries), canaries.gradient_norm

    def loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        *inputs, slot = example
        real = loss_fn(params, *inputs)
        block = params[CANARY_LEAF]
        hit = (torch.arange(m, device=block.device) == slot).to(block.dtype)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real)) + scale * (block * hit).sum()

    return loss


def canary_rows(data: tuple[torch.Tensor, ...], canaries: DiracCanaries) -> tuple[torch.Tensor, ...]:
    """The training set of a Dirac audit: the real rows, then one slot per canary (the inputs of real row 0, whose
    loss is masked), with the slot column appended: ``(*data, slots [n + m])``."""
    if not isinstance(data, tuple) or not data or not all(isinstance(t, torch.Tensor) for t in data):
        raise InputTypeError("data must be a tuple of per-example tensors [n, ...] (inputs, labels, ...).")
    n, m = len(data[0]), len(canaries)
    if n < 1 or any(len(t) != n for t in data):
        raise ConfigurationError(f"data tensors must share a non-zero first dimension, got {[len(t) for t in data]}.")
    filled = tuple(torch.cat([t, t[:1].expand(m, *t.shape[1:])]) for t in data)
    slots = torch.cat([torch.full((n,), REAL_ROW, dtype=torch.long), torch.as_tensor(canaries.slots)])
    return (*filled, slots)
