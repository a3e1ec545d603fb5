import io
import math

import numpy as np
import pytest
import torch

from opake_core import mf, random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf.streaming import SECOND_MOMENT_STREAM, STREAM
from opake_core.tree import Clipped, Noised, PerGroup

N = 96
SHAPES = {"a": (3, 2), "b": (5,)}
EXPECTED_BUFFERS = {
    "Identity": 0,
    "BandedToeplitz": 7,
    "BufferedToeplitz": None,
    "BSR": 7,
    "BISR": 3,
    "LambdaCGD": 1,
}


def _concrete_strategies():
    return [
        mf.identity(),
        mf.optimize(mf.band_mf(8), N),
        mf.optimize(mf.blt(4), N),
        mf.bsr(8, 1.0, 0.9),
        mf.bisr(4),
        mf.lambda_cgd(0.5),
    ]


STRATEGIES = _concrete_strategies()


def _zeros(dtype=torch.float32):
    return {k: torch.zeros(s, dtype=dtype) for k, s in SHAPES.items()}


def _run(strategy, steps, *, dtype, key, multiplier=1.0, sensitivity=1.0, stream=STREAM):
    fn, state = mf.mf_gaussian_noise(
        _zeros(), strategy, n_steps=N, noise_multiplier=multiplier, key=key, compute_dtype=dtype
    )
    outs = []
    for _ in range(steps):
        noised, state = fn(Clipped(_zeros(), sensitivity), state)
        outs.append(noised)
    return outs, state


def _dense_reference(strategy, key, dtype, stream=STREAM):
    C_inv = np.linalg.inv(mf.materialize(strategy, N))
    names = sorted(SHAPES)  # the tree's leaf order
    leaves = [torch.zeros(SHAPES[name], dtype=dtype) for name in names]
    draws = [random.normal_tree(random.fold_in(key, stream, t), leaves, dtype=dtype) for t in range(N)]
    return {
        name: C_inv @ np.stack([draws[t][i].double().numpy().ravel() for t in range(N)]) for i, name in enumerate(names)
    }


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_streamed_noise_equals_dense_inverse(strategy, dtype, tol):
    key = random.key(7)
    outs, state = _run(strategy, N, dtype=dtype, key=key)
    sens = mf.sensitivity(strategy, N)
    refs = _dense_reference(strategy, key, dtype)
    for name in SHAPES:
        got = np.stack([o.value[name].double().numpy().ravel() for o in outs]) / sens
        np.testing.assert_allclose(got, refs[name], atol=tol, rtol=tol)
    expected = EXPECTED_BUFFERS[type(strategy).__name__]
    expected = strategy.num_buffers if expected is None else expected
    assert len(state.buffers) == expected == mf.num_buffers(strategy)
    for buf in state.buffers:
        assert [tuple(t.shape) for t in buf] == [SHAPES[k] for k in sorted(SHAPES)]
        assert all(t.dtype == dtype for t in buf)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_resume_from_saved_state_continues_identically(strategy):
    key = random.key(3)
    fn, state = mf.mf_gaussian_noise(_zeros(), strategy, n_steps=N, noise_multiplier=1.0, key=key)
    full = []
    for t in range(12):
        if t == 5:
            buf = io.BytesIO()
            torch.save(state, buf)
            saved = buf.getvalue()
        noised, state = fn(Clipped(_zeros(), 1.0), state)
        full.append(noised)
    restored = torch.load(io.BytesIO(saved), weights_only=False)
    fn2, _ = mf.mf_gaussian_noise(_zeros(), strategy, n_steps=N, noise_multiplier=1.0, key=key)
    for t in range(5, 12):
        noised, restored = fn2(Clipped(_zeros(), 1.0), restored)
        for k in SHAPES:
            assert torch.equal(noised.value[k], full[t].value[k])


def test_noise_std_is_marginal_std_and_scales_with_sensitivity():
    strategy = mf.bsr(4, 1.0, 0.9)
    n, z, delta = 8, 1.5, 0.25
    fn, state = mf.mf_gaussian_noise(_zeros(), strategy, n_steps=n, noise_multiplier=z, key=random.key(0))
    C_inv = np.linalg.inv(mf.materialize(strategy, n))
    sens = mf.sensitivity(strategy, n)
    for t in range(n):
        noised, state = fn(Clipped(_zeros(), delta), state)
        assert isinstance(noised, Noised)
        assert noised.noise_std == pytest.approx(z * sens * delta * np.linalg.norm(C_inv[t]), rel=1e-12)
    # empirically: the marginal variance of step 3 over many coordinates
    big = {"w": torch.zeros(200_000)}
    fn, state = mf.mf_gaussian_noise(big, strategy, n_steps=n, noise_multiplier=z, key=random.key(1))
    for _ in range(4):
        noised, state = fn(Clipped(big, delta), state)
    assert noised.value["w"].std().item() == pytest.approx(noised.noise_std, rel=0.01)


def test_participation_scales_noise():
    strategy = mf.lambda_cgd(0.5)
    part = mf.MinSepParticipation(4, 8)
    fn, state = mf.mf_gaussian_noise(
        _zeros(), strategy, n_steps=32, noise_multiplier=1.0, key=random.key(0), participation=part
    )
    noised, _ = fn(Clipped(_zeros(), 1.0), state)
    assert noised.noise_std == pytest.approx(mf.sensitivity(strategy, 32, participation=part))


def test_horizon_latch_and_inputs():
    fn, state = mf.mf_gaussian_noise(_zeros(), mf.lambda_cgd(), n_steps=2, noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="Clipped"):
        fn(Noised(_zeros(), 1.0, 1.0), state)
    _, s1 = fn(Clipped(_zeros(), 1.0), state)
    with pytest.raises(ConfigurationError, match="varying"):
        fn(Clipped(_zeros(), 0.5), s1)
    _, s2 = fn(Clipped(_zeros(), 1.0), s1)
    with pytest.raises(ConfigurationError, match=r"horizon \[0, 2\)"):
        fn(Clipped(_zeros(), 1.0), s2)


def test_zero_multiplier_is_exact_and_state_is_not_mutated():
    fn, state = mf.mf_gaussian_noise(_zeros(), mf.bsr(4), n_steps=4, noise_multiplier=0.0, key=random.key(0))
    x = {k: torch.ones(s) for k, s in SHAPES.items()}
    noised, new = fn(Clipped(x, 1.0), state)
    assert all(torch.equal(noised.value[k], x[k]) for k in SHAPES) and noised.noise_std == 0.0
    fn, state = mf.mf_gaussian_noise(_zeros(), mf.bsr(4), n_steps=4, noise_multiplier=1.0, key=random.key(0))
    _, new = fn(Clipped(_zeros(), 1.0), state)
    assert state.step == 0 and all(torch.count_nonzero(t) == 0 for b in state.buffers for t in b)
    assert new.step == 1


def test_half_precision_compute_keeps_float32_state_unless_asked():
    fn, state = mf.mf_gaussian_noise(
        _zeros(), mf.bsr(4), n_steps=4, noise_multiplier=1.0, key=random.key(0), compute_dtype="bfloat16"
    )
    noised, state = fn(Clipped(_zeros(), 1.0), state)
    assert noised.value["a"].dtype == torch.bfloat16 and state.buffers[0][0].dtype == torch.float32
    _, state = mf.mf_gaussian_noise(
        _zeros(),
        mf.bsr(4),
        n_steps=4,
        noise_multiplier=1.0,
        key=random.key(0),
        compute_dtype="bfloat16",
        state_dtype=torch.bfloat16,
    )
    assert state.buffers[0][0].dtype == torch.bfloat16


def test_per_group_sensitivity():
    groups = PerGroup.build({"a": "g1", "b": "g2"}, {"g1": 1.0, "g2": 2.0})
    fn, state = mf.mf_gaussian_noise(_zeros(), mf.identity(), n_steps=4, noise_multiplier=2.0, key=random.key(0))
    noised, _ = fn(Clipped(_zeros(), groups), state)
    assert noised.noise_std.value_of["g1"] == pytest.approx(2.0 * math.sqrt(1.0 * 3.0))
    assert noised.noise_std.value_of["g2"] == pytest.approx(2.0 * math.sqrt(2.0 * 3.0))


def test_mf_gaussian_noise_is_one_stream():
    """A second stream (private second moments) is only noised as one release with the first, by
    ``opake_core.noise.paired_mf_gaussian_noise``: two streams each noised at the full multiplier would be two
    releases, accounted as one."""
    with pytest.raises(TypeError, match="second_moment_strategy"):
        mf.mf_gaussian_noise(
            _zeros(), mf.bsr(4), n_steps=N, noise_multiplier=1.0, key=random.key(11),
            second_moment_strategy=mf.lambda_cgd(0.5),
        )  # fmt: skip


def test_paired_noise_streams_equal_their_dense_inverses():
    """``paired_mf_gaussian_noise`` with two strategies: each stream is its strategy's ``C^-1 Z`` on its own stream
    tag (the dense inverse), scaled by the stream's noise standard deviation."""
    from opake_core.moments import ClippedMoments
    from opake_core.noise import paired_mf_gaussian_noise

    key = random.key(11)
    first, second = mf.bsr(4), mf.lambda_cgd(0.5)
    fn, state = paired_mf_gaussian_noise(
        _zeros(torch.float64), first, second_moment_strategy=second, n_steps=N, noise_multiplier=1.0, key=key,
        compute_dtype=torch.float64,
    )  # fmt: skip
    pair = ClippedMoments(Clipped(_zeros(torch.float64), 0.5), Clipped(_zeros(torch.float64), 0.25))
    outs = []
    for _ in range(N):
        out, state = fn(pair, state)
        outs.append(out)
    for strategy, stream, pick in ((first, STREAM, "first"), (second, SECOND_MOMENT_STREAM, "second")):
        ref = _dense_reference(strategy, key, torch.float64, stream=stream)
        row0 = abs(float(mf.inverse_coefficients(strategy, N)[0]))
        sigma = getattr(outs[0], pick).noise_std / row0  # the std of the stream's z
        for name in SHAPES:
            got = np.stack([getattr(o, pick).value[name].numpy().ravel() for o in outs]) / sigma
            np.testing.assert_allclose(got, ref[name], atol=1e-10)
