"""Noise-variance bias correction (DP-AdamBC and its RMSprop / Adagrad / StableAdamW forms) against float64 loops
written from the equations: the second moment minus the noise variance where that is positive, else the second
moment itself; plain optimizer bit for bit when sigma = 0; and convergence on a noisy quadratic."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_core.tree import Noised, PerGroup

B1, B2, EPS, LR = 0.9, 0.99, 1e-8, 1e-2
GROUP_OF = {"w": "big", "b": "small"}


def _tree(seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g, dtype=dtype), "b": torch.randn(6, generator=g, dtype=dtype)}


def _sigmas(step: int) -> dict[str, float]:
    # Noise std changes between steps and differs between groups.
    return {"big": 0.8 + 0.1 * step, "small": 0.05}


def _noisy_grads(steps: int) -> list[dict[str, torch.Tensor]]:
    # Signal of size ~0.3 plus noise of size ~1 in "w": many coordinates fall below the noise, others above.
    return [{k: 0.3 + _sigmas(i)[GROUP_OF[k]] * x for k, x in _tree(i).items()} for i in range(steps)]


def _corrected(second: float, noise: float) -> tuple[float, bool]:
    """The rule, one coordinate at a time: (denominator's second moment, whether the correction applied)."""
    return (second - noise, True) if second - noise > 0 else (second, False)


def _run(opt: optim.Optimizer, grads, sigma_of_step) -> list[dict[str, torch.Tensor]]:
    state = opt.init(grads[0])
    out = []
    for i, g in enumerate(grads):
        std = PerGroup.build(GROUP_OF, sigma_of_step(i))
        updates, state = opt.update(Noised(g, 1.0, std), state, params=grads[0])
        out.append(updates)
    return out


def _check(got, want, counts, *, rtol: float) -> None:
    assert counts[True] > 0 and counts[False] > 0, f"both branches of the rule must be exercised, got {counts}"
    for g, w in zip(got, want, strict=True):
        for k in w:
            torch.testing.assert_close(g[k], torch.tensor(w[k], dtype=torch.float64).view(g[k].shape), atol=1e-12,
                                       rtol=rtol)  # fmt: skip


def _adam_reference(grads, sigma_of_step):
    """DP-AdamBC per coordinate in Python floats: updates per step and how often each branch of the rule ran."""
    flat = [{k: v.flatten().tolist() for k, v in g.items()} for g in grads]
    m = {k: [0.0] * len(v) for k, v in flat[0].items()}
    v = {k: [0.0] * len(x) for k, x in flat[0].items()}
    phi = dict.fromkeys(flat[0], 0.0)
    out, counts = [], {True: 0, False: 0}
    for t, g in enumerate(flat, start=1):
        step = {}
        for k in g:
            sigma = sigma_of_step(t - 1)[GROUP_OF[k]]
            phi[k] = B2 * phi[k] + (1 - B2) * sigma**2
            step[k] = []
            for i, gi in enumerate(g[k]):
                m[k][i] = B1 * m[k][i] + (1 - B1) * gi
                v[k][i] = B2 * v[k][i] + (1 - B2) * gi**2
                d, applied = _corrected(v[k][i] / (1 - B2**t), phi[k] / (1 - B2**t))
                counts[applied] += 1
                step[k].append(-LR * (m[k][i] / (1 - B1**t)) / (math.sqrt(d) + EPS))
        out.append(step)
    return out, counts


def test_adam_matches_float64_reference_with_noise() -> None:
    grads = _noisy_grads(6)
    want, counts = _adam_reference(grads, _sigmas)
    got = _run(optim.adam(LR, (B1, B2), EPS, noise_bias_correction=True), grads, _sigmas)
    # torchopt computes 1 - beta^t in float32 (pow of a 0-d int64 tensor), as in its own Adam: with b2 = 0.99 that
    # factor carries a relative error of a few 1e-6 in the first steps.
    _check(got, want, counts, rtol=1e-5)


def test_rmsprop_matches_float64_reference_with_noise() -> None:
    alpha, decay, momentum = 0.9, 0.01, 0.5
    grads, params = _noisy_grads(6), _tree(0)
    flat_p = {k: p.flatten().tolist() for k, p in params.items()}
    v = {k: [0.0] * len(p) for k, p in flat_p.items()}
    b = {k: [0.0] * len(p) for k, p in flat_p.items()}
    phi = dict.fromkeys(flat_p, 0.0)
    want, counts = [], {True: 0, False: 0}
    for t, g in enumerate(grads):
        step = {}
        for k, gk in g.items():
            phi[k] = alpha * phi[k] + (1 - alpha) * _sigmas(t)[GROUP_OF[k]] ** 2  # no division by 1 - alpha^t
            step[k] = []
            for i, gi in enumerate(gk.flatten().tolist()):
                gi = gi + decay * flat_p[k][i]
                v[k][i] = alpha * v[k][i] + (1 - alpha) * gi**2
                d, applied = _corrected(v[k][i], phi[k])
                counts[applied] += 1
                b[k][i] = momentum * b[k][i] + gi / (math.sqrt(d) + EPS)
                step[k].append(-LR * b[k][i])
        want.append(step)
    state = None
    opt = optim.rmsprop(LR, alpha, EPS, decay, momentum, noise_bias_correction=True)
    got = []
    for t, g in enumerate(grads):
        state = opt.init(params) if state is None else state
        updates, state = opt.update(Noised(g, 1.0, PerGroup.build(GROUP_OF, _sigmas(t))), state, params=params)
        got.append(updates)
    _check(got, want, counts, rtol=1e-12)


def test_adagrad_matches_float64_reference_with_noise() -> None:
    lr_decay, initial = 0.1, 0.05
    grads = _noisy_grads(6)
    s = {k: [initial] * x.numel() for k, x in grads[0].items()}
    total_noise = dict.fromkeys(grads[0], 0.0)
    want, counts = [], {True: 0, False: 0}
    for t, g in enumerate(grads):
        step = {}
        for k, gk in g.items():
            total_noise[k] += _sigmas(t)[GROUP_OF[k]] ** 2
            step[k] = []
            for i, gi in enumerate(gk.flatten().tolist()):
                s[k][i] += gi**2
                d, applied = _corrected(s[k][i], total_noise[k])
                counts[applied] += 1
                step[k].append(-LR / (1 + t * lr_decay) * gi / (math.sqrt(d) + 1e-10))
        want.append(step)
    opt = optim.adagrad(LR, lr_decay, initial_accumulator_value=initial, noise_bias_correction=True)
    _check(_run(opt, grads, _sigmas), want, counts, rtol=1e-12)


def test_radam_matches_float64_reference_with_noise() -> None:
    b2 = 0.9  # rho_inf = 19: the rectified (adaptive) step starts at t = 6, so both kinds of update run
    grads = _noisy_grads(8)
    rho_inf = 2 / (1 - b2) - 1
    m = {k: [0.0] * x.numel() for k, x in grads[0].items()}
    v = {k: [0.0] * x.numel() for k, x in grads[0].items()}
    phi = dict.fromkeys(grads[0], 0.0)
    want, counts = [], {True: 0, False: 0}
    for t, g in enumerate(grads, start=1):
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        step = {}
        for k, gk in g.items():
            phi[k] = b2 * phi[k] + (1 - b2) * _sigmas(t - 1)[GROUP_OF[k]] ** 2  # also on momentum-only updates
            step[k] = []
            for i, gi in enumerate(gk.flatten().tolist()):
                m[k][i] = B1 * m[k][i] + (1 - B1) * gi
                v[k][i] = b2 * v[k][i] + (1 - b2) * gi**2
                m_hat = m[k][i] / (1 - B1**t)
                if rho > 5:
                    r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
                    d, applied = _corrected(v[k][i] / (1 - b2**t), phi[k] / (1 - b2**t))
                    counts[applied] += 1
                    step[k].append(-LR * r * m_hat / (math.sqrt(d) + EPS / math.sqrt(1 - b2**t)))
                else:
                    step[k].append(-LR * m_hat)
        want.append(step)
    # torch.optim.RAdam's form, m_hat sqrt(1 - b2^t) / (sqrt(v) + eps), is the formula above rearranged
    _check(_run(optim.radam(LR, (B1, b2), EPS, noise_bias_correction=True), grads, _sigmas), want, counts, rtol=1e-10)


def test_ademamix_matches_float64_reference_with_noise() -> None:
    b3, alpha = 0.99, 3.0
    grads = _noisy_grads(6)
    m1 = {k: [0.0] * x.numel() for k, x in grads[0].items()}
    m2 = {k: [0.0] * x.numel() for k, x in grads[0].items()}
    v = {k: [0.0] * x.numel() for k, x in grads[0].items()}
    phi = dict.fromkeys(grads[0], 0.0)
    want, counts = [], {True: 0, False: 0}
    for t, g in enumerate(grads, start=1):
        step = {}
        for k, gk in g.items():
            phi[k] = B2 * phi[k] + (1 - B2) * _sigmas(t - 1)[GROUP_OF[k]] ** 2
            step[k] = []
            for i, gi in enumerate(gk.flatten().tolist()):
                m1[k][i] = B1 * m1[k][i] + (1 - B1) * gi
                m2[k][i] = b3 * m2[k][i] + (1 - b3) * gi
                v[k][i] = B2 * v[k][i] + (1 - B2) * gi**2
                d, applied = _corrected(v[k][i], phi[k])  # un-normalized; the factor 1 - b2^t divides the root
                counts[applied] += 1
                numerator = m1[k][i] / (1 - B1**t) + alpha * m2[k][i]
                step[k].append(-LR * numerator / (math.sqrt(d) / math.sqrt(1 - B2**t) + EPS))
        want.append(step)
    opt = optim.ademamix(LR, (B1, B2, b3), alpha, EPS, noise_bias_correction=True)
    _check(_run(opt, grads, _sigmas), want, counts, rtol=1e-10)


def test_correction_enlarges_steps_relative_to_plain() -> None:
    grads = [_tree(i) for i in range(7)]
    pairs = [
        (optim.adam(LR, (B1, B2), EPS, noise_bias_correction=True), optim.adam(LR, (B1, B2), EPS)),
        (optim.rmsprop(LR, noise_bias_correction=True), optim.rmsprop(LR)),
        (optim.adagrad(LR, noise_bias_correction=True), optim.adagrad(LR)),
        (
            optim.stable_adamw(LR, weight_decay=0.0, update_rms_clip=1e9, noise_bias_correction=True),
            optim.adamw(LR, weight_decay=0.0),
        ),
        (optim.radam(LR, (B1, 0.9), noise_bias_correction=True), optim.radam(LR, (B1, 0.9))),
        (optim.ademamix(LR, noise_bias_correction=True), optim.ademamix(LR)),
    ]
    for corrected_opt, plain_opt in pairs:
        corrected, plain = _run(corrected_opt, grads, _sigmas), _run(plain_opt, grads, _sigmas)
        for c, p in zip(corrected, plain, strict=True):
            for k in c:
                assert bool((c[k].abs() >= p[k].abs() * (1 - 1e-6)).all()), corrected_opt.name
        # RAdam's first five updates (b2 = 0.9) are momentum only (no second moment): compare the last one
        assert bool((corrected[-1]["w"].abs() > plain[-1]["w"].abs() * 1.01).any()), corrected_opt.name


def _zero(step: int) -> dict[str, float]:
    return {"big": 0.0, "small": 0.0}


@pytest.mark.parametrize(
    "make",
    [
        lambda bc: optim.adam(LR, (B1, B2), EPS, noise_bias_correction=bc),
        lambda bc: optim.adamw(LR, (B1, B2), EPS, weight_decay=0.0, noise_bias_correction=bc),
        lambda bc: optim.rmsprop(LR, weight_decay=0.1, momentum=0.9, noise_bias_correction=bc),
        lambda bc: optim.adagrad(LR, lr_decay=0.1, noise_bias_correction=bc),
        lambda bc: optim.stable_adamw(LR, noise_bias_correction=bc),
        lambda bc: optim.radam(LR, (B1, 0.9), weight_decay=0.1, noise_bias_correction=bc),
        lambda bc: optim.ademamix(LR, weight_decay=0.1, noise_bias_correction=bc),
    ],
    ids=["adam", "adamw", "rmsprop", "adagrad", "stable_adamw", "radam", "ademamix"],
)
def test_sigma_zero_is_the_plain_optimizer_bitwise(make) -> None:
    grads = [_tree(i, torch.float32) for i in range(5)]
    for g in grads:
        g["b"][0] = 1e-6  # a second moment far below any floor: still the plain optimizer
        g["b"][1] = 0.0  # a zero second moment
    corrected, plain = _run(make(True), grads, _zero), _run(make(False), grads, _zero)
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


def test_centered_rmsprop_with_correction_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"centered=True, noise_bias_correction=True\) is refused"):
        optim.rmsprop(centered=True, noise_bias_correction=True)


# -- the noisy quadratic: 0.5 * sum h (p - target)^2 with Gaussian noise of known std on every gradient ------------

DIM, SIGMA, STEPS, QUAD_LR = 100, 0.1, 300, 0.05


def _quadratic(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.rand(DIM, generator=gen, dtype=torch.float64).add(0.5)
    return h, torch.randn(DIM, generator=gen, dtype=torch.float64), gen


def _distance_ours(opt: optim.Optimizer, seed: int) -> float:
    h, target, gen = _quadratic(seed)
    params = {"w": torch.zeros(DIM, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(STEPS):
        grad = h * (params["w"] - target) + SIGMA * torch.randn(DIM, generator=gen, dtype=torch.float64)
        updates, state = opt.update(Noised({"w": grad}, 1.0, SIGMA), state, params=params)
        params = optim.apply_updates(params, updates)
    return float((params["w"] - target).norm())


def _distance_floored(seed: int, floor: float = 1e-8) -> float:
    """AdamW-BC with the paper's constant floor, ``max(v_hat - phi_hat, floor)``, in float64: the rule we replaced."""
    h, target, gen = _quadratic(seed)
    p, m, v = (torch.zeros(DIM, dtype=torch.float64) for _ in range(3))
    for t in range(1, STEPS + 1):
        g = h * (p - target) + SIGMA * torch.randn(DIM, generator=gen, dtype=torch.float64)
        m, v = B1 * m + (1 - B1) * g, 0.999 * v + (1 - 0.999) * g**2
        d = torch.clamp(v / (1 - 0.999**t) - SIGMA**2, min=floor)
        p = p - QUAD_LR * ((m / (1 - B1**t)) / (d.sqrt() + EPS) + 0.01 * p)
    return float((p - target).norm())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adamw_bc_converges_like_adamw_on_the_noisy_quadratic(seed) -> None:
    start = float(_quadratic(seed)[1].norm())  # about 10
    plain = _distance_ours(optim.adamw(QUAD_LR), seed)
    corrected = _distance_ours(optim.adamw(QUAD_LR, noise_bias_correction=True), seed)
    floored = _distance_floored(seed)
    assert plain < 0.1 * start
    assert corrected < 1.5 * plain, (corrected, plain)
    # The constant floor sends noise-dominated coordinates lr * m_hat / 1e-4 away: the reason for the rule.
    assert floored > 10 * plain, (floored, plain)
