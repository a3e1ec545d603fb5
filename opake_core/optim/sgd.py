"""Stochastic gradient descent, with optional heavy-ball or Nesterov momentum.

The update for gradient ``g`` (a noised sum, already divided by the expected batch size) is, per leaf,
``g <- g + weight_decay * p`` (L2 penalty, as ``torch.optim.SGD``), then with momentum ``mu``
``b <- mu * b + g`` and ``g <- b`` (heavy ball) or ``g <- g + mu * b`` (Nesterov, Sutskever et al. 2013), then
``update = -lr * g``. Gaussian noise is zero-mean, so these linear rules need no DP correction.
"""

from __future__ import annotations

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation
from torchopt.transform.trace import TraceState

from opake_core import validate
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr

__all__ = ["momentum", "sgd"]


def trace(decay: float, *, nesterov: bool) -> GradientTransformation:
    """Momentum ``b <- decay * b + g`` (state ``TraceState(trace=b)``, zeros at init).

    ``torchopt.transform.trace`` remembers in its closure whether it was called before and treats the first
    call specially, so a fresh optimizer resumed from a saved non-zero state would drop ``decay * b`` on its
    first step. This version is a pure function of its inputs; with a zero state it computes the same numbers.
    """

    def init_fn(params):
        return TraceState(trace=optree.tree_map(torch.zeros_like, params))

    def update_fn(updates, state, *, params=None, inplace=False):
        pairs = zip(optree.tree_leaves(state.trace), optree.tree_leaves(updates), strict=True)
        if inplace and all(b.dtype == g.dtype for b, g in pairs):
            # the trace in its own tensors, the updates in the gradients' (never the trace itself)
            new_trace = optree.tree_map(lambda b, g: b.mul_(decay).add_(g), state.trace, updates)
            if nesterov:
                optree.tree_map(lambda g, b: g.add_(b, alpha=decay), updates, new_trace)
            else:
                optree.tree_map(lambda g, b: g.copy_(b), updates, new_trace)
            return updates, TraceState(trace=new_trace)
        new_trace = optree.tree_map(lambda b, g: b.mul(decay).add_(g), state.trace, updates)
        if nesterov:
            updates = optree.tree_map(lambda g, b: g.add(b, alpha=decay), updates, new_trace)
        else:
            updates = new_trace
        return updates, TraceState(trace=new_trace)

    return GradientTransformation(init_fn, update_fn)


def sgd(lr: LearningRate, *, weight_decay: float = 0.0, non_private: bool = False) -> Optimizer:
    """Plain SGD: ``update = -lr * (g + weight_decay * p)``.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        weight_decay: L2 penalty coefficient (>= 0), added to the gradient like ``torch.optim.SGD``.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.SGD``.

        >>> import torch
        >>> from opake_core import optim
        >>> opt, params = optim.sgd(lr=0.1, non_private=True), {"w": torch.tensor([1.0, -2.0])}
        >>> reference = torch.nn.Parameter(params["w"].clone())
        >>> torch_opt, state = torch.optim.SGD([reference], lr=0.1), opt.init(params)
        >>> for grad in (torch.tensor([0.5, 0.1]), torch.tensor([-0.3, 0.2]), torch.tensor([0.1, 0.4])):
        ...     updates, state = opt.update({"w": grad}, state, params=params)
        ...     params = optim.apply_updates(params, updates)
        ...     reference.grad = grad.clone()
        ...     torch_opt.step()
        >>> torch.allclose(params["w"], reference.detach(), atol=1e-6)
        True
    """
    return _build("sgd", lr, None, nesterov=False, weight_decay=weight_decay, non_private=non_private)


def momentum(
    lr: LearningRate,
    momentum: float = 0.9,
    *,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    non_private: bool = False,
) -> Optimizer:
    """SGD with heavy-ball (or ``nesterov=True``) momentum, as ``torch.optim.SGD(momentum=..., dampening=0)``.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        momentum: momentum coefficient in [0, 1).
        nesterov: use Nesterov momentum.
        weight_decay: L2 penalty coefficient (>= 0), added to the gradient before the momentum.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.SGD(momentum=0.9)``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> opt = optim.momentum(lr=0.1, momentum=0.9, non_private=True)
        >>> testing.matches_torch_optimizer(opt, torch.optim.SGD, lr=0.1, momentum=0.9)
        True
    """
    decay = validate.decay("momentum", momentum)
    return _build("momentum", lr, decay, nesterov=nesterov, weight_decay=weight_decay, non_private=non_private)


def _build(
    name: str,
    lr: LearningRate,
    decay: float | None,
    *,
    nesterov: bool,
    weight_decay: float,
    non_private: bool,
) -> Optimizer:
    lr = check_lr(lr)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    parts = [add_decayed_weights(weight_decay)]
    if decay is not None:
        parts.append(trace(decay, nesterov=nesterov))
    parts.append(scale_by_neg_lr(lr))
    return Optimizer(name, chain(*parts), non_private=non_private, needs_params=weight_decay > 0, in_place=True)
