"""Per-example losses for Hugging Face models.

The privacy unit is one example, so the loss of one example may depend on that example only: a sequence's loss
is the mean over *its own* target tokens (padding and ignored labels get weight zero), never a normalization by
the number of tokens in the whole batch (Hugging Face's ``num_items_in_batch``), which would couple examples.

A record without a position its attention mask keeps (all padding, or an empty ``input_ids``) has loss 0 and gradient
0, exactly (:func:`attended`): such a record attends to nothing of its own, so whatever a model computes for it (BERT:
a uniform average over the batch's padded length) would depend on the other records of its batch.

Every function here takes one example without a batch dimension, except :func:`batch_losses`, which returns every
example's own loss from one batched forward (for ``opake_torch.layerwise``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from opake_core.errors import ConfigurationError
from opake_torch.patches.kernels import opake_cross_entropy_loss, opake_fused_linear_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "ExampleOutput",
    "FusedHead",
    "HFLoss",
    "attended",
    "batch_losses",
    "causal_lm_loss",
    "fused_causal_lm_losses",
    "fused_head",
    "hf_loss",
    "infer_task",
    "logits_losses",
    "loss_from_logits",
    "per_example_loss",
    "sequence_classification_loss",
    "token_classification_loss",
]

IGNORE_INDEX = -100
TASKS = ("causal_lm", "masked_lm", "sequence_classification", "token_classification")


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    kernel: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy over one sequence's target tokens.

    Args:
        logits: ``[T, V]`` logits for one sequence (``[m, T, V]`` for ``m`` sequences: then ``[m]`` losses).
        labels: ``[T]`` token ids (``[m, T]``); position ``t`` is predicted from positions ``< t``;
            ``ignore_index`` marks positions without a target (padding, prompt tokens).
        kernel: use :func:`~opake_torch.patches.kernels.opake_cross_entropy_loss` (without label smoothing).

    Returns:
        A float32 scalar; 0 when the sequence has no target token.
    """
    return _masked_mean_ce(
        logits[..., :-1, :], labels[..., 1:], label_smoothing=label_smoothing, ignore_index=ignore_index, kernel=kernel
    )


def token_classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    kernel: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy over one sequence's labelled tokens (``logits [T, C]``, ``labels [T]``)."""
    return _masked_mean_ce(logits, labels, label_smoothing=label_smoothing, ignore_index=ignore_index, kernel=kernel)


def _masked_mean_ce(
    logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float, ignore_index: int, kernel: bool
) -> torch.Tensor:
    if kernel and not label_smoothing:  # the Triton cross-entropy (its torch reference off CUDA): same value
        return opake_cross_entropy_loss(logits, labels, ignore_index=ignore_index, reduction="mean")
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    flat = logits.float().reshape(-1, logits.shape[-1])  # [..., T, V] as rows: each position's loss on its own
    nll = F.cross_entropy(flat, safe.reshape(-1).long(), reduction="none", label_smoothing=label_smoothing)
    return _masked_mean(nll.view(safe.shape), mask)


def _masked_mean(nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``nll`` over the positions ``mask`` keeps, along the last dimension; 0 where it keeps none."""
    return (nll.float() * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def sequence_classification_loss(
    logits: torch.Tensor, label: torch.Tensor, *, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Cross-entropy of one example (``logits [C]``, an integer ``label []`` or class probabilities ``[C]``), or of
    each of ``m`` (``[m, C]``, labels ``[m]`` or ``[m, C]``); squared error for one float output."""
    if logits.shape[-1] == 1 and label.is_floating_point():
        return (logits.float().squeeze(-1) - label.float()).square()
    flat = logits.float().reshape(-1, logits.shape[-1])
    if label.is_floating_point():  # class probabilities
        nll = F.cross_entropy(flat, label.reshape(flat.shape), reduction="none", label_smoothing=label_smoothing)
        return nll.view(label.shape[:-1])
    nll = F.cross_entropy(flat, label.reshape(-1).long(), reduction="none", label_smoothing=label_smoothing)
    return nll.view(label.shape)


def _task_of(model: nn.Module) -> str | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    architectures = getattr(getattr(base, "config", None), "architectures", None) or []
    names = [type(base).__name__, *architectures]
    for candidate in names:
        if candidate.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal_lm"
        if candidate.endswith("ForMaskedLM"):
            return "masked_lm"
        if candidate.endswith("ForSequenceClassification"):
            return "sequence_classification"
        if candidate.endswith("ForTokenClassification"):
            return "token_classification"
    return None


def infer_task(model: nn.Module) -> str:
    """The loss family of a Hugging Face model, from its class name."""
    task = _task_of(model)
    if task is not None:
        return task
    raise ConfigurationError(
        f"cannot tell which per-example loss fits {type(model).__name__}; pass compute_loss_func=(logits, labels) "
        "-> scalar for one example."
    )


@dataclass
class ExampleOutput(ModelOutput):
    """What a Hugging Face-style ``compute_loss_func`` receives as ``outputs``: one example's ``logits`` ``[1, ...]``
    (read as ``outputs.logits``, ``outputs["logits"]`` or ``outputs[0]``)."""

    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class HFLoss:
    """A ``compute_loss_func(outputs, labels, num_items_in_batch)`` with ``transformers.Trainer``'s contract, called on
    **one** example at a time: ``outputs`` an :class:`ExampleOutput` of that example's logits ``[1, ...]``, ``labels``
    its labels ``[1, ...]``, ``num_items_in_batch`` its own count of target labels (not -100; for a causal LM those of
    ``labels[..., 1:]``, as Hugging Face counts; at least 1). A loss that sums its token losses and divides by
    ``num_items_in_batch`` is then the mean over the example's own tokens: no example's loss reads another's count,
    which Hugging Face's batch-wide count would do."""

    func: Callable[..., torch.Tensor]
    shifts_labels: bool

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss (a scalar) of one example from its ``logits`` and ``labels``, both without batch dimension."""
        counted = labels[1:] if self.shifts_labels else labels
        count = counted.ne(IGNORE_INDEX).sum().clamp(min=1)
        loss = self.func(ExampleOutput(logits=logits[None]), labels[None], num_items_in_batch=count)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigurationError(
                f"compute_loss_func returned {loss!r:.80} for one example; it must return the example's loss, a "
                "tensor with one element."
            )
        return loss.reshape(())


def hf_loss(func: Callable[..., torch.Tensor] | None, model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """``func`` as an :class:`HFLoss` when it has Hugging Face's contract (a ``num_items_in_batch`` parameter, or three
    positional ones: ``outputs, labels, num_items_in_batch``); unchanged when it is a one-example ``(logits, labels)
    -> scalar`` (or None). Labels are counted shifted for a causal LM (``model``'s class)."""
    if func is None:
        return None
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the one-example contract
        return func
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "num_items_in_batch" in parameters or len(positional) >= 3:
        return HFLoss(func, shifts_labels=_task_of(model) == "causal_lm")
    return func


def loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    task: str,
    compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
    kernel: bool = False,
) -> torch.Tensor:
    """One example's loss from its logits and labels (both without batch dimension); ``kernel``: the token losses
    through the Triton cross-entropy."""
    if compute_loss_func is not None:
        return compute_loss_func(logits, labels)
    if task == "causal_lm":
        return causal_lm_loss(logits, labels, label_smoothing=label_smoothing, kernel=kernel)
    if task in ("token_classification", "masked_lm"):  # a masked LM classifies its masked tokens over the vocabulary
        return token_classification_loss(logits, labels, label_smoothing=label_smoothing, kernel=kernel)
    if task == "sequence_classification":
        return sequence_classification_loss(logits, labels, label_smoothing=label_smoothing)
    raise ConfigurationError(f"task must be one of {TASKS}, got {task!r}.")


def logits_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    task: str | None,
    compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Every example's loss ``[B]`` from a batch's ``logits [B, ...]`` and ``labels [B, ...]`` (:func:`loss_from_logits`
    row by row; a Hugging Face-style :class:`HFLoss` in a Python loop, as it may do anything with its batch)."""
    if isinstance(compute_loss_func, HFLoss):
        return torch.stack([compute_loss_func(logits[i], labels[i]) for i in range(len(logits))])
    one = lambda row_logits, row_labels: loss_from_logits(  # noqa: E731
        row_logits, row_labels, task=task, compute_loss_func=compute_loss_func
    )
    return torch.vmap(one)(logits, labels)


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
    kernel: bool = False,
) -> torch.Tensor:
    """The loss of one example: :func:`batch_losses` on a batch of one.

    ``example`` holds the model inputs and its labels, each without a batch dimension. ``compute_loss_func``,
    when given, receives the example's logits (without batch dimension) and labels and returns a scalar.

    Example: a sequence's loss is the mean over its own target tokens; padding changes nothing.

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from opake_torch import functional_model, per_example_loss
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> apply, params, frozen = functional_model(model)
        >>> short = {"input_ids": torch.tensor([9, 10]), "labels": torch.tensor([9, 10])}
        >>> padded = {"input_ids": torch.tensor([9, 10, 0]), "attention_mask": torch.tensor([1, 1, 0]),
        ...           "labels": torch.tensor([9, 10, -100])}
        >>> loss = per_example_loss(apply, params, frozen, short, task="causal_lm")
        >>> torch.allclose(loss, per_example_loss(apply, params, frozen, padded, task="causal_lm"))
        True
    """
    one = {k: v[None] for k, v in example.items()}
    return batch_losses(
        apply,
        params,
        frozen,
        one,
        task=task,
        label_names=label_names,
        compute_loss_func=compute_loss_func,
        label_smoothing=label_smoothing,
        kernel=kernel,
    )[0]


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
    kernel: bool = False,
) -> torch.Tensor:
    """Every example's loss ``[m]`` from one batched forward: the same losses as :func:`per_example_loss` row by row.

    ``batch`` holds the model inputs and labels with their batch dimension. Each row's loss reads only that row's
    logits and labels, so the examples stay separate as long as the model keeps them separate (attention masks,
    no batch normalization).

    Example: one forward over a padded batch gives each row's own loss.

        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from opake_torch import batch_losses, functional_model, per_example_loss
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> apply, params, frozen = functional_model(model)
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
        ...          "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        ...          "labels": torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])}
        >>> losses = batch_losses(apply, params, frozen, batch, task="causal_lm")
        >>> second = {"input_ids": torch.tensor([9, 10]), "labels": torch.tensor([9, 10])}
        >>> losses.shape, torch.allclose(losses[1], per_example_loss(apply, params, frozen, second, task="causal_lm"))
        (torch.Size([2]), True)
    """
    inputs = {k: v for k, v in batch.items() if k not in label_names}
    logits = apply(params, frozen, **inputs).logits

    def one(row_logits: torch.Tensor, row_labels: torch.Tensor) -> torch.Tensor:
        return loss_from_logits(
            row_logits,
            row_labels,
            task=task,
            compute_loss_func=compute_loss_func,
            label_smoothing=label_smoothing,
            kernel=kernel,
        )

    labels = batch[label_names[0]]
    if isinstance(compute_loss_func, HFLoss):
        return attended(logits_losses(logits, labels, task=task, compute_loss_func=compute_loss_func), inputs)
    if compute_loss_func is not None or kernel:  # per example: a user's loss, the Triton kernel's per-row mean
        return attended(torch.vmap(one)(logits, labels), inputs)
    # the built-in losses on the whole batch, row by row the same operations: under torch.compile, vmap's batching
    # rules would fix the batch's shapes (one compilation per sequence length)
    return attended(loss_from_logits(logits, labels, task=task, label_smoothing=label_smoothing), inputs)


@dataclass(frozen=True)
class FusedHead:
    """What the fused causal-LM loss needs: the final norm (its output is what the head reads) and the name of the
    head's weight among the model's parameters."""

    norm: nn.Module
    weight_name: str


def fused_head(model: nn.Module, trainable: set[str]) -> FusedHead | None:
    """The head of a Llama-style causal LM (``<base>.model.norm`` then ``lm_head``), or None where the fused loss
    does not apply: no such structure, or a trainable head (whose gradient the layerwise engine must see as a layer).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", None), "norm", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(norm, nn.Module) or not isinstance(weight, torch.Tensor):
        return None
    name = next((n for n, p in model.named_parameters() if p is weight), None)
    if name is None or name in trainable:
        return None
    return FusedHead(norm, name)


def _final_hidden(
    apply: Callable[..., Any],
    params: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    inputs: dict[str, torch.Tensor],
    head: FusedHead,
) -> torch.Tensor:
    """The final norm's output ``[B, T, H]``; the model computes the logits of its last position only."""
    captured: list[torch.Tensor] = []
    handle = head.norm.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        apply(params, frozen, **inputs, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]


def fused_causal_lm_losses(
    apply: Callable[..., Any],
    params: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    head: FusedHead,
    *,
    label_names: tuple[str, ...] = ("labels",),
) -> torch.Tensor:
    """Each example's mean next-token cross-entropy ``[B]``, the logits never materialized.

    The same value as :func:`causal_lm_loss` row by row (without label smoothing): the final hidden states go
    through :func:`~opake_torch.patches.kernels.opake_fused_linear_cross_entropy` with the head's weight. Works with a
    batch dimension of 1 inside ``vmap`` (one example) and with a whole batch.
    """
    inputs = {k: v for k, v in batch.items() if k not in label_names}
    hidden = _final_hidden(apply, params, frozen, inputs, head)
    weight = {**frozen, **params}[head.weight_name]
    labels = batch[label_names[0]][:, 1:]
    nll = opake_fused_linear_cross_entropy(hidden[:, :-1], weight, labels, reduction="none")
    return attended(_masked_mean(nll, labels != IGNORE_INDEX), inputs)


def attended(losses: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``losses [m]`` with 0, exactly, for every row whose ``attention_mask`` ``[m, T]`` (1 or True: a position the
    row attends to) keeps no position; unchanged without such a mask (a 4-D mask may be additive, where 0 keeps).

    ``torch.where`` rather than a product: the row's loss is 0 even where its forward is not finite, and its gradient
    is exactly 0 wherever that forward is finite (the backward hands the row a zero gradient), in both engines, since
    :func:`per_example_loss` is :func:`batch_losses` on a batch of one.
    """
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != losses.shape[0]:
        return losses
    return torch.where(mask.ne(0).any(dim=1), losses, torch.zeros_like(losses))
