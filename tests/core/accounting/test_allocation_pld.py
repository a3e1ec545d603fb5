"""The numerical PLD of random allocation: an upper bound, close to exact, checked against independent references."""

from __future__ import annotations

import itertools
import math
import time

import dp_accounting
import numpy as np
import pytest

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_core.accounting.allocation_pld import allocation_pld
from opake_core.accounting.random_allocation import _kl, loss_samples
from opake_core.errors import ConfigurationError

BLOCK = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=100, allocation="block")  # the issue's example


def test_one_step_is_the_gaussian_mechanism():
    # t = 1: P = N(1, sigma^2), Q = N(0, sigma^2); Balle and Wang's exact epsilon is the reference.
    for sigma in (0.5, 1.0, 3.0):
        for delta in (1e-3, 1e-6, 1e-10):
            exact = dp_accounting.get_epsilon_gaussian(sigma, delta)
            ours = acc.epsilon(acc.random_allocation(acc.gaussian(sigma), 1), delta=delta).value
            assert exact - 1e-9 <= ours <= exact + 2e-3, (sigma, delta, ours, exact)


def test_k_equal_t_is_k_gaussian_releases():
    # Each of k blocks has one step: k Gaussian releases at sigma, i.e. one at sigma / sqrt(k).
    ours = acc.epsilon(acc.k_out_of_t(acc.gaussian(2.0), k=4, t=4, allocation="block"), delta=1e-8).value
    exact = dp_accounting.get_epsilon_gaussian(1.0, 1e-8)
    assert exact - 1e-9 <= ours <= exact + 2e-3


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-10])
def test_within_the_reference_bracket(delta):
    # pld-accounting (the random-allocation authors' numerical PLD) returns a certified (upper, lower) pair.
    api = pytest.importorskip("PLD_accounting.random_allocation_api")
    upper, lower = api.gaussian_allocation_epsilon_range(delta=delta, sigma=1.0, num_steps=50, num_epochs=2)
    ours = acc.epsilon(BLOCK, delta=delta).value
    assert lower <= ours <= upper, (lower, ours, upper)


def test_converges_in_the_grid_step():
    # Halving h moves epsilon by well under 1e-3 (second order): the default grid is close to exact.
    coarse = allocation_pld(1.0, 50).self_compose(2)
    fine = allocation_pld(1.0, 50, log_grid=2.5e-3).self_compose(2)
    for delta in (1e-3, 1e-10):
        gap = coarse.get_epsilon_for_delta(delta) - fine.get_epsilon_for_delta(delta)
        assert -2e-4 <= gap <= 1e-3, (delta, gap)


def _chernoff_lower(mean: float, n: int, log_term: float) -> float:
    """The lower end of a one-sided Chernoff interval on a [0, 1]-valued mean (Hoeffding 1963, Thm 1)."""
    lo, hi = 0.0, mean
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if n * _kl(mean, mid) <= log_term:
            hi = mid
        else:
            lo = mid
    return lo


def test_agrees_with_the_monte_carlo_accountant():
    # False alarm at most 2e-6: a sampled confidence bound (beta = 1e-6 per check) on the exact curve.
    config = acc.MonteCarlo(num_samples=400_000, failure_probability=1e-6)
    delta = 1e-3
    ours = acc.epsilon(BLOCK, delta=delta).value
    # 1. Never above the Monte Carlo upper confidence bound (0.01 grid), which holds for the exact epsilon.
    assert ours <= acc.epsilon(BLOCK, delta=delta, accountant="monte_carlo", monte_carlo=config).value
    # 2. The exact delta at our epsilon is <= delta if ours is an upper bound: its lower confidence bound must be too.
    for add in (True, False):
        losses = loss_samples(BLOCK, add=add, config=config)
        tail = losses[losses > ours]
        mean = float(-np.expm1(ours - tail).sum()) / len(losses)
        assert _chernoff_lower(mean, len(losses), math.log(1 / config.failure_probability)) <= delta


def test_monotone_in_delta_and_noise():
    deltas = [1e-2, 1e-4, 1e-6, 1e-8, 1e-10]
    values = [acc.epsilon(BLOCK, delta=d).value for d in deltas]
    assert all(a < b for a, b in itertools.pairwise(values))
    sigmas = [0.6, 0.8, 1.0, 1.5, 3.0]
    by_sigma = [acc.epsilon(acc.random_allocation(acc.gaussian(s), 200), delta=1e-6).value for s in sigmas]
    assert all(a > b for a, b in itertools.pairwise(by_sigma))


def test_delta_and_epsilon_are_consistent():
    eps = acc.epsilon(BLOCK, delta=1e-5).value
    assert acc.delta(BLOCK, epsilon=eps).value <= 1e-5 * (1 + 1e-9)  # dp-accounting searches epsilon to 1e-9
    assert acc.delta(BLOCK, epsilon=eps - 0.01).value > 1e-5


def test_composes_with_dp_accounting_events():
    # A random allocation followed by a Poisson-sampled step: the composition of the two PLDs, direction by direction.
    mixed = acc.compose(acc.random_allocation(acc.gaussian(1.0), 4), acc.poisson(acc.gaussian(1.0), 0.1))
    poisson = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        1.0, sampling_prob=0.1, value_discretization_interval=1e-4
    )
    direct = allocation_pld(1.0, 4).compose(poisson).get_epsilon_for_delta(1e-6)
    assert acc.epsilon(mixed, delta=1e-6).value == pytest.approx(direct, abs=1e-9)
    assert direct > acc.epsilon(acc.random_allocation(acc.gaussian(1.0), 4), delta=1e-6).value


def test_accountant_choice():
    assert acc.epsilon(BLOCK, delta=1e-5).accountant == "pld"
    with pytest.raises(ConfigurationError, match="numerical PLD"):
        acc.epsilon(BLOCK, delta=1e-5, accountant="rdp")
    with pytest.raises(ConfigurationError, match="accountant='monte_carlo'"):
        acc.epsilon(BLOCK, delta=1e-5, monte_carlo=acc.MonteCarlo(num_samples=1_000))
    assert acc.epsilon(acc.k_out_of_t(acc.gaussian(0.0), k=2, t=10, allocation="block"), delta=1e-5).value == math.inf


def test_issue_example_is_finite_at_small_delta():
    # Monte Carlo gave inf at delta 1e-5 (about 25 s a query); the PLD answers at 1e-10 in about a second.
    start = time.perf_counter()
    value = acc.epsilon(BLOCK, delta=1e-10).value
    assert math.isfinite(value) and time.perf_counter() - start < 10


def test_calibration_at_a_million_examples():
    n = 10**6
    delta = 1 / n**1.1
    run = lambda z: acc.k_out_of_t(acc.gaussian(z), k=2, t=2_000, allocation="block")  # noqa: E731
    start = time.perf_counter()
    found = acc.calibrate_noise_multiplier(run, target_epsilon=2.0, delta=delta, tolerance=1e-2)
    assert time.perf_counter() - start < 60
    assert found.accountant == "pld" and found.epsilon <= 2.0
    assert acc.epsilon(run(found.value * 0.97), delta=delta).value > 2.0


def test_balls_in_bins_identity_dp_ftrl_at_thirty_thousand_examples():
    # mf_identity with balls-in-bins is a random allocation (fixed bins, k epochs: sigma / sqrt(k)).
    n = 30_000
    sampler = sampling.balls_in_bins(dataset_size=n, num_bins=100)
    run = acc.mf_process(mf.identity(), sampler=sampler, noise_multiplier=1.0, n_steps=1_000)
    start = time.perf_counter()
    result = acc.epsilon(run, delta=1 / n**1.1)
    assert time.perf_counter() - start < 10 and result.accountant == "pld"
    direct = acc.epsilon(acc.random_allocation(acc.gaussian(1.0 / math.sqrt(10)), 100), delta=1 / n**1.1)
    assert result.value == direct.value
