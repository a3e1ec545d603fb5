"""opake_core.plan: one validation of sampler, mechanism, clipping, budget and horizon, for researchers and the trainer
alike; the resolved numbers against dp-accounting and the accounting functions directly."""

from __future__ import annotations

import dp_accounting
import pytest
from dp_accounting import pld

from opake_core import accounting, mf, sampling
from opake_core.clipping import adaptive
from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_core.plan import SAMPLERS, check_combination, is_horizon, plan

N, DELTA = 1000, 1e-5
POISSON = sampling.poisson(dataset_size=N, sample_rate=0.05)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"sampler": "poisson", "mechanism": "mf_band"}, ConfigurationError, "cyclic_poisson"),
        ({"sampler": "balls_in_bins", "mechanism": "gaussian"}, ConfigurationError, "goes with"),
        ({"sampler": "cyclic_poisson", "mechanism": "mf_band", "adaptive_clipping": True}, ConfigurationError,
         "constant per-step"),
        ({"sampler": "k_out_of_t", "adaptive_clipping": True}, ConfigurationError, "plain Poisson"),
        ({"sampler": "sequential", "noise_multiplier": 1.0}, ConfigurationError, "no privacy amplification"),
        ({"sampler": "poisson", "noise_multiplier": 0.0, "target": 3.0}, PrivacyBudgetError, "non-private"),
        ({"sampler": "cyclic_poisson", "mechanism": "mf_band", "noise_multiplier": 1.0, "target": 3.0},
         PrivacyBudgetError, "whole-horizon"),
    ],
)  # fmt: skip
def test_combinations_without_an_accountant_are_refused(kwargs, error, needle):
    base = {"mechanism": "gaussian", "adaptive_clipping": False, "noise_multiplier": None, "target": 3.0}
    with pytest.raises(error, match=needle):
        check_combination(**{**base, **kwargs})


def test_every_listed_pair_is_accepted_and_horizons_are_named():
    for mechanism, samplers in SAMPLERS.items():
        for name in samplers:
            multiplier = 0.0 if name == "sequential" else None
            check_combination(
                mechanism=mechanism, sampler=name, adaptive_clipping=False, noise_multiplier=multiplier, target=None
            )
    assert not is_horizon("gaussian", "poisson") and is_horizon("gaussian", "k_out_of_t")
    assert is_horizon("mf_band", "cyclic_poisson")


def test_a_calibrated_dp_sgd_plan_is_the_accounting_calibration():
    resolved = plan(sampler=POISSON, steps=200, delta=DELTA, target_epsilon=3.0)
    direct = accounting.calibrate_noise_multiplier(
        lambda z: accounting.repeat(accounting.poisson(accounting.gaussian(z), 0.05), 200),
        target_epsilon=3.0,
        delta=DELTA,
    )
    assert resolved.noise_multiplier == direct.value and resolved.calibration_source == "calibrated"
    assert resolved.release == accounting.poisson(accounting.gaussian(direct.value), 0.05)
    assert not resolved.horizon and resolved.expected_batch_size == 50.0 and resolved.sample_rate == 0.05


def test_adaptive_clipping_adds_its_count_release():
    rule = adaptive(1.0, count_noise_fraction=0.05)
    resolved = plan(sampler=POISSON, steps=10, delta=DELTA, clipping=rule, noise_multiplier=1.0)
    count = accounting.adaptive_clipping(accounting.gaussian(1.0), count_noise_fraction=0.05, expected_batch_size=50.0)
    assert resolved.release == accounting.poisson(count, 0.05)


def test_a_dp_ftrl_plan_optimizes_the_strategy_and_accounts_the_whole_horizon():
    cyclic = sampling.cyclic_poisson(dataset_size=N, sample_rate=0.05, bands=4)
    resolved = plan(sampler=cyclic, steps=64, delta=DELTA, strategy=mf.band_mf(4), noise_multiplier=2.0)
    assert resolved.horizon and resolved.strategy is not None
    assert resolved.release == accounting.mf_process(
        resolved.strategy, sampler=cyclic, noise_multiplier=2.0, n_steps=64
    )
    with pytest.raises(ConfigurationError, match="bands <= the steps"):
        plan(sampler=cyclic, steps=2, delta=DELTA, strategy=mf.band_mf(4), noise_multiplier=2.0)


def test_a_fixed_multiplier_stops_at_the_last_step_within_the_total_target():
    spent = accounting.Ledger().record(accounting.poisson(accounting.gaussian(1.0), 0.05), 10)
    resolved = plan(
        sampler=POISSON, steps=1000, delta=DELTA, noise_multiplier=1.0, target_epsilon=2.0, spent=spent, done=0
    )
    assert resolved.stop_step < 1000
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.0))
    accountant.compose(event, 10 + resolved.stop_step)
    assert accountant.get_epsilon(DELTA) <= 2.0
    accountant.compose(event)
    assert accountant.get_epsilon(DELTA) > 2.0


def test_a_spent_budget_is_refused_and_an_unchanged_resume_keeps_its_multiplier():
    first = plan(sampler=POISSON, steps=100, delta=DELTA, target_epsilon=2.0)
    spent = accounting.Ledger().record(first.release, 100)
    with pytest.raises(PrivacyBudgetError, match="budget is spent"):
        plan(sampler=POISSON, steps=200, delta=DELTA, target_epsilon=2.0, spent=spent, done=100)
    halfway = accounting.Ledger().record(first.release, 50)
    kept = plan(
        sampler=POISSON, steps=100, delta=DELTA, target_epsilon=2.0, spent=halfway, done=50,
        resumed_multiplier=first.noise_multiplier,
    )  # fmt: skip
    assert kept.noise_multiplier == first.noise_multiplier


# -- the MoE router release (router_ratio) ---------------------------------------------------------------------------


def _pld_epsilon(z: float, q: float, steps: int) -> float:
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return accountant.get_epsilon(DELTA)


def test_a_router_release_accounts_each_step_at_the_effective_multiplier():
    """With ``router_ratio=rho`` the recorded release is a Poisson-sampled Gaussian at ``z / sqrt(1 + rho)``, and its
    epsilon is dp-accounting's for that multiplier (larger than without the release)."""
    rho, z, steps = 0.5, 1.2, 40
    resolved = plan(sampler=POISSON, steps=steps, delta=DELTA, noise_multiplier=z, router_ratio=rho)
    assert resolved.noise_multiplier == z
    assert resolved.release == accounting.moe_aux(accounting.poisson(accounting.gaussian(z), 0.05), ratio=rho)
    ours = accounting.epsilon(accounting.repeat(resolved.release, steps), delta=DELTA).value
    direct = _pld_epsilon(z / (1 + rho) ** 0.5, 0.05, steps)
    assert ours == pytest.approx(direct, rel=1e-6)
    assert ours > _pld_epsilon(z, 0.05, steps)


def test_a_router_release_calibrates_the_gradient_multiplier_for_the_effective_one():
    """A target epsilon gives the gradient's ``z``; the pair's effective ``z / sqrt(1 + rho)`` meets the target (and a
    slightly smaller ``z`` would not)."""
    rho, steps, target = 0.2, 100, 2.0
    resolved = plan(sampler=POISSON, steps=steps, delta=DELTA, target_epsilon=target, router_ratio=rho)
    z = resolved.noise_multiplier
    assert resolved.calibration_source == "calibrated"
    assert _pld_epsilon(z / (1 + rho) ** 0.5, 0.05, steps) <= target * (1 + 1e-6)
    assert _pld_epsilon(0.98 * z / (1 + rho) ** 0.5, 0.05, steps) > target
    plain = plan(sampler=POISSON, steps=steps, delta=DELTA, target_epsilon=target).noise_multiplier
    assert z == pytest.approx(plain * (1 + rho) ** 0.5, rel=1e-2)


def test_a_router_release_is_refused_without_dp_sgd_and_fixed_clipping():
    cyclic = sampling.cyclic_poisson(dataset_size=N, sample_rate=0.05, bands=4)
    with pytest.raises(ConfigurationError, match="router release is a DP-SGD release"):
        plan(sampler=cyclic, steps=64, delta=DELTA, strategy=mf.band_mf(4), noise_multiplier=2.0, router_ratio=0.1)
    with pytest.raises(ConfigurationError, match="fixed clipping bound"):
        rule = adaptive(1.0, count_noise_fraction=0.05)
        plan(sampler=POISSON, steps=10, delta=DELTA, clipping=rule, noise_multiplier=1.0, router_ratio=0.1)
    with pytest.raises(ConfigurationError, match="router_ratio"):
        plan(sampler=POISSON, steps=10, delta=DELTA, noise_multiplier=1.0, router_ratio=0.0)
