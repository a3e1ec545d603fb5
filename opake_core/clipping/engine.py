"""The clipping engine: how :func:`~opake_core.clipping.clipped_grad` computes one chunk of examples.

An :class:`Engine` is one value with two parts:

* ``gradients(example_grad, args, batch_argnums) -> (PerExampleGradients, values)`` forms the chunk's per-example
  gradients, in whatever form the engine keeps them. How they are clipped and summed is the arithmetic of that form:
  :class:`PerExampleGradients` gives the per-leaf squared norms and adds a scaled sum; the rule that turns norms into
  scales stays in :mod:`opake_core.clipping.rules`, so every engine releases the same clipped sum up to float
  rounding. ``example_grad(*example_args) -> (gradient tree, value)`` is ``grad`` of the loss of **one** example
  (batched arguments without their batch dimension); ``values`` are the stacked per-example values, ``[m]`` losses
  (or ``(losses, aux)`` when the loss has an auxiliary output).
* ``transform`` wraps the chunk function once (``torch.compile``, a CUDA-graph capture); ``None`` runs it as it is.

Engines here: :class:`VmapGradients` (``torch.func.vmap`` of ``example_grad``, the default, held as
:class:`MaterializedGradients`); the adapter adds ``opake_torch.layerwise.LayerwiseGradients`` (one batched pass,
ghost norms), ``opake_torch.patches.kernels.FusedGradients`` (Triton norms and scaled sums for materialized
gradients) and ``opake_torch.auditing.DiracGradients`` (an audit's Dirac canaries written down beside another
engine's gradients). A new engine is a ``gradients`` callable, and a :class:`PerExampleGradients` class when its
gradients are not plain tensors ``[m, *leaf.shape]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import optree
import torch
from torch.func import grad, vmap

from opake_core.errors import ConfigurationError, VmapCompatibilityError

__all__ = [
    "VMAP",
    "Engine",
    "MaterializedGradients",
    "PerExampleGradients",
    "SquaringGradients",
    "VmapGradients",
    "example_grad",
]

Chunk = Callable[..., tuple[Any, ...]]
"""``chunk(rule, bounds, live, *chunk_args) -> (sums, norms [m], clipped [m], values)``: tensors in (the rule is
hashable), tensors out."""


class PerExampleGradients(Protocol):
    """The per-example gradients of one chunk of ``m`` examples, in whatever form an engine keeps them.

    Leaves are in the parameter tree's flattening order (``L`` leaves).

    Example: a form for a single leaf held as rows ``[m, d]``, plugged into the default engine.

        >>> import torch
        >>> from opake_core import Engine, VmapGradients, clipped_grad
        >>> class Rows:
        ...     def __init__(self, leaves):
        ...         self.rows = leaves[0]
        ...     def squared_norms(self):
        ...         return self.rows.double().square().sum(dim=1)[None]
        ...     def add_scaled(self, scales, sums):
        ...         sums[0].add_(scales[sums[0].dtype][0] @ self.rows)
        >>> engine = Engine(gradients=VmapGradients(form=Rows))
        >>> grad_fn, state = clipped_grad(lambda w, x: x @ w, clipping_norm=1.0, engine=engine)
        >>> clipped, state = grad_fn(torch.zeros(2), torch.tensor([[3.0, 4.0], [0.1, 0.0]]), state=state)
        >>> clipped.value  # (3, 4) clipped to norm 1, plus (0.1, 0)
        tensor([0.7000, 0.8000])
    """

    def squared_norms(self) -> torch.Tensor:
        """float64 ``[L, m]``: the squared L2 norm of every example's gradient of every leaf."""
        ...

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        """Add ``sum_i s[k, i] * g_i[k]`` to ``sums[k]`` for every leaf ``k``, in place, with ``s = scales[dtype]``
        for the dtype of ``sums[k]``.

        ``scales[dtype]`` is ``[L, m]`` in that dtype (row ``k``: leaf ``k``; an expanded view with stride 0 when all
        leaves share the scales); an example whose scale is 0 must add exactly nothing, even where its gradient is not
        finite.
        """
        ...


class SquaringGradients(PerExampleGradients, Protocol):
    """Per-example gradients that can also add their scaled element-wise squares (private second moments,
    ``clipped_grad(..., second_moment=True)``); an engine whose form lacks this refuses that option."""

    def add_squared_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        """Add ``sum_i (s[k, i] * g_i[k])^2`` (element-wise) to ``sums[k]`` for every leaf ``k``, in place.

        The square of the very contribution :meth:`add_scaled` adds, formed in the dtype of ``sums[k]``, so that
        ``||fl(s g) ⊙ fl(s g)||_2 <= ||fl(s g)||_2^2 <= C^2`` holds for the stored values (up to the rounding of the
        square, which the clipping margin of 4 unit roundoffs absorbs). An example whose scale is 0 adds nothing.
        """
        ...


class MaterializedGradients:
    """Per-example gradients held as tensors ``[m, *leaf.shape]`` (what ``vmap(grad)`` returns).

    Example: one leaf, two examples; the second is kept whole, the first scaled by 0.2.

        >>> import torch
        >>> from opake_core import MaterializedGradients
        >>> grads = MaterializedGradients([torch.tensor([[3.0, 4.0], [0.0, 1.0]])])
        >>> grads.squared_norms()
        tensor([[25.,  1.]], dtype=torch.float64)
        >>> sums = [torch.zeros(2)]
        >>> grads.add_scaled({torch.float32: torch.tensor([[0.2, 1.0]])}, sums)
        >>> sums[0]
        tensor([0.6000, 1.8000])
    """

    def __init__(self, leaves: list[torch.Tensor]) -> None:
        self.leaves = [g.detach() for g in leaves]

    def squared_norms(self) -> torch.Tensor:
        return torch.stack([g.to(torch.float64).square().reshape(g.shape[0], -1).sum(dim=1) for g in self.leaves])

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        for k, (g, total) in enumerate(zip(self.leaves, sums, strict=True)):
            leaf_scale = scales[total.dtype][k].reshape(g.shape[0], *([1] * (g.dim() - 1)))
            contribution = torch.nan_to_num(g.to(total.dtype) * leaf_scale, nan=0.0, posinf=0.0, neginf=0.0)
            total.add_(contribution.sum(dim=0))

    def add_squared_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        for k, (g, total) in enumerate(zip(self.leaves, sums, strict=True)):
            leaf_scale = scales[total.dtype][k].reshape(g.shape[0], *([1] * (g.dim() - 1)))
            contribution = torch.nan_to_num(g.to(total.dtype) * leaf_scale, nan=0.0, posinf=0.0, neginf=0.0)
            total.add_(contribution.square().sum(dim=0))


@dataclass(frozen=True)
class VmapGradients:
    """``torch.func.vmap(example_grad)`` over the chunk, with dropout drawn per example (``randomness="different"``),
    held as ``form(leaves)``: :class:`MaterializedGradients`, or a subclass with faster arithmetic.

    Example: the gradients of ``w -> x.w`` for two examples are the examples themselves.

        >>> import torch
        >>> from torch.func import grad
        >>> from opake_core import VmapGradients
        >>> example_grad = lambda w, x: (grad(lambda w: x @ w)(w), x @ w)  # (gradient, value) of one example
        >>> args = (torch.zeros(2), torch.tensor([[3.0, 4.0], [1.0, 0.0]]))  # batched: position 1
        >>> grads, values = VmapGradients()(example_grad, args, (1,))
        >>> grads.squared_norms(), values
        (tensor([[25.,  1.]], dtype=torch.float64), tensor([0., 0.]))
    """

    form: Callable[[list[torch.Tensor]], PerExampleGradients] = MaterializedGradients

    def __call__(
        self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]
    ) -> tuple[PerExampleGradients, Any]:
        in_dims = tuple(0 if i in batch_argnums else None for i in range(len(args)))
        try:
            tree, values = vmap(example_grad, in_dims=in_dims, randomness="different")(*args)
        except RuntimeError as exc:
            if _runs_without_vmap(example_grad, args, batch_argnums):
                raise _vmap_error(exc) from exc
            raise
        return self.form(optree.tree_leaves(tree)), values


@dataclass(frozen=True)
class Engine:
    """How each chunk's per-example gradients are formed (``gradients``) and how the chunk runs (``transform``).

    Attributes:
        gradients: ``gradients(example_grad, args, batch_argnums) -> (PerExampleGradients, values)`` for the chunk's
            arguments ``args`` (batched ones ``[m, ...]`` at ``batch_argnums``); see the module docstring.
        transform: wraps the chunk function ``chunk(rule, bounds, live, *chunk_args) -> (sums, norms, clipped,
            values)`` once, when ``clipped_grad`` is built (one capture or compilation per argument shape). With a
            transform and a ``microbatch_size``, every chunk gets a ``live`` mask, so that its arguments keep one
            structure. The wrapped function must return tensors of its own: the sums are accumulated and divided in
            place.
        row_multiple: each chunk's rows are rounded up to a multiple of this (at most the ``microbatch_size``) with
            dead rows (copies of its last example, marked dead by ``live``, that add exactly nothing), so that
            Poisson batches of varying size meet ``ceil(microbatch_size / row_multiple)`` shapes (the allocator,
            the kernels and a transform see them again); 1 runs the real rows only. None (the default): the whole
            ``microbatch_size`` with a transform (one shape), 1 without.
        min_rows: each chunk runs at least this many rows (at most the ``microbatch_size``), dead rows added: 2
            keeps a compiled chunk off the one-row size that Dynamo specializes (a second compilation).

    Example: padding each chunk to a multiple of 4 rows changes the shapes, not the clipped sum.

        >>> import torch
        >>> from opake_core import Engine, clipped_grad
        >>> x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
        >>> results = []
        >>> for engine in (Engine(), Engine(row_multiple=4)):
        ...     grad_fn, state = clipped_grad(lambda w, x: (x @ w).sin(), clipping_norm=0.5, microbatch_size=3,
        ...                                   engine=engine)
        ...     results.append(grad_fn(torch.ones(3), x, state=state)[0].value)
        >>> torch.allclose(results[0], results[1])
        True
    """

    gradients: Callable[..., tuple[PerExampleGradients, Any]] = VmapGradients()
    transform: Callable[[Chunk], Chunk] | None = None
    row_multiple: int | None = None
    min_rows: int = 1

    def __post_init__(self) -> None:
        multiple = self.row_multiple
        if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
            raise ConfigurationError(f"row_multiple must be None or an int >= 1, got {multiple!r}.")
        rows = self.min_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ConfigurationError(f"min_rows must be an int >= 1, got {rows!r}.")


VMAP = Engine()
"""The default engine: ``vmap(grad)``, materialized gradients, each chunk run as it is."""


def example_grad(loss_fn: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool) -> Callable[..., Any]:
    """``grad`` of one example's loss, returning ``(gradient tree, value)``: the loss (detached), or ``(loss, aux)``
    with ``has_aux``. Refuses a loss that is not a scalar (a batch of losses)."""

    def with_value(*args: Any) -> tuple[torch.Tensor, Any]:
        out = loss_fn(*args)
        loss, aux = out if has_aux else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(
                f"loss_fn must return a scalar tensor for one example, got {shape}. Return the example's own loss "
                "(a mean over its tokens at most), not a batch of losses."
            )
        return loss, ((loss.detach(), aux) if has_aux else loss.detach())

    return grad(with_value, argnums=argnums, has_aux=True)


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


def _runs_without_vmap(fn: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]) -> bool:
    """Whether the per-example function runs on the first example alone: then a failure under vmap is vmap's."""
    single = [optree.tree_map(lambda x: x[0], a) if i in batch_argnums else a for i, a in enumerate(args)]
    try:
        fn(*single)
    except Exception:
        return False
    return True
