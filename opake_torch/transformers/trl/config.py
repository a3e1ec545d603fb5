"""``SFTConfig`` and ``DPOConfig``: :class:`TrainingArguments` plus the TRL fields that keep their meaning under DP.

The privacy unit is one training example: one text, one conversation, one (prompt, completion) pair, one
(prompt, chosen, rejected) preference triple. Every field here is validated so that a row of the dataset stays one
example: packing and padding-free batching (which put several examples into one row) are refused, and losses that
couple the examples of a batch (TRL's ``aot`` sorts log-ratios across the batch) are refused too.

Constructing either class never imports ``trl``. :meth:`SFTConfig.from_trl` / :meth:`DPOConfig.from_trl` import it
lazily and reuse :func:`opake_torch.transformers._from_hf.from_hf` for the Hugging Face fields; the TRL fields go
through the tables below (``*_TRL_RENAME``, ``*_TRL_DIRECT``, ``*_TRL_REFUSE``, ``*_TRL_DROP``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Any

from opake_core.errors import ConfigurationError
from opake_torch.transformers import _parsing as p
from opake_torch.transformers.arguments import TrainingArguments

__all__ = ["DPO_LOSS_TYPES", "SFT_LOSS_TYPES", "DPOConfig", "SFTConfig"]

SFT_LOSS_TYPES = ("nll", "dft", "chunked_nll")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")

_ONE_ROW_ONE_EXAMPLE = (
    "one row must be one example: {name} puts several examples into one row, so one example's gradient could no "
    "longer be clipped on its own and the privacy unit would be lost. Set {name}=False (pad_to_multiple_of bounds "
    "padding waste)"
)


def _refuse_packing(name: str, value: Any) -> None:
    if value:
        raise ConfigurationError(f"{name}={value!r} is refused: " + _ONE_ROW_ONE_EXAMPLE.format(name=name) + ".")


def _resolve_chat_template(value: Any) -> str | None:
    """A Jinja template string, or the path of a file holding one (``.jinja`` or a text file)."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigurationError(f"chat_template must be a Jinja template string or a file path, got {value!r}.")
    text = str(value)
    if "{" not in text and os.path.isfile(text):
        with open(text, encoding="utf-8") as handle:
            return handle.read()
    if "{" not in text:
        raise ConfigurationError(
            f"chat_template={text!r} is neither a Jinja template (no '{{') nor an existing file. Pass the template "
            "text, or the path of a .jinja file."
        )
    return text


@dataclass
class SFTConfig(TrainingArguments):
    """Arguments of private supervised fine-tuning; see ``docs/sft-dpo.md``.

    Args (beyond :class:`TrainingArguments`):
        max_length: tokens kept per example (keep-start truncation at tokenization); None keeps everything.
        dataset_text_field: the text column of a language-modelling dataset.
        completion_only_loss: train on completion tokens only (prompt tokens get label -100). None: True for
            prompt-completion data, False otherwise.
        assistant_only_loss: for conversational data, train on assistant turns only; the chat template must mark
            them with ``{% generation %}``.
        chat_template: a Jinja chat template (the text or a file path) set on the tokenizer before formatting.
        eos_token: the token appended to non-conversational text; None uses the tokenizer's.
        loss_type: ``"nll"`` (mask-aware mean cross-entropy per example), ``"dft"`` (cross-entropy weighted by the
            detached target probability, arXiv 2508.05629) or ``"chunked_nll"`` (``"nll"`` computed from hidden
            states without the full ``[T, V]`` logits, see :mod:`opake_torch.transformers.trl.chunked_nll`).
        loss_chunk_size: positions per chunk for ``"chunked_nll"``.
        packing, padding_free: accepted for TRL compatibility, refused when True.
    """

    _: KW_ONLY
    learning_rate: float = 2e-5
    logging_steps: int | float = 10
    max_length: int | None = 1024
    dataset_text_field: str = "text"
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    chat_template: str | None = None
    eos_token: str | None = None
    loss_type: str = "nll"
    loss_chunk_size: int = 256
    packing: bool = False
    padding_free: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_packing("packing", self.packing)
        _refuse_packing("padding_free", self.padding_free)
        self.loss_type = p.as_choice(self.loss_type, "loss_type", SFT_LOSS_TYPES)
        self.loss_chunk_size = p.as_positive_int(self.loss_chunk_size, "loss_chunk_size")
        if not isinstance(self.dataset_text_field, str) or not self.dataset_text_field:
            raise ConfigurationError(
                f"dataset_text_field must be a column name, got {self.dataset_text_field!r}; e.g. 'text'."
            )
        if self.completion_only_loss not in (None, True, False):
            raise ConfigurationError(
                f"completion_only_loss must be True, False or None (auto), got {self.completion_only_loss!r}."
            )
        if self.assistant_only_loss not in (True, False):
            raise ConfigurationError(f"assistant_only_loss must be a bool, got {self.assistant_only_loss!r}.")
        if self.label_smoothing_factor and self.loss_type != "nll":
            raise ConfigurationError(
                f"label_smoothing_factor={self.label_smoothing_factor!r} is supported with loss_type='nll' only "
                f"(got {self.loss_type!r}); set label_smoothing_factor=0.0 or loss_type='nll'."
            )
        self.chat_template = _resolve_chat_template(self.chat_template)

    @classmethod
    def from_trl(cls, trl_args: Any, *, strict: bool = True, **overrides: Any) -> SFTConfig:
        """Convert a ``trl.SFTConfig`` like :meth:`TrainingArguments.from_hf` (a DP knob must be in ``overrides``).

        Raises:
            TypeError: ``trl_args`` is not a ``trl.SFTConfig``.
            PrivacyBudgetError: no ``privacy_noise_multiplier`` / ``privacy_target_epsilon`` in ``overrides``.
            ValueError: a field whose TRL meaning breaks the one-row-one-example unit (packing...), with the reason.
        """
        import trl

        return _from_trl(cls, trl_args, trl.SFTConfig, SFT_TABLES, strict=strict, overrides=overrides)


@dataclass
class DPOConfig(TrainingArguments):
    """Arguments of private DPO; see ``docs/sft-dpo.md``.

    Args (beyond :class:`TrainingArguments`):
        max_length: tokens kept per prompt + completion sequence (keep-start truncation).
        beta: the DPO temperature (the KL weight; IPO's tau).
        loss_type: ``"sigmoid"`` (DPO, arXiv 2305.18290 eq. 7), ``"hinge"`` (SLiC, arXiv 2305.10425) or ``"ipo"``
            (arXiv 2310.12036 eq. 17, log-ratios averaged over completion tokens as TRL does). A one-element list is
            accepted for TRL compatibility.
        precompute_ref_log_probs: score every example with the reference once, at construction, and store the
            results as the ``ref_chosen_logps`` / ``ref_rejected_logps`` columns; False runs the reference in every
            step.
        precompute_ref_batch_size: batch size of that pass; None uses ``per_device_eval_batch_size``.
        disable_dropout: set every dropout probability of the policy and the reference to 0.
        chat_template: a Jinja chat template (the text or a file path) set on the tokenizer before formatting.
        padding_free: accepted for TRL compatibility, refused when True.
    """

    _: KW_ONLY
    learning_rate: float = 1e-6
    logging_steps: int | float = 10
    max_length: int | None = 1024
    beta: float = 0.1
    loss_type: str | list[str] = "sigmoid"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    disable_dropout: bool = True
    chat_template: str | None = None
    padding_free: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_packing("padding_free", self.padding_free)
        loss = self.loss_type
        if isinstance(loss, list | tuple):
            if len(loss) != 1:
                raise ConfigurationError(
                    f"loss_type={loss!r}: a combination of DPO losses (TRL's MPO) is not supported; pick one of "
                    f"{list(DPO_LOSS_TYPES)}."
                )
            loss = loss[0]
        if loss in ("aot", "aot_unpaired"):
            raise ConfigurationError(
                f"loss_type={loss!r} sorts log-ratios across the batch, so one example's loss depends on the others "
                f"and its gradient cannot be clipped alone. Use one of {list(DPO_LOSS_TYPES)}."
            )
        if loss not in DPO_LOSS_TYPES:
            raise ConfigurationError(f"loss_type must be one of {list(DPO_LOSS_TYPES)}, got {self.loss_type!r}.")
        self.loss_type = loss
        beta = p.as_number(self.beta, "beta")
        if not 0 < beta < float("inf"):
            raise ConfigurationError(f"beta must be a positive finite number, got {self.beta!r}; TRL's default is 0.1.")
        self.beta = float(beta)
        self.precompute_ref_batch_size = p.as_optional_positive_int(
            self.precompute_ref_batch_size, "precompute_ref_batch_size"
        )
        for name in ("precompute_ref_log_probs", "disable_dropout"):
            if getattr(self, name) not in (True, False):
                raise ConfigurationError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        self.chat_template = _resolve_chat_template(self.chat_template)

    @classmethod
    def from_trl(cls, trl_args: Any, *, strict: bool = True, **overrides: Any) -> DPOConfig:
        """Convert a ``trl.DPOConfig`` like :meth:`TrainingArguments.from_hf` (a DP knob must be in ``overrides``).

        Raises:
            TypeError: ``trl_args`` is not a ``trl.DPOConfig``.
            PrivacyBudgetError: no ``privacy_noise_multiplier`` / ``privacy_target_epsilon`` in ``overrides``.
            ValueError: a field set to a value without a private counterpart (with the reason).
            ConfigurationError: a ``loss_type`` outside :data:`DPO_LOSS_TYPES`.
        """
        import trl

        return _from_trl(cls, trl_args, trl.DPOConfig, DPO_TABLES, strict=strict, overrides=overrides)


# -- from_trl ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tables:
    """How each TRL-only field converts: copied, renamed, refused when set (with the reason), or dropped."""

    direct: tuple[str, ...]
    rename: dict[str, str]
    refuse: dict[str, str]
    drop: tuple[str, ...]


_PACK = "one row must be one example; packing mixes examples, so one example's gradient could not be clipped alone"
_SHUFFLE = "the DP Poisson sampler owns the order and composition of batches"
_KEEP_END = "only keep-start truncation is implemented; shorten the prompts or raise max_length"
_PAD_TOKEN = "set pad_token on the tokenizer you pass as processing_class; padding never reaches the per-example loss"
_AUX = "the MoE router auxiliary loss is not implemented per example"
_NOT_IMPL = "this variant of the DPO loss is not implemented in the private trainer; use loss_type in "
_NOT_IMPL += str(list(DPO_LOSS_TYPES))
_TRDPO = "TR-DPO reference syncing is not implemented in the private trainer"

SFT_TABLES = _Tables(
    direct=("dataset_text_field", "completion_only_loss", "assistant_only_loss", "eos_token", "loss_type"),
    rename={"chat_template_path": "chat_template"},
    refuse={
        "packing": _PACK,
        "padding_free": _PACK,
        "eval_packing": _PACK,
        "shuffle_dataset": _SHUFFLE,
        "truncation_mode": _KEEP_END,
        "pad_token": _PAD_TOKEN,
        "router_aux_loss_coef": _AUX,
    },
    drop=(
        "model_init_kwargs", "trust_remote_code", "dataset_kwargs", "dataset_num_proc", "packing_strategy",
        "activation_offloading",
    ),
)  # fmt: skip
DPO_TABLES = _Tables(
    direct=("beta", "loss_type", "precompute_ref_log_probs", "precompute_ref_batch_size", "disable_dropout"),
    rename={},
    refuse={
        "padding_free": _PACK,
        "truncation_mode": _KEEP_END,
        "pad_token": _PAD_TOKEN,
        "router_aux_loss_coef": _AUX,
        "loss_weights": _NOT_IMPL,
        "ld_alpha": _NOT_IMPL,
        "f_divergence_type": _NOT_IMPL,
        "label_smoothing": _NOT_IMPL,
        "use_weighting": _NOT_IMPL,
        "sync_ref_model": _TRDPO,
    },
    drop=(
        "model_init_kwargs", "trust_remote_code", "dataset_num_proc", "activation_offloading", "discopop_tau",
        "f_alpha_divergence_coef", "ref_model_mixup_alpha", "ref_model_sync_steps",
    ),
)  # fmt: skip
# Fields that TRL redefines on top of transformers.TrainingArguments, converted here rather than by from_hf.
_SHARED = ("max_length", "pad_to_multiple_of", "bf16", "gradient_checkpointing")


def _from_trl(cls: type, trl_args: Any, trl_cls: type, tables: _Tables, *, strict: bool, overrides: dict) -> Any:
    from opake_torch.transformers._from_hf import _field_values, _is_default, from_hf

    if not isinstance(trl_args, trl_cls):
        raise TypeError(
            f"{cls.__name__}.from_trl expects a trl.{trl_cls.__name__}, got {type(trl_args).__name__}. Use "
            f"TrainingArguments.from_hf for plain Hugging Face arguments, or build {cls.__name__} directly."
        )
    import transformers

    hf_names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    fields = _field_values(trl_args)
    own = {n: fv for n, fv in fields.items() if n not in hf_names}
    known = set(tables.direct) | set(tables.rename) | set(tables.refuse) | set(tables.drop)

    for name, reason in tables.refuse.items():
        if name in own and not _is_default(*own[name]):
            raise ValueError(f"{name}={p.plain(own[name][0])!r} cannot be converted: {reason}.")

    out: dict[str, Any] = {}
    for name in tables.direct:
        if name in own:
            out[name] = p.plain(own[name][0])
    for old, new in tables.rename.items():
        if old in own and own[old][0] is not None:
            out[new] = p.plain(own[old][0])
    max_length = fields.get("max_length", (1024, None))[0]
    out["max_length"] = max_length
    multiple = p.plain(fields.get("pad_to_multiple_of", (None, None))[0])
    out["pad_to_multiple_of"] = None if multiple == "auto" else multiple
    out["bf16"] = bool(getattr(trl_args, "bf16", False))  # TRL's None means "auto", resolved by its __post_init__
    out["gradient_checkpointing"] = bool(getattr(trl_args, "gradient_checkpointing", False))
    if isinstance(out.get("loss_type"), list) and len(out["loss_type"]) == 1:
        out["loss_type"] = out["loss_type"][0]

    handled = known | set(own) | set(_SHARED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        converted = from_hf(cls, trl_args, strict=strict, **{**out, **overrides})
    for record in caught:  # from_hf does not know the TRL fields; report the HF ones it dropped
        text = str(record.message)
        name = text.removeprefix("from_hf drops ").split("=", 1)[0]
        if name not in handled:
            warnings.warn(text.replace("from_hf", "from_trl", 1), record.category, stacklevel=3)
    if strict:
        for name in tables.drop:
            if name in own and not _is_default(*own[name]):
                warnings.warn(
                    f"from_trl drops {name}={p.plain(own[name][0])!r}: irrelevant to the private trainer.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        for name in sorted(set(own) - known - set(_SHARED)):
            if not _is_default(*own[name]):
                warnings.warn(
                    f"from_trl drops {name}={p.plain(own[name][0])!r}: not translated by this version of Opake.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return converted


# ``TrainingArguments.__new__`` takes ``**kwargs``; keep help() and IDEs showing the real fields.
for _cls in (SFTConfig, DPOConfig):
    _cls.__signature__ = inspect.signature(_cls.__init__).replace(
        parameters=list(inspect.signature(_cls.__init__).parameters.values())[1:]
    )
