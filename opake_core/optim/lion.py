"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", NeurIPS, arXiv:2302.06675,
Algorithm 2).

Per leaf and coordinate, at every update, with gradient ``g`` and momentum ``m`` (zeros at init):

====================  ==============================================================================
``c``                 ``b1 * m + (1 - b1) * g`` (the interpolation whose sign is the step)
``update``            ``-lr * (sign(c) + weight_decay * p)`` (``sign(0) = 0``)
``m``                 ``b2 * m + (1 - b2) * g`` (the momentum kept for the next update)
====================  ==============================================================================

Every coordinate moves by exactly ``lr`` (plus the decay), whatever the gradient's scale: the step is unitless,
so ``lr`` is usually 3-10 times smaller than AdamW's and ``weight_decay`` that much larger. Under DP noise, a
coordinate whose noise dominates its signal gets a sign that is close to a coin flip, so it still moves by
``lr``: the update's size does not shrink with the noise, only its direction becomes random. The momentum ``m``
averages the noise over about ``1 / (1 - b2)`` steps, but ``c`` adds ``(1 - b1)`` of the current noisy
gradient. The noise std of the input is not used (the sign is post-processing).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr

__all__ = ["LionState", "lion", "scale_by_lion"]


class LionState(NamedTuple):
    """State of :func:`scale_by_lion`: ``mu``, the momentum ``m`` (a tree like the parameters)."""

    mu: Any


def scale_by_lion(b1: float, b2: float) -> GradientTransformation:
    """``g -> sign(b1 * m + (1 - b1) * g)``, then ``m <- b2 * m + (1 - b2) * g``."""

    def init_fn(params):
        return LionState(mu=optree.tree_map(torch.zeros_like, params))

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        m = optree.tree_leaves(state.mu)
        c = torch._foreach_mul(m, b1)
        torch._foreach_add_(c, g, alpha=1 - b1)
        mu = torch._foreach_mul(m, b2)
        torch._foreach_add_(mu, g, alpha=1 - b2)
        out = torch._foreach_sign(c)
        return optree.tree_unflatten(treedef, out), LionState(mu=optree.tree_unflatten(treedef, mu))

    return GradientTransformation(init_fn, update_fn)


def lion(
    lr: LearningRate = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    non_private: bool = False,
) -> Optimizer:
    """Lion: ``update = -lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * p)``, then
    ``m <- b2 * m + (1 - b2) * g``.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``, in parameter units per update (every coordinate
            moves by ``lr``); the paper uses 3-10 times less than AdamW.
        betas: ``(b1, b2)``, each in [0, 1): ``b1`` weighs the momentum in the step's sign, ``b2`` is the
            momentum's decay (the paper's defaults 0.9 and 0.99).
        weight_decay: decoupled decay coefficient (>= 0), multiplied by ``lr`` as in the paper.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: every coordinate moves by exactly ``lr``, in the direction of the sign.

        >>> import torch
        >>> from opake_core import Noised, optim
        >>> opt, params = optim.lion(lr=0.1), {"w": torch.tensor([1.0, -2.0, 0.5])}
        >>> updates, state = opt.update(Noised({"w": torch.tensor([0.5, -0.001, 3.0])}, 1.0, noise_std=0.1),
        ...                             opt.init(params))
        >>> updates["w"]
        tensor([-0.1000,  0.1000, -0.1000])
    """
    lr = check_lr(lr)
    b1, b2 = check_betas(betas, 2)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    transform = chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay), scale_by_neg_lr(lr))
    return Optimizer("lion", transform, non_private=non_private, needs_params=weight_decay > 0)
