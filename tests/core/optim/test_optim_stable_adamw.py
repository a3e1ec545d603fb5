"""StableAdamW (Wortsman et al. 2023, Algorithm 2) against a float64 loop over coordinates: per-tensor RMS of
g^2 / max(v_hat, eps^2), learning rate divided by max(1, RMS / update_rms_clip), decoupled decay at that rate."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_core.tree import Noised, PerGroup

B1, B2, EPS, LR, DECAY = 0.9, 0.99, 1e-8, 1e-2, 0.1
GROUP_OF = {"w": "big", "b": "small"}
SIGMAS = {"big": 0.7, "small": 0.05}


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    """Small gradients, then at step 5 a spike in "w" only: "w" gets clipped there, "b" does not."""
    out = []
    for t in range(steps):
        gen = torch.Generator().manual_seed(t)
        g = {"w": 0.1 * torch.randn(4, 3, generator=gen, dtype=torch.float64),
             "b": 0.1 * torch.randn(5, generator=gen, dtype=torch.float64)}  # fmt: skip
        if t == 5:
            g["w"] = g["w"] * 30
        out.append(g)
    return out


def _reference(grads, params, clip: float, *, sigmas=None):
    """Float64 loop; returns per-step updates and the per-step, per-leaf learning-rate factors 1 / max(1, RMS/clip)."""
    flat = {k: p.flatten().tolist() for k, p in params.items()}
    m = {k: [0.0] * len(p) for k, p in flat.items()}
    v = {k: [0.0] * len(p) for k, p in flat.items()}
    phi = dict.fromkeys(flat, 0.0)
    out, factors = [], []
    for t, g in enumerate(grads, start=1):
        step, factor = {}, {}
        for k, gk in g.items():
            gk = gk.flatten().tolist()
            if sigmas is not None:
                phi[k] = B2 * phi[k] + (1 - B2) * sigmas[GROUP_OF[k]] ** 2
            v_hat = []
            for i, gi in enumerate(gk):
                m[k][i] = B1 * m[k][i] + (1 - B1) * gi
                v[k][i] = B2 * v[k][i] + (1 - B2) * gi**2
                raw, noise = v[k][i] / (1 - B2**t), phi[k] / (1 - B2**t)
                v_hat.append(raw - noise if raw - noise > 0 else raw)
            rms = math.sqrt(sum(gi**2 / max(vi, EPS**2) for gi, vi in zip(gk, v_hat, strict=True)) / len(gk))
            factor[k] = 1 / max(1.0, rms / clip)
            step[k] = [
                -LR * factor[k] * (m[k][i] / (1 - B1**t) / (math.sqrt(v_hat[i]) + EPS) + DECAY * flat[k][i])
                for i in range(len(gk))
            ]
        out.append(step)
        factors.append(factor)
    return out, factors


def _ours(opt, grads, params, *, sigmas=None):
    state, out = opt.init(params), []
    for g in grads:
        noised = Noised(g, 1.0, PerGroup.build(GROUP_OF, sigmas)) if sigmas else g
        updates, state = opt.update(noised, state, params=params)
        out.append(updates)
    return out


@pytest.mark.parametrize("clip", [1.0, 2.0])
def test_matches_float64_reference(clip) -> None:
    grads, params = _grads(8), {"w": torch.ones(4, 3, dtype=torch.float64), "b": -torch.ones(5, dtype=torch.float64)}
    want, factors = _reference(grads, params, clip)
    got = _ours(optim.stable_adamw(LR, (B1, B2), EPS, DECAY, update_rms_clip=clip, non_private=True), grads, params)
    assert factors[5]["w"] < 0.9 and factors[5]["b"] == 1.0, "the spike must clip 'w' and leave 'b' alone"
    for g, w in zip(got, want, strict=True):
        for k in w:
            torch.testing.assert_close(g[k].flatten(), torch.tensor(w[k], dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_matches_float64_reference_with_bias_correction() -> None:
    grads, params = _grads(8), {"w": torch.ones(4, 3, dtype=torch.float64), "b": -torch.ones(5, dtype=torch.float64)}
    want, _ = _reference(grads, params, 1.0, sigmas=SIGMAS)
    opt = optim.adamw(LR, (B1, B2), EPS, DECAY, update_rms_clip=1.0, noise_bias_correction=True)
    got = _ours(opt, grads, params, sigmas=SIGMAS)
    for g, w in zip(got, want, strict=True):
        for k in w:
            torch.testing.assert_close(g[k].flatten(), torch.tensor(w[k], dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_adamw_with_update_rms_clip_is_stable_adamw() -> None:
    grads, params = _grads(6), {"w": torch.ones(4, 3, dtype=torch.float64), "b": -torch.ones(5, dtype=torch.float64)}
    a = _ours(optim.adamw(LR, update_rms_clip=1.0, non_private=True), grads, params)
    b = _ours(optim.stable_adamw(LR, non_private=True), grads, params)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    assert optim.stable_adamw().name == "stable_adamw" and optim.adam(update_rms_clip=1.0).name == "stable_adam"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_update_rms_clip_must_be_positive(bad) -> None:
    with pytest.raises(ConfigurationError, match="update_rms_clip"):
        optim.stable_adamw(update_rms_clip=bad)
