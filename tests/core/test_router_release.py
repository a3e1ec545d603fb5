"""The private router load-balancing release (``opake_core.router_release``) and its accounting
(``accounting.moe_aux``).

References are independent of the code under test: the sensitivity is brute-forced over every routing of small
cases, the statistic and the surrogate's gradient are recomputed by Python loops in float64, the accounting is
dp-accounting's own composition of the two Gaussians, the filter is a NumPy re-implementation, and the noise scales
are checked by statistical tests whose false-alarm rates are stated where they run.
"""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import optree
import pytest
import scipy.stats
import torch

from opake_core import accounting, random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.router_release import (
    RouterGeometry,
    load_probabilities,
    load_statistic,
    router_release,
    sum_statistics,
    surrogate_loss,
)
from opake_core.tree import NAMESPACE, Clipped, Noised


def _routing_logits(choices: tuple[tuple[int, ...], ...], layers: int, tokens: int, experts: int) -> torch.Tensor:
    """Logits ``[L, T, E]`` whose top-k in layer ``l``, token ``t`` is ``choices[l * T + t]``."""
    logits = torch.zeros(layers, tokens, experts, dtype=torch.float64)
    for i, chosen in enumerate(choices):
        logits[i // tokens, i % tokens, list(chosen)] = 1.0
    return logits


@pytest.mark.parametrize(
    ("experts", "top_k", "layers", "tokens", "max_tokens", "mean_tokens"),
    [(3, 1, 2, 2, 2, None), (4, 2, 1, 3, 3, None), (4, 2, 2, 2, 2, 1.5), (5, 2, 1, 3, 2, None), (4, 3, 1, 3, 4, 2.0)],
)
def test_sensitivity_is_the_largest_statistic_over_every_routing(
    experts: int, top_k: int, layers: int, tokens: int, max_tokens: int, mean_tokens: float | None
) -> None:
    geometry = RouterGeometry(top_k, experts, layers, max_tokens, mean_tokens)
    subsets = list(itertools.combinations(range(experts), top_k))
    worst = 0.0
    for real in range(tokens + 1):  # every example length up to the padded width, masks included
        mask = torch.zeros(tokens, dtype=torch.float64)
        mask[:real] = 1
        routings = list(itertools.product(subsets, repeat=layers * tokens))
        logits = torch.stack([_routing_logits(r, layers, tokens, experts) for r in routings])
        stats = torch.vmap(lambda lg, m=mask: load_statistic(geometry, lg, m))(logits)
        worst = max(worst, float(stats.flatten(1).norm(dim=1).max()))
    # the brute-force maximum over all routings and lengths is the closed form (attained: one length >= T_max
    # routes every token to the same k experts, when tokens >= max_tokens)
    weight = min(tokens, max_tokens) / geometry.mean_tokens
    attained = weight * math.sqrt(top_k * layers * (1 - top_k / experts))
    assert worst == pytest.approx(attained, rel=1e-12)
    assert worst <= geometry.sensitivity * (1 + 1e-12)
    if tokens >= max_tokens:
        assert worst == pytest.approx(geometry.sensitivity, rel=1e-12)


def test_statistic_matches_a_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    geometry = RouterGeometry(top_k=2, num_experts=5, num_layers=3, max_tokens=4, mean_tokens=3.0)
    logits = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float64)  # 5 real tokens, longer than max_tokens
    expected = np.zeros((3, 5))
    for layer in range(3):
        for t in range(6):
            if mask[t]:
                for e in np.argsort(-logits[layer, t].numpy())[:2]:
                    expected[layer, e] += 1 / 5
    expected = min(5, 4) / 3.0 * (expected - 2 / 5)
    np.testing.assert_allclose(load_statistic(geometry, logits, mask).numpy(), expected, rtol=0, atol=1e-15)
    empty = load_statistic(geometry, logits, torch.zeros(6))
    assert torch.equal(empty, torch.zeros(3, 5, dtype=torch.float64))


def test_surrogate_is_value_neutral_with_the_gradient_of_its_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    geometry = RouterGeometry(top_k=2, num_experts=4, num_layers=2, max_tokens=8, mean_tokens=4.0)
    logits = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1, 1, 1, 0, 0], dtype=torch.float64)
    load = torch.tensor([0.9, 0.3, 0.5, 0.3], dtype=torch.float64)
    value = surrogate_loss(geometry, logits, load, mask)
    assert value.item() == 0.0
    (grad,) = torch.autograd.grad(value, logits)

    def explicit(lg: torch.Tensor) -> torch.Tensor:  # E w sum_e (f_e - k/E) P_e, P averaged by loops
        total = lg.new_zeros(())
        for layer in range(2):
            for t in range(3):
                p = torch.softmax(lg[layer, t], dim=-1)
                total = total + ((load - 0.5) * p).sum() / (3 * 2)
        return 4 * (3 / 4.0) * total

    (expected,) = torch.autograd.grad(explicit(logits), logits)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert torch.equal(grad[:, 3:], torch.zeros_like(grad[:, 3:]))  # padding gets no gradient
    # a descent step moves probability away from the overloaded expert 0, towards the underloaded ones
    after = load_probabilities((logits - 0.1 * grad).detach(), mask)
    before = load_probabilities(logits.detach(), mask)
    assert after[0] < before[0] and after[1] > before[1] and after[3] > before[3]


def test_sum_statistics_sensitivity_and_shape() -> None:
    geometry = RouterGeometry(top_k=1, num_experts=3, num_layers=2, max_tokens=4)
    stats = torch.ones(5, 2, 3)
    clipped = sum_statistics(geometry, stats, expected_batch_size=10)
    assert isinstance(clipped, Clipped) and clipped.value.dtype == torch.float64
    torch.testing.assert_close(clipped.value, torch.full((2, 3), 0.5, dtype=torch.float64))
    assert clipped.sensitivity == pytest.approx(geometry.sensitivity / 10, rel=1e-15)
    with pytest.raises(InputTypeError, match=r"\[B, L=2, E=3\]"):
        sum_statistics(geometry, torch.ones(5, 3, 2), expected_batch_size=10)


def _numpy_filter(released: list[np.ndarray], beta: float, top_k: int) -> np.ndarray:
    m = np.zeros(released[0].shape[1])
    for y in released:
        pooled = y.mean(axis=0)
        m = beta * m + (1 - beta) * (pooled - pooled.mean())
    d = m / (1 - beta ** len(released))
    return np.clip(top_k / m.size + d, 0, 1)


def test_release_noise_filter_and_replay() -> None:
    geometry = RouterGeometry(top_k=2, num_experts=6, num_layers=3, max_tokens=16, mean_tokens=8.0)
    z, rho, b = 1.3, 0.05, 32.0
    release_fn, state = router_release(
        geometry, noise_multiplier=z, expected_batch_size=b, ratio=rho, key=random.key(3), filter_beta=0.9
    )
    gen = torch.Generator().manual_seed(2)
    released = []
    for _ in range(4):
        stats = torch.stack([load_statistic(geometry, torch.randn(3, 7, 6, generator=gen)) for _ in range(20)])
        clipped = sum_statistics(geometry, stats, expected_batch_size=b)
        noised, state = release_fn(clipped, state)
        assert isinstance(noised, Noised) and noised.sensitivity == clipped.sensitivity
        assert noised.noise_std == pytest.approx(z / math.sqrt(rho) * geometry.sensitivity / b, rel=1e-15)
        released.append(noised.value.numpy())
    np.testing.assert_allclose(state.load.numpy(), _numpy_filter(released, 0.9, 2), rtol=0, atol=1e-14)
    assert state.step == 4 and abs(float(state.deviation.sum())) < 1e-14
    assert state.imbalance == pytest.approx(float(np.abs(state.load.numpy() - 1 / 3).max()) * 3, rel=1e-12)
    # the state is a pytree whose only leaf is the filtered tensor, and a saved state replays the same release
    leaves, spec = optree.tree_flatten(state, namespace=NAMESPACE)
    assert len(leaves) == 1 and leaves[0] is state.filtered
    again = optree.tree_unflatten(spec, leaves)
    a, _ = release_fn(clipped, again)
    b_, _ = release_fn(clipped, again)
    assert torch.equal(a.value, b_.value)


def test_release_noise_std_and_filtered_std_statistically() -> None:
    """KS test of the release's noise (false alarm 1e-4) and a chi-square interval on the filter's noise variance
    (two-sided false alarm 1e-4), on a zero statistic over independent keys."""
    geometry = RouterGeometry(top_k=1, num_experts=4, num_layers=2, max_tokens=10)
    z, rho, b, beta = 0.8, 0.1, 16.0, 0.5
    zero = Clipped(torch.zeros(2, 4, dtype=torch.float64), geometry.sensitivity / b)
    sigma = z / math.sqrt(rho) * geometry.sensitivity / b
    draws, deviations = [], []
    for seed in range(1500):
        release_fn, state = router_release(
            geometry, noise_multiplier=z, expected_batch_size=b, ratio=rho, key=random.key(seed), filter_beta=beta
        )
        for _ in range(3):
            noised, state = release_fn(zero, state)
        draws.append(noised.value.flatten().numpy())
        deviations.append(state.deviation[0].item())  # one coordinate per independent run
    assert scipy.stats.kstest(np.concatenate(draws) / sigma, "norm").pvalue > 1e-4
    n = len(deviations)
    ratio = np.sum(np.square(deviations)) / state.filtered_noise_std**2  # ~ chi^2(n): the mean is known to be 0
    assert scipy.stats.chi2.ppf(5e-5, n) < ratio < scipy.stats.chi2.ppf(1 - 5e-5, n)
    # the closed form: v_t = beta^2 v_{t-1} + (1-beta)^2 s_h^2, s_h^2 = sigma^2 / L (E-1)/E
    s2 = sigma**2 / 2 * 3 / 4
    v = 0.0
    for _ in range(3):
        v = beta**2 * v + (1 - beta) ** 2 * s2
    assert state.filtered_noise_std == pytest.approx(math.sqrt(v) / (1 - beta**3), rel=1e-12)


def test_release_refusals() -> None:
    geometry = RouterGeometry(top_k=1, num_experts=4, num_layers=2, max_tokens=10)
    release_fn, state = router_release(geometry, noise_multiplier=1.0, expected_batch_size=4, key=random.key(0))
    good = sum_statistics(geometry, torch.zeros(3, 2, 4), expected_batch_size=4)
    with pytest.raises(InputTypeError, match="Clipped mean"):
        release_fn(good.value, state)
    with pytest.raises(InputTypeError, match="Delta_L / B"):
        release_fn(Clipped(good.value, good.sensitivity / 2), state)
    with pytest.raises(InputTypeError, match=r"\(2, 4\) tensor"):
        release_fn(Clipped(torch.zeros(4, 2), good.sensitivity), state)
    with pytest.raises(ConfigurationError, match="noise_multiplier > 0"):
        router_release(geometry, noise_multiplier=0.0, expected_batch_size=4, key=random.key(0))
    with pytest.raises(ConfigurationError, match="filter_beta"):
        router_release(geometry, noise_multiplier=1.0, expected_batch_size=4, key=random.key(0), filter_beta=1.0)
    with pytest.raises(ConfigurationError, match="ratio"):
        router_release(geometry, noise_multiplier=1.0, expected_batch_size=4, key=random.key(0), ratio=0.0)
    with pytest.raises(ConfigurationError, match="top_k must be smaller than num_experts=4, got 4"):
        RouterGeometry(top_k=4, num_experts=4, num_layers=1, max_tokens=1)
    with pytest.raises(InputTypeError, match=r"\[L=2, T, E=4\]"):
        load_statistic(geometry, torch.zeros(3, 5, 4))


# -- accounting ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("z", "rho"), [(0.8, 0.02), (1.5, 0.5), (3.0, 1.0)])
def test_two_gaussians_are_one_gaussian_at_the_effective_multiplier(z: float, rho: float) -> None:
    pair = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(z), dp_accounting.GaussianDpEvent(z / math.sqrt(rho))]
    )
    single = accounting.to_dp_event(accounting.moe_aux(accounting.gaussian(z), ratio=rho))
    assert single == dp_accounting.GaussianDpEvent(z / math.sqrt(1 + rho))
    # RDP of a Gaussian is alpha / (2 sigma^2): the composition is exact
    orders = [1.5, 2.0, 8.0, 64.0]
    rdp = [dp_accounting.rdp.RdpAccountant(orders).compose(e) for e in (pair, single)]
    for a, b in zip(rdp[0]._rdp, rdp[1]._rdp, strict=True):
        assert a == pytest.approx(b, rel=1e-12)
    # PLD: the same epsilon up to the discretization of the loss distributions
    eps = [
        dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(e).get_epsilon(1e-6)
        for e in (pair, single)
    ]
    assert eps[0] == pytest.approx(eps[1], rel=2e-3)


def test_moe_aux_maps_every_gaussian_of_a_process() -> None:
    z, rho, q = 1.1, 0.02, 0.01
    z_eff = z / math.sqrt(1 + rho)
    run = accounting.compose(
        accounting.repeat(accounting.poisson(accounting.gaussian(z), q), 50),
        accounting.truncated_poisson(accounting.gaussian(z), q, dataset_size=1000, truncated_batch_size=30),
    )
    mapped = accounting.moe_aux(run, ratio=rho)
    expected = accounting.compose(
        accounting.repeat(accounting.poisson(accounting.gaussian(z_eff), q), 50),
        accounting.truncated_poisson(accounting.gaussian(z_eff), q, dataset_size=1000, truncated_batch_size=30),
    )
    assert mapped == expected
    assert accounting.moe_aux_multiplier(z, ratio=rho) == pytest.approx(z_eff, rel=1e-15)
    assert accounting.from_json(accounting.to_json(mapped)) == mapped
    plain = accounting.epsilon(accounting.repeat(accounting.poisson(accounting.gaussian(z), q), 50), delta=1e-5)
    joint = accounting.epsilon(
        accounting.moe_aux(accounting.repeat(accounting.poisson(accounting.gaussian(z), q), 50), ratio=rho), delta=1e-5
    )
    assert joint.value > plain.value  # the router release costs privacy
    with pytest.raises(ConfigurationError, match="fixed clipping bound"):
        accounting.moe_aux(
            accounting.adaptive_clipping(accounting.gaussian(z), count_noise_fraction=0.05, expected_batch_size=8),
            ratio=rho,
        )
    with pytest.raises(InputTypeError, match="DP-SGD process"):
        accounting.moe_aux("gaussian", ratio=rho)
