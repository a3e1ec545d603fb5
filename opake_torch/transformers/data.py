"""Batches for the trainer: fetch the sampled examples and pad them into tensors.

Padding only ever adds positions that the per-example loss ignores (label ``-100``, attention mask 0), so an
example's loss and gradient do not depend on how long the other examples in its batch are.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["collate", "fetch", "language_modeling_labels", "model_input_names", "on_device"]

_PAD_VALUES = {"attention_mask": 0, "labels": -100, "token_type_ids": 0, "position_ids": 0}


def model_input_names(model: torch.nn.Module) -> set[str]:
    """The keyword arguments ``model.forward`` accepts (its signature), used to drop unused dataset columns."""
    forward = getattr(getattr(model, "get_base_model", lambda: model)(), "forward", model.forward)
    return set(inspect.signature(forward).parameters) - {"self", "kwargs"}


def fetch(dataset: Any, indices: Sequence[int], keep: set[str] | None) -> list[dict[str, Any]]:
    """The examples ``dataset[i]`` for ``i`` in ``indices``, restricted to the columns in ``keep``."""
    examples = []
    for i in indices:
        example = dataset[int(i)]
        if not isinstance(example, Mapping):
            raise InputTypeError(f"dataset items must be mappings of column -> value, item {i} is {type(example)}.")
        examples.append({k: v for k, v in example.items() if keep is None or k in keep})
    return examples


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    tensor = torch.as_tensor(value)
    # an empty list has no dtype of its own (torch reads it as float); empty sequences stand for token ids
    return tensor.long() if tensor.numel() == 0 and tensor.is_floating_point() else tensor


def collate(
    examples: list[Mapping[str, Any]],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Stack examples into ``[B, ...]`` tensors, right-padding sequences to a common length.

    Sequence columns (1-D per example) are truncated to ``max_length`` and padded to the longest example (rounded
    up to ``pad_to_multiple_of``): ``input_ids`` with ``pad_token_id``, ``labels`` with -100, masks with 0.
    Scalar columns (a class label) are stacked. A fixed ``max_length`` with ``pad_to_multiple_of`` keeps shapes
    constant across steps, which compiled or graph-captured kernels need.

    Examples without an ``attention_mask`` get one (1 on their own tokens, 0 on the padding), so that no record's
    output, loss or gradient depends on how long the other records of its batch are. An empty sequence becomes a
    record of padding only (at least one position, so that a batch of empty records runs), whose mask keeps nothing:
    its per-example loss and gradient are 0 (:func:`~opake_torch.transformers.loss.attended`).
    """
    if not examples:
        raise ConfigurationError("collate needs at least one example; build empty batches by slicing [:0].")
    batch: dict[str, torch.Tensor] = {}
    for key in examples[0]:
        values = [_tensor(example[key]) for example in examples]
        name = "labels" if key == "label" else key
        if values[0].dim() == 0:
            batch[name] = torch.stack(values)
            continue
        if max_length is not None:
            values = [v[:max_length] for v in values]
        length = max(1, *(v.shape[0] for v in values))  # a batch of empty records still runs: one padding position
        if pad_to_multiple_of:
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        dtype = next((v.dtype for v in values if v.numel()), values[0].dtype)  # an empty first value: the others
        pad = _PAD_VALUES.get(name, pad_token_id)
        values = [v if v.dtype == dtype else v.to(dtype) for v in values]
        padded = pad_sequence(values, batch_first=True, padding_value=pad)  # one host operation for the batch
        if padded.shape[1] < length:
            padded = torch.cat(
                [padded, padded.new_full((len(values), length - padded.shape[1], *padded.shape[2:]), pad)], dim=1
            )
        batch[name] = padded
        if name == "input_ids" and "attention_mask" not in examples[0]:
            lengths = torch.tensor([v.shape[0] for v in values])
            batch["attention_mask"] = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int64)
    return batch


def language_modeling_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add ``labels = input_ids`` (padding positions set to -100) when the batch has no labels."""
    if "labels" in batch or "input_ids" not in batch:
        return batch
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    return {**batch, "labels": torch.where(mask.bool(), batch["input_ids"], torch.full_like(batch["input_ids"], -100))}


def on_device(batch: Mapping[str, Any], device: torch.device, *, pin: bool = True) -> dict[str, torch.Tensor]:
    """The batch's tensors on ``device`` (other values dropped); on CUDA with ``pin`` (``dataloader_pin_memory``)
    through pinned memory, so that the copy does not wait for the GPU work already queued."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if device.type == "cuda" and pin:
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}
