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
dimensionless multiplier (1.0 in the paper).

**Why no noise-bias correction** (``noise_bias_correction=True`` is refused). The noised gradient is ``g = s + z``,
``z`` of independent ``N(0, sigma_t^2)`` entries independent of the signal ``s``. The noise enters both accumulators,
and each share can be derived:

* the denominator: ``E[g^2] = s^2 + sigma_t^2`` and ``v`` is linear in ``g^2``, so ``E[v_t] = v_t(s) + phi_t``,
  ``phi_t = rho phi_{t-1} + (1 - rho) sigma_t^2`` (a scalar per leaf, as RMSprop's);
* the numerator: the step is ``d_t = r_t g_t`` with ``r_t = sqrt(u_{t-1} + eps) / sqrt(v_t + eps)``; given ``r_t``,
  ``E[d_t^2] = r_t^2 s^2 + r_t^2 sigma_t^2``, so ``E[u_t] = u_t(s) + psi_t`` with the per-coordinate
  ``psi_t = rho psi_{t-1} + (1 - rho) r_t^2 sigma_t^2`` (exact up to a term of relative order ``1 - rho``: ``r_t``
  depends on the current draw through ``v_t``). This is the reference library's second, per-element EMA.

Removing both shares (``v - phi``, ``u - psi`` where positive, else uncorrected, as the other optimizers' rule) is
unbiased for ``v`` (and for ``u`` to that order), and yet it makes DP Adadelta worse: on the noisy quadratic of
``tests/core/optim/test_optim_noise_correction_factored.py`` (``rho = 0.9``, ``sigma`` 0.3 and 1, ``lr`` 1 and 10, three
seeds, 1000 steps) it ends 3.7 to 20 times farther from the optimum than plain Adadelta, and removing ``phi`` alone 16
to 53 times (beyond the starting point at ``sigma = 1``). The likely reason is the ratio: plain Adadelta's ``sqrt(u /
v)`` carries the noise in both terms (the squared steps and the squared gradients), which balance, so the noise does not
shrink the step as it does Adam's (whose numerator, the first moment, averages the noise out while the denominator keeps
it). The correction removes that balance, so there is nothing for it to repair and it is not offered.
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
    noise_bias_correction: bool = False,
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
        noise_bias_correction: must be False: the correction is derived but makes DP Adadelta converge worse (the
            module docstring), so ``True`` is refused.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.Adadelta``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.adadelta(lr=1.0, non_private=True), torch.optim.Adadelta, lr=1.0)
        True
    """
    if noise_bias_correction:
        raise ConfigurationError(
            "adadelta(noise_bias_correction=True) is refused: Adadelta's step sqrt(u / v) * g carries the noise in "
            "both its numerator (the squared steps) and its denominator (the squared gradients), which balance; "
            "removing the noise shares from both ends 3.7 to 20 times farther from the optimum on a noisy quadratic, "
            "and from the denominator alone 16 to 53 times (see opake_core.optim.adadelta). Use "
            "adadelta without it, or a corrected optimizer (rmsprop, adagrad, adam, adafactor with "
            "noise_bias_correction=True)."
        )
    lr = check_lr(lr)
    rho = validate.decay("rho", rho)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    transform = chain(add_decayed_weights(weight_decay), scale_by_adadelta(rho, eps), scale_by_neg_lr(lr))
    return Optimizer("adadelta", transform, non_private=non_private, needs_params=weight_decay > 0)
