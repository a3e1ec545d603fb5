"""Every field name of the installed ``trl.SFTConfig`` / ``trl.DPOConfig`` is accepted by our configs: honoured,
renamed, inert with a warning, or refused with the reason; a real TRL config passed as ``args`` is converted.

The lists come from ``dataclasses.fields`` of the installed trl, so a new upstream field fails here, not for a user.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
from tiny_hf import tiny_model
from trl_support import preference_rows, text_rows, tiny_tokenizer

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_torch.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from opake_torch.transformers.trl.config import DPO_NAMES, SFT_NAMES

try:
    import transformers
    import trl
except ImportError:  # the table tests below run without the opake[trl] extra; the field-list ones need it
    trl = None
needs_trl = pytest.mark.skipif(trl is None, reason="the TRL field lists need the opake[trl] extra")

DP = {"privacy_noise_multiplier": 1.0, "use_cpu": True}
CASES = [(SFTConfig, "SFTConfig", SFT_NAMES), (DPOConfig, "DPOConfig", DPO_NAMES)]
IDS = ["SFTConfig", "DPOConfig"]


def _trl_fields(name):
    return [f for f in dataclasses.fields(getattr(trl, name)) if f.init] if trl is not None else []


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


@needs_trl
@pytest.mark.parametrize(("cls", "name", "names"), CASES, ids=IDS)
def test_every_trl_only_name_is_in_the_table(cls, name, names):
    trl_only = {f.name for f in _trl_fields(name)} - {
        f.name for f in dataclasses.fields(transformers.TrainingArguments)
    }
    assert trl_only - set(names) == set(), f"new trl.{name} fields: classify them in config.py"
    assert set(names) - trl_only == set(), f"trl.{name} no longer has these fields: drop them from config.py"
    assert {rule.kind for rule in names.values()} <= {"field", "alias", "inert", "refused"}
    for field_name, rule in names.items():
        if rule.kind == "field":
            assert field_name in {f.name for f in dataclasses.fields(cls)}, field_name
        if rule.kind == "alias":
            assert rule.target in {f.name for f in dataclasses.fields(cls)}, field_name
        if rule.kind == "refused":
            assert rule.why and rule.instead, field_name


def _every_field_at_default(name):
    return [pytest.param(name, f.name, id=f"{name}.{f.name}") for f in _trl_fields(name)]


@needs_trl
@pytest.mark.parametrize(
    ("name", "field_name"), _every_field_at_default("SFTConfig") + _every_field_at_default("DPOConfig")
)
def test_every_trl_name_is_accepted_at_trls_default(tmp_path, name, field_name):
    """Hugging Face's names and TRL's, at the value ``trl.<Config>`` defaults them to: never a bare TypeError, never
    a refusal (a default value means the script did not ask for anything)."""
    cls = {"SFTConfig": SFTConfig, "DPOConfig": DPOConfig}[name]
    field = next(f for f in _trl_fields(name) if f.name == field_name)
    kwargs = {**DP, "output_dir": str(tmp_path), field_name: _default(field)}
    if field_name == "output_dir":
        kwargs["output_dir"] = str(tmp_path)
    if field_name in ("use_cpu",):
        kwargs[field_name] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls(**kwargs)


# a non-default value for each TRL-only name of kind inert / refused (generic rules below cover the rest)
NON_DEFAULT = {
    "model_init_kwargs": {"dtype": "float32"},
    "router_aux_loss_coef": 0.01,
    "dataset_kwargs": {"skip_prepare_dataset": True},
    "dataset_num_proc": 4,
    "eval_packing": True,
    "pad_token": "<pad>",
    "loss_weights": [1.0],
    "ld_alpha": 0.5,
    "truncation_mode": "keep_end",
    "f_divergence_type": "js_divergence",
    "packing_strategy": "wrapped",
}


def _non_default(rule, field_name):
    if field_name in NON_DEFAULT:
        return NON_DEFAULT[field_name]
    default = rule.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    raise AssertionError(f"give {field_name} a non-default value in NON_DEFAULT")


def _rules(kind):
    return [
        pytest.param(cls, field_name, rule, id=f"{cls.__name__}.{field_name}")
        for cls, _, names in CASES
        for field_name, rule in names.items()
        if rule.kind == kind
    ]


@pytest.mark.parametrize(("cls", "field_name", "rule"), _rules("inert"))
def test_inert_names_warn_and_change_nothing(tmp_path, cls, field_name, rule):
    value = _non_default(rule, field_name)
    with pytest.warns(RuntimeWarning, match=rf"{field_name}=.* has no effect: \w+"):
        args = cls(str(tmp_path), **DP, **{field_name: value})
    assert args == cls(str(tmp_path), **DP)


@pytest.mark.parametrize(("cls", "field_name", "rule"), _rules("refused"))
def test_refused_names_say_why_and_what_instead(tmp_path, cls, field_name, rule):
    value = _non_default(rule, field_name)
    with pytest.raises(ConfigurationError, match=rf"{field_name}=.* is refused: .+\. Instead, \w+"):
        cls(str(tmp_path), **DP, **{field_name: value})


def test_aliases_and_trl_spellings(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert SFTConfig(**DP, chat_template_path=str(path)).chat_template == path.read_text()
    with pytest.raises(ConfigurationError, match="both"):
        SFTConfig(**DP, chat_template_path=str(path), chat_template="{{ x }}")
    args = SFTConfig(**DP, pad_to_multiple_of="auto", bf16=None, loss_type="nll")
    assert (args.pad_to_multiple_of, args.bf16) == (None, False)
    assert DPOConfig(**DP, loss_type=["robust"], label_smoothing=0.1).loss_type == "robust"


def test_names_from_the_issue_do_not_raise_type_errors():
    with pytest.warns(RuntimeWarning, match="dataset_num_proc=4 has no effect"):
        SFTConfig(**DP, dataset_num_proc=4)
    with pytest.warns(RuntimeWarning, match="dataset_num_proc=4 has no effect"):
        DPOConfig(**DP, dataset_num_proc=4)
    assert DPOConfig(**DP, loss_type="robust", label_smoothing=0.1).label_smoothing == 0.1


@pytest.mark.parametrize(
    ("cls", "kwargs", "hint"),
    [
        (SFTConfig, {"dataset_num_prc": 2}, "dataset_num_proc"),
        (SFTConfig, {"dataset_text_feild": "x"}, "dataset_text_field"),
        (DPOConfig, {"label_smothing": 0.1}, "label_smoothing"),
        (DPOConfig, {"discopop_ta": 0.1}, "discopop_tau"),
        (DPOConfig, {"ref_model_sync_step": 3}, "ref_model_sync_steps"),
    ],
)
def test_unknown_names_get_a_did_you_mean_hint(cls, kwargs, hint):
    with pytest.raises(ConfigurationError, match=rf"(?i)did you mean .*'{hint}'"):
        cls(**DP, **kwargs)


# -- a real TRL config as args -----------------------------------------------------------------------------------------

RUN = {"max_steps": 1, "report_to": "none", "save_strategy": "no", "per_device_train_batch_size": 2, "use_cpu": True,
       "max_grad_norm": math.inf, "gradient_checkpointing": False, "disable_tqdm": True}  # fmt: skip


@needs_trl
def test_a_trl_sft_config_as_args_is_converted_with_from_trls_warnings(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = trl.SFTConfig(output_dir=str(tmp_path), dataset_num_proc=2, max_length=32, **RUN)
    cfg.privacy_noise_multiplier = 0.0  # the one line a TRL script adds: its config has no privacy budget
    with pytest.warns(RuntimeWarning, match="from_trl drops dataset_num_proc=2"):
        trainer = SFTTrainer(tiny_model("llama"), cfg, train_dataset=text_rows(4), processing_class=tiny_tokenizer())
    assert type(trainer.args) is SFTConfig
    assert (trainer.args.max_length, trainer.args.privacy_noise_multiplier, trainer.args.microbatch_size) == (32, 0, 2)
    assert trainer.train().global_step == 1


@needs_trl
def test_a_trl_dpo_config_as_args_is_converted(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = trl.DPOConfig(output_dir=str(tmp_path), loss_type=["apo_zero"], beta=0.3, **{**RUN, "max_grad_norm": 1.0})
    cfg.target_epsilon = 50.0  # Opacus' name of the knob is accepted too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(tiny_model("llama"), None, cfg, train_dataset=preference_rows(4),
                             processing_class=tiny_tokenizer())  # fmt: skip
    assert type(trainer.args) is DPOConfig
    assert (trainer.args.loss_type, trainer.args.beta, trainer.args.privacy_target_epsilon) == ("apo_zero", 0.3, 50.0)


@needs_trl
def test_a_trl_config_without_a_budget_says_how_to_give_one(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = trl.SFTConfig(output_dir=str(tmp_path), **RUN)
    with pytest.raises(PrivacyBudgetError, match=r"args\.privacy_target_epsilon = 8\.0.*from_trl"):
        SFTTrainer(tiny_model("llama"), cfg, train_dataset=text_rows(2), processing_class=tiny_tokenizer())
    with pytest.raises(TypeError, match=r"trl\.DPOConfig"):  # the other trainer's config is still a type error
        cfg.privacy_noise_multiplier = 0.0
        DPOTrainer(tiny_model("llama"), None, cfg, train_dataset=preference_rows(2), processing_class=tiny_tokenizer())
