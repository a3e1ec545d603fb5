"""Adagrad (Duchi, Hazan, Singer 2011, "Adaptive Subgradient Methods for Online Learning and Stochastic
Optimization", JMLR 12), as ``torch.optim.Adagrad``.

Per leaf and coordinate, at update ``t`` (from 1), with gradient ``g``:

====================  ==============================================================================
``g``                 ``g + weight_decay * p`` (L2 penalty, added to the gradient)
``s``                 ``s + g^2`` (``s`` starts at ``initial_accumulator_value``)
``update``            ``-lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)``
====================  ==============================================================================

**DP: the accumulator sums the noise variance.** A noised gradient ``g = s_t + z_t`` with ``z_t ~ N(0, sigma^2)``
adds ``sigma^2`` to ``E[s]`` at every update, so ``sqrt(s) >= sigma * sqrt(t)`` on average and the step shrinks
like ``lr / (sigma * sqrt(t))`` whatever the signal: learning slows down and, over a long run, stalls.
``noise_bias_correction=True`` subtracts the summed noise variance ``Phi_t = sum_i sigma_i^2`` from ``s`` (the rule of
:mod:`opake_core.optim.bias_correction`), which removes that drift.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import noise_aware_chain, scale_by_bias_corrected_adagrad

__all__ = ["AdagradState", "adagrad", "scale_by_adagrad"]


class AdagradState(NamedTuple):
    """State of :func:`scale_by_adagrad`.

    Attributes:
        sum: the accumulated squared gradients ``s``, a tree like the parameters.
        count: number of updates applied so far (0-d int64 tensor on the CPU).
    """

    sum: Any
    count: torch.Tensor


def scale_by_adagrad(eps: float, lr_decay: float, initial_accumulator_value: float) -> GradientTransformation:
    """``g -> g / (sqrt(s) + eps) / (1 + (t - 1) * lr_decay)`` with ``s`` the running sum of ``g^2``."""

    def init_fn(params):
        return AdagradState(
            sum=optree.tree_map(lambda p: torch.full_like(p, initial_accumulator_value), params),
            count=torch.zeros((), dtype=torch.int64),
        )

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        count = state.count + 1
        total = torch._foreach_addcmul(optree.tree_leaves(state.sum), g, g)
        denominator = torch._foreach_sqrt(total)
        torch._foreach_add_(denominator, eps)
        out = torch._foreach_div(g, denominator)
        if lr_decay:
            torch._foreach_div_(out, 1 + (int(count) - 1) * lr_decay)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), AdagradState(sum=unflatten(total), count=count)

    return GradientTransformation(init_fn, update_fn)


def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """Adagrad: ``update = -lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum of g^2) + eps)``; equal to
    ``torch.optim.Adagrad`` with the same arguments. Under DP the sum grows by the noise variance every update
    (see the module docstring).

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        lr_decay: ``lr`` is divided by ``1 + (t - 1) * lr_decay`` at update ``t`` (>= 0).
        weight_decay: L2 penalty coefficient (>= 0), added to the gradient like ``torch.optim.Adagrad``.
        initial_accumulator_value: the starting value of the sum of squared gradients (>= 0, gradient units
            squared).
        eps: added to the square root of the sum in the denominator (> 0), in gradient units.
        noise_bias_correction: subtract the summed noise variance from the sum of squared gradients
            (:mod:`opake_core.optim.bias_correction`).
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.Adagrad``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.adagrad(lr=0.1, non_private=True), torch.optim.Adagrad, lr=0.1)
        True
    """
    lr = check_lr(lr)
    lr_decay = validate.non_negative("lr_decay", lr_decay)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    initial = validate.non_negative("initial_accumulator_value", initial_accumulator_value)
    eps = validate.positive("eps", eps)
    needs_params = weight_decay > 0
    if noise_bias_correction:
        rescale = scale_by_bias_corrected_adagrad(eps, lr_decay, initial)
        transform = noise_aware_chain(add_decayed_weights(weight_decay), rescale, scale_by_neg_lr(lr))
        return Optimizer("adagrad", transform, non_private=non_private, needs_params=needs_params, noise_aware=True)
    transform = chain(add_decayed_weights(weight_decay), scale_by_adagrad(eps, lr_decay, initial), scale_by_neg_lr(lr))
    return Optimizer("adagrad", transform, non_private=non_private, needs_params=needs_params)
