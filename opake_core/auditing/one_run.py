"""The statistics of the one-run privacy audit (Steinke, Nasr and Jagielski, NeurIPS 2023, arXiv 2305.08846).

Notation: ``m`` canaries, each included in the training set independently with probability 1/2 (``S_i = +1`` in,
``S_i = -1`` out). After training, the auditor scores every canary, guesses ``+1`` for the ``k_pos`` highest scores,
``-1`` for the ``k_neg`` lowest and abstains on the rest: ``r = k_pos + k_neg`` guesses, ``v`` of them correct.

Theorem (the paper's Theorem 3 with its delta term, Appendix D): if training is (eps, delta)-DP with respect to the
canaries, then for every ``v``

    P[W >= v] <= P[Binomial(r, q) >= v] + 2 m delta * max_{1 <= i <= v} (1 / i) * P[v - i <= Binomial(r, q) < v],

with ``q = e^eps / (1 + e^eps)`` (the accuracy of eps-randomized response). The right-hand side is the p-value of
``v`` correct guesses under the null hypothesis "(eps, delta)-DP". :func:`epsilon_lower_bound` returns the largest
``eps`` the observed ``v`` rejects at level ``1 - confidence`` (0 when none is rejected): with probability at least
``confidence`` over the coins and the training randomness, a mechanism that *is* (eps, delta)-DP gets a lower bound
``<= eps``. The guarantee holds for any scoring function that does not look at the coins, so a conservative
bound can never be "too good" because of a clever score.

One-run audits are loose by design (each canary is one binary observation), so the bound of a correct DP-SGD run is
usually far below its theoretical epsilon; it can only be large when the mechanism leaks (a bug, or no noise). The
ceiling for ``m`` canaries is about ``ln(m)`` at ``delta`` well below ``1 / m``.

The bound says nothing about parameters the canaries do not touch, nor about whether the claimed epsilon is the
one the run's accountant reported: :mod:`opake_core.auditing.noise_scale` and
:mod:`opake_core.auditing.accounting_check` check those.

Everything here is a pure function on numbers (NumPy / SciPy); the training side lives in :mod:`opake_torch.auditing`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key, fold_in, numpy_generator

__all__ = [
    "AuditResult",
    "coin_flips",
    "count_correct",
    "epsilon_lower_bound",
    "guesses",
    "one_run_audit",
    "p_value",
]

TAG = "opake.audit.coin_flip"
_EPS_MAX = 50.0


@dataclass(frozen=True)
class AuditResult:
    """The outcome of a one-run audit.

    Attributes:
        epsilon: the empirical lower bound on epsilon (0 when nothing is rejected).
        delta: the delta it holds at.
        confidence: the probability (over coins and training) that a truly (epsilon, delta)-DP run would give a bound
            below ``epsilon``; with a sweep over several ``k`` it already includes the Bonferroni correction.
        num_canaries: ``m``.
        num_guesses: ``r`` of the chosen guess set.
        num_correct: ``v`` of the chosen guess set.
        k_pos, k_neg: how many top / bottom scores were guessed "in" / "out".
    """

    epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    k_pos: int
    k_neg: int

    @property
    def accuracy(self) -> float:
        """``v / r`` (nan without guesses)."""
        return self.num_correct / self.num_guesses if self.num_guesses else math.nan


def _count(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InputTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


def _check_counts(m: int, r: int, v: int) -> tuple[int, int, int]:
    m, r, v = _count("m", m, 1), _count("r", r), _count("v", v)
    if not v <= r <= m:
        raise ConfigurationError(
            f"need 0 <= v <= r <= m (correct guesses <= guesses <= canaries), got v={v}, r={r}, m={m}."
        )
    return m, r, v


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 <= delta < 1:
        raise ConfigurationError(f"delta must be a number in [0, 1), got {delta!r}.")
    return float(delta)


def _check_confidence(confidence: object) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) or not 0 < confidence < 1:
        raise ConfigurationError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}.")
    return float(confidence)


def p_value(m: int, r: int, v: int, *, epsilon: float, delta: float) -> float:
    """The p-value of ``v`` correct guesses out of ``r`` (``m`` canaries) under the null "(epsilon, delta)-DP".

    See the module docstring for the bound; the result is capped at 1.
    """
    m, r, v = _check_counts(m, r, v)
    delta = _check_delta(delta)
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not 0 <= epsilon < math.inf:
        raise ConfigurationError(f"epsilon must be finite and >= 0, got {epsilon!r}.")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    # below[i - 1] = P[v - i <= Binomial(r, q) < v] for i = 1..v
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, *, delta: float, confidence: float = 0.95) -> float:
    """The largest epsilon rejected at level ``1 - confidence`` by ``v`` correct out of ``r`` guesses (``m`` canaries).

    The p-value increases with epsilon, so this is a bisection to an absolute tolerance of 1e-6 (rounded down,
    so the bound stays conservative). Returns 0.0 when even epsilon = 0 is not rejected.
    """
    m, r, v = _check_counts(m, r, v)
    delta, confidence = _check_delta(delta), _check_confidence(confidence)
    level = 1.0 - confidence
    if p_value(m, r, v, epsilon=0.0, delta=delta) > level:
        return 0.0
    lo, hi = 0.0, _EPS_MAX
    if p_value(m, r, v, epsilon=hi, delta=delta) <= level:
        return hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if p_value(m, r, v, epsilon=mid, delta=delta) <= level:
            lo = mid
        else:
            hi = mid
    return lo


def coin_flips(key: Key, num_canaries: int) -> np.ndarray:
    """Fair coins for ``num_canaries`` canaries (True = included), drawn from ``fold_in(key, TAG)`` only."""
    if not isinstance(key, Key):
        raise InputTypeError(f"coin_flips needs key=opake_core.random.key(seed), got {type(key).__name__}.")
    num_canaries = _count("num_canaries", num_canaries, 1)
    return numpy_generator(fold_in(key, TAG)).random(num_canaries) < 0.5


def _as_1d(name: str, values: object, dtype: type) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ConfigurationError(f"{name} must be one-dimensional (one entry per canary), got shape {array.shape}.")
    if dtype is bool and array.dtype != np.bool_:
        raise InputTypeError(f"{name} must be a boolean array (True = included), got dtype {array.dtype}.")
    if dtype is float:
        array = array.astype(np.float64)
        if not np.all(np.isfinite(array)):
            raise ConfigurationError(f"{name} holds {int(np.sum(~np.isfinite(array)))} non-finite values; clamp them.")
    return array


def guesses(scores: Sequence[float] | np.ndarray, *, k_pos: int, k_neg: int) -> np.ndarray:
    """Guesses in {-1, 0, +1}: +1 for the ``k_pos`` highest scores, -1 for the ``k_neg`` lowest, 0 elsewhere.

    Ties are broken by position (a stable sort), which does not depend on the coins.
    """
    scores = _as_1d("scores", scores, float)
    k_pos, k_neg = _count("k_pos", k_pos), _count("k_neg", k_neg)
    if k_pos + k_neg > len(scores):
        raise ConfigurationError(f"k_pos + k_neg = {k_pos + k_neg} exceeds the {len(scores)} canaries.")
    order = np.argsort(-scores, kind="stable")
    out = np.zeros(len(scores), dtype=np.int64)
    out[order[:k_pos]] = 1
    if k_neg:
        out[order[len(scores) - k_neg :]] = -1
    return out


def count_correct(guess: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """``(r, v)``: the number of non-zero guesses and how many of them match the coins."""
    guess = np.asarray(guess)
    included = _as_1d("included", included, bool)
    if guess.shape != included.shape:
        raise ConfigurationError(f"guesses {guess.shape} and coins {included.shape} must have the same shape.")
    truth = np.where(included, 1, -1)
    return int(np.count_nonzero(guess)), int(np.sum(guess * truth == 1))


def _default_ks(m: int) -> list[int]:
    ks = sorted({max(1, round(m * f)) for f in (0.02, 0.05, 0.1, 0.2, 0.5)})
    return [k for k in ks if 2 * k <= m]


def one_run_audit(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    k: int | Sequence[int] | None = None,
) -> AuditResult:
    """The one-run epsilon lower bound from canary scores (higher score = "more likely included").

    Args:
        scores: one finite score per canary, computed without looking at the coins (e.g. minus the loss).
        included: the coins (True = the canary was in the training set).
        delta: the delta of the null hypothesis; use the run's delta.
        confidence: the probability that a truly (eps, delta)-DP run gives a bound below eps (default 0.95).
        k: guess "in" for the ``k`` top and "out" for the ``k`` bottom scores. A sequence of ``k`` sweeps them and
            keeps the best bound, each computed at confidence ``1 - (1 - confidence) / len(k)`` (Bonferroni), so the
            reported confidence still holds. ``None`` sweeps 2%, 5%, 10%, 20% and 50% of ``m``.

    Returns:
        An :class:`AuditResult`.

    Example: 1,000 canaries, each seen through a Gaussian release of multiplier 0.5 (its score is its coin plus
    noise of std 0.5); the bound is positive and below that release's epsilon.

        >>> import dp_accounting
        >>> import numpy as np
        >>> from opake_core import one_run_audit, random
        >>> from opake_core.auditing import coin_flips
        >>> included = coin_flips(random.key(0), 1_000)
        >>> scores = included + 0.5 * np.random.default_rng(0).standard_normal(1_000)
        >>> bound = one_run_audit(scores, included, delta=1e-5)
        >>> 0.0 < bound.epsilon < dp_accounting.get_epsilon_gaussian(0.5, 1e-5), bound.num_canaries
        (True, 1000)
    """
    scores = _as_1d("scores", scores, float)
    included = _as_1d("included", included, bool)
    if scores.shape != included.shape:
        raise ConfigurationError(f"scores {scores.shape} and coins {included.shape} must have one entry per canary.")
    m = len(scores)
    if m < 2:
        raise ConfigurationError(f"the audit needs at least 2 canaries, got {m}; use hundreds for a useful bound.")
    confidence = _check_confidence(confidence)
    if k is None:
        ks = _default_ks(m)
    elif isinstance(k, int | np.integer) and not isinstance(k, bool):
        ks = [int(k)]
    else:
        ks = [_count("k", item, 1) for item in k]
    if not ks or any(kk < 1 or 2 * kk > m for kk in ks):
        raise ConfigurationError(f"every k must satisfy 1 <= k <= m / 2 = {m // 2}, got {ks}.")
    per_test = 1.0 - (1.0 - confidence) / len(ks)
    best: AuditResult | None = None
    for kk in ks:
        r, v = count_correct(guesses(scores, k_pos=kk, k_neg=kk), included)
        eps = epsilon_lower_bound(m, r, v, delta=delta, confidence=per_test)
        if best is None or eps > best.epsilon:
            best = AuditResult(eps, float(delta), confidence, m, r, v, kk, kk)
    assert best is not None
    return best
