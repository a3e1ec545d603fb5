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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import optree.dataclasses
import torch
from torch.func import grad, vmap

from opake_core.errors import ConfigurationError, InputTypeError, VmapCompatibilityError
from opake_core.tree import NAMESPACE, Clipped, PerGroup, leaf_paths

__all__ = ["ClipDiagnostics", "FixedClipState", "clipped_grad"]


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class FixedClipState:
    """State of fixed-bound clipping: it holds nothing and comes back unchanged from every call."""


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


def _check_bound(clipping_norm: Any) -> float | PerGroup:
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
) -> tuple[Callable[..., Any], FixedClipState]:
    """Build a function that returns the clipped, summed and normalized per-example gradients of ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``) for **one** example: the
            arguments at ``batch_argnums`` are passed without their batch dimension. It must be a per-example loss
            (for a sequence, a mask-aware mean over that sequence's own tokens), never a batch-level normalization.
        clipping_norm: L2 bound ``C`` on each example's gradient; ``math.inf`` disables clipping; a
            :class:`~opake_core.tree.PerGroup` (see :func:`~opake_core.tree.per_group`) clips each group separately.
        argnums: the argument(s) to differentiate (parameters). Other unbatched arguments (frozen parameters,
            buffers) are passed through unchanged.
        batch_argnums: the argument(s) whose tensors carry a leading batch dimension ``[B, ...]``.
        normalize_by: public normalizer ``n`` the sum is divided by (the expected batch size for DP-SGD), never the
            realized batch size.
        microbatch_size: examples per vmap chunk (memory/speed trade-off only; ``None`` = the whole batch at once).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; per-example ``aux`` values are returned stacked ``[B, ...]``.
            They are **not** covered by the privacy guarantee.
        return_diagnostics: also return :class:`ClipDiagnostics` (outside the guarantee).

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
    sensitivity = bound.map(lambda c: c / normalize_by) if isinstance(bound, PerGroup) else bound / normalize_by
    grad_argnums = diff_args[0] if isinstance(argnums, int) else diff_args
    per_example = grad(_with_value(loss_fn, has_aux), argnums=grad_argnums, has_aux=True)

    def grad_fn(*args: Any, state: FixedClipState) -> tuple[Any, FixedClipState]:
        if not isinstance(state, FixedClipState):
            raise InputTypeError(f"grad_fn expects the FixedClipState from clipped_grad, got {type(state).__name__}.")
        if max(*diff_args, *batch_args) >= len(args):
            raise ConfigurationError(
                f"grad_fn got {len(args)} arguments but argnums={diff_args} and batch_argnums={batch_args}."
            )
        with torch.profiler.record_function("opake::clipped_grad"), torch.no_grad():
            params = args[diff_args[0]] if isinstance(argnums, int) else tuple(args[i] for i in diff_args)
            engine = _ClipSum(params, bound)
            batch_size = _batch_size([args[i] for i in batch_args])
            chunk = microbatch_size or max(batch_size, 1)
            in_dims = tuple(0 if i in batch_args else None for i in range(len(args)))
            vmapped = vmap(per_example, in_dims=in_dims, randomness="different")
            losses, auxes = [], []
            for start in range(0, batch_size, chunk):
                stop = min(start + chunk, batch_size)
                sliced = [_slice(a, start, stop) if i in batch_args else a for i, a in enumerate(args)]
                try:
                    grads, values = vmapped(*sliced)
                except RuntimeError as exc:
                    if _runs_without_vmap(per_example, args, batch_args):
                        raise _vmap_error(exc) from exc
                    raise
                engine.add(grads)
                loss, aux = values if has_aux else (values, None)
                losses.append(loss)
                auxes.append(aux)
            clipped = Clipped(engine.result(normalize_by), sensitivity)
            outputs: list[Any] = [clipped]
            if has_aux:
                outputs.append(_concat(auxes) if auxes else None)
            if return_diagnostics:
                outputs.append(engine.diagnostics(losses, batch_size))
        return (outputs[0] if len(outputs) == 1 else tuple(outputs)), state

    return grad_fn, FixedClipState()


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


def _concat(chunks: list[Any]) -> Any:
    return optree.tree_map(lambda *xs: torch.cat(xs, dim=0), *chunks)


class _ClipSum:
    """Running clipped sum over chunks (the generic torch backend)."""

    def __init__(self, params: Any, bound: float | PerGroup) -> None:
        leaves, self._treedef = optree.tree_flatten(params)
        for path, leaf in zip(leaf_paths(params), leaves, strict=True):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                raise InputTypeError(f"parameter {path!r} must be a floating-point tensor, got {leaf!r:.80}.")
        self._sums = [torch.zeros(leaf.shape, dtype=_accumulation_dtype(leaf), device=leaf.device) for leaf in leaves]
        if isinstance(bound, PerGroup):
            group_of = bound.group_of
            paths = leaf_paths(params)
            unknown = [p for p in paths if p not in group_of]
            if unknown:
                raise ConfigurationError(
                    f"per-group clipping_norm has no group for parameters {unknown[:5]}; build it with "
                    "per_group(params, ...) on the same parameter tree."
                )
            names = [name for name, _ in bound.values]
            self._group_index = [names.index(group_of[p]) for p in paths]
            self._bounds = [value for _, value in bound.values]
        else:
            self._group_index = [0] * len(leaves)
            self._bounds = [bound]
        self._norms: list[torch.Tensor] = []
        self._clipped: list[torch.Tensor] = []

    def add(self, grads: Any) -> None:
        leaves = optree.tree_leaves(grads)
        m = leaves[0].shape[0]
        device = leaves[0].device
        group_sq = torch.zeros(len(self._bounds), m, dtype=torch.float64, device=device)
        for index, g in zip(self._group_index, leaves, strict=True):
            group_sq[index] += g.detach().to(torch.float64).square().reshape(m, -1).sum(dim=1)
        group_norms = group_sq.sqrt()
        norms = group_sq.sum(dim=0).sqrt()
        bounds = torch.tensor(self._bounds, dtype=torch.float64, device=device).unsqueeze(1)
        scales = {}
        for dtype in {total.dtype for total in self._sums}:
            u = torch.finfo(dtype).eps / 2
            scale = torch.clamp(bounds * (1 - 4 * u) / group_norms, max=1.0)
            scales[dtype] = torch.where(torch.isfinite(norms), scale, torch.zeros_like(scale))
        for index, (g, total) in enumerate(zip(leaves, self._sums, strict=True)):
            scale = scales[total.dtype]
            leaf_scale = scale[self._group_index[index]].to(total.dtype).reshape(m, *([1] * (g.dim() - 1)))
            contribution = torch.nan_to_num(g.detach().to(total.dtype) * leaf_scale, nan=0.0, posinf=0.0, neginf=0.0)
            total.add_(contribution.sum(dim=0))
        self._norms.append(norms.float())
        self._clipped.append((group_norms > bounds).any(dim=0))

    def result(self, normalize_by: float) -> Any:
        return optree.tree_unflatten(self._treedef, [total / normalize_by for total in self._sums])

    def diagnostics(self, losses: list[torch.Tensor], batch_size: int) -> ClipDiagnostics:
        device = self._sums[0].device
        if not self._norms:
            empty = torch.zeros(0, dtype=torch.float32, device=device)
            return ClipDiagnostics(empty, torch.zeros((), device=device), empty, 0)
        clipped = torch.cat(self._clipped)
        return ClipDiagnostics(torch.cat(self._norms), clipped.float().mean(), torch.cat(losses), batch_size)
