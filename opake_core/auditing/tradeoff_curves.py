"""Trade-off curves of f-DP (Dong, Roth and Su, "Gaussian Differential Privacy", JRSS-B 2022): the Gaussian curves,
their (epsilon, delta) conversions, and the curve implied by a privacy profile or claimed by an accounting process.

A mechanism is f-DP when no test between the outputs on two neighbouring datasets has type I error ``alpha`` and type
II error below ``f(alpha)``. ``mu``-GDP is f-DP with ``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` (their Definition
2.7), the curve of telling ``N(0, 1)`` from ``N(mu, 1)``; the Gaussian mechanism with noise multiplier ``z`` is
``1/z``-GDP. ``mu``-GDP implies ``(epsilon, delta(epsilon))``-DP for every epsilon with ``delta(epsilon) =
Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)`` (their Corollary 2.13), which :func:`gaussian_epsilon`
inverts. A whole privacy profile ``delta(epsilon)`` implies the curve ``max_k f_{epsilon_k, delta_k}`` (their
Proposition 2.12 and the intersection of the constraints), :func:`profile_tradeoff`.

These are the claims the one-run f-DP test (:mod:`opake_core.auditing.fdp_test`) rejects or keeps. Everything here is
a pure function of NumPy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize, special

from opake_core import validate
from opake_core.accounting import Process, to_dp_event
from opake_core.accounting.allocation_pld import AllocationPLDAccountant
from opake_core.errors import ConfigurationError

__all__ = [
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "gaussian_tradeoff",
    "process_tradeoff",
    "profile_tradeoff",
]

Tradeoff = Callable[[np.ndarray], np.ndarray]
"""A trade-off curve: type I errors ``alpha`` (an array) to the least type II errors ``f(alpha)`` (same shape)."""


def _mu(name: str, value: object) -> float:
    return validate.non_negative(name, value)


def gaussian_tradeoff(alpha: float | np.ndarray, *, mu: float) -> np.ndarray:
    """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``: the least type II error at type I error ``alpha`` between
    ``N(0, 1)`` and ``N(mu, 1)`` (Dong, Roth and Su 2022, Definition 2.7).

    Args:
        alpha: type I errors in [0, 1], any shape.
        mu: ``mu >= 0``.

    Returns:
        The type II errors, same shape as ``alpha`` (float64).
    """
    mu = _mu("mu", mu)
    alpha = np.asarray(alpha, dtype=np.float64)
    if np.any(~((alpha >= 0) & (alpha <= 1))):
        raise ConfigurationError(f"alpha must lie in [0, 1], got values in [{np.min(alpha)}, {np.max(alpha)}].")
    return special.ndtr(-special.ndtri(alpha) - mu)


def gaussian_delta(mu: float, *, epsilon: float) -> float:
    """The ``delta`` at which ``mu``-GDP is ``(epsilon, delta)``-DP (Dong, Roth and Su 2022, Corollary 2.13).

    ``delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)``, computed in log space so that large
    ``epsilon`` does not overflow; 0 for ``mu = 0``.
    """
    mu, epsilon = _mu("mu", mu), validate.non_negative("epsilon", epsilon)
    if mu == 0:
        return 0.0
    first = special.ndtr(-epsilon / mu + mu / 2)
    second = math.exp(epsilon + special.log_ndtr(-epsilon / mu - mu / 2))
    return float(max(first - second, 0.0))


def gaussian_epsilon(mu: float, *, delta: float) -> float:
    """The smallest ``epsilon`` with ``gaussian_delta(mu, epsilon=epsilon) <= delta``: the epsilon of ``mu``-GDP.

    Args:
        mu: ``mu >= 0`` (0 gives 0).
        delta: in (0, 1).

    Returns:
        ``epsilon >= 0`` to a relative tolerance of 1e-12 (``inf`` for ``mu = inf``).
    """
    delta = validate.delta("delta", delta)
    mu = validate.number("mu", mu)
    if mu == math.inf:
        return math.inf
    mu = _mu("mu", mu)
    if gaussian_delta(mu, epsilon=0.0) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(mu, epsilon=hi) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: gaussian_delta(mu, epsilon=e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def gaussian_mu(epsilon: float, *, delta: float) -> float:
    """The ``mu`` whose Gaussian curve is exactly ``(epsilon, delta)``-DP: the inverse of :func:`gaussian_epsilon`.

    ``mu``-GDP with this ``mu`` is the least private Gaussian mechanism that the claim "(epsilon, delta)-DP" allows.
    """
    epsilon, delta = validate.non_negative("epsilon", epsilon), validate.delta("delta", delta)
    hi = 1.0
    while gaussian_delta(hi, epsilon=epsilon) < delta:
        hi *= 2
    return float(optimize.brentq(lambda u: gaussian_delta(u, epsilon=epsilon) - delta, 0.0, hi, xtol=1e-12))


def profile_tradeoff(epsilons: Sequence[float] | np.ndarray, deltas: Sequence[float] | np.ndarray) -> Tradeoff:
    """The trade-off curve implied by a privacy profile: ``(epsilon_k, delta_k)``-DP for every ``k``.

    Each pair gives ``f_k(alpha) = max(0, 1 - delta_k - e^epsilon_k alpha, e^-epsilon_k (1 - delta_k - alpha))``
    (Dong, Roth and Su 2022, Proposition 2.12); a mechanism that satisfies all of them is f-DP with ``f = max_k
    f_k``. Give it an accountant's ``delta(epsilon)`` on a grid of epsilons (say 0 to 3x the claimed epsilon) to test
    exactly what the accountant claims with :func:`~opake_core.auditing.fdp_test.audit_claim`.

    Args:
        epsilons: ``[K]`` values ``>= 0``.
        deltas: ``[K]`` values in [0, 1].

    Returns:
        ``f(alpha)`` for an array ``alpha`` of type I errors in [0, 1] (same shape, float64).
    """
    eps = np.asarray(epsilons, dtype=np.float64).reshape(-1)
    dels = np.asarray(deltas, dtype=np.float64).reshape(-1)
    if eps.shape != dels.shape or eps.size == 0:
        raise ConfigurationError(
            f"epsilons and deltas must be non-empty and of one length, got {eps.size} and {dels.size} values."
        )
    # accountants return deltas a few ulps outside [0, 1]
    if np.any(~np.isfinite(eps)) or np.any(eps < 0) or np.any(~((dels >= -1e-12) & (dels <= 1 + 1e-12))):
        raise ConfigurationError("epsilons must be finite and >= 0 and deltas in [0, 1]; drop the invalid pairs.")
    dels = np.clip(dels, 0.0, 1.0)
    grow, shrink = np.exp(eps), np.exp(-eps)

    def f(alpha: np.ndarray) -> np.ndarray:
        a = np.asarray(alpha, dtype=np.float64)
        flat = a.reshape(-1, 1)
        lines = np.maximum(1 - dels - grow * flat, shrink * (1 - dels - flat))
        return np.maximum(lines.max(axis=1), 0.0).reshape(a.shape)

    return f


def process_tradeoff(process: Process, *, epsilons: Sequence[float] | np.ndarray | None = None) -> Tradeoff:
    """The trade-off curve an :mod:`opake_core.accounting` process claims: :func:`profile_tradeoff` of its PLD
    privacy profile (dp-accounting, add-or-remove adjacency, the pessimistic estimate with discretization 1e-4, so
    ``delta(epsilon)`` is an upper bound and the curve is at most the true one: a correct run is rejected with
    probability at most ``1 - confidence``).

    Args:
        process: a process with a dp-accounting event (DP-SGD with Poisson sampling, amplified BandMF, ...) or with
            random allocation (k-out-of-t, balls-in-bins: :mod:`opake_core.accounting.allocation_pld`).
        epsilons: where to evaluate ``delta(epsilon)``; default 121 points from 0 to 30 (denser below 10). The curve
            between the points is the envelope of the lines through them, a valid (slightly weaker) curve.

    Returns:
        ``f(alpha)`` (see :func:`profile_tradeoff`).
    """
    grid = (
        np.concatenate([np.linspace(0.0, 10.0, 101), np.linspace(11.0, 30.0, 20)])
        if epsilons is None
        else np.asarray(epsilons, dtype=np.float64)
    )
    event = to_dp_event(process)
    accountant = AllocationPLDAccountant(value_discretization_interval=1e-4)  # random allocation too
    if not accountant.supports(event):
        raise ConfigurationError(f"{process!r} has no PLD accounting; give its curve with profile_tradeoff instead.")
    accountant.compose(event)
    return profile_tradeoff(grid, [accountant.get_delta(float(e)) for e in grid])
