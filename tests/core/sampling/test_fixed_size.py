"""The fixed-size sampler (sampling without replacement) and its accounting: exact sizes, uniform subsets, replay,
and the epsilon against dp-accounting's RDP accountant under replace-one adjacency, queried directly.

Statistical tests run at a false-alarm rate of 1e-6 with fixed keys."""

from __future__ import annotations

import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from sampler_draws import draw
from scipy import stats

from opake_core import accounting as acc
from opake_core import plan, sampling
from opake_core.clipping import adaptive
from opake_core.errors import ConfigurationError, StateError
from opake_core.random import key
from opake_core.testing import accounted_rate

ALPHA = 1e-6
KEY = key(77)


def _draw(sampler, steps, state=None, k=KEY):
    return draw(sampler, steps, k, state)


def test_every_batch_has_exactly_batch_size_distinct_examples():
    batches, state = _draw(sampling.fixed_size(dataset_size=50, batch_size=7), 200)
    assert state.step == 200
    assert {len(b) for b in batches} == {7}
    assert all(b.min() >= 0 and b.max() < 50 for b in batches)
    full, _ = _draw(sampling.fixed_size(dataset_size=3, batch_size=3), 2)
    assert all(b.tolist() == [0, 1, 2] for b in full)


def test_each_subset_of_the_batch_size_is_equally_likely():
    """N = 6, B = 2: 15 subsets, 6,000 draws; chi-square against the uniform distribution over subsets."""
    batches, _ = _draw(sampling.fixed_size(dataset_size=6, batch_size=2), 6000)
    subsets = {pair: i for i, pair in enumerate(itertools.combinations(range(6), 2))}
    counts = np.bincount([subsets[tuple(b.tolist())] for b in batches], minlength=len(subsets))
    assert stats.chisquare(counts).pvalue > ALPHA


def test_replays_and_restores_and_refuses_another_configuration():
    sampler = sampling.fixed_size(dataset_size=40, batch_size=5)
    full, _ = _draw(sampler, 10)
    first, state = _draw(sampler, 4)
    restored = sampling.SamplerState.from_json(json.loads(json.dumps(state.to_json())))
    rest, _ = _draw(sampler, 6, state=restored)
    for a, b in zip(full, first + rest, strict=True):
        np.testing.assert_array_equal(a, b)
    other, _ = _draw(sampler, 10, k=key(78))
    assert any(not np.array_equal(a, b) for a, b in zip(full, other, strict=True))
    with pytest.raises(StateError, match="differ"):
        sampling.fixed_size(dataset_size=40, batch_size=6).sample(KEY, state)
    with pytest.raises(StateError, match="differ"):
        sampling.poisson(dataset_size=40, sample_rate=0.125).sample(KEY, state)


def test_data_parallel_ranks_split_one_global_draw():
    whole, _ = _draw(sampling.fixed_size(dataset_size=30, batch_size=7), 20)
    ranks = [_draw(sampling.fixed_size(dataset_size=30, batch_size=7, world_size=3, rank=r), 20)[0] for r in range(3)]
    for step, batch in enumerate(whole):
        parts = [ranks[r][step] for r in range(3)]
        assert [len(p) for p in parts] == [3, 2, 2]
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), batch)
    state = sampling.fixed_size(dataset_size=30, batch_size=7, world_size=3, rank=1).init()
    assert dict(state.config)["world_size"] == 3
    with pytest.raises(StateError, match="differ"):
        sampling.fixed_size(dataset_size=30, batch_size=7).sample(KEY, state)
    with pytest.raises(ConfigurationError, match="rank must be in"):
        sampling.fixed_size(dataset_size=30, batch_size=7, world_size=2, rank=2)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dataset_size": 5, "batch_size": 6}, "batch_size must be <= dataset_size"),
        ({"dataset_size": 5, "batch_size": 0}, "batch_size"),
        ({"dataset_size": 0, "batch_size": 1}, "dataset_size"),
    ],
)
def test_bad_configuration_is_refused(kwargs, needle):
    with pytest.raises(ConfigurationError, match=needle):
        sampling.fixed_size(**kwargs)


# -- accounting ---------------------------------------------------------------------------------------------------


def _rdp_replace_one(event, count: int, delta: float) -> float:
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    ("n", "b", "z", "steps"), [(1000, 10, 1.0, 1000), (60_000, 256, 1.1, 2000), (500, 50, 3.0, 30)]
)
def test_epsilon_is_dp_accounting_rdp_under_replace_one_at_half_the_multiplier(n, b, z, steps):
    """Replacing one example moves the clipped sum by up to twice the clipping bound: noise ``z C`` is a Gaussian
    release with multiplier ``z / 2`` under replace-one adjacency."""
    sampler = sampling.fixed_size(dataset_size=n, batch_size=b)
    process = sampler.process(z, steps)
    assert process == acc.repeat(acc.without_replacement(acc.gaussian(z), dataset_size=n, sample_size=b), steps)
    want = _rdp_replace_one(
        dp_accounting.SampledWithoutReplacementDpEvent(n, b, dp_accounting.GaussianDpEvent(z / 2)), steps, 1e-5
    )
    got = acc.epsilon(process, delta=1e-5)
    assert got.accountant == "rdp" and got.value == pytest.approx(want, rel=1e-12)
    assert acc.epsilon(process, delta=1e-5, accountant="rdp", adjacency="replace_one").value == got.value
    assert acc.delta(process, epsilon=got.value).value == pytest.approx(1e-5, rel=1e-3)


def test_a_batch_of_the_whole_dataset_is_the_gaussian_mechanism_with_twice_the_sensitivity():
    """B = N: no amplification; the RDP of a Gaussian of multiplier z/2, ``2 alpha / z^2`` per step, from the
    add-or-remove Gaussian event (another code path of dp-accounting), and the exact replace-one PLD."""
    z, steps = 2.0, 25
    got = acc.epsilon(sampling.fixed_size(dataset_size=20, batch_size=20).process(z, steps), delta=1e-6).value
    reference = rdp.RdpAccountant()
    reference.compose(dp_accounting.GaussianDpEvent(z / 2), steps)
    assert got == pytest.approx(reference.get_epsilon(1e-6), rel=1e-9)
    unamplified = acc.epsilon(acc.repeat(acc.gaussian(z), steps), delta=1e-6, accountant="rdp").value
    assert got > 1.5 * unamplified  # the doubled sensitivity is charged
    # dp-accounting's PLD models replacement itself (shifts of +-1 sensitivity): it takes the multiplier z, and
    # being exact it lies below the RDP bound, by a few percent here
    exact = pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    exact.compose(dp_accounting.GaussianDpEvent(z), steps)
    assert exact.get_epsilon(1e-6) <= got <= 1.1 * exact.get_epsilon(1e-6)


def test_queries_refuse_what_does_not_account_sampling_without_replacement():
    process = sampling.fixed_size(dataset_size=100, batch_size=10).process(1.0, 10)
    with pytest.raises(ConfigurationError, match="RDP only"):
        acc.epsilon(process, delta=1e-5, accountant="pld")
    with pytest.raises(ConfigurationError, match="replace-one adjacency only"):
        acc.epsilon(process, delta=1e-5, adjacency="add_or_remove")
    poisson_step = acc.poisson(acc.gaussian(1.0), 0.1)
    with pytest.raises(ConfigurationError, match="cannot be composed with other releases"):
        acc.epsilon(acc.compose(process, poisson_step), delta=1e-5)
    with pytest.raises(ConfigurationError, match="plain Gaussian"):
        acc.without_replacement(
            acc.adaptive_clipping(acc.gaussian(1.0), count_noise_fraction=0.1, expected_batch_size=10.0),
            dataset_size=100,
            sample_size=10,
        )
    with pytest.raises(ConfigurationError, match="replace-one only"):
        acc.moe_aux(process, ratio=0.1)
    # dp-accounting's RDP reads a plain Gaussian's multiplier against the replace-one sensitivity: refused
    with pytest.raises(ConfigurationError, match="serves sampling without replacement only"):
        acc.epsilon(acc.repeat(acc.gaussian(1.0), 3), delta=1e-5, accountant="rdp", adjacency="replace_one")
    assert math.isinf(acc.epsilon(sampling.fixed_size(dataset_size=5, batch_size=2).process(0.0, 3), delta=1e-5).value)


def test_the_default_adjacency_is_the_one_the_query_uses():
    """``default_adjacency`` (what accountant.json and the model card state) names the relation that a query with
    ``adjacency=None`` uses: replace-one for fixed-size batches, add-or-remove for Poisson sampling."""
    fixed = sampling.fixed_size(dataset_size=100, batch_size=10).process(1.0, 10)
    poisson = sampling.poisson(dataset_size=100, sample_rate=0.1).process(1.0, 10)
    assert acc.default_adjacency(fixed) == "replace_one" and acc.default_adjacency(poisson) == "add_or_remove"
    for process in (fixed, poisson):
        named = acc.epsilon(process, delta=1e-5, adjacency=acc.default_adjacency(process))
        assert acc.epsilon(process, delta=1e-5) == named
    assert acc.epsilon(poisson, delta=1e-5) != acc.epsilon(poisson, delta=1e-5, adjacency="replace_one")


def test_the_process_round_trips_through_json_and_its_rate_is_batch_over_dataset():
    sampler = sampling.fixed_size(dataset_size=300, batch_size=12)
    process = sampler.process(0.9, 7)
    assert acc.from_json(json.loads(json.dumps(acc.to_json(process)))) == process
    assert accounted_rate(sampler, 7) == (12 / 300, "accounting process")


def test_the_plan_calibrates_dp_sgd_with_it_and_refuses_the_rest():
    sampler = sampling.fixed_size(dataset_size=2000, batch_size=20)
    planned = plan.plan(sampler=sampler, steps=300, delta=1e-5, target_epsilon=4.0)
    assert planned.expected_batch_size == 20.0 and planned.sample_rate == 0.01
    reached = acc.epsilon(sampler.process(planned.noise_multiplier, 300), delta=1e-5).value
    assert 4.0 * (1 - 1e-3) <= reached <= 4.0
    with pytest.raises(ConfigurationError, match="adaptive clipping"):
        plan.plan(sampler=sampler, steps=10, delta=1e-5, noise_multiplier=1.0, clipping=adaptive())
    with pytest.raises(ConfigurationError, match="no accountant with the 'fixed_size' sampler"):
        plan.check_combination(
            mechanism="mf_band", sampler="fixed_size", adaptive_clipping=False, noise_multiplier=1.0, target=None
        )
