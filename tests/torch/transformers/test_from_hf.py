"""TrainingArguments.from_hf: renamed, transformed, dropped and refused fields, on real HF argument objects."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

transformers = pytest.importorskip("transformers")

from opake_core.errors import ConfigurationError, PrivacyBudgetError  # noqa: E402
from opake_torch.transformers import TrainingArguments, _from_hf  # noqa: E402

DP = {"privacy_target_epsilon": 8.0}


@pytest.fixture
def hf(tmp_path):
    def build(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HF's own deprecation notices are not under test
            return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)

    return build


def convert(hf_args, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return TrainingArguments.from_hf(hf_args, **{**DP, **overrides})


CONVERTED = [
    # (HF kwargs, opake attribute, expected)
    ({}, "per_device_train_batch_size", 8),
    ({}, "microbatch_size", 8),
    ({}, "optim", "adamw"),
    ({}, "clipping_norm", 1.0),
    ({}, "use_performance_kernels", False),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, "per_device_train_batch_size", 8),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, "microbatch_size", 2),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "per_device_eval_batch_size": 16},
     "per_device_eval_batch_size", 16),
    ({"auto_find_batch_size": True}, "auto_find_microbatch_size", True),
    ({"lr_scheduler_type": "cosine"}, "lr_scheduler", "cosine"),
    ({"lr_scheduler_type": "constant_with_warmup"}, "lr_scheduler", "constant"),
    ({"optim": "adamw_torch"}, "optim", "adamw"),
    ({"optim": "adafactor"}, "optim", "adafactor"),
    ({"optim": "sgd"}, "optim", "sgd"),
    ({"max_grad_norm": 0.5}, "clipping_norm", 0.5),
    ({"use_liger_kernel": True}, "use_performance_kernels", True),
    ({"activation_checkpointing": True}, "gradient_checkpointing", True),
    ({"learning_rate": 1e-3, "weight_decay": 0.1}, "weight_decay", 0.1),
    ({"warmup_steps": 0.1}, "warmup_steps", 0.1),
    ({"logging_steps": 0.05}, "logging_steps", 0.05),
    ({"eval_strategy": "steps", "eval_steps": 50}, "eval_steps", 50),
    ({"save_strategy": "epoch", "save_total_limit": 2}, "save_total_limit", 2),
    ({"num_train_epochs": 1.5, "max_steps": 100}, "max_steps", 100),
    ({"bf16": True}, "bf16", True),
    ({"seed": 3}, "data_seed", 3),
    ({"label_names": ["y"]}, "label_names", ["y"]),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 100, "eval_steps": 50},
     "metric_for_best_model", "eval_loss"),
    ({"include_for_metrics": ["loss"]}, "include_for_metrics", ["loss"]),
    # honoured: same name and meaning
    ({"do_train": True}, "do_train", True),
    ({"do_predict": True}, "do_predict", True),
    ({"do_eval": True}, "do_eval", True),
    ({"eval_strategy": "steps", "eval_steps": 50}, "do_eval", True),
    ({"log_level": "info"}, "log_level", "info"),
    ({"log_level_replica": "error"}, "log_level_replica", "error"),
    ({"log_on_each_node": False}, "log_on_each_node", False),
    ({"eval_delay": 2}, "eval_delay", 2),
    ({"project": "dp"}, "project", "dp"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
     "gradient_checkpointing_kwargs", {"use_reentrant": False}),
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
     "gradient_checkpointing_kwargs", {"use_reentrant": False}),
]  # fmt: skip


@pytest.mark.parametrize(("hf_kwargs", "attr", "expected"), CONVERTED)
def test_converted_fields(hf, hf_kwargs, attr, expected):
    assert getattr(convert(hf(**hf_kwargs)), attr) == expected


def test_output_dir_and_privacy_overrides(hf, tmp_path):
    args = convert(hf(), privacy_target_delta=1e-6)
    assert args.output_dir == str(tmp_path)
    assert (args.privacy_target_epsilon, args.privacy_target_delta, args.privacy_accounting) == (
        8.0,
        1e-6,
        True,
    )


OVERRIDES = [
    ({"max_grad_norm": 0.5}, {"clipping_norm": 2.0}, "clipping_norm", 2.0),
    ({"max_grad_norm": 0.0}, {"clipping_norm": 2.0}, "clipping_norm", 2.0),
    ({"use_liger_kernel": True}, {"use_performance_kernels": False}, "use_performance_kernels", False),
    ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, {"microbatch_size": 1},
     "microbatch_size", 1),
    ({"optim": "adamw_torch"}, {"optim": "adamw-bc"}, "optim", "adamw-bc"),
    ({}, {"privacy_noise_mechanism": "mf_band"}, "sampling_mode", "cyclic_poisson"),
]  # fmt: skip


@pytest.mark.parametrize(("hf_kwargs", "overrides", "attr", "expected"), OVERRIDES)
def test_overrides_win(hf, hf_kwargs, overrides, attr, expected):
    assert getattr(convert(hf(**hf_kwargs), **overrides), attr) == expected


REFUSED = [
    ({"fp16": True}, "fp16=True cannot be converted: fp16 loss scaling"),
    ({"fsdp": "hybrid_shard"}, "hybrid sharding.*not supported yet"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0.*accountant"),
    ({"optim": "adamw_8bit"}, "optim='adamw_8bit'.*torchopt"),
    ({"optim": "paged_adamw_32bit"}, "optim='paged_adamw_32bit'.*torchopt"),
    ({"train_sampling_strategy": "group_by_length"}, "DP sampler owns batch composition"),
    ({"max_grad_norm": 0.0}, "per-example clipping"),
]


@pytest.mark.parametrize(("hf_kwargs", "phrase"), REFUSED)
def test_refused_fields(hf, hf_kwargs, phrase):
    try:
        hf_args = hf(**hf_kwargs)
    except (ValueError, ImportError) as exc:  # HF itself may refuse the value on a CPU-only host
        if "fp16" in hf_kwargs or "fsdp" in hf_kwargs:
            hf_args = hf()
            object.__setattr__(hf_args, next(iter(hf_kwargs)), next(iter(hf_kwargs.values())))
        else:
            raise exc
    with pytest.raises(ValueError, match=phrase):
        TrainingArguments.from_hf(hf_args, **DP)


DROPPED = [
    {"hub_strategy": "end"},
    {"batch_eval_metrics": True},
    {"dataloader_drop_last": True},
    {"eval_accumulation_steps": 4},
    {"ddp_find_unused_parameters": True},
    {"eval_do_concat_batches": False},
]


@pytest.mark.parametrize("hf_kwargs", DROPPED)
def test_dropped_fields_warn_when_strict(hf, hf_kwargs):
    hf_args = hf(**hf_kwargs)
    (name,) = hf_kwargs
    with pytest.warns(RuntimeWarning, match=f"drops {name}="):
        TrainingArguments.from_hf(hf_args, **DP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        args = TrainingArguments.from_hf(hf_args, strict=False, **DP)
    assert name not in args.to_dict()


def test_defaults_convert_without_warnings(hf):
    convert(hf())  # RuntimeWarning is an error in convert()


def test_every_hf_field_is_classified():  # tests/torch/transformers/test_hf_fields.py checks the tables in depth
    known = set(_from_hf.HONOURED) | set(_from_hf.ALIASES) | set(_from_hf.INERT) | set(_from_hf.REFUSED)
    missing = sorted(f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init)
    assert [n for n in missing if n not in known] == []


def test_honoured_and_aliased_fields_exist_on_opake_arguments():
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(_from_hf.HONOURED) <= ours
    assert set(_from_hf.ALIASES.values()) <= ours


def test_requires_a_dp_knob(hf):
    with pytest.raises(PrivacyBudgetError, match="carry no privacy budget"):
        TrainingArguments.from_hf(hf())
    assert TrainingArguments.from_hf(hf(), privacy_noise_multiplier=0.0).privacy_noise_multiplier == 0.0


def test_rejects_non_hf_input():
    with pytest.raises(TypeError, match=r"transformers\.TrainingArguments"):
        TrainingArguments.from_hf(TrainingArguments(**DP), **DP)


def test_unknown_override_is_refused_with_a_hint(hf):
    with pytest.raises(ConfigurationError, match="unknown argument 'no_such_field'"):
        TrainingArguments.from_hf(hf(), no_such_field=1, **DP)
    with pytest.raises(ConfigurationError, match="Did you mean 'clipping_norm'"):
        TrainingArguments.from_hf(hf(), clipping_nrom=1.0, **DP)


@pytest.mark.parametrize(
    ("overrides", "attr", "expected"),
    [
        ({"target_epsilon": 3.0}, "privacy_target_epsilon", 3.0),
        ({"noise_multiplier": 0.0}, "privacy_noise_multiplier", 0.0),
        ({**DP, "target_delta": 1e-7}, "privacy_target_delta", 1e-7),
        ({**DP, "max_grad_norm": 0.25}, "clipping_norm", 0.25),
        ({**DP, "lr_scheduler_type": "cosine"}, "lr_scheduler", "cosine"),
    ],
)
def test_overrides_accept_hugging_face_and_opacus_names(hf, overrides, attr, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert getattr(TrainingArguments.from_hf(hf(max_grad_norm=0.5), **overrides), attr) == expected
