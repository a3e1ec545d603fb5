"""Samplers: inclusion frequencies, exact participation counts, replay and save/restore, accounting choice.

Statistical tests use exact binomial or chi-square tests at a per-test false-alarm rate of 1e-6
(Bonferroni-split over the checks inside a test), with fixed seeds, so a correct sampler fails them with
probability <= 1e-6.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sampler_draws import draw
from scipy import stats

from opake_core import accounting as acc
from opake_core import sampling
from opake_core.errors import ConfigurationError, StateError
from opake_core.random import key

ALPHA = 1e-6
KEY = key(1234)


def _draw(sampler, steps, state=None, k=KEY):
    return draw(sampler, steps, k, state)


def test_poisson_inclusion_frequency_is_q():
    n, q, steps = 200, 0.1, 300
    batches, state = _draw(sampling.poisson(dataset_size=n, sample_rate=q), steps)
    assert state.step == steps
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert stats.binomtest(int(counts.sum()), n * steps, q).pvalue > ALPHA / 2
    # Per example: Binomial(steps, q), Bonferroni over the n examples.
    pvalues = [stats.binomtest(int(c), steps, q).pvalue for c in counts]
    assert min(pvalues) > ALPHA / 2 / n


def test_poisson_emits_empty_batches():
    batches, state = _draw(sampling.poisson(dataset_size=5, sample_rate=0.02), 50)
    assert state.step == 50
    assert any(len(b) == 0 for b in batches)


def test_truncated_poisson_caps_batches_uniformly():
    n, q, cap, steps = 100, 0.3, 20, 400
    sampler = sampling.poisson(dataset_size=n, sample_rate=q, truncated_batch_size=cap)
    batches, _ = _draw(sampler, steps)
    sizes = np.array([len(b) for b in batches])
    assert sizes.max() == cap
    # The kept subset is uniform: each example's count is exchangeable; chi-square on counts, rate 1e-6.
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert stats.chisquare(counts).pvalue > ALPHA
    process = sampler.process(1.0, 10)
    assert isinstance(process.process, acc.TruncatedPoisson)


def test_poisson_replays_and_restores():
    sampler = sampling.poisson(dataset_size=50, sample_rate=0.2)
    full, _ = _draw(sampler, 12)
    first, state = _draw(sampler, 5)
    saved = json.loads(json.dumps(state.to_json()))
    rest, _ = _draw(sampling.poisson(dataset_size=50, sample_rate=0.2), 7, state=sampling.SamplerState.from_json(saved))
    for a, b in zip(full, first + rest, strict=True):
        np.testing.assert_array_equal(a, b)
    other, _ = _draw(sampler, 12, k=key(99))
    assert any(not np.array_equal(a, b) for a, b in zip(full, other, strict=True))


@pytest.mark.parametrize(
    "other",
    [
        sampling.poisson(dataset_size=51, sample_rate=0.2),
        sampling.poisson(dataset_size=50, sample_rate=0.3),
        sampling.poisson(dataset_size=50, sample_rate=0.2, truncated_batch_size=5),
        sampling.k_out_of_t(dataset_size=50, k=1, t=5, allocation="block"),
    ],
)
def test_restore_refuses_another_configuration(other):
    state = sampling.poisson(dataset_size=50, sample_rate=0.2).init()
    with pytest.raises(StateError, match="differ"):
        other.sample(KEY, state)
    with pytest.raises(StateError):
        other.sample(KEY, state.to_json())


def test_k_out_of_t_block_places_every_example_exactly_k_times():
    n, k, t = 300, 3, 12
    sampler = sampling.k_out_of_t(dataset_size=n, k=k, t=t, allocation="block")
    batches, state = _draw(sampler, t)
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert np.all(counts == k)
    size = t // k
    for block in range(k):
        members = np.concatenate(batches[block * size : (block + 1) * size])
        assert np.array_equal(np.sort(members), np.arange(n))
    # Within a block the step is uniform: chi-square on each block's batch sizes (Bonferroni over blocks).
    for block in range(k):
        sizes = [len(b) for b in batches[block * size : (block + 1) * size]]
        assert stats.chisquare(sizes).pvalue > ALPHA / k
    with pytest.raises(StateError, match="horizon"):
        sampler.sample(KEY, state)


def test_k_out_of_t_total_is_a_uniform_k_subset():
    n, k, t = 400, 3, 10
    sampler = sampling.k_out_of_t(dataset_size=n, k=k, t=t, allocation="total")
    batches, _ = _draw(sampler, t)
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert np.all(counts == k)
    # Each step holds an example with probability k/t, independently across examples (Bonferroni over steps).
    for batch in batches:
        assert stats.binomtest(len(batch), n, k / t).pvalue > ALPHA / t
    # Pairs of steps: P(both) = k(k-1) / (t(t-1)); test one pair.
    both = len(np.intersect1d(batches[0], batches[1]))
    assert stats.binomtest(both, n, k * (k - 1) / (t * (t - 1))).pvalue > ALPHA


def test_k_out_of_t_restores_and_declares_its_accounting():
    sampler = sampling.k_out_of_t(dataset_size=40, k=2, t=6, allocation="total")
    full, _ = _draw(sampler, 6)
    first, state = _draw(sampler, 2)
    rest, _ = _draw(sampler, 4, state=sampling.SamplerState.from_json(state.to_json()))
    for a, b in zip(full, first + rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sampler.process(1.0) == acc.k_out_of_t(acc.gaussian(1.0), k=2, t=6, allocation="total")
    with pytest.raises(ConfigurationError, match="steps must equal t=6"):
        sampler.process(1.0, 10)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"k": 0, "t": 5, "allocation": "block"}, "k must be an int >= 1"),
        ({"k": 6, "t": 5, "allocation": "total"}, "k must be <= t"),
        ({"k": 2, "t": 5, "allocation": "block"}, "divisible"),
        ({"k": 1, "t": 5, "allocation": "random"}, "random"),
    ],
)
def test_k_out_of_t_bad_configuration(kwargs, needle):
    with pytest.raises(ConfigurationError, match=needle):
        sampling.k_out_of_t(dataset_size=10, **kwargs)


@pytest.mark.parametrize("q", [0.0, -0.1, 1.01, float("nan")])
def test_poisson_bad_rate(q):
    with pytest.raises(ConfigurationError, match="sample_rate"):
        sampling.poisson(dataset_size=10, sample_rate=q)


def test_sequential_covers_each_epoch_and_is_unamplified():
    sampler = sampling.sequential(dataset_size=10, batch_size=3)
    batches, _ = _draw(sampler, 6)
    first_epoch = np.concatenate(batches[:3])
    assert len(np.unique(first_epoch)) == 9
    assert not np.array_equal(np.concatenate(batches[3:]), first_epoch)
    plain, _ = _draw(sampling.sequential(dataset_size=10, batch_size=3, shuffle=False), 3)
    np.testing.assert_array_equal(np.concatenate(plain), np.arange(9))
    with pytest.raises(ConfigurationError, match="no amplification"):
        sampler.process(1.0, 6)
    assert sampler.process(1.0, 6, unamplified=True) == acc.repeat(acc.gaussian(1.0), 2)
    assert acc.epsilon(sampler.process(0.0, 6), delta=1e-5).value == float("inf")


def test_poisson_declares_its_accounting():
    sampler = sampling.poisson(dataset_size=1000, sample_rate=0.01)
    assert sampler.process(1.0, 5) == acc.repeat(acc.poisson(acc.gaussian(1.0), 0.01), 5)
    assert sampler.expected_batch_size == 10.0
