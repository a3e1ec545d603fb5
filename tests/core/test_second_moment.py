"""Private second moments: the two clipped streams, their joint noise, its accounting, and the optimizer.

References used here: a float64 loop over single examples (``torch.autograd.grad``, not vmap) for both streams;
``dp_accounting`` directly for the privacy of the joint release; a two-dimensional quadrature of the hockey-stick
divergence for the Poisson-subsampled pair; dense strategy matrices for DP-FTRL; a float64 loop of the optimizer's
formulas. Statistical tests state their false-alarm rates.
"""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, pld, rdp
from dp_accounting.pld import privacy_loss_distribution
from scipy import stats

from opake_core import accounting, mf, optim, random
from opake_core import testing as t
from opake_core.clipping import Engine, auto_s, clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.jme import jme_noise
from opake_core.moments import ClippedMoments, NoisedMoments, paired_noise_std
from opake_core.noise import PAIRED_STREAMS, gaussian_noise, paired_mf_gaussian_noise
from opake_core.optim import apply_updates, private_moments_adam
from opake_core.plan import plan
from opake_core.sampling import b_min_sep, balls_in_bins, cyclic_poisson, poisson
from opake_core.step import dp_ftrl, dp_sgd, dp_step
from opake_core.tree import Clipped, Noised, PerGroup, per_group

Z = 1.1


def _params():
    gen = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(5, 6, generator=gen, dtype=torch.float64),
        "b1": torch.zeros(6, dtype=torch.float64),
        "w2": torch.randn(6, 3, generator=gen, dtype=torch.float64),
    }


def _loss(p, x, y):
    logits = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return F.cross_entropy(logits[None], y[None])


def _data(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64) * torch.logspace(-1, 1, n, dtype=torch.float64)[:, None]
    return x, torch.randint(0, 3, (n,), generator=gen)


def _loop(params, x, y, bound_of, *, normalize_by, gamma=None):
    """Both streams one example at a time in float64: ``c_i`` clipped per group, ``sum c_i / n``, ``sum c_i^2 / n``."""
    first = {k: torch.zeros_like(v) for k, v in params.items()}
    second = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        grads = dict(zip(p, torch.autograd.grad(_loss(p, x[i], y[i]), list(p.values())), strict=True))
        groups = {}
        for name in grads:
            groups.setdefault(bound_of[name], []).append(name)
        for bound, names in groups.items():
            norm = math.sqrt(sum(float(grads[k].square().sum()) for k in names))
            factor = bound / (norm + gamma) if gamma is not None else min(1.0, bound / norm)
            for k in names:
                c = grads[k] * factor
                first[k] += c
                second[k] += c * c
    return {k: v / normalize_by for k, v in first.items()}, {k: v / normalize_by for k, v in second.items()}


def _close(a, b, rtol=1e-12):
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=1e-15), (k, (a[k] - b[k]).abs().max())


# -- the two clipped streams --------------------------------------------------------------------------------------


@pytest.mark.parametrize("microbatch_size", [None, 1, 4])
def test_both_streams_match_the_float64_loop(microbatch_size):
    params, (x, y) = _params(), _data(9)
    fn, state = clipped_grad(
        _loss,
        clipping_norm=0.8,
        normalize_by=7.0,
        batch_argnums=(1, 2),
        microbatch_size=microbatch_size,
        second_moment=True,
    )
    out, _ = fn(params, x, y, state=state)
    assert isinstance(out, ClippedMoments)
    assert out.first.sensitivity == 0.8 / 7.0 and out.second.sensitivity == pytest.approx(0.64 / 7.0)
    first, second = _loop(params, x, y, dict.fromkeys(params, 0.8), normalize_by=7.0)
    _close(out.first.value, first)
    _close(out.second.value, second)
    plain, plain_state = clipped_grad(_loss, clipping_norm=0.8, normalize_by=7.0, batch_argnums=(1, 2))
    _close(out.first.value, plain(params, x, y, state=plain_state)[0].value, rtol=0)


def test_per_group_and_auto_s_streams():
    params, (x, y) = _params(), _data(6, seed=2)
    bounds = per_group(params, {"^w1$": 0.3, "^w2$": 0.9}, fallback=0.5)
    fn, state = clipped_grad(
        _loss, clipping_norm=bounds, normalize_by=6.0, batch_argnums=(1, 2), second_moment=True, microbatch_size=4
    )
    out, _ = fn(params, x, y, state=state)
    first, second = _loop(params, x, y, {"w1": 0.3, "w2": 0.9, "b1": 0.5}, normalize_by=6.0)
    _close(out.first.value, first)
    _close(out.second.value, second)
    assert out.second.sensitivity.value_of == pytest.approx({"^w1$": 0.09 / 6, "^w2$": 0.81 / 6, "fallback": 0.25 / 6})
    fn, state = clipped_grad(
        _loss, clipping_norm=auto_s(0.7, gamma=0.02), normalize_by=6.0, batch_argnums=(1, 2), second_moment=True
    )
    out, _ = fn(params, x, y, state=state)
    first, second = _loop(params, x, y, dict.fromkeys(params, 0.7), normalize_by=6.0, gamma=0.02)
    _close(out.first.value, first)
    _close(out.second.value, second)
    assert out.second.sensitivity == pytest.approx(0.49 / 6.0)


def test_empty_batch_gives_two_zero_streams():
    params, (x, y) = _params(), _data(3)
    fn, state = clipped_grad(_loss, clipping_norm=1.0, normalize_by=4.0, batch_argnums=(1, 2), second_moment=True)
    out, _ = fn(params, x[:0], y[:0], state=state)
    assert all(float(v.abs().sum()) == 0 for v in [*out.first.value.values(), *out.second.value.values()])
    assert (out.first.sensitivity, out.second.sensitivity) == (0.25, 0.25)


def test_second_stream_keeps_its_bound_in_float32():
    params = {k: v.float() for k, v in _params().items()}
    x = torch.full((1, 5), 1e5)
    y = torch.zeros(1, dtype=torch.long)
    fn, state = clipped_grad(
        lambda p, xx, yy: _loss(p, xx, yy) * 1e6, clipping_norm=0.5, batch_argnums=(1, 2), second_moment=True
    )
    out, _ = fn(params, x, y, state=state)
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in out.second.value.values()))
    assert out.second.value["w1"].dtype == torch.float32 and 0 < norm <= 0.25


def test_neighbouring_batches_move_each_stream_within_its_sensitivity():
    params, (x, y) = _params(), _data(8, seed=3)
    fn, state = clipped_grad(_loss, clipping_norm=0.6, normalize_by=8.0, batch_argnums=(1, 2), second_moment=True)
    for stream in ("first", "second"):
        t.assert_sensitivity(lambda b, s=stream: getattr(fn(params, *b, state=state)[0], s), (x, y), key=random.key(4))


def test_engine_without_squares_is_refused():
    class NormsOnly:
        def __init__(self, leaves):  # norms and scaled sums, but no add_squared_scaled
            self.leaves = leaves

        def squared_norms(self):
            return torch.stack([g.square().reshape(g.shape[0], -1).sum(1) for g in self.leaves]).double()

        def add_scaled(self, scales, sums):
            for k, (g, total) in enumerate(zip(self.leaves, sums, strict=True)):
                total.add_((g.to(total.dtype) * scales[total.dtype][k].reshape(-1, *([1] * (g.dim() - 1)))).sum(0))

    from opake_core.clipping import VmapGradients

    params, (x, y) = _params(), _data(3)
    engine = Engine(gradients=VmapGradients(NormsOnly))
    fn, state = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2), second_moment=True, engine=engine)
    with pytest.raises(ConfigurationError, match="second_moment"):
        fn(params, x, y, state=state)


# -- one Gaussian release for the pair -----------------------------------------------------------------------------


@pytest.mark.parametrize(("d1", "d2"), [(0.04, 0.08), (1.0 / 256, 1.0 / 256), (0.3, 0.002)])
def test_allocation_is_one_gaussian_with_multiplier_z(d1, d2):
    s1, s2 = paired_noise_std(d1, d2, noise_multiplier=Z)
    assert (d1 / s1) ** 2 + (d2 / s2) ** 2 == pytest.approx(1 / Z**2, rel=1e-12)
    assert s1 == pytest.approx(Z * math.sqrt(d1 * (d1 + d2)), rel=1e-12)
    # with strategy sensitivities s_k (DP-FTRL): sum_k (s_k d_k / sigma_k)^2 = 1 / z^2
    m1, m2 = paired_noise_std(d1, d2, noise_multiplier=Z, strategy_sensitivities=(1.7, 0.6))
    assert (1.7 * d1 / m1) ** 2 + (0.6 * d2 / m2) ** 2 == pytest.approx(1 / Z**2, rel=1e-12)


def test_per_group_allocation_is_one_gaussian_with_multiplier_z():
    groups = PerGroup.build({"a": "g", "b": "h"}, {"g": 0.02, "h": 0.05})
    squares = groups.map(lambda d: d * d * 30)
    s1, s2 = paired_noise_std(groups, squares, noise_multiplier=Z)
    whitened = sum((d / s) ** 2 for (_, d), (_, s) in zip(groups.values, s1.values, strict=True))
    whitened += sum((d / s) ** 2 for (_, d), (_, s) in zip(squares.values, s2.values, strict=True))
    assert whitened == pytest.approx(1 / Z**2, rel=1e-12)


def test_dp_accounting_composition_of_the_two_streams_equals_one_gaussian():
    """Without subsampling the pair is two independent Gaussian mechanisms on the same example: compose them in
    dp-accounting (RDP exactly, PLD up to its pessimistic discretization) and compare with one Gaussian at ``z``."""
    d1, d2 = 0.04, 0.08
    s1, s2 = paired_noise_std(d1, d2, noise_multiplier=Z)
    pair = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(s1 / d1), dp_event.GaussianDpEvent(s2 / d2)])
    single = dp_event.GaussianDpEvent(Z)
    eps = [rdp.RdpAccountant().compose(e).get_epsilon(1e-5) for e in (pair, single)]
    assert eps[0] == pytest.approx(eps[1], rel=1e-9)
    eps = [pld.PLDAccountant(value_discretization_interval=1e-4).compose(e).get_epsilon(1e-5) for e in (pair, single)]
    assert eps[0] == pytest.approx(eps[1], rel=1e-4)  # privacy losses discretized on a 1e-4 grid
    # a 5% under-noised pair is told apart
    worse = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(0.95 * s1 / d1), dp_event.GaussianDpEvent(s2 / d2)])
    assert rdp.RdpAccountant().compose(worse).get_epsilon(1e-5) > eps[1] * 1.01


def _subsampled_pair_delta(shift, q, epsilon, h=0.01, bound=9.0):
    """``delta(epsilon)`` of ``Q = N(0, I_2)`` against ``P = (1 - q) Q + q N(shift, I_2)`` in both directions, by
    summing cell masses over a 2-D grid (a post-processing of the output: at most the true delta, converging to it
    as ``h -> 0``)."""
    edges = np.arange(-bound, bound + h / 2, h)

    def cells(mu):
        return np.diff(stats.norm.cdf(edges - mu))

    null = np.outer(cells(0.0), cells(0.0))
    moved = np.outer(cells(shift[0]), cells(shift[1]))
    mixed = (1 - q) * null + q * moved
    e = math.exp(epsilon)
    return max(np.clip(mixed - e * null, 0, None).sum(), np.clip(null - e * mixed, 0, None).sum())


def test_poisson_subsampled_pair_is_the_subsampled_gaussian_of_dp_accounting():
    """One coin per example decides both streams: the whitened pair is a 2-D Gaussian mixture. Its delta, summed
    over a grid in the original (unrotated) coordinates, must lie below dp-accounting's pessimistic PLD of one
    Poisson-subsampled Gaussian with multiplier ``z`` and within the two discretizations of it."""
    d1, d2, q, epsilon = 0.04, 0.08, 0.05, 1.0
    s1, s2 = paired_noise_std(d1, d2, noise_multiplier=Z)
    shift = (d1 / s1, d2 / s2)
    reference = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=Z, sensitivity=1.0, sampling_prob=q, value_discretization_interval=1e-4
    ).get_delta_for_epsilon(epsilon)
    grid = _subsampled_pair_delta(shift, q, epsilon)
    assert grid <= reference * (1 + 1e-9)
    assert grid >= reference * (1 - 2e-3)
    larger = _subsampled_pair_delta((1.05 * shift[0], 1.05 * shift[1]), q, epsilon)
    assert larger > reference * 1.1  # the check tells a 5% under-noised pair apart


def test_gaussian_noise_on_the_pair_has_the_stated_stds():
    """RMS and KS tests per stream, each at alpha = 1e-3 (four tests: false-alarm rate at most 4e-3), plus a
    correlation test between the streams at 1e-3."""
    size = 30_000
    pair = ClippedMoments(
        Clipped({"a": torch.zeros(size, dtype=torch.float64)}, 0.04),
        Clipped({"a": torch.zeros(size, dtype=torch.float64)}, 0.08),
    )
    noise_fn, state = gaussian_noise(noise_multiplier=Z, key=random.key(7), compute_dtype=torch.float64)
    out, new_state = noise_fn(pair, state)
    assert isinstance(out, NoisedMoments) and new_state.step == 1 and new_state.key == state.key
    s1, s2 = paired_noise_std(0.04, 0.08, noise_multiplier=Z)
    assert (out.first.noise_std, out.second.noise_std) == pytest.approx((s1, s2), rel=1e-12)
    assert (out.first.sensitivity, out.second.sensitivity) == (0.04, 0.08)
    t.assert_noise(out.first.value["a"], std=s1)
    t.assert_noise(out.second.value["a"], std=s2)
    t.assert_fresh_noise([out.first.value["a"], out.second.value["a"]])
    again, _ = noise_fn(pair, state)
    assert torch.equal(again.second.value["a"], out.second.value["a"])
    plain, _ = noise_fn(pair.first, state)  # the single-stream path draws from its own stream
    assert not torch.equal(plain.value["a"], out.first.value["a"])
    assert PAIRED_STREAMS[0] != PAIRED_STREAMS[1]


def test_zero_multiplier_adds_nothing_even_without_clipping():
    pair = ClippedMoments(Clipped({"a": torch.ones(3)}, math.inf), Clipped({"a": torch.ones(3)}, math.inf))
    noise_fn, state = gaussian_noise(noise_multiplier=0.0, key=random.key(0))
    out, _ = noise_fn(pair, state)
    assert torch.equal(out.first.value["a"], torch.ones(3)) and out.second.noise_std == 0.0
    noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(ConfigurationError, match="finite"):
        noise_fn(pair, state)


def test_pair_types_refuse_mixtures():
    with pytest.raises(InputTypeError):
        ClippedMoments(Clipped({}, 1.0), Noised({}, 1.0, 1.0))
    groups = PerGroup.build({"a": "g"}, {"g": 1.0})
    with pytest.raises(InputTypeError, match="per group"):
        ClippedMoments(Clipped({"a": torch.zeros(1)}, groups), Clipped({"a": torch.zeros(1)}, 1.0))
    other = PerGroup.build({"a": "h"}, {"h": 1.0})
    with pytest.raises(ConfigurationError, match="different groups"):
        ClippedMoments(Clipped({"a": torch.zeros(1)}, groups), Clipped({"a": torch.zeros(1)}, other))


# -- DP-FTRL ------------------------------------------------------------------------------------------------------


def test_paired_mf_noise_stds_and_the_joint_gram_matrix():
    n, size = 4, 25_000
    strategy = mf.lambda_cgd(0.5)
    template = {"a": torch.zeros(size, dtype=torch.float64)}
    noise_fn, state = paired_mf_gaussian_noise(
        template,
        strategy,
        second_moment_strategy=strategy,
        n_steps=n,
        noise_multiplier=Z,
        key=random.key(9),
        compute_dtype=torch.float64,
    )
    d1, d2 = 0.05, 0.02
    pair = ClippedMoments(Clipped(template, d1), Clipped(template, d2))
    out, _ = noise_fn(pair, state)
    s = mf.sensitivity(strategy, n)
    row0 = abs(float(mf.inverse_coefficients(strategy, n)[0]))
    total = s * d1 + s * d2
    expected = (Z * math.sqrt(s * d1 * total) * row0, Z * math.sqrt(s * d2 * total) * row0)
    assert (out.first.noise_std, out.second.noise_std) == pytest.approx(expected, rel=1e-12)
    # step 0 adds row 0 of C^-1 times z_0: RMS and KS at 1e-3 per stream (false alarm at most 4e-3)
    t.assert_noise(out.first.value["a"], std=expected[0])
    t.assert_noise(out.second.value["a"], std=expected[1])
    # whitened by each stream's noise, the pair's Gram matrix is C^T C / (z s)^2: that of the first stream alone
    c = mf.materialize(strategy, n)
    sigma = [x / row0 for x in expected]
    joint = sum((d / sig) ** 2 * c.T @ c for d, sig in zip((d1, d2), sigma, strict=True))
    np.testing.assert_allclose(joint, c.T @ c / (Z * s) ** 2, rtol=1e-12)


def test_paired_mf_noise_refusals():
    template = {"a": torch.zeros(3)}
    with pytest.raises(ConfigurationError, match="second_moment_strategy"):
        paired_mf_gaussian_noise(template, mf.identity(), n_steps=2, noise_multiplier=1.0, key=random.key(0))
    noise_fn, state = paired_mf_gaussian_noise(
        template,
        mf.identity(),
        second_moment_strategy=mf.identity(),
        n_steps=2,
        noise_multiplier=1.0,
        key=random.key(0),
    )
    with pytest.raises(InputTypeError, match="ClippedMoments"):
        noise_fn(Clipped(template, 1.0), state)
    _, state = noise_fn(ClippedMoments(Clipped(template, 1.0), Clipped(template, 1.0)), state)
    with pytest.raises(ConfigurationError, match="change across calls"):
        noise_fn(ClippedMoments(Clipped(template, 0.5), Clipped(template, 0.25)), state)


def test_dp_ftrl_needs_a_second_strategy():
    opt = private_moments_adam(1e-2)
    common = {
        "params": _params(),
        "strategy": mf.band_mf(bands=2),
        "n_steps": 3,
        "clipping_norm": 1.0,
        "noise_multiplier": Z,
        "key": random.key(0),
        "optimizer": opt,
        "expected_batch_size": 4.0,
    }
    with pytest.raises(ConfigurationError, match="second_moment_strategy"):
        dp_ftrl(_loss, second_moment=True, **common)
    with pytest.raises(ConfigurationError, match="second_moment=True"):
        dp_ftrl(_loss, second_moment_strategy=mf.identity(), **common)
    step_fn, dp_state = dp_ftrl(_loss, second_moment=True, second_moment_strategy=mf.band_mf(bands=2), **common)
    params, (x, y) = _params(), _data(4)
    opt_state = opt.init(params)
    for _ in range(3):
        params, opt_state, dp_state, metrics = step_fn(params, opt_state, dp_state, (x, y))
    assert all(torch.isfinite(v).all() for v in params.values()) and metrics.step == 2


def _whitened_pair(first, second, n, d1, d2):
    """The stacked whitened strategy ``[C_1 Delta_1 / sigma_1; C_2 Delta_2 / sigma_2]`` (2n x n, float64) of the
    paired noise at multiplier Z with single-participation sensitivities."""
    s1, s2 = mf.sensitivity(first, n), mf.sensitivity(second, n)
    total = s1 * d1 + s2 * d2
    sigma = (Z * math.sqrt(s1 * d1 * total), Z * math.sqrt(s2 * d2 * total))
    return np.vstack([mf.materialize(first, n) * d1 / sigma[0], mf.materialize(second, n) * d2 / sigma[1]])


def test_cyclic_poisson_covers_a_second_strategy_with_at_most_the_groups_bands():
    """The reduction behind cyclic Poisson accounting (one Poisson-subsampled Gaussian per visit of a group, whitened
    sensitivity 1/z) needs the stacked pair's columns of one group orthogonal and each of norm at most 1/z: true on
    the dense matrices for a second strategy with no more bands than groups, false with more; mf_process accepts the
    first and refuses the second."""
    n, groups = 12, 3
    first = mf.optimize(mf.band_mf(bands=3), n)
    sampler = cyclic_poisson(dataset_size=60, sample_rate=0.1, bands=groups)

    def group_columns_orthogonal(second):
        w = _whitened_pair(first, second, n, 0.05, 0.02)
        gram = w.T @ w
        assert np.all(np.sqrt(np.diag(gram)) <= 1 / Z * (1 + 1e-12))
        same_group = [(i, j) for i in range(n) for j in range(n) if i != j and (i - j) % groups == 0]
        return max(abs(gram[i, j]) for i, j in same_group) < 1e-15

    covered, uncovered = mf.optimize(mf.band_mf(bands=2), n), mf.optimize(mf.band_mf(bands=5), n)
    assert group_columns_orthogonal(covered) and not group_columns_orthogonal(uncovered)
    kwargs = {"sampler": sampler, "noise_multiplier": Z, "n_steps": n}
    assert accounting.mf_process(first, second_moment_strategy=covered, **kwargs) == accounting.mf_process(
        first, **kwargs
    )
    with pytest.raises(ConfigurationError, match="at most 3 bands"):
        accounting.mf_process(first, second_moment_strategy=uncovered, **kwargs)
    # without amplification, the noise scaled for the sampler's own pattern covers the pair
    pattern = mf.CyclicParticipation(groups)
    unamplified = {**kwargs, "participation": pattern, "amplified": False}
    accounting.mf_process(first, second_moment_strategy=uncovered, **unamplified)
    with pytest.raises(ConfigurationError, match="participation pattern"):
        single = {**unamplified, "participation": mf.SingleParticipation()}
        accounting.mf_process(first, second_moment_strategy=uncovered, **single)


def test_monte_carlo_accountants_refuse_a_different_second_strategy():
    n = 8
    bins = balls_in_bins(dataset_size=40, num_bins=4)
    kwargs = {"sampler": bins, "noise_multiplier": Z, "n_steps": n}
    blt = mf.optimize(mf.blt(2), n)
    accounting.mf_process(blt, second_moment_strategy=mf.blt(2), **kwargs)  # the same strategy: covered
    with pytest.raises(ConfigurationError, match="first strategy's coefficients alone"):
        accounting.mf_process(blt, second_moment_strategy=mf.lambda_cgd(0.5), **kwargs)
    band = mf.band_mf(bands=2)
    sep = b_min_sep(dataset_size=40, sample_rate=0.1, min_sep=2)
    with pytest.raises(ConfigurationError, match="'b_min_sep'"):
        accounting.mf_process(band, sampler=sep, noise_multiplier=Z, n_steps=n, second_moment_strategy=mf.identity())


def test_plan_validates_the_second_strategy_with_the_sampler():
    groups, steps = 3, 12
    sampler = cyclic_poisson(dataset_size=60, sample_rate=0.1, bands=groups)
    common = {"sampler": sampler, "steps": steps, "delta": 1e-5, "noise_multiplier": Z}
    done = plan(strategy=mf.band_mf(bands=3), second_moment_strategy=mf.band_mf(bands=2), **common)
    pattern = accounting.sampler_participation(sampler)
    assert done.second_moment_strategy == mf.optimize(mf.band_mf(bands=2), steps, participation=pattern)
    assert done.release == plan(strategy=mf.band_mf(bands=3), **common).release
    with pytest.raises(ConfigurationError, match="at most 3 bands"):
        plan(strategy=mf.band_mf(bands=3), second_moment_strategy=mf.band_mf(bands=4), **common)
    poisson_sampler = poisson(dataset_size=60, sample_rate=0.1)
    with pytest.raises(ConfigurationError, match="DP-SGD's private second moments"):
        plan(sampler=poisson_sampler, steps=steps, delta=1e-5, noise_multiplier=Z, second_moment_strategy=mf.identity())


# -- the optimizer ------------------------------------------------------------------------------------------------


def _adam_loop(steps, *, lr, b1, b2, eps, wd, params):
    """The optimizer's formulas, element by element, in float64 Python."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for t_, (g, s) in enumerate(steps, start=1):
        for k in p:
            flat_p, out = p[k].reshape(-1), []
            for j in range(flat_p.numel()):
                gj, sj = float(g[k].reshape(-1)[j]), float(s[k].reshape(-1)[j])
                mj = b1 * float(m[k].reshape(-1)[j]) + (1 - b1) * gj
                vj = b2 * float(v[k].reshape(-1)[j]) + (1 - b2) * sj
                m[k].reshape(-1)[j], v[k].reshape(-1)[j] = mj, vj
                m_hat, v_hat = mj / (1 - b1**t_), vj / (1 - b2**t_)
                d = v_hat if v_hat > 0 else m_hat * m_hat
                pj = float(flat_p[j])
                out.append(pj - lr * (m_hat / (math.sqrt(d) + eps) + wd * pj))
            p[k] = torch.tensor(out, dtype=torch.float64).reshape(p[k].shape)
    return p


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_private_moments_adam_matches_its_formulas(weight_decay):
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(3, 2, generator=gen, dtype=torch.float64), "b": torch.randn(4, generator=gen).double()}
    steps = []
    for _ in range(4):
        g = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
        s = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * 0.5 for k, v in params.items()}
        steps.append((g, s))  # s has negative entries: the fallback to m_hat^2 is exercised
    opt = private_moments_adam(0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=weight_decay)
    state, p = opt.init(params), params
    for g, s in steps:
        noised = NoisedMoments(Noised(g, 1.0, 0.1), Noised(s, 1.0, 0.1))
        updates, state = opt.update(noised, state, params=p)
        p = apply_updates(p, updates)
    ref = _adam_loop(steps, lr=0.05, b1=0.8, b2=0.9, eps=1e-6, wd=weight_decay, params=params)
    _close(p, ref, rtol=1e-12)


def test_private_moments_adam_refuses_single_and_unnoised_streams():
    opt = private_moments_adam()
    tree = {"a": torch.zeros(2)}
    state = opt.init(tree)
    for bad, match in [
        (Noised(tree, 1.0, 1.0), "single Noised"),
        (Clipped(tree, 1.0), "not noised"),
        (ClippedMoments(Clipped(tree, 1.0), Clipped(tree, 1.0)), "not noised"),
        (tree, "plain"),
    ]:
        with pytest.raises(InputTypeError, match=match):
            opt.update(bad, state)


def _paired_dp_sgd(**kwargs):
    """``dp_sgd`` with private second moments at multiplier ``Z`` and expected batch 4."""
    return dp_sgd(_loss, noise_multiplier=Z, expected_batch_size=4.0, second_moment=True, **kwargs)


# -- composed steps and the bias-correction refusal ------------------------------------------------------------------


def test_dp_sgd_with_second_moments_runs_and_replays():
    opt = private_moments_adam(1e-2)
    step_fn, dp_state = _paired_dp_sgd(clipping_norm=1.0, key=random.key(5), optimizer=opt, compute_dtype=torch.float64)
    params, (x, y) = _params(), _data(5)
    opt_state = opt.init(params)
    out1 = step_fn(params, opt_state, dp_state, (x, y))
    out2 = step_fn(params, opt_state, dp_state, (x, y))
    assert all(torch.equal(out1[0][k], out2[0][k]) for k in params)
    s1, _ = paired_noise_std(0.25, 0.25, noise_multiplier=Z)
    assert out1[3].noise_std == pytest.approx(s1)


def test_second_moments_and_bias_correction_are_refused_together():
    bc = optim.adam(1e-3, noise_bias_correction=True)
    with pytest.raises(ConfigurationError, match="bias correction"):
        _paired_dp_sgd(clipping_norm=1.0, key=random.key(0), optimizer=bc)
    with pytest.raises(ConfigurationError, match="private_moments_adam"):
        _paired_dp_sgd(clipping_norm=1.0, key=random.key(0), optimizer=optim.adam(1e-3))
    # a mechanism that releases moments (JME) meets a bias-corrected optimizer at the first step
    step_fn, dp_state = dp_step(
        _loss,
        clipping=1.0,
        noise=jme_noise(noise_multiplier=Z, key=random.key(0)),
        optimizer=bc,
        expected_batch_size=4.0,
    )
    params, (x, y) = _params(), _data(4)
    with pytest.raises(ConfigurationError, match="bias correction"):
        step_fn(params, bc.init(params), dp_state, (x, y))


def test_reduce_is_applied_to_each_stream():
    calls = []

    def reduce(clipped):
        calls.append(clipped.sensitivity)
        return Clipped(optree.tree_map(lambda v: v * 1.0, clipped.value), clipped.sensitivity)

    opt = private_moments_adam(1e-2)
    step_fn, dp_state = _paired_dp_sgd(clipping_norm=0.5, key=random.key(5), optimizer=opt, reduce=reduce)
    params, (x, y) = _params(), _data(4)
    step_fn(params, opt.init(params), dp_state, (x, y))
    assert calls == [0.125, 0.0625]
