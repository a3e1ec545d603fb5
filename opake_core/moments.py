"""Private second moments: a clipped sum and its clipped sum of squares, released as one Gaussian mechanism.

Adam divides by a second moment. In DP training the second moment of the *noised* gradient is dominated by the noise
variance; instead, the clipping step can release two streams of the same examples (``n`` the public normalizer,
``c_i = clip(g_i, C)`` each example's clipped gradient, ``⊙`` the element-wise product):

====================  ===============================================================  ================================
stream                value                                                            L2 sensitivity
====================  ===============================================================  ================================
first                 ``(1/n) sum_i c_i``                                              ``Delta_1 = C / n``
second                ``(1/n) sum_i c_i ⊙ c_i``                                        ``Delta_2 = C^2 / n``
====================  ===============================================================  ================================

The second bound holds because ``||c ⊙ c||_2 = ||c||_4^2 <= ||c||_2^2 <= C^2``. Per group (bounds ``C_k``), stream one
has group sensitivities ``C_k / n`` and stream two ``C_k^2 / n``; AUTO-S with bound ``R`` gives ``R / n`` and
``R^2 / n``.

**Noise allocation (one release).** Both streams are noised by one Gaussian mechanism with multiplier ``z``: with
``S = Delta_1 + Delta_2``,

    sigma_1 = z * sqrt(Delta_1 * S),    sigma_2 = z * sqrt(Delta_2 * S),

so that ``(Delta_1 / sigma_1)^2 + (Delta_2 / sigma_2)^2 = (Delta_1 + Delta_2) / (z^2 S) = 1 / z^2``: dividing each
stream by its ``sigma`` gives a Gaussian mechanism whose mean moves by at most ``1 / z`` (in units of the unit noise)
when one example is added or removed, exactly a single Gaussian mechanism with multiplier ``z`` and sensitivity 1.
The accountant is unchanged (the same process as DP-SGD with multiplier ``z``, Poisson subsampling included: one
coin per example decides both streams). Among the allocations that satisfy the constraint it minimizes the total
variance ``sigma_1^2 + sigma_2^2`` per coordinate (Lagrange: ``sigma_k^2 ∝ Delta_k``). It is the per-group
allocation of :func:`opake_core.noise.noise_std_for` with the two streams as groups; with per-group bounds every
(stream, group) pair is a group and ``S`` sums all of them. The price: the first stream's noise grows from
``z Delta_1`` to ``z Delta_1 sqrt(1 + Delta_2 / Delta_1) = z Delta_1 sqrt(1 + C)``.

**Matrix factorization (DP-FTRL).** Stream ``k`` is noised with its own strategy ``C_k`` (sensitivity ``s_k`` under
the declared participation) and ``sigma_k = z sqrt(s_k Delta_k T)``, ``T = s_1 Delta_1 + s_2 Delta_2``; whitened,
the pair is the matrix mechanism of the stacked strategy ``[a_1 C_1; a_2 C_2]``, ``a_k = Delta_k / sigma_k``, whose
Gram matrix ``(w_1 C_1^T C_1 / s_1^2 + w_2 C_2^T C_2 / s_2^2) / z^2`` (``w_k = s_k Delta_k / T``, ``w_1 + w_2 = 1``)
equals that of ``C_1`` alone when ``C_2 = C_1``: the first strategy's accountant is then unchanged. See
:func:`opake_core.noise.paired_mf_gaussian_noise` for the cases a different second strategy is covered.

The private second moments follow the paired-stream release of the Opake library; the optimizer that consumes them
is :func:`opake_core.optim.private_moments.private_moments_adam`. Projected joint moment estimation
(:mod:`opake_core.jme`) releases the same pair of types with a different construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import optree

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup

__all__ = ["ClippedMoments", "NoisedMoments", "paired_noise_std", "paired_scale"]


@dataclass(frozen=True)
class ClippedMoments:
    """The two clipped streams of one step: the clipped sum and the clipped sum of element-wise squares.

    Attributes:
        first: the clipped, normalized sum ``(1/n) sum_i c_i``; sensitivity ``C / n``.
        second: ``(1/n) sum_i c_i ⊙ c_i`` (same tree, same shapes); sensitivity ``C^2 / n``.
    """

    first: Clipped
    second: Clipped

    def __post_init__(self) -> None:
        for name, value in (("first", self.first), ("second", self.second)):
            if not isinstance(value, Clipped) or isinstance(value, Noised):
                raise InputTypeError(f"ClippedMoments.{name} must be an un-noised Clipped, got {type(value).__name__}.")
        if isinstance(self.first.sensitivity, PerGroup) != isinstance(self.second.sensitivity, PerGroup):
            raise InputTypeError(
                "ClippedMoments needs both streams scalar or both per group, got "
                f"{type(self.first.sensitivity).__name__} and {type(self.second.sensitivity).__name__}."
            )
        if isinstance(self.first.sensitivity, PerGroup) and (
            [g for g, _ in self.first.sensitivity.values] != [g for g, _ in self.second.sensitivity.values]
        ):
            raise ConfigurationError(
                "the two streams of ClippedMoments have different groups: "
                f"{[g for g, _ in self.first.sensitivity.values]} and "
                f"{[g for g, _ in self.second.sensitivity.values]}; clip both with the same per_group bounds."
            )


@dataclass(frozen=True)
class NoisedMoments:
    """The two streams after one Gaussian release: the noised first moment and the noised second moment.

    Attributes:
        first: the noised gradient (what Adam's ``m`` averages).
        second: the noised second-moment estimate (what Adam's ``v`` averages); it may be negative where the noise
            exceeds the signal.
    """

    first: Noised
    second: Noised

    def __post_init__(self) -> None:
        for name, value in (("first", self.first), ("second", self.second)):
            if not isinstance(value, Noised):
                raise InputTypeError(f"NoisedMoments.{name} must be a Noised tree, got {type(value).__name__}.")

    @property
    def noise_std(self) -> float | PerGroup:
        """The first stream's per-coordinate noise standard deviation (what a step reports as its noise)."""
        return self.first.noise_std

    @property
    def sensitivity(self) -> float | PerGroup:
        """The first stream's L2 sensitivity."""
        return self.first.sensitivity


optree.register_pytree_node(
    ClippedMoments,
    lambda m: ((m.first, m.second), None, ("first", "second")),
    lambda _, children: ClippedMoments(*children),
    namespace=NAMESPACE,
)
optree.register_pytree_node(
    NoisedMoments,
    lambda m: ((m.first, m.second), None, ("first", "second")),
    lambda _, children: NoisedMoments(*children),
    namespace=NAMESPACE,
)


def _total(sensitivity: float | PerGroup) -> float:
    """``sum_k Delta_k`` (a scalar sensitivity is one group)."""
    if isinstance(sensitivity, PerGroup):
        return sum(v for _, v in sensitivity.values)
    return float(sensitivity)


def paired_scale(
    first: float | PerGroup,
    second: float | PerGroup,
    *,
    strategy_sensitivities: tuple[float, float] = (1.0, 1.0),
) -> tuple[float, float]:
    """The factors ``(c_1, c_2)`` that turn each stream's sensitivity into its *effective* sensitivity.

    Stream ``k`` noised as a Gaussian release of sensitivity ``c_k * Delta_k`` (per group: every group value times
    ``c_k``, then the per-group allocation of :func:`opake_core.noise.noise_std_for` inside the stream) with
    multiplier ``z * s_k`` gets exactly the joint allocation of the module docstring:
    ``c_k = sqrt(T / (s_k * D_k))`` with ``D_k = sum_groups Delta_k``, ``T = s_1 D_1 + s_2 D_2``. For scalars and
    ``s_k = 1``: ``c_k Delta_k = sqrt(Delta_k (Delta_1 + Delta_2))``. A stream with ``D_k = 0`` gets ``c_k = 0``.

    Args:
        first: the first stream's sensitivity ``Delta_1`` (float or PerGroup).
        second: the second stream's sensitivity ``Delta_2`` (same kind and groups as ``first``).
        strategy_sensitivities: ``(s_1, s_2)``, each strategy's sensitivity under the declared participation
            (1 for DP-SGD).

    Raises:
        ConfigurationError: an infinite sensitivity (clipping disabled) or a non-positive strategy sensitivity.
    """
    s = [validate.positive(f"strategy_sensitivities[{k}]", v) for k, v in enumerate(strategy_sensitivities)]
    totals = [_total(first), _total(second)]
    if not all(math.isfinite(d) for d in totals):
        raise ConfigurationError(
            f"paired noise needs finite sensitivities, got {totals}: clip with a finite clipping_norm, or use "
            "noise_multiplier=0 for a non-private run."
        )
    t = s[0] * totals[0] + s[1] * totals[1]
    return tuple(0.0 if d == 0 else math.sqrt(t / (sk * d)) for sk, d in zip(s, totals, strict=True))


def paired_noise_std(
    first: float | PerGroup,
    second: float | PerGroup,
    *,
    noise_multiplier: float,
    strategy_sensitivities: tuple[float, float] = (1.0, 1.0),
) -> tuple[float | PerGroup, float | PerGroup]:
    """The standard deviations ``(sigma_1, sigma_2)`` of the joint allocation (module docstring).

    Scalars: ``sigma_k = z sqrt(s_k Delta_k T)`` with ``T = s_1 Delta_1 + s_2 Delta_2``; per group:
    ``sigma_{k,g} = z sqrt(s_k Delta_{k,g} T)`` with ``T = sum_{k,g} s_k Delta_{k,g}``. Then
    ``sum_{k,g} (s_k Delta_{k,g} / sigma_{k,g})^2 = 1 / z^2``. ``z = 0`` gives zeros.
    """
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    scales = paired_scale(first, second, strategy_sensitivities=strategy_sensitivities)
    out = []
    for sensitivity, c, sk in zip((first, second), scales, strategy_sensitivities, strict=True):
        # sigma = z * s_k * (per-group allocation of the effective sensitivity c_k * Delta_k)
        if isinstance(sensitivity, PerGroup):
            total = c * _total(sensitivity)
            out.append(sensitivity.map(lambda d, c=c, total=total, sk=sk: z * sk * math.sqrt(c * d * total)))
        else:
            out.append(z * sk * c * float(sensitivity))
    return out[0], out[1]
