"""Noise of the claimed scale on every parameter leaf: a per-leaf variance test of the privatized update.

The one-run audits (:mod:`opake_core.auditing.one_run`, :mod:`opake_core.auditing.fdp_test`) observe canaries that
live in a parameter block of their own, so a mechanism that noises that block correctly and the real parameters less
(or not at all) passes them. This test looks at every leaf of the real parameters.

Observations: for every leaf, noise only, divided by the standard deviation the claim implies, ``y = x / sigma``.
``x`` is what the mechanism added to a coordinate: the difference of two privatized updates of the same batch with
two noise keys divided by ``sqrt(2)``, or the privatized update of a batch whose per-example gradients are all zero.
``sigma`` is ``z * Delta``, with ``Delta = C / B`` the sensitivity of the clipped sum (per group for per-group
bounds: the allocation of :func:`opake_core.noise.noise_std_for`). Correlated (DP-FTRL) noise is whitened first
(:func:`whiten`). Under the claim the ``n`` values of a leaf are i.i.d. ``N(0, 1)``, so ``S = sum y^2 ~ chi2(n)``.

Test (:func:`leaf_noise_test`): a two-sided chi-square test of ``S`` per leaf at level ``false_alarm / L``
(Bonferroni over the ``L`` leaves), so a mechanism whose noise matches the claim on every leaf is flagged with
probability at most ``false_alarm``. On a leaf with at least :func:`min_coordinates` values, a standard deviation
``1 - scale_error`` times the claim or less (or ``1 / (1 - scale_error)`` times or more) is flagged with probability
at least ``power``; a leaf with no noise at all gives ``S = 0`` and is flagged whatever its size. Smaller leaves
are pooled across steps (repeats) to reach that count; a leaf that stays below it is still tested, and listed as
underpowered.

Everything here is a pure function on numbers; the runs that produce the observations live in
:mod:`opake_torch.auditing.scope_checks`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from opake_core import mf
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf.participation import SINGLE, Participation
from opake_core.noise import noise_std_for
from opake_core.testing import min_noise_samples
from opake_core.tree import PerGroup

__all__ = [
    "LeafNoise",
    "NoiseScaleReport",
    "claimed_std",
    "leaf_noise_test",
    "min_coordinates",
    "sum_squares",
    "whiten",
]

SCALE_ERROR = 1 / 3
"""The default detectable error: noise whose standard deviation is ``2/3`` of the claim or less (the "noise x 1/1.5"
leak, which needs 20,000 canaries in the one-run audit)."""


@dataclass(frozen=True)
class LeafNoise:
    """The test of one leaf.

    Attributes:
        name: the leaf's path.
        coordinates: ``n``, the values tested (coordinates times steps).
        std_ratio: ``sqrt(S / n)``, the empirical noise std over the claimed one (1 for a correct mechanism, 0 for
            no noise).
        p_value: the two-sided chi-square p-value of ``S``.
        flagged: ``p_value`` below the per-leaf level.
        powered: ``coordinates`` reached :func:`min_coordinates`.
    """

    name: str
    coordinates: int
    std_ratio: float
    p_value: float
    flagged: bool
    powered: bool


@dataclass(frozen=True)
class NoiseScaleReport:
    """The per-leaf noise test of a run.

    Attributes:
        leaves: one :class:`LeafNoise` per leaf, in the order given.
        false_alarm: the probability that a mechanism matching the claim on every leaf is flagged (at most).
        level: the per-leaf level, ``false_alarm / len(leaves)``.
        min_coordinates: the values a leaf needs for the stated power.
        scale_error: the detectable relative error of the standard deviation.
        power: the detection probability of such an error on a leaf with ``min_coordinates`` values.
        steps: the privatized updates observed (pairs of them for the two-key difference).
    """

    leaves: tuple[LeafNoise, ...]
    false_alarm: float
    level: float
    min_coordinates: int
    scale_error: float
    power: float
    steps: int = 0

    @property
    def flagged(self) -> bool:
        """Whether some leaf's noise is not of the claimed scale."""
        return any(leaf.flagged for leaf in self.leaves)

    @property
    def flagged_leaves(self) -> tuple[str, ...]:
        return tuple(leaf.name for leaf in self.leaves if leaf.flagged)

    @property
    def underpowered(self) -> tuple[str, ...]:
        """Leaves tested with fewer than ``min_coordinates`` values (a missing noise is still caught there)."""
        return tuple(leaf.name for leaf in self.leaves if not leaf.powered)


def _check_rates(false_alarm: float, scale_error: float, power: float) -> None:
    for name, value in (("false_alarm", false_alarm), ("scale_error", scale_error), ("power", power)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
            raise ConfigurationError(f"{name} must be a number in (0, 1), got {value!r}.")


def min_coordinates(
    num_leaves: int, *, false_alarm: float = 1e-3, scale_error: float = SCALE_ERROR, power: float = 0.999
) -> int:
    """The values a leaf needs so that a standard deviation ``1 - scale_error`` times the claim or less (or
    ``1 / (1 - scale_error)`` times or more) is flagged with probability ``power`` at the per-leaf level
    ``false_alarm / num_leaves``.

    :func:`opake_core.testing.min_noise_samples` at that level: 158 for 25 leaves with the defaults.
    """
    if isinstance(num_leaves, bool) or not isinstance(num_leaves, int) or num_leaves < 1:
        raise ConfigurationError(f"num_leaves must be an int >= 1, got {num_leaves!r}.")
    _check_rates(false_alarm, scale_error, power)
    return min_noise_samples(scale_error=scale_error, alpha=false_alarm / num_leaves, power=power)


def sum_squares(values: Any) -> tuple[float, int]:
    """``(S, n)``: the sum of squares of ``values`` (any shape, in float64) and their number, the statistic of
    :func:`leaf_noise_test`; sums over several steps add up."""
    y = np.asarray(values, dtype=np.float64).ravel()
    return float(np.sum(y * y)), int(y.size)


def leaf_noise_test(
    sums: Mapping[str, tuple[float, int]],
    *,
    false_alarm: float = 1e-3,
    scale_error: float = SCALE_ERROR,
    power: float = 0.999,
    steps: int = 0,
) -> NoiseScaleReport:
    """Test every leaf's standardized noise against ``N(0, 1)`` (module docstring).

    Args:
        sums: ``{leaf name: (S, n)}`` (:func:`sum_squares`): the sum of squares of that leaf's ``n`` values of noise
            divided by its claimed standard deviation.
        false_alarm: the total false-alarm rate (Bonferroni over the leaves).
        scale_error: the detectable relative error of the standard deviation, for :func:`min_coordinates`.
        power: the detection probability of that error on a leaf with :func:`min_coordinates` values.
        steps: the number of updates the values come from (reported only).

    Returns:
        A :class:`NoiseScaleReport`; a leaf whose sum is not finite is flagged (p-value 0).
    """
    if not isinstance(sums, Mapping) or not sums:
        raise InputTypeError(f"sums must be a non-empty mapping of leaf name -> (S, n), got {sums!r:.80}.")
    needed = min_coordinates(len(sums), false_alarm=false_alarm, scale_error=scale_error, power=power)
    level = false_alarm / len(sums)
    leaves = []
    for name, (s, n) in sums.items():
        s, n = float(s), int(n)
        if n < 1:
            raise ConfigurationError(f"leaf {name!r} has no values to test; drop it or observe more steps.")
        if not math.isfinite(s):
            leaves.append(LeafNoise(str(name), n, math.nan, 0.0, True, n >= needed))
            continue
        p = min(1.0, 2 * min(float(stats.chi2.cdf(s, n)), float(stats.chi2.sf(s, n))))
        leaves.append(LeafNoise(str(name), n, math.sqrt(s / n), p, p < level, n >= needed))
    return NoiseScaleReport(tuple(leaves), float(false_alarm), level, needed, float(scale_error), float(power), steps)


def claimed_std(sensitivity: float | PerGroup, noise_multiplier: float, names: Sequence[str]) -> dict[str, float]:
    """``{leaf name: sigma}``: the noise standard deviation the claim implies on each leaf, ``noise_multiplier *
    sensitivity`` (per group: :func:`opake_core.noise.noise_std_for`'s allocation; ``names`` are the group's leaf
    paths). For DP-FTRL pass ``z * sens(C)`` as ``noise_multiplier`` (the scale of the noise before ``C^-1``)."""
    if not noise_multiplier > 0:
        raise ConfigurationError(
            f"the noise check needs a claimed noise multiplier > 0, got {noise_multiplier!r}; a non-private run "
            "adds no noise to test."
        )
    std = noise_std_for(sensitivity, noise_multiplier)
    if not isinstance(std, PerGroup):
        return {name: float(std) for name in names}
    group_of, value_of = std.group_of, std.value_of
    missing = [name for name in names if name not in group_of]
    if missing:
        raise ConfigurationError(
            f"the per-group sensitivity has no group for the leaves {missing[:5]}; build it with "
            "opake_core.tree.per_group over the same parameters."
        )
    return {name: value_of[group_of[name]] for name in names}


def whiten(
    observations: np.ndarray, strategy: Any, *, n_steps: int, participation: Participation = SINGLE
) -> np.ndarray:
    """DP-FTRL noise made independent across steps: ``C[:T, :T] @ x`` for ``x`` of shape ``[T, ...]`` (the noise of
    the first ``T <= n_steps`` steps), with ``C`` the strategy matrix for the horizon (``C`` is lower triangular, so
    its leading block maps the first ``T`` noises to the first ``T`` draws). The matrix mechanism adds
    ``sigma * (C^-1 w)_t`` with ``w`` i.i.d. ``N(0, 1)``, so the result is ``sigma * w``: divided by the claimed
    ``sigma`` it is standard normal at every step."""
    x = np.asarray(observations, dtype=np.float64)
    steps = x.shape[0]
    if not 1 <= steps <= n_steps:
        raise ConfigurationError(f"whiten needs 1 to n_steps={n_steps} steps of noise, got {steps}.")
    c = mf.materialize(strategy, n_steps, participation=participation)[:steps, :steps]
    return (c @ x.reshape(steps, -1)).reshape(x.shape)
