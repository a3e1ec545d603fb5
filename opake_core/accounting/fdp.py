"""Hypothesis-testing (f-DP) answers for a process: an attacker's advantage, its least type II error at a given type
I error, and its least Bayes risk at a given prior.

All three come from the process's privacy profile ``delta(epsilon)`` (dp-accounting's pessimistic PLD, the larger of
the add and remove directions), so each is a guarantee: the advantage an upper bound, the type II error and the Bayes
risk lower bounds of the exact values (Dong, Roth and Su, "Gaussian Differential Privacy", JRSS-B 2022).

* ``advantage`` = max over tests of ``TPR - FPR`` = the total variation distance = ``delta(0)``.
* ``beta(alpha)`` = ``sup_{epsilon >= 0} max(0, 1 - delta(epsilon) - e^epsilon alpha, e^-epsilon (1 - delta(epsilon)
  - alpha))`` (their Proposition 2.12, the intersection over every ``epsilon``; the supremum over a grid of
  ``epsilon``, refined around its best point, so never above the exact value).
* ``bayes_risk(prior)`` = ``min over tests of prior * (type II) + (1 - prior) * (type I)`` = ``m (1 - delta(log(M /
  m)))`` with ``m = min(prior, 1 - prior)``, ``M = max(prior, 1 - prior)`` (the hockey-stick divergence at ``M/m``).

``adjacency`` and ``discretization`` are those of :func:`opake_core.accounting.epsilon`. For ``mu``-GDP (one
Gaussian release with noise multiplier ``1/mu``) these are ``2 Phi(mu/2) - 1``,
``Phi(Phi^-1(1 - alpha) - mu)`` and ``prior Phi(log(g)/mu - mu/2) + (1 - prior) Phi(-log(g)/mu - mu/2)``,
``g = (1 - prior) / prior``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize

from opake_core import validate
from opake_core.accounting.mf_monte_carlo import MonteCarloMF
from opake_core.accounting.processes import Process, is_nonprivate
from opake_core.accounting.queries import Result, _composed, _resolve
from opake_core.accounting.queries import epsilon as _epsilon
from opake_core.errors import ConfigurationError

__all__ = ["advantage", "bayes_risk", "beta"]

_GRID = 401  # epsilons on which beta's supremum is first searched


def _profile(process: Process, what: str, adjacency: str | None, discretization: float | None):
    """``delta(epsilon)`` of the process's PLD (vectorized), or None for a non-private process. Where dp-accounting's
    ``get_delta`` overflows (``e^epsilon`` times a mass, at the large epsilons of a nearly non-private process) it
    answers NaN; that delta is read as 1, its trivial upper bound, so every query here stays on its safe side
    (advantage an upper bound, beta and Bayes risk lower bounds)."""
    if isinstance(process, MonteCarloMF) or _resolve(process, None) != "pld":
        raise ConfigurationError(
            f"{what} reads a PLD privacy profile, and {type(process).__name__} processes of this kind have none "
            "(Monte Carlo DP-FTRL, or sampling without replacement, accounted by RDP). Use a process with a PLD."
        )
    if is_nonprivate(process):
        return None
    accountant, _ = _composed(process, "pld", adjacency, discretization)

    def profile(eps: np.ndarray | float) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow is read as delta 1 below, not reported
            delta = np.asarray(accountant.get_delta(eps), dtype=np.float64)
        return np.clip(np.nan_to_num(delta, nan=1.0), 0.0, 1.0)

    return profile


def advantage(process: Process, *, adjacency: str | None = None, discretization: float | None = None) -> Result:
    """The largest ``TPR - FPR`` of any test between neighbouring runs: ``delta(0)`` (an upper bound).

    Example: one Gaussian release with multiplier 2 is 1/2-GDP, advantage ``2 Phi(1/4) - 1``.

        >>> from scipy.stats import norm
        >>> from opake_core import accounting
        >>> ours = accounting.advantage(accounting.gaussian(2.0)).value
        >>> exact = 2 * norm.cdf(0.25) - 1
        >>> bool(exact <= ours < exact + 1e-4)
        True
    """
    profile = _profile(process, "advantage", adjacency, discretization)
    return Result(1.0 if profile is None else float(profile(0.0)), "pld")


def beta(
    process: Process, *, alpha: float, adjacency: str | None = None, discretization: float | None = None
) -> Result:
    """The least type II error of a test with type I error ``alpha`` (the trade-off curve at ``alpha``; a lower
    bound of the exact value).

    Example: against the Gaussian curve ``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` at ``mu = 1/2``.

        >>> from scipy.stats import norm
        >>> from opake_core import accounting
        >>> ours = accounting.beta(accounting.gaussian(2.0), alpha=0.05).value
        >>> exact = norm.cdf(norm.ppf(0.95) - 0.5)
        >>> bool(exact - 1e-3 < ours <= exact)
        True
    """
    a = validate.in_range("alpha", alpha, 0.0, 1.0, low_open=False, high_open=False)
    profile = _profile(process, "beta", adjacency, discretization)
    if profile is None:
        return Result(0.0, "pld")

    def line(eps: np.ndarray | float) -> np.ndarray:
        d = profile(eps)
        with np.errstate(over="ignore"):  # e^eps alpha beyond float range: that line is -inf, the other one counts
            return np.maximum(np.maximum(1 - d - np.exp(eps) * a, np.exp(-eps) * (1 - d - a)), 0.0)

    # Past the epsilon at delta 1e-12 both lines only fall: 1 - delta is flat there while e^eps alpha grows and
    # e^-eps shrinks.
    top = _epsilon(process, delta=1e-12, adjacency=adjacency, discretization=discretization).value
    grid = np.linspace(0.0, max(top, 1e-3), _GRID)
    values = line(grid)
    best = int(np.argmax(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, _GRID - 1)]
    # one epsilon at a time as a float: dp-accounting's scalar delta is about 100 times faster than its array path
    refined = optimize.minimize_scalar(lambda e: -float(line(float(e))), bounds=(lo, hi), method="bounded")
    return Result(float(max(values[best], -refined.fun)), "pld")


def bayes_risk(
    process: Process, *, prior: float, adjacency: str | None = None, discretization: float | None = None
) -> Result:
    """The least Bayes error of telling neighbouring runs apart when the example is in with probability ``prior``
    (a lower bound of the exact value).

    Example: against the closed form for ``mu``-GDP at ``mu = 1/2`` and prior 0.3.

        >>> import math
        >>> from scipy.stats import norm
        >>> from opake_core import accounting
        >>> g, mu = 0.7 / 0.3, 0.5
        >>> exact = 0.3 * norm.cdf(math.log(g) / mu - mu / 2) + 0.7 * norm.cdf(-math.log(g) / mu - mu / 2)
        >>> ours = accounting.bayes_risk(accounting.gaussian(2.0), prior=0.3).value
        >>> bool(exact - 1e-4 < ours <= exact)
        True
    """
    p = validate.in_range("prior", prior, 0.0, 1.0, low_open=False, high_open=False)
    low, high = min(p, 1 - p), max(p, 1 - p)
    profile = _profile(process, "bayes_risk", adjacency, discretization)
    if profile is None or low == 0.0:
        return Result(0.0, "pld")
    return Result(float(low * (1 - profile(math.log(high / low)))), "pld")
