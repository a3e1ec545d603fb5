"""The checks a ``DPTrainer.train()`` call passes before it spends any privacy budget.

* :func:`check_data`: every row is one the loss can take (:mod:`.dataset_check`, one pass over the rows) and, with
  the built-in loss, the model's output on the longest row is one it can read (:func:`.model_setup.probe_outputs`);
* :func:`verified_engine`: the layerwise engine agrees with ``grad`` of the per-example loss on two training
  examples (:func:`.engines.verified`);
* :func:`independent_engine`: the records stay independent under the engine the step uses (the neighbour test,
  :func:`.engines.independent`).

With the MoE router release (``geometry``), the engine checks run as its step does: router logits off, and the
batch carrying a load estimate, here the uniform load ``k / E``. Each check reads the trainer through its public
surface (``model``, ``args``, ``fetch_batch``, ``trainable_params``...); the loss functions are passed in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from opake_torch.transformers import coupling, engines
from opake_torch.transformers.data import collate, fetch, on_device
from opake_torch.transformers.dataset_check import DataSummary, check_dataset, dataset_schema
from opake_torch.transformers.model_setup import probe_outputs
from opake_torch.transformers.routers import router_logits_off, with_load
from opake_torch.transformers.users import slot_array

__all__ = ["check_data", "independent_engine", "routing", "verified_engine"]


def check_data(trainer: Any, dataset: Any, name: str, *, training: bool, own_loss: bool) -> DataSummary:
    """Refuse a row of ``dataset`` (called ``name`` in messages) that the loss cannot take and, with the built-in
    loss (``own_loss``), a model output it cannot read (one forward of the longest row); ``training``: labels are
    required. ConfigurationError or InputTypeError naming the row. Returns what the pass over the rows learnt."""
    model, task, labels = trainer.model, trainer.task, trainer.label_names
    schema = dataset_schema(model, task=task, label_names=labels, own_loss=own_loss, require_labels=training)
    summary = check_dataset(dataset, schema, keep=trainer.dataset_columns, name=name)
    row = summary.probe_row
    if own_loss and row is not None:
        classes = schema.label_bound if task is not None else None
        forward = functools.partial(trainer.apply_model, trainer.trainable_params)
        batch = trainer.fetch_batch(dataset, np.array([row]))
        where = f"{name} row {row}"
        probe_outputs(model, forward, batch, label_names=labels, task=task, classes=classes, where=where)
    return summary


def verified_engine(trainer: Any, layerwise: Any, *, loss_fn: Callable[..., torch.Tensor], geometry: Any) -> Any:
    """``layerwise`` after its check against ``grad`` of ``loss_fn`` (one example's loss) on the first two training
    examples (users, with ``privacy_unit="user"``); None: ``'auto'`` fell back to vmap (:func:`.engines.verified`)."""
    dataset, users = trainer.train_dataset, trainer._users
    first = np.arange(min(2, len(dataset))) if users is None else users.first(2)
    batch = _with_uniform_load(trainer.fetch_batch(dataset, first), geometry)
    topology = trainer.topology
    with routing(trainer.model, geometry):
        return engines.verified(
            layerwise, args=trainer.args, model=trainer.model, params=topology.engine_params(trainer.trainable_params),
            loss_fn=loss_fn, batch=batch, check=topology.layerwise_check(trainer.model),
        )  # fmt: skip


def independent_engine(
    trainer: Any,
    layerwise: Any,
    *,
    loss_fn: Callable[..., Any],
    has_aux: bool,
    geometry: Any,
    microbatch: int,
    own_loss: bool,
) -> Any:
    """The engine in use after the neighbour test on a few training rows, in the step's chunks of ``microbatch``
    rows, with the step's ``loss_fn`` (``has_aux``: it returns ``(loss, aux)``): :func:`.engines.independent`.
    The test adds an empty record where the trainer's own collation and loss serve the run (``own_loss`` and no
    ``data_collator``). None: ``'auto'`` fell back to vmap."""
    dataset = trainer.train_dataset

    def batch_of(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return _with_uniform_load(trainer.fetch_batch(rows, np.arange(len(rows))), geometry)

    read = functools.partial(fetch, dataset, keep=trainer.dataset_columns)
    users = trainer._users
    if users is not None:  # the records are users: the test adds one user, all its rows

        def batch_of(records: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
            rows = [row for record in records for row in record]
            return trainer.fetch_batch(rows, slot_array([len(record) for record in records]))

        sample = coupling.neighbour_users(read, users.row_users, users.max_rows)
    else:
        sample = coupling.neighbour_rows(dataset, read, empty=own_loss and trainer.data_collator is None)
    if users is None and sample is not None and _draws_at_random(trainer, sample[0]):
        # a collator that draws (MLM masking) would give the rows of S other draws in the second batch; the test
        # compares the rows with one draw each, padded by the trainer's own collation
        *rows, extra = _drawn_once(trainer, [*sample[0], sample[1]])
        sample = (rows, extra)
        pad = getattr(trainer.processing_class, "pad_token_id", None) or 0

        def batch_of(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            batch = on_device(collate(rows, pad_token_id=pad), trainer.args.device)
            return _with_uniform_load(batch, geometry)

    with routing(trainer.model, geometry):
        return engines.independent(
            layerwise, args=trainer.args, model=trainer.model,
            params=trainer.topology.engine_params(trainer.trainable_params), batch_of=batch_of,
            loss_fn=loss_fn, has_aux=has_aux, sample=sample, microbatch=microbatch,
        )  # fmt: skip


def _draws_at_random(trainer: Any, rows: list[dict[str, Any]]) -> bool:
    """Whether the trainer's ``data_collator`` draws random numbers (``DataCollatorForLanguageModeling`` draws the
    masked tokens): two collations of ``rows`` in a row differ. The global torch generator is left as it was."""
    if trainer.data_collator is None:
        return False
    with torch.random.fork_rng(devices=[]):
        first, second = (trainer.fetch_batch(rows, np.arange(len(rows))) for _ in range(2))
    return first.keys() != second.keys() or any(not torch.equal(first[k], second[k]) for k in first)


def _drawn_once(trainer: Any, rows: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """``rows`` collated once by the trainer's collator, then split back into rows on the host, each sequence column
    cut to the row's own ``input_ids`` length (the padding the collator added removed). The global torch generator
    is left as it was."""
    with torch.random.fork_rng(devices=[]):
        batch = {k: v.cpu() for k, v in trainer.fetch_batch(rows, np.arange(len(rows))).items()}
    width = batch["input_ids"].shape[1] if "input_ids" in batch else None
    out = []
    for i, row in enumerate(rows):
        length = len(row["input_ids"]) if "input_ids" in row else width
        out.append({k: v[i, :length] if v.dim() > 1 and v.shape[1] == width else v[i] for k, v in batch.items()})
    return out


@contextlib.contextmanager
def routing(model: torch.nn.Module, geometry: Any) -> Iterator[None]:
    """With the router release (``geometry`` not None), the model's router logits off, as its step runs."""
    with router_logits_off(model) if geometry is not None else contextlib.nullcontext():
        yield


def _with_uniform_load(batch: dict[str, torch.Tensor], geometry: Any) -> dict[str, torch.Tensor]:
    if geometry is None:
        return batch
    return with_load(batch, torch.full((geometry.num_experts,), geometry.uniform, dtype=torch.float64))
