"""Adadelta (Zeiler 2012, "ADADELTA: An Adaptive Learning Rate Method", arXiv:1212.5701, Algorithm 1), as
``torch.optim.Adadelta``.

Per leaf and coordinate, at every update, with gradient ``g`` (both accumulators zeros at init):

====================  ==============================================================================
``g``                 ``g + weight_decay * p`` (L2 penalty, added to the gradient)
``v``                 ``rho * v + (1 - rho) * g^2``
``d``                 ``sqrt(u + eps) / sqrt(v + eps) * g`` (``u`` from the previous update)
``u``                 ``rho * u + (1 - rho) * d^2``
``update``            ``-lr * d``
====================  ==============================================================================

The step has the units of the parameters (the ratio of two RMS values times ``g``), so ``lr`` is a
dimensionless multiplier (1.0 in the paper). Under DP noise, ``v`` absorbs the noise variance as RMSprop's does,
and ``u`` accumulates the squares of the noisy steps, so the noise enters both the numerator and the denominator;
there is no noise correction here.
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

__all__ = ["AdadeltaState", "adadelta", "scale_by_adadelta"]


class AdadeltaState(NamedTuple):
    """State of :func:`scale_by_adadelta`.

    Attributes:
        nu: the EMA ``v`` of the squared gradients, a tree like the parameters.
        delta: the EMA ``u`` of the squared steps, a tree like the parameters.
    """

    nu: Any
    delta: Any


def scale_by_adadelta(rho: float, eps: float) -> GradientTransformation:
    """``g -> sqrt(u + eps) / sqrt(v + eps) * g``, with ``v`` and ``u`` the EMAs of ``g^2`` and of the steps'
    squares."""

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])  # noqa: E731
        return AdadeltaState(nu=zeros(), delta=zeros())

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), rho)
        torch._foreach_addcmul_(nu, g, g, value=1 - rho)
        std = torch._foreach_add(nu, eps)
        torch._foreach_sqrt_(std)
        u = optree.tree_leaves(state.delta)
        out = torch._foreach_add(u, eps)
        torch._foreach_sqrt_(out)
        torch._foreach_div_(out, std)
        torch._foreach_mul_(out, g)
        delta = torch._foreach_mul(u, rho)
        torch._foreach_addcmul_(delta, out, out, value=1 - rho)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), AdadeltaState(nu=unflatten(nu), delta=unflatten(delta))

    return GradientTransformation(init_fn, update_fn)


def adadelta(
    lr: LearningRate = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    non_private: bool = False,
) -> Optimizer:
    """Adadelta: ``update = -lr * sqrt(u + eps) / sqrt(v + eps) * g``; equal to ``torch.optim.Adadelta`` with
    the same arguments.

    Args:
        lr: dimensionless multiplier of the step (> 0) or a schedule ``step -> lr``; the paper's is 1.
        rho: decay of both EMAs, in [0, 1).
        eps: added inside both square roots (> 0), in squared gradient and squared parameter units; it also
            sets the size of the first steps (``sqrt(eps)`` relative to the gradient's RMS).
        weight_decay: L2 penalty coefficient (>= 0), added to the gradient like ``torch.optim.Adadelta``.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.Adadelta``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.adadelta(lr=1.0, non_private=True), torch.optim.Adadelta, lr=1.0)
        True
    """
    lr = check_lr(lr)
    rho = validate.decay("rho", rho)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    transform = chain(add_decayed_weights(weight_decay), scale_by_adadelta(rho, eps), scale_by_neg_lr(lr))
    return Optimizer("adadelta", transform, non_private=non_private, needs_params=weight_decay > 0)
