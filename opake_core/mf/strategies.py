"""The closed-form strategies and the functions every strategy shares.

Notation (Choquette-Choo et al. 2023, arXiv:2306.08153; jax_privacy's matrix-factorization conventions):

==============  ==================================================================================
symbol          meaning
==============  ==================================================================================
``A``           workload (``n x n``, lower triangular); prefix sum ``np.tri(n)`` by default
``C``           strategy (encoder), lower-triangular Toeplitz: the mechanism privately releases ``C x + z``
``C^-1``        noising matrix: the noise added to the gradient of step ``t`` is ``(C^-1 z)_t``
``B = A C^-1``  decoder; the noise on the workload's outputs is ``B z``
``n``           the horizon (``n_steps``)
``sens(C)``     ``max_pi ||sum_{j in pi} C[:, j]||`` over the participation patterns ``pi``
error           per-query variance ``||B[i, :]||^2`` for unit-variance ``z``; loss = ``sens^2 * error``
==============  ==================================================================================

Strategies are frozen dataclasses. ``identity``, ``bsr``, ``bisr`` and ``lambda_cgd`` are closed forms. ``band_mf``
and ``blt`` are *specifications* whose coefficients are optimized for a horizon and a participation pattern by
:func:`optimize`, which returns a concrete :class:`~opake_core.mf.band_mf.BandedToeplitz` or
:class:`~opake_core.mf.blt.BufferedToeplitz`. Every function here accepts either; given a specification it
optimizes first (nothing is cached: keep the result of :func:`optimize` to reuse it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf import toeplitz
from opake_core.mf._base import Concrete, StreamPlan
from opake_core.mf.band_mf import BandedToeplitz, BandMF, band_mf
from opake_core.mf.blt import BLT, BufferedToeplitz, blt
from opake_core.mf.participation import SINGLE, Participation

__all__ = [
    "BISR",
    "BLT",
    "BSR",
    "BandMF",
    "BandedToeplitz",
    "BufferedToeplitz",
    "Identity",
    "LambdaCGD",
    "band_mf",
    "bisr",
    "blt",
    "bsr",
    "coefficients",
    "identity",
    "inverse_coefficients",
    "lambda_cgd",
    "materialize",
    "num_buffers",
    "optimize",
]


def _inv_sqrt_series(n: int) -> np.ndarray:
    """Coefficients of ``(1 - x)^(-1/2)``: ``r_k = binom(2k, k) / 4^k`` = 1, 1/2, 3/8, 5/16, ..."""
    r = np.ones(n)
    for k in range(1, n):
        r[k] = r[k - 1] * (2 * k - 1) / (2 * k)
    return r


def _sqrt_series(n: int) -> np.ndarray:
    """Coefficients of ``(1 - x)^(1/2)``: 1, -1/2, -1/8, -1/16, -5/128, ..."""
    s = np.ones(n)
    for k in range(1, n):
        s[k] = s[k - 1] * (k - 1.5) / k
    return s


def _two_factor(series: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """Coefficients of ``f(alpha x) f(beta x)`` for ``f = sum_k series_k x^k``."""
    k = np.arange(series.size)
    return np.convolve(series * alpha**k, series * beta**k)[: series.size]


@dataclass(frozen=True)
class Identity(Concrete):
    """``C = I``: DP-SGD inside the matrix-factorization framework (independent noise, no buffer)."""

    def strategy_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad([1.0], n)

    def noising_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad([1.0], n)

    @property
    def plan(self) -> StreamPlan:
        return StreamPlan("identity")


@dataclass(frozen=True)
class LambdaCGD(Concrete):
    """DP-lambdaCGD (Kalinin, McKenna, Pagh and Lampert 2026, arXiv:2601.22334): ``C^-1 = T([1, -lambda])``.

    Each step cancels a ``lambda`` fraction of the previous step's noise: ``x_t = z_t - lambda z_{t-1}``, so
    ``C = T(1, lambda, lambda^2, ...)`` (positive and decreasing; single-participation ``sens^2 =
    (1 - lambda^(2n)) / (1 - lambda^2)``). No normalization is applied: the noise is scaled by ``sens(C)`` like
    every other strategy. One buffer (the previous ``z``).

    Attributes:
        lambda_: in ``[0, 1)`` (0 is DP-SGD).
    """

    lambda_: float = 0.5

    def __post_init__(self) -> None:
        validate.in_range("lambda_", self.lambda_, 0.0, 1.0, low_open=False, high_open=True)

    def strategy_coef(self, n: int) -> np.ndarray:
        return self.lambda_ ** np.arange(n, dtype=np.float64)

    def noising_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad([1.0, -self.lambda_], n)

    @property
    def plan(self) -> StreamPlan:
        return StreamPlan("fir", (1.0, -self.lambda_))


@dataclass(frozen=True)
class BSR(Concrete):
    """Banded square root (Kalinin and Lampert 2024, arXiv:2405.13763): ``C`` = the first ``bandwidth`` coefficients
    of ``sqrt(A_{alpha, beta})``, zeros after.

    For the momentum / weight-decay workload ``A_{alpha, beta}`` (series ``1 / ((1 - alpha x)(1 - beta x))``),
    ``c_k = sum_{j<=k} r_j r_{k-j} alpha^j beta^(k-j)`` with ``r`` the coefficients of ``(1 - x)^(-1/2)``; for
    ``alpha = 1, beta = 0`` this is the square root of the prefix sum (Fichtenberger et al. 2023). The coefficients
    are positive and non-increasing, so the Toeplitz min-sep sensitivity is exact. ``bandwidth - 1`` buffers.

    Attributes:
        bandwidth: ``p >= 1``.
        alpha: multiplicative weight decay in ``(0, 1]``.
        beta: momentum in ``[0, 1)``, with ``alpha > beta`` (the paper's and reference code's convention).
    """

    bandwidth: int = 8
    alpha: float = 1.0
    beta: float = 0.9

    def __post_init__(self) -> None:
        validate.integer("bandwidth", self.bandwidth, minimum=1)
        validate.in_range("alpha", self.alpha, 0.0, 1.0, low_open=True, high_open=False)
        validate.in_range("beta", self.beta, 0.0, 1.0, low_open=False, high_open=True)
        if not self.alpha > self.beta:
            raise ConfigurationError(
                f"BSR needs alpha > beta (weight decay factor above momentum), got alpha={self.alpha!r}, "
                f"beta={self.beta!r}; use band_mf for other workloads."
            )

    def band(self) -> np.ndarray:
        """The ``bandwidth`` non-zero coefficients of ``C``."""
        return _two_factor(_inv_sqrt_series(self.bandwidth), self.alpha, self.beta)

    def strategy_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad(self.band(), n)

    def noising_coef(self, n: int) -> np.ndarray:
        return toeplitz.inverse_coef(self.band(), n)

    @property
    def plan(self) -> StreamPlan:
        return StreamPlan("iir", tuple(float(v) for v in self.band()))


@dataclass(frozen=True)
class BISR(Concrete):
    """Banded inverse square root (Kalinin, McKenna, Upadhyay and Lampert 2025, arXiv:2505.12128): ``C^-1`` = the
    first ``bandwidth`` coefficients of ``A_{alpha, beta}^(-1/2)``, ``C`` its (dense) inverse.

    For the prefix sum the taps are those of ``(1 - x)^(1/2)``: 1, -1/2, -1/8, -1/16, ... The implied ``C`` is
    positive and non-increasing. ``bandwidth - 1`` buffers (the past ``z``).

    Attributes:
        bandwidth: ``p >= 1`` (1 is the identity).
        alpha: multiplicative weight decay in ``(0, 1]`` of the workload the taps are built for.
        beta: momentum in ``[0, 1)`` of that workload.
    """

    bandwidth: int = 4
    alpha: float = 1.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        validate.integer("bandwidth", self.bandwidth, minimum=1)
        validate.in_range("alpha", self.alpha, 0.0, 1.0, low_open=True, high_open=False)
        validate.in_range("beta", self.beta, 0.0, 1.0, low_open=False, high_open=True)

    def taps(self) -> np.ndarray:
        """The ``bandwidth`` non-zero coefficients of ``C^-1``."""
        return _two_factor(_sqrt_series(self.bandwidth), self.alpha, self.beta)

    def strategy_coef(self, n: int) -> np.ndarray:
        return toeplitz.inverse_coef(self.taps(), n)

    def noising_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad(self.taps(), n)

    @property
    def plan(self) -> StreamPlan:
        return StreamPlan("fir", tuple(float(v) for v in self.taps()))


def identity() -> Identity:
    """``C = I`` (DP-SGD noise).

    Example: independent noise; on the prefix-sum workload step ``i`` carries the noise of ``i + 1`` draws.

        >>> from opake_core import mf
        >>> mf.materialize(mf.identity(), 3)
        array([[1., 0., 0.],
               [0., 1., 0.],
               [0., 0., 1.]])
        >>> mf.per_query_error(mf.identity(), 4)
        array([1., 2., 3., 4.])
    """
    return Identity()


def lambda_cgd(lambda_: float = 0.5) -> LambdaCGD:
    """DP-lambdaCGD, ``C^-1 = T([1, -lambda_])``; see :class:`LambdaCGD`.

    Example:

        >>> from opake_core import mf
        >>> mf.inverse_coefficients(mf.lambda_cgd(0.5), 4), mf.coefficients(mf.lambda_cgd(0.5), 4)
        (array([ 1. , -0.5,  0. ,  0. ]), array([1.   , 0.5  , 0.25 , 0.125]))
    """
    return LambdaCGD(lambda_)


def bsr(bandwidth: int = 8, alpha: float = 1.0, beta: float = 0.9) -> BSR:
    """Banded square root of the momentum / weight-decay workload; see :class:`BSR`.

    Example: without momentum and with a band as long as the horizon, ``C`` is the square root of the prefix sum:
    ``C C = A`` (the Toeplitz coefficients convolve to ones).

        >>> import numpy as np
        >>> from opake_core import mf
        >>> c = mf.coefficients(mf.bsr(bandwidth=5, beta=0.0), 5)
        >>> c
        array([1.       , 0.5      , 0.375    , 0.3125   , 0.2734375])
        >>> np.convolve(c, c)[:5]
        array([1., 1., 1., 1., 1.])
        >>> mf.num_buffers(mf.bsr(bandwidth=3))
        2
    """
    return BSR(bandwidth, alpha, beta)


def bisr(bandwidth: int = 4, alpha: float = 1.0, beta: float = 0.0) -> BISR:
    """Banded inverse square root; see :class:`BISR`.

    Example: the taps of ``C^-1`` are those of ``(1 - x)^(1/2)``, cut after ``bandwidth``.

        >>> from opake_core import mf
        >>> mf.inverse_coefficients(mf.bisr(bandwidth=3), 5)
        array([ 1.   , -0.5  , -0.125,  0.   ,  0.   ])
    """
    return BISR(bandwidth, alpha, beta)


Strategy = Identity | LambdaCGD | BSR | BISR | BandMF | BandedToeplitz | BLT | BufferedToeplitz


def optimize(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> Concrete:
    """The concrete strategy for a horizon: specifications (``band_mf``, ``blt``) are optimized for ``n_steps`` and
    ``participation``; concrete strategies are checked against the horizon and returned as they are.

    Example: optimize once and pass the result to the noise and the accountant alike.

        >>> from opake_core import mf
        >>> concrete = mf.optimize(mf.band_mf(bands=2), 8)
        >>> type(concrete).__name__, concrete.bands, mf.optimize(concrete, 8) is concrete
        ('BandedToeplitz', 2, True)
    """
    with torch.profiler.record_function("opake::mf_optimize"):
        validate.integer("n_steps", n_steps, minimum=1)
        if isinstance(strategy, BandMF | BLT):
            return strategy.optimize(n_steps, participation=participation)
        if not isinstance(strategy, Concrete):
            raise InputTypeError(
                f"expected an opake_core.mf strategy (identity(), band_mf(), blt(), bsr(), bisr(), lambda_cgd()), "
                f"got {type(strategy).__name__}."
            )
        strategy.check_horizon(n_steps)
        return strategy


def coefficients(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> np.ndarray:
    """The first column of ``C`` (length ``n_steps``, float64).

    Example: ``C`` and ``C^-1`` are Toeplitz, so their first columns convolve to the unit impulse.

        >>> import numpy as np
        >>> from opake_core import mf
        >>> c, c_inv = mf.coefficients(mf.bsr(bandwidth=3), 6), mf.inverse_coefficients(mf.bsr(bandwidth=3), 6)
        >>> np.allclose(np.convolve(c, c_inv)[:6], np.eye(6)[0])
        True
    """
    with torch.profiler.record_function("opake::mf_coefficients"):
        return optimize(strategy, n_steps, participation=participation).strategy_coef(n_steps)


def inverse_coefficients(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> np.ndarray:
    """The first column of ``C^-1`` (length ``n_steps``, float64): the weights of the past draws in each step's noise.

    Example:

        >>> from opake_core import mf
        >>> mf.inverse_coefficients(mf.lambda_cgd(0.25), 3)
        array([ 1.  , -0.25,  0.  ])
    """
    with torch.profiler.record_function("opake::mf_inverse_coefficients"):
        return optimize(strategy, n_steps, participation=participation).noising_coef(n_steps)


def materialize(strategy: Any, n_steps: int, *, participation: Participation = SINGLE) -> np.ndarray:
    """The dense ``n_steps x n_steps`` float64 ``C`` (tests and plots; ``O(n^2)`` memory).

    Example:

        >>> from opake_core import mf
        >>> mf.materialize(mf.lambda_cgd(0.5), 3)
        array([[1.  , 0.  , 0.  ],
               [0.5 , 1.  , 0.  ],
               [0.25, 0.5 , 1.  ]])
    """
    with torch.profiler.record_function("opake::mf_materialize"):
        return toeplitz.materialize(coefficients(strategy, n_steps, participation=participation), n_steps)


def num_buffers(strategy: Any, n_steps: int | None = None, *, participation: Participation = SINGLE) -> int:
    """Model-sized buffers the streaming noise keeps: 0 identity, ``bands - 1`` BandMF, ``bandwidth - 1`` BSR and
    BISR, 1 lambda-CGD, the number of buffers of a BLT (a ``blt()`` specification needs ``n_steps``).

    Example:

        >>> from opake_core import mf
        >>> mf.num_buffers(mf.identity()), mf.num_buffers(mf.band_mf(bands=4)), mf.num_buffers(mf.lambda_cgd())
        (0, 3, 1)
    """
    with torch.profiler.record_function("opake::mf_num_buffers"):
        if isinstance(strategy, BandMF):
            return strategy.bands - 1
        if n_steps is None:
            if isinstance(strategy, Concrete):
                return strategy.num_buffers
            raise ConfigurationError("num_buffers(blt(...)) needs n_steps: the buffer count is optimized for it.")
        return optimize(strategy, n_steps, participation=participation).num_buffers
