"""The taps of Hugging Face mixture-of-experts layers: top-k routers and stacked experts recognized, and the experts
run with their two projections tapped, an example's rows kept contiguous.

A router is a linear layer on the flattened tokens ``[m T, d]``: the engine taps its logits. A stacked experts layer
(``[E, ...]`` weights) runs :func:`tapped_experts_forward` during the pass: one row per token and chosen expert, the
rows sorted by expert once (:class:`Routing`) and multiplied by their experts in one grouped matmul
(:func:`grouped_rows`). Their norms and sums (:mod:`opake_torch.layerwise.ghost`, :mod:`opake_torch.layerwise.dense`)
take the same sorted rows in groups (:func:`grouped_sums`, :func:`padded`), so that the operators a layer dispatches
do not grow with the number of experts ``E``.

A grouped matmul is ``torch._grouped_mm`` where the device has it for the dtype (float32, bf16, float16; 16-byte
aligned strides); elsewhere (float64) the groups' rows are padded into batched matmuls, which needs the groups'
sizes on the host (:attr:`Routing.pair_sizes`: one host sync per layer, shared by its projections, forward and
backward). The norms always pad (a Gram matrix per group), so they read the sizes too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Routing", "grouped_rows", "grouped_sums", "moe_kind", "padded", "replace_forward", "tapped_experts_forward"]


@dataclass(frozen=True)
class Routing:
    """Where the ``m R`` rows of an experts layer went (example ``i`` owns rows ``i R ... i R + R - 1``), built on
    the device without a host sync.

    ``order`` lists the rows sorted by (expert, example), ascending within each such pair; ``inverse`` is its inverse
    permutation and ``sorted_pairs`` the pair ``e m + i`` of each row in that order; ``pair_ends`` (int32 ``[E m]``)
    holds the cumulative row counts of the pairs in that order and ``ends`` (int32 ``[E]``) those of the experts:
    the offsets of grouped matmuls."""

    experts: torch.Tensor  # [m R]: the expert of every row
    order: torch.Tensor
    inverse: torch.Tensor
    sorted_pairs: torch.Tensor
    pair_ends: torch.Tensor
    m: int

    @staticmethod
    def of(experts: torch.Tensor, num_experts: int, m: int) -> Routing:
        rows = torch.arange(experts.shape[0], device=experts.device)
        example = torch.div(rows, experts.shape[0] // m, rounding_mode="floor")
        order = torch.argsort(experts, stable=True)  # the rows are example-major: sorted by (expert, example) too
        sorted_pairs = (experts * m + example).index_select(0, order)
        pairs = torch.arange(num_experts * m, device=experts.device)
        pair_ends = torch.searchsorted(sorted_pairs, pairs, right=True, out_int32=True)
        inverse = torch.empty_like(order).index_copy_(0, order, rows)
        return Routing(experts, order, inverse, sorted_pairs, pair_ends, m)

    @functools.cached_property
    def ends(self) -> torch.Tensor:
        return self.pair_ends[self.m - 1 :: self.m].contiguous()  # a kernel's offsets: contiguous

    @functools.cached_property
    def sorted_experts(self) -> torch.Tensor:
        """``[m R]``: the expert of each row in ``order``."""
        return torch.div(self.sorted_pairs, self.m, rounding_mode="floor")

    @functools.cached_property
    def pair_sizes(self) -> list[int]:
        """The rows of each pair ``e m + i``, read from the device: the layer's one host sync."""
        return torch.diff(self.pair_ends, prepend=self.pair_ends.new_zeros(1)).tolist()

    @functools.cached_property
    def sizes(self) -> list[int]:
        """The rows of each expert (from :attr:`pair_sizes`)."""
        pairs, m = self.pair_sizes, self.m
        return [sum(pairs[e * m : (e + 1) * m]) for e in range(len(pairs) // m)]


@functools.cache
def _has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` in ``dtype``, both forms (rows times stacked matrices, and
    sums over groups of rows), tried once on a small input."""
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    a = torch.ones(16, 16, dtype=dtype, device=device)
    offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
    try:
        torch._grouped_mm(a, torch.ones(2, 16, 16, dtype=dtype, device=device), offs=offs)
        torch._grouped_mm(a.T, a, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _grouped(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``tensors`` as they are: one dtype it has on their device, the storage
    and every non-unit stride 16-byte aligned."""
    first = tensors[0]
    aligned = all(
        t.dtype == first.dtype and t.data_ptr() % 16 == 0 and all(s == 1 or s * t.element_size() % 16 == 0
                                                                  for s in t.stride())
        for t in tensors
    )  # fmt: skip
    return aligned and _has_grouped_mm(first.device, first.dtype)


def _chunks(sizes: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(r0, r1, W)``: the groups with rows, in the order of a stable descending sort of ``sizes``, cut into runs
    ``r0 ... r1 - 1`` padded to their first (widest) group's ``W`` rows, a run growing while its padded rows stay
    within twice its rows. So a run takes every group of at least ``W / 2`` rows, there are at most
    ``log2(widest) + 1`` runs whatever the number of groups, and all the padded rows are at most twice the rows."""
    ranked = sorted((size for size in sizes if size), reverse=True)
    r0 = 0
    while r0 < len(ranked):
        width, rows, r1 = ranked[r0], ranked[r0], r0 + 1
        while r1 < len(ranked) and (r1 + 1 - r0) * width <= 2 * (rows + ranked[r1]):
            rows += ranked[r1]
            r1 += 1
        yield r0, r1, width
        r0 = r1


def padded(
    rows: tuple[torch.Tensor, ...], ends: torch.Tensor, sizes: list[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]]:
    """The sorted rows ``rows`` (each ``[S, d]``) of ``len(sizes)`` groups (``ends``: their cumulative sizes on the
    device, ``sizes`` on the host) as padded blocks ``[n, W, d]`` of ``n`` groups of at most ``W`` rows each (zero
    rows after a group's last), in the runs of :func:`_chunks`: a few batched launches, whatever the number of
    groups, and at most twice the rows in all. Yields ``(groups [n], index [n, W], blocks)``, ``index`` the sorted
    row of each padded row (``S`` for a padding row)."""
    total = rows[0].shape[0]
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).long()
    starts = ends.long() - counts
    ranked = torch.argsort(counts, descending=True, stable=True)  # the order of _chunks' sort, on the device
    rows = tuple(F.pad(x, (0, 0, 0, 1)) for x in rows)  # row S: zeros, read by the padding rows
    slots = torch.arange(max(sizes, default=0), device=ends.device)  # the widest run's; each run takes its first W
    for r0, r1, width in _chunks(sizes):
        groups = ranked[r0:r1]
        index = starts[groups][:, None] + slots[:width]
        index = torch.where(slots[:width] < counts[groups][:, None], index, total)
        blocks = tuple(x.index_select(0, index.reshape(-1)).view(*index.shape, -1) for x in rows)
        yield groups, index, blocks


def grouped_rows(x: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``[S, out]``: each row of ``x`` ``[S, in]`` (sorted as ``routing.order``) times its expert's ``weight[e]``
    (``weight`` ``[E, in, out]``), in one grouped matmul (else padded batched matmuls)."""
    if _grouped(x, weight):
        return torch._grouped_mm(x, weight, offs=routing.ends)
    y = x.new_zeros(x.shape[0] + 1, weight.shape[-1])  # the last row takes the padding rows' products
    for experts, index, (block,) in padded((x,), routing.ends, routing.sizes):
        y = y.index_copy(0, index.reshape(-1), torch.bmm(block, weight[experts]).reshape(-1, y.shape[-1]))
    return y[:-1]


def grouped_sums(
    left: torch.Tensor, right: torch.Tensor, routing: Routing, *, pairs: bool = False
) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """``(groups [n], [n, p, q])``: for each group of the sorted rows (the experts; the (expert, example) pairs
    ``e m + i`` with ``pairs``), ``sum_r left_r^T right_r`` over its rows (``left`` ``[S, p]``, ``right``
    ``[S, q]``, sorted as ``routing.order``): all groups in one grouped matmul (``groups`` None: all, in order),
    else in padded runs."""
    ends = routing.pair_ends if pairs else routing.ends
    if _grouped(left.T, right):
        yield None, torch._grouped_mm(left.T, right, offs=ends)
        return
    for groups, _, (a, b) in padded((left, right), ends, routing.pair_sizes if pairs else routing.sizes):
        yield groups, torch.bmm(a.transpose(1, 2), b)


def moe_kind(module: nn.Module) -> str | None:
    """``"router"`` for a Hugging Face top-k router (``*TopKRouter``: its logits are ``F.linear`` of the flattened
    tokens with its ``weight`` (and ``bias``), returned first, and its scores come from them), ``"experts"`` for a
    stacked experts layer of ``transformers.integrations.moe.use_experts_implementation`` (``[E, ...]`` weights,
    without expert parallelism or a post-expert norm), else None."""
    if not type(module).__module__.startswith("transformers."):
        return None
    if type(module).__name__.endswith("TopKRouter") and isinstance(getattr(module, "weight", None), nn.Parameter):
        return "router"
    flags = ("has_gate", "has_bias", "is_transposed")
    # releases before transformers 5.2x have neither a post-expert norm nor expert parallelism (nor their flags)
    later = getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False)
    if all(hasattr(module, f) for f in flags) and not later:
        first = "gate_up_proj" if module.has_gate else "up_proj"
        stacked = [getattr(module, name, None) for name in (first, "down_proj")]
        if all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in stacked):
            return "experts"
    return None


def _expert_linear(module: nn.Module, attr: str, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Row ``r`` of ``x`` ``[S, in]`` through its expert's projection ``attr`` (and its bias): the rows sorted by
    expert, one grouped matmul, back in their order. Under autocast the factors take its dtype, as ``F.linear``'s
    do (a grouped matmul has no autocast rule)."""
    weight = getattr(module, attr)  # [E, out, in], or [E, in, out] when transposed
    device = x.device.type
    dtype = weight.dtype
    if torch.is_autocast_enabled(device) and torch.float64 not in (x.dtype, weight.dtype):
        dtype = torch.get_autocast_dtype(device)
    weight = weight if module.is_transposed else weight.transpose(1, 2)
    y = grouped_rows(x.index_select(0, routing.order).to(dtype), weight.to(dtype), routing)
    if module.has_bias:
        y = y + getattr(module, f"{attr}_bias").index_select(0, routing.sorted_experts)
    return y.index_select(0, routing.inverse)


def tapped_experts_forward(
    module: nn.Module, tap: Callable[..., torch.Tensor], hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, *, examples: int,
) -> torch.Tensor:  # fmt: skip
    """The experts layer's function (that of Hugging Face's ``batched_mm`` implementation: token ``n``'s ``k`` rows
    are rows ``n k ... n k + k - 1``), with its two projections tapped (``tap``), so that an example's rows are
    contiguous: ``[m * T * k, d]`` from ``m = examples`` examples of ``T`` tokens."""
    tokens, k = top_k_index.shape
    x = hidden_states.repeat_interleave(k, dim=0)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    routing = Routing.of(top_k_index.reshape(-1), getattr(module, first).shape[0], examples)
    h = tap(module, first, x, routing, _expert_linear(module, first, x, routing))
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = tap(module, "down_proj", h, routing, _expert_linear(module, "down_proj", h, routing))
    weighted = y * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


class _Restore:
    """Undoes :func:`replace_forward` (the ``remove()`` of a hook handle)."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module, self.previous = module, previous

    def remove(self) -> None:
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


def replace_forward(module: nn.Module, forward: Callable[..., Any], tap: Callable[..., Any]) -> _Restore:
    """Run ``forward(module, tap, ...)`` as ``module``'s forward until the returned handle is removed."""
    previous = module.__dict__.get("forward")
    module.forward = lambda *args: forward(module, tap, *args)
    return _Restore(module, previous)
