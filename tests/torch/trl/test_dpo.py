"""DPOTrainer: reference resolution, precomputed vs on-the-fly reference, per-example independence, losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_model
from trl_support import preference_rows, tiny_tokenizer

from opake_core.errors import ConfigurationError
from opake_torch.transformers.trl import DPOConfig, DPOTrainer
from opake_torch.transformers.trl.dpo import dpo_loss

BASE = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf, "use_cpu": True, "disable_tqdm": True,
        "report_to": "none", "save_strategy": "no", "max_steps": 1, "per_device_train_batch_size": 4}  # fmt: skip
LORA = {"r": 2, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}


def _trainer(tmp_path, data, ref_model=None, peft=False, **kwargs):
    from peft import LoraConfig

    return DPOTrainer(
        tiny_model("llama"), ref_model, DPOConfig(str(tmp_path), **{**BASE, **kwargs}), train_dataset=data,
        eval_dataset=data, processing_class=tiny_tokenizer(), peft_config=LoraConfig(**LORA) if peft else None,
    )  # fmt: skip


def _perturbed_reference():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _per_example(trainer, rows):
    batch = trainer.fetch_batch(trainer.train_dataset, rows)
    fn = torch.func.vmap(torch.func.grad_and_value(trainer.compute_per_example_loss), in_dims=(None, 0))
    return fn(trainer._params, batch)


def test_loss_formulas():
    pc, pr, rc, rr = torch.tensor(-3.0), torch.tensor(-5.0), torch.tensor(-4.0), torch.tensor(-4.5)
    delta = (pc - rc) - (pr - rr)
    assert torch.allclose(dpo_loss(pc, pr, rc, rr, beta=0.1), -F.logsigmoid(0.1 * delta))
    assert torch.allclose(dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="hinge"), torch.relu(1 - 0.1 * delta))
    ipo = dpo_loss(
        pc, pr, rc, rr, beta=0.1, loss_type="ipo", chosen_tokens=torch.tensor(2), rejected_tokens=torch.tensor(4)
    )
    assert torch.allclose(ipo, ((pc - rc) / 2 - (pr - rr) / 4 - 5.0) ** 2)


@pytest.mark.parametrize("peft", [False, True])
def test_precomputed_reference_equals_on_the_fly(tmp_path, peft):
    data = preference_rows(4)
    on_the_fly = _trainer(tmp_path, data, peft=peft)
    precomputed = _trainer(tmp_path, data, peft=peft, precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    assert "ref_chosen_logps" in precomputed.train_dataset[0] and "ref_chosen_logps" not in on_the_fly.train_dataset[0]
    (g1, l1), (g2, l2) = _per_example(on_the_fly, [0, 1, 2, 3]), _per_example(precomputed, [0, 1, 2, 3])
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-5, rtol=1e-5)


def test_initial_loss_is_log2_when_the_reference_is_the_initial_policy(tmp_path):
    for peft in (False, True):  # a deep copy, or the base model with (non-zero) adapters disabled: log-ratios differ
        trainer = _trainer(tmp_path, preference_rows(4), peft=peft, precompute_ref_log_probs=True)
        loss = trainer.evaluate()["eval_loss"]
        if peft:
            assert abs(loss - math.log(2)) > 1e-4  # the LoRA policy differs from its base
        else:
            assert loss == pytest.approx(math.log(2), abs=1e-6)


def test_peft_reference_is_the_base_model_with_adapters_off(tmp_path):
    data = preference_rows(3)
    trainer = _trainer(tmp_path, data, peft=True, precompute_ref_log_probs=True)
    explicit = _trainer(tmp_path, data, ref_model=tiny_model("llama"), precompute_ref_log_probs=True)
    for ours, theirs in zip(trainer.train_dataset, explicit.train_dataset, strict=True):
        torch.testing.assert_close(ours["ref_chosen_logps"], theirs["ref_chosen_logps"])
        torch.testing.assert_close(ours["ref_rejected_logps"], theirs["ref_rejected_logps"])
    assert all("lora_" in name for name in trainer._params)


@pytest.mark.parametrize(
    "loss_type", ["sigmoid", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "apo_zero", "apo_down", "sigmoid_norm"]
)
def test_neighbour_changes_only_its_own_contribution(tmp_path, loss_type):
    data = preference_rows(4)
    changed = [*data[:2], {"prompt": "big dog", "chosen": " ran on the mat", "rejected": " no"}, data[3]]
    smoothing = {"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0)
    (ga, la), (gb, lb) = (
        _per_example(
            _trainer(tmp_path, d, _perturbed_reference(), loss_type=loss_type, beta=2.0, label_smoothing=smoothing),
            [0, 1, 2, 3],
        )
        for d in (data, changed)
    )
    keep = [0, 1, 3]
    torch.testing.assert_close(la[keep], lb[keep], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(la[2], lb[2])
    for name in ga:
        torch.testing.assert_close(ga[name][keep], gb[name][keep], atol=1e-6, rtol=1e-6)


def test_private_training_moves_the_policy_not_the_reference(tmp_path):
    trainer = _trainer(tmp_path, preference_rows(8, conversational=True), privacy_noise_multiplier=1.0,
                       clipping_norm=1.0, max_steps=2, learning_rate=0.05, microbatch_size=2)  # fmt: skip
    before = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    output = trainer.train()
    assert output.global_step == 2 and math.isfinite(output.training_loss)
    assert all(torch.equal(p, before[n]) for n, p in trainer.ref_model.named_parameters())
    assert not all(
        torch.equal(p, q) for p, q in zip(trainer.model.parameters(), trainer.ref_model.parameters(), strict=True)
    )


def test_implicit_prompt_and_refusals(tmp_path):
    chat = preference_rows(2, conversational=True)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in chat]
    a, b = _trainer(tmp_path, chat).train_dataset[0], _trainer(tmp_path, implicit).train_dataset[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = tiny_model("llama")
    with pytest.raises(ConfigurationError, match="policy object itself"):
        DPOTrainer(model, model, DPOConfig(**BASE), processing_class=tiny_tokenizer())
    with pytest.raises(ConfigurationError, match="privacy_noise_multiplier"):
        DPOTrainer(tiny_model("llama"), None, None, processing_class=tiny_tokenizer())
