"""``SFTConfig`` and ``DPOConfig``: :class:`TrainingArguments` plus every field name of ``trl.SFTConfig`` /
``trl.DPOConfig``.

The privacy unit is one training example: one text, one conversation, one (prompt, completion) pair, one
(prompt, chosen, rejected) preference triple. Every field here is validated so that a row of the dataset stays one
example: packing and padding-free batching (which put several examples into one row) are refused, and losses that
couple the examples of a batch (TRL's ``aot`` sorts log-ratios across the batch) are refused too.

Every name that TRL adds to ``transformers.TrainingArguments`` is in one of the tables :data:`SFT_NAMES` /
:data:`DPO_NAMES`, and a test checks them against the installed ``trl``, so that a new upstream field fails a test
rather than a user. Each name is:

- ``field``: a field of the Opake class with TRL's meaning (``beta``, ``loss_type``, ``dataset_text_field`` ...);
- ``alias``: another name for one of the fields (``chat_template_path`` is ``chat_template``);
- ``inert``: accepted, with no effect on a private run; a value other than TRL's default warns (``RuntimeWarning``);
- ``refused``: a value other than TRL's default (or the listed accepted values) raises ``ConfigurationError`` with
  why, under DP, and what to use instead.

The Hugging Face names (``transformers.TrainingArguments``) are the base class's business. A name that neither knows
raises ``ConfigurationError`` with a "did you mean" hint.

Both work with ``transformers.HfArgumentParser`` (and TRL's ``TrlParser``) as :class:`TrainingArguments` does: the TRL
names are options too, translated like keyword arguments (:mod:`opake_torch.transformers._command_line`).

Constructing either class never imports ``trl``. :meth:`SFTConfig.from_trl` / :meth:`DPOConfig.from_trl` import it
lazily, reuse :func:`opake_torch.transformers._from_hf.from_hf` for the Hugging Face fields and apply the same tables
to the TRL fields (inert ones are dropped with a ``RuntimeWarning``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import warnings
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

from opake_core.errors import ConfigurationError
from opake_torch.limits import MAX_COUNT, MAX_SCALE
from opake_torch.transformers import _command_line as cli
from opake_torch.transformers import _field_help
from opake_torch.transformers import _from_hf as hf
from opake_torch.transformers import _parsing as p
from opake_torch.transformers.arguments import TrainingArguments
from opake_torch.transformers.trl.dpo_losses import PairOptions

__all__ = [
    "DPO_LOSS_TYPES",
    "DPO_NAMES",
    "DPO_REFUSED_LOSSES",
    "SFT_LOSS_TYPES",
    "SFT_NAMES",
    "DPOConfig",
    "SFTConfig",
    "TRLName",
]

SFT_LOSS_TYPES = ("nll", "dft", "chunked_nll")
# TRL's per-pair DPO losses (trl/trainer/dpo_trainer.py, TRL 1.16): each is a function of one pair's four
# log-probabilities (and, for ipo / sigmoid_norm, its completion lengths); see opake_torch.transformers.trl.dpo. Then
# the reference-free ones of TRL's CPO / ORPO trainers and the chosen completion's NLL, from the pair's own tokens
# (opake_torch.transformers.trl.dpo_losses).
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sigmoid_norm", "simpo", "cpo", "orpo", "chosen_nll",
)  # fmt: skip
_COUPLED = "so one example's loss depends on the other examples of the batch and its gradient cannot be clipped alone"
# TRL's DPO losses that are not per-pair, and why.
DPO_REFUSED_LOSSES = {
    "aot": f"sorts log-ratios across the batch, {_COUPLED}",
    "aot_unpaired": f"sorts log-ratios across the batch, {_COUPLED}",
    "sft": (
        "is TRL's mean over the chosen tokens of the whole batch (a token-level normalization across examples), "
        f"{_COUPLED}; use loss_type='chosen_nll', the mean over each pair's own chosen tokens"
    ),
}
# DPO losses that read label_smoothing (TRL ignores it for the others).
_SMOOTHED = ("robust", "exo_pair", "simpo", "cpo")

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


def _model_init_kwargs(value: Any) -> dict[str, Any] | None:
    """TRL's ``model_init_kwargs``: None, or the keyword arguments of ``from_pretrained`` (a dict or a JSON object)."""
    return None if value is None else p.as_dict(value, "model_init_kwargs")


# -- the TRL names -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TRLName:
    """What the Opake config does with one TRL field name (module docstring).

    ``default``: TRL's default, accepted silently by ``inert`` and ``refused`` names; ``accepted``: other values a
    ``refused`` name accepts; ``why`` / ``instead``: the reason (inert: why it has no effect; refused: why under DP)
    and what to do instead.
    """

    kind: str
    default: Any = None
    target: str | None = None
    why: str = ""
    instead: str = ""
    accepted: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        return _same(value, self.default) or any(_same(value, other) for other in self.accepted)

    def refusal(self, name: str, value: Any, verb: str) -> str:
        return f"{name}={p.plain(value)!r} {verb}: {self.why}. Instead, {self.instead}."


def _field() -> TRLName:
    return TRLName("field")


def _alias(target: str) -> TRLName:
    return TRLName("alias", target=target)


def _inert(default: Any, why: str) -> TRLName:
    return TRLName("inert", default=default, why=why)


def _refused(default: Any, why: str, instead: str, accepted: tuple[Any, ...] = ()) -> TRLName:
    return TRLName("refused", default=default, why=why, instead=instead, accepted=accepted)


def _same(value: Any, default: Any) -> bool:
    value, default = p.plain(value), p.plain(default)
    if value == default:
        return True
    empty = (None, "", False, [], {}, ())
    return value in empty and default in empty


_PER_ROW = "rows are formatted once, in this process, when the trainer is built; pre-tokenized rows are used as given"
_PACK = (
    "one row must be one example: packing puts several examples into one row, so one example's gradient could no "
    "longer be clipped on its own and the privacy unit would be lost"
)
_PAD_FREE = (
    "one row must be one example: padding-free batching flattens several examples into one row, so one example's "
    "gradient could no longer be clipped on its own and the privacy unit would be lost"
)
_BOUND_PADDING = "(pad_to_multiple_of bounds padding waste)"
_SHUFFLE = (
    "the DP sampler owns the order and composition of batches (Poisson sampling draws every example independently); "
    "a shuffle the accountant does not see would not be part of the guarantee"
)
_KEEP_END = "only keep-start truncation is implemented (TRL deprecates keep_end)"
_PAD_TOKEN = "TRL deprecates it (1.1), and the private trainers never mutate the tokenizer from the config"
_AUX = (
    "the MoE load-balancing loss is computed over all the tokens routed in a batch, so one example's loss would "
    "depend on the others and its gradient could not be clipped alone"
)

SFT_NAMES: dict[str, TRLName] = {
    "model_init_kwargs": _field(),
    "trust_remote_code": _field(),
    "router_aux_loss_coef": _refused(None, _AUX, "leave router_aux_loss_coef=None (no auxiliary loss is added)"),
    "chat_template_path": _alias("chat_template"),
    "dataset_text_field": _field(),
    "dataset_kwargs": _inert(None, _PER_ROW),
    "dataset_num_proc": _inert(None, _PER_ROW),
    "eos_token": _field(),
    "max_length": _field(),
    "truncation_mode": _refused("keep_start", _KEEP_END, "shorten the prompts or raise max_length"),
    "shuffle_dataset": _refused(False, _SHUFFLE, "leave shuffle_dataset=False"),
    "packing": _refused(False, _PACK, f"set packing=False {_BOUND_PADDING}"),
    "packing_strategy": _inert("bfd", "it only serves packing, which is refused (one row must be one example)"),
    "padding_free": _refused(False, _PAD_FREE, f"set padding_free=False {_BOUND_PADDING}"),
    "pad_to_multiple_of": _field(),  # TRL's "auto" is None off Neuron
    "eval_packing": _refused(None, _PACK, "leave eval_packing unset (or False)", accepted=(False,)),
    "completion_only_loss": _field(),
    "assistant_only_loss": _field(),
    "loss_type": _field(),
    "activation_offloading": _field(),
    "pad_token": _refused(None, _PAD_TOKEN, "set pad_token on the tokenizer you pass as processing_class"),
}
DPO_NAMES: dict[str, TRLName] = {
    "model_init_kwargs": _field(),
    "trust_remote_code": _field(),
    "router_aux_loss_coef": _refused(None, _AUX, "leave router_aux_loss_coef=None (no auxiliary loss is added)"),
    "disable_dropout": _field(),
    "dataset_num_proc": _inert(None, _PER_ROW),
    "max_length": _field(),
    "truncation_mode": _refused("keep_start", _KEEP_END, "shorten the prompts or raise max_length"),
    "padding_free": _refused(False, _PAD_FREE, f"set padding_free=False {_BOUND_PADDING}"),
    "pad_to_multiple_of": _field(),
    "precompute_ref_log_probs": _field(),
    "precompute_ref_batch_size": _field(),
    "loss_type": _field(),
    "loss_weights": _field(),
    "ld_alpha": _field(),
    "f_divergence_type": _field(),
    "f_alpha_divergence_coef": _field(),
    "label_smoothing": _field(),
    "beta": _field(),
    "use_weighting": _field(),
    "discopop_tau": _field(),
    "activation_offloading": _field(),
    "sync_ref_model": _field(),
    "ref_model_mixup_alpha": _field(),
    "ref_model_sync_steps": _field(),
    "pad_token": _refused(None, _PAD_TOKEN, "set pad_token on the tokenizer you pass as processing_class"),
}


def _check_known(cls: type, name: str, names: dict[str, TRLName]) -> None:
    """A name that is neither a field, a TRL name nor a Hugging Face name: ``ConfigurationError`` with the closest
    TRL names when there are some (the base class hints at its own names otherwise)."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    if name in fields or name in hf.ALIASES or name in hf.REFUSED or name in hf.INERT:
        return
    close = difflib.get_close_matches(name, [n for n in names if n not in fields], n=3, cutoff=0.6)
    if close:
        raise ConfigurationError(
            f"{cls.__name__} got an unknown argument {name!r}. Did you mean {' or '.join(map(repr, close))} (a "
            f"trl.{cls.__name__} name)? Every accepted TRL name is listed in docs/sft-dpo.md."
        )


def _translate(cls: type, kwargs: dict[str, Any], names: dict[str, TRLName]) -> dict[str, Any]:
    """``kwargs`` with the TRL names resolved: aliases renamed, inert names dropped (warning when set), refused
    names checked and dropped, TRL's ``"auto"`` / ``None`` spellings of shared fields made concrete."""
    out = dict(kwargs)
    fields = {f.name for f in dataclasses.fields(cls)}
    for name, value in kwargs.items():
        rule = names.get(name)
        if rule is None:
            _check_known(cls, name, names)
            continue
        if rule.kind == "field" or (rule.kind == "refused" and rule.allows(value) and name in fields):
            continue  # a field keeps its value, for its own checks (packing="" is no bool)
        del out[name]
        if rule.kind == "alias":
            if rule.target in kwargs and not _same(kwargs[rule.target], value) and value is not None:
                raise ConfigurationError(
                    f"{cls.__name__} got both {name}={value!r} and {rule.target}={kwargs[rule.target]!r}; "
                    f"{name} is TRL's name for {rule.target}: pass one of them."
                )
            if value is not None:
                out[rule.target] = value
        elif rule.kind == "inert":
            if not _same(value, rule.default):
                warnings.warn(
                    f"{cls.__name__}: {name}={p.plain(value)!r} has no effect: {rule.why}.",
                    RuntimeWarning,
                    stacklevel=4,
                )
        elif not rule.allows(value):
            raise ConfigurationError(rule.refusal(name, value, "is refused"))
    if p.plain(out.get("pad_to_multiple_of")) == "auto":
        out["pad_to_multiple_of"] = None  # TRL: pad to a multiple of 128 on Neuron only
    if "bf16" in out and out["bf16"] is None:
        out["bf16"] = False  # TRL's "auto"; a private run chooses its precision explicitly
    return out


def _option(names: dict[str, TRLName], target: str) -> dict[str, Any]:
    """``HfArgumentParser`` metadata of the field ``target``: its TRL names are options too."""
    return cli.option(*(name for name, rule in names.items() if rule.target == target))


def _carrier(names: dict[str, TRLName], *fields: str) -> dict[str, Any]:
    """``HfArgumentParser`` metadata of the option that also takes the TRL names that are no field (``fields``: the
    refused names that are fields of the config; the fields of :class:`TrainingArguments`, such as
    ``router_aux_loss_coef``, have their own option)."""
    taken = {*fields, *(f.name for f in dataclasses.fields(TrainingArguments))}
    return cli.carrier(*(n for n, rule in names.items() if rule.kind in ("inert", "refused") and n not in taken))


def _base_translate(owner: type, cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face names through :class:`TrainingArguments`'s own translation (which also refuses unknown names
    with a hint)."""
    base = getattr(super(owner, cls), "_translate_kwargs", None)
    return base(kwargs) if base is not None else kwargs


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
        chat_template: a Jinja chat template (the text or a file path) set on the tokenizer before formatting;
            TRL's ``chat_template_path`` is accepted as another name for it.
        eos_token: the token appended to non-conversational text; None uses the tokenizer's.
        loss_type: ``"nll"`` (mask-aware mean cross-entropy per example), ``"dft"`` (cross-entropy weighted by the
            detached target probability, arXiv 2508.05629) or ``"chunked_nll"`` (``"nll"`` computed from hidden
            states without the full ``[T, V]`` logits, see :mod:`opake_torch.transformers.trl.chunked_nll`).
        loss_chunk_size: positions per chunk for ``"chunked_nll"``.
        model_init_kwargs: keyword arguments of ``from_pretrained`` (``dtype``, ``revision``,
            ``attn_implementation``, ...) when the trainer's ``model`` is a name or path
            (:mod:`opake_torch.transformers.trl.loading`); None: TRL's defaults (``dtype="float32"``).
        trust_remote_code: run the model's own code from its repository when loading it by name (as in TRL).
        packing, padding_free: accepted for TRL compatibility, refused when True.

    Every other ``trl.SFTConfig`` name is accepted as :data:`SFT_NAMES` says.

    Example: TRL's defaults, on top of the privacy arguments.

        >>> from opake_torch import SFTConfig
        >>> config = SFTConfig("out", privacy_noise_multiplier=1.0, completion_only_loss=True)
        >>> config.max_length, config.loss_type, config.learning_rate, config.privacy.privacy_noise_multiplier
        (1024, 'nll', 2e-05, 1.0)
    """

    _: KW_ONLY
    learning_rate: float = 2e-5
    logging_steps: float = 10
    max_length: int | None = 1024
    dataset_text_field: str = "text"
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    chat_template: str | None = field(default=None, metadata=_option(SFT_NAMES, "chat_template"))
    eos_token: str | None = None
    loss_type: str = "nll"
    loss_chunk_size: int = 256
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    packing: bool = False
    # --padding_free also takes TRL's names that are no field (hidden from --help)
    padding_free: bool = field(default=False, metadata=_carrier(SFT_NAMES, "packing", "padding_free"))

    _trl_names = SFT_NAMES
    _limits: ClassVar[dict[str, p.Limit]] = {
        **TrainingArguments._limits,
        "loss_chunk_size": p.Limit(True, 1, MAX_COUNT, "positions per chunk"),
    }

    @classmethod
    def _translate_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Resolve the TRL names of ``kwargs`` (:data:`SFT_NAMES`), then the Hugging Face ones (the base class)."""
        return _base_translate(SFTConfig, cls, _translate(cls, kwargs, SFT_NAMES))

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_packing("packing", self.packing)
        _refuse_packing("padding_free", self.padding_free)
        self.loss_type = p.as_choice(self.loss_type, "loss_type", SFT_LOSS_TYPES)
        if not isinstance(self.dataset_text_field, str) or not self.dataset_text_field:
            raise ConfigurationError(
                f"dataset_text_field must be a column name, got {self.dataset_text_field!r}; e.g. 'text'."
            )
        if self.label_smoothing_factor and self.loss_type != "nll":
            raise ConfigurationError(
                f"label_smoothing_factor={self.label_smoothing_factor!r} is supported with loss_type='nll' only "
                f"(got {self.loss_type!r}); set label_smoothing_factor=0.0 or loss_type='nll'."
            )
        self.chat_template = _resolve_chat_template(self.chat_template)
        self.model_init_kwargs = _model_init_kwargs(self.model_init_kwargs)

    @classmethod
    def from_trl(cls, trl_args: Any, *, strict: bool = True, **overrides: Any) -> SFTConfig:
        """Convert a ``trl.SFTConfig`` like :meth:`TrainingArguments.from_hf` (a DP knob must be in ``overrides``).

        Raises:
            TypeError: ``trl_args`` is not a ``trl.SFTConfig``.
            PrivacyBudgetError: no ``privacy_noise_multiplier`` / ``privacy_target_epsilon`` in ``overrides``.
            ConfigurationError: a field whose TRL meaning breaks the one-row-one-example unit (packing...), with the
                reason (a ``ValueError``).
        """
        import trl

        return _from_trl(cls, trl_args, trl.SFTConfig, SFT_NAMES, strict=strict, overrides=overrides)


def _dpo_loss_type(value: Any) -> str | tuple[str, ...]:
    """One per-pair loss name, or a tuple of several (TRL's MPO; a list, or names separated by commas)."""
    loss = p.plain(value)
    if isinstance(loss, str) and "," in loss:
        loss = [name.strip() for name in loss.split(",")]
    names = [p.plain(name) for name in loss] if isinstance(loss, list | tuple) else [loss]
    for name in names:
        if name in DPO_REFUSED_LOSSES:
            raise ConfigurationError(
                f"loss_type={name!r} {DPO_REFUSED_LOSSES[name]}. Use one of the per-pair losses {list(DPO_LOSS_TYPES)}."
            )
        if name not in DPO_LOSS_TYPES:
            close = difflib.get_close_matches(str(name), DPO_LOSS_TYPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigurationError(f"loss_type must be one of {list(DPO_LOSS_TYPES)}, got {value!r}{hint}.")
    if not names or len(set(names)) != len(names):
        raise ConfigurationError(
            f"loss_type={value!r}: name each loss once (a list combines them, weighted by loss_weights), e.g. "
            "['sigmoid', 'chosen_nll']."
        )
    return names[0] if len(names) == 1 else tuple(names)


@dataclass
class DPOConfig(TrainingArguments):
    """Arguments of private DPO; see ``docs/sft-dpo.md``.

    Args (beyond :class:`TrainingArguments`):
        max_length: tokens kept per prompt + completion sequence (keep-start truncation).
        beta: the DPO temperature (the KL weight; IPO's tau).
        loss_type: one of :data:`DPO_LOSS_TYPES`, TRL's per-pair losses with TRL's formulas (see
            :func:`opake_torch.transformers.trl.dpo.dpo_loss`) and the reference-free ``"simpo"``, ``"cpo"``,
            ``"orpo"``, ``"chosen_nll"`` (:mod:`opake_torch.transformers.trl.dpo_losses`); or several of them (a
            list, or names separated by commas: TRL's MPO), stored as a tuple. The losses of
            :data:`DPO_REFUSED_LOSSES` couple the examples of a batch and are refused.
        loss_weights: one weight (>= 0) per loss of ``loss_type``; None: all 1.
        label_smoothing: the flip probability of ``"robust"`` (in [0, 0.5)), the epsilon of ``"exo_pair"`` (in
            (0, 1)) and the conservative smoothing of ``"simpo"`` / ``"cpo"``; as in TRL, the other losses ignore
            it (a non-zero value warns).
        simpo_gamma, cpo_alpha, orpo_lambda: SimPO's target margin, CPO's NLL weight, ORPO's odds-ratio weight.
        ld_alpha: LD-DPO's weight of the completion tokens past the shorter completion's length, in [0, 1]; None:
            plain sums.
        f_divergence_type, f_alpha_divergence_coef: f-DPO's divergence (``"reverse_kl"`` is DPO) and the alpha of
            ``"alpha_divergence"``.
        use_weighting: WPO's weighting of each pair by its completions' probabilities under the policy.
        discopop_tau: the temperature of ``"discopop"`` (TRL's default 0.05).
        precompute_ref_log_probs: score every example with the reference once, at construction, and store the
            results as the ``ref_chosen_logps`` / ``ref_rejected_logps`` columns; False runs the reference in every
            step.
        precompute_ref_batch_size: batch size of that pass; None uses ``per_device_eval_batch_size``.
        sync_ref_model: TR-DPO (arXiv 2404.09656): every ``ref_model_sync_steps`` steps the reference becomes
            ``ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * reference``, from the released
            weights (post-processing: no privacy cost; :mod:`opake_torch.transformers.trl.reference_sync`). Needs a
            loss that reads the reference, a separate reference (no PEFT policy), and neither
            ``precompute_ref_log_probs`` nor ``fsdp``.
        ref_model_mixup_alpha: the weight of the policy in a sync, in (0, 1] (1: the paper's hard update).
        ref_model_sync_steps: the steps between two syncs (a sync ends steps tau, 2 tau, ...), >= 1.
        disable_dropout: set every dropout probability of the policy and the reference to 0.
        chat_template: a Jinja chat template (the text or a file path) set on the tokenizer before formatting.
        model_init_kwargs, trust_remote_code: as in :class:`SFTConfig`, for a policy given by name or path.
        padding_free: accepted for TRL compatibility, refused when True.

    Every other ``trl.DPOConfig`` name is accepted as :data:`DPO_NAMES` says.

    Example:

        >>> from opake_torch import DPOConfig
        >>> config = DPOConfig("out", privacy_target_epsilon=4.0, beta=0.2)
        >>> config.beta, config.loss_type, config.learning_rate
        (0.2, 'sigmoid', 1e-06)
    """

    _: KW_ONLY
    learning_rate: float = 1e-6
    logging_steps: float = 10
    max_length: int | None = 1024
    beta: float = 0.1
    loss_type: str = "sigmoid"  # a list too (TRL's type), stored as a tuple when several; str for HfArgumentParser
    loss_weights: list[float] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    orpo_lambda: float = 1.0
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    disable_dropout: bool = True
    chat_template: str | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    # --padding_free also takes TRL's names that are no field (hidden from --help)
    padding_free: bool = field(default=False, metadata=_carrier(DPO_NAMES, "padding_free"))

    _trl_names = DPO_NAMES
    _limits: ClassVar[dict[str, p.Limit]] = {
        **TrainingArguments._limits,
        "beta": p.Limit(False, 0, MAX_SCALE, "the DPO temperature; TRL's default is 0.1", open_low=True),
        "discopop_tau": p.Limit(False, 0, MAX_SCALE, "TRL's default is 0.05", open_low=True),
        "label_smoothing": p.Limit(False, 0, 1, "a probability; see loss_type for the range each loss reads"),
        "precompute_ref_batch_size": p.Limit(True, 1, MAX_COUNT, "a batch size"),
        "simpo_gamma": p.Limit(False, 0, MAX_SCALE, "SimPO's target reward margin; its default is 0.5"),
        "cpo_alpha": p.Limit(False, 0, MAX_SCALE, "the weight of CPO's NLL term; its default is 1.0"),
        "orpo_lambda": p.Limit(False, 0, MAX_SCALE, "the weight of ORPO's odds-ratio term; its default is 1.0"),
        "ld_alpha": p.Limit(False, 0, 1, "LD-DPO's weight of the tokens past the shorter completion"),
        "f_alpha_divergence_coef": p.Limit(False, 0, MAX_SCALE, "the alpha of f_divergence_type='alpha_divergence'"),
        "ref_model_mixup_alpha": p.Limit(
            False, 0, 1, "the weight of the policy in a TR-DPO sync; TRL's default is 0.6", open_low=True
        ),
        "ref_model_sync_steps": p.Limit(True, 1, MAX_COUNT, "the steps between two TR-DPO syncs; TRL's is 512"),
    }

    @classmethod
    def _translate_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Resolve the TRL names of ``kwargs`` (:data:`DPO_NAMES`), then the Hugging Face ones (the base class)."""
        return _base_translate(DPOConfig, cls, _translate(cls, kwargs, DPO_NAMES))

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_packing("padding_free", self.padding_free)
        self.loss_type = _dpo_loss_type(self.loss_type)  # types and ranges of the fields: _parsing.check_types
        self.beta = float(self.beta)
        self._resolve_label_smoothing()
        self.discopop_tau = float(self.discopop_tau)
        if self.loss_weights is not None:
            self.loss_weights = [float(w) for w in self.loss_weights]
        PairOptions.from_args(self)  # the combinations: weights per loss, f-DPO's losses, ld_alpha's range
        self._check_sync()
        self.chat_template = _resolve_chat_template(self.chat_template)
        self.model_init_kwargs = _model_init_kwargs(self.model_init_kwargs)

    def _check_sync(self) -> None:
        """TR-DPO's combinations: its two numbers warn when it is off; on, it needs a reference that a loss reads,
        that is scored in every step, and that every rank holds whole."""
        self.ref_model_mixup_alpha = float(self.ref_model_mixup_alpha)
        if not self.sync_ref_model:
            for name, default in (("ref_model_mixup_alpha", 0.6), ("ref_model_sync_steps", 512)):
                if getattr(self, name) != default:
                    warnings.warn(
                        f"DPOConfig: {name}={getattr(self, name)!r} has no effect: it only serves sync_ref_model "
                        "(TR-DPO), which is False.",
                        RuntimeWarning,
                        stacklevel=5,
                    )
            return
        if not PairOptions.from_args(self).needs_reference:
            raise ConfigurationError(
                f"sync_ref_model=True with loss_type={self.loss_type!r}: no loss of it reads the reference model, so "
                "there is nothing to sync. Set sync_ref_model=False, or use a loss with a reference (e.g. 'sigmoid')."
            )
        if self.precompute_ref_log_probs:
            raise ConfigurationError(
                "sync_ref_model=True with precompute_ref_log_probs=True: the precomputed reference log-probabilities "
                "would go stale at the first sync (TRL refuses the pair too). Set precompute_ref_log_probs=False (the "
                "reference then scores every batch) or sync_ref_model=False."
            )
        if self.fsdp:
            raise ConfigurationError(
                f"sync_ref_model=True with fsdp={self.fsdp!r}: the sync mixes whole policy weights into the "
                "reference, while each rank holds only its rows of them. Train with DDP (torchrun without fsdp) or set "
                "sync_ref_model=False."
            )

    def _resolve_label_smoothing(self) -> None:
        smoothing = float(self.label_smoothing)
        loss = self.loss_type
        names = (loss,) if isinstance(loss, str) else loss
        if "robust" in names and not 0 <= smoothing < 0.5:
            raise ConfigurationError(
                f"label_smoothing={smoothing!r} with loss_type='robust' is the probability that a preference label is "
                "flipped and must lie in [0, 0.5) (the loss divides by 1 - 2 * label_smoothing); e.g. 0.1."
            )
        if "exo_pair" in names and not 0 < smoothing < 1:
            raise ConfigurationError(
                f"label_smoothing={smoothing!r} with loss_type='exo_pair' is EXO's epsilon and must lie in (0, 1) "
                "(the loss takes log(epsilon)); the EXO paper recommends 1e-3."
            )
        if not 0 <= smoothing < 1:
            raise ConfigurationError(f"label_smoothing must be in [0, 1), got {smoothing!r}.")
        if smoothing and not set(names) & set(_SMOOTHED):
            warnings.warn(
                f"DPOConfig: label_smoothing={smoothing!r} has no effect with loss_type={loss!r}: as in TRL, only "
                f"{list(_SMOOTHED)} read it.",
                RuntimeWarning,
                stacklevel=5,
            )
        self.label_smoothing = smoothing

    @classmethod
    def from_trl(cls, trl_args: Any, *, strict: bool = True, **overrides: Any) -> DPOConfig:
        """Convert a ``trl.DPOConfig`` like :meth:`TrainingArguments.from_hf` (a DP knob must be in ``overrides``).

        Raises:
            TypeError: ``trl_args`` is not a ``trl.DPOConfig``.
            PrivacyBudgetError: no ``privacy_noise_multiplier`` / ``privacy_target_epsilon`` in ``overrides``.
            ConfigurationError: a field set to a value without a private counterpart (with the reason), or a
                ``loss_type`` outside :data:`DPO_LOSS_TYPES`.
        """
        import trl

        return _from_trl(cls, trl_args, trl.DPOConfig, DPO_NAMES, strict=strict, overrides=overrides)


# -- from_trl ----------------------------------------------------------------------------------------------------------

# Fields that TRL redefines on top of transformers.TrainingArguments, converted here rather than by from_hf.
_SHARED = ("max_length", "pad_to_multiple_of", "bf16", "gradient_checkpointing")


def _from_trl(
    cls: type, trl_args: Any, trl_cls: type, names: dict[str, TRLName], *, strict: bool, overrides: dict
) -> Any:
    if not isinstance(trl_args, trl_cls):
        raise TypeError(
            f"{cls.__name__}.from_trl expects a trl.{trl_cls.__name__}, got {type(trl_args).__name__}. Use "
            f"TrainingArguments.from_hf for plain Hugging Face arguments, or build {cls.__name__} directly."
        )
    import transformers

    hf_names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    fields = hf._field_values(trl_args)
    own = {n: fv for n, fv in fields.items() if n not in hf_names}

    for name, rule in names.items():
        if rule.kind == "refused" and name in own and not rule.allows(own[name][0]):
            raise ConfigurationError(rule.refusal(name, own[name][0], "cannot be converted"))

    out: dict[str, Any] = {}
    for name, rule in names.items():
        if name not in own or name in _SHARED:
            continue
        if rule.kind == "field":
            out[name] = p.plain(own[name][0])
        elif rule.kind == "alias" and own[name][0] is not None:
            out[rule.target] = p.plain(own[name][0])
    out["max_length"] = fields.get("max_length", (1024, None))[0]
    multiple = p.plain(fields.get("pad_to_multiple_of", (None, None))[0])
    out["pad_to_multiple_of"] = None if multiple == "auto" else multiple
    out["bf16"] = bool(getattr(trl_args, "bf16", False))  # TRL's None means "auto", resolved by its __post_init__
    out["gradient_checkpointing"] = bool(getattr(trl_args, "gradient_checkpointing", False))

    handled = set(names) | set(own) | set(_SHARED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        converted = hf.from_hf(cls, trl_args, strict=strict, **{**out, **overrides})
    for record in caught:  # from_hf does not know the TRL fields; report the HF ones it dropped, and the rest
        text = str(record.message)
        if text.startswith("from_hf drops "):
            name = text.removeprefix("from_hf drops ").split("=", 1)[0]
            if name in handled:
                continue
            text = text.replace("from_hf", "from_trl", 1)
        warnings.warn(text, record.category, stacklevel=3)
    if strict:
        for name, rule in names.items():
            if rule.kind == "inert" and name in own and not _same(own[name][0], rule.default):
                warnings.warn(
                    f"from_trl drops {name}={p.plain(own[name][0])!r}: {rule.why}.", RuntimeWarning, stacklevel=3
                )
        for name in sorted(set(own) - set(names) - set(_SHARED)):
            if not _same(*own[name]):
                warnings.warn(
                    f"from_trl drops {name}={p.plain(own[name][0])!r}: not translated by this version of Opake.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return converted


_field_help.attach(SFTConfig, _field_help.SFT_HELP)
_field_help.attach(DPOConfig, _field_help.DPO_HELP)
# Keep help() and IDEs showing the real fields.
for _cls in (SFTConfig, DPOConfig):
    _cls.__signature__ = inspect.signature(_cls.__init__).replace(
        parameters=list(inspect.signature(_cls.__init__).parameters.values())[1:]
    )
