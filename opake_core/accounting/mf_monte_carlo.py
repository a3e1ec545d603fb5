"""Monte Carlo accounting of DP-FTRL runs whose dominating pair has no closed form.

Two whole-horizon processes of :func:`opake_core.accounting.mf_process` are accounted here, following jax_privacy's
``experimental/monte_carlo``: :class:`BallsInBinsMF` (fixed-bin balls-in-bins sampling, Choquette-Choo et al. 2024,
arXiv 2410.06266, Lemma 3.2) and :class:`BMinSepMF` (banded MF with b-min-sep sampling, Dong and Ganesh 2026, arXiv
2602.09338, Eq. 2). The dominating pair is ``Q = N(0, s^2 I_n)`` against ``P = E_x N(C x, s^2 I_n)`` (``x`` the
participation pattern the sampler draws for one example, ``s = z_1`` with ``||c|| = 1``); the privacy loss is
sampled under ``P`` (add direction) and ``-L`` under ``Q`` (remove direction), and delta is bounded by the one-sided
Chernoff bound of :mod:`opake_core.accounting.random_allocation` (Bonferroni over both directions and the epsilon
grid): an answer holds with probability >= 1 - ``failure_probability``. Every answer is also capped by the exact
unamplified Gaussian bound (:func:`unamplified`, Balle and Wang 2018), reported as ``"analytic_gaussian"`` when
smaller.

Default sample count when no ``MonteCarlo`` is given: ``N = ceil(4 * log(2 G / beta) / delta)`` for the queried
delta, ``G`` the grid size (10 001) and ``beta = 1e-6``, so the certified floor ``log(2 G / beta) / N`` is delta / 4.
Samples are drawn from ``fold_in(key(seed), "opake.accounting.mf.<sampler>", direction, chunk)``: reproducible.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
import numpy as np
from scipy.special import logsumexp
from scipy.stats import norm

from opake_core import validate
from opake_core.accounting import random_allocation as _ra
from opake_core.accounting.processes import Process, gaussian
from opake_core.errors import ConfigurationError
from opake_core.mf import toeplitz as _toeplitz
from opake_core.random import fold_in, key, numpy_generator

__all__ = ["BMinSepMF", "BallsInBinsMF", "MonteCarloMF", "default_monte_carlo", "delta", "epsilon", "unamplified"]

_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class BallsInBinsMF:
    """A whole run of MF noise with fixed-bin balls-in-bins sampling, accounted by Monte Carlo.

    Attributes:
        coef: the first column of ``C`` over the horizon (``n_steps`` values, ``>= 0``), scaled to unit norm.
        noise_multiplier: ``z_1``, the noise std over ``||c||`` (see the module docstring).
        num_bins: the number of bins ``b``.
        n_steps: the horizon, a multiple of ``num_bins``.

    Example: :func:`~opake_core.accounting.mf_process` builds it; its epsilon is never above the unamplified
    Gaussian bound (``amplified=False``), which answers when the samples cannot certify less.

        >>> import dp_accounting
        >>> from opake_core import accounting, mf, sampling
        >>> sampler = sampling.balls_in_bins(dataset_size=1_000, num_bins=4)
        >>> run = accounting.mf_process(mf.bsr(bandwidth=2), sampler=sampler, noise_multiplier=2.0, n_steps=8)
        >>> type(run).__name__, run.num_bins, len(run.coef)
        ('BallsInBinsMF', 4, 8)
        >>> settings = accounting.MonteCarlo(num_samples=20_000, failure_probability=1e-3)
        >>> result = accounting.epsilon(run, delta=1e-3, monte_carlo=settings)
        >>> plain = accounting.mf_process(mf.bsr(bandwidth=2), sampler=sampler, noise_multiplier=2.0, n_steps=8,
        ...                               amplified=False)
        >>> result.value <= dp_accounting.get_epsilon_gaussian(plain.noise_multiplier, 1e-3)
        True
    """

    coef: tuple[float, ...]
    noise_multiplier: float
    num_bins: int
    n_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", _unit_coef(self.coef))
        object.__setattr__(
            self, "noise_multiplier", validate.noise_multiplier("noise_multiplier", self.noise_multiplier)
        )
        validate.integer("num_bins", self.num_bins, minimum=1)
        validate.integer("n_steps", self.n_steps, minimum=1)
        _check_bins(self.n_steps, self.num_bins)
        if len(self.coef) != self.n_steps:
            raise ConfigurationError(f"coef needs n_steps={self.n_steps} values, got {len(self.coef)}.")
        if min(self.coef) < -1e-12:
            raise ConfigurationError(
                f"the balls-in-bins dominating pair (Choquette-Choo et al. 2024, Lemma 3.2) needs C >= 0, got a "
                f"coefficient {min(self.coef):.3g}; use a strategy with non-negative coefficients."
            )


@dataclass(frozen=True)
class BMinSepMF:
    """A whole run of banded MF noise with b-min-sep sampling, accounted by Monte Carlo.

    Attributes:
        coef: the band ``c_0 .. c_{bands-1}`` of ``C``, scaled to unit norm (``bands <= min_sep``).
        noise_multiplier: ``z_1``, the noise std over ``||c||``.
        min_sep: ``b``, the minimum separation of two participations.
        sampling_prob: ``p``, the probability that an eligible example joins a step.
        n_steps: the horizon.

    Example: BandMF with 2 bands under b-min-sep sampling with ``min_sep = 4``.

        >>> from opake_core import accounting, mf, sampling
        >>> sampler = sampling.b_min_sep(dataset_size=1_000, sample_rate=0.05, min_sep=4)
        >>> run = accounting.mf_process(mf.band_mf(bands=2), sampler=sampler, noise_multiplier=2.0, n_steps=8)
        >>> type(run).__name__, run.min_sep, len(run.coef), run.sampling_prob == sampler.sampling_prob
        ('BMinSepMF', 4, 2, True)
        >>> settings = accounting.MonteCarlo(num_samples=20_000, failure_probability=1e-3)
        >>> accounting.epsilon(run, delta=1e-3, monte_carlo=settings).value < 3.0
        True
    """

    coef: tuple[float, ...]
    noise_multiplier: float
    min_sep: int
    sampling_prob: float
    n_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", _unit_coef(self.coef))
        object.__setattr__(
            self, "noise_multiplier", validate.noise_multiplier("noise_multiplier", self.noise_multiplier)
        )
        validate.integer("min_sep", self.min_sep, minimum=1)
        object.__setattr__(self, "sampling_prob", validate.rate("sampling_prob", self.sampling_prob))
        validate.integer("n_steps", self.n_steps, minimum=1)
        if len(self.coef) > self.min_sep:
            raise ConfigurationError(
                f"b-min-sep accounting needs bands <= min_sep (participations' columns of C must not overlap), got "
                f"bands={len(self.coef)} and min_sep={self.min_sep}; use band_mf(bands<={self.min_sep}) or a larger "
                "min_sep."
            )


MonteCarloMF = BallsInBinsMF | BMinSepMF


def _unit_coef(coef: Any) -> tuple[float, ...]:
    c = np.asarray(coef, dtype=np.float64).ravel()
    if c.size == 0 or not np.all(np.isfinite(c)) or not np.linalg.norm(c) > 0:
        raise ConfigurationError(f"coef must be finite and not all zero, got {coef!r}.")
    scale = float(np.linalg.norm(c))
    return tuple(float(v) for v in (c if abs(scale - 1.0) < 1e-12 else c / scale))  # idempotent: JSON round trips


def _check_bins(n_steps: int, num_bins: int) -> None:
    if n_steps % num_bins:
        lower, upper = (n_steps // num_bins) * num_bins, (n_steps // num_bins + 1) * num_bins
        raise ConfigurationError(
            f"balls-in-bins accounting needs whole epochs: n_steps={n_steps} is not a multiple of num_bins="
            f"{num_bins}; use n_steps={upper}" + (f" or {lower}." if lower else ".")
        )


def _generator(process: MonteCarloMF, add: bool, seed: int, chunk: int) -> np.random.Generator:
    tag = "balls_in_bins" if isinstance(process, BallsInBinsMF) else "b_min_sep"
    return numpy_generator(fold_in(key(seed), f"opake.accounting.mf.{tag}", "add" if add else "remove", chunk))


def _bins_gram(process: BallsInBinsMF) -> np.ndarray:
    """``G = M^T M`` for the modes ``M[:, j] = C x_j`` (``x_j`` the steps ``j, j + b, ...``)."""
    n, b, c = process.n_steps, process.num_bins, np.asarray(process.coef)
    modes = np.empty((n, b))
    for j in range(b):
        pattern = np.zeros(n)
        pattern[j::b] = 1.0
        modes[:, j] = np.convolve(c, pattern)[:n] if n <= 4096 else _fft_conv(c, pattern, n)
    return modes.T @ modes


def _fft_conv(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    size = 1 << (2 * n - 1).bit_length()
    return np.fft.irfft(np.fft.rfft(a, size) * np.fft.rfft(b, size), size)[:n]


def _bins_losses(process: BallsInBinsMF, add: bool, num_samples: int, seed: int) -> np.ndarray:
    gram, b, s = _bins_gram(process), process.num_bins, process.noise_multiplier
    w, v = np.linalg.eigh(gram)
    root = v * np.sqrt(np.clip(w, 0.0, None))  # root @ root.T == gram: rows of g @ root.T ~ N(0, gram)
    out = np.empty(num_samples)
    rows = max(1, _CHUNK_ELEMENTS // b)
    for chunk, start in enumerate(range(0, num_samples, rows)):
        gen = _generator(process, add, seed, chunk)
        size = min(rows, num_samples - start)
        proj = s * (gen.standard_normal((size, b)) @ root.T)  # <C x_j, s g> for every mode j
        if add:
            proj += gram[gen.integers(0, b, size)]  # y = C x_J + s g, J uniform
        llr = (proj - 0.5 * np.diag(gram)) / s**2
        loss = logsumexp(llr, axis=1) - math.log(b)
        out[start : start + size] = loss if add else -loss
    return out


def _min_sep_losses(process: BMinSepMF, add: bool, num_samples: int, seed: int) -> np.ndarray:
    c, n, b, p, s = (
        np.asarray(process.coef),
        process.n_steps,
        process.min_sep,
        process.sampling_prob,
        process.noise_multiplier,
    )
    bands = len(c)
    col_sq = np.array([float(c[: min(bands, n - i)] @ c[: min(bands, n - i)]) for i in range(n)])
    log_p, log_q = math.log(p), (math.log1p(-p) if p < 1 else -math.inf)
    out = np.empty(num_samples)
    rows = max(1, _CHUNK_ELEMENTS // (n + b))
    for chunk, start in enumerate(range(0, num_samples, rows)):
        gen = _generator(process, add, seed, chunk)
        size = min(rows, num_samples - start)
        y = s * gen.standard_normal((size, n))
        if add:
            # One example's chain from the stationary (warm-start) distribution of the b-min-sep sampler.
            waiting = np.where(gen.random(size) < 1 / (1 + (b - 1) * p), 0, gen.integers(1, b, size) if b > 1 else 0)
            x = np.zeros((size, n))
            for t in range(n):
                joined = (waiting == 0) & (gen.random(size) < p)
                x[:, t] = joined
                waiting = np.where(joined, b - 1, np.maximum(waiting - 1, 0))
            for r in range(bands):
                y[:, r:] += c[r] * x[:, : n - r]
        corr = np.zeros((size, n))
        for r in range(bands):
            corr[:, : n - r] += c[r] * y[:, r:]
        llr = (corr - 0.5 * col_sq) / s**2
        # Dong and Ganesh 2026, Eq. 2: L_i = log((1 - p) e^{L_{i+1}} + p e^{llr_i + L_{i+b}}), L_{>=n} = 0.
        suffix = np.zeros((size, n + b))
        with np.errstate(divide="ignore"):
            for i in range(n - 1, -1, -1):
                suffix[:, i] = np.logaddexp(log_q + suffix[:, i + 1], log_p + llr[:, i] + suffix[:, i + b])
        terms = np.concatenate([suffix[:, :1], log_p + suffix[:, 1:b]], axis=1)
        loss = logsumexp(terms, axis=1) - math.log1p((b - 1) * p)
        out[start : start + size] = loss if add else -loss
    return out


def _samples(process: MonteCarloMF, config: _ra.MonteCarlo) -> tuple[np.ndarray, np.ndarray]:
    draw = _bins_losses if isinstance(process, BallsInBinsMF) else _min_sep_losses
    return tuple(np.sort(draw(process, add, config.num_samples, config.seed)) for add in (True, False))


def default_monte_carlo(delta: float) -> _ra.MonteCarlo:
    """The Monte Carlo settings used when none are given: enough samples that the certified floor is delta / 4."""
    base = _ra.MonteCarlo()
    return replace(
        base, num_samples=builtins.max(100_000, math.ceil(4 * base.log_term / validate.delta("delta", delta)))
    )


def _mc_epsilon(samples: tuple[np.ndarray, np.ndarray], delta: float, config: _ra.MonteCarlo) -> float:
    def ok(i: int) -> bool:
        return max(_ra._delta_bound(s, i * config.epsilon_resolution, config) for s in samples) <= delta

    lo, hi = -1, config.grid_size - 1
    if not ok(hi):
        return math.inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi * config.epsilon_resolution


def unamplified(process: BallsInBinsMF | BMinSepMF) -> Process:
    """The one-Gaussian bound of a Monte Carlo process: ``gaussian(z_1 / sens)`` with ``sens`` the sensitivity of the
    unit-norm ``C`` under the sampler's participation pattern (valid without any amplification argument)."""
    n, c = process.n_steps, np.asarray(process.coef)
    if isinstance(process, BallsInBinsMF):
        sens_sq = _toeplitz.cyclic_sensitivity_squared(c, process.num_bins, n=n)
    else:
        sens_sq = _toeplitz.minsep_sensitivity_squared(c, process.min_sep, n=n)
    return gaussian(process.noise_multiplier / math.sqrt(sens_sq))


def _gaussian_delta(sigma: float, eps: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with multiplier ``sigma`` (Balle and Wang 2018, Thm 8)."""
    a, b = 0.5 / sigma, eps * sigma
    return float(max(0.0, norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)))


def epsilon(process: MonteCarloMF, *, delta: float, config: _ra.MonteCarlo | None = None) -> tuple[float, str]:
    """Epsilon at ``delta`` (``config`` default :func:`default_monte_carlo`) and the accountant that gave it."""
    if process.noise_multiplier == 0.0:
        return math.inf, "monte_carlo"
    config = config or default_monte_carlo(delta)
    sampled = _mc_epsilon(_samples(process, config), delta, config)
    bound = float(dp_accounting.get_epsilon_gaussian(unamplified(process).noise_multiplier, delta))
    return (sampled, "monte_carlo") if sampled <= bound else (bound, "analytic_gaussian")


def delta(process: MonteCarloMF, *, epsilon: float, config: _ra.MonteCarlo | None = None) -> tuple[float, str]:
    """Delta at ``epsilon`` (``config`` default ``MonteCarlo()``) and the accountant that gave it."""
    if process.noise_multiplier == 0.0:
        return 1.0, "monte_carlo"
    config = config or _ra.MonteCarlo()
    sampled = max(_ra._delta_bound(s, epsilon, config) for s in _samples(process, config))
    bound = _gaussian_delta(unamplified(process).noise_multiplier, epsilon)
    return (sampled, "monte_carlo") if sampled <= bound else (bound, "analytic_gaussian")
