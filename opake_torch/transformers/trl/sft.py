"""``SFTTrainer``: private supervised fine-tuning with TRL's data formats.

The privacy unit is one row of the dataset (one text, one conversation, one prompt-completion pair). The trainer
formats every row once, at construction, into ``input_ids`` / ``attention_mask`` / ``labels``, then runs
:class:`~opake_torch.transformers.DPTrainer`'s loop unchanged; only the per-example loss is chosen here. Each loss is
a mask-aware mean over the example's own target tokens, never a normalization across the batch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_torch.transformers._from_hf import ALIASES
from opake_torch.transformers.arguments import TrainingArguments
from opake_torch.transformers.loss import loss_from_logits
from opake_torch.transformers.trainer import DPTrainer
from opake_torch.transformers.trl.chunked_nll import chunked_nll
from opake_torch.transformers.trl.config import SFTConfig
from opake_torch.transformers.trl.data import IGNORE_INDEX, default_collator, sft_example
from opake_torch.transformers.trl.loading import load_model, load_tokenizer
from opake_torch.transformers.trl.metrics import TRLMetrics, sft_example_metrics

__all__ = ["SFTTrainer", "dft_loss"]

COLUMNS = {"input_ids", "attention_mask", "labels"}
_KNOB_ALIASES = ("target_epsilon", "noise_multiplier")  # Opacus' names of the DP knobs


def dft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning loss of one sequence (arXiv 2508.05629): NLL weighted by the detached target probability.

    ``logits [T, V]``, ``labels [T]`` (position ``t`` predicts ``labels[t + 1]``); mean over the target tokens.
    """
    targets = labels[1:]
    mask = targets != IGNORE_INDEX
    safe = torch.where(mask, targets, torch.zeros_like(targets))
    logps = torch.gather(F.log_softmax(logits[:-1].float(), dim=-1), -1, safe[:, None]).squeeze(-1)
    return -(logps * logps.detach().exp() * mask).sum() / mask.sum().clamp(min=1)


def _upstream_knobs(args: Any, cls: type) -> dict[str, Any]:
    """The Opake names (a DP knob, most often) set as plain attributes on an upstream config object: the one place an
    unmodified script that builds a ``trl`` config can add them (``training_args.privacy_target_epsilon = 8.0``)."""
    fields = {f.name for f in dataclasses.fields(args)}
    ours = {f.name for f in dataclasses.fields(cls) if f.init}
    extra = {name: value for name, value in vars(args).items() if name not in fields}
    return {name: value for name, value in extra.items() if name in ours or name in ALIASES}


def upcast_args(args: Any, cls: type) -> Any:
    """``args`` as ``cls`` (SFTConfig / DPOConfig).

    A plain :class:`TrainingArguments` keeps its values. A real ``trl.SFTConfig`` / ``trl.DPOConfig`` is converted
    by ``cls.from_trl`` (with its warnings), a ``transformers.TrainingArguments`` by ``cls.from_hf``; upstream
    configs carry no privacy budget, so the DP knob comes from an attribute set on the object
    (``args.privacy_target_epsilon = 8.0``), else :class:`PrivacyBudgetError` says how to give one.
    """
    name = cls.__name__
    if args is None:
        raise ConfigurationError(
            f"{name[:3]}Trainer needs args={name}(..., privacy_noise_multiplier=... or "
            "privacy_target_epsilon=...): a private run has no default budget."
        )
    if isinstance(args, cls):
        return args
    if isinstance(args, TrainingArguments):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
        values["max_length"] = args.max_length
        return cls(**values)
    upstream = type(args).__module__.split(".")[0]
    if upstream in ("trl", "transformers") and dataclasses.is_dataclass(args):
        knobs = _upstream_knobs(args, cls)
        if all(knobs.get(k) is None for k in ("privacy_noise_multiplier", "privacy_target_epsilon", *_KNOB_ALIASES)):
            raise PrivacyBudgetError(
                f"{name[:3]}Trainer got a {upstream}.{type(args).__name__}, which carries no privacy budget. Set the "
                f"DP knob on it (args.privacy_target_epsilon = 8.0, or args.privacy_noise_multiplier = ...), or pass "
                f"{name}.from_trl(args, privacy_target_epsilon=...), or build opake's {name} (it accepts every TRL "
                "field name)."
            )
        if upstream == "trl":
            return cls.from_trl(args, **knobs)
        return cls.from_hf(args, **knobs)
    raise ConfigurationError(
        f"args must be a {name} (or opake_torch.transformers.TrainingArguments, or a trl.{name} to convert), got "
        f"{type(args).__module__}.{type(args).__name__}."
    )


def prepare_model(model: nn.Module | str, args: Any, peft_config: Any, quantization_config: Any = None) -> nn.Module:
    """``model``, loaded first when it is a name or path (:func:`~opake_torch.transformers.trl.loading.load_model`,
    as TRL does), then wrapped with ``peft.get_peft_model`` when ``peft_config`` is given."""
    model = load_model(model, args, quantization_config)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return model


def prepare_tokenizer(tokenizer: Any, chat_template: str | None) -> Any:
    """A copy of ``tokenizer`` with ``chat_template`` set, and a pad token that falls back to EOS."""
    if tokenizer is None:
        return None
    if chat_template is None and getattr(tokenizer, "pad_token", None) is not None:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)  # never mutate the caller's tokenizer
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def output_embedding_name(model: nn.Module) -> tuple[str, str | None]:
    """The parameter names (as ``functional_model`` keys them) of the LM head weight and bias."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ConfigurationError(
            f"loss_type='chunked_nll' needs a model with an output embedding (get_output_embeddings()); "
            f"{type(model).__name__} has none. Use loss_type='nll'."
        )
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ConfigurationError(
                f"loss_type='chunked_nll' computes logits as hidden @ W.T (+ b); {type(model).__name__} rescales them "
                f"({attr}={getattr(config, attr)!r}). Use loss_type='nll'."
            )
    names = {id(p): name for name, p in reversed(list(model.named_parameters()))}
    weight = names.get(id(head.weight))
    bias = names.get(id(head.bias)) if getattr(head, "bias", None) is not None else None
    if weight is None:
        raise ConfigurationError("loss_type='chunked_nll': the output embedding weight is not a model parameter.")
    return weight, bias


class SFTTrainer(DPTrainer):
    """Private SFT: TRL's ``SFTTrainer`` data formats on :class:`DPTrainer`'s DP-SGD loop.

    Args:
        model: a causal LM (PEFT models train their adapters only), or its name or path, loaded as TRL does with
            ``args.model_init_kwargs`` (:mod:`opake_torch.transformers.trl.loading`).
        args: :class:`SFTConfig`; a plain :class:`TrainingArguments` is upcast (keeping its values), a
            ``trl.SFTConfig`` converted (:func:`upcast_args`).
        data_collator: ``list of examples -> batch``; defaults to right-padding (labels -100, masks 0).
        train_dataset: a map-style dataset of rows in one of the formats of
            :mod:`opake_torch.transformers.trl.data`; formatted once here.
        eval_dataset: the same, for evaluation.
        processing_class: the tokenizer (a copy gets ``args.chat_template`` and an EOS pad fallback); None with a
            model given by name loads the tokenizer saved with it.
        compute_loss_func: ``(logits [T, V], labels [T]) -> scalar`` for one example; only with ``loss_type='nll'``.
        quantization_config: TRL's argument; None only (quantized base weights are refused).
        peft_config: wrap ``model`` with ``peft.get_peft_model`` first.
        formatting_func: ``row -> str`` written into ``args.dataset_text_field``.
        compute_metrics: as in :class:`DPTrainer`.
        callbacks: as in :class:`DPTrainer`.
        optimizers: as in :class:`DPTrainer`.
        optimizer_cls_and_kwargs: as in :class:`DPTrainer`.

    Besides the loss, :meth:`compute_per_example_loss_and_metrics` gives TRL's ``mean_token_accuracy``, ``entropy``
    and ``num_tokens`` per example (:mod:`opake_torch.transformers.trl.metrics`; outside the guarantee).

    Example: prompt-completion rows are formatted once; the prompt's tokens get label -100, so only the completion
    (and the EOS token) is trained on. ``trainer.train()`` then runs DP-SGD as :class:`DPTrainer` does.

        >>> import tempfile
        >>> from opake_torch.transformers.trl.examples import tiny_llama, word_tokenizer
        >>> tokenizer, model = word_tokenizer(), tiny_llama()  # offline, random weights
        >>> folder = tempfile.TemporaryDirectory()
        >>> from opake_torch import SFTConfig, SFTTrainer
        >>> config = SFTConfig(folder.name, privacy_noise_multiplier=1.0, per_device_train_batch_size=4, use_cpu=True,
        ...                    report_to="none")
        >>> rows = [{"prompt": "the cat", "completion": " sat on the mat"}] * 8
        >>> trainer = SFTTrainer(model, config, train_dataset=rows, processing_class=tokenizer)
        >>> trainer.train_dataset[0]["labels"]
        tensor([-100, -100,    5,    6,    3,    7,    1])
        >>> folder.cleanup()
    """

    privacy_unit = "one example (one text, one conversation or one prompt-completion pair)"

    def __init__(
        self,
        model: nn.Module | str,
        args: SFTConfig | TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[Any], str] | None = None,
    ) -> None:
        args = upcast_args(args, SFTConfig)
        if compute_loss_func is not None and args.loss_type != "nll":
            raise ConfigurationError(
                f"compute_loss_func replaces the loss, which loss_type={args.loss_type!r} also defines; pass one of "
                "them (compute_loss_func with loss_type='nll')."
            )
        tokenizer = prepare_tokenizer(load_tokenizer(processing_class, model, args), args.chat_template)
        model = prepare_model(model, args, peft_config, quantization_config)
        self.formatting_func = formatting_func
        train_dataset = self._format(train_dataset, tokenizer, args)
        eval_dataset = self._format(eval_dataset, tokenizer, args)
        if data_collator is None:
            data_collator = default_collator(tokenizer, args.pad_to_multiple_of)
        super().__init__(
            model,
            args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self.dataset_columns = COLUMNS
        self._head = output_embedding_name(self.model) if args.loss_type == "chunked_nll" else None

    def _format(self, dataset: Any, tokenizer: Any, args: SFTConfig) -> list[dict[str, torch.Tensor]] | None:
        if dataset is None:
            return None
        return [
            sft_example(
                dataset[i],
                tokenizer,
                text_field=args.dataset_text_field,
                completion_only_loss=args.completion_only_loss,
                assistant_only_loss=args.assistant_only_loss,
                max_length=args.max_length,
                eos_token=args.eos_token,
                chat_template=args.chat_template,
                formatting_func=self.formatting_func,
            )
            for i in range(len(dataset))
        ]

    def compute_batch_losses(self, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every example's loss from one batched forward, for the layerwise engine: ``loss_type="nll"`` only (the
        other loss types raise, and ``per_example_gradients="auto"`` then uses vmap)."""
        self._require_batched()
        return super().compute_batch_losses(params, batch)

    def _require_batched(self) -> None:
        """Refuse the batched forms for loss types that have none (``per_example_gradients="auto"`` then uses vmap)."""
        if self.args.loss_type != "nll":
            raise ConfigurationError(
                f"loss_type={self.args.loss_type!r} has no batched form; the layerwise engine serves loss_type='nll'."
            )

    def compute_per_example_loss(
        self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The mask-aware mean loss of one example (``args.loss_type``); see :class:`SFTConfig`."""
        loss_type = self.args.loss_type
        if loss_type == "nll":
            return super().compute_per_example_loss(params, example)
        inputs = {"input_ids": example["input_ids"][None], "attention_mask": example["attention_mask"][None]}
        if loss_type == "dft":
            return dft_loss(self.apply_model(params, **inputs).logits[0], example["labels"])
        out = self.apply_model(params, **inputs, output_hidden_states=True, logits_to_keep=1)
        weight_name, bias_name = self._head
        tensors = {**self._frozen, **params}
        return chunked_nll(
            out.hidden_states[-1][0],
            tensors[weight_name],
            example["labels"],
            bias=None if bias_name is None else tensors[bias_name],
            chunk_size=self.args.loss_chunk_size,
        )

    def compute_per_example_loss_and_metrics(
        self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The example's loss (the value of :meth:`compute_per_example_loss`) and its TRL log values
        (:func:`~opake_torch.transformers.trl.metrics.sft_example_metrics`) from the same forward. The values are
        detached statistics of the example, outside the privacy guarantee; ``chunked_nll`` never builds the logits,
        so it reports ``num_tokens`` only."""
        labels, mask = example["labels"], example["attention_mask"]
        loss_type = self.args.loss_type
        if loss_type == "chunked_nll":
            return self.compute_per_example_loss(params, example), sft_example_metrics(None, labels, mask)
        if loss_type == "dft":
            inputs = {"input_ids": example["input_ids"][None], "attention_mask": mask[None]}
            logits = self.apply_model(params, **inputs).logits[0]
            return dft_loss(logits, labels), sft_example_metrics(logits, labels, mask)
        inputs = {k: v[None] for k, v in example.items() if k not in self.label_names}
        logits = self.apply_model(params, **inputs).logits[0]
        return self._nll(logits, labels), sft_example_metrics(logits, labels, mask)

    def _nll(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One example's ``loss_type="nll"`` loss from its logits ``[T, V]`` and labels ``[T]``."""
        return loss_from_logits(
            logits,
            labels,
            task=self.task,
            compute_loss_func=self.compute_loss_func,
            label_smoothing=self.args.label_smoothing_factor,
            kernel=self._ce_kernel,
        )

    def compute_batch_losses_and_metrics(
        self, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batched form of :meth:`compute_per_example_loss_and_metrics` (``loss_type="nll"``, one forward): row
        ``i`` holds example ``i``'s loss and values, for the layerwise engine."""
        self._require_batched()
        labels = batch["labels"]
        logits = self.apply_model(params, **{k: v for k, v in batch.items() if k not in self.label_names}).logits
        metrics = torch.vmap(sft_example_metrics)(logits, labels, batch["attention_mask"])
        return torch.vmap(self._nll)(logits, labels), metrics

    def example_metrics(self) -> TRLMetrics:
        """A fresh accumulator of this trainer's per-example log values, read out under TRL's names."""
        return TRLMetrics()
