"""Trade-off curves (opake_core.auditing.tradeoff_curves) against independent references: closed-form Gaussian
trade-off curves, numerical integration and dp-accounting."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from scipy import integrate, stats

from opake_core import accounting, auditing
from opake_core.errors import ConfigurationError

DELTA = 1e-5


# -- Gaussian curves ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mu", [0.0, 0.5, 1.0, 3.0])
def test_gaussian_tradeoff_is_the_type_ii_error_of_the_likelihood_ratio_test(mu):
    alpha = np.array([1e-6, 1e-3, 0.05, 0.3, 0.5, 0.9, 1.0])
    threshold = stats.norm.isf(alpha)  # reject N(0, 1) above the threshold: type I error alpha
    expected = stats.norm.cdf(threshold - mu)  # P[N(mu, 1) <= threshold]
    np.testing.assert_allclose(auditing.gaussian_tradeoff(alpha, mu=mu), expected, rtol=1e-10, atol=1e-15)
    # a trade-off curve of a symmetric pair is its own inverse
    inner = auditing.gaussian_tradeoff(alpha[1:-1], mu=mu)
    np.testing.assert_allclose(auditing.gaussian_tradeoff(inner, mu=mu), alpha[1:-1], rtol=1e-8)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 5.0])
def test_gaussian_epsilon_matches_dp_accounting_for_the_gaussian_mechanism(sigma):
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(sigma))
    reference = pld.get_epsilon(DELTA)  # pessimistic, and exact for one Gaussian up to rounding
    assert auditing.gaussian_epsilon(1 / sigma, delta=DELTA) == pytest.approx(reference, abs=1e-6)


@pytest.mark.parametrize(("mu", "epsilon"), [(0.5, 0.3), (1.0, 1.0), (2.0, 4.0), (3.0, 12.0)])
def test_gaussian_delta_is_the_hockey_stick_divergence(mu, epsilon):
    # delta(eps) = E_{Y ~ N(mu, 1)} (1 - e^{eps - L(Y)})_+ with the privacy loss L(y) = mu y - mu^2 / 2
    start = (epsilon + mu * mu / 2) / mu
    value, _ = integrate.quad(
        lambda y: stats.norm.pdf(y - mu) - math.exp(epsilon) * stats.norm.pdf(y), start, np.inf, epsabs=1e-14
    )
    assert auditing.gaussian_delta(mu, epsilon=epsilon) == pytest.approx(value, rel=1e-6, abs=1e-14)


def test_gaussian_mu_inverts_gaussian_epsilon():
    for epsilon in (0.5, 2.0, 4.0, 8.0):
        mu = auditing.gaussian_mu(epsilon, delta=DELTA)
        assert auditing.gaussian_epsilon(mu, delta=DELTA) == pytest.approx(epsilon, rel=1e-8)
    assert auditing.gaussian_epsilon(0.0, delta=DELTA) == 0.0
    assert auditing.gaussian_epsilon(math.inf, delta=DELTA) == math.inf


def test_profile_tradeoff_of_a_gaussian_profile_is_a_valid_and_close_curve():
    mu = 1.2
    eps = np.linspace(0.0, 12.0, 400)
    curve = auditing.profile_tradeoff(eps, [auditing.gaussian_delta(mu, epsilon=e) for e in eps])
    alpha = np.linspace(0.0, 1.0, 2001)
    exact = auditing.gaussian_tradeoff(alpha, mu=mu)
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
    curve = auditing.process_tradeoff(accounting.repeat(accounting.poisson(accounting.gaussian(z), 0.2), 200))
    alpha = np.concatenate([np.logspace(-4, -1, 100), np.linspace(0.1, 1.0, 200)])
    gaussian = auditing.gaussian_tradeoff(alpha, mu=auditing.gaussian_mu(4.0, delta=DELTA))
    assert np.all(curve(alpha) >= gaussian - 1e-6)


def test_process_tradeoff_of_random_allocation_with_k_equal_t_is_the_gaussian_curve():
    """k-out-of-t with k = t puts every example in all t steps: t Gaussian releases of multiplier z, exactly
    mu-GDP with mu = sqrt(t) / z. The claimed curve never claims more privacy than that, and is close to it."""
    z, t = 2.0, 4
    curve = auditing.process_tradeoff(accounting.k_out_of_t(accounting.gaussian(z), k=t, t=t, allocation="block"))
    alpha = np.concatenate([np.logspace(-4, -1, 100), np.linspace(0.1, 1.0, 200)])
    exact = auditing.gaussian_tradeoff(alpha, mu=math.sqrt(t) / z)
    assert np.all(curve(alpha) <= exact + 1e-9)
    assert np.max(exact - curve(alpha)) < 0.02


# -- errors ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_typed_errors():
    with pytest.raises(ConfigurationError, match="alpha"):
        auditing.gaussian_tradeoff(1.5, mu=1.0)
    with pytest.raises(ConfigurationError, match="one length"):
        auditing.profile_tradeoff([0.0, 1.0], [0.1])
