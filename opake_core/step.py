"""Composed DP step functions.

DP-SGD (Abadi et al. 2016, Algorithm 1), one logical step on a sampled batch:

    per-example gradients -> clip to C -> sum / expected batch size -> Gaussian noise -> optimizer update

The batch is sampled outside the step (see :mod:`opake_core.sampling`), so that the sampler and the accountant can be
chosen together; the clipped sum is divided by the *expected* batch size, never the realized one, so an empty batch
is a valid step that releases pure noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree.dataclasses
import torch

from opake_core import random
from opake_core.clipping import FixedClipState, clipped_grad
from opake_core.errors import InputTypeError
from opake_core.noise import add_gaussian_noise, compute_dtype_of
from opake_core.optim import apply_updates
from opake_core.tree import NAMESPACE, PerGroup

__all__ = ["DPSGDState", "StepMetrics", "dp_sgd"]


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class DPSGDState:
    """State of a composed DP-SGD step: steps taken so far and the clipping state."""

    step: int = optree.dataclasses.field(pytree_node=False)
    clip: FixedClipState


@dataclass(frozen=True)
class StepMetrics:
    """What one step reports.

    ``noise_std`` and ``step`` are public. ``batch_size``, ``loss`` (mean per-example loss, a tensor) and ``clip_rate``
    (a tensor) are exact statistics of the private batch: **outside the privacy guarantee**.
    """

    step: int
    noise_std: float | PerGroup
    batch_size: int
    loss: torch.Tensor
    clip_rate: torch.Tensor


def dp_sgd(
    loss_fn: Callable[..., torch.Tensor],
    *,
    optimizer: Any,
    clipping_norm: float | PerGroup,
    noise_multiplier: float,
    expected_batch_size: float,
    microbatch_size: int | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
) -> tuple[Callable[..., tuple[Any, Any, DPSGDState, StepMetrics]], DPSGDState]:
    """A composed DP-SGD step as ``(step_fn, dp_state)``.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example (see
            :func:`~opake_core.clipping.clipped_grad`).
        optimizer: an :mod:`opake_core.optim` optimizer (``init`` / ``update``).
        clipping_norm: per-example L2 bound (float, ``math.inf`` for none, or PerGroup).
        noise_multiplier: ``z``; the noise std is ``z * clipping_norm / expected_batch_size``. 0 = non-private.
        expected_batch_size: the public expected batch size (sampling rate times dataset size).
        microbatch_size: vmap chunk size (memory only; the result does not depend on it).
        compute_dtype: dtype the noise is drawn and added in.

    Returns:
        ``step_fn(params, opt_state, dp_state, batch, key) -> (params, opt_state, dp_state, metrics)`` where
        ``batch`` is a tuple of per-example tensors ``[B, ...]`` (``loss_fn(params, *batch[i])`` is one example's
        loss) and ``key`` is the run's noise key: the noise of step ``t`` depends only on ``(key, t)``.
    """
    dtype = compute_dtype_of(compute_dtype)
    grad_fn, clip_state = clipped_grad(
        lambda params, batch: loss_fn(params, *batch),
        clipping_norm=clipping_norm,
        normalize_by=expected_batch_size,
        microbatch_size=microbatch_size,
        return_diagnostics=True,
    )

    def step_fn(
        params: Any, opt_state: Any, dp_state: DPSGDState, batch: tuple[torch.Tensor, ...], key: random.Key
    ) -> tuple[Any, Any, DPSGDState, StepMetrics]:
        if not isinstance(dp_state, DPSGDState):
            raise InputTypeError(f"step_fn expects the DPSGDState from dp_sgd, got {type(dp_state).__name__}.")
        if not isinstance(batch, tuple):
            raise InputTypeError(f"batch must be a tuple of per-example tensors, got {type(batch).__name__}.")
        with torch.profiler.record_function("opake::dp_sgd_step"):
            (clipped, diagnostics), clip = grad_fn(params, batch, state=dp_state.clip)
            noised = add_gaussian_noise(
                clipped, noise_multiplier=noise_multiplier, key=key, step=dp_state.step, compute_dtype=dtype
            )
            updates, opt_state = optimizer.update(noised, opt_state, params=params)
            params = apply_updates(params, updates)
        losses = diagnostics.losses
        metrics = StepMetrics(
            step=dp_state.step,
            noise_std=noised.noise_std,
            batch_size=diagnostics.batch_size,
            loss=losses.mean() if losses.numel() else torch.zeros((), device=losses.device),
            clip_rate=diagnostics.clip_rate,
        )
        return params, opt_state, DPSGDState(dp_state.step + 1, clip), metrics

    return step_fn, DPSGDState(0, clip_state)
