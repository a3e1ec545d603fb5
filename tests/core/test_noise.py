"""Gaussian noise: distribution, scale, replay, per-group allocation and refusals."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.noise import add_gaussian_noise, gaussian_noise
from opake_core.tree import Clipped, Noised, PerGroup, per_group

N = 100_000


def _noise_of(clipped: Clipped, noise_multiplier: float, seed: int = 0, **kw) -> torch.Tensor:
    noise_fn, state = gaussian_noise(noise_multiplier=noise_multiplier, key=random.key(seed), **kw)
    noised, _ = noise_fn(clipped, state)
    return noised


def test_noise_is_gaussian_with_the_reported_std():
    """KS at level 0.01 (false alarm 1%, fixed seed so deterministic) and std within 6 sigma of its estimator."""
    clipped = Clipped({"a": torch.zeros(N // 2), "b": torch.zeros(N // 2)}, sensitivity=0.8)
    noised = _noise_of(clipped, 1.5)
    assert noised.noise_std == pytest.approx(1.2)
    draws = torch.cat([noised.value["a"], noised.value["b"]]).double().numpy()
    assert stats.kstest(draws / 1.2, "norm").pvalue > 0.01
    realized = math.sqrt((draws**2).mean())
    tolerance = 6 / math.sqrt(2 * N)  # std of the RMS estimator is sigma / sqrt(2N): a 6-sigma band
    assert abs(realized / 1.2 - 1) < tolerance
    # The same checks catch a mechanism whose noise is 3% too small.
    assert stats.kstest(0.97 * draws / 1.2, "norm").pvalue < 0.01
    assert abs(0.97 * realized / 1.2 - 1) > tolerance


def test_leaves_and_steps_get_independent_noise():
    clipped = Clipped({"a": torch.zeros(1000), "b": torch.zeros(1000)}, sensitivity=1.0)
    noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(3))
    first, state1 = noise_fn(clipped, state)
    second, state2 = noise_fn(clipped, state1)
    assert (state.step, state1.step, state2.step) == (0, 1, 2)
    a, b, c = first.value["a"], first.value["b"], second.value["a"]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.15  # |r| > 0.15 has probability < 1e-6 at n=1000
    assert abs(torch.corrcoef(torch.stack([a, c]))[0, 1]) < 0.15


def test_replay_from_saved_state_is_bit_exact():
    clipped = Clipped({"w": torch.randn(4, 5)}, sensitivity=0.5)
    noise_fn, state = gaussian_noise(noise_multiplier=2.0, key=random.key(11))
    _, state = noise_fn(clipped, state)
    saved = state
    out1, _ = noise_fn(clipped, state)
    out2, _ = noise_fn(clipped, saved)
    assert torch.equal(out1.value["w"], out2.value["w"])
    direct = add_gaussian_noise(clipped, noise_multiplier=2.0, key=random.key(11), step=1)
    assert torch.equal(direct.value["w"], out1.value["w"])


def test_zero_multiplier_returns_input_unchanged():
    value = {"w": torch.randn(3)}
    noised = _noise_of(Clipped(value, sensitivity=math.inf), 0.0)
    assert isinstance(noised, Noised) and noised.noise_std == 0.0
    assert noised.value["w"] is value["w"]


def test_per_group_allocation():
    """sigma_k = z * sqrt(C_k * sum_j C_j): z=2, C = {1, 3} gives {4, sqrt(48)}; whitened sensitivity is 1/z."""
    params = {"small": torch.zeros(N), "large": torch.zeros(N)}
    groups = per_group(params, {"small": 1.0, "large": 3.0})
    noised = _noise_of(Clipped(params, sensitivity=groups), 2.0)
    std = noised.noise_std.value_of
    assert std == pytest.approx({"small": 4.0, "large": 6.928203230275509})
    assert sum((c / std[g]) ** 2 for g, c in groups.value_of.items()) == pytest.approx(1 / 4)
    for name, sigma in std.items():
        assert abs(noised.value[name].std().item() / sigma - 1) < 6 / math.sqrt(2 * N)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", torch.float64])
def test_compute_dtype(dtype):
    noised = _noise_of(Clipped({"w": torch.zeros(2000)}, sensitivity=1.0), 1.0, compute_dtype=dtype)
    expected = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert noised.value["w"].dtype == expected
    assert 0.9 < noised.value["w"].float().std().item() < 1.1


def test_draws_depend_on_key_step_and_shape_only():
    a = add_gaussian_noise(Clipped({"w": torch.zeros(8)}, 1.0), noise_multiplier=1.0, key=random.key(0), step=5)
    b = add_gaussian_noise(Clipped({"w": torch.ones(8)}, 1.0), noise_multiplier=1.0, key=random.key(0), step=5)
    c = add_gaussian_noise(Clipped({"w": torch.zeros(8)}, 1.0), noise_multiplier=1.0, key=random.key(0), step=6)
    torch.testing.assert_close(b.value["w"] - 1, a.value["w"], rtol=0, atol=1e-6)
    assert not torch.equal(a.value["w"], c.value["w"])


def test_refusals():
    clipped = Clipped({"w": torch.zeros(3)}, 1.0)
    with pytest.raises(InputTypeError, match="Clipped"):
        _noise_of({"w": torch.zeros(3)}, 1.0)
    with pytest.raises(InputTypeError, match="already went through"):
        _noise_of(Noised({"w": torch.zeros(3)}, 1.0, 1.0), 1.0)
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        gaussian_noise(noise_multiplier=-1.0, key=random.key(0))
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        gaussian_noise(noise_multiplier=math.nan, key=random.key(0))
    with pytest.raises(InputTypeError, match="key"):
        gaussian_noise(noise_multiplier=1.0, key=0)
    with pytest.raises(ConfigurationError, match="compute_dtype"):
        gaussian_noise(noise_multiplier=1.0, key=random.key(0), compute_dtype="int8")
    with pytest.raises(InputTypeError, match="compute_dtype"):
        gaussian_noise(noise_multiplier=1.0, key=random.key(0), compute_dtype=3)
    with pytest.raises(ConfigurationError, match="infinite sensitivity"):
        _noise_of(Clipped({"w": torch.zeros(3)}, math.inf), 1.0)
    noise_fn, _ = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="GaussianNoiseState"):
        noise_fn(clipped, None)
    with pytest.raises(TypeError):
        gaussian_noise(noise_multiplier=1.0, key=random.key(0), bound=3.0)
    mismatched = PerGroup.build({"x": "g"}, {"g": 1.0})
    with pytest.raises(ConfigurationError, match="covers 1 leaves"):
        _noise_of(Clipped({"a": torch.zeros(1), "b": torch.zeros(1)}, mismatched), 1.0)


@pytest.mark.cuda
def test_cuda_replay_is_bit_exact_and_on_device():
    clipped = Clipped({"w": torch.zeros(1 << 20, device="cuda")}, sensitivity=1.0)
    a = add_gaussian_noise(clipped, noise_multiplier=1.0, key=random.key(7), step=3)
    b = add_gaussian_noise(clipped, noise_multiplier=1.0, key=random.key(7), step=3)
    assert a.value["w"].device.type == "cuda"
    assert torch.equal(a.value["w"], b.value["w"])
    draws = a.value["w"].double().cpu().numpy()
    assert stats.kstest(draws, "norm").pvalue > 0.01
