"""``clipped_grad``: the clipped, summed and normalized per-example gradients of a loss.

It composes the three parts of this package: the rule (:mod:`~opake_core.clipping.rules`) turns each example's
norms into scales, the engine (:mod:`~opake_core.clipping.engine`) forms the per-example gradients of a chunk and
runs it, and microbatching (:mod:`~opake_core.clipping.microbatching`) cuts the batch into chunks and adds their
clipped sums. The released value is ``sum_i g_i * scale_i / n`` (see the rules module for the scales and the
sensitivity); with ``second_moment=True`` also ``sum_i (g_i * scale_i)^2 / n`` (private second moments,
:mod:`opake_core.moments`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core import random, validate
from opake_core.clipping import rules
from opake_core.clipping.engine import VMAP, Engine, example_grad
from opake_core.clipping.microbatching import Chunked, run_chunks
from opake_core.clipping.rules import AdaptiveClipState, AdaptiveRule, AutoSRule, ClipRule, FixedClipState
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.moments import ClippedMoments
from opake_core.tree import Clipped, PerGroup

__all__ = ["ClipDiagnostics", "clipped_grad"]


@dataclass(frozen=True)
class ClipDiagnostics:
    """Exact per-batch statistics of one clipping call.

    These are computed from the private data without noise: they are **outside the privacy guarantee**. Keep them
    private or do not log them.

    Attributes:
        norms: float32 tensor ``[B]``, each example's gradient L2 norm before clipping (NaN or inf for a non-finite
            one, which the clipped sum drops; a finite norm above float32's range reads as its largest value).
        clip_rate: float32 scalar tensor, fraction of examples whose norm exceeded its bound (any group exceeded, for
            per-group bounds); 0 for an empty batch.
        losses: tensor ``[B]`` of per-example loss values.
        batch_size: ``B``, the realized number of examples.
        nonfinite: int64 scalar tensor, the examples whose gradient norm was not finite (NaN or inf anywhere in the
            gradient): they got scale 0 and added nothing to the clipped sum, which is then a sum over the others.
            A tensor, so that counting waits for no device.

    Example:

        >>> import torch
        >>> from opake_core import clipped_grad
        >>> loss_fn = lambda w, x: (x @ w) ** 2
        >>> x = torch.tensor([[0.1, 0.0], [3.0, 4.0]])
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, return_diagnostics=True)
        >>> (clipped, diagnostics), state = grad_fn(torch.ones(2), x, state=state)
        >>> diagnostics.norms  # ||2 (x.w) x||: 0.02 and 70
        tensor([2.0000e-02, 7.0000e+01])
        >>> diagnostics.clip_rate, diagnostics.batch_size, diagnostics.nonfinite.item()
        (tensor(0.5000), 2, 0)
    """

    norms: torch.Tensor
    clip_rate: torch.Tensor
    losses: torch.Tensor
    batch_size: int
    nonfinite: torch.Tensor


def clipped_grad(
    loss_fn: Callable[..., Any],
    *,
    clipping_norm: float | PerGroup | AutoSRule | AdaptiveRule,
    argnums: int | tuple[int, ...] = 0,
    batch_argnums: int | tuple[int, ...] | slice = 1,
    normalize_by: float = 1.0,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    return_diagnostics: bool = False,
    key: random.Key | None = None,
    engine: Engine = VMAP,
    reduce_count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    second_moment: bool = False,
) -> tuple[Callable[..., Any], FixedClipState | AdaptiveClipState]:
    """Build a function that returns the clipped, summed and normalized per-example gradients of ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``) for **one** example: the
            arguments at ``batch_argnums`` are passed without their batch dimension. It must be a per-example loss
            (for a sequence, a mask-aware mean over that sequence's own tokens), never a batch-level normalization.
        clipping_norm: L2 bound ``C`` on each example's gradient; ``math.inf`` disables clipping; a
            :class:`~opake_core.tree.PerGroup` (see :func:`~opake_core.tree.per_group`) clips each group separately;
            :func:`~opake_core.clipping.auto_s` or :func:`~opake_core.clipping.adaptive` select the other rules
            (see :mod:`opake_core.clipping.rules`).
        argnums: the argument(s) to differentiate (parameters). Other unbatched arguments (frozen parameters,
            buffers) are passed through unchanged.
        batch_argnums: the argument(s) whose tensors carry a leading batch dimension ``[B, ...]``; a slice names
            positions of the call (``slice(1, None)``: every argument after the first, however many).
        normalize_by: public normalizer ``n`` the sum is divided by (the expected batch size for DP-SGD), never the
            realized batch size.
        microbatch_size: the most examples per chunk (memory/speed trade-off only; ``None`` = the whole batch at once);
            a batch of ``B`` runs as ``ceil(B / microbatch_size)`` chunks of equal size (see
            :mod:`~opake_core.clipping.microbatching`).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; per-example ``aux`` values are returned stacked ``[B, ...]``.
            They are **not** covered by the privacy guarantee. The engine must return them (``VmapGradients`` does).
        return_diagnostics: also return :class:`ClipDiagnostics` (outside the guarantee).
        key: the key of adaptive clipping's count noise (required for :func:`~opake_core.clipping.adaptive`,
            refused otherwise); it lives in the returned state.
        engine: how each chunk's per-example gradients are formed and how the chunk runs
            (:class:`~opake_core.clipping.Engine`; default :data:`~opake_core.clipping.VMAP`).
        reduce_count: for adaptive clipping under data parallelism, sums the float64 tensor ``[clipped count, batch
            size]`` across ranks before the noisy count is formed (every rank then draws the same count noise and
            moves to the same bound). ``None``: the counts of this call only.
        second_moment: also release the clipped sum of element-wise squares, ``(1/n) sum_i c_i ⊙ c_i`` with
            ``c_i`` example ``i``'s clipped gradient, sensitivity ``C^2 / n`` (per group ``C_k^2 / n``, AUTO-S
            ``R^2 / n``): private second moments for Adam (:mod:`opake_core.moments`). The engine's per-example
            gradients must form squares (the default VMAP engine does; layerwise ghost norms do not).

    Returns:
        ``(grad_fn, state)``. ``grad_fn(*args, state=state) -> (out, state)`` where ``out`` is a
        :class:`~opake_core.tree.Clipped` tree with ``sensitivity = C / n``; with ``has_aux`` and/or
        ``return_diagnostics`` it is a tuple ``(clipped, aux?, diagnostics?)`` in that order. The clipped values are
        float32 (float64 for float64 parameters). An empty batch (``B = 0``) gives zeros with the same sensitivity.
        With ``second_moment`` the first output is a :class:`~opake_core.moments.ClippedMoments` ``(first,
        second)`` instead of the ``Clipped`` tree: ``first`` is that tree and ``second`` the clipped sum of squares
        (same structure, shapes and dtypes). Noise it with :func:`~opake_core.noise.gaussian_noise` (one Gaussian
        release for both streams) or :func:`~opake_core.noise.paired_mf_gaussian_noise`.

    Example: the clipped sum of a least-squares loss equals a float64 loop over the examples.

        >>> import torch
        >>> from opake_core import clipped_grad
        >>> loss_fn = lambda w, x, y: (x @ w - y) ** 2
        >>> x, y = torch.randn(8, 3, generator=torch.Generator().manual_seed(0)), torch.ones(8)
        >>> grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), normalize_by=8.0)
        >>> clipped, state = grad_fn(torch.zeros(3), x, y, state=state)
        >>> clipped.sensitivity  # clipping_norm / normalize_by
        0.125
        >>> loop = torch.zeros(3, dtype=torch.float64)
        >>> for xi, yi in zip(x.double(), y.double()):
        ...     g = 2 * (xi @ torch.zeros(3, dtype=torch.float64) - yi) * xi
        ...     loop += g * min(1.0, 1.0 / g.norm().item())
        >>> torch.allclose(clipped.value.double(), loop / 8.0, atol=1e-6)
        True
    """
    if not callable(loss_fn):
        raise InputTypeError(
            f"loss_fn must be a function of one example, got {type(loss_fn).__name__} {loss_fn!r:.40}."
        )
    bound = rules.check_rule(clipping_norm)
    diff_args = _argnums("argnums", argnums)
    batch_spec = batch_argnums if isinstance(batch_argnums, slice) else _argnums("batch_argnums", batch_argnums)
    if not isinstance(batch_spec, slice):  # a slice is resolved, and checked, at each call
        _disjoint(diff_args, batch_spec)
    normalize_by = validate.positive("normalize_by", normalize_by)
    rules.check_scale(bound, normalize_by)
    if microbatch_size is not None:
        validate.integer("microbatch_size", microbatch_size, minimum=1)
    if isinstance(bound, PerGroup) and len(diff_args) != 1:
        raise ConfigurationError("per-group clipping needs a single argnums (one parameter tree).")
    if not isinstance(engine, Engine):
        raise InputTypeError(f"engine must be an opake_core.clipping.Engine, got {type(engine).__name__}.")
    if not isinstance(second_moment, bool):
        raise InputTypeError(f"second_moment must be a bool, got {type(second_moment).__name__} {second_moment!r}.")
    initial = rules.initial_state(bound, key)
    example = example_grad(loss_fn, diff_args[0] if isinstance(argnums, int) else diff_args, has_aux)

    def params_of(args: Sequence[Any]) -> Any:
        return args[diff_args[0]] if isinstance(argnums, int) else tuple(args[i] for i in diff_args)

    def chunk(rule: ClipRule, bounds: torch.Tensor, live: torch.Tensor | None, *args: Any) -> tuple[Any, ...]:
        """One chunk: per-example gradients, then the clipped sum (fresh accumulators), norms, clip flags, values."""
        grads, values = engine.gradients(example, args, _positions(batch_spec, len(args)))
        sums, norms, clipped = rule(grads, optree.tree_leaves(params_of(args)), bounds, live)
        return sums, norms, clipped, values

    run_chunk = chunk if engine.transform is None else engine.transform(chunk)

    def grad_fn(*args: Any, state: Any) -> tuple[Any, Any]:
        if not isinstance(state, type(initial)):
            raise InputTypeError(
                f"grad_fn expects the {type(initial).__name__} from clipped_grad, got {type(state).__name__}."
            )
        batch_args = _positions(batch_spec, len(args))
        _disjoint(diff_args, batch_args)
        if max(*diff_args, *batch_args) >= len(args):
            raise ConfigurationError(
                f"grad_fn got {len(args)} arguments but argnums={diff_args} and batch_argnums={batch_args}."
            )
        with torch.profiler.record_function("opake::clipped_grad"), torch.no_grad():
            params = params_of(args)
            current = state.clipping_norm if isinstance(state, AdaptiveClipState) else bound
            rule, floats = ClipRule.of(params, current)
            if second_moment:
                rule = rule._replace(second_moment=True)
            leaves, treedef = optree.tree_flatten(params)
            device = leaves[0].device
            chunks = run_chunks(
                run_chunk,
                (rule, rules.bounds_on(floats, device)),
                args,
                batch_args,
                microbatch_size=microbatch_size,
                pad=engine.transform is not None,
                device=device,
                row_multiple=engine.row_multiple,
                min_rows=engine.min_rows,
            )
            width = 2 * len(leaves) if second_moment else len(leaves)
            sums = rules.accumulators(leaves * (width // len(leaves))) if chunks.sums is None else chunks.sums
            torch._foreach_div_(sums, normalize_by)  # the accumulators are this call's own
            clipped = Clipped(
                optree.tree_unflatten(treedef, sums[: len(leaves)]), rules.sensitivity(current, normalize_by)
            )
            if second_moment:
                squares = optree.tree_unflatten(treedef, sums[len(leaves) :])
                clipped = ClippedMoments(
                    clipped, Clipped(squares, rules.second_moment_sensitivity(current, normalize_by))
                )
            outputs: list[Any] = [clipped]
            losses, aux = (
                _split_values(chunks.values, has_aux, device) if has_aux or return_diagnostics else (None, None)
            )
            if has_aux:
                outputs.append(aux)
            if return_diagnostics:
                outputs.append(_diagnostics(chunks, losses, device))
            if isinstance(state, AdaptiveClipState):
                num_clipped = chunks.clipped.sum() if chunks.size else torch.zeros((), dtype=torch.long)
                counts = torch.stack([num_clipped.double().cpu(), torch.tensor(float(chunks.size))])
                if reduce_count is not None:
                    counts = reduce_count(counts)
                state = rules.next_adaptive_state(bound, state, counts, normalize_by)
        return (outputs[0] if len(outputs) == 1 else tuple(outputs)), state

    return grad_fn, initial


def _argnums(name: str, value: Any) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise InputTypeError(f"{name} must be an int or a tuple of ints, got {value!r}.")
    items = tuple(items)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigurationError(f"{name} must hold non-negative ints, got {value!r}.")
    if not items:
        raise ConfigurationError(f"{name} must name at least one argument, got {value!r}.")
    if len(set(items)) != len(items):
        raise ConfigurationError(f"{name} repeats an argument: {value!r}.")
    return items


def _positions(spec: tuple[int, ...] | slice, n_args: int) -> tuple[int, ...]:
    """The batched positions of a call with ``n_args`` arguments."""
    if not isinstance(spec, slice):
        return spec
    return _argnums("batch_argnums", tuple(range(n_args))[spec])


def _disjoint(diff_args: tuple[int, ...], batch_args: tuple[int, ...]) -> None:
    if set(diff_args) & set(batch_args):
        raise ConfigurationError(
            f"argnums {diff_args} and batch_argnums {batch_args} overlap: parameters cannot carry a batch axis."
        )


def _split_values(values: list[Any], has_aux: bool, device: torch.device) -> tuple[torch.Tensor, Any]:
    """``(losses [B], aux [B, ...] or None)`` from the values of every chunk."""
    if not values:
        return torch.zeros(0, dtype=torch.float32, device=device), None
    if not has_aux:
        return torch.cat(values), None
    if not all(isinstance(v, tuple) and len(v) == 2 for v in values):
        raise ConfigurationError(
            "has_aux needs an engine that returns the loss's aux output with each loss (VmapGradients does); this "
            "engine returns losses only. Drop has_aux or use the VMAP engine."
        )
    return torch.cat([v[0] for v in values]), optree.tree_map(lambda *xs: torch.cat(xs, dim=0), *[v[1] for v in values])


def _diagnostics(chunks: Chunked, losses: torch.Tensor, device: torch.device) -> ClipDiagnostics:
    if not chunks.size:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        none = torch.zeros((), dtype=torch.int64, device=device)
        return ClipDiagnostics(empty, torch.zeros((), device=device), empty, 0, none)
    nonfinite = (~torch.isfinite(chunks.norms)).sum()
    return ClipDiagnostics(chunks.norms, chunks.clipped.float().mean(), losses, chunks.size, nonfinite)
