import itertools

import numpy as np
import pytest

from opake_core import mf
from opake_core.mf import toeplitz
from opake_core.mf.band_mf import banded_loss
from opake_core.mf.blt import blt_loss, optimize_buffers


@pytest.mark.parametrize("participation", [mf.SingleParticipation(), mf.MinSepParticipation(4, 8)])
def test_bandmf_loss_does_not_grow_with_bands(participation):
    n = 64
    losses = [
        banded_loss(mf.optimize(mf.band_mf(b), n, participation=participation).coef, n, participation=participation)
        for b in (1, 2, 4, 8, 16)
    ]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in itertools.pairwise(losses))
    fhu = mf.bsr(16, 1.0, 0.0).band()
    assert losses[-1] <= banded_loss(fhu, n, participation=participation) * (1 + 1e-9)


def test_bandmf_with_lr_schedule_and_momentum():
    n = 48
    w = mf.lr_schedule(np.linspace(1.0, 0.1, n), beta=0.9)
    s = mf.optimize(mf.band_mf(6, workload=w), n)
    base = mf.optimize(mf.band_mf(6), n)
    assert banded_loss(s.coef, n, workload=w) <= banded_loss(base.coef, n, workload=w) * (1 + 1e-9)
    assert np.linalg.norm(s.coef) == pytest.approx(1.0)


def test_blt_golden_jax_privacy():
    # jax_privacy buffered_toeplitz_test.test_optimize_single_participation_golden
    blt, _ = optimize_buffers(100_000, 2, objective="max")
    np.testing.assert_allclose(blt.output_scale, [0.0122853238, 0.1878393665], rtol=1e-5)
    np.testing.assert_allclose(blt.buf_decay, [0.9999528892, 0.9857068667], rtol=1e-5)


def test_blt_closed_form_matches_materialized_loss():
    params = np.array([4.0, 1.0, 0.3, 0.2])
    for n in (5, 300):
        closed = blt_loss(params, n)
        concrete = mf.BufferedToeplitz(*_pairs(params))
        c = concrete.strategy_coef(n)
        err = np.cumsum(np.cumsum(concrete.noising_coef(n)) ** 2)
        assert closed == pytest.approx(float(c @ c) * err[-1], rel=1e-10)


def _pairs(params):
    from opake_core.mf.blt import _blt_from_params

    b = _blt_from_params(params)
    return b.buf_decay, b.output_scale


def test_blt_inverse_and_identity():
    b = mf.BufferedToeplitz((0.9, 0.5, 0.1), (0.1, 0.2, 0.3))
    n = 20
    C, C_inv = mf.materialize(b, n), toeplitz.materialize(b.noising_coef(n), n)
    np.testing.assert_allclose(C @ C_inv, np.eye(n), atol=1e-12)
    assert np.array_equal(mf.materialize(mf.BufferedToeplitz((), ()), 5), np.eye(5))
    full = mf.optimize(mf.blt(3, min_buffers=0), 8, participation=mf.MinSepParticipation(1, 8))
    assert full.num_buffers == 0


def test_blt_multi_participation_beats_identity_and_respects_max():
    n, part = 128, mf.MinSepParticipation(8, 16)
    s = mf.optimize(mf.blt(3, objective="mean"), n, participation=part)
    assert 1 <= s.num_buffers <= 3
    ident = mf.expected_error(mf.identity(), n, participation=part, scale_by_sensitivity=True).mean
    assert mf.expected_error(s, n, participation=part, scale_by_sensitivity=True).mean < ident
