"""``TrainingArguments``: the Hugging Face fields a DP trainer honours, plus the privacy, clipping and sampling fields.

A standalone dataclass, not a subclass of ``transformers.TrainingArguments``: ``transformers`` is imported only by
:meth:`TrainingArguments.from_hf`. Every value is resolved and validated in ``__post_init__``, so a constructed object
holds no ``"auto"`` and no ``None`` that the trainer would have to interpret, except ``privacy_target_delta`` (the
dataset size is a sensitive input, not configuration) and ``privacy_noise_multiplier`` (calibrated by the trainer).
``dataclasses.replace`` re-runs the validation; assigning a field afterwards does not.

Hugging Face and Opacus names are accepted by the constructor, through the tables of
:mod:`opake_torch.transformers._from_hf` (the one list of what each name means here): a field with HF's name and
meaning (``do_train``, ``log_level``, ``tf32``), an alias of one of Opake's fields (``lr_scheduler_type``,
``max_grad_norm``, ``target_epsilon``), a setting with no effect on a private run (accepted; a non-default value
warns once), or a setting refused under DP with the reason and what to use instead (``gradient_accumulation_steps``
above 1, ``fp16``). The translation runs before the dataclass ``__init__`` (:class:`_AcceptsHuggingFaceNames`), so
``dataclasses.fields`` and :meth:`TrainingArguments.to_dict` hold Opake's fields only. An unknown name raises
``ConfigurationError`` with the closest accepted names.

``transformers.HfArgumentParser`` builds its command line from the fields: their annotations are ones it reads
(``warmup_steps: float`` as in Hugging Face), and the metadata of :mod:`opake_torch.transformers._command_line` makes
the Hugging Face names options too, whose values reach ``_translate_kwargs`` under those names.

Decisions on points where the reference designs disagree:

- Adaptive clipping with an ``mf_*`` mechanism raises. Matrix-factorization noise is calibrated to a constant
  per-step sensitivity; silently switching to fixed clipping would run something the user did not ask for.
- Per-group clipping (a ``clipping_norm`` dict) is supported with ``clipping_mode="fixed"`` only. Adaptive clipping
  estimates one private quantile; per-group adaptive would spend budget on one quantile per group and is not
  implemented. AUTO-S normalizes by the whole per-example norm, which has no per-group form.
- ``privacy_noise_mechanism_kwargs["bound"]`` raises "no matching accountant".
- ``clipping_norm`` dict keys are regular expressions matched with ``re.search`` on dotted parameter names, the
  semantics of :func:`opake_core.tree.per_group`; the patterns are compiled here.
- ``dataloader_drop_last`` and ``batch_eval_metrics`` are refused by the constructor: the training batches come from
  the DP sampler, the eval loader keeps every example, and metrics are computed once over the whole eval set.
  ``from_hf`` drops them with a warning.
- ``max_grad_norm`` is ``clipping_norm``: the bound of each example's gradient, not of the batch gradient. ``from_hf``
  maps it without a warning unless ``clipping_norm`` is passed explicitly; ``use_liger_kernel`` maps to
  ``use_performance_kernels``.
- ``privacy_accounting`` is on unless set to ``False``: a fixed-noise run reports its epsilon. A non-private run
  (``privacy_noise_multiplier=0.0``) always reports epsilon = inf.
- ``fp16`` is not a field; a read-only ``fp16 == False`` shim remains for code written against HF.
- ``cuda_graphs`` is a count of retained graph signatures (``0`` disables), not a bool; a bool is refused so that
  ``True`` does not silently mean "one signature".
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import logging
import math
import os
import sys
import typing
import warnings
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Literal

import torch

from opake_core.errors import ConfigurationError, InputTypeError, PrivacyBudgetError
from opake_core.plan import check_combination, is_horizon
from opake_torch import limits
from opake_torch.transformers import _command_line as cli
from opake_torch.transformers import _from_hf as hf
from opake_torch.transformers import _parsing as p

__all__ = ["SECRET_FIELDS", "ParallelMode", "TrainingArguments", "as_training_arguments"]

SECRET_FIELDS = ("hub_token", "privacy_noise_seed")  # hidden from repr and masked by to_dict
DOCS_PAGE = "the 'Training arguments' page of the Opake documentation"
# Hugging Face's log levels (transformers.utils.logging), "passive" keeping the level already set.
LOG_LEVELS = {"detail": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL, "passive": -1}  # fmt: skip
# gradient_checkpointing_kwargs keys the vmap-safe recompute honours (it replaces both of torch's implementations
# and always replays the forward's dropout masks), and those it cannot.
CHECKPOINTING_KWARGS = ("use_reentrant", "preserve_rng_state", "every_n_layers")
_WARNED_INERT: set[str] = set()  # inert names already warned about in this process


class ParallelMode(enum.StrEnum):
    """The values of Hugging Face's ``ParallelMode`` that this trainer can run in."""

    NOT_PARALLEL = "not_parallel"
    DISTRIBUTED = "distributed"


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, bool) and isinstance(default, int) and not isinstance(default, bool):
        return False  # gradient_accumulation_steps=True is not the count 1
    try:
        return hf._is_default(value, default)
    except Exception:  # an exotic value (an array, a tensor) is not a default
        return False


def _unknown_name(cls: type, name: str) -> ConfigurationError:
    candidates = [f.name for f in dataclasses.fields(cls) if f.init] + list(hf.ALIASES)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    close += [c for c in candidates if c.endswith(f"_{name}") and c not in close]  # epsilon -> privacy_target_epsilon
    named = [f"{c!r} (= {hf.ALIASES[c]!r})" if c in hf.ALIASES else repr(c) for c in close[:3]]
    hint = f" Did you mean {' or '.join(named)}?" if named else ""
    return ConfigurationError(
        f"{cls.__name__} got an unknown argument {name!r}.{hint} Every accepted name, Hugging Face's and Opacus' "
        f"included, is listed on {DOCS_PAGE}."
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an array or a tensor compared elementwise
        return a is b


def _alias_value(name: str, value: Any) -> Any:
    if name == "max_grad_norm" and (value is None or (isinstance(value, int | float) and not value > 0)):
        raise ConfigurationError(
            f"max_grad_norm={value!r} means 'no clipping' in transformers, but DP needs a bound: max_grad_norm is "
            "Opake's clipping_norm, the bound of each example's gradient (not of the batch gradient). Pass a positive "
            "clipping_norm (math.inf only with privacy_noise_multiplier=0.0)."
        )
    return value


def _as_bool(value: Any, name: str, *, allow_none: bool = False) -> bool | None:
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    raise ConfigurationError(
        f"{name} must be True or False{' or None' if allow_none else ''}, got {type(value).__name__} {value!r}. A "
        "string or a number is not read as a bool (the string 'False' is true in Python): pass True or False."
    )


@functools.cache
def _typed_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """``(name, kind, optional)`` of every field of ``cls`` annotated ``bool``, ``int`` or ``float`` (``kind``), alone
    or with None (``optional``): the fields that :meth:`TrainingArguments._check_types` checks, found from the
    annotations so that a new field is checked without being listed."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        optional = type(None) in kinds
        kinds.discard(type(None))
        if len(kinds) == 1 and (kind := kinds.pop()) in (bool, int, float):
            out.append((f.name, kind, optional))
    return tuple(out)


def _tf32_available() -> bool:
    """As ``transformers.utils.is_torch_tf32_available``: a CUDA build and a GPU of compute capability 8 or more."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


def _set_tf32(enabled: bool) -> None:
    # torch's per-backend switches, which the rest of Opake (benchmarks, tests) uses too
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


class _AcceptsHuggingFaceNames(type):
    """Metaclass of :class:`TrainingArguments`: ``cls(**kwargs)`` translates the keyword names with
    ``cls._translate_kwargs`` before the dataclass ``__init__`` runs (subclasses inherit it, and may extend the hook
    for names of their own). The values ``HfArgumentParser`` collected under other names
    (:mod:`~opake_torch.transformers._command_line`) are translated as those keyword arguments."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **cls._translate_kwargs(cli.as_keywords(kwargs)))


def _option(name: str, *, loose: bool = False) -> dict[str, Any]:
    """``HfArgumentParser`` metadata of the field ``name``: its Hugging Face names (``hf.ALIASES``) are options too."""
    return cli.option(*(alias for alias, target in hf.ALIASES.items() if target == name), loose=loose)


@dataclass
class TrainingArguments(metaclass=_AcceptsHuggingFaceNames):
    """Arguments of a DP training run.

    Every field, default and rule, and what each Hugging Face or Opacus argument name means here, is on the
    'Training arguments' page of the Opake documentation.
    """

    output_dir: str | None = None
    _: KW_ONLY
    overwrite_output_dir: bool = False
    # batches
    per_device_train_batch_size: int = field(default=8, metadata=_option("per_device_train_batch_size"))
    per_device_eval_batch_size: int | None = field(default=None, metadata=_option("per_device_eval_batch_size"))
    microbatch_size: int | None = None
    auto_find_microbatch_size: bool = field(default=False, metadata=_option("auto_find_microbatch_size"))
    per_example_gradients: str = "auto"
    # optimizer and schedule
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw"
    optim_args: dict[str, Any] | str | None = None
    lr_scheduler: str = field(default="linear", metadata=_option("lr_scheduler"))
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: float = 0  # a count (an int), or a fraction of the run (a float in (0, 1)): HF's annotation
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # clipping
    clipping_norm: float | dict[str, float] | str = field(default=1.0, metadata=_option("clipping_norm", loose=True))
    clipping_mode: str = "fixed"
    clipping_kwargs: dict[str, Any] | str | None = None
    # privacy
    privacy_target_epsilon: float | None = None
    privacy_target_delta: float | None = None
    privacy_noise_multiplier: float | None = None
    privacy_accounting: bool | None = True
    privacy_allow_large_delta: bool = False
    privacy_noise_seed: int | None = field(default=None, repr=False)
    privacy_noise_generator: str = "philox"
    privacy_noise_mechanism: str = "gaussian"
    privacy_noise_mechanism_kwargs: dict[str, Any] | str | None = None
    noise_calibration_kwargs: dict[str, Any] | str | None = None
    sampling_mode: str = "auto"
    sampling_kwargs: dict[str, Any] | str | None = None
    # mixture of experts: the private router load-balancing release
    router_aux_loss_coef: float | None = None
    router_aux_kwargs: dict[str, Any] | str | None = None
    # precision, compile, kernels
    bf16: bool = False
    bf16_full_eval: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool = field(default=False, metadata=_option("gradient_checkpointing"))
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_option("gradient_checkpointing_kwargs")
    )
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    cuda_graphs: int = 0
    use_compat_patches: bool = True
    use_performance_kernels: bool = field(default=False, metadata=_option("use_performance_kernels"))
    performance_kernels_config: dict[str, Any] | str | None = None
    use_cpu: bool = False
    # reproducibility
    seed: int = 42
    data_seed: int | None = None
    # logging
    logging_dir: str | None = None
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    logging_steps: float = 500  # a count or a fraction, as warmup_steps
    disable_tqdm: bool | None = None
    report_to: None | str | list[str] = None  # noqa: RUF036 (HF's order: HfArgumentParser reads str)
    run_name: str | None = None
    include_num_input_tokens_seen: str | bool = field(
        default="no", metadata=_option("include_num_input_tokens_seen", loose=True)
    )
    include_tokens_per_second: bool = False
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None | Literal[False] = field(  # noqa: RUF036 (HF's annotation and order)
        default=None, metadata=_option("trackio_static_space_id", loose=True)
    )
    # saving
    save_strategy: str = "steps"
    save_steps: float = 500  # a count or a fraction, as warmup_steps
    save_total_limit: int | None = None
    save_safetensors: bool = True
    save_on_each_node: bool = False
    save_only_model: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    restore_callback_states_from_checkpoint: bool = False
    resume_from_checkpoint: str | None = None
    ignore_data_skip: bool = False
    # evaluation
    eval_strategy: str = field(default="no", metadata=_option("eval_strategy"))
    eval_steps: float | None = None  # a count or a fraction, as warmup_steps
    eval_on_start: bool = False
    eval_delay: float = 0
    prediction_loss_only: bool = False
    include_for_metrics: list[str] = field(default_factory=list)
    # data
    label_names: list[str] | None = None
    label_smoothing_factor: float = 0.0
    remove_unused_columns: bool = True
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    # distributed
    # --local_rank also takes Hugging Face's names that are no field (hidden from --help)
    local_rank: int = field(default=-1, metadata=cli.carrier(*hf.REFUSED, *hf.INERT))
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    average_tokens_across_devices: bool = True
    # hub
    push_to_hub: bool = False
    hub_model_id: str | None = field(default=None, metadata=_option("hub_model_id"))
    hub_token: str | None = field(default=None, repr=False, metadata=_option("hub_token"))
    hub_private_repo: bool | None = None
    # script flags: not read by the trainer, read by training scripts (as in Hugging Face)
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False

    _limits: ClassVar[dict[str, p.Limit]] = p.NUMERIC_LIMITS  # the range of each numeric field

    @classmethod
    def _translate_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with Opake's names: fields kept, aliases renamed, inert names dropped (a non-default value warns
        once), refused names raised (unless at Hugging Face's default), unknown names raised with a hint."""
        own = {f.name for f in dataclasses.fields(cls) if f.init}
        out: dict[str, Any] = {}
        given: dict[str, str] = {}  # Opake field -> the name it was given under
        for name, value in kwargs.items():
            if name in own:
                target = name
            elif name in hf.ALIASES:
                target, value = hf.ALIASES[name], _alias_value(name, value)
            elif name in hf.REFUSED:
                if not _is_default(value, hf.REFUSED[name][0]):
                    raise ConfigurationError(
                        f"{cls.__name__} does not support {name}={p.plain(value)!r}: {hf.refusal(name)}"
                    )
                continue
            elif name in hf.INERT:
                if not _is_default(value, hf.INERT[name][0]) and name not in _WARNED_INERT:
                    _WARNED_INERT.add(name)
                    warnings.warn(
                        f"{cls.__name__} ignores {name}={p.plain(value)!r}: {hf.INERT[name][1]}.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                continue
            else:
                raise _unknown_name(cls, name)
            if target in out and not _same(out[target], value):
                raise ConfigurationError(
                    f"{given[target]!r} and {name!r} both set {cls.__name__}.{target}; pass only one of them."
                )
            out[target], given[target] = value, name
        return out

    def __post_init__(self) -> None:
        self._check_types()
        self._resolve_output()
        self._resolve_batches()
        self._resolve_optimizer()
        self._resolve_mechanism()
        self._resolve_privacy()
        self._resolve_clipping()
        self._resolve_router()
        self._resolve_compile()
        self._resolve_logging_eval_save()
        self._resolve_distributed()
        self._resolve_tf32()
        self._resolve_script_flags()

    # -- resolution, one concern each ------------------------------------------------------------------------------

    def _check_types(self) -> None:
        """Before any other rule: every field annotated ``bool`` holds a bool (or None where annotated so), and
        every numeric field a finite number of its type within its :data:`~._parsing.NUMERIC_LIMITS` entry, so that
        no value reaches a step to overflow there or be read as truthy."""
        if self.gradient_checkpointing is None:  # Hugging Face's default in older versions, meaning off
            self.gradient_checkpointing = False
        for name, kind, optional in _typed_fields(type(self)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if kind is bool:
                _as_bool(value, name, allow_none=optional)
            elif name in self._limits:
                p.check_limit(value, name, self._limits[name])

    def _resolve_output(self) -> None:
        self.output_dir = p.as_path("trainer_output" if self.output_dir is None else self.output_dir, "output_dir")
        if self.logging_dir is None:
            self.logging_dir = os.path.join(self.output_dir, "runs")
        self.logging_dir = p.as_path(self.logging_dir, "logging_dir")
        if self.resume_from_checkpoint is not None:
            self.resume_from_checkpoint = p.as_path(self.resume_from_checkpoint, "resume_from_checkpoint")

    def _resolve_batches(self) -> None:  # types and ranges: _check_types
        if self.microbatch_size is not None:
            if self.microbatch_size > self.per_device_train_batch_size:
                raise ConfigurationError(
                    f"microbatch_size must be in [1, per_device_train_batch_size={self.per_device_train_batch_size}], "
                    f"got {self.microbatch_size}. It is the physical vmap chunk; raise per_device_train_batch_size "
                    "to grow the logical batch."
                )
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.microbatch_size or self.per_device_train_batch_size
        if self.use_cpu:
            self.dataloader_pin_memory = False
        if self.data_seed is None:
            self.data_seed = self.seed
        if self.max_steps == 0:
            raise ConfigurationError("max_steps must be a positive int, or -1 to use num_train_epochs; got 0.")
        names = self.label_names
        if names is not None and (not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names)):
            raise ConfigurationError(
                f"label_names must be a list of column names (strings), or None for the model's own label columns; "
                f"got {names!r}. Example: label_names=['labels']."
            )
        self.label_names = None if names is None else list(names)
        self.include_for_metrics = (
            [self.include_for_metrics]
            if isinstance(self.include_for_metrics, str)
            else list(self.include_for_metrics or [])
        )
        if not set(self.include_for_metrics) <= {"inputs", "loss"}:
            raise ConfigurationError(
                f"include_for_metrics must be a subset of ['inputs', 'loss'], got {self.include_for_metrics!r}."
            )

    def _resolve_optimizer(self) -> None:
        name = p.plain(self.optim)
        name = p.OPTIMIZER_ALIASES.get(name, name) if isinstance(name, str) else name
        if isinstance(name, str) and any(marker in name for marker in p._REFUSED_OPTIM_MARKERS):
            raise ConfigurationError(
                f"optim={self.optim!r} (8-bit, paged, Apex-fused or GaLore optimizers) has no functional torchopt "
                f"equivalent under DP. Use one of {list(p.OPTIMIZERS)}, e.g. optim='adamw'."
            )
        self.optim = p.as_choice(name, "optim", p.OPTIMIZERS)
        self.optim_args = p.as_dict(self.optim_args, "optim_args")
        name = p.plain(self.lr_scheduler)
        name = p.SCHEDULER_ALIASES.get(name, name) if isinstance(name, str) else name
        self.lr_scheduler = p.as_choice(name, "lr_scheduler", p.SCHEDULERS)
        self.lr_scheduler_kwargs = p.as_dict(self.lr_scheduler_kwargs, "lr_scheduler_kwargs")
        p.check_keys(
            self.lr_scheduler_kwargs,
            p.SCHEDULER_KWARGS[self.lr_scheduler],
            "lr_scheduler_kwargs",
            f"lr_scheduler={self.lr_scheduler!r}",
        )
        self.warmup_steps = p.as_steps(self.warmup_steps, "warmup_steps", allow_zero=True)
        self._check_weight_decay()

    def _check_weight_decay(self) -> None:
        """Every optimizer but adam (which has no weight decay) multiplies the weights by ``1 - lr * weight_decay`` in
        a step (decoupled decay, or the L2 term of SGD): above 1 that flips their sign, from 2 it grows them until
        they overflow."""
        end = self.lr_scheduler_kwargs.get("end_value")
        if end is not None:
            why = "the learning rate the schedule ends at"
            limits.check_number(end, "lr_scheduler_kwargs['end_value']", 0, limits.MAX_SCALE, why=why)
        if self.optim.removesuffix("-bc") == "adam":  # no weight decay (the optimizer page of the docs)
            return
        decay = self.weight_decay
        if "weight_decay" in self.optim_args:  # optim_args overrides the field
            decay = limits.check_number(
                self.optim_args["weight_decay"], "optim_args['weight_decay']", 0, limits.MAX_SCALE
            )
        peak = max(self.learning_rate, end or 0.0)
        if peak * decay > 1:
            raise ConfigurationError(
                f"learning_rate * weight_decay must be <= 1, got {peak!r} * {decay!r}: each step multiplies the "
                f"weights by 1 - learning_rate * weight_decay, so a larger product flips their sign and from 2 grows "
                "them until they overflow. Typical decoupled weight decay is 0.01 to 0.1."
            )

    def _resolve_mechanism(self) -> None:
        self.privacy_noise_mechanism = p.as_choice(
            self.privacy_noise_mechanism, "privacy_noise_mechanism", tuple(p.MECHANISM_DEFAULTS)
        )
        self.privacy_noise_mechanism_kwargs = p.mechanism_kwargs(
            self.privacy_noise_mechanism, self.privacy_noise_mechanism_kwargs
        )
        self.sampling_mode, self.sampling_kwargs = p.sampling(
            self.privacy_noise_mechanism, self.sampling_mode, self.sampling_kwargs
        )

    @property
    def is_complete_horizon(self) -> bool:
        """True when the mechanism or sampler is accounted once over the declared horizon (mf_*, k_out_of_t)."""
        return is_horizon(self.privacy_noise_mechanism, self.sampling_mode)

    def _resolve_privacy(self) -> None:
        nm, eps, delta = self.privacy_noise_multiplier, self.privacy_target_epsilon, self.privacy_target_delta
        if nm is None and eps is None:
            raise PrivacyBudgetError(
                "Set either privacy_noise_multiplier (use 0.0 for non-private training) or privacy_target_epsilon "
                "(to calibrate noise to a budget); neither was provided."
            )
        if nm is not None:  # bounds before float(): a huge int does not convert
            if not 0 <= p.as_number(nm, "privacy_noise_multiplier") < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_noise_multiplier must be finite and >= 0 (0.0 = non-private), got {nm!r}."
                )
            if nm != 0:
                limits.check_number(
                    nm, "privacy_noise_multiplier", limits.MIN_NOISE_MULTIPLIER, limits.MAX_NOISE_MULTIPLIER,
                    why="or 0.0 for a non-private run; see opake_torch.limits", error=PrivacyBudgetError,
                )  # fmt: skip
            nm = self.privacy_noise_multiplier = float(nm)
        if eps is not None:
            if not 0 < p.as_number(eps, "privacy_target_epsilon") < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_target_epsilon must be finite and > 0, got {eps!r}. For a non-private run set "
                    "privacy_noise_multiplier=0.0 and leave privacy_target_epsilon unset."
                )
            limits.check_number(
                eps, "privacy_target_epsilon", 0, limits.MAX_SCALE, open_low=True,
                why="an epsilon anywhere near it protects nothing", error=PrivacyBudgetError,
            )  # fmt: skip
            eps = self.privacy_target_epsilon = float(eps)
        if delta is not None:
            if not 0 < p.as_number(delta, "privacy_target_delta") < 1:
                raise PrivacyBudgetError(
                    f"privacy_target_delta must be in (0, 1), got {delta!r}; leave it None for 1 / N**1.1."
                )
            delta = self.privacy_target_delta = float(delta)
        accounting = self.privacy_accounting  # a bool or None: _check_types
        if accounting is False and eps is not None:
            raise ConfigurationError(
                "privacy_accounting=False cannot be combined with privacy_target_epsilon: the target needs the "
                "accountant. Remove privacy_accounting=False."
            )
        if accounting is False and self.is_complete_horizon:
            raise ConfigurationError(
                f"privacy_accounting=False is not allowed with privacy_noise_mechanism={self.privacy_noise_mechanism!r}"
                f" / sampling_mode={self.sampling_mode!r}: the horizon snapshot lets a resumed run detect a changed "
                "strategy or multiplier, so it is always recorded. Remove privacy_accounting=False."
            )
        if accounting is None:  # the default: every run reports its epsilon unless asked not to
            self.privacy_accounting = True
        self.noise_calibration_kwargs = p.calibration(self.noise_calibration_kwargs)
        seed = self.privacy_noise_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigurationError(  # the type only: the value is a secret
                f"privacy_noise_seed must be an int (or None for a secret key from the operating system), got "
                f"{type(seed).__name__}."
            )
        self.privacy_noise_generator = p.as_choice(
            self.privacy_noise_generator, "privacy_noise_generator", ("philox", "chacha20")
        )

    def _resolve_clipping(self) -> None:
        self.clipping_norm = p.parse_clipping_norm(self.clipping_norm)
        mode = self.clipping_mode = p.as_choice(self.clipping_mode, "clipping_mode", tuple(p.CLIPPING_KWARGS))
        bounds = self.clipping_norm.values() if isinstance(self.clipping_norm, dict) else (self.clipping_norm,)
        if any(math.isinf(b) for b in bounds) and self.privacy_noise_multiplier != 0.0:
            raise ConfigurationError(
                f"clipping_norm=inf disables clipping and is allowed only with privacy_noise_multiplier=0.0 (got "
                f"{self.privacy_noise_multiplier!r}): infinite sensitivity with noise gives infinite noise."
            )
        if isinstance(self.clipping_norm, dict) and mode != "fixed":
            raise ConfigurationError(
                f"per-group clipping_norm is supported only with clipping_mode='fixed', got {mode!r}. Use a scalar "
                "clipping_norm or fixed clipping."
            )
        self.clipping_kwargs = p.clipping_kwargs(mode, self.clipping_kwargs)
        check_combination(  # the core's rule: sampler, mechanism, clipping and budget have one accountant together
            mechanism=self.privacy_noise_mechanism,
            sampler=self.sampling_mode,
            adaptive_clipping=mode == "adaptive",
            noise_multiplier=self.privacy_noise_multiplier,
            target=self.privacy_target_epsilon,
        )

    def _resolve_router(self) -> None:
        coefficient, self.router_aux_kwargs = p.router_aux(self.router_aux_loss_coef, self.router_aux_kwargs)
        if not coefficient:  # off: None (the default, as TRL's) or 0.0, as given
            self.router_aux_loss_coef = None if p.plain(self.router_aux_loss_coef) is None else 0.0
            return
        self.router_aux_loss_coef = coefficient
        if self.privacy_noise_mechanism != "gaussian":
            raise ConfigurationError(
                f"router_aux_loss_coef={self.router_aux_loss_coef!r} (the private router release) needs "
                f"privacy_noise_mechanism='gaussian', got {self.privacy_noise_mechanism!r}: the router release is a "
                "DP-SGD release, accounted next to independent Gaussian noise only. Use 'gaussian', or set "
                "router_aux_loss_coef=0.0."
            )
        if self.clipping_mode != "fixed" or isinstance(self.clipping_norm, dict):
            what = "a per-group clipping_norm" if isinstance(self.clipping_norm, dict) else repr(self.clipping_mode)
            raise ConfigurationError(
                f"router_aux_loss_coef={self.router_aux_loss_coef!r} (the private router release) needs fixed "
                f"scalar clipping (clipping_mode='fixed', one clipping_norm), got {what}. Use a scalar clipping_norm "
                "with clipping_mode='fixed', or set router_aux_loss_coef=0.0."
            )

    @property
    def router_release(self) -> bool:
        """Whether the run releases the MoE router load statistic (``router_aux_loss_coef > 0``)."""
        return bool(self.router_aux_loss_coef)

    def _resolve_checkpointing(self) -> None:
        if self.gradient_checkpointing_kwargs is None:
            return
        kwargs = p.as_dict(self.gradient_checkpointing_kwargs, "gradient_checkpointing_kwargs")
        p.check_keys(kwargs, CHECKPOINTING_KWARGS, "gradient_checkpointing_kwargs", "the vmap-safe recompute")
        for key in ("use_reentrant", "preserve_rng_state"):
            if key in kwargs:
                _as_bool(kwargs[key], f"gradient_checkpointing_kwargs[{key!r}]")
        if kwargs.get("every_n_layers", 1) != 1:
            raise ConfigurationError(
                f"gradient_checkpointing_kwargs['every_n_layers']={kwargs['every_n_layers']!r} is not supported: the "
                "vmap-safe recompute checkpoints every decoder layer. Remove it (or set 1); lower microbatch_size "
                "to trade speed for memory instead."
            )
        self.gradient_checkpointing_kwargs = kwargs

    def _resolve_compile(self) -> None:
        self._resolve_checkpointing()
        if self.torch_compile_mode is not None:
            self.torch_compile_mode = p.as_choice(self.torch_compile_mode, "torch_compile_mode", p.COMPILE_MODES)
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.cuda_graphs and self.torch_compile:
            raise ConfigurationError("cuda_graphs > 0 and torch_compile are mutually exclusive; pick one.")
        if self.cuda_graphs and self.auto_find_microbatch_size:
            raise ConfigurationError(
                "cuda_graphs > 0 is incompatible with auto_find_microbatch_size: the probe's OOM retries would "
                "capture graphs at every probed size. Set microbatch_size explicitly."
            )
        if self.torch_compile and self.auto_find_microbatch_size:
            raise ConfigurationError(
                "torch_compile is incompatible with auto_find_microbatch_size (recompiles at every probed size, "
                "PyTorch #128711). Set microbatch_size explicitly."
            )
        if self.torch_compile and self.gradient_checkpointing:
            raise ConfigurationError("gradient_checkpointing is incompatible with torch_compile; disable one of them.")
        self.per_example_gradients = p.as_choice(
            self.per_example_gradients, "per_example_gradients", ("auto", "layerwise", "vmap")
        )
        self.performance_kernels_config = (
            None
            if self.performance_kernels_config is None
            else p.as_dict(self.performance_kernels_config, "performance_kernels_config")
        )

    def _resolve_logging_eval_save(self) -> None:
        self.logging_strategy = p.as_choice(self.logging_strategy, "logging_strategy", ("no", "steps", "epoch"))
        self.save_strategy = p.as_choice(self.save_strategy, "save_strategy", ("no", "steps", "epoch", "best"))
        self.eval_strategy = p.as_choice(self.eval_strategy, "eval_strategy", ("no", "steps", "epoch"))
        self.logging_steps = p.as_steps(self.logging_steps, "logging_steps", allow_zero=True)
        if self.logging_strategy == "steps" and self.logging_steps == 0:
            raise ConfigurationError("logging_strategy='steps' requires a non-zero logging_steps.")
        self.save_steps = p.as_steps(self.save_steps, "save_steps")
        if self.eval_steps is None and self.eval_strategy == "steps":
            if self.logging_steps == 0:
                raise ConfigurationError("eval_strategy='steps' requires eval_steps or a non-zero logging_steps.")
            self.eval_steps = self.logging_steps
        if self.eval_steps is not None:
            self.eval_steps = p.as_steps(self.eval_steps, "eval_steps")
        self.report_to = p.report_to(self.report_to)
        self.log_level = p.as_choice(self.log_level, "log_level", tuple(LOG_LEVELS))
        self.log_level_replica = p.as_choice(self.log_level_replica, "log_level_replica", tuple(LOG_LEVELS))
        if not isinstance(self.project, str) or not self.project:
            raise ConfigurationError(f"project must be a non-empty string, got {self.project!r}.")
        for name in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, str) or (name == "trackio_static_space_id" and value is False)):
                raise ConfigurationError(f"{name} must be a string or None, got {value!r}.")
        tokens = self.include_num_input_tokens_seen
        if isinstance(tokens, bool):
            tokens = "all" if tokens else "no"
        self.include_num_input_tokens_seen = p.as_choice(
            tokens, "include_num_input_tokens_seen", ("no", "all", "non_padding")
        )
        self._resolve_best_model()

    def _resolve_best_model(self) -> None:
        metric = self.metric_for_best_model
        if metric is None and self.load_best_model_at_end:
            metric = "loss"
        if metric is None and self.save_strategy == "best":
            raise ConfigurationError("save_strategy='best' requires metric_for_best_model (e.g. 'loss').")
        if metric is not None:
            if not isinstance(metric, str) or not metric:
                raise ConfigurationError(f"metric_for_best_model must be a metric name, got {metric!r}.")
            if metric.startswith("train_"):
                raise ConfigurationError(
                    f"metric_for_best_model={metric!r} selects checkpoints on a training-set metric: which checkpoint "
                    "survives would reveal memorisation of the private data outside the DP guarantee. Use an eval "
                    "metric (e.g. 'loss' -> 'eval_loss')."
                )
            metric = metric if metric.startswith("eval_") else f"eval_{metric}"
            if self.greater_is_better is None:
                self.greater_is_better = not metric.endswith("loss")
        self.metric_for_best_model = metric
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ConfigurationError("save_strategy='best' requires eval_strategy != 'no' (best is judged on eval).")
        p.check_schedule_free_best_model(self.optim, self.load_best_model_at_end)
        if not self.load_best_model_at_end:
            return
        if self.save_strategy == "no" or self.eval_strategy == "no":
            raise ConfigurationError(
                f"load_best_model_at_end requires saving and evaluation, got save_strategy={self.save_strategy!r}, "
                f"eval_strategy={self.eval_strategy!r}."
            )
        if self.save_strategy == "best":
            return
        if self.save_strategy != self.eval_strategy:
            raise ConfigurationError(
                "--load_best_model_at_end requires the save and eval strategy to match, got "
                f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}."
            )
        if self.save_strategy == "steps":
            save, ev = self.save_steps, self.eval_steps
            if isinstance(save, float) != isinstance(ev, float) or round(save / ev, 9) % 1:
                raise ConfigurationError(
                    f"--load_best_model_at_end requires save_steps ({save!r}) to be a round multiple of eval_steps "
                    f"({ev!r}), both counts or both fractions."
                )

    def _resolve_distributed(self) -> None:
        if self.local_rank == -1:
            self.local_rank = p.env_int("LOCAL_RANK", -1)
            p.check_limit(self.local_rank, "LOCAL_RANK", self._limits["local_rank"])
        if self.ddp_backend is not None:
            self.ddp_backend = p.as_choice(self.ddp_backend, "ddp_backend", p.DDP_BACKENDS)
        if self.bf16 and not self.use_cpu and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ConfigurationError("Your setup doesn't support bf16 on this GPU; set bf16=False or use_cpu=True.")

    def _resolve_tf32(self) -> None:
        """Hugging Face's meaning: ``True``/``False`` switch TF32 matmuls and convolutions on/off for the process
        (at construction, as in transformers); ``None`` leaves the setting alone."""
        if self.tf32 is None:
            return
        if self.tf32 and not _tf32_available():
            raise ConfigurationError(
                "tf32=True requires an NVIDIA GPU of the Ampere generation or newer with a CUDA build of torch; set "
                "tf32=None (leave the setting alone) or tf32=False."
            )
        if _tf32_available():
            _set_tf32(self.tf32)

    def _resolve_script_flags(self) -> None:
        if self.eval_strategy != "no":  # as in Hugging Face: evaluating during training means do_eval
            self.do_eval = True

    # -- properties -----------------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return p.env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        return p.env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        return max(self.local_rank, 0)

    @property
    def train_batch_size(self) -> int:
        """Cluster-wide expected (Poisson) batch; the sample rate is ``train_batch_size / N``."""
        return self.per_device_train_batch_size * self.world_size

    @property
    def eval_batch_size(self) -> int:
        """Per-rank eval batch (as in HF under DDP)."""
        return self.per_device_eval_batch_size

    @property
    def device(self) -> torch.device:
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", self.local_process_index)

    @property
    def should_log(self) -> bool:
        """As in Hugging Face: local rank 0 of every node with ``log_on_each_node`` (the default), else global rank
        0."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level of this process, as in Hugging Face: ``log_level`` where :attr:`should_log`, else
        ``log_level_replica``; ``"passive"`` keeps the level of the ``transformers`` logger."""
        level = LOG_LEVELS[self.log_level if self.should_log else self.log_level_replica]
        return logging.getLogger("transformers").getEffectiveLevel() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """As in Hugging Face: under an initialized ``torch.distributed`` process group, the main process (of the
        node with ``local``, else of the cluster) runs the block before the others (which wait at a barrier), so
        that they can reuse what it cached. Without a process group every process runs the block at once."""
        import torch.distributed as dist

        synced = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        main = (self.local_process_index if local else self.process_index) == 0
        if synced and not main:
            dist.barrier()
        try:
            yield
        finally:
            if synced and main:
                dist.barrier()

    @property
    def n_gpu(self) -> int:
        """GPUs used by this process: 1 on CUDA (one per process under DDP; no DataParallel), else 0."""
        return int(self.device.type == "cuda")

    @property
    def parallel_mode(self) -> ParallelMode:
        """``ParallelMode.DISTRIBUTED`` under torchrun (a local rank is set), else ``NOT_PARALLEL``."""
        return ParallelMode.DISTRIBUTED if self.local_rank != -1 else ParallelMode.NOT_PARALLEL

    @property
    def should_save(self) -> bool:
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    @property
    def gradient_accumulation_steps(self) -> int:
        """Always 1: a DP step is one sampled batch."""
        return 1

    @property
    def fp16(self) -> bool:
        """Always False: fp16 is unsupported (use bf16)."""
        return False

    @property
    def lr_scheduler_type(self) -> str:
        """HF's name for :attr:`lr_scheduler`."""
        return self.lr_scheduler

    @property
    def warmup_ratio(self) -> float:
        """The warm-up fraction when ``warmup_steps`` is a fraction, else 0.0."""
        return self.warmup_steps if isinstance(self.warmup_steps, float) else 0.0

    @property
    def noise_bias_correction(self) -> bool:
        """True for ``adam-bc`` / ``adamw-bc``: Adam's second moment is corrected for the noise variance."""
        return self.optim.endswith("-bc")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-serializable values (dtypes by name, unknown objects as ``str``); the secrets (the hub
        token, the reproducible noise seed) are masked."""
        out = {f.name: p.jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name in SECRET_FIELDS:  # never write a credential or a noise seed into logs or checkpoints
            if out[name] is not None:
                out[name] = "<SECRET>"
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """As in Hugging Face (TensorBoard's hparams): :meth:`to_dict` with the batch sizes, every value a bool, int,
        float or str."""
        data = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in data.items()}

    @classmethod
    def from_hf(cls, hf_args: Any, *, strict: bool = True, **overrides: Any) -> TrainingArguments:
        """Convert a ``transformers.TrainingArguments``; see :func:`opake_torch.transformers._from_hf.from_hf`."""
        from opake_torch.transformers._from_hf import from_hf

        return from_hf(cls, hf_args, strict=strict, **overrides)


# The metaclass's ``__call__`` takes ``**kwargs``; keep help() and IDEs showing the real fields.
TrainingArguments.__signature__ = inspect.signature(TrainingArguments.__init__).replace(
    parameters=list(inspect.signature(TrainingArguments.__init__).parameters.values())[1:]
)


def as_training_arguments(args: Any, **overrides: Any) -> TrainingArguments:
    """``args`` as Opake's :class:`TrainingArguments`, for a trainer that accepts either kind of arguments.

    - Opake's ``TrainingArguments`` (or a subclass): returned as is, or with ``overrides`` applied
      (``dataclasses.replace``, which validates again).
    - A ``transformers.TrainingArguments`` (a TRL config included): converted by :meth:`TrainingArguments.from_hf`,
      with its warnings. Hugging Face arguments carry no privacy budget, so ``overrides`` must hold the DP knob
      (``privacy_target_epsilon`` or ``privacy_noise_multiplier``; ``target_epsilon`` and the other accepted names
      too).
    - ``None``: ``TrainingArguments(**overrides)``.

    Raises:
        InputTypeError: ``args`` is none of these.
        PrivacyBudgetError: Hugging Face arguments without a DP knob in ``overrides``.
    """
    if isinstance(args, TrainingArguments):
        return dataclasses.replace(args, **type(args)._translate_kwargs(overrides)) if overrides else args
    if args is None:
        return TrainingArguments(**overrides)
    transformers = sys.modules.get("transformers")  # an instance of its class means it is imported
    if transformers is None or not isinstance(args, transformers.TrainingArguments):
        raise InputTypeError(
            f"args must be an opake_torch.transformers.TrainingArguments or a transformers.TrainingArguments, got "
            f"{type(args).__name__}."
        )
    knobs = TrainingArguments._translate_kwargs(overrides)
    if knobs.get("privacy_target_epsilon") is None and knobs.get("privacy_noise_multiplier") is None:
        raise PrivacyBudgetError(
            f"got a {type(args).__module__}.{type(args).__name__}, which carries no privacy budget. Convert it with "
            "opake_torch.transformers.TrainingArguments.from_hf(args, privacy_target_epsilon=...) (or "
            "privacy_noise_multiplier=..., 0.0 for non-private) and pass the result, or pass the DP knob along with "
            "it."
        )
    return TrainingArguments.from_hf(args, **knobs)
