"""Schedule-Free AdamW (Defazio, Yang, Mehta, Mishchenko, Khaled, Cutkosky 2024, "The Road Less Scheduled",
NeurIPS, arXiv:2405.15682, Algorithm 1, with the weighting of the authors' implementation).

Three sequences per parameter: ``z``, the base AdamW iterate; ``x``, a weighted average of the ``z``'s, which
is the model to evaluate and publish; and ``y = (1 - b1) z + b1 x``, where the gradients are taken. The
parameters an optimizer step trains are ``y``; the state holds ``z`` and the second moment, and ``x`` is recovered
from the two as ``x = z + (y - z) / b1`` by :meth:`Optimizer.eval_params <opake_core.optim.Optimizer.eval_params>`.

At update ``t`` (from 1), with gradient ``g`` taken at ``y_t`` and ``v = 0``, ``z_1 = x_1 = y_1`` at init:

==========================  ========================================================================
``gamma_t``                 ``lr(t - 1) * min(1, t / warmup_steps)`` (``lr(t - 1)``: the schedule, or ``lr``)
``v``                       ``b2 * v + (1 - b2) * g^2``
``d``                       ``g / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * y_t`` (decay taken at ``y``)
``z_{t+1}``                 ``z_t - gamma_t * d``
``w_t``                     ``t^r * (max_{i <= t} gamma_i)^weight_lr_power``
``c_{t+1}``                 ``w_t / sum_{i <= t} w_i`` (0 while the sum is 0)
``x_{t+1}``                 ``(1 - c_{t+1}) x_t + c_{t+1} z_{t+1}``
``y_{t+1}``                 ``(1 - b1) z_{t+1} + b1 x_{t+1}``, computed from ``y_t`` and ``z_t`` as
                            ``y_t + c_{t+1} (z_t - y_t) + gamma_t (b1 (1 - c_{t+1}) - 1) d``
==========================  ========================================================================

With ``r = 0``, ``weight_lr_power = 2`` and a non-decreasing learning rate, ``c_{t+1} = gamma_t^2 / sum_i
gamma_i^2``, the paper's weighting. The paper's algorithm box folds Adam's bias correction into the learning rate
(``gamma_t * sqrt(1 - b2^t)``, also in the weights) where the authors' implementation, followed here (and by
Hugging Face's ``schedule_free_adamw``), divides ``v`` by it; the two are the same update when ``b2 = 0``.

:func:`schedule_free` wraps any other optimizer of this package in the same three sequences (its own section below).

No learning-rate decay is needed: the averaging plays its part. The warm-up is a factor on ``lr`` exactly like a
linear warm-up schedule. Under DP, ``x`` is a weighted average of the noisy iterates ``z``: post-processing, so it
costs no privacy, and the average damps the noise in the published weights. The second moment absorbs the noise
variance as Adam's does (no correction here).

**Around any optimizer** (:func:`schedule_free`, the paper's general form, Section 2): the base optimizer's update
``u_t`` (its learning rate included), computed from the gradient at ``y_t`` with the base's ``params = z_t`` (so its
weight decay applies to ``z``), moves ``z``; the average uses uniform weights after a warm-up of ``W`` updates during
which ``x`` follows ``z``:

==========================  ========================================================================
``z_{t+1}``                 ``z_t + u_t``
``c_{t+1}``                 ``1`` for ``t <= W``, else ``1 / (t - W + 1)`` (``x`` averages ``z_{W+1} ..``)
``x_{t+1}``                 ``(1 - c_{t+1}) x_t + c_{t+1} z_{t+1}``
``y_{t+1}``                 ``(1 - b) z_{t+1} + b x_{t+1}``, computed as ``y_t + c_{t+1} (z_t - y_t) +
                            (1 - b + b c_{t+1}) u_t``
==========================  ========================================================================

The base optimizer keeps its own state (moments, noise-variance correction, learning-rate schedule) and sees only
the noised gradients, so the wrapper, like the average, is post-processing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation

from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.optim._checks import betas as check_betas
from opake_core.optim._guard import NoiseAwareTransformation, Optimizer
from opake_core.optim._lr import LearningRate, check_lr, lr_at

__all__ = [
    "ScheduleFreeState",
    "ScheduleFreeWrapState",
    "scale_by_schedule_free_adamw",
    "schedule_free",
    "schedule_free_adamw",
]


class ScheduleFreeState(NamedTuple):
    """State of :func:`scale_by_schedule_free_adamw`.

    Attributes:
        z: the base iterate ``z``, a tree like the parameters (which hold ``y``).
        nu: the second moment ``v``, a tree like the parameters.
        count: number of updates applied so far (0-d int64 tensor on the CPU).
        weight_sum: ``sum_{i <= t} w_i``, the averaging weights so far (0-d float64 tensor on the CPU).
        lr_max: the largest learning rate ``gamma_i`` so far (0-d float64 tensor on the CPU).
    """

    z: Any
    nu: Any
    count: torch.Tensor
    weight_sum: torch.Tensor
    lr_max: torch.Tensor


def scale_by_schedule_free_adamw(
    lr: LearningRate,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    *,
    warmup_steps: int,
    r: float,
    weight_lr_power: float,
) -> GradientTransformation:
    """The update ``y_{t+1} - y_t`` of the module docstring (the learning rate included); ``update`` needs
    ``params`` (``y_t``). Arguments are validated by :func:`schedule_free_adamw`."""

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        scalar = lambda: torch.zeros((), dtype=torch.float64)  # noqa: E731
        return ScheduleFreeState(
            z=optree.tree_unflatten(treedef, [p.clone() for p in leaves]),
            nu=optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves]),
            count=torch.zeros((), dtype=torch.int64),
            weight_sum=scalar(),
            lr_max=scalar(),
        )

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = optree.tree_flatten(updates)
        y, z = optree.tree_leaves(params), optree.tree_leaves(state.z)
        k = int(state.count)  # updates already applied; this is update t = k + 1
        t = k + 1
        gamma = lr_at(lr, k) * (min(1.0, t / warmup_steps) if warmup_steps else 1.0)
        lr_max = max(float(state.lr_max), gamma)
        weight = t**r * lr_max**weight_lr_power
        weight_sum = float(state.weight_sum) + weight
        c = weight / weight_sum if weight_sum > 0 else 0.0
        nu = torch._foreach_mul(optree.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        denominator = torch._foreach_div(nu, 1 - b2**t)
        torch._foreach_sqrt_(denominator)
        torch._foreach_add_(denominator, eps)
        d = torch._foreach_div(g, denominator)
        if weight_decay:
            torch._foreach_add_(d, y, alpha=weight_decay)
        out = torch._foreach_sub(z, y)
        torch._foreach_mul_(out, c)
        torch._foreach_add_(out, d, alpha=gamma * (b1 * (1 - c) - 1))
        new_z = torch._foreach_add(z, d, alpha=-gamma)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        new_state = ScheduleFreeState(
            z=unflatten(new_z),
            nu=unflatten(nu),
            count=state.count + 1,
            weight_sum=torch.tensor(weight_sum, dtype=torch.float64),
            lr_max=torch.tensor(lr_max, dtype=torch.float64),
        )
        return unflatten(out), new_state

    return GradientTransformation(init_fn, update_fn)


def schedule_free_adamw(
    lr: LearningRate = 0.0025,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
    non_private: bool = False,
) -> Optimizer:
    """Schedule-Free AdamW: the parameters it trains are ``y``; evaluate and publish
    ``optimizer.eval_params(state, params)``, the averaged iterate ``x`` (see the module docstring).

    ``update`` always needs ``params``. Defaults are the authors' implementation's.

    Args:
        lr: learning rate (> 0) or a schedule ``step -> lr``; a constant is the intended use (the averaging
            replaces the decay).
        betas: ``(b1, b2)``: ``b1`` in (0, 1) is the interpolation ``y = (1 - b1) z + b1 x`` (it plays the part
            of Adam's momentum; ``x`` is recovered from ``y`` and ``z`` by dividing by it, so it cannot be 0),
            ``b2`` in [0, 1) the decay of the second moment.
        eps: added to ``sqrt(v_hat)`` in the denominator (> 0), in gradient units.
        weight_decay: decay coefficient (>= 0), taken at ``y`` and multiplied by the learning rate.
        warmup_steps: linear warm-up of the learning rate over this many updates (int >= 0; 0: none):
            ``gamma_t = lr * min(1, t / warmup_steps)``.
        r: power of ``t`` in the averaging weights (>= 0; 0 weighs by the learning rate only).
        weight_lr_power: power of the running-maximum learning rate in the averaging weights (>= 0).
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: minimize ``(w - 3)^2``; the averaged iterate, which is what to evaluate, gets close to 3.

        >>> import torch
        >>> from opake_core import optim
        >>> opt, params = optim.schedule_free_adamw(lr=0.5, non_private=True), {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> for _ in range(100):
        ...     updates, state = opt.update({"w": 2 * (params["w"] - 3)}, state, params=params)
        ...     params = optim.apply_updates(params, updates)
        >>> abs(opt.eval_params(state, params)["w"].item() - 3) < 0.1
        True
    """
    lr = check_lr(lr)
    b1, b2 = check_betas(betas, 2)
    if b1 == 0:
        raise ConfigurationError(
            "betas[0] must lie in (0, 1) for schedule_free_adamw, got 0.0: the averaged weights are recovered as "
            "x = z + (y - z) / b1; use b1 > 0 (0.9 is the usual value)."
        )
    eps = validate.positive("eps", eps)
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    warmup_steps = validate.integer("warmup_steps", warmup_steps, minimum=0)
    r = validate.non_negative("r", r)
    weight_lr_power = validate.non_negative("weight_lr_power", weight_lr_power)
    transform = scale_by_schedule_free_adamw(
        lr, b1, b2, eps, weight_decay, warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power
    )
    weight = 1 - 1 / b1

    def averaged(state: ScheduleFreeState, params: Any) -> Any:
        y, treedef = optree.tree_flatten(params)
        return optree.tree_unflatten(treedef, torch._foreach_lerp(y, optree.tree_leaves(state.z), weight))

    return Optimizer("schedule_free_adamw", transform, non_private=non_private, needs_params=True, eval_fn=averaged)


class ScheduleFreeWrapState(NamedTuple):
    """State of :func:`schedule_free`.

    Attributes:
        z: the base iterate ``z``, a tree like the parameters (which hold ``y``).
        base: the base optimizer's state.
        count: number of updates applied so far (0-d int64 tensor on the CPU).
    """

    z: Any
    base: Any
    count: torch.Tensor


def schedule_free(base: Optimizer, *, beta: float = 0.9, warmup_steps: int = 0) -> Optimizer:
    """Schedule-Free around ``base``: the parameters it trains are ``y``; evaluate and publish
    ``optimizer.eval_params(state, params)``, the average ``x`` (the module docstring's last table).

    ``update`` always needs ``params``. A noise-aware ``base`` (``noise_bias_correction=True``) keeps its
    correction; a non-private ``base`` makes the wrapper non-private; a ``base`` that ``needs_whole_leaves``
    (Adafactor, StableAdamW) makes the wrapper need them too.

    Args:
        base: an optimizer of this package (its learning rate, schedule and weight decay are its own); not a
            schedule-free one, and not :func:`~opake_core.optim.private_moments_adam` (another input type).
        beta: the interpolation ``y = (1 - beta) z + beta x`` in (0, 1] (``x`` is recovered from ``y`` and ``z`` by
            dividing by it, so it cannot be 0).
        warmup_steps: updates (int >= 0) during which ``x`` follows ``z``; the uniform average starts after them.

    Example: momentum SGD on ``(w - 3)^2``; the average, which is what to evaluate, gets close to 3.

        >>> import torch
        >>> from opake_core import optim
        >>> opt = optim.schedule_free(optim.momentum(0.05, 0.5, non_private=True), warmup_steps=10)
        >>> params = {"w": torch.zeros(1)}
        >>> state = opt.init(params)
        >>> for _ in range(200):
        ...     updates, state = opt.update({"w": 2 * (params["w"] - 3)}, state, params=params)
        ...     params = optim.apply_updates(params, updates)
        >>> opt.name, abs(opt.eval_params(state, params)["w"].item() - 3) < 0.05
        ('schedule_free_momentum', True)
    """
    if not isinstance(base, Optimizer):
        raise ConfigurationError(
            f"schedule_free wraps an optimizer of opake_core.optim (an Optimizer), got {type(base).__name__}: the "
            "moments optimizer takes another input type; build the base with one of the optim factories."
        )
    if base.eval_fn is not None:
        raise ConfigurationError(
            f"schedule_free cannot wrap {base.name}, whose trained parameters are not its published weights "
            "(it is schedule-free already); wrap its base optimizer instead."
        )
    beta = validate.in_range("beta", beta, 0.0, 1.0, low_open=True, high_open=False)
    warmup_steps = validate.integer("warmup_steps", warmup_steps, minimum=0)

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params)
        z = optree.tree_unflatten(treedef, [p.clone() for p in leaves])
        return ScheduleFreeWrapState(z=z, base=base.transform.init(params), count=torch.zeros((), dtype=torch.int64))

    def step(updates, state, params, noise_std):
        if base.noise_aware:
            u, base_state = base.transform.update(updates, state.base, params=state.z, noise_std=noise_std)
        else:
            u, base_state = base.transform.update(updates, state.base, params=state.z, inplace=False)
        t = int(state.count) + 1
        c = 1.0 if t <= warmup_steps else 1.0 / (t - warmup_steps + 1)
        u, treedef = optree.tree_flatten(u)
        y, z = optree.tree_leaves(params), optree.tree_leaves(state.z)
        out = torch._foreach_sub(z, y)
        torch._foreach_mul_(out, c)
        torch._foreach_add_(out, u, alpha=1 - beta + beta * c)
        new_z = torch._foreach_add(z, u)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), ScheduleFreeWrapState(z=unflatten(new_z), base=base_state, count=state.count + 1)

    if base.noise_aware:

        def noise_aware_fn(updates, state, *, params=None, noise_std, inplace=False):
            return step(updates, state, params, noise_std)

        transform = NoiseAwareTransformation(init_fn, noise_aware_fn)
    else:

        def update_fn(updates, state, *, params=None, inplace=False):
            return step(updates, state, params, None)

        transform = GradientTransformation(init_fn, update_fn)
    weight = 1 - 1 / beta

    def averaged(state: ScheduleFreeWrapState, params: Any) -> Any:
        y, treedef = optree.tree_flatten(params)
        return optree.tree_unflatten(treedef, torch._foreach_lerp(y, optree.tree_leaves(state.z), weight))

    return Optimizer(
        f"schedule_free_{base.name}",
        transform,
        non_private=base.non_private,
        needs_params=True,
        noise_aware=base.noise_aware,
        eval_fn=averaged,
        needs_whole_leaves=base.needs_whole_leaves,
    )
