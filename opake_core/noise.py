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
horizon (DP-SGD is DP-FTRL with ``C = I``, as in JAX Privacy). The noise of step ``t`` is
``random.normal_tree(fold_in(key, "opake.noise.gaussian", t), leaves)``: one draw per device, cut into the leaves in
order, each piece on its leaf's device, so it replays bit-exactly from ``(key, t)``.

Private second moments (:mod:`opake_core.moments`): ``gaussian_noise``'s ``noise_fn`` also takes a
:class:`~opake_core.moments.ClippedMoments` pair (``clipped_grad(..., second_moment=True)``) and noises both streams
as **one** Gaussian release with multiplier ``z``: ``sigma_k = z sqrt(Delta_k (Delta_1 + Delta_2))``
(:func:`~opake_core.moments.paired_noise_std`), drawn from ``fold_in(key, PAIRED_STREAMS[k], t, i)``; it returns a
:class:`~opake_core.moments.NoisedMoments` and the same state as a single stream. The accountant is unchanged.
:func:`paired_mf_gaussian_noise` is the DP-FTRL counterpart, one strategy per stream.

Sharded trees (FSDP2): given a :class:`~opake_core.sharding.Shard`, every mechanism here noises one rank's rows of
the clipped sum with exactly those coordinates of the one-process draw (``random.normal_tree_shard``), so the ranks
together add one Gaussian (or one correlated stream) per coordinate, equal to one process's noise bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake_core import random, validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf import streaming
from opake_core.mf.participation import SINGLE, Participation
from opake_core.mf.sensitivity import sensitivity
from opake_core.mf.strategies import identity, optimize
from opake_core.mf.streaming import (
    SECOND_MOMENT_STREAM,
    GaussianNoiseState,
    NoiseFn,
    compute_dtype_of,
    matrix_mechanism,
    mf_gaussian_noise,
    noise_std_for,
)
from opake_core.moments import ClippedMoments, NoisedMoments, paired_scale
from opake_core.sharding import Shard
from opake_core.tree import Clipped, Noised, PerGroup

__all__ = [
    "PAIRED_STREAMS",
    "STREAM",
    "GaussianNoiseState",
    "NoiseFn",
    "add_gaussian_noise",
    "compute_dtype_of",
    "gaussian_noise",
    "mf_gaussian_noise",
    "noise_std_for",
    "paired_mf_gaussian_noise",
]

STREAM = "opake.noise.gaussian"
PAIRED_STREAMS = ("opake.noise.gaussian.paired.first", "opake.noise.gaussian.paired.second")
"""The stream tags of the two streams of a :class:`~opake_core.moments.ClippedMoments` pair under DP-SGD."""


def gaussian_noise(
    *,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    shard: Shard | None = None,
    inplace: bool = False,
) -> tuple[NoiseFn, GaussianNoiseState]:
    """The DP-SGD Gaussian mechanism as a ``(noise_fn, state)`` pair.

    ``noise_fn(clipped, state) -> (noised, new_state)`` adds ``N(0, (noise_multiplier * sensitivity)^2)`` to every
    coordinate (per-group allocation for per-group sensitivities), in ``compute_dtype``, and advances the step; the
    sensitivity may change between steps. ``key`` lives in the state. ``noise_multiplier=0`` adds nothing (a
    non-private run).

    Given a :class:`~opake_core.moments.ClippedMoments` pair (``clipped_grad(..., second_moment=True)``), ``noise_fn``
    returns a :class:`~opake_core.moments.NoisedMoments`: both streams noised as one Gaussian release with
    multiplier ``z``, ``sigma_k = z sqrt(Delta_k (Delta_1 + Delta_2))`` (per group: every (stream, group) pair is a
    group of the allocation), streams ``PAIRED_STREAMS``; account it exactly like a single stream.

    With ``shard`` (a :class:`~opake_core.sharding.Shard`, this rank's rows of the global tree), ``noise_fn`` takes
    the rank's part of the clipped sum (leaves of ``shard.local_shapes``) and adds exactly those coordinates of the
    one-process noise: the ranks' outputs put together are the one-process output bit for bit.

    With ``inplace=True`` the noise is added into the clipped tree's own tensors (for a caller that gives it up, such
    as :func:`~opake_core.dp_step` with ``donate=True``); the values are the same.

    Example: the noise on a zero tree of sensitivity 0.1 with multiplier 2 has standard deviation 0.2, and a saved
    state replays the same noise.

        >>> import torch
        >>> from opake_core import Clipped, gaussian_noise, random
        >>> noise_fn, state = gaussian_noise(noise_multiplier=2.0, key=random.key(0))
        >>> noised, after = noise_fn(Clipped({"w": torch.zeros(100_000)}, sensitivity=0.1), state)
        >>> noised.noise_std, abs(noised.value["w"].std().item() - 0.2) < 0.002
        (0.2, True)
        >>> again, _ = noise_fn(Clipped({"w": torch.zeros(100_000)}, sensitivity=0.1), state)
        >>> torch.equal(again.value["w"], noised.value["w"]), after.step
        (True, 1)

    Sharded over two ranks, the noise of each rank's rows is its part of the one-process noise.

        >>> from opake_core import Shard
        >>> def rank_noise(rank):
        ...     shard = Shard.rows([(100_000,)], rank=rank, world_size=2)
        ...     fn, first = gaussian_noise(noise_multiplier=2.0, key=random.key(0), shard=shard)
        ...     return fn(Clipped({"w": torch.zeros(50_000)}, sensitivity=0.1), first)[0].value["w"]
        >>> torch.equal(torch.cat([rank_noise(0), rank_noise(1)]), noised.value["w"])
        True
    """
    options = {
        "n_steps": None,
        "noise_multiplier": noise_multiplier,
        "key": key,
        "name": "gaussian_noise",
        "compute_dtype": compute_dtype,
        "shard": shard,
    }
    plain_fn, state = matrix_mechanism(None, identity(), stream=STREAM, inplace=inplace, **options)
    first_fn, _ = matrix_mechanism(None, identity(), stream=PAIRED_STREAMS[0], **options)
    second_fn, _ = matrix_mechanism(None, identity(), stream=PAIRED_STREAMS[1], **options)
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)

    def noise_fn(clipped: Clipped | ClippedMoments, state: GaussianNoiseState) -> tuple[Any, GaussianNoiseState]:
        if not isinstance(clipped, ClippedMoments):
            return plain_fn(clipped, state)
        # no horizon, no buffers: both streams read the same (key, step) and advance it to the same next state
        noised, states = _noise_moments(clipped, (state, state), (first_fn, second_fn), (1.0, 1.0), z)
        return noised, states[0]

    return noise_fn, state


def add_gaussian_noise(
    clipped: Clipped,
    *,
    noise_multiplier: float,
    key: random.Key,
    step: int,
    compute_dtype: torch.dtype | str = torch.float32,
    shard: Shard | None = None,
) -> Noised:
    """The noise :func:`gaussian_noise` adds at step ``step``, as a pure function of its inputs.

    Args:
        clipped: output of a clipping function; its ``sensitivity`` sets the noise scale.
        noise_multiplier: ``z >= 0``; 0 returns the values unchanged (a non-private run).
        key: the noise key; the draw depends only on ``(key, step)``.
        step: the step counter (int >= 0).
        compute_dtype: dtype the noise is drawn and added in; the result has this dtype.
        shard: this rank's part of a sharded tree, as in :func:`gaussian_noise`.

    Returns:
        A :class:`~opake_core.tree.Noised` tree with the same sensitivity and the noise standard deviation used.

    Example: the noise of step 3 of :func:`gaussian_noise`, without running steps 0 to 2.

        >>> import torch
        >>> from opake_core import Clipped, add_gaussian_noise, gaussian_noise, random
        >>> clipped = Clipped({"w": torch.zeros(5)}, sensitivity=1.0)
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(7))
        >>> for _ in range(4):
        ...     noised, state = noise_fn(clipped, state)
        >>> direct = add_gaussian_noise(clipped, noise_multiplier=1.0, key=random.key(7), step=3)
        >>> torch.equal(direct.value["w"], noised.value["w"])
        True
    """
    noise_fn, state = gaussian_noise(
        noise_multiplier=noise_multiplier, key=key, compute_dtype=compute_dtype, shard=shard
    )
    noised, _ = noise_fn(clipped, GaussianNoiseState(state.key, validate.integer("step", step, minimum=0)))
    return noised


def _scaled(sensitivity: float | PerGroup, factor: float) -> float | PerGroup:
    return sensitivity.map(lambda d: d * factor) if isinstance(sensitivity, PerGroup) else sensitivity * factor


def _noise_moments(
    moments: ClippedMoments,
    states: tuple[Any, Any],
    fns: tuple[Callable[..., Any], Callable[..., Any]],
    strategy_sensitivities: tuple[float, float],
    noise_multiplier: float,
) -> tuple[NoisedMoments, tuple[Any, Any]]:
    """Noise both streams as one release: stream ``k`` goes through its mechanism with the effective sensitivity
    ``c_k * Delta_k`` of :func:`~opake_core.moments.paired_scale` (so its std is the joint allocation), and comes
    back with its own sensitivity ``Delta_k`` and the std actually added."""
    first, second = moments.first, moments.second
    if noise_multiplier == 0:
        factors = (1.0, 1.0)  # nothing is added; keep the sensitivities as they are (clipping may be disabled)
    else:
        factors = paired_scale(first.sensitivity, second.sensitivity, strategy_sensitivities=strategy_sensitivities)
    out, new_states = [], []
    for stream, factor, fn, state in zip((first, second), factors, fns, states, strict=True):
        noised, new_state = fn(Clipped(stream.value, _scaled(stream.sensitivity, factor)), state)
        out.append(Noised(noised.value, stream.sensitivity, noised.noise_std))
        new_states.append(new_state)
    return NoisedMoments(out[0], out[1]), (new_states[0], new_states[1])


def paired_mf_gaussian_noise(
    template: Any,
    strategy: Any,
    *,
    second_moment_strategy: Any = None,
    n_steps: int,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    state_dtype: torch.dtype | str | None = None,
    shard: Shard | None = None,
) -> tuple[Callable[..., tuple[NoisedMoments, Any]], tuple[GaussianNoiseState, GaussianNoiseState]]:
    """DP-FTRL noise for private second moments: each stream of a :class:`~opake_core.moments.ClippedMoments` gets
    its own correlated noise, the pair is one Gaussian release with multiplier ``z``.

    Stream ``k`` (``k = 1``: the clipped sum, strategy ``strategy``; ``k = 2``: the clipped sum of squares,
    ``second_moment_strategy``) is the matrix mechanism of :func:`~opake_core.mf.mf_gaussian_noise` with
    ``z_k ~ N(0, sigma_k^2 I)``, ``sigma_k = z sqrt(s_k Delta_k T)``, ``T = s_1 Delta_1 + s_2 Delta_2``, ``s_k`` the
    sensitivity of strategy ``k`` under ``participation`` and ``Delta_k`` the stream's clipped sensitivity (per
    group: every (stream, group) pair is a group). Whitened, ``sum_k (s_k Delta_k / sigma_k)^2 = 1 / z^2``
    (:mod:`opake_core.moments`). The streams draw from ``mf.streaming.STREAM`` and ``SECOND_MOMENT_STREAM`` under
    the same key; the state is the pair of the two mechanisms' states.

    Accounting. With ``second_moment_strategy`` the same strategy as ``strategy``, the whitened pair has the Gram
    matrix of ``C_1`` alone, so ``accounting.mf_process(strategy, ...)`` with multiplier ``z`` accounts it unchanged
    for every sampler. A different second strategy mixes the two Gram matrices (weights ``s_k Delta_k / T``); the
    first strategy's process still covers it where that process only sees the per-step sensitivity: unamplified
    accounting (``amplified=False``, the noise scaled for the sampler's own pattern), and amplified BandMF under
    cyclic Poisson with single participation when the second strategy is banded with no more bands than the
    sampler's groups (each visit of a group is then one Poisson-subsampled Gaussian of whitened sensitivity
    ``1 / z``). The Monte Carlo accountants (``balls_in_bins`` with a correlated strategy, ``b_min_sep``) are computed
    from the first strategy's coefficients and do **not** cover a different second strategy: pass the same strategy
    there. ``accounting.mf_process(..., second_moment_strategy=...)`` and ``plan(..., second_moment_strategy=...)``
    refuse a second strategy they do not cover.

    Args:
        template: a tree shaped like the clipped sums (the buffers of both streams follow it).
        strategy: the first stream's :mod:`opake_core.mf` strategy (optimized here for ``n_steps``).
        second_moment_strategy: the second stream's strategy; required (a ``ConfigurationError`` names it when
            missing). The second moment of Adam averages over a longer window than the first, so a strategy
            optimized for its workload (for example ``band_mf(..., momentum=0.999)``) is the usual choice; see the
            accounting note above.
        n_steps: the horizon (int >= 1); a call at step ``>= n_steps`` raises.
        noise_multiplier: ``z >= 0``, the multiplier of the joint release (0: a non-private run).
        key: the noise key, kept in both states.
        compute_dtype: dtype of the outputs.
        participation: the pattern each ``s_k`` is computed for.
        state_dtype: dtype of the buffers (see :func:`~opake_core.mf.streaming.matrix_mechanism`).
        shard: this rank's part of a sharded tree (see :func:`~opake_core.mf.streaming.matrix_mechanism`); the
            template and both streams' buffers then hold the local pieces.

    Returns:
        ``(noise_fn, state)`` with ``noise_fn(moments, state) -> (NoisedMoments, state)``.

    Raises:
        ConfigurationError: no ``second_moment_strategy``; the errors of
            :func:`~opake_core.mf.streaming.matrix_mechanism`; sensitivities that change between calls.
        InputTypeError: an input that is not a ``ClippedMoments``.
    """
    if second_moment_strategy is None:
        raise ConfigurationError(
            "paired_mf_gaussian_noise needs second_moment_strategy=<an opake_core.mf strategy> for the second-moment "
            "stream, for example the same strategy as the first stream (whose accountant then covers the pair "
            "unchanged) or band_mf(bands=..., momentum=0.999)."
        )
    n = validate.integer("n_steps", n_steps, minimum=1)
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    concrete = tuple(optimize(s, n, participation=participation) for s in (strategy, second_moment_strategy))
    strategy_sensitivities = tuple(sensitivity(c, n, participation=participation) for c in concrete)
    options = {
        "n_steps": n,
        "noise_multiplier": z,
        "key": key,
        "compute_dtype": compute_dtype,
        "participation": participation,
        "state_dtype": state_dtype,
        "name": "paired_mf_gaussian_noise",
        "shard": shard,
    }
    with torch.profiler.record_function("opake::paired_mf_gaussian_noise_init"):
        first_fn, first_state = matrix_mechanism(template, concrete[0], stream=streaming.STREAM, **options)
        second_fn, second_state = matrix_mechanism(template, concrete[1], stream=SECOND_MOMENT_STREAM, **options)

    def noise_fn(moments: ClippedMoments, state: tuple[Any, Any]) -> tuple[NoisedMoments, Any]:
        if not isinstance(moments, ClippedMoments):
            raise InputTypeError(
                "paired_mf_gaussian_noise expects the ClippedMoments of clipped_grad(..., second_moment=True), got "
                f"{type(moments).__name__}; for a single clipped stream use mf_gaussian_noise."
            )
        if not (isinstance(state, tuple) and len(state) == 2):
            raise InputTypeError(f"noise_fn expects the pair of states it returned, got {type(state).__name__}.")
        first, second = moments.first, moments.second
        factors = (
            (1.0, 1.0)
            if z == 0
            else paired_scale(first.sensitivity, second.sensitivity, strategy_sensitivities=strategy_sensitivities)
        )
        effective = (_scaled(first.sensitivity, factors[0]), _scaled(second.sensitivity, factors[1]))
        latched = getattr(state[0], "sensitivity", None)
        if latched is not None and latched != effective[0]:
            raise ConfigurationError(
                f"paired_mf_gaussian_noise saw the clipped sensitivities change across calls (now first="
                f"{first.sensitivity!r}, second={second.sensitivity!r}). MF privacy proofs assume a constant per-step "
                "sensitivity; adaptive clipping is unsupported with MF noise."
            )
        n1, s1 = first_fn(Clipped(first.value, effective[0]), state[0])
        n2, s2 = second_fn(Clipped(second.value, effective[1]), state[1])
        noised = NoisedMoments(
            Noised(n1.value, first.sensitivity, n1.noise_std), Noised(n2.value, second.sensitivity, n2.noise_std)
        )
        return noised, (s1, s2)

    return noise_fn, (first_state, second_state)
