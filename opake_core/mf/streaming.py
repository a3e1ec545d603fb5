"""The Gaussian matrix mechanism, streamed one step at a time: :func:`matrix_mechanism`.

Step ``t`` adds ``sigma * (C^-1 z)_t`` to the clipped sum, with ``z_t ~ N(0, I)`` drawn by
``random.normal_tree(fold_in(key, stream, t), leaves)`` (one draw per device, cut into the leaves in order), and

    sigma = noise_multiplier * sens(C) * Delta,

``Delta`` the clipped tree's sensitivity (clipping bound / normalizer) and ``sens(C)`` the strategy's sensitivity under
the declared participation. Per-group sensitivities ``Delta_k`` get per-group standard deviations
``sigma_k = z * sqrt(Delta_k * sum_j Delta_j)`` (:func:`noise_std_for`): this allocation minimizes the total noise
variance under ``sum_k Delta_k^2 / sigma_k^2 <= 1 / z^2``, so the whitened release is a Gaussian mechanism with
multiplier ``z`` and sensitivity 1, accounted exactly like the scalar case.

Two faces (as in JAX Privacy, where DP-SGD is matrix factorization with ``C = I``):

* DP-SGD: :func:`opake_core.noise.gaussian_noise` is this mechanism with the identity strategy, no horizon and the
  stream ``"opake.noise.gaussian"``: independent noise ``N(0, (z Delta)^2)`` every step, any number of steps, a
  sensitivity that may change between steps (adaptive clipping).
* DP-FTRL: :func:`mf_gaussian_noise`, a matrix-factorization strategy over a declared horizon of ``n_steps``, stream
  ``"opake.noise.mf_gaussian"``. With ``SingleParticipation`` (default) ``noise_multiplier`` is the per-round
  multiplier of amplified BandMF accounting (jax_privacy's convention, ``stddev(z) = sigma * clip * ||c||``); with a
  multi-participation pattern it is the multiplier of the single Gaussian mechanism covering the whole horizon. The
  matrix mechanism's privacy proof assumes one per-step bound for the whole horizon, so a ``Clipped.sensitivity``
  that differs from the first call's raises (adaptive clipping is unsupported).

``C^-1`` is applied with the memory the strategy needs (:class:`~opake_core.mf._base.StreamPlan`): 0 buffers for the
identity, ``bands - 1`` past outputs for BandMF, ``p - 1`` for BSR (past outputs) and BISR (past ``z``), 1 for
lambda-CGD (the previous ``z``), ``m`` for an ``m``-buffer BLT. Buffers are model-shaped tensors on each leaf's device,
allocated at construction, and kept at unit scale (``sigma`` is applied on output). Their dtype is ``state_dtype``: by
default the compute dtype, widened to float32 for half-precision compute when there are buffers; pass
``state_dtype=torch.bfloat16`` to keep bf16 buffers (half the memory, ~3 significant digits of recursion accuracy).

The key lives in the state. Each call returns a new state and never writes into the old one, so a saved state resumes
the identical noise sequence. Reported ``noise_std``: the per-coordinate standard deviation of the noise actually added
at this step, ``sigma * ||row_t(C^-1)||`` (what DP-AdamBC subtracts), not the scale of ``z``.

Sharded trees (FSDP2): with ``shard=`` (a :class:`~opake_core.sharding.Shard`) a rank noises its own rows only, with
``z_t``'s coordinates of those rows (``random.normal_tree_shard``); ``C^-1`` acts coordinate by coordinate, so its
buffers hold the rank's rows too, and the ranks together release exactly the one-process noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree
import optree.dataclasses
import torch

from opake_core import random, validate
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.mf._base import StreamPlan
from opake_core.mf.participation import SINGLE, Participation, SingleParticipation
from opake_core.mf.sensitivity import sensitivity
from opake_core.mf.strategies import optimize
from opake_core.sharding import Shard
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup, effective, size_groups, writable

__all__ = [
    "SECOND_MOMENT_STREAM",
    "STREAM",
    "GaussianNoiseState",
    "NoiseFn",
    "compute_dtype_of",
    "matrix_mechanism",
    "mf_gaussian_noise",
    "noise_std_for",
]

STREAM = "opake.noise.mf_gaussian"
SECOND_MOMENT_STREAM = "opake.noise.mf_gaussian.second_moment"

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _dtype(name: str, value: Any) -> torch.dtype:
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ConfigurationError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}.")
        return _DTYPES[value]
    if not isinstance(value, torch.dtype):
        raise InputTypeError(f"{name} must be a torch.dtype or a name, got {type(value).__name__}.")
    if value not in _DTYPES.values():
        raise ConfigurationError(f"{name} must be one of {sorted(_DTYPES)}, got {value}.")
    return value


def compute_dtype_of(value: torch.dtype | str) -> torch.dtype:
    """A noise compute dtype from a ``torch.dtype`` or its name (``"float16"``, ``"bfloat16"``, ...)."""
    return _dtype("compute_dtype", value)


def noise_std_for(sensitivity: float | PerGroup, noise_multiplier: float) -> float | PerGroup:
    """The noise standard deviation(s) for a sensitivity: ``z * Delta``, or the per-group allocation above."""
    if noise_multiplier == 0:
        return sensitivity.map(lambda _: 0.0) if isinstance(sensitivity, PerGroup) else 0.0
    if isinstance(sensitivity, PerGroup):
        total = sum(v for _, v in sensitivity.values)
        return sensitivity.map(lambda d: noise_multiplier * math.sqrt(d * total))
    return noise_multiplier * sensitivity


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class GaussianNoiseState:
    """State of the Gaussian (matrix) mechanism.

    Attributes:
        key: the noise key; step ``t`` draws from ``fold_in(key, stream, t)``.
        step: steps already noised.
        buffers: ``num_buffers`` tuples, each with one tensor per leaf (the strategy's streaming memory; none for
            ``C = I``).
        sensitivity: under a horizon, the clipped sensitivity latched on the first call (``None`` before it, and
            always without a horizon).
    """

    key: random.Key = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False, default=0)
    buffers: tuple[tuple[torch.Tensor, ...], ...] = ()
    sensitivity: float | PerGroup | None = optree.dataclasses.field(pytree_node=False, default=None)


NoiseFn = Callable[[Clipped, Any], tuple[Noised, Any]]
"""A privatizer's function: ``noise_fn(clipped, state) -> (noised, new_state)``."""


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


def _add_scaled(
    values: list[torch.Tensor], noise: list[torch.Tensor], stds: list[float], dtype: torch.dtype, inplace: bool
) -> list[torch.Tensor]:
    """``[v + std * x]`` in ``dtype``: one fused launch per distinct std (per group); new tensors, or with ``inplace``
    written into the values that can take them (dtype ``dtype``, dense, none sharing memory; the same bits)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(values)
    into = writable(values) if inplace else [False] * len(values)
    by_std: dict[tuple[float, bool], list[int]] = {}
    for i, std in enumerate(stds):
        by_std.setdefault((std, into[i] and values[i].dtype == dtype), []).append(i)
    for (std, in_place), indices in by_std.items():
        noise_in = [_in(noise[i], dtype) for i in indices]
        if in_place:
            torch._foreach_add_([values[i] for i in indices], noise_in, alpha=std)
            sums = [values[i] for i in indices]
        else:
            sums = torch._foreach_add([_in(values[i], dtype) for i in indices], noise_in, alpha=std)
        for i, total in zip(indices, sums, strict=True):
            out[i] = total
    return out


def _in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is: no dispatch for a no-op conversion)."""
    return x if x.dtype == dtype else x.to(dtype)


def _check_clipped(name: str, clipped: Any) -> None:
    if isinstance(clipped, Noised):
        raise InputTypeError(
            f"{name} expects a Clipped tree, not a Noised one that already went through a noise mechanism."
        )
    if not isinstance(clipped, Clipped):
        raise InputTypeError(
            f"{name} expects a Clipped tree (the output of clipped_grad), got {type(clipped).__name__}. "
            "Wrap values you clipped yourself with opake_core.tree.Clipped(value, sensitivity)."
        )


def matrix_mechanism(
    template: Any,
    strategy: Any,
    *,
    n_steps: int | None,
    noise_multiplier: float,
    key: random.Key,
    stream: str,
    name: str,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    state_dtype: torch.dtype | str | None = None,
    shard: Shard | None = None,
    inplace: bool = False,
) -> tuple[NoiseFn, GaussianNoiseState]:
    """The streamed Gaussian matrix mechanism as a ``(noise_fn, state)`` pair (see the module docstring).

    Args:
        template: a tree of tensors shaped like the clipped sums (or a ``Clipped``): buffers follow its shapes and
            devices. ``None`` is allowed for a strategy without buffers (then any tree is noised).
        strategy: an ``opake_core.mf`` strategy; ``band_mf`` / ``blt`` are optimized here for the horizon.
        n_steps: the horizon, an int >= 1, a call at step ``>= n_steps`` raises; or ``None`` for no horizon, which
            needs noise independent across steps (no buffers) under single participation.
        noise_multiplier: ``z >= 0``; the std of ``z_t`` is ``z * sens(C) * Delta``. 0 is a non-private run.
        key: the noise key, kept in the state.
        stream: the tag that separates this mechanism's draws from others' under the same key.
        name: the mechanism's name in error messages and its profiler label (``opake::<name>``).
        compute_dtype: dtype of the output (fp16, bf16, fp32, fp64).
        participation: the pattern ``sens(C)`` is computed for.
        state_dtype: dtype of the buffers and of the draws; ``None`` for the default above.
        shard: this rank's part of a tree sharded over ranks (:class:`~opake_core.sharding.Shard`, the global shapes
            of the clipped tree): ``noise_fn`` then takes the clipped sum of the rank's own rows (leaves of
            ``shard.local_shapes``, on one device) and adds exactly those coordinates of the one-process noise, so
            the ranks' outputs put together equal the one-process output bit for bit; the template (and so the
            buffers) has the local shapes. ``None``: the whole tree.
        inplace: ``noise_fn`` adds the noise into the clipped tree's own tensors where they have ``compute_dtype``
            (the same bits): for a caller that gives the clipped tree up, such as :func:`~opake_core.dp_step` with
            ``donate=True``. The noise is drawn a group of leaves at a time either way, so the only scratch is one
            group's draw (:data:`GROUP_NUMEL` values).

    Raises:
        InputTypeError: a non-Clipped input, a wrong key or state, ``n_steps`` not an int, a ``shard`` that is not a
            ``Shard``.
        ConfigurationError: ``n_steps < 1``, a bad multiplier or dtype, a strategy that does not fit the horizon,
            a step past the horizon, a sensitivity that changes under a horizon, an infinite sensitivity with noise,
            a tree or template whose leaves do not have the shard's local shapes.
    """
    if n_steps is not None:
        validate.integer("n_steps", n_steps, minimum=1)
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    if not isinstance(key, random.Key):
        raise InputTypeError(f"{name} needs key=opake_core.random.key(seed), got {type(key).__name__}.")
    if shard is not None and not isinstance(shard, Shard):
        raise InputTypeError(
            f"{name}'s shard must be an opake_core.Shard (such as Shard.rows(shapes, rank=..., world_size=...)) or "
            f"None, got {type(shard).__name__}."
        )
    dtype = _dtype("compute_dtype", compute_dtype)
    horizon = 1 if n_steps is None else n_steps
    concrete = optimize(strategy, horizon, participation=participation)
    plan = concrete.plan
    if n_steps is None and (plan.num_buffers or not isinstance(participation, SingleParticipation)):
        raise ConfigurationError(
            f"{name} without a horizon (n_steps=None) needs noise independent across steps under single "
            f"participation, got {type(concrete).__name__} with {plan.num_buffers} buffers and "
            f"{type(participation).__name__}; declare n_steps."
        )
    if state_dtype is not None:
        draw_dtype = _dtype("state_dtype", state_dtype)
    elif plan.num_buffers and dtype in (torch.float16, torch.bfloat16):
        draw_dtype = torch.float32
    else:
        draw_dtype = dtype
    scale = z * sensitivity(concrete, horizon, participation=participation)
    row_norms = np.sqrt(np.cumsum(concrete.noising_coef(horizon) ** 2))  # without a horizon (C = I) all rows are 1
    treedef = None
    buffers: tuple[tuple[torch.Tensor, ...], ...] = ()
    if template is not None or plan.num_buffers:
        leaves, treedef = _template_leaves(name, template)
        _check_local(name, "template", leaves, shard)
        buffers = tuple(
            tuple(torch.zeros(leaf.shape, dtype=draw_dtype, device=leaf.device) for leaf in leaves)
            for _ in range(plan.num_buffers)
        )

    def noise_fn(clipped: Clipped, state: GaussianNoiseState) -> tuple[Noised, GaussianNoiseState]:
        _check_clipped(name, clipped)
        if not isinstance(state, GaussianNoiseState):
            raise InputTypeError(f"noise_fn expects a GaussianNoiseState, got {type(state).__name__}.")
        if len(state.buffers) != plan.num_buffers:
            raise StateError(
                f"the state holds {len(state.buffers)} buffers but this strategy streams with {plan.num_buffers}; "
                "restore a state produced by the same strategy and horizon."
            )
        t = state.step
        if n_steps is not None and t >= n_steps:
            raise ConfigurationError(
                f"MF noise step {t} is outside the calibrated horizon [0, {n_steps}); rebuild the mechanism with a "
                f"larger n_steps (and recalibrate), or stop calling noise_fn after {n_steps} steps."
            )
        if n_steps is not None and state.sensitivity is not None and clipped.sensitivity != state.sensitivity:
            raise ConfigurationError(
                f"{name} saw a varying Clipped.sensitivity across calls (first={state.sensitivity!r}, "
                f"now={clipped.sensitivity!r}). MF privacy proofs assume a constant per-step sensitivity; adaptive "
                "clipping is unsupported with MF noise."
            )
        values, tree = optree.tree_flatten(clipped.value)
        if treedef is not None and tree != treedef:
            raise InputTypeError(f"the clipped tree {tree} does not match the template {treedef}.")
        _check_local(name, "clipped tree", values, shard)
        std = noise_std_for(clipped.sensitivity, scale)
        stds = std.leaf_values() if isinstance(std, PerGroup) else [std] * len(values)
        if len(stds) != len(values):
            raise ConfigurationError(
                f"the per-group sensitivity covers {len(stds)} leaves but the tree has {len(values)}."
            )
        if scale > 0 and math.isinf(effective(clipped.sensitivity)):
            raise ConfigurationError(
                "cannot add noise to a tree with infinite sensitivity (clipping disabled); clip with a finite "
                "clipping_norm, or use noise_multiplier=0 for a non-private run."
            )
        if scale > 0 and max(stds, default=0.0) > torch.finfo(dtype).max / 64:  # no draw reaches 64 std
            raise ConfigurationError(
                f"{name}'s noise standard deviation {max(stds):.3g} (noise multiplier times sensitivity) overflows "
                f"{dtype}: the noised values would be infinite. Lower the noise multiplier or the clipping bound."
            )
        row = float(row_norms[t if n_steps is not None else 0])
        with torch.profiler.record_function(f"opake::{name}"), torch.no_grad():
            if scale == 0:
                out, new_buffers = [v.to(dtype) for v in values], state.buffers
            else:  # one group of leaves at a time: a group's draw is the only scratch of model size's order
                out = [torch.empty(0)] * len(values)
                per_buffer: list[list[torch.Tensor]] = [[] for _ in range(plan.num_buffers)]
                for group, draws in _draw_groups(random.fold_in(state.key, stream, t), values, shard, draw_dtype):
                    xs = []
                    for i, draw in zip(group, draws, strict=True):
                        x, leaf_buffers = _advance(plan, draw, [b[i] for b in state.buffers])
                        for j, b in enumerate(leaf_buffers):
                            per_buffer[j].append(b)
                        xs.append(x)
                    added = _add_scaled([values[i] for i in group], xs, [stds[i] for i in group], dtype, inplace)
                    for i, total in zip(group, added, strict=True):
                        out[i] = total
                    del draws, xs
                new_buffers = tuple(tuple(b) for b in per_buffer)
        latched = clipped.sensitivity if n_steps is not None else None
        reported = noise_std_for(clipped.sensitivity, scale * row)
        noised = Noised(optree.tree_unflatten(tree, out), clipped.sensitivity, reported)
        return noised, GaussianNoiseState(state.key, t + 1, new_buffers, latched)

    return noise_fn, GaussianNoiseState(key, 0, buffers, None)


GROUP_NUMEL = 2**26
"""Values (256 MB in float32) per group of leaves whose noise is drawn at once."""


def _draw_groups(
    k: random.Key, values: list[torch.Tensor], shard: Shard | None, dtype: torch.dtype
) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """``(indices, draws)`` group by group: ``random.normal_tree(k, values)``'s draws, or with a shard the shard's
    coordinates of the one-process draw (the whole tree on one device) shaped like the local ``values``."""
    if shard is None:
        yield from random.normal_tree_groups(k, values, dtype=dtype, group_numel=GROUP_NUMEL)
        return
    device = values[0].device if values else torch.device("cpu")
    for group in size_groups([v.numel() for v in values], GROUP_NUMEL):
        ranges = [shard.ranges[i] if group[0] <= i <= group[-1] else (0, 0) for i in range(len(values))]
        draws = random.normal_tree_shard(k, shard.shapes, ranges, dtype=dtype, device=device)
        yield group, [draws[i].view(values[i].shape) for i in group]


def _check_local(name: str, what: str, leaves: list[torch.Tensor], shard: Shard | None) -> None:
    """A sharded mechanism's leaves are the shard's local pieces, all on one device (one rank's)."""
    if shard is None:
        return
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    if shapes != shard.local_shapes:
        raise ConfigurationError(
            f"{name} was built for a shard whose local leaf shapes are {shard.local_shapes}, but the {what} has "
            f"leaves of shapes {shapes}; pass this rank's local pieces (reduce-scatter the clipped sum to the "
            "shard's rows), or build the shard from the global shapes of this tree."
        )
    devices = {leaf.device for leaf in leaves}
    if len(devices) > 1:
        raise ConfigurationError(
            f"{name} with a shard draws one rank's noise on one device, but the {what} spans "
            f"{sorted(map(str, devices))}; place the rank's pieces on its own device."
        )


def _template_leaves(name: str, template: Any) -> tuple[list[torch.Tensor], Any]:
    value = template.value if isinstance(template, Clipped) else template
    leaves, treedef = optree.tree_flatten(value)
    if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise InputTypeError(f"{name} needs a template tree of tensors (for example the parameters).")
    return leaves, treedef


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
    shard: Shard | None = None,
    inplace: bool = False,
) -> tuple[NoiseFn, GaussianNoiseState]:
    """DP-FTRL's correlated Gaussian noise as a ``(noise_fn, state)`` pair: :func:`matrix_mechanism` over a declared
    horizon on the stream ``STREAM``.

    Args:
        template: a tree of tensors shaped like the clipped sums (or a ``Clipped``): buffers follow its shapes and
            devices.
        strategy: an ``opake_core.mf`` strategy; ``band_mf`` / ``blt`` are optimized here for ``n_steps`` and
            ``participation`` (pass the result of ``opake_core.mf.optimize`` to reuse an optimization).
        n_steps: the horizon, an int >= 1; a call at step ``>= n_steps`` raises.
        noise_multiplier: as in :func:`matrix_mechanism`.
        key: as in :func:`matrix_mechanism`.
        compute_dtype: as in :func:`matrix_mechanism`.
        participation: as in :func:`matrix_mechanism`.
        state_dtype: as in :func:`matrix_mechanism`.
        shard: as in :func:`matrix_mechanism`: this rank's part of a sharded tree; ``template`` then holds the local
            pieces, and so do the buffers (the strategy's memory is sharded with the parameters).
        inplace: as in :func:`matrix_mechanism`: the noise is added into the clipped tree's tensors.

    Returns:
        ``(noise_fn, state)`` with ``noise_fn(clipped, state) -> (Noised, state)``.

    Example: the noise of a 3-step horizon is ``sigma C^-1 z``, so the strategy matrix ``C`` turns it back into
    independent standard normals once divided by ``sigma = z sens(C) Delta`` (here ``z = Delta = 1``).

        >>> import torch
        >>> from opake_core import Clipped, mf, mf_gaussian_noise, random
        >>> strategy, zeros = mf.bsr(bandwidth=2), {"w": torch.zeros(50_000)}
        >>> noise_fn, state = mf_gaussian_noise(zeros, strategy, n_steps=3, noise_multiplier=1.0, key=random.key(0))
        >>> noise = []
        >>> for _ in range(3):
        ...     noised, state = noise_fn(Clipped(zeros, sensitivity=1.0), state)
        ...     noise.append(noised.value["w"].double())
        >>> C = torch.from_numpy(mf.materialize(strategy, 3))
        >>> white = C @ torch.stack(noise) / mf.sensitivity(strategy, 3)
        >>> bool((white.std(dim=1) - 1).abs().max() < 0.01)
        True
        >>> bool((torch.corrcoef(white) - torch.eye(3)).abs().max() < 0.02)
        True
    """
    validate.integer("n_steps", n_steps, minimum=1)
    options = {
        "n_steps": n_steps,
        "noise_multiplier": noise_multiplier,
        "key": key,
        "compute_dtype": compute_dtype,
        "participation": participation,
        "state_dtype": state_dtype,
        "name": "mf_gaussian_noise",
        "shard": shard,
        "inplace": inplace,
    }
    with torch.profiler.record_function("opake::mf_gaussian_noise_init"):
        return matrix_mechanism(template, strategy, stream=STREAM, **options)
