"""Projected joint moment estimation (JME): the mean gradient and its element-wise square, released together.

Kalinin, Upadhyay, Lampert, "Continual Release Moment Estimation with Differential Privacy", arXiv 2502.06597v2
(Algorithm 1; the projection and its sensitivity: Definition 3.4, Lemma 3.5; the noise allocation: Theorem 4.3 and
Appendix A). Per step, from the clipped and normalized sum ``a = (1/n) sum_i clip(g_i, C)`` (sensitivity
``Delta = C / n``):

=====================  =============================================================================================
``x``                  ``Pi_R(a) = a * min(1, R / ||a||_2)``: projection onto the L2 ball of public radius ``R``
                       (``aggregate_norm``)
first stream           ``x~ = x + xi``,        ``xi ~ N(0, sigma_1^2 I)``, ``sigma_1 = z * S_lambda``
second stream          ``x2~ = x ⊙ x + eta``,  ``eta ~ N(0, sigma_2^2 I)``, ``sigma_2 = z * S_lambda / sqrt(lambda)``
=====================  =============================================================================================

The optimizer averages ``x~`` into Adam's ``m`` and ``x2~`` into its ``v``
(:func:`opake_core.optim.private_moments.private_moments_adam`), so ``v`` estimates the square of the mean gradient
without the noise variance that Adam's ``v`` of a noised gradient carries (which is why JME and the noise-variance
bias correction of DP-AdamBC are not combined: the variance would be removed twice).

**Sensitivity** (our derivation; ``d`` coordinates). Neighbouring batches give ``||a - a'|| <= Delta``; projection
onto a convex set is 1-Lipschitz and ``x, x'`` lie in the ball, so ``r = ||x - x'|| <= D = min(Delta, 2R)``. With
``u = x - x'`` and ``w = x + x'``, ``x ⊙ x - x' ⊙ x' = u ⊙ w`` and ``x, x'`` in the ball means ``||w ± u|| <= 2R``.
Define ``M_R(r) = sup {||u ⊙ w||^2 : ||u|| = r, ||w + u|| <= 2R, ||w - u|| <= 2R}``. Then

    M_R(r) = r^2 (2R - r)^2                  for 0 <= r <= 2R/3   (u, w on one coordinate; the only case for d = 1)
    M_R(r) = r^2 (4R^2 - r^2) / 2            for 2R/3 <= r <= 2R  (d >= 2: u = (r, r)/sqrt(2), w ⊥ u)

Sketch: write ``m_j = |u_j w_j|``; for given ``m`` the smallest ``||w||^2`` is ``(sum_j m_j)^2 / r^2`` (Cauchy-Schwarz,
``u_j^2 ∝ m_j``), the constraints need ``||w||^2 + r^2 + 2 |<u, w>| <= 4R^2`` and ``|<u, w>| >= max_j m_j -
sum_{others} m_j``. With ``mu = max_j m_j`` and ``nu = sum_others m_j`` the objective ``sum_j m_j^2`` is at most
``mu^2 + nu^2`` when ``nu <= mu`` (at most ``(mu + nu)^2 / 2`` otherwise), a convex function maximized at an extreme
point of the convex feasible set ``{(mu + nu)^2 / r^2 + 2 (mu - nu) <= 4R^2 - r^2, 0 <= nu <= mu}``; along its curved
edge it is convex in ``(mu + nu)^2``, so the maximum is at ``nu = 0`` (first branch) or ``nu = mu`` (second
branch), and both are attained. The pair is whitened by ``(sigma_1, sigma_2)``; its squared sensitivity is at most
``(r^2 + lambda M_R(r)) / (z S_lambda)^2`` with

    S_lambda^2 = sup_{0 <= r <= D} E(r),  E(r) = r^2 + lambda M_R(r)

(:func:`jme_sensitivity_squared`). For ``d >= 2``, ``E`` increases up to ``r* = sqrt(2R^2 + 1/lambda)``, where it
equals ``2R^2 + 2 lambda R^4 + 1/(2 lambda)``, so ``S_lambda^2 = E(min(D, r*))``; for ``d = 1`` the maximum is at
``D`` or at the stationary point ``r = (3R - sqrt(R^2 - 2/lambda)) / 2`` (when ``lambda R^2 >= 2``). The whitened
release therefore moves by at most ``1 / z``: a Gaussian mechanism with multiplier ``z`` and sensitivity 1,
accounted as DP-SGD (Poisson-subsampled Gaussian, ``sampler.process(z, n_steps)``; one coin per example decides both
streams, and joint convexity of the hockey-stick divergence carries the subsampling bound over to this non-linear
release).

**Allocation** (:class:`JmeAllocation`): ``lambda`` trades the first stream's noise against the second's.
``paper_reference()`` takes ``lambda R^2 = 1/2`` (``d >= 2``) or ``(11 + 5 sqrt(5)) / 8`` (``d = 1``); at ``D = R``
this raises the first stream's variance by 75% over DP-SGD's ``(z D)^2``. ``first_variance_cap(kappa)`` takes the
largest ``lambda`` with ``S_lambda^2 <= kappa D^2`` (default 1.5): the first stream's variance grows by at most the
factor ``kappa``.

**Scope.** DP-SGD only (independent noise; no matrix-factorization version), one scalar clipping bound (the
projection and ``M_R`` are global), a public fixed ``n`` (the expected batch size, never the realized one), a
public ``R`` and allocation, the Gaussian mechanism, plain Poisson sampling for amplified accounting. Sum the shards
of a data-parallel run before the noise. An empty batch releases noise around zero and advances the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core import random, validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf.strategies import identity
from opake_core.mf.streaming import GaussianNoiseState, matrix_mechanism
from opake_core.moments import ClippedMoments, NoisedMoments
from opake_core.tree import Clipped, Noised, PerGroup

__all__ = [
    "JME_STREAMS",
    "JmeAllocation",
    "jme_noise",
    "jme_sensitivity_squared",
    "project",
    "square_growth",
]

JME_STREAMS = ("opake.noise.jme.first", "opake.noise.jme.second")
"""The stream tags of the first (mean) and second (square) JME streams."""


def square_growth(r: float, *, radius: float, dim: int) -> float:
    """``M_R(r)``: the largest ``||x ⊙ x - x' ⊙ x'||_2^2`` over ``x, x'`` in the L2 ball of radius ``R`` with
    ``||x - x'||_2 = r`` (module docstring), for ``0 <= r <= 2R``; ``dim`` is the number of coordinates ``d``."""
    r, radius = float(r), float(radius)
    if not 0 <= r <= 2 * radius * (1 + 1e-12):
        raise ConfigurationError(f"square_growth needs 0 <= r <= 2R = {2 * radius}, got r={r}.")
    r = min(r, 2 * radius)
    one_coordinate = r * r * (2 * radius - r) ** 2
    if dim == 1 or r <= 2 * radius / 3:
        return one_coordinate
    return max(one_coordinate, r * r * (4 * radius * radius - r * r) / 2)


def _distance(delta: float, radius: float) -> float:
    """``D = min(Delta, 2R)``: the most two projected sums can differ."""
    return min(float(delta), 2 * float(radius))


def jme_sensitivity_squared(lam: float, *, delta: float, radius: float, dim: int) -> float:
    """``S_lambda^2 = sup_{0 <= r <= D} r^2 + lambda M_R(r)`` with ``D = min(delta, 2 radius)`` (module docstring).

    Args:
        lam: ``lambda > 0``, the weight of the second stream (``sigma_2 = sigma_1 / sqrt(lambda)``).
        delta: the clipped sum's L2 sensitivity ``Delta = C / n`` (``math.inf``: no clipping; the projection still
            bounds the release).
        radius: the projection radius ``R > 0``.
        dim: the number of coordinates ``d >= 1`` of the released tree.

    Returns:
        ``S_lambda^2`` in squared gradient units.
    """
    lam = validate.positive("lam", lam)
    radius = validate.positive("radius", radius)
    d = validate.integer("dim", dim, minimum=1)
    big_d = _distance(validate.positive("delta", delta, allow_inf=True), radius)

    def energy(r: float) -> float:
        return r * r + lam * square_growth(r, radius=radius, dim=d)

    if d >= 2:
        peak = 2 * radius * radius + 1 / lam  # r*^2, the stationary point of the second branch
        if big_d * big_d > peak:
            return 2 * radius * radius + 2 * lam * radius**4 + 1 / (2 * lam)
        return energy(big_d)
    candidates = [big_d]
    if lam * radius * radius >= 2:
        stationary = (3 * radius - math.sqrt(radius * radius - 2 / lam)) / 2
        if stationary <= big_d:
            candidates.append(stationary)
    return max(energy(r) for r in candidates)


@dataclass(frozen=True)
class JmeAllocation:
    """How ``lambda`` is chosen for each call (build with :meth:`paper_reference` or :meth:`first_variance_cap`).

    Attributes:
        kind: ``"paper_reference"`` or ``"first_variance_cap"``.
        kappa: the cap ``kappa > 1`` of ``first_variance_cap`` (None for the paper's reference allocation).
    """

    kind: str
    kappa: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "paper_reference":
            if self.kappa is not None:
                raise ConfigurationError("JmeAllocation.paper_reference() takes no kappa.")
        elif self.kind == "first_variance_cap":
            kappa = validate.number("kappa", self.kappa)
            if not (kappa > 1 and math.isfinite(kappa)):
                raise ConfigurationError(
                    f"first_variance_cap needs a finite kappa > 1 (the allowed growth factor of the first stream's "
                    f"variance), got {self.kappa!r}."
                )
        else:
            raise ConfigurationError(
                f"JmeAllocation kind must be 'paper_reference' or 'first_variance_cap', got {self.kind!r}; build it "
                "with JmeAllocation.paper_reference() or JmeAllocation.first_variance_cap(kappa)."
            )

    @classmethod
    def paper_reference(cls) -> JmeAllocation:
        """``lambda R^2 = 1/2`` for ``d >= 2`` and ``(11 + 5 sqrt(5)) / 8`` for ``d = 1`` (Kalinin et al., App. A)."""
        return cls("paper_reference")

    @classmethod
    def first_variance_cap(cls, kappa: float = 1.5) -> JmeAllocation:
        """The largest ``lambda`` with ``S_lambda^2 <= kappa D^2``: the first stream's variance is at most ``kappa``
        times DP-SGD's ``(z D)^2``; ``kappa > 1``."""
        return cls("first_variance_cap", kappa)

    def lam(self, *, delta: float, radius: float, dim: int) -> float:
        """``lambda`` for a sensitivity ``delta``, radius ``R`` and ``dim`` coordinates.

        ``first_variance_cap``: ``S_lambda^2`` is continuous and non-decreasing in ``lambda`` (a supremum of functions
        non-decreasing in it) and tends to ``D^2`` as ``lambda -> 0``, so the largest admissible ``lambda`` is found
        by bisection on ``log lambda`` to float64 precision.
        """
        if self.kind == "paper_reference":
            factor = 0.5 if dim >= 2 else (11 + 5 * math.sqrt(5)) / 8
            return factor / (radius * radius)
        big_d = _distance(delta, radius)
        target = self.kappa * big_d * big_d

        def fits(lam: float) -> bool:
            return jme_sensitivity_squared(lam, delta=delta, radius=radius, dim=dim) <= target

        low = high = 1 / (radius * radius)
        while fits(high):
            high *= 2
            if high > 1e300:  # pragma: no cover - S_lambda grows without bound for D > 0
                raise ConfigurationError(f"no lambda reaches the first-variance cap kappa={self.kappa}.")
        while not fits(low):
            low /= 2
        for _ in range(200):
            mid = math.sqrt(low * high)
            if mid in (low, high):
                break
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low


def project(value: Any, radius: float) -> tuple[Any, float]:
    """``(Pi_R(value), ||value||_2)``: the tree scaled by ``min(1, R (1 - 4u) / ||value||)`` (one global norm over
    every leaf, accumulated in float64; ``u`` the unit roundoff of the widest leaf dtype, so that the stored result
    has norm at most ``R``). A non-finite norm projects to zero."""
    leaves, treedef = optree.tree_flatten(value)
    norm = math.sqrt(sum(float(leaf.detach().to(torch.float64).square().sum()) for leaf in leaves))
    u = max(torch.finfo(leaf.dtype).eps for leaf in leaves) / 2
    if not math.isfinite(norm):
        scale = 0.0
    else:
        scale = min(1.0, radius * (1 - 4 * u) / norm) if norm > 0 else 1.0
    return optree.tree_unflatten(treedef, [leaf * scale for leaf in leaves]), norm


def jme_noise(
    *,
    noise_multiplier: float,
    key: random.Key,
    aggregate_norm: float = 1.0,
    allocation: JmeAllocation | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
) -> tuple[Any, GaussianNoiseState]:
    """Projected JME as a ``(noise_fn, state)`` privatizer (module docstring; Kalinin et al., arXiv 2502.06597).

    Args:
        noise_multiplier: ``z >= 0``, the multiplier of the joint Gaussian release (0: no noise, a non-private run;
            the projection still applies).
        key: the noise key, kept in the state; step ``t`` draws from ``fold_in(key, JME_STREAMS[k], t)``
            (``random.normal_tree``).
        aggregate_norm: the public projection radius ``R > 0`` (in the units of the normalized clipped sum).
        allocation: how ``lambda`` is chosen (default :meth:`JmeAllocation.first_variance_cap` with ``kappa = 1.5``).
        compute_dtype: dtype the noise is drawn and added in (fp16, bf16, fp32, fp64).

    Returns:
        ``(noise_fn, state)``; ``noise_fn(clipped, state) -> (NoisedMoments, state)`` takes the aggregated clipped
        sum (a :class:`~opake_core.tree.Clipped` with a scalar sensitivity ``Delta``, the same ``d`` coordinates every
        call) and returns ``first = Noised(x~, D, z S_lambda)`` and ``second = Noised(x2~, sqrt(max_{r <= D}
        M_R(r)), z S_lambda / sqrt(lambda))`` with ``D = min(Delta, 2R)``; the state is a
        :class:`~opake_core.mf.streaming.GaussianNoiseState`.

    Raises:
        ConfigurationError: a bad multiplier, radius, allocation or dtype; at call time a per-group sensitivity.
        InputTypeError: anything but an un-noised ``Clipped`` (a ``ClippedMoments`` included: JME forms its own
            second moment, clip with ``second_moment=False``), or a wrong state.
    """
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    radius = validate.positive("aggregate_norm", aggregate_norm)
    allocation = JmeAllocation.first_variance_cap(1.5) if allocation is None else allocation
    if not isinstance(allocation, JmeAllocation):
        raise InputTypeError(
            f"allocation must be a JmeAllocation (paper_reference() or first_variance_cap(kappa)), got "
            f"{type(allocation).__name__}."
        )
    options = {"n_steps": None, "noise_multiplier": z, "key": key, "name": "jme_noise", "compute_dtype": compute_dtype}
    first_fn, state = matrix_mechanism(None, identity(), stream=JME_STREAMS[0], **options)
    second_fn, _ = matrix_mechanism(None, identity(), stream=JME_STREAMS[1], **options)

    def noise_fn(clipped: Clipped, state: GaussianNoiseState) -> tuple[NoisedMoments, GaussianNoiseState]:
        if isinstance(clipped, ClippedMoments):
            raise InputTypeError(
                "jme_noise forms its own second moment from the projected mean; pass the plain clipped sum "
                "(clipped_grad with second_moment=False), not a ClippedMoments pair."
            )
        if isinstance(clipped, Noised) or not isinstance(clipped, Clipped):
            raise InputTypeError(
                "jme_noise expects an un-noised Clipped tree (the output of clipped_grad), got "
                f"{type(clipped).__name__}."
            )
        if isinstance(clipped.sensitivity, PerGroup):
            raise ConfigurationError(
                "jme_noise needs one scalar clipping bound (the projection and its sensitivity are global), got a "
                "per-group sensitivity; clip with a float clipping_norm."
            )
        with torch.profiler.record_function("opake::jme_noise"), torch.no_grad():
            leaves = optree.tree_leaves(clipped.value)
            if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
                raise InputTypeError("jme_noise needs a tree of tensors.")
            dim = sum(leaf.numel() for leaf in leaves)
            delta = float(clipped.sensitivity)
            big_d = _distance(delta, radius)
            lam = allocation.lam(delta=delta, radius=radius, dim=dim)
            s_lambda = math.sqrt(jme_sensitivity_squared(lam, delta=delta, radius=radius, dim=dim))
            x, _ = project(clipped.value, radius)
            squares = optree.tree_map(torch.square, x)
            first, new_state = first_fn(Clipped(x, s_lambda), state)
            second, _ = second_fn(Clipped(squares, s_lambda / math.sqrt(lam)), state)
        peak = min(big_d, radius if dim == 1 else math.sqrt(2) * radius)  # where M_R is largest on [0, D]
        square_sensitivity = math.sqrt(square_growth(peak, radius=radius, dim=dim))
        noised = NoisedMoments(
            Noised(first.value, big_d, first.noise_std), Noised(second.value, square_sensitivity, second.noise_std)
        )
        return noised, new_state

    return noise_fn, state
