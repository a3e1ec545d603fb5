"""One-run f-DP auditing (opake_core.fdp_audit) against independent references: closed-form Gaussian trade-off
curves, numerical integration, dp-accounting, the exact binomial law of coin flips, and simulations of an ideal
Gaussian mechanism with stated false-alarm rates.

Statistical assertions: each states the probability that a correct implementation fails it (at most 1e-3); the
seeds are fixed, so every run gives the same outcome.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy import integrate, stats

from opake_core import accounting, mf, random
from opake_core import fdp_audit as fa
from opake_core.audit import coin_flips, count_correct, guesses
from opake_core.errors import ConfigurationError, InputTypeError

DELTA = 1e-5


def _gaussian_scores(rng: np.random.Generator, m: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """An ideal mu-GDP audit: an included canary scores N(mu, 1), an excluded one N(0, 1)."""
    included = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * included, included


# -- Gaussian curves ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mu", [0.0, 0.5, 1.0, 3.0])
def test_gaussian_tradeoff_is_the_type_ii_error_of_the_likelihood_ratio_test(mu):
    alpha = np.array([1e-6, 1e-3, 0.05, 0.3, 0.5, 0.9, 1.0])
    threshold = stats.norm.isf(alpha)  # reject N(0, 1) above the threshold: type I error alpha
    expected = stats.norm.cdf(threshold - mu)  # P[N(mu, 1) <= threshold]
    np.testing.assert_allclose(fa.gaussian_tradeoff(alpha, mu=mu), expected, rtol=1e-10, atol=1e-15)
    # a trade-off curve of a symmetric pair is its own inverse
    inner = fa.gaussian_tradeoff(alpha[1:-1], mu=mu)
    np.testing.assert_allclose(fa.gaussian_tradeoff(inner, mu=mu), alpha[1:-1], rtol=1e-8)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
def test_gaussian_epsilon_matches_dp_accounting_for_the_gaussian_mechanism(sigma):
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(sigma))
    reference = pld.get_epsilon(DELTA)  # pessimistic, and exact for one Gaussian up to rounding
    assert fa.gaussian_epsilon(1 / sigma, delta=DELTA) == pytest.approx(reference, abs=1e-6)


@pytest.mark.parametrize(("mu", "epsilon"), [(0.5, 0.3), (1.0, 1.0), (2.0, 4.0), (3.0, 12.0)])
def test_gaussian_delta_is_the_hockey_stick_divergence(mu, epsilon):
    # delta(eps) = E_{Y ~ N(mu, 1)} (1 - e^{eps - L(Y)})_+ with the privacy loss L(y) = mu y - mu^2 / 2
    start = (epsilon + mu * mu / 2) / mu
    value, _ = integrate.quad(
        lambda y: stats.norm.pdf(y - mu) - math.exp(epsilon) * stats.norm.pdf(y), start, np.inf, epsabs=1e-14
    )
    assert fa.gaussian_delta(mu, epsilon=epsilon) == pytest.approx(value, rel=1e-6, abs=1e-14)


def test_gaussian_mu_inverts_gaussian_epsilon():
    for epsilon in (0.5, 2.0, 4.0, 8.0):
        mu = fa.gaussian_mu(epsilon, delta=DELTA)
        assert fa.gaussian_epsilon(mu, delta=DELTA) == pytest.approx(epsilon, rel=1e-8)
    assert fa.gaussian_epsilon(0.0, delta=DELTA) == 0.0
    assert fa.gaussian_epsilon(math.inf, delta=DELTA) == math.inf


def test_profile_tradeoff_of_a_gaussian_profile_is_a_valid_and_close_curve():
    mu = 1.2
    eps = np.linspace(0.0, 12.0, 400)
    curve = fa.profile_tradeoff(eps, [fa.gaussian_delta(mu, epsilon=e) for e in eps])
    alpha = np.linspace(0.0, 1.0, 2001)
    exact = fa.gaussian_tradeoff(alpha, mu=mu)
    # every (eps, delta(eps)) pair holds for G_mu, so the implied curve never claims more privacy than G_mu
    assert np.all(curve(alpha) <= exact + 1e-12)
    assert np.max(exact - curve(alpha)) < 5e-3  # and a dense profile recovers it


def test_process_tradeoff_of_dp_sgd_dominates_the_gaussian_curve_of_its_epsilon():
    """A correct DP-SGD run at epsilon 4 is also mu-GDP for the mu whose Gaussian epsilon is 4 (on these settings),
    which is what makes the Gaussian-curve flag valid for the runs of the docs' table."""
    z = accounting.calibrate_noise_multiplier(
        lambda s: accounting.repeat(accounting.poisson(accounting.gaussian(s), 0.2), 200),
        target_epsilon=4.0,
        delta=DELTA,
    ).value
    curve = fa.process_tradeoff(accounting.repeat(accounting.poisson(accounting.gaussian(z), 0.2), 200))
    alpha = np.concatenate([np.logspace(-4, -1, 100), np.linspace(0.1, 1.0, 200)])
    gaussian = fa.gaussian_tradeoff(alpha, mu=fa.gaussian_mu(4.0, delta=DELTA))
    assert np.all(curve(alpha) >= gaussian - 1e-6)


# -- the test of Algorithm 3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [10, 40, 150, 400])
def test_at_mu_zero_the_test_is_a_valid_binomial_test(r):
    """A 0-GDP run's output is independent of the coins, so ``v ~ Binomial(r, 1/2)`` exactly: the test must reject
    only values with binomial tail at most the level (validity), and not much later than the exact test (power)."""
    m = 1000
    first = next(v for v in range(r + 1) if fa.rejects(m, r, v, mu=0.0))
    assert stats.binom.sf(first - 1, r, 0.5) <= 0.05
    assert all(fa.rejects(m, r, v, mu=0.0) for v in range(first, r + 1))
    exact = next(v for v in range(r + 1) if stats.binom.sf(v - 1, r, 0.5) <= 0.05)
    assert first - exact <= 1 + r // 100


def test_rejection_is_monotone_in_mu_and_in_correct_guesses():
    m, r = 1000, 200
    for v in (120, 150, 180, 200):
        flags = [fa.rejects(m, r, v, mu=mu) for mu in np.linspace(0, 3, 61)]
        assert flags == sorted(flags, reverse=True)
    flags = [fa.rejects(m, r, v, mu=0.8) for v in range(100, r + 1)]
    assert flags == sorted(flags)


def test_mu_lower_bound_is_the_boundary_of_rejection():
    m, r, v = 1000, 150, 141
    mu = fa.mu_lower_bound(m, r, v)
    assert mu > 0
    assert fa.rejects(m, r, v, mu=mu)
    assert not fa.rejects(m, r, v, mu=mu + 0.002)
    assert fa.mu_lower_bound(m, r, v, confidence=0.99) < mu


def test_generic_curve_reproduces_the_gaussian_test():
    for r, v, mu in ((100, 90, 0.9), (300, 240, 0.5), (60, 60, 1.4)):
        curve = lambda a, mu=mu: fa.gaussian_tradeoff(a, mu=mu)  # noqa: E731
        assert fa.rejects(1000, r, v, tradeoff=curve) == fa.rejects(1000, r, v, mu=mu)


def test_false_alarm_rate_and_tightness_on_an_ideal_gaussian_mechanism():
    """200 ideal audits of a 1-GDP mechanism with 1,000 canaries and one fixed guess set at confidence 0.95.

    Validity: the bound may exceed mu = 1 in at most 5% of the audits; a correct implementation shows 22 or more
    such audits out of 200 with probability P[Binomial(200, 0.05) >= 22] < 1e-3. Tightness: the mean bound is about
    0.5 mu here (a sixth of the audits' spread is 0.005); below 0.4 mu would mean a broken statistic.
    """
    assert stats.binom.sf(21, 200, 0.05) < 1e-3
    rng = np.random.default_rng(2024)
    bounds = np.array(
        [fa.fdp_audit(*_gaussian_scores(rng, 1000, 1.0), delta=DELTA, guess_sets=[(75, 75)]).mu for _ in range(200)]
    )
    assert np.sum(bounds > 1.0) <= 21
    assert bounds.mean() > 0.4


def test_bonferroni_sweep_keeps_its_false_alarm_rate():
    """The default sweep of eight guess sets, on 100 ideal audits at mu = 0.5: at most 5% exceed mu, so 14 or more
    happen with probability P[Binomial(100, 0.05) >= 14] < 1e-3 for a correct implementation."""
    assert stats.binom.sf(13, 100, 0.05) < 1e-3
    rng = np.random.default_rng(7)
    bounds = [fa.fdp_audit(*_gaussian_scores(rng, 1000, 0.5), delta=DELTA).mu for _ in range(100)]
    assert sum(b > 0.5 for b in bounds) <= 13


def test_claim_test_of_dp_sgd_rejects_a_halved_noise_and_keeps_the_correct_claim():
    """The accountant's exact curve for DP-SGD (q = 0.2, 200 steps, epsilon 4) tested on 40 simulated all-iterates
    audits with likelihood-ratio scores, guess set (100, 100).

    Correct runs: rejected in at most 5% of runs, so 8 or more of 40 with probability < 1e-3 (0 of 200 other seeds
    were rejected when this test was written). Noise halved with the claim unchanged: rejected in 199 of 200
    simulations with other seeds; fewer than 30 of 40 has probability < 1e-3 if the power is at least 0.95.
    """
    assert stats.binom.sf(7, 40, 0.05) < 1e-3 and stats.binom.cdf(29, 40, 0.95) < 1e-3
    q, steps = 0.2, 200
    z = accounting.calibrate_noise_multiplier(
        lambda s: accounting.repeat(accounting.poisson(accounting.gaussian(s), q), steps),
        target_epsilon=4.0,
        delta=DELTA,
    ).value
    curve = fa.process_tradeoff(accounting.repeat(accounting.poisson(accounting.gaussian(z), q), steps))

    def rejected(noise: float, seed: int) -> bool:
        x, included = fa.simulate_dirac_observations(
            random.key(seed), num_canaries=1000, steps=steps, sample_rate=q, noise_multiplier=noise
        )
        scores = fa.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=q)
        return fa.audit_claim(scores, included, tradeoff=curve, guess_sets=[(100, 100)]).rejected

    assert sum(rejected(z, seed) for seed in range(40)) <= 7
    assert sum(rejected(z / 2, 100 + seed) for seed in range(40)) >= 30


# -- guess sets and audits ------------------------------------------------------------------------------------------


def test_fdp_audit_reports_the_best_guess_set_and_its_epsilon():
    rng = np.random.default_rng(3)
    scores, included = _gaussian_scores(rng, 1000, 1.5)
    sets = [(50, 0), (100, 100), (200, 200)]
    result = fa.fdp_audit(scores, included, delta=DELTA, guess_sets=sets)
    per_set = []
    for kp, kn in sets:
        r, v = count_correct(guesses(scores, k_pos=kp, k_neg=kn), included)
        per_set.append(fa.mu_lower_bound(1000, r, v, confidence=1 - 0.05 / len(sets)))
    assert result.mu == pytest.approx(max(per_set), abs=1e-12)
    assert (result.k_pos, result.k_neg) == sets[int(np.argmax(per_set))]
    assert result.epsilon == pytest.approx(fa.gaussian_epsilon(result.mu, delta=DELTA))
    assert result.flags(result.epsilon - 1e-3) and not result.flags(result.epsilon)


def test_select_guess_set_maximizes_the_mean_bound():
    rng = np.random.default_rng(11)
    simulated = [_gaussian_scores(rng, 400, 1.0) for _ in range(3)]
    candidates = [(10, 10), (40, 40), (40, 0), (120, 120)]
    choice = fa.select_guess_set(simulated, candidates=candidates)
    means = []
    for kp, kn in candidates:
        bounds = []
        for scores, included in simulated:
            r, v = count_correct(guesses(scores, k_pos=kp, k_neg=kn), included)
            bounds.append(fa.mu_lower_bound(400, r, v))
        means.append(np.mean(bounds))
    assert choice == candidates[int(np.argmax(means))]


# -- scores ---------------------------------------------------------------------------------------------------------


def test_likelihood_ratio_scores_are_the_log_density_ratio_of_the_mixture():
    rng = np.random.default_rng(5)
    x = rng.normal(0.3, 1.5, (7, 4))
    z, q = 1.3, 0.25
    signal = np.array([1.0, 0.8, 1.0, 0.5, 1.0, 1.0, 0.9])
    mask = rng.random((7, 4)) < 0.7
    inside = (1 - q) * stats.norm.pdf(x, 0, z) + q * stats.norm.pdf(x, signal[:, None], z)
    expected = np.where(mask, np.log(inside / stats.norm.pdf(x, 0, z)), 0.0).sum(axis=0)
    got = fa.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=q, signal=signal, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    full = fa.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=1.0)
    np.testing.assert_allclose(full, ((x - 0.5) / z**2).sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(fa.sum_scores(x), x.sum(axis=0))
    np.testing.assert_allclose(fa.max_scores(x, mask=mask), np.where(mask, x, -np.inf).max(axis=0))


def test_matrix_projections_decorrelate_band_mf_noise():
    steps, bands = 24, 4
    concrete = mf.optimize(mf.band_mf(bands=bands), steps)
    c = mf.materialize(concrete, steps)
    # one participation at step 5, no noise: the projection is a_5 at step 5 and 0 at steps >= bands away
    x = np.linalg.solve(c, c @ np.eye(steps)[:, [5]])
    projections, signal = fa.matrix_projections(x, c)
    assert projections[5, 0] == pytest.approx(signal[5])
    far = [t for t in range(steps) if abs(t - 5) >= bands]
    np.testing.assert_allclose(projections[far, 0], 0.0, atol=1e-12)
    # noise z s C^-1 w: projections are N(0, z1^2) and uncorrelated across steps (z1 = z s / ||c||)
    z, s = 1.7, mf.sensitivity(concrete, steps)
    w = np.random.default_rng(0).standard_normal((steps, 20_000))
    noise = z * s * np.linalg.solve(c, w)
    p, _ = fa.matrix_projections(noise, c)
    z1 = z * s / np.linalg.norm(c[:, 0])
    cov = np.cov(p) / z1**2
    # each diagonal entry is a sample variance of 20,000 normals: within 5 standard errors (4.5%) of 1
    np.testing.assert_allclose(np.diag(cov)[[0, bands, 2 * bands]], 1.0, atol=0.05)
    orthogonal = np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands
    assert np.max(np.abs(cov[orthogonal])) < 0.05
    assert signal.max() == pytest.approx(1.0) and np.all(signal > 0)


def test_simulated_observations_follow_the_claimed_mechanism():
    key = random.key(9)
    x, included = fa.simulate_dirac_observations(
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


# -- errors ---------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_typed_errors():
    with pytest.raises(ConfigurationError, match="v <= r <= m"):
        fa.mu_lower_bound(10, 5, 6)
    with pytest.raises(ConfigurationError, match="confidence"):
        fa.mu_lower_bound(10, 5, 5, confidence=1.0)
    with pytest.raises(ConfigurationError, match="exactly one"):
        fa.rejects(10, 5, 5)
    with pytest.raises(InputTypeError, match="callable"):
        fa.rejects(10, 5, 5, tradeoff=0.3)
    with pytest.raises(InputTypeError, match="boolean"):
        fa.fdp_audit(np.zeros(4), np.zeros(4), delta=DELTA)
    with pytest.raises(ConfigurationError, match="non-finite"):
        fa.fdp_audit(np.array([0.0, np.nan]), np.array([True, False]), delta=DELTA)
    with pytest.raises(ConfigurationError, match="k_pos \\+ k_neg"):
        fa.fdp_audit(np.zeros(4), np.ones(4, bool), delta=DELTA, guess_sets=[(3, 3)])
    with pytest.raises(ConfigurationError, match="alpha"):
        fa.gaussian_tradeoff(1.5, mu=1.0)
    with pytest.raises(ConfigurationError, match="one length"):
        fa.profile_tradeoff([0.0, 1.0], [0.1])
    with pytest.raises(ConfigurationError, match="\\[steps, canaries\\]"):
        fa.sum_scores(np.zeros(3))
    with pytest.raises(ConfigurationError, match="strategy_matrix"):
        fa.matrix_projections(np.zeros((3, 2)), np.eye(4))
