"""BandMF: a banded lower-triangular Toeplitz ``C`` optimized for a horizon (Choquette-Choo et al. 2023,
arXiv:2306.08153; the Toeplitz parameterization of McKenna 2024, arXiv:2405.15913).

``C[i, j] = c_{i-j}`` for ``0 <= i - j < bands`` and 0 further down, so columns at least ``bands`` apart are
orthogonal. The ``bands`` coefficients minimize ``loss(c) = sens^2(c) * reduce_i ||B[i, :]||^2`` for the workload
``A`` (``B = A C^-1``) with scipy's L-BFGS-B on the host (float64, coefficients kept non-negative), starting from
the truncated square root of the prefix sum; the loss is scale-invariant and the result is normalized to
``||c|| = 1``. One loss evaluation costs ``O(n bands)`` for a Toeplitz workload plus an FFT (``O(n^2)`` with a
learning-rate schedule). Streaming ``C^-1`` keeps ``bands - 1`` past outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import torch

from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.mf import _autodiff, toeplitz
from opake_core.mf._base import Concrete, StreamPlan
from opake_core.mf.participation import SINGLE, Participation
from opake_core.mf.workload import PREFIX_SUM, Workload

__all__ = ["BandMF", "BandedToeplitz", "band_mf", "banded_loss", "optimize_banded"]

_OBJECTIVES = ("mean", "max")


def _objective(name: str, value: str) -> str:
    if value not in _OBJECTIVES:
        raise ConfigurationError(f"{name} must be one of {_OBJECTIVES}, got {value!r}.")
    return value


@dataclass(frozen=True)
class BandedToeplitz(Concrete):
    """A banded lower-triangular Toeplitz ``C`` with the given non-zero coefficients (an optimized BandMF).

    Attributes:
        coef: ``c_0 .. c_{bands-1}``, finite, ``c_0 > 0``.

    Example: a hand-made 2-banded ``C``; its inverse is dense.

        >>> from opake_core import mf
        >>> strategy = mf.BandedToeplitz((1.0, 0.5))
        >>> mf.coefficients(strategy, 4), mf.inverse_coefficients(strategy, 4)
        (array([1. , 0.5, 0. , 0. ]), array([ 1.   , -0.5  ,  0.25 , -0.125]))
        >>> mf.band_count(strategy, 4), mf.num_buffers(strategy)
        (2, 1)
    """

    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        c = tuple(float(v) for v in np.asarray(self.coef, dtype=np.float64).ravel())
        if not c or not all(np.isfinite(c)) or not c[0] > 0:
            raise ConfigurationError(f"coef must be finite with coef[0] > 0, got {self.coef!r}.")
        object.__setattr__(self, "coef", c)

    @property
    def bands(self) -> int:
        return len(self.coef)

    def strategy_coef(self, n: int) -> np.ndarray:
        return toeplitz.pad(self.coef, n)

    def noising_coef(self, n: int) -> np.ndarray:
        return toeplitz.inverse_coef(self.coef, n)

    @property
    def plan(self) -> StreamPlan:
        return StreamPlan("iir", self.coef)

    def check_horizon(self, n: int) -> None:
        if self.bands > n:
            raise ConfigurationError(f"BandMF needs bands <= n_steps, got bands={self.bands} and n_steps={n}.")


def banded_loss(
    coef: np.ndarray,
    n: int,
    *,
    participation: Participation = SINGLE,
    workload: Workload = PREFIX_SUM,
    objective: str = "mean",
    grad: bool = False,
) -> float | tuple[float, np.ndarray]:
    """``sens^2 * reduce(error)`` of the banded Toeplitz strategy ``coef`` (and its gradient when ``grad``).

    The sensitivity is the Toeplitz min-sep closed form on the raw coefficients (exact for non-negative,
    non-increasing ones, which the optimum has); ``objective`` picks the mean or the max per-query error.
    """
    c = torch.tensor(np.asarray(coef, dtype=np.float64), requires_grad=grad)
    min_sep, k = participation.min_sep_and_count(n)
    padded = torch.nn.functional.pad(c, (0, max(0, n - c.numel())))[:n]
    sens2 = _autodiff.minsep_sensitivity_squared(padded, min_sep, k)
    err = _autodiff.per_query_error(_autodiff.inverse_series(c, n), workload, n)
    loss = sens2 * (err.mean() if objective == "mean" else err.max())
    if not grad:
        return float(loss)
    loss.backward()
    return float(loss.detach()), c.grad.numpy().copy()


def optimize_banded(
    n: int,
    bands: int,
    *,
    participation: Participation = SINGLE,
    workload: Workload = PREFIX_SUM,
    objective: str = "mean",
    max_iterations: int = 500,
) -> BandedToeplitz:
    """Optimize ``bands`` Toeplitz coefficients for horizon ``n`` (see the module docstring)."""
    validate.integer("n", n, minimum=1)
    validate.integer("bands", bands, minimum=1)
    if bands > n:
        raise ConfigurationError(f"BandMF needs bands <= n_steps, got bands={bands} and n_steps={n}.")
    workload.rates(n)  # a schedule shorter than the horizon fails here, before the optimization
    init = np.ones(bands)
    for k in range(1, bands):
        init[k] = init[k - 1] * (2 * k - 1) / (2 * k)
    if bands == 1:
        return BandedToeplitz((1.0,))
    scale = banded_loss(init, n, participation=participation, workload=workload, objective=objective)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        value, g = banded_loss(x, n, participation=participation, workload=workload, objective=objective, grad=True)
        return value / scale, g / scale

    bounds = [(1e-6, None)] + [(0.0, None)] * (bands - 1)
    result = scipy.optimize.minimize(
        fun,
        init,
        jac=True,
        method="L-BFGS-B",
        bounds=bounds,
        options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10},
    )
    x = result.x if result.fun <= 1.0 else init
    if not np.all(np.isfinite(x)):
        raise ConfigurationError(f"BandMF optimization diverged for n_steps={n}, bands={bands}: {result.message}")
    return BandedToeplitz(tuple(x / np.linalg.norm(x)))


@dataclass(frozen=True)
class BandMF:
    """Specification of BandMF: ``bands`` Toeplitz coefficients optimized by :func:`optimize_banded`.

    Attributes:
        bands: ``>= 1`` (1 is the identity); must be ``<= n_steps`` when optimized.
        workload: the workload ``A`` the error is measured on (prefix sum by default).
        objective: ``"mean"`` (mean squared error over the steps) or ``"max"`` (worst step).
    """

    bands: int = 16
    workload: Workload = field(default_factory=Workload)
    objective: str = "mean"

    def __post_init__(self) -> None:
        validate.integer("bands", self.bands, minimum=1)
        _objective("objective", self.objective)
        if not isinstance(self.workload, Workload):
            raise ConfigurationError(f"workload must be an opake_core.mf.Workload, got {type(self.workload).__name__}.")

    def optimize(self, n: int, *, participation: Participation = SINGLE) -> BandedToeplitz:
        """The optimized :class:`BandedToeplitz` for horizon ``n`` and ``participation``."""
        return optimize_banded(
            n, self.bands, participation=participation, workload=self.workload, objective=self.objective
        )


def band_mf(bands: int = 16, *, workload: Workload | None = None, objective: str = "mean") -> BandMF:
    """BandMF with ``bands`` bands (optimized for the horizon when used); see :class:`BandMF`.

    Example: at equal privacy (error times squared sensitivity) two bands already beat independent noise on the
    prefix sum over 8 steps.

        >>> from opake_core import mf
        >>> banded = mf.expected_error(mf.band_mf(bands=2), 8, scale_by_sensitivity=True)
        >>> independent = mf.expected_error(mf.identity(), 8, scale_by_sensitivity=True)
        >>> round(banded.mean, 3), independent.mean
        (3.061, 4.5)
    """
    return BandMF(bands, workload if workload is not None else Workload(), objective)
