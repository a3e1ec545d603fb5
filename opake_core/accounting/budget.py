"""Privacy budgets: what a run is allowed to spend (:class:`Budget`), and the guard on delta against the dataset size.

A :class:`Budget` names the number that is bounded and the query that computes it: epsilon at a delta, delta at an
epsilon (:func:`~opake_core.accounting.epsilon`, :func:`~opake_core.accounting.delta`), an attacker's advantage, its
least type II error at a type I error, or its least Bayes risk at a prior (:mod:`opake_core.accounting.fdp`). The
first three are more private when lower, the last two when higher; :func:`~opake_core.accounting.calibrate` searches
any monotone parameter of a process against any of them.

Delta is the probability that the guarantee fails outright. The mechanism that publishes one uniformly chosen
record in the clear is ``(0, 1/N)``-DP on ``N`` records, so a delta of ``1/N`` or more allows exactly such a leak
and certifies nothing about any one person. :func:`check_delta` refuses it unless the caller overrides explicitly,
and warns above ``1/(10 N)``, where the failure probability is still a sizeable fraction of "one record leaks".
The usual choice, and the trainer's default, is ``1 / N**1.1``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from opake_core import validate
from opake_core.accounting import fdp
from opake_core.accounting import queries as _queries
from opake_core.accounting.processes import Process
from opake_core.accounting.queries import Result
from opake_core.errors import ConfigurationError, PrivacyBudgetError

__all__ = ["BUDGET_KINDS", "Budget", "check_delta"]

BUDGET_KINDS = ("epsilon", "delta", "advantage", "beta", "bayes_risk")
"""What a :class:`Budget` can bound; the first three are more private when lower, the last two when higher."""
_AT = {"epsilon": "delta", "delta": "epsilon", "advantage": None, "beta": "alpha", "bayes_risk": "prior"}


@dataclass(frozen=True)
class Budget:
    """A bound on one privacy number of a process: ``kind`` (one of :data:`BUDGET_KINDS`) is at most ``bound``
    (epsilon, delta, advantage) or at least ``bound`` (beta, Bayes risk), at the point ``at`` (the delta of an
    epsilon, the epsilon of a delta, the type I error ``alpha`` of a beta, the prior of a Bayes risk; None for the
    advantage).

    Build one with the constructor named after the number: ``Budget.epsilon(8.0, delta=1e-5)``,
    ``Budget.delta(1e-6, epsilon=2.0)``, ``Budget.advantage(0.1)``, ``Budget.beta(0.5, alpha=0.05)``,
    ``Budget.bayes_risk(0.45, prior=0.5)``.

    Example: one Gaussian release with multiplier 2 (1/2-GDP) meets a beta of 0.8 at alpha 0.05 (its curve gives
    about 0.87) but not an advantage of 0.15 (about 0.197).

        >>> from opake_core import accounting
        >>> release = accounting.gaussian(2.0)
        >>> budget = accounting.Budget.beta(0.8, alpha=0.05)
        >>> str(budget), budget.lower_is_more_private, budget.meets(budget.query(release).value)
        ('beta >= 0.8 at alpha 0.05', False, True)
        >>> accounting.Budget.advantage(0.15).meets(accounting.advantage(release).value)
        False
    """

    kind: str
    bound: float
    at: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_KINDS:
            raise ConfigurationError(f"a budget's kind must be one of {BUDGET_KINDS}, got {self.kind!r}.")
        name = f"the {self.kind} budget"
        if self.kind == "epsilon":
            bound = validate.real(name, self.bound)
            if not bound > 0:
                raise ConfigurationError(f"{name} must be > 0, got {self.bound!r}.")
        elif self.kind == "bayes_risk":
            bound = validate.in_range(name, self.bound, 0.0, 0.5, low_open=True, high_open=False)
        else:
            bound = validate.in_range(name, self.bound, 0.0, 1.0, low_open=True, high_open=True)
        object.__setattr__(self, "bound", bound)
        at = _AT[self.kind]
        if at is None:
            if self.at is not None:
                raise ConfigurationError(f"an advantage budget is not taken at a point, got at={self.at!r}.")
            return
        if self.at is None:
            raise ConfigurationError(f"a {self.kind} budget needs its {at} (at=), got None.")
        checks = {
            "delta": lambda: validate.delta("delta", self.at),
            "epsilon": lambda: validate.epsilon("epsilon", self.at),
            "alpha": lambda: validate.in_range("alpha", self.at, 0.0, 1.0, low_open=False, high_open=False),
            "prior": lambda: validate.in_range("prior", self.at, 0.0, 1.0, low_open=True, high_open=True),
        }
        object.__setattr__(self, "at", checks[at]())

    @classmethod
    def epsilon(cls, bound: float, *, delta: float) -> Budget:
        """Epsilon at most ``bound`` at ``delta`` (the usual (epsilon, delta) budget)."""
        return cls("epsilon", bound, delta)

    @classmethod
    def delta(cls, bound: float, *, epsilon: float) -> Budget:
        """Delta at most ``bound`` at ``epsilon``."""
        return cls("delta", bound, epsilon)

    @classmethod
    def advantage(cls, bound: float) -> Budget:
        """The largest ``TPR - FPR`` of any membership test at most ``bound``."""
        return cls("advantage", bound)

    @classmethod
    def beta(cls, bound: float, *, alpha: float) -> Budget:
        """The least type II error of a test with type I error ``alpha`` at least ``bound``."""
        return cls("beta", bound, alpha)

    @classmethod
    def bayes_risk(cls, bound: float, *, prior: float) -> Budget:
        """The least Bayes error of a membership guess at ``prior`` at least ``bound`` (at most ``min(prior,
        1 - prior)``, the error of guessing blind)."""
        return cls("bayes_risk", bound, prior)

    @property
    def lower_is_more_private(self) -> bool:
        """True for epsilon, delta and advantage (bounded above); False for beta and Bayes risk (bounded below)."""
        return self.kind in ("epsilon", "delta", "advantage")

    def meets(self, value: float) -> bool:
        """Whether the number ``value`` (this budget's kind) is within the budget; the bound itself is."""
        return value <= self.bound if self.lower_is_more_private else value >= self.bound

    def query(self, process: Process, *, accountant: str | None = None, **query: object) -> Result:
        """This budget's number for ``process``: :func:`~opake_core.accounting.epsilon` or
        :func:`~opake_core.accounting.delta` (``accountant`` and ``query`` passed on), or the f-DP query of
        :mod:`opake_core.accounting.fdp` (PLD only; ``query`` may hold ``adjacency`` and ``discretization``)."""
        if self.kind == "epsilon":
            return _queries.epsilon(process, delta=self.at, accountant=accountant, **query)
        if self.kind == "delta":
            return _queries.delta(process, epsilon=self.at, accountant=accountant, **query)
        if accountant not in (None, "pld"):
            raise ConfigurationError(
                f"a {self.kind} budget is read from the PLD privacy profile, not the {accountant!r} accountant; "
                "use accountant=None or 'pld'."
            )
        if self.kind == "advantage":
            return fdp.advantage(process, **query)
        if self.kind == "beta":
            return fdp.beta(process, alpha=self.at, **query)
        return fdp.bayes_risk(process, prior=self.at, **query)

    def __str__(self) -> str:
        name = "Bayes risk" if self.kind == "bayes_risk" else self.kind
        side = "<=" if self.lower_is_more_private else ">="
        at = "" if self.at is None else f" at {_AT[self.kind]} {self.at:g}"
        return f"{name} {side} {self.bound:g}{at}"


def check_delta(delta: float, *, dataset_size: int, allow_large: bool = False) -> float:
    """``delta`` checked against ``1/dataset_size``: PrivacyBudgetError at or above it (unless ``allow_large``),
    a warning above ``1/(10 dataset_size)``; returns it as a float.

    Example:

        >>> from opake_core import PrivacyBudgetError, accounting
        >>> accounting.check_delta(1e-6, dataset_size=10_000)
        1e-06
        >>> try:
        ...     accounting.check_delta(1e-3, dataset_size=10_000)  # one record in the clear would satisfy it
        ... except PrivacyBudgetError:
        ...     print("refused")
        refused
    """
    value = validate.delta("delta", delta)
    n = validate.integer("dataset_size", dataset_size, minimum=1)
    if value >= 1 / n and not allow_large:
        raise PrivacyBudgetError(
            f"delta={value:.3g} is >= 1/N = {1 / n:.3g} for N={n} records: at that delta, publishing one random "
            f"record in the clear satisfies the guarantee. Use delta < 1/N (the default is 1/N**1.1 = "
            f"{n**-1.1:.3g}), or set the explicit override (privacy_allow_large_delta=True, --allow-large-delta) "
            "if you accept that."
        )
    if value > 1 / (10 * n):
        warnings.warn(
            f"delta={value:.3g} is above 1/(10 N) = {1 / (10 * n):.3g} for N={n} records: the guarantee fails with "
            f"a probability close to that of leaking one record. The usual choice is 1/N**1.1 = {n**-1.1:.3g}.",
            stacklevel=2,
        )
    return value
