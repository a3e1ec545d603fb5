"""Schedule-Free AdamW against float64 loops that keep the paper's three sequences x, z and y explicitly: Algorithm 1
of Defazio et al. 2024 ("The Road Less Scheduled") where it and the authors' implementation coincide (b2 = 0), and
the implementation's weighting (r, weight_lr_power, running-maximum learning rate) and bias correction otherwise.
The optimizer itself keeps only z and updates y in place of x, so these loops check that algebra too."""

from __future__ import annotations

import math

import pytest
import torch
from noisy_quadratic import flat, gradient, run, start

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_core.optim import schedules
from opake_core.tree import Noised

STEPS = 80
CLOSE = {"rel_tol": 1e-12, "abs_tol": 1e-12}


def _algorithm_1(lr: float, b1: float, b2: float, eps: float, decay: float, warmup: int):
    """The paper's box, line by line: returns (x_{T+1}, y_{T+1})."""
    x = {k: v.flatten().tolist() for k, v in start().items()}
    z = {k: list(v) for k, v in x.items()}
    v = {k: [0.0] * len(p) for k, p in x.items()}
    gammas_squared = 0.0
    for t in range(1, STEPS + 1):
        y = {k: [(1 - b1) * zi + b1 * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
        gamma = lr * math.sqrt(1 - b2**t) * min(1.0, t / warmup)
        gammas_squared += gamma**2
        c = gamma**2 / gammas_squared
        for k in x:
            g = gradient(k, y[k], t - 1)
            for i, gi in enumerate(g):
                v[k][i] = b2 * v[k][i] + (1 - b2) * gi**2
                z[k][i] = z[k][i] - gamma * gi / (math.sqrt(v[k][i]) + eps) - gamma * decay * y[k][i]
                x[k][i] = (1 - c) * x[k][i] + c * z[k][i]
    y = {k: [(1 - b1) * zi + b1 * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
    return x, y


def _implementation(lr, b1, b2, eps, decay, warmup, r, power):
    """The same three sequences with the authors' implementation's choices: v_hat = v / (1 - b2^t) under the square
    root, weights t^r * (max gamma so far)^power. ``lr`` is a float or a schedule of the update index (from 0)."""
    x = {k: v.flatten().tolist() for k, v in start().items()}
    z = {k: list(v) for k, v in x.items()}
    v = {k: [0.0] * len(p) for k, p in x.items()}
    weights, lr_max = 0.0, 0.0
    for t in range(1, STEPS + 1):
        y = {k: [(1 - b1) * zi + b1 * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
        gamma = (lr(t - 1) if callable(lr) else lr) * (min(1.0, t / warmup) if warmup else 1.0)
        lr_max = max(lr_max, gamma)
        weight = t**r * lr_max**power
        weights += weight
        c = weight / weights if weights > 0 else 0.0
        for k in x:
            g = gradient(k, y[k], t - 1)
            for i, gi in enumerate(g):
                v[k][i] = b2 * v[k][i] + (1 - b2) * gi**2
                d = gi / (math.sqrt(v[k][i] / (1 - b2**t)) + eps) + decay * y[k][i]
                z[k][i] = z[k][i] - gamma * d
                x[k][i] = (1 - c) * x[k][i] + c * z[k][i]
    y = {k: [(1 - b1) * zi + b1 * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
    return x, y


def _ours(opt: optim.Optimizer):
    params, state = run(opt, STEPS)
    return flat(opt.eval_params(state, params)), flat(params)


def _assert_close(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    for k in want:
        assert all(math.isclose(a, b, **CLOSE) for a, b in zip(got[k], want[k], strict=True)), k


@pytest.mark.parametrize(
    ("lr", "b1", "eps", "decay", "warmup"),
    [(1e-2, 0.9, 1e-8, 0.0, 1), (2e-2, 0.8, 1e-3, 0.05, 10), (5e-3, 0.95, 1e-6, 0.2, 40)],
)
def test_matches_algorithm_1_where_the_paper_and_the_implementation_agree(lr, b1, eps, decay, warmup) -> None:
    opt = optim.schedule_free_adamw(lr, (b1, 0.0), eps, decay, warmup_steps=warmup)
    x, y = _ours(opt)
    want_x, want_y = _algorithm_1(lr, b1, 0.0, eps, decay, warmup)
    _assert_close(x, want_x)
    _assert_close(y, want_y)


@pytest.mark.parametrize(
    ("lr", "betas", "decay", "warmup", "r", "power"),
    [
        (2.5e-3, (0.9, 0.999), 0.0, 0, 0.0, 2.0),
        (1e-2, (0.9, 0.99), 0.1, 20, 0.0, 2.0),
        (1e-2, (0.7, 0.95), 0.01, 5, 1.0, 1.5),
        (schedules.linear(2e-2, 1e-3, STEPS, transition_begin=10), (0.9, 0.999), 0.05, 10, 0.5, 2.0),  # lr_max
        (schedules.with_warmup(schedules.constant(1e-2), 5), (0.9, 0.999), 0.0, 0, 0.0, 2.0),  # lr 0 first
    ],
    ids=["defaults", "warmup_decay", "r_and_power", "decaying_schedule", "zero_first_rate"],
)
def test_matches_the_implementation_loop(lr, betas, decay, warmup, r, power) -> None:
    opt = optim.schedule_free_adamw(lr, betas, 1e-8, decay, warmup_steps=warmup, r=r, weight_lr_power=power)
    x, y = _ours(opt)
    want_x, want_y = _implementation(lr, *betas, 1e-8, decay, warmup, r, power)
    _assert_close(x, want_x)
    _assert_close(y, want_y)
    assert x != y


def test_eval_params_at_init_and_for_other_optimizers() -> None:
    params = start()
    opt = optim.schedule_free_adamw()
    x = opt.eval_params(opt.init(params), params)
    assert x is not params and all(torch.equal(x[k], params[k]) for k in params)  # x_1 = z_1 = y_1
    adam = optim.adam()
    assert adam.eval_params(adam.init(params), params) is params


def test_eval_params_does_not_touch_its_inputs() -> None:
    opt, params = optim.schedule_free_adamw(1e-2), start()
    grads = Noised({k: torch.ones_like(v) for k, v in params.items()}, 1.0, 0.1)
    updates, state = opt.update(grads, opt.init(params), params=params)
    params = optim.apply_updates(params, updates)
    before = ({k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in state.z.items()})
    opt.eval_params(state, params)
    assert all(torch.equal(params[k], before[0][k]) and torch.equal(state.z[k], before[1][k]) for k in params)


def test_b1_zero_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"betas\[0\] must lie in \(0, 1\) for schedule_free_adamw, got 0.0"):
        optim.schedule_free_adamw(betas=(0.0, 0.999))


# -- schedule_free(base): the three sequences around any optimizer ------------------------------------------------


def _momentum_base(lr: float, mu: float, decay: float):
    """Heavy-ball SGD with L2 decay, one coordinate at a time: ``(init(n), step(g, z, state) -> (u, state))``."""

    def step(g, z, b):
        b = [mu * bi + gi + decay * zi for bi, gi, zi in zip(b, g, z, strict=True)]
        return [-lr * bi for bi in b], b

    return (lambda n: [0.0] * n), step


def _adagrad_bc_base(lr: float, sigma: float):
    """Adagrad with the summed noise variance removed (where the difference is positive)."""

    def step(g, z, state):
        s, noise = state
        s, noise = [si + gi**2 for si, gi in zip(s, g, strict=True)], noise + sigma**2
        d = [si - noise if si - noise > 0 else si for si in s]
        return [-lr * gi / (math.sqrt(di) + 1e-10) for gi, di in zip(g, d, strict=True)], (s, noise)

    return (lambda n: ([0.0] * n, 0.0)), step


def _wrapped(base, beta: float, warmup: int):
    """x, y and z kept explicitly: returns (x_{T+1}, y_{T+1})."""
    init, step = base
    x = {k: v.flatten().tolist() for k, v in start().items()}
    z = {k: list(v) for k, v in x.items()}
    state = {k: init(len(v)) for k, v in x.items()}
    for t in range(1, STEPS + 1):
        y = {k: [(1 - beta) * zi + beta * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
        c = 1.0 if t <= warmup else 1 / (t - warmup + 1)
        for k in x:
            u, state[k] = step(gradient(k, y[k], t - 1), z[k], state[k])
            z[k] = [zi + ui for zi, ui in zip(z[k], u, strict=True)]
            x[k] = [(1 - c) * xi + c * zi for xi, zi in zip(x[k], z[k], strict=True)]
    y = {k: [(1 - beta) * zi + beta * xi for zi, xi in zip(z[k], x[k], strict=True)] for k in x}
    return x, y


@pytest.mark.parametrize(("beta", "warmup"), [(0.9, 0), (0.5, 10), (1.0, 3)])
def test_wrapper_matches_the_three_sequences_around_momentum(beta, warmup) -> None:
    opt = optim.schedule_free(optim.momentum(2e-2, 0.8, weight_decay=0.05), beta=beta, warmup_steps=warmup)
    x, y = _ours(opt)
    want_x, want_y = _wrapped(_momentum_base(2e-2, 0.8, 0.05), beta, warmup)
    _assert_close(x, want_x)
    _assert_close(y, want_y)
    assert opt.name == "schedule_free_momentum"


def test_wrapper_keeps_the_base_noise_correction() -> None:
    # noisy_quadratic.run passes noise_std 0.3 with every gradient
    opt = optim.schedule_free(optim.adagrad(0.1, noise_bias_correction=True), beta=0.8, warmup_steps=5)
    assert opt.noise_aware
    x, y = _ours(opt)
    want_x, want_y = _wrapped(_adagrad_bc_base(0.1, 0.3), 0.8, 5)
    _assert_close(x, want_x)
    _assert_close(y, want_y)


def test_wrapper_refusals() -> None:
    with pytest.raises(ConfigurationError, match=r"beta must lie in \(0, 1\], got 0.0"):
        optim.schedule_free(optim.sgd(0.1), beta=0.0)
    with pytest.raises(ConfigurationError, match="schedule-free already"):
        optim.schedule_free(optim.schedule_free_adamw())
    with pytest.raises(ConfigurationError, match="got MomentsOptimizer"):
        optim.schedule_free(optim.private_moments_adam())
