"""The Hugging Face names of training arguments, and the conversion of a ``transformers.TrainingArguments``.

The tables below are the one place that says what Opake does with a Hugging Face (or Opacus) argument name. Every
field of the installed ``transformers.TrainingArguments`` is in exactly one of them, and a test enforces it, so that a
new upstream field fails a test rather than a user:

- ``HONOURED``: a field of Opake's ``TrainingArguments`` with the same name and Hugging Face's meaning.
- ``ALIASES``: another name for one of Opake's fields (``lr_scheduler_type`` is ``lr_scheduler``).
- ``INERT``: accepted, with no effect on a private run, and harmless; setting it to a non-default value warns once.
- ``REFUSED``: a non-default value has no meaning under DP (or is not implemented); refused with the reason and what
  to use instead. The Hugging Face default is accepted (``gradient_accumulation_steps=1``, ``fp16=False``).

``TrainingArguments(...)`` accepts all of these names (:func:`translate`, before its ``__init__``);
:func:`from_hf` applies the same tables to a ``transformers.TrainingArguments`` object, with three differences:
it folds ``gradient_accumulation_steps`` into the batch (``TRANSFORMED``), drops the refused names that only
concern batching or evaluation with a warning instead of refusing them (``DROPPED_BY_FROM_HF``), and warns about
non-default fields it does not know (a newer transformers). Legacy names (``per_gpu_*``, ``evaluation_strategy``,
``adafactor``, ``push_to_hub_*``) are read with ``getattr`` so that older transformers versions convert as well.

The conversion is one-way. Upstream configs carry no privacy budget, so a DP knob must come in ``overrides``.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_torch.transformers._parsing import plain

__all__ = [
    "ALIASES",
    "DROPPED_BY_FROM_HF",
    "HONOURED",
    "INERT",
    "REFUSED",
    "TRANSFORMED",
    "from_hf",
    "refusal",
    "translate",
]

HONOURED = (
    "output_dir", "overwrite_output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
    "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_kwargs", "warmup_steps", "optim", "optim_args",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "average_tokens_across_devices",
    "label_smoothing_factor", "bf16", "bf16_full_eval", "tf32", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode", "logging_dir",
    "logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node", "log_level", "log_level_replica",
    "include_num_input_tokens_seen", "include_tokens_per_second", "disable_tqdm", "report_to", "run_name", "project",
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "eval_strategy", "eval_steps", "eval_delay",
    "prediction_loss_only", "eval_on_start", "include_for_metrics", "save_only_model", "save_strategy", "save_steps",
    "save_on_each_node", "save_total_limit", "save_safetensors", "push_to_hub", "hub_token", "hub_private_repo",
    "hub_model_id", "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "seed", "data_seed", "use_cpu", "dataloader_num_workers",
    "dataloader_pin_memory", "remove_unused_columns", "label_names", "ddp_backend", "ddp_timeout", "fsdp",
    "fsdp_config", "resume_from_checkpoint", "local_rank", "do_train", "do_eval", "do_predict", "enable_jit_checkpoint",
    "full_determinism",
)  # fmt: skip

ALIASES = {
    "lr_scheduler_type": "lr_scheduler",
    "max_grad_norm": "clipping_norm",  # HF clips the batch gradient; Opake clips each example's gradient
    "auto_find_batch_size": "auto_find_microbatch_size",
    "use_liger_kernel": "use_performance_kernels",
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    "evaluation_strategy": "eval_strategy",  # legacy transformers
    "per_gpu_train_batch_size": "per_device_train_batch_size",  # legacy transformers
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",  # legacy transformers
    "push_to_hub_model_id": "hub_model_id",  # legacy transformers
    "push_to_hub_token": "hub_token",  # legacy transformers
    "target_epsilon": "privacy_target_epsilon",  # Opacus
    "target_delta": "privacy_target_delta",  # Opacus
    "noise_multiplier": "privacy_noise_multiplier",  # Opacus
}

_DDP = "the trainer runs its own DDP (a cross-rank sum of the clipped per-example gradients before one noise draw), "
_DDP += "not torch's DistributedDataParallel, so this DistributedDataParallel knob has nothing to tune"
_LOADER = "training fetches the rows each step draws in the main process, and evaluation's loaders take only "
_LOADER += "dataloader_num_workers and dataloader_pin_memory, so this DataLoader setting has nothing to tune"
_HUB = "DPTrainer pushes once, at the end of training (push_to_hub=True) or when push_to_hub() is called"
_LEGACY = "a setting of older transformers versions with no effect on this trainer"
# name -> (the Hugging Face default, why it has no effect here)
INERT: dict[str, tuple[Any, str]] = {
    "optim_target_modules": (None, "it only serves GaLore/APOLLO optimizers, which are refused under DP"),
    "liger_kernel_config": (
        None,
        "Liger's kernel switches do not apply to Opake's kernels; use use_performance_kernels and "
        "performance_kernels_config",
    ),
    "use_cache": (
        False,
        "the trainer leaves the model's config.use_cache as loaded; a KV cache does not change the per-example "
        "gradients",
    ),
    "torch_empty_cache_steps": (None, "the trainer empties the allocator cache only to retry after an out-of-memory"),
    "logging_nan_inf_filter": (
        True,
        "the logged loss always leaves non-finite step losses out of its mean (and counts them), Hugging Face's "
        "default",
    ),
    "eval_use_gather_object": (False, "evaluation collects tensors only; there are no Python objects to gather"),
    "eval_accumulation_steps": (None, "evaluation already moves every batch's outputs to the CPU"),
    "hub_strategy": ("every_save", _HUB),
    "hub_always_push": (False, _HUB),
    "hub_revision": (None, _HUB + "; pass revision= to push_to_hub() to push to another branch"),
    "dataloader_persistent_workers": (False, _LOADER),
    "dataloader_prefetch_factor": (None, _LOADER),
    "dataloader_multiprocessing_context": (None, _LOADER),
    "dataloader_in_order": (True, _LOADER),
    "ddp_find_unused_parameters": (None, _DDP),
    "ddp_bucket_cap_mb": (None, _DDP),
    "ddp_broadcast_buffers": (None, _DDP),
    "ddp_static_graph": (None, _DDP),
    "debug": ("", "Hugging Face's underflow/overflow and TPU debug hooks are not installed"),
    "skip_memory_metrics": (True, "the trainer adds no memory-profiler metrics"),
    "tpu_metrics_debug": (False, _LEGACY),
    "ray_scope": ("last", _LEGACY),
    "torchdynamo": (None, _LEGACY + "; use torch_compile_backend"),
    "use_mps_device": (False, _LEGACY),
    "use_ipex": (False, _LEGACY),
    "jit_mode_eval": (False, _LEGACY),
    "past_index": (-1, _LEGACY),
    "split_batches": (None, _LEGACY),
    "dispatch_batches": (None, _LEGACY),
    "use_seedable_sampler": (True, _LEGACY),
    "push_to_hub_organization": (None, _LEGACY + "; use hub_model_id='organization/name'"),
    "use_legacy_prediction_loop": (False, _LEGACY),
}

_BF16 = "use bf16=True (native bf16 autocast, no loss scaler)"
_FP16 = "fp16 loss scaling adds a per-example unscale before clipping, and fp16 is not a supported precision"
_SHARDING = "DeepSpeed's and Accelerate's engines shard gradients that per-example clipping must see first"
_TORCHRUN = "use the built-in DDP (torchrun)"
_FSDP = "use fsdp='full_shard' under torchrun (PyTorch's FSDP2), or the built-in DDP"
# name -> (the Hugging Face default, why a non-default value is refused, what to do instead)
REFUSED: dict[str, tuple[Any, str, str]] = {
    "gradient_accumulation_steps": (
        1,
        "a DP step is one Poisson draw: accumulation would change the sampled batch the accountant sees",
        "raise per_device_train_batch_size (the expected batch) and set microbatch_size to bound memory",
    ),
    "fp16": (False, _FP16, _BF16),
    "fp16_full_eval": (False, _FP16, "use bf16_full_eval=True"),
    "fp16_opt_level": ("O1", _FP16 + " (Apex AMP)", _BF16),
    "half_precision_backend": ("auto", _FP16, _BF16),
    "fp16_backend": ("auto", _FP16, _BF16),
    "train_sampling_strategy": (
        "random",
        "the DP sampler owns batch composition: Poisson amplification needs every example drawn independently with "
        "the same probability, which sequential, length-grouped or rebalanced batches break",
        "leave it unset and choose the DP sampler with sampling_mode",
    ),
    "group_by_length": (
        False,
        "length-bucketed batches break the equal inclusion probability that Poisson amplification relies on",
        "leave examples unsorted; set pad_to_multiple_of to bound padding",
    ),
    "length_column_name": (
        "length",
        "it only serves length-grouped sampling, which breaks the equal inclusion probability of Poisson sampling",
        "remove it; set pad_to_multiple_of to bound padding",
    ),
    "dataloader_drop_last": (
        False,
        "training batches come from the DP sampler (variable size by design) and the eval loader keeps every example",
        "remove it; the sampler owns batch composition",
    ),
    "neftune_noise_alpha": (
        None,
        "NEFTune adds data-dependent embedding noise that the privacy accountant does not model",
        "remove it; the DP noise is the only noise the guarantee accounts for",
    ),
    "deepspeed": (None, _SHARDING, _FSDP),
    "parallelism_config": (None, _SHARDING, _FSDP),
    "accelerator_config": (
        None,
        "the trainer drives DDP itself; Accelerate's batch dispatch would bypass the DP sampler",
        _TORCHRUN,
    ),
    "tpu_num_cores": (None, "TPU/XLA is not a supported backend", "run on CUDA or CPU"),
    "mp_parameters": ("", "SageMaker model parallelism is not a supported backend", _TORCHRUN),
    "batch_eval_metrics": (
        False,
        "streaming metric reduction is not implemented",
        "remove it; compute_metrics is called once over the whole eval set",
    ),
    "eval_do_concat_batches": (
        True,
        "evaluation always concatenates (and pads) the batches",
        "remove it; compute_metrics receives arrays",
    ),
    "include_inputs_for_metrics": (False, "it is a legacy name", "use include_for_metrics=['inputs']"),
}

# from_hf folds these into Opake's fields itself (batch, optimizer, clipping, kernels, sampler).
TRANSFORMED = (
    "per_device_train_batch_size", "per_gpu_train_batch_size", "gradient_accumulation_steps", "auto_find_batch_size",
    "optim", "adafactor", "max_grad_norm", "use_liger_kernel",
)  # fmt: skip
# Refused by the constructor, but dropped with a warning by from_hf: they only concern batching or evaluation,
# which the DP trainer owns, so a config written for transformers.Trainer still converts.
DROPPED_BY_FROM_HF = (
    "dataloader_drop_last", "length_column_name", "tpu_num_cores", "batch_eval_metrics", "eval_do_concat_batches",
    "include_inputs_for_metrics",
)  # fmt: skip
_REFUSED_OPTIM_MARKERS = ("8bit", "paged", "apex", "galore", "bnb", "lomo")
# HF names whose optimizer has the same update here (the 32-bit bitsandbytes Lion is Lion); "rmsprop", "adagrad",
# "ademamix", "schedule_free_adamw" and "stable_adamw" keep their names. Refused: the schedule-free RAdam and SGD
# (another update than the wrapper of those names here).
_HF_OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adafactor": "adafactor",
              "sgd": "sgd", "lion_32bit": "lion", "rmsprop": "rmsprop", "adagrad": "adagrad", "ademamix": "ademamix",
              "schedule_free_adamw": "schedule_free_adamw", "stable_adamw": "stable_adamw"}  # fmt: skip


def refusal(name: str) -> str:
    """Why a non-default value of the ``REFUSED`` name is refused, and what to do instead."""
    _, why, instead = REFUSED[name]
    return f"{why}. Instead, {instead}."


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


def _given_default(value: Any, default: Any) -> bool:
    if isinstance(value, bool) and isinstance(default, int) and not isinstance(default, bool):
        return False  # gradient_accumulation_steps=True is not the count 1
    try:
        return _is_default(value, default)
    except Exception:  # an exotic value (an array, a tensor) is not a default
        return False


def _unknown_name(cls: type, name: str) -> ConfigurationError:
    candidates = [f.name for f in dataclasses.fields(cls) if f.init] + list(ALIASES)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    close += [c for c in candidates if c.endswith(f"_{name}") and c not in close]  # epsilon -> privacy_target_epsilon
    named = [f"{c!r} (= {ALIASES[c]!r})" if c in ALIASES else repr(c) for c in close[:3]]
    hint = f" Did you mean {' or '.join(named)}?" if named else ""
    return ConfigurationError(
        f"{cls.__name__} got an unknown argument {name!r}.{hint} Every accepted name, Hugging Face's and Opacus' "
        "included, is listed on the 'Training arguments' page of the Opake documentation."
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


def translate(cls: type, kwargs: dict[str, Any], *, warned: set[str]) -> dict[str, Any]:
    """``kwargs`` of ``cls(...)`` (Opake's ``TrainingArguments`` or a subclass) with Opake's names: fields kept,
    aliases renamed, inert names dropped (a non-default value warns, once per name in ``warned``), refused names
    raised (unless at Hugging Face's default), unknown names raised with a hint."""
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # Opake field -> the name it was given under
    for name, value in kwargs.items():
        if name in own:
            target = name
        elif name in ALIASES:
            target, value = ALIASES[name], _alias_value(name, value)
        elif name in REFUSED:
            if not _given_default(value, REFUSED[name][0]):
                raise ConfigurationError(f"{cls.__name__} does not support {name}={plain(value)!r}: {refusal(name)}")
            continue
        elif name in INERT:
            if not _given_default(value, INERT[name][0]) and name not in warned:
                warned.add(name)
                warnings.warn(
                    f"{cls.__name__} ignores {name}={plain(value)!r}: {INERT[name][1]}.", RuntimeWarning, stacklevel=4
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


def _field_values(hf_args: Any) -> dict[str, tuple[Any, Any]]:
    """``{name: (value, default)}`` for every init field of the HF dataclass."""
    return {f.name: (getattr(hf_args, f.name), _default_of(f)) for f in dataclasses.fields(hf_args) if f.init}


def from_hf(cls: type, hf_args: Any, *, strict: bool = True, **overrides: Any) -> Any:
    """Translate ``hf_args`` (a ``transformers.TrainingArguments``) into ``cls`` (Opake's ``TrainingArguments``).

    Args:
        cls: the Opake ``TrainingArguments`` class (or a subclass).
        hf_args: a ``transformers.TrainingArguments`` instance.
        strict: warn (``RuntimeWarning``) about non-default fields that are dropped; ``False`` drops silently.
        **overrides: Opake fields (or the names ``cls`` accepts, such as ``target_epsilon``), applied last. Must
            include ``privacy_noise_multiplier`` or ``privacy_target_epsilon``.

    Raises:
        TypeError: ``hf_args`` is not a ``transformers.TrainingArguments``.
        PrivacyBudgetError: no DP knob in ``overrides``.
        ConfigurationError: a field set to a value that has no meaning under DP (with the per-field reason), or an
            unknown override.
    """
    import transformers

    if not isinstance(hf_args, transformers.TrainingArguments):
        raise TypeError(
            f"from_hf expects a transformers.TrainingArguments, got {type(hf_args).__name__}. "
            "Build opake_torch.transformers.TrainingArguments directly for other inputs."
        )
    translate = getattr(cls, "_translate_kwargs", None)
    if translate is not None:
        overrides = translate(overrides)
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

    for name in REFUSED:
        if name in TRANSFORMED or name in DROPPED_BY_FROM_HF:
            continue
        if name in fields and not _is_default(*fields[name]):
            raise ConfigurationError(f"{name}={plain(fields[name][0])!r} cannot be converted: {refusal(name)}")

    out: dict[str, Any] = {}
    for name in HONOURED:
        if name in fields and name not in TRANSFORMED:
            out[name] = plain(fields[name][0])
    for old, new in ALIASES.items():
        if old in fields and old not in TRANSFORMED and (new not in out or not _is_default(*fields[old])):
            out[new] = plain(fields[old][0])
    out.update(_transform(fields, clipping_given="clipping_norm" in overrides))

    if strict:
        known = set(HONOURED) | set(ALIASES) | set(TRANSFORMED) | (set(REFUSED) - set(DROPPED_BY_FROM_HF))
        dropped = sorted(n for n, (v, d) in fields.items() if n not in known and not _is_default(v, d))
        for name in dropped:
            if name in INERT:
                why = INERT[name][1]
            elif name in DROPPED_BY_FROM_HF:
                why = REFUSED[name][1]
            else:
                why = "not translated by this version of Opake"
            warnings.warn(f"from_hf drops {name}={plain(fields[name][0])!r}: {why}.", RuntimeWarning, stacklevel=3)
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
        raise ConfigurationError(
            f"optim={optim!r} cannot be converted: 8-bit, paged, Apex-fused and GaLore optimizers have no functional "
            "torchopt equivalent under DP; pass optim='adamw' (or another supported name) as an override."
        )
    if optim in ("schedule_free_radam", "schedule_free_sgd"):
        raise ConfigurationError(
            f"optim={optim!r} cannot be converted: Hugging Face's is the authors' {optim} optimizer, whose update "
            f"(its own averaging weights and warm-up) differs from opake_core.optim.schedule_free around "
            f"{optim.removeprefix('schedule_free_')}. Convert with optim='schedule_free_adamw' in the Hugging Face "
            f"arguments (the same update as Hugging Face's), or build TrainingArguments(optim={optim!r}) directly for "
            "that wrapper."
        )
    out["optim"] = "adafactor" if value("adafactor", False) else _HF_OPTIMS.get(optim, optim)

    if not clipping_given:
        norm = value("max_grad_norm", 1.0)
        if norm is None or not norm > 0:
            raise ConfigurationError(
                f"max_grad_norm={norm!r} disables HF's batch clipping, but DP needs per-example clipping: pass "
                "clipping_norm=... explicitly (math.inf only with privacy_noise_multiplier=0.0)."
            )
        out["clipping_norm"] = float(norm)
    out["use_performance_kernels"] = bool(value("use_liger_kernel", False))
    return out
