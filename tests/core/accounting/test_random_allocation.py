"""Monte Carlo accounting of random allocation: against Poisson, the Gaussian, and its own invariants.

The estimator's bound holds with probability >= 1 - failure_probability (1e-6 here) over its own seeded
samples; the samples are fixed by the seed, so these tests are deterministic.
"""

from __future__ import annotations

import math

import dp_accounting
import pytest

from opake_core import accounting as acc
from opake_core.errors import ConfigurationError

MC = acc.MonteCarlo(num_samples=50_000)
DELTA = 1e-3


def _ra(process):
    result = acc.epsilon(process, delta=DELTA, accountant="monte_carlo", monte_carlo=MC)
    assert result.accountant == "monte_carlo"
    return result.value


@pytest.mark.parametrize(("sigma", "t"), [(0.6, 8), (0.8, 10)])
def test_one_out_of_t_beats_poisson_at_rate_one_over_t(sigma, t):
    # Feldman & Shenfeld 2025 (arXiv 2502.08202): at small sigma (large per-step epsilon) random allocation is
    # clearly more private than Poisson at the same rate, where Poisson may select an example several times.
    ra = _ra(acc.random_allocation(acc.gaussian(sigma), t))
    poisson = acc.epsilon(acc.repeat(acc.poisson(acc.gaussian(sigma), 1 / t), t), delta=DELTA).value
    assert ra < poisson


def test_one_out_of_one_is_the_gaussian_mechanism():
    exact = dp_accounting.get_epsilon_gaussian(1.0, DELTA)
    estimate = _ra(acc.random_allocation(acc.gaussian(1.0), 1))
    assert exact <= estimate <= exact + 0.5  # pessimistic, and close


def test_allocation_amplifies_a_single_gaussian():
    single = dp_accounting.get_epsilon_gaussian(1.0, DELTA)
    assert _ra(acc.random_allocation(acc.gaussian(1.0), 10)) < single
    assert _ra(acc.random_allocation(acc.gaussian(1.0), 10)) < _ra(acc.random_allocation(acc.gaussian(1.0), 3))


def test_block_is_k_compositions():
    block = acc.k_out_of_t(acc.gaussian(1.0), k=3, t=12, allocation="block")
    composed = acc.repeat(acc.random_allocation(acc.gaussian(1.0), 4), 3)
    assert block == composed
    by_compose = acc.compose(*[acc.random_allocation(acc.gaussian(1.0), 4)] * 3)
    assert _ra(block) == pytest.approx(_ra(by_compose), abs=0.05)  # different seeds per part: MC noise only
    assert _ra(block) > _ra(acc.random_allocation(acc.gaussian(1.0), 4))


def test_total_is_no_smaller_than_block():
    same_total = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=8, allocation="total")
    same_block = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=8, allocation="block")
    assert _ra(same_total) >= _ra(same_block)
    # t = 7: blocks of 3 and 4 are bounded by blocks of 4 and 4 (t = 8) from above in privacy.
    uneven = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=7, allocation="total")
    assert _ra(uneven) >= _ra(same_block)


def test_delta_and_epsilon_agree_and_are_reproducible():
    process = acc.random_allocation(acc.gaussian(1.0), 5)
    eps = _ra(process)
    assert eps == _ra(process)
    assert acc.delta(process, epsilon=eps, accountant="monte_carlo", monte_carlo=MC).value <= DELTA
    assert acc.delta(process, epsilon=eps - 0.05, accountant="monte_carlo", monte_carlo=MC).value > DELTA * 0.5


def test_uncertifiable_delta_is_inf_and_mixing_is_refused():
    tiny = acc.MonteCarlo(num_samples=1000)
    assert (
        acc.epsilon(
            acc.random_allocation(acc.gaussian(1.0), 4), delta=1e-6, accountant="monte_carlo", monte_carlo=tiny
        ).value
        == math.inf
    )
    mixed = acc.compose(acc.random_allocation(acc.gaussian(1.0), 4), acc.poisson(acc.gaussian(1.0), 0.1))
    with pytest.raises(ConfigurationError, match="Monte Carlo"):
        acc.epsilon(mixed, delta=DELTA, accountant="monte_carlo")
    with pytest.raises(ConfigurationError, match="num_samples"):
        acc.MonteCarlo(num_samples=10)


def test_nonprivate_allocation_is_inf():
    assert acc.epsilon(acc.random_allocation(acc.gaussian(0.0), 4), delta=DELTA).value == math.inf
