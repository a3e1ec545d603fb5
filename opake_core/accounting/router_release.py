"""Accounting of the private router release of mixture-of-experts models (:mod:`opake_core.router_release`).

Each step releases, from the same sampled batch, the gradient (sensitivity ``C / B``, noise std ``z C / B``) and the
router load statistic (sensitivity ``Delta_L / B``, noise std ``(z / sqrt(rho)) Delta_L / B``). Divide each block by
its sensitivity: one example moves the pair by ``(u, v)`` with ``||u|| <= 1`` and ``||v|| <= 1``, in blocks whose
noise stds are ``z`` and ``z / sqrt(rho)``. Rescale the second block by ``sqrt(rho)``: both blocks then have noise
std ``z`` and the shift has norm at most ``sqrt(1 + rho)``, so the pair is one Gaussian mechanism with multiplier
``z_eff = z / sqrt(1 + rho)`` (``1/z_eff^2 = 1/z^2 + rho/z^2``, the Gaussian composition theorem of Dong, Roth, Su
2019, Corollary 3.3, as a single release). Sampling, repetition and composition act on the pair as on any Gaussian
release, so the process of a run with the router release is the run's process with every Gaussian's multiplier
replaced by ``z_eff``.
"""

from __future__ import annotations

import dataclasses
import math

from opake_core import validate
from opake_core.accounting.processes import (
    AdaptiveClipping,
    Compose,
    Gaussian,
    Poisson,
    PoissonGroup,
    Process,
    RandomAllocation,
    Repeat,
    TruncatedPoisson,
    WithoutReplacement,
)
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["moe_aux", "moe_aux_multiplier"]


def moe_aux_multiplier(noise_multiplier: float, *, ratio: float) -> float:
    """``z / sqrt(1 + rho)``: the multiplier of the gradient and router releases accounted as one Gaussian.

    Example:

        >>> from opake_core import accounting
        >>> accounting.moe_aux_multiplier(1.0, ratio=0.21)  # 1 / sqrt(1.21)
        0.9090909090909091
    """
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    return z / math.sqrt(1.0 + validate.positive("ratio", ratio))


def moe_aux(process: Process, *, ratio: float) -> Process:
    """``process`` with the router release of every step added: each Gaussian's multiplier ``z`` becomes
    ``z / sqrt(1 + ratio)``.

    Args:
        process: the run's process without the router release, built from ``gaussian`` (plain, Poisson, truncated
            Poisson, Poisson seen by a group, random allocation, repeated or composed).
        ratio: ``rho > 0``, the router release's share (its own multiplier is ``z / sqrt(rho)``).

    Raises:
        ConfigurationError: adaptive clipping inside ``process`` (the router release is defined with a fixed
            clipping bound), or ``ratio <= 0``.
        InputTypeError: ``process`` is not a process of :mod:`opake_core.accounting.processes` (a DP-FTRL process
            is refused: the router release is a DP-SGD release).

    Example: the router release costs what a gradient release at the smaller multiplier costs.

        >>> from opake_core import accounting
        >>> run = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 100)
        >>> accounting.moe_aux(run, ratio=0.21) == accounting.repeat(
        ...     accounting.poisson(accounting.gaussian(1 / 1.1), 0.01), 100)
        True
    """
    rho = validate.positive("ratio", ratio)
    if isinstance(process, Gaussian):
        return Gaussian(moe_aux_multiplier(process.noise_multiplier, ratio=rho))
    if isinstance(process, AdaptiveClipping):
        raise ConfigurationError(
            "moe_aux accounts the router release next to a fixed-bound Gaussian gradient, got adaptive_clipping(...); "
            "use a fixed clipping bound with the router release."
        )
    if isinstance(process, WithoutReplacement):
        raise ConfigurationError(
            "moe_aux accounts the router release under add-or-remove adjacency; sampling without replacement is "
            "accounted under replace-one only. Use Poisson sampling with the router release."
        )
    if isinstance(process, Poisson | PoissonGroup | TruncatedPoisson | RandomAllocation):
        return dataclasses.replace(process, inner=moe_aux(process.inner, ratio=rho))
    if isinstance(process, Repeat):
        return Repeat(moe_aux(process.process, ratio=rho), process.count)
    if isinstance(process, Compose):
        return Compose(tuple(moe_aux(p, ratio=rho) for p in process.processes))
    raise InputTypeError(
        f"moe_aux expects a DP-SGD process (gaussian, poisson, repeat, compose...), got {type(process).__name__}; "
        "the router release runs with the Gaussian mechanism only."
    )
