"""User-level sampling and group clipping: users sampled at their rate, each contributing at most k of its own rows
chosen uniformly, a replayable and resumable draw, accounting over users equal to dp-accounting's, and a clipped sum
that one user (all its rows) moves by at most C, checked against a float64 loop over users.

Statistical tests: exact binomial and chi-square tests at a per-test false-alarm rate of 1e-6 (Bonferroni-split over
the checks inside a test), with fixed seeds.
"""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pytest
import torch
from scipy import stats

from opake_core import accounting as acc
from opake_core import mf, optim, random, sampling
from opake_core.clipping import clipped_grad, user_loss
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.plan import plan
from opake_core.step import dp_sgd

ALPHA = 1e-6
KEY = random.key(7)
# 12 users with 1 to 9 rows each, the rows of a user scattered over the dataset
COUNTS = np.array([1, 2, 3, 9, 4, 1, 7, 5, 2, 8, 6, 3])
ROW_USERS = np.random.default_rng(0).permutation(np.repeat(np.arange(len(COUNTS)), COUNTS))


def _sampler(q=0.3, k=4, users=None):
    users = users or sampling.poisson(dataset_size=len(COUNTS), sample_rate=q)
    return sampling.by_user(users, row_users=ROW_USERS, max_rows_per_user=k)


def _draws(sampler, steps, key=KEY):
    state, out = sampler.init(), []
    for _ in range(steps):
        slots, state = sampler.sample(key, state)
        out.append(slots)
    return out, state


def test_users_are_sampled_at_their_rate_and_contribute_at_most_k_of_their_own_rows():
    q, k, steps = 0.3, 4, 400
    sampler = _sampler(q, k)
    draws, state = _draws(sampler, steps)
    assert state.step == steps
    seen = np.zeros(len(COUNTS), dtype=np.int64)
    for slots in draws:
        assert slots.ndim == 2 and slots.shape[1] <= k
        for row in slots:
            real = row[row >= 0]
            assert len(real) == min(COUNTS[ROW_USERS[real[0]]], k)  # min(n_u, k) rows, the real ones first
            assert (row[len(real) :] == -1).all() and (np.diff(real) > 0).all()
            assert len(set(ROW_USERS[real])) == 1  # one user's rows only
            seen[ROW_USERS[real[0]]] += 1
    pvalues = [stats.binomtest(int(c), steps, q).pvalue for c in seen]
    assert min(pvalues) > ALPHA / len(COUNTS)


def test_a_users_rows_are_chosen_uniformly():
    # user 3 has 9 rows and contributes 4 a step: each row is in its draw with probability 4/9, all alike
    sampler = _sampler(q=1.0, k=4)
    draws, _ = _draws(sampler, 900)
    rows_of_3 = np.flatnonzero(ROW_USERS == 3)
    counts = np.zeros(len(rows_of_3), dtype=np.int64)
    for slots in draws:
        picked = slots[ROW_USERS[slots[:, 0]] == 3][0]
        counts += np.isin(rows_of_3, picked)
    assert counts.sum() == 900 * 4
    assert stats.chisquare(counts).pvalue > ALPHA


def test_the_draw_replays_resumes_and_refuses_another_configuration():
    sampler = _sampler()
    draws, state = _draws(sampler, 6)
    again, _ = _draws(sampler, 6)
    assert all(np.array_equal(a, b) for a, b in zip(draws, again, strict=True))
    saved = json.loads(json.dumps(state.to_json()))
    _, middle = _draws(sampler, 3)
    resumed = sampling.SamplerState.from_json(json.loads(json.dumps(middle.to_json())))
    tail = [sampler.sample(KEY, resumed)[0]]
    assert np.array_equal(tail[0], draws[3])
    assert sampling.SamplerState.from_json(saved) == state
    for other in (_sampler(k=3), sampling.poisson(dataset_size=len(COUNTS), sample_rate=0.3)):
        with pytest.raises(StateError):
            other.sample(KEY, state)
    # the users it draws are the user sampler's, at the same key and step
    users = sampling.poisson(dataset_size=len(COUNTS), sample_rate=0.3)
    drawn, _ = users.sample(KEY, users.init())
    assert sorted(set(ROW_USERS[draws[0][:, 0]])) == [u for u in drawn if COUNTS[u] > 0]


def test_accounting_is_over_users_and_equals_dp_accounting():
    num_users, rate, z, steps, delta = 5_000, 0.01, 1.1, 300, 1e-6
    row_users = np.repeat(np.arange(num_users), 3)
    sampler = sampling.by_user(
        sampling.poisson(dataset_size=num_users, sample_rate=rate), row_users=row_users, max_rows_per_user=2
    )
    assert sampler.expected_batch_size == pytest.approx(num_users * rate)  # users, not rows
    ours = acc.epsilon(sampler.process(z, steps), delta=delta, discretization=1e-3).value
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z))
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event, steps)
    assert ours == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
    # a plan given the user-level sampler calibrates over users too
    planned = plan(sampler=sampler, steps=steps, delta=delta, target_epsilon=ours, clipping=1.0)
    assert planned.noise_multiplier == pytest.approx(z, rel=2e-3)


def test_dp_ftrl_over_users_is_accounted_as_the_user_sampler():
    users = sampling.cyclic_poisson(dataset_size=400, sample_rate=0.05, bands=4)
    sampler = sampling.by_user(users, row_users=np.arange(1200) % 400, max_rows_per_user=3)
    ours = acc.mf_process(mf.band_mf(bands=4), sampler=sampler, noise_multiplier=1.0, n_steps=40)
    assert ours == acc.mf_process(mf.band_mf(bands=4), sampler=users, noise_multiplier=1.0, n_steps=40)


def test_bad_input_is_refused_with_the_reason():
    users = sampling.poisson(dataset_size=3, sample_rate=0.5)
    with pytest.raises(ConfigurationError, match=r"in \[0, 3\)"):
        sampling.by_user(users, row_users=np.array([0, 1, 3]), max_rows_per_user=2)
    with pytest.raises(InputTypeError, match="integer"):
        sampling.by_user(users, row_users=np.array([0.0, 1.0]), max_rows_per_user=2)
    with pytest.raises(ConfigurationError, match="max_rows_per_user"):
        sampling.by_user(users, row_users=np.array([0, 1]), max_rows_per_user=0)
    inner = sampling.by_user(users, row_users=np.array([0, 1]), max_rows_per_user=1)
    with pytest.raises(ConfigurationError, match="not another user-level"):
        sampling.by_user(inner, row_users=np.array([0, 1]), max_rows_per_user=1)
    with pytest.raises(ConfigurationError, match="reduction"):
        user_loss(lambda w, x: x @ w, reduction="max")


def _row_loss(w, x, y):
    return (torch.tanh(x @ w["a"]) @ w["b"] - y) ** 2


def _params():
    gen = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(5, 4, generator=gen, dtype=torch.float64),
        "b": torch.randn(4, generator=gen, dtype=torch.float64),
    }


def _data(n_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n_rows, 5, generator=gen, dtype=torch.float64), torch.randn(
        n_rows, generator=gen, dtype=torch.float64
    )


def _float64_loop(params, x, y, slots, clip, reduction):
    """sum over users of min(1, C / ||g_u||) g_u with g_u the sum (or mean) of the row gradients, one row at a time."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for row in slots:
        real = row[row >= 0]
        g = {k: torch.zeros_like(v) for k, v in params.items()}
        for r in real:
            p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            _row_loss(p, x[r], y[r]).backward()
            for k in g:
                g[k] += p[k].grad / (len(real) if reduction == "mean" else 1)
        norm = torch.sqrt(sum(v.square().sum() for v in g.values()))
        for k in g:
            total[k] += g[k] * min(1.0, clip / norm.item())
    return total


def _batch(x, y, slots):
    rows, live = sampling.filled_slots(slots)
    rows = torch.as_tensor(rows)
    return torch.as_tensor(live), x[rows], y[rows]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_group_clipping_equals_a_float64_loop_over_users(reduction):
    params, (x, y) = _params(), _data(len(ROW_USERS), 0)
    slots = _sampler(q=1.0, k=4).sample(KEY, _sampler(q=1.0, k=4).init())[0]
    grad_fn, state = clipped_grad(
        user_loss(_row_loss, reduction=reduction), clipping_norm=0.7, batch_argnums=(1, 2, 3), return_diagnostics=True
    )
    (clipped, diagnostics), _ = grad_fn(params, *_batch(x, y, slots), state=state)
    expected = _float64_loop(params, x, y, slots, 0.7, reduction)
    for k in expected:
        torch.testing.assert_close(clipped.value[k], expected[k], rtol=1e-10, atol=1e-12)
    assert clipped.sensitivity == 0.7 and diagnostics.batch_size == len(slots)
    assert diagnostics.clip_rate > 0  # the bound binds for some users: the test sees clipping at work


def test_removing_one_user_moves_the_clipped_sum_by_at_most_c():
    clip = 0.5
    params, (x, y) = _params(), _data(len(ROW_USERS), 1)
    x[ROW_USERS == 3] *= 50  # an extreme user: its summed gradient is far above the bound
    slots = _sampler(q=1.0, k=9).sample(KEY, _sampler(q=1.0, k=9).init())[0]
    grad_fn, state = clipped_grad(user_loss(_row_loss), clipping_norm=clip, batch_argnums=(1, 2, 3))
    full = grad_fn(params, *_batch(x, y, slots), state=state)[0].value
    worst = 0.0
    for u in range(len(COUNTS)):
        kept = slots[ROW_USERS[slots[:, 0]] != u]
        without = grad_fn(params, *_batch(x, y, kept), state=state)[0].value
        moved = torch.sqrt(sum((full[k] - without[k]).square().sum() for k in full)).item()
        worst = max(worst, moved)
        assert moved <= clip * (1 + 1e-9)
    assert worst > 0.99 * clip  # the extreme user moves it by the whole bound: the check can fail


def test_a_user_level_dp_sgd_step_runs_on_the_slots():
    params, (x, y) = _params(), _data(len(ROW_USERS), 2)
    sampler = _sampler(q=0.5, k=3)
    step_fn, dp_state = dp_sgd(user_loss(_row_loss), clipping_norm=1.0, noise_multiplier=0.0, key=KEY,
                               optimizer=optim.sgd(0.1), expected_batch_size=sampler.expected_batch_size)  # fmt: skip
    opt_state = optim.sgd(0.1).init(params)
    slots, _ = sampler.sample(KEY, sampler.init())
    new, _, _, _ = step_fn(params, opt_state, dp_state, _batch(x, y, slots))
    expected = _float64_loop(params, x, y, slots, 1.0, "sum")
    for k in params:
        torch.testing.assert_close(params[k] - new[k], 0.1 * expected[k] / sampler.expected_batch_size)
