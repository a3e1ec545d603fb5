"""AdEMAMix (Pagliardini, Ablin, Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older",
arXiv:2409.03152, Algorithm 1): Adam with a second, slow EMA of the gradients added to the numerator.

Per leaf and coordinate, at update ``t`` (from 1), with gradient ``g`` (all moments zeros at init):

====================  ==============================================================================
``m1``                ``b1 * m1 + (1 - b1) * g`` (fast EMA, bias-corrected: ``m1_hat = m1 / (1 - b1^t)``)
``m2``                ``b3(t) * m2 + (1 - b3(t)) * g`` (slow EMA, *not* bias-corrected)
``nu``                ``b2 * nu + (1 - b2) * g^2`` (``nu_hat = nu / (1 - b2^t)``)
``update``            ``-lr * ((m1_hat + alpha(t) * m2) / (sqrt(nu_hat) + eps) + weight_decay * p)``
====================  ==============================================================================

The paper's schedulers warm up the slow EMA's weight and memory (without them ``alpha(t) = alpha`` and
``b3(t) = b3``):

* ``alpha(t) = min(t * alpha / t_alpha, alpha)`` (linear);
* ``b3(t) = min(exp(ln(b1) ln(b3) / ((1 - t / t_beta3) ln(b3) + (t / t_beta3) ln(b1))), b3)``: the reciprocal
  ``1 / ln(b3(t))``, hence the EMA's half-life, grows linearly from ``b1``'s to ``b3``'s over ``t_beta3`` steps.

The paper sets both warm-ups to the number of training steps for large ``b3``. Under DP noise the slow EMA
averages the noise over about ``1 / (1 - b3)`` steps (10^4 for the default), so ``alpha * m2`` adds signal with
little noise; the second moment ``nu`` absorbs the noise variance as Adam's does, and ``noise_bias_correction=True``
removes it (the rule of :mod:`opake_core.optim.bias_correction`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import NoiseAwareTransformation, Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import (
    noise_aware_chain,
    with_noise_variance,
    without_noise,
)

__all__ = ["AdEMAMixState", "ademamix", "alpha_at", "beta3_at", "scale_by_ademamix"]


class AdEMAMixState(NamedTuple):
    """State of :func:`scale_by_ademamix`.

    Attributes:
        mu_fast: the fast EMA ``m1``, a tree like the parameters.
        mu_slow: the slow EMA ``m2``, a tree like the parameters.
        nu: the second moment ``nu``, a tree like the parameters.
        count: number of updates applied so far (0-d int64 tensor on the CPU).
    """

    mu_fast: Any
    mu_slow: Any
    nu: Any
    count: torch.Tensor


def alpha_at(t: int, alpha: float, t_alpha: int | None) -> float:
    """The paper's alpha scheduler at update ``t`` (from 1): ``min(t * alpha / t_alpha, alpha)``; ``alpha``
    when ``t_alpha`` is None."""
    return alpha if t_alpha is None else min(t * alpha / t_alpha, alpha)


def beta3_at(t: int, b1: float, b3: float, t_beta3: int | None) -> float:
    """The paper's beta3 scheduler at update ``t`` (from 1):
    ``min(exp(ln(b1) ln(b3) / ((1 - a) ln(b3) + a ln(b1))), b3)`` with ``a = t / t_beta3``; ``b3`` when
    ``t_beta3`` is None or ``t >= t_beta3``. ``b1 = 0`` is the limit ``1 / ln(b1) = 0``: ``b3^(1 / a)``."""
    if t_beta3 is None or t >= t_beta3 or b3 <= b1:  # b3 <= b1: the min is b3 at every step
        return b3
    a = t / t_beta3
    if b1 == 0.0:
        return min(b3 ** (1 / a), b3)
    log1, log3 = math.log(b1), math.log(b3)
    return min(math.exp(log1 * log3 / ((1 - a) * log3 + a * log1)), b3)


def scale_by_ademamix(
    b1: float,
    b2: float,
    b3: float,
    alpha: float,
    eps: float,
    *,
    t_alpha: int | None,
    t_beta3: int | None,
    noise_bias_correction: bool = False,
) -> GradientTransformation | NoiseAwareTransformation:
    """``g -> (m1_hat + alpha(t) * m2) / (sqrt(nu_hat) + eps)`` (see the module docstring).

    With ``noise_bias_correction`` a :class:`~opake_core.optim.bias_correction.NoiseAwareTransformation` whose state
    is ``NoiseVarianceState(AdEMAMixState, phi)``: ``nu`` loses the EMA ``phi`` of ``sigma^2`` where ``nu - phi > 0``
    (both un-normalized, as Adam's)."""

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])  # noqa: E731
        state = AdEMAMixState(mu_fast=zeros(), mu_slow=zeros(), nu=zeros(), count=torch.zeros((), dtype=torch.int64))
        return state

    def step(updates, state, phi):
        g, treedef = optree.tree_flatten(updates)
        count = state.count + 1
        t = int(count)
        b3_t, alpha_t = beta3_at(t, b1, b3, t_beta3), alpha_at(t, alpha, t_alpha)
        mu_fast = torch._foreach_mul(optree.tree_leaves(state.mu_fast), b1)
        torch._foreach_add_(mu_fast, g, alpha=1 - b1)
        mu_slow = torch._foreach_mul(optree.tree_leaves(state.mu_slow), b3_t)
        torch._foreach_add_(mu_slow, g, alpha=1 - b3_t)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        second = nu if phi is None else [without_noise(v, float(f)) for v, f in zip(nu, phi, strict=True)]
        denominator = torch._foreach_sqrt(second)
        torch._foreach_div_(denominator, math.sqrt(1 - b2**t))
        torch._foreach_add_(denominator, eps)
        numerator = torch._foreach_div(mu_fast, 1 - b1**t)
        torch._foreach_add_(numerator, mu_slow, alpha=alpha_t)
        out = torch._foreach_div(numerator, denominator)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        new_state = AdEMAMixState(mu_fast=unflatten(mu_fast), mu_slow=unflatten(mu_slow), nu=unflatten(nu), count=count)
        return unflatten(out), new_state

    return with_noise_variance(init_fn, step, b2, correct=noise_bias_correction)


def ademamix(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
    alpha: float = 5.0,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    t_alpha: int | None = None,
    t_beta3: int | None = None,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """AdEMAMix: ``update = -lr * ((m1_hat + alpha(t) * m2) / (sqrt(nu_hat) + eps) + weight_decay * p)``.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        betas: ``(b1, b2, b3)``, each in [0, 1): the fast EMA's, the second moment's and the slow EMA's decay.
        alpha: weight of the slow EMA (>= 0; the paper uses 4 to 10; 0 gives AdamW).
        eps: added to ``sqrt(nu_hat)`` in the denominator (> 0), in gradient units.
        weight_decay: decoupled decay coefficient (>= 0), multiplied by ``lr`` (AdamW's convention).
        t_alpha: warm-up of ``alpha`` in updates (int >= 1), or None for none.
        t_beta3: warm-up of ``b3`` in updates (int >= 1), or None for none.
        noise_bias_correction: remove the EMA of the noise variance from ``nu``
            (:mod:`opake_core.optim.bias_correction`).
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: ``alpha = 0`` is AdamW (the slow EMA gets no weight).

        >>> import torch
        >>> from opake_core import optim
        >>> params, grads = {"w": torch.tensor([1.0, -2.0])}, [torch.tensor([0.5, 0.1]), torch.tensor([-0.3, 0.2])]
        >>> results = []
        >>> for opt in (optim.ademamix(lr=0.1, alpha=0.0, non_private=True),
        ...             optim.adamw(lr=0.1, weight_decay=0.0, non_private=True)):
        ...     p, state = params, opt.init(params)
        ...     for grad in grads:
        ...         updates, state = opt.update({"w": grad}, state, params=p)
        ...         p = optim.apply_updates(p, updates)
        ...     results.append(p["w"])
        >>> torch.allclose(results[0], results[1])
        True
    """
    lr = check_lr(lr)
    b1, b2, b3 = check_betas(betas, 3)
    alpha = validate.non_negative("alpha", alpha)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    t_alpha = None if t_alpha is None else validate.integer("t_alpha", t_alpha, minimum=1)
    t_beta3 = None if t_beta3 is None else validate.integer("t_beta3", t_beta3, minimum=1)
    rescale = scale_by_ademamix(
        b1, b2, b3, alpha, eps, t_alpha=t_alpha, t_beta3=t_beta3, noise_bias_correction=noise_bias_correction
    )
    parts = [rescale, add_decayed_weights(weight_decay), scale_by_neg_lr(lr)]
    needs_params = weight_decay > 0
    if noise_bias_correction:
        transform = noise_aware_chain(*parts)
        return Optimizer("ademamix", transform, non_private=non_private, needs_params=needs_params, noise_aware=True)
    return Optimizer("ademamix", chain(*parts), non_private=non_private, needs_params=needs_params)
