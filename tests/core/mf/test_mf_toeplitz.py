import numpy as np
import pytest

from opake_core import mf
from opake_core.mf import toeplitz


def test_inverse_and_multiply_match_dense():
    c = np.array([1.0, 0.5, 0.375, 0.3125])
    n = 12
    inv = toeplitz.inverse_coef(c, n)
    np.testing.assert_allclose(toeplitz.materialize(inv, n), np.linalg.inv(toeplitz.materialize(c, n)), atol=1e-12)
    np.testing.assert_allclose(toeplitz.multiply(c, inv, n), np.eye(n)[0], atol=1e-12)


def test_sqrt_of_prefix_sum():
    r = mf.coefficients(mf.bsr(64, alpha=1.0, beta=0.0), 64)
    np.testing.assert_allclose(toeplitz.multiply(r, r, 64), np.ones(64), atol=1e-12)


def test_identity_error_oracle():
    err = mf.expected_error(mf.identity(), 64)
    assert err.mean == pytest.approx(32.5) and err.max == pytest.approx(64.0)


def test_coef_one_minsep_is_min_n_k():
    for n, b, k in [(10, 1, 3), (10, 3, None), (10, 4, 7), (7, 7, 2)]:
        expected = min(k or n, -(-n // b))
        assert toeplitz.minsep_sensitivity_squared([1.0], b, n=n, max_participations=k) == expected


def test_cyclic_equals_minsep_for_full_epochs():
    c = mf.coefficients(mf.bsr(8, 1.0, 0.9), 64)
    assert toeplitz.cyclic_sensitivity_squared(c, 8, n=64) == pytest.approx(
        toeplitz.minsep_sensitivity_squared(c, 8, n=64, max_participations=8), rel=1e-14
    )


def test_reference_coefficients():
    np.testing.assert_allclose(
        mf.bsr(8, 1.0, 0.9).band(),
        [1, 0.95, 0.90375, 0.8609375, 0.8212773438, 0.7845092578, 0.7503956162, 0.7187194097],
        atol=1e-9,
    )
    np.testing.assert_allclose(mf.bisr(5).taps(), [1, -0.5, -0.125, -0.0625, -5 / 128])
    np.testing.assert_allclose(mf.bisr(4, 1.0, 0.9).taps(), [1, -0.95, -0.00125, -0.0011875], atol=1e-12)
    np.testing.assert_allclose(
        mf.coefficients(mf.bisr(4), 8),
        [1, 0.5, 0.375, 0.3125, 0.234375, 0.1796875, 0.138671875, 0.1064453125],
    )
    s2 = mf.sensitivity_squared(mf.lambda_cgd(0.5), 64, participation=mf.MinSepParticipation(8, 8))
    assert s2 == pytest.approx(10.7398, abs=1e-4)
    assert mf.sensitivity_squared(mf.lambda_cgd(0.5), 64) == pytest.approx((1 - 0.25**64) / 0.75)


def test_workload_coefficients_and_matrix():
    w = mf.momentum_weight_decay(alpha=0.99, beta=0.9)
    a = w.toeplitz_coef(10)
    k = np.arange(10)
    np.testing.assert_allclose(a, (0.99 ** (k + 1) - 0.9 ** (k + 1)) / (0.99 - 0.9))
    np.testing.assert_allclose(w.matrix(10), toeplitz.materialize(a, 10), atol=1e-12)
    assert np.array_equal(mf.prefix_sum().matrix(5), np.tri(5))
    lr = mf.lr_schedule(np.linspace(1.0, 0.1, 6))
    np.testing.assert_allclose(lr.matrix(6), np.tri(6) * np.linspace(1.0, 0.1, 6)[None, :])


def test_expected_error_matches_dense_for_every_workload():
    n = 24
    strategy = mf.bsr(4, 1.0, 0.9)
    C_inv = np.linalg.inv(mf.materialize(strategy, n))
    for w in [
        mf.prefix_sum(),
        mf.momentum_weight_decay(alpha=0.98, beta=0.9),
        mf.lr_schedule(np.linspace(1, 0.2, n), beta=0.5, alpha=0.99),
    ]:
        B = w.matrix(n) @ C_inv
        np.testing.assert_allclose(mf.per_query_error(strategy, n, workload=w), (B**2).sum(1), rtol=1e-10)
        e = mf.expected_error(strategy, n, workload=w)
        assert e.mean == pytest.approx((B**2).sum(1).mean()) and e.max == pytest.approx((B**2).sum(1).max())
