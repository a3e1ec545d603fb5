"""DP-FTRL samplers: cyclic Poisson, b-min-sep, balls-in-bins (group structure, rates, replay, resume, refusals).

Statistical checks use exact binomial tests at a per-test false-alarm rate of 1e-6 (Bonferroni over the checks in
a test) with fixed seeds, so a correct sampler fails one with probability <= 1e-6.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from sampler_draws import draw
from scipy import stats

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_core.errors import ConfigurationError, StateError
from opake_core.random import key
from opake_core.sampling import SamplerState

ALPHA = 1e-6
KEY = key(77)


def _draw(sampler, steps, state=None, k=KEY):
    return draw(sampler, steps, k, state)


# --- cyclic Poisson ---------------------------------------------------------------------------------------------


def test_cyclic_poisson_groups_are_disjoint_floor_sized_and_skip_the_remainder():
    sampler = sampling.cyclic_poisson(dataset_size=103, sample_rate=0.2, bands=4)
    assert sampler.group_size == 25  # floor(103 / 4)
    groups = [sampler.group(KEY, g) for g in range(4)]
    union = np.concatenate(groups)
    assert all(len(g) == 25 for g in groups) and len(np.unique(union)) == 100
    batches, _ = _draw(sampler, 40)
    for t, batch in enumerate(batches):
        assert set(batch) <= set(groups[t % 4])
    assert not set(np.concatenate(batches)) - set(union)  # the 3 remainder examples never participate
    assert sampler.conditional_rate == pytest.approx(0.2 * 103 / 25)
    assert sampler.expected_batch_size == pytest.approx(0.2 * 103)


def test_cyclic_poisson_per_rank_groups_use_floor_of_the_shard():
    n, world, bands = 1003, 3, 5
    ranks = [
        sampling.cyclic_poisson(dataset_size=n, sample_rate=0.1, bands=bands, world_size=world, rank=r)
        for r in range(3)
    ]
    assert all(s.group_size == (n // world) // bands == 66 for s in ranks)
    for g in range(bands):
        members = [s.group(KEY, g) for s in ranks]
        assert len(np.unique(np.concatenate(members))) == world * 66  # disjoint across ranks
        for r, m in enumerate(members):
            assert np.all((m >= r * (n // world)) & (m < (r + 1) * (n // world)))
    q = ranks[0].conditional_rate
    assert q == pytest.approx(0.1 * n / (world * 66))


def test_cyclic_poisson_inclusion_rate_is_the_conditional_rate():
    sampler = sampling.cyclic_poisson(dataset_size=400, sample_rate=0.05, bands=4)
    batches, _ = _draw(sampler, 200)
    total = sum(len(b) for b in batches)
    assert stats.binomtest(total, 200 * sampler.group_size, sampler.conditional_rate).pvalue > ALPHA


def test_cyclic_poisson_refuses_a_conditional_rate_above_one():
    with pytest.raises(ConfigurationError, match="conditional rate"):
        sampling.cyclic_poisson(dataset_size=100, sample_rate=0.3, bands=4)
    with pytest.raises(ConfigurationError, match="at least one example per group"):
        sampling.cyclic_poisson(dataset_size=10, sample_rate=0.01, bands=4, world_size=4)
    with pytest.raises(ConfigurationError, match="rank"):
        sampling.cyclic_poisson(dataset_size=100, sample_rate=0.01, bands=4, world_size=2, rank=2)
    # An exact rate of 1 (everything divides) is accepted.
    assert sampling.cyclic_poisson(dataset_size=100, sample_rate=0.25, bands=4).conditional_rate == 1.0


# --- b-min-sep ----------------------------------------------------------------------------------------------------


def test_b_min_sep_separation_and_rate():
    n, r, b, steps = 300, 0.1, 4, 240
    sampler = sampling.b_min_sep(dataset_size=n, sample_rate=r, min_sep=b)
    assert sampler.sampling_prob == pytest.approx(r / (1 - (b - 1) * r))
    batches, _ = _draw(sampler, steps)
    last = np.full(n, -(10**9))
    for t, batch in enumerate(batches):
        assert np.all(t - last[batch] >= b)
        last[batch] = t
    # Warm start: the participation rate is r from step 0 on. Per-step counts are dependent, so test the first
    # step alone (each example eligible-and-chosen independently with probability r) at 1e-6.
    assert stats.binomtest(len(batches[0]), n, r).pvalue > ALPHA
    assert abs(sum(map(len, batches)) / (n * steps) - r) < 0.01


def test_b_min_sep_with_min_sep_one_is_poisson_at_the_rate():
    sampler = sampling.b_min_sep(dataset_size=200, sample_rate=0.1, min_sep=1)
    batches, _ = _draw(sampler, 100)
    assert stats.binomtest(sum(map(len, batches)), 200 * 100, 0.1).pvalue > ALPHA


def test_b_min_sep_resume_from_json_continues_the_identical_sequence():
    make = lambda: sampling.b_min_sep(dataset_size=150, sample_rate=0.1, min_sep=3)  # noqa: E731
    full, _ = _draw(make(), 30)
    first, state = _draw(make(), 12)
    restored = SamplerState.from_json(json.loads(json.dumps(state.to_json())))
    assert restored == state and restored.carry is not None  # the cooldowns travel in the state
    rest, _ = _draw(make(), 18, state=restored)
    assert all(np.array_equal(a, b) for a, b in zip(full, first + rest, strict=True))
    replayed, _ = _draw(make(), 18, state=SamplerState(12, state.config))  # no carry: replayed from step 0
    assert all(np.array_equal(a, b) for a, b in zip(rest, replayed, strict=True))


def test_b_min_sep_refuses_a_rate_above_one_over_min_sep():
    with pytest.raises(ConfigurationError, match="1 / min_sep"):
        sampling.b_min_sep(dataset_size=100, sample_rate=0.3, min_sep=4)


# --- balls-in-bins --------------------------------------------------------------------------------------------------


def test_balls_in_bins_fixed_bins_every_example_every_num_bins_steps():
    n, bins = 120, 6
    sampler = sampling.balls_in_bins(dataset_size=n, num_bins=bins)
    batches, _ = _draw(sampler, 3 * bins)
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert np.all(counts == 3)  # exactly n_steps / num_bins participations
    for t in range(bins, 3 * bins):
        assert np.array_equal(batches[t], batches[t - bins])  # bins fixed across epochs
    assert sampler.expected_batch_size == n / bins and sampler.sample_rate == 1 / bins


def test_balls_in_bins_refusals_and_foreign_state():
    with pytest.raises(ConfigurationError):
        sampling.balls_in_bins(dataset_size=10, num_bins=1)
    a = sampling.balls_in_bins(dataset_size=10, num_bins=2)
    b = sampling.balls_in_bins(dataset_size=11, num_bins=2)
    with pytest.raises(StateError):
        b.sample(KEY, a.init())


@pytest.mark.parametrize(
    "sampler",
    [
        sampling.cyclic_poisson(dataset_size=90, sample_rate=0.1, bands=3, world_size=2, rank=1),
        sampling.b_min_sep(dataset_size=90, sample_rate=0.1, min_sep=3),
        sampling.balls_in_bins(dataset_size=90, num_bins=3),
    ],
    ids=["cyclic_poisson", "b_min_sep", "balls_in_bins"],
)
def test_replay_resume_and_stream_tag(sampler):
    full, _ = _draw(sampler, 9)
    again, _ = _draw(sampler, 9)
    assert all(np.array_equal(a, b) for a, b in zip(full, again, strict=True))
    _, mid = _draw(sampler, 4)
    rest, _ = _draw(sampler, 5, state=SamplerState.from_json(mid.to_json()))
    assert all(np.array_equal(a, b) for a, b in zip(full[4:], rest, strict=True))
    other, _ = _draw(sampler, 9, k=key(78))
    assert any(not np.array_equal(a, b) for a, b in zip(full, other, strict=True))
    name = dict(sampler.config)["sampler"]
    assert type(sampler).__module__.endswith(name)
    assert sys.modules[type(sampler).__module__].TAG == f"opake.sampling.{name}"


def test_sampler_process_delegates_to_mf_process():
    strategy = mf.optimize(mf.band_mf(3), 12)
    sampler = sampling.cyclic_poisson(dataset_size=90, sample_rate=0.1, bands=3)
    expected = acc.mf_process(strategy, sampler=sampler, noise_multiplier=1.1, n_steps=12)
    assert sampler.process(1.1, 12, strategy=strategy) == expected
