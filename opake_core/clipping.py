"""Per-example gradient clipping: ``clipped_grad``.

Notation: a batch of ``B`` examples, per-example gradients ``g_i`` (one pytree each), a clipping bound ``C`` (or one
bound ``C_k`` per group of leaves) and a public normalizer ``n`` (the expected batch size in DP-SGD). The released
value is

    sum_i  g_i * min(1, C / ||g_i||)   /  n          (global clipping)

with the norm taken over all leaves of ``g_i``, or per group with ``C_k`` for per-group clipping. Its L2
sensitivity under adding or removing one example is ``C / n`` (``sqrt(sum_k C_k^2) / n`` per group).

How it is computed:

* ``torch.func.vmap(grad(loss_fn))`` over chunks of ``microbatch_size`` examples; each chunk is clipped and summed
  at once, so per-example gradients never exist for more than one chunk. The running sum is kept in float32 (float64
  for float64 parameters), whatever the parameter dtype. The result does not depend on the chunk size beyond float
  summation order.
* Squared norms are accumulated in float64 for every dtype, so huge entries cannot overflow and the scale is exact to
  well below the storage precision. The scale is ``min(1, C * (1 - 4u) / ||g_i||)`` with ``u`` the unit roundoff of
  the accumulation dtype: the margin absorbs the rounding of the scale and of the product, so every stored clipped
  contribution satisfies ``||fl(scale * g_i)|| <= C`` in the dtype it is stored in.
* An example whose gradient contains NaN or infinity contributes nothing (its scale is 0); its presence is still
  counted in the diagnostics.
* ``clipping_norm=math.inf`` disables clipping (scale 1); the sensitivity is then infinite, which only a
  non-private run (noise multiplier 0) accepts.
* Randomness inside the loss (dropout) is drawn independently for every example (``vmap(randomness="different")``).

Two other rules replace the fixed bound (pass them as ``clipping_norm``):

* :func:`auto_s` (AUTO-S, Bu et al. 2023, "Automatic clipping", arXiv 2206.07136): every example is scaled by
  ``R / (||g_i|| + gamma)``, so each contribution has norm below ``R``; the sensitivity is ``R / n``.
* :func:`adaptive` (Andrew, Thakkar, McMahan, Ramaswamy 2021, arXiv 1905.03871, Algorithm 1): the bound follows a
  target quantile of the per-example norms, ``C <- C * exp(-eta * (b - gamma))`` where ``b`` is a noisy estimate of
  the fraction of unclipped examples. The count is released with Gaussian noise of std
  ``count_noise_fraction * n``; account for it with ``accounting.adaptive_clipping``. Updating the bound reads one
  number from the device per step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import optree
import optree.dataclasses
import torch
from torch.func import grad, vmap

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError, VmapCompatibilityError
from opake_core.tree import NAMESPACE, Clipped, PerGroup, leaf_paths

__all__ = [
    "AdaptiveClipState",
    "AdaptiveRule",
    "AutoSRule",
    "ClipDiagnostics",
    "FixedClipState",
    "MaterializedGradients",
    "PerExampleGradients",
    "adaptive",
    "auto_s",
    "clip_scales",
    "clipped_grad",
]

ADAPTIVE_STREAM = "opake.clipping.adaptive"


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class FixedClipState:
    """State of fixed-bound clipping: it holds nothing and comes back unchanged from every call."""


@dataclass(frozen=True)
class AutoSRule:
    """AUTO-S: scale each example by ``bound / (||g|| + gamma)`` (build with :func:`auto_s`)."""

    bound: float
    gamma: float


@dataclass(frozen=True)
class AdaptiveRule:
    """Quantile-tracking adaptive clipping (build with :func:`adaptive`)."""

    initial_clipping_norm: float
    target_quantile: float
    learning_rate: float
    count_noise_fraction: float
    clipping_norm_min: float
    clipping_norm_max: float


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class AdaptiveClipState:
    """State of adaptive clipping: the bound for the next call, the number of calls, and the count-noise key."""

    clipping_norm: float = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False)
    key: random.Key = optree.dataclasses.field(pytree_node=False)


def _positive_number(value: Any, name: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name} must be a number, got {type(value).__name__}.")
    if not 0 < value < math.inf and not (allow_inf and value == math.inf):
        raise ConfigurationError(f"{name} must be positive{'' if allow_inf else ' and finite'}, got {value!r}.")
    return float(value)


def auto_s(bound: float = 1.0, *, gamma: float = 0.01) -> AutoSRule:
    """AUTO-S normalization with bound ``R = bound`` and stability constant ``gamma`` (both > 0)."""
    return AutoSRule(_positive_number(bound, "bound"), _positive_number(gamma, "gamma"))


def adaptive(
    initial_clipping_norm: float = 1.0,
    *,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_noise_fraction: float = 0.05,
    clipping_norm_min: float = 1e-3,
    clipping_norm_max: float = 1e3,
) -> AdaptiveRule:
    """Adaptive clipping that tracks the ``target_quantile`` of per-example norms (Andrew et al. 2021).

    Args:
        initial_clipping_norm: the bound of the first step.
        target_quantile: the fraction of examples that should stay unclipped, in (0, 1).
        learning_rate: ``eta`` of the geometric update, > 0.
        count_noise_fraction: the count's noise std as a fraction of the expected batch size, > 0.
        clipping_norm_min, clipping_norm_max: the bound stays in this range.
    """
    if not isinstance(target_quantile, int | float) or not 0 < target_quantile < 1:
        raise ConfigurationError(f"target_quantile must be in (0, 1), got {target_quantile!r}.")
    low = _positive_number(clipping_norm_min, "clipping_norm_min")
    high = _positive_number(clipping_norm_max, "clipping_norm_max", allow_inf=True)
    if not high > low:
        raise ConfigurationError(f"clipping_norm_max ({high}) must exceed clipping_norm_min ({low}).")
    return AdaptiveRule(
        _positive_number(initial_clipping_norm, "initial_clipping_norm"),
        float(target_quantile),
        _positive_number(learning_rate, "learning_rate"),
        _positive_number(count_noise_fraction, "count_noise_fraction"),
        low,
        high,
    )


@dataclass(frozen=True)
class ClipDiagnostics:
    """Exact per-batch statistics of one clipping call.

    These are computed from the private data without noise: they are **outside the privacy guarantee**. Keep them
    private or do not log them.

    Attributes:
        norms: float32 tensor ``[B]``, each example's gradient L2 norm before clipping (NaN for a non-finite one).
        clip_rate: float32 scalar tensor, fraction of examples whose norm exceeded its bound (any group exceeded, for
            per-group bounds); 0 for an empty batch.
        losses: tensor ``[B]`` of per-example loss values.
        batch_size: ``B``, the realized number of examples.
    """

    norms: torch.Tensor
    clip_rate: torch.Tensor
    losses: torch.Tensor
    batch_size: int


def _as_argnums(value: Any, name: str, *, allow_empty: bool) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise InputTypeError(f"{name} must be an int or a tuple of ints, got {value!r}.")
    items = tuple(items)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigurationError(f"{name} must hold non-negative ints, got {value!r}.")
    if not items and not allow_empty:
        raise ConfigurationError(f"{name} must name at least one argument, got {value!r}.")
    if len(set(items)) != len(items):
        raise ConfigurationError(f"{name} repeats an argument: {value!r}.")
    return items


def _check_bound(clipping_norm: Any) -> float | PerGroup | AutoSRule | AdaptiveRule:
    if isinstance(clipping_norm, AutoSRule | AdaptiveRule):
        return clipping_norm
    if isinstance(clipping_norm, PerGroup):
        for group, bound in clipping_norm.values:
            if not bound > 0:
                raise ConfigurationError(f"clipping_norm for group {group!r} must be positive, got {bound!r}.")
        return clipping_norm
    if isinstance(clipping_norm, bool) or not isinstance(clipping_norm, int | float):
        raise InputTypeError(
            f"clipping_norm must be a positive float, math.inf or a PerGroup, got {type(clipping_norm).__name__}."
        )
    if not clipping_norm > 0:  # refuses NaN too
        raise ConfigurationError(f"clipping_norm must be positive (math.inf disables clipping), got {clipping_norm!r}.")
    return float(clipping_norm)


def _accumulation_dtype(leaf: torch.Tensor) -> torch.dtype:
    return torch.float64 if leaf.dtype == torch.float64 else torch.float32


def _vmap_error(exc: RuntimeError) -> VmapCompatibilityError:
    text = str(exc)
    if "data-dependent control flow" in text or ".item()" in text:
        cause = (
            "the loss branches on a tensor value (an `if` on a tensor, `.item()`, or a Python conversion). vmap runs "
            "every example through the same operations. Replace the branch with torch.where or compute both sides."
        )
    elif "inplace" in text or "in-place" in text or "broadcast shape" in text:
        cause = (
            "the loss (or the model) modifies a tensor in place, e.g. `x.add_(y)` or `x[:, 0] = 0`. Write it out of "
            "place: `x = x + y`, `x = torch.cat([zeros, x[:, 1:]], dim=1)`."
        )
    else:
        cause = "an operation in the loss has no vmap support. Run the loss on one example outside vmap to locate it."
    return VmapCompatibilityError(f"the loss cannot run per example under torch.func.vmap: {cause} (torch: {text})")


def _runs_without_vmap(per_example: Callable[..., Any], args: tuple[Any, ...], batch_args: tuple[int, ...]) -> bool:
    """Whether the per-example function runs on the first example alone: then a failure under vmap is vmap's."""
    single = [optree.tree_map(lambda x: x[0], a) if i in batch_args else a for i, a in enumerate(args)]
    try:
        per_example(*single)
    except Exception:
        return False
    return True


def _batch_size(batch: list[Any]) -> int:
    sizes = {
        leaf.shape[0] if leaf.dim() else -1 for leaf in optree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)
    }
    if not sizes:
        raise InputTypeError("the batch arguments hold no tensor; per-example arguments must be tensors [B, ...].")
    if -1 in sizes or len(sizes) != 1:
        raise ConfigurationError(
            f"every batched tensor needs the same leading batch dimension, got sizes {sorted(sizes)}."
        )
    return sizes.pop()


def clipped_grad(
    loss_fn: Callable[..., Any],
    *,
    clipping_norm: float | PerGroup,
    argnums: int | tuple[int, ...] = 0,
    batch_argnums: int | tuple[int, ...] = 1,
    normalize_by: float = 1.0,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    return_diagnostics: bool = False,
    key: random.Key | None = None,
    clip_backend: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    per_example_grads: Callable[..., tuple[PerExampleGradients, torch.Tensor]] | None = None,
    chunk_transform: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[Callable[..., Any], FixedClipState | AdaptiveClipState]:
    """Build a function that returns the clipped, summed and normalized per-example gradients of ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``) for **one** example: the
            arguments at ``batch_argnums`` are passed without their batch dimension. It must be a per-example loss
            (for a sequence, a mask-aware mean over that sequence's own tokens), never a batch-level normalization.
        clipping_norm: L2 bound ``C`` on each example's gradient; ``math.inf`` disables clipping; a
            :class:`~opake_core.tree.PerGroup` (see :func:`~opake_core.tree.per_group`) clips each group separately;
            :func:`auto_s` or :func:`adaptive` select the other rules (module docstring).
        argnums: the argument(s) to differentiate (parameters). Other unbatched arguments (frozen parameters,
            buffers) are passed through unchanged.
        batch_argnums: the argument(s) whose tensors carry a leading batch dimension ``[B, ...]``.
        normalize_by: public normalizer ``n`` the sum is divided by (the expected batch size for DP-SGD), never the
            realized batch size.
        microbatch_size: examples per vmap chunk (memory/speed trade-off only; ``None`` = the whole batch at once).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; per-example ``aux`` values are returned stacked ``[B, ...]``.
            They are **not** covered by the privacy guarantee.
        return_diagnostics: also return :class:`ClipDiagnostics` (outside the guarantee).
        key: the key of adaptive clipping's count noise (required for :func:`adaptive`, refused otherwise).
        clip_backend: a faster clip-and-sum for the fixed and adaptive rules (for example the fused kernels of
            ``opake_torch.patches.kernels.clip_and_sum``): ``backend(leaves, *, group_index, bounds, accumulators)
            -> (norms [m], group_norms [G, m])`` must add exactly what the generic engine adds to the float32
            accumulators (same margin, zero for non-finite examples). ``None`` uses the generic torch engine.
        reduce_count: for adaptive clipping under data parallelism, sums the float64 tensor ``[clipped count, batch
            size]`` across ranks before the noisy count is formed (every rank then draws the same count noise and
            moves to the same bound). ``None``: the counts of this call only.
        per_example_grads: replaces ``vmap(grad(loss_fn))`` on each chunk: ``per_example_grads(*chunk_args) ->
            (PerExampleGradients, losses [m])`` with the same arguments as ``loss_fn`` (batched ones sliced to the
            chunk), for example ``opake_torch.layerwise.LayerwiseGradients``, which computes them from layer inputs
            and output gradients. It must describe the gradients of the same per-example losses; ``loss_fn`` is
            then not called. ``clip_backend`` applies to materialized gradients only; ``has_aux`` is refused.
        chunk_transform: wraps the per-chunk function once, when ``clipped_grad`` is built, for example with
            ``torch.compile`` or a CUDA-graph capture (``opake_torch.transformers.compile``). The chunk function is
            ``chunk(rule, bounds, live, *chunk_args) -> (sums, norms [m], clipped [m], values)``: tensors in, tensors
            out, with ``rule`` hashable and the current bounds a float64 tensor ``[G, 1]`` (adaptive clipping moves
            them without a new capture). With a transform, ``clip_backend`` is not used, and with a
            ``microbatch_size`` every chunk is padded to exactly ``microbatch_size`` rows (copies of its last example,
            marked dead by ``live`` so that they add exactly nothing), so that every chunk has one shape. The
            wrapped function must return tensors of its own: the sums are accumulated and divided in place.

    Returns:
        ``(grad_fn, state)``. ``grad_fn(*args, state=state) -> (out, state)`` where ``out`` is a
        :class:`~opake_core.tree.Clipped` tree with ``sensitivity = C / n``; with ``has_aux`` and/or
        ``return_diagnostics`` it is a tuple ``(clipped, aux?, diagnostics?)`` in that order. The clipped values are
        float32 (float64 for float64 parameters). An empty batch (``B = 0``) gives zeros with the same sensitivity.
    """
    bound = _check_bound(clipping_norm)
    diff_args = _as_argnums(argnums, "argnums", allow_empty=False)
    batch_args = _as_argnums(batch_argnums, "batch_argnums", allow_empty=False)
    if set(diff_args) & set(batch_args):
        raise ConfigurationError(
            f"argnums {diff_args} and batch_argnums {batch_args} overlap: parameters cannot carry a batch axis."
        )
    if isinstance(normalize_by, bool) or not isinstance(normalize_by, int | float):
        raise InputTypeError(f"normalize_by must be a positive number, got {type(normalize_by).__name__}.")
    if not 0 < normalize_by < math.inf:
        raise ConfigurationError(f"normalize_by must be positive and finite, got {normalize_by!r}.")
    if microbatch_size is not None and (
        isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1
    ):
        raise ConfigurationError(f"microbatch_size must be None or an int >= 1, got {microbatch_size!r}.")
    if isinstance(bound, PerGroup) and len(diff_args) != 1:
        raise ConfigurationError("per-group clipping needs a single argnums (one parameter tree).")
    is_adaptive = isinstance(bound, AdaptiveRule)
    if is_adaptive != (key is not None):
        raise ConfigurationError(
            "adaptive clipping needs key=opake_core.random.key(...) for its count noise"
            if is_adaptive
            else "key= is only used by adaptive clipping; drop it."
        )
    if is_adaptive and not isinstance(key, random.Key):
        raise InputTypeError(f"key must be an opake_core.random.Key, got {type(key).__name__}.")
    if per_example_grads is not None and has_aux:
        raise ConfigurationError("has_aux is not available with per_example_grads; drop one of them.")
    state_type = AdaptiveClipState if is_adaptive else FixedClipState
    initial = AdaptiveClipState(bound.initial_clipping_norm, 0, key) if is_adaptive else FixedClipState()
    grad_argnums = diff_args[0] if isinstance(argnums, int) else diff_args
    per_example = grad(_with_value(loss_fn, has_aux), argnums=grad_argnums, has_aux=True)

    def params_of(args: tuple[Any, ...] | list[Any]) -> Any:
        return args[diff_args[0]] if isinstance(argnums, int) else tuple(args[i] for i in diff_args)

    def chunk(rule: _ClipRule, bounds: torch.Tensor, live: torch.Tensor | None, *args: Any) -> tuple[Any, ...]:
        """One chunk: per-example gradients, then the clipped sum (fresh accumulators), norms, clip flags, values."""
        if per_example_grads is not None:
            with torch.enable_grad():
                grads, values = per_example_grads(*args)
        else:
            try:
                in_dims = tuple(0 if i in batch_args else None for i in range(len(args)))
                tree, values = vmap(per_example, in_dims=in_dims, randomness="different")(*args)
            except RuntimeError as exc:
                if _runs_without_vmap(per_example, args, batch_args):
                    raise _vmap_error(exc) from exc
                raise
            grads = MaterializedGradients(optree.tree_leaves(tree))
        sums, norms, clipped = rule(grads, optree.tree_leaves(params_of(args)), bounds, live)
        return sums, norms, clipped, values

    run_chunk = chunk if chunk_transform is None else chunk_transform(chunk)

    def grad_fn(*args: Any, state: Any) -> tuple[Any, Any]:
        if not isinstance(state, state_type):
            raise InputTypeError(
                f"grad_fn expects the {state_type.__name__} from clipped_grad, got {type(state).__name__}."
            )
        if max(*diff_args, *batch_args) >= len(args):
            raise ConfigurationError(
                f"grad_fn got {len(args)} arguments but argnums={diff_args} and batch_argnums={batch_args}."
            )
        with torch.profiler.record_function("opake::clipped_grad"), torch.no_grad():
            params = params_of(args)
            current = state.clipping_norm if is_adaptive else bound
            rule, floats = _ClipRule.of(params, current, backend=clip_backend if chunk_transform is None else None)
            leaves, treedef = optree.tree_flatten(params)
            device = leaves[0].device
            bounds = _bounds_on(floats, device)
            batch_size = _batch_size([args[i] for i in batch_args])
            chunk_size = microbatch_size or max(batch_size, 1)
            pad = chunk_transform is not None and microbatch_size is not None
            all_live = torch.ones(chunk_size, dtype=torch.bool, device=device) if pad else None
            sums, norms, clipped, losses, auxes = None, [], [], [], []
            for start in range(0, batch_size, chunk_size):
                stop = min(start + chunk_size, batch_size)
                sliced = [_slice(a, start, stop) if i in batch_args else a for i, a in enumerate(args)]
                live = all_live
                if pad and stop - start < chunk_size:  # repeat the last example; its copies are dead rows
                    rows = torch.arange(chunk_size, device=device)
                    live = rows < stop - start
                    rows = rows.clamp(max=stop - start - 1)
                    sliced = [_take(a, rows) if i in batch_args else a for i, a in enumerate(sliced)]
                part, chunk_norms, chunk_clipped, values = run_chunk(rule, bounds, live, *sliced)
                if sums is None:
                    sums = part
                else:
                    torch._foreach_add_(sums, part)
                real = stop - start
                norms.append(chunk_norms[:real])
                clipped.append(chunk_clipped[:real])
                loss, aux = values if has_aux else (values, None)
                losses.append(loss[:real])
                auxes.append(optree.tree_map(lambda x, real=real: x[:real], aux) if has_aux else None)
            if sums is None:
                sums = _zeros_like_leaves(leaves)
            torch._foreach_div_(sums, normalize_by)  # the accumulators are this call's own
            result = optree.tree_unflatten(treedef, sums)
            clipped_out = Clipped(result, _sensitivity(current, normalize_by))
            outputs: list[Any] = [clipped_out]
            if has_aux:
                outputs.append(_concat(auxes) if auxes else None)
            if return_diagnostics:
                outputs.append(_diagnostics(norms, clipped, losses, batch_size, device))
            if is_adaptive:
                num_clipped = torch.cat(clipped).sum() if clipped else torch.zeros((), dtype=torch.long)
                counts = torch.stack([num_clipped.double().cpu(), torch.tensor(float(batch_size))])
                if reduce_count is not None:
                    counts = reduce_count(counts)
                state = _next_adaptive_state(bound, state, counts, normalize_by)
        return (outputs[0] if len(outputs) == 1 else tuple(outputs)), state

    return grad_fn, initial


def _sensitivity(bound: float | PerGroup | AutoSRule, normalize_by: float) -> float | PerGroup:
    if isinstance(bound, PerGroup):
        return bound.map(lambda c: c / normalize_by)
    return (bound.bound if isinstance(bound, AutoSRule) else bound) / normalize_by


def _next_adaptive_state(
    rule: AdaptiveRule, state: AdaptiveClipState, counts: torch.Tensor, normalize_by: float
) -> AdaptiveClipState:
    """Andrew et al. 2021, Algorithm 1: a noisy centred count of unclipped examples moves the bound geometrically.

    The centred count ``sum_i (1[||g_i|| <= C] - 1/2)`` has sensitivity 1/2 under adding or removing an example; it
    is released with Gaussian noise of std ``count_noise_fraction * n`` (n the expected batch size).
    """
    num_clipped, batch_size = (float(c) for c in counts.tolist())  # ``[clipped, batch size]``, maybe rank-summed
    unclipped = batch_size - num_clipped
    noise = random.numpy_generator(random.fold_in(state.key, ADAPTIVE_STREAM, state.step)).normal()
    centred = unclipped - batch_size / 2 + noise * rule.count_noise_fraction * normalize_by
    fraction = centred / normalize_by + 0.5
    bound = state.clipping_norm * math.exp(-rule.learning_rate * (fraction - rule.target_quantile))
    bound = min(max(bound, rule.clipping_norm_min), rule.clipping_norm_max)
    return AdaptiveClipState(bound, state.step + 1, state.key)


def _with_value(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn`` returning ``(loss, (loss, aux))`` (``(loss, loss)`` without aux), so that
    ``grad(..., has_aux=True)`` also gives the value."""

    def wrapped(*args: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, Any]]:
        out = loss_fn(*args)
        loss, aux = out if has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(
                f"loss_fn must return a scalar tensor for one example, got {shape}. Return the example's own loss "
                "(a mean over its tokens at most), not a batch of losses."
            )
        return loss, ((loss.detach(), aux) if has_aux else loss.detach())

    return wrapped


def _slice(tree: Any, start: int, stop: int) -> Any:
    return optree.tree_map(lambda x: x[start:stop] if isinstance(x, torch.Tensor) else x, tree)


def _take(tree: Any, rows: torch.Tensor) -> Any:
    return optree.tree_map(lambda x: x[rows.to(x.device)] if isinstance(x, torch.Tensor) else x, tree)


def _concat(chunks: list[Any]) -> Any:
    return optree.tree_map(lambda *xs: torch.cat(xs, dim=0), *chunks)


class PerExampleGradients(Protocol):
    """The per-example gradients of one chunk of ``m`` examples, in whatever form an engine keeps them.

    The generic engine holds them materialized (``vmap(grad)``); ``opake_torch.layerwise`` holds layer inputs and
    output gradients instead. Leaves are in the parameter tree's flattening order.
    """

    def squared_norms(self) -> list[torch.Tensor]:
        """Per leaf, the float64 squared L2 norms ``[m]`` of every example's gradient of that leaf."""
        ...

    def add_scaled(self, scales: list[torch.Tensor], sums: list[torch.Tensor]) -> None:
        """Add ``sum_i scales[k][i] * g_i[k]`` to ``sums[k]`` for every leaf ``k``.

        ``scales[k]`` is ``[m]`` in the dtype of ``sums[k]``; an example whose scale is 0 must add exactly nothing,
        even where its gradient is not finite.
        """
        ...


class MaterializedGradients:
    """Per-example gradients held as tensors ``[m, *leaf.shape]`` (what ``vmap(grad)`` returns)."""

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        self.leaves = [g.detach() for g in leaves]

    def squared_norms(self) -> list[torch.Tensor]:
        return [g.to(torch.float64).square().reshape(g.shape[0], -1).sum(dim=1) for g in self.leaves]

    def add_scaled(self, scales: list[torch.Tensor], sums: list[torch.Tensor]) -> None:
        for g, scale, total in zip(self.leaves, scales, sums, strict=True):
            leaf_scale = scale.reshape(g.shape[0], *([1] * (g.dim() - 1)))
            contribution = torch.nan_to_num(g.to(total.dtype) * leaf_scale, nan=0.0, posinf=0.0, neginf=0.0)
            total.add_(contribution.sum(dim=0))


def clip_scales(
    group_norms: torch.Tensor,
    norms: torch.Tensor,
    bounds: Sequence[float] | torch.Tensor,
    dtypes: set[torch.dtype],
    *,
    gamma: float | None = None,
) -> dict[torch.dtype, torch.Tensor]:
    """The clipping rule's per-example scales ``[G, m]``, one tensor per accumulation dtype (in that dtype).

    ``scale = min(1, C_k (1 - 4u) / ||g||_k)`` with ``u`` the unit roundoff of the dtype (AUTO-S with ``gamma``:
    ``C_k (1 - 4u) / (||g||_k + gamma)``), and 0 for an example whose total norm ``norms`` is not finite.
    ``group_norms`` ``[G, m]`` and ``norms`` ``[m]`` are float64; ``bounds`` are the ``G`` bounds ``C_k`` (floats, or a
    float64 tensor ``[G, 1]`` on the device). Clip-and-sum backends (``clip_backend``) use this so that they add
    exactly what the generic engine adds.
    """
    bound = bounds if isinstance(bounds, torch.Tensor) else _bounds_on(tuple(bounds), group_norms.device)
    scales = {}
    for dtype in dtypes:
        u = torch.finfo(dtype).eps / 2
        if gamma is None:
            scale = torch.clamp(bound * (1 - 4 * u) / group_norms, max=1.0)
        else:  # AUTO-S: bound * ||g|| / (||g|| + gamma) < bound, no clamp
            scale = bound * (1 - 4 * u) / (group_norms + gamma)
        scales[dtype] = torch.where(torch.isfinite(norms), scale, torch.zeros_like(scale)).to(dtype)
    return scales


@functools.lru_cache(maxsize=64)
def _bounds_on(bounds: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The bounds as a float64 ``[G, 1]`` tensor on ``device``, made once per value: a copy from host memory to a
    GPU waits for the device to finish its queued work, which would stall every step. Never modified."""
    return torch.tensor(bounds, dtype=torch.float64).unsqueeze(1).to(device)


def _zeros_like_leaves(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero accumulators shaped like ``leaves`` in their accumulation dtype: views of one buffer per dtype and device
    (one allocation and one fill instead of one per leaf)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault((_accumulation_dtype(leaf), leaf.device), []).append(index)
    out: list[torch.Tensor] = [torch.empty(0)] * len(leaves)
    for (dtype, device), indices in groups.items():
        flat = torch.zeros(sum(leaves[i].numel() for i in indices), dtype=dtype, device=device)
        for i, view in zip(indices, flat.split([leaves[i].numel() for i in indices]), strict=True):
            out[i] = view.view(leaves[i].shape)
    return out


@dataclass(frozen=True)
class _ClipRule:
    """The static part of one call's clipping rule, as hashable data: each leaf's group and AUTO-S's ``gamma``.

    The bounds themselves reach a chunk as a float64 tensor ``[G, 1]``, so that a captured or compiled chunk follows
    a moving (adaptive) bound. Only a ``backend`` (used without a chunk transform) gets them as floats.
    """

    group_index: tuple[int, ...]
    groups: int
    gamma: float | None = None
    backend: Callable[..., Any] | None = None
    backend_bounds: tuple[float, ...] | None = None

    @staticmethod
    def of(
        params: Any, bound: float | PerGroup | AutoSRule, backend: Callable[..., Any] | None
    ) -> tuple[_ClipRule, tuple[float, ...]]:
        """The rule for ``params`` and the bound ``C_k`` of each group."""
        gamma = bound.gamma if isinstance(bound, AutoSRule) else None
        bound = bound.bound if isinstance(bound, AutoSRule) else bound
        backend = backend if gamma is None else None  # backends implement the clamp rule only
        leaves = optree.tree_leaves(params)
        paths = leaf_paths(params)
        for path, leaf in zip(paths, leaves, strict=True):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                raise InputTypeError(f"parameter {path!r} must be a floating-point tensor, got {leaf!r:.80}.")
        if isinstance(bound, PerGroup):
            unknown = [p for p in paths if p not in bound.group_of]
            if unknown:
                raise ConfigurationError(
                    f"per-group clipping_norm has no group for parameters {unknown[:5]}; build it with "
                    "per_group(params, ...) on the same parameter tree."
                )
            names = [name for name, _ in bound.values]
            group_index = tuple(names.index(bound.group_of[p]) for p in paths)
            bounds = tuple(value for _, value in bound.values)
        else:
            group_index, bounds = (0,) * len(leaves), (bound,)
        rule = _ClipRule(group_index, len(bounds), gamma, backend, bounds if backend is not None else None)
        return rule, bounds

    def __call__(
        self, grads: PerExampleGradients, params: list[torch.Tensor], bounds: torch.Tensor, live: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(sums, norms [m] float32, clipped [m] bool)``: the clipped sum of the chunk in fresh accumulators
        shaped like ``params``, each example's norm, and whether any of its groups exceeded its bound. Examples
        with ``live`` False add nothing."""
        sums = _zeros_like_leaves(params)
        if self.backend is not None and isinstance(grads, MaterializedGradients):
            norms, group_norms = self.backend(
                grads.leaves, group_index=list(self.group_index), bounds=list(self.backend_bounds), accumulators=sums
            )
            return sums, norms.float(), (group_norms > bounds).any(dim=0)
        leaf_sq = grads.squared_norms()
        m = leaf_sq[0].shape[0]
        group_sq = torch.zeros(self.groups, m, dtype=torch.float64, device=leaf_sq[0].device)
        for index, sq in zip(self.group_index, leaf_sq, strict=True):
            group_sq[index] += sq
        group_norms = group_sq.sqrt()
        norms = group_sq.sum(dim=0).sqrt()
        if live is not None:  # a dead (padding) row counts as non-finite: scale 0
            norms = torch.where(live, norms, torch.full_like(norms, math.nan))
        scales = clip_scales(group_norms, norms, bounds, {total.dtype for total in sums}, gamma=self.gamma)
        grads.add_scaled(
            [scales[total.dtype][group] for group, total in zip(self.group_index, sums, strict=True)], sums
        )
        return sums, norms.float(), (group_norms > bounds).any(dim=0)


def _diagnostics(
    norms: list[torch.Tensor], clipped: list[torch.Tensor], losses: list[torch.Tensor], batch_size: int, device: Any
) -> ClipDiagnostics:
    if not norms:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return ClipDiagnostics(empty, torch.zeros((), device=device), empty, 0)
    return ClipDiagnostics(torch.cat(norms), torch.cat(clipped).float().mean(), torch.cat(losses), batch_size)
