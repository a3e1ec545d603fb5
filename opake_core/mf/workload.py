"""Workloads ``A``: the linear maps from the gradient stream to the quantities training actually uses.

SGD with momentum ``beta`` and multiplicative weight decay ``alpha`` (``alpha = 1``: no decay) and learning rates
``eta_t`` on the step axis,

    m_t = beta m_{t-1} + g_t,        theta_t = alpha theta_{t-1} - eta_t m_t,

gives ``theta_t - alpha^t theta_0 = -(A g)_t`` with ``A = T(alpha^k) diag(eta) T(beta^k)``. Without a schedule
(``eta = 1``) ``A`` is lower-triangular Toeplitz with coefficients ``a_k = sum_{j<=k} alpha^(k-j) beta^j`` (the
series ``1 / ((1 - alpha x)(1 - beta x))``), the workload of Kalinin and Lampert 2024 (arXiv:2405.13763); with
``alpha = 1, beta = 0`` it is the prefix sum ``np.tri(n)`` of plain DP-FTRL.

The workload changes only which strategy is good (through the error), never the privacy: noise released as
``x + C^-1 z`` stays private under any post-processing ``A``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.signal

from opake_core import validate
from opake_core.errors import ConfigurationError

__all__ = ["PREFIX_SUM", "Workload", "lr_schedule", "momentum_weight_decay", "prefix_sum"]


@dataclass(frozen=True)
class Workload:
    """The workload ``A = T(alpha^k) diag(learning_rates) T(beta^k)``.

    Attributes:
        alpha: multiplicative weight decay per step, in ``(0, 1]`` (1: none).
        beta: momentum, in ``[0, 1)`` (0: none).
        learning_rates: per-step learning rates (positive, at least ``n`` of them when evaluated at horizon ``n``),
            or ``None`` for a constant rate (the workload is then Toeplitz).
    """

    alpha: float = 1.0
    beta: float = 0.0
    learning_rates: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        validate.in_range("alpha", self.alpha, 0.0, 1.0, low_open=True, high_open=False)
        validate.in_range("beta", self.beta, 0.0, 1.0, low_open=False, high_open=True)
        if self.learning_rates is not None:
            lrs = tuple(float(v) for v in self.learning_rates)
            if not lrs or not all(math.isfinite(v) and v > 0 for v in lrs):
                raise ConfigurationError(
                    "learning_rates must be a non-empty sequence of positive finite floats, "
                    f"got {self.learning_rates!r}."
                )
            object.__setattr__(self, "learning_rates", lrs)

    @property
    def is_toeplitz(self) -> bool:
        """True without a learning-rate schedule."""
        return self.learning_rates is None

    def toeplitz_coef(self, n: int) -> np.ndarray:
        """``a_k = sum_{j<=k} alpha^(k-j) beta^j`` for ``k < n``: the Toeplitz part (all of ``A`` without a schedule).

        Computed as the impulse response of ``1 / ((1 - alpha x)(1 - beta x))``, which is also well defined for
        ``alpha == beta`` (``(k+1) alpha^k``).
        """
        validate.integer("n", n, minimum=1)
        impulse = np.zeros(n)
        impulse[0] = 1.0
        return scipy.signal.lfilter([1.0], [1.0, -(self.alpha + self.beta), self.alpha * self.beta], impulse)

    def rates(self, n: int) -> np.ndarray:
        """The first ``n`` learning rates (ones without a schedule)."""
        validate.integer("n", n, minimum=1)
        if self.learning_rates is None:
            return np.ones(n)
        if len(self.learning_rates) < n:
            raise ConfigurationError(
                f"the workload's learning-rate schedule covers {len(self.learning_rates)} steps, fewer than the "
                f"horizon n_steps={n}; give at least {n} learning rates."
            )
        return np.asarray(self.learning_rates[:n], dtype=np.float64)

    def matrix(self, n: int) -> np.ndarray:
        """The dense ``n x n`` float64 matrix ``A``."""
        idx = np.arange(n)
        lag = idx[:, None] - idx[None, :]
        lower = lag >= 0
        decay = np.where(lower, self.alpha ** np.maximum(lag, 0), 0.0)
        momentum = np.where(lower, self.beta ** np.maximum(lag, 0), 0.0)
        return decay @ (self.rates(n)[:, None] * momentum)


def prefix_sum() -> Workload:
    """``A = np.tri(n)``: plain SGD (DP-FTRL's default workload).

    Example:

        >>> from opake_core import mf
        >>> mf.prefix_sum().matrix(3)
        array([[1., 0., 0.],
               [1., 1., 0.],
               [1., 1., 1.]])
    """
    return Workload()


def momentum_weight_decay(*, alpha: float = 1.0, beta: float = 0.9) -> Workload:
    """SGD with momentum ``beta`` and multiplicative weight decay ``alpha`` (the workload BSR is built for).

    Example: the update of step ``t`` reaches the parameters of step ``s >= t`` with weight ``1 + beta + ... +
    beta^(s - t)``.

        >>> from opake_core import mf
        >>> mf.momentum_weight_decay(beta=0.5).matrix(3)
        array([[1.  , 0.  , 0.  ],
               [1.5 , 1.  , 0.  ],
               [1.75, 1.5 , 1.  ]])
    """
    return Workload(alpha=alpha, beta=beta)


def lr_schedule(
    learning_rates: list[float] | tuple[float, ...] | np.ndarray, *, alpha: float = 1.0, beta: float = 0.0
) -> Workload:
    """A workload with per-step learning rates on the step axis (and optional momentum / weight decay).

    Example: a decaying learning rate; optimize a strategy for it with ``band_mf(workload=...)``.

        >>> from opake_core import mf
        >>> mf.lr_schedule([1.0, 0.5, 0.25]).matrix(3)
        array([[1.  , 0.  , 0.  ],
               [1.  , 0.5 , 0.  ],
               [1.  , 0.5 , 0.25]])
    """
    return Workload(alpha=alpha, beta=beta, learning_rates=tuple(float(v) for v in np.asarray(learning_rates).ravel()))


PREFIX_SUM = Workload()
"""The default workload (a module-level instance, so that it can be a default argument)."""
