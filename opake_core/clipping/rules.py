"""Clipping rules: the bound of every example, the scale that enforces it, and the clipped sum of one chunk.

Notation: ``m`` examples in a chunk, per-example gradients ``g_i`` (one pytree each) whose ``L`` leaves fall into
``G`` groups (``G = 1`` unless the bound is a :class:`~opake_core.tree.PerGroup`), bounds ``C_k`` and a public
normalizer ``n`` (the expected batch size in DP-SGD).

* fixed bound (a float, ``math.inf`` for none, or a PerGroup): ``scale_ik = min(1, C_k (1 - 4u) / ||g_i||_k)``;
  sensitivity ``C / n`` (``sqrt(sum_k C_k^2) / n`` per group).
* :func:`auto_s` (AUTO-S, Bu et al. 2023, "Automatic clipping", arXiv 2206.07136, eq. 4): ``scale_i = R (1 - 4u) /
  (||g_i|| + gamma)``, so every contribution has norm below ``R``; sensitivity ``R / n``.
* :func:`adaptive` (Andrew, Thakkar, McMahan, Ramaswamy 2021, arXiv 1905.03871, Algorithm 1): the fixed rule with a
  bound that follows a target quantile of the per-example norms, moved after every call by a noisy count
  (:func:`next_adaptive_state`); account the count with ``accounting.adaptive_clipping``.

``u`` is the unit roundoff of the accumulation dtype (float32, float64 for float64 leaves). Squared norms are float64
for every dtype, so the scale is exact well below the storage precision, and the margin ``4u`` absorbs the rounding
of the scale and of the product: every stored contribution satisfies ``||fl(scale * g_i)|| <= C`` in its dtype. An
example whose norm is not finite (or a padding row) gets scale 0 and adds exactly nothing; its reported norm is NaN
or inf, so that the diagnostics count the dropped examples (``ClipDiagnostics.nonfinite``).

Private second moments (``ClipRule.second_moment``, :mod:`opake_core.moments`): the same scales also sum the squares
``(1/n) sum_i (scale_i g_i) ⊙ (scale_i g_i)``, sensitivity ``C^2 / n`` (``C_k^2 / n`` per group, ``R^2 / n`` for
AUTO-S) since ``||c ⊙ c||_2 <= ||c||_2^2`` (:func:`second_moment_sensitivity`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import optree.dataclasses
import torch

from opake_core import random, validate
from opake_core.clipping.engine import PerExampleGradients
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import NAMESPACE, PerGroup, leaf_paths

__all__ = [
    "ADAPTIVE_STREAM",
    "AdaptiveClipState",
    "AdaptiveRule",
    "AutoSRule",
    "ClipRule",
    "FixedClipState",
    "accumulators",
    "adaptive",
    "auto_s",
    "check_rule",
    "check_scale",
    "clip_scales",
    "initial_state",
    "next_adaptive_state",
    "second_moment_sensitivity",
    "sensitivity",
]

ADAPTIVE_STREAM = "opake.clipping.adaptive"

Rule = float | PerGroup
"""A fixed bound: a float (``math.inf`` for none) or a PerGroup of per-group bounds."""


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class FixedClipState:
    """State of fixed-bound clipping: it holds nothing and comes back unchanged from every call."""


@dataclass(frozen=True)
class AutoSRule:
    """AUTO-S: scale each example by ``bound / (||g|| + gamma)`` (build with :func:`auto_s`)."""

    bound: float
    gamma: float


@dataclass(frozen=True)
class AdaptiveRule:
    """Quantile-tracking adaptive clipping (build with :func:`adaptive`)."""

    initial_clipping_norm: float
    target_quantile: float
    learning_rate: float
    count_noise_fraction: float
    clipping_norm_min: float
    clipping_norm_max: float


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class AdaptiveClipState:
    """State of adaptive clipping: the bound for the next call, the number of calls, and the count-noise key."""

    clipping_norm: float = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False)
    key: random.Key = optree.dataclasses.field(pytree_node=False)


def auto_s(bound: float = 1.0, *, gamma: float = 0.01) -> AutoSRule:
    """AUTO-S normalization with bound ``R = bound`` and stability constant ``gamma`` (both > 0).

    Example: pass it as the clipping norm; every example is scaled, none clamped.

        >>> import torch
        >>> from opake_core import auto_s, clipped_grad
        >>> grad_fn, state = clipped_grad(lambda w, x: x @ w, clipping_norm=auto_s(1.0, gamma=0.01), normalize_by=4.0)
        >>> clipped, state = grad_fn(torch.zeros(2), torch.tensor([[3.0, 4.0]]), state=state)
        >>> clipped.value  # R x / (||x|| + gamma) / n
        tensor([0.1497, 0.1996])
        >>> clipped.sensitivity
        0.25
    """
    return AutoSRule(validate.positive("bound", bound), validate.positive("gamma", gamma))


def adaptive(
    initial_clipping_norm: float = 1.0,
    *,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_noise_fraction: float = 0.05,
    clipping_norm_min: float = 1e-3,
    clipping_norm_max: float = 1e3,
) -> AdaptiveRule:
    """Adaptive clipping that tracks the ``target_quantile`` of per-example norms (Andrew et al. 2021).

    Args:
        initial_clipping_norm: the bound of the first step.
        target_quantile: the fraction of examples that should stay unclipped, in (0, 1).
        learning_rate: ``eta`` of the geometric update, > 0.
        count_noise_fraction: the count's noise std as a fraction of the expected batch size, > 0.
        clipping_norm_min: the smallest bound, > 0.
        clipping_norm_max: the largest bound, above ``clipping_norm_min``.

    Example: every gradient is far below the bound, so the bound moves down (by about ``exp(-eta / 2)`` when the
    noisy count sees every example unclipped). Account the noisy count with ``accounting.adaptive_clipping``.

        >>> import torch
        >>> from opake_core import adaptive, clipped_grad, random
        >>> grad_fn, state = clipped_grad(
        ...     lambda w, x: x @ w, clipping_norm=adaptive(1.0, learning_rate=0.2), normalize_by=8.0, key=random.key(0))
        >>> state.clipping_norm
        1.0
        >>> clipped, state = grad_fn(torch.zeros(2), torch.full((8, 2), 0.01), state=state)
        >>> state.clipping_norm < 1.0, state.step
        (True, 1)
    """
    quantile = validate.in_range("target_quantile", target_quantile, 0.0, 1.0, low_open=True, high_open=True)
    low = validate.positive("clipping_norm_min", clipping_norm_min)
    high = validate.positive("clipping_norm_max", clipping_norm_max, allow_inf=True)
    if not high > low:
        raise ConfigurationError(f"clipping_norm_max ({high}) must exceed clipping_norm_min ({low}).")
    return AdaptiveRule(
        validate.positive("initial_clipping_norm", initial_clipping_norm),
        quantile,
        validate.positive("learning_rate", learning_rate),
        validate.positive("count_noise_fraction", count_noise_fraction),
        low,
        high,
    )


def check_rule(clipping_norm: Any) -> Rule | AutoSRule | AdaptiveRule:
    """``clipping_norm`` as a rule: a positive float (``math.inf`` disables clipping), a PerGroup of positive
    bounds, or an :class:`AutoSRule` / :class:`AdaptiveRule`."""
    if isinstance(clipping_norm, AutoSRule | AdaptiveRule):
        return clipping_norm
    if isinstance(clipping_norm, PerGroup):
        for group, bound in clipping_norm.values:
            validate.positive(f"clipping_norm for group {group!r}", bound, allow_inf=True)
        return clipping_norm
    return validate.positive("clipping_norm", clipping_norm, allow_inf=True)


def check_scale(bound: Rule | AutoSRule | AdaptiveRule, normalize_by: float) -> None:
    """ConfigurationError when the clipped sum divided by ``normalize_by`` cannot be held in float32: a normalizer
    whose reciprocal overflows it, or a finite sensitivity ``C / n`` beyond its range (the released values would be
    infinite, silently)."""
    largest = torch.finfo(torch.float32).max
    if 1.0 / normalize_by > largest:
        raise ConfigurationError(
            f"normalize_by (the expected batch size of a DP step) is {normalize_by!r}: dividing the float32 clipped "
            "sum by it overflows. Pass the public expected batch size (sampling rate times dataset size)."
        )
    if isinstance(bound, PerGroup):
        bounds = [value for _, value in bound.values]
    elif isinstance(bound, AdaptiveRule):
        bounds = [bound.initial_clipping_norm, bound.clipping_norm_max]
    else:
        bounds = [bound.bound if isinstance(bound, AutoSRule) else bound]
    for value in bounds:
        if math.isfinite(value) and value / normalize_by > largest:
            raise ConfigurationError(
                f"the sensitivity clipping_norm / normalize_by = {value!r} / {normalize_by!r} exceeds float32's range: "
                "the clipped sum and its noise would overflow. Use a clipping bound near the gradients' norms (often "
                "0.1 to 10) and the expected batch size as normalizer."
            )


def initial_state(rule: Rule | AutoSRule | AdaptiveRule, key: random.Key | None) -> FixedClipState | AdaptiveClipState:
    """The state of a rule's first call; ``key`` (adaptive clipping's count noise) is required for
    :func:`adaptive` and refused for the others."""
    is_adaptive = isinstance(rule, AdaptiveRule)
    if is_adaptive != (key is not None):
        raise ConfigurationError(
            "adaptive clipping needs key=opake_core.random.key(...) for its count noise"
            if is_adaptive
            else "key= is only used by adaptive clipping; drop it."
        )
    if not is_adaptive:
        return FixedClipState()
    if not isinstance(key, random.Key):
        raise InputTypeError(f"key must be an opake_core.random.Key, got {type(key).__name__}.")
    return AdaptiveClipState(rule.initial_clipping_norm, 0, key)


def sensitivity(bound: Rule | AutoSRule, normalize_by: float) -> float | PerGroup:
    """The L2 sensitivity of the clipped sum divided by ``normalize_by``: ``C / n``, per group for a PerGroup."""
    if isinstance(bound, PerGroup):
        return bound.map(lambda c: c / normalize_by)
    return (bound.bound if isinstance(bound, AutoSRule) else bound) / normalize_by


def second_moment_sensitivity(bound: Rule | AutoSRule, normalize_by: float) -> float | PerGroup:
    """The L2 sensitivity of the clipped sum of element-wise squares divided by ``normalize_by``: ``C^2 / n`` (per
    group ``C_k^2 / n``; AUTO-S ``R^2 / n``), from ``||c ⊙ c||_2 = ||c||_4^2 <= ||c||_2^2 <= C^2``."""
    if isinstance(bound, PerGroup):
        return bound.map(lambda c: c * c / normalize_by)
    value = bound.bound if isinstance(bound, AutoSRule) else bound
    return value * value / normalize_by


def next_adaptive_state(
    rule: AdaptiveRule, state: AdaptiveClipState, counts: torch.Tensor, normalize_by: float
) -> AdaptiveClipState:
    """Andrew et al. 2021, Algorithm 1: a noisy centred count of unclipped examples moves the bound geometrically.

    ``counts`` is the float64 tensor ``[clipped, batch size]`` (summed across ranks under data parallelism). The
    centred count ``sum_i (1[||g_i|| <= C] - 1/2)`` has sensitivity 1/2 under adding or removing an example; it is
    released with Gaussian noise of std ``count_noise_fraction * n`` (``n`` the expected batch size), drawn from
    ``fold_in(state.key, ADAPTIVE_STREAM, state.step)``.
    """
    num_clipped, batch_size = (float(c) for c in counts.tolist())
    unclipped = batch_size - num_clipped
    noise = random.numpy_generator(random.fold_in(state.key, ADAPTIVE_STREAM, state.step)).normal()
    centred = unclipped - batch_size / 2 + noise * rule.count_noise_fraction * normalize_by
    fraction = centred / normalize_by + 0.5
    bound = state.clipping_norm * math.exp(-rule.learning_rate * (fraction - rule.target_quantile))
    bound = min(max(bound, rule.clipping_norm_min), rule.clipping_norm_max)
    return AdaptiveClipState(bound, state.step + 1, state.key)


def clip_scales(
    group_norms: torch.Tensor,
    norms: torch.Tensor,
    bounds: Sequence[float] | torch.Tensor,
    dtypes: set[torch.dtype],
    *,
    gamma: float | None = None,
) -> dict[torch.dtype, torch.Tensor]:
    """The per-example scales ``[G, m]``, one tensor per accumulation dtype (in that dtype).

    ``scale = min(1, C_k (1 - 4u) / ||g||_k)`` with ``u`` the unit roundoff of the dtype (AUTO-S with ``gamma``:
    ``C_k (1 - 4u) / (||g||_k + gamma)``), and 0 for an example whose total norm ``norms`` is not finite.
    ``group_norms`` ``[G, m]`` and ``norms`` ``[m]`` are float64; ``bounds`` are the ``G`` bounds ``C_k`` (floats, or a
    float64 tensor ``[G, 1]`` on the device).
    """
    bound = bounds if isinstance(bounds, torch.Tensor) else bounds_on(tuple(bounds), group_norms.device)
    scales = {}
    for dtype in dtypes:
        u = torch.finfo(dtype).eps / 2
        if gamma is None:
            scale = torch.clamp(bound * (1 - 4 * u) / group_norms, max=1.0)
        else:  # AUTO-S: bound * ||g|| / (||g|| + gamma) < bound, no clamp
            scale = bound * (1 - 4 * u) / (group_norms + gamma)
        scales[dtype] = torch.where(torch.isfinite(norms), scale, torch.zeros_like(scale)).to(dtype)
    return scales


@functools.lru_cache(maxsize=64)
def bounds_on(bounds: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The bounds as a float64 ``[G, 1]`` tensor on ``device``, made once per value: a copy from host memory to a
    GPU waits for the device to finish its queued work, which would stall every step. Never modified."""
    return torch.tensor(bounds, dtype=torch.float64).unsqueeze(1).to(device)


def accumulators(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero sums shaped like ``leaves`` in their accumulation dtype (float64 for float64 leaves, else float32):
    views of one buffer per dtype and device (one allocation and one fill instead of one per leaf). Traced by
    ``torch.compile``, one tensor per leaf instead: an in-place write into a view of a shared buffer is traced as a new
    copy of the whole buffer (functionalization), so a compiled chunk would rewrite every parameter's sum at each
    layer's addition and hold several copies of them all."""
    if torch.compiler.is_compiling():
        return [torch.zeros(leaf.shape, dtype=accumulation_dtype(leaf.dtype), device=leaf.device) for leaf in leaves]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault((accumulation_dtype(leaf.dtype), leaf.device), []).append(index)
    out: list[torch.Tensor] = [torch.empty(0)] * len(leaves)
    for (dtype, device), indices in groups.items():
        flat = torch.zeros(sum(leaves[i].numel() for i in indices), dtype=dtype, device=device)
        for i, view in zip(indices, flat.split([leaves[i].numel() for i in indices]), strict=True):
            out[i] = view if view.shape == leaves[i].shape else view.view(leaves[i].shape)  # 1-D: already shaped
    return out


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the clipped sum of a leaf of ``dtype`` accumulates: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ClipRule(NamedTuple):
    """The static part of one call's rule as hashable data: each leaf's group, AUTO-S's ``gamma``, and whether the
    clipped sum of squares is formed too (``second_moment``).

    The bounds reach a chunk as a float64 tensor ``[G, 1]``, so that a captured or compiled chunk follows a moving
    (adaptive) bound without a new capture. A named tuple, not a dataclass: every ``torch.compile`` release we support
    traces a tuple argument (Dynamo 2.11 lost the fields of a frozen dataclass passed into the compiled chunk).
    """

    group_index: tuple[int, ...]
    groups: int
    gamma: float | None = None
    second_moment: bool = False

    @staticmethod
    def of(params: Any, bound: Rule | AutoSRule) -> tuple[ClipRule, tuple[float, ...]]:
        """The rule for the parameter tree ``params`` and the bound ``C_k`` of each group."""
        gamma = bound.gamma if isinstance(bound, AutoSRule) else None
        bound = bound.bound if isinstance(bound, AutoSRule) else bound
        leaves = optree.tree_leaves(params)
        if not leaves:
            raise InputTypeError(
                f"the parameters hold no tensor (got {params!r:.60}); pass the tree of trainable tensors, such as "
                "dict(model.named_parameters())."
            )
        paths = leaf_paths(params)
        for path, leaf in zip(paths, leaves, strict=True):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                raise InputTypeError(f"parameter {path!r} must be a floating-point tensor, got {leaf!r:.80}.")
        if not isinstance(bound, PerGroup):
            return ClipRule((0,) * len(leaves), 1, gamma), (bound,)
        unknown = [p for p in paths if p not in bound.group_of]
        if unknown:
            raise ConfigurationError(
                f"per-group clipping_norm has no group for parameters {unknown[:5]}; build it with "
                "per_group(params, ...) on the same parameter tree."
            )
        names = [name for name, _ in bound.values]
        group_index = tuple(names.index(bound.group_of[p]) for p in paths)
        return ClipRule(group_index, len(names), gamma), tuple(value for _, value in bound.values)

    def __call__(
        self, grads: PerExampleGradients, params: list[torch.Tensor], bounds: torch.Tensor, live: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(sums, norms [m] float32, clipped [m] bool)``: the clipped sum of the chunk in fresh accumulators
        shaped like ``params``, each example's norm, and whether any of its groups exceeded its bound. Examples with
        ``live`` False (padding rows) add nothing. With ``second_moment``, ``sums`` holds ``2 L`` tensors: the
        ``L`` clipped sums, then the ``L`` clipped sums of squares."""
        sums = accumulators(params)
        leaf_sq = grads.squared_norms()  # float64 [L, m]
        if self.groups == 1:
            group_sq = leaf_sq.sum(dim=0, keepdim=True)
        else:
            members = [[leaf_sq[i] for i, k in enumerate(self.group_index) if k == g] for g in range(self.groups)]
            group_sq = torch.stack([torch.stack(rows).sum(dim=0) for rows in members])
        group_norms = group_sq.sqrt()
        norms = group_sq.sum(dim=0).sqrt()
        if live is not None:  # a dead (padding) row counts as non-finite: scale 0
            norms = torch.where(live, norms, torch.full_like(norms, math.nan))
        scales = clip_scales(group_norms, norms, bounds, {total.dtype for total in sums}, gamma=self.gamma)
        leaves = len(self.group_index)
        if self.groups == 1:  # one view, no copy: the fused path then reads a single row
            per_leaf = {dtype: s.expand(leaves, -1) for dtype, s in scales.items()}
        else:
            per_leaf = {dtype: torch.stack([s[k] for k in self.group_index]) for dtype, s in scales.items()}
        grads.add_scaled(per_leaf, sums)
        if self.second_moment:
            add_squares = getattr(grads, "add_squared_scaled", None)
            if add_squares is None:
                raise ConfigurationError(
                    f"second_moment=True needs per-example gradients that can form their squares; this engine's "
                    f"{type(grads).__name__} cannot. Use the default engine (VMAP, or VmapGradients(...)) for private "
                    "second moments, or drop second_moment."
                )
            squares = accumulators(params)
            add_squares(per_leaf, squares)
            sums = sums + squares
        return sums, _reported(norms), (group_norms > bounds).any(dim=0)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _reported(norms: torch.Tensor) -> torch.Tensor:
    """The float64 norms ``[m]`` as the float32 the diagnostics report: a finite norm beyond float32's range
    saturates at its largest value, so that the reported norm is NaN or inf exactly for the examples
    :func:`clip_scales` drops, and counting those counts the dropped examples."""
    return torch.where(torch.isfinite(norms), norms.clamp(max=_FLOAT32_MAX), norms).float()
