"""DP-AdamBC: v_hat - phi_hat in the denominator, and plain Adam when sigma = 0."""

from __future__ import annotations

import math

import torch

from opake_core import optim
from opake_core.tree import Noised, PerGroup

B1, B2, EPS, LR = 0.9, 0.99, 1e-8, 1e-2
GROUP_OF = {"w": "big", "b": "small"}


def _tree(seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g, dtype=dtype), "b": torch.randn(6, generator=g, dtype=dtype)}


def _sigmas(step: int) -> dict[str, float]:
    # Noise std changes between steps and differs between groups.
    return {"big": 0.8 + 0.1 * step, "small": 0.05}


def _reference(grads: list[dict[str, torch.Tensor]], sigma_of_step) -> tuple[list, dict]:
    """A float64 loop from the DP-AdamBC equations: per-step updates, and how often the floor bit per leaf."""
    m = {k: torch.zeros_like(v) for k, v in grads[0].items()}
    v = {k: torch.zeros_like(x) for k, x in grads[0].items()}
    phi = dict.fromkeys(grads[0], 0.0)
    out, floored = [], dict.fromkeys(grads[0], 0)
    for t, g in enumerate(grads, start=1):
        step = {}
        for k in g:
            sigma = sigma_of_step(t - 1)[GROUP_OF[k]]
            m[k] = B1 * m[k] + (1 - B1) * g[k]
            v[k] = B2 * v[k] + (1 - B2) * g[k] ** 2
            phi[k] = B2 * phi[k] + (1 - B2) * sigma**2
            m_hat, v_hat = m[k] / (1 - B1**t), v[k] / (1 - B2**t)
            phi_hat = phi[k] / (1 - B2**t)
            floor = torch.clamp(v_hat, max=optim.VARIANCE_FLOOR)
            corrected = torch.maximum(v_hat - phi_hat, floor)
            floored[k] += int((v_hat - phi_hat < floor).sum())
            step[k] = -LR * m_hat / (corrected.sqrt() + EPS)
        out.append(step)
    return out, floored


def _run(opt: optim.Optimizer, grads, sigma_of_step) -> list[dict[str, torch.Tensor]]:
    state = opt.init(grads[0])
    out = []
    for i, g in enumerate(grads):
        std = PerGroup.build(GROUP_OF, sigma_of_step(i))
        updates, state = opt.update(Noised(g, 1.0, std), state)
        out.append(updates)
    return out


def test_matches_float64_reference_with_noise() -> None:
    # Signal of size ~0.3 plus noise of size ~1 in "w": many coordinates fall under the noise floor.
    grads = [{k: 0.3 + s * x for k, x in _tree(i).items() for s in [_sigmas(i)[GROUP_OF[k]]]} for i in range(6)]
    want, floored = _reference(grads, _sigmas)
    got = _run(optim.adam(LR, (B1, B2), EPS, noise_bias_correction=True), grads, _sigmas)
    assert floored["w"] > 0, "the test should exercise the floor"
    assert floored["w"] < 6 * 15, "the test should exercise the corrected branch"
    for g, w in zip(got, want, strict=True):
        for k in w:
            # torchopt computes 1 - beta^t in float32 (pow of a 0-d int64 tensor), as in its own Adam: with
            # b2 = 0.99 that factor carries a relative error of a few 1e-6 in the first steps.
            torch.testing.assert_close(g[k], w[k], atol=1e-12, rtol=1e-5)


def test_correction_enlarges_steps_relative_to_adam() -> None:
    grads = [_tree(i) for i in range(3)]
    corrected = _run(optim.adam(LR, (B1, B2), EPS, noise_bias_correction=True), grads, _sigmas)
    plain = _run(optim.adam(LR, (B1, B2), EPS), grads, _sigmas)
    for c, p in zip(corrected, plain, strict=True):
        for k in c:
            assert bool((c[k].abs() >= p[k].abs()).all())
        assert bool((c["w"].abs() > p["w"].abs()).any())


def test_sigma_zero_is_adam_bitwise() -> None:
    grads = [_tree(i, torch.float32) for i in range(5)]
    for g in grads:
        g["b"][0] = 1e-6  # v_hat far below VARIANCE_FLOOR: still plain Adam

    def zero(step: int) -> dict[str, float]:
        return {"big": 0.0, "small": 0.0}

    for make in (optim.adam, lambda *a, **k: optim.adamw(*a, weight_decay=0.0, **k)):
        corrected = _run(make(LR, (B1, B2), EPS, noise_bias_correction=True), grads, zero)
        plain = _run(make(LR, (B1, B2), EPS), grads, zero)
        for c, p in zip(corrected, plain, strict=True):
            for k in c:
                assert torch.equal(c[k], p[k])


def test_phi_hat_tracks_constant_sigma() -> None:
    opt = optim.adam(LR, noise_bias_correction=True)
    grads = _tree(0)
    state = opt.init(grads)
    for _ in range(4):
        _, state = opt.update(Noised(grads, 1.0, 0.5), state)
    head = state[0]
    phi_hat = float(head.phi["w"]) / (1 - 0.999 ** int(head.count["w"]))
    assert math.isclose(phi_hat, 0.25, rel_tol=1e-12)
