"""The ledger (epsilon of a history), the delta guard and the bounded cost of PLD queries."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from dp_accounting import pld

from opake_core import accounting as acc
from opake_core.errors import ConfigurationError, InputTypeError, PrivacyBudgetError


def _step(z, q=0.05):
    return acc.poisson(acc.gaussian(z), q)


def test_ledger_epsilon_is_that_of_a_fresh_accountant_fed_the_history():
    ledger = acc.Ledger().record(_step(1.0), 30).record(_step(1.0), 10).record(_step(3.0, 0.1), 20).record(_step(1.0))
    assert ledger.entries == ((_step(1.0), 40), (_step(3.0, 0.1), 20), (_step(1.0), 1))
    assert ledger.releases == 61
    direct = pld.PLDAccountant(value_discretization_interval=1e-4)
    for z, q, n in ((1.0, 0.05, 40), (3.0, 0.1, 20), (1.0, 0.05, 1)):
        direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    assert ledger.epsilon(delta=1e-5).value == pytest.approx(direct.get_epsilon(1e-5), rel=1e-6)


def test_ledger_json_round_trip_and_refusals():
    ledger = acc.Ledger().record(_step(1.0), 3).record(acc.poisson(acc.adaptive_clipping(
        acc.gaussian(2.0), count_noise_fraction=0.05, expected_batch_size=8.0), 0.1))  # fmt: skip
    assert acc.Ledger.from_json(json.loads(json.dumps(ledger.to_json()))) == ledger
    assert acc.Ledger().epsilon(delta=1e-5).value == 0.0 and acc.Ledger().process() is None
    document = ledger.to_json()
    document["entries"][0]["count"] = 0
    with pytest.raises(ConfigurationError):
        acc.Ledger.from_json(document)
    with pytest.raises(ConfigurationError):
        acc.Ledger.from_json({"format": "opake.accounting.ledger/1", "entries": [{"process": {"type": "os"}}]})
    with pytest.raises(InputTypeError):
        acc.Ledger().record("not a process")


def test_a_noise_free_release_makes_the_whole_history_non_private():
    assert math.isinf(acc.Ledger().record(_step(1.0), 5).record(_step(0.0)).epsilon(delta=1e-5).value)


def test_check_delta_refuses_one_over_n_warns_above_a_tenth_and_can_be_overridden():
    assert acc.check_delta(1e-5, dataset_size=1000) == 1e-5
    with pytest.raises(PrivacyBudgetError, match="1/N"):
        acc.check_delta(1e-3, dataset_size=1000)
    with pytest.warns(UserWarning, match=r"1/\(10 N\)"):
        acc.check_delta(5e-4, dataset_size=1000)
    with pytest.warns(UserWarning):
        assert acc.check_delta(0.5, dataset_size=1000, allow_large=True) == 0.5


def test_pld_cost_is_bounded_and_the_answer_stays_an_upper_bound():
    """1000 unsampled steps at noise 0.3 are one Gaussian with noise 0.3 / sqrt(1000), whose epsilon is known in
    closed form (Balle and Wang 2018). The coarse grid (about 1e6 points) stays above it, within 0.1%."""
    exact = dp_accounting.get_epsilon_gaussian(0.3 / math.sqrt(1000), 1e-5)
    answer = acc.epsilon(acc.repeat(acc.gaussian(0.3), 1000), delta=1e-5)
    assert answer.accountant == "pld"
    assert exact <= answer.value <= exact * 1.001


def test_epsilons_in_the_millions_are_answered_by_rdp_and_long_runs_are_refused_for_pld():
    tiny = acc.repeat(_step(0.01, 0.01), 1000)
    answer = acc.epsilon(tiny, delta=1e-5)
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.01)), 1000)
    assert answer.accountant == "rdp" and answer.value == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(ConfigurationError, match="accountant='rdp'"):
        acc.epsilon(acc.repeat(_step(1.0), 2 * 10**6), delta=1e-5)
    assert acc.epsilon(acc.repeat(_step(1.0), 2 * 10**6), delta=1e-5, accountant="rdp").accountant == "rdp"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # dp-accounting's own overflow on the tiny multiplier
def test_a_vanishing_noise_multiplier_is_refused_not_read_as_epsilon_zero():
    # dp-accounting's RDP accountant itself answers epsilon 0 for this Gaussian (its variance underflows)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1e-160)), 100)
    assert rdp.get_epsilon(1e-5) == 0.0
    for tiny in (1e-160, 1e-7):
        with pytest.raises(ConfigurationError, match="non-private"):
            acc.gaussian(tiny)
    with pytest.raises(ConfigurationError, match="1e\\+06"):
        acc.gaussian(1e7)
    assert acc.epsilon(acc.repeat(acc.poisson(acc.gaussian(1e-6), 0.01), 100), delta=1e-5).value > 1e10
