"""StableAdamW: AdamW whose learning rate shrinks, per tensor, when the update outgrows the second moment.

Wortsman, Dettmers, Zettlemoyer, Morcos, Farhadi, Schmidt, "Stable and low-precision training for large-scale
vision-language models", NeurIPS 2023, arXiv:2304.13013, Algorithm 2 (AdamW with the update clipping of Adafactor,
Shazeer and Stern 2018). Per leaf (one tensor), at update ``t`` (from 1), with gradient ``g``:

====================  ==============================================================================
``m, v``              ``b1 m + (1 - b1) g``, ``b2 v + (1 - b2) g^2``
``m_hat, v_hat``      ``m / (1 - b1^t)``, ``v / (1 - b2^t)`` (``v_hat`` with the noise variance removed
                      when ``noise_bias_correction``, :mod:`opake_core.optim.bias_correction`)
``RMS``               ``sqrt(mean(g^2 / max(v_hat, eps^2)))`` over the tensor's elements
``lr_t``              ``lr / max(1, RMS / update_rms_clip)``
``update``            ``-lr_t * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``
====================  ==============================================================================

``RMS`` is about 1 while the gradients look like their running second moment; a gradient much larger than ``v``
remembers (a loss spike, or a stale ``v`` after a quiet stretch) makes Adam's step much larger than ``lr``, and the
tensor's learning rate shrinks by that factor instead. Under DP the rule reads only the noised gradients and the
optimizer state: post-processing, no privacy cost. The paper's threshold is 1 (``update_rms_clip=1.0``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._guard import NoiseAwareTransformation, Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import noise_aware_chain, without_noise

__all__ = ["StableAdamState", "scale_by_stable_adam", "stable_adamw", "stable_optimizer"]


class StableAdamState(NamedTuple):
    """State of :func:`scale_by_stable_adam`.

    Attributes:
        mu: first moments ``m``, a tree like the parameters.
        nu: second moments ``v``, a tree like the parameters.
        count: the number of updates applied so far (0-d int64 CPU tensor).
        phi: per-leaf EMA of the noise variance (0-d float64 CPU tensors) with the noise-bias correction, else
            None.
    """

    mu: Any
    nu: Any
    count: torch.Tensor
    phi: Any


def scale_by_stable_adam(
    b1: float, b2: float, eps: float, weight_decay: float, update_rms_clip: float, *, noise_bias_correction: bool
) -> GradientTransformation | NoiseAwareTransformation:
    """``lr_t / lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`` of the module docstring (the factor ``-lr``
    comes after). A :class:`NoiseAwareTransformation` (``update`` takes ``noise_std``) with
    ``noise_bias_correction``. ``update`` needs ``params`` when ``weight_decay > 0``; it always computes out of place.
    Arguments are validated by the calling factory."""

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        unflatten = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return StableAdamState(
            mu=unflatten([torch.zeros_like(p) for p in leaves]),
            nu=unflatten([torch.zeros_like(p) for p in leaves]),
            count=torch.zeros((), dtype=torch.int64),
            phi=unflatten([torch.zeros((), dtype=torch.float64) for _ in leaves]) if noise_bias_correction else None,
        )

    def step(updates, state, params, noise_std):
        g, treedef = optree.tree_flatten(updates)
        count = state.count + 1
        t = int(count)
        mu = torch._foreach_mul(optree.tree_leaves(state.mu), b1)
        torch._foreach_add_(mu, g, alpha=1 - b1)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        phi, noise = None, [0.0] * len(g)
        if noise_std is not None:
            phi = optree.tree_map(lambda f, s: f * b2 + (1 - b2) * float(s) ** 2, state.phi, noise_std)
            noise = [float(f) for f in optree.tree_leaves(phi)]
        decayed = optree.tree_leaves(params) if weight_decay else [None] * len(g)
        out = []
        for x, m, v, f, p in zip(g, mu, nu, noise, decayed, strict=True):
            v_hat = without_noise(v, f).div(1 - b2**t)
            rms = x.square().div(v_hat.clamp(min=eps**2)).mean().sqrt()
            d = m.div(1 - b1**t).div(v_hat.sqrt().add(eps))
            if p is not None:
                d = d.add(p, alpha=weight_decay)
            # a tensor op, not max() on a Python float: no device sync per leaf
            out.append(d.div(rms.div(update_rms_clip).clamp(min=1.0)))
        unflatten = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return unflatten(out), StableAdamState(mu=unflatten(mu), nu=unflatten(nu), count=count, phi=phi)

    if noise_bias_correction:

        def corrected_fn(updates, state, *, params=None, noise_std, inplace=False):
            return step(updates, state, params, noise_std)

        return NoiseAwareTransformation(init_fn, corrected_fn)

    def update_fn(updates, state, *, params=None, inplace=False):
        return step(updates, state, params, None)

    return GradientTransformation(init_fn, update_fn)


def stable_optimizer(
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    update_rms_clip: float,
    *,
    noise_bias_correction: bool,
    non_private: bool,
) -> Optimizer:
    """The :class:`Optimizer` of :func:`scale_by_stable_adam` followed by ``-lr``, from validated arguments (shared
    by :func:`stable_adamw` and :func:`~opake_core.optim.adamw` with ``update_rms_clip``)."""
    b1, b2 = betas
    head = scale_by_stable_adam(b1, b2, eps, weight_decay, update_rms_clip, noise_bias_correction=noise_bias_correction)
    flags = {"non_private": non_private, "needs_params": weight_decay > 0, "needs_whole_leaves": True}  # per-tensor RMS
    if noise_bias_correction:
        return Optimizer(name, noise_aware_chain(head, scale_by_neg_lr(lr)), noise_aware=True, **flags)
    return Optimizer(name, chain(head, scale_by_neg_lr(lr)), **flags)


def stable_adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    update_rms_clip: float = 1.0,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """StableAdamW (Wortsman et al. 2023): AdamW whose per-tensor learning rate is ``lr / max(1, RMS /
    update_rms_clip)``, ``RMS = sqrt(mean(g^2 / max(v_hat, eps^2)))``; see :mod:`opake_core.optim.stable_adamw`.
    The arguments are :func:`~opake_core.optim.adamw`'s (``update_rms_clip`` here defaults to the paper's 1.0).

    Example: after a gradient a hundred times larger than the ones before, ``RMS = |g| / sqrt(v_hat)`` is about 10
    (``b2 = 0.99``), and StableAdamW takes about a tenth of AdamW's step.

        >>> import torch
        >>> from opake_core import optim
        >>> params, steps = {"w": torch.zeros(4)}, {}
        >>> for make in (optim.adamw, optim.stable_adamw):
        ...     opt = make(lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, non_private=True)
        ...     state = opt.init(params)
        ...     for g in [0.01] * 200 + [1.0]:
        ...         updates, state = opt.update({"w": torch.full((4,), g)}, state)
        ...     steps[make.__name__] = round(updates["w"][0].item(), 3)
        >>> steps
        {'adamw': -0.101, 'stable_adamw': -0.011}
    """
    return stable_optimizer(
        "stable_adamw",
        check_lr(lr),
        check_betas(betas, 2),
        validate.positive("eps", eps),
        validate.non_negative("weight_decay", weight_decay),
        validate.positive("update_rms_clip", update_rms_clip),
        noise_bias_correction=noise_bias_correction,
        non_private=non_private,
    )
