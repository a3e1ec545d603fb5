"""DP-FTRL matrix-factorization strategies: lower-triangular Toeplitz factorizations ``A = B C`` of a workload.

See :mod:`opake_core.mf.strategies` for the notation. Modules: ``toeplitz`` (coefficient algebra), ``workload``,
``participation``, ``strategies`` (identity, BSR, BISR, lambda-CGD and the shared functions), ``band_mf``, ``blt``,
``sensitivity``, ``error`` and ``streaming`` (the streamed Gaussian matrix mechanism: ``mf_gaussian_noise``, and
``opake_core.noise.gaussian_noise`` with ``C = I``).
"""

from opake_core.mf.band_mf import BandedToeplitz, BandMF, band_mf
from opake_core.mf.blt import BLT, BufferedToeplitz, blt
from opake_core.mf.error import ExpectedError, expected_error, per_query_error
from opake_core.mf.participation import CyclicParticipation, MinSepParticipation, SingleParticipation
from opake_core.mf.sensitivity import band_count, sensitivity, sensitivity_squared
from opake_core.mf.strategies import (
    BISR,
    BSR,
    Identity,
    LambdaCGD,
    bisr,
    bsr,
    coefficients,
    identity,
    inverse_coefficients,
    lambda_cgd,
    materialize,
    num_buffers,
    optimize,
)
from opake_core.mf.streaming import GaussianNoiseState, mf_gaussian_noise
from opake_core.mf.workload import Workload, lr_schedule, momentum_weight_decay, prefix_sum

__all__ = [
    "BISR",
    "BLT",
    "BSR",
    "BandMF",
    "BandedToeplitz",
    "BufferedToeplitz",
    "CyclicParticipation",
    "ExpectedError",
    "GaussianNoiseState",
    "Identity",
    "LambdaCGD",
    "MinSepParticipation",
    "SingleParticipation",
    "Workload",
    "band_count",
    "band_mf",
    "bisr",
    "blt",
    "bsr",
    "coefficients",
    "expected_error",
    "identity",
    "inverse_coefficients",
    "lambda_cgd",
    "lr_schedule",
    "materialize",
    "mf_gaussian_noise",
    "momentum_weight_decay",
    "num_buffers",
    "optimize",
    "per_query_error",
    "prefix_sum",
    "sensitivity",
    "sensitivity_squared",
]
