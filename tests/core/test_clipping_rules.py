"""AUTO-S and adaptive clipping against float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opake_core import optim, random
from opake_core.clipping import ADAPTIVE_STREAM, AdaptiveClipState, adaptive, auto_s, clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.step import dp_ftrl, dp_sgd


def _loss(p, g):
    return (p["w"] * g).sum()  # the per-example gradient is g itself


def _grads(n=12, d=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen) * torch.logspace(-2, 2, n)[:, None]


def test_auto_s_matches_float64_formula():
    g = _grads()
    grad_fn, state = clipped_grad(_loss, clipping_norm=auto_s(0.5, gamma=0.01), normalize_by=4.0)
    clipped, _ = grad_fn({"w": torch.ones(7)}, g, state=state)
    g64 = g.double()
    ref = (g64 * (0.5 / (g64.norm(dim=1, keepdim=True) + 0.01))).sum(0) / 4.0
    assert clipped.sensitivity == 0.5 / 4.0
    torch.testing.assert_close(clipped.value["w"].double(), ref, rtol=1e-6, atol=1e-9)
    single, _ = grad_fn({"w": torch.ones(7)}, g[-1:] * 1e6, state=state)
    assert single.value["w"].double().norm().item() * 4.0 <= 0.5  # every contribution stays below R


def test_adaptive_follows_the_published_update():
    g = _grads(n=10)
    rule = adaptive(1.0, target_quantile=0.3, learning_rate=0.2, count_noise_fraction=0.05)
    key = random.key(5)
    grad_fn, state = clipped_grad(_loss, clipping_norm=rule, normalize_by=10.0, key=key)
    assert isinstance(state, AdaptiveClipState) and state.clipping_norm == 1.0
    bound = 1.0
    norms = g.double().norm(dim=1).numpy()
    for step in range(4):
        clipped, state = grad_fn({"w": torch.ones(7)}, g, state=state)
        assert clipped.sensitivity == pytest.approx(bound / 10.0)
        noise = random.numpy_generator(random.fold_in(key, ADAPTIVE_STREAM, step)).normal()
        unclipped = int((norms <= bound * (1 - 1e-9)).sum())
        fraction = (unclipped - 5 + noise * 0.05 * 10.0) / 10.0 + 0.5
        bound = min(max(bound * math.exp(-0.2 * (fraction - 0.3)), 1e-3), 1e3)
        assert state.clipping_norm == pytest.approx(bound, rel=1e-12)
        assert state.step == step + 1


def test_adaptive_bound_tracks_the_target_quantile():
    g = _grads(n=40, seed=1)
    rule = adaptive(0.01, target_quantile=0.5, learning_rate=0.5, count_noise_fraction=1e-3)
    grad_fn, state = clipped_grad(_loss, clipping_norm=rule, normalize_by=40.0, key=random.key(0))
    for _ in range(200):
        _, state = grad_fn({"w": torch.ones(7)}, g, state=state)
    norms = np.sort(g.double().norm(dim=1).numpy())
    assert norms[14] <= state.clipping_norm <= norms[25]  # within the middle quarter of the norms


def test_adaptive_step_changes_noise_scale_and_replays():
    torch.manual_seed(0)
    params = {"w": torch.zeros(7)}
    opt = optim.sgd(0.1)
    step_fn, dp_state = dp_sgd(
        _loss,
        optimizer=opt,
        clipping_norm=adaptive(1.0),
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        key=random.key(1),
    )
    batch = (_grads(n=8),)
    p1, _, s1, m1 = step_fn(params, opt.init(params), dp_state, batch)
    p2, _, s2, _ = step_fn(params, opt.init(params), dp_state, batch)
    assert torch.equal(p1["w"], p2["w"]) and s1.clip.clipping_norm == s2.clip.clipping_norm
    assert m1.noise_std == pytest.approx(1.0 / 8.0)
    assert s1.clip.clipping_norm != 1.0


def test_rules_are_validated():
    with pytest.raises(ConfigurationError, match="gamma"):
        auto_s(1.0, gamma=0.0)
    with pytest.raises(ConfigurationError, match="target_quantile"):
        adaptive(target_quantile=1.0)
    with pytest.raises(ConfigurationError, match="clipping_norm_max"):
        adaptive(clipping_norm_min=2.0, clipping_norm_max=1.0)
    with pytest.raises(ConfigurationError, match="needs key"):
        clipped_grad(_loss, clipping_norm=adaptive())
    with pytest.raises(ConfigurationError, match="only used by adaptive"):
        clipped_grad(_loss, clipping_norm=1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="Key"):
        clipped_grad(_loss, clipping_norm=adaptive(), key=3)
    with pytest.raises(ConfigurationError, match="adaptive clipping is refused"):
        dp_ftrl(
            _loss,
            params={"w": torch.zeros(2)},
            optimizer=optim.sgd(0.1),
            strategy=None,
            n_steps=2,
            clipping_norm=adaptive(),
            noise_multiplier=1.0,
            expected_batch_size=2.0,
            key=random.key(0),
        )


def test_adaptive_counts_can_be_summed_across_shards():
    """Two identical shards whose counts are summed move the bound exactly like one process on both shards."""
    g = _grads(n=6)
    rule, key = adaptive(1.0, learning_rate=0.3), random.key(2)
    shard_fn, shard_state = clipped_grad(
        _loss, clipping_norm=rule, normalize_by=12.0, key=key, reduce_count=lambda c: 2 * c
    )
    whole_fn, whole_state = clipped_grad(_loss, clipping_norm=rule, normalize_by=12.0, key=key)
    for _ in range(3):
        _, shard_state = shard_fn({"w": torch.ones(7)}, g, state=shard_state)
        _, whole_state = whole_fn({"w": torch.ones(7)}, torch.cat([g, g]), state=whole_state)
        assert shard_state.clipping_norm == whole_state.clipping_norm
