"""Evaluation and prediction of a :class:`DPTrainer`: the losses, predictions and metrics of a model on a dataset.

Evaluation runs on data the caller chooses and releases exact statistics of it: when that data is private, its
metrics are **outside** the privacy guarantee (as the trainer's logged training loss is). Its metrics carry
Hugging Face's speed metrics (``<prefix>_runtime``, ``_samples_per_second``, ``_steps_per_second``). The batches
are those of :func:`.loaders.eval_loader`, in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.func import vmap
from transformers.trainer_utils import EvalPrediction, PredictionOutput, speed_metrics

from opake_torch.transformers.microbatch import retry_eval_batch

__all__ = ["prediction_loop"]

_Piece = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def prediction_loop(
    model: torch.nn.Module,
    loader: Any,
    *,
    args: Any,
    label_names: tuple[str, ...],
    logits_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    per_example_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
    compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None,
    prefix: str,
    preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> PredictionOutput:
    """Losses, predictions, labels and ``<prefix>_*`` metrics of ``model`` on the batches of ``loader`` (a
    :func:`.loaders.eval_loader`, whose ``dataset`` is the range of rows).

    ``logits_loss(logits, labels)`` is every example's loss ``[B]`` from the batch's logits and labels.
    ``preprocess_logits_for_metrics(logits, labels)``, as Hugging Face's, turns each batch's logits into what the
    predictions keep (an argmax, say), after the loss is computed from the logits.
    ``per_example_loss(example)``, when given, replaces the model's logits with another objective (SFT variants, DPO):
    only its per-example losses are reported. Batches of ``per_device_eval_batch_size``; with
    ``auto_find_microbatch_size`` the rows of an out-of-memory batch are evaluated in halves (and the later batches in
    pieces of the size that worked) without losing an example.
    """
    began = time.time()
    was_training = model.training
    model.eval()
    losses, logits_list, labels_list = [], [], []
    size = args.per_device_eval_batch_size

    def evaluate_batch(batch: dict[str, torch.Tensor]) -> _Piece:
        if per_example_loss is not None:  # another objective: its per-example losses only, no logits
            return vmap(per_example_loss)(batch).float().cpu(), None, None
        labels = batch.get(label_names[0])
        inputs = {k: v for k, v in batch.items() if k not in label_names}
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16_full_eval):
            logits = model(**inputs).logits
        loss = logits_loss(logits, labels).float().cpu() if labels is not None else None
        kept = None if args.prediction_loss_only else _kept(logits, labels, preprocess_logits_for_metrics)
        return loss, kept, (labels.cpu() if labels is not None else None)

    with torch.no_grad():
        for batch in loader:
            if args.auto_find_microbatch_size:
                rows = lambda lo, hi, batch=batch: evaluate_batch({k: v[lo:hi] for k, v in batch.items()})  # noqa: E731
                pieces, size = retry_eval_batch(rows, start=0, stop=_rows(batch), batch_size=size)
            else:
                pieces = [evaluate_batch(batch)]
            for loss, logits, labels in pieces:
                if loss is not None:
                    losses.append(loss)
                if logits is not None:
                    logits_list.append(logits)
                if labels is not None:
                    labels_list.append(labels)
    model.train(was_training)
    metrics: dict[str, float] = {}
    if losses:
        metrics[f"{prefix}_loss"] = torch.cat(losses).mean().item()
    predictions = _concat_padded(logits_list) if logits_list else None
    label_ids = _concat_padded(labels_list) if labels_list else None
    if compute_metrics is not None and predictions is not None and label_ids is not None:
        extra = {"losses": torch.cat(losses).numpy()} if "loss" in args.include_for_metrics else {}
        for name, value in compute_metrics(EvalPrediction(predictions, label_ids, **extra)).items():
            metrics[name if name.startswith(f"{prefix}_") else f"{prefix}_{name}"] = value
    metrics.update(speed_metrics(prefix, began, num_samples=len(loader.dataset), num_steps=len(loader)))
    return PredictionOutput(predictions, label_ids, metrics)


def _kept(logits: torch.Tensor, labels: torch.Tensor | None, preprocess: Callable | None) -> torch.Tensor:
    """What the predictions keep of a batch's logits, on the CPU (floats as float32)."""
    kept = logits if preprocess is None else preprocess(logits, labels)
    return (kept.float() if kept.is_floating_point() else kept).cpu()


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _concat_padded(chunks: list[torch.Tensor]) -> np.ndarray:
    """Concatenate along the batch axis, padding a differing sequence axis with -100."""
    if chunks[0].dim() > 1:
        length = max(c.shape[1] for c in chunks)
        chunks = [
            torch.nn.functional.pad(c, (0, 0) * (c.dim() - 2) + (0, length - c.shape[1]), value=-100) for c in chunks
        ]
    return torch.cat(chunks).numpy()
