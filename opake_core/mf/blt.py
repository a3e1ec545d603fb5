"""Buffered linear Toeplitz (BLT) strategies (Dvijotham, McMahan, Pillutla, Steinke and Thakurta 2024,
arXiv:2404.16706; McMahan et al. 2024, arXiv:2408.08868; McMahan and Pillutla 2025, arXiv:2504.21413).

``C`` is lower-triangular Toeplitz with ``c_0 = 1`` and ``c_k = sum_j omega_j theta_j^(k-1)`` for ``k >= 1``
(``m`` buffers, decays ``theta`` in (0, 1), output scales ``omega > 0``): the generating function is the rational
``c(x) = prod_j (1 - theta_hat_j x) / prod_j (1 - theta_j x)``, and ``C^-1`` is again a BLT with decays
``theta_hat`` and scales ``omega_hat``. Given the pair ``(theta, theta_hat)`` the scales are the residues
(Dvijotham et al. 2024, Lemma 5.2; McMahan and Pillutla 2025, Theorem 2)

    omega_i     = prod_j (theta_i - theta_hat_j) / prod_{j != i} (theta_i - theta_j),
    omega_hat_i = prod_j (theta_hat_i - theta_j) / prod_{j != i} (theta_hat_i - theta_hat_j).

The optimizer parameterizes interlaced pairs ``1 > theta_0 > theta_hat_0 > theta_1 > ... > theta_hat_{m-1} > 0``
by ``2m`` logits of successive ratios. Interlacing gives ``omega > 0``, ``omega_hat < 0`` and
``sum(omega) = sum(theta - theta_hat) < 1``, so the coefficients of ``C`` are positive and non-increasing and the
closed-form min-sep sensitivity is exact: the constraints the barrier terms of jax_privacy enforce hold by
construction. The loss ``sens^2(C) * reduce(error(C^-1))`` is evaluated on the materialized ``n`` coefficients
(``O(n m)`` plus an FFT for a non-prefix workload) and minimized with scipy's L-BFGS-B in float64; the number of
buffers grows from ``min_buffers`` while the loss improves by more than 1% (jax_privacy's rule). Streaming
``C^-1`` keeps ``m`` buffers (McMahan et al. 2024, Algorithm 3), independent of ``n``.
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
from opake_core.mf.participation import SINGLE, Participation, SingleParticipation
from opake_core.mf.workload import PREFIX_SUM, Workload

__all__ = ["BLT", "BufferedToeplitz", "blt", "blt_loss", "optimize_buffers"]

MAX_BUFFERS = 15
"""Above this the optimization is numerically unstable (as in jax_privacy)."""


@dataclass(frozen=True)
class BufferedToeplitz(Concrete):
    """A concrete BLT strategy ``C`` (0 buffers is the identity).

    Attributes:
        buf_decay: ``theta``, each in ``(0, 1)``.
        output_scale: ``omega``, each ``> 0``, as many as ``buf_decay`` (at most 15).

    Example: one buffer, ``c_0 = 1`` and ``c_k = omega theta^(k-1)``; the streamed inverse matches the dense one.

        >>> import numpy as np
        >>> from opake_core import mf
        >>> strategy = mf.BufferedToeplitz(buf_decay=(0.5,), output_scale=(0.25,))
        >>> mf.coefficients(strategy, 4)
        array([1.    , 0.25  , 0.125 , 0.0625])
        >>> np.allclose(np.linalg.inv(mf.materialize(strategy, 4))[:, 0], mf.inverse_coefficients(strategy, 4))
        True
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def __post_init__(self) -> None:
        theta = tuple(float(v) for v in np.asarray(self.buf_decay, dtype=np.float64).ravel())
        omega = tuple(float(v) for v in np.asarray(self.output_scale, dtype=np.float64).ravel())
        if len(theta) != len(omega):
            raise ConfigurationError(
                f"buf_decay and output_scale must have the same length, got {len(theta)} and {len(omega)}."
            )
        if len(theta) > MAX_BUFFERS:
            raise ConfigurationError(f"a BLT has at most {MAX_BUFFERS} buffers, got {len(theta)}.")
        if not all(0.0 < t < 1.0 for t in theta):
            raise ConfigurationError(f"buf_decay must be in (0, 1), got {self.buf_decay!r}.")
        if not all(np.isfinite(w) and w > 0 for w in omega):
            raise ConfigurationError(f"output_scale must be positive and finite, got {self.output_scale!r}.")
        order = np.argsort(theta)[::-1]
        object.__setattr__(self, "buf_decay", tuple(theta[i] for i in order))
        object.__setattr__(self, "output_scale", tuple(omega[i] for i in order))

    def strategy_coef(self, n: int) -> np.ndarray:
        theta, omega = np.asarray(self.buf_decay), np.asarray(self.output_scale)
        out = np.zeros(n)
        out[0] = 1.0
        if theta.size and n > 1:
            out[1:] = (theta[None, :] ** np.arange(n - 1)[:, None]) @ omega
        return out

    def noising_coef(self, n: int) -> np.ndarray:
        # The BLT recursion on a unit impulse: O(n m), exact in float64.
        theta, omega = np.asarray(self.buf_decay), np.asarray(self.output_scale)
        out = np.zeros(n)
        state = np.zeros(theta.size)
        for t in range(n):
            x = (1.0 if t == 0 else 0.0) - omega @ state
            state = theta * state + x
            out[t] = x
        return out

    @property
    def plan(self) -> StreamPlan:
        if not self.buf_decay:
            return StreamPlan("identity")
        return StreamPlan("blt", self.output_scale, self.buf_decay)


def _pairs_from_params(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ratios = torch.sigmoid(u)
    values = torch.cumprod(ratios, dim=0)  # strictly decreasing in (0, 1)
    return values[0::2], values[1::2]


def _scales(theta: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``omega_i = prod_j (theta_i - other_j) / prod_{j != i} (theta_i - theta_j)``."""
    m = theta.numel()
    num = torch.prod(theta[:, None] - other[None, :], dim=1)
    diff = theta[:, None] - theta[None, :] + torch.eye(m, dtype=theta.dtype)
    return num / torch.prod(diff, dim=1)


def _coef_from_pairs(theta: torch.Tensor, omega: torch.Tensor, n: int) -> torch.Tensor:
    k = torch.arange(n - 1, dtype=theta.dtype)
    tail = torch.exp(k[:, None] * torch.log(theta)[None, :]) @ omega
    return torch.cat([torch.ones(1, dtype=theta.dtype), tail])


def _closed_form_applies(participation: Participation, workload: Workload, objective: str) -> bool:
    return (
        isinstance(participation, SingleParticipation)
        and objective == "max"
        and workload.is_toeplitz
        and workload.alpha == 1.0
        and workload.beta == 0.0
    )


def _geometric(rho: torch.Tensor, count: int) -> torch.Tensor:
    """``sum_{k<count} rho^k = (1 - rho^count) / (1 - rho)`` for ``rho`` in (0, 1)."""
    return -torch.expm1(count * torch.log(rho)) / (1.0 - rho)


def _closed_form_single_max_loss(
    theta: torch.Tensor, omega: torch.Tensor, theta_hat: torch.Tensor, omega_hat: torch.Tensor, n: int
) -> torch.Tensor:
    """Single-participation ``sens^2 * max error`` for the prefix sum in ``O(m^2)``, independent of ``n``.

    ``sens^2 = ||c||^2 = 1 + sum_ij omega_i omega_j G(theta_i theta_j, n - 1)`` (Dvijotham et al. 2024, Lemma 5.3)
    and the max error is the last row of ``B = T(1) C^-1``: with the partial sums
    ``b_k = g - sum_i gamma_i theta_hat_i^k`` (``gamma_i = omega_hat_i / (1 - theta_hat_i)``, ``g = 1 + sum gamma``),
    ``sum_{k<n} b_k^2 = n g^2 - 2 g sum_i gamma_i G(theta_hat_i, n) + sum_ij gamma_i gamma_j G(theta_hat_i
    theta_hat_j, n)`` (the same quantity as Lemma 5.4, written through the inverse BLT).
    """
    sens2 = 1.0 + omega @ _geometric(theta[:, None] * theta[None, :], n - 1) @ omega
    gamma = omega_hat / (1.0 - theta_hat)
    g = 1.0 + gamma.sum()
    err = (
        n * g * g
        - 2.0 * g * (gamma @ _geometric(theta_hat, n))
        + gamma @ _geometric(theta_hat[:, None] * theta_hat[None, :], n) @ gamma
    )
    return sens2 * err


def blt_loss(
    params: np.ndarray,
    n: int,
    *,
    participation: Participation = SINGLE,
    workload: Workload = PREFIX_SUM,
    objective: str = "max",
    grad: bool = False,
) -> float | tuple[float, np.ndarray]:
    """``sens^2(C) * reduce(error(C^-1))`` for the interlaced parameters ``params`` (``2m`` logits)."""
    u = torch.tensor(np.asarray(params, dtype=np.float64), requires_grad=grad)
    theta, theta_hat = _pairs_from_params(u)
    omega, omega_hat = _scales(theta, theta_hat), _scales(theta_hat, theta)
    if _closed_form_applies(participation, workload, objective):
        loss = _closed_form_single_max_loss(theta, omega, theta_hat, omega_hat, n)
    else:
        c = _coef_from_pairs(theta, omega, n)
        c_inv = _coef_from_pairs(theta_hat, omega_hat, n)
        min_sep, k = participation.min_sep_and_count(n)
        sens2 = _autodiff.minsep_sensitivity_squared(c, min_sep, k)
        err = _autodiff.per_query_error(c_inv, workload, n)
        loss = sens2 * (err.mean() if objective == "mean" else err.max())
    if not grad:
        return float(loss.detach())
    loss.backward()
    return float(loss.detach()), u.grad.numpy().copy()


def _blt_from_params(params: np.ndarray) -> BufferedToeplitz:
    with torch.no_grad():
        theta, theta_hat = _pairs_from_params(torch.tensor(params, dtype=torch.float64))
        omega = _scales(theta, theta_hat)
    return BufferedToeplitz(tuple(theta.tolist()), tuple(omega.tolist()))


def _initial_params(n: int, m: int) -> np.ndarray:
    # 1 - value log-spaced from ~1/n to ~0.7: decays that cover the horizon's time scales, interlaced.
    gaps = np.geomspace(0.5 / n, 0.7, 2 * m)
    values = 1.0 - gaps
    ratios = np.concatenate([[values[0]], values[1:] / values[:-1]])
    return np.log(ratios) - np.log1p(-ratios)


def optimize_buffers(
    n: int,
    num_buffers: int,
    *,
    participation: Participation = SINGLE,
    workload: Workload = PREFIX_SUM,
    objective: str = "max",
    max_iterations: int = 400,
) -> tuple[BufferedToeplitz, float]:
    """The best BLT with exactly ``num_buffers`` buffers for horizon ``n``, and its loss."""
    validate.integer("n", n, minimum=1)
    validate.integer("num_buffers", num_buffers, minimum=0)
    if num_buffers == 0:
        ident = BufferedToeplitz((), ())
        _, k = participation.min_sep_and_count(n)
        err = _autodiff.per_query_error(torch.from_numpy(toeplitz.pad([1.0], n)), workload, n)
        return ident, float(k * (err.mean() if objective == "mean" else err.max()))
    init = _initial_params(n, num_buffers)
    kwargs = {"participation": participation, "workload": workload, "objective": objective}
    scale = blt_loss(init, n, **kwargs)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        value, g = blt_loss(x, n, grad=True, **kwargs)
        return value / scale, g / scale

    result = scipy.optimize.minimize(
        fun,
        init,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": max_iterations, "maxfun": 2 * max_iterations, "ftol": 1e-15, "gtol": 1e-12},
    )
    if not np.all(np.isfinite(result.x)):
        raise ConfigurationError(f"BLT optimization diverged for n_steps={n}, buffers={num_buffers}.")
    return _blt_from_params(result.x), float(result.fun * scale)


@dataclass(frozen=True)
class BLT:
    """Specification of a BLT strategy optimized for a horizon and participation pattern.

    Attributes:
        max_buffers: ``1 .. 15``; the optimizer uses the fewest buffers (from ``min_buffers``) past which the loss
            improves by less than 1%.
        min_buffers: ``0 .. max_buffers`` (0 allows the identity, which is optimal for full participation).
        workload: the workload ``A`` (prefix sum by default).
        objective: ``"max"`` (default, as jax_privacy) or ``"mean"`` per-query error.
    """

    max_buffers: int = 10
    min_buffers: int = 1
    workload: Workload = field(default_factory=Workload)
    objective: str = "max"

    def __post_init__(self) -> None:
        validate.integer("max_buffers", self.max_buffers, minimum=1)
        if self.max_buffers > MAX_BUFFERS:
            raise ConfigurationError(
                f"max_buffers must be <= {MAX_BUFFERS} (more buffers make the optimization numerically unstable), "
                f"got {self.max_buffers}."
            )
        validate.integer("min_buffers", self.min_buffers, minimum=0)
        if self.min_buffers > self.max_buffers:
            raise ConfigurationError(
                f"min_buffers must be <= max_buffers, got min_buffers={self.min_buffers}, "
                f"max_buffers={self.max_buffers}."
            )
        if self.objective not in ("mean", "max"):
            raise ConfigurationError(f"objective must be 'mean' or 'max', got {self.objective!r}.")
        if not isinstance(self.workload, Workload):
            raise ConfigurationError(f"workload must be an opake_core.mf.Workload, got {type(self.workload).__name__}.")

    def optimize(self, n: int, *, participation: Participation = SINGLE) -> BufferedToeplitz:
        """The optimized :class:`BufferedToeplitz` for horizon ``n`` and ``participation``."""
        self.workload.rates(n)
        kwargs = {"participation": participation, "workload": self.workload, "objective": self.objective}
        best, best_loss = optimize_buffers(n, self.min_buffers, **kwargs)
        for m in range(self.min_buffers + 1, self.max_buffers + 1):
            candidate, loss = optimize_buffers(n, m, **kwargs)
            if not loss * 1.01 < best_loss:
                break
            best, best_loss = candidate, loss
        return best


def blt(
    max_buffers: int = 10, *, min_buffers: int = 1, workload: Workload | None = None, objective: str = "max"
) -> BLT:
    """A BLT with at most ``max_buffers`` buffers (optimized for the horizon when used); see :class:`BLT`.

    Example: one buffer, optimized for 8 steps, has a smaller worst-step error than independent noise at equal
    privacy.

        >>> from opake_core import mf
        >>> concrete = mf.optimize(mf.blt(max_buffers=1), 8)
        >>> type(concrete).__name__, mf.num_buffers(concrete)
        ('BufferedToeplitz', 1)
        >>> mf.expected_error(concrete, 8, scale_by_sensitivity=True).max < mf.expected_error(
        ...     mf.identity(), 8, scale_by_sensitivity=True).max
        True
    """
    return BLT(max_buffers, min_buffers, workload if workload is not None else Workload(), objective)
