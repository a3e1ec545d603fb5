"""The privacy loss distribution of random allocation, computed numerically: deterministic and pessimistic.

Notation: ``t`` steps in one allocation, ``sigma`` the noise multiplier, ``h`` the step of the log grid
(``log_grid``), ``Delta`` the PLD discretization (dp-accounting's ``value_discretization_interval``).

Mechanism. 1-out-of-``t`` random allocation of a Gaussian release (Feldman & Shenfeld, "Privacy amplification by
random allocation", arXiv 2502.08202) has the dominating pair ``P = (1/t) sum_j N(e_j, sigma^2 I_t)`` (the example
takes part in one uniform step) against ``Q = N(0, sigma^2 I_t)`` (Chua et al., "Balls-and-bins sampling for
DP-SGD", arXiv 2412.16802, Sec. 3). With ``X_j = exp((y_j - 1/2) / sigma^2)`` the likelihood ratio of step ``j``
(i.i.d. log-normal with mean 1 under ``Q``) and ``S = sum_j X_j``, the privacy loss is ``L = log(S / t)``, and
``dP/dQ = S / t``. In dp-accounting's convention the REMOVE distribution is ``L`` under ``P`` (the upper
distribution holds the example) and the ADD distribution is ``-L`` under ``Q``. Both follow from the law of ``S``
under ``Q``; for any ``epsilon`` and any independent part ``O`` composed with it, their hockey-stick divergences
are ``E_Q[g(S)]`` with ``g(s) = E_O[(s / t - e^{epsilon - L_O})_+]`` (REMOVE) or ``E_O[(1 - e^{epsilon + L_O}
s / t)_+]`` (ADD): convex functions of ``s``.

Algorithm. ``S`` is a sum of ``t`` independent terms, so its law is built on the geometric grid ``{e^{i h}}`` by
doubling: ``S_{2m} = S_m + S_m'`` and ``S_{m+n} = S_m + S_n`` for independent copies, ``O(log t)`` merges. A merge
sends the grid pair ``(e^{i h}, e^{j h})``, ``i <= j``, to ``e^{j h} (1 + e^{-d h})``, ``d = j - i``, and splits its
mass between the two grid points around that value so that the mean is kept. Grouped by the lower point
(``log(2) / h`` groups), the split weight is affine in ``e^{-d h}``, so each group is two box sums read from
cumulative sums: a merge costs ``O(n log(2) / h)`` for ``n`` grid points. Each ``X_j`` starts as the same
mean-keeping split of every grid cell of its log-normal law; the grid spans both tails to ``z`` standard
deviations, with ``t`` times the mass beyond it below 1e-17. Mass below ``1e-30`` at the low end is split, mean
kept, between ``S = 0`` and the lowest cell kept.

Guarantee. A mean-keeping split is a spread: the computed ``S~`` dominates ``S`` in the convex order, and sums of
independent spreads are spreads. As ``g`` is convex, every delta read from the two PLDs, alone or composed with
any other PLD, is an upper bound of the exact one; the mass beyond the grid is counted as infinite loss, and the
losses are rounded up to dp-accounting's grid ``Delta``. The excess over the exact epsilon is of second order in
``h`` (halving the default ``h`` moves epsilon by less than 1e-3, see the tests) plus at most ``Delta``. Floating-point
rounding loses up to about 1e-11 of mass in the sums, which the PLDs count as infinite loss (it adds to delta).

The pair dominates the adaptive composition of the steps as well (Feldman & Shenfeld 2025, Sec. 3; Chua et al.
2024, Sec. 3), which is what a training run is.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy.stats import norm

from opake_core import validate
from opake_core.accounting.group import GroupPoissonDpEvent, group_poisson_pld
from opake_core.errors import ConfigurationError

__all__ = ["AllocationPLDAccountant", "RandomAllocationDpEvent", "allocation_pld", "default_log_grid"]

_MAX_GRID = 1e-2  # the coarsest automatic h
_GRID_WORK = 1e6  # grid points times groups per merge that the automatic h allows
_TAIL = 1e-17  # t times the Gaussian mass beyond the grid, on each side
_PRUNE = 1e-30  # low-end mass split off to S = 0 after a merge
_CHUNK = 1 << 22  # groups x cells handled at once in a merge
_MIN_SIGMA = 0.1


@dataclass(frozen=True)
class _Law:
    """A law of ``S`` (under ``Q``, possibly with mass lost to the tails): ``probs[i]`` at ``e^{(offset + i) h}``,
    ``zero`` at ``S = 0``."""

    offset: int
    probs: np.ndarray
    zero: float


@functools.lru_cache(maxsize=8)
def _groups(h: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(m, d_lo, d_hi)``: ``floor(log(1 + e^{-d h}) / h) = m`` for ``d`` in ``[d_lo, d_hi]``; the last group
    (``m = 0``) has ``d_hi = -1``, meaning every larger ``d``."""
    d_max = math.ceil(-math.log(math.expm1(h)) / h) + 2  # beyond it log(1 + e^{-d h}) < h
    d = np.arange(d_max + 1)
    m = np.floor(np.log1p(np.exp(-d * h)) / h).astype(np.int64)
    starts = np.flatnonzero(np.diff(m, prepend=-1))
    ends = np.append(starts[1:] - 1, -1)
    return m[starts], d[starts], ends


def _log_normal(sigma: float, t: int, h: float) -> _Law:
    """``X = e^W``, ``W ~ N(-1/(2 sigma^2), 1/sigma^2)``, each grid cell's mass split between its ends, mean kept."""
    sd, mean_q = 1.0 / sigma, -0.5 / sigma**2
    z = float(norm.isf(_TAIL / t))
    lo, hi = math.floor((mean_q - z * sd) / h), math.ceil((-mean_q + z * sd) / h)
    edges = np.arange(lo, hi + 1) * h

    def cells(mean: float) -> np.ndarray:  # masses of [edge_k, edge_k+1], each from its accurate side
        u = (edges - mean) / sd
        return np.where(u[1:] <= 0, np.diff(norm.cdf(u)), -np.diff(norm.sf(u)))

    mass = cells(mean_q)
    first_moment = cells(-mean_q)  # E_Q[X; cell] = P(cell): the tilted law is N(+1/(2 sigma^2), 1/sigma^2)
    upper = np.clip((first_moment * np.exp(-edges[:-1]) - mass) / math.expm1(h), 0.0, mass)
    probs = np.zeros(len(edges))
    probs[:-1] += mass - upper
    probs[1:] += upper
    return _Law(lo, probs, 0.0)


def _box(cum: np.ndarray, rcum: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Sums of ``p[first..last]`` (clipped to the array; empty when ``first > last``), from the side where they are
    not differences of nearly equal numbers. ``cum[k] = p[:k].sum()``, ``rcum[k] = p[k:].sum()``."""
    n = len(cum) - 1
    a, b = np.clip(first, 0, n), np.clip(last + 1, 0, n)
    low, high = cum[b] - cum[a], rcum[a] - rcum[b]
    return np.maximum(np.where(cum[b] <= 0.5 * cum[-1], low, high), 0.0)


def _sums(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate(([0.0], np.cumsum(p))), np.concatenate((np.cumsum(p[::-1])[::-1], [0.0]))


def _merge(a: _Law, b: _Law, h: float) -> _Law:
    """The law of ``A + B`` for independent ``A``, ``B``, split onto the grid with the mean kept."""
    groups, scale = _groups(h), math.expm1(h)
    lo = min(a.offset, b.offset)
    out = np.zeros(max(a.offset + len(a.probs), b.offset + len(b.probs)) + int(groups[0][0]) + 2 - lo)
    for big, small, strict in ((b, a, False), (a, b, True)):  # pairs with d = 0 counted once, with b the larger
        k = np.arange(len(small.probs))
        cum, rcum = _sums(small.probs)
        # e^{k h} p_k for the tilted sums; shifted by the top index so that nothing overflows
        ecum, ercum = _sums(small.probs * np.exp((k - k[-1]) * h))
        rel = np.arange(big.offset, big.offset + len(big.probs)) - small.offset  # big's cells in small's indices
        tilt = np.exp(np.minimum((k[-1] - rel) * h, 700.0))
        ms, d_los, d_his = groups
        d_los = np.maximum(d_los, 1) if strict else d_los
        live = (d_his == -1) | (d_los <= d_his)
        ms, d_los, d_his = ms[live], d_los[live], d_his[live]
        rows = max(1, _CHUNK // len(rel))
        for s in range(0, len(ms), rows):  # a block of groups at a time, as (groups, cells) arrays
            m, d_lo, d_hi = ms[s : s + rows, None], d_los[s : s + rows, None], d_his[s : s + rows, None]
            first, last = np.where(d_hi == -1, 0, rel - d_hi), rel - d_lo
            mass = _box(cum, rcum, first, last)
            moment = _box(ecum, ercum, first, last) * tilt  # sum of e^{-d h} p over the group
            # weight on the upper point: (1 + e^{-d h} - e^{m h}) / (e^{m h} (e^h - 1)), affine in e^{-d h}
            grow = np.exp(m * h)
            upper = np.clip((moment - (grow - 1.0) * mass) / (grow * scale), 0.0, mass)
            lower_cell = (big.offset - lo + m + np.arange(len(rel))).ravel()
            out += np.bincount(lower_cell, weights=(big.probs * (mass - upper)).ravel(), minlength=len(out))
            out += np.bincount(lower_cell + 1, weights=(big.probs * upper).ravel(), minlength=len(out))
    for x, other in ((a, b), (b, a)):  # S = 0 is the identity of the sum
        start = x.offset - lo
        out[start : start + len(x.probs)] += other.zero * x.probs
    return _prune(_Law(lo, out, a.zero * b.zero), h)


def _prune(x: _Law, h: float) -> _Law:
    """Drop empty end cells; split the low-end mass below ``_PRUNE`` between ``S = 0`` and the lowest cell kept."""
    p = x.probs
    nonzero = np.flatnonzero(p)
    p = p[: nonzero[-1] + 1]
    first = max(int(np.searchsorted(np.cumsum(p), _PRUNE, side="right")), int(nonzero[0]))
    if first >= len(p) - 1:
        return _Law(x.offset, p, x.zero)
    low = p[:first]
    moment = float(low @ np.exp((np.arange(first) - first) * h))  # their mean, in units of the kept cell
    kept = p[first:].copy()
    kept[0] += moment
    return _Law(x.offset + first, kept, x.zero + float(low.sum()) - moment)


def _sum_of(single: _Law, count: int, h: float) -> _Law:
    """``S_count``, the sum of ``count`` independent copies of ``single``, by binary doubling."""
    acc, power = None, single
    while True:
        if count & 1:
            acc = power if acc is None else _merge(acc, power, h)
        count >>= 1
        if not count:
            return acc
        power = _merge(power, power, h)


def default_log_grid(noise_multiplier: float, num_steps: int) -> float:
    """The automatic ``h``: a tenth of the standard deviation of ``log(S / t)``, ``sqrt((e^{1/sigma^2} - 1) / t)``
    (the grid's spread then adds about 1% to its variance), at most 1e-2, and no finer than a merge of about 1e6
    operations allows (the bound then stays valid, with a larger excess)."""
    sigma, t = noise_multiplier, num_steps
    spread = math.sqrt(math.expm1(min(sigma**-2, 700.0)) / t)
    width = 2 * float(norm.isf(_TAIL / t)) / sigma + sigma**-2  # the span of log X on the grid
    return max(min(_MAX_GRID, 0.1 * spread), math.sqrt(width * math.log(2) / _GRID_WORK))


def _pmf(loss: np.ndarray, probs: np.ndarray, discretization: float) -> pld_pmf.PLDPmf:
    """The pessimistic dp-accounting pmf: losses rounded up to ``discretization``, missing mass at infinity."""
    index = np.ceil(loss / discretization).astype(np.int64)
    lower = int(index.min())
    dense = np.bincount(index - lower, weights=probs)
    infinity = max(0.0, 1.0 - float(dense.sum()))
    return pld_pmf.DensePLDPmf(discretization, lower, dense, infinity, pessimistic_estimate=True)


@functools.lru_cache(maxsize=64)
def allocation_pld(
    noise_multiplier: float, num_steps: int, *, discretization: float = 1e-4, log_grid: float | None = None
) -> PrivacyLossDistribution:
    """The pessimistic PLD (both directions) of one 1-out-of-``num_steps`` allocation of a Gaussian release.

    Args:
        noise_multiplier: ``sigma``, the noise std over the L2 sensitivity of the release (> 0).
        num_steps: ``t``, the steps one allocation spreads over (the example takes part in exactly one).
        discretization: ``Delta``, the PLD's loss grid (it must equal that of any PLD it is composed with).
        log_grid: ``h``, the step of the log grid of ``S`` (module docstring); None is :func:`default_log_grid`.

    Example: one step is the Gaussian mechanism.

        >>> import dp_accounting
        >>> from opake_core.accounting.allocation_pld import allocation_pld
        >>> ours = allocation_pld(2.0, 1).get_epsilon_for_delta(1e-5)
        >>> exact = dp_accounting.get_epsilon_gaussian(2.0, 1e-5)
        >>> bool(exact <= ours < exact + 1e-3)
        True
    """
    sigma = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    if sigma == 0.0:
        raise ConfigurationError("a random allocation with noise_multiplier 0 is non-private; it has no PLD.")
    if sigma < _MIN_SIGMA:
        # the log grid would span more than e^700 (float64's range): below 0.1 epsilon is in the hundreds anyway
        raise ConfigurationError(
            f"the random-allocation PLD needs noise_multiplier >= {_MIN_SIGMA}, got {sigma!r}; at such noise epsilon "
            "is in the hundreds. Use more noise, or accountant='monte_carlo'."
        )
    t = validate.integer("num_steps", num_steps, minimum=1)
    log_grid = default_log_grid(sigma, t) if log_grid is None else log_grid
    for name, value in (("discretization", discretization), ("log_grid", log_grid)):
        if not validate.real(name, value) > 0:
            raise ConfigurationError(f"{name} must be > 0, got {value!r}.")
    law = _sum_of(_log_normal(sigma, t, log_grid), t, log_grid)
    log_s = np.arange(law.offset, law.offset + len(law.probs)) * log_grid
    remove = _pmf(log_s - math.log(t), law.probs * np.exp(log_s - math.log(t)), discretization)  # dP = S/t dQ
    add = _pmf(math.log(t) - log_s, law.probs, discretization)
    return PrivacyLossDistribution(remove, add)


@dataclass(frozen=True)
class RandomAllocationDpEvent(dp_event.DpEvent):
    """A dp-accounting event for one 1-out-of-``num_steps`` allocation of a Gaussian release, which
    :class:`AllocationPLDAccountant` accounts (dp-accounting 0.6.0 has none)."""

    noise_multiplier: float
    num_steps: int


class AllocationPLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's PLD accountant, plus :class:`RandomAllocationDpEvent` and
    :class:`~opake_core.accounting.group.GroupPoissonDpEvent` (add-or-remove adjacency only).

    Example: two independent allocations of 50 steps each (2-out-of-100, ``allocation="block"``).

        >>> from opake_core.accounting.allocation_pld import AllocationPLDAccountant, RandomAllocationDpEvent
        >>> import dp_accounting
        >>> two = dp_accounting.SelfComposedDpEvent(RandomAllocationDpEvent(1.0, 50), 2)
        >>> round(AllocationPLDAccountant().compose(two).get_epsilon(1e-5), 2)
        1.23
    """

    def __init__(self, *args: object, log_grid: float | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._log_grid = log_grid

    def _maybe_compose(
        self, event: dp_event.DpEvent, count: int, do_compose: bool
    ) -> privacy_accountant.PrivacyAccountant.CompositionErrorDetails | None:
        if not isinstance(event, RandomAllocationDpEvent | GroupPoissonDpEvent):
            return super()._maybe_compose(event, count, do_compose)
        if self.neighboring_relation != privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE:
            return self.CompositionErrorDetails(
                invalid_event=event,
                error_message=f"{type(event).__name__} is accounted under add-or-remove adjacency only, not "
                f"{self.neighboring_relation}.",
            )
        if do_compose:
            if event.noise_multiplier == 0:
                self._contains_non_dp_event = True
            elif isinstance(event, GroupPoissonDpEvent):
                one = group_poisson_pld(event, discretization=self._value_discretization_interval)
                self._pld = self._pld.compose(one.self_compose(count) if count > 1 else one)
            else:
                one = allocation_pld(
                    event.noise_multiplier,
                    event.num_steps,
                    discretization=self._value_discretization_interval,
                    log_grid=self._log_grid,
                )
                with np.errstate(over="ignore", divide="ignore"):  # dp-accounting's tail bound overflows harmlessly
                    self._pld = self._pld.compose(one.self_compose(count) if count > 1 else one)
        return None
