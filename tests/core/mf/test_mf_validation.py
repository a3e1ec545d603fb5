import pytest
import torch

from opake_core import mf, random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import Clipped


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: mf.band_mf(0), "bands"),
        (lambda: mf.band_mf(4, objective="median"), "objective"),
        (lambda: mf.blt(0), "max_buffers"),
        (lambda: mf.blt(16), "max_buffers"),
        (lambda: mf.blt(3, min_buffers=4), "min_buffers"),
        (lambda: mf.bsr(8, alpha=0.9, beta=0.9), "alpha > beta"),
        (lambda: mf.bsr(8, alpha=0.5, beta=0.9), "alpha > beta"),
        (lambda: mf.bsr(0), "bandwidth"),
        (lambda: mf.bsr(8, alpha=1.5), "alpha"),
        (lambda: mf.bsr(8, alpha=0.0, beta=0.0), "alpha"),
        (lambda: mf.bisr(0), "bandwidth"),
        (lambda: mf.bisr(4, beta=1.0), "beta"),
        (lambda: mf.lambda_cgd(1.0), "lambda_"),
        (lambda: mf.lambda_cgd(-0.1), "lambda_"),
        (lambda: mf.lambda_cgd(float("nan")), "lambda_"),
        (lambda: mf.MinSepParticipation(0), "min_sep"),
        (lambda: mf.MinSepParticipation(2, 0), "max_participations"),
        (lambda: mf.CyclicParticipation(0), "cycle_length"),
        (lambda: mf.Workload(beta=1.0), "beta"),
        (lambda: mf.lr_schedule([1.0, -1.0]), "learning_rates"),
        (lambda: mf.BufferedToeplitz((1.2,), (0.1,)), "buf_decay"),
        (lambda: mf.BufferedToeplitz((0.9,), (-0.1,)), "output_scale"),
        (lambda: mf.BufferedToeplitz((0.9, 0.5), (0.1,)), "same length"),
        (lambda: mf.BandedToeplitz((0.0, 1.0)), "coef"),
        (lambda: mf.optimize(mf.band_mf(16), 8), "bands <= n_steps"),
        (lambda: mf.optimize(mf.BandedToeplitz((1.0, 0.5, 0.2)), 2), "bands <= n_steps"),
        (lambda: mf.optimize(mf.band_mf(2, workload=mf.lr_schedule([1.0] * 4)), 8), "n_steps=8"),
        (lambda: mf.optimize(mf.identity(), 0), "n_steps"),
    ],
)
def test_documented_constraints_raise(build, match):
    with pytest.raises(ConfigurationError, match=match):
        build()


def test_type_errors():
    with pytest.raises(InputTypeError, match="bands"):
        mf.band_mf(4.0)
    with pytest.raises(InputTypeError, match="strategy"):
        mf.optimize("bandmf", 8)
    template = {"w": torch.zeros(3)}
    with pytest.raises(InputTypeError, match="n_steps"):
        mf.mf_gaussian_noise(template, mf.identity(), n_steps=True, noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="n_steps"):
        mf.mf_gaussian_noise(template, mf.identity(), n_steps=8.0, noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(ConfigurationError, match="n_steps"):
        mf.mf_gaussian_noise(template, mf.identity(), n_steps=0, noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        mf.mf_gaussian_noise(template, mf.identity(), n_steps=4, noise_multiplier=-1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="key"):
        mf.mf_gaussian_noise(template, mf.identity(), n_steps=4, noise_multiplier=1.0, key=0)
    with pytest.raises(ConfigurationError, match="compute_dtype"):
        mf.mf_gaussian_noise(
            template, mf.identity(), n_steps=4, noise_multiplier=1.0, key=random.key(0), compute_dtype="int8"
        )
    fn, state = mf.mf_gaussian_noise(template, mf.identity(), n_steps=4, noise_multiplier=1.0, key=random.key(0))
    with pytest.raises(InputTypeError, match="Clipped"):
        fn(template, state)
    with pytest.raises(ConfigurationError, match="bands <= n_steps"):
        mf.mf_gaussian_noise(template, mf.band_mf(8), n_steps=4, noise_multiplier=1.0, key=random.key(0))
    assert isinstance(Clipped(template, 1.0), Clipped)
