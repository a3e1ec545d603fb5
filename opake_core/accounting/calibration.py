"""Calibration: a monotone parameter (noise multiplier, sample rate, steps) for any budget, the stop-at-epsilon step.

:func:`calibrate` finds the least private value of one parameter whose process meets a :class:`Budget` (epsilon at
delta, delta at epsilon, advantage, beta at alpha, Bayes risk at a prior): the smallest noise multiplier, the largest
sample rate or the most steps. It assumes the budget's number moves one way with the parameter (more noise, a lower
rate or fewer steps is never less private), which holds for every process here; the assumption is checked at every
probe against the most private end of the range, and the search refuses when that end misses the budget.

Searches keep a bracket whose safe end meets the budget and return that end, so a calibrated run is never
under-noised. Probes are Illinois (safeguarded regula falsi) steps on the log of the budget's number (its negative
log where higher is more private), which is smooth and monotone in ``log z``, ``log q`` and the step count; for an
epsilon budget with PLD, a cheap RDP answer gives the starting point. A search costs a handful of PLD queries.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from opake_core import validate
from opake_core.accounting.budget import Budget
from opake_core.accounting.mf_monte_carlo import MonteCarloMF, default_monte_carlo
from opake_core.accounting.processes import (
    Process,
    compose,
    contains_random_allocation,
    is_nonprivate,
    repeat,
)
from opake_core.accounting.queries import _quiet_absl
from opake_core.accounting.queries import epsilon as _epsilon
from opake_core.accounting.random_allocation import MonteCarlo
from opake_core.errors import CalibrationError, ConfigurationError, InputTypeError

__all__ = [
    "DEFAULT_RANGES",
    "PARAMETERS",
    "Calibrated",
    "calibrate",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "stop_step",
]

PARAMETERS = ("noise_multiplier", "sample_rate", "steps")
"""The parameters :func:`calibrate` searches: more noise, a lower sample rate and fewer steps are more private."""


@dataclass(frozen=True)
class Calibrated:
    """The calibrated value, the budget's number it achieves (``achieved``), the accountant that answered, how many
    queries it took, and the budget. ``epsilon`` is ``achieved`` for an epsilon budget (refused for the others).

    Example:

        >>> from opake_core import accounting
        >>> found = accounting.calibrate_noise_multiplier(accounting.gaussian, target_epsilon=1.0, delta=1e-5,
        ...                                               accountant="rdp")
        >>> round(found.value, 3), found.epsilon <= 1.0, found.accountant
        (4.045, True, 'rdp')
    """

    value: float | int
    achieved: float
    accountant: str
    evaluations: int
    budget: Budget

    @property
    def epsilon(self) -> float:
        """The epsilon at the budget's delta (epsilon budgets only; ``achieved`` holds the other kinds' number)."""
        if self.budget.kind != "epsilon":
            raise ConfigurationError(
                f"this calibration met a {self.budget.kind} budget ({self.budget}), not an epsilon one: read "
                f"achieved={self.achieved:.6g}, or query epsilon(process, delta=...) at the calibrated value."
            )
        return self.achieved


def _target(target_epsilon: float) -> float:
    value = validate.real("target_epsilon", target_epsilon)
    if value <= 0:
        raise ConfigurationError(f"target_epsilon must be > 0, got {value!r}.")
    return value


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _illinois(eval_at, x0: float, y0: float, x1: float, y1: float, goal: float, is_upper, done, integer: bool):
    """Illinois regula falsi on a bracket of an increasing ``eval_at``: ``x0`` is below the goal, ``x1``
    above.

    ``is_upper(y)`` says on which side a probe lands; ``done(x0, y0, x1)`` stops the search. Returns ``(x0,
    y0, x1, y1)``, the final bracket.
    """
    side = 0
    f0, f1 = y0 - goal, y1 - goal
    while not done(x0, y0, x1):
        w = x1 - x0
        finite = math.isfinite(f0) and math.isfinite(f1) and f1 != f0
        x = x0 - f0 * w / (f1 - f0) if finite else x0 + 0.5 * w
        x = builtins.min(x1 - 1e-3 * w, builtins.max(x0 + 1e-3 * w, x))
        if integer:
            x = float(builtins.min(x1 - 1, builtins.max(x0 + 1, round(x))))
        y = eval_at(x)
        if is_upper(y):
            x1, y1, f1 = x, y, y - goal
            if side == 1:
                f0 /= 2
            side = 1
        else:
            x0, y0, f0 = x, y, y - goal
            if side == -1:
                f1 /= 2
            side = -1
    return x0, y0, x1, y1


def calibrate_noise_multiplier(
    make_process: Callable[[float], Process],
    *,
    target_epsilon: float,
    delta: float,
    min: float = 0.11,
    max: float = 10.0,
    tolerance: float = 1e-3,
    accountant: str | None = None,
    **query: object,
) -> Calibrated:
    """The smallest multiplier in [min, max] (up to ``tolerance``) with ``epsilon(make_process(m)) <=
    target``: :func:`calibrate` with ``Budget.epsilon(target_epsilon, delta=delta)``.

    The returned multiplier's epsilon is <= ``target_epsilon`` and >= ``target_epsilon * (1 - tolerance)``
    (unless ``min`` already meets the target, when ``min`` is returned). Raises CalibrationError when even
    ``max`` does not reach the target. ``query`` is passed to :func:`opake_core.accounting.epsilon`. With PLD,
    a cheap RDP calibration first gives a starting point (RDP is looser, so its multiplier is usually already
    safe).

    Whole-horizon Monte Carlo processes (DP-FTRL with balls-in-bins or b-min-sep sampling) are bisected on ``log z``
    instead, with common random numbers (the same samples' seed at every probe), until the bracket is within
    ``tolerance`` relative on ``z``; each probe runs at failure probability ``beta / 40`` so that the returned
    multiplier's guarantee holds with probability >= 1 - ``beta`` (at most 40 probes). The returned multiplier is
    always the safe end of the bracket.

    Example: the multiplier for epsilon 2 over 1,000 steps at rate 0.01, to 1% (RDP here for speed; PLD is the
    default and gives a smaller multiplier). It meets the target, and a multiplier 3% smaller does not.

        >>> from opake_core import accounting
        >>> run = lambda z: accounting.repeat(accounting.poisson(accounting.gaussian(z), 0.01), 1_000)
        >>> found = accounting.calibrate_noise_multiplier(run, target_epsilon=2.0, delta=1e-5, tolerance=0.01,
        ...                                               accountant="rdp")
        >>> eps = lambda z: accounting.epsilon(run(z), delta=1e-5, accountant="rdp").value
        >>> round(found.value, 2), eps(found.value) <= 2.0 < eps(0.97 * found.value)
        (1.02, True)
    """
    budget = Budget.epsilon(_target(target_epsilon), delta=delta)
    return calibrate(
        make_process,
        budget=budget,
        parameter="noise_multiplier",
        min=min,
        max=max,
        tolerance=tolerance,
        accountant=accountant,
        **query,
    )


@dataclass(frozen=True)
class _Axis:
    """The search coordinate ``u`` of a parameter: the budget's loss grows with ``u`` (``u = -log z``, ``log q``, or
    the step count ``n``), so the low end of the range is the private one."""

    name: str
    integer: bool

    def u(self, value: float) -> float:
        if self.name == "noise_multiplier":
            return -math.log(value)
        return math.log(value) if self.name == "sample_rate" else float(value)

    def value(self, u: float) -> float | int:
        if self.name == "noise_multiplier":
            return math.exp(-u)
        return math.exp(u) if self.name == "sample_rate" else int(u)

    def advance(self, u: float, step: float, far: float) -> float:
        """A probe ``step`` (in log units of the parameter) past ``u``, at most ``far``."""
        if self.integer:
            return builtins.min(far, builtins.max(u + 1, float(round(u * math.exp(step)))))
        return builtins.min(far, u + step)


DEFAULT_RANGES = {"noise_multiplier": (0.11, 10.0), "sample_rate": (1e-9, 1.0), "steps": (1, 10**7)}
"""The range :func:`calibrate` searches for each of :data:`PARAMETERS` when ``min`` / ``max`` are not given."""
_MONOTONE_SLACK = 1e-3  # of the bound: a probe this much more private than the private end is not rounding noise


def _loss(budget: Budget, value: float) -> float:
    """The budget's number on a scale that grows as privacy is lost: its log, or minus its log."""
    return _log(value) if budget.lower_is_more_private else -_log(value)


def _range(parameter: str, min: float | None, max: float | None) -> tuple[float, float]:
    default_lo, default_hi = DEFAULT_RANGES[parameter]
    lo = default_lo if min is None else min
    hi = default_hi if max is None else max
    if parameter == "steps":
        lo, hi = validate.integer("min", lo, minimum=1), validate.integer("max", hi, minimum=1)
        if lo > hi:
            raise CalibrationError(f"step calibration needs 1 <= min <= max, got min={lo!r}, max={hi!r}.")
        return lo, hi
    lo, hi = validate.real("min", lo), validate.real("max", hi)
    if not 0 < lo < hi:
        raise CalibrationError(f"calibration bounds need 0 < min < max, got min={lo!r}, max={hi!r}.")
    if parameter == "sample_rate" and hi > 1:
        raise CalibrationError(f"a sample rate is at most 1, got max={hi!r}.")
    return lo, hi


def _unreachable(parameter: str, budget: Budget, end: float, value: float) -> CalibrationError:
    what = f"{budget.kind} there is {value:.6g}"
    if parameter == "noise_multiplier":
        return CalibrationError(
            f"the budget {budget} is unreachable with noise multipliers up to max={end}: {what}. Raise max, lower "
            "the steps or the sample rate, or accept a larger budget."
        )
    if parameter == "sample_rate":
        return CalibrationError(
            f"the budget {budget} is unreachable with sample rates down to min={end}: {what}. Raise the noise "
            "multiplier, lower the steps, or accept a larger budget."
        )
    steps = "one step" if end == 1 else f"min={end} steps"
    return CalibrationError(
        f"even {steps} misses the budget {budget} ({budget.kind} {value:.6g}); raise the noise multiplier or lower "
        "the sample rate."
    )


def calibrate(
    make_process: Callable[[Any], Process],
    *,
    budget: Budget,
    parameter: str,
    min: float | None = None,
    max: float | None = None,
    tolerance: float = 1e-3,
    accountant: str | None = None,
    **query: object,
) -> Calibrated:
    """The least private value in ``[min, max]`` of one parameter of ``make_process`` that meets ``budget``.

    ``parameter`` is one of :data:`PARAMETERS`: ``"noise_multiplier"`` (the smallest multiplier; default range
    [0.11, 10]), ``"sample_rate"`` (the largest rate; (0, 1], default [1e-9, 1]) or ``"steps"`` (the most steps, an
    integer; default [1, 10**7]). ``make_process(value)`` builds the process at that value. The budget's number is
    assumed monotone in the parameter (more noise, a lower rate or fewer steps is never less private).

    Guarantees: the returned value meets the budget (its number, ``achieved``, is checked by the budget's own query).
    For a continuous parameter, ``achieved`` is within a factor ``1 - tolerance`` of the bound (``bound * (1 -
    tolerance) <= achieved <= bound`` where lower is more private, ``bound <= achieved <= bound / (1 - tolerance)``
    where higher is), unless the least private end of the range already meets it, when that end is returned. Steps
    are exact: one more step misses the budget.

    Raises:
        CalibrationError: the most private end of the range (``max`` noise, ``min`` rate, ``min`` steps) misses the
            budget, bad bounds, or a probe more private than that end (the parameter is not monotone).
        ConfigurationError: a parameter that is not in :data:`PARAMETERS`; a budget the process has no query for
            (f-DP budgets need a PLD; Monte Carlo DP-FTRL processes calibrate the noise multiplier to an epsilon
            budget only, see :func:`calibrate_noise_multiplier`).

    ``query`` is passed to the budget's query (``adjacency``, ``discretization``, ``monte_carlo``).

    Example: the largest Poisson rate for 1,000 steps at multiplier 1 whose delta at epsilon 2 is at most 1e-6
    (RDP for speed here; PLD is the default). It meets the budget, and a rate 2% higher does not.

        >>> from opake_core import accounting
        >>> run = lambda q: accounting.repeat(accounting.poisson(accounting.gaussian(1.0), q), 1_000)
        >>> budget = accounting.Budget.delta(1e-6, epsilon=2.0)
        >>> found = accounting.calibrate(run, budget=budget, parameter="sample_rate", tolerance=0.01,
        ...                              accountant="rdp")
        >>> d = lambda q: accounting.delta(run(q), epsilon=2.0, accountant="rdp").value
        >>> round(found.value, 4), d(found.value) <= 1e-6 < d(1.02 * found.value)
        (0.0079, True)
    """
    if not isinstance(budget, Budget):
        raise InputTypeError(
            f"budget must be an accounting.Budget, got {type(budget).__name__}; build one with "
            "Budget.epsilon(8.0, delta=1e-5) or another of its constructors."
        )
    if parameter not in PARAMETERS:
        raise ConfigurationError(f"parameter must be one of {PARAMETERS}, got {parameter!r}.")
    lo, hi = _range(parameter, min, max)
    tol = validate.real("tolerance", tolerance)
    if not 0 < tol < 1:
        raise CalibrationError(f"tolerance must be in (0, 1), got {tol!r}; the default is 1e-3 (relative).")
    private, far = (hi, lo) if parameter == "noise_multiplier" else (lo, hi)
    if isinstance(make_process(private), MonteCarloMF):
        if parameter != "noise_multiplier" or budget.kind != "epsilon":
            raise ConfigurationError(
                f"a Monte Carlo DP-FTRL process (balls-in-bins or b-min-sep sampling) calibrates the noise multiplier "
                f"to an epsilon budget only, got parameter={parameter!r} and the budget {budget}."
            )
        return _bisect_monte_carlo(make_process, budget, lo, hi, tol, accountant, **query)
    axis = _Axis(parameter, integer=parameter == "steps")
    seen: dict[float, tuple[float | int, float, str]] = {}  # u -> (parameter value, budget's number, accountant)
    calls = 0

    def loss_at(u: float, value: float | int | None = None) -> float:
        nonlocal calls
        calls += 1
        value = axis.value(u) if value is None else value
        result = budget.query(make_process(value), accountant=accountant, **query)
        seen[u] = (value, result.value, result.accountant)
        first = seen.setdefault(u_private, seen[u])[1]  # every probe is checked against the most private end
        gain = first - result.value if budget.lower_is_more_private else result.value - first
        if gain > _MONOTONE_SLACK * budget.bound:
            raise CalibrationError(
                f"the budget's {budget.kind} is not monotone in {parameter}: {result.value:.6g} at {value!r} is more "
                f"private than {first:.6g} at the most private end {private!r}; calibrate a parameter that moves the "
                "privacy loss one way only."
            )
        # A NaN answer (a profile read past its float range) is never taken for a safe one.
        return math.inf if math.isnan(result.value) else _loss(budget, result.value)

    def found(u: float) -> Calibrated:
        value, number, name = seen[u]
        return Calibrated(value, number, name, calls, budget)

    goal = _loss(budget, budget.bound)
    u_private, u_far = axis.u(private), axis.u(far)
    l0 = loss_at(u_private, private)
    if l0 > goal:
        raise _unreachable(parameter, budget, private, seen[u_private][1])
    u0 = u_private
    if budget.kind == "epsilon" and seen[u0][2] == "pld":
        try:
            with _quiet_absl():
                guide = calibrate(
                    make_process,
                    budget=budget,
                    parameter=parameter,
                    min=lo,
                    max=hi,
                    tolerance=1e-2,
                    accountant="rdp",
                ).value
        except (ConfigurationError, ValueError):
            guide = None
        # RDP is looser than PLD, so its answer is usually already safe: the search starts there.
        if guide is not None and (ug := axis.u(guide)) > u0 and (lg := loss_at(ug, guide)) <= goal:
            u0, l0 = ug, lg
    # Walk away from the private end in growing steps until a probe misses the budget: the unsafe end of the bracket.
    step = 0.08
    while True:
        if u0 == u_far:
            return found(u0)
        u1 = axis.advance(u0, step, u_far)
        l1 = loss_at(u1, far if u1 == u_far else None)
        if l1 > goal:
            break
        u0, l0, step = u1, l1, step * 4
    floor = goal + math.log(1 - tol)
    done = (lambda a, ya, b: b - a <= 1) if axis.integer else (lambda a, ya, b: ya >= floor or b - a < 1e-12)
    us, _, _, _ = _illinois(loss_at, u0, l0, u1, l1, goal, lambda y: y > goal, done, integer=axis.integer)
    return found(us)


_MONTE_CARLO_PROBES = 40


def _bisect_monte_carlo(
    make_process: Callable[[float], Any],
    budget: Budget,
    lo: float,
    hi: float,
    tol: float,
    accountant: str | None,
    monte_carlo: MonteCarlo | None = None,
) -> Calibrated:
    """Bisection on ``log z`` for Monte Carlo processes (see :func:`calibrate_noise_multiplier`)."""
    target, delta = budget.bound, budget.at
    base = monte_carlo or default_monte_carlo(delta)
    config = replace(base, failure_probability=base.failure_probability / _MONTE_CARLO_PROBES)
    calls, names = 0, {}

    def eps(z: float) -> float:
        nonlocal calls
        calls += 1
        result = _epsilon(make_process(z), delta=delta, accountant=accountant, monte_carlo=config)
        names[z] = result.accountant
        return result.value

    e_hi = eps(hi)
    if e_hi > target:
        raise CalibrationError(
            f"target_epsilon={target} is unreachable with noise multipliers up to max={hi}: the Monte Carlo epsilon "
            f"there is {e_hi:.6g}. Raise max, use more Monte Carlo samples, or accept a larger target."
        )
    e_lo = eps(lo)
    if e_lo <= target:
        return Calibrated(lo, e_lo, names[lo], calls, budget)
    while hi / lo - 1 > tol and calls < _MONTE_CARLO_PROBES:
        mid = math.sqrt(lo * hi)
        e_mid = eps(mid)
        if e_mid <= target:
            hi, e_hi = mid, e_mid
        else:
            lo = mid
    return Calibrated(hi, e_hi, names[hi], calls, budget)


def _first_reaching(
    eps_of: Callable[[int], float], target: float, max_steps: int, start: int = 1
) -> tuple[int | None, int]:
    """The smallest n in [1, max_steps] with eps_of(n) >= target (None if none), and the number of queries.

    ``start`` is a guess; the search brackets the answer around it, then narrows it by Illinois steps on log
    eps.
    """
    calls = 0

    def y_of(n: float) -> float:
        nonlocal calls
        calls += 1
        return _log(eps_of(int(n)))

    goal = math.log(target)
    n = builtins.min(builtins.max(1, start), max_steps)
    y = y_of(n)
    lo, y_lo, hi, y_hi = 0, -math.inf, None, math.inf
    if y >= goal:
        hi, y_hi = n, y
    else:
        lo, y_lo = n, y
    grow = 1.25 if start > 1 else 4.0
    while hi is None:
        if lo >= max_steps:
            return None, calls
        n = builtins.min(max_steps, builtins.max(lo + 1, int(lo * grow)))
        y = y_of(n)
        if y >= goal:
            hi, y_hi = n, y
        else:
            lo, y_lo = n, y
        grow *= grow
    while lo == 0 and hi > 1:
        n = builtins.max(1, int(hi / 1.25))
        y = y_of(n)
        if y >= goal:
            hi, y_hi = n, y
        else:
            lo, y_lo = n, y
    if lo == 0:
        return 1, calls
    _, _, hi, _ = _illinois(
        y_of, lo, y_lo, hi, y_hi, goal, lambda v: v >= goal, lambda a, ya, b: b - a <= 1, integer=True
    )
    return int(hi), calls


def _run(step_process: Process, prefix: Process | None, n: int) -> Process:
    return repeat(step_process, n) if prefix is None else compose(prefix, repeat(step_process, n))


def _guide(step_process: Process, prefix: Process | None, target: float, delta: float, max_steps: int) -> int:
    """A starting guess for a PLD step search: the RDP answer (cheap, usually a bit smaller)."""
    try:
        with _quiet_absl():
            found = _first_reaching(
                lambda n: _epsilon(_run(step_process, prefix, n), delta=delta, accountant="rdp").value,
                target,
                max_steps,
            )[0]
    except ConfigurationError:
        return 1
    return found or 1


def _step_query(step_process: Process, prefix: Process | None, target_epsilon: float, where: str) -> float:
    target = _target(target_epsilon)
    if contains_random_allocation(step_process):
        raise ConfigurationError(
            f"{where} needs a per-step process; a random allocation (k-out-of-t) is a whole horizon that is "
            f"accounted "
            "once, so it has no stop-at-epsilon step."
        )
    if is_nonprivate(step_process):
        raise ConfigurationError(
            f"{where}: the step process is non-private (noise multiplier 0, epsilon = inf) but "
            f"target_epsilon={target}; "
            "drop the target for a non-private run or use a positive noise multiplier."
        )
    return target


def stop_step(
    step_process: Process,
    *,
    target_epsilon: float,
    delta: float,
    prefix: Process | None = None,
    max_steps: int = 10**7,
    accountant: str | None = None,
    **query: object,
) -> int | None:
    """The first step n at which ``compose(prefix, repeat(step_process, n))`` reaches epsilon >= target.

    Predicted before training (searched over n, not scanned); None when it is not reached within
    ``max_steps``.

    Example: the step that crosses the target is one past the last step within it.

        >>> from opake_core import accounting
        >>> step = accounting.gaussian(10.0)
        >>> n = accounting.stop_step(step, target_epsilon=2.0, delta=1e-5, accountant="rdp")
        >>> eps = lambda k: accounting.epsilon(accounting.repeat(step, k), delta=1e-5, accountant="rdp").value
        >>> n, eps(n - 1) < 2.0 <= eps(n)
        (22, True)
    """
    target = _step_query(step_process, prefix, target_epsilon, "stop_step")
    max_steps = validate.integer("max_steps", max_steps, minimum=1)

    def eps_of(n: int) -> float:
        return _epsilon(_run(step_process, prefix, n), delta=delta, accountant=accountant, **query).value

    start = _guide(step_process, prefix, target, delta, max_steps) if accountant in (None, "pld") else 1
    return _first_reaching(eps_of, target, max_steps, start)[0]


def calibrate_steps(
    step_process: Process,
    *,
    target_epsilon: float,
    delta: float,
    prefix: Process | None = None,
    max_steps: int = 10**7,
    accountant: str | None = None,
    **query: object,
) -> Calibrated:
    """The most steps n of ``step_process`` (after ``prefix``) whose epsilon is <= ``target_epsilon``:
    :func:`calibrate` of ``parameter="steps"`` with ``Budget.epsilon(target_epsilon, delta=delta)``.

    Raises CalibrationError when even one step exceeds the target; returns ``max_steps`` when the budget is
    not reached within it.

    Example: ``n`` Gaussian releases at multiplier 10 are one at ``10 / sqrt(n)``; 21 fit a budget of 2, and after 20
    spent, one is left.

        >>> from opake_core import accounting
        >>> step = accounting.gaussian(10.0)
        >>> found = accounting.calibrate_steps(step, target_epsilon=2.0, delta=1e-5, accountant="rdp")
        >>> one = accounting.epsilon(accounting.gaussian(10.0 / 21**0.5), delta=1e-5, accountant="rdp").value
        >>> found.value, abs(found.epsilon - one) < 1e-9
        (21, True)
        >>> accounting.calibrate_steps(step, target_epsilon=2.0, delta=1e-5, prefix=accounting.repeat(step, 20),
        ...                            accountant="rdp").value
        1
    """
    target = _step_query(step_process, prefix, target_epsilon, "calibrate_steps")
    max_steps = validate.integer("max_steps", max_steps, minimum=1)
    return calibrate(
        lambda n: _run(step_process, prefix, n),
        budget=Budget.epsilon(target, delta=delta),
        parameter="steps",
        min=1,
        max=max_steps,
        accountant=accountant,
        **query,
    )
