"""The taps of Hugging Face mixture-of-experts layers: top-k routers and stacked experts recognized, and the experts
run with their two projections tapped, an example's rows kept contiguous.

A router is a linear layer on the flattened tokens ``[m T, d]``: the engine taps its logits. A stacked experts layer
(``[E, ...]`` weights) runs :func:`tapped_experts_forward` during the pass: one row per token and chosen expert, the
rows grouped by expert (:class:`Routing`) for one matmul per expert. Their norms and sums are taken by
:mod:`opake_torch.layerwise.ghost` and :mod:`opake_torch.layerwise.dense`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Routing", "moe_kind", "replace_forward", "tapped_experts_forward"]


@dataclass(frozen=True)
class Routing:
    """Where the ``m R`` rows of an experts layer went (example ``i`` owns rows ``i R ... i R + R - 1``), read from
    the device once per layer: ``order`` lists the rows grouped by expert (ascending within each), ``counts[e]`` is
    how many went to expert ``e`` and ``widths[e]`` the most that one example sent it."""

    experts: torch.Tensor  # [m R]: the expert of every row
    order: torch.Tensor
    counts: list[int]
    widths: list[int]

    @staticmethod
    def of(experts: torch.Tensor, num_experts: int, m: int) -> Routing:
        example = torch.div(torch.arange(experts.shape[0], device=experts.device), experts.shape[0] // m,
                            rounding_mode="floor")  # fmt: skip
        per_pair = torch.bincount(experts * m + example, minlength=num_experts * m).view(num_experts, m)
        counts, widths = torch.stack([per_pair.sum(dim=1), per_pair.max(dim=1).values]).tolist()
        return Routing(experts, torch.argsort(experts, stable=True), counts, widths)

    def groups(self) -> Iterator[tuple[int, torch.Tensor, int]]:
        """``(expert, its rows in ascending order, widest example)`` for every expert that got rows."""
        start = 0
        for e, (count, width) in enumerate(zip(self.counts, self.widths, strict=True)):
            if count:
                yield e, self.order[start : start + count], width
            start += count


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
    """Row ``r`` of ``x`` ``[S, in]`` through its expert's projection ``attr`` (and its bias): the rows grouped by
    expert, one matmul per expert, back in their order."""
    weight = getattr(module, attr)  # [E, out, in], or [E, in, out] when transposed
    bias = getattr(module, f"{attr}_bias") if module.has_bias else None
    pieces = []
    for e, rows, _ in routing.groups():
        xe = x.index_select(0, rows)
        y = xe @ weight[e] if module.is_transposed else F.linear(xe, weight[e])
        pieces.append(y if bias is None else y + bias[e])
    return torch.cat(pieces)[torch.argsort(routing.order)]


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
