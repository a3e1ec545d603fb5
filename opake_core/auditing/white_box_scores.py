"""Canary scores from white-box observations (Nasr et al., "Tight Auditing of Differentially Private Machine
Learning", USENIX Security 2023; Steinke, Nasr and Jagielski 2023), and the observations of a run that does exactly
what it claims.

``observations[t, j]`` is what the auditor reads on canary ``j``'s coordinate at step ``t`` in units of the per-step
sensitivity (the privatized clipped sum divided by ``clipping_norm / expected_batch_size``): ``signal_t * b_tj +
noise_multiplier * N(0, 1)`` with ``b_tj`` 1 when the canary was in the batch. :func:`likelihood_ratio_scores` is the
Neyman-Pearson statistic of a Poisson-subsampled Gaussian (the most powerful test for one canary, so its score
distribution realizes the mechanism's trade-off curve); :func:`sum_scores` and :func:`max_scores` are the simpler
statistics of the papers. Correlated (DP-FTRL) noise is decorrelated first with :func:`matrix_projections`.
:func:`simulate_dirac_observations` draws the observations of the claimed mechanism, from which
:func:`~opake_core.auditing.fdp_test.select_guess_set` chooses the guess set before the real run.

Everything here is a pure function of NumPy arrays; the training side lives in :mod:`opake_torch.auditing`.
"""

from __future__ import annotations

import math

import numpy as np

from opake_core import validate
from opake_core.auditing.one_run import coin_flips
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key, fold_in, numpy_generator

__all__ = [
    "likelihood_ratio_scores",
    "matrix_projections",
    "max_scores",
    "simulate_dirac_observations",
    "sum_scores",
]


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
            :func:`opake_core.auditing.one_run.coin_flips` with the same key.
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
