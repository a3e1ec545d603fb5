"""TrainingArguments: accepted forms, resolved values, and every construction rule."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import typing

import pytest
import torch

from opake_core.errors import ConfigurationError, InputTypeError, OpakeError, PrivacyBudgetError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.trl import DPOConfig, SFTConfig

DP = {"privacy_target_epsilon": 8.0}
FIXED = {"privacy_noise_multiplier": 1.0}
OFF = {"privacy_noise_multiplier": 0.0}


def make(**kwargs):
    return TrainingArguments(**{**DP, **kwargs}) if not {*kwargs} & {*FIXED, *DP} else TrainingArguments(**kwargs)


def test_seed_example_mf_band():
    args = TrainingArguments(privacy_noise_mechanism="mf_band", privacy_target_epsilon=8.0)
    assert args.sampling_mode == "cyclic_poisson"
    assert args.privacy_noise_mechanism_kwargs == {"bands": 16}
    assert args.privacy_accounting is True


def test_defaults():
    args = make()
    assert args.output_dir == "trainer_output"
    assert args.logging_dir.endswith("runs")
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size, args.microbatch_size) == (
        8,
        8,
        None,
    )
    assert (args.optim, args.lr_scheduler, args.clipping_norm, args.clipping_mode) == (
        "adamw",
        "linear",
        1.0,
        "fixed",
    )
    assert args.sampling_mode == "poisson"
    assert args.privacy_target_delta is None
    assert args.noise_calibration_kwargs == {"min": 0.11, "max": 10.0, "tolerance": 1e-3}
    assert args.report_to == [] and args.include_for_metrics == []
    assert args.data_seed == 42 and args.save_strategy == "steps" and args.eval_strategy == "no"
    assert args.gradient_accumulation_steps == 1 and args.fp16 is False
    assert args.train_batch_size == 8 and args.eval_batch_size == 8
    assert args.device == torch.device("cpu") or torch.cuda.is_available()


def test_transformers_is_not_imported():
    code = "import sys, opake_torch.transformers as t; t.TrainingArguments(privacy_target_epsilon=1.0); "
    code += "assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


ACCEPTED = [
    # (kwargs, attribute, resolved value)
    ({"clipping_norm": 2}, "clipping_norm", 2.0),
    ({"clipping_norm": "0.5"}, "clipping_norm", 0.5),
    ({"clipping_norm": {"fallback": 3.0}}, "clipping_norm", 3.0),
    ({"clipping_norm": {"attn": 0.5, "fallback": 1.0}}, "clipping_norm", {"attn": 0.5, "fallback": 1.0}),
    ({"clipping_norm": '{"attn": 0.5, "fallback": 1}'}, "clipping_norm", {"attn": 0.5, "fallback": 1.0}),
    ({"clipping_norm": r"attn\..*=0.5,fallback=1"}, "clipping_norm", {r"attn\..*": 0.5, "fallback": 1.0}),
    ({"clipping_norm": math.inf, **OFF}, "clipping_norm", math.inf),
    ({"clipping_norm": "inf", **OFF}, "clipping_norm", math.inf),
    ({"warmup_steps": 100}, "warmup_steps", 100),
    ({"warmup_steps": 0.1}, "warmup_steps", 0.1),
    ({"warmup_steps": 50.0}, "warmup_steps", 50),
    ({"logging_steps": 0.05}, "logging_steps", 0.05),
    ({"logging_steps": 10}, "logging_steps", 10),
    ({"eval_strategy": "steps", "logging_steps": 0.25}, "eval_steps", 0.25),
    ({"clipping_mode": "adaptive", "clipping_kwargs": "target_quantile=0.5,clipping_norm_max=10"}, "clipping_kwargs",
     {"target_quantile": 0.5, "clipping_norm_max": 10}),
    ({"clipping_mode": "auto", "clipping_kwargs": '{"gamma": 0.01}'}, "clipping_kwargs", {"gamma": 0.01}),
    ({"noise_calibration_kwargs": "max=20"}, "noise_calibration_kwargs", {"min": 0.11, "max": 20.0, "tolerance": 1e-3}),
    ({"sampling_kwargs": {"truncated_batch_size": 16}}, "sampling_kwargs", {"truncated_batch_size": 16}),
    ({"sampling_mode": "k_out_of_t", "sampling_kwargs": "k=2,allocation=block"}, "sampling_kwargs",
     {"k": 2, "allocation": "block"}),
    ({"privacy_noise_mechanism": "mf_bsr", "privacy_noise_mechanism_kwargs": "beta=0.5"},
     "privacy_noise_mechanism_kwargs", {"bandwidth": 8, "alpha": 1.0, "beta": 0.5}),
    ({"privacy_noise_mechanism": "mf_band", "privacy_noise_mechanism_kwargs": {"bands": 4}},
     "privacy_noise_mechanism_kwargs", {"bands": 4}),
    ({"privacy_noise_mechanism_kwargs": {"compute_dtype": "bfloat16"}}, "privacy_noise_mechanism_kwargs",
     {"compute_dtype": torch.bfloat16}),
    ({"privacy_noise_mechanism_kwargs": "compute_dtype=float64"}, "privacy_noise_mechanism_kwargs",
     {"compute_dtype": torch.float64}),
    ({"lr_scheduler_kwargs": "end_value=0.0", "lr_scheduler": "cosine"}, "lr_scheduler_kwargs", {"end_value": 0.0}),
    ({"optim_args": "flag=true,x=none,name=abc"}, "optim_args", {"flag": True, "x": None, "name": "abc"}),
    ({"performance_kernels_config": "rope=false"}, "performance_kernels_config", {"rope": False}),
    ({"optim": "adamw_torch_fused"}, "optim", "adamw"),
    ({"optim": "adamw_hf"}, "optim", "adamw"),
    ({"optim": "adamw-bc"}, "noise_bias_correction", True),
    ({"lr_scheduler": "constant_with_warmup"}, "lr_scheduler", "constant"),
    ({"microbatch_size": 2}, "per_device_eval_batch_size", 2),
    ({"microbatch_size": 2, "per_device_eval_batch_size": 32}, "per_device_eval_batch_size", 32),
    ({"report_to": "none"}, "report_to", []),
    ({"report_to": "all"}, "report_to", ["all"]),
    ({"report_to": ["tensorboard"]}, "report_to", ["tensorboard"]),
    ({"include_num_input_tokens_seen": True}, "include_num_input_tokens_seen", "all"),
    ({"include_for_metrics": "loss"}, "include_for_metrics", ["loss"]),
    ({"metric_for_best_model": "accuracy"}, "metric_for_best_model", "eval_accuracy"),
    ({"metric_for_best_model": "accuracy"}, "greater_is_better", True),
    ({"metric_for_best_model": "eval_loss"}, "greater_is_better", False),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 100, "eval_steps": 50},
     "metric_for_best_model", "eval_loss"),
    ({"torch_compile_mode": "max-autotune"}, "torch_compile", True),
    ({"torch_compile": True}, "torch_compile_backend", "inductor"),
    ({"use_cpu": True}, "dataloader_pin_memory", False),
    ({"privacy_noise_mechanism": "mf_identity"}, "sampling_mode", "poisson"),
    ({"privacy_noise_mechanism": "mf_identity", "sampling_mode": "balls_in_bins"}, "sampling_mode", "balls_in_bins"),
    ({"privacy_noise_mechanism": "mf_band", "sampling_mode": "b_min_sep"}, "sampling_mode", "b_min_sep"),
    ({"privacy_noise_mechanism": "mf_blt"}, "sampling_mode", "balls_in_bins"),
    ({"privacy_noise_mechanism": "mf_lambda_cgd"}, "privacy_noise_mechanism_kwargs", {"lambda_": 0.5}),
    ({"privacy_noise_mechanism": "mf_bisr"}, "privacy_noise_mechanism_kwargs", {"bandwidth": 4}),
    ({"privacy_noise_mechanism": "mf_blt"}, "privacy_noise_mechanism_kwargs", {"max_buffers": 10}),
    ({**FIXED}, "privacy_accounting", True),  # on by default: a fixed-noise run reports its epsilon
    ({**FIXED, "privacy_accounting": None}, "privacy_accounting", True),  # None means the default
    ({**FIXED, "privacy_accounting": False}, "privacy_accounting", False),  # off only when asked
    ({**FIXED, "privacy_accounting": True}, "privacy_accounting", True),
    ({**OFF}, "privacy_accounting", True),
    ({**FIXED, "privacy_noise_mechanism": "mf_blt"}, "privacy_accounting", True),
    ({**FIXED, "sampling_mode": "k_out_of_t", "sampling_kwargs": {"k": 1, "allocation": "total"}},
     "privacy_accounting", True),
    ({**FIXED, **DP}, "privacy_accounting", True),  # stop-at-epsilon on independent DP-SGD
    ({**OFF, "sampling_mode": "sequential"}, "sampling_mode", "sequential"),
    ({"privacy_target_delta": 1e-5}, "privacy_target_delta", 1e-5),
    ({"cuda_graphs": 8}, "cuda_graphs", 8),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "attr", "expected"), ACCEPTED)
def test_accepted_forms(kwargs, attr, expected):
    assert getattr(make(**kwargs), attr) == expected


REFUSED = [
    # (kwargs, error, key phrase)
    ({"privacy_target_epsilon": None}, PrivacyBudgetError, "neither was provided"),
    ({**OFF, **DP}, PrivacyBudgetError, "non-private path"),
    ({"privacy_noise_multiplier": -1.0}, PrivacyBudgetError, ">= 0"),
    ({"privacy_target_epsilon": 0.0}, PrivacyBudgetError, "> 0"),
    ({"privacy_target_delta": 1.0}, PrivacyBudgetError, r"in \(0, 1\)"),
    ({"privacy_target_delta": 0.0}, PrivacyBudgetError, r"in \(0, 1\)"),
    ({**FIXED, **DP, "privacy_noise_mechanism": "mf_band"}, PrivacyBudgetError, "whole-horizon"),
    ({**FIXED, **DP, "sampling_mode": "k_out_of_t", "sampling_kwargs": {"k": 1, "allocation": "block"}},
     PrivacyBudgetError, "whole-horizon"),
    ({"privacy_accounting": "yes"}, ConfigurationError, "True or False or None"),
    ({**DP, "privacy_accounting": False}, ConfigurationError, "needs the accountant"),
    ({**FIXED, "privacy_noise_mechanism": "mf_blt", "privacy_accounting": False}, ConfigurationError,
     "horizon snapshot"),
    ({"clipping_norm": None}, ConfigurationError, "use math.inf"),
    ({"clipping_norm": True}, InputTypeError, "not a bool"),
    ({"clipping_norm": -1.0}, ConfigurationError, "positive number"),
    ({"clipping_norm": {"attn": 1.0}}, ConfigurationError, "'fallback' key"),
    ({"clipping_norm": {"(": 1.0, "fallback": 1.0}}, ConfigurationError, "regular expression"),
    ({"clipping_norm": "a=1,b"}, ConfigurationError, "key=value"),
    ({"clipping_norm": math.inf, **FIXED}, ConfigurationError, "only with privacy_noise_multiplier=0.0"),
    ({"clipping_norm": {"x": math.inf, "fallback": 1.0}, **FIXED}, ConfigurationError, "only with"),
    ({"clipping_mode": "median"}, ConfigurationError, "clipping_mode must be one of"),
    ({"clipping_mode": "adaptive", "privacy_noise_mechanism": "mf_band"}, ConfigurationError, "constant per-step"),
    ({"clipping_mode": "adaptive", "clipping_norm": {"a": 1.0, "fallback": 1.0}}, ConfigurationError, "per-group"),
    ({"clipping_kwargs": {"gamma": 0.1}}, ConfigurationError, r"unsupported keys for clipping_mode='fixed'.*none"),
    ({"clipping_mode": "adaptive", "clipping_kwargs": {"gamma": 0.1}}, ConfigurationError, "target_quantile"),
    ({"clipping_mode": "adaptive", "clipping_kwargs": {"target_quantile": 1.5}}, ConfigurationError, r"\(0, 1\)"),
    ({"privacy_noise_mechanism": "laplace"}, ConfigurationError, "privacy_noise_mechanism must be one of"),
    ({"privacy_noise_mechanism_kwargs": {"bound": 3.0}}, ConfigurationError, "no matching accountant"),
    ({"privacy_noise_mechanism_kwargs": {"bands": 3}}, ConfigurationError, "Allowed: \\['compute_dtype'\\]"),
    ({"privacy_noise_mechanism_kwargs": {"compute_dtype": "int8"}}, ConfigurationError, "compute_dtype"),
    ({"privacy_noise_mechanism_kwargs": {"compute_dtype": 3}}, InputTypeError, "compute_dtype"),
    ({"privacy_noise_mechanism": "mf_bsr", "privacy_noise_mechanism_kwargs": {"beta": 2.0}}, ConfigurationError,
     "alpha > beta"),
    ({"privacy_noise_mechanism": "mf_band", "privacy_noise_mechanism_kwargs": {"bands": 0}}, ConfigurationError,
     "bands"),
    ({"privacy_noise_mechanism": "mf_band", "sampling_mode": "poisson"}, ConfigurationError, "banded participation"),
    ({"privacy_noise_mechanism": "mf_blt", "sampling_mode": "poisson"}, ConfigurationError, "no matching accountant"),
    ({"sampling_mode": "cyclic_poisson"}, ConfigurationError, "no matching accountant"),
    ({"sampling_kwargs": {"sampling_prob": 0.1}}, ConfigurationError, "derived from the privacy configuration"),
    ({"sampling_kwargs": {"truncated_batch_size": 0}}, ConfigurationError, "truncated_batch_size"),
    ({"sampling_mode": "k_out_of_t", "sampling_kwargs": {"k": 2}}, ConfigurationError, "requires both"),
    ({"sampling_mode": "k_out_of_t", "sampling_kwargs": {"k": 2, "allocation": "x"}}, ConfigurationError,
     "allocation"),
    ({"sampling_mode": "k_out_of_t", "sampling_kwargs": {"truncated_batch_size": 4}}, ConfigurationError,
     "only supported with sampling_mode='poisson'"),
    ({"sampling_mode": "sequential", **FIXED}, ConfigurationError, "no privacy amplification"),
    ({"noise_calibration_kwargs": {"min": 2.0, "max": 1.0}}, ConfigurationError, "min < max"),
    ({"noise_calibration_kwargs": {"tolerance": 0}}, ConfigurationError, "tolerance > 0"),
    ({"noise_calibration_kwargs": {"step": 1}}, ConfigurationError, "unsupported keys"),
    ({"noise_calibration_kwargs": "{bad json"}, ConfigurationError, "not a valid JSON"),
    ({"noise_calibration_kwargs": 3}, InputTypeError, "mapping, a JSON object string"),
    ({"microbatch_size": 16}, ConfigurationError, r"in \[1, per_device_train_batch_size=8\]"),
    ({"microbatch_size": 0}, ConfigurationError, "microbatch_size"),
    ({"per_device_train_batch_size": 0}, ConfigurationError, "per_device_train_batch_size"),
    ({"warmup_steps": True}, ConfigurationError, "a bool, not a number"),
    ({"warmup_steps": -1}, ConfigurationError, "warmup_steps"),
    ({"warmup_steps": 1.5}, ConfigurationError, "integer if bigger than 1"),
    ({"logging_steps": 2.5}, ConfigurationError, "logging_steps must be an integer if bigger than 1"),
    ({"logging_steps": 0}, ConfigurationError, "non-zero logging_steps"),
    ({"save_steps": 0}, ConfigurationError, "save_steps"),
    ({"max_steps": 0}, ConfigurationError, "max_steps"),
    ({"optim": "adamw_8bit"}, ConfigurationError, "no functional torchopt"),
    ({"optim": "paged_adamw_32bit"}, ConfigurationError, "no functional torchopt"),
    ({"optim": "galore_adamw"}, ConfigurationError, "no functional torchopt"),
    ({"optim": "schedule_free_lion"}, ConfigurationError, "optim must be one of"),
    ({"lr_scheduler": "exponential"}, ConfigurationError, "lr_scheduler must be one of"),
    ({"lr_scheduler_kwargs": {"num_cycles": 2}}, ConfigurationError, "unsupported keys"),
    ({"cuda_graphs": True}, ConfigurationError, r"cuda_graphs must be in \[0"),
    ({"cuda_graphs": -1}, ConfigurationError, r"cuda_graphs must be in \[0"),
    ({"cuda_graphs": 4, "torch_compile": True}, ConfigurationError, "mutually exclusive"),
    ({"cuda_graphs": 4, "auto_find_microbatch_size": True}, ConfigurationError, "probed size"),
    ({"torch_compile": True, "auto_find_microbatch_size": True}, ConfigurationError, "128711"),
    ({"torch_compile": True, "gradient_checkpointing": True}, ConfigurationError, "gradient_checkpointing"),
    ({"torch_compile_mode": "fast"}, ConfigurationError, "torch_compile_mode must be one of"),
    ({"logging_strategy": "often"}, ConfigurationError, "logging_strategy must be one of"),
    ({"save_strategy": "best"}, ConfigurationError, "requires metric_for_best_model"),
    ({"save_strategy": "best", "metric_for_best_model": "loss"}, ConfigurationError, "eval_strategy != 'no'"),
    ({"metric_for_best_model": "train_loss"}, ConfigurationError, "memorisation"),
    ({"load_best_model_at_end": True}, ConfigurationError, "requires saving and evaluation"),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch"}, ConfigurationError, "strategy to match"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 300}, ConfigurationError,
     "round multiple"),
    ({"include_for_metrics": ["logits"]}, ConfigurationError, "subset"),
    ({"include_num_input_tokens_seen": "some"}, ConfigurationError, "include_num_input_tokens_seen"),
    ({"label_smoothing_factor": 1.0}, ConfigurationError, "label_smoothing_factor"),
    ({"ddp_backend": "xla"}, ConfigurationError, "ddp_backend must be one of"),
    ({"report_to": 3}, InputTypeError, "report_to"),
    ({"max_length": 0}, ConfigurationError, "max_length"),
    # the values that passed and failed later, at step 1 or in torch (issue 32)
    ({"save_only_model": "False"}, ConfigurationError, "save_only_model must be True or False, got str 'False'"),
    ({"bf16": "yes"}, ConfigurationError, "bf16 must be True or False, got str 'yes'"),
    ({"push_to_hub": "yes"}, ConfigurationError, "push_to_hub must be True or False"),
    ({"torch_compile": "yes"}, ConfigurationError, "torch_compile must be True or False"),
    ({"clipping_norm": 1e300}, ConfigurationError, r"clipping_norm must be in \[1e-12, 1e\+06\]"),
    ({"privacy_noise_multiplier": 1e300}, PrivacyBudgetError, r"privacy_noise_multiplier must be in \[1e-06, 1e\+06\]"),
    ({"privacy_noise_multiplier": 1e-160}, PrivacyBudgetError, "or 0.0 for a non-private run"),
    ({"weight_decay": 1e300}, ConfigurationError, r"weight_decay must be in \[0, 1e\+06\]"),
    ({"pad_to_multiple_of": 10**29}, ConfigurationError, r"pad_to_multiple_of must be in \[1, 2\*\*31 - 1\]"),
    ({"label_names": 7}, ConfigurationError, "label_names must be a list of column names"),
    ({"label_names": "labels"}, ConfigurationError, "label_names must be a list of column names"),
    ({"seed": -1}, ConfigurationError, r"seed must be in \[0, 2\*\*32 - 1\]"),
    ({"learning_rate": 20.0, "weight_decay": 0.1}, ConfigurationError, "learning_rate \\* weight_decay must be <= 1"),
    ({"learning_rate": 0.01, "weight_decay": 0.1, "lr_scheduler_kwargs": {"end_value": 20.0}}, ConfigurationError,
     r"got 20.0 \* 0.1"),
    ({"optim_args": {"weight_decay": 1e3}, "learning_rate": 0.01}, ConfigurationError,
     "learning_rate \\* weight_decay"),
    ({"noise_calibration_kwargs": {"max": 1e300}}, ConfigurationError, r"noise_calibration_kwargs\['max'\]"),
    ({"noise_calibration_kwargs": {"tolerance": 1e-300}}, ConfigurationError, "rounding of epsilon"),
    ({"sampling_kwargs": {"truncated_batch_size": 2**40}}, ConfigurationError, "2\\*\\*31 - 1"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "phrase"), REFUSED)
def test_rules(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        make(**kwargs)


@pytest.mark.parametrize(
    "name",
    [
        "gradient_accumulation_steps", "fp16", "fp16_full_eval", "group_by_length", "length_column_name",
        "dataloader_drop_last", "deepspeed", "accelerator_config", "parallelism_config",
        "tpu_num_cores", "mp_parameters", "half_precision_backend", "fp16_backend", "batch_eval_metrics",
    ],
)  # fmt: skip
def test_unsupported_hf_kwargs_raise_configuration_error(name):
    with pytest.raises(ConfigurationError, match=f"does not support {name}=True: .*Instead"):
        TrainingArguments(privacy_target_epsilon=1.0, **{name: True})


def test_unknown_kwarg_raises_configuration_error():
    with pytest.raises(ConfigurationError, match="unknown argument 'no_such_field'"):
        TrainingArguments(privacy_target_epsilon=1.0, no_such_field=1)


def test_output_dir_positional_and_rest_keyword_only(tmp_path):
    assert TrainingArguments(str(tmp_path), privacy_target_epsilon=1.0).output_dir == str(tmp_path)
    assert TrainingArguments(tmp_path, privacy_target_epsilon=1.0).logging_dir == str(tmp_path / "runs")
    with pytest.raises(TypeError):
        TrainingArguments("out", 16)


def test_shims_refuse_assignment_as_the_constructor_does():
    args = make()
    with pytest.raises(ConfigurationError, match="does not support gradient_accumulation_steps=4: a DP step is one"):
        args.gradient_accumulation_steps = 4
    with pytest.raises(ConfigurationError, match="does not support fp16=True"):
        args.fp16 = True
    args.gradient_accumulation_steps = 1  # Hugging Face's default is accepted
    assert (args.gradient_accumulation_steps, args.fp16) == (1, False)


def test_distributed_properties(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = make(per_device_train_batch_size=16, use_cpu=True, log_on_each_node=False)
    assert args.local_rank == 0 and args.local_process_index == 0
    assert (args.world_size, args.process_index, args.train_batch_size) == (4, 2, 64)
    assert args.device == torch.device("cpu")
    assert not args.should_log and not args.should_save
    assert make(save_on_each_node=True).should_save
    assert make().should_log  # Hugging Face's default log_on_each_node=True: local rank 0 of every node logs


def test_to_dict_is_json_safe_and_round_trips():
    args = make(
        privacy_noise_mechanism_kwargs={"compute_dtype": torch.float64},
        clipping_norm={"attn": 0.5, "fallback": 1.0},
        warmup_steps=0.1,
    )
    data = json.loads(json.dumps(args.to_dict()))
    assert data["privacy_noise_mechanism_kwargs"] == {"compute_dtype": "float64"}
    assert TrainingArguments(**data) == args
    assert dataclasses.replace(args, seed=7).seed == 7


def test_replace_revalidates():
    with pytest.raises(ConfigurationError, match="microbatch_size"):
        dataclasses.replace(make(microbatch_size=4), per_device_train_batch_size=2)


def test_user_mechanism_kwargs_are_not_mutated():
    user = {"beta": 0.5}
    make(privacy_noise_mechanism="mf_bsr", privacy_noise_mechanism_kwargs=user)
    assert user == {"beta": 0.5}


def test_secrets_are_masked_and_hidden_from_repr():
    args = make(hub_token="hf_secret", privacy_noise_seed=987654321)
    assert args.to_dict()["hub_token"] == args.to_dict()["privacy_noise_seed"] == "<SECRET>"
    assert "hf_secret" not in repr(args) and "987654321" not in repr(args) and "987654321" not in str(args)


# -- types and ranges, checked at construction for every field -----------------------------------------------------


def _annotated(cls: type, kinds: set[type]) -> dict[str, bool]:
    """``{name: None allowed}`` of the fields annotated with one of ``kinds`` (alone or with None)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        args = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        optional = type(None) in args
        args.discard(type(None))
        if len(args) == 1 and args <= kinds:
            out[f.name] = optional
    return out


@pytest.mark.parametrize("cls", [TrainingArguments, SFTConfig, DPOConfig], ids=lambda c: c.__name__)
def test_every_bool_field_takes_a_bool_only(cls):
    flags = _annotated(cls, {bool})
    assert len(flags) >= 33  # a new bool field is covered without being listed
    for name in flags:
        for bad in ("False", "yes", "", 0, 1, 1.0, [True]):
            with pytest.raises(ConfigurationError) as refused:
                cls(**FIXED, **{name: bad})
            assert f"{name}=" in str(refused.value) or f"{name} must be True or False" in str(refused.value)
            assert repr(bad) in str(refused.value)
        assert getattr(cls(**FIXED, **{name: False}), name) is False


# Accepted on purpose: documented sentinels, and the noise seed, which is hashed (any int).
SENTINELS = {("max_steps", -1), ("local_rank", -1), ("privacy_noise_seed", 2**70), ("privacy_noise_seed", -1)}


@pytest.mark.parametrize("cls", [TrainingArguments, SFTConfig, DPOConfig], ids=lambda c: c.__name__)
def test_numeric_fields_refuse_values_that_would_overflow(cls):
    """Every numeric field (found from the annotations) with 1e300, 2**70, NaN, inf and -1: a clear error naming the
    field, unless the value is a documented sentinel."""
    numeric = [*_annotated(cls, {int, float}), "clipping_norm"]
    assert len(numeric) >= 30
    for name in numeric:
        for value in (1e300, 2**70, math.nan, math.inf, -1):
            try:
                args = cls(**{**FIXED, name: value})
            except OpakeError as exc:
                assert name in str(exc), (name, value, str(exc))
                continue
            assert (name, value) in SENTINELS, (name, value, getattr(args, name))


def test_a_secret_seed_stays_out_of_the_message():
    with pytest.raises(ConfigurationError) as refused:
        make(privacy_noise_seed="987654321")
    assert "987654321" not in str(refused.value) and "got str" in str(refused.value)


def test_the_largest_accepted_scales_run_a_step_without_overflow(tmp_path):
    """clipping_norm, privacy_noise_multiplier and learning_rate at their limit (1e6 each), plain SGD: one step's
    noise (about 1e12 / 8 per coordinate) times the learning rate stays finite in float32."""
    from tiny_hf import tiny_model, token_data

    from opake_torch.transformers import DPTrainer

    args = TrainingArguments(
        str(tmp_path), clipping_norm=1e6, privacy_noise_multiplier=1e6, learning_rate=1e6, optim="sgd", max_steps=1,
        per_device_train_batch_size=8, use_cpu=True, save_strategy="no", report_to="none", disable_tqdm=True,
        privacy_noise_seed=0, lr_scheduler="constant",
    )  # fmt: skip
    model = tiny_model("llama")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = DPTrainer(model, args, train_dataset=token_data(32))
    trainer.train()
    moved = [(v.detach() - before[k]).abs().max() for k, v in trainer.model.named_parameters()]
    assert all(torch.isfinite(v).all() for v in trainer.model.parameters())
    assert max(moved) > 1e9  # the noise did reach the weights, at its scale
