"""Every Hugging Face argument name against the real field list of the installed transformers: each one is honoured,
an alias, inert or refused (the tables of ``_from_hf``), so that a new upstream field fails here instead of in a
user's script. Also the Opacus names, the did-you-mean hint for unknown names, and ``as_training_arguments``."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest

transformers = pytest.importorskip("transformers")

from opake_core.errors import ConfigurationError, InputTypeError, PrivacyBudgetError  # noqa: E402
from opake_torch.transformers import TrainingArguments, arguments  # noqa: E402
from opake_torch.transformers import _from_hf as hf  # noqa: E402
from opake_torch.transformers.arguments import ParallelMode, as_training_arguments  # noqa: E402

DP = {"privacy_target_epsilon": 8.0}
FIXED = {"privacy_noise_multiplier": 1.0}
HF_FIELDS = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
OURS = {f.name for f in dataclasses.fields(TrainingArguments)}
TABLES = {"honoured": set(hf.HONOURED), "alias": set(hf.ALIASES), "inert": set(hf.INERT), "refused": set(hf.REFUSED)}


def hf_default(name):
    f = next(f for f in dataclasses.fields(transformers.TrainingArguments) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def non_default(default):
    """A value that is not Hugging Face's default (nor equivalent to it)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, str):
        return default + "_other" if default else "other"
    return "other"  # None


@pytest.fixture
def fresh_inert_warnings(monkeypatch):
    monkeypatch.setattr(arguments, "_WARNED_INERT", set())


# -- the tables ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HF_FIELDS)
def test_every_installed_hf_field_is_in_exactly_one_table(name):
    tables = [kind for kind, names in TABLES.items() if name in names]
    assert len(tables) == 1, (
        f"transformers.TrainingArguments.{name} is in {tables or 'no table'}: classify it in exactly one of "
        "HONOURED, ALIASES, INERT or REFUSED (opake_torch/transformers/_from_hf.py) and document it in "
        "docs/arguments.md"
    )


def test_table_targets_are_opake_fields_and_the_rest_are_not():
    assert set(hf.HONOURED) <= OURS
    assert set(hf.ALIASES.values()) <= OURS
    assert not (set(hf.ALIASES) | set(hf.INERT) | set(hf.REFUSED)) & OURS
    assert set(hf.TRANSFORMED) <= set(hf.HONOURED) | set(hf.ALIASES) | set(hf.REFUSED) | {"adafactor"}
    assert set(hf.DROPPED_BY_FROM_HF) <= set(hf.REFUSED)


@pytest.mark.parametrize("name", sorted((set(hf.INERT) | set(hf.REFUSED)) & set(HF_FIELDS)))
def test_table_defaults_are_the_installed_defaults(name):
    default = (hf.INERT.get(name) or hf.REFUSED[name])[0]
    assert hf._is_default(hf_default(name), default), (name, hf_default(name), default)


def test_the_tables_sizes():
    installed = set(HF_FIELDS)
    sizes = {kind: len(names & installed) for kind, names in TABLES.items()}
    assert sum(sizes.values()) == len(installed)
    if transformers.__version__.startswith("5.24."):  # the numbers docs/arguments.md states
        assert sizes == {"honoured": 75, "alias": 6, "inert": 21, "refused": 12}


def test_every_hf_default_is_accepted_silently():
    values = {name: hf_default(name) for name in HF_FIELDS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = TrainingArguments(**values, **DP)
    assert (args.optim, args.lr_scheduler, args.clipping_norm, args.gradient_checkpointing) == (
        "adamw",
        "linear",
        1.0,
        False,
    )
    assert set(args.to_dict()) == OURS  # nothing but Opake's fields is stored


# -- aliases ---------------------------------------------------------------------------------------------------------

ALIAS_VALUES = {
    "lr_scheduler_type": ("cosine", "cosine"),
    "max_grad_norm": (0.5, 0.5),
    "auto_find_batch_size": (True, True),
    "use_liger_kernel": (True, True),
    "activation_checkpointing": (True, True),
    "activation_checkpointing_kwargs": ({"use_reentrant": False}, {"use_reentrant": False}),
    "evaluation_strategy": ("epoch", "epoch"),
    "per_gpu_train_batch_size": (16, 16),
    "per_gpu_eval_batch_size": (4, 4),
    "push_to_hub_model_id": ("me/model", "me/model"),
    "push_to_hub_token": ("hf_x", "hf_x"),
    "target_epsilon": (3.0, 3.0),
    "target_delta": (1e-6, 1e-6),
    "noise_multiplier": (0.5, 0.5),
}


def test_every_alias_has_a_case():
    assert set(ALIAS_VALUES) == set(hf.ALIASES)


@pytest.mark.parametrize("name", sorted(ALIAS_VALUES))
def test_alias_maps_to_its_field(name):
    value, expected = ALIAS_VALUES[name]
    target = hf.ALIASES[name]
    base = DP if target in ("privacy_noise_multiplier", "privacy_target_delta") else FIXED
    args = TrainingArguments(**base, **{name: value})
    assert getattr(args, target) == expected
    assert name not in args.to_dict()


@pytest.mark.parametrize("name", sorted(ALIAS_VALUES))
def test_alias_and_its_field_together(name):
    value, _ = ALIAS_VALUES[name]
    target = hf.ALIASES[name]
    base = {} if target.startswith("privacy_") else FIXED
    base = {**DP, **base} if target in ("privacy_noise_multiplier", "privacy_target_delta") else base
    if target == "privacy_target_epsilon":
        base = FIXED
    assert getattr(TrainingArguments(**base, **{name: value, target: value}), target) == value  # same value: fine
    other = {"lr_scheduler": "constant", "eval_strategy": "no", "hub_model_id": "you/other", "hub_token": "hf_y"}
    different = other.get(target, not value if isinstance(value, bool) else None)
    if isinstance(value, int | float) and not isinstance(value, bool):
        different = value / 2
    if isinstance(value, dict):
        different = {"use_reentrant": True}
    with pytest.raises(ConfigurationError, match=f"both set TrainingArguments.{target}; pass only one"):
        TrainingArguments(**base, **{name: value, target: different})


def test_max_grad_norm_is_the_per_example_bound():
    assert TrainingArguments(max_grad_norm=2.0, **FIXED).clipping_norm == 2.0
    for off in (0, 0.0, None, -1.0):
        with pytest.raises(ConfigurationError, match=r"means 'no clipping' in transformers.*each example's gradient"):
            TrainingArguments(max_grad_norm=off, **FIXED)


def test_opacus_names():
    args = TrainingArguments(target_epsilon=3.0, target_delta=1e-6, max_grad_norm=1.5)
    assert (args.privacy_target_epsilon, args.privacy_target_delta, args.clipping_norm) == (3.0, 1e-6, 1.5)
    assert TrainingArguments(noise_multiplier=0.8).privacy_noise_multiplier == 0.8


# -- honoured ---------------------------------------------------------------------------------------------------------


def test_script_flags_are_stored_with_hf_meaning():
    args = TrainingArguments(do_train=True, do_predict=True, **FIXED)
    assert (args.do_train, args.do_eval, args.do_predict) == (True, False, True)
    assert TrainingArguments(eval_strategy="epoch", **FIXED).do_eval  # as in HF: evaluating means do_eval
    with pytest.raises(ConfigurationError, match="do_train must be True or False"):
        TrainingArguments(do_train="yes", **FIXED)


def test_log_levels(monkeypatch):
    assert TrainingArguments(log_level="info", **FIXED).get_process_log_level() == logging.INFO
    assert TrainingArguments(log_level="detail", **FIXED).get_process_log_level() == logging.DEBUG
    monkeypatch.setattr(logging.getLogger("transformers"), "level", logging.ERROR)
    assert TrainingArguments(**FIXED).get_process_log_level() == logging.ERROR  # "passive" keeps the level
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    replica = TrainingArguments(log_level="debug", log_level_replica="critical", **FIXED)
    assert not replica.should_log and replica.get_process_log_level() == logging.CRITICAL
    with pytest.raises(ConfigurationError, match="log_level must be one of"):
        TrainingArguments(log_level="loud", **FIXED)


def test_log_on_each_node(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert TrainingArguments(**FIXED).should_log  # HF's default: the first process of every node logs
    assert not TrainingArguments(log_on_each_node=False, **FIXED).should_log
    assert TrainingArguments(**FIXED).parallel_mode == ParallelMode.DISTRIBUTED


def test_script_helpers():
    args = TrainingArguments(use_cpu=True, **FIXED)
    assert (args.n_gpu, args.parallel_mode.value) == (0, "not_parallel")
    with args.main_process_first(desc="tokenize"):
        ran = True
    assert ran
    sanitized = args.to_sanitized_dict()
    assert sanitized["train_batch_size"] == 8 and sanitized["report_to"] == "[]"
    assert all(type(v) in (bool, int, float, str) for v in sanitized.values())


def test_tf32_off_or_unset_is_accepted_anywhere(monkeypatch):
    calls = []
    monkeypatch.setattr(arguments, "_set_tf32", calls.append)
    assert TrainingArguments(**FIXED).tf32 is None
    assert TrainingArguments(tf32=False, **FIXED).tf32 is False
    assert calls == ([False] if arguments._tf32_available() else [])


def test_tf32_on_needs_an_ampere_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(arguments, "_set_tf32", calls.append)
    monkeypatch.setattr(arguments, "_tf32_available", lambda: False)
    with pytest.raises(ConfigurationError, match="tf32=True requires an NVIDIA GPU of the Ampere generation"):
        TrainingArguments(tf32=True, **FIXED)
    monkeypatch.setattr(arguments, "_tf32_available", lambda: True)
    assert TrainingArguments(tf32=True, **FIXED).tf32 is True
    assert calls == [True]
    with pytest.raises(ConfigurationError, match="tf32 must be True or False or None"):
        TrainingArguments(tf32="yes", **FIXED)


def test_set_tf32_switches_torch_backends():
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        arguments._set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        arguments._set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"use_reentrant": False}, {"use_reentrant": False}),
        ('{"use_reentrant": true, "preserve_rng_state": true}', {"use_reentrant": True, "preserve_rng_state": True}),
        ({"every_n_layers": 1}, {"every_n_layers": 1}),
        (None, None),
    ],
)
def test_gradient_checkpointing_kwargs_honoured(kwargs, expected):
    args = TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs, **FIXED)
    assert args.gradient_checkpointing_kwargs == expected


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"offload": True}, "unsupported keys for the vmap-safe recompute: \\['offload'\\]"),
        ({"every_n_layers": 2}, "checkpoints every decoder layer"),
        ({"use_reentrant": "no"}, "use_reentrant'\\] must be True or False"),
        ({"context_fn": "x"}, "unsupported keys"),
    ],
)
def test_gradient_checkpointing_kwargs_refused(kwargs, phrase):
    with pytest.raises(ConfigurationError, match=phrase):
        TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs, **FIXED)


def test_gradient_checkpointing_none_means_off():
    assert TrainingArguments(gradient_checkpointing=None, **FIXED).gradient_checkpointing is False


# -- inert ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hf.INERT))
def test_inert_names_warn_once_and_are_not_stored(name, fresh_inert_warnings):
    default, why = hf.INERT[name]
    assert why
    value = non_default(default)
    with pytest.warns(RuntimeWarning, match=f"TrainingArguments ignores {name}="):
        args = TrainingArguments(**{name: value}, **FIXED)
    assert name not in args.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingArguments(**{name: value}, **FIXED)  # once per process
        TrainingArguments(**{name: default}, **FIXED)  # the default never warns


# -- refused ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hf.REFUSED))
def test_refused_names_explain_and_accept_the_hf_default(name):
    default, why, instead = hf.REFUSED[name]
    assert why and instead
    with pytest.raises(ConfigurationError, match=f"does not support {name}=.*: .+\\. Instead, .+"):
        TrainingArguments(**{name: non_default(default)}, **FIXED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingArguments(**{name: default}, **FIXED)


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"gradient_accumulation_steps": 4}, "Poisson draw.*raise per_device_train_batch_size"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps=True"),
        ({"fp16": True}, "use bf16=True"),
        ({"train_sampling_strategy": "group_by_length"}, "DP sampler owns batch composition.*sampling_mode"),
        ({"neftune_noise_alpha": 5.0}, "accountant does not model"),
        ({"deepspeed": "ds.json"}, "per-example clipping must see first.*fsdp='full_shard'"),
        ({"fsdp": "offload"}, "CPU offload of the parameters is not supported yet"),
    ],
)
def test_refusals_say_why_under_dp(kwargs, phrase):
    with pytest.raises(ConfigurationError, match=phrase):
        TrainingArguments(**kwargs, **FIXED)


def test_read_only_shims_keep_hf_values():
    args = TrainingArguments(gradient_accumulation_steps=1, fp16=False, **FIXED)
    assert (args.gradient_accumulation_steps, args.fp16, args.lr_scheduler_type) == (1, False, "linear")


# -- unknown names ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("lr_schedular", "'lr_scheduler'"),
        ("learning_rat", "'learning_rate'"),
        ("max_grad_nrom", "'max_grad_norm' \\(= 'clipping_norm'\\)"),
        ("target_epsilom", "'target_epsilon' \\(= 'privacy_target_epsilon'\\)"),
        ("epsilon", "'privacy_target_epsilon'"),
        ("noise_multipler", "'noise_multiplier'"),
        ("per_device_batch_size", "'per_device_train_batch_size'"),
        ("clip_norm", "'clipping_norm'"),
    ],
)
def test_unknown_names_get_a_hint(name, suggestion):
    with pytest.raises(ConfigurationError, match=f"unknown argument '{name}'. Did you mean .*{suggestion}") as info:
        TrainingArguments(**{name: 1}, **FIXED)
    assert "'Training arguments' page" in str(info.value)
    assert not isinstance(info.value, TypeError)


def test_unknown_name_without_a_close_match():
    with pytest.raises(ConfigurationError, match=r"unknown argument 'zzz'\. Every accepted name") as info:
        TrainingArguments(zzz=1, **FIXED)
    assert "Did you mean" not in str(info.value)


def test_replace_and_signature_keep_the_fields():
    import inspect

    args = TrainingArguments(lr_scheduler_type="cosine", **FIXED)
    assert dataclasses.replace(args, seed=1).lr_scheduler == "cosine"
    assert TrainingArguments(**args.to_dict()) == args
    params = inspect.signature(TrainingArguments).parameters
    assert "lr_scheduler" in params and "kwargs" not in params


# -- as_training_arguments --------------------------------------------------------------------------------------------


@pytest.fixture
def hf_args(tmp_path):
    def build(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HF's own deprecation notices are not under test
            return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)

    return build


def test_as_training_arguments_passes_ours_through():
    args = TrainingArguments(**FIXED)
    assert as_training_arguments(args) is args
    replaced = as_training_arguments(args, max_grad_norm=0.25, seed=3)
    assert (replaced.clipping_norm, replaced.seed, args.clipping_norm) == (0.25, 3, 1.0)


def test_as_training_arguments_converts_hf_arguments_like_from_hf(hf_args):
    real = hf_args(per_device_train_batch_size=2, gradient_accumulation_steps=4, lr_scheduler_type="cosine")
    converted = as_training_arguments(real, **DP)
    assert isinstance(converted, TrainingArguments)
    assert converted == TrainingArguments.from_hf(real, **DP)
    assert (converted.per_device_train_batch_size, converted.microbatch_size, converted.lr_scheduler) == (
        8,
        2,
        "cosine",
    )
    assert as_training_arguments(real, target_epsilon=2.0).privacy_target_epsilon == 2.0


def test_as_training_arguments_gives_from_hf_warnings(hf_args):
    with pytest.warns(RuntimeWarning, match="from_hf drops hub_strategy='end'"):
        as_training_arguments(hf_args(hub_strategy="end"), **FIXED)
    with pytest.raises(ConfigurationError, match=r"neftune_noise_alpha=5\.0 cannot be converted"):
        as_training_arguments(hf_args(neftune_noise_alpha=5.0), **FIXED)


def test_as_training_arguments_needs_a_budget_for_hf_arguments(hf_args):
    with pytest.raises(PrivacyBudgetError, match=r"carries no privacy budget.*from_hf"):
        as_training_arguments(hf_args())


def test_as_training_arguments_none_and_other_types():
    assert as_training_arguments(None, **FIXED) == TrainingArguments(**FIXED)
    with pytest.raises(PrivacyBudgetError, match="neither was provided"):
        as_training_arguments(None)
    with pytest.raises(InputTypeError, match="got dict"):
        as_training_arguments({"learning_rate": 1e-3})


def test_every_installed_hf_field_is_documented():
    from pathlib import Path

    page = Path(__file__).resolve().parents[3] / "docs" / "arguments.md"  # the tests run from the repository
    text = page.read_text()
    section = text[text.index("## Hugging Face and Opacus names") : text.index("## Converting from Hugging Face")]
    missing = [name for name in [*HF_FIELDS, *hf.ALIASES] if f"`{name}`" not in section]
    assert missing == []
