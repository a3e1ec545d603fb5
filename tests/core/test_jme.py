"""Projected joint moment estimation: the sensitivity against brute force, the allocation, the mechanism.

The closed forms of :mod:`opake_core.jme` are checked against a direct search over pairs of points of the ball (a
dense grid for ``d = 1, 2``, random pairs for ``d = 3``, each refined by a constrained local optimizer): no feasible
pair may exceed the closed form, and the search must come within ``1e-6`` of it (the supremum is attained).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize

from opake_core import random
from opake_core import testing as t
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.jme import JME_STREAMS, JmeAllocation, jme_noise, jme_sensitivity_squared, project, square_growth
from opake_core.moments import ClippedMoments, NoisedMoments
from opake_core.optim import private_moments_adam
from opake_core.step import dp_step
from opake_core.tree import Clipped, Noised, PerGroup

Z = 1.1


def _objective(x, y, w1, w2):
    """``w1 ||x - y||^2 + w2 ||x ⊙ x - y ⊙ y||^2`` for stacked pairs ``x, y [..., d]``."""
    return w1 * ((x - y) ** 2).sum(-1) + w2 * ((x * x - y * y) ** 2).sum(-1)


def _candidates(d, radius, rng):
    """Points of the ball: a dense grid for d <= 2, random points (interior and sphere) for d = 3."""
    if d == 1:
        return np.linspace(-radius, radius, 801)[:, None]
    if d == 2:
        axis = np.linspace(-radius, radius, 41)
        grid = np.stack(np.meshgrid(axis, axis), -1).reshape(-1, 2)
        grid = grid[(grid**2).sum(1) <= radius**2]
        angles = np.linspace(0, 2 * np.pi, 160, endpoint=False)
        return np.concatenate([grid, radius * np.stack([np.cos(angles), np.sin(angles)], 1)])
    points = rng.normal(size=(1200, d))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    return np.concatenate([points * radius, points[:600] * radius * rng.uniform(size=(600, 1)) ** (1 / d)])


def _search(d, distance, radius, w1, w2, seed=0):
    """The largest objective over feasible pairs (``||x||, ||y|| <= R``, ``||x - y|| <= D``) found by a dense
    search, then refined by SLSQP from the 8 best pairs; only pairs feasible to 1e-12 count."""
    rng = np.random.default_rng(seed)
    points = _candidates(d, radius, rng)
    best = []
    for start in range(0, len(points), 400):
        x = points[start : start + 400, None, :]
        values = _objective(x, points[None, :, :], w1, w2)
        values[((x - points[None]) ** 2).sum(-1) > distance**2 + 1e-15] = -np.inf
        i, j = np.unravel_index(np.argsort(values, axis=None)[-8:], values.shape)
        best += [(values[a, b], start + a, b) for a, b in zip(i, j, strict=True)]
    best.sort(reverse=True)
    found = best[0][0]
    constraints = [
        {"type": "ineq", "fun": lambda v: radius**2 - (v[:d] ** 2).sum()},
        {"type": "ineq", "fun": lambda v: radius**2 - (v[d:] ** 2).sum()},
        {"type": "ineq", "fun": lambda v: distance**2 - ((v[:d] - v[d:]) ** 2).sum()},
    ]
    for _, a, b in best[:8]:
        start = np.concatenate([points[a], points[b]])
        res = optimize.minimize(
            lambda v: -_objective(v[:d], v[d:], w1, w2),
            start,
            method="SLSQP",
            constraints=constraints,
            options={"ftol": 1e-15, "maxiter": 500},
        )
        v = res.x
        feasible = all(c["fun"](v) >= -1e-12 for c in constraints)
        if feasible:
            found = max(found, _objective(v[:d], v[d:], w1, w2))
    return found


CASES = [
    # (d, Delta, lambda): both branches of M_R at D, the interior peak r* < D, D = 2R, and d = 1 with its
    # stationary point
    (2, 0.5, 0.5),
    (2, 1.0, 0.5),
    (2, 2.0, 2.0),
    (2, 5.0, 0.7),
    (3, 1.2, 1.5),
    (1, 0.9, 0.5),
    (1, 1.8, 3.0),
    (1, 2.0, 1.25),
]


@pytest.mark.parametrize(("d", "delta", "lam"), CASES, ids=[f"d{c[0]}-D{c[1]}-l{c[2]}" for c in CASES])
def test_sensitivity_squared_is_the_supremum(d, delta, lam):
    closed = jme_sensitivity_squared(lam, delta=delta, radius=1.0, dim=d)
    found = _search(d, min(delta, 2.0), 1.0, 1.0, lam)
    assert found <= closed * (1 + 1e-9)
    assert found >= closed * (1 - 1e-6)


@pytest.mark.parametrize(("d", "distance"), [(1, 0.7), (1, 1.6), (2, 0.5), (2, 1.2), (2, 1.9), (3, 1.0)])
def test_square_growth_is_the_supremum(d, distance):
    """``max_{r <= D} M_R(r)`` (the second stream's own sensitivity squared) against the search."""
    radius = 1.0
    peak = min(distance, radius if d == 1 else math.sqrt(2) * radius)
    closed = square_growth(peak, radius=radius, dim=d)
    found = _search(d, distance, radius, 0.0, 1.0, seed=1)
    assert found <= closed * (1 + 1e-9)
    assert found >= closed * (1 - 1e-6)
    assert all(square_growth(r, radius=radius, dim=d) <= closed + 1e-15 for r in np.linspace(0, distance, 50))


def test_allocations():
    assert JmeAllocation.paper_reference().lam(delta=0.3, radius=2.0, dim=10) == pytest.approx(0.5 / 4)
    assert JmeAllocation.paper_reference().lam(delta=0.3, radius=1.0, dim=1) == pytest.approx((11 + 5 * 5**0.5) / 8)
    # at D = R the paper's allocation raises the first stream's variance by 75% (checked against the search)
    lam = JmeAllocation.paper_reference().lam(delta=1.0, radius=1.0, dim=3)
    assert jme_sensitivity_squared(lam, delta=1.0, radius=1.0, dim=3) == pytest.approx(1.75, rel=1e-12)
    for d, delta, kappa in [(5, 0.3, 1.5), (5, 1.5, 1.2), (5, 3.0, 2.0), (1, 0.8, 1.5), (1, 1.9, 3.0)]:
        allocation = JmeAllocation.first_variance_cap(kappa)
        lam = allocation.lam(delta=delta, radius=1.0, dim=d)
        target = kappa * min(delta, 2.0) ** 2
        assert jme_sensitivity_squared(lam, delta=delta, radius=1.0, dim=d) <= target
        assert jme_sensitivity_squared(lam * (1 + 1e-9), delta=delta, radius=1.0, dim=d) > target * (1 - 1e-12)


def test_allocation_refusals():
    with pytest.raises(ConfigurationError, match="kappa"):
        JmeAllocation.first_variance_cap(1.0)
    with pytest.raises(ConfigurationError, match="kind"):
        JmeAllocation("optimal")
    with pytest.raises(ConfigurationError, match="aggregate_norm"):
        jme_noise(noise_multiplier=1.0, key=random.key(0), aggregate_norm=0.0)
    with pytest.raises(InputTypeError, match="JmeAllocation"):
        jme_noise(noise_multiplier=1.0, key=random.key(0), allocation=1.5)


def test_projection_and_the_noiseless_streams():
    gen = torch.Generator().manual_seed(2)
    value = {
        "a": torch.randn(7, generator=gen, dtype=torch.float64) * 3,
        "b": torch.randn(2, 2, generator=gen).double(),
    }
    norm = math.sqrt(sum(float(v.square().sum()) for v in value.values()))
    projected, seen = project(value, 0.5)
    assert seen == pytest.approx(norm)
    assert math.sqrt(sum(float(v.square().sum()) for v in projected.values())) <= 0.5
    noise_fn, state = jme_noise(
        noise_multiplier=0.0, key=random.key(0), aggregate_norm=0.5, compute_dtype=torch.float64
    )
    out, new_state = noise_fn(Clipped(value, 0.1), state)
    assert isinstance(out, NoisedMoments) and new_state.step == 1
    for k, v in value.items():
        assert torch.allclose(out.first.value[k], v * 0.5 / norm, rtol=1e-14)
        assert torch.allclose(out.second.value[k], (v * 0.5 / norm) ** 2, rtol=1e-14)
    inside = {"a": torch.full((3,), 0.1, dtype=torch.float64)}
    assert torch.equal(noise_fn(Clipped(inside, 0.1), state)[0].first.value["a"], inside["a"])


def test_noise_of_both_streams_has_the_stated_std():
    """Zero input (an empty batch): the release is pure noise. RMS and KS tests at alpha = 1e-3 per stream (false
    alarm at most 4e-3), and a correlation test between the streams at 1e-3."""
    size, delta, radius = 30_000, 0.05, 0.2
    noise_fn, state = jme_noise(
        noise_multiplier=Z, key=random.key(4), aggregate_norm=radius, compute_dtype=torch.float64
    )
    zeros = {"w": torch.zeros(size, dtype=torch.float64)}
    out, new_state = noise_fn(Clipped(zeros, delta), state)
    lam = JmeAllocation.first_variance_cap(1.5).lam(delta=delta, radius=radius, dim=size)
    s_lambda = math.sqrt(jme_sensitivity_squared(lam, delta=delta, radius=radius, dim=size))
    assert out.first.noise_std == pytest.approx(Z * s_lambda, rel=1e-12)
    assert out.second.noise_std == pytest.approx(Z * s_lambda / math.sqrt(lam), rel=1e-12)
    assert out.first.noise_std <= Z * delta * math.sqrt(1.5) * (1 + 1e-12)
    t.assert_noise(out.first.value["w"], std=out.first.noise_std)
    t.assert_noise(out.second.value["w"], std=out.second.noise_std)
    t.assert_fresh_noise([out.first.value["w"], out.second.value["w"]])
    replay, _ = noise_fn(Clipped(zeros, delta), state)
    assert torch.equal(replay.second.value["w"], out.second.value["w"]) and new_state.step == 1
    assert JME_STREAMS[0] != JME_STREAMS[1]


def test_mechanism_refusals():
    noise_fn, state = jme_noise(noise_multiplier=1.0, key=random.key(0))
    tree = {"a": torch.zeros(3)}
    with pytest.raises(ConfigurationError, match="scalar clipping bound"):
        noise_fn(Clipped(tree, PerGroup.build({"a": "g"}, {"g": 1.0})), state)
    with pytest.raises(InputTypeError, match="second_moment=False"):
        noise_fn(ClippedMoments(Clipped(tree, 1.0), Clipped(tree, 1.0)), state)
    with pytest.raises(InputTypeError, match="un-noised"):
        noise_fn(Noised(tree, 1.0, 1.0), state)


def test_jme_with_private_moments_adam_in_a_step():
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 2, generator=gen, dtype=torch.float64)}
    x, y = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, 2, generator=gen, dtype=torch.float64)
    opt = private_moments_adam(1e-2)
    step_fn, dp_state = dp_step(
        lambda p, xi, yi: ((xi @ p["w"] - yi) ** 2).sum(),
        clipping=1.0,
        noise=jme_noise(noise_multiplier=Z, key=random.key(3), aggregate_norm=0.5, compute_dtype=torch.float64),
        optimizer=opt,
        expected_batch_size=4.0,
    )
    opt_state = opt.init(params)
    for batch in [(x, y), (x[:0], y[:0]), (x[:3], y[:3])]:  # an empty Poisson draw is a step too
        new, opt_state, dp_state, metrics = step_fn(params, opt_state, dp_state, batch)
        assert torch.isfinite(new["w"]).all() and not torch.equal(new["w"], params["w"])
        params = new
    assert dp_state.noise.step == 3 and metrics.noise_std > 0
