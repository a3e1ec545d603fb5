"""Conversion of a ``transformers.TrainingArguments`` into Opake's :class:`TrainingArguments`.

Every init field of the HF dataclass falls in one bucket: copied (``DIRECT``), renamed (``RENAME``), transformed
(batch, optimizer, clipping, kernels), refused when set (``REJECT_IF_SET``, a ``ValueError`` with the reason), or
dropped (``DROP``, a ``RuntimeWarning`` when set and ``strict``). A field this module does not know (a newer
transformers) is dropped with a warning too. Legacy names (``per_gpu_*``, ``evaluation_strategy``, ``adafactor``,
``push_to_hub_*``) are read with ``getattr`` so that older transformers versions convert as well.

The conversion is one-way. Upstream configs carry no privacy budget, so a DP knob must come in ``overrides``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from opake_core.errors import PrivacyBudgetError
from opake_torch.transformers._parsing import plain

__all__ = ["DIRECT", "DROP", "REJECT_IF_SET", "RENAME", "TRANSFORMED", "from_hf"]

DIRECT = (
    "output_dir", "overwrite_output_dir", "per_device_eval_batch_size", "num_train_epochs", "max_steps",
    "learning_rate", "lr_scheduler_kwargs", "warmup_steps", "optim_args", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "average_tokens_across_devices", "label_smoothing_factor", "bf16", "bf16_full_eval",
    "gradient_checkpointing", "torch_compile", "torch_compile_backend", "torch_compile_mode", "logging_dir",
    "logging_strategy", "logging_steps", "logging_first_step", "include_num_input_tokens_seen",
    "include_tokens_per_second", "disable_tqdm", "report_to", "run_name", "eval_strategy", "eval_steps",
    "prediction_loss_only", "eval_on_start", "include_for_metrics", "save_only_model", "save_strategy", "save_steps",
    "save_on_each_node", "save_total_limit", "save_safetensors", "push_to_hub", "hub_token", "hub_private_repo",
    "hub_model_id", "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "seed", "data_seed", "use_cpu", "dataloader_num_workers",
    "dataloader_pin_memory", "remove_unused_columns", "label_names", "ddp_backend", "ddp_timeout",
    "resume_from_checkpoint", "local_rank",
)  # fmt: skip
RENAME = {
    "lr_scheduler_type": "lr_scheduler",
    "evaluation_strategy": "eval_strategy",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "activation_checkpointing": "gradient_checkpointing",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_token": "hub_token",
}
TRANSFORMED = (
    "per_device_train_batch_size", "per_gpu_train_batch_size", "gradient_accumulation_steps", "auto_find_batch_size",
    "optim", "adafactor", "max_grad_norm", "use_liger_kernel", "train_sampling_strategy",
)  # fmt: skip

_FP16 = "fp16 loss scaling adds a per-example unscale before clipping; use bf16=True"
_SHARD = "parameter/gradient sharding is incompatible with vmap per-example gradients; use the built-in DDP (torchrun)"
REJECT_IF_SET = {
    "fp16": _FP16,
    "fp16_full_eval": _FP16,
    "fp16_opt_level": _FP16,
    "fp16_backend": _FP16,
    "half_precision_backend": _FP16,
    "fsdp": _SHARD,
    "fsdp_config": _SHARD,
    "deepspeed": _SHARD,
    "parallelism_config": _SHARD,
    "accelerator_config": "the DP trainer drives DDP itself; Accelerate's batch dispatch would bypass the DP sampler",
    "mp_parameters": "SageMaker model parallelism is not a supported backend; use the built-in DDP (torchrun)",
    "neftune_noise_alpha": "NEFTune adds data-dependent embedding noise that the privacy accountant does not model",
    "group_by_length": "length-bucketed batches break the equal inclusion probability Poisson amplification needs",
}
DROP = (
    "do_train", "do_eval", "do_predict", "tpu_num_cores", "tpu_metrics_debug", "hub_strategy", "hub_always_push",
    "hub_revision", "ray_scope", "optim_target_modules", "batch_eval_metrics", "eval_use_gather_object",
    "eval_do_concat_batches", "eval_accumulation_steps", "eval_delay", "log_level", "log_level_replica",
    "log_on_each_node", "logging_nan_inf_filter", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "dataloader_drop_last", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "length_column_name", "tf32", "use_cache",
    "torch_empty_cache_steps", "skip_memory_metrics", "full_determinism", "debug", "enable_jit_checkpoint",
    "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "liger_kernel_config",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "torchdynamo",
    "use_mps_device", "use_ipex", "jit_mode_eval", "past_index", "include_inputs_for_metrics", "split_batches",
    "dispatch_batches", "use_seedable_sampler", "push_to_hub_organization", "use_legacy_prediction_loop",
)  # fmt: skip
_REFUSED_OPTIM_MARKERS = ("8bit", "paged", "apex", "galore", "bnb", "lomo")
_HF_OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adafactor": "adafactor",
              "sgd": "sgd"}  # fmt: skip


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_default(value: Any, default: Any) -> bool:
    value, default = plain(value), plain(default)
    if value == default:
        return True
    empty = (None, "", False, [], {}, ())
    if default in empty and value in empty:
        return True  # HF's __post_init__ turns None into False, "" into [], "none" into [] ...
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            return value == type(value)()  # e.g. the AcceleratorConfig HF builds when none was given
        except TypeError:
            return False
    return False


def _field_values(hf_args: Any) -> dict[str, tuple[Any, Any]]:
    """``{name: (value, default)}`` for every init field of the HF dataclass."""
    return {f.name: (getattr(hf_args, f.name), _default_of(f)) for f in dataclasses.fields(hf_args) if f.init}


def from_hf(cls: type, hf_args: Any, *, strict: bool = True, **overrides: Any) -> Any:
    """Translate ``hf_args`` (a ``transformers.TrainingArguments``) into ``cls`` (Opake's ``TrainingArguments``).

    Args:
        cls: the Opake ``TrainingArguments`` class (or a subclass).
        hf_args: a ``transformers.TrainingArguments`` instance.
        strict: warn (``RuntimeWarning``) about non-default fields that are dropped; ``False`` drops silently.
        **overrides: Opake fields, applied last. Must include ``privacy_noise_multiplier`` or
            ``privacy_target_epsilon``.

    Raises:
        TypeError: ``hf_args`` is not a ``transformers.TrainingArguments``.
        PrivacyBudgetError: no DP knob in ``overrides``.
        ValueError: a field set to a value that has no meaning under DP (with the per-field reason).
    """
    import transformers

    if not isinstance(hf_args, transformers.TrainingArguments):
        raise TypeError(
            f"from_hf expects a transformers.TrainingArguments, got {type(hf_args).__name__}. "
            "Build opake_torch.transformers.TrainingArguments directly for other inputs."
        )
    if overrides.get("privacy_noise_multiplier") is None and overrides.get("privacy_target_epsilon") is None:
        raise PrivacyBudgetError(
            "from_hf needs a DP knob: pass privacy_target_epsilon=... (calibrate the noise) or "
            "privacy_noise_multiplier=... (0.0 for non-private). Upstream configs carry no privacy budget."
        )
    fields = _field_values(hf_args)
    for legacy in ("per_gpu_train_batch_size", "per_gpu_eval_batch_size", "evaluation_strategy", "adafactor",
                   "push_to_hub_model_id", "push_to_hub_token", "group_by_length"):  # fmt: skip
        if legacy not in fields and hasattr(hf_args, legacy):
            fields[legacy] = (getattr(hf_args, legacy), None)

    for name, reason in REJECT_IF_SET.items():
        if name in fields and not _is_default(*fields[name]):
            raise ValueError(f"{name}={plain(fields[name][0])!r} cannot be converted: {reason}.")
    sampling = plain(fields.get("train_sampling_strategy", ("random", None))[0])
    if sampling != "random":
        raise ValueError(
            f"train_sampling_strategy={sampling!r} cannot be converted: the DP sampler owns batch composition "
            "(use sampling_mode= on Opake's TrainingArguments)."
        )

    out: dict[str, Any] = {}
    for name in DIRECT:
        if name in fields:
            out[name] = plain(fields[name][0])
    for old, new in RENAME.items():
        if old in fields and (new not in out or not _is_default(*fields[old])):
            out[new] = plain(fields[old][0])
    out.update(_transform(fields, clipping_given="clipping_norm" in overrides))

    if strict:
        known = set(DIRECT) | set(RENAME) | set(TRANSFORMED) | set(REJECT_IF_SET)
        if plain(fields.get("eval_strategy", ("no", None))[0]) != "no":
            known.add("do_eval")  # HF sets it from eval_strategy, which is converted
        dropped = sorted(n for n, (v, d) in fields.items() if n not in known and not _is_default(v, d))
        for name in dropped:
            why = "irrelevant to the DP trainer" if name in DROP else "not translated by this version of Opake"
            warnings.warn(
                f"from_hf drops {name}={plain(fields[name][0])!r}: {why}.",
                RuntimeWarning,
                stacklevel=3,
            )
    out.update(overrides)
    return cls(**out)


def _transform(fields: dict[str, tuple[Any, Any]], *, clipping_given: bool) -> dict[str, Any]:
    def value(name: str, default: Any = None) -> Any:
        return plain(fields[name][0]) if name in fields else default

    out: dict[str, Any] = {}
    per_device = value("per_device_train_batch_size", 8)
    legacy = value("per_gpu_train_batch_size")
    if legacy is not None:
        per_device = legacy
    accumulation = value("gradient_accumulation_steps", 1)
    out["per_device_train_batch_size"] = per_device * accumulation
    out["microbatch_size"] = per_device
    out["auto_find_microbatch_size"] = bool(value("auto_find_batch_size", False))

    optim = str(value("optim", "adamw"))
    if any(marker in optim for marker in _REFUSED_OPTIM_MARKERS):
        raise ValueError(
            f"optim={optim!r} cannot be converted: 8-bit, paged, Apex-fused and GaLore optimizers have no functional "
            "torchopt equivalent under DP; pass optim='adamw' (or another supported name) as an override."
        )
    out["optim"] = "adafactor" if value("adafactor", False) else _HF_OPTIMS.get(optim, optim)

    if not clipping_given:
        norm = value("max_grad_norm", 1.0)
        if norm is None or not norm > 0:
            raise ValueError(
                f"max_grad_norm={norm!r} disables HF's batch clipping, but DP needs per-example clipping: pass "
                "clipping_norm=... explicitly (math.inf only with privacy_noise_multiplier=0.0)."
            )
        out["clipping_norm"] = float(norm)
    out["use_performance_kernels"] = bool(value("use_liger_kernel", False))
    return out
