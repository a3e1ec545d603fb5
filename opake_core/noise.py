"""Gaussian noise for DP-SGD: ``gaussian_noise``.

The Gaussian mechanism adds ``N(0, sigma^2)`` to every coordinate of a clipped sum with L2 sensitivity ``Delta``,
where ``sigma = noise_multiplier * Delta``. The accountant only needs the noise multiplier.

Per-group sensitivities ``Delta_k`` get per-group standard deviations ``sigma_k = z * sqrt(Delta_k * sum_j Delta_j)``
(``z`` the noise multiplier). This allocation minimizes the total noise variance under the constraint
``sum_k Delta_k^2 / sigma_k^2 <= 1 / z^2``, which makes the whitened release a Gaussian mechanism with multiplier ``z``
and sensitivity 1: it is accounted exactly like the scalar case.

Noise for step ``t`` and leaf ``i`` is drawn from ``fold_in(key, "opake.noise.gaussian", t, i)`` on the leaf's own
device, so it replays bit-exactly from ``(key, t)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import optree.dataclasses
import torch

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup, effective

__all__ = [
    "GaussianNoiseState",
    "add_gaussian_noise",
    "compute_dtype_of",
    "gaussian_noise",
    "mf_gaussian_noise",
    "noise_std_for",
]

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
STREAM = "opake.noise.gaussian"


def compute_dtype_of(value: torch.dtype | str) -> torch.dtype:
    """A noise compute dtype from a ``torch.dtype`` or its name (``"float16"``, ``"bfloat16"``, ...)."""
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ConfigurationError(f"compute_dtype must be one of {sorted(_DTYPES)}, got {value!r}.")
        return _DTYPES[value]
    if not isinstance(value, torch.dtype):
        raise InputTypeError(f"compute_dtype must be a torch.dtype or a name, got {type(value).__name__}.")
    if value not in _DTYPES.values():
        raise ConfigurationError(f"compute_dtype must be one of {sorted(_DTYPES)}, got {value}.")
    return value


def _check_multiplier(noise_multiplier: Any) -> float:
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, int | float):
        raise InputTypeError(f"noise_multiplier must be a number, got {type(noise_multiplier).__name__}.")
    if not 0 <= noise_multiplier < math.inf:
        raise ConfigurationError(
            f"noise_multiplier must be finite and non-negative (0 for a non-private run), got {noise_multiplier!r}."
        )
    return float(noise_multiplier)


def noise_std_for(sensitivity: float | PerGroup, noise_multiplier: float) -> float | PerGroup:
    """The noise standard deviation(s) for a sensitivity: ``z * Delta``, or the per-group allocation above."""
    if noise_multiplier == 0:
        return sensitivity.map(lambda _: 0.0) if isinstance(sensitivity, PerGroup) else 0.0
    if isinstance(sensitivity, PerGroup):
        total = sum(v for _, v in sensitivity.values)
        return sensitivity.map(lambda d: noise_multiplier * math.sqrt(d * total))
    return noise_multiplier * sensitivity


def add_gaussian_noise(
    clipped: Clipped,
    *,
    noise_multiplier: float,
    key: random.Key,
    step: int,
    compute_dtype: torch.dtype | str = torch.float32,
) -> Noised:
    """Add the Gaussian noise of step ``step`` to a clipped tree (a pure function of its inputs).

    Args:
        clipped: output of a clipping function; its ``sensitivity`` sets the noise scale.
        noise_multiplier: ``z >= 0``; 0 returns the values unchanged (a non-private run).
        key: the run's noise key; the draw depends only on ``(key, step)``.
        step: the step counter (int >= 0).
        compute_dtype: dtype the noise is drawn and added in; the result has this dtype.

    Returns:
        A :class:`~opake_core.tree.Noised` tree with the same sensitivity and the noise standard deviation used.
    """
    if isinstance(clipped, Noised):
        raise InputTypeError(
            "gaussian noise expects a Clipped tree, not a Noised one that already went through a noise mechanism."
        )
    if not isinstance(clipped, Clipped):
        raise InputTypeError(
            f"gaussian noise expects a Clipped tree (the output of clipped_grad), got {type(clipped).__name__}. "
            "Wrap values you clipped yourself with opake_core.tree.Clipped(value, sensitivity)."
        )
    z = _check_multiplier(noise_multiplier)
    dtype = compute_dtype_of(compute_dtype)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigurationError(f"step must be an int >= 0, got {step!r}.")
    std = noise_std_for(clipped.sensitivity, z)
    if z == 0:
        return Noised(clipped.value, clipped.sensitivity, std)
    if math.isinf(effective(clipped.sensitivity)):
        raise ConfigurationError(
            "cannot add noise to a tree with infinite sensitivity (clipping disabled); clip with a finite "
            "clipping_norm, or use noise_multiplier=0 for a non-private run."
        )
    leaves, treedef = optree.tree_flatten(clipped.value)
    stds = std.leaf_values() if isinstance(std, PerGroup) else [std] * len(leaves)
    if len(stds) != len(leaves):
        raise ConfigurationError(f"the per-group sensitivity covers {len(stds)} leaves but the tree has {len(leaves)}.")
    step_key = random.fold_in(key, STREAM, step)
    with torch.profiler.record_function("opake::gaussian_noise"), torch.no_grad():
        draws = random.normal_like([random.fold_in(step_key, i) for i in range(len(leaves))], leaves, dtype=dtype)
        noised = [
            torch.add(leaf.to(dtype), draw, alpha=leaf_std)
            for leaf, draw, leaf_std in zip(leaves, draws, stds, strict=True)
        ]
    return Noised(optree.tree_unflatten(treedef, noised), clipped.sensitivity, std)


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class GaussianNoiseState:
    """State of :func:`gaussian_noise`: the key and the number of steps already noised."""

    key: random.Key = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False, default=0)


def gaussian_noise(
    *,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
) -> tuple[Callable[[Clipped, GaussianNoiseState], tuple[Noised, GaussianNoiseState]], GaussianNoiseState]:
    """The DP-SGD Gaussian mechanism as a ``(noise_fn, state)`` pair.

    ``noise_fn(clipped, state) -> (noised, new_state)`` adds ``N(0, (noise_multiplier * sensitivity)^2)`` to every
    coordinate (per-group allocation for per-group sensitivities) and advances the step. Replaying a saved state
    gives bit-identical noise. ``noise_multiplier=0`` returns the values unchanged (a non-private run).
    """
    z = _check_multiplier(noise_multiplier)
    dtype = compute_dtype_of(compute_dtype)
    if not isinstance(key, random.Key):
        raise InputTypeError(f"gaussian_noise needs key=opake_core.random.key(seed), got {type(key).__name__}.")

    def noise_fn(clipped: Clipped, state: GaussianNoiseState) -> tuple[Noised, GaussianNoiseState]:
        if not isinstance(state, GaussianNoiseState):
            raise InputTypeError(f"noise_fn expects a GaussianNoiseState, got {type(state).__name__}.")
        noised = add_gaussian_noise(clipped, noise_multiplier=z, key=state.key, step=state.step, compute_dtype=dtype)
        return noised, GaussianNoiseState(state.key, state.step + 1)

    return noise_fn, GaussianNoiseState(key, 0)


from opake_core.mf.streaming import mf_gaussian_noise  # noqa: E402  (the DP-FTRL mechanism, re-exported here)
