"""Evaluation and prediction of a :class:`DPTrainer`, and the data loaders Hugging Face scripts ask a trainer for.

Evaluation runs on data the caller chooses and releases exact statistics of it: when that data is private, its
metrics are **outside** the privacy guarantee (as the trainer's logged training loss is). Its metrics carry
Hugging Face's speed metrics (``<prefix>_runtime``, ``_samples_per_second``, ``_steps_per_second``).

:func:`train_loader` is what ``get_train_dataloader`` returns: a ``torch.utils.data.DataLoader`` whose batch
sampler draws batches with the run's sampler (Poisson: variable-size batches, possibly empty) from a fresh key of its
own. It has the distribution of the training batches, not the batches training uses: training draws from its own
secret sampler key and never reads this loader. :func:`eval_loader` yields the batches evaluation runs, in order.

Both loaders honour ``dataloader_num_workers`` (worker processes fetch and collate the rows on the host; ``0``: this
process) and ``dataloader_pin_memory`` (pinned host memory for the copy to a CUDA device), and yield batches on the
device, as the loaders of ``transformers.Trainer`` do. ``train()`` itself fetches the rows each step draws in the
main process, right after drawing them.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.func import vmap
from torch.utils.data import DataLoader, Sampler
from transformers.trainer_utils import EvalPrediction, PredictionOutput, speed_metrics

from opake_core import random
from opake_core.errors import ConfigurationError
from opake_torch.transformers.microbatch import retry_eval_batch
from opake_torch.transformers.privacy import build_plan

__all__ = [
    "DataLoaders",
    "DeviceLoader",
    "SampledBatches",
    "eval_loader",
    "num_examples",
    "prediction_loop",
    "train_loader",
]

_Piece = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def prediction_loop(
    model: torch.nn.Module,
    dataset: Any,
    *,
    args: Any,
    host_batch_of: Callable[[Any, np.ndarray], dict[str, Any]],
    to_device: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    label_names: tuple[str, ...],
    logits_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    per_example_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None,
    compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None,
    prefix: str,
) -> PredictionOutput:
    """Losses, predictions, labels and ``<prefix>_*`` metrics of ``model`` on ``dataset``.

    The batches are those of :func:`eval_loader` (``host_batch_of(dataset, indices)`` collates on the host,
    ``to_device`` moves a batch to the device); ``logits_loss(logits, labels)`` is one example's loss (vmapped here).
    ``per_example_loss(example)``, when given, replaces the model's logits with another objective (SFT variants, DPO):
    only its per-example losses are reported. Batches of ``per_device_eval_batch_size``; with
    ``auto_find_microbatch_size`` the rows of an out-of-memory batch are evaluated in halves (and the later batches in
    pieces of the size that worked) without losing an example.
    """
    if dataset is None:
        raise ConfigurationError("evaluation needs an eval_dataset.")
    began = time.time()
    was_training = model.training
    model.eval()
    losses, logits_list, labels_list = [], [], []
    size = args.per_device_eval_batch_size
    loss_of = vmap(logits_loss)

    def evaluate_batch(batch: dict[str, torch.Tensor]) -> _Piece:
        if per_example_loss is not None:  # another objective: its per-example losses only, no logits
            return vmap(per_example_loss)(batch).float().cpu(), None, None
        labels = batch.get(label_names[0])
        inputs = {k: v for k, v in batch.items() if k not in label_names}
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16_full_eval):
            logits = model(**inputs).logits
        loss = loss_of(logits, labels).float().cpu() if labels is not None else None
        kept = None if args.prediction_loss_only else logits.float().cpu()
        return loss, kept, (labels.cpu() if labels is not None else None)

    with torch.no_grad():
        for batch in eval_loader(dataset, args, host_batch_of, to_device):
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
    batches = math.ceil(len(dataset) / args.per_device_eval_batch_size)
    metrics.update(speed_metrics(prefix, began, num_samples=len(dataset), num_steps=batches))
    return PredictionOutput(predictions, label_ids, metrics)


class SampledBatches(Sampler[list[int]]):
    """``steps`` index batches of a core sampler (``opake_core.sampling``), drawn from a fresh key (from the
    operating system) at every iteration: the distribution of training's batches, never its draws."""

    def __init__(self, sampler: Any, steps: int) -> None:
        self.sampler, self.steps = sampler, steps

    def __iter__(self) -> Iterator[list[int]]:
        key, state = random.random_key(), self.sampler.init()
        for _ in range(self.steps):
            indices, state = self.sampler.sample(key, state)
            yield [int(i) for i in indices]

    def __len__(self) -> int:
        return self.steps


class DeviceLoader(DataLoader):
    """A ``DataLoader`` whose batches, collated on the host (by its workers), are moved to the device by
    ``to_device`` in this process, as the loaders ``transformers.Trainer`` prepares with accelerate."""

    def __init__(self, *args: Any, to_device: Callable[[dict[str, Any]], dict[str, torch.Tensor]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.to_device = to_device

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return map(self.to_device, super().__iter__())


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _collate_rows(host_batch_of: Callable[[Any, np.ndarray], dict], dataset: Any, indices: list[int]) -> dict:
    return host_batch_of(dataset, np.asarray(indices, dtype=np.int64))


def _loader(dataset: Any, args: Any, host_batch_of: Callable, to_device: Callable, **batching: Any) -> DeviceLoader:
    return DeviceLoader(
        range(len(dataset)),
        collate_fn=functools.partial(_collate_rows, host_batch_of, dataset),
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory and args.device.type == "cuda",
        to_device=to_device,
        **batching,
    )


def train_loader(dataset: Any, plan: Any, args: Any, host_batch_of: Callable, to_device: Callable) -> DeviceLoader:
    """A loader of one expected epoch of batches drawn like training's (module docstring), collated by
    ``host_batch_of(dataset, indices)`` and moved by ``to_device``; ``loader.dataset`` is the range of row indices."""
    steps = max(1, math.ceil(round(plan.steps_per_epoch, 9)))
    return _loader(dataset, args, host_batch_of, to_device, batch_sampler=SampledBatches(plan.sampler, steps))


def eval_loader(dataset: Any, args: Any, host_batch_of: Callable, to_device: Callable) -> DeviceLoader:
    """The batches :func:`prediction_loop` runs: ``per_device_eval_batch_size`` rows in order, the last one
    shorter, collated by ``host_batch_of(dataset, indices)`` and moved by ``to_device``."""
    if dataset is None:
        raise ConfigurationError("evaluation needs an eval_dataset.")
    return _loader(dataset, args, host_batch_of, to_device, batch_size=args.per_device_eval_batch_size, shuffle=False)


def num_examples(loader: Any, batch_size: int) -> int:
    """The rows behind ``loader`` (Hugging Face's ``Trainer.num_examples``): its dataset's length, else an estimate
    from its number of batches."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return len(loader) * batch_size


def _concat_padded(chunks: list[torch.Tensor]) -> np.ndarray:
    """Concatenate along the batch axis, padding a differing sequence axis with -100."""
    if chunks[0].dim() > 1:
        length = max(c.shape[1] for c in chunks)
        chunks = [
            torch.nn.functional.pad(c, (0, 0) * (c.dim() - 2) + (0, length - c.shape[1]), value=-100) for c in chunks
        ]
    return torch.cat(chunks).numpy()


class DataLoaders:
    """``transformers.Trainer``'s data-loader methods, for :class:`~opake_torch.transformers.DPTrainer` (which
    provides ``args``, ``train_dataset``, ``eval_dataset``, the host collation ``_host_batch`` and ``_to_device``)."""

    def get_train_dataloader(self) -> DataLoader:
        """One expected epoch of batches drawn like training's (Poisson: variable size, possibly empty) from a fresh
        key, collated onto the device: their distribution, never the batches training draws, which come from the
        trainer's secret sampler key (:func:`train_loader`). ``train()`` does not read this loader."""
        if self.train_dataset is None:
            raise ConfigurationError("get_train_dataloader needs a train_dataset.")
        plan = self._plan or build_plan(self.args, len(self.train_dataset), spent=self._ledger)
        return train_loader(self.train_dataset, plan, self.args, self._host_batch, self._to_device)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """The batches ``evaluate`` runs (``per_device_eval_batch_size`` rows, in order); a ``str`` names one of a
        dict of eval datasets."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        return eval_loader(dataset, self.args, self._host_batch, self._to_device)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """The batches ``predict`` runs on ``test_dataset``."""
        return eval_loader(test_dataset, self.args, self._host_batch, self._to_device)

    def num_examples(self, dataloader: DataLoader) -> int:
        """The number of rows behind ``dataloader`` (the length of its dataset), as Hugging Face's."""
        return num_examples(dataloader, self.args.per_device_train_batch_size)
