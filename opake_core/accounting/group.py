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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution
from scipy import stats

__all__ = ["GroupPoissonDpEvent", "group_poisson_pld"]


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
    return privacy_loss_distribution.from_mixture_gaussian_mechanism(
        standard_deviation=event.noise_multiplier,
        sensitivities=counts.astype(float).tolist(),
        sampling_probs=stats.binom.pmf(counts, k, q).tolist(),
        value_discretization_interval=discretization,
    )
