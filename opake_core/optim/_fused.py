"""Adam's update applied to the parameters by torch's fused kernel (``torch._fused_adamw_``): the moments, the bias
corrections, the decoupled weight decay and the step in one pass over each tensor, for a donated step
(:meth:`~opake_core.optim.Optimizer.apply_in_place`).

The multi-tensor path (:mod:`opake_core.optim._foreach`) makes about a dozen passes over the model-sized tensors
and writes the updates before they are added; the fused kernel reads the gradient, the moments and the parameter
once and writes the three back: the arithmetic of ``torch.optim.AdamW(fused=True)``, the same update up to float
rounding (the weight decay is applied to the parameter before the step, ``p (1 - lr wd) - lr m_hat / (sqrt(v_hat) +
eps)``, where the multi-tensor path forms ``-lr (m_hat / (sqrt(v_hat) + eps) + wd p)`` and adds it). It runs on
:data:`FUSED_DEVICES` only, where the training runs whose update costs time run (the 1.1B Llama's multi-tensor update
took 42.5 ms a step on an H100, torch's fused AdamW 12.6 ms); on a CPU the donated step keeps the bits of the
out-of-place step, which CPU tests and reproductions compare with (there the fused kernel is also faster: about 9 ms
against 48 ms for 2^24 parameters on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from opake_core.optim._foreach import AdamState
from opake_core.optim._lr import LearningRate, LearningRateState, lr_at

__all__ = ["FUSED_DEVICES", "fused_adam_apply"]

FUSED_DEVICES = ("cuda",)
"""The device types on which a donated Adam or AdamW step takes the fused kernel."""


def fused_adam_apply(
    b1: float, b2: float, eps: float, weight_decay: float, lr: LearningRate
) -> Callable[[list[torch.Tensor], Any, list[torch.Tensor]], Any]:
    """``apply(grads, state, params) -> new state``, or None where the kernel does not apply: the state of
    ``chain(scale_by_adam, add_decayed_weights, scale_by_neg_lr)``, the moments and the parameters written in place.

    It applies where every parameter lives on one device of :data:`FUSED_DEVICES` and each leaf's gradient, moments
    and parameter share one floating dtype (one launch per dtype); anywhere else it writes nothing and returns None.
    """

    def apply(grads: list[torch.Tensor], state: Any, params: list[torch.Tensor]) -> Any:
        adam, decay, schedule = state
        mu, nu = optree.tree_leaves(adam.mu), optree.tree_leaves(adam.nu)
        device = params[0].device if params else None
        if device is None or device.type not in FUSED_DEVICES or not hasattr(torch, "_fused_adamw_"):
            return None
        for g, m, v, p in zip(grads, mu, nu, params, strict=True):
            if not p.is_floating_point() or any(t.device != device or t.dtype != p.dtype for t in (g, m, v, p)):
                return None
        count = adam.count + 1
        step = torch.full((), float(count), dtype=torch.float32, device=device)  # the kernel reads it per leaf
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        with torch.no_grad():
            for group in by_dtype.values():
                torch._fused_adamw_(
                    [params[i] for i in group], [grads[i] for i in group], [mu[i] for i in group],
                    [nu[i] for i in group], [], [step] * len(group),
                    lr=lr_at(lr, int(schedule.count)), beta1=b1, beta2=b2, weight_decay=weight_decay, eps=eps,
                    amsgrad=False, maximize=False,
                )  # fmt: skip
        return AdamState(adam.mu, adam.nu, count), decay, LearningRateState(schedule.count + 1)

    return apply
