"""The causal-LM loss from final hidden states (fused linear cross-entropy) against the loss from the logits."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import tiny_lora, tiny_model, token_data

from opake_torch.functional import functional_model
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, fused_causal_lm_losses, fused_head, per_example_loss

DATA = token_data(24)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_losses_equal_the_logits_losses(family):
    apply_runtime_patches()
    model = tiny_lora(family).double()
    apply, params, frozen = functional_model(model)
    head = fused_head(model, set(params))
    assert head is not None and head.weight_name.endswith("lm_head.weight")
    batch = language_modeling_labels(collate(token_data(5), pad_token_id=0))  # padded rows: labels -100 there
    expected = batch_losses(apply, params, frozen, batch, task="causal_lm")
    torch.testing.assert_close(fused_causal_lm_losses(apply, params, frozen, batch, head), expected, rtol=1e-12, atol=0)

    def fused_one(p, example):
        return fused_causal_lm_losses(apply, p, frozen, {k: v[None] for k, v in example.items()}, head)[0]

    def plain_one(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    grads = [torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(params, batch) for f in (fused_one, plain_one)]
    for name in params:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-10, atol=1e-12)


def test_no_fused_head_where_it_does_not_apply():
    model = tiny_model("llama")  # full fine-tune: the head is trainable
    assert fused_head(model, set(functional_model(model)[1])) is None
    gpt2 = tiny_model("gpt2")  # no `.model.norm`
    assert fused_head(gpt2, set()) is None


def _train(folder, model, **kw):
    """Three DP steps of DPTrainer; the trainer and its trained parameters (float32, on the CPU)."""
    base = {"per_device_train_batch_size": 6, "max_steps": 3, "privacy_noise_multiplier": 1.0, "clipping_norm": 0.1,
            "disable_tqdm": True, "learning_rate": 0.05, "save_strategy": "no", "report_to": "none",
            "privacy_noise_seed": 0}  # fmt: skip
    trainer = DPTrainer(model, TrainingArguments(str(folder), **{**base, **kw}), train_dataset=DATA)
    trainer.train()
    return trainer, {k: v.detach().float().cpu() for k, v in trainer.model.named_parameters() if v.requires_grad}


def _assert_same(a, b, rtol=1e-5, atol=1e-6):
    for name, value in b.items():
        torch.testing.assert_close(a[name], value, rtol=rtol, atol=atol, msg=name)


def _forced_patches(monkeypatch, patches):
    """On CPU the kernels are off; this makes the trainer see ``patches`` applied (the loss kernels then run their
    torch references)."""
    monkeypatch.setattr(
        "opake_torch.transformers.model_setup.apply_performance_kernels", lambda model, **kwargs: patches
    )


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_trainer_with_the_fused_loss_trains_the_same_model(tmp_path, monkeypatch, engine):
    plain, expected = _train(tmp_path / "plain", tiny_lora(), use_cpu=True, per_example_gradients=engine)
    _forced_patches(monkeypatch, ["fused_linear_cross_entropy"])
    fused, trained = _train(tmp_path / "fused", tiny_lora(), use_cpu=True, per_example_gradients=engine)
    assert plain._fused_head is None and fused._fused_head is not None
    _assert_same(trained, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_trainer_with_the_triton_kernels_trains_the_same_model_on_cuda(tmp_path, engine):
    runs = []
    for kernels in (True, False):
        model = tiny_lora()
        model.config._attn_implementation = "sdpa"
        trainer, trained = _train(
            tmp_path / f"{kernels}", model, per_example_gradients=engine, use_performance_kernels=kernels
        )
        assert (trainer._fused_head is not None) == kernels
        assert ("fused_linear_cross_entropy" in trainer.performance_patches) == kernels
        runs.append(trained)
    _assert_same(runs[0], runs[1], rtol=1e-4, atol=1e-5)


def test_the_cross_entropy_kernel_gives_the_same_token_losses():
    from opake_torch.transformers.loss import causal_lm_loss, token_classification_loss

    torch.manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.float64)
    labels = torch.tensor([3, -100, 5, 0, -100, 10, 2])
    for loss in (causal_lm_loss, token_classification_loss):
        torch.testing.assert_close(loss(logits, labels, kernel=True), loss(logits, labels), rtol=1e-12, atol=0)
    none = torch.full((7,), -100)
    assert causal_lm_loss(logits, none, kernel=True).item() == 0.0


def test_trainer_with_the_cross_entropy_kernel_trains_the_same_model(tmp_path, monkeypatch):
    _, expected = _train(tmp_path / "plain", tiny_model("llama"), use_cpu=True)
    _forced_patches(monkeypatch, ["cross_entropy"])
    trainer, trained = _train(tmp_path / "kernel", tiny_model("llama"), use_cpu=True)
    assert trainer._ce_kernel and trainer._fused_head is None
    _assert_same(trained, expected)
