"""opake_core.testing catches planted bugs and passes the correct mechanisms."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import grad, vmap

from opake_core import random, sampling
from opake_core import testing as t
from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError
from opake_core.noise import GaussianNoiseState, add_gaussian_noise, gaussian_noise
from opake_core.tree import Clipped, Noised

C, N_EXPECTED = 1.0, 8.0


def _params():
    gen = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(4, 6, generator=gen, dtype=torch.float64),
        "w2": torch.randn(6, generator=gen, dtype=torch.float64),
    }


def _loss(p, x, y):
    return (torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2


def _batch(n=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen, dtype=torch.float64), 5 * torch.randn(n, generator=gen, dtype=torch.float64)


KEY = random.key(7)


def _correct_release():
    grad_fn, state = clipped_grad(_loss, clipping_norm=C, normalize_by=N_EXPECTED, batch_argnums=(1, 2))
    params = _params()
    return lambda batch: grad_fn(params, *batch, state=state)[0]


def _realized_normalizer_release():
    grad_fn, state = clipped_grad(_loss, clipping_norm=C, normalize_by=1.0, batch_argnums=(1, 2))
    params = _params()

    def release(batch):
        b = max(batch[0].shape[0], 1)
        summed = grad_fn(params, *batch, state=state)[0].value
        return Clipped({k: v / b for k, v in summed.items()}, C / N_EXPECTED)

    return release


def _clip_after_sum_release():
    params = _params()
    per_example = vmap(grad(_loss), in_dims=(None, 0, 0))

    def release(batch):
        if batch[0].shape[0] == 0:
            return Clipped({k: torch.zeros_like(v) for k, v in params.items()}, C / N_EXPECTED)
        g = {k: v.sum(0) for k, v in per_example(params, *batch).items()}
        norm = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
        scale = min(1.0, C / norm) if norm > 0 else 1.0
        return Clipped({k: v * scale / N_EXPECTED for k, v in g.items()}, C / N_EXPECTED)

    return release


def test_neighbour_constructors():
    x, y = _batch(3)
    assert t.remove_one((x, y), 1)[0].shape == (2, 4)
    added = t.add_one((x, y), t.example_at((x, y), 0))
    assert torch.equal(added[0][-1], x[0])
    replaced = t.replace_one((x, y), 2, (torch.zeros(4, dtype=x.dtype), torch.tensor(1.0, dtype=y.dtype)))
    assert torch.equal(replaced[0][2], torch.zeros(4, dtype=x.dtype)) and replaced[1][2] == 1.0
    variants = t.extreme_examples((x[0], y[0]))
    assert len(variants) == len(t.EXTREME_SCALES)
    assert all(torch.isfinite(v[0]).all() for v in variants)
    with pytest.raises(ConfigurationError, match="index"):
        t.remove_one((x, y), 5)


def test_correct_clipping_passes():
    report = t.assert_sensitivity(_correct_release(), _batch(), key=KEY)
    assert report.max_ratio <= 1 + report.rtol and report.trials > 32 and report.sensitivity == C / N_EXPECTED


def test_correct_clipping_passes_on_empty_batch_with_pool():
    x, y = _batch(2)
    empty = (x[:0], y[:0])
    report = t.assert_sensitivity(_correct_release(), empty, key=KEY, pool=[t.example_at((x, y), 0)])
    assert report.passed


def test_planted_realized_batch_normalizer_is_flagged():
    report = t.check_sensitivity(_realized_normalizer_release(), _batch(), key=KEY)
    assert not report.passed and report.max_ratio > 1.05
    with pytest.raises(AssertionError, match="sensitivity violated"):
        t.assert_sensitivity(_realized_normalizer_release(), _batch(), key=KEY)


def test_planted_clip_after_sum_is_flagged():
    report = t.check_sensitivity(_clip_after_sum_release(), _batch(), key=KEY)
    assert not report.passed and report.max_ratio > 1.05, report


def test_sensitivity_needs_a_declared_bound():
    with pytest.raises(ConfigurationError, match="sensitivity="):
        t.check_sensitivity(lambda b: {"v": b[0].sum(0)}, _batch(), key=KEY)


# -- noise --------------------------------------------------------------------------------------------------------

Z, SIZE = 1.3, 30_000


def _short_noise(noise_multiplier, key):
    """Planted: draws 3% too little noise but reports the full standard deviation."""

    def noise_fn(clipped, state):
        out = add_gaussian_noise(clipped, noise_multiplier=0.97 * noise_multiplier, key=state.key, step=state.step)
        return Noised(out.value, clipped.sensitivity, noise_multiplier * clipped.sensitivity), GaussianNoiseState(
            state.key, state.step + 1
        )

    return noise_fn, GaussianNoiseState(key, 0)


def _reused_key_noise(noise_multiplier, key):
    """Planted: every step and every leaf draws from the same key."""

    def noise_fn(clipped, state):
        std = noise_multiplier * clipped.sensitivity
        value = {
            k: v + std * random.normal(state.key, v.shape, dtype=v.dtype, device=v.device)
            for k, v in clipped.value.items()
        }
        return Noised(value, clipped.sensitivity, std), GaussianNoiseState(state.key, state.step + 1)

    return noise_fn, GaussianNoiseState(key, 0)


def test_min_noise_samples_has_power_for_three_percent():
    n = t.min_noise_samples()
    assert 20_000 < n < 25_000
    assert t.min_noise_samples(scale_error=0.1) < n


def test_correct_noise_passes():
    draws, outs, _ = t.noise_draws(*gaussian_noise(noise_multiplier=Z, key=KEY), size=SIZE, steps=2)
    report = t.assert_noise(draws, std=outs[0].noise_std)
    assert report.passed and abs(report.std_ratio - 1) < 0.01
    assert outs[0].noise_std == pytest.approx(Z)


def test_planted_small_noise_is_flagged():
    draws, outs, _ = t.noise_draws(*_short_noise(Z, KEY), size=SIZE, steps=2)
    report = t.check_noise(draws, std=Z)
    assert not report.passed and report.std_ratio == pytest.approx(0.97, abs=0.01) and report.rms_p_value < 1e-6
    with pytest.raises(AssertionError, match=r"ratio 0\.97"):
        t.assert_noise(draws, std=outs[0].noise_std)


def test_noise_check_refuses_too_few_samples():
    with pytest.raises(ConfigurationError, match="at least"):
        t.check_noise(torch.randn(1000, generator=torch.Generator().manual_seed(0)), std=1.0)


def test_correct_noise_is_fresh_across_steps_and_leaves():
    draws, _, _ = t.noise_draws(*gaussian_noise(noise_multiplier=Z, key=KEY), size=2000, steps=3, leaves=2)
    assert t.assert_fresh_noise(draws).passed


def test_planted_key_reuse_is_flagged():
    draws, _, _ = t.noise_draws(*_reused_key_noise(Z, KEY), size=2000, steps=3, leaves=2)
    report = t.check_fresh_noise(draws)
    assert not report.passed and report.max_abs_correlation > 0.999
    with pytest.raises(AssertionError, match="reused"):
        t.assert_fresh_noise(draws)


# -- replay -------------------------------------------------------------------------------------------------------


def test_replay_of_the_core_mechanisms_is_exact():
    noise_fn, state = gaussian_noise(noise_multiplier=Z, key=KEY)
    clipped = _correct_release()(_batch())
    assert t.assert_replay(noise_fn, clipped, state).passed
    sampler = sampling.poisson(dataset_size=100, sample_rate=0.1)
    assert t.assert_replay(sampler.sample, KEY, sampler.init()).passed


def test_replay_flags_global_rng_and_mutation():
    report = t.check_replay(lambda x: x + torch.randn(x.shape), torch.zeros(4))
    assert not report.passed and report.mismatches

    def mutating(x):
        x.add_(1.0)
        return x * 0

    report = t.check_replay(mutating, torch.zeros(3))
    assert not report.passed and report.mutated
    with pytest.raises(AssertionError, match="inputs modified"):
        t.assert_replay(mutating, torch.zeros(3))


# -- sampler against accountant -----------------------------------------------------------------------------------


class _OffRateSampler:
    """Planted: samples at 1.1 q, accounted (and normalized) at q."""

    def __init__(self, dataset_size, sample_rate):
        self._accounted = sampling.poisson(dataset_size=dataset_size, sample_rate=sample_rate)
        self._actual = sampling.poisson(dataset_size=dataset_size, sample_rate=1.1 * sample_rate)
        self.dataset_size = dataset_size
        self.expected_batch_size = self._accounted.expected_batch_size

    def init(self):
        return self._actual.init()

    def sample(self, key, state):
        return self._actual.sample(key, state)

    def process(self, noise_multiplier, steps):
        return self._accounted.process(noise_multiplier, steps)


def test_poisson_rate_agrees_with_its_accountant():
    report = t.assert_sampling_rate(sampling.poisson(dataset_size=1000, sample_rate=0.05), key=KEY, steps=200)
    assert report.source == "accounting process" and report.accounted_rate == 0.05


def test_truncated_poisson_rate_is_the_truncated_one():
    sampler = sampling.poisson(dataset_size=500, sample_rate=0.05, truncated_batch_size=25)
    rate, source = t.accounted_rate(sampler, 10)
    assert rate < 0.05 and source == "accounting process"
    assert t.assert_sampling_rate(sampler, key=KEY, steps=300).passed


def test_k_out_of_t_rate_agrees():
    sampler = sampling.k_out_of_t(dataset_size=400, k=2, t=10, allocation="block")
    assert t.accounted_rate(sampler, 10)[0] == pytest.approx(0.2)
    assert t.assert_sampling_rate(sampler, key=KEY, steps=10).passed


@pytest.mark.parametrize(
    "sampler",
    [
        sampling.poisson(dataset_size=1000, sample_rate=0.05, world_size=4, rank=2),
        sampling.cyclic_poisson(dataset_size=1200, sample_rate=0.05, bands=2, world_size=3, rank=1),
    ],
    ids=["poisson", "cyclic_poisson"],
)
def test_a_sharded_sampler_is_tested_on_the_union_of_its_ranks(sampler):
    """One rank alone includes about q / world_size of the dataset per step; the union of the ranks is the global
    rate the accountant analyses (binomial test at alpha = 1e-3, its false-alarm rate)."""
    report = t.assert_sampling_rate(sampler, key=KEY, steps=200)
    assert report.accounted_rate == pytest.approx(0.05) and report.empirical_rate == pytest.approx(0.05, rel=0.1)


def test_planted_ten_percent_rate_error_is_flagged():
    report = t.check_sampling_rate(_OffRateSampler(1000, 0.05), key=KEY, steps=200)
    assert not report.passed and report.empirical_rate == pytest.approx(0.055, rel=0.03)
    with pytest.raises(AssertionError, match="accountant assumes"):
        t.assert_sampling_rate(_OffRateSampler(1000, 0.05), key=KEY, steps=200)
