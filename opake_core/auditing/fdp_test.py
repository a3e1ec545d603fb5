"""The one-run f-DP test (Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy in One Run", ICML 2025,
arXiv 2410.22235): whether canary guesses reject a claimed trade-off curve, the ``mu`` lower bound of Gaussian curves,
and the audits from canary scores.

Notation (that of :mod:`opake_core.auditing.one_run`): ``m`` canaries, each included independently with probability
1/2; the auditor guesses "in" for the ``k_pos`` highest scores and "out" for the ``k_neg`` lowest and abstains on the
rest: ``r = k_pos + k_neg`` guesses (the paper's ``c'``), ``v`` of them correct (the paper's ``c``). ``tau = 1 -
confidence`` is the level of the test. The curves tested (Gaussian ``G_mu``, a privacy profile's, an accounting
process's) are those of :mod:`opake_core.auditing.tradeoff_curves`.

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
Bonferroni correction, as :func:`opake_core.auditing.one_run.one_run_audit` does.

The empirical epsilon is ``gaussian_epsilon(mu_lower_bound, delta)``, the paper's "empirical privacy": the epsilon
at ``delta`` of the least private Gaussian curve the run rejects. It is a lower bound on the epsilon of any
mechanism whose trade-off curve is Gaussian; for another curve (subsampled mechanisms), test the claimed curve
itself with :func:`audit_claim` and :func:`~opake_core.auditing.tradeoff_curves.profile_tradeoff`.

Everything here is a pure function of NumPy arrays; the canary scores come from
:mod:`opake_core.auditing.white_box_scores` or from the training side, :mod:`opake_torch.auditing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special

from opake_core import validate
from opake_core.auditing.one_run import count_correct, guesses
from opake_core.auditing.tradeoff_curves import Tradeoff, gaussian_epsilon
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "MU_MAX",
    "ClaimTest",
    "FDPAuditResult",
    "audit_claim",
    "default_guess_sets",
    "fdp_audit",
    "mu_lower_bound",
    "rejects",
    "select_guess_set",
]

MU_MAX = 10.0
"""The largest ``mu`` the search considers (epsilon about 45 at delta 1e-5): far above what 10^6 canaries show."""
_COARSE = 0.02
_FINE = 0.001


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
        mu = validate.non_negative("mu", mu)
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

    Example: canaries seen through a Gaussian release of multiplier 0.5 are ``mu = 2`` GDP; the bound on ``mu`` is
    positive and below 2, and scores that ignore the coins give none.

        >>> import numpy as np
        >>> from opake_core import fdp_audit, random
        >>> from opake_core.auditing import coin_flips
        >>> included, noise = coin_flips(random.key(0), 1_000), np.random.default_rng(0).standard_normal(1_000)
        >>> result = fdp_audit(included + 0.5 * noise, included, delta=1e-5)
        >>> 0.0 < result.mu < 2.0, fdp_audit(noise, included, delta=1e-5).mu
        (True, 0.0)
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
    """Test one claimed trade-off curve (for example
    :func:`~opake_core.auditing.tradeoff_curves.profile_tradeoff` of an accountant's profile) with the test of the
    module docstring, sweeping ``guess_sets`` with a (``weights``-weighted) Bonferroni correction as
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
            :func:`~opake_core.auditing.white_box_scores.simulate_dirac_observations` and the score the real
            audit uses).
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
