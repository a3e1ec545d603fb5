"""The composed DP step, ``dp_step``, and its presets ``dp_sgd`` and ``dp_ftrl``.

One logical step on a sampled batch:

    per-example gradients -> clip -> sum / expected batch size -> (cross-rank sum) -> noise -> optimizer update

The noise is a value: any privatizer (the contract of :mod:`opake_core.noise`), whose state holds its key. The presets
fix it:

* :func:`dp_sgd`, DP-SGD (Abadi et al. 2016, Algorithm 1): the Gaussian mechanism
  (:func:`opake_core.noise.gaussian_noise`); account it with the sampler's process.
* :func:`dp_ftrl`, DP-FTRL / matrix factorization (Choquette-Choo et al. 2023, arXiv:2306.08153): the correlated noise
  of :func:`opake_core.mf.mf_gaussian_noise` over a declared horizon of ``n_steps``; account it with
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

import optree
import optree.dataclasses
import torch

from opake_core import random, validate
from opake_core.clipping import ADAPTIVE_STREAM, VMAP, AdaptiveRule, AutoSRule, Engine, clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError, StateError
from opake_core.mf import mf_gaussian_noise
from opake_core.mf.participation import SINGLE, Participation
from opake_core.moments import ClippedMoments, NoisedMoments
from opake_core.noise import NoiseFn, gaussian_noise, paired_mf_gaussian_noise
from opake_core.optim import apply_updates
from opake_core.sharding import Shard
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup, writable

__all__ = ["DPState", "StepMetrics", "dp_ftrl", "dp_sgd", "dp_step", "rekeyed", "unkeyed"]


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class DPState:
    """State of a composed step: steps taken so far, the clipping state and the noise mechanism's state (its key and,
    for DP-FTRL, its buffers).

    Example: a step returns the next state and leaves the one it was given as it was, so a saved state replays.

        >>> import torch
        >>> from opake_core import dp_sgd, optim, random
        >>> sgd = optim.sgd(lr=0.1)
        >>> step_fn, first = dp_sgd(lambda w, x: x @ w, clipping_norm=1.0, noise_multiplier=1.0, key=random.key(0),
        ...                         optimizer=sgd, expected_batch_size=4.0)
        >>> w, batch = torch.zeros(3), (torch.ones(4, 3),)
        >>> w1, _, second, _ = step_fn(w, sgd.init(w), first, batch)
        >>> w1_again, _, _, _ = step_fn(w, sgd.init(w), first, batch)
        >>> first.step, second.step, torch.equal(w1, w1_again)
        (0, 1, True)
    """

    step: int = optree.dataclasses.field(pytree_node=False)
    clip: Any
    noise: Any


@dataclass(frozen=True)
class StepMetrics:
    """What one step reports.

    ``noise_std`` and ``step`` are public. ``batch_size``, ``loss`` (mean per-example loss, a tensor), ``clip_rate``
    (a tensor), ``nonfinite`` and ``aux`` (with ``has_aux``: the loss function's per-example auxiliary values,
    stacked ``[B, ...]``) are exact statistics of the private batch: **outside the privacy guarantee**.

    ``nonfinite`` (an int64 scalar tensor) counts the examples whose per-example gradient was not finite (NaN or inf,
    even where their loss is finite): clipping gave them scale 0, so they added nothing, while the step still
    released its noise and is accounted in full. The step never warns about them itself (that would wait for the
    device at every step); read the count here. When it equals ``batch_size`` at every step, the run releases noise
    only.

    Example:

        >>> import torch
        >>> from opake_core import dp_sgd, optim, random
        >>> sgd = optim.sgd(lr=0.1)
        >>> step_fn, dp_state = dp_sgd(lambda w, x: x @ w, clipping_norm=1.0, noise_multiplier=1.0, key=random.key(0),
        ...                            optimizer=sgd, expected_batch_size=4.0)
        >>> x = torch.tensor([[0.5, 0.0], [3.0, 4.0], [0.0, 0.1]])  # gradient norms 0.5, 5 and 0.1
        >>> _, _, _, metrics = step_fn(torch.zeros(2), sgd.init(torch.zeros(2)), dp_state, (x,))
        >>> metrics.step, metrics.noise_std, metrics.batch_size, round(metrics.clip_rate.item(), 4)
        (0, 0.25, 3, 0.3333)
    """

    step: int
    noise_std: float | PerGroup
    batch_size: int
    loss: torch.Tensor
    clip_rate: torch.Tensor
    nonfinite: torch.Tensor
    aux: Any = None


StepFn = Callable[[Any, Any, DPState, tuple[torch.Tensor, ...]], tuple[Any, Any, DPState, StepMetrics]]


def dp_step(
    loss_fn: Callable[..., torch.Tensor],
    *,
    clipping: float | PerGroup | AutoSRule | AdaptiveRule,
    noise: tuple[NoiseFn, Any],
    optimizer: Any,
    expected_batch_size: float,
    microbatch_size: int | None = None,
    engine: Engine = VMAP,
    reduce: Callable[[Clipped], Clipped] | None = None,
    reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    clipping_key: random.Key | None = None,
    has_aux: bool = False,
    second_moment: bool = False,
    sum_like: Any = None,
    donate: bool = False,
) -> tuple[StepFn, DPState]:
    """A composed DP step as ``(step_fn, dp_state)``: clip, sum, noise with any privatizer, update.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example (see
            :func:`~opake_core.clipping.clipped_grad`).
        clipping: the per-example rule: an L2 bound (float, ``math.inf`` for none, or PerGroup), or a rule from
            :func:`~opake_core.clipping.auto_s` or :func:`~opake_core.clipping.adaptive`. Adaptive clipping releases a
            noisy count too: account it with ``accounting.adaptive_clipping``.
        noise: a privatizer's ``(noise_fn, state)`` pair (the contract of :mod:`opake_core.noise`), for example
            ``gaussian_noise(noise_multiplier=z, key=key)``; its state, key included, lives in ``dp_state.noise``.
        optimizer: an :mod:`opake_core.optim` optimizer (``init`` / ``update``).
        expected_batch_size: the public expected batch size (sampling rate times dataset size); the clipped sum is
            divided by it, so the sensitivity is ``clipping / expected_batch_size``.
        microbatch_size: examples per chunk (memory only; the result does not depend on it).
        engine: how per-example gradients are formed and each chunk runs (:class:`~opake_core.clipping.Engine`).
        reduce: applied to the clipped, normalized sum before the noise (default: identity). Data-parallel adapters
            pass a cross-rank SUM here (``opake_torch.distributed.sum_gradients``), so that the noise is added once,
            after the sum; it must return a :class:`~opake_core.tree.Clipped` with the same sensitivity.
        reduce_count: adaptive clipping under data parallelism: sums its ``[clipped, batch size]`` counts across
            ranks (see :func:`~opake_core.clipping.clipped_grad`).
        clipping_key: the key of adaptive clipping's count noise (required for adaptive clipping, refused
            otherwise); it lives in ``dp_state.clip``.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the per-example ``aux`` values reach ``metrics.aux``.
        second_moment: also clip and release the sum of squared clipped gradients (private second moments,
            :mod:`opake_core.moments`): the noise then gets a :class:`~opake_core.moments.ClippedMoments` pair
            (``gaussian_noise`` noises it as one release) and the optimizer must take the noised pair
            (:func:`~opake_core.optim.private_moments.private_moments_adam`). Refused with a noise-variance
            bias-corrected optimizer (``noise_bias_correction=True``): the two are alternatives.
        sum_like: the tree in which the clipped sum is formed before ``reduce``, with the structure of ``params``
            (default: ``params`` itself). It is what ``loss_fn`` gets as its parameters; the optimizer still gets
            ``params``. For parameters sharded over ranks (FSDP2), ``params`` and the optimizer state hold this
            rank's rows, ``sum_like`` stands for the global shapes (zero-stride stand-ins such as
            ``torch.zeros((), dtype=..., device=...).expand(shape)``, whose values the loss does not read), and
            ``reduce`` reduce-scatters the full-size sum to this rank's rows; noise that rank's rows with a sharded
            privatizer (``gaussian_noise(..., shard=...)``).
        donate: the caller gives up ``params`` and ``opt_state`` at every call (as JAX's ``donate_argnums``): the new
            parameters are written into the old ones' tensors and, for an optimizer built ``in_place`` (Adam, AdamW,
            SGD, momentum), the new state into the old state's and the updates into the noised sum's. The values are
            the same bits; the step then allocates no model-sized tree beyond the clipped sum (with a privatizer
            built ``inplace=True`` the noise goes into that sum too). The caller must not read the inputs after the
            call, and a call that raises may leave them partly updated.

    Returns:
        ``step_fn(params, opt_state, dp_state, batch) -> (params, opt_state, dp_state, metrics)`` where ``batch`` is
        a tuple of per-example tensors ``[B, ...]`` (``loss_fn(params, *batch[i])`` is one example's loss). A step
        depends only on its inputs: the same state replays the same step.

    Example: with the noise off (multiplier 0, a non-private run), one SGD step moves the parameters by exactly
    ``-lr`` times the clipped sum divided by the expected batch size.

        >>> import torch
        >>> from opake_core import clipped_grad, dp_step, gaussian_noise, optim, random
        >>> loss_fn = lambda w, x, y: (x @ w - y) ** 2
        >>> x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.ones(6)
        >>> sgd = optim.sgd(lr=0.5)
        >>> noise = gaussian_noise(noise_multiplier=0.0, key=random.key(0))
        >>> step_fn, dp_state = dp_step(loss_fn, clipping=1.0, noise=noise, optimizer=sgd, expected_batch_size=8.0)
        >>> w = torch.zeros(4)
        >>> w1, _, dp_state, metrics = step_fn(w, sgd.init(w), dp_state, (x, y))
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=8.0)
        >>> torch.allclose(w1, w - 0.5 * grad_fn(w, x, y, state=state)[0].value)
        True
    """
    if not (isinstance(noise, tuple) and len(noise) == 2 and callable(noise[0])):
        raise InputTypeError(
            f"noise must be a privatizer's (noise_fn, state) pair, such as gaussian_noise(...), got {noise!r:.80}."
        )
    noise_fn, noise_state = noise
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise InputTypeError(
            f"optimizer must be an opake_core.optim optimizer (init / update), such as optim.adam(lr=1e-3), got "
            f"{type(optimizer).__name__} {optimizer!r:.40}."
        )
    if second_moment:
        _check_moments_optimizer(optimizer, "second_moment=True")
    sum_structure = None if sum_like is None else _sum_structure(sum_like)
    # an optimizer that honours update(inplace=True) and applies its update in place (Optimizer.apply_in_place)
    in_place = donate and getattr(optimizer, "in_place", False) and callable(getattr(optimizer, "apply_in_place", None))
    grad_fn, clip_state = clipped_grad(
        loss_fn,
        clipping_norm=clipping,
        batch_argnums=slice(1, None),
        normalize_by=validate.positive("expected_batch_size", expected_batch_size),
        microbatch_size=microbatch_size,
        return_diagnostics=True,
        key=clipping_key,
        engine=engine,
        reduce_count=reduce_count,
        has_aux=has_aux,
        second_moment=second_moment,
    )

    def step_fn(
        params: Any, opt_state: Any, dp_state: DPState, batch: tuple[torch.Tensor, ...]
    ) -> tuple[Any, Any, DPState, StepMetrics]:
        if not isinstance(dp_state, DPState):
            raise InputTypeError(f"step_fn expects the DPState its factory returned, got {type(dp_state).__name__}.")
        if not isinstance(batch, tuple):
            raise InputTypeError(f"batch must be a tuple of per-example tensors, got {type(batch).__name__}.")
        if sum_structure is not None and optree.tree_structure(params) != sum_structure:
            raise InputTypeError(
                f"sum_like must have the tree structure of params: sum_like is {sum_structure}, params is "
                f"{optree.tree_structure(params)}; build sum_like from the same parameter tree."
            )
        with torch.profiler.record_function("opake::dp_step"):
            (clipped, *aux, diagnostics), clip = grad_fn(
                params if sum_like is None else sum_like, *batch, state=dp_state.clip
            )
            noised, noise = noise_fn(_reduced(reduce, clipped), dp_state.noise)
            del clipped  # each model-sized tree is let go once used, before the next one is formed (peak memory)
            if isinstance(noised, NoisedMoments):
                _check_moments_optimizer(optimizer, f"the noise mechanism's {type(noised).__name__} output")
            noise_std = noised.noise_std
            if in_place and isinstance(noised, Noised) and all(writable(optree.tree_leaves(noised.value))):
                # the noised sum is the step's own (unless a privatizer returned a stand-in it cannot overwrite)
                params, opt_state = optimizer.apply_in_place(noised, opt_state, params)
                del noised
            else:
                updates, opt_state = optimizer.update(noised, opt_state, params=params)
                del noised
                params = apply_updates(params, updates, inplace=donate)
                del updates
        losses = diagnostics.losses
        metrics = StepMetrics(
            step=dp_state.step,
            noise_std=noise_std,
            batch_size=diagnostics.batch_size,
            loss=losses.mean() if losses.numel() else torch.zeros((), device=losses.device),
            clip_rate=diagnostics.clip_rate,
            nonfinite=diagnostics.nonfinite,
            aux=aux[0] if aux else None,
        )
        return params, opt_state, DPState(dp_state.step + 1, clip, noise), metrics

    return step_fn, DPState(0, clip_state, noise_state)


def _sum_structure(sum_like: Any) -> Any:
    """The tree structure of ``sum_like``, checked to be a non-empty tree of floating-point tensors."""
    leaves, structure = optree.tree_flatten(sum_like)
    if not leaves or not all(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in leaves):
        raise InputTypeError(
            f"sum_like must be a tree of floating-point tensors with the structure of params, got {sum_like!r:.80}."
        )
    return structure


def _check_sharded(shard: Shard | None, step_options: dict[str, Any], name: str) -> None:
    """A sharded step forms the clipped sum in the global shapes (``sum_like``) and reduces it to the shard's rows."""
    if shard is None:
        return
    if not isinstance(shard, Shard):
        raise InputTypeError(f"{name}'s shard must be an opake_core.Shard or None, got {type(shard).__name__}.")
    sum_like = step_options.get("sum_like")
    shapes = None if sum_like is None else tuple(tuple(getattr(x, "shape", ())) for x in optree.tree_leaves(sum_like))
    if shapes != shard.shapes:
        raise ConfigurationError(
            f"{name} with shard= forms the clipped sum in the global shapes {shard.shapes}, got sum_like with leaf "
            f"shapes {shapes}; pass sum_like= a tree of the global shapes (zero-stride stand-ins, "
            "torch.zeros((), dtype=..., device=...).expand(shape)) in the leaf order of params."
        )
    if step_options.get("reduce") is None and shard.local_shapes != shard.shapes:
        raise ConfigurationError(
            f"{name} with shard= needs reduce= to bring the full-size clipped sum to this rank's rows (a "
            "reduce-scatter across ranks); without it the rank's noise and update would not fit its parameters."
        )


def _check_moments_optimizer(optimizer: Any, what: str) -> None:
    """Second moments from a private stream need an optimizer that takes them, and exclude bias correction."""
    if getattr(optimizer, "noise_aware", False):
        raise ConfigurationError(
            f"{what} (private second moments) cannot be combined with the noise-variance bias correction of "
            f"{getattr(optimizer, 'name', type(optimizer).__name__)} (noise_bias_correction=True): both remove the "
            "noise from Adam's second moment, together they would correct twice. Pick one: "
            "opake_core.optim.private_moments_adam for the private second moments, or a bias-corrected optimizer "
            "with second_moment=False and a single-stream noise."
        )
    if not getattr(optimizer, "takes_moments", False):
        raise ConfigurationError(
            f"{what} releases a pair of streams (NoisedMoments) that "
            f"{getattr(optimizer, 'name', type(optimizer).__name__)} cannot take; use "
            "opake_core.optim.private_moments_adam(...), or drop the second moment."
        )


def _reduced(reduce: Callable[[Clipped], Clipped] | None, clipped: Clipped | ClippedMoments) -> Any:
    """``reduce(clipped)`` (a cross-rank sum), checked to keep the type and the sensitivity of the clipped sum; a
    :class:`~opake_core.moments.ClippedMoments` pair is reduced stream by stream."""
    if reduce is None:
        return clipped
    if isinstance(clipped, ClippedMoments):
        return ClippedMoments(_reduced(reduce, clipped.first), _reduced(reduce, clipped.second))
    out = reduce(clipped)
    if not isinstance(out, Clipped) or isinstance(out, Noised) or out.sensitivity != clipped.sensitivity:
        raise InputTypeError(
            f"reduce must return an un-noised Clipped with the same sensitivity ({clipped.sensitivity!r}), got "
            f"{type(out).__name__} with sensitivity {getattr(out, 'sensitivity', None)!r}; sum the clipped values only."
        )
    return out


def dp_sgd(
    loss_fn: Callable[..., torch.Tensor],
    *,
    clipping_norm: float | PerGroup | AutoSRule | AdaptiveRule,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    shard: Shard | None = None,
    donate: bool = False,
    **step_options: Any,
) -> tuple[StepFn, DPState]:
    """DP-SGD: :func:`dp_step` with the Gaussian mechanism of :func:`~opake_core.noise.gaussian_noise`.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example.
        clipping_norm: the ``clipping`` rule of :func:`dp_step`; adaptive clipping's count noise is keyed by
            ``fold_in(key, ADAPTIVE_STREAM)``.
        noise_multiplier: ``z``; the noise std is ``z * clipping_norm / expected_batch_size``. 0 = non-private.
        key: the run's noise key, kept in ``dp_state``: the noise of step ``t`` depends only on ``(key, t)``.
        compute_dtype: dtype the noise is drawn and added in.
        shard: parameters sharded over ranks (FSDP2): this rank's :class:`~opake_core.sharding.Shard`; ``params``
            hold its rows, ``sum_like`` (required then, of the shard's global shapes) and ``reduce`` (a
            reduce-scatter to the rank's rows) are passed to :func:`dp_step`, and the rank draws exactly its rows
            of the one-process noise.
        donate: as in :func:`dp_step`; the noise is then added into the clipped sum's tensors too.
        **step_options: the other arguments of :func:`dp_step` (``optimizer``, ``expected_batch_size``, and
            optionally ``microbatch_size``, ``engine``, ``reduce``, ``reduce_count``, ``sum_like``).

    Example: what a step adds to the clipped update is Gaussian noise of standard deviation
    ``lr * noise_multiplier * clipping_norm / expected_batch_size``.

        >>> import torch
        >>> from opake_core import clipped_grad, dp_sgd, optim, random
        >>> loss_fn = lambda w, x: x @ w
        >>> x = torch.randn(16, 20_000, generator=torch.Generator().manual_seed(0))
        >>> sgd = optim.sgd(lr=1.0)
        >>> step_fn, dp_state = dp_sgd(loss_fn, clipping_norm=1.0, noise_multiplier=2.0, key=random.key(0),
        ...                            optimizer=sgd, expected_batch_size=16.0)
        >>> w = torch.zeros(20_000)
        >>> w1, opt_state, dp_state, metrics = step_fn(w, sgd.init(w), dp_state, (x,))
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, normalize_by=16.0)
        >>> noise = (w - w1) - grad_fn(w, x, state=state)[0].value
        >>> metrics.noise_std, round(noise.std().item(), 2)
        (0.125, 0.12)
    """
    _check_sharded(shard, step_options, "dp_sgd")
    noise = gaussian_noise(
        noise_multiplier=noise_multiplier, key=key, compute_dtype=compute_dtype, shard=shard, inplace=donate
    )
    count_key = random.fold_in(key, ADAPTIVE_STREAM) if isinstance(clipping_norm, AdaptiveRule) else None
    return dp_step(loss_fn, clipping=clipping_norm, noise=noise, clipping_key=count_key, donate=donate, **step_options)


def dp_ftrl(
    loss_fn: Callable[..., torch.Tensor],
    *,
    params: Any,
    strategy: Any,
    n_steps: int,
    clipping_norm: float | PerGroup | AutoSRule,
    noise_multiplier: float,
    key: random.Key,
    compute_dtype: torch.dtype | str = torch.float32,
    participation: Participation = SINGLE,
    second_moment_strategy: Any = None,
    shard: Shard | None = None,
    donate: bool = False,
    **step_options: Any,
) -> tuple[StepFn, DPState]:
    """DP-FTRL: :func:`dp_step` with the correlated noise of :func:`~opake_core.mf.mf_gaussian_noise`.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example.
        params: a tree shaped like the parameters: the noise buffers (the strategy's streaming memory) follow its
            shapes and devices and live in ``dp_state.noise``.
        strategy: an :mod:`opake_core.mf` strategy; specifications are optimized here once for ``n_steps`` and
            ``participation``.
        n_steps: the declared horizon; ``step_fn`` raises StateError at step ``n_steps``.
        clipping_norm: a fixed per-example L2 bound (float or PerGroup) or AUTO-S. Adaptive clipping is refused: the
            matrix mechanism needs one sensitivity for the whole horizon.
        noise_multiplier: ``z``; the noise of step ``t`` is ``z * sens(C, participation) * clipping_norm /
            expected_batch_size * (C^-1 w)_t``. Account it with ``accounting.mf_process(strategy, sampler=...,
            noise_multiplier=z, n_steps=n_steps, participation=participation)``. 0 = non-private.
        key: the run's noise key, kept in ``dp_state``.
        compute_dtype: dtype the noise is added in.
        participation: the pattern the noise is scaled for (single participation: the per-round convention of
            amplified accounting).
        second_moment_strategy: with ``second_moment=True`` (private second moments), the strategy of the second
            stream's own correlated noise (:func:`~opake_core.noise.paired_mf_gaussian_noise`; the same strategy as
            ``strategy`` keeps ``mf_process(strategy, ...)`` valid for every sampler). Required then, refused
            otherwise.
        shard: parameters sharded over ranks (FSDP2), as in :func:`dp_sgd`; ``params`` then holds this rank's
            rows, and so do the strategy's buffers: the streaming memory is sharded with the parameters.
        donate: as in :func:`dp_sgd`.
        **step_options: the other arguments of :func:`dp_step` (``optimizer``, ``expected_batch_size``, and
            optionally ``microbatch_size``, ``engine``, ``reduce``, ``second_moment``, ``sum_like``).

    Example: BandMF with 2 bands over a horizon of 4 steps (to be sampled and accounted with cyclic Poisson sampling
    over 2 groups, see :func:`~opake_core.accounting.mf_process`); a fifth step is refused.

        >>> import torch
        >>> from opake_core import StateError, dp_ftrl, mf, optim, random
        >>> strategy = mf.optimize(mf.band_mf(bands=2), 4)
        >>> sgd, w = optim.sgd(lr=0.1), torch.zeros(3)
        >>> step_fn, dp_state = dp_ftrl(lambda w, x: x @ w, params=w, strategy=strategy, n_steps=4, clipping_norm=1.0,
        ...                             noise_multiplier=1.0, key=random.key(0), optimizer=sgd,
        ...                             expected_batch_size=50.0)
        >>> opt_state = sgd.init(w)
        >>> for _ in range(4):
        ...     w, opt_state, dp_state, metrics = step_fn(w, opt_state, dp_state, (torch.ones(50, 3),))
        >>> try:
        ...     step_fn(w, opt_state, dp_state, (torch.ones(50, 3),))
        ... except StateError:
        ...     print("past the horizon")
        past the horizon
    """
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, numbers.Real | PerGroup | AutoSRule):
        raise ConfigurationError(
            f"dp_ftrl needs a fixed clipping_norm (a number or PerGroup), got {type(clipping_norm).__name__}; "
            "adaptive clipping is refused under matrix-factorization noise, whose privacy proof assumes a constant "
            "per-step sensitivity. Use a fixed bound (or dp_sgd for adaptive clipping)."
        )
    second_moment = step_options.get("second_moment", False)
    if second_moment and second_moment_strategy is None:
        raise ConfigurationError(
            "dp_ftrl with second_moment=True needs second_moment_strategy=<an opake_core.mf strategy> for the "
            "second-moment stream's correlated noise, for example the same strategy as strategy= (then the "
            "first strategy's accountant covers the pair unchanged)."
        )
    if second_moment_strategy is not None and not second_moment:
        raise ConfigurationError(
            "dp_ftrl got second_moment_strategy= without second_moment=True; pass second_moment=True to release "
            "private second moments, or drop second_moment_strategy."
        )
    _check_sharded(shard, step_options, "dp_ftrl")
    noise_options = {
        "n_steps": n_steps,
        "noise_multiplier": noise_multiplier,
        "key": key,
        "compute_dtype": compute_dtype,
        "participation": participation,
        "shard": shard,
    }
    if second_moment:
        noise = paired_mf_gaussian_noise(
            params, strategy, second_moment_strategy=second_moment_strategy, **noise_options
        )
    else:
        noise = mf_gaussian_noise(params, strategy, inplace=donate, **noise_options)
    step_fn, dp_state = dp_step(loss_fn, clipping=clipping_norm, noise=noise, donate=donate, **step_options)

    def within_horizon(
        params: Any, opt_state: Any, dp_state: DPState, batch: tuple[torch.Tensor, ...]
    ) -> tuple[Any, Any, DPState, StepMetrics]:
        if isinstance(dp_state, DPState) and dp_state.step >= n_steps:  # refused before any gradient is computed
            raise StateError(
                f"DP-FTRL step {dp_state.step} is past the declared horizon of n_steps={n_steps} (accounted as a "
                "whole); build a new run with a larger n_steps, recalibrated, to train longer."
            )
        return step_fn(params, opt_state, dp_state, batch)

    return within_horizon, dp_state


def rekeyed(state: Any, keys_from: Any) -> Any:
    """``state`` with every key replaced by the one at the same place in ``keys_from``, a state of the same structure
    (a fresh ``dp_state`` built with this segment's keys); counters, bounds and buffers stay ``state``'s.

    With :func:`unkeyed` it keeps keys out of saved states: a checkpoint stores ``unkeyed(dp_state)`` and its keys
    apart, and a resume continues ``rekeyed(saved, fresh)``. A resumed run that starts a new segment with new keys
    thereby never adds noise drawn for one trajectory to another.
    """
    if isinstance(state, random.Key) or isinstance(keys_from, random.Key):
        return keys_from
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        fields = dataclasses.fields(state)
        return dataclasses.replace(
            state, **{f.name: rekeyed(getattr(state, f.name), getattr(keys_from, f.name, None)) for f in fields}
        )
    if type(state) in (tuple, list):
        others = keys_from if type(keys_from) is type(state) and len(keys_from) == len(state) else [None] * len(state)
        return type(state)(rekeyed(a, b) for a, b in zip(state, others, strict=True))
    return state


def unkeyed(state: Any) -> Any:
    """``state`` with every key replaced by None: what a checkpoint stores (see :func:`rekeyed`)."""
    return rekeyed(state, None)
