"""RMSprop (Hinton, Srivastava, Swersky, "Neural Networks for Machine Learning", lecture 6e, 2012; the centered
variant from Graves 2013, "Generating Sequences With Recurrent Neural Networks", arXiv:1308.0850), as
``torch.optim.RMSprop``.

Per leaf and coordinate, at every update, with gradient ``g`` (all buffers zeros at init):

====================  ==============================================================================
``g``                 ``g + weight_decay * p`` (L2 penalty, added to the gradient)
``v``                 ``alpha * v + (1 - alpha) * g^2``
``mean``              ``alpha * mean + (1 - alpha) * g`` (``centered=True`` only)
``d``                 ``g / (sqrt(v) + eps)``, or ``g / (sqrt(v - mean^2) + eps)`` when centered
``b``                 ``momentum * b + d`` (``momentum > 0`` only; then ``d = b``)
``update``            ``-lr * d``
====================  ==============================================================================

``v`` is not bias-corrected (unlike Adam's), so the first updates are larger by up to ``1 / sqrt(1 - alpha)``.
Under DP noise of standard deviation ``sigma`` (per coordinate), ``E[v] -> E[s^2] + sigma^2`` for a signal ``s``:
where the noise dominates the denominator is about ``sigma`` and RMSprop behaves like SGD with learning rate
``lr / sigma``. ``noise_bias_correction=True`` removes the EMA of ``sigma^2`` from ``v`` (the rule of
:mod:`opake_core.optim.bias_correction`). The centered variant subtracts the squared mean of the gradients, not the
noise variance; the two are not combined (see :func:`rmsprop`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import noise_aware_chain, scale_by_bias_corrected_rms
from opake_core.optim.sgd import trace

__all__ = ["RMSpropState", "rmsprop", "scale_by_rms"]


class RMSpropState(NamedTuple):
    """State of :func:`scale_by_rms`.

    Attributes:
        nu: the EMA ``v`` of the squared gradients, a tree like the parameters.
        mean: the EMA of the gradients (a tree like the parameters) when centered, else None.
    """

    nu: Any
    mean: Any


def scale_by_rms(alpha: float, eps: float, *, centered: bool) -> GradientTransformation:
    """``g -> g / (sqrt(v) + eps)`` (``sqrt(v - mean^2)`` when ``centered``), ``v`` the EMA of ``g^2``."""

    def init_fn(params):
        zeros = lambda: optree.tree_map(torch.zeros_like, params)  # noqa: E731
        return RMSpropState(nu=zeros(), mean=zeros() if centered else None)

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), alpha)
        torch._foreach_addcmul_(nu, g, g, value=1 - alpha)
        mean = None
        if centered:
            mean = torch._foreach_lerp(optree.tree_leaves(state.mean), g, 1 - alpha)
            denominator = torch._foreach_addcmul(nu, mean, mean, value=-1)
            torch._foreach_sqrt_(denominator)
        else:
            denominator = torch._foreach_sqrt(nu)
        torch._foreach_add_(denominator, eps)
        out = torch._foreach_div(g, denominator)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        new_state = RMSpropState(nu=unflatten(nu), mean=None if mean is None else unflatten(mean))
        return unflatten(out), new_state

    return GradientTransformation(init_fn, update_fn)


def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    *,
    centered: bool = False,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """RMSprop: ``update = -lr * g / (sqrt(v) + eps)`` with ``v`` the EMA of ``g^2``; equal to
    ``torch.optim.RMSprop`` with the same arguments.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        alpha: decay of the squared-gradient EMA, in [0, 1).
        eps: added to ``sqrt(v)`` in the denominator (> 0), in gradient units.
        weight_decay: L2 penalty coefficient (>= 0), added to the gradient like ``torch.optim.RMSprop``.
        momentum: momentum coefficient in [0, 1) applied to the rescaled gradient (0: none).
        centered: divide by the square root of the gradients' EMA variance, ``v - mean^2``, instead of ``v``.
        noise_bias_correction: remove the EMA of the noise variance ``noise_std^2`` from ``v``
            (:mod:`opake_core.optim.bias_correction`); not with ``centered``.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.RMSprop``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.rmsprop(lr=0.01, non_private=True), torch.optim.RMSprop, lr=0.01)
        True
    """
    lr = check_lr(lr)
    alpha = validate.decay("alpha", alpha)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    momentum = validate.decay("momentum", momentum)
    if noise_bias_correction and centered:
        raise ConfigurationError(
            "rmsprop(centered=True, noise_bias_correction=True) is refused: the centered denominator v - mean^2 "
            "estimates the gradients' variance, and the noise's share of it is not sigma^2 (the mean's EMA carries "
            "noise too), so subtracting sigma^2 would over-correct. Use centered=False with the correction, or "
            "centered=True without it."
        )
    if noise_bias_correction:
        rescale = scale_by_bias_corrected_rms(alpha, eps)
    else:
        rescale = scale_by_rms(alpha, eps, centered=bool(centered))
    parts = [add_decayed_weights(weight_decay), rescale]
    if momentum > 0:
        parts.append(trace(momentum, nesterov=False))
    parts.append(scale_by_neg_lr(lr))
    needs_params = weight_decay > 0
    if noise_bias_correction:
        transform = noise_aware_chain(*parts)
        return Optimizer("rmsprop", transform, non_private=non_private, needs_params=needs_params, noise_aware=True)
    return Optimizer("rmsprop", chain(*parts), non_private=non_private, needs_params=needs_params)
