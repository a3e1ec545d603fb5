"""Adam (Kingma & Ba 2015), AdamW (Loshchilov & Hutter 2019) and StableAdamW (Wortsman et al. 2023), optionally
with DP noise bias correction.

Without correction both are torchopt's ``scale_by_adam`` (here as multi-tensor operations with the same
arithmetic, :mod:`opake_core.optim._foreach`) chained with (AdamW only) decoupled weight decay and the learning
rate: ``update = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``, equal to
``torch.optim.Adam`` / ``torch.optim.AdamW``. With ``noise_bias_correction=True`` the rescaling is
:func:`~opake_core.optim.bias_correction.scale_by_bias_corrected_adam`, which removes the noise variance of
the :class:`~opake_core.tree.Noised` input (its ``noise_std``, per leaf when per group) from ``v_hat``
(DP-AdamBC). With ``update_rms_clip`` the rescaling is
:func:`~opake_core.optim.stable_adamw.scale_by_stable_adam`: each tensor's learning rate is divided by
``max(1, RMS / update_rms_clip)``, ``RMS`` the root mean square of ``g / sqrt(v_hat)`` (StableAdamW).
"""

from __future__ import annotations

from torchopt import chain

from opake_core import validate
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._foreach import add_decayed_weights, scale_by_adam
from opake_core.optim._fused import fused_adam_apply
from opake_core.optim._guard import Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import noise_aware_chain, scale_by_bias_corrected_adam
from opake_core.optim.stable_adamw import stable_optimizer

__all__ = ["adam", "adamw"]


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    *,
    update_rms_clip: float | None = None,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """Adam.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        betas: ``(b1, b2)``, decay rates of the first and second moment EMAs, each in [0, 1).
        eps: added to ``sqrt(v_hat)`` in the denominator (> 0), in gradient units.
        update_rms_clip: None, or a threshold (> 0, the paper's 1.0) on the per-tensor ``RMS`` of ``g / sqrt(v_hat)``
            above which the tensor's learning rate is divided by ``RMS / update_rms_clip`` (StableAdamW, see
            :mod:`opake_core.optim.stable_adamw`).
        noise_bias_correction: remove the noise variance ``noise_std^2`` of the noised input from ``v_hat``
            (DP-AdamBC, Tang et al. 2024); see :mod:`opake_core.optim.bias_correction`.
        non_private: accept plain trees of tensors (an explicitly non-private run; noise std 0).

    Example: three updates (non-private here, to compare) match ``torch.optim.Adam``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.adam(lr=0.1, non_private=True), torch.optim.Adam, lr=0.1)
        True
    """
    return _build(
        "adam",
        lr,
        betas,
        eps,
        0.0,
        update_rms_clip=update_rms_clip,
        noise_bias_correction=noise_bias_correction,
        non_private=non_private,
    )


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    update_rms_clip: float | None = None,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay, ``update = -lr * (adam_direction + weight_decay * p)``.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to ``sqrt(v_hat)`` in the denominator (> 0).
        weight_decay: decoupled decay coefficient (>= 0), multiplied by ``lr`` like ``torch.optim.AdamW`` (by the
            tensor's clipped rate with ``update_rms_clip``).
        update_rms_clip: as in :func:`adam`; ``adamw(update_rms_clip=1.0)`` is
            :func:`~opake_core.optim.stable_adamw`.
        noise_bias_correction: as in :func:`adam`.
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: with noise-variance bias correction, the noise's variance ``noise_std^2`` is taken out of Adam's second
    moment; on a gradient that is pure noise the first step is then larger than plain AdamW's.

        >>> import torch
        >>> from opake_core import Noised, optim
        >>> params, noised = {"w": torch.zeros(1)}, Noised({"w": torch.tensor([0.3])}, 1.0, noise_std=0.25)
        >>> steps = []
        >>> for correct in (False, True):
        ...     opt = optim.adamw(lr=0.1, noise_bias_correction=correct)
        ...     updates, _ = opt.update(noised, opt.init(params), params=params)
        ...     steps.append(updates["w"].abs().item())
        >>> round(steps[0], 4), steps[1] > steps[0]
        (0.1, True)
    """
    return _build(
        "adamw",
        lr,
        betas,
        eps,
        weight_decay,
        update_rms_clip=update_rms_clip,
        noise_bias_correction=noise_bias_correction,
        non_private=non_private,
    )


def _build(
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    *,
    update_rms_clip: float | None,
    noise_bias_correction: bool,
    non_private: bool,
) -> Optimizer:
    lr = check_lr(lr)
    b1, b2 = check_betas(betas, 2)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    needs_params = weight_decay > 0
    if update_rms_clip is not None:
        clip = validate.positive("update_rms_clip", update_rms_clip)
        return stable_optimizer(
            f"stable_{name}",
            lr,
            (b1, b2),
            eps,
            weight_decay,
            clip,
            noise_bias_correction=noise_bias_correction,
            non_private=non_private,
        )
    tail = [add_decayed_weights(weight_decay), scale_by_neg_lr(lr)]
    if noise_bias_correction:
        transform = noise_aware_chain(scale_by_bias_corrected_adam(b1, b2, eps), chain(*tail))
        return Optimizer(name, transform, non_private=non_private, needs_params=needs_params, noise_aware=True)
    transform = chain(scale_by_adam(b1, b2, eps), *tail)
    fused = fused_adam_apply(b1, b2, eps, weight_decay, lr)
    return Optimizer(name, transform, non_private=non_private, needs_params=needs_params, in_place=True, fused=fused)
