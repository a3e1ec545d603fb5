"""Participation patterns: how often, and how far apart, one example can contribute to the stream.

The sensitivity of a strategy ``C`` is ``max_pi ||sum_{j in pi} C[:, j]||`` over the allowed sets ``pi`` of steps.
These are public facts about the sampler; the samplers themselves (and the check that a sampler matches the
pattern it declares) live in ``opake_core.sampling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opake_core import validate

__all__ = ["SINGLE", "CyclicParticipation", "MinSepParticipation", "Participation", "SingleParticipation"]


@dataclass(frozen=True)
class SingleParticipation:
    """Every example contributes to at most one step (single-epoch DP-FTRL; also the per-round sensitivity that
    amplified BandMF under cyclic Poisson sampling is accounted with).

    Example: the default pattern; the sensitivity is then the norm of one column of ``C``.

        >>> from opake_core import mf
        >>> strategy = mf.BandedToeplitz((0.8, 0.6))
        >>> mf.sensitivity(strategy, 6, participation=mf.SingleParticipation())
        1.0
        >>> round(mf.sensitivity(strategy, 6, participation=mf.MinSepParticipation(2)), 6)  # 3 columns, no overlap
        1.732051
    """

    def min_sep_and_count(self, n: int) -> tuple[int, int]:
        """The equivalent ``(min_sep, max_participations)``."""
        return n, 1


@dataclass(frozen=True)
class MinSepParticipation:
    """At most ``max_participations`` steps (all when ``None``), any two at least ``min_sep`` apart.

    Attributes:
        min_sep: ``b >= 1``, the minimum separation of two participations.
        max_participations: ``k >= 1``, or ``None`` for ``ceil(n / b)``.
    """

    min_sep: int
    max_participations: int | None = None

    def __post_init__(self) -> None:
        validate.integer("min_sep", self.min_sep, minimum=1)
        if self.max_participations is not None:
            validate.integer("max_participations", self.max_participations, minimum=1)

    def min_sep_and_count(self, n: int) -> tuple[int, int]:
        """The equivalent ``(min_sep, max_participations)`` at horizon ``n``."""
        cap = math.ceil(n / self.min_sep)
        k = cap if self.max_participations is None else min(cap, self.max_participations)
        return self.min_sep, k


@dataclass(frozen=True)
class CyclicParticipation:
    """An example belongs to one residue ``r`` of ``cycle_length`` and may join the steps ``r, r + b, r + 2b, ...``
    (cyclic Poisson / balls-in-bins / fixed-epoch order: ``b`` = the number of groups or bins).

    Attributes:
        cycle_length: ``b >= 1``.
    """

    cycle_length: int

    def __post_init__(self) -> None:
        validate.integer("cycle_length", self.cycle_length, minimum=1)

    def min_sep_and_count(self, n: int) -> tuple[int, int]:
        """The equivalent ``(min_sep, max_participations)``: ``(b, ceil(n / b))`` (same worst case for ``C >= 0``)."""
        return self.cycle_length, math.ceil(n / self.cycle_length)


Participation = SingleParticipation | MinSepParticipation | CyclicParticipation

SINGLE = SingleParticipation()
"""The default participation pattern (a module-level instance, so that it can be a default argument)."""
