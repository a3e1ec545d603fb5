"""Composed DP step functions.

DP-SGD (Abadi et al. 2016, Algorithm 1), one logical step on a sampled batch:

    per-example gradients -> clip to C -> sum / expected batch size -> Gaussian noise -> optimizer update

DP-FTRL (:func:`dp_ftrl`) is the same pipeline with the correlated matrix-factorization noise of
:func:`opake_core.mf.mf_gaussian_noise` over a declared horizon of ``n_steps``; its accounting is
:func:`opake_core.accounting.mf_process` for the whole horizon.

The batch is sampled outside the step (see :mod:`opake_core.sampling`), so that the sampler and the accountant can be
chosen together; the clipped sum is divided by the *expected* batch size, never the realized one, so an empty batch
is a valid step that releases pure noise.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree.dataclasses
import torch

from opake_core import random
from opake_core.clipping import ADAPTIVE_STREAM, AdaptiveClipState, AdaptiveRule, AutoSRule, clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.mf import MFNoiseState, mf_gaussian_noise
from opake_core.mf import optimize as _optimize_strategy
from opake_core.mf.participation import SINGLE, Participation
from opake_core.noise import add_gaussian_noise, compute_dtype_of
from opake_core.optim import apply_updates
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup

__all__ = ["DPFTRLState", "DPSGDState", "StepMetrics", "dp_ftrl", "dp_sgd"]


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class DPSGDState:
    """State of a composed DP-SGD step: steps taken so far and the clipping state."""

    step: int = optree.dataclasses.field(pytree_node=False)
    clip: Any


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


def _clipped_sum(
    loss_fn: Callable[..., torch.Tensor],
    clipping_norm: float | PerGroup | AutoSRule | AdaptiveRule,
    expected_batch_size: float,
    microbatch_size: int | None,
    clip_backend: Callable[..., Any] | None = None,
    reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    per_example_grads: Callable[..., Any] | None = None,
    chunk_transform: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[Callable[..., Any], Any]:
    """The clipped, expected-batch-normalized gradient sum of a batch tuple, with diagnostics.

    Adaptive clipping gets a placeholder key here; :func:`_keyed` replaces it with one derived from the run's key
    at every step, so that a step depends only on ``(key, t)``.
    """
    return clipped_grad(
        lambda params, batch: loss_fn(params, *batch),
        clipping_norm=clipping_norm,
        normalize_by=expected_batch_size,
        microbatch_size=microbatch_size,
        return_diagnostics=True,
        key=random.key(0) if isinstance(clipping_norm, AdaptiveRule) else None,
        clip_backend=clip_backend,
        reduce_count=reduce_count,
        per_example_grads=None if per_example_grads is None else lambda p, batch: per_example_grads(p, *batch),
        chunk_transform=chunk_transform,
    )


def _keyed(clip_state: Any, key: random.Key) -> Any:
    """The clipping state with the count-noise key of adaptive clipping taken from the run's key."""
    if isinstance(clip_state, AdaptiveClipState):
        return dataclasses.replace(clip_state, key=random.fold_in(key, ADAPTIVE_STREAM))
    return clip_state


def _reduced(reduce: Callable[[Clipped], Clipped] | None, clipped: Clipped) -> Clipped:
    """``reduce(clipped)`` (a cross-rank sum), checked to keep the type and the sensitivity of the clipped sum."""
    if reduce is None:
        return clipped
    out = reduce(clipped)
    if not isinstance(out, Clipped) or isinstance(out, Noised) or out.sensitivity != clipped.sensitivity:
        raise InputTypeError(
            f"reduce must return an un-noised Clipped with the same sensitivity ({clipped.sensitivity!r}), got "
            f"{type(out).__name__} with sensitivity {getattr(out, 'sensitivity', None)!r}; sum the clipped values only."
        )
    return out


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, tuple):
        raise InputTypeError(f"batch must be a tuple of per-example tensors, got {type(batch).__name__}.")


def _metrics(step: int, noised: Any, diagnostics: Any) -> StepMetrics:
    losses = diagnostics.losses
    return StepMetrics(
        step=step,
        noise_std=noised.noise_std,
        batch_size=diagnostics.batch_size,
        loss=losses.mean() if losses.numel() else torch.zeros((), device=losses.device),
        clip_rate=diagnostics.clip_rate,
    )


def dp_sgd(
    loss_fn: Callable[..., torch.Tensor],
    *,
    optimizer: Any,
    clipping_norm: float | PerGroup,
    noise_multiplier: float,
    expected_batch_size: float,
    microbatch_size: int | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
    clip_backend: Callable[..., Any] | None = None,
    reduce: Callable[[Clipped], Clipped] | None = None,
    reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    per_example_grads: Callable[..., Any] | None = None,
    chunk_transform: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[Callable[..., tuple[Any, Any, DPSGDState, StepMetrics]], DPSGDState]:
    """A composed DP-SGD step as ``(step_fn, dp_state)``.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example (see
            :func:`~opake_core.clipping.clipped_grad`).
        optimizer: an :mod:`opake_core.optim` optimizer (``init`` / ``update``).
        clipping_norm: per-example L2 bound (float, ``math.inf`` for none, or PerGroup), or a rule from
            :func:`~opake_core.clipping.auto_s` or :func:`~opake_core.clipping.adaptive`. Adaptive clipping releases a
            noisy count too: account it with ``accounting.adaptive_clipping``.
        noise_multiplier: ``z``; the noise std is ``z * clipping_norm / expected_batch_size``. 0 = non-private.
        expected_batch_size: the public expected batch size (sampling rate times dataset size).
        microbatch_size: vmap chunk size (memory only; the result does not depend on it).
        compute_dtype: dtype the noise is drawn and added in.
        clip_backend: a faster clip-and-sum engine (see :func:`~opake_core.clipping.clipped_grad`).
        reduce: applied to the clipped, normalized sum before the noise (default: identity). Data-parallel adapters
            pass a cross-rank SUM here (``opake_torch.distributed.sum_gradients``), so that the noise is added once,
            after the sum; it must return a :class:`~opake_core.tree.Clipped` with the same sensitivity.
        reduce_count: adaptive clipping under data parallelism: sums its ``[clipped, batch size]`` counts across
            ranks (see :func:`~opake_core.clipping.clipped_grad`).
        per_example_grads: replaces ``vmap(grad(loss_fn))``: ``per_example_grads(params, *batch) ->
            (PerExampleGradients, losses)`` for the same per-example losses (see
            :func:`~opake_core.clipping.clipped_grad`; ``opake_torch.layerwise.LayerwiseGradients`` is one).
        chunk_transform: wraps the per-chunk clip function once (``torch.compile``, a CUDA-graph capture); with a
            ``microbatch_size`` every chunk is padded to that many rows (see :func:`~opake_core.clipping.clipped_grad`).

    Returns:
        ``step_fn(params, opt_state, dp_state, batch, key) -> (params, opt_state, dp_state, metrics)`` where
        ``batch`` is a tuple of per-example tensors ``[B, ...]`` (``loss_fn(params, *batch[i])`` is one example's
        loss) and ``key`` is the run's noise key: the noise of step ``t`` depends only on ``(key, t)``.
    """
    dtype = compute_dtype_of(compute_dtype)
    grad_fn, clip_state = _clipped_sum(
        loss_fn,
        clipping_norm,
        expected_batch_size,
        microbatch_size,
        clip_backend,
        reduce_count,
        per_example_grads,
        chunk_transform,
    )

    def step_fn(
        params: Any, opt_state: Any, dp_state: DPSGDState, batch: tuple[torch.Tensor, ...], key: random.Key
    ) -> tuple[Any, Any, DPSGDState, StepMetrics]:
        if not isinstance(dp_state, DPSGDState):
            raise InputTypeError(f"step_fn expects the DPSGDState from dp_sgd, got {type(dp_state).__name__}.")
        _check_batch(batch)
        with torch.profiler.record_function("opake::dp_sgd_step"):
            (clipped, diagnostics), clip = grad_fn(params, batch, state=_keyed(dp_state.clip, key))
            clipped = _reduced(reduce, clipped)
            noised = add_gaussian_noise(
                clipped, noise_multiplier=noise_multiplier, key=key, step=dp_state.step, compute_dtype=dtype
            )
            updates, opt_state = optimizer.update(noised, opt_state, params=params)
            params = apply_updates(params, updates)
        return params, opt_state, DPSGDState(dp_state.step + 1, clip), _metrics(dp_state.step, noised, diagnostics)

    return step_fn, DPSGDState(0, clip_state)


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class DPFTRLState:
    """State of a composed DP-FTRL step: steps taken, the clipping state and the MF noise state (its buffers)."""

    step: int = optree.dataclasses.field(pytree_node=False)
    clip: Any
    noise: MFNoiseState


def dp_ftrl(
    loss_fn: Callable[..., torch.Tensor],
    *,
    params: Any,
    optimizer: Any,
    strategy: Any,
    n_steps: int,
    clipping_norm: float | PerGroup,
    noise_multiplier: float,
    expected_batch_size: float,
    microbatch_size: int | None = None,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    clip_backend: Callable[..., Any] | None = None,
    reduce: Callable[[Clipped], Clipped] | None = None,
    per_example_grads: Callable[..., Any] | None = None,
    chunk_transform: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[Callable[..., tuple[Any, Any, DPFTRLState, StepMetrics]], DPFTRLState]:
    """A composed DP-FTRL step as ``(step_fn, dp_state)``, used exactly like :func:`dp_sgd`.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example.
        params: a tree shaped like the parameters: the noise buffers (the strategy's streaming memory) follow its
            shapes and devices and live in ``dp_state.noise``.
        optimizer: an :mod:`opake_core.optim` optimizer.
        strategy: an :mod:`opake_core.mf` strategy; specifications are optimized here once for ``n_steps`` and
            ``participation``.
        n_steps: the declared horizon; ``step_fn`` raises StateError at step ``n_steps``.
        clipping_norm: a fixed per-example L2 bound (float or PerGroup). Adaptive clipping is refused: the
            matrix mechanism needs one sensitivity for the whole horizon.
        noise_multiplier: ``z``; the noise of step ``t`` is ``z * sens(C, participation) * clipping_norm /
            expected_batch_size * (C^-1 w)_t``. Account it with ``accounting.mf_process(strategy, sampler=...,
            noise_multiplier=z, n_steps=n_steps, participation=participation)``. 0 = non-private.
        expected_batch_size: the public expected batch size (``sampler.expected_batch_size``).
        microbatch_size: vmap chunk size (memory only).
        compute_dtype: dtype the noise is added in.
        participation: the pattern the noise is scaled for (single participation: the per-round convention of
            amplified accounting).
        clip_backend: a faster clip-and-sum engine (see :func:`~opake_core.clipping.clipped_grad`).
        reduce: applied to the clipped, normalized sum before the noise (default: identity). Data-parallel adapters
            pass a cross-rank SUM here (``opake_torch.distributed.sum_gradients``), so that the noise is added once,
            after the sum; it must return a :class:`~opake_core.tree.Clipped` with the same sensitivity.
        per_example_grads: replaces ``vmap(grad(loss_fn))``: ``per_example_grads(params, *batch) ->
            (PerExampleGradients, losses)`` for the same per-example losses (see
            :func:`~opake_core.clipping.clipped_grad`; ``opake_torch.layerwise.LayerwiseGradients`` is one).
        chunk_transform: wraps the per-chunk clip function once (``torch.compile``, a CUDA-graph capture); with a
            ``microbatch_size`` every chunk is padded to that many rows (see :func:`~opake_core.clipping.clipped_grad`).

    Returns:
        ``step_fn(params, opt_state, dp_state, batch, key) -> (params, opt_state, dp_state, metrics)``; the noise of
        step ``t`` is drawn from ``(key, t)``, so pass the run's key at every step.
    """
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, numbers.Real | PerGroup | AutoSRule):
        raise ConfigurationError(
            f"dp_ftrl needs a fixed clipping_norm (a number or PerGroup), got {type(clipping_norm).__name__}; "
            "adaptive clipping is refused under matrix-factorization noise, whose privacy proof assumes a constant "
            "per-step sensitivity. Use a fixed bound (or dp_sgd for adaptive clipping)."
        )
    dtype = compute_dtype_of(compute_dtype)
    concrete = _optimize_strategy(strategy, n_steps, participation=participation)
    grad_fn, clip_state = _clipped_sum(
        loss_fn,
        clipping_norm,
        expected_batch_size,
        microbatch_size,
        clip_backend,
        per_example_grads=per_example_grads,
        chunk_transform=chunk_transform,
    )
    noise_fn, noise_state = mf_gaussian_noise(
        params,
        concrete,
        n_steps=n_steps,
        noise_multiplier=noise_multiplier,
        key=random.key(0),  # replaced by the step's key at every call
        compute_dtype=dtype,
        participation=participation,
    )

    def step_fn(
        params: Any, opt_state: Any, dp_state: DPFTRLState, batch: tuple[torch.Tensor, ...], key: random.Key
    ) -> tuple[Any, Any, DPFTRLState, StepMetrics]:
        if not isinstance(dp_state, DPFTRLState):
            raise InputTypeError(f"step_fn expects the DPFTRLState from dp_ftrl, got {type(dp_state).__name__}.")
        _check_batch(batch)
        if not isinstance(key, random.Key):
            raise InputTypeError(f"step_fn needs key=opake_core.random.key(seed), got {type(key).__name__}.")
        if dp_state.step >= n_steps:
            raise StateError(
                f"DP-FTRL step {dp_state.step} is past the declared horizon of n_steps={n_steps} (accounted as a "
                "whole); build a new run with a larger n_steps, recalibrated, to train longer."
            )
        with torch.profiler.record_function("opake::dp_ftrl_step"):
            (clipped, diagnostics), clip = grad_fn(params, batch, state=dp_state.clip)
            clipped = _reduced(reduce, clipped)
            noised, noise = noise_fn(clipped, dataclasses.replace(dp_state.noise, key=key))
            updates, opt_state = optimizer.update(noised, opt_state, params=params)
            params = apply_updates(params, updates)
        state = DPFTRLState(dp_state.step + 1, clip, noise)
        return params, opt_state, state, _metrics(dp_state.step, noised, diagnostics)

    return step_fn, DPFTRLState(0, clip_state, noise_state)
