"""How a :class:`DPTrainer` turns dataset rows into batches: :meth:`DataLoaders.fetch_batch`, and the data loaders
Hugging Face scripts ask a trainer for.

A batch is the rows' kept columns (``dataset_columns``) collated on the host (``data_collator``, else right-padding
with the tokenizer's pad token; a causal LM's labels added), then moved to the device. ``train()`` fetches the rows
each step draws in the main process, right after drawing them.

:func:`train_loader` is what ``get_train_dataloader`` returns: a ``torch.utils.data.DataLoader`` whose batch
sampler draws batches with the run's sampler (Poisson: variable-size batches, possibly empty) from a fresh key of its
own. It has the distribution of the training batches, not the batches training uses: training draws from its own
secret sampler key and never reads this loader. :func:`eval_loader` yields the batches evaluation runs, in order.

Both loaders honour ``dataloader_num_workers`` (worker processes fetch and collate the rows on the host; ``0``: this
process) and ``dataloader_pin_memory`` (pinned host memory for the copy to a CUDA device), and yield batches on the
device, as the loaders of ``transformers.Trainer`` do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from opake_core import random
from opake_core.errors import ConfigurationError
from opake_torch.transformers.data import collate, fetch, language_modeling_labels, on_device
from opake_torch.transformers.resume import planned
from opake_torch.transformers.users import user_batch, users_of

__all__ = [
    "DataLoaders",
    "DeviceLoader",
    "SampledBatches",
    "eval_loader",
    "num_examples",
    "train_loader",
]


class SampledBatches(Sampler[list[int]]):
    """``steps`` index batches of a core sampler (``opake_core.sampling``), drawn from a fresh key (from the
    operating system) at every iteration: the distribution of training's batches, never its draws. A user-level
    sampler's batch is the rows its users contribute."""

    def __init__(self, sampler: Any, steps: int) -> None:
        self.sampler, self.steps = sampler, steps

    def __iter__(self) -> Iterator[list[int]]:
        key, state = random.random_key(), self.sampler.init()
        for _ in range(self.steps):
            indices, state = self.sampler.sample(key, state)
            yield [int(i) for i in indices.reshape(-1) if i >= 0]

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
    """The batches evaluation runs: ``per_device_eval_batch_size`` rows in order, the last one shorter, collated by
    ``host_batch_of(dataset, indices)`` and moved by ``to_device``; ``loader.dataset`` is the range of row indices."""
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


class DataLoaders:
    """The batches of a :class:`~opake_torch.transformers.DPTrainer` (:meth:`fetch_batch`) and
    ``transformers.Trainer``'s data-loader methods. The trainer provides ``args``, ``data_collator``,
    ``processing_class``, ``task``, ``dataset_columns``, ``train_dataset``, ``eval_dataset``, ``privacy_plan`` and
    ``ledger``."""

    def fetch_batch(self, dataset: Any, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """The rows ``indices`` of ``dataset`` collated into one batch of tensors (``[len(indices), ...]``) on the
        run's device, in this process: what a training step, the model probe and the audits run on. No row gives
        the empty batch of the dataset's columns (an empty Poisson draw is still a step). A slot array ``[users, k]``
        (a user-level draw, ``privacy_unit="user"``) gives the batch of :func:`.users.user_batch`."""
        if np.ndim(indices) == 2:
            return user_batch(lambda rows: self.fetch_batch(dataset, rows), np.asarray(indices))
        return self._to_device(self._host_batch(dataset, indices))

    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.data_collator is not None:
            batch = dict(self.data_collator(examples))
        else:
            pad = getattr(self.processing_class, "pad_token_id", None) or 0
            args = self.args
            batch = collate(
                examples, pad_token_id=pad, max_length=args.max_length, pad_to_multiple_of=args.pad_to_multiple_of
            )
        if self.task == "causal_lm":
            batch = language_modeling_labels(batch)
        return batch

    def _host_batch(self, dataset: Any, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """The rows ``indices`` of ``dataset`` collated on the host (in a loader's worker process, for evaluation)."""
        if len(indices):
            return self._collate(fetch(dataset, indices, self.dataset_columns))
        template = self._collate(fetch(dataset, [0], self.dataset_columns))  # an empty Poisson draw is still a step
        return {k: v[:0] for k, v in template.items() if isinstance(v, torch.Tensor)}

    def _to_device(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return on_device(batch, self.args.device, pin=self.args.dataloader_pin_memory)

    def get_train_dataloader(self) -> DataLoader:
        """One expected epoch of batches drawn like training's (Poisson: variable size, possibly empty) from a fresh
        key, collated onto the device: their distribution, never the batches training draws, which come from the
        trainer's secret sampler key (:func:`train_loader`). ``train()`` does not read this loader. The sampler is
        that of the trainer's ``privacy_plan``; before the first ``train()``, that of the plan a call that resumes no
        checkpoint would run (:func:`.resume.planned`)."""
        if self.train_dataset is None:
            raise ConfigurationError("get_train_dataloader needs a train_dataset.")
        users = self._users or users_of(self.args.privacy, self.train_dataset)
        plan = self.privacy_plan or planned(self.args, len(self.train_dataset), self.ledger, users=users)
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
