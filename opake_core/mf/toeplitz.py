"""Lower-triangular Toeplitz (LTT) algebra on float64 NumPy coefficient vectors.

An ``n x n`` LTT matrix ``T(c)`` has ``T(c)[i, j] = c[i - j]`` for ``i >= j`` and 0 above the diagonal. It is
determined by its first column ``c`` and behaves like the power series ``c(x) = sum_k c_k x^k`` truncated at
``x^n``: products are convolutions and the inverse is the series reciprocal (Fichtenberger, Henzinger and
Upadhyay 2023, arXiv:2202.11205, use the same view for the square root of the prefix sum).

==========  =====================================================================
symbol      meaning
==========  =====================================================================
``c``       first column of the strategy ``C`` (the encoder)
``c_inv``   first column of ``C^-1`` (the noising matrix)
``n``       the horizon (number of steps)
``b``       minimum separation of two participations of one example
``k``       maximum number of participations of one example
==========  =====================================================================

Everything here runs on the host in float64; the streaming noise (``opake_core.mf.streaming``) is the only part
of ``opake_core.mf`` that touches the device.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import scipy.signal

from opake_core import validate
from opake_core.errors import ConfigurationError

__all__ = [
    "cyclic_sensitivity_squared",
    "inverse_coef",
    "materialize",
    "minsep_sensitivity_squared",
    "multiply",
    "pad",
    "true_max_participations",
]


def _coef(coef: np.ndarray | list[float], what: str = "coef") -> np.ndarray:
    c = np.asarray(coef, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ConfigurationError(f"{what} must be a non-empty 1-D sequence, got shape {c.shape}.")
    if not np.all(np.isfinite(c)):
        raise ConfigurationError(f"{what} must be finite, got {c!r}.")
    return c


def pad(coef: np.ndarray | list[float], n: int) -> np.ndarray:
    """The first ``n`` coefficients of ``coef``, zero-padded when it is shorter."""
    c = _coef(coef)
    out = np.zeros(n)
    m = min(n, c.size)
    out[:m] = c[:m]
    return out


def inverse_coef(coef: np.ndarray | list[float], n: int) -> np.ndarray:
    """The first column of ``T(coef)^-1`` (length ``n``): the reciprocal of the series ``coef``.

    ``y_0 = 1 / c_0`` and ``y_i = -(sum_{r>=1} c_r y_{i-r}) / c_0``; a recursive filter, ``O(n len(coef))``.
    """
    c = _coef(coef)
    validate.integer("n", n, minimum=1)
    if c[0] == 0:
        raise ConfigurationError(f"a lower-triangular Toeplitz matrix with coef[0] = 0 is singular, got {c[:4]!r}.")
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return scipy.signal.lfilter([1.0], c[:n], impulse)


def multiply(a: np.ndarray | list[float], b: np.ndarray | list[float], n: int) -> np.ndarray:
    """The first column of ``T(a) T(b)`` (length ``n``): the truncated convolution."""
    return np.convolve(pad(a, n), pad(b, n))[:n]


def materialize(coef: np.ndarray | list[float], n: int) -> np.ndarray:
    """The dense ``n x n`` float64 matrix ``T(coef)`` (for tests, error evaluation and plots)."""
    c = pad(coef, n)
    return scipy.linalg.toeplitz(c, np.zeros(n))


def true_max_participations(n: int, min_sep: int, max_participations: int | None) -> int:
    """``min(k, ceil(n / b))``: the most participations ``b``-separated steps in ``[0, n)`` allow."""
    cap = math.ceil(n / min_sep)
    return cap if max_participations is None else min(max_participations, cap)


def _comb(c: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    """``v = sum_{m<k} shift_{m b}(c)``: the sum of the columns ``0, b, ..., (k-1) b`` of ``T(c)``.

    With ``i = q b + s``, ``v_i = sum_{q-k < q' <= q} c_{q' b + s}``: block cumulative sums minus a sliding window.
    """
    n = c.size
    rows = math.ceil(n / min_sep)
    blocks = np.zeros(rows * min_sep)
    blocks[:n] = c
    cs = np.cumsum(blocks.reshape(rows, min_sep), axis=0)
    if k < rows:
        cs[k:] = cs[k:] - cs[:-k].copy()
    return cs.reshape(-1)[:n]


def minsep_sensitivity_squared(
    coef: np.ndarray | list[float], min_sep: int, *, n: int, max_participations: int | None = None
) -> float:
    """Squared L2 sensitivity of ``T(coef)`` (``n x n``) when an example joins at most ``k`` steps ``>= b`` apart.

    For non-negative, non-increasing coefficients the worst case is the participation pattern ``0, b, ..., (k-1) b``
    (Kalinin and Lampert 2024, arXiv:2405.13763, Theorem 2), so ``sens^2 = ||sum_m shift_{m b}(c)||^2`` exactly.
    Other coefficients are replaced by their non-increasing majorant ``reverse-cummax(|c|)``: the result is then an
    upper bound (``|sum_j C[:, j]| <= sum_j |C[:, j]|`` entrywise, and the majorant dominates every shifted column).
    """
    validate.integer("n", n, minimum=1)
    validate.integer("min_sep", min_sep, minimum=1)
    if max_participations is not None:
        validate.integer("max_participations", max_participations, minimum=1)
    c = pad(coef, n)
    majorant = np.maximum.accumulate(np.abs(c)[::-1])[::-1]
    k = true_max_participations(n, min_sep, max_participations)
    v = _comb(majorant, min_sep, k)
    return float(v @ v)


def cyclic_sensitivity_squared(coef: np.ndarray | list[float], cycle_length: int, *, n: int) -> float:
    """Squared L2 sensitivity of ``T(coef)`` when an example joins the steps ``r, r + b, r + 2b, ...`` of its cycle.

    This is the (k, b) fixed-epoch sensitivity ``max_r ||sum_{j = r mod b} C[:, j]||^2`` (Choquette-Choo et al.
    2022, arXiv:2211.06530). For a Toeplitz ``C`` the column sum of residue ``r`` is the residue-0 sum shifted down
    by ``r``, so ``r = 0`` is the worst case; with ``|coef|`` the value is exact for non-negative coefficients and an
    upper bound otherwise. No monotonicity is needed.
    """
    validate.integer("n", n, minimum=1)
    validate.integer("cycle_length", cycle_length, minimum=1)
    c = np.abs(pad(coef, n))
    v = _comb(c, cycle_length, math.ceil(n / cycle_length))
    return float(v @ v)
