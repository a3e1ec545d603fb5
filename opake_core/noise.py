"""Noise mechanisms (privatizers): the contract, and the Gaussian mechanism of DP-SGD, ``gaussian_noise``.

The privatizer contract, which :func:`opake_core.step.dp_step` relies on and every mechanism follows:

* a factory returns ``(noise_fn, state)``; ``noise_fn(clipped, state) -> (noised, new_state)``;
* ``clipped`` is a :class:`~opake_core.tree.Clipped` tree (anything else is refused with ``InputTypeError``, a
  :class:`~opake_core.tree.Noised` one too); ``noised`` is a :class:`~opake_core.tree.Noised` tree with the same
  sensitivity and the per-coordinate standard deviation of the noise it added (``noise_std``, float or PerGroup);
* ``state`` is a frozen dataclass registered with optree (namespace ``"opake"``) that holds the key and the step
  counter: a call depends only on ``(clipped, state)``, never mutates its inputs, and a saved state replays the
  identical noise.

The Gaussian mechanism adds ``N(0, sigma^2)`` to every coordinate of a clipped sum with L2 sensitivity ``Delta``,
``sigma = noise_multiplier * Delta`` (per group: the allocation of :func:`noise_std_for`); the accountant only needs
the noise multiplier. It is the matrix mechanism of :mod:`opake_core.mf.streaming` with the identity strategy and no
horizon (DP-SGD is DP-FTRL with ``C = I``, as in JAX Privacy). Noise for step ``t`` and leaf ``i`` is drawn from
``fold_in(key, "opake.noise.gaussian", t, i)`` on the leaf's own device, every leaf of a step in one pass, so it
replays bit-exactly from ``(key, t)``.
"""

from __future__ import annotations

import torch

from opake_core import random, validate
from opake_core.mf.strategies import identity
from opake_core.mf.streaming import (
    GaussianNoiseState,
    NoiseFn,
    compute_dtype_of,
    matrix_mechanism,
    mf_gaussian_noise,
    noise_std_for,
)
from opake_core.tree import Clipped, Noised

__all__ = [
    "STREAM",
    "GaussianNoiseState",
    "NoiseFn",
    "add_gaussian_noise",
    "compute_dtype_of",
    "gaussian_noise",
    "mf_gaussian_noise",
    "noise_std_for",
]

STREAM = "opake.noise.gaussian"


def gaussian_noise(
    *,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
) -> tuple[NoiseFn, GaussianNoiseState]:
    """The DP-SGD Gaussian mechanism as a ``(noise_fn, state)`` pair.

    ``noise_fn(clipped, state) -> (noised, new_state)`` adds ``N(0, (noise_multiplier * sensitivity)^2)`` to every
    coordinate (per-group allocation for per-group sensitivities), in ``compute_dtype``, and advances the step; the
    sensitivity may change between steps. ``key`` lives in the state. ``noise_multiplier=0`` adds nothing (a
    non-private run).
    """
    return matrix_mechanism(
        None,
        identity(),
        n_steps=None,
        noise_multiplier=noise_multiplier,
        key=key,
        stream=STREAM,
        name="gaussian_noise",
        compute_dtype=compute_dtype,
    )


def add_gaussian_noise(
    clipped: Clipped,
    *,
    noise_multiplier: float,
    key: random.Key,
    step: int,
    compute_dtype: torch.dtype | str = torch.float32,
) -> Noised:
    """The noise :func:`gaussian_noise` adds at step ``step``, as a pure function of its inputs.

    Args:
        clipped: output of a clipping function; its ``sensitivity`` sets the noise scale.
        noise_multiplier: ``z >= 0``; 0 returns the values unchanged (a non-private run).
        key: the noise key; the draw depends only on ``(key, step)``.
        step: the step counter (int >= 0).
        compute_dtype: dtype the noise is drawn and added in; the result has this dtype.

    Returns:
        A :class:`~opake_core.tree.Noised` tree with the same sensitivity and the noise standard deviation used.
    """
    noise_fn, state = gaussian_noise(noise_multiplier=noise_multiplier, key=key, compute_dtype=compute_dtype)
    noised, _ = noise_fn(clipped, GaussianNoiseState(state.key, validate.integer("step", step, minimum=0)))
    return noised
