"""Processes, queries, calibration and serialization of opake_core.accounting."""

from __future__ import annotations

import functools
import json
import math

import dp_accounting
import pytest
from dp_accounting import pld

from opake_core import accounting as acc
from opake_core.errors import CalibrationError, ConfigurationError, InputTypeError

STEP = acc.poisson(acc.gaussian(1.0), 0.05)
FAST = {"discretization": 1e-3}  # behaviour tests; the oracle tests use the default 1e-4


def test_repeat_and_compose_agree():
    a = acc.epsilon(acc.repeat(STEP, 3), delta=1e-5, **FAST).value
    b = acc.epsilon(acc.compose(STEP, STEP, STEP), delta=1e-5, **FAST).value
    c = acc.epsilon(acc.compose(acc.repeat(STEP, 2), STEP), delta=1e-5, **FAST).value
    assert a == pytest.approx(b, rel=1e-6)
    assert a == pytest.approx(c, rel=1e-6)


def test_delta_at_epsilon_inverts_epsilon_at_delta():
    run = acc.repeat(STEP, 20)
    eps = acc.epsilon(run, delta=1e-5, **FAST).value
    d = acc.delta(run, epsilon=eps, **FAST)
    assert d.accountant == "pld"
    assert d.value <= 1e-5 * (1 + 1e-6)
    assert acc.delta(run, epsilon=0.5 * eps, **FAST).value > 1e-5


def test_sample_rate_one_is_the_plain_gaussian():
    a = acc.epsilon(acc.poisson(acc.gaussian(1.0), 1.0), delta=1e-5, **FAST).value
    assert a == pytest.approx(acc.epsilon(acc.gaussian(1.0), delta=1e-5, **FAST).value)
    assert a == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0, 1e-5), rel=1e-3)


def test_nonprivate_is_inf_not_an_error():
    for process in (acc.gaussian(0.0), acc.repeat(acc.poisson(acc.gaussian(0.0), 0.01), 10)):
        assert acc.epsilon(process, delta=1e-5, **FAST).value == math.inf
        assert acc.delta(process, epsilon=1.0, **FAST).value == 1.0
    mixed = acc.compose(acc.repeat(STEP, 5), acc.poisson(acc.gaussian(0.0), 0.01))
    assert acc.epsilon(mixed, delta=1e-5, **FAST).value == math.inf


def test_nonprivate_with_a_finite_target_is_refused():
    step = acc.poisson(acc.gaussian(0.0), 0.01)
    with pytest.raises(ConfigurationError, match="non-private"):
        acc.calibrate_steps(step, target_epsilon=8.0, delta=1e-5)
    with pytest.raises(ConfigurationError, match="non-private"):
        acc.stop_step(step, target_epsilon=8.0, delta=1e-5)


@pytest.mark.parametrize(
    ("build", "error", "needle"),
    [
        (lambda: acc.poisson(acc.gaussian(1.0), 0.0), ConfigurationError, "0.0"),
        (lambda: acc.poisson(acc.gaussian(1.0), 1.5), ConfigurationError, "1.5"),
        (lambda: acc.poisson(acc.gaussian(1.0), math.nan), ConfigurationError, "nan"),
        (lambda: acc.gaussian(math.nan), ConfigurationError, "nan"),
        (lambda: acc.gaussian(-1.0), ConfigurationError, "-1.0"),
        (lambda: acc.repeat(STEP, -3), ConfigurationError, "-3"),
        (lambda: acc.repeat(STEP, 2.5), InputTypeError, "2.5"),
        (lambda: acc.poisson(acc.repeat(STEP, 2), 0.1), ConfigurationError, "no correct accountant"),
        (
            lambda: acc.k_out_of_t(acc.gaussian(1.0), k=3, t=10, allocation="block"),
            ConfigurationError,
            "t=10",
        ),
        (
            lambda: acc.k_out_of_t(acc.gaussian(1.0), k=2, t=10, allocation="other"),
            ConfigurationError,
            "other",
        ),
        (
            lambda: acc.truncated_poisson(acc.gaussian(1.0), 1.0, dataset_size=10, truncated_batch_size=2),
            ConfigurationError,
            "1.0",
        ),
    ],
)
def test_bad_processes_are_refused(build, error, needle):
    with pytest.raises(error, match=needle.replace(".", r"\.").replace("(", r"\(")):
        build()


@pytest.mark.parametrize("bad", [0.0, 1.0, -1e-5, math.nan, 2.0])
def test_bad_delta_is_refused(bad):
    with pytest.raises(ConfigurationError, match="delta"):
        acc.epsilon(STEP, delta=bad, **FAST)


def test_accountant_mismatches_are_refused():
    truncated = acc.truncated_poisson(acc.gaussian(1.0), 0.01, dataset_size=1000, truncated_batch_size=20)
    assert acc.epsilon(truncated, delta=1e-5, **FAST).accountant == "pld"
    with pytest.raises(ConfigurationError, match="rdp"):
        acc.epsilon(truncated, delta=1e-5, accountant="rdp", **FAST)
    ra = acc.random_allocation(acc.gaussian(1.0), 4)
    with pytest.raises(ConfigurationError, match="numerical PLD"):
        acc.epsilon(ra, delta=1e-3, accountant="rdp", **FAST)
    with pytest.raises(ConfigurationError, match="only for random-allocation"):
        acc.epsilon(STEP, delta=1e-3, accountant="monte_carlo", **FAST)
    with pytest.raises(ConfigurationError, match="accountant must be"):
        acc.epsilon(STEP, delta=1e-3, accountant="prv", **FAST)


def test_truncated_poisson_uses_the_truncated_event():
    truncated = acc.truncated_poisson(acc.gaussian(1.0), 0.01, dataset_size=1000, truncated_batch_size=20)
    event = acc.to_dp_event(truncated)
    assert isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent)
    direct = pld.PLDAccountant(value_discretization_interval=1e-3)
    direct.compose(dp_accounting.SelfComposedDpEvent(event, 50))
    ours = acc.epsilon(acc.repeat(truncated, 50), delta=1e-5, **FAST).value
    assert ours == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)


def test_adaptive_clipping_effective_multiplier():
    # Andrew et al. 2021, Thm 1: (sigma^-2 + (2 sigma_b)^-2)^(-1/2), sigma_b = fraction * expected batch size.
    ada = acc.adaptive_clipping(acc.gaussian(1.0), count_noise_fraction=0.05, expected_batch_size=20)
    assert ada.effective_noise_multiplier == pytest.approx((1.0 + (2 * 0.05 * 20) ** -2) ** -0.5)
    plain = acc.epsilon(acc.repeat(acc.poisson(acc.gaussian(1.0), 0.05), 10), delta=1e-5).value
    adaptive = acc.epsilon(acc.repeat(acc.poisson(ada, 0.05), 10), delta=1e-5, **FAST).value
    same = acc.epsilon(
        acc.repeat(acc.poisson(acc.gaussian(ada.effective_noise_multiplier), 0.05), 10), delta=1e-5, **FAST
    )
    assert adaptive > plain
    assert adaptive == pytest.approx(same.value, rel=1e-12)


def test_json_round_trip():
    process = acc.compose(
        acc.repeat(
            acc.poisson(
                acc.adaptive_clipping(acc.gaussian(0.9), count_noise_fraction=0.05, expected_batch_size=32),
                0.01,
            ),
            7,
        ),
        acc.truncated_poisson(acc.gaussian(1.1), 0.02, dataset_size=500, truncated_batch_size=15),
        acc.k_out_of_t(acc.gaussian(1.0), k=2, t=9, allocation="total"),
    )
    doc = json.loads(json.dumps(acc.to_json(process)))
    assert acc.from_json(doc) == process
    assert set(doc["versions"]) == {"opake", "dp-accounting"}
    assert doc["versions"]["dp-accounting"] == "0.6.0"
    with pytest.raises(ConfigurationError, match="format"):
        acc.from_json({"process": doc["process"]})
    bad = json.loads(json.dumps(doc).replace('"sample_rate": 0.01', '"sample_rate": 7.0'))
    with pytest.raises(ConfigurationError, match=r"7\.0"):
        acc.from_json(bad)


def test_calibration_round_trip():
    target, tol = 2.0, 1e-3
    found = acc.calibrate_noise_multiplier(
        lambda s: acc.repeat(acc.poisson(acc.gaussian(s), 0.02), 50),
        target_epsilon=target,
        delta=1e-5,
        tolerance=tol,
        **FAST,
    )
    assert target * (1 - tol) <= found.epsilon <= target
    run = acc.repeat(acc.poisson(acc.gaussian(found.value), 0.02), 50)
    check = acc.epsilon(run, delta=1e-5, **FAST).value
    assert check == found.epsilon
    assert found.value >= 0.11


def test_calibration_bounds():
    make = lambda s: acc.repeat(acc.poisson(acc.gaussian(s), 0.02), 50)  # noqa: E731
    with pytest.raises(CalibrationError, match="unreachable"):
        acc.calibrate_noise_multiplier(make, target_epsilon=0.01, delta=1e-5, max=2.0, **FAST)
    at_min = acc.calibrate_noise_multiplier(make, target_epsilon=1e4, delta=1e-5, accountant="rdp")
    assert at_min.value == 0.11
    with pytest.raises(CalibrationError, match="min < max"):
        acc.calibrate_noise_multiplier(make, target_epsilon=1.0, delta=1e-5, min=3.0, max=2.0)


@functools.cache
def _curve(count: int = 14) -> tuple[float, ...]:
    """Epsilon after each step, composing one step at a time with dp-accounting's PLD accountant."""
    accountant = pld.PLDAccountant(value_discretization_interval=FAST["discretization"])
    out = []
    for _ in range(count):
        accountant.compose(acc.to_dp_event(SLOW_STEP))
        out.append(accountant.get_epsilon(1e-5))
    return tuple(out)


SLOW_STEP = acc.poisson(acc.gaussian(1.0), 0.1)


@pytest.mark.parametrize("k", [0, 5, 12])
def test_stop_step_matches_composing_one_step_at_a_time(k):
    curve = _curve()
    target = 0.5 * (curve[k] + curve[k + 1])  # between consecutive values, so rounding cannot flip the answer
    assert acc.stop_step(SLOW_STEP, target_epsilon=target, delta=1e-5, **FAST) == k + 2


def test_stop_step_beyond_max_steps_is_none():
    assert acc.stop_step(SLOW_STEP, target_epsilon=_curve()[-1] * 1.01, delta=1e-5, max_steps=14, **FAST) is None


def test_stop_step_with_a_prefix_and_calibrate_steps():
    curve = _curve()
    target = 0.5 * (curve[11] + curve[12])
    prefix = acc.repeat(SLOW_STEP, 5)
    assert acc.stop_step(SLOW_STEP, target_epsilon=target, delta=1e-5, prefix=prefix, **FAST) == 13 - 5
    fits = acc.calibrate_steps(SLOW_STEP, target_epsilon=target, delta=1e-5, **FAST)
    assert fits.value == 12
    assert fits.epsilon <= target
    with pytest.raises(CalibrationError, match="even one step"):
        acc.calibrate_steps(SLOW_STEP, target_epsilon=curve[0] / 2, delta=1e-5, **FAST)


def test_stop_step_refuses_a_horizon_process():
    with pytest.raises(ConfigurationError, match="whole horizon"):
        acc.stop_step(acc.random_allocation(acc.gaussian(1.0), 4), target_epsilon=1.0, delta=1e-5)
