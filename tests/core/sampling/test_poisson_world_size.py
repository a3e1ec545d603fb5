"""Poisson with ``world_size`` > 1: per-rank strided shards whose union is Poisson(q) over the whole dataset.

Statistical tests use exact binomial tests at a per-test false-alarm rate of 1e-6 (Bonferroni-split over the checks
inside a test), with fixed seeds, so a correct sampler fails them with probability <= 1e-6.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from sampler_draws import draw_ranks
from scipy import stats

from opake_core import accounting as acc
from opake_core import sampling
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.plan import plan
from opake_core.random import fold_in, key

ALPHA = 1e-6
KEY = key(1234)


def _ranks(n, q, world):
    return [sampling.poisson(dataset_size=n, sample_rate=q, world_size=world, rank=r) for r in range(world)]


@pytest.mark.parametrize(("n", "world"), [(10, 2), (11, 3), (7, 7)])
def test_shards_are_strided_disjoint_and_cover_the_dataset(n, world):
    samplers = _ranks(n, 0.5, world)
    shards = [s.shard() for s in samplers]
    for r, shard in enumerate(shards):
        np.testing.assert_array_equal(shard, np.arange(r, n, world))
        assert shard.dtype == np.int64
        np.testing.assert_array_equal(samplers[0].shard(r), shard)  # any rank's shard from any rank
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))


def test_each_rank_draws_only_from_its_shard():
    samplers = _ranks(30, 0.5, 3)
    for parts in draw_ranks(samplers, 20, KEY):
        for r, idx in enumerate(parts):
            assert np.all(idx % 3 == r)


def test_the_union_over_ranks_is_poisson_at_the_global_rate():
    """Each example's count over the steps is Binomial(steps, q), the union's total Binomial(N * steps, q), and an
    example of rank 0 and one of rank 1 at the same local position are in a step together at rate q**2
    (independent streams): 1 + N + 1 checks at 1e-6 in all."""
    n, q, world, steps = 90, 0.3, 3, 600
    draws = draw_ranks(_ranks(n, q, world), steps, KEY)
    union = [np.concatenate(parts) for parts in draws]
    counts = np.bincount(np.concatenate(union), minlength=n)
    checks = n + 2
    assert stats.binomtest(int(counts.sum()), n * steps, q).pvalue > ALPHA / checks
    assert min(stats.binomtest(int(c), steps, q).pvalue for c in counts) > ALPHA / checks
    both = sum(1 for parts in draws if 0 in parts[0] and 1 in parts[1])  # local index 0 of ranks 0 and 1
    assert stats.binomtest(both, steps, q * q).pvalue > ALPHA / checks


def test_the_draws_are_the_shards_poisson_from_the_rank_key():
    """Rank r's stream is ``fold_in(key, "rank", r)`` then the plain Poisson stream over its shard; the values are
    pinned, so the draws stay bit-identical to the ones opake_torch.distributed made before the option moved here."""
    n, q, world = 1001, 0.03, 3
    for r, sampler in enumerate(_ranks(n, q, world)):
        local = sampling.poisson(dataset_size=len(sampler.shard()), sample_rate=q)
        state, local_state = sampler.init(), local.init()
        for _ in range(5):
            idx, state = sampler.sample(KEY, state)
            picked, local_state = local.sample(fold_in(KEY, "rank", r), local_state)
            np.testing.assert_array_equal(idx, sampler.shard()[picked])
    pinned = {0: [[0, 6], [], [0, 2]], 1: [[3, 5], [3, 5, 7, 9], [1, 3]]}
    for r, sampler in enumerate(_ranks(10, 0.5, 2)):
        state, got = sampler.init(), []
        for _ in range(3):
            idx, state = sampler.sample(key(0), state)
            got.append(idx.tolist())
        assert got == pinned[r]
    rank2 = sampling.poisson(dataset_size=1001, sample_rate=0.03, world_size=3, rank=2)
    assert rank2.sample(key(7), rank2.init())[0].tolist() == [53, 392, 566, 776]


def test_sample_rank_replays_any_rank():
    rank0, rank1 = _ranks(40, 0.4, 2)
    state = rank0.init()
    for _ in range(4):
        mine, _ = rank1.sample(KEY, state)
        replayed, _ = rank0.sample_rank(KEY, state, 1)
        np.testing.assert_array_equal(mine, replayed)
        _, state = rank0.sample(KEY, state)
    with pytest.raises(ConfigurationError, match=r"rank must be in \[0, world_size=2\)"):
        rank0.sample_rank(KEY, state, 2)
    with pytest.raises(ConfigurationError, match=r"world_size=2"):
        rank0.shard(5)


def test_world_size_one_is_the_plain_sampler():
    plain = sampling.poisson(dataset_size=50, sample_rate=0.2)
    explicit = sampling.poisson(dataset_size=50, sample_rate=0.2, world_size=1, rank=0)
    assert plain == explicit and "world_size" not in dict(plain.config)  # old checkpoints keep resuming
    state = plain.init()
    for _ in range(5):
        a, _ = plain.sample(KEY, state)
        b, state = plain.sample_rank(KEY, state, 0)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.shard(), np.arange(50))


def test_global_batch_accounting_and_plan():
    n, q = 1000, 0.05
    ranks = _ranks(n, q, 4)
    single = sampling.poisson(dataset_size=n, sample_rate=q)
    for sampler in ranks:
        assert sampler.dataset_size == n and sampler.sample_rate == q and sampler.expected_batch_size == 50.0
        assert sampler.process(1.0, 7) == single.process(1.0, 7) == acc.repeat(acc.poisson(acc.gaussian(1.0), q), 7)
    resolved = plan(sampler=ranks[3], steps=100, delta=1e-5, noise_multiplier=1.0)
    reference = plan(sampler=single, steps=100, delta=1e-5, noise_multiplier=1.0)
    assert resolved.release == reference.release and resolved.expected_batch_size == 50.0
    assert resolved.sample_rate == q and not resolved.horizon


def test_every_rank_resumes_from_rank_zeros_state():
    """The configuration holds world_size, not rank: a state saved by rank 0 continues every rank's sequence."""
    rank0, rank1 = _ranks(60, 0.25, 2)
    assert rank0.config == rank1.config and dict(rank0.config)["world_size"] == 2 and "rank" not in dict(rank0.config)
    full = [parts[0] for parts in draw_ranks([rank1], 10, KEY)]
    state = rank0.init()
    for _ in range(4):
        _, state = rank0.sample(KEY, state)
    state = sampling.SamplerState.from_json(json.loads(json.dumps(state.to_json())))
    for expected in full[4:]:
        idx, state = rank1.sample(KEY, state)
        np.testing.assert_array_equal(idx, expected)
    assert state.step == 10


@pytest.mark.parametrize(
    "other",
    [
        sampling.poisson(dataset_size=60, sample_rate=0.25),
        sampling.poisson(dataset_size=60, sample_rate=0.25, world_size=3, rank=0),
        sampling.poisson(dataset_size=61, sample_rate=0.25, world_size=2, rank=0),
    ],
)
def test_a_state_of_another_world_size_or_dataset_is_refused(other):
    state = sampling.poisson(dataset_size=60, sample_rate=0.25, world_size=2, rank=1).init()
    with pytest.raises(StateError, match="differ"):
        other.sample(KEY, state)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"truncated_batch_size": 4}, ConfigurationError, r"truncated Poisson.*=2 > 1.*Drop truncated_batch_size"),
        ({"dataset_size": 1}, ConfigurationError, r"dataset_size=1 is smaller than world_size=2"),
        ({"rank": 2}, ConfigurationError, r"rank must be in \[0, world_size=2\), got rank=2"),
        ({"rank": -1}, ConfigurationError, r"rank must be an int >= 0"),
        ({"world_size": 0, "rank": 0}, ConfigurationError, r"world_size must be an int >= 1"),
        ({"world_size": 2.0}, InputTypeError, r"world_size must be an int"),
        ({"rank": True}, InputTypeError, r"rank must be an int"),
    ],
)  # fmt: skip
def test_refusals(kwargs, error, needle):
    base = {"dataset_size": 10, "sample_rate": 0.1, "world_size": 2, "rank": 1}
    with pytest.raises(error, match=needle):
        sampling.poisson(**{**base, **kwargs})
