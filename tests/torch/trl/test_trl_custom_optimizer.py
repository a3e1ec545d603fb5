"""``optimizer_cls_and_kwargs`` through SFTTrainer and DPOTrainer: the factory's optimizer is the one that trains.

Two private steps with the same noise seed: the run with ``optim="sgd"`` and the factory of Lion equals, bit for bit,
the run with ``optim="lion"`` (the factory receives the run's schedule, warm-up included); with the factory ignored it
would be the SGD run, which moves the weights elsewhere."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import tiny_model
from trl_support import preference_rows, text_rows, tiny_tokenizer

from opake_core import optim
from opake_torch.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

BETAS, DECAY = (0.8, 0.95), 0.01
RUN = {"privacy_noise_multiplier": 1.0, "clipping_norm": 1.0, "use_cpu": True, "disable_tqdm": True,
       "report_to": "none", "save_strategy": "no", "max_steps": 2, "per_device_train_batch_size": 4,
       "microbatch_size": 2, "privacy_noise_seed": 0, "learning_rate": 0.01, "lr_scheduler": "linear",
       "warmup_steps": 1, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1], "weight_decay": DECAY}  # fmt: skip
KINDS = {
    "sft": lambda folder, factory, **kw: SFTTrainer(
        tiny_model("llama"), SFTConfig(str(folder), **{**RUN, **kw}), train_dataset=text_rows(8),
        processing_class=tiny_tokenizer(), optimizer_cls_and_kwargs=factory,
    ),
    "dpo": lambda folder, factory, **kw: DPOTrainer(
        tiny_model("llama"), None, DPOConfig(str(folder), **{**RUN, "beta": 0.5, **kw}),
        train_dataset=preference_rows(8), processing_class=tiny_tokenizer(), optimizer_cls_and_kwargs=factory,
    ),
}  # fmt: skip


def _trained(trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", KINDS)
def test_the_factory_optimizer_is_the_one_that_trains(tmp_path, kind):
    make = KINDS[kind]
    custom = make(tmp_path / "custom", (optim.lion, {"betas": BETAS, "weight_decay": DECAY}), optim="sgd")
    got = _trained(custom)
    assert custom.optimizer.name == "lion"
    named = _trained(make(tmp_path / "named", None, optim="lion"))
    initial = dict(tiny_model("llama").named_parameters())
    assert any(not torch.equal(got[name], initial[name]) for name in got)  # the steps moved the weights
    assert sorted(got) == sorted(named) and all(torch.equal(got[name], named[name]) for name in got)
