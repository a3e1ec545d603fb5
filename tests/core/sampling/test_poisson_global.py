"""Poisson with ``sharding="global"`` (parallel Poisson sampling): every rank draws the whole dataset independently at
its own rate, and a record drawn by ``J`` ranks moves the summed clipped sums by ``J C``: a group of ``world_size``.

Statistical tests use exact binomial tests at a per-test false-alarm rate of 1e-6 (Bonferroni-split over the checks
inside a test), with fixed seeds, so a correct sampler fails them with probability <= 1e-6. The clipped-sum test
compares against a float64 loop over the examples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampler_draws import draw_ranks
from scipy import stats

from opake_core import accounting as acc
from opake_core import clipped_grad, mf, sampling
from opake_core.clipping import adaptive
from opake_core.errors import ConfigurationError, StateError
from opake_core.plan import plan
from opake_core.random import fold_in, key

ALPHA = 1e-6
KEY = key(2024)


def _ranks(n, q, world):
    return [
        sampling.poisson(dataset_size=n, sample_rate=q, world_size=world, rank=r, sharding="global")
        for r in range(world)
    ]


def test_each_rank_draws_the_whole_dataset_at_its_own_rate():
    """Per rank, each example's count over the steps is Binomial(steps, q_r) and the total Binomial(N steps, q_r):
    W (N + 1) checks at 1e-6 in all. A strided shard would leave each rank's count of the other residues at 0."""
    n, q, world, steps = 40, 0.2, 3, 400
    draws = draw_ranks(_ranks(n, q, world), steps, KEY)
    checks = world * (n + 1)
    for r in range(world):
        counts = np.bincount(np.concatenate([parts[r] for parts in draws]), minlength=n)
        assert stats.binomtest(int(counts.sum()), n * steps, q).pvalue > ALPHA / checks
        assert min(stats.binomtest(int(c), steps, q).pvalue for c in counts) > ALPHA / checks


def test_the_ranks_draw_independently():
    """For each pair of ranks the steps in which both draw a given example number Binomial(N steps, q_r^2), and all
    three draw it Binomial(N steps, q_r^3): the multiplicity J of an example is Binomial(W, q_r). 4 checks."""
    n, q, world, steps = 50, 0.3, 3, 400
    draws = draw_ranks(_ranks(n, q, world), steps, KEY)
    member = np.zeros((steps, world, n), dtype=bool)
    for s, parts in enumerate(draws):
        for r, idx in enumerate(parts):
            member[s, r, idx] = True
    for a, b in ((0, 1), (0, 2), (1, 2)):
        both = int((member[:, a] & member[:, b]).sum())
        assert stats.binomtest(both, n * steps, q * q).pvalue > ALPHA / 4
    assert stats.binomtest(int(member.all(axis=1).sum()), n * steps, q**3).pvalue > ALPHA / 4


def test_the_draws_are_poisson_over_all_indices_from_the_rank_key():
    n, q, world = 30, 0.4, 2
    for r, sampler in enumerate(_ranks(n, q, world)):
        plain = sampling.poisson(dataset_size=n, sample_rate=q)
        state, plain_state = sampler.init(), plain.init()
        for _ in range(4):
            idx, state = sampler.sample(KEY, state)
            expected, plain_state = plain.sample(fold_in(KEY, "rank", r), plain_state)
            np.testing.assert_array_equal(idx, expected)
        np.testing.assert_array_equal(sampler.shard(), np.arange(n))
        replayed, _ = _ranks(n, q, world)[1 - r].sample_rank(KEY, sampler.init(), r)
        np.testing.assert_array_equal(replayed, sampler.sample(KEY, sampler.init())[0])


def test_the_process_is_a_group_of_world_size_and_the_plan_uses_it():
    n, q, world = 1000, 0.01, 4
    ranks = _ranks(n, q, world)
    group = acc.repeat(acc.poisson_group(acc.gaussian(1.3), q, group_size=world), 9)
    for sampler in ranks:
        assert sampler.process(1.3, 9) == group
        assert sampler.expected_batch_size == pytest.approx(world * n * q)  # a record counted once per drawing rank
    resolved = plan(sampler=ranks[2], steps=50, delta=1e-5, noise_multiplier=1.3)
    assert resolved.release == acc.poisson_group(acc.gaussian(1.3), q, group_size=world)
    assert resolved.expected_batch_size == pytest.approx(40.0) and resolved.sample_rate == pytest.approx(0.04)
    # at the same expected union batch, the strided shards (Poisson at W q_r) cost less than the group
    spent = acc.epsilon(acc.repeat(resolved.release, 50), delta=1e-5).value
    sharded = plan(sampler=sampling.poisson(dataset_size=n, sample_rate=world * q, world_size=world), steps=50,
                   delta=1e-5, noise_multiplier=1.3)  # fmt: skip
    assert spent > acc.epsilon(acc.repeat(sharded.release, 50), delta=1e-5).value


def test_removing_a_record_moves_the_union_clipped_sum_by_j_times_c():
    """The privacy property the accountant rests on. The union batch (each rank's draw, a record once per rank that
    drew it) is clipped and summed; removing record i from every rank moves the sum by exactly J_i clip(g_i), of norm
    J_i min(C, |g_i|) <= J_i C: more than C for records drawn twice, which a one-record accountant would miss."""
    n, q, world, c = 12, 0.5, 3, 1.0
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, 4, generator=gen, dtype=torch.float64) * 3, torch.randn(n, generator=gen, dtype=torch.float64)
    w = torch.randn(4, generator=gen, dtype=torch.float64)

    def loss_fn(params, xi, yi):
        return (xi @ params - yi) ** 2

    grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=c, batch_argnums=(1, 2))

    def union_sum(idx):
        return grad_fn(w, x[idx], y[idx], state=clip_state)[0].value

    def reference(i):  # float64 loop: example i's clipped gradient
        g = 2 * (x[i] @ w - y[i]) * x[i]
        return g * min(1.0, c / g.norm().item())

    moved_over_c = 0
    for parts in draw_ranks(_ranks(n, q, world), 6, KEY):
        union = np.concatenate(parts)
        total = union_sum(union)
        for i in np.unique(union):
            j = int((union == i).sum())
            moved = total - union_sum(union[union != i])
            torch.testing.assert_close(moved, j * reference(i), rtol=1e-9, atol=1e-9)
            assert moved.norm().item() <= j * c * (1 + 1e-9)
            moved_over_c += moved.norm().item() > c * (1 + 1e-6)
    assert moved_over_c > 0  # some record drawn by several ranks moved the sum by more than one bound


def test_configuration_state_and_refusals():
    rank0, rank1 = _ranks(20, 0.1, 2)
    assert rank0.config == rank1.config and dict(rank0.config)["sharding"] == "global"
    per_rank = sampling.poisson(dataset_size=20, sample_rate=0.1, world_size=2)
    assert "sharding" not in dict(per_rank.config)  # per-rank checkpoints keep resuming
    with pytest.raises(StateError):
        rank0.sample(KEY, per_rank.init())  # a changed sharding is another sampler
    assert _ranks(2, 0.5, 3)[2].shard().tolist() == [0, 1]  # fewer records than ranks: every rank draws them all
    with pytest.raises(ConfigurationError, match="sharding must be one of"):
        sampling.poisson(dataset_size=20, sample_rate=0.1, world_size=2, sharding="all")
    with pytest.raises(ConfigurationError, match="world_size=1"):
        sampling.poisson(dataset_size=20, sample_rate=0.1, sharding="global")
    with pytest.raises(ConfigurationError, match="truncated"):
        sampling.poisson(dataset_size=20, sample_rate=0.1, truncated_batch_size=3, world_size=2, sharding="global")
    with pytest.raises(ConfigurationError, match=r"adaptive clipping.*sharding='global'"):
        plan(sampler=rank0, steps=5, delta=1e-5, noise_multiplier=1.0, clipping=adaptive(1.0, target_quantile=0.5))
    with pytest.raises(ConfigurationError, match=r"matrix-factorization.*sharding='global'"):
        plan(sampler=rank0, steps=5, delta=1e-5, noise_multiplier=1.0, strategy=mf.identity())
    with pytest.raises(ConfigurationError, match=r"matrix-factorization.*sharding='global'"):
        acc.mf_process(mf.identity(), sampler=rank0, noise_multiplier=1.0, n_steps=5, amplified=False)


def test_the_router_release_composes_with_the_group():
    group = acc.repeat(acc.poisson_group(acc.gaussian(1.0), 0.02, group_size=2), 3)
    expected = acc.repeat(acc.poisson_group(acc.gaussian(1 / 1.1), 0.02, group_size=2), 3)
    assert acc.moe_aux(group, ratio=0.21) == expected
