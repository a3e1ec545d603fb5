"""Epsilon at delta and delta at epsilon for a process, with the accountant that answered.

* ``"pld"`` (the default): dp-accounting's ``PLDAccountant``, pessimistic, discretization 1e-4 (see below), with
  random allocation (k-out-of-t, balls-in-bins with ``C = I``) from the numerical PLD of
  :mod:`opake_core.accounting.allocation_pld`.
* ``"rdp"``: dp-accounting's ``RdpAccountant`` with its default orders (looser; no truncated Poisson, no random
  allocation; a group under Poisson sampling through the Poisson step that dominates it,
  :func:`opake_core.accounting.group.rdp_dominating`).
* ``"monte_carlo"``: the estimators of :mod:`opake_core.accounting.random_allocation` (on request, for processes with
  a random-allocation part; ``monte_carlo=`` settings need it named) and :mod:`opake_core.accounting.mf_monte_carlo`,
  the only accountant for the Monte Carlo DP-FTRL processes (chosen automatically for them when ``accountant=None``;
  they may answer ``"analytic_gaussian"``, their exact unamplified bound, when it is smaller).

One surface for every process: ``epsilon`` and ``delta`` dispatch on the process, DP-SGD and DP-FTRL alike.

Adjacency is add-or-remove-one by default; ``adjacency="replace_one"`` or ``"replace_special"`` select
dp-accounting's other neighbouring relations where the analysis needs them. A process that samples without
replacement (fixed-size batches) has an amplification bound under replace-one only, by RDP: ``adjacency=None`` and
``accountant=None`` resolve to ``"replace_one"`` and ``"rdp"`` for it, and anything else is refused. A process with
a noise multiplier of 0 anywhere is non-private: epsilon is ``inf`` and delta is 1 (values, not errors).

Bounded cost. A PLD grid spans the privacy loss of the run, so its size grows with epsilon: a tiny noise multiplier,
or many steps without sampling, would otherwise take minutes and gigabytes (0.3 noise over 1000 unsampled steps:
150 s and 21 GB at 1e-4). When ``discretization`` is left at None, a cheap RDP upper bound ``E`` of epsilon at
delta 1e-10 is computed first and the interval is ``max(1e-4, E / 1e6)``: unchanged wherever that bound is below
100, and about a million grid points otherwise. Pessimistic discretization stays an upper bound at any interval;
the added slack is at most the interval per composed step (0.1% of epsilon in the example above, now 2 s).
Where that bound exceeds a million (an epsilon no grid can hold, and no guarantee at all), RDP answers, and the
result says so. PLD queries of more than a million composed steps are refused with a pointer to RDP: dp-accounting
takes minutes (ten million steps) to hours for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import dp_accounting
from dp_accounting import rdp

from opake_core import validate
from opake_core.accounting import mf_monte_carlo as _mf_mc
from opake_core.accounting import random_allocation as _ra
from opake_core.accounting.allocation_pld import AllocationPLDAccountant
from opake_core.accounting.group import rdp_dominating
from opake_core.accounting.mf_monte_carlo import MonteCarloMF
from opake_core.accounting.processes import (
    Compose,
    Process,
    Repeat,
    WithoutReplacement,
    contains_random_allocation,
    contains_without_replacement,
    is_nonprivate,
    releases,
    to_dp_event,
)
from opake_core.errors import ConfigurationError

__all__ = ["ACCOUNTANTS", "ADJACENCIES", "DEFAULT_DISCRETIZATION", "Result", "default_adjacency", "delta", "epsilon"]

ACCOUNTANTS = ("pld", "rdp", "monte_carlo")
"""The accountants a query can name (``accountant=``); None picks one for the process (module docstring)."""
DEFAULT_DISCRETIZATION = 1e-4
GRID_POINTS = 1e6  # the grid size the automatic discretization aims at for large epsilons
MAX_PLD_STEPS = 10**6  # dp-accounting's PLD composition of more steps takes minutes to hours
_Rel = dp_accounting.NeighboringRelation
ADJACENCIES = {
    "add_or_remove": _Rel.ADD_OR_REMOVE_ONE,
    "replace_one": _Rel.REPLACE_ONE,
    "replace_special": _Rel.REPLACE_SPECIAL,
}


@dataclass(frozen=True)
class Result:
    """A privacy number and the accountant that produced it (``float(result)`` gives the number).

    Example:

        >>> from opake_core import accounting
        >>> result = accounting.epsilon(accounting.gaussian(2.0), delta=1e-5, accountant="rdp")
        >>> result.accountant, float(result) == result.value
        ('rdp', True)
    """

    value: float
    accountant: str

    def __float__(self) -> float:
        return self.value


def _resolve(process: Process, accountant: str | None, monte_carlo: object = None) -> str:
    only_mc = isinstance(process, MonteCarloMF)
    allocation = not only_mc and contains_random_allocation(process)
    fixed_size = contains_without_replacement(process)
    if accountant is None:
        accountant = "monte_carlo" if only_mc else "rdp" if fixed_size else "pld"
    if fixed_size and accountant != "rdp":
        raise ConfigurationError(
            f"sampling without replacement is accounted by RDP only (Wang, Balle and Kasiviswanathan 2019; "
            f"dp-accounting's PLD has no event for it), not {accountant!r}. Use accountant='rdp' or None."
        )
    if accountant not in ACCOUNTANTS:
        raise ConfigurationError(f"accountant must be one of {ACCOUNTANTS} or None, got {accountant!r}.")
    if only_mc and accountant != "monte_carlo":
        raise ConfigurationError(
            f"a {type(process).__name__} process (DP-FTRL with balls-in-bins or b-min-sep sampling) is accounted by "
            f"Monte Carlo only, not {accountant!r}: dp-accounting has no event for it. Use accountant='monte_carlo' "
            "or None."
        )
    if allocation and accountant == "rdp":
        raise ConfigurationError(
            "a random allocation (k-out-of-t, balls-in-bins) is accounted by its numerical PLD (accountant='pld', the "
            "default) or by Monte Carlo (accountant='monte_carlo'), not 'rdp'."
        )
    if accountant == "monte_carlo" and not (only_mc or allocation):
        raise ConfigurationError(
            "accountant='monte_carlo' is only for random-allocation and Monte Carlo DP-FTRL processes; use 'pld' "
            "(exact, the default)."
        )
    if monte_carlo is not None and accountant != "monte_carlo":
        raise ConfigurationError(
            f"monte_carlo settings were given but the {accountant!r} accountant answers (random allocations are "
            "accounted by their numerical PLD by default); pass accountant='monte_carlo' to use the Monte Carlo "
            "estimator, or drop the settings."
        )
    return accountant


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Silence dp-accounting's warnings about the RDP orders it drops (the RDP answer only sizes the PLD grid)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def _steps(process: Process) -> int:
    """How many releases ``process`` composes (a whole-horizon release counts once)."""
    if isinstance(process, Repeat):
        return process.count * _steps(process.process)
    if isinstance(process, Compose):
        return sum(_steps(p) for p in process.processes)
    return 1


def _rdp_bound(event: dp_accounting.DpEvent, relation: _Rel) -> float | None:
    """RDP's epsilon of ``event`` at delta 1e-10 (cheap; an upper bound of the PLD answer), None if unsupported."""
    accountant = rdp.RdpAccountant(neighboring_relation=relation)
    event = rdp_dominating(event)
    if not accountant.supports(event):
        return None
    with _quiet_absl():
        accountant.compose(event)
        return accountant.get_epsilon(1e-10)


def _check_rdp_replace_one(process: Process) -> None:
    """Under replace-one, dp-accounting's RDP reads a Gaussian's multiplier against the replace-one sensitivity (twice
    the clipping bound); only :class:`WithoutReplacement` converts to that convention, so it must be alone."""
    if all(isinstance(part, WithoutReplacement) for part in releases(process)):
        return
    if contains_without_replacement(process):
        raise ConfigurationError(
            "sampling without replacement cannot be composed with other releases here: no accountant covers both "
            "(they are accounted under different adjacencies and accountants). Account each run on its own."
        )
    raise ConfigurationError(
        "under replace-one adjacency the RDP accountant serves sampling without replacement only: dp-accounting's "
        "RDP reads a plain Gaussian's multiplier against the replace-one sensitivity (twice the clipping bound), "
        "these processes against the clipping bound. Use accountant='pld', which models the replacement itself."
    )


def default_adjacency(process: Process) -> str:
    """The neighbouring relation a query of ``process`` uses by default (``adjacency=None``): replace-one for a
    process that samples without replacement (the only one it is accounted under), add-or-remove otherwise.

    Example:

        >>> from opake_core import accounting
        >>> g = accounting.gaussian(1.0)
        >>> accounting.default_adjacency(accounting.poisson(g, 0.01))
        'add_or_remove'
        >>> accounting.default_adjacency(accounting.without_replacement(g, dataset_size=100, sample_size=10))
        'replace_one'
    """
    return "replace_one" if contains_without_replacement(process) else "add_or_remove"


def _adjacency(process: Process, adjacency: str | None) -> str:
    """The neighbouring relation of the query: ``adjacency``, checked, or :func:`default_adjacency`."""
    if adjacency is None:
        return default_adjacency(process)
    if adjacency not in ADJACENCIES:
        raise ConfigurationError(f"adjacency must be one of {sorted(ADJACENCIES)}, got {adjacency!r}.")
    if contains_without_replacement(process) and adjacency != "replace_one":
        raise ConfigurationError(
            f"sampling without replacement has an amplification bound under replace-one adjacency only, not "
            f"{adjacency!r}: the dataset size is public. Use adjacency='replace_one' or None, or Poisson sampling "
            "for an add-or-remove guarantee."
        )
    return adjacency


def _composed(
    process: Process, name: str, adjacency: str | None, discretization: float | None
) -> tuple[dp_accounting.PrivacyAccountant, str]:
    """The accountant that answers for ``process`` (with ``process`` composed in) and its name (module docstring:
    a PLD grid sized to the epsilon; RDP where epsilon is in the millions, which no grid can hold)."""
    adjacency = _adjacency(process, adjacency)
    relation = ADJACENCIES[adjacency]
    event = to_dp_event(process)
    if name == "pld":
        if (steps := _steps(process)) > MAX_PLD_STEPS:
            raise ConfigurationError(
                f"PLD accounting of {steps} composed steps is refused above {MAX_PLD_STEPS}: it would take minutes to "
                "hours. Use accountant='rdp' (--accountant rdp), a looser upper bound computed at once."
            )
        if discretization is None:
            bound = _rdp_bound(event, relation)
            if bound is not None and not bound <= GRID_POINTS:
                name = "rdp"
            discretization = max(DEFAULT_DISCRETIZATION, (bound or 0.0) / GRID_POINTS)
        discretization = validate.real("discretization", discretization)
        if discretization <= 0:
            raise ConfigurationError(f"discretization must be > 0, got {discretization!r}; the default is 1e-4.")
    if name == "rdp" and adjacency == "replace_one":
        _check_rdp_replace_one(process)
    if name == "rdp":
        accountant = rdp.RdpAccountant(neighboring_relation=relation)
        event = rdp_dominating(event)  # a group of records: the Poisson step that dominates it
    else:
        accountant = AllocationPLDAccountant(relation, value_discretization_interval=discretization)
    if not accountant.supports(event):
        raise ConfigurationError(
            f"the {name!r} accountant cannot account {process!r} under adjacency {adjacency!r}; "
            "use accountant='pld' (truncated Poisson is PLD-only) or another adjacency."
        )
    with _quiet_absl():
        accountant.compose(event)
    return accountant, name


def epsilon(
    process: Process,
    *,
    delta: float,
    accountant: str | None = None,
    adjacency: str | None = None,
    discretization: float | None = None,
    monte_carlo: _ra.MonteCarlo | None = None,
) -> Result:
    """The smallest epsilon such that ``process`` is (epsilon, delta)-DP, by the named accountant.

    ``accountant=None`` means PLD, or Monte Carlo where no dp-accounting event exists. ``discretization=None`` is
    1e-4, coarsened for epsilons above 100 (module docstring). Returns ``Result(inf, ...)`` for a non-private
    process.

    Example: the PLD answer is dp-accounting's, and RDP's is a looser upper bound.

        >>> import dp_accounting
        >>> from opake_core import accounting
        >>> pld = accounting.epsilon(accounting.gaussian(3.0), delta=1e-5)
        >>> direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        >>> pld, pld.value == direct.compose(dp_accounting.GaussianDpEvent(3.0)).get_epsilon(1e-5)
        (Result(value=1.27..., accountant='pld'), True)
        >>> accounting.epsilon(accounting.gaussian(3.0), delta=1e-5, accountant="rdp").value > pld.value
        True
    """
    target = validate.delta("delta", delta)
    name = _resolve(process, accountant, monte_carlo)
    if isinstance(process, MonteCarloMF):
        return Result(*_mf_mc.epsilon(process, delta=target, config=monte_carlo))
    if is_nonprivate(process):
        return Result(math.inf, name)
    if name == "monte_carlo":
        return Result(_ra.epsilon(process, delta=target, config=monte_carlo or _ra.MonteCarlo()), name)
    accountant, name = _composed(process, name, adjacency, discretization)
    return Result(float(accountant.get_epsilon(target)), name)


def delta(
    process: Process,
    *,
    epsilon: float,
    accountant: str | None = None,
    adjacency: str | None = None,
    discretization: float | None = None,
    monte_carlo: _ra.MonteCarlo | None = None,
) -> Result:
    """The smallest delta such that ``process`` is (epsilon, delta)-DP; 1 for a non-private process.

    Example: one Gaussian release, against the exact delta of the Gaussian mechanism (Balle and Wang 2018, Thm 8),
    ``Phi(1 / (2 sigma) - epsilon sigma) - e^epsilon Phi(-1 / (2 sigma) - epsilon sigma)``.

        >>> import math
        >>> from scipy.stats import norm
        >>> from opake_core import accounting
        >>> sigma, eps = 3.0, 1.0
        >>> exact = norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)
        >>> bool(abs(accounting.delta(accounting.gaussian(sigma), epsilon=eps).value / exact - 1) < 1e-6)
        True
    """
    target = validate.epsilon("epsilon", epsilon)
    name = _resolve(process, accountant, monte_carlo)
    if isinstance(process, MonteCarloMF):
        return Result(*_mf_mc.delta(process, epsilon=target, config=monte_carlo))
    if is_nonprivate(process):
        return Result(1.0, name)
    if name == "monte_carlo":
        return Result(_ra.delta(process, epsilon=target, config=monte_carlo or _ra.MonteCarlo()), name)
    accountant, name = _composed(process, name, adjacency, discretization)
    return Result(float(min(max(accountant.get_delta(target), 0.0), 1.0)), name)
