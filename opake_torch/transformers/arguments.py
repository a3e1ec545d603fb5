"""``TrainingArguments``: the Hugging Face shell of a DP run's settings, built from two frozen values by effect.

The fields that decide the privacy guarantee (batch and horizon, sampler, mechanism, clipping, budget, accounting,
router release) make :class:`~opake_torch.transformers.privacy_settings.PrivacySettings`, ``args.privacy``, which
:func:`opake_torch.transformers.privacy.build_plan` consumes; the fields that choose how a step computes (precision,
chunking, engine, compilation, kernels, device) make
:class:`~opake_torch.transformers.compute_settings.ComputeSettings`, ``args.compute``. Each value holds the rules of
its fields. The arguments keep the Hugging Face fields (logging, saving, evaluation, optimizer, hub, script flags),
their rules, the rules across the two values, and the names Hugging Face scripts read.

A standalone dataclass, not a subclass of ``transformers.TrainingArguments``: ``transformers`` is imported only by
:meth:`TrainingArguments.from_hf`. Every value is resolved and validated in ``__post_init__``, so a constructed object
holds no ``"auto"`` and no ``None`` that the trainer would have to interpret, except ``privacy_target_delta`` (the
dataset size is a sensitive input, not configuration) and ``privacy_noise_multiplier`` (calibrated by the trainer).
The privacy and compute fields hold the values of ``args.privacy`` and ``args.compute``. ``dataclasses.replace``
re-runs the validation. Assigning a privacy or compute field afterwards builds its value again (so ``args.privacy``
and ``args.compute`` always match the fields, and a wrong value is refused); assigning another field checks nothing.

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

Decisions on points where the reference designs disagree (the privacy ones: :mod:`.privacy_settings`):

- ``dataloader_drop_last`` and ``batch_eval_metrics`` are refused by the constructor: the training batches come from
  the DP sampler, the eval loader keeps every example, and metrics are computed once over the whole eval set.
  ``from_hf`` drops them with a warning.
- ``max_grad_norm`` is ``clipping_norm``: the bound of each example's gradient, not of the batch gradient. ``from_hf``
  maps it without a warning unless ``clipping_norm`` is passed explicitly; ``use_liger_kernel`` maps to
  ``use_performance_kernels``.
- ``fp16`` is not a field; a read-only ``fp16 == False`` shim remains for code written against HF.
- ``cuda_graphs`` is a count of retained graph signatures (``0`` disables), not a bool; a bool is refused so that
  ``True`` does not silently mean "one signature".
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Literal

import torch

from opake_core.errors import ConfigurationError, InputTypeError, PrivacyBudgetError
from opake_torch import limits, sharded
from opake_torch.transformers import _command_line as cli
from opake_torch.transformers import _field_help
from opake_torch.transformers import _from_hf as hf
from opake_torch.transformers import _parsing as p
from opake_torch.transformers._outputs import OutputRules
from opake_torch.transformers._process import LOG_LEVELS, ParallelMode, ProcessView
from opake_torch.transformers.compute_settings import ComputeSettings
from opake_torch.transformers.optimizer import check_schedule_free_base, check_schedule_kwargs, probe_optimizer
from opake_torch.transformers.privacy_settings import PrivacySettings

__all__ = ["LOG_LEVELS", "SECRET_FIELDS", "ParallelMode", "TrainingArguments", "as_training_arguments"]

SECRET_FIELDS = ("hub_token", "privacy_noise_seed")  # hidden from repr and masked by to_dict
_WARNED_INERT: set[str] = set()  # inert names already warned about in this process
# The fields of the arguments that build each settings value (same names); world_size comes from the environment.
_GROUPS: dict[type, tuple[str, ...]] = {
    kind: tuple(f.name for f in dataclasses.fields(kind) if f.name != "world_size")
    for kind in (PrivacySettings, ComputeSettings)
}
_GROUP_OF = {name: kind for kind, names in _GROUPS.items() for name in names}


def _tf32_available() -> bool:
    """As ``transformers.utils.is_torch_tf32_available``: a CUDA build and a GPU of compute capability 8 or more."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


def _set_tf32(enabled: bool) -> None:
    # torch's per-backend switches, which the rest of Opake (benchmarks, tests) uses too
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _check_microbatch(privacy: PrivacySettings, compute: ComputeSettings) -> None:
    """The rule across the two settings values: a chunk holds at most the expected batch of a rank."""
    batch, chunk = privacy.per_device_train_batch_size, compute.microbatch_size
    if chunk is not None and chunk > batch:
        raise ConfigurationError(
            f"microbatch_size must be in [1, per_device_train_batch_size={batch}], got {chunk}. It is the physical "
            "vmap chunk; raise per_device_train_batch_size to grow the logical batch."
        )


_MISSING = object()


def _inert_default(cls: type, name: str) -> Any:
    """The Hugging Face (or TRL) default of ``name`` when it is an inert or refused name of ``cls`` that is no field
    (the value a run behaves as if it had), else ``_MISSING``."""
    if name in hf.INERT:
        return hf.INERT[name][0]
    if name in hf.REFUSED:
        return hf.REFUSED[name][0]
    rule = getattr(cls, "_trl_names", {}).get(name)
    if rule is not None and rule.kind in ("inert", "refused") and name not in cls.__dataclass_fields__:
        return rule.default
    return _MISSING


def _alias_target(cls: type, name: str) -> str | None:
    """The field that ``name`` is another name for (Hugging Face's, Opacus' or TRL's), or None."""
    rule = getattr(cls, "_trl_names", {}).get(name)
    return rule.target if rule is not None and rule.kind == "alias" else hf.ALIASES.get(name)


class _AcceptsHuggingFaceNames(type):
    """Metaclass of :class:`TrainingArguments`: ``cls(**kwargs)`` translates the keyword names with
    ``cls._translate_kwargs`` before the dataclass ``__init__`` runs (subclasses inherit it, and may extend the hook
    for names of their own). The values ``HfArgumentParser`` collected under other names
    (:mod:`~opake_torch.transformers._command_line`) are translated as those keyword arguments. The values given to
    inert names stay readable (``args.hub_strategy``), though they change nothing."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs = cli.as_keywords(kwargs)
        obj = super().__call__(*args, **cls._translate_kwargs(kwargs))
        given = {name: value for name, value in kwargs.items() if _inert_default(cls, name) is not _MISSING}
        object.__setattr__(obj, "_inert_values", given)
        return obj


def _option(name: str, *, loose: bool = False) -> dict[str, Any]:
    """``HfArgumentParser`` metadata of the field ``name``: its Hugging Face names (``hf.ALIASES``) are options too."""
    return cli.option(*(alias for alias, target in hf.ALIASES.items() if target == name), loose=loose)


@dataclass
class TrainingArguments(ProcessView, OutputRules, metaclass=_AcceptsHuggingFaceNames):
    """Arguments of a DP training run.

    Every field, default and rule, and what each Hugging Face or Opacus argument name means here, is on the
    'Training arguments' page of the Opake documentation.

    Example: the settings that change epsilon are kept apart from the compute flags; a run without a privacy knob
    is refused.

        >>> from opake_core import PrivacyBudgetError
        >>> from opake_torch import TrainingArguments
        >>> args = TrainingArguments("out", privacy_target_epsilon=8.0, per_device_train_batch_size=16)
        >>> args.privacy.privacy_target_epsilon, args.privacy.sampling_mode, args.compute.microbatch_size
        (8.0, 'poisson', None)
        >>> try:
        ...     TrainingArguments("out")
        ... except PrivacyBudgetError as error:
        ...     print(str(error)[:40])
        Set either privacy_noise_multiplier (use
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
    per_example_row_multiple: int = 1
    layerwise_ghost_advantage: float = 1.0
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
    privacy_unit: str = "record"
    privacy_user_column: str | None = None
    privacy_max_rows_per_user: int | None = None
    privacy_user_reduction: str = "mean"
    ddp_shard: str = "per_rank"
    # mixture of experts: the private router load-balancing release
    router_aux_loss_coef: float | None = None
    router_aux_kwargs: dict[str, Any] | str | None = None
    router_fp32: bool = False  # the routers' logits and softmax in float32 (opake_torch.patches.router_fp32)
    # precision, compile, kernels
    bf16: bool = False
    bf16_full_eval: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool = field(default=False, metadata=_option("gradient_checkpointing"))
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_option("gradient_checkpointing_kwargs")
    )
    activation_offloading: bool = False  # saved activations in pinned host memory (opake_torch.offloading)
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
    full_determinism: bool = False
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
    step_perf: bool = False  # per-phase step times in the logs (opake_torch.transformers.step_perf)
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
    enable_jit_checkpoint: bool = False
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
    # Hugging Face's options (a string, a list or True; annotated str for HfArgumentParser); canonical: "auto_wrap
    # full_shard" or ""
    fsdp: str | None = field(default="", metadata=_option("fsdp", loose=True))
    fsdp_config: dict[str, Any] | str | None = None  # a dict or a JSON file; canonical: the supported keys
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
        """``kwargs`` with Opake's names (:func:`~opake_torch.transformers._from_hf.translate`); each inert name
        warns once per process."""
        return hf.translate(cls, kwargs, warned=_WARNED_INERT)

    def __post_init__(self) -> None:
        p.check_types(self, self._limits, skip=frozenset(_GROUP_OF))  # the settings values check their own fields
        self._adopt(self._settings(PrivacySettings))
        self._adopt(self._settings(ComputeSettings))
        self._resolve_output()
        self._resolve_batches()
        self._resolve_optimizer()
        self._resolve_keys()
        self._resolve_logging_eval_save()
        self._resolve_distributed()
        self._resolve_tf32()
        self._resolve_script_flags()

    def __getattr__(self, name: str) -> Any:
        """Hugging Face's (and TRL's) names that are no field: an alias reads its field (``max_grad_norm`` is
        ``clipping_norm``), an inert name the value it was given or its default, a refused name its default (the
        only value it accepts)."""
        target = None if name.startswith("__") else _alias_target(type(self), name)
        if target is not None:
            return getattr(self, target)
        if name.startswith("__") or _inert_default(type(self), name) is _MISSING:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.__dict__.get("_inert_values", {}).get(name, _inert_default(type(self), name))

    def __setattr__(self, name: str, value: Any) -> None:
        alias = _alias_target(type(self), name) is not None
        if name not in self.__dataclass_fields__ and (alias or _inert_default(type(self), name) is not _MISSING):
            # as in the constructor: an alias sets its field, an inert name warns, a refused value is refused
            for target, translated in type(self)._translate_kwargs({name: value}).items():
                setattr(self, target, translated)
            if not alias:
                self.__dict__.setdefault("_inert_values", {})[name] = value
            return
        kind = _GROUP_OF.get(name)
        if kind is None or "_compute" not in self.__dict__:  # another field, or during construction
            super().__setattr__(name, value)
            return
        settings = self._settings(kind, **{name: value})  # a wrong value is refused before anything changes
        if kind is PrivacySettings:
            _check_microbatch(settings, self._compute)
        else:
            _check_microbatch(self._privacy, settings)
        self._adopt(settings)

    def _settings(self, kind: type, **changes: Any) -> Any:
        """A settings value of ``kind`` from the fields of the same names (with ``changes``)."""
        values = {name: getattr(self, name) for name in _GROUPS[kind]} | changes
        if kind is PrivacySettings:
            values["world_size"] = self.world_size
        return kind(**values)

    def _adopt(self, settings: PrivacySettings | ComputeSettings) -> None:
        """``settings`` as ``args.privacy`` or ``args.compute``, its canonical values in the fields of the same names
        (dicts as copies: the value's own are never shared)."""
        for name in _GROUPS[type(settings)]:
            value = getattr(settings, name)
            object.__setattr__(self, name, dict(value) if isinstance(value, dict) else value)
        object.__setattr__(self, "_privacy" if isinstance(settings, PrivacySettings) else "_compute", settings)

    @property
    def privacy(self) -> PrivacySettings:
        """The privacy settings of the run: what :func:`~opake_torch.transformers.privacy.build_plan` plans with and
        what a resume keeps."""
        return self._privacy

    @property
    def compute(self) -> ComputeSettings:
        """The compute settings of the run: how its steps compute, never what they release."""
        return self._compute

    @property
    def is_complete_horizon(self) -> bool:
        """True when the mechanism or sampler is accounted once over the declared horizon (mf_*, k_out_of_t)."""
        return self._privacy.is_complete_horizon

    @property
    def router_release(self) -> bool:
        """Whether the run releases the MoE router load statistic (``router_aux_loss_coef > 0``)."""
        return self._privacy.router_release

    # -- resolution, one concern each ------------------------------------------------------------------------------

    def _resolve_output(self) -> None:
        self.output_dir = p.as_path("trainer_output" if self.output_dir is None else self.output_dir, "output_dir")
        if self.logging_dir is None:
            self.logging_dir = os.path.join(self.output_dir, "runs")
        self.logging_dir = p.as_path(self.logging_dir, "logging_dir")
        if self.resume_from_checkpoint is not None:
            self.resume_from_checkpoint = p.as_path(self.resume_from_checkpoint, "resume_from_checkpoint")

    def _resolve_batches(self) -> None:  # types and ranges: check_types
        _check_microbatch(self._privacy, self._compute)
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.microbatch_size or self.per_device_train_batch_size
        if self.use_cpu:
            self.dataloader_pin_memory = False
        if self.data_seed is None:
            self.data_seed = self.seed
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
        self.optim_args = p.as_dict(self.optim_args, "optim_args")
        wrapper = name == "schedule_free" and "base" in self.optim_args  # else Schedule-Free AdamW, as before
        name = p.OPTIMIZER_ALIASES.get(name, name) if isinstance(name, str) and not wrapper else name
        if isinstance(name, str) and any(marker in name for marker in p._REFUSED_OPTIM_MARKERS):
            raise ConfigurationError(
                f"optim={self.optim!r} (8-bit, paged, Apex-fused or GaLore optimizers) has no functional torchopt "
                f"equivalent under DP. Use one of {list(p.OPTIMIZERS)}, e.g. optim='adamw'."
            )
        self.optim = p.as_choice(name, "optim", p.OPTIMIZERS)
        check_schedule_free_base(self.optim, self.optim_args)
        name = p.plain(self.lr_scheduler)
        name = p.SCHEDULER_ALIASES.get(name, name) if isinstance(name, str) else name
        if isinstance(name, str) and name in p.REFUSED_SCHEDULERS:
            raise ConfigurationError(f"lr_scheduler={name!r} is refused: {p.REFUSED_SCHEDULERS[name]}.")
        self.lr_scheduler = p.as_choice(name, "lr_scheduler", p.SCHEDULERS)
        self.lr_scheduler_kwargs = p.as_dict(self.lr_scheduler_kwargs, "lr_scheduler_kwargs")
        p.check_keys(
            self.lr_scheduler_kwargs,
            p.SCHEDULER_KWARGS[self.lr_scheduler],
            "lr_scheduler_kwargs",
            f"lr_scheduler={self.lr_scheduler!r}",
        )
        check_schedule_kwargs(self.lr_scheduler, self.lr_scheduler_kwargs)
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

    def _resolve_keys(self) -> None:
        seed = self.privacy_noise_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigurationError(  # the type only: the value is a secret
                f"privacy_noise_seed must be an int (or None for a secret key from the operating system), got "
                f"{type(seed).__name__}."
            )
        self.privacy_noise_generator = p.as_choice(
            self.privacy_noise_generator, "privacy_noise_generator", ("philox", "chacha20")
        )

    def _resolve_distributed(self) -> None:
        if self.local_rank == -1:
            self.local_rank = p.env_int("LOCAL_RANK", -1)
            p.check_limit(self.local_rank, "LOCAL_RANK", self._limits["local_rank"])
        if self.ddp_backend is not None:
            self.ddp_backend = p.as_choice(self.ddp_backend, "ddp_backend", p.DDP_BACKENDS)
        self.fsdp = " ".join(sharded.parse_fsdp(self.fsdp))
        self.fsdp_config = sharded.parse_fsdp_config(self.fsdp_config)
        if self.fsdp_config and not self.fsdp:
            raise ConfigurationError(f"fsdp_config={self.fsdp_config!r} is set but fsdp is not; set fsdp='full_shard'.")

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

    # -- Hugging Face's names ------------------------------------------------------------------------------------

    @property
    def train_batch_size(self) -> int:
        """Cluster-wide expected (Poisson) batch; the sample rate is ``train_batch_size / N``."""
        return self.per_device_train_batch_size * self.world_size

    @property
    def eval_batch_size(self) -> int:
        """Per-rank eval batch (as in HF under DDP)."""
        return self.per_device_eval_batch_size

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
        """True when the optimizer that ``optim`` and ``optim_args`` build corrects its second moment for the noise
        variance, read from that optimizer (its ``noise_aware``): ``adam-bc`` / ``adamw-bc``,
        ``optim_args={"noise_bias_correction": True}`` with an optimizer that offers it, or a Schedule-Free base that
        does. ``DPTrainer``'s ``optimizer_cls_and_kwargs`` replaces the named optimizer: ``trainer.optimizer`` tells."""
        return probe_optimizer(self).noise_aware

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


_field_help.attach(TrainingArguments, _field_help.HELP)
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
