"""Hugging Face glue of the private router release (:mod:`opake_core.router_release`): where a model's routers are,
their geometry, and the per-example loss that returns the load statistic next to the loss.

Router logits are read by forward hooks on the model's router modules (the class Hugging Face records as
``router_logits``: ``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``, ``GptOssTopKRouter``...), output ``index`` 0, a
``[tokens, E]`` tensor per layer. The model is **not** run with ``output_router_logits=True``: the causal-LM heads of
transformers 5 then compute their batch-level auxiliary loss (``load_balancing_loss_func``), which couples the
examples of a batch and does not run under ``vmap`` (in-place ``scatter_add_``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from opake_core import random
from opake_core.errors import ConfigurationError
from opake_core.router_release import (
    ReleaseFn,
    RouterGeometry,
    RouterState,
    exact_router_release,
    load_statistic,
    router_release,
    sum_statistics,
    surrogate_loss,
)
from opake_core.tree import Clipped

__all__ = [
    "LOAD_KEY",
    "ROUTER_STREAM",
    "RouterSetup",
    "batched_router_loss",
    "capture_router_logits",
    "moe_geometry",
    "router_logits_off",
    "router_loss",
    "router_modules",
    "with_load",
]

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
    """The :class:`~opake_core.router_release.RouterGeometry` of a Hugging Face MoE model: ``top_k`` from
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
    runs. The statistic is ``s(x)`` of :func:`opake_core.router_release.load_statistic`, ``[L, E]``, detached.
    """

    batched = batched_router_loss(model, batch_losses, geometry, coefficient=coefficient, mask_key=mask_key)

    def loss(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        values, statistics = batched(params, {k: v[None] for k, v in example.items()})
        return values[0], statistics[0]

    return loss


def batched_router_loss(
    model: nn.Module,
    batch_losses: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
    geometry: RouterGeometry,
    *,
    coefficient: float,
    mask_key: str = "attention_mask",
) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """The batched form of :func:`router_loss`, for the layerwise engine: ``(losses + coefficient * surrogates [m],
    statistics [m, L, E])`` from one forward of the batch, row ``i`` that of :func:`router_loss` on example ``i``.

    The routers see the batch's tokens flattened to ``[m T, E]``; example ``i`` owns rows ``i T ... i T + T - 1``.
    """

    def loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        load = batch[LOAD_KEY]
        inputs = {k: v for k, v in batch.items() if k != LOAD_KEY}
        with capture_router_logits(model) as captured:
            values = batch_losses(params, inputs)
        if len(captured) != geometry.num_layers:
            raise ConfigurationError(
                f"the forward ran {len(captured)} routers, the geometry has num_layers={geometry.num_layers}; "
                "build the geometry with moe_geometry(model) for this model."
            )
        m = values.shape[0]
        logits = torch.stack([c.reshape(m, -1, geometry.num_experts) for c in captured], dim=1)  # [m, L, T, E]
        mask = inputs.get(mask_key)
        if mask is None:
            mask = torch.ones(logits.shape[:3:2], dtype=torch.long, device=logits.device)  # [m, T]
        statistics = torch.vmap(lambda x, k: load_statistic(geometry, x, k))(logits, mask)
        surrogates = torch.vmap(lambda x, f, k: surrogate_loss(geometry, x, f, k))(logits, load, mask)
        return values + coefficient * surrogates.to(values.dtype), statistics

    return loss


def with_load(batch: dict[str, Any], load: torch.Tensor) -> dict[str, Any]:
    """``batch`` with the load estimate ``f~`` (``[E]``) repeated for every row under :data:`LOAD_KEY`."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor))
    return {**batch, LOAD_KEY: load.to(device).expand(rows, -1)}


ROUTER_STREAM = "opake.transformers.router_release"
"""The tag that derives a trainer's router-release key from its noise key, ``fold_in(noise_key, ROUTER_STREAM)``: a
stream of its own, never the gradient noise's."""


@contextlib.contextmanager
def router_logits_off(model: nn.Module) -> Iterator[None]:
    """``config.output_router_logits = False`` on the model inside the block (the router logits come from hooks, and
    Hugging Face's batch-level auxiliary loss is not computed); the value is restored on exit."""
    config = getattr(_base(model), "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        yield
        return
    config.output_router_logits = False
    try:
        yield
    finally:
        config.output_router_logits = True


@dataclasses.dataclass(frozen=True)
class RouterSetup:
    """The private router release of a trainer run (``router_aux_loss_coef > 0``): the model's geometry and the
    release's public settings."""

    geometry: RouterGeometry
    coefficient: float
    ratio: float
    filter_beta: float

    @staticmethod
    def of(model: nn.Module, args: Any) -> RouterSetup:
        """From the arguments' ``router_aux_loss_coef`` and ``router_aux_kwargs``; ConfigurationError for a model
        without MoE routers."""
        kwargs = args.router_aux_kwargs
        geometry = moe_geometry(model, max_tokens=kwargs["max_tokens"], mean_tokens=kwargs["mean_tokens"])
        return RouterSetup(geometry, float(args.router_aux_loss_coef), float(kwargs["ratio"]), kwargs["filter_beta"])

    def settings(self) -> dict[str, Any]:
        """What a resume may not change (recorded in the checkpoint's ``dp_state.json``)."""
        g = self.geometry
        return {
            "router_aux_loss_coef": self.coefficient,
            "ratio": self.ratio,
            "max_tokens": g.max_tokens,
            "mean_tokens": g.mean_tokens,
            "filter_beta": self.filter_beta,
            "top_k": g.top_k,
            "num_experts": g.num_experts,
            "num_layers": g.num_layers,
        }

    def release(
        self, *, noise_multiplier: float, expected_batch_size: float, noise_key: random.Key
    ) -> tuple[ReleaseFn, RouterState]:
        """``(release_fn, state)`` of the run: noise multiplier ``z / sqrt(ratio)`` for a private run (the exact
        release for a non-private one, multiplier 0), keyed by ``fold_in(noise_key, ROUTER_STREAM)``."""
        key = random.fold_in(noise_key, ROUTER_STREAM)
        if noise_multiplier == 0.0:
            return exact_router_release(
                self.geometry, expected_batch_size=expected_batch_size, key=key, filter_beta=self.filter_beta
            )
        return router_release(
            self.geometry,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            ratio=self.ratio,
            key=key,
            filter_beta=self.filter_beta,
        )

    def step(
        self,
        release_fn: ReleaseFn,
        state: RouterState,
        statistics: torch.Tensor | None,
        *,
        expected_batch_size: float,
        reduce: Callable[[Clipped], Clipped] | None,
    ) -> RouterState:
        """One release: this rank's statistics ``[m, L, E]`` (None for an empty draw) summed in float64, divided by
        the public expected batch, summed across ranks (``reduce``), noised once; returns the new state. The
        un-noised sum and the released value stay inside this call."""
        g = self.geometry
        if statistics is None:
            statistics = torch.zeros(0, g.num_layers, g.num_experts, dtype=torch.float64, device=state.filtered.device)
        clipped = sum_statistics(g, statistics, expected_batch_size=expected_batch_size)
        if reduce is not None:
            clipped = reduce(clipped)
        _, new_state = release_fn(clipped, state)
        return new_state


def unkeyed(state: RouterState) -> RouterState:
    """``state`` without its secret key (a fixed placeholder), as a checkpoint's tensors file stores it."""
    return dataclasses.replace(state, key=random.key(0))


def rekeyed(saved: RouterState, current: RouterState) -> RouterState:
    """The saved ``state`` with the key of ``current`` (this segment's)."""
    return dataclasses.replace(saved, key=current.key)
