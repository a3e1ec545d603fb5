import itertools

import numpy as np
import pytest

from opake_core import mf

N = 12


def _brute_force_squared(C: np.ndarray, patterns) -> float:
    return max(float(np.sum(C[:, list(p)], axis=1) @ np.sum(C[:, list(p)], axis=1)) for p in patterns)


def _minsep_patterns(n, b, k):
    for size in range(1, k + 1):
        for p in itertools.combinations(range(n), size):
            if all(q - r >= b for r, q in itertools.pairwise(p)):
                yield p


def _cyclic_patterns(n, b):
    for r in range(b):
        steps = list(range(r, n, b))
        for size in range(1, len(steps) + 1):
            yield from itertools.combinations(steps, size)


STRATEGIES = [
    mf.identity(),
    mf.band_mf(4),
    mf.blt(3),
    mf.bsr(4, 1.0, 0.9),
    mf.bsr(3, 0.99, 0.5),
    mf.bisr(4),
    mf.bisr(3, 1.0, 0.9),
    mf.lambda_cgd(0.5),
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: type(s).__name__)
def test_closed_forms_equal_brute_force(strategy):
    concrete = mf.optimize(strategy, N)
    C = mf.materialize(concrete, N)
    assert mf.sensitivity_squared(concrete, N) == pytest.approx(
        _brute_force_squared(C, [(j,) for j in range(N)]), rel=1e-10
    )
    for b, k in [(1, 3), (2, 4), (3, None), (5, 2)]:
        part = mf.MinSepParticipation(b, k)
        kk = k if k is not None else -(-N // b)
        expected = _brute_force_squared(C, _minsep_patterns(N, b, kk))
        assert mf.sensitivity_squared(concrete, N, participation=part) == pytest.approx(expected, rel=1e-10)
    for b in [1, 3, 4]:
        expected = _brute_force_squared(C, _cyclic_patterns(N, b))
        got = mf.sensitivity_squared(concrete, N, participation=mf.CyclicParticipation(b))
        assert got == pytest.approx(expected, rel=1e-10)


def test_optimized_strategies_have_monotone_coefficients():
    for strategy in [mf.band_mf(8), mf.blt(4)]:
        c = mf.coefficients(strategy, 64, participation=mf.MinSepParticipation(8, 8))
        assert np.all(c >= 0) and np.all(np.diff(c) <= 1e-12)


def test_band_count():
    assert mf.band_count(mf.band_mf(4), 32) == 4
    assert mf.band_count(mf.bsr(8), 32) == 8
    assert mf.band_count(mf.identity(), 32) == 1
    assert mf.band_count(mf.lambda_cgd(), 32) == 32


def test_bandmf_orthogonal_columns_sensitivity_is_k():
    s = mf.optimize(mf.band_mf(4), 64, participation=mf.MinSepParticipation(4, 16))
    assert mf.sensitivity_squared(s, 64) == pytest.approx(1.0)
    assert mf.sensitivity_squared(s, 64, participation=mf.MinSepParticipation(4, 16)) == pytest.approx(16.0)
