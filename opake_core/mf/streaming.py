"""Correlated (matrix-factorization) Gaussian noise for DP-FTRL: ``mf_gaussian_noise``.

Step ``t`` adds ``sigma * (C^-1 z)_t`` to the clipped sum, with ``z_t ~ N(0, I)`` drawn from
``fold_in(key, "opake.noise.mf_gaussian", t, leaf_index)`` on the leaf's device, and

    sigma = noise_multiplier * sens(C) * Delta,

``Delta`` the clipped tree's sensitivity (clipping bound / normalizer; per group with the DP-SGD allocation of
:func:`opake_core.noise.noise_std_for`) and ``sens(C)`` the strategy's sensitivity under the declared
participation. With ``SingleParticipation`` (default) ``noise_multiplier`` is the per-round multiplier of amplified
BandMF accounting (jax_privacy's convention, ``stddev(z) = sigma * clip * ||c||``); with a multi-participation
pattern it is the multiplier of the single Gaussian mechanism covering the whole horizon.

``C^-1`` is applied one step at a time with the memory the strategy needs (:class:`~opake_core.mf._base.StreamPlan`):
0 buffers for the identity, ``bands - 1`` past outputs for BandMF, ``p - 1`` for BSR (past outputs) and BISR (past
``z``), 1 for lambda-CGD (the previous ``z``), ``m`` for an ``m``-buffer BLT. Buffers are model-shaped tensors on
each leaf's device, allocated at construction, and kept at unit scale (``sigma`` is applied on output). Their dtype
is ``state_dtype``: by default the compute dtype, widened to float32 for half-precision compute; pass
``state_dtype=torch.bfloat16`` to keep bf16 buffers (half the memory, ~3 significant digits of recursion accuracy).

Each call returns a new state; it never writes into the old one, so a saved state (``torch.save``) resumes the
identical noise sequence. Reported ``noise_std``: the per-coordinate standard deviation of the noise actually added
at this step, ``sigma * ||row_t(C^-1)||`` (what DP-AdamBC subtracts), not the scale of ``z``.

The constant-sensitivity latch: the matrix mechanism's privacy proof assumes one per-step bound for the whole
horizon, so a ``Clipped.sensitivity`` that differs from the first call's raises (adaptive clipping is unsupported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import optree
import optree.dataclasses
import torch

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.mf import _checks
from opake_core.mf._base import Concrete, StreamPlan
from opake_core.mf.participation import SINGLE, Participation
from opake_core.mf.sensitivity import sensitivity
from opake_core.mf.strategies import optimize
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup, effective

__all__ = ["SECOND_MOMENT_STREAM", "STREAM", "MFNoiseState", "mf_gaussian_noise", "mf_second_moment_noise"]

STREAM = "opake.noise.mf_gaussian"
SECOND_MOMENT_STREAM = "opake.noise.mf_gaussian.second_moment"

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _dtype(name: str, value: Any) -> torch.dtype:
    # The same rule as opake_core.noise.compute_dtype_of (not imported: noise.py re-exports this module).
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ConfigurationError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}.")
        return _DTYPES[value]
    if not isinstance(value, torch.dtype):
        raise InputTypeError(f"{name} must be a torch.dtype or a name, got {type(value).__name__}.")
    if value not in _DTYPES.values():
        raise ConfigurationError(f"{name} must be one of {sorted(_DTYPES)}, got {value}.")
    return value


def _leaf_stds(sensitivity_value: float | PerGroup, noise_multiplier: float, n_leaves: int) -> list[float]:
    if isinstance(sensitivity_value, PerGroup):
        total = sum(v for _, v in sensitivity_value.values)
        stds = [noise_multiplier * math.sqrt(d * total) for d in sensitivity_value.leaf_values()]
        if len(stds) != n_leaves:
            raise ConfigurationError(
                f"the per-group sensitivity covers {len(stds)} leaves but the tree has {n_leaves}."
            )
        return stds
    return [noise_multiplier * float(sensitivity_value)] * n_leaves


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class MFNoiseState:
    """State of :func:`mf_gaussian_noise`.

    Attributes:
        buffers: ``num_buffers`` tuples, each with one tensor per leaf (the strategy's streaming memory).
        key: the run's noise key.
        step: steps already noised.
        sensitivity: the clipped sensitivity latched on the first call (``None`` before it).
    """

    buffers: tuple[tuple[torch.Tensor, ...], ...]
    key: random.Key = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False, default=0)
    sensitivity: float | PerGroup | None = optree.dataclasses.field(pytree_node=False, default=None)


def _template_leaves(template: Any) -> tuple[list[torch.Tensor], Any]:
    value = template.value if isinstance(template, Clipped) else template
    leaves, treedef = optree.tree_flatten(value)
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise InputTypeError("mf_gaussian_noise needs a template tree of tensors (for example the parameters).")
    return leaves, treedef


def _advance(plan: StreamPlan, z: torch.Tensor, buffers: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of ``C^-1`` for one leaf: ``(x_t, new buffers)``; never writes into ``buffers``."""
    if plan.kind == "identity":
        return z, buffers
    if plan.kind == "fir":
        x = z * plan.coef[0]
        for h, past in zip(plan.coef[1:], buffers, strict=True):
            x = x.add(past, alpha=h)
        return x, [z, *buffers[:-1]]
    if plan.kind == "iir":
        acc = z
        for c, past in zip(plan.coef[1:], buffers, strict=True):
            acc = acc.add(past, alpha=-c)
        x = acc / plan.coef[0]
        return x, [x, *buffers[:-1]]
    x = z
    for w, buf in zip(plan.coef, buffers, strict=True):
        x = x.add(buf, alpha=-w)
    return x, [buf.mul(d).add_(x) for d, buf in zip(plan.decay, buffers, strict=True)]


def _build(
    template: Any,
    strategy: Any,
    *,
    n_steps: int,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: Any,
    state_dtype: Any,
    participation: Participation,
    stream: str,
) -> tuple[Callable[[Clipped, MFNoiseState], tuple[Noised, MFNoiseState]], MFNoiseState]:
    if isinstance(n_steps, bool) or not isinstance(n_steps, int):
        raise InputTypeError(f"n_steps must be an int, got {type(n_steps).__name__} {n_steps!r}.")
    _checks.integer("n_steps", n_steps)
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, int | float):
        raise InputTypeError(f"noise_multiplier must be a number, got {type(noise_multiplier).__name__}.")
    if not 0 <= noise_multiplier < math.inf:
        raise ConfigurationError(
            f"noise_multiplier must be finite and non-negative (0 for a non-private run), got {noise_multiplier!r}."
        )
    if not isinstance(key, random.Key):
        raise InputTypeError(f"mf_gaussian_noise needs key=opake_core.random.key(seed), got {type(key).__name__}.")
    dtype = _dtype("compute_dtype", compute_dtype)
    if state_dtype is None:
        state = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    else:
        state = _dtype("state_dtype", state_dtype)
    concrete: Concrete = optimize(strategy, n_steps, participation=participation)
    plan = concrete.plan
    scale = float(noise_multiplier) * sensitivity(concrete, n_steps, participation=participation)
    row_norms = np.sqrt(np.cumsum(concrete.noising_coef(n_steps) ** 2))
    leaves, treedef = _template_leaves(template)
    buffers = tuple(
        tuple(torch.zeros(leaf.shape, dtype=state, device=leaf.device) for leaf in leaves)
        for _ in range(plan.num_buffers)
    )

    def noise_fn(clipped: Clipped, state_in: MFNoiseState) -> tuple[Noised, MFNoiseState]:
        if isinstance(clipped, Noised):
            raise InputTypeError(
                "mf_gaussian_noise expects a Clipped tree, not a Noised one that already went through a noise "
                "mechanism."
            )
        if not isinstance(clipped, Clipped):
            raise InputTypeError(
                f"mf_gaussian_noise expects a Clipped tree (the output of clipped_grad), got {type(clipped).__name__}. "
                "Wrap values you clipped yourself with opake_core.tree.Clipped(value, sensitivity)."
            )
        if not isinstance(state_in, MFNoiseState):
            raise InputTypeError(f"noise_fn expects an MFNoiseState, got {type(state_in).__name__}.")
        if len(state_in.buffers) != plan.num_buffers:
            raise StateError(
                f"the state holds {len(state_in.buffers)} buffers but this strategy streams with {plan.num_buffers}; "
                "restore a state produced by the same strategy and horizon."
            )
        t = state_in.step
        if t >= n_steps:
            raise ConfigurationError(
                f"MF noise step {t} is outside the calibrated horizon [0, {n_steps}); rebuild the mechanism with a "
                f"larger n_steps (and recalibrate), or stop calling noise_fn after {n_steps} steps."
            )
        if state_in.sensitivity is not None and clipped.sensitivity != state_in.sensitivity:
            raise ConfigurationError(
                f"mf_gaussian_noise saw a varying Clipped.sensitivity across calls (first={state_in.sensitivity!r}, "
                f"now={clipped.sensitivity!r}). MF privacy proofs assume a constant per-step sensitivity; adaptive "
                "clipping is unsupported with MF noise."
            )
        values, tree = optree.tree_flatten(clipped.value)
        if tree != treedef:
            raise InputTypeError(f"the clipped tree {tree} does not match the template {treedef}.")
        stds = _leaf_stds(clipped.sensitivity, scale, len(values))
        if scale > 0 and math.isinf(effective(clipped.sensitivity)):
            raise ConfigurationError(
                "cannot add noise to a tree with infinite sensitivity (clipping disabled); clip with a finite "
                "clipping_norm, or use noise_multiplier=0 for a non-private run."
            )
        reported: float | PerGroup
        if isinstance(clipped.sensitivity, PerGroup):
            total = sum(v for _, v in clipped.sensitivity.values)
            reported = clipped.sensitivity.map(lambda d: scale * math.sqrt(d * total) * row_norms[t])
        else:
            reported = float(stds[0] * row_norms[t])
        with torch.profiler.record_function("opake::mf_gaussian_noise"), torch.no_grad():
            if scale == 0:
                out, new_buffers = [v.to(dtype) for v in values], state_in.buffers
            else:
                step_key = random.fold_in(state_in.key, stream, t)
                out = []
                per_leaf = [[] for _ in range(plan.num_buffers)]
                draws = random.normal_like(
                    [random.fold_in(step_key, i) for i in range(len(values))], values, dtype=state
                )
                for i, (leaf, std, z) in enumerate(zip(values, stds, draws, strict=True)):
                    x, bufs = _advance(plan, z, [b[i] for b in state_in.buffers])
                    for j, b in enumerate(bufs):
                        per_leaf[j].append(b)
                    out.append(leaf.to(dtype).add(x.to(dtype), alpha=std))
                new_buffers = tuple(tuple(b) for b in per_leaf)
        new_state = MFNoiseState(new_buffers, state_in.key, t + 1, clipped.sensitivity)
        return Noised(optree.tree_unflatten(treedef, out), clipped.sensitivity, reported), new_state

    return noise_fn, MFNoiseState(buffers, key, 0, None)


def mf_gaussian_noise(
    template: Any,
    strategy: Any,
    *,
    n_steps: int,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    state_dtype: torch.dtype | str | None = None,
    second_moment_strategy: Any = None,
) -> tuple[Callable[..., tuple[Any, Any]], Any]:
    """DP-FTRL's correlated Gaussian noise as a ``(noise_fn, state)`` pair (see the module docstring).

    Args:
        template: a tree of tensors shaped like the clipped sums (or a ``Clipped``): buffers follow its shapes and
            devices.
        strategy: an ``opake_core.mf`` strategy; ``band_mf`` / ``blt`` are optimized here for ``n_steps`` and
            ``participation`` (pass the result of ``opake_core.mf.optimize`` to reuse an optimization).
        n_steps: the horizon, an int >= 1; a call at step ``>= n_steps`` raises.
        noise_multiplier: ``z >= 0``; the std of ``z`` is ``z * sens(C) * Delta``. 0 is a non-private run.
        key: the run's noise key; step ``t`` and leaf ``i`` draw from ``fold_in(key, STREAM, t, i)``.
        compute_dtype: dtype of the output (fp16, bf16, fp32, fp64).
        participation: the pattern ``sens(C)`` is computed for (single participation by default).
        state_dtype: dtype of the buffers and of the recursion; ``None`` for ``compute_dtype`` widened to float32.
        second_moment_strategy: if given, ``noise_fn`` takes and returns a pair ``(first, second)``: the second
            clipped stream (private second moments for Adam) is noised with this strategy on its own stream
            (:func:`mf_second_moment_noise`) and the state is a pair of states.

    Returns:
        ``(noise_fn, state)`` with ``noise_fn(clipped, state) -> (Noised, state)``.

    Raises:
        InputTypeError: a non-Clipped input, a wrong key or state, ``n_steps`` not an int.
        ConfigurationError: ``n_steps < 1``, a bad multiplier or dtype, a strategy that does not fit the horizon,
            a step past the horizon, a sensitivity that changes between calls.
    """
    with torch.profiler.record_function("opake::mf_gaussian_noise_init"):
        common = {
            "n_steps": n_steps,
            "noise_multiplier": noise_multiplier,
            "key": key,
            "compute_dtype": compute_dtype,
            "state_dtype": state_dtype,
            "participation": participation,
        }
        first_fn, first_state = _build(template, strategy, stream=STREAM, **common)
        if second_moment_strategy is None:
            return first_fn, first_state
        second_fn, second_state = mf_second_moment_noise(template, second_moment_strategy, **common)

    def pair_fn(clipped: tuple[Clipped, Clipped], state: tuple[MFNoiseState, MFNoiseState]) -> tuple[Any, Any]:
        if not (isinstance(clipped, tuple) and len(clipped) == 2):
            raise InputTypeError(
                "with second_moment_strategy, noise_fn expects a pair (first Clipped, second-moment Clipped), got "
                f"{type(clipped).__name__}."
            )
        first, s1 = first_fn(clipped[0], state[0])
        second, s2 = second_fn(clipped[1], state[1])
        return (first, second), (s1, s2)

    return pair_fn, (first_state, second_state)


def mf_second_moment_noise(
    template: Any,
    strategy: Any,
    *,
    n_steps: int,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    state_dtype: torch.dtype | str | None = None,
) -> tuple[Callable[[Clipped, MFNoiseState], tuple[Noised, MFNoiseState]], MFNoiseState]:
    """:func:`mf_gaussian_noise` for a second clipped stream (private second moments), with its own strategy and
    the stream tag ``SECOND_MOMENT_STREAM``, so its noise is independent of the first stream's under the same key.
    How the privacy budget is split between the two streams is the clipping side's business (their sensitivities).
    """
    with torch.profiler.record_function("opake::mf_second_moment_noise_init"):
        return _build(
            template,
            strategy,
            n_steps=n_steps,
            noise_multiplier=noise_multiplier,
            key=key,
            compute_dtype=compute_dtype,
            state_dtype=state_dtype,
            participation=participation,
            stream=SECOND_MOMENT_STREAM,
        )
