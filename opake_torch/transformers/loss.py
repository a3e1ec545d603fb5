"""Per-example losses for Hugging Face models.

The privacy unit is one example, so the loss of one example may depend on that example only: a sequence's loss
is the mean over *its own* target tokens (padding and ignored labels get weight zero), never a normalization by
the number of tokens in the whole batch (Hugging Face's ``num_items_in_batch``), which would couple examples.

Every function here takes one example without a batch dimension, except :func:`batch_losses`, which returns every
example's own loss from one batched forward (for ``opake_torch.layerwise``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_core.errors import ConfigurationError

__all__ = [
    "IGNORE_INDEX",
    "batch_losses",
    "causal_lm_loss",
    "infer_task",
    "loss_from_logits",
    "per_example_loss",
    "sequence_classification_loss",
    "token_classification_loss",
]

IGNORE_INDEX = -100
TASKS = ("causal_lm", "sequence_classification", "token_classification")


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean next-token cross-entropy over one sequence's target tokens.

    Args:
        logits: ``[T, V]`` logits for one sequence.
        labels: ``[T]`` token ids; position ``t`` is predicted from positions ``< t``; ``ignore_index`` marks
            positions without a target (padding, prompt tokens).

    Returns:
        A float32 scalar; 0 when the sequence has no target token.
    """
    return _masked_mean_ce(logits[:-1], labels[1:], label_smoothing=label_smoothing, ignore_index=ignore_index)


def token_classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy over one sequence's labelled tokens (``logits [T, C]``, ``labels [T]``)."""
    return _masked_mean_ce(logits, labels, label_smoothing=label_smoothing, ignore_index=ignore_index)


def _masked_mean_ce(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float, ignore_index: int
) -> torch.Tensor:
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    nll = F.cross_entropy(logits.float(), safe, reduction="none", label_smoothing=label_smoothing)
    return (nll * mask).sum() / mask.sum().clamp(min=1)


def sequence_classification_loss(
    logits: torch.Tensor, label: torch.Tensor, *, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Cross-entropy of one example (``logits [C]``, integer ``label []``); squared error for one float output."""
    if logits.shape[-1] == 1 and label.is_floating_point():
        return (logits.float().squeeze(-1) - label.float()).square()
    return F.cross_entropy(logits.float()[None], label[None], label_smoothing=label_smoothing)


def infer_task(model: nn.Module) -> str:
    """The loss family of a Hugging Face model, from its class name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    architectures = getattr(getattr(base, "config", None), "architectures", None) or []
    names = [type(base).__name__, *architectures]
    for candidate in names:
        if candidate.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal_lm"
        if candidate.endswith("ForSequenceClassification"):
            return "sequence_classification"
        if candidate.endswith("ForTokenClassification"):
            return "token_classification"
    raise ConfigurationError(
        f"cannot tell which per-example loss fits {type(model).__name__}; pass compute_loss_func=(logits, labels) "
        "-> scalar for one example."
    )


def loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    task: str,
    compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """One example's loss from its logits and labels (both without batch dimension)."""
    if compute_loss_func is not None:
        return compute_loss_func(logits, labels)
    if task == "causal_lm":
        return causal_lm_loss(logits, labels, label_smoothing=label_smoothing)
    if task == "token_classification":
        return token_classification_loss(logits, labels, label_smoothing=label_smoothing)
    if task == "sequence_classification":
        return sequence_classification_loss(logits, labels, label_smoothing=label_smoothing)
    raise ConfigurationError(f"task must be one of {TASKS}, got {task!r}.")


def per_example_loss(
    apply: Callable[..., Any],
    params: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    example: dict[str, torch.Tensor],
    *,
    task: str,
    label_names: tuple[str, ...] = ("labels",),
    compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The loss of one example: run the model on it with a batch dimension of 1, then :func:`loss_from_logits`.

    ``example`` holds the model inputs and its labels, each without a batch dimension. ``compute_loss_func``,
    when given, receives the example's logits (without batch dimension) and labels and returns a scalar.
    """
    inputs = {k: v[None] for k, v in example.items() if k not in label_names}
    logits = apply(params, frozen, **inputs).logits[0]
    return loss_from_logits(
        logits,
        example[label_names[0]],
        task=task,
        compute_loss_func=compute_loss_func,
        label_smoothing=label_smoothing,
    )


def batch_losses(
    apply: Callable[..., Any],
    params: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    *,
    task: str,
    label_names: tuple[str, ...] = ("labels",),
    compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Every example's loss ``[m]`` from one batched forward: the same losses as :func:`per_example_loss` row by row.

    ``batch`` holds the model inputs and labels with their batch dimension. Each row's loss reads only that row's
    logits and labels, so the examples stay separate as long as the model keeps them separate (attention masks,
    no batch normalization).
    """
    inputs = {k: v for k, v in batch.items() if k not in label_names}
    logits = apply(params, frozen, **inputs).logits

    def one(row_logits: torch.Tensor, row_labels: torch.Tensor) -> torch.Tensor:
        return loss_from_logits(
            row_logits, row_labels, task=task, compute_loss_func=compute_loss_func, label_smoothing=label_smoothing
        )

    return torch.vmap(one)(logits, batch[label_names[0]])
