"""Record-level Poisson sampling seen by a group of records: the user-level epsilon of example-level sampling.

Chua et al. 2024 ("Mind the Privacy Unit!", arXiv 2406.14322) call it ELS: train with record-level Poisson sampling
on a dataset where every user holds at most ``k`` rows, and state the guarantee for a user (a group of up to ``k``
records). Removing a user removes ``J ~ Binomial(k, q)`` of its rows from a step's batch, each moving the clipped
sum by at most ``C``: the worst case aligns them, and one step's pair of outputs is the mixture of Gaussians
``sum_j P(J = j) N(j C, s^2)`` against ``N(0, s^2)`` (Schuchardt et al. 2024, "Unified Mechanism-Specific
Amplification by Subsampling and Group Privacy Amplification", NeurIPS, arXiv 2403.04867, section 3.3 and the Gaussian
group case; Jiang et al. 2024, "Tight Group-Level Differential Privacy Guarantees for DP-SGD with Sampling via Mixture
of Privacy Loss Distributions", arXiv 2401.10294). dp-accounting builds the privacy loss distribution of such a
mixture for both the remove and the add direction (``from_mixture_gaussian_mechanism``, pessimistic rounding: an upper
bound), and composes it like any other.

``k = 1`` is the Poisson-subsampled Gaussian itself. The group-privacy theorem (``k epsilon``,
``k e^((k - 1) epsilon) delta``) bounds the same run far more loosely; the mixture is the tight answer.

The same mixture is the guarantee of parallel Poisson sampling (``k`` data-parallel ranks each drawing the whole
dataset independently at rate ``q``, :func:`opake_core.sampling.poisson` with ``sharding="global"``): a record is then
drawn by ``J ~ Binomial(k, q)`` ranks.

Speed: dp-accounting inverts the mixture's privacy loss at every grid point by a bisection written as a Python
recursion (15 to 25 s for one step of a group of 2 at q = 0.01, z = 1 and the default 1e-4 grid, so a calibration
took minutes). :class:`_MixtureLoss` runs the same bisection for all grid points at once in NumPy: the same
midpoints, the same comparisons, hence the same inverses and the same PLD (tests compare the two pmfs exactly), in
about 1.5 s for that step; composing it over the steps is dp-accounting's FFT (a fraction of a second).

RDP (looser, and what sizes the PLD grid and guides a calibration): the step is dominated by the Poisson-subsampled
Gaussian at rate ``p = 1 - (1 - q)^k`` with shift ``k`` (multiplier ``z / k``), for every hockey-stick divergence in
both directions. Write the mixture as ``sum_{j >= 1} w'_j ((1 - p) N(0) + p N(j))`` with ``w'`` the law of ``J``
given ``J >= 1``: the divergences are jointly convex, and ``(N(j), N(0))`` is a post-processing of ``(N(k), N(0))``
for ``j <= k``. Dominance survives composition (Zhu, Dong and Wang 2022, "Optimal Accounting of Differential Privacy
via Characteristic Function", AISTATS, Theorem 10), so dp-accounting's RDP of that event bounds the run from above
(:func:`rdp_dominating`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_pmf, privacy_loss_distribution, privacy_loss_mechanism
from scipy import stats

__all__ = ["GroupPoissonDpEvent", "group_poisson_pld", "rdp_dominating"]


@dataclass(frozen=True)
class GroupPoissonDpEvent(dp_event.DpEvent):
    """A dp-accounting event for one step of Poisson sampling at ``sampling_probability`` of a Gaussian release
    (``noise_multiplier``), seen by a group of ``group_size`` records; the PLD accountant of
    :mod:`opake_core.accounting.allocation_pld` accounts it (dp-accounting 0.6.0 has no event for it)."""

    noise_multiplier: float
    sampling_probability: float
    group_size: int


def group_poisson_pld(
    event: GroupPoissonDpEvent, *, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The privacy loss distribution (both directions, pessimistic) of one step of ``event``: the mixture over
    ``j = 0..k`` of ``N(j, z^2)`` with Binomial(``k``, ``q``) weights, against ``N(0, z^2)`` (sensitivity 1)."""
    k, q = event.group_size, event.sampling_probability
    counts = np.arange(k + 1)
    weights = stats.binom.pmf(counts, k, q).tolist()

    def one_direction(adjacency: privacy_loss_mechanism.AdjacencyType) -> pld_pmf.PLDPmf:
        # exactly what from_mixture_gaussian_mechanism builds (connect-the-dots, pessimistic, truncation e^-50),
        # through dp-accounting's own (private) constructor: the pmf test pins the result against the public path
        loss = _MixtureLoss(event.noise_multiplier, counts.astype(float).tolist(), weights, adjacency_type=adjacency)
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True
        )

    adjacency = privacy_loss_mechanism.AdjacencyType
    return privacy_loss_distribution.PrivacyLossDistribution(
        one_direction(adjacency.REMOVE), one_direction(adjacency.ADD)
    )


def rdp_dominating(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """``event`` with each :class:`GroupPoissonDpEvent` replaced by the Poisson-subsampled Gaussian that dominates it
    (rate ``1 - (1 - q)^k``, multiplier ``z / k``; module docstring), for dp-accounting's RDP accountant."""
    if isinstance(event, GroupPoissonDpEvent):
        k, q = event.group_size, event.sampling_probability
        rate = 1.0 if q == 1 else -math.expm1(k * math.log1p(-q))
        return dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(event.noise_multiplier / k))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(rdp_dominating(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([rdp_dominating(e) for e in event.events])
    return event


class _MixtureLoss(privacy_loss_mechanism.MixtureGaussianPrivacyLoss):
    """dp-accounting's mixture-of-Gaussians privacy loss, its bisection vectorized over the grid (module docstring)."""

    def _inverse_privacy_losses_with_range(
        self, privacy_losses: np.ndarray, bounds: tuple[float, float], precision: float = 1e-6
    ) -> np.ndarray:
        """For each loss ``l``: the upper end, rounded down to ``precision``, of the bisection interval of width at
        most ``precision`` on which the privacy loss crosses ``l``; dp-accounting's recursion, element by element."""
        losses = np.asarray(privacy_losses, dtype=float)
        low, high = np.full(losses.shape, float(bounds[0])), np.full(losses.shape, float(bounds[1]))
        active = high - low > precision
        while active.any():
            mid = (low[active] + high[active]) / 2
            above = losses[active] < self._losses(mid)  # the loss decreases in x: the inverse lies right of mid
            low[active] = np.where(above, mid, low[active])
            high[active] = np.where(above, high[active], mid)
            active = high - low > precision
        return np.floor(high / precision) * precision

    def _losses(self, x: np.ndarray) -> np.ndarray:
        """:meth:`privacy_loss` at each point of ``x`` (the same float operations, one row per point)."""
        x_loss = self.sensitivities[None, :] * x[:, None] / self._variance
        constants = self._precompute_privacy_loss_constants
        if self.adjacency_type == privacy_loss_mechanism.AdjacencyType.ADD:
            return -np.logaddexp.reduce(constants + x_loss, axis=1)
        return np.logaddexp.reduce(constants - x_loss, axis=1)
