"""Sensitivity of a strategy ``C`` under a participation pattern.

``sens(C) = max_pi ||sum_{j in pi} C[:, j]||_2`` over the sets ``pi`` of steps one example may join. All
strategies here are lower-triangular Toeplitz, so the sensitivities are closed forms of the first column ``c``:

* :class:`~opake_core.mf.participation.SingleParticipation`: ``||c||`` (the max column norm: column 0 is longest).
* :class:`~opake_core.mf.participation.MinSepParticipation` ``(b, k)``: the min-sep closed form of
  :func:`opake_core.mf.toeplitz.minsep_sensitivity_squared`, exact for non-negative non-increasing ``c`` (Kalinin
  and Lampert 2024, Theorem 2; true of every strategy here) and an upper bound through the majorant otherwise.
* :class:`~opake_core.mf.participation.CyclicParticipation` ``(b)``: the fixed-epoch sensitivity of
  :func:`opake_core.mf.toeplitz.cyclic_sensitivity_squared` (all steps ``= r mod b``), exact for ``c >= 0``.

For amplified BandMF under cyclic Poisson sampling (Choquette-Choo et al. 2023, Theorem 1) the accountant needs
the *per-round* sensitivity, which is the single-participation value, and the condition ``bands <= cycle_length``:
see :func:`band_count`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from opake_core.errors import InputTypeError
from opake_core.mf import toeplitz
from opake_core.mf.participation import (
    SINGLE,
    CyclicParticipation,
    MinSepParticipation,
    Participation,
    SingleParticipation,
)
from opake_core.mf.strategies import BSR, BandedToeplitz, Identity, optimize

__all__ = ["band_count", "sensitivity", "sensitivity_squared"]


def sensitivity_squared(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> float:
    """``sens(C)^2`` for horizon ``n_steps`` (a specification is optimized for ``participation`` first).

    Example: with single participation, the squared norm of ``C``'s first column.

        >>> from opake_core import mf
        >>> mf.sensitivity_squared(mf.lambda_cgd(0.5), 3)  # 1 + 1/4 + 1/16
        1.3125
    """
    with torch.profiler.record_function("opake::mf_sensitivity"):
        concrete = optimize(strategy, n_steps, participation=participation)
        c = concrete.strategy_coef(n_steps)
        if isinstance(participation, SingleParticipation):
            return float(c @ c)
        if isinstance(participation, MinSepParticipation):
            return toeplitz.minsep_sensitivity_squared(
                c, participation.min_sep, n=n_steps, max_participations=participation.max_participations
            )
        if isinstance(participation, CyclicParticipation):
            return toeplitz.cyclic_sensitivity_squared(c, participation.cycle_length, n=n_steps)
        raise InputTypeError(
            "participation must be SingleParticipation(), MinSepParticipation(min_sep, max_participations) or "
            f"CyclicParticipation(cycle_length), got {type(participation).__name__}."
        )


def sensitivity(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> float:
    """``sens(C)``: the L2 sensitivity of ``C x`` for a unit per-step contribution bound.

    Example: independent noise over 8 steps, an example in every other step (2 groups): 4 participations.

        >>> from opake_core import mf
        >>> mf.sensitivity(mf.identity(), 8), mf.sensitivity(mf.identity(), 8, participation=mf.CyclicParticipation(2))
        (1.0, 2.0)
    """
    return math.sqrt(sensitivity_squared(strategy, n_steps, participation=participation))


def band_count(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> int:
    """Number of non-zero diagonals of ``C`` within the horizon (``n_steps`` for a dense ``C``).

    Amplification by cyclic Poisson sampling (columns of one group orthogonal) needs ``band_count <= cycle_length``.

    Example:

        >>> from opake_core import mf
        >>> mf.band_count(mf.band_mf(bands=4), 16), mf.band_count(mf.lambda_cgd(), 16)
        (4, 16)
    """
    concrete = optimize(strategy, n_steps, participation=participation)
    if isinstance(concrete, Identity):
        return 1
    if isinstance(concrete, BandedToeplitz):
        return min(concrete.bands, n_steps)
    if isinstance(concrete, BSR):
        return min(concrete.bandwidth, n_steps)
    return n_steps
