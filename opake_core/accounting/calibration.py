"""Calibration: the noise multiplier for a target, the steps that fit a budget, the stop-at-epsilon step.

Searches keep a bracket whose safe end never exceeds the target and return that end, so a calibrated run is
never under-noised. Probes are Illinois (safeguarded regula falsi) steps on log epsilon, which is smooth and
monotone in the multiplier and in the step count; with PLD, a cheap RDP answer gives the starting point. A
search costs a handful of PLD queries.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from opake_core import validate
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
from opake_core.errors import CalibrationError, ConfigurationError

__all__ = ["Calibrated", "calibrate_noise_multiplier", "calibrate_steps", "stop_step"]


@dataclass(frozen=True)
class Calibrated:
    """The calibrated value, the epsilon it achieves, the accountant, and how many queries it took.

    Example:

        >>> from opake_core import accounting
        >>> found = accounting.calibrate_noise_multiplier(accounting.gaussian, target_epsilon=1.0, delta=1e-5,
        ...                                               accountant="rdp")
        >>> round(found.value, 3), found.epsilon <= 1.0, found.accountant
        (4.045, True, 'rdp')
    """

    value: float | int
    epsilon: float
    accountant: str
    evaluations: int


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
    target``.

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
    target = _target(target_epsilon)
    lo, hi = validate.real("min", min), validate.real("max", max)
    tol = validate.real("tolerance", tolerance)
    if not 0 < lo < hi:
        raise CalibrationError(f"calibration bounds need 0 < min < max, got min={lo!r}, max={hi!r}.")
    if not 0 < tol < 1:
        raise CalibrationError(f"tolerance must be in (0, 1), got {tol!r}; the default is 1e-3 (relative).")
    if isinstance(make_process(hi), MonteCarloMF):
        return _bisect_monte_carlo(make_process, target, delta, lo, hi, tol, accountant, **query)
    calls, names = 0, set()

    def eps(sigma: float) -> float:
        nonlocal calls
        calls += 1
        result = _epsilon(make_process(sigma), delta=delta, accountant=accountant, **query)
        names.add(result.accountant)
        return result.value

    e_hi = eps(hi)
    if e_hi > target:
        raise CalibrationError(
            f"target_epsilon={target} is unreachable with noise multipliers up to max={hi}: epsilon there is "
            f"{e_hi:.6g}. Raise max, lower the steps or the sample rate, or accept a larger target."
        )
    if names == {"pld"}:
        try:
            with _quiet_absl():
                guide = calibrate_noise_multiplier(
                    make_process,
                    target_epsilon=target,
                    delta=delta,
                    min=lo,
                    max=hi,
                    tolerance=1e-2,
                    accountant="rdp",
                ).value
        except (ConfigurationError, ValueError):
            guide = None
        if guide is not None and guide < hi and (e := eps(guide)) <= target:
            hi, e_hi = guide, e
    # Walk down in log sigma until a probe exceeds the target: that is the unsafe end of the bracket.
    x1, step = math.log(hi), 0.08
    while True:
        x0 = builtins.max(math.log(lo), x1 - step)
        e0 = eps(math.exp(x0))
        if e0 > target:
            break
        if x0 == math.log(lo):
            return Calibrated(lo, e0, names.pop(), calls)
        x1, e_hi, step = x0, e0, step * 4
    # In x = -log(sigma) epsilon increases: x0 = -x1 (safe), x1 = -x0 (unsafe).
    goal, floor = math.log(target), math.log(target * (1 - tol))
    xs, ys, _, _ = _illinois(
        lambda x: _log(eps(math.exp(-x))),
        -x1,
        _log(e_hi),
        -x0,
        _log(e0),
        goal,
        lambda y: y > goal,
        lambda a, ya, b: ya >= floor or b - a < 1e-12,
        integer=False,
    )
    return Calibrated(math.exp(-xs), math.exp(ys), names.pop(), calls)


_MONTE_CARLO_PROBES = 40


def _bisect_monte_carlo(
    make_process: Callable[[float], Any],
    target: float,
    delta: float,
    lo: float,
    hi: float,
    tol: float,
    accountant: str | None,
    monte_carlo: MonteCarlo | None = None,
) -> Calibrated:
    """Bisection on ``log z`` for Monte Carlo processes (see :func:`calibrate_noise_multiplier`)."""
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
        return Calibrated(lo, e_lo, names[lo], calls)
    while hi / lo - 1 > tol and calls < _MONTE_CARLO_PROBES:
        mid = math.sqrt(lo * hi)
        e_mid = eps(mid)
        if e_mid <= target:
            hi, e_hi = mid, e_mid
        else:
            lo = mid
    return Calibrated(hi, e_hi, names[hi], calls)


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
    """The most steps n of ``step_process`` (after ``prefix``) whose epsilon is <= ``target_epsilon``.

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
    values: dict[int, tuple[float, str]] = {}

    def eps_of(n: int) -> float:
        result = _epsilon(_run(step_process, prefix, n), delta=delta, accountant=accountant, **query)
        values[n] = (result.value, result.accountant)
        return result.value

    start = _guide(step_process, prefix, target, delta, max_steps) if accountant in (None, "pld") else 1
    first, calls = _first_reaching(lambda n: eps_of(n) if n not in values else values[n][0], target, max_steps, start)
    if first is None:
        n = max_steps
    elif values[first][0] > target:
        n = first - 1
    else:
        n = first  # epsilon exactly at the target still fits
    if n < 1:
        raise CalibrationError(
            f"even one step exceeds target_epsilon={target} (epsilon {values[1][0]:.6g}); "
            "raise the noise multiplier or lower the sample rate."
        )
    if n not in values:
        eps_of(n)
        calls += 1
    return Calibrated(n, values[n][0], values[n][1], calls)
