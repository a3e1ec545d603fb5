"""The composed DP-SGD step equals the primitives composed by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_core import optim, random
from opake_core.clipping import adaptive, clipped_grad
from opake_core.errors import InputTypeError
from opake_core.noise import gaussian_noise
from opake_core.step import DPState, dp_sgd, rekeyed, unkeyed
from opake_torch.functional import functional_model


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    apply, params, frozen = functional_model(model)

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)) for n in (6, 0, 9)]
    return model, params, loss, batches


def test_step_equals_hand_composition():
    _, params, loss, batches = _setup()
    key = random.key(3)
    opt = optim.adam(lr=0.01)
    step_fn, dp_state = dp_sgd(
        loss, optimizer=opt, clipping_norm=0.7, noise_multiplier=1.3, expected_batch_size=8, key=key
    )
    p_step, s_step = params, opt.init(params)
    for batch in batches:
        p_step, s_step, dp_state, metrics = step_fn(p_step, s_step, dp_state, batch)
    assert dp_state.step == 3 and metrics.step == 2 and metrics.batch_size == 9
    assert metrics.noise_std == pytest.approx(1.3 * 0.7 / 8)

    grad_fn, clip_state = clipped_grad(loss, clipping_norm=0.7, normalize_by=8, batch_argnums=(1, 2))
    noise_fn, noise_state = gaussian_noise(noise_multiplier=1.3, key=key)
    p_hand, s_hand = params, opt.init(params)
    for batch in batches:
        clipped, clip_state = grad_fn(p_hand, *batch, state=clip_state)
        noised, noise_state = noise_fn(clipped, noise_state)
        updates, s_hand = opt.update(noised, s_hand, params=p_hand)
        p_hand = optim.apply_updates(p_hand, updates)
    for k in params:
        assert torch.equal(p_step[k], p_hand[k])


def test_non_private_step_is_plain_sgd():
    model, params, loss, batches = _setup()
    opt = optim.sgd(lr=0.1)
    step_fn, dp_state = dp_sgd(
        loss, optimizer=opt, clipping_norm=math.inf, noise_multiplier=0.0, expected_batch_size=6, key=random.key(0)
    )
    x, y = batches[0]
    new_params, _, _, metrics = step_fn(params, opt.init(params), dp_state, (x, y))
    assert metrics.noise_std == 0.0
    reference = torch.optim.SGD(model.parameters(), lr=0.1)
    reference.zero_grad()
    F.cross_entropy(model(x), y).backward()  # mean over 6 examples = sum / expected batch size 6
    reference.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(new_params[name], p.detach(), rtol=1e-6, atol=1e-6)


def test_step_refuses_bad_inputs():
    _, params, loss, batches = _setup()
    opt = optim.sgd(lr=0.1)
    step_fn, dp_state = dp_sgd(
        loss, optimizer=opt, clipping_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, key=random.key(0)
    )
    with pytest.raises(InputTypeError, match="tuple"):
        step_fn(params, opt.init(params), dp_state, list(batches[0]))
    with pytest.raises(InputTypeError, match="DPState"):
        step_fn(params, opt.init(params), None, batches[0])
    assert isinstance(dp_state, DPState)


def test_saved_states_hold_no_key_and_take_the_keys_of_a_new_segment():
    """A checkpoint stores ``unkeyed(dp_state)``; a resume continues ``rekeyed(saved, fresh)``, under the keys of the
    fresh state (another segment's), with the saved counters and clipping bound."""
    _, params, loss, batches = _setup()
    opt = optim.sgd(lr=0.1)
    common = {"optimizer": opt, "clipping_norm": adaptive(1.0), "noise_multiplier": 1.0, "expected_batch_size": 4}
    step_fn, dp_state = dp_sgd(loss, key=random.key(1), **common)
    _, _, dp_state, _ = step_fn(params, opt.init(params), dp_state, batches[0])
    saved = unkeyed(dp_state)
    assert saved.noise.key is None and saved.clip.key is None and dp_state.noise.key == random.key(1)
    _, fresh = dp_sgd(loss, key=random.key(2), **common)
    resumed = rekeyed(saved, fresh)
    assert (resumed.noise.key, resumed.clip.key) == (fresh.noise.key, fresh.clip.key)
    assert (resumed.step, resumed.noise.step, resumed.clip.step) == (1, 1, 1)
    assert resumed.clip.clipping_norm == dp_state.clip.clipping_norm != 1.0
