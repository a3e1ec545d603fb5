"""Expected error of a strategy: the variance of the noise ``B z`` on the workload's outputs.

For unit-variance ``z``, query ``i`` has variance ``||B[i, :]||^2`` with ``B = A C^-1``. Multiply by
``(noise_multiplier * sens(C) * clip / normalizer)^2`` for the actual variance; ``loss = sens^2 * error`` compares
strategies at equal privacy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opake_core.mf import _autodiff
from opake_core.mf.participation import SINGLE, Participation
from opake_core.mf.sensitivity import sensitivity_squared
from opake_core.mf.strategies import optimize
from opake_core.mf.workload import Workload

__all__ = ["ExpectedError", "expected_error", "per_query_error"]


@dataclass(frozen=True)
class ExpectedError:
    """Mean and max over the ``n`` queries of ``||B[i, :]||^2`` (unit-variance ``z``)."""

    mean: float
    max: float


def per_query_error(
    strategy: Any,
    n_steps: int,
    *,
    workload: Workload | None = None,
    participation: Participation = SINGLE,
) -> np.ndarray:
    """``||B[i, :]||^2`` for every step ``i < n_steps`` (float64).

    Example: the square-root factorization spreads the prefix sum's error more evenly than independent noise.

        >>> from opake_core import mf
        >>> mf.per_query_error(mf.identity(), 4)
        array([1., 2., 3., 4.])
        >>> mf.per_query_error(mf.bsr(bandwidth=4, beta=0.0), 4)
        array([1.        , 1.25      , 1.390625  , 1.48828125])
    """
    with torch.profiler.record_function("opake::mf_per_query_error"):
        concrete = optimize(strategy, n_steps, participation=participation)
        noising = torch.from_numpy(concrete.noising_coef(n_steps))
        return _autodiff.per_query_error(noising, workload or Workload(), n_steps).numpy()


def expected_error(
    strategy: Any,
    n_steps: int,
    *,
    workload: Workload | None = None,
    participation: Participation = SINGLE,
    scale_by_sensitivity: bool = False,
) -> ExpectedError:
    """Mean and max squared error of the rows of ``B z``; with ``scale_by_sensitivity`` the loss ``sens^2 * error``
    under ``participation`` (the error at equal privacy).

    Example: independent noise on the prefix sum over 8 steps: errors 1 .. 8.

        >>> from opake_core import mf
        >>> mf.expected_error(mf.identity(), 8)
        ExpectedError(mean=4.5, max=8.0)
    """
    with torch.profiler.record_function("opake::mf_expected_error"):
        concrete = optimize(strategy, n_steps, participation=participation)
        err = per_query_error(concrete, n_steps, workload=workload)
        scale = sensitivity_squared(concrete, n_steps, participation=participation) if scale_by_sensitivity else 1.0
        return ExpectedError(float(err.mean() * scale), float(err.max() * scale))
