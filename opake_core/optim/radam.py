"""RAdam (Liu et al. 2020, "On the Variance of the Adaptive Learning Rate and Beyond", ICLR, arXiv:1908.03265,
Algorithm 2), as ``torch.optim.RAdam``.

Per leaf and coordinate, at update ``t`` (from 1), with gradient ``g`` (moments zeros at init):

========================  ==========================================================================
``m``, ``v``              ``b1 * m + (1 - b1) * g``, ``b2 * v + (1 - b2) * g^2``; ``m_hat = m / (1 - b1^t)``
``rho_inf``               ``2 / (1 - b2) - 1``, the length of the approximated simple moving average
``rho_t``                 ``rho_inf - 2 t b2^t / (1 - b2^t)``
``r_t``                   ``sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))``
``d``                     ``r_t * m_hat * sqrt(1 - b2^t) / (sqrt(v) + eps)`` if ``rho_t > 5``, else ``m_hat``
``update``                ``-lr * d`` (``-lr * (d + weight_decay * p)`` with decoupled weight decay)
========================  ==========================================================================

Without ``decoupled_weight_decay`` the decay is an L2 penalty added to ``g`` first, as in ``torch.optim.RAdam``.
The first updates (``rho_t <= 5``: five of them for ``b2 = 0.999``) are SGD with momentum, in gradient units. Under
DP noise ``v`` absorbs the noise variance as Adam's does; ``noise_bias_correction=True`` removes it (the rule of
:mod:`opake_core.optim.bias_correction`). The rectification ``r_t`` depends only on ``t``, not on the gradients.
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

__all__ = ["RAdamState", "radam", "scale_by_radam"]

RECTIFICATION_THRESHOLD = 5.0
"""``rho_t`` above which the adaptive, rectified step is taken (``torch.optim.RAdam``'s threshold)."""


class RAdamState(NamedTuple):
    """State of :func:`scale_by_radam`: the moments ``mu`` and ``nu`` (trees like the parameters) and ``count``,
    the number of updates applied so far (0-d int64 tensor on the CPU)."""

    mu: Any
    nu: Any
    count: torch.Tensor


def scale_by_radam(
    b1: float, b2: float, eps: float, *, noise_bias_correction: bool = False
) -> GradientTransformation | NoiseAwareTransformation:
    """``g -> r_t * m_hat * sqrt(1 - b2^t) / (sqrt(v) + eps)`` once ``rho_t > 5``, ``m_hat`` before.

    With ``noise_bias_correction`` a :class:`~opake_core.optim.bias_correction.NoiseAwareTransformation` whose state
    is ``NoiseVarianceState(RAdamState, phi)``: ``v`` loses the EMA ``phi`` of ``sigma^2`` where ``v - phi > 0`` (both
    un-normalized, so the difference carries the same ``1 - b2^t`` factor), and ``phi`` advances on every update,
    the momentum-only ones included."""
    rho_inf = 2 / (1 - b2) - 1

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])  # noqa: E731
        state = RAdamState(mu=zeros(), nu=zeros(), count=torch.zeros((), dtype=torch.int64))
        return state

    def step(updates, state, phi):
        g, treedef = optree.tree_flatten(updates)
        count = state.count + 1
        t = int(count)
        mu = torch._foreach_lerp(optree.tree_leaves(state.mu), g, 1 - b1)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        out = torch._foreach_div(mu, 1 - b1**t)
        correction2 = 1 - b2**t
        rho_t = rho_inf - 2 * t * b2**t / correction2
        if rho_t > RECTIFICATION_THRESHOLD:
            rectification = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            second = nu if phi is None else [without_noise(v, float(f)) for v, f in zip(nu, phi, strict=True)]
            denominator = torch._foreach_sqrt(second)
            torch._foreach_add_(denominator, eps)
            torch._foreach_div_(out, denominator)
            torch._foreach_mul_(out, rectification * math.sqrt(correction2))
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), RAdamState(mu=unflatten(mu), nu=unflatten(nu), count=count)

    return with_noise_variance(init_fn, step, b2, correct=noise_bias_correction)


def radam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    decoupled_weight_decay: bool = False,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """RAdam: Adam with the variance of its adaptive learning rate rectified (SGD with momentum while
    ``rho_t <= 5``); equal to ``torch.optim.RAdam`` with the same arguments.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to ``sqrt(v)`` in the denominator (> 0), in gradient units.
        weight_decay: decay coefficient (>= 0): an L2 penalty added to the gradient, or with
            ``decoupled_weight_decay=True`` AdamW's decoupled decay ``-lr * weight_decay * p``.
        decoupled_weight_decay: decouple the weight decay from the gradient (as ``torch.optim.RAdam``).
        noise_bias_correction: remove the EMA of the noise variance from ``v``
            (:mod:`opake_core.optim.bias_correction`); the momentum-only first updates are unchanged.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.RAdam``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.radam(lr=0.1, non_private=True), torch.optim.RAdam, lr=0.1)
        True
    """
    lr = check_lr(lr)
    b1, b2 = check_betas(betas, 2)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    decay = add_decayed_weights(weight_decay)
    rescale = scale_by_radam(b1, b2, eps, noise_bias_correction=noise_bias_correction)
    parts = [rescale, decay] if decoupled_weight_decay else [decay, rescale]
    needs_params = weight_decay > 0
    if noise_bias_correction:
        transform = noise_aware_chain(*parts, scale_by_neg_lr(lr))
        return Optimizer("radam", transform, non_private=non_private, needs_params=needs_params, noise_aware=True)
    return Optimizer("radam", chain(*parts, scale_by_neg_lr(lr)), non_private=non_private, needs_params=needs_params)
