"""``clipped_fun``: clip and sum the per-example *outputs* of any function, not only gradients.

For ``fun(*args) -> y`` (a pytree of floating-point tensors for **one** example), the release is

    y_bar = (1/n) sum_{i in B} y_i * scale_i,    scale_i = min(1, C (1 - 4u) / ||y_i||_2),

``||y_i||_2`` the L2 norm over every leaf of example ``i``'s output, ``n`` a public normalizer and ``u`` the unit
roundoff of the accumulation dtype: the rules of :mod:`opake_core.clipping.rules` applied to outputs. Adding or
removing one example moves ``y_bar`` by at most ``C / n`` (the ``sensitivity`` of the returned
:class:`~opake_core.tree.Clipped`); per group (:func:`~opake_core.tree.per_group` built on a tree shaped like one
example's output) ``sqrt(sum_k C_k^2) / n``; AUTO-S (:func:`auto_clipped_fun`, Bu et al. 2023, arXiv 2206.07136,
eq. 4) scales by ``R (1 - 4u) / (||y_i|| + gamma)``, sensitivity ``R / n``.

Uses: releasing per-example statistics (feature means, embedding sums, per-example losses as a vector, a sketch) or
gradients formed by hand; the sum is noised with :func:`opake_core.noise.gaussian_noise` like a clipped gradient.

The batch runs in chunks of ``microbatch_size`` examples (:mod:`opake_core.clipping.microbatching`): the result
does not depend on the chunking beyond float summation order. Outputs are formed with ``torch.func.vmap(fun)``
(``randomness="different"``). Unlike :func:`~opake_core.clipping.clipped_grad`, an **empty batch is refused**: the
structure and shapes of the output tree come from evaluating ``fun``, and with no example there is nothing to
evaluate (a zero tree of the right shape cannot be inferred). Callers that sample Poisson batches should either
build the zero release themselves from a known output template or skip the call and noise zeros of that shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.func import vmap

from opake_core import validate
from opake_core.clipping import rules
from opake_core.clipping.engine import MaterializedGradients, _runs_without_vmap, _vmap_error
from opake_core.clipping.grad import _argnums
from opake_core.clipping.microbatching import batch_size, run_chunks
from opake_core.clipping.rules import AdaptiveRule, AutoSRule, ClipRule, FixedClipState
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import Clipped, PerGroup

__all__ = ["OutputDiagnostics", "auto_clipped_fun", "clipped_fun"]


@dataclass(frozen=True)
class OutputDiagnostics:
    """Exact per-batch statistics of one :func:`clipped_fun` call: **outside the privacy guarantee**.

    Attributes:
        norms: float32 ``[B]``, each example's output L2 norm before clipping (NaN for a non-finite one).
        clip_rate: float32 scalar tensor, the fraction of examples whose norm exceeded its bound.
        batch_size: ``B``, the realized number of examples.
        nonfinite: int64 scalar tensor, the examples whose output norm was not finite: they added nothing.

    Example:

        >>> import torch
        >>> from opake_core import clipped_fun
        >>> fn, state = clipped_fun(lambda x: x, clipping_norm=1.0, return_diagnostics=True)
        >>> (clipped, diagnostics), state = fn(torch.tensor([[0.3, 0.4], [6.0, 8.0]]), state=state)
        >>> diagnostics.norms, diagnostics.clip_rate
        (tensor([ 0.5000, 10.0000]), tensor(0.5000))
    """

    norms: torch.Tensor
    clip_rate: torch.Tensor
    batch_size: int
    nonfinite: torch.Tensor


def clipped_fun(
    fun: Callable[..., Any],
    *,
    clipping_norm: float | PerGroup | AutoSRule,
    batch_argnums: int | tuple[int, ...] = 0,
    normalize_by: float = 1.0,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    return_diagnostics: bool = False,
) -> tuple[Callable[..., Any], FixedClipState]:
    """Build a function that clips every example's output of ``fun`` to L2 norm ``C``, sums and normalizes.

    Args:
        fun: ``fun(*args) -> y`` for **one** example (the arguments at ``batch_argnums`` without their batch
            dimension); ``y`` is a tensor or a pytree of floating-point tensors, the same structure and shapes for
            every example. With ``has_aux``, ``fun`` returns ``(y, aux)``.
        clipping_norm: the bound ``C`` on each example's output norm (``math.inf`` disables clipping), a
            :class:`~opake_core.tree.PerGroup` built with ``per_group`` on a tree shaped like one output, or
            :func:`~opake_core.clipping.auto_s` (AUTO-S). Adaptive clipping is not offered for outputs.
        batch_argnums: the argument(s) whose tensors carry a leading batch dimension ``[B, ...]``; the others are
            passed whole to every example.
        normalize_by: the public normalizer ``n`` (> 0), never the realized batch size.
        microbatch_size: the most examples per chunk (memory only; ``None`` = the whole batch at once).
        has_aux: ``fun`` returns ``(y, aux)``; the per-example ``aux`` values are returned stacked ``[B, ...]``,
            **outside** the privacy guarantee.
        return_diagnostics: also return :class:`OutputDiagnostics` (outside the guarantee).

    Returns:
        ``(fn, state)``. ``fn(*args, state=state) -> (out, state)`` where ``out`` is a
        :class:`~opake_core.tree.Clipped` tree shaped like one example's output, with ``sensitivity = C / n``
        (``sqrt(sum_k C_k^2) / n`` jointly per group, ``R / n`` for AUTO-S), float32 (float64 for float64
        outputs); with ``has_aux`` and/or ``return_diagnostics`` it is a tuple ``(clipped, aux?, diagnostics?)``.

    Raises:
        ConfigurationError: at build time, a bad bound, normalizer or chunk size, or adaptive clipping; at call time,
            an empty batch (``B = 0``: the output tree cannot be inferred without an example), a ``batch_argnums``
            beyond the arguments, or a per-group bound that does not cover the output's leaves.
        InputTypeError: an output leaf that is not a floating-point tensor, or a state from another factory.

    Example: a private mean of vectors; the second row is scaled down to norm 1.

        >>> import torch
        >>> from opake_core import clipped_fun
        >>> fn, state = clipped_fun(lambda x: x, clipping_norm=1.0, normalize_by=2.0)
        >>> clipped, state = fn(torch.tensor([[0.6, 0.0], [0.0, 4.0]]), state=state)
        >>> clipped.value, clipped.sensitivity
        (tensor([0.3000, 0.5000]), 0.5)
    """
    if not callable(fun):
        raise InputTypeError(f"fun must be a function of one example, got {type(fun).__name__} {fun!r:.40}.")
    bound = rules.check_rule(clipping_norm)
    if isinstance(bound, AdaptiveRule):
        raise ConfigurationError(
            "clipped_fun does not offer adaptive clipping (its threshold update is defined for gradients); pass a "
            "fixed clipping_norm, a PerGroup or auto_s(...)."
        )
    batch_args = _argnums("batch_argnums", batch_argnums)
    normalize_by = validate.positive("normalize_by", normalize_by)
    rules.check_scale(bound, normalize_by)
    if microbatch_size is not None:
        validate.integer("microbatch_size", microbatch_size, minimum=1)
    initial = FixedClipState()
    example = _example_fun(fun, has_aux)

    def clipped_fn(*args: Any, state: Any) -> tuple[Any, Any]:
        if not isinstance(state, FixedClipState):
            raise InputTypeError(f"fn expects the FixedClipState from clipped_fun, got {type(state).__name__}.")
        if max(batch_args) >= len(args):
            raise ConfigurationError(f"fn got {len(args)} arguments but batch_argnums={batch_args}.")
        with torch.profiler.record_function("opake::clipped_fun"), torch.no_grad():
            size = batch_size([args[i] for i in batch_args])
            if size == 0:
                raise ConfigurationError(
                    "clipped_fun needs a non-empty batch (got B = 0): the structure and shapes of the output tree "
                    "come from evaluating fun on an example. For an empty draw, release noise on a zero tree shaped "
                    "like one example's output (Clipped(zeros, sensitivity)) instead of calling fn."
                )
            treedefs: list[Any] = []

            def chunk(live: torch.Tensor | None, *chunk_args: Any) -> tuple[Any, ...]:
                outputs, aux = _per_example(example, chunk_args, batch_args)
                leaves, treedef = optree.tree_flatten(outputs)
                template = _template(leaves, treedef)
                rule, floats = ClipRule.of(template, bound)
                treedefs.append(treedef)
                device = leaves[0].device
                sums, norms, clipped = rule(
                    MaterializedGradients(leaves), optree.tree_leaves(template), rules.bounds_on(floats, device), live
                )
                return sums, norms, clipped, (aux if has_aux else torch.zeros(len(norms), device=device))

            device = _first_device(args, batch_args)
            chunks = run_chunks(chunk, (), args, batch_args, microbatch_size=microbatch_size, pad=False, device=device)
            if any(t != treedefs[0] for t in treedefs):
                raise ConfigurationError(
                    f"fun returned different output structures across chunks ({treedefs[0]} and others); it must "
                    "return the same tree for every example."
                )
            torch._foreach_div_(chunks.sums, normalize_by)  # the accumulators are this call's own
            outputs: list[Any] = [
                Clipped(optree.tree_unflatten(treedefs[0], chunks.sums), rules.sensitivity(bound, normalize_by))
            ]
            if has_aux:
                outputs.append(optree.tree_map(lambda *xs: torch.cat(xs, dim=0), *chunks.values))
            if return_diagnostics:
                nonfinite = (~torch.isfinite(chunks.norms)).sum()
                outputs.append(OutputDiagnostics(chunks.norms, chunks.clipped.float().mean(), chunks.size, nonfinite))
        return (outputs[0] if len(outputs) == 1 else tuple(outputs)), state

    return clipped_fn, initial


def auto_clipped_fun(
    fun: Callable[..., Any],
    *,
    bound: float = 1.0,
    gamma: float = 0.01,
    batch_argnums: int | tuple[int, ...] = 0,
    normalize_by: float = 1.0,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    return_diagnostics: bool = False,
) -> tuple[Callable[..., Any], FixedClipState]:
    """:func:`clipped_fun` with AUTO-S normalization (Bu et al. 2023, "Automatic clipping", arXiv 2206.07136, eq. 4).

    Every example's output is scaled by ``R (1 - 4u) / (||y_i||_2 + gamma)`` (never clamped: every contribution has
    norm below ``R``), so the sum's sensitivity is ``R / n``. Same as ``clipped_fun(fun,
    clipping_norm=auto_s(bound, gamma=gamma), ...)``; ``bound`` is ``R`` (> 0), ``gamma`` the stability constant
    (> 0). The other arguments, the result and the empty-batch refusal are those of :func:`clipped_fun`.

    Example: every example contributes a vector of norm just below ``R``, whatever its own norm.

        >>> import torch
        >>> from opake_core import auto_clipped_fun
        >>> fn, state = auto_clipped_fun(lambda x: x, bound=2.0, gamma=0.01)
        >>> for row in ([3.0, 4.0], [0.03, 0.04]):
        ...     clipped, state = fn(torch.tensor([row]), state=state)
        ...     print(round(clipped.value.norm().item(), 4), clipped.sensitivity)
        1.996 2.0
        1.6667 2.0
    """
    return clipped_fun(
        fun,
        clipping_norm=rules.auto_s(bound, gamma=gamma),
        batch_argnums=batch_argnums,
        normalize_by=normalize_by,
        microbatch_size=microbatch_size,
        has_aux=has_aux,
        return_diagnostics=return_diagnostics,
    )


def _example_fun(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``fun`` for one example, returning ``(output tree, aux)`` (``aux`` a zero scalar without ``has_aux``)."""

    def one(*args: Any) -> tuple[Any, Any]:
        out = fun(*args)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConfigurationError(f"with has_aux, fun must return (output, aux), got {type(out).__name__}.")
            return out
        return out, torch.zeros(())

    return one


def _per_example(example: Callable[..., Any], args: Sequence[Any], batch_args: tuple[int, ...]) -> tuple[Any, Any]:
    in_dims = tuple(0 if i in batch_args else None for i in range(len(args)))
    try:
        return vmap(example, in_dims=in_dims, randomness="different")(*args)
    except RuntimeError as exc:
        if _runs_without_vmap(example, args, batch_args):
            raise _vmap_error(exc) from exc
        raise


def _template(leaves: list[Any], treedef: Any) -> Any:
    """One example's output tree (row 0 of each stacked leaf), after checking every leaf is a float tensor."""
    paths = optree.tree_paths(optree.tree_unflatten(treedef, leaves))
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            what = f"{leaf.dtype} tensor" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise InputTypeError(
                f"fun's output leaf {'.'.join(map(str, path)) or '<root>'!r} is a {what}; clipped_fun clips "
                "floating-point tensors only. Convert the output to float (or drop that leaf)."
            )
    if not leaves:
        raise InputTypeError("fun returned an output with no tensor leaf; return a tensor or a tree of tensors.")
    return optree.tree_unflatten(treedef, [leaf[0] for leaf in leaves])


def _first_device(args: Sequence[Any], batch_args: tuple[int, ...]) -> torch.device:
    for i in batch_args:
        for leaf in optree.tree_leaves(args[i]):
            if isinstance(leaf, torch.Tensor):
                return leaf.device
    return torch.device("cpu")
