"""Epsilon at delta and delta at epsilon for a process, with the accountant that answered.

* ``"pld"`` (the default): dp-accounting's ``PLDAccountant``, pessimistic, discretization 1e-4.
* ``"rdp"``: dp-accounting's ``RdpAccountant`` with its default orders (looser; no truncated Poisson).
* ``"monte_carlo"``: the estimator of :mod:`opake_core.accounting.random_allocation`, the only accountant for
  processes with a random-allocation part (chosen automatically for them when ``accountant=None``).

Adjacency is add-or-remove-one by default; ``adjacency="replace_one"`` or ``"replace_special"`` select
dp-accounting's other neighbouring relations where the analysis needs them. A process with a noise multiplier
of 0 anywhere is non-private: epsilon is ``inf`` and delta is 1 (values, not errors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting
from dp_accounting import pld, rdp

from opake_core.accounting import _checks
from opake_core.accounting import random_allocation as _ra
from opake_core.accounting.processes import Process, contains_random_allocation, is_nonprivate, to_dp_event
from opake_core.errors import ConfigurationError

__all__ = ["ACCOUNTANTS", "ADJACENCIES", "DEFAULT_DISCRETIZATION", "Result", "delta", "epsilon"]

ACCOUNTANTS = ("pld", "rdp", "monte_carlo")
DEFAULT_DISCRETIZATION = 1e-4
_Rel = dp_accounting.NeighboringRelation
ADJACENCIES = {
    "add_or_remove": _Rel.ADD_OR_REMOVE_ONE,
    "replace_one": _Rel.REPLACE_ONE,
    "replace_special": _Rel.REPLACE_SPECIAL,
}


@dataclass(frozen=True)
class Result:
    """A privacy number and the accountant that produced it (``float(result)`` gives the number)."""

    value: float
    accountant: str

    def __float__(self) -> float:
        return self.value


def _resolve(process: Process, accountant: str | None) -> str:
    needs_mc = contains_random_allocation(process)
    if accountant is None:
        return "monte_carlo" if needs_mc else "pld"
    if accountant not in ACCOUNTANTS:
        raise ConfigurationError(f"accountant must be one of {ACCOUNTANTS} or None, got {accountant!r}.")
    if needs_mc and accountant != "monte_carlo":
        raise ConfigurationError(
            f"a random-allocation process (k-out-of-t sampling) cannot be accounted with {accountant!r}: "
            "dp-accounting has no event for it. Use accountant='monte_carlo' or None."
        )
    if not needs_mc and accountant == "monte_carlo":
        raise ConfigurationError(
            "accountant='monte_carlo' is only for random-allocation processes; use 'pld' (exact, the default)."
        )
    return accountant


def _accountant(name: str, adjacency: str, discretization: float) -> dp_accounting.PrivacyAccountant:
    if adjacency not in ADJACENCIES:
        raise ConfigurationError(f"adjacency must be one of {sorted(ADJACENCIES)}, got {adjacency!r}.")
    relation = ADJACENCIES[adjacency]
    if name == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    discretization = _checks.real("discretization", discretization)
    if discretization <= 0:
        raise ConfigurationError(f"discretization must be > 0, got {discretization!r}; the default is 1e-4.")
    return pld.PLDAccountant(relation, value_discretization_interval=discretization)


def _composed(process: Process, name: str, adjacency: str, discretization: float) -> dp_accounting.PrivacyAccountant:
    acc = _accountant(name, adjacency, discretization)
    event = to_dp_event(process)
    if not acc.supports(event):
        raise ConfigurationError(
            f"the {name!r} accountant cannot account {process!r} under adjacency {adjacency!r}; "
            "use accountant='pld' (truncated Poisson is PLD-only) or another adjacency."
        )
    acc.compose(event)
    return acc


def epsilon(
    process: Process,
    *,
    delta: float,
    accountant: str | None = None,
    adjacency: str = "add_or_remove",
    discretization: float = DEFAULT_DISCRETIZATION,
    monte_carlo: _ra.MonteCarlo | None = None,
) -> Result:
    """The smallest epsilon such that ``process`` is (epsilon, delta)-DP, by the named accountant.

    ``accountant=None`` means PLD, or Monte Carlo for random allocation. Returns ``Result(inf, ...)`` for a
    non-private process.
    """
    target = _checks.delta(delta)
    name = _resolve(process, accountant)
    if is_nonprivate(process):
        return Result(math.inf, name)
    if name == "monte_carlo":
        return Result(_ra.epsilon(process, delta=target, config=monte_carlo or _ra.MonteCarlo()), name)
    value = _composed(process, name, adjacency, discretization).get_epsilon(target)
    return Result(float(value), name)


def delta(
    process: Process,
    *,
    epsilon: float,
    accountant: str | None = None,
    adjacency: str = "add_or_remove",
    discretization: float = DEFAULT_DISCRETIZATION,
    monte_carlo: _ra.MonteCarlo | None = None,
) -> Result:
    """The smallest delta such that ``process`` is (epsilon, delta)-DP; 1 for a non-private process."""
    target = _checks.epsilon("epsilon", epsilon)
    name = _resolve(process, accountant)
    if is_nonprivate(process):
        return Result(1.0, name)
    if name == "monte_carlo":
        return Result(_ra.delta(process, epsilon=target, config=monte_carlo or _ra.MonteCarlo()), name)
    value = _composed(process, name, adjacency, discretization).get_delta(target)
    return Result(float(min(max(value, 0.0), 1.0)), name)
