"""Whole-horizon accounting of DP-FTRL (matrix-factorization) runs: one entry point, :func:`mf_process`.

``mf_process(strategy, sampler=..., noise_multiplier=z, n_steps=n)`` validates the triple (mechanism, sampler,
horizon) together and returns the process of the **whole** run; MF noise is correlated across steps, so there is no
per-step accounting and every epsilon reported during the run is this full-horizon value.

Noise convention (that of :func:`opake_core.mf.mf_gaussian_noise` and :func:`opake_core.step.dp_ftrl`): the run adds
``C^-1 w`` with ``w ~ N(0, (z * sens(C, P) * Delta)^2 I)``, ``Delta`` the per-step clipped sensitivity and ``P`` the
``participation`` the noise was scaled with (single participation by default, so ``sens = ||c||``, the max column
norm of ``C``). Pass the same ``participation`` here as to the noise. Below, ``z_1 = z * sens(C, P) / ||c||`` is the
multiplier relative to one column of ``C``.

==========================  =================  ===================================================================
mechanism                   sampler            process
==========================  =================  ===================================================================
``mf_band`` (BandMF)        ``cyclic_poisson`` ``repeat(poisson(gaussian(z_1), q), ceil(n / b))``: the exact
                                               reduction of Choquette-Choo et al. 2023 (arXiv 2306.08153, Theorem 1,
                                               formally Theorems 4-5, Algorithm 2): each group is visited every ``b``
                                               steps, its columns of the b-banded ``C`` are orthogonal, and each
                                               visit is a Poisson-subsampled Gaussian at the conditional rate ``q``
                                               with per-round sensitivity ``||c||``. Needs bands = groups.
``mf_band``                 ``b_min_sep``      :class:`BMinSepMF`, Monte Carlo (Dong and Ganesh 2026, arXiv
                                               2602.09338, Eq. 2); needs bands <= min_sep.
``mf_blt|bisr|bsr|``        ``balls_in_bins``  :class:`BallsInBinsMF`, Monte Carlo of the dominating pair of
``lambda_cgd``                                 Choquette-Choo et al. 2024 (arXiv 2410.06266, Lemma 3.2; needs
                                               ``C >= 0``); ``n_steps`` a multiple of the number of bins.
``mf_identity``             ``poisson``        exactly the DP-SGD process ``sampler.process(z_1, n)``.
``mf_identity``             ``balls_in_bins``  ``random_allocation(gaussian(z_1 / sqrt(k)), bins)``, ``k = n / bins``:
                                               fixed bins over ``k`` epochs with ``C = I`` have Gram ``k I``.
any of the above            (``amplified=False``) ``gaussian(z * sens(C, P) / sens(C, P_sampler))``: one Gaussian
                                               mechanism over the horizon with the sensitivity under the sampler's
                                               participation pattern (no amplification).
==========================  =================  ===================================================================

Monte Carlo (``BMinSepMF``, ``BallsInBinsMF``). Following jax_privacy's ``experimental/monte_carlo``: the dominating
pair is ``Q = N(0, s^2 I_n)`` against ``P = E_x N(C x, s^2 I_n)`` (``x`` the participation pattern the sampler draws
for one example, ``s = z_1`` with ``||c|| = 1``), the privacy loss ``L(y) = log E_x exp((2 <Cx, y> - ||Cx||^2) /
(2 s^2))`` is sampled under ``P`` (add direction) and ``-L`` under ``Q`` (remove direction), and delta is bounded by
the one-sided Chernoff bound of :mod:`opake_core.accounting.random_allocation` (Bonferroni over both directions and
the epsilon grid): an answer holds with probability >= 1 - ``failure_probability``. Balls-in-bins needs only the
``bins x bins`` Gram matrix of the modes ``C x_j`` (the loss depends on ``y`` through ``M^T y``), so a sample costs
O(bins^2); b-min-sep runs the backward recursion of Dong and Ganesh over the ``n`` steps, O(n * bands) per sample.
Samples are drawn from ``fold_in(key(seed), "opake.accounting.mf.<sampler>", direction, chunk)``: reproducible.
Default sample count when no ``MonteCarlo`` is given: ``N = ceil(4 * log(2 G / beta) / delta)`` for the queried
delta, ``G`` the grid size (10 001) and ``beta = 1e-6``, so the certified floor ``log(2 G / beta) / N`` is delta / 4
(about 9.5 million samples per direction at delta = 1e-5).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
import numpy as np
from scipy.special import logsumexp
from scipy.stats import norm

from opake_core import mf as _mf
from opake_core.accounting import _checks
from opake_core.accounting import random_allocation as _ra
from opake_core.accounting.calibration import Calibrated
from opake_core.accounting.calibration import calibrate_noise_multiplier as _calibrate
from opake_core.accounting.processes import Process, gaussian, poisson, random_allocation, repeat
from opake_core.accounting.queries import Result
from opake_core.accounting.queries import delta as _delta
from opake_core.accounting.queries import epsilon as _epsilon
from opake_core.errors import CalibrationError, ConfigurationError, InputTypeError
from opake_core.mf import toeplitz as _toeplitz
from opake_core.mf.participation import SINGLE
from opake_core.random import fold_in, key, numpy_generator

__all__ = [
    "COMPATIBLE_SAMPLERS",
    "BMinSepMF",
    "BallsInBinsMF",
    "MFProcess",
    "calibrate_mf_noise_multiplier",
    "default_monte_carlo",
    "mechanism_name",
    "mf_delta",
    "mf_epsilon",
    "mf_process",
    "sampler_participation",
    "unamplified",
]

COMPATIBLE_SAMPLERS: dict[str, tuple[str, ...]] = {
    "mf_band": ("cyclic_poisson", "b_min_sep"),
    "mf_blt": ("balls_in_bins",),
    "mf_bisr": ("balls_in_bins",),
    "mf_bsr": ("balls_in_bins",),
    "mf_lambda_cgd": ("balls_in_bins",),
    "mf_identity": ("poisson", "balls_in_bins"),
}
"""The mechanism x sampler pairs that have an accountant here (``mf_process`` refuses every other pair)."""

_MECHANISMS = (
    ((_mf.BandMF, _mf.BandedToeplitz), "mf_band"),
    ((_mf.BLT, _mf.BufferedToeplitz), "mf_blt"),
    ((_mf.BISR,), "mf_bisr"),
    ((_mf.BSR,), "mf_bsr"),
    ((_mf.LambdaCGD,), "mf_lambda_cgd"),
    ((_mf.Identity,), "mf_identity"),
)
_CHUNK_ELEMENTS = 1 << 22
_CALIBRATION_PROBES = 40


def mechanism_name(strategy: Any) -> str:
    """The mechanism name (``"mf_band"``, ``"mf_blt"``, ...) of an :mod:`opake_core.mf` strategy."""
    for types, name in _MECHANISMS:
        if isinstance(strategy, types):
            return name
    raise InputTypeError(
        f"expected an opake_core.mf strategy (identity(), band_mf(), blt(), bsr(), bisr(), lambda_cgd()), got "
        f"{type(strategy).__name__}."
    )


def _sampler_name(sampler: Any) -> str:
    config = getattr(sampler, "config", None)
    name = dict(config).get("sampler") if isinstance(config, tuple) else None
    if not isinstance(name, str):
        raise InputTypeError(
            f"sampler must be an opake_core.sampling sampler (cyclic_poisson, b_min_sep, balls_in_bins, poisson), "
            f"got {type(sampler).__name__}."
        )
    return name


def sampler_participation(sampler: Any) -> _mf.MinSepParticipation | _mf.CyclicParticipation:
    """The participation pattern a sampler guarantees (what unamplified accounting and optimization use)."""
    name = _sampler_name(sampler)
    if name == "cyclic_poisson":
        return _mf.CyclicParticipation(sampler.bands)
    if name == "balls_in_bins":
        return _mf.CyclicParticipation(sampler.num_bins)
    if name == "b_min_sep":
        return _mf.MinSepParticipation(sampler.min_sep)
    if name == "poisson":
        return _mf.MinSepParticipation(1)
    raise ConfigurationError(f"the {name!r} sampler has no matrix-factorization participation pattern here.")


@dataclass(frozen=True)
class BallsInBinsMF:
    """A whole run of MF noise with fixed-bin balls-in-bins sampling, accounted by Monte Carlo.

    Attributes:
        coef: the first column of ``C`` over the horizon (``n_steps`` values, ``>= 0``), scaled to unit norm.
        noise_multiplier: ``z_1``, the noise std over ``||c||`` (see the module docstring).
        num_bins: the number of bins ``b``.
        n_steps: the horizon, a multiple of ``num_bins``.
    """

    coef: tuple[float, ...]
    noise_multiplier: float
    num_bins: int
    n_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", _unit_coef(self.coef))
        object.__setattr__(self, "noise_multiplier", _checks.noise_multiplier(self.noise_multiplier))
        _checks.integer("num_bins", self.num_bins, minimum=1)
        _checks.integer("n_steps", self.n_steps, minimum=1)
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
    """

    coef: tuple[float, ...]
    noise_multiplier: float
    min_sep: int
    sampling_prob: float
    n_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", _unit_coef(self.coef))
        object.__setattr__(self, "noise_multiplier", _checks.noise_multiplier(self.noise_multiplier))
        _checks.integer("min_sep", self.min_sep, minimum=1)
        object.__setattr__(self, "sampling_prob", _checks.rate("sampling_prob", self.sampling_prob))
        _checks.integer("n_steps", self.n_steps, minimum=1)
        if len(self.coef) > self.min_sep:
            raise ConfigurationError(
                f"b-min-sep accounting needs bands <= min_sep (participations' columns of C must not overlap), got "
                f"bands={len(self.coef)} and min_sep={self.min_sep}; use band_mf(bands<={self.min_sep}) or a larger "
                "min_sep."
            )


MonteCarloMF = BallsInBinsMF | BMinSepMF
MFProcess = Process | BallsInBinsMF | BMinSepMF


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


def mf_process(
    strategy: Any,
    *,
    sampler: Any,
    noise_multiplier: float,
    n_steps: int,
    participation: Any = SINGLE,
    amplified: bool = True,
) -> MFProcess:
    """The whole-horizon privacy process of a DP-FTRL run (see the module docstring for each pair).

    Args:
        strategy: an :mod:`opake_core.mf` strategy; ``band_mf``/``blt`` specifications are optimized for
            ``n_steps`` and ``participation`` exactly as :func:`opake_core.mf.mf_gaussian_noise` does (pass the
            result of ``opake_core.mf.optimize`` to both to optimize once).
        sampler: an :mod:`opake_core.sampling` sampler compatible with the mechanism (:data:`COMPATIBLE_SAMPLERS`).
        noise_multiplier: ``z >= 0``, the multiplier given to the noise; 0 is a non-private run.
        n_steps: the horizon ``n``.
        participation: the participation pattern the noise was scaled with (``sens(C, participation)``).
        amplified: ``False`` accounts the run as one Gaussian mechanism with the sensitivity under the sampler's
            participation pattern (a valid, looser bound).

    Raises:
        ConfigurationError: an incompatible mechanism/sampler pair (the message names the compatible samplers),
            BandMF bands > n_steps, bands != the cyclic sampler's groups or > min_sep, a balls-in-bins horizon that
            is not a multiple of the bins, a negative coefficient under balls-in-bins.
        InputTypeError: not a strategy or not a sampler.
    """
    mechanism, name = mechanism_name(strategy), _sampler_name(sampler)
    allowed = COMPATIBLE_SAMPLERS[mechanism]
    if name not in allowed:
        users = sorted(m for m, s in COMPATIBLE_SAMPLERS.items() if name in s)
        hint = f"; the {name!r} sampler goes with {users}" if users else ""
        raise ConfigurationError(
            f"mechanism {mechanism!r} cannot be accounted with the {name!r} sampler; use one of {list(allowed)} "
            f"for {mechanism!r}{hint}."
        )
    n = _checks.integer("n_steps", n_steps, minimum=1)
    z = _checks.noise_multiplier(noise_multiplier)
    concrete = _mf.optimize(strategy, n, participation=participation)
    coef = _mf.coefficients(concrete, n)
    z1 = z * _mf.sensitivity(concrete, n, participation=participation) / float(np.linalg.norm(coef))
    if name == "balls_in_bins":
        _check_bins(n, sampler.num_bins)
    if name == "cyclic_poisson" and _mf.band_count(concrete, n) != sampler.bands:
        raise ConfigurationError(
            f"BandMF with cyclic Poisson needs the strategy's bands to equal the sampler's groups, got bands="
            f"{_mf.band_count(concrete, n)} and cyclic_poisson(bands={sampler.bands}); build both with the same "
            "bands."
        )
    if name == "b_min_sep" and _mf.band_count(concrete, n) > sampler.min_sep:
        raise ConfigurationError(
            f"BandMF with b-min-sep sampling needs bands <= min_sep, got bands={_mf.band_count(concrete, n)} and "
            f"min_sep={sampler.min_sep}; use fewer bands or a larger min_sep."
        )
    if not amplified:
        pattern = sampler_participation(sampler)
        return gaussian(
            z
            * _mf.sensitivity(concrete, n, participation=participation)
            / _mf.sensitivity(concrete, n, participation=pattern)
        )
    if name == "poisson":
        return sampler.process(z1, n)
    if name == "cyclic_poisson":
        return repeat(poisson(gaussian(z1), sampler.conditional_rate), math.ceil(n / sampler.bands))
    if name == "b_min_sep":
        band = coef[: _mf.band_count(concrete, n)]
        return BMinSepMF(tuple(band), z1, sampler.min_sep, sampler.sampling_prob, n)
    if mechanism == "mf_identity":
        return random_allocation(gaussian(z1 / math.sqrt(n // sampler.num_bins)), sampler.num_bins)
    return BallsInBinsMF(tuple(coef), z1, sampler.num_bins, n)


# ---------------------------------------------------------------------------------------------------------------
# Monte Carlo privacy-loss samples.


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
    return replace(base, num_samples=builtins.max(100_000, math.ceil(4 * base.log_term / _checks.delta(delta))))


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


def _monte_carlo_only(process: MonteCarloMF, accountant: str | None) -> None:
    if accountant not in (None, "monte_carlo"):
        raise ConfigurationError(
            f"a {type(process).__name__} process is accounted by Monte Carlo only (no dp-accounting event), got "
            f"accountant={accountant!r}; use accountant=None or 'monte_carlo'."
        )


def mf_epsilon(
    process: MFProcess,
    *,
    delta: float,
    accountant: str | None = None,
    monte_carlo: _ra.MonteCarlo | None = None,
    **query: Any,
) -> Result:
    """Epsilon at ``delta`` of a process from :func:`mf_process` (the full horizon).

    Analytic processes go to :func:`opake_core.accounting.epsilon`. Monte Carlo ones are sampled with
    ``monte_carlo`` (default :func:`default_monte_carlo`), hold with probability >= 1 - its failure probability,
    and never exceed the exact unamplified bound (:func:`unamplified`, the analytic Gaussian of Balle and Wang 2018),
    which is reported instead when smaller (``accountant="analytic_gaussian"`` in the result).
    """
    if not isinstance(process, BallsInBinsMF | BMinSepMF):
        return _epsilon(process, delta=delta, accountant=accountant, monte_carlo=monte_carlo, **query)
    _monte_carlo_only(process, accountant)
    target = _checks.delta(delta)
    if process.noise_multiplier == 0.0:
        return Result(math.inf, "monte_carlo")
    config = monte_carlo or default_monte_carlo(target)
    sampled = _mc_epsilon(_samples(process, config), target, config)
    bound = float(dp_accounting.get_epsilon_gaussian(unamplified(process).noise_multiplier, target))
    return Result(sampled, "monte_carlo") if sampled <= bound else Result(bound, "analytic_gaussian")


def mf_delta(
    process: MFProcess,
    *,
    epsilon: float,
    accountant: str | None = None,
    monte_carlo: _ra.MonteCarlo | None = None,
    **query: Any,
) -> Result:
    """Delta at ``epsilon`` of a process from :func:`mf_process` (Monte Carlo default: ``MonteCarlo()``)."""
    if not isinstance(process, BallsInBinsMF | BMinSepMF):
        return _delta(process, epsilon=epsilon, accountant=accountant, monte_carlo=monte_carlo, **query)
    _monte_carlo_only(process, accountant)
    eps = _checks.epsilon("epsilon", epsilon)
    if process.noise_multiplier == 0.0:
        return Result(1.0, "monte_carlo")
    config = monte_carlo or _ra.MonteCarlo()
    sampled = max(_ra._delta_bound(s, eps, config) for s in _samples(process, config))
    bound = _gaussian_delta(unamplified(process).noise_multiplier, eps)
    return Result(sampled, "monte_carlo") if sampled <= bound else Result(bound, "analytic_gaussian")


def calibrate_mf_noise_multiplier(
    make_process: Callable[[float], MFProcess],
    *,
    target_epsilon: float,
    delta: float,
    min: float = 0.11,
    max: float = 10.0,
    tolerance: float = 1e-3,
    accountant: str | None = None,
    monte_carlo: _ra.MonteCarlo | None = None,
    **query: Any,
) -> Calibrated:
    """The smallest multiplier in [min, max] whose full-horizon epsilon is <= ``target_epsilon``.

    ``make_process(z)`` is typically ``lambda z: mf_process(strategy, sampler=s, noise_multiplier=z, n_steps=n)``.
    Analytic processes use :func:`opake_core.accounting.calibrate_noise_multiplier` (``tolerance`` relative on
    epsilon). Monte Carlo processes are bisected on ``log z`` with common random numbers (the same seed at every
    probe) until the bracket is within ``tolerance`` (relative on ``z``); each probe runs at failure probability
    ``beta / 40`` so that the returned multiplier's guarantee holds with probability >= 1 - ``beta`` (at most 40
    probes). The returned multiplier is always the safe end of the bracket.
    """
    lo, hi = _checks.real("min", min), _checks.real("max", max)
    if not 0 < lo < hi:
        raise CalibrationError(f"calibration bounds need 0 < min < max, got min={lo!r}, max={hi!r}.")
    probe = make_process(hi)
    if not isinstance(probe, BallsInBinsMF | BMinSepMF):
        return _calibrate(
            make_process,
            target_epsilon=target_epsilon,
            delta=delta,
            min=lo,
            max=hi,
            tolerance=tolerance,
            accountant=accountant,
            monte_carlo=monte_carlo,
            **query,
        )
    target = _checks.real("target_epsilon", target_epsilon)
    tol = _checks.real("tolerance", tolerance)
    if target <= 0 or not 0 < tol < 1:
        raise CalibrationError(f"need target_epsilon > 0 and tolerance in (0, 1), got {target!r} and {tol!r}.")
    base = monte_carlo or default_monte_carlo(delta)
    config = replace(base, failure_probability=base.failure_probability / _CALIBRATION_PROBES)
    calls, names = 0, {}

    def eps(z: float) -> float:
        nonlocal calls
        calls += 1
        result = mf_epsilon(make_process(z), delta=delta, accountant=accountant, monte_carlo=config)
        names[z] = result.accountant
        return result.value

    e_hi = eps(hi)
    if e_hi > target:
        raise CalibrationError(
            f"target_epsilon={target} is unreachable with noise multipliers up to max={hi}: the Monte Carlo epsilon "
            f"there is {e_hi:.6g}. Raise max, use more Monte Carlo samples, or accept a larger target."
        )
    e_lo = eps(lo)
    if e_lo <= target:
        return Calibrated(lo, e_lo, names[lo], calls)
    while hi / lo - 1 > tol and calls < _CALIBRATION_PROBES:
        mid = math.sqrt(lo * hi)
        e_mid = eps(mid)
        if e_mid <= target:
            hi, e_hi = mid, e_mid
        else:
            lo = mid
    return Calibrated(hi, e_hi, names[hi], calls)
