"""The loss functions a ``DPTrainer`` step runs, built from the trainer's loss seams.

A trainer defines one example's loss (``compute_per_example_loss``) and its batched form (``compute_batch_losses``;
TRL trainers add ``*_and_metrics`` variants that also return per-example log values). The step runs
:func:`example_loss` under ``vmap(grad)`` and :func:`batched_loss` on the layerwise engine. With the MoE router
release, each example's loss carries the release's surrogate and returns the example's load statistic as its
auxiliary output (:mod:`.routers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake_torch.transformers.routers import RouterSetup, batched_router_loss, router_loss

__all__ = ["batched_loss", "example_loss"]


def example_loss(trainer: Any, router: RouterSetup | None = None, *, with_metrics: bool = False) -> Callable:
    """``(params, example) -> loss`` for one example, under the run's autocast (bf16 with ``args.bf16``).

    ``with_metrics``: ``(loss, log values)`` from ``compute_per_example_loss_and_metrics``; with the router release
    (``router``): ``(loss + router_aux_loss_coef * surrogate, load statistic s(x))``.
    """
    args = trainer.args
    fn = trainer.compute_per_example_loss_and_metrics if with_metrics else trainer.compute_per_example_loss
    if router is not None:

        def one(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return trainer.compute_per_example_loss(params, {k: v[0] for k, v in batch.items()})[None]

        fn = router_loss(trainer.model, one, router.geometry, coefficient=router.coefficient)

    def loss(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> Any:
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            return fn(params, example)

    return loss


def batched_loss(
    trainer: Any, router: RouterSetup | None = None, *, with_metrics: bool, unbatched: bool
) -> tuple[Callable | None, list[str]]:
    """``(loss of a batch, reasons)``: what the layerwise engine runs, ``compute_batch_losses`` (or, ``with_metrics``,
    ``compute_batch_losses_and_metrics``; with the router release, each example's loss with its surrogate and its
    load statistic), and why it cannot serve the run (empty when it can). ``unbatched``: the trainer overrides
    ``compute_per_example_loss`` but not ``compute_batch_losses``, whose default would then compute another loss."""
    reasons = [f"{type(trainer).__name__} overrides compute_per_example_loss but not compute_batch_losses"]
    batched = trainer.compute_batch_losses
    if with_metrics:
        batched = getattr(trainer, "compute_batch_losses_and_metrics", None)
        unbatched = unbatched or batched is None
    if router is not None:
        batched = batched_router_loss(trainer.model, batched, router.geometry, coefficient=router.coefficient)
    return batched, reasons if unbatched else []
