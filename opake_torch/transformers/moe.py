"""Hugging Face glue of the private router release (:mod:`opake_core.moe`): where a model's routers are, their
geometry, and the per-example loss that returns the load statistic next to the loss.

Router logits are read by forward hooks on the model's router modules (the class Hugging Face records as
``router_logits``: ``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``GptOssTopKRouter``...), output ``index`` 0, a
``[tokens, E]`` tensor per layer. The model is **not** run with ``output_router_logits=True``: the causal-LM heads of
transformers 5 then compute their batch-level auxiliary loss (``load_balancing_loss_func``), which couples the
examples of a batch and does not run under ``vmap`` (in-place ``scatter_add_``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from opake_core.errors import ConfigurationError
from opake_core.moe import RouterGeometry, load_statistic, surrogate_loss

__all__ = ["LOAD_KEY", "capture_router_logits", "moe_geometry", "router_loss", "router_modules", "with_load"]

LOAD_KEY = "router_load"
"""The batch entry that carries the load estimate ``f~`` (``[E]`` per example, the same row for all) into the loss."""


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of a Hugging Face model, in forward order; ``[]`` for a dense model.

    Found from the model's ``_can_record_outputs["router_logits"]`` (the module class transformers itself records).
    """
    base = _base(model)
    recorders = [getattr(m, "_can_record_outputs", None) or {} for m in base.modules()]
    recorder = next((r["router_logits"] for r in recorders if "router_logits" in r), None)
    if recorder is None:
        return []
    target = getattr(recorder, "target_class", None)
    if target is None or getattr(recorder, "index", 0) != 0:
        return []
    return [m for m in base.modules() if isinstance(m, target)]


def moe_geometry(model: nn.Module, *, max_tokens: int, mean_tokens: float | None = None) -> RouterGeometry:
    """The :class:`~opake_core.moe.RouterGeometry` of a Hugging Face MoE model: ``top_k`` from
    ``config.num_experts_per_tok``, ``E`` from ``config.num_local_experts`` or ``config.num_experts``, ``L`` the
    number of router modules.

    Raises:
        ConfigurationError: the model has no router (a dense model) or its config lacks the fields.
    """
    config = getattr(_base(model), "config", None)
    routers = router_modules(model)
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not routers or top_k is None or experts is None:
        raise ConfigurationError(
            f"{type(_base(model)).__name__} is not a mixture-of-experts model with Hugging Face routers (found "
            f"{len(routers)} router modules, num_experts_per_tok={top_k!r}, experts={experts!r}); the router release "
            "needs one: set router_aux_loss_coef=0.0 for a dense model."
        )
    return RouterGeometry(int(top_k), int(experts), len(routers), max_tokens, mean_tokens)


@contextlib.contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect every router's logits (``[tokens, E]``, in forward order) of the forwards run inside the block.

    The hooks exist only inside the block; they work under ``torch.func.vmap`` and ``functional_call``.
    """
    captured: list[torch.Tensor] = []
    hook = lambda module, args, output: captured.append(output[0])  # noqa: E731
    handles = [m.register_forward_hook(hook) for m in router_modules(model)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def router_loss(
    model: nn.Module,
    batch_losses: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
    geometry: RouterGeometry,
    *,
    coefficient: float,
    mask_key: str = "attention_mask",
) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """One example's ``(loss + coefficient * surrogate, s(x))`` for ``vmap(grad(..., has_aux=True))``.

    Args:
        model: the Hugging Face MoE model whose routers are hooked.
        batch_losses: ``(params, batch) -> [m]`` losses of a batch (run here on a batch of one).
        geometry: the model's :func:`moe_geometry`.
        coefficient: the auxiliary-loss coefficient ``alpha`` (the surrogate's weight).
        mask_key: the example's token mask entry (every token counts when absent).

    The example carries the load estimate ``f~`` under :data:`LOAD_KEY` (``[E]``); it is removed before the model
    runs. The statistic is ``s(x)`` of :func:`opake_core.moe.load_statistic`, ``[L, E]``, detached.
    """

    def loss(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        load = example[LOAD_KEY]
        inputs = {k: v[None] for k, v in example.items() if k != LOAD_KEY}
        with capture_router_logits(model) as captured:
            value = batch_losses(params, inputs)[0]
        if len(captured) != geometry.num_layers:
            raise ConfigurationError(
                f"the forward ran {len(captured)} routers, the geometry has num_layers={geometry.num_layers}; "
                "build the geometry with moe_geometry(model) for this model."
            )
        logits = torch.stack([c.reshape(-1, geometry.num_experts) for c in captured])  # [L, T, E]
        mask = example.get(mask_key)
        statistic = load_statistic(geometry, logits, mask)
        return value + coefficient * surrogate_loss(geometry, logits, load, mask).to(value.dtype), statistic

    return loss


def with_load(batch: dict[str, Any], load: torch.Tensor) -> dict[str, Any]:
    """``batch`` with the load estimate ``f~`` (``[E]``) repeated for every row under :data:`LOAD_KEY`."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor))
    return {**batch, LOAD_KEY: load.to(device).expand(rows, -1)}
