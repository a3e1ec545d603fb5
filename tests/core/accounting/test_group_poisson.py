"""``poisson_group``: a group of k records under record-level Poisson sampling (the user-level guarantee of ELS).

References: dp-accounting's Poisson-subsampled Gaussian at k = 1; for k > 1, the hockey-stick divergence of one step
computed by quadrature in float64 from the densities (both directions), which the PLD answer must bound from above
and approach; and a check of the worst case the accountant assumes: two records whose clipped gradients point in
different directions (a 2-D mixture, integrated on a grid) never leak more than two aligned ones. The fast
construction of the mixture's PLD is compared with dp-accounting's own, pmf for pmf.
"""

from __future__ import annotations

import json
import math
import time

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from scipy import integrate, stats

from opake_core import accounting as acc
from opake_core.accounting.group import GroupPoissonDpEvent, group_poisson_pld
from opake_core.errors import ConfigurationError


def test_a_group_of_one_is_the_poisson_step():
    run = acc.repeat(acc.poisson_group(acc.gaussian(1.2), 0.02, group_size=1), 50)
    event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.2))
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event, 50)
    assert acc.epsilon(run, delta=1e-6).value == pytest.approx(direct.get_epsilon(1e-6), rel=1e-6)


def _mixture_delta(sigma, q, k, epsilon):
    """max over the two directions of H_{e^eps}, one step, from the 1-D densities on a grid of step 2e-5 sigma
    (trapezoid rule: relative error below 1e-6 here)."""
    weights = stats.binom.pmf(np.arange(k + 1), k, q)
    x = np.arange(-12 * sigma, k + 12 * sigma, 2e-5 * sigma)
    p = sum(w * stats.norm.pdf(x, j, sigma) for j, w in enumerate(weights))
    q0 = stats.norm.pdf(x, 0.0, sigma)
    a = math.exp(epsilon)
    remove = integrate.trapezoid(np.maximum(p - a * q0, 0.0), x)
    add = integrate.trapezoid(np.maximum(q0 - a * p, 0.0), x)
    return max(remove, add)


@pytest.mark.parametrize(("sigma", "q", "k", "epsilon"), [(1.0, 0.1, 3, 1.0), (0.8, 0.3, 5, 2.0), (2.0, 0.05, 8, 0.3)])
def test_one_step_delta_bounds_the_exact_hockey_stick_divergence(sigma, q, k, epsilon):
    exact = _mixture_delta(sigma, q, k, epsilon)
    group = acc.poisson_group(acc.gaussian(sigma), q, group_size=k)
    ours = acc.delta(group, epsilon=epsilon, discretization=1e-3).value  # 10 times faster, still an upper bound
    assert exact * (1 - 1e-6) <= ours <= exact * 1.01 + 1e-9  # pessimistic (to the grid's error), and tight


def _grid_delta(sigma, q, vectors, epsilon, n=1201):
    """Remove direction of one step for records with clipped gradients ``vectors`` (2-D), on a grid: the batch holds
    each record with probability q independently, the release is the sum of those present plus N(0, sigma^2 I)."""
    k = len(vectors)
    reach = 10 * sigma + sum(np.linalg.norm(v) for v in vectors)
    axis = np.linspace(-reach, reach, n)
    x, y = np.meshgrid(axis, axis, indexing="ij")
    density = np.zeros_like(x)
    for mask in range(2**k):
        present = [vectors[i] for i in range(k) if mask >> i & 1]
        mean = np.sum(present, axis=0) if present else np.zeros(2)
        weight = q ** len(present) * (1 - q) ** (k - len(present))
        density += weight * stats.norm.pdf(x, mean[0], sigma) * stats.norm.pdf(y, mean[1], sigma)
    base = stats.norm.pdf(x, 0, sigma) * stats.norm.pdf(y, 0, sigma)
    cell = (axis[1] - axis[0]) ** 2
    return float(np.maximum(density - math.exp(epsilon) * base, 0).sum() * cell)


def test_aligned_gradients_are_the_worst_case_of_a_group_of_two():
    sigma, q, epsilon = 0.7, 0.3, 0.8
    aligned = _grid_delta(sigma, q, [np.array([1.0, 0.0]), np.array([1.0, 0.0])], epsilon)
    assert aligned == pytest.approx(_mixture_delta(sigma, q, 2, epsilon), rel=1e-3)  # the 2-D grid is accurate
    for degrees in (30, 60, 90, 135, 180):
        angle = math.radians(degrees)
        turned = [np.array([1.0, 0.0]), np.array([math.cos(angle), math.sin(angle)])]
        assert _grid_delta(sigma, q, turned, epsilon) <= aligned * (1 + 1e-6)
    assert _grid_delta(sigma, q, [np.array([1.0, 0.0]), np.array([0.5, 0.0])], epsilon) <= aligned  # shorter


def test_the_process_serializes_and_composes():
    group = acc.poisson_group(acc.gaussian(1.0), 0.05, group_size=3)
    run = acc.compose(acc.repeat(group, 4), acc.poisson(acc.gaussian(1.0), 0.05))
    assert acc.from_json(json.loads(json.dumps(acc.to_json(run)))) == run
    coarse = {"delta": 1e-5, "discretization": 1e-2}
    assert acc.epsilon(run, **coarse).value > acc.epsilon(acc.repeat(group, 4), **coarse).value
    assert acc.is_nonprivate(acc.poisson_group(acc.gaussian(0.0), 0.05, group_size=3))
    with pytest.raises(ConfigurationError, match="plain Gaussian"):
        acc.poisson_group(acc.poisson(acc.gaussian(1.0), 0.1), 0.05, group_size=2)


@pytest.mark.parametrize(("sigma", "q", "k"), [(1.0, 0.01, 2), (0.7, 0.3, 5), (2.0, 0.05, 8)])
def test_the_fast_construction_is_dp_accountings_pld_exactly(sigma, q, k):
    """The vectorized bisection gives dp-accounting's own PLD of the mixture, bit for bit, in both directions."""
    counts = np.arange(k + 1)
    reference = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        sigma, counts.astype(float).tolist(), stats.binom.pmf(counts, k, q).tolist(), value_discretization_interval=1e-2
    )
    ours = group_poisson_pld(GroupPoissonDpEvent(sigma, q, k), discretization=1e-2)
    for mine, theirs in ((ours._pmf_remove, reference._pmf_remove), (ours._pmf_add, reference._pmf_add)):
        mine, theirs = mine.to_dense_pmf(), theirs.to_dense_pmf()
        assert mine._lower_loss == theirs._lower_loss and mine._infinity_mass == theirs._infinity_mass
        np.testing.assert_array_equal(mine._probs, theirs._probs)


def test_one_step_at_the_default_grid_builds_in_seconds():
    """Calibrating a parallel-Poisson run queries this PLD ten or more times: dp-accounting's own construction takes
    15 to 25 s for this step (a Python recursion per grid point), the vectorized one about 1.5 s; the bound leaves
    a factor 5 for a loaded machine."""
    start = time.perf_counter()
    group_poisson_pld(GroupPoissonDpEvent(1.0, 0.01, 2), discretization=1e-4)
    assert time.perf_counter() - start < 8.0


@pytest.mark.parametrize(("sigma", "q", "k", "epsilon"), [(1.0, 0.1, 3, 1.0), (0.8, 0.3, 5, 2.0), (2.0, 0.05, 8, 0.3)])
def test_the_dominating_poisson_step_bounds_the_group(sigma, q, k, epsilon):
    """RDP answers through the Poisson step at rate 1 - (1 - q)^k with multiplier sigma / k: one step's exact
    hockey-stick divergence (quadrature, both directions) is below that step's (dp-accounting PLD), and over 50 steps
    the RDP answer is above the group's PLD answer."""
    rate = 1 - (1 - q) ** k
    dominating = acc.poisson(acc.gaussian(sigma / k), rate)
    assert _mixture_delta(sigma, q, k, epsilon) <= acc.delta(dominating, epsilon=epsilon).value
    group = acc.poisson_group(acc.gaussian(sigma), q, group_size=k)
    via_rdp = acc.epsilon(acc.repeat(group, 50), delta=1e-5, accountant="rdp")
    assert via_rdp.accountant == "rdp"
    same = acc.epsilon(acc.repeat(dominating, 50), delta=1e-5, accountant="rdp").value
    assert via_rdp.value == pytest.approx(same, rel=1e-12)  # the rate computed as -expm1(k log1p(-q))
    assert via_rdp.value >= acc.epsilon(acc.repeat(group, 50), delta=1e-5, discretization=1e-3).value
