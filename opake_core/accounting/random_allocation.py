"""Monte Carlo accounting of random allocation, with a pessimistic confidence bound.

The default accountant of random allocation is its numerical PLD (:mod:`opake_core.accounting.allocation_pld`);
this estimator answers on request (``accountant="monte_carlo"``) and serves as an independent check of it.

Notation: ``t`` steps in an allocation, ``sigma`` the noise multiplier, ``N`` samples per direction, ``beta``
the failure probability, ``h`` the epsilon grid step.

Mechanism. 1-out-of-``t`` random allocation of a Gaussian release (Feldman & Shenfeld, "Privacy amplification
by random allocation", arXiv 2502.08202) has the dominating pair ``P = (1/t) sum_j N(e_j, sigma^2 I_t)`` and
``Q = N(0, sigma^2 I_t)``, whose privacy loss is ``L(y) = logsumexp_j((y_j - 1/2) / sigma^2) - log t`` (Chua
et al., "Balls-and-bins sampling for DP-SGD", arXiv 2412.16802, Sec. 3). A composition of independent
allocations (the k blocks of k-out-of-t) has the sum of their losses as its loss.

Estimate. For each direction (add: the loss ``L`` under ``P``; remove: the loss ``-L`` under ``Q``) we draw
``N`` samples ``l_i`` of the total loss; ``delta(eps) = E[(1 - exp(eps - l))_+]`` is the mean of variables in
[0, 1]. The reported delta is the upper end of a one-sided Chernoff interval on that mean, ``max{m >= mean : N
* kl(mean || m) <= log(1 / beta')}`` (Hoeffding 1963, Thm 1, which holds for any [0, 1]-valued variables),
with ``beta' = beta / (2 * grid size)``: a Bonferroni correction over both directions and every grid epsilon,
so the whole epsilon(delta) curve holds simultaneously with probability >= 1 - beta. Epsilon is the smallest
grid point ``i * h`` whose bound is <= delta (rounded up to the grid; inf when no grid point up to
``max_epsilon`` qualifies).

Limits. The cost is O(N * total steps) normal draws. No delta below about ``log(1 / beta') / N`` can be
certified: at delta = 1e-5 use ``num_samples`` of 10**7 or more. Samples come from explicit keys
(``fold_in(key(seed), "opake.accounting.random_allocation", direction, part, block)``), so answers are
reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from opake_core import validate
from opake_core.accounting.processes import Compose, Process, RandomAllocation, Repeat
from opake_core.errors import ConfigurationError
from opake_core.random import fold_in, key, numpy_generator

__all__ = ["MonteCarlo", "delta", "epsilon", "loss_samples"]

_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class MonteCarlo:
    """Settings of the Monte Carlo accountant (see the module docstring for what each controls).

    Example: more samples certify a smaller epsilon (the bound holds with probability ``1 - failure_probability``).

        >>> from opake_core import accounting
        >>> once_in_ten = accounting.random_allocation(accounting.gaussian(1.0), 10)
        >>> few, more = (accounting.MonteCarlo(num_samples=n, failure_probability=1e-3) for n in (5_000, 50_000))
        >>> eps = lambda config: accounting.epsilon(once_in_ten, delta=0.05, accountant="monte_carlo",
        ...                                         monte_carlo=config).value
        >>> eps(more) < eps(few)
        True
    """

    num_samples: int = 1_000_000
    failure_probability: float = 1e-6
    epsilon_resolution: float = 1e-2
    max_epsilon: float = 100.0
    seed: int = 0

    def __post_init__(self) -> None:
        validate.integer("num_samples", self.num_samples, minimum=100)
        beta = validate.real("failure_probability", self.failure_probability)
        if not 0 < beta < 1:
            raise ConfigurationError(f"failure_probability must be in (0, 1), got {beta!r}; 1e-6 is the default.")
        for name in ("epsilon_resolution", "max_epsilon"):
            if validate.real(name, getattr(self, name)) <= 0:
                raise ConfigurationError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        validate.integer("seed", self.seed, minimum=-(2**63))

    @property
    def grid_size(self) -> int:
        return math.ceil(self.max_epsilon / self.epsilon_resolution) + 1

    @property
    def log_term(self) -> float:
        return math.log(2 * self.grid_size / self.failure_probability)


def _parts(p: Process, count: int = 1) -> list[tuple[float, int, int]]:
    """``(sigma, t, number of independent allocations)`` for every random-allocation part of ``p``."""
    if isinstance(p, RandomAllocation):
        return [(p.inner.noise_multiplier, p.num_steps, count)]
    if isinstance(p, Repeat):
        return _parts(p.process, count * p.count)
    if isinstance(p, Compose):
        return [part for c in p.processes for part in _parts(c, count)]
    raise ConfigurationError(
        f"the Monte Carlo accountant handles random allocations and their compositions only, got "
        f"{type(p).__name__}; "
        "account other parts separately (a horizon process is included exactly once)."
    )


def _allocation_losses(gen: np.random.Generator, sigma: float, t: int, n: int, add: bool) -> np.ndarray:
    out = np.empty(n)
    rows = max(1, _CHUNK_ELEMENTS // t)
    for start in range(0, n, rows):
        z = gen.standard_normal((min(rows, n - start), t))
        if add:
            z[:, 0] += 1.0 / sigma
        llr = z / sigma - 0.5 / sigma**2
        peak = llr.max(axis=1)
        loss = peak + np.log(np.exp(llr - peak[:, None]).sum(axis=1)) - math.log(t)
        out[start : start + len(loss)] = loss if add else -loss
    return out


def loss_samples(process: Process, *, add: bool, config: MonteCarlo) -> np.ndarray:
    """``config.num_samples`` draws of the privacy loss of ``process`` (add: under P; remove: under Q)."""
    root = fold_in(key(config.seed), "opake.accounting.random_allocation", "add" if add else "remove")
    total = np.zeros(config.num_samples)
    for index, (sigma, t, count) in enumerate(_parts(process)):
        for block in range(count):
            gen = numpy_generator(fold_in(root, index, block))
            total += _allocation_losses(gen, sigma, t, config.num_samples, add)
    return np.sort(total)


def _kl(p: float, q: float) -> float:
    if q >= 1.0:
        return math.inf
    first = 0.0 if p == 0.0 else p * math.log(p / q)
    return first + (1 - p) * math.log((1 - p) / (1 - q))


def _upper(mean: float, n: int, log_term: float) -> float:
    lo, hi = mean, 1.0
    if _kl(mean, hi) * n <= log_term:
        return 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _kl(mean, mid) * n <= log_term:
            lo = mid
        else:
            hi = mid
    return hi


def _delta_bound(sorted_losses: np.ndarray, eps: float, config: MonteCarlo) -> float:
    tail = sorted_losses[np.searchsorted(sorted_losses, eps, side="right") :]
    mean = float(-np.expm1(eps - tail).sum()) / len(sorted_losses) if len(tail) else 0.0
    return _upper(min(max(mean, 0.0), 1.0), len(sorted_losses), config.log_term)


def _both(process: Process, config: MonteCarlo) -> tuple[np.ndarray, np.ndarray]:
    return loss_samples(process, add=True, config=config), loss_samples(process, add=False, config=config)


def delta(process: Process, *, epsilon: float, config: MonteCarlo) -> float:
    """A delta that holds at ``epsilon`` with probability >= 1 - failure_probability."""
    samples = _both(process, config)
    return max(_delta_bound(s, epsilon, config) for s in samples)


def epsilon(process: Process, *, delta: float, config: MonteCarlo) -> float:
    """The smallest grid epsilon whose bound on delta is <= ``delta`` (inf if none up to ``max_epsilon``)."""
    samples = _both(process, config)

    def ok(i: int) -> bool:
        return max(_delta_bound(s, i * config.epsilon_resolution, config) for s in samples) <= delta

    lo, hi = -1, config.grid_size - 1
    if not ok(hi):
        return math.inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi * config.epsilon_resolution
