"""``DPOTrainer``: private Direct Preference Optimization against a frozen reference model.

The privacy unit is one (prompt, chosen, rejected) row. Its loss depends on the policy's log-probabilities of its two
completions (summed over completion tokens) and on the reference's, nothing else; DP-SGD clips that row's gradient
and adds noise, so the guarantee covers the row.

Why the reference does not leak: the reference model is fixed before training and independent of the private data
(a public pre-trained model, or the initial policy). Its log-probabilities for a row are a deterministic function of
that row alone, used only inside that row's loss, so they are part of the row as far as the mechanism is concerned:
whether they are precomputed once into the ``ref_chosen_logps`` / ``ref_rejected_logps`` columns or recomputed in every
step, they reach the released model only through the clipped, noised gradient of their own row. They are never
saved; the TRL log values that read them (``rewards/*``), like every logged statistic of the training data, are
outside the guarantee. (A reference trained on the private data without DP would void this argument.)

TR-DPO (``sync_ref_model``) moves the reference towards the policy every ``ref_model_sync_steps`` steps, from the
released weights only: post-processing, at no privacy cost, and saved in the checkpoints
(:mod:`~opake_torch.transformers.trl.reference_sync`).

Losses: TRL's per-pair losses with TRL's formulas (:func:`dpo_loss`, :data:`~.config.DPO_LOSS_TYPES`), the
reference-free ones (SimPO, CPO, ORPO, the chosen NLL) and the per-pair options (MPO weights, WPO, LD-DPO, f-DPO) of
:mod:`~opake_torch.transformers.trl.dpo_losses`; the losses that couple the pairs of a batch are refused by
:class:`~.config.DPOConfig`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.trainer_utils import TrainOutput

from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.transformers.arguments import TrainingArguments
from opake_torch.transformers.run_state import Run
from opake_torch.transformers.trainer import DPTrainer
from opake_torch.transformers.trl import reference_sync
from opake_torch.transformers.trl.config import DPO_LOSS_TYPES, DPOConfig
from opake_torch.transformers.trl.data import default_collator, preference_example
from opake_torch.transformers.trl.dpo_losses import PairOptions, pair_logps, pair_loss, summed_logps, token_logps
from opake_torch.transformers.trl.loading import load_tokenizer
from opake_torch.transformers.trl.metrics import TRLMetrics, dpo_example_metrics
from opake_torch.transformers.trl.sft import prepare_model, prepare_tokenizer, upcast_args

__all__ = ["DPOTrainer", "adapters_disabled", "dpo_loss", "sequence_logps"]

SIDES = ("chosen", "rejected")

logger = logging.getLogger(__name__)


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Sum of next-token log-probabilities over the completion tokens of one sequence (``logits [T, V]``)."""
    logps = torch.gather(F.log_softmax(logits[:-1].float(), dim=-1), -1, input_ids[1:, None]).squeeze(-1)
    return (logps * completion_mask[1:]).sum(-1)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """The DPO loss of one preference pair (or elementwise over a batch of pairs), TRL's formula for ``loss_type``.

    With the log-ratios ``c = log pi(y_w|x) - log ref(y_w|x)``, ``r = log pi(y_l|x) - log ref(y_l|x)`` (summed over
    completion tokens), ``d = c - r``, ``s = sigmoid``, ``e = label_smoothing``:

    - ``sigmoid``: ``-log s(beta d)`` (DPO); ``hinge``: ``max(0, 1 - beta d)`` (SLiC);
    - ``ipo``: ``(c / n_w - r / n_l - 1 / (2 beta))^2`` with the completion lengths ``n`` (TRL's length-normalized
      IPO); ``sigmoid_norm``: ``-log s(beta (c / n_w - r / n_l))``;
    - ``exo_pair``: ``q_w (log q_w - log(1 - e)) + q_l (log q_l - log e)`` with ``q_w = s(beta d)``,
      ``q_l = s(-beta d)`` (EXO, arXiv 2402.00856 eq. 16);
    - ``robust``: ``(-(1 - e) log s(beta d) + e log s(-beta d)) / (1 - 2 e)`` (arXiv 2403.00409);
    - ``nca_pair``: ``-log s(beta c) - log s(-beta c) / 2 - log s(-beta r) / 2`` (arXiv 2402.05369);
    - ``bco_pair``: ``-log s(beta c) - log s(-beta r)`` (TRL 1.16: no running reward mean, so it is per pair);
    - ``sppo_hard``: ``(c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2`` (arXiv 2405.00675, hard labels);
    - ``apo_zero``: ``1 - s(beta c) + s(beta r)``; ``apo_down``: ``s(beta c) + 1 - s(beta d)`` (arXiv 2408.06266);
    - ``discopop``: ``-log s(beta d) (1 - m) + exp(-beta d) m`` with ``m = s(beta d / discopop_tau)``
      (arXiv 2406.08414).

    ``chosen_tokens`` / ``rejected_tokens`` (completion token counts) are needed by ``ipo`` and ``sigmoid_norm``.
    """
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    delta = chosen - rejected
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_tokens is None or rejected_tokens is None:
            raise ConfigurationError(
                f"loss_type={loss_type!r} needs chosen_tokens and rejected_tokens (completion lengths)."
            )
        normalized = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        if loss_type == "ipo":
            return (normalized - 1 / (2 * beta)) ** 2
        return -F.logsigmoid(beta * normalized)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "exo_pair":
        log_qw, log_ql = F.logsigmoid(beta * delta), F.logsigmoid(-beta * delta)
        return log_qw.exp() * (log_qw - math.log1p(-label_smoothing)) + log_ql.exp() * (
            log_ql - math.log(label_smoothing)
        )
    if loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * label_smoothing)
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if loss_type == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * delta)
    if loss_type == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    raise ConfigurationError(f"loss_type must be one of {list(DPO_LOSS_TYPES)}, got {loss_type!r}.")


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """PEFT's ``model.disable_adapter()`` without its ``requires_grad_`` toggling, which functorch transforms refuse.

    Only the layers' ``_disable_adapters`` flags change (plain Python state, restored on exit), so the context can be
    entered inside ``vmap(grad(...))``.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    saved = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, flag in zip(layers, saved, strict=True):
            layer._disable_adapters = flag


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


class DPOTrainer(DPTrainer):
    """Private DPO on :class:`DPTrainer`'s DP-SGD loop.

    Args:
        model: the policy, a causal LM (PEFT models train their adapters only), or its name or path, loaded as TRL
            does (:mod:`opake_torch.transformers.trl.loading`).
        ref_model: the reference, frozen (moved towards the policy by ``args.sync_ref_model`` only). None: for a
            PEFT policy, the base model with adapters disabled; otherwise a frozen deep copy of the initial policy.
            Must not be ``model`` itself.
        args: :class:`DPOConfig`; a plain :class:`TrainingArguments` is upcast, a ``trl.DPOConfig`` converted
            (:func:`~opake_torch.transformers.trl.sft.upcast_args`).
        data_collator: defaults to right-padding every column (ids with the pad token, masks with 0).
        train_dataset: rows with ``prompt`` / ``chosen`` / ``rejected`` (strings or message lists) or
            conversational ``chosen`` / ``rejected`` with an implicit prompt; formatted once here.
        eval_dataset: the same, for evaluation.
        processing_class: the tokenizer (a copy gets ``args.chat_template`` and an EOS pad fallback).
        quantization_config: TRL's argument; None only (quantized base weights are refused).
        peft_config: wrap ``model`` with ``peft.get_peft_model`` first.
        compute_metrics: as in :class:`DPTrainer`.
        callbacks: as in :class:`DPTrainer`.
        optimizers: as in :class:`DPTrainer`.
        optimizer_cls_and_kwargs: as in :class:`DPTrainer`.

    Besides the loss, :meth:`compute_per_example_loss_and_metrics` gives TRL's ``rewards/*``, ``logps/*``,
    ``logits/*``, ``mean_token_accuracy``, ``entropy`` and ``num_tokens`` per pair
    (:mod:`opake_torch.transformers.trl.metrics`; outside the guarantee).

    Example: a preference pair is one example (the privacy unit); its two sequences share the prompt, and only the
    completions count in the loss. ``trainer.train()`` then runs DP-SGD as :class:`DPTrainer` does.

        >>> import tempfile
        >>> from opake_torch.transformers.trl.examples import tiny_llama, word_tokenizer
        >>> tokenizer, model = word_tokenizer(), tiny_llama()  # offline, random weights
        >>> folder = tempfile.TemporaryDirectory()
        >>> from opake_torch import DPOConfig, DPOTrainer
        >>> config = DPOConfig(folder.name, privacy_noise_multiplier=1.0, per_device_train_batch_size=4, use_cpu=True,
        ...                    report_to="none")
        >>> pairs = [{"prompt": "the cat", "chosen": " sat", "rejected": " ran"}] * 8
        >>> trainer = DPOTrainer(model, args=config, train_dataset=pairs, processing_class=tokenizer)
        >>> pair = trainer.train_dataset[0]
        >>> pair["chosen_input_ids"], pair["rejected_input_ids"], pair["chosen_completion_mask"]
        (tensor([3, 4, 5, 1]), tensor([ 3,  4, 10,  1]), tensor([0, 0, 1, 1]))
        >>> folder.cleanup()
    """

    privacy_unit = "one preference pair (one prompt with its chosen and rejected completions)"

    def __init__(
        self,
        model: nn.Module | str,
        ref_model: nn.Module | None = None,
        args: DPOConfig | TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        args = upcast_args(args, DPOConfig)
        if ref_model is not None and ref_model is model:
            raise ConfigurationError(
                "ref_model is the policy object itself: it would move with training. Pass ref_model=None (a frozen "
                "copy of the initial policy, or the base model for PEFT) or a separate model."
            )
        processing_class = load_tokenizer(processing_class, model, args)
        model = prepare_model(model, args, peft_config, quantization_config)
        if args.sync_ref_model and _is_peft(model):
            raise ConfigurationError(
                "sync_ref_model=True with a PEFT policy is refused, as TRL refuses it: the reference is the base model "
                "with the adapters disabled, which shares its weights with the policy, so there is no separate "
                "reference to mix the policy into. Train the full model (no peft_config) or set sync_ref_model=False."
            )
        if ref_model is None and not _is_peft(model):
            ref_model = copy.deepcopy(model)
        if ref_model is not None:
            ref_model = ref_model.to(args.device).eval().requires_grad_(False)
        if args.disable_dropout:
            _disable_dropout(model)
            if ref_model is not None:
                _disable_dropout(ref_model)
        self.ref_model = ref_model
        tokenizer = prepare_tokenizer(processing_class, args.chat_template)
        train_dataset, eval_dataset = (self._format(d, tokenizer, args) for d in (train_dataset, eval_dataset))
        if data_collator is None:
            data_collator = default_collator(tokenizer, args.pad_to_multiple_of)
        super().__init__(
            model,
            args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            compute_loss_func=None,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self.dataset_columns = None  # the formatted rows hold exactly the preference columns
        if ref_model is not None:
            self._ref_apply, ref_params, ref_frozen = functional_model(ref_model)
            self._ref_tensors = {**ref_frozen, **ref_params}  # share the module's storage: a sync shows through
        if args.sync_ref_model:
            reference_sync.check_pair(ref_model, {**self._frozen, **self._params})
        if args.precompute_ref_log_probs:
            for dataset in (self.train_dataset, self.eval_dataset):
                if dataset is not None:
                    self.precompute_ref_log_probs(dataset)

    @staticmethod
    def _format(dataset: Any, tokenizer: Any, args: DPOConfig) -> list[dict[str, torch.Tensor]] | None:
        if dataset is None:
            return None
        return [
            preference_example(dataset[i], tokenizer, max_length=args.max_length, chat_template=args.chat_template)
            for i in range(len(dataset))
        ]

    # -- reference -------------------------------------------------------------------------------------------------

    def _step_boundary(self, run: Run) -> None:
        """TR-DPO: at the end of every ``ref_model_sync_steps``-th step, the reference moves towards the released
        policy weights (:func:`~opake_torch.transformers.trl.reference_sync.mix_into`)."""
        args = self.args
        if args.sync_ref_model and self.state.global_step % args.ref_model_sync_steps == 0:
            reference_sync.mix_into(self.ref_model, {**self._frozen, **run.params}, args.ref_model_mixup_alpha)

    def _checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """The synced reference's parameters (TR-DPO), which a resume cannot rebuild from the policy alone."""
        if not self.args.sync_ref_model:
            return {}
        return {reference_sync.FILE: reference_sync.saved_state(self.ref_model)}

    def _start(self, resume_from_checkpoint: str | bool | None) -> Run:
        """:meth:`DPTrainer._start`, and the synced reference of the checkpoint a TR-DPO run resumes."""
        run = super()._start(resume_from_checkpoint)
        if self.args.sync_ref_model and run.checkpoint is not None:
            if not reference_sync.restore(self.ref_model, run.checkpoint):
                logger.warning(
                    "%s holds no synced reference (%s): it was written without sync_ref_model, so the run resumes "
                    "from the ref_model of this trainer, which its syncs move from now on.",
                    run.checkpoint, reference_sync.FILE,
                )  # fmt: skip
        return run

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """:meth:`DPTrainer.train`. TR-DPO with ``load_best_model_at_end``: the reference comes back from the best
        checkpoint with the policy (the reference mixed up to that checkpoint, which its :data:`~.reference_sync.FILE`
        holds), so that evaluation and a later save read the pair as it was trained together. The policy is restored
        before ``on_train_end``, the reference when ``train()`` returns."""
        output = super().train(resume_from_checkpoint)
        best = self.state.best_model_checkpoint
        if self.args.sync_ref_model and self.args.load_best_model_at_end and best:
            if not reference_sync.restore(self.ref_model, Path(best)):
                logger.warning(
                    "the best checkpoint %s holds no synced reference (%s): it was written without sync_ref_model, "
                    "so the reference stays the one synced up to the last step, not the one of the restored policy.",
                    best, reference_sync.FILE,
                )  # fmt: skip
        return output

    def _reference_logits(self, params: dict[str, torch.Tensor], **inputs: torch.Tensor) -> torch.Tensor:
        """Reference logits ``[B, T, V]``: the separate reference, or the PEFT policy with its adapters disabled."""
        if self.ref_model is not None:
            return self._ref_apply({}, self._ref_tensors, **inputs).logits
        with adapters_disabled(self.model):
            return self.apply_model(params, **inputs).logits

    @torch.no_grad()
    def precompute_ref_log_probs(self, dataset: list[dict[str, torch.Tensor]]) -> None:
        """Add ``ref_chosen_logps`` / ``ref_rejected_logps`` to every formatted row, once, without gradients."""
        size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(dataset), size):
            rows = dataset[start : start + size]
            batch = {k: v.to(self.args.device) for k, v in self.data_collator(rows).items()}
            logps = {}
            for side in SIDES:
                ids, mask = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"]
                logits = self._reference_logits(self._params, input_ids=ids, attention_mask=mask)
                logps[side] = torch.vmap(token_logps)(logits, ids)
            masks = {side: batch[f"{side}_completion_mask"] for side in SIDES}
            summed = torch.vmap(lambda lp, m: summed_logps(lp, m, self.args.ld_alpha))(logps, masks)
            for side in SIDES:
                for row, value in zip(rows, summed[side].cpu(), strict=True):
                    row[f"ref_{side}_logps"] = value
        self.model.train(was_training)

    # -- loss ------------------------------------------------------------------------------------------------------

    def compute_per_example_loss(
        self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The DPO loss (``args.loss_type``) of one preference pair, from summed completion log-probabilities."""
        return self._pair(params, example)[0]

    def compute_per_example_loss_and_metrics(
        self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The pair's loss and its TRL log values (:func:`~opake_torch.transformers.trl.metrics.dpo_example_metrics`)
        from the same forward passes. The values are detached statistics of the pair, outside the privacy guarantee.
        """
        loss, policy, reference, logits = self._pair(params, example)
        metrics = dpo_example_metrics(
            beta=self.args.beta,
            policy=policy,
            reference=reference,
            logits=logits,
            input_ids={side: example[f"{side}_input_ids"] for side in SIDES},
            completion_mask={side: example[f"{side}_completion_mask"] for side in SIDES},
            attention_mask={side: example[f"{side}_attention_mask"] for side in SIDES},
        )
        return loss, metrics

    def _pair(self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        """``(loss, policy logps, reference logps, policy logits)`` of one pair, per side (the loss and its options:
        :mod:`~opake_torch.transformers.trl.dpo_losses`)."""
        options = PairOptions.from_args(self.args)
        logits, ids, completion, ref_logps = {}, {}, {}, {}
        for side in SIDES:
            ids[side], completion[side] = example[f"{side}_input_ids"], example[f"{side}_completion_mask"]
            inputs = {"input_ids": ids[side][None], "attention_mask": example[f"{side}_attention_mask"][None]}
            logits[side] = self.apply_model(params, **inputs).logits[0]
            if options.needs_reference and f"ref_{side}_logps" not in example:
                with torch.no_grad():
                    ref_logps[side] = token_logps(self._reference_logits(params, **inputs)[0], ids[side]).detach()
        reference = None
        if options.needs_reference:
            precomputed = {side: example[f"ref_{side}_logps"] for side in SIDES if f"ref_{side}_logps" in example}
            reference = precomputed or summed_logps(ref_logps, completion, options.ld_alpha)
        pair = pair_logps(options, logits, ids, completion, reference)
        policy = {"chosen": pair.chosen, "rejected": pair.rejected}
        if reference is None:  # reference-free losses: TRL's CPO / ORPO log rewards against a zero reference
            reference = {side: torch.zeros_like(value).detach() for side, value in policy.items()}
        return pair_loss(pair, options), policy, reference, logits

    def example_metrics(self) -> TRLMetrics:
        """A fresh accumulator of this trainer's per-example log values, read out under TRL's names."""
        return TRLMetrics()
