"""One-run f-DP auditing (Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy in One Run", ICML 2025,
arXiv 2410.22235), Gaussian trade-off curves, and the canary scores of white-box audits.

Notation (that of :mod:`opake_core.audit`): ``m`` canaries, each included independently with probability 1/2; the
auditor guesses "in" for the ``k_pos`` highest scores and "out" for the ``k_neg`` lowest and abstains on the rest:
``r = k_pos + k_neg`` guesses (the paper's ``c'``), ``v`` of them correct (the paper's ``c``). ``tau = 1 -
confidence`` is the level of the test.

Trade-off curves (Dong, Roth and Su, "Gaussian Differential Privacy", JRSS-B 2022): a mechanism is f-DP when no test
between the outputs on two neighbouring datasets has type I error ``alpha`` and type II error below ``f(alpha)``.
``mu``-GDP is f-DP with ``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)`` (their Definition 2.7), the curve of telling
``N(0, 1)`` from ``N(mu, 1)``; the Gaussian mechanism with noise multiplier ``z`` is ``1/z``-GDP. ``mu``-GDP implies
``(epsilon, delta(epsilon))``-DP for every epsilon with ``delta(epsilon) = Phi(-epsilon/mu + mu/2) - e^epsilon
Phi(-epsilon/mu - mu/2)`` (their Corollary 2.13), which :func:`gaussian_epsilon` inverts. A whole privacy profile
``delta(epsilon)`` implies the curve ``max_k f_{epsilon_k, delta_k}`` (their Proposition 2.12 and the intersection
of the constraints), :func:`profile_tradeoff`.

The test (the paper's bound for guessing with abstention, computed by its Algorithm 3): for an f-DP mechanism and
any guesser that looks at the output only, ``P[at least v of r guesses correct] <= tau`` whenever the sequences

    r_v = tau * v / m,   h_v = tau * (r - v) / m,
    h_i = max(h_{i+1}, fbar^-1(r_{i+1})),   r_i = r_{i+1} + i / (r - i) * (h_i - h_{i+1})   (i = v-1, ..., 0)

end with ``r_0 + h_0 > r / m``. Here ``fbar^-1(y) = f(1 - y)`` is the least probability an event can have under one
neighbour when it has probability ``y`` under the other (for the binary membership game, the paper's ``k = 2``).
``r_i`` and ``h_i`` bound the correct and the wrong guesses per canary that a run with ``i`` or more correct
guesses needs; more than ``r / m`` in total is impossible, so the observation rejects "the mechanism is f-DP" at
level ``tau``. :func:`rejects` evaluates it for any curve, :func:`mu_lower_bound` returns the largest ``mu`` such
that "``mu'``-GDP" is rejected for every ``mu' <= mu`` on a fixed grid of step 0.001 (a valid confidence bound
without assuming the test is monotone in ``mu``: a ``mu0``-GDP mechanism is ``g``-GDP for the first grid point
``g >= mu0``, which is rejected with probability at most ``tau``), and :func:`fdp_audit` sweeps guess counts with a
Bonferroni correction, as :func:`opake_core.audit.one_run_audit` does.

The empirical epsilon is ``gaussian_epsilon(mu_lower_bound, delta)``, the paper's "empirical privacy": the epsilon
at ``delta`` of the least private Gaussian curve the run rejects. It is a lower bound on the epsilon of any
mechanism whose trade-off curve is Gaussian; for another curve (subsampled mechanisms), test the claimed curve
itself with :func:`audit_claim` and :func:`profile_tradeoff`.

Scores for white-box canaries (Nasr et al., "Tight Auditing of Differentially Private Machine Learning", USENIX
Security 2023; Steinke, Nasr and Jagielski 2023): ``observations[t, j]`` is what the auditor reads on canary ``j``'s
coordinate at step ``t`` in units of the per-step sensitivity (the privatized clipped sum divided by
``clipping_norm / expected_batch_size``): ``signal_t * b_tj + noise_multiplier * N(0, 1)`` with ``b_tj`` 1 when the
canary was in the batch. :func:`likelihood_ratio_scores` is the Neyman-Pearson statistic of a Poisson-subsampled
Gaussian (the most powerful test for one canary, so its score distribution realizes the mechanism's trade-off
curve); :func:`sum_scores` and :func:`max_scores` are the simpler statistics of the papers. Correlated (DP-FTRL)
noise is decorrelated first with :func:`matrix_projections`.

Everything here is a pure function of NumPy arrays; the training side lives in :mod:`opake_torch.audit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from dp_accounting import pld
from scipy import optimize, special

from opake_core import validate
from opake_core.accounting import Process, to_dp_event
from opake_core.audit import coin_flips, count_correct, guesses
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key, fold_in, numpy_generator

__all__ = [
    "MU_MAX",
    "ClaimTest",
    "FDPAuditResult",
    "audit_claim",
    "default_guess_sets",
    "fdp_audit",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "gaussian_tradeoff",
    "likelihood_ratio_scores",
    "matrix_projections",
    "max_scores",
    "mu_lower_bound",
    "process_tradeoff",
    "profile_tradeoff",
    "rejects",
    "select_guess_set",
    "simulate_dirac_observations",
    "sum_scores",
]

MU_MAX = 10.0
"""The largest ``mu`` the search considers (epsilon about 45 at delta 1e-5): far above what 10^6 canaries show."""
_COARSE = 0.02
_FINE = 0.001

Tradeoff = Callable[[np.ndarray], np.ndarray]


# -- Gaussian trade-off curves --------------------------------------------------------------------------------------


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
    exactly what the accountant claims with :func:`audit_claim`.

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
        process: a process with a dp-accounting event (DP-SGD with Poisson sampling, amplified BandMF, ...).
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
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    if not accountant.supports(event):
        raise ConfigurationError(f"{process!r} has no PLD accounting; give its curve with profile_tradeoff instead.")
    accountant.compose(event)
    return profile_tradeoff(grid, [accountant.get_delta(float(e)) for e in grid])


# -- the test (the recursion of Algorithm 3) --------------------------------------------------------------------------


def _counts(m: object, r: object, v: object) -> tuple[int, int, int]:
    m = validate.integer("m", m, minimum=1)
    r = validate.integer("r", r, minimum=0)
    v = validate.integer("v", v, minimum=0)
    if not v <= r <= m:
        raise ConfigurationError(
            f"need 0 <= v <= r <= m (correct guesses <= guesses <= canaries), got v={v}, r={r}, m={m}."
        )
    return m, r, v


def _level(confidence: object) -> float:
    confidence = validate.number("confidence", confidence)
    if not 0 < confidence < 1:
        raise ConfigurationError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}.")
    return 1.0 - confidence


def _rejected(
    inverse: Callable[[np.ndarray, np.ndarray], np.ndarray],
    m: int,
    r: np.ndarray,
    v: np.ndarray,
    level: np.ndarray,
) -> np.ndarray:
    """The test for many entries at once: ``r``, ``v``, ``level`` are ``[E]``; ``inverse(y, idx)`` is ``fbar^-1``
    of entries ``idx`` at ``y``. Returns ``[E]`` booleans (True: "f-DP" rejected).

    Once ``fbar^-1(r_{i+1}) <= h_{i+1}`` an entry's ``(r_i, h_i)`` stop changing, and once ``r_i + h_i > r/m``
    (both only grow as ``i`` decreases) it is rejected: such entries leave the loop early.
    """
    rr = level * v / m
    hh = level * (r - v) / m
    cap = r / m
    done = rr + hh > cap
    rejected = done.copy()
    for i in range(int(v.max(initial=0)) - 1, -1, -1):
        idx = np.flatnonzero((v > i) & ~done)
        if idx.size == 0:
            if not np.any((v <= i) & ~done):
                break
            continue
        h_new = np.maximum(hh[idx], inverse(np.minimum(rr[idx], 1.0), idx))
        grow = h_new - hh[idx]
        r_new = rr[idx] + i / (r[idx] - i) * grow
        rr[idx], hh[idx] = r_new, h_new
        over = r_new + h_new > cap[idx]
        rejected[idx[over]] = True
        done[idx[over | (grow <= 0)]] = True
    return rejected


def rejects(
    m: int,
    r: int,
    v: int,
    *,
    tradeoff: Tradeoff | None = None,
    mu: float | None = None,
    confidence: float = 0.95,
) -> bool:
    """Whether ``v`` correct out of ``r`` guesses (``m`` canaries) rejects "the run is f-DP" at level ``1 -
    confidence`` (the recursion of the paper's Algorithm 3; see the module docstring).

    Args:
        m: canaries.
        r: guesses.
        v: correct guesses.
        tradeoff: the claimed curve ``f`` (a vectorized ``alpha -> beta``, symmetric as every curve of a
            neighbouring relation that is symmetric), or
        mu: the claimed Gaussian curve ``G_mu``.
        confidence: one minus the level.

    Returns:
        True when the claim is rejected: a truly f-DP run gets True with probability at most ``1 - confidence``.
    """
    m, r, v = _counts(m, r, v)
    level = _level(confidence)
    inverse = _inverse(tradeoff, mu)
    return bool(_rejected(inverse, m, np.array([r]), np.array([v]), np.array([level]))[0])


def _inverse(tradeoff: Tradeoff | None, mu: float | None) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    if (tradeoff is None) == (mu is None):
        raise ConfigurationError("give exactly one of tradeoff=f (a callable) or mu=... (a Gaussian curve).")
    if mu is not None:
        mu = _mu("mu", mu)
        return lambda y, idx: special.ndtr(special.ndtri(y) - mu)
    if not callable(tradeoff):
        raise InputTypeError(f"tradeoff must be a callable alpha -> beta, got {type(tradeoff).__name__}.")
    return lambda y, idx: np.clip(np.asarray(tradeoff(1.0 - y), dtype=np.float64), 0.0, 1.0)


def _gaussian_bounds(m: int, r: np.ndarray, v: np.ndarray, level: float | np.ndarray) -> np.ndarray:
    """``[G]`` mu lower bounds (grid scan, see the module docstring) for guess sets ``(r[g], v[g])``."""
    groups = len(r)
    coarse = np.arange(0.0, MU_MAX + _COARSE / 2, _COARSE)
    grid = np.broadcast_to(coarse, (groups, len(coarse))).reshape(-1)

    def scan(mus: np.ndarray, rows: np.ndarray) -> np.ndarray:
        inverse = lambda y, idx: special.ndtr(special.ndtri(y) - mus[idx])  # noqa: E731
        return _rejected(inverse, m, r[rows], v[rows], levels[rows])

    levels = np.broadcast_to(np.asarray(level, dtype=np.float64), (groups,))
    rows = np.repeat(np.arange(groups), len(coarse))
    hit = scan(grid, rows).reshape(groups, len(coarse))
    first_miss = np.where(hit.all(axis=1), len(coarse), np.argmin(hit, axis=1))
    bounds = np.where(first_miss > 0, coarse[np.maximum(first_miss - 1, 0)], 0.0)
    refine = np.flatnonzero((first_miss > 0) & (first_miss < len(coarse)))
    if refine.size:
        steps = np.arange(1, round(_COARSE / _FINE)) * _FINE
        fine = (bounds[refine, None] + steps[None, :]).reshape(-1)
        fine_rows = np.repeat(refine, len(steps))
        fine_hit = scan(fine, fine_rows).reshape(len(refine), len(steps))
        extra = np.where(fine_hit.all(axis=1), len(steps), np.argmin(fine_hit, axis=1))
        bounds[refine] = bounds[refine] + extra * _FINE
    return bounds


def mu_lower_bound(m: int, r: int, v: int, *, confidence: float = 0.95) -> float:
    """The largest ``mu`` (grid step 0.001, at most :data:`MU_MAX`) such that ``v`` correct out of ``r`` guesses
    rejects "``mu'``-GDP" for every ``mu' <= mu`` at level ``1 - confidence``; 0 when 0-GDP is not rejected.

    With probability at least ``confidence`` the result is at most the ``mu`` of any ``mu``-GDP run.
    """
    m, r, v = _counts(m, r, v)
    return float(_gaussian_bounds(m, np.array([r]), np.array([v]), _level(confidence))[0])


# -- audits from scores ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FDPAuditResult:
    """The outcome of a one-run f-DP audit (Gaussian curves).

    Attributes:
        mu: the lower bound on ``mu`` (the least private Gaussian curve the run rejects).
        epsilon: ``gaussian_epsilon(mu, delta)``, the empirical epsilon at ``delta``.
        delta: the delta of the conversion.
        confidence: the probability that a run whose curve is ``G_mu`` (or more private) gets a bound below
            ``mu``; with a sweep over guess sets it already includes the Bonferroni correction.
        num_canaries: ``m``.
        num_guesses: ``r`` of the chosen guess set.
        num_correct: ``v`` of the chosen guess set.
        k_pos, k_neg: how many top / bottom scores were guessed "in" / "out".
    """

    mu: float
    epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_pos: int
    k_neg: int

    def flags(self, claimed_epsilon: float) -> bool:
        """Whether the run leaks more than ``claimed_epsilon`` at the same delta: the lower bound exceeds it."""
        return self.epsilon > validate.non_negative("claimed_epsilon", claimed_epsilon)


@dataclass(frozen=True)
class ClaimTest:
    """The test of one claimed trade-off curve: ``rejected`` at level ``1 - confidence`` (Bonferroni over the guess
    sets), with the guess set that rejected it (the best one when none did)."""

    rejected: bool
    confidence: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_pos: int
    k_neg: int


def default_guess_sets(m: int) -> list[tuple[int, int]]:
    """The ``(k_pos, k_neg)`` pairs :func:`fdp_audit` sweeps by default: ``k_pos`` at 1%, 2%, 5%, 10%, 20% and 40% of
    ``m`` with no "out" guess (subsampled mechanisms reveal inclusion through high scores only), and 5% and 20% of
    ``m`` on both sides (a Gaussian mechanism reveals it on both); eight tests in all."""
    m = validate.integer("m", m, minimum=2)
    sets = {(max(1, round(m * f)), 0) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)}
    sets |= {(max(1, round(m * f)), max(1, round(m * f))) for f in (0.05, 0.2)}
    return sorted(s for s in sets if s[0] + s[1] <= m)


def _scores_and_coins(scores: object, included: object) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores)
    c = np.asarray(included)
    if s.ndim != 1 or c.ndim != 1 or s.shape != c.shape:
        raise ConfigurationError(
            f"scores and included must be one-dimensional with one entry per canary, got shapes {s.shape} and "
            f"{c.shape}."
        )
    if c.dtype != np.bool_:
        raise InputTypeError(f"included must be a boolean array (True = included), got dtype {c.dtype}.")
    s = s.astype(np.float64)
    if not np.all(np.isfinite(s)):
        raise ConfigurationError(f"scores hold {int(np.sum(~np.isfinite(s)))} non-finite values; clamp them.")
    if len(s) < 2:
        raise ConfigurationError(f"the audit needs at least 2 canaries, got {len(s)}; use hundreds or more.")
    return s, c


def _guess_sets(m: int, sets: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
    if sets is None:
        return default_guess_sets(m)
    out = []
    for item in sets:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise InputTypeError(f"guess_sets must hold (k_pos, k_neg) pairs, got {item!r}.")
        k_pos = validate.integer("k_pos", item[0], minimum=0)
        k_neg = validate.integer("k_neg", item[1], minimum=0)
        if not 1 <= k_pos + k_neg <= m:
            raise ConfigurationError(f"each guess set needs 1 <= k_pos + k_neg <= m = {m}, got {(k_pos, k_neg)}.")
        out.append((k_pos, k_neg))
    if not out:
        raise ConfigurationError("guess_sets is empty; pass None for the default sweep.")
    return out


def _levels(level: float, count: int, weights: Sequence[float] | None) -> np.ndarray:
    """Each test's level: ``level * w_g / sum(w)`` (a weighted Bonferroni correction; equal weights by default)."""
    if weights is None:
        return np.full(count, level / count)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != (count,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ConfigurationError(
            f"weights must be {count} positive numbers, one per guess set, got {list(np.atleast_1d(w))}."
        )
    return level * w / w.sum()


def _tally(scores: np.ndarray, included: np.ndarray, sets: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    counts = [count_correct(guesses(scores, k_pos=kp, k_neg=kn), included) for kp, kn in sets]
    return np.array([c[0] for c in counts]), np.array([c[1] for c in counts])


def fdp_audit(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
    weights: Sequence[float] | None = None,
) -> FDPAuditResult:
    """The one-run f-DP audit of Mahloujifar, Melis and Chaudhuri (2025) with Gaussian curves, from canary scores.

    Args:
        scores: ``[m]`` finite scores, higher = "more likely included", computed without looking at the coins.
        included: ``[m]`` booleans, the coins.
        delta: the delta at which the ``mu`` bound is turned into an epsilon (use the run's delta).
        confidence: the probability that a run whose curve is at least as private as ``G_mu`` gets a bound below
            ``mu`` (default 0.95).
        guess_sets: ``(k_pos, k_neg)`` pairs to try, each at level ``(1 - confidence) / len(guess_sets)``
            (Bonferroni); None: :func:`default_guess_sets`.
        weights: one positive weight per guess set: set ``g`` is tested at level ``(1 - confidence) w_g / sum(w)``
            (a weighted Bonferroni correction, still valid at ``confidence``); None: equal weights.

    Returns:
        An :class:`FDPAuditResult` for the guess set with the largest bound.
    """
    s, c = _scores_and_coins(scores, included)
    delta = validate.delta("delta", delta)
    level = _level(confidence)
    sets = _guess_sets(len(s), guess_sets)
    r, v = _tally(s, c, sets)
    bounds = _gaussian_bounds(len(s), r, v, _levels(level, len(sets), weights))
    best = int(np.argmax(bounds))
    mu = float(bounds[best])
    return FDPAuditResult(
        mu, gaussian_epsilon(mu, delta=delta), delta, 1.0 - level, len(s), int(r[best]), int(v[best]), *sets[best]
    )


def audit_claim(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    tradeoff: Tradeoff,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
    weights: Sequence[float] | None = None,
) -> ClaimTest:
    """Test one claimed trade-off curve (for example :func:`profile_tradeoff` of an accountant's profile) with the
    test of the module docstring, sweeping ``guess_sets`` with a (``weights``-weighted) Bonferroni correction as
    :func:`fdp_audit` does.

    A run that is truly ``tradeoff``-DP is rejected with probability at most ``1 - confidence``.
    """
    s, c = _scores_and_coins(scores, included)
    level = _level(confidence)
    sets = _guess_sets(len(s), guess_sets)
    r, v = _tally(s, c, sets)
    inverse = _inverse(tradeoff, None)
    hit = _rejected(inverse, len(s), r, v, _levels(level, len(sets), weights))
    best = int(np.argmax(hit)) if hit.any() else int(np.argmax(v / np.maximum(r, 1)))
    return ClaimTest(bool(hit.any()), 1.0 - level, len(s), int(r[best]), int(v[best]), *sets[best])


def select_guess_set(
    simulated: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    candidates: Sequence[tuple[int, int]] | None = None,
) -> tuple[int, int]:
    """The guess set to test a real run with, chosen before the run from simulated audits of the claimed mechanism.

    A choice that depends on public information only (the claimed mechanism, never the run's coins) costs no
    Bonferroni correction: test the run with ``fdp_audit(..., guess_sets=[select_guess_set(...)])`` at the full
    level. This is how the audit gets within about half of the theoretical epsilon with 1,000 canaries.

    Args:
        simulated: ``(scores [m], included [m])`` pairs from runs of the claimed mechanism (for Dirac canaries,
            :func:`simulate_dirac_observations` and the score the real audit uses).
        candidates: ``(k_pos, k_neg)`` pairs; default 2.5%, 5%, 7.5%, 10%, 15% and 20% of ``m`` on both sides and on
            the "in" side only.

    Returns:
        The candidate with the largest mean ``mu`` bound (ties: the first).
    """
    if not simulated:
        raise ConfigurationError("select_guess_set needs at least one simulated (scores, included) pair.")
    m = len(np.asarray(simulated[0][0]))
    if candidates is None:
        ks = sorted({max(1, round(m * f)) for f in (0.025, 0.05, 0.075, 0.1, 0.15, 0.2)})
        candidates = [(k, k) for k in ks if 2 * k <= m] + [(k, 0) for k in ks]
    sets = _guess_sets(m, candidates)
    total = np.zeros(len(sets))
    for scores, included in simulated:
        s, c = _scores_and_coins(scores, included)
        if len(s) != m:
            raise ConfigurationError(f"every simulation needs the same number of canaries, got {len(s)} and {m}.")
        r, v = _tally(s, c, sets)
        total += _gaussian_bounds(m, r, v, 0.05)
    return sets[int(np.argmax(total))]


def simulate_dirac_observations(
    key: Key,
    *,
    num_canaries: int,
    steps: int,
    sample_rate: float,
    noise_multiplier: float,
) -> tuple[np.ndarray, np.ndarray]:
    """What an auditor sees of ``num_canaries`` Dirac canaries in a DP-SGD run with Poisson sampling that does
    exactly what it claims: ``x[t, j] = b_tj + z N(0, 1)``, ``b_tj ~ Bernoulli(q)`` for included canaries, 0 for the
    others (sensitivity units).

    Args:
        key: draws come from ``fold_in(key, "opake.audit.simulation")``; the coins from
            :func:`opake_core.audit.coin_flips` with the same key.
        num_canaries: ``m``.
        steps: ``T``.
        sample_rate: ``q`` in (0, 1].
        noise_multiplier: ``z >= 0``.

    Returns:
        ``(observations [T, m] float64, included [m] bool)``.
    """
    m = validate.integer("num_canaries", num_canaries, minimum=1)
    t = validate.integer("steps", steps, minimum=1)
    q = validate.rate("sample_rate", sample_rate)
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    included = coin_flips(key, m)
    gen = numpy_generator(fold_in(key, "opake.audit.simulation"))
    sampled = (gen.random((t, m)) < q) & included[None, :]
    return sampled + z * gen.standard_normal((t, m)), included


# -- canary scores from white-box observations ----------------------------------------------------------------------


def _observations(observations: object) -> np.ndarray:
    x = np.asarray(observations, dtype=np.float64)
    if x.ndim != 2:
        raise ConfigurationError(
            f"observations must be [steps, canaries] (one row per step), got shape {x.shape}; use x[None] for one step."
        )
    if not np.all(np.isfinite(x)):
        raise ConfigurationError(f"observations hold {int(np.sum(~np.isfinite(x)))} non-finite values.")
    return x


def _mask(mask: object, shape: tuple[int, int]) -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    out = np.asarray(mask)
    if out.dtype != np.bool_:
        raise InputTypeError(f"mask must be boolean (True = the canary may participate at that step), got {out.dtype}.")
    try:
        return np.broadcast_to(out, shape)
    except ValueError:
        raise ConfigurationError(f"mask of shape {out.shape} does not broadcast to the observations {shape}.") from None


def likelihood_ratio_scores(
    observations: np.ndarray,
    *,
    noise_multiplier: float,
    sample_rate: float,
    signal: float | np.ndarray = 1.0,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Log-likelihood ratios of "included" against "excluded" for each canary of a Poisson-subsampled Gaussian.

    Under "included", ``x_t = a_t b_t + z N(0, 1)`` with ``b_t ~ Bernoulli(q)``; under "excluded", ``x_t = z N(0,
    1)``. The steps are independent, so the log-likelihood ratio is

        sum_t log(1 - q + q exp((a_t x_t - a_t^2 / 2) / z^2)),

    the Neyman-Pearson statistic for one canary: thresholding it is the most powerful test at every type I
    error, so with non-interfering canaries (Dirac canaries on separate coordinates) the scores realize the
    mechanism's trade-off curve, which is what makes the one-run bound tight.

    Args:
        observations: ``[T, m]`` in units of the per-step sensitivity (see the module docstring).
        noise_multiplier: ``z > 0``, the multiplier the run claims.
        sample_rate: ``q`` in (0, 1], the rate the accountant uses.
        signal: ``a_t``, a canary's contribution when sampled, in sensitivity units (1 for a clipped canary of norm
            at least the clipping bound); a scalar, ``[T]`` or ``[T, m]``.
        mask: ``[T, m]`` (or broadcastable) booleans: the steps at which each canary can participate (cyclic
            sampling); the others are ignored. None: every step.

    Returns:
        ``[m]`` scores (float64).
    """
    x = _observations(observations)
    z = validate.positive("noise_multiplier", noise_multiplier)
    q = validate.rate("sample_rate", sample_rate)
    a = np.asarray(signal, dtype=np.float64)
    a = a[:, None] if a.ndim == 1 else a
    keep = _mask(mask, x.shape)
    exponent = (a * x - a * a / 2) / (z * z)
    terms = exponent if q == 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + exponent)
    return np.where(keep, terms, 0.0).sum(axis=0)


def sum_scores(observations: np.ndarray, *, mask: np.ndarray | None = None) -> np.ndarray:
    """``sum_t x_t`` per canary (``[T, m] -> [m]``): the dot product of the canary's gradient with the summed
    updates, the white-box score of Steinke, Nasr and Jagielski (2023); the final model reveals exactly this under
    SGD."""
    x = _observations(observations)
    return np.where(_mask(mask, x.shape), x, 0.0).sum(axis=0)


def max_scores(observations: np.ndarray, *, mask: np.ndarray | None = None) -> np.ndarray:
    """``max_t x_t`` per canary (``[T, m] -> [m]``): the largest single-step response, the all-iterates score of Nasr
    et al. (2023) for rarely sampled canaries."""
    x = _observations(observations)
    return np.where(_mask(mask, x.shape), x, -np.inf).max(axis=0)


def matrix_projections(observations: np.ndarray, strategy_matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decorrelate DP-FTRL observations: ``x = u + z s C^-1 w`` becomes one statistic per step.

    With ``y = C x = C u + z s w`` (``w`` white), the projection of ``y`` on column ``t`` of ``C``, divided by
    ``||C[:, t]||`` and by the largest column norm ``||c||``, is ``u_t a_t + z_1 N(0, 1)`` with ``a_t =
    ||C[:, t]|| / ||c||`` and ``z_1 = z s / ||c||`` (the multiplier :func:`opake_core.accounting.mf_process` accounts)
    whenever the other participations of the canary sit on orthogonal columns (BandMF under cyclic sampling,
    Choquette-Choo et al. 2023, Theorem 1). Feed the result to :func:`likelihood_ratio_scores` with ``signal=a``
    and ``noise_multiplier=z_1``.

    Args:
        observations: ``[T, m]`` in units of the per-step sensitivity.
        strategy_matrix: ``C``, ``[T, T]`` lower-triangular (``opake_core.mf.materialize(strategy, T)``).

    Returns:
        ``(projections [T, m], a [T])``.
    """
    x = _observations(observations)
    c = np.asarray(strategy_matrix, dtype=np.float64)
    if c.shape != (x.shape[0], x.shape[0]):
        raise ConfigurationError(
            f"strategy_matrix must be [T, T] with T = {x.shape[0]} steps of observations, got {c.shape}."
        )
    norms = np.linalg.norm(c, axis=0)
    if np.any(norms <= 0):
        raise ConfigurationError("strategy_matrix has a zero column; a strategy matrix is invertible.")
    top = float(norms.max())
    projections = (c.T @ (c @ x)) / (norms[:, None] * top)
    return projections, norms / top
