"""Canary scores from white-box observations (opake_core.auditing.white_box_scores) against independent references:
the log density ratio of the mixture, the strategy matrix's covariance, and the law of the simulated observations.

Statistical assertions state the probability that a correct implementation fails them; the seeds are fixed, so
every run gives the same outcome.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from opake_core import auditing, mf, random
from opake_core.auditing import coin_flips
from opake_core.errors import ConfigurationError

# -- scores ---------------------------------------------------------------------------------------------------------


def test_likelihood_ratio_scores_are_the_log_density_ratio_of_the_mixture():
    rng = np.random.default_rng(5)
    x = rng.normal(0.3, 1.5, (7, 4))
    z, q = 1.3, 0.25
    signal = np.array([1.0, 0.8, 1.0, 0.5, 1.0, 1.0, 0.9])
    mask = rng.random((7, 4)) < 0.7
    inside = (1 - q) * stats.norm.pdf(x, 0, z) + q * stats.norm.pdf(x, signal[:, None], z)
    expected = np.where(mask, np.log(inside / stats.norm.pdf(x, 0, z)), 0.0).sum(axis=0)
    got = auditing.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=q, signal=signal, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    full = auditing.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=1.0)
    np.testing.assert_allclose(full, ((x - 0.5) / z**2).sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(auditing.sum_scores(x), x.sum(axis=0))
    np.testing.assert_allclose(auditing.max_scores(x, mask=mask), np.where(mask, x, -np.inf).max(axis=0))


def test_matrix_projections_decorrelate_band_mf_noise():
    steps, bands = 24, 4
    concrete = mf.optimize(mf.band_mf(bands=bands), steps)
    c = mf.materialize(concrete, steps)
    # one participation at step 5, no noise: the projection is a_5 at step 5 and 0 at steps >= bands away
    x = np.linalg.solve(c, c @ np.eye(steps)[:, [5]])
    projections, signal = auditing.matrix_projections(x, c)
    assert projections[5, 0] == pytest.approx(signal[5])
    far = [t for t in range(steps) if abs(t - 5) >= bands]
    np.testing.assert_allclose(projections[far, 0], 0.0, atol=1e-12)
    # noise z s C^-1 w: projections are N(0, z1^2) and uncorrelated across steps (z1 = z s / ||c||)
    z, s = 1.7, mf.sensitivity(concrete, steps)
    w = np.random.default_rng(0).standard_normal((steps, 20_000))
    noise = z * s * np.linalg.solve(c, w)
    p, _ = auditing.matrix_projections(noise, c)
    z1 = z * s / np.linalg.norm(c[:, 0])
    cov = np.cov(p) / z1**2
    # each diagonal entry is a sample variance of 20,000 normals: within 5 standard errors (4.5%) of 1
    np.testing.assert_allclose(np.diag(cov)[[0, bands, 2 * bands]], 1.0, atol=0.05)
    orthogonal = np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands
    assert np.max(np.abs(cov[orthogonal])) < 0.05
    assert signal.max() == pytest.approx(1.0) and np.all(signal > 0)


def test_simulated_observations_follow_the_claimed_mechanism():
    key = random.key(9)
    x, included = auditing.simulate_dirac_observations(
        key, num_canaries=2000, steps=50, sample_rate=0.3, noise_multiplier=2.0
    )
    assert x.shape == (50, 2000) and np.array_equal(included, coin_flips(key, 2000))
    # excluded canaries: pure noise of std 2 (a chi-square test on ~50,000 values; fails with probability 1e-4)
    out = x[:, ~included].ravel()
    chi = np.sum(out**2) / 4.0
    assert stats.chi2.sf(chi, out.size) > 5e-5 and stats.chi2.cdf(chi, out.size) > 5e-5
    # included canaries: mean q (a z-test at 1e-4)
    inside = x[:, included].ravel()
    zstat = (inside.mean() - 0.3) / math.sqrt((4.0 + 0.21) / inside.size)
    assert abs(zstat) < 3.9


# -- errors ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_typed_errors():
    with pytest.raises(ConfigurationError, match="\\[steps, canaries\\]"):
        auditing.sum_scores(np.zeros(3))
    with pytest.raises(ConfigurationError, match="strategy_matrix"):
        auditing.matrix_projections(np.zeros((3, 2)), np.eye(4))
