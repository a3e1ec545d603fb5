"""The per-leaf noise test against simulated noise: its false-alarm rate, its power, its claim and its whitening."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from opake_core import mf, random
from opake_core.auditing import noise_scale
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf import mf_gaussian_noise
from opake_core.tree import Clipped, per_group


def _report(gen, sizes, ratios=None, **kwargs):
    ratios = ratios or {}
    sums = {name: noise_scale.sum_squares(ratios.get(name, 1.0) * gen.standard_normal(n)) for name, n in sizes.items()}
    return noise_scale.leaf_noise_test(sums, **kwargs)


def test_false_alarm_rate_is_at_most_the_stated_one():
    """2,000 correct runs of five leaves at false_alarm 0.05: alarms ~ Binomial(2000, p <= 0.05). We allow 131
    (P[> 131] < 1e-3 at p = 0.05), so this test itself fails a correct implementation with probability below 1e-3; a
    test without the Bonferroni correction (p about 0.23) fails it."""
    gen = np.random.default_rng(0)
    sizes = {"a": 3, "b": 40, "c": 200, "d": 1000, "e": 7}
    alarms = sum(_report(gen, sizes, false_alarm=0.05).flagged for _ in range(2000))
    assert stats.binom.sf(131, 2000, 0.05) < 1e-3
    assert alarms <= 131


def test_power_at_min_coordinates():
    """A leaf with min_coordinates values and std 2/3 of the claim is flagged in at least 99.9% of runs (the
    normal approximation's promise); 2,000 runs, we require 1,990 (P[< 1990] < 1e-3 at power 0.999)."""
    gen = np.random.default_rng(1)
    n = noise_scale.min_coordinates(4)
    sizes = {"w": 5000, "b": n, "c": 50, "d": 50}
    detected = sum("b" in _report(gen, sizes, {"b": 2 / 3}).flagged_leaves for _ in range(2000))
    assert stats.binom.cdf(1989, 2000, 0.999) < 1e-3
    assert detected >= 1990


def test_min_coordinates_matches_the_normal_approximation():
    level = 1e-3 / 25
    z = stats.norm.ppf(1 - level / 2) + stats.norm.ppf(0.999)
    assert noise_scale.min_coordinates(25) == math.ceil(2 * (z / (2 * math.log(1.5))) ** 2) == 158


def test_missing_noise_is_flagged_on_a_single_coordinate():
    report = noise_scale.leaf_noise_test({"w": noise_scale.sum_squares(np.ones(500)), "b": (0.0, 1)})
    assert report.flagged_leaves == ("b",) and report.underpowered == ("b",)
    assert report.leaves[1].std_ratio == 0.0 and report.leaves[1].p_value == 0.0


def test_non_finite_values_are_flagged():
    report = noise_scale.leaf_noise_test({"w": (math.nan, 10), "b": (10.0, 10)})
    assert report.flagged_leaves == ("w",)


def test_claimed_std_scalar_and_per_group():
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    assert noise_scale.claimed_std(0.25, 2.0, ["w", "b"]) == {"w": 0.5, "b": 0.5}
    groups = per_group(params, {"^b": 0.5}, fallback=2.0).map(lambda c: c / 8)
    std = noise_scale.claimed_std(groups, 2.0, ["w", "b"])
    total = (0.5 + 2.0) / 8  # the allocation sigma_g = z sqrt(Delta_g sum_h Delta_h)
    assert std["b"] == pytest.approx(2.0 * math.sqrt(0.5 / 8 * total))
    assert std["w"] == pytest.approx(2.0 * math.sqrt(2.0 / 8 * total))
    with pytest.raises(ConfigurationError, match="no group"):
        noise_scale.claimed_std(groups, 2.0, ["w", "other"])
    with pytest.raises(ConfigurationError, match="> 0"):
        noise_scale.claimed_std(0.25, 0.0, ["w"])


def test_whiten_recovers_independent_draws_from_the_matrix_mechanism():
    """BandMF noise over 10 of its 12 steps, whitened with C, is sigma times i.i.d. standard normals: the chi-square
    test passes (at 1e-3) with the claimed sigma, and each whitened step has the claimed variance."""
    n_steps, steps = 12, 10
    strategy = mf.optimize(mf.band_mf(bands=4), n_steps)
    template = {"w": torch.zeros(4000, dtype=torch.float64)}
    noise_fn, state = mf_gaussian_noise(
        template, strategy, n_steps=n_steps, noise_multiplier=1.5, key=random.key(0), compute_dtype=torch.float64
    )
    rows = []
    for _ in range(steps):
        noised, state = noise_fn(Clipped(template, 0.5), state)
        rows.append(noised.value["w"].numpy())
    sigma = 1.5 * mf.sensitivity(strategy, n_steps) * 0.5
    white = noise_scale.whiten(np.stack(rows), strategy, n_steps=n_steps) / sigma
    assert not noise_scale.leaf_noise_test({"w": noise_scale.sum_squares(white)}).flagged
    assert np.allclose(white.var(axis=1), 1.0, atol=0.1)
    raw = np.stack(rows) / sigma  # without whitening the steps' variances follow the rows of C^-1
    assert noise_scale.leaf_noise_test({"w": noise_scale.sum_squares(raw)}).flagged


def test_errors_name_the_value():
    with pytest.raises(InputTypeError, match="mapping"):
        noise_scale.leaf_noise_test({})
    with pytest.raises(ConfigurationError, match="no values"):
        noise_scale.leaf_noise_test({"w": (0.0, 0)})
    with pytest.raises(ConfigurationError, match="false_alarm"):
        noise_scale.min_coordinates(3, false_alarm=1.5)
    with pytest.raises(ConfigurationError, match="n_steps=4"):
        noise_scale.whiten(np.zeros((5, 2)), mf.identity(), n_steps=4)
