"""The accounting check against dp-accounting directly and against planted accountant bugs."""

from __future__ import annotations

import dp_accounting
import pytest

from opake_core import accounting, random, sampling
from opake_core.auditing.accounting_check import check_accounting, claimed_releases
from opake_core.errors import ConfigurationError

N, Q, Z, DELTA, T = 200, 0.1, 1.2, 1e-5, 40
SAMPLER = sampling.poisson(dataset_size=N, sample_rate=Q)
STEP = accounting.poisson(accounting.gaussian(Z), Q)


def _dp_accounting_epsilon(steps, q=Q, z=Z):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    return dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(DELTA)


def _check(claim, **kwargs):
    return check_accounting(claim, steps=T, release=STEP, delta=DELTA, sampler=SAMPLER, key=random.key(0), **kwargs)


def test_a_correct_ledger_passes_and_its_epsilon_is_dp_accountings():
    report = _check(accounting.Ledger().record(STEP, T))
    assert not report.flagged, report.reasons
    assert report.claimed_steps == report.steps == T
    assert report.observed_epsilon == pytest.approx(_dp_accounting_epsilon(T), rel=1e-9)
    assert report.claimed_epsilon == report.observed_epsilon
    assert report.sampling and report.sampling[0].passed


def test_half_the_steps_are_flagged():
    report = _check(SAMPLER.process(Z, T // 2))
    assert report.flagged and report.claimed_steps == T // 2
    assert "counted 20 releases, 40 steps ran" in report.reasons[0]
    assert report.claimed_epsilon == pytest.approx(_dp_accounting_epsilon(T // 2), rel=1e-9)
    assert report.claimed_epsilon < report.observed_epsilon


def test_a_reported_epsilon_below_the_ledgers_is_flagged():
    ledger = accounting.Ledger().record(STEP, T)
    report = _check(ledger, claimed_epsilon=0.9 * ledger.epsilon(delta=DELTA).value)
    assert report.flagged and "below" in report.reasons[-1]


def test_another_multiplier_or_rate_in_the_ledger_is_flagged():
    larger_z = _check(accounting.Ledger().record(accounting.poisson(accounting.gaussian(2 * Z), Q), T))
    assert larger_z.flagged and larger_z.mismatched
    # a ledger at half the rate the sampler draws with: the rate test sees the sampler's rate
    half_rate = accounting.poisson(accounting.gaussian(Z), Q / 2)
    report = check_accounting(
        accounting.Ledger().record(half_rate, T),
        steps=T,
        release=half_rate,
        delta=DELTA,
        sampler=SAMPLER,
        key=random.key(0),
    )
    assert report.flagged and not report.sampling[0].passed and report.sampling[0].p_value < 1e-10


def test_claimed_releases_expand_repeats_and_compositions():
    other = accounting.poisson(accounting.gaussian(3.0), Q)
    process = accounting.compose(accounting.repeat(STEP, 3), accounting.repeat(accounting.compose(STEP, other), 2))
    assert claimed_releases(process) == [(STEP, 3), (STEP, 2), (other, 2)]
    ledger = accounting.Ledger().record(STEP, 2).record(other, 5)
    assert claimed_releases(ledger) == [(STEP, 2), (other, 5)]


def test_whole_horizon_claims_are_refused():
    horizon = accounting.random_allocation(accounting.gaussian(Z), 10)
    with pytest.raises(ConfigurationError, match="whole-horizon"):
        check_accounting(horizon, steps=10, release=horizon, delta=DELTA)
    with pytest.raises(ConfigurationError, match="per-step"):
        check_accounting(SAMPLER.process(Z, 2), steps=2, release=SAMPLER.process(Z, 2), delta=DELTA)
