"""DPTrainer's choice of per-example gradient engine, and that the choice does not change the trained model."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import tiny_lora, tiny_model, token_data

from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments

DATA = token_data(24)
CLASSES = token_data(24, classes=3)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 6,
        "max_steps": 3,
        "privacy_noise_multiplier": 1.0,
        "clipping_norm": 0.1,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "lr_scheduler": "constant",
        "logging_steps": 3,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 0,  # both engines draw the same batches and noise
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


@pytest.mark.parametrize(
    ("build", "data", "mechanism"),
    [
        (tiny_lora, DATA, "gaussian"),
        (lambda: tiny_model("bert"), CLASSES, "gaussian"),
        (tiny_lora, DATA, "mf_band"),
    ],
    ids=["llama_lora_dpsgd", "bert_full_dpsgd", "llama_lora_bandmf"],
)
def test_layerwise_and_vmap_train_the_same_model(tmp_path, build, data, mechanism):
    """Same keys, same batches: the two engines release the same noisy updates (up to float32 rounding)."""
    trained = {}
    for engine in ("layerwise", "vmap"):
        options = {"privacy_noise_mechanism_kwargs": {"bands": 2}} if mechanism == "mf_band" else {}
        args = _args(tmp_path / engine, per_example_gradients=engine, privacy_noise_mechanism=mechanism, **options)
        trainer = DPTrainer(build(), args, train_dataset=data)
        trainer.train()
        assert trainer.per_example_gradients_engine == engine
        trained[engine] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    for name, value in trained["vmap"].items():
        torch.testing.assert_close(trained["layerwise"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_picks_layerwise_where_it_serves_and_vmap_elsewhere(tmp_path, caplog):
    def engine(model, args):
        return DPTrainer(model, args, train_dataset=DATA).per_example_gradients_engine

    assert engine(tiny_lora(), _args(tmp_path)) == "layerwise"
    assert engine(tiny_model("llama"), _args(tmp_path)) == "layerwise"
    checkpointed = _args(tmp_path, gradient_checkpointing=True)
    assert engine(tiny_lora(), checkpointed) == "layerwise"  # adapters
    assert engine(tiny_model("llama"), checkpointed) == "layerwise"  # a full fine-tune


@pytest.mark.parametrize("build", [tiny_lora, lambda: tiny_model("llama")], ids=["lora", "full"])
def test_checkpointed_training_equals_training_without_checkpointing(tmp_path, build):
    """gradient_checkpointing on the layerwise engine, adapters or a full fine-tune: the same keys and batches give
    the model that the run without checkpointing gives (the recompute changes nothing but memory)."""
    trained = {}
    for checkpointing in (False, True):
        args = _args(tmp_path / str(checkpointing), gradient_checkpointing=checkpointing)
        trainer = DPTrainer(build(), args, train_dataset=DATA)
        trainer.train()
        assert trainer.per_example_gradients_engine == "layerwise"
        trained[checkpointing] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    for name, value in trained[False].items():
        torch.testing.assert_close(trained[True][name], value, rtol=1e-5, atol=1e-6, msg=name)


class _SFTLike(DPTrainer):
    def compute_per_example_loss(self, params, example):
        return super().compute_per_example_loss(params, example)


def test_layerwise_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(ConfigurationError, match="overrides compute_per_example_loss"):
        _SFTLike(tiny_model("llama"), _args(tmp_path, per_example_gradients="layerwise"), train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="per_example_gradients"):
        _args(tmp_path, per_example_gradients="ghost")


@pytest.mark.parametrize("error", [ConfigurationError, RuntimeError], ids=["mismatch", "layerwise pass fails"])
def test_a_failed_check_falls_back_to_vmap_in_auto_and_raises_when_asked(tmp_path, monkeypatch, error):
    from opake_torch import layerwise

    def failing_check(self, *args, **kwargs):
        raise error("layerwise per-example gradients cannot serve this model (injected)")

    monkeypatch.setattr(layerwise.LayerwiseGradients, "check", failing_check)
    trainer = DPTrainer(tiny_lora(), _args(tmp_path), train_dataset=DATA)
    trainer.train()
    assert trainer.per_example_gradients_engine == "vmap"
    strict = DPTrainer(tiny_lora(), _args(tmp_path, per_example_gradients="layerwise"), train_dataset=DATA)
    with pytest.raises(error, match="injected"):
        strict.train()


def test_the_check_runs_on_the_first_positions_of_two_examples(tmp_path, monkeypatch):
    """The engine check runs without checkpointing: it takes each example's first CHECK_POSITIONS positions (so it
    fits where a step does) and still passes on them."""
    from opake_torch import layerwise
    from opake_torch.transformers import engines

    seen = []
    check = layerwise.LayerwiseGradients.check

    def spy(self, params, loss_fn, batch, **kwargs):
        seen.append({k: tuple(v.shape) for k, v in batch.items()})
        return check(self, params, loss_fn, batch, **kwargs)

    monkeypatch.setattr(layerwise.LayerwiseGradients, "check", spy)
    monkeypatch.setattr(engines, "CHECK_POSITIONS", 4)
    trainer = DPTrainer(tiny_lora(), _args(tmp_path, gradient_checkpointing=True, max_steps=1), train_dataset=DATA)
    trainer.train()
    assert trainer.per_example_gradients_engine == "layerwise"
    (shapes,) = seen
    assert shapes["input_ids"] == (2, 4) and shapes["attention_mask"] == (2, 4)
