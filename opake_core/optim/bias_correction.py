"""Second moments with the Gaussian noise variance removed (DP bias correction).

Tang, Panda, Shi, Lécuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply Bias Correction)",
AAAI 2024, arXiv:2312.14334. For a noised gradient ``g = s + z`` with ``z ~ N(0, sigma^2 I)`` independent of
the signal ``s``, ``E[g^2] = E[s^2] + sigma^2``: a second moment built from ``g^2`` estimates the signal's second
moment plus the noise variance, so with DP noise the denominator is dominated by ``sigma`` and the adaptive optimizer
degenerates into SGD with a rescaled learning rate. The correction keeps the same average of the known ``sigma^2``
(``phi``, a scalar per leaf, in the optimizer state, so a changing or per-group ``sigma`` is handled exactly) and
subtracts it.

Notation (per leaf, elementwise; ``t`` counts updates from 1; ``sigma_t`` is the leaf's noise std at step ``t``,
in the units of the gradient):

==========================  ==========================================================================
Adam, AdamW, StableAdamW,   ``v_t = b2 v + (1 - b2) g_t^2``, ``phi_t = b2 phi + (1 - b2) sigma_t^2``;
RAdam, AdEMAMix             ``v_hat = v_t / (1 - b2^t)``, ``phi_hat = phi_t / (1 - b2^t)`` (the pair compared)
RMSprop                     ``v_t = alpha v + (1 - alpha) g_t^2``, ``phi_t = alpha phi + (1 - alpha) sigma_t^2``
                            (neither divided by ``1 - alpha^t``: RMSprop's ``v`` is not bias-corrected, and
                            ``E[v_t] = (1 - alpha^t) (E[s^2] + sigma^2)`` when sigma is constant)
Adagrad                     ``s_t = s + g_t^2``, ``Phi_t = Phi + sigma_t^2`` (the sum grows by ``sigma^2`` each
                            update, so without the correction the step shrinks like ``1 / (sigma sqrt(t))``)
the rule                    ``D = V - P`` where ``V - P > 0``, else ``D = V`` (``V, P`` the pair above)
==========================  ==========================================================================

``D`` replaces the second moment in the optimizer's denominator ``sqrt(D) + eps``.

Why the rule, and not the paper's floor ``max(V - P, gamma)``: where the noise dominates a coordinate, ``V - P`` is
near zero or negative. A constant floor (``gamma = 1e-8``) then turns the denominator into ``sqrt(gamma) = 1e-4``
and the step into ``lr * m_hat / 1e-4``, ten thousand times the first moment: on the noisy quadratic of
``docs/optimizers.md`` (``lr = 0.05``) AdamW with that floor ends 41 to 66 from the optimum, plain AdamW about 0.5.
Falling back to the uncorrected ``V`` there keeps the plain optimizer's step (at most a few ``lr`` per coordinate for
Adam) wherever the correction cannot say how much of ``V`` is signal; where the signal is visible above the noise,
the corrected ``V - P`` is used and the step is larger than the plain one. The correction only ever shrinks the
denominator, and with ``sigma = 0`` every optimizer here is its uncorrected version bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation
from torchopt.transform.utils import inc_count, update_moment

from opake_core.optim._guard import NoiseAwareTransformation

__all__ = [
    "BiasCorrectedAdagradState",
    "BiasCorrectedAdamState",
    "BiasCorrectedRMSpropState",
    "NoiseVarianceState",
    "noise_aware_chain",
    "noise_ema",
    "scale_by_bias_corrected_adagrad",
    "scale_by_bias_corrected_adam",
    "scale_by_bias_corrected_rms",
    "with_noise_variance",
    "without_noise",
    "zero_noise",
]


def without_noise(second: torch.Tensor, noise: float) -> torch.Tensor:
    """``second - noise`` where positive, else ``second`` (the rule of the module docstring).

    ``second``: a second-moment tensor (gradient units squared); ``noise``: the matching average of ``sigma^2``.
    With ``noise = 0`` the result equals ``second`` bit for bit.
    """
    corrected = second.sub(noise)
    return torch.where(corrected > 0, corrected, second)


class NoiseVarianceState(NamedTuple):
    """State of an optimizer whose own state is unchanged by the correction (RAdam, AdEMAMix).

    Attributes:
        inner: the optimizer's own state.
        phi: per-leaf EMA of the noise variance, un-normalized like the optimizer's ``v`` (0-d float64 CPU tensors).
    """

    inner: Any
    phi: Any


def noise_ema(phi: Any, noise_std: Any, decay: float) -> Any:
    """Per leaf ``decay * phi + (1 - decay) * sigma^2`` (0-d float64 CPU tensors: sigma is known on the host)."""
    return optree.tree_map(lambda f, s: f * decay + (1 - decay) * float(s) ** 2, phi, noise_std)


def with_noise_variance(init: Any, step: Any, decay: float, *, correct: bool) -> Any:
    """An optimizer whose state stays its own under the correction (RAdam, AdEMAMix), as a transformation.

    ``init(params) -> state`` and ``step(updates, state, phi) -> (out, state)`` with ``phi`` the per-leaf noise
    variance average (a list, or None uncorrected). With ``correct`` a :class:`NoiseAwareTransformation` whose state
    is ``NoiseVarianceState(state, phi)``, ``phi`` averaged with ``decay``; else a plain ``GradientTransformation``.
    """
    if not correct:

        def update_fn(updates, state, *, params=None, inplace=False):
            return step(updates, state, None)

        return GradientTransformation(init, update_fn)

    def corrected_init(params: Any) -> NoiseVarianceState:
        return NoiseVarianceState(inner=init(params), phi=zero_noise(params))

    def corrected_fn(updates, state, *, params=None, noise_std, inplace=False):
        phi = noise_ema(state.phi, noise_std, decay)
        out, inner = step(updates, state.inner, optree.tree_leaves(phi))
        return out, NoiseVarianceState(inner=inner, phi=phi)

    return NoiseAwareTransformation(corrected_init, corrected_fn)


def zero_noise(params: Any) -> Any:
    """A zero ``phi`` per leaf of ``params`` (0-d float64 CPU tensors)."""
    return optree.tree_map(lambda p: torch.zeros((), dtype=torch.float64), params)


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

    Its ``update(updates, state, *, params=None, noise_std, inplace=False)`` takes ``noise_std``, a tree like
    ``updates`` of floats (each leaf's noise standard deviation); it always computes out of place. Arguments are
    validated by the calling factory.
    """

    def init_fn(params):
        return BiasCorrectedAdamState(
            mu=optree.tree_map(torch.zeros_like, params),
            nu=optree.tree_map(torch.zeros_like, params),
            count=optree.tree_map(lambda p: torch.zeros((), dtype=torch.int64, device=p.device), params),
            phi=zero_noise(params),
        )

    def update_fn(updates, state, *, params=None, noise_std, inplace=False):
        mu = update_moment(updates, state.mu, b1, order=1, inplace=False)
        nu = update_moment(updates, state.nu, b2, order=2, inplace=False)
        count = inc_count(updates, state.count)
        phi = noise_ema(state.phi, noise_std, b2)

        def scale(m, v, c, f):
            # The operations of torchopt's scale_by_adam, so that phi = 0 reproduces it bit for bit. Subtracting
            # phi before the bias correction shares one correction factor, (v - phi) / (1 - b2^t) = v_hat - phi_hat,
            # and avoids cancellation error between two separately rounded factors.
            m_hat = m.div(1 - pow(b1, c))
            v_hat = without_noise(v, float(f)).div(1 - pow(b2, c))
            return m_hat.div(v_hat.sqrt().add(eps))

        updates = optree.tree_map(scale, mu, nu, count, phi)
        return updates, BiasCorrectedAdamState(mu=mu, nu=nu, count=count, phi=phi)

    return NoiseAwareTransformation(init_fn, update_fn)


class BiasCorrectedRMSpropState(NamedTuple):
    """State of :func:`scale_by_bias_corrected_rms`.

    Attributes:
        nu: the EMA ``v`` of the squared gradients, a tree like the parameters.
        phi: per-leaf EMA of the noise variance (0-d float64 CPU tensors).
    """

    nu: Any
    phi: Any


def scale_by_bias_corrected_rms(alpha: float, eps: float) -> NoiseAwareTransformation:
    """RMSprop's rescaling ``g / (sqrt(v) + eps)`` with the noise variance removed from ``v`` (not centered).

    Takes ``noise_std`` like :func:`scale_by_bias_corrected_adam`; with ``sigma = 0`` it equals
    :func:`opake_core.optim.rmsprop.scale_by_rms` (``centered=False``) bit for bit.
    """

    def init_fn(params):
        return BiasCorrectedRMSpropState(nu=optree.tree_map(torch.zeros_like, params), phi=zero_noise(params))

    def update_fn(updates, state, *, params=None, noise_std, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), alpha)
        torch._foreach_addcmul_(nu, g, g, value=1 - alpha)
        phi = noise_ema(state.phi, noise_std, alpha)
        phis = optree.tree_leaves(phi)
        out = [x.div(without_noise(v, float(f)).sqrt().add(eps)) for x, v, f in zip(g, nu, phis, strict=True)]
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), BiasCorrectedRMSpropState(nu=unflatten(nu), phi=phi)

    return NoiseAwareTransformation(init_fn, update_fn)


class BiasCorrectedAdagradState(NamedTuple):
    """State of :func:`scale_by_bias_corrected_adagrad`.

    Attributes:
        sum: the accumulated squared gradients ``s``, a tree like the parameters.
        count: number of updates applied so far (0-d int64 tensor on the CPU).
        phi: per-leaf sum ``Phi`` of the noise variances so far (0-d float64 CPU tensors).
    """

    sum: Any
    count: torch.Tensor
    phi: Any


def scale_by_bias_corrected_adagrad(
    eps: float, lr_decay: float, initial_accumulator_value: float
) -> NoiseAwareTransformation:
    """Adagrad's rescaling ``g / (sqrt(s) + eps) / (1 + (t - 1) lr_decay)`` with the summed noise variance removed
    from ``s``. Takes ``noise_std`` like :func:`scale_by_bias_corrected_adam`; with ``sigma = 0`` it equals
    :func:`opake_core.optim.adagrad.scale_by_adagrad` bit for bit."""

    def init_fn(params):
        return BiasCorrectedAdagradState(
            sum=optree.tree_map(lambda p: torch.full_like(p, initial_accumulator_value), params),
            count=torch.zeros((), dtype=torch.int64),
            phi=zero_noise(params),
        )

    def update_fn(updates, state, *, params=None, noise_std, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        count = state.count + 1
        total = torch._foreach_addcmul(optree.tree_leaves(state.sum), g, g)
        phi = optree.tree_map(lambda f, s: f + float(s) ** 2, state.phi, noise_std)
        phis = optree.tree_leaves(phi)
        out = [x.div(without_noise(s, float(f)).sqrt().add(eps)) for x, s, f in zip(g, total, phis, strict=True)]
        if lr_decay:
            torch._foreach_div_(out, 1 + (int(count) - 1) * lr_decay)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), BiasCorrectedAdagradState(sum=unflatten(total), count=count, phi=phi)

    return NoiseAwareTransformation(init_fn, update_fn)


def noise_aware_chain(*transforms: Any) -> NoiseAwareTransformation:
    """The transforms in order; ``noise_std`` goes to the :class:`NoiseAwareTransformation` ones, the others are
    torchopt ``GradientTransformation`` s (run out of place). The state is the tuple of their states."""

    def init_fn(params):
        return tuple(t.init(params) for t in transforms)

    def update_fn(updates, state, *, params=None, noise_std, inplace=False):
        states = []
        for transform, part in zip(transforms, state, strict=True):
            if isinstance(transform, NoiseAwareTransformation):
                updates, part = transform.update(updates, part, params=params, noise_std=noise_std)
            else:
                updates, part = transform.update(updates, part, params=params, inplace=False)
            states.append(part)
        return updates, tuple(states)

    return NoiseAwareTransformation(init_fn, update_fn)
