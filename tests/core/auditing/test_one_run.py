"""The one-run audit statistics against direct numerical checks."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from opake_core import random
from opake_core.auditing import one_run
from opake_core.errors import ConfigurationError, InputTypeError


def _brute_p_value(m, r, v, eps, delta):
    """The bound of the module docstring by enumerating every outcome of r guesses (exact rationals where possible)."""
    q = math.exp(eps) / (1 + math.exp(eps))
    probs = {}
    for outcome in itertools.product((0, 1), repeat=r):
        w = sum(outcome)
        probs[w] = probs.get(w, 0.0) + q**w * (1 - q) ** (r - w)
    tail = sum(p for w, p in probs.items() if w >= v)
    alpha = max((sum(probs.get(w, 0.0) for w in range(v - i, v)) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail + 2 * m * delta * alpha)


@pytest.mark.parametrize(("m", "r", "v"), [(10, 6, 5), (12, 8, 8), (20, 10, 3), (5, 4, 0), (30, 12, 10)])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("delta", [0.0, 1e-3])
def test_p_value_matches_brute_force(m, r, v, eps, delta):
    assert one_run.p_value(m, r, v, epsilon=eps, delta=delta) == pytest.approx(
        _brute_p_value(m, r, v, eps, delta), rel=1e-9
    )


def test_p_value_at_eps_zero_all_correct_is_exact():
    # 10 correct out of 10 coin flips: 2^-10 exactly.
    assert one_run.p_value(10, 10, 10, epsilon=0.0, delta=0.0) == pytest.approx(float(Fraction(1, 1024)))


def test_lower_bound_inverts_the_p_value():
    m, r, v, delta = 200, 60, 57, 1e-5
    eps = one_run.epsilon_lower_bound(m, r, v, delta=delta, confidence=0.95)
    assert eps > 0
    assert one_run.p_value(m, r, v, epsilon=eps, delta=delta) <= 0.05
    assert one_run.p_value(m, r, v, epsilon=eps + 1e-4, delta=delta) > 0.05


def test_lower_bound_is_monotone_and_zero_for_chance():
    delta = 1e-5
    bounds = [one_run.epsilon_lower_bound(100, 40, v, delta=delta) for v in range(20, 41, 5)]
    assert bounds == sorted(bounds)
    assert one_run.epsilon_lower_bound(100, 40, 20, delta=delta) == 0.0
    assert one_run.epsilon_lower_bound(100, 40, 40, delta=delta, confidence=0.99) < one_run.epsilon_lower_bound(
        100, 40, 40, delta=delta
    )


def test_ceiling_is_about_log_m():
    # All r guesses correct: q^r = 1 - confidence, so eps = log(r / -log(1 - confidence)) to first order.
    eps = one_run.epsilon_lower_bound(1000, 1000, 1000, delta=0.0)
    assert eps == pytest.approx(math.log(1000 / -math.log(0.05)), abs=0.01)


def test_false_alarm_rate_on_randomized_response():
    """A truly eps-DP mechanism (randomized response on every canary) exceeds eps in at most 5% of audits.

    400 audits at confidence 0.95: the number of false alarms is Binomial(400, <= 0.05); we allow 35 (P[> 35] < 1e-3
    under the worst case p = 0.05), so this test itself has a false-alarm rate below 1e-3 (and a fixed seed).
    """
    eps_true, m = 1.0, 200
    gen = np.random.default_rng(0)
    q = math.exp(eps_true) / (1 + math.exp(eps_true))
    alarms = 0
    for _ in range(400):
        included = gen.random(m) < 0.5
        # Randomized response: the released bit equals the coin with probability q; the score is the released bit.
        released = np.where(gen.random(m) < q, included, ~included)
        scores = released.astype(float) + 1e-3 * gen.random(m)
        result = one_run.one_run_audit(scores, included, delta=0.0, k=m // 2)
        alarms += result.epsilon > eps_true
    assert alarms <= 35


def test_perfect_memorization_gives_a_large_bound():
    included = one_run.coin_flips(random.key(0), 300)
    scores = np.where(included, 1.0, -1.0)
    result = one_run.one_run_audit(scores, included, delta=1e-5)
    assert result.epsilon > 3 and result.accuracy == 1.0 and result.num_canaries == 300


def test_uninformative_scores_give_zero():
    included = one_run.coin_flips(random.key(1), 300)
    result = one_run.one_run_audit(np.zeros(300), included, delta=1e-5)
    assert result.epsilon < 0.5


def test_guesses_and_counts():
    g = one_run.guesses([0.1, 0.9, 0.5, -1.0], k_pos=1, k_neg=1)
    assert g.tolist() == [0, 1, 0, -1]
    assert one_run.count_correct(g, np.array([False, True, True, True])) == (2, 1)


def test_coin_flips_replay_and_balance():
    a = one_run.coin_flips(random.key(3), 10_000)
    assert np.array_equal(a, one_run.coin_flips(random.key(3), 10_000))
    assert abs(a.mean() - 0.5) < 0.02


def test_errors_name_the_value():
    with pytest.raises(ConfigurationError, match="v <= r <= m"):
        one_run.p_value(5, 6, 1, epsilon=1.0, delta=0.0)
    with pytest.raises(ConfigurationError, match="confidence"):
        one_run.epsilon_lower_bound(5, 4, 4, delta=0.0, confidence=95)
    with pytest.raises(InputTypeError, match="boolean"):
        one_run.one_run_audit([1.0, 2.0], [1, 0], delta=0.0)
    with pytest.raises(ConfigurationError, match="non-finite"):
        one_run.one_run_audit([1.0, math.nan], [True, False], delta=0.0)
    with pytest.raises(ConfigurationError, match="k must satisfy"):
        one_run.one_run_audit([1.0, 2.0, 3.0], [True, False, True], delta=0.0, k=2)
