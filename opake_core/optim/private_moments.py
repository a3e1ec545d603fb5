"""Adam whose second moment comes from a private stream, not from the square of the noised gradient.

The input is a :class:`~opake_core.moments.NoisedMoments` pair ``(g~, s~)``: the noised gradient and a noised
estimate of its element-wise second moment, released together as one Gaussian mechanism. Two producers:

* ``clipped_grad(..., second_moment=True)`` then ``gaussian_noise`` / ``paired_mf_gaussian_noise``: ``s~`` estimates
  ``(1/n) sum_i c_i ⊙ c_i``, the mean of the examples' squared clipped gradients (:mod:`opake_core.moments`). Note
  the scale: that is the per-example second moment, larger than the square of the batch-mean gradient by the
  examples' variance, so the steps are smaller than plain Adam's at the same learning rate where examples disagree.
* :func:`opake_core.jme.jme_noise` (projected JME, Kalinin et al., arXiv 2502.06597): ``s~`` estimates ``x ⊙ x``, the
  square of the projected mean gradient, the quantity Adam's ``v`` averages without noise.

Notation (per leaf, element-wise; ``t`` counts updates from 1):

====================  ==============================================================================
``m_t``               ``b1 * m_{t-1} + (1 - b1) * g~_t``
``v_t``               ``b2 * v_{t-1} + (1 - b2) * s~_t``
``m_hat, v_hat``      ``m_t / (1 - b1^t)``, ``v_t / (1 - b2^t)``
``d_t``               ``v_hat`` where ``v_hat > 0``, else ``m_hat^2``
``update``            ``-lr * (m_hat / (sqrt(d_t) + eps) + weight_decay * p)``
====================  ==============================================================================

``s~`` carries zero-mean noise, so ``v_hat`` is an unbiased estimate of the averaged second moment and needs no
noise-variance correction: combining these streams with DP-AdamBC (``noise_bias_correction=True``,
:mod:`opake_core.optim.bias_correction`) would subtract a variance that is not there, and is refused by
:func:`opake_core.step.dp_step`. Where the noise makes ``v_hat`` non-positive (the signal is below the noise), the
private estimate says nothing and the denominator falls back to ``m_hat^2``, the second moment of the current first
moment (so the update there is ``m_hat / (|m_hat| + eps)``, bounded by 1 in magnitude). Weight decay is decoupled
(AdamW), so it does not enter ``v``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch
from torch.profiler import record_function
from torchopt import chain

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.moments import ClippedMoments, NoisedMoments
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.tree import Clipped, Noised

__all__ = ["MomentsAdamState", "MomentsOptimizer", "private_moments_adam"]


class MomentsAdamState(NamedTuple):
    """State of :func:`private_moments_adam`'s rescaling.

    Attributes:
        mu: first moments ``m``, a tree like the parameters.
        nu: second moments ``v`` (from the private stream), a tree like the parameters.
        count: the number of updates, a 0-d int64 CPU tensor.
    """

    mu: Any
    nu: Any
    count: torch.Tensor


@dataclass(frozen=True)
class MomentsOptimizer:
    """A functional optimizer that takes a :class:`~opake_core.moments.NoisedMoments` pair.

    ``init(params) -> state``; ``update(moments, state, *, params=None) -> (updates, new_state)``; apply the updates
    with :func:`opake_core.optim.apply_updates`. It refuses a single :class:`~opake_core.tree.Noised` tree (there is
    no private second moment in it), anything clipped but not noised, and plain trees.

    Attributes:
        name: used in messages and in the profiler label ``opake::optim.<name>``.
        b1, b2, eps: Adam's constants.
        tail: the torchopt transformation after the rescaling (decoupled weight decay and ``-lr``).
        needs_params: ``update`` needs ``params`` (weight decay).
    """

    name: str
    b1: float
    b2: float
    eps: float
    tail: Any
    needs_params: bool = False
    takes_moments: bool = True
    noise_aware: bool = False

    def init(self, params: Any) -> tuple[MomentsAdamState, Any]:
        """Zero moments shaped like ``params`` and the tail's state."""
        with record_function(f"opake::optim.{self.name}.init"):
            leaves, treedef = optree.tree_flatten(params)
            zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])  # noqa: E731
            return MomentsAdamState(zeros(), zeros(), torch.zeros((), dtype=torch.int64)), self.tail.init(params)

    def update(self, updates: Any, state: Any, *, params: Any = None) -> tuple[Any, Any]:
        """Parameter updates from a noised pair (module docstring); nothing is modified in place.

        Raises:
            InputTypeError: anything but a ``NoisedMoments`` (the message names the producer to use).
            ConfigurationError: ``params`` missing with weight decay; streams whose trees differ.
        """
        with record_function(f"opake::optim.{self.name}"):
            first, second = self._unwrap(updates)
            if self.needs_params and params is None:
                raise ConfigurationError(
                    f"{self.name}.update needs params (weight decay); call update(moments, state, params=params)."
                )
            g, treedef = optree.tree_flatten(first)
            s, second_treedef = optree.tree_flatten(second)
            if second_treedef != treedef:
                raise ConfigurationError(
                    f"the two streams have different trees ({treedef} and {second_treedef}); release them from one "
                    "clipped sum."
                )
            moments, tail_state = state
            b1, b2 = self.b1, self.b2
            mu = torch._foreach_mul(optree.tree_leaves(moments.mu), b1)
            torch._foreach_add_(mu, g, alpha=1 - b1)
            nu = torch._foreach_mul(optree.tree_leaves(moments.nu), b2)
            torch._foreach_add_(nu, s, alpha=1 - b2)
            count = moments.count + 1
            m_hat = torch._foreach_div(mu, float(1 - pow(b1, int(count))))
            v_hat = torch._foreach_div(nu, float(1 - pow(b2, int(count))))
            denominators = [
                torch.where(v > 0, v, m * m).clamp(min=0).sqrt().add(self.eps)
                for m, v in zip(m_hat, v_hat, strict=True)
            ]
            direction = optree.tree_unflatten(treedef, torch._foreach_div(m_hat, denominators))
            out, tail_state = self.tail.update(direction, tail_state, params=params, inplace=False)
            unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
            return out, (MomentsAdamState(unflatten(mu), unflatten(nu), count), tail_state)

    def eval_params(self, state: Any, params: Any) -> Any:
        """The weights to evaluate and publish: the trained ``params`` themselves."""
        return params

    def _unwrap(self, updates: Any) -> tuple[Any, Any]:
        if isinstance(updates, NoisedMoments):
            return updates.first.value, updates.second.value
        if isinstance(updates, ClippedMoments) or (isinstance(updates, Clipped) and not isinstance(updates, Noised)):
            raise InputTypeError(
                f"{self.name}.update received a clipped {type(updates).__name__} that was not noised: pass it "
                "through opake_core.noise.gaussian_noise (or paired_mf_gaussian_noise) first; use noise_multiplier=0 "
                "for an explicitly non-private run."
            )
        if isinstance(updates, Noised):
            raise InputTypeError(
                f"{self.name}.update received a single Noised tree, which has no private second moment: clip with "
                "clipped_grad(..., second_moment=True) and noise with gaussian_noise, or noise with "
                "opake_core.jme.jme_noise; or use opake_core.optim.adam for a single stream."
            )
        raise InputTypeError(
            f"{self.name}.update received a plain {type(updates).__name__}, not a NoisedMoments pair: clip with "
            "clipped_grad(..., second_moment=True) and noise with gaussian_noise (noise_multiplier=0 for an "
            "explicitly non-private run)."
        )


def private_moments_adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> MomentsOptimizer:
    """Adam (AdamW with ``weight_decay > 0``) with its second moment from the private stream (module docstring).

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``.
        betas: ``(b1, b2)``, decay rates of the first and second moment EMAs, each in [0, 1).
        eps: added to ``sqrt(d_t)`` in the denominator (> 0), in gradient units.
        weight_decay: decoupled decay coefficient (>= 0), multiplied by ``lr`` like ``torch.optim.AdamW``.

    Returns:
        A :class:`MomentsOptimizer`; it takes the :class:`~opake_core.moments.NoisedMoments` of
        ``gaussian_noise`` on ``clipped_grad(..., second_moment=True)``, of ``paired_mf_gaussian_noise``, or of
        ``jme_noise``. There is no noise-variance bias correction: see the module docstring.

    Example: a DP-SGD step that releases the second moment too; with the noise off and one example per batch, the
    private second moment is the squared gradient, so the step is exactly AdamW's.

        >>> import torch
        >>> from opake_core import dp_step, gaussian_noise, optim, random
        >>> loss_fn, x = (lambda w, x: x @ w), torch.tensor([[0.3, -0.4]])
        >>> step_fn, dp_state = dp_step(loss_fn, clipping=1.0, noise=gaussian_noise(noise_multiplier=0.0,
        ...                             key=random.key(0)), optimizer=optim.private_moments_adam(lr=0.1),
        ...                             expected_batch_size=1.0, second_moment=True)
        >>> w = torch.zeros(2)
        >>> w1, _, _, _ = step_fn(w, optim.private_moments_adam(lr=0.1).init(w), dp_state, (x,))
        >>> adamw = optim.adamw(lr=0.1, non_private=True)
        >>> updates, _ = adamw.update(x[0], adamw.init(w), params=w)
        >>> torch.allclose(w1, w + updates)
        True
    """
    lr = check_lr(lr)
    b1, b2 = check_betas(betas, 2)
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    tail = chain(add_decayed_weights(weight_decay), scale_by_neg_lr(lr))
    return MomentsOptimizer("private_moments_adam", b1, b2, eps, tail, needs_params=weight_decay > 0)
