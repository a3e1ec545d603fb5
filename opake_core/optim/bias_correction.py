"""Adam's second moment with the Gaussian noise variance removed (DP-AdamBC).

Tang, Panda, Shi, Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)",
AAAI 2024, arXiv:2312.14334. For a noised gradient ``g = s + z`` with ``z ~ N(0, sigma^2 I)`` independent of
the signal ``s``, ``E[g^2] = E[s^2] + sigma^2``: Adam's ``v`` estimates the signal's second moment plus the
noise variance, so with DP noise the denominator is dominated by ``sigma`` and Adam degenerates into SGD with
a rescaled learning rate. The correction subtracts the noise variance's own EMA.

Notation (per leaf, elementwise; ``t`` counts updates from 1; ``sigma_t`` is the leaf's noise std at step
``t``, in the units of the gradient):

====================  ==============================================================================
``m_t``               ``b1 * m_{t-1} + (1 - b1) * g_t``
``v_t``               ``b2 * v_{t-1} + (1 - b2) * g_t^2``
``phi_t``             ``b2 * phi_{t-1} + (1 - b2) * sigma_t^2`` (a scalar per leaf; sigma may change)
``m_hat, v_hat``      ``m_t / (1 - b1^t)``, ``v_t / (1 - b2^t)``
``phi_hat``           ``phi_t / (1 - b2^t)`` (equals ``sigma^2`` when sigma is constant)
``update``            ``m_hat / (sqrt(max(v_hat - phi_hat, min(VARIANCE_FLOOR, v_hat))) + eps)``
====================  ==============================================================================

The floor: where the noise dominates, ``v_hat - phi_hat`` is near zero or negative and the corrected step
would blow up; the paper floors it at a constant (its gamma'). We floor at ``VARIANCE_FLOOR = 1e-8`` (gradient
units squared, so the square root never falls below 1e-4 where the correction is active), but never above
``v_hat`` itself: the correction only ever shrinks Adam's denominator, and with ``sigma = 0`` the update is
plain Adam bit for bit, also for coordinates whose ``v_hat`` is below the floor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt.transform.utils import inc_count, update_moment

from opake_core.optim._guard import NoiseAwareTransformation

__all__ = ["VARIANCE_FLOOR", "BiasCorrectedAdamState", "noise_aware_chain", "scale_by_bias_corrected_adam"]

VARIANCE_FLOOR = 1e-8
"""Smallest corrected second moment (gradient units squared) in the denominator; see the module docstring."""


class BiasCorrectedAdamState(NamedTuple):
    """State of :func:`scale_by_bias_corrected_adam`.

    Attributes:
        mu: first moments, a tree like the parameters.
        nu: second moments, a tree like the parameters.
        count: per-leaf update counts (0-d int64 tensors on each leaf's device), as in torchopt's Adam.
        phi: per-leaf EMA of the noise variance (0-d float64 tensors on the CPU: sigma is known on the host).
    """

    mu: Any
    nu: Any
    count: Any
    phi: Any


def scale_by_bias_corrected_adam(b1: float, b2: float, eps: float) -> NoiseAwareTransformation:
    """Adam's rescaling ``m_hat / (sqrt(v_hat) + eps)`` with the noise variance removed from ``v_hat``.

    Its ``update(updates, state, *, params=None, noise_std)`` takes ``noise_std``, a tree like ``updates`` of
    floats (each leaf's noise standard deviation). Arguments are validated by the calling factory.
    """

    def init_fn(params):
        return BiasCorrectedAdamState(
            mu=optree.tree_map(torch.zeros_like, params),
            nu=optree.tree_map(torch.zeros_like, params),
            count=optree.tree_map(lambda p: torch.zeros((), dtype=torch.int64, device=p.device), params),
            phi=optree.tree_map(lambda p: torch.zeros((), dtype=torch.float64), params),
        )

    def update_fn(updates, state, *, params=None, noise_std):
        mu = update_moment(updates, state.mu, b1, order=1, inplace=False)
        nu = update_moment(updates, state.nu, b2, order=2, inplace=False)
        count = inc_count(updates, state.count)
        phi = optree.tree_map(lambda f, s: f * b2 + (1 - b2) * s**2, state.phi, noise_std)

        def scale(m, v, c, f):
            # The operations of torchopt's scale_by_adam, so that phi = 0 reproduces it bit for bit.
            # Subtracting phi before the bias correction shares one correction factor,
            # (v - phi) / (1 - b2^t) = v_hat - phi_hat, and avoids cancellation error between two
            # separately rounded factors.
            m_hat = m.div(1 - pow(b1, c))
            v_hat = v.div(1 - pow(b2, c))
            corrected = torch.maximum(v.sub(float(f)).div(1 - pow(b2, c)), v_hat.clamp(max=VARIANCE_FLOOR))
            return m_hat.div(corrected.sqrt().add(eps))

        updates = optree.tree_map(scale, mu, nu, count, phi)
        return updates, BiasCorrectedAdamState(mu=mu, nu=nu, count=count, phi=phi)

    return NoiseAwareTransformation(init_fn, update_fn)


def noise_aware_chain(head: NoiseAwareTransformation, tail: Any) -> NoiseAwareTransformation:
    """``head`` (noise-aware) followed by ``tail`` (a torchopt ``GradientTransformation``); the state is the
    pair ``(head_state, tail_state)``."""

    def init_fn(params):
        return head.init(params), tail.init(params)

    def update_fn(updates, state, *, params=None, noise_std):
        updates, head_state = head.update(updates, state[0], params=params, noise_std=noise_std)
        updates, tail_state = tail.update(updates, state[1], params=params, inplace=False)
        return updates, (head_state, tail_state)

    return NoiseAwareTransformation(init_fn, update_fn)
