"""The one-run f-DP test (opake_core.auditing.fdp_test) against independent references: the exact binomial law of
coin flips, the closed-form Gaussian test, and simulations of an ideal Gaussian mechanism with stated false-alarm
rates.

Statistical assertions: each states the probability that a correct implementation fails it (at most 1e-3); the
seeds are fixed, so every run gives the same outcome.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from opake_core import accounting, auditing, random
from opake_core.auditing import count_correct, guesses
from opake_core.errors import ConfigurationError, InputTypeError

DELTA = 1e-5


def _gaussian_scores(rng: np.random.Generator, m: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """An ideal mu-GDP audit: an included canary scores N(mu, 1), an excluded one N(0, 1)."""
    included = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * included, included


# -- the test of Algorithm 3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [10, 40, 150, 400])
def test_at_mu_zero_the_test_is_a_valid_binomial_test(r):
    """A 0-GDP run's output is independent of the coins, so ``v ~ Binomial(r, 1/2)`` exactly: the test must reject
    only values with binomial tail at most the level (validity), and not much later than the exact test (power)."""
    m = 1000
    first = next(v for v in range(r + 1) if auditing.rejects(m, r, v, mu=0.0))
    assert stats.binom.sf(first - 1, r, 0.5) <= 0.05
    assert all(auditing.rejects(m, r, v, mu=0.0) for v in range(first, r + 1))
    exact = next(v for v in range(r + 1) if stats.binom.sf(v - 1, r, 0.5) <= 0.05)
    assert first - exact <= 1 + r // 100


def test_rejection_is_monotone_in_mu_and_in_correct_guesses():
    m, r = 1000, 200
    for v in (120, 150, 180, 200):
        flags = [auditing.rejects(m, r, v, mu=mu) for mu in np.linspace(0, 3, 61)]
        assert flags == sorted(flags, reverse=True)
    flags = [auditing.rejects(m, r, v, mu=0.8) for v in range(100, r + 1)]
    assert flags == sorted(flags)


def test_mu_lower_bound_is_the_boundary_of_rejection():
    m, r, v = 1000, 150, 141
    mu = auditing.mu_lower_bound(m, r, v)
    assert mu > 0
    assert auditing.rejects(m, r, v, mu=mu)
    assert not auditing.rejects(m, r, v, mu=mu + 0.002)
    assert auditing.mu_lower_bound(m, r, v, confidence=0.99) < mu


def test_generic_curve_reproduces_the_gaussian_test():
    for r, v, mu in ((100, 90, 0.9), (300, 240, 0.5), (60, 60, 1.4)):
        curve = lambda a, mu=mu: auditing.gaussian_tradeoff(a, mu=mu)  # noqa: E731
        assert auditing.rejects(1000, r, v, tradeoff=curve) == auditing.rejects(1000, r, v, mu=mu)


def test_false_alarm_rate_and_tightness_on_an_ideal_gaussian_mechanism():
    """200 ideal audits of a 1-GDP mechanism with 1,000 canaries and one fixed guess set at confidence 0.95.

    Validity: the bound may exceed mu = 1 in at most 5% of the audits; a correct implementation shows 22 or more
    such audits out of 200 with probability P[Binomial(200, 0.05) >= 22] < 1e-3. Tightness: the mean bound is about
    0.5 mu here (a sixth of the audits' spread is 0.005); below 0.4 mu would mean a broken statistic.
    """
    assert stats.binom.sf(21, 200, 0.05) < 1e-3
    rng = np.random.default_rng(2024)
    bounds = np.array(
        [
            auditing.fdp_audit(*_gaussian_scores(rng, 1000, 1.0), delta=DELTA, guess_sets=[(75, 75)]).mu
            for _ in range(200)
        ]
    )
    assert np.sum(bounds > 1.0) <= 21
    assert bounds.mean() > 0.4


def test_bonferroni_sweep_keeps_its_false_alarm_rate():
    """The default sweep of eight guess sets, on 100 ideal audits at mu = 0.5: at most 5% exceed mu, so 14 or more
    happen with probability P[Binomial(100, 0.05) >= 14] < 1e-3 for a correct implementation."""
    assert stats.binom.sf(13, 100, 0.05) < 1e-3
    rng = np.random.default_rng(7)
    bounds = [auditing.fdp_audit(*_gaussian_scores(rng, 1000, 0.5), delta=DELTA).mu for _ in range(100)]
    assert sum(b > 0.5 for b in bounds) <= 13


def test_claim_test_of_dp_sgd_rejects_a_halved_noise_and_keeps_the_correct_claim():
    """The accountant's exact curve for DP-SGD (q = 0.2, 200 steps, epsilon 4) tested on 40 simulated all-iterates
    audits with likelihood-ratio scores, guess set (100, 100).

    Correct runs: rejected in at most 5% of runs, so 8 or more of 40 with probability < 1e-3 (0 of 200 other seeds
    were rejected when this test was written). Noise halved with the claim unchanged: rejected in 199 of 200
    simulations with other seeds; fewer than 30 of 40 has probability < 1e-3 if the power is at least 0.95.
    """
    assert stats.binom.sf(7, 40, 0.05) < 1e-3 and stats.binom.cdf(29, 40, 0.95) < 1e-3
    q, steps = 0.2, 200
    z = accounting.calibrate_noise_multiplier(
        lambda s: accounting.repeat(accounting.poisson(accounting.gaussian(s), q), steps),
        target_epsilon=4.0,
        delta=DELTA,
    ).value
    curve = auditing.process_tradeoff(accounting.repeat(accounting.poisson(accounting.gaussian(z), q), steps))

    def rejected(noise: float, seed: int) -> bool:
        x, included = auditing.simulate_dirac_observations(
            random.key(seed), num_canaries=1000, steps=steps, sample_rate=q, noise_multiplier=noise
        )
        scores = auditing.likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=q)
        return auditing.audit_claim(scores, included, tradeoff=curve, guess_sets=[(100, 100)]).rejected

    assert sum(rejected(z, seed) for seed in range(40)) <= 7
    assert sum(rejected(z / 2, 100 + seed) for seed in range(40)) >= 30


# -- guess sets and audits ------------------------------------------------------------------------------------------


def test_fdp_audit_reports_the_best_guess_set_and_its_epsilon():
    rng = np.random.default_rng(3)
    scores, included = _gaussian_scores(rng, 1000, 1.5)
    sets = [(50, 0), (100, 100), (200, 200)]
    result = auditing.fdp_audit(scores, included, delta=DELTA, guess_sets=sets)
    per_set = []
    for kp, kn in sets:
        r, v = count_correct(guesses(scores, k_pos=kp, k_neg=kn), included)
        per_set.append(auditing.mu_lower_bound(1000, r, v, confidence=1 - 0.05 / len(sets)))
    assert result.mu == pytest.approx(max(per_set), abs=1e-12)
    assert (result.k_pos, result.k_neg) == sets[int(np.argmax(per_set))]
    assert result.epsilon == pytest.approx(auditing.gaussian_epsilon(result.mu, delta=DELTA))
    assert result.flags(result.epsilon - 1e-3) and not result.flags(result.epsilon)


def test_select_guess_set_maximizes_the_mean_bound():
    rng = np.random.default_rng(11)
    simulated = [_gaussian_scores(rng, 400, 1.0) for _ in range(3)]
    candidates = [(10, 10), (40, 40), (40, 0), (120, 120)]
    choice = auditing.select_guess_set(simulated, candidates=candidates)
    means = []
    for kp, kn in candidates:
        bounds = []
        for scores, included in simulated:
            r, v = count_correct(guesses(scores, k_pos=kp, k_neg=kn), included)
            bounds.append(auditing.mu_lower_bound(400, r, v))
        means.append(np.mean(bounds))
    assert choice == candidates[int(np.argmax(means))]


# -- errors ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_typed_errors():
    with pytest.raises(ConfigurationError, match="v <= r <= m"):
        auditing.mu_lower_bound(10, 5, 6)
    with pytest.raises(ConfigurationError, match="confidence"):
        auditing.mu_lower_bound(10, 5, 5, confidence=1.0)
    with pytest.raises(ConfigurationError, match="exactly one"):
        auditing.rejects(10, 5, 5)
    with pytest.raises(InputTypeError, match="callable"):
        auditing.rejects(10, 5, 5, tradeoff=0.3)
    with pytest.raises(InputTypeError, match="boolean"):
        auditing.fdp_audit(np.zeros(4), np.zeros(4), delta=DELTA)
    with pytest.raises(ConfigurationError, match="non-finite"):
        auditing.fdp_audit(np.array([0.0, np.nan]), np.array([True, False]), delta=DELTA)
    with pytest.raises(ConfigurationError, match="k_pos \\+ k_neg"):
        auditing.fdp_audit(np.zeros(4), np.ones(4, bool), delta=DELTA, guess_sets=[(3, 3)])
