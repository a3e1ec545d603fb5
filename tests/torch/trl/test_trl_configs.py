"""SFTConfig / DPOConfig: defaults, validation, and from_trl's renamed, copied, dropped and refused fields."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.trl import DPOConfig, SFTConfig

DP = {"privacy_noise_multiplier": 1.0}


def test_configs_subclass_training_arguments_and_keep_its_validation():
    sft, dpo = SFTConfig(**DP), DPOConfig(**DP)
    assert isinstance(sft, TrainingArguments) and isinstance(dpo, TrainingArguments)
    assert (sft.learning_rate, sft.max_length, sft.loss_type, sft.logging_steps) == (2e-5, 1024, "nll", 10)
    assert (dpo.learning_rate, dpo.beta, dpo.loss_type, dpo.precompute_ref_log_probs) == (1e-6, 0.1, "sigmoid", False)
    with pytest.raises(PrivacyBudgetError):
        SFTConfig()
    with pytest.raises(ConfigurationError, match="microbatch_size"):
        DPOConfig(**DP, per_device_train_batch_size=2, microbatch_size=4)


@pytest.mark.parametrize("cls", [SFTConfig, DPOConfig])
def test_configs_refuse_schedule_free_with_load_best_model_at_end(cls):
    kwargs = {**DP, "optim": "schedule_free_adamw", "eval_strategy": "steps", "save_strategy": "steps"}
    with pytest.raises(ConfigurationError, match="optim='schedule_free_adamw' cannot be combined with load_best"):
        cls(**kwargs, load_best_model_at_end=True)
    assert cls(**kwargs, load_best_model_at_end=False).optim == "schedule_free_adamw"


def test_constructing_configs_does_not_import_trl():
    code = "import sys; from opake_torch.transformers.trl import SFTConfig, DPOConfig; " \
           "SFTConfig(privacy_noise_multiplier=0.0); DPOConfig(privacy_noise_multiplier=0.0); " \
           "print('trl' in sys.modules, 'transformers' in sys.modules)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (SFTConfig, {"packing": True}, "one row must be one example"),
        (SFTConfig, {"padding_free": True}, "one row must be one example"),
        (SFTConfig, {"loss_type": "sft"}, r"\['nll', 'dft', 'chunked_nll'\]"),
        (SFTConfig, {"loss_chunk_size": 0}, "loss_chunk_size"),
        (SFTConfig, {"dataset_text_field": ""}, "dataset_text_field"),
        (SFTConfig, {"loss_type": "dft", "label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        (SFTConfig, {"chat_template": "no-such-file"}, "neither a Jinja template"),
        (DPOConfig, {"padding_free": True}, "one row must be one example"),
        (DPOConfig, {"loss_type": "no_such_loss"}, r"\['sigmoid', 'hinge', 'ipo', 'exo_pair', "),
        (DPOConfig, {"loss_type": "robst"}, "did you mean 'robust'"),
        (DPOConfig, {"loss_type": "aot"}, "sorts log-ratios across the batch"),
        (DPOConfig, {"loss_type": "aot_unpaired"}, "sorts log-ratios across the batch"),
        (DPOConfig, {"loss_type": "sft"}, "normalization across examples"),
        (DPOConfig, {"loss_type": "exo_pair"}, r"EXO's epsilon and must lie in \(0, 1\)"),
        (DPOConfig, {"loss_type": "robust", "label_smoothing": 0.5}, r"must lie in \[0, 0.5\)"),
        (DPOConfig, {"label_smoothing": 1.0}, r"label_smoothing must be in \[0, 1\)"),
        (DPOConfig, {"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau"),
        (DPOConfig, {"loss_type": ["sigmoid", "sft"]}, "use loss_type='chosen_nll'"),
        (DPOConfig, {"beta": 0.0}, "beta"),
        (DPOConfig, {"precompute_ref_batch_size": 0}, "precompute_ref_batch_size"),
    ],
)
def test_refused_values(cls, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        cls(**DP, **kwargs)


def test_one_element_loss_list_and_template_file(tmp_path):
    assert DPOConfig(**DP, loss_type=["ipo"]).loss_type == "ipo"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert SFTConfig(**DP, chat_template=str(path)).chat_template == path.read_text()


# -- from_trl ----------------------------------------------------------------------------------------------------------

trl = pytest.importorskip("trl", reason="the converters need the opake[trl] extra")


def _trl(cls, tmp_path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


def _convert(cls, cfg, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return cls.from_trl(cfg, **{**DP, **overrides})


# (trl class, trl kwargs, opake attribute, expected)
CONVERTED = [
    ("SFTConfig", {}, "learning_rate", 2e-5),
    ("SFTConfig", {}, "max_length", 1024),
    ("SFTConfig", {}, "pad_to_multiple_of", None),
    ("SFTConfig", {"bf16": False}, "bf16", False),
    ("SFTConfig", {"bf16": True}, "bf16", True),
    ("SFTConfig", {"max_length": 64}, "max_length", 64),
    ("SFTConfig", {"dataset_text_field": "body"}, "dataset_text_field", "body"),
    ("SFTConfig", {"completion_only_loss": False}, "completion_only_loss", False),
    ("SFTConfig", {"loss_type": "dft"}, "loss_type", "dft"),
    ("SFTConfig", {"eos_token": "<eos>"}, "eos_token", "<eos>"),
    ("SFTConfig", {"pad_to_multiple_of": 8}, "pad_to_multiple_of", 8),
    ("SFTConfig", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, "microbatch_size", 2),
    ("SFTConfig", {"lr_scheduler_type": "cosine"}, "lr_scheduler", "cosine"),  # HF rename, through from_hf
    ("DPOConfig", {}, "learning_rate", 1e-6),
    ("DPOConfig", {"beta": 0.5}, "beta", 0.5),
    ("DPOConfig", {"loss_type": ["hinge"]}, "loss_type", "hinge"),
    ("DPOConfig", {"loss_type": "ipo"}, "loss_type", "ipo"),
    ("DPOConfig", {"precompute_ref_log_probs": True}, "precompute_ref_log_probs", True),
    ("DPOConfig", {"precompute_ref_batch_size": 4}, "precompute_ref_batch_size", 4),
    ("DPOConfig", {"disable_dropout": False}, "disable_dropout", False),
    ("DPOConfig", {"loss_type": ["robust"], "label_smoothing": 0.2}, "label_smoothing", 0.2),
    ("DPOConfig", {"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, "loss_type", "exo_pair"),
    ("DPOConfig", {"loss_type": ["discopop"], "discopop_tau": 0.2}, "discopop_tau", 0.2),
    ("DPOConfig", {"loss_type": ["bco_pair"]}, "loss_type", "bco_pair"),
    ("DPOConfig", {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5]}, "loss_type", ("sigmoid", "ipo")),
    ("DPOConfig", {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5]}, "loss_weights", [1.0, 0.5]),
    ("DPOConfig", {"ld_alpha": 0.5}, "ld_alpha", 0.5),
    ("DPOConfig", {"use_weighting": True}, "use_weighting", True),
    ("DPOConfig", {"f_divergence_type": "js_divergence"}, "f_divergence_type", "js_divergence"),
    ("DPOConfig", {"f_alpha_divergence_coef": 0.3}, "f_alpha_divergence_coef", 0.3),
    ("DPOConfig", {"sync_ref_model": True}, "sync_ref_model", True),
    ("DPOConfig", {"sync_ref_model": True, "ref_model_mixup_alpha": 0.9}, "ref_model_mixup_alpha", 0.9),
    ("DPOConfig", {"sync_ref_model": True, "ref_model_sync_steps": 8}, "ref_model_sync_steps", 8),
    ("SFTConfig", {"do_train": True}, "do_train", True),  # an HF field the base honours
    ("SFTConfig", {"activation_offloading": True}, "activation_offloading", True),
    ("DPOConfig", {"activation_offloading": True}, "activation_offloading", True),
]


@pytest.mark.parametrize(("name", "kwargs", "attr", "expected"), CONVERTED)
def test_from_trl_converts(tmp_path, name, kwargs, attr, expected):
    cls = {"SFTConfig": SFTConfig, "DPOConfig": DPOConfig}[name]
    converted = _convert(cls, _trl(getattr(trl, name), tmp_path, **kwargs))
    assert type(converted) is cls
    assert getattr(converted, attr) == expected


def test_from_trl_renames_chat_template_path(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    converted = _convert(SFTConfig, _trl(trl.SFTConfig, tmp_path, chat_template_path=str(path)))
    assert converted.chat_template == path.read_text()


REFUSED = [
    ("SFTConfig", {"packing": True}, "packing"),
    ("SFTConfig", {"padding_free": True}, "padding_free"),
    ("SFTConfig", {"eval_packing": True}, "eval_packing"),
    ("SFTConfig", {"shuffle_dataset": True}, "shuffle_dataset"),
    ("SFTConfig", {"truncation_mode": "keep_end"}, "truncation_mode"),
    ("SFTConfig", {"pad_token": "<pad>"}, "pad_token"),
    ("SFTConfig", {"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),  # an HF field, refused by from_hf
    ("DPOConfig", {"padding_free": True}, "padding_free"),
    ("DPOConfig", {"router_aux_loss_coef": 0.01}, "router_aux_loss_coef"),
]


@pytest.mark.parametrize(("name", "kwargs", "field"), REFUSED)
def test_from_trl_refuses(tmp_path, name, kwargs, field):
    cls = {"SFTConfig": SFTConfig, "DPOConfig": DPOConfig}[name]
    with pytest.raises(ValueError, match=rf"{field}=.*cannot be converted: \w+"):
        _convert(cls, _trl(getattr(trl, name), tmp_path, **kwargs))


@pytest.mark.parametrize("loss_type", [["sft"], ["aot"], ["sigmoid", "aot"]])
def test_from_trl_unsupported_dpo_loss_names_the_supported_ones(tmp_path, loss_type):
    with pytest.raises(ConfigurationError, match="sigmoid"):
        _convert(DPOConfig, _trl(trl.DPOConfig, tmp_path, loss_type=loss_type))


DROPPED = [
    ("SFTConfig", {"dataset_num_proc": 2}, "dataset_num_proc"),
    ("SFTConfig", {"torch_empty_cache_steps": 5}, "torch_empty_cache_steps"),  # an HF field, dropped by from_hf
    ("DPOConfig", {"dataset_num_proc": 2}, "dataset_num_proc"),
]


@pytest.mark.parametrize(("name", "kwargs", "field"), DROPPED)
def test_from_trl_drops_with_warning(tmp_path, name, kwargs, field):
    cls = {"SFTConfig": SFTConfig, "DPOConfig": DPOConfig}[name]
    cfg = _trl(getattr(trl, name), tmp_path, **kwargs)
    with pytest.warns(RuntimeWarning, match=rf"from_trl drops {field}="):
        cls.from_trl(cfg, **DP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cls.from_trl(cfg, strict=False, **DP)


def test_from_trl_label_smoothing_is_inert_for_losses_that_do_not_read_it(tmp_path):
    cfg = _trl(trl.DPOConfig, tmp_path, label_smoothing=0.1)  # TRL's sigmoid ignores it too
    with pytest.warns(RuntimeWarning, match=r"label_smoothing=0.1 has no effect with loss_type='sigmoid'"):
        converted = DPOConfig.from_trl(cfg, **DP)
    assert (converted.loss_type, converted.label_smoothing) == ("sigmoid", 0.1)


def test_from_trl_needs_a_dp_knob_and_the_right_type(tmp_path):
    with pytest.raises(PrivacyBudgetError, match="DP knob"):
        SFTConfig.from_trl(_trl(trl.SFTConfig, tmp_path))
    with pytest.raises(TypeError, match=r"trl\.SFTConfig"):
        SFTConfig.from_trl(_trl(trl.DPOConfig, tmp_path), **DP)
    overridden = _convert(DPOConfig, _trl(trl.DPOConfig, tmp_path, beta=0.2), beta=0.3, privacy_target_epsilon=None)
    assert overridden.beta == 0.3
