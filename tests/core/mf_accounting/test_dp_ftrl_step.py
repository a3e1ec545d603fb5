"""The composed DP-FTRL step equals clip -> MF noise -> optimizer composed by hand; horizon and clipping refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_core import mf, optim, random
from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError, StateError
from opake_core.mf import mf_gaussian_noise
from opake_core.step import DPState, dp_ftrl
from opake_torch.functional import functional_model


def _setup():
    torch.manual_seed(0)
    apply, params, frozen = functional_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in (6, 0, 9, 4)]
    return params, loss, batches


def test_step_equals_hand_composition_and_stops_at_the_horizon():
    params, loss, batches = _setup()
    strategy, key, opt = mf.optimize(mf.band_mf(3), 4), random.key(5), optim.sgd(lr=0.1)
    step_fn, state = dp_ftrl(
        loss,
        params=params,
        optimizer=opt,
        strategy=strategy,
        n_steps=4,
        clipping_norm=0.7,
        noise_multiplier=1.3,
        expected_batch_size=6,
        key=key,
    )
    assert isinstance(state, DPState) and len(state.noise.buffers) == strategy.num_buffers == 2
    grad_fn, clip = clipped_grad(lambda p, b: loss(p, *b), clipping_norm=0.7, normalize_by=6)
    noise_fn, noise = mf_gaussian_noise(params, strategy, n_steps=4, noise_multiplier=1.3, key=key)
    p_step, s_step, p_hand, s_hand = params, opt.init(params), params, opt.init(params)
    for t, batch in enumerate(batches):
        p_step, s_step, state, metrics = step_fn(p_step, s_step, state, batch)
        clipped, clip = grad_fn(p_hand, batch, state=clip)
        noised, noise = noise_fn(clipped, noise)
        updates, s_hand = opt.update(noised, s_hand, params=p_hand)
        p_hand = optim.apply_updates(p_hand, updates)
        assert metrics.step == t and metrics.batch_size == len(batch[0])
        assert metrics.noise_std == pytest.approx(noised.noise_std)
        for name in p_hand:
            torch.testing.assert_close(p_step[name], p_hand[name], rtol=0, atol=0)
    with pytest.raises(StateError, match="past the declared horizon"):
        step_fn(p_step, s_step, state, batches[0])


def test_resume_from_a_saved_state_replays_the_same_noise():
    params, loss, batches = _setup()
    opt = optim.sgd(lr=0.1)
    kwargs = dict(params=params, optimizer=opt, strategy=mf.blt(2), n_steps=4, clipping_norm=1.0)
    key = random.key(9)
    step_fn, state = dp_ftrl(loss, noise_multiplier=1.0, expected_batch_size=5, key=key, **kwargs)
    p, s = params, opt.init(params)
    p, s, mid, _ = step_fn(p, s, state, batches[0])
    a = step_fn(p, s, mid, batches[2])[0]
    b = step_fn(p, s, mid, batches[2])[0]  # the same state twice: the state was not mutated
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_adaptive_clipping_and_bad_horizons_are_refused():
    params, loss, _ = _setup()
    common = dict(
        params=params, optimizer=optim.sgd(lr=0.1), noise_multiplier=1.0, expected_batch_size=4, key=random.key(0)
    )
    with pytest.raises(ConfigurationError, match="adaptive clipping is refused"):
        dp_ftrl(loss, strategy=mf.identity(), n_steps=4, clipping_norm="adaptive", **common)
    with pytest.raises(ConfigurationError, match="bands <= n_steps"):
        dp_ftrl(loss, strategy=mf.band_mf(8), n_steps=4, clipping_norm=1.0, **common)
