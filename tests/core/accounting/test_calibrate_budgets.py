"""Calibration of the noise multiplier, the sample rate and the steps to every budget kind.

Each calibrated value must meet its budget by the budget's own query and by an independent reference (dp-accounting's
PLD directly, or the closed forms of the Gaussian mechanism, mu-GDP), and one step further in the less private
direction must miss it.
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting import pld
from scipy.stats import norm

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_core.errors import CalibrationError, ConfigurationError, InputTypeError

FAST = {"discretization": 1e-3}  # the PLD grid; dp-accounting is given the same one below
COARSE = {"discretization": 1e-2}  # for beta, whose query scans the profile (pessimistic at any grid)
TOL = 1e-3


def _poisson_run(z: float, q: float, n: int) -> acc.Process:
    return acc.repeat(acc.poisson(acc.gaussian(z), q), n)


def _direct(z: float, q: float, n: int) -> pld.PLDAccountant:
    """dp-accounting's own PLD accountant for ``n`` Poisson-sampled Gaussian steps, not through this library."""
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    return pld.PLDAccountant(value_discretization_interval=FAST["discretization"]).compose(event, n)


def _check_tight(found: acc.Calibrated, budget: acc.Budget) -> None:
    """Within the stated tolerance: a factor ``1 - TOL`` of the bound, on the private side."""
    if budget.lower_is_more_private:
        assert budget.bound * (1 - TOL) <= found.achieved <= budget.bound
    else:
        assert budget.bound <= found.achieved <= budget.bound / (1 - TOL)


POISSON_BUDGETS = {
    "epsilon": (acc.Budget.epsilon(2.0, delta=1e-5), lambda a: a.get_epsilon(1e-5)),
    "delta": (acc.Budget.delta(1e-6, epsilon=2.0), lambda a: a.get_delta(2.0)),
    "advantage": (acc.Budget.advantage(0.2), lambda a: a.get_delta(0.0)),
    # m (1 - delta(log(M / m))) at prior 0.2 (m = 0.2, M = 0.8), read from dp-accounting's profile
    "bayes_risk": (acc.Budget.bayes_risk(0.19, prior=0.2), lambda a: 0.2 * (1 - a.get_delta(math.log(4.0)))),
}


@pytest.mark.parametrize("kind", sorted(POISSON_BUDGETS))
def test_noise_multiplier_meets_each_budget_and_one_percent_less_misses(kind):
    budget, direct = POISSON_BUDGETS[kind]
    found = acc.calibrate(
        lambda z: _poisson_run(z, 0.02, 20), budget=budget, parameter="noise_multiplier", min=0.3, **FAST
    )
    assert found.budget == budget and found.accountant == "pld"
    assert found.achieved == budget.query(_poisson_run(found.value, 0.02, 20), **FAST).value
    _check_tight(found, budget)
    assert budget.meets(direct(_direct(found.value, 0.02, 20)))
    assert not budget.meets(direct(_direct(0.99 * found.value, 0.02, 20)))


GDP = {
    # mu-GDP closed forms at mu = sqrt(n) / z (Dong, Roth and Su 2022): the exact number, and the mu that hits the
    # bound exactly
    "advantage": (
        acc.Budget.advantage(0.2),
        lambda mu: 2 * norm.cdf(mu / 2) - 1,
        2 * norm.ppf(0.6),
    ),
    "beta": (
        acc.Budget.beta(0.7, alpha=0.05),
        lambda mu: norm.cdf(norm.ppf(0.95) - mu),
        norm.ppf(0.95) - norm.ppf(0.7),
    ),
}


@pytest.mark.parametrize("kind", sorted(GDP))
def test_noise_multiplier_against_the_gaussian_closed_form(kind):
    budget, exact, mu_star = GDP[kind]
    n = 4
    query = COARSE if kind == "beta" else FAST
    found = acc.calibrate(
        lambda z: acc.repeat(acc.gaussian(z), n), budget=budget, parameter="noise_multiplier", **query
    )
    _check_tight(found, budget)
    # The queries are guarantees (advantage an upper bound, beta a lower bound), so the multiplier is never below the
    # exact one, and the exact curve at it meets the budget.
    z_star = math.sqrt(n) / mu_star
    assert z_star <= found.value <= 1.01 * z_star
    assert budget.meets(exact(math.sqrt(n) / found.value))
    assert not budget.meets(budget.query(acc.repeat(acc.gaussian(0.99 * found.value), n), **query).value)


def test_sample_rate_for_poisson_meets_epsilon_and_delta_and_one_percent_more_misses():
    for budget, direct in (POISSON_BUDGETS["epsilon"], POISSON_BUDGETS["delta"]):
        found = acc.calibrate(lambda q: _poisson_run(1.0, q, 100), budget=budget, parameter="sample_rate", **FAST)
        _check_tight(found, budget)
        assert 0 < found.value < 1
        assert budget.meets(direct(_direct(1.0, found.value, 100)))
        assert not budget.meets(direct(_direct(1.0, 1.01 * found.value, 100)))


def test_sample_rate_for_a_dp_ftrl_run():
    """BandMF with cyclic Poisson sampling: the rate sets the per-group rate the process is accounted at."""

    def run(q: float) -> acc.Process:
        sampler = sampling.cyclic_poisson(dataset_size=10_000, sample_rate=q, bands=2)
        return acc.mf_process(mf.band_mf(bands=2), sampler=sampler, noise_multiplier=1.0, n_steps=100)

    budget = acc.Budget.advantage(0.3)
    found = acc.calibrate(run, budget=budget, parameter="sample_rate", max=0.5, **FAST)
    _check_tight(found, budget)
    process = run(found.value)
    direct = pld.PLDAccountant(value_discretization_interval=FAST["discretization"])
    direct.compose(acc.to_dp_event(process))
    assert budget.meets(direct.get_delta(0.0))
    assert not budget.meets(acc.advantage(run(1.01 * found.value), **FAST).value)


def test_steps_for_delta_are_exact_against_dp_accounting():
    budget = acc.Budget.delta(1e-6, epsilon=1.0)
    found = acc.calibrate(lambda n: _poisson_run(2.0, 0.05, n), budget=budget, parameter="steps", **FAST)
    n = found.value
    assert isinstance(n, int) and n > 1
    assert found.achieved == budget.query(_poisson_run(2.0, 0.05, n), **FAST).value
    assert budget.meets(_direct(2.0, 0.05, n).get_delta(1.0))
    assert not budget.meets(_direct(2.0, 0.05, n + 1).get_delta(1.0))


def test_steps_for_bayes_risk_against_the_gaussian_closed_form():
    """n releases at multiplier 5 are mu-GDP with mu = sqrt(n) / 5; the risk at prior 1/2 is Phi(-mu / 2)."""
    budget = acc.Budget.bayes_risk(0.3, prior=0.5)
    found = acc.calibrate(lambda n: acc.repeat(acc.gaussian(5.0), n), budget=budget, parameter="steps", **FAST)
    n = found.value
    exact_most = math.floor((2 * 5.0 * norm.ppf(0.7)) ** 2)  # the largest n with Phi(-sqrt(n) / 10) >= 0.3
    assert n <= exact_most  # the query is a lower bound of the risk, so it never allows more steps
    assert budget.meets(norm.cdf(-math.sqrt(n) / 10))
    assert not budget.meets(acc.bayes_risk(acc.repeat(acc.gaussian(5.0), n + 1), prior=0.5, **FAST).value)


def test_range_ends_meeting_the_budget_are_returned():
    run = lambda q: _poisson_run(5.0, q, 10)  # noqa: E731
    found = acc.calibrate(run, budget=acc.Budget.advantage(0.9), parameter="sample_rate", max=0.1, **FAST)
    assert found.value == 0.1 and found.achieved == acc.advantage(run(0.1), **FAST).value
    steps = acc.calibrate(
        lambda n: acc.repeat(acc.gaussian(50.0), n), budget=acc.Budget.advantage(0.5), parameter="steps", max=7
    )
    assert steps.value == 7


def test_unattainable_budgets_are_refused_with_the_number_seen():
    run = lambda z: _poisson_run(z, 0.02, 20)  # noqa: E731
    with pytest.raises(CalibrationError, match=r"unreachable with noise multipliers up to max=2\.0: advantage there"):
        acc.calibrate(run, budget=acc.Budget.advantage(1e-4), parameter="noise_multiplier", max=2.0, **FAST)
    # an unsampled release in the run: no sample rate, however small, brings it under its epsilon
    fixed = acc.gaussian(1.0)
    with_fixed = lambda q: acc.compose(fixed, _poisson_run(1.0, q, 10))  # noqa: E731
    floor = acc.epsilon(fixed, delta=1e-5, **FAST).value
    with pytest.raises(CalibrationError, match="unreachable with sample rates down to min=1e-09"):
        acc.calibrate(with_fixed, budget=acc.Budget.epsilon(floor / 2, delta=1e-5), parameter="sample_rate", **FAST)
    with pytest.raises(CalibrationError, match=r"even one step misses the budget beta >= 0\.9 at alpha 0\.05"):
        acc.calibrate(
            lambda n: acc.repeat(acc.gaussian(1.0), n),
            budget=acc.Budget.beta(0.9, alpha=0.05),
            parameter="steps",
            **COARSE,
        )
    with pytest.raises(CalibrationError, match=r"Bayes risk >= 0\.35 at prior 0\.3 is unreachable"):
        acc.calibrate(run, budget=acc.Budget.bayes_risk(0.35, prior=0.3), parameter="noise_multiplier", **FAST)


class _NaNBelowOne(acc.Budget):
    """An advantage budget whose query answers NaN below multiplier 1, as a profile read past its float range does."""

    def query(self, process, **query):
        found = super().query(process, **query)
        return acc.Result(math.nan, found.accountant) if process.noise_multiplier < 1 else found


def test_a_nan_answer_is_never_taken_for_a_safe_one():
    budget = _NaNBelowOne("advantage", 0.3)
    found = acc.calibrate(acc.gaussian, budget=budget, parameter="noise_multiplier", **FAST)
    z_star = 1 / (2 * norm.ppf(0.65))  # advantage 2 Phi(1 / (2 z)) - 1 = 0.3
    assert z_star <= found.value <= 1.01 * z_star and budget.meets(found.achieved)


def test_a_parameter_that_is_not_monotone_the_assumed_way_is_refused():
    # a "rate" that lowers the sampling probability as it grows: the walk finds probes more private than the start
    backwards = lambda q: _poisson_run(1.0, 1.0 - 0.5 * q, 10)  # noqa: E731
    with pytest.raises(CalibrationError, match="not monotone in sample_rate"):
        acc.calibrate(backwards, budget=acc.Budget.epsilon(50.0, delta=1e-5), parameter="sample_rate", **FAST)


def test_bad_budgets_parameters_and_results_are_refused():
    run = lambda z: _poisson_run(z, 0.02, 20)  # noqa: E731
    with pytest.raises(InputTypeError, match="Budget"):
        acc.calibrate(run, budget=2.0, parameter="noise_multiplier")
    with pytest.raises(ConfigurationError, match="parameter must be one of"):
        acc.calibrate(run, budget=acc.Budget.advantage(0.1), parameter="clip_norm")
    with pytest.raises(ConfigurationError, match=r"must lie in \(0, 0\.5\]"):
        acc.Budget.bayes_risk(0.6, prior=0.5)
    with pytest.raises(ConfigurationError, match="needs its alpha"):
        acc.Budget("beta", 0.5)
    with pytest.raises(ConfigurationError, match="kind must be one of"):
        acc.Budget("renyi", 1.0, 2.0)
    with pytest.raises(ConfigurationError, match="PLD privacy profile"):
        acc.Budget.advantage(0.1).query(acc.gaussian(1.0), accountant="rdp")
    with pytest.raises(CalibrationError, match="at most 1"):
        acc.calibrate(
            lambda q: _poisson_run(1.0, q, 10), budget=acc.Budget.advantage(0.1), parameter="sample_rate", max=2.0
        )
    found = acc.calibrate(acc.gaussian, budget=acc.Budget.advantage(0.3), parameter="noise_multiplier", **FAST)
    with pytest.raises(ConfigurationError, match="not an epsilon one"):
        found.epsilon  # noqa: B018
    monte_carlo = lambda z: acc.BallsInBinsMF((1.0, 1.0), z, 2, 2)  # noqa: E731
    with pytest.raises(ConfigurationError, match="epsilon budget only"):
        acc.calibrate(monte_carlo, budget=acc.Budget.delta(1e-5, epsilon=1.0), parameter="noise_multiplier")


def test_the_old_entry_points_are_the_general_search():
    run = lambda z: _poisson_run(z, 0.02, 20)  # noqa: E731
    old = acc.calibrate_noise_multiplier(run, target_epsilon=2.0, delta=1e-5, accountant="rdp")
    budget = acc.Budget.epsilon(2.0, delta=1e-5)
    new = acc.calibrate(run, budget=budget, parameter="noise_multiplier", accountant="rdp")
    assert (old.value, old.epsilon) == (new.value, new.achieved)
    step = acc.poisson(acc.gaussian(1.0), 0.1)
    steps = acc.calibrate_steps(step, target_epsilon=3.0, delta=1e-5, **FAST)
    assert steps.epsilon <= 3.0 < acc.epsilon(acc.repeat(step, steps.value + 1), delta=1e-5, **FAST).value
