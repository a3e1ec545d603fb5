"""``TrainingArguments``: the Hugging Face fields a DP trainer honours, plus the privacy, clipping and sampling fields.

A standalone dataclass, not a subclass of ``transformers.TrainingArguments``: ``transformers`` is imported only by
:meth:`TrainingArguments.from_hf`. Every value is resolved and validated in ``__post_init__``, so a constructed object
holds no ``"auto"`` and no ``None`` that the trainer would have to interpret, except ``privacy_target_delta`` (the
dataset size is a sensitive input, not configuration) and ``privacy_noise_multiplier`` (calibrated by the trainer).
``dataclasses.replace`` re-runs the validation; assigning a field afterwards does not.

Decisions on points where the reference sources disagree (``opake-surface.md`` section 7):

- Adaptive clipping with an ``mf_*`` mechanism raises (#1). Matrix-factorization noise is calibrated to a constant
  per-step sensitivity; silently switching to fixed clipping would run something the user did not ask for.
- Per-group clipping (a ``clipping_norm`` dict) is supported with ``clipping_mode="fixed"`` only. Adaptive clipping
  estimates one private quantile; per-group adaptive would spend budget on one quantile per group and is not
  implemented. AUTO-S normalizes by the whole per-example norm, which has no per-group form.
- ``privacy_noise_mechanism_kwargs["bound"]`` raises "no matching accountant" (#2).
- ``clipping_norm`` dict keys are regular expressions matched with ``re.search`` on dotted parameter names, the
  semantics of :func:`opake_core.tree.per_group` (#12); the patterns are compiled here.
- ``dataloader_drop_last`` and ``batch_eval_metrics`` are unsupported by the constructor (#7, #8): the training batches
  come from the DP sampler, the eval loader keeps every example, and metrics are computed once over the whole eval set.
  ``from_hf`` drops them with a warning.
- ``from_hf`` maps ``max_grad_norm`` to ``clipping_norm`` loosely, without a warning, unless ``clipping_norm`` is
  passed explicitly (#9); ``use_liger_kernel`` maps to ``use_performance_kernels`` (#10).
- ``privacy_accounting`` defaults to off only for fixed-noise independent DP-SGD (#19).
- ``fp16`` is not a field; a read-only ``fp16 == False`` shim remains for code written against HF (#21).
- ``cuda_graphs`` is a count of retained graph signatures (``0`` disables), not a bool; a bool is refused so that
  ``True`` does not silently mean "one signature".
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_core.plan import check_combination, is_horizon
from opake_torch.transformers import _parsing as p

__all__ = ["SECRET_FIELDS", "UNSUPPORTED", "TrainingArguments"]

SECRET_FIELDS = ("hub_token", "privacy_noise_seed")  # hidden from repr and masked by to_dict

_BF16_ALTERNATIVE = "use bf16=True (native bf16 autocast, no loss scaler)"
_SHARDING = "parameter/gradient sharding is incompatible with vmap per-example gradients"
# HF keyword -> (why a DP trainer does not support it, what to do instead).
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "gradient_accumulation_steps": (
        "a DP step is one Poisson draw: accumulation would change the sampled batch the accountant sees",
        "raise per_device_train_batch_size (the expected batch) and set microbatch_size to bound memory",
    ),
    "fp16": ("fp16 loss scaling adds a per-example unscale before clipping", _BF16_ALTERNATIVE),
    "fp16_full_eval": ("fp16 is not a supported precision", "use bf16_full_eval=True"),
    "fp16_opt_level": ("fp16 / Apex AMP is not a supported precision", _BF16_ALTERNATIVE),
    "half_precision_backend": ("fp16 is not a supported precision", _BF16_ALTERNATIVE),
    "fp16_backend": ("fp16 is not a supported precision", _BF16_ALTERNATIVE),
    "group_by_length": (
        "length-bucketed batches break the equal inclusion probability that Poisson amplification relies on",
        "leave examples unsorted; set pad_to_multiple_of to bound padding",
    ),
    "length_column_name": ("it only serves group_by_length, which is unsupported", "remove it"),
    "dataloader_drop_last": (
        "training batches come from the DP sampler (variable size by design) and the eval loader keeps every example",
        "remove it; the sampler owns batch composition",
    ),
    "deepspeed": (_SHARDING, "use the built-in DDP (torchrun)"),
    "fsdp": (_SHARDING, "use the built-in DDP (torchrun)"),
    "fsdp_config": (_SHARDING, "use the built-in DDP (torchrun)"),
    "accelerator_config": ("the trainer drives DDP itself, not Accelerate", "use the built-in DDP (torchrun)"),
    "parallelism_config": (_SHARDING, "use the built-in DDP (torchrun)"),
    "tpu_num_cores": ("TPU/XLA is not a supported backend", "run on CUDA or CPU"),
    "mp_parameters": ("SageMaker model parallelism is not a supported backend", "use the built-in DDP (torchrun)"),
    "batch_eval_metrics": ("streaming metric reduction is not implemented", "compute metrics over the full eval set"),
}


def _unsupported(name: str) -> TypeError:
    why, instead = UNSUPPORTED[name]
    return TypeError(f"TrainingArguments does not support {name!r}: {why}. Instead, {instead}.")


@dataclass
class TrainingArguments:
    """Arguments of a DP training run. See ``docs/arguments.md`` for every field, default and rule."""

    output_dir: str | None = None
    _: KW_ONLY
    overwrite_output_dir: bool = False
    # batches
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int | None = None
    microbatch_size: int | None = None
    auto_find_microbatch_size: bool = False
    per_example_gradients: str = "auto"
    # optimizer and schedule
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw"
    optim_args: dict[str, Any] | str | None = None
    lr_scheduler: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: int | float = 0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # clipping
    clipping_norm: float | dict[str, float] | str = 1.0
    clipping_mode: str = "fixed"
    clipping_kwargs: dict[str, Any] | str | None = None
    # privacy
    privacy_target_epsilon: float | None = None
    privacy_target_delta: float | None = None
    privacy_noise_multiplier: float | None = None
    privacy_accounting: bool | None = None
    privacy_allow_large_delta: bool = False
    privacy_noise_seed: int | None = field(default=None, repr=False)
    privacy_noise_generator: str = "philox"
    privacy_noise_mechanism: str = "gaussian"
    privacy_noise_mechanism_kwargs: dict[str, Any] | str | None = None
    noise_calibration_kwargs: dict[str, Any] | str | None = None
    sampling_mode: str = "auto"
    sampling_kwargs: dict[str, Any] | str | None = None
    # precision, compile, kernels
    bf16: bool = False
    bf16_full_eval: bool = False
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    cuda_graphs: int = 0
    use_compat_patches: bool = True
    use_performance_kernels: bool = False
    performance_kernels_config: dict[str, Any] | str | None = None
    use_cpu: bool = False
    # reproducibility
    seed: int = 42
    data_seed: int | None = None
    # logging
    logging_dir: str | None = None
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    logging_steps: int | float = 500
    disable_tqdm: bool | None = None
    report_to: str | list[str] | None = None
    run_name: str | None = None
    include_num_input_tokens_seen: str | bool = "no"
    include_tokens_per_second: bool = False
    # saving
    save_strategy: str = "steps"
    save_steps: int | float = 500
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
    eval_strategy: str = "no"
    eval_steps: int | float | None = None
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
    local_rank: int = -1
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    average_tokens_across_devices: bool = True
    # hub
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = field(default=None, repr=False)
    hub_private_repo: bool | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingArguments:
        # The generated __init__ stays in charge of the fields; this only turns known HF knobs into explanations.
        for name in kwargs:
            if name in UNSUPPORTED:
                raise _unsupported(name)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._resolve_output()
        self._resolve_batches()
        self._resolve_optimizer()
        self._resolve_mechanism()
        self._resolve_privacy()
        self._resolve_clipping()
        self._resolve_compile()
        self._resolve_logging_eval_save()
        self._resolve_distributed()

    # -- resolution, one concern each ------------------------------------------------------------------------------

    def _resolve_output(self) -> None:
        self.output_dir = p.as_path("trainer_output" if self.output_dir is None else self.output_dir, "output_dir")
        if self.logging_dir is None:
            self.logging_dir = os.path.join(self.output_dir, "runs")
        self.logging_dir = p.as_path(self.logging_dir, "logging_dir")
        if self.resume_from_checkpoint is not None:
            self.resume_from_checkpoint = p.as_path(self.resume_from_checkpoint, "resume_from_checkpoint")

    def _resolve_batches(self) -> None:
        self.per_device_train_batch_size = p.as_positive_int(
            self.per_device_train_batch_size, "per_device_train_batch_size"
        )
        if self.microbatch_size is not None:
            self.microbatch_size = p.as_positive_int(self.microbatch_size, "microbatch_size")
            if self.microbatch_size > self.per_device_train_batch_size:
                raise ConfigurationError(
                    f"microbatch_size must be in [1, per_device_train_batch_size={self.per_device_train_batch_size}], "
                    f"got {self.microbatch_size}. It is the physical vmap chunk; raise per_device_train_batch_size "
                    "to grow the logical batch."
                )
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.microbatch_size or self.per_device_train_batch_size
        self.per_device_eval_batch_size = p.as_positive_int(
            self.per_device_eval_batch_size, "per_device_eval_batch_size"
        )
        self.max_length = p.as_optional_positive_int(self.max_length, "max_length")
        self.pad_to_multiple_of = p.as_optional_positive_int(self.pad_to_multiple_of, "pad_to_multiple_of")
        self.dataloader_num_workers = p.as_positive_int(
            self.dataloader_num_workers, "dataloader_num_workers", minimum=0
        )
        if self.use_cpu:
            self.dataloader_pin_memory = False
        if self.data_seed is None:
            self.data_seed = self.seed
        if not math.isfinite(p.as_number(self.num_train_epochs, "num_train_epochs")) or self.num_train_epochs <= 0:
            raise ConfigurationError(
                f"num_train_epochs must be a positive finite number, got {self.num_train_epochs!r}."
            )
        if (
            not isinstance(self.max_steps, int)
            or isinstance(self.max_steps, bool)
            or (self.max_steps < 1 and self.max_steps != -1)
        ):
            raise ConfigurationError(
                f"max_steps must be a positive int, or -1 to use num_train_epochs; got {self.max_steps!r}."
            )
        if not 0 <= p.as_number(self.label_smoothing_factor, "label_smoothing_factor") < 1:
            raise ConfigurationError(f"label_smoothing_factor must be in [0, 1), got {self.label_smoothing_factor!r}.")
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
        for attr in ("learning_rate", "weight_decay", "adam_epsilon"):
            if p.as_number(getattr(self, attr), attr) < 0:
                raise ConfigurationError(f"{attr} must be >= 0, got {getattr(self, attr)!r}.")
        for attr in ("adam_beta1", "adam_beta2"):
            if not 0 <= p.as_number(getattr(self, attr), attr) < 1:
                raise ConfigurationError(f"{attr} must be in [0, 1), got {getattr(self, attr)!r}.")
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
        if isinstance(self.warmup_steps, bool):
            raise ConfigurationError(
                f"warmup_steps must be a count or a fraction in (0, 1), not a bool; got {self.warmup_steps!r}."
            )
        self.warmup_steps = p.as_steps(self.warmup_steps, "warmup_steps", allow_zero=True)

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
        if self.ignore_data_skip and self.sampling_mode != "poisson":
            raise ConfigurationError(
                f"ignore_data_skip=True requires sampling_mode='poisson' (got {self.sampling_mode!r}): participation "
                "samplers must resume from their saved cursor or examples would participate more often than accounted."
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
        if nm is not None:
            nm = self.privacy_noise_multiplier = float(p.as_number(nm, "privacy_noise_multiplier"))
            if not 0 <= nm < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_noise_multiplier must be finite and >= 0 (0.0 = non-private), got {nm!r}."
                )
        if eps is not None:
            eps = self.privacy_target_epsilon = float(p.as_number(eps, "privacy_target_epsilon"))
            if not 0 < eps < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_target_epsilon must be finite and > 0, got {eps!r}. For a non-private run set "
                    "privacy_noise_multiplier=0.0 and leave privacy_target_epsilon unset."
                )
        if delta is not None:
            delta = self.privacy_target_delta = float(p.as_number(delta, "privacy_target_delta"))
            if not 0 < delta < 1:
                raise PrivacyBudgetError(
                    f"privacy_target_delta must be in (0, 1), got {delta!r}; leave it None for 1 / N**1.1."
                )
        accounting = self.privacy_accounting
        if accounting is not None and not isinstance(accounting, bool):
            raise ConfigurationError(f"privacy_accounting must be True, False or None, got {accounting!r}.")
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
        if accounting is None:
            self.privacy_accounting = eps is not None or self.is_complete_horizon
        self.noise_calibration_kwargs = p.calibration(self.noise_calibration_kwargs)
        if not isinstance(self.privacy_allow_large_delta, bool):
            raise ConfigurationError(
                f"privacy_allow_large_delta must be True or False, got {self.privacy_allow_large_delta!r}."
            )
        seed = self.privacy_noise_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigurationError(
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

    def _resolve_compile(self) -> None:
        if self.torch_compile_mode is not None:
            self.torch_compile_mode = p.as_choice(self.torch_compile_mode, "torch_compile_mode", p.COMPILE_MODES)
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if isinstance(self.cuda_graphs, bool) or not isinstance(self.cuda_graphs, int) or self.cuda_graphs < 0:
            raise ConfigurationError(
                f"cuda_graphs is the number of graph signatures to retain (0 disables), an int >= 0; got "
                f"{self.cuda_graphs!r}. Use e.g. cuda_graphs=8."
            )
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
        if self.per_example_gradients == "layerwise" and self.gradient_checkpointing:
            raise ConfigurationError(
                "per_example_gradients='layerwise' is incompatible with gradient_checkpointing (the recomputed "
                "layers would be recorded twice); it needs no checkpointing to fit: its memory is that of "
                "non-private training. Drop gradient_checkpointing, or use per_example_gradients='vmap'."
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
        self.save_total_limit = p.as_optional_positive_int(self.save_total_limit, "save_total_limit")
        self.report_to = p.report_to(self.report_to)
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
        if isinstance(self.local_rank, bool) or not isinstance(self.local_rank, int) or self.local_rank < -1:
            raise ConfigurationError(f"local_rank must be an int >= -1, got {self.local_rank!r}.")
        if self.ddp_backend is not None:
            self.ddp_backend = p.as_choice(self.ddp_backend, "ddp_backend", p.DDP_BACKENDS)
        self.ddp_timeout = p.as_positive_int(self.ddp_timeout, "ddp_timeout")
        if self.bf16 and not self.use_cpu and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ConfigurationError("Your setup doesn't support bf16 on this GPU; set bf16=False or use_cpu=True.")

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
        return self.process_index == 0

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

    @classmethod
    def from_hf(cls, hf_args: Any, *, strict: bool = True, **overrides: Any) -> TrainingArguments:
        """Convert a ``transformers.TrainingArguments``; see :func:`opake_torch.transformers._from_hf.from_hf`."""
        from opake_torch.transformers._from_hf import from_hf

        return from_hf(cls, hf_args, strict=strict, **overrides)


# ``__new__`` takes ``**kwargs``; keep help() and IDEs showing the real fields.
TrainingArguments.__signature__ = inspect.signature(TrainingArguments.__init__).replace(
    parameters=list(inspect.signature(TrainingArguments.__init__).parameters.values())[1:]
)
