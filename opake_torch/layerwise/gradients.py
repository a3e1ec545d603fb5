"""The chunk's per-example gradients as the hook engine forms them: instantiated ones in grouped buffers and ghost
calls, with their squared norms and their scaled sum (the
:class:`~opake_core.clipping.engine.PerExampleGradients` protocol)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.ghost import Bound, GramSquares, ScaledInputs, add_ghost, finish, gram_squares, tied_norms
from opake_torch.layerwise.precision import float32_matmuls

__all__ = ["NORM_NUMEL", "Gradients"]

NORM_NUMEL = 2**24
"""Elements of instantiated gradients whose float64 norms are taken in one launch (their float64 copy: 128 MiB); a
group of many small leaves (biases, norm weights) takes a few launches instead of one per leaf."""


@dataclass
class _Group:
    """Instantiated per-example gradients of the names that share an accumulation dtype and a shape: one contiguous
    buffer ``[c, m, *shape]`` (name ``j``'s gradients are ``buffer[j]``), so that their norms and their scaled sum
    take one batched operation each instead of one per name."""

    names: list[str]
    dtype: torch.dtype
    shape: torch.Size
    buffer: torch.Tensor | None = None  # zeros from the backward's first write into the group; None before

    def flat(self) -> torch.Tensor:
        """The buffer as ``[c, m, numel]``."""
        return self.buffer.view(len(self.names), self.buffer.shape[1], math.prod(self.shape))


@dataclass
class Gradients:
    """The chunk's per-example gradients: per trainable name, instantiated ``[m, *shape]`` or ghost calls.

    Instantiated gradients live in the buffers of :class:`_Group` (``dense[name]`` is a view of its rows), grouped
    once the forward has shown which names they are (:meth:`group`); a group's buffer is allocated at the backward's
    first write into it (:meth:`block`), past the forward's peak, and a group never written holds zero gradients.
    """

    names: list[str]
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]  # accumulation dtype: float64 for float64 parameters, else float32
    m: int
    device: torch.device
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [m, *shape], a view of its group's buffer
    ghost: dict[str, tuple[Call, torch.Tensor | Bound]] = field(default_factory=dict)  # name -> (call, squared norms)
    groups: list[_Group] = field(default_factory=list)
    group_of: dict[str, _Group] = field(default_factory=dict)
    product_error: float = 0.0  # of the float32 ghost sums, at the run's matmul precision (precision.product_error)
    norm_route: str = "gram"  # how ghost linear and Conv1D calls take their norms (ghost.NORM_ROUTES)
    one_pass: set[str] = field(default_factory=set)  # ghost weights whose norms carry the one-pass sum's margin
    # ghost weights tied to an embedding (ghost.tied_names): its call and norms once the backward records it
    tied: dict[str, tuple[Call, torch.Tensor] | None] = field(default_factory=dict)

    def group(self, names: Sequence[str]) -> None:
        """The (dtype, shape) groups of the instantiated gradients of ``names``."""
        by_shape: dict[tuple[torch.dtype, torch.Size], list[str]] = {}
        for name in names:
            by_shape.setdefault((self.dtypes[name], self.shapes[name]), []).append(name)
        for (dtype, shape), members in by_shape.items():
            self.groups.append(_Group(members, dtype, shape))
            self.group_of.update(dict.fromkeys(members, self.groups[-1]))

    def block(self, name: str) -> torch.Tensor:
        """``[m, *shape]``: where the gradients of ``name`` are written (its group's buffer, allocated at the first
        request)."""
        if name not in self.dense:
            group = self.group_of[name]
            group.buffer = torch.zeros(len(group.names), self.m, *group.shape, dtype=group.dtype, device=self.device)
            self.dense.update(zip(group.names, group.buffer.unbind(0), strict=True))
        return self.dense[name]

    def squared_norms(self) -> torch.Tensor:
        self._form_gram_squares()
        rows, bounds = {}, {}
        for name, (call, norms) in self.ghost.items():
            if (embedding := self.tied.get(name)) is not None:  # a tied weight: both calls' parts and their cross term
                rows[name] = tied_norms(call, norms, *embedding, self.m)
            else:
                (bounds if isinstance(norms, Bound) else rows)[name] = norms
        rows.update(zip(bounds, finish(list(bounds.values())), strict=True))  # a layer shape at a time
        for group in self.groups:  # vector_norm reads a float64 copy of what it is given: NORM_NUMEL at a time
            if group.buffer is None:
                continue
            flat = group.flat()
            step = max(1, NORM_NUMEL // max(1, self.m * math.prod(group.shape)))
            for start in range(0, len(group.names), step):
                sq = torch.linalg.vector_norm(flat[start : start + step], dim=2, dtype=torch.float64).square()
                rows.update(zip(group.names[start : start + step], sq.unbind(0), strict=True))
        zeros = torch.zeros(self.m, dtype=torch.float64, device=self.device)
        return torch.stack([rows.get(name, zeros) for name in self.names])

    def _form_gram_squares(self) -> None:
        """The Gram-route squares the calls left (:class:`~opake_torch.layerwise.ghost.GramSquares`), formed a batch
        at a time (:func:`~opake_torch.layerwise.ghost.gram_squares`) and put in their place."""
        pending = {}  # name -> (GramSquares, its Bound or None)
        for name, (_, norms) in self.ghost.items():
            bound = norms if isinstance(norms, Bound) else None
            squares = norms if bound is None else bound.squares
            if isinstance(squares, GramSquares):
                pending[name] = (squares, bound)
        if not pending:
            return
        formed = gram_squares([p for p, _ in pending.values()], [b is not None for _, b in pending.values()], self.m)
        for (name, (_, bound)), (squares, spread) in zip(pending.items(), formed, strict=True):
            norms = squares if bound is None else dataclasses.replace(bound, squares=squares, spread=spread)
            self.ghost[name] = (self.ghost[name][0], norms)  # a margin's spread from the same Gram matrices

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        """Consumes the instantiated buffers (scaled in place): call once, after :meth:`squared_norms`."""
        index = {name: k for k, name in enumerate(self.names)}
        for group in self.groups:
            if group.buffer is None:
                continue
            leaves = [index[name] for name in group.names]
            rows = scales[group.buffer.dtype]  # [L, m]; stride 0: one row for every leaf
            scale = rows[0].expand(len(leaves), -1) if not rows.stride(0) else torch.stack([rows[k] for k in leaves])
            scaled = group.flat().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(scale[:, :, None])
            summed = scaled.sum(dim=1).view(-1, *group.shape)  # [c, *shape]: the leaves' shape, one view for all
            torch._foreach_add_([sums[k] for k in leaves], list(summed.unbind(0)))
        rows_of: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        inputs = ScaledInputs(self.m)
        with float32_matmuls(self.device, highest=not self.product_error):  # the precision the norms assumed
            for name, (call, _) in self.ghost.items():
                k = index[name]
                total = sums[k]
                rows = scales[total.dtype]
                key = (total.dtype, k if rows.stride(0) else 0)  # one row for all leaves (stride 0): one mask
                embedding = self.tied.get(name)
                for part in (call, None if embedding is None else embedding[0]):  # a tied weight: both calls' parts
                    if part is None or part.grad is None:  # the loss does not depend on this output: zero gradient
                        continue
                    if key not in rows_of:
                        scale = rows[k].reshape(self.m, 1, 1)
                        rows_of[key] = (scale, scale == 0)
                    add_ghost(part, *rows_of[key], total, inputs, one_pass=part is call and name in self.one_pass)
                    part.inputs = part.grad = None  # consumed, as the buffers are: the next sums run without them
