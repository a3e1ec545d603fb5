"""A model given to the TRL trainers by name or path is loaded as TRL loads it (``model_init_kwargs``, TRL's dtype
rule, the tokenizer saved with it); ``quantization_config=None`` is accepted and a real one refused with the reason;
the Hugging Face and TRL names a script reads from its config are readable attributes."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from tiny_hf import tiny_model
from trl_support import preference_rows, text_rows, tiny_tokenizer

from opake_core.errors import ConfigurationError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers import _from_hf as hf
from opake_torch.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from opake_torch.transformers.trl.config import DPO_NAMES, SFT_NAMES
from opake_torch.transformers.trl.loading import load_model

DP = {"privacy_noise_multiplier": 1.0, "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 4,
      "max_steps": 1, "save_strategy": "no", "disable_tqdm": True}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama and its tokenizer saved in one folder, as a Hub checkpoint is."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_sft_trainer_loads_a_model_and_its_tokenizer_by_path(saved, tmp_path):
    args = SFTConfig(str(tmp_path), **DP, max_length=16)
    trainer = SFTTrainer(str(saved), args, train_dataset=text_rows(8))
    assert type(trainer.model).__name__ == "LlamaForCausalLM"
    assert _same_weights(trainer.model, tiny_model("llama"))
    assert trainer.processing_class.get_vocab() == tiny_tokenizer().get_vocab()
    assert trainer.train().global_step == 1


def test_dpo_trainer_loads_the_policy_by_path_and_copies_it_as_the_reference(saved, tmp_path):
    trainer = DPOTrainer(str(saved), args=DPOConfig(str(tmp_path), **DP), train_dataset=preference_rows(8))
    assert _same_weights(trainer.model, trainer.ref_model) and trainer.ref_model is not trainer.model
    assert trainer.train().global_step == 1


def test_model_init_kwargs_reach_from_pretrained_with_trls_dtype_rule(saved, tmp_path):
    default = load_model(str(saved), SFTConfig(str(tmp_path), **DP))
    assert next(default.parameters()).dtype == torch.float32  # TRL's default dtype
    args = SFTConfig(str(tmp_path), **DP, model_init_kwargs='{"dtype": "bfloat16", "attn_implementation": "eager"}')
    assert args.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    model = load_model(str(saved), args)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    with pytest.raises(ConfigurationError, match=r"model_init_kwargs\['dtype'\] must be 'auto'"):
        load_model(str(saved), SFTConfig(str(tmp_path), **DP, model_init_kwargs={"dtype": "float8"}))


def test_a_quantization_config_is_refused_and_none_accepted(saved, tmp_path):
    args = SFTConfig(str(tmp_path), **DP)
    with pytest.raises(ConfigurationError, match=r"quantization_config=.* is refused: quantized base weights"):
        SFTTrainer(str(saved), args, train_dataset=text_rows(4), quantization_config={"load_in_4bit": True})
    with pytest.raises(ConfigurationError, match=r"model_init_kwargs\['quantization_config'\] is refused"):
        load_model(str(saved), dataclasses.replace(args, model_init_kwargs={"quantization_config": {"bits": 4}}))
    trainer = DPOTrainer(str(saved), args=DPOConfig(str(tmp_path), **DP), train_dataset=preference_rows(4),
                         quantization_config=None)  # fmt: skip
    assert trainer.model is not None


def test_the_fields_trls_scripts_read_and_write(tmp_path):
    for cls in (SFTConfig, DPOConfig):
        args = cls(str(tmp_path), **DP)
        assert (args.trust_remote_code, args.model_init_kwargs) == (False, None)
        args.model_init_kwargs = {"revision": None, "dtype": "float32"}  # what sft.py / dpo.py do
        assert args.model_init_kwargs["dtype"] == "float32"
        assert cls(str(tmp_path), **DP, trust_remote_code=True).trust_remote_code is True


def test_from_trl_carries_model_init_kwargs_and_trust_remote_code(tmp_path):
    trl = pytest.importorskip("trl")
    cfg = trl.SFTConfig(str(tmp_path), model_init_kwargs={"dtype": "bfloat16"}, trust_remote_code=True,
                        use_cpu=True, report_to="none")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = SFTConfig.from_trl(cfg, privacy_noise_multiplier=1.0)
    assert (converted.model_init_kwargs, converted.trust_remote_code) == ({"dtype": "bfloat16"}, True)


def test_hugging_faces_names_are_readable(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(str(tmp_path), **DP, max_grad_norm=0.5, hub_strategy="end")
    assert (args.max_grad_norm, args.clipping_norm) == (0.5, 0.5)
    assert (args.hub_strategy, args.eval_accumulation_steps) == ("end", None)
    args.max_grad_norm = 2.0  # an alias sets its field, and the privacy settings with it
    assert (args.clipping_norm, args.privacy.clipping_norm) == (2.0, 2.0)
    with pytest.raises(ConfigurationError, match="does not support dataloader_drop_last=True"):
        args.dataloader_drop_last = True
    fresh = TrainingArguments(str(tmp_path), **DP)
    for name, (default, _) in hf.INERT.items():
        assert getattr(fresh, name) == default, name
    for name, (default, _, _) in hf.REFUSED.items():
        if not isinstance(getattr(type(fresh), name, None), property):
            assert getattr(fresh, name) == default, name
    with pytest.raises(AttributeError):
        fresh.not_a_name  # noqa: B018


@pytest.mark.parametrize(("cls", "names"), [(SFTConfig, SFT_NAMES), (DPOConfig, DPO_NAMES)])
def test_every_trl_name_is_readable(tmp_path, cls, names):
    args = cls(str(tmp_path), **DP)
    for name, rule in names.items():
        value = getattr(args, name)
        if rule.kind in ("inert", "refused") and name not in {f.name for f in dataclasses.fields(cls)}:
            assert value == rule.default, name
    with pytest.warns(RuntimeWarning, match="dataset_num_proc=4 has no effect"):
        assert cls(str(tmp_path), **DP, dataset_num_proc=4).dataset_num_proc == 4
