"""f-DP queries against the closed forms of the Gaussian mechanism (mu-GDP, Dong, Roth and Su 2022)."""

from __future__ import annotations

import math

import pytest
from scipy.stats import norm

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_core.errors import ConfigurationError

MUS = [0.5, 1.0, 2.0]


@pytest.mark.parametrize("mu", MUS)
def test_advantage_is_the_total_variation(mu):
    exact = 2 * norm.cdf(mu / 2) - 1
    ours = acc.advantage(acc.gaussian(1 / mu)).value
    assert exact <= ours <= exact + 1e-4


@pytest.mark.parametrize("mu", MUS)
@pytest.mark.parametrize("alpha", [1e-4, 0.1, 0.9])
def test_beta_is_the_gaussian_curve(mu, alpha):
    exact = norm.cdf(norm.ppf(1 - alpha) - mu)
    ours = acc.beta(acc.gaussian(1 / mu), alpha=alpha).value
    assert exact - 1e-3 <= ours <= exact + 1e-12


@pytest.mark.parametrize("mu", MUS)
@pytest.mark.parametrize("prior", [0.5, 0.9, 0.01])
def test_bayes_risk_is_the_gaussian_closed_form(mu, prior):
    g = (1 - prior) / prior
    exact = prior * norm.cdf(math.log(g) / mu - mu / 2) + (1 - prior) * norm.cdf(-math.log(g) / mu - mu / 2)
    ours = acc.bayes_risk(acc.gaussian(1 / mu), prior=prior).value
    assert exact - 1e-4 <= ours <= exact + 1e-12


def test_composition_and_random_allocation():
    # Four releases at multiplier 2 are one at multiplier 1 (mu = 1): the curve of the composition is G_1.
    four = acc.repeat(acc.gaussian(2.0), 4)
    assert abs(acc.beta(four, alpha=0.05).value - norm.cdf(norm.ppf(0.95) - 1.0)) < 1e-3
    block = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=100, allocation="block")
    b = acc.beta(block, alpha=0.05).value
    assert 0.0 < b < 0.95  # some power, yet short of a perfect test
    assert acc.bayes_risk(block, prior=0.5).value == pytest.approx(0.5 * (1 - acc.advantage(block).value))


def test_edges_and_refusals():
    off = acc.gaussian(0.0)
    assert (acc.advantage(off).value, acc.beta(off, alpha=0.1).value, acc.bayes_risk(off, prior=0.2).value) == (
        1.0,
        0.0,
        0.0,
    )
    assert acc.bayes_risk(acc.gaussian(1.0), prior=0.0).value == 0.0
    with pytest.raises(ConfigurationError, match="alpha"):
        acc.beta(acc.gaussian(1.0), alpha=1.5)
    run = acc.mf_process(
        mf.bsr(bandwidth=2),
        sampler=sampling.balls_in_bins(dataset_size=1_000, num_bins=4),
        noise_multiplier=2.0,
        n_steps=8,
    )
    with pytest.raises(ConfigurationError, match="PLD privacy profile"):
        acc.advantage(run)


@pytest.mark.parametrize("sigma", [0.02])
def test_queries_of_a_nearly_nonprivate_gaussian_are_finite_and_on_their_safe_side(sigma):
    """At sigma = 0.02 (mu = 50) dp-accounting's delta overflows to NaN at large epsilons, which made beta NaN; each
    query must give a number on its safe side of the exact mu-GDP value (beta and Bayes risk at or below it,
    advantage at or above it), at any discretization (a coarse one here, for time)."""
    mu = 1 / sigma
    process = acc.gaussian(sigma)
    beta = acc.beta(process, alpha=0.05, discretization=0.5).value
    assert math.isfinite(beta) and 0.0 <= beta <= norm.cdf(norm.ppf(0.95) - mu) + 1e-300
    risk = acc.bayes_risk(process, prior=0.3, discretization=0.5).value
    g = 0.7 / 0.3
    exact_risk = 0.3 * norm.cdf(math.log(g) / mu - mu / 2) + 0.7 * norm.cdf(-math.log(g) / mu - mu / 2)
    assert math.isfinite(risk) and 0.0 <= risk <= exact_risk + 1e-300
    advantage = acc.advantage(process, discretization=0.5).value
    assert math.isfinite(advantage) and 2 * norm.cdf(mu / 2) - 1 - 1e-12 <= advantage <= 1.0
