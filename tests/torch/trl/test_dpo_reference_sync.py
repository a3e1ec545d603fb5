"""TR-DPO (``sync_ref_model``): the reference follows the mixup recursion from the released policy weights, the loss
reads the synced reference, a resumed run equals the uninterrupted one bit for bit, and bad settings are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tiny_hf import tiny_model
from transformers import TrainerCallback
from trl_support import preference_rows, tiny_tokenizer

from opake_core.errors import CheckpointError, ConfigurationError
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.trl import DPOConfig, DPOTrainer
from opake_torch.transformers.trl.reference_sync import FILE, mix_into

RUN = {"privacy_noise_multiplier": 1.0, "clipping_norm": 1.0, "learning_rate": 0.05, "use_cpu": True,
       "disable_tqdm": True, "report_to": "none", "save_strategy": "no", "per_device_train_batch_size": 4,
       "microbatch_size": 2, "beta": 0.5, "sync_ref_model": True}  # fmt: skip
DATA = preference_rows(8)


def _trainer(folder, *, ref_model=None, peft_config=None, **kwargs):
    return DPOTrainer(
        tiny_model("llama"), ref_model, DPOConfig(str(folder), **{**RUN, **kwargs}), train_dataset=DATA,
        eval_dataset=DATA, processing_class=tiny_tokenizer(), peft_config=peft_config,
    )  # fmt: skip


class _PolicyAtEachStep(TrainerCallback):
    """The policy's weights at the end of each step (what the next step starts from), in float64."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        weights = {**dict(self.trainer.model.named_parameters()), **self.trainer.trainable_params}
        self.steps[state.global_step] = {name: value.detach().double().clone() for name, value in weights.items()}


def _reference(trainer):
    return {name: p.detach().clone() for name, p in trainer.ref_model.named_parameters()}


def _recursion(initial, policies, *, alpha, every):
    """The TR-DPO reference, in float64: ``ref <- alpha * policy_t + (1 - alpha) * ref`` after each step ``t`` that is
    a multiple of ``every``."""
    ref = {name: value.double() for name, value in initial.items()}
    for step in sorted(policies):
        if step % every == 0:
            ref = {name: alpha * policies[step][name] + (1 - alpha) * value for name, value in ref.items()}
    return ref


def test_the_reference_follows_the_mixup_recursion_of_the_released_weights(tmp_path):
    trainer = _trainer(tmp_path, max_steps=5, ref_model_sync_steps=2, ref_model_mixup_alpha=0.3)
    recorder = _PolicyAtEachStep(trainer)
    trainer.add_callback(recorder)
    initial = _reference(trainer)
    trainer.train()
    assert sorted(recorder.steps) == [1, 2, 3, 4, 5]
    synced = _reference(trainer)
    expected = _recursion(initial, recorder.steps, alpha=0.3, every=2)  # syncs after steps 2 and 4
    for name, value in synced.items():  # float32 in place vs float64: a few roundings of |x| <= 1
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-6, atol=1e-6)
    # the check discriminates: a reference synced at every step, or never, is far outside that tolerance
    for other in (_recursion(initial, recorder.steps, alpha=0.3, every=1), initial):
        assert max(float((synced[n].double() - other[n].double()).abs().max()) for n in synced) > 1e-3
    assert set(synced) == {name for name, _ in trainer.model.named_parameters()}


def test_the_loss_reads_the_synced_reference(tmp_path):
    """With alpha = 1 and a sync after every step, each step starts with reference == policy, so every pair's
    sigmoid loss is log 2; without the sync, the policy moves away from its initial copy after the first step. The
    keys come from a seed: with secret ones, an unlucky draw of batches and noise can leave the unsynced loss within
    1e-3 of log 2."""
    losses = {}
    for sync in (True, False):
        options = {"ref_model_mixup_alpha": 1.0, "ref_model_sync_steps": 1} if sync else {"sync_ref_model": False}
        trainer = _trainer(tmp_path / str(sync), max_steps=3, logging_steps=1, privacy_noise_seed=0, **options)
        trainer.train()
        losses[sync] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        if sync:
            policy = dict(trainer.model.named_parameters())
            assert all(torch.equal(p, policy[n]) for n, p in trainer.ref_model.named_parameters())
            assert trainer.evaluate()["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert len(losses[True]) == 3 and all(loss == pytest.approx(math.log(2), abs=1e-5) for loss in losses[True])
    assert abs(losses[False][-1] - math.log(2)) > 1e-3, losses[False]


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    sync = {"ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5, "max_steps": 4}
    full = _trainer(tmp_path / "a", save_strategy="steps", save_steps=2, **sync)
    full.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert FILE in json.loads((checkpoint / ckpt.DP_STATE).read_text())["files"]  # sealed with the checkpoint
    resumed = _trainer(tmp_path / "b", **sync)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for a, b in ((full.model, resumed.model), (full.ref_model, resumed.ref_model)):
        theirs = dict(b.named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in a.named_parameters())
    initial = dict(tiny_model("llama").named_parameters())  # the reference moved: its state mattered
    assert not all(torch.equal(p, initial[n]) for n, p in full.ref_model.named_parameters())

    bf16 = tiny_model("llama").to(torch.bfloat16)  # names and shapes match the policy; the saved dtype does not
    with pytest.raises(CheckpointError, match=r"holds another reference .*dtypes differ"):
        _trainer(tmp_path / "c", ref_model=bf16, **sync).train(resume_from_checkpoint=str(checkpoint))
    (checkpoint / FILE).unlink()  # the seal lists it: a checkpoint without it is incomplete
    with pytest.raises(CheckpointError, match="is missing"):
        _trainer(tmp_path / "c", **sync).train(resume_from_checkpoint=str(checkpoint))


def test_load_best_model_at_end_restores_the_reference_of_the_best_checkpoint(tmp_path):
    """alpha = 1 and a sync after every step: at every checkpoint the reference equals the policy, so every eval loss
    is log 2 and the first checkpoint stays the best (a later one must improve on it). Restoring it must bring back
    its reference with its policy; the reference synced with the last step's policy would score another loss."""
    sync = {"ref_model_mixup_alpha": 1.0, "ref_model_sync_steps": 1, "max_steps": 3}
    saves = {"save_strategy": "steps", "save_steps": 1, "eval_strategy": "steps", "eval_steps": 1}
    trainer = _trainer(tmp_path, load_best_model_at_end=True, **sync, **saves)
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    best, last = (load_file(str(tmp_path / f"checkpoint-{step}" / FILE)) for step in (1, 3))
    assert any(not torch.equal(best[name], last[name]) for name in best)  # the restore has something to undo
    policy = dict(trainer.model.named_parameters())
    for name, value in trainer.ref_model.named_parameters():
        assert torch.equal(value, best[name]) and torch.equal(value, policy[name])
    assert trainer.evaluate()["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_a_checkpoint_written_without_sync_resumes_from_the_given_reference(tmp_path, caplog):
    _trainer(tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1, sync_ref_model=False).train()
    assert not (tmp_path / "a" / "checkpoint-1" / FILE).exists()
    trainer = _trainer(tmp_path / "b", max_steps=2, ref_model_sync_steps=5)
    initial = _reference(trainer)
    with caplog.at_level("WARNING"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    assert "holds no synced reference" in caplog.text
    assert all(torch.equal(p, initial[n]) for n, p in trainer.ref_model.named_parameters())  # no sync before step 5


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ref_model_mixup_alpha": 0.0}, r"ref_model_mixup_alpha must be .*0\.0"),
        ({"ref_model_mixup_alpha": -0.1}, "ref_model_mixup_alpha"),
        ({"ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha"),
        ({"ref_model_mixup_alpha": float("nan")}, "ref_model_mixup_alpha"),
        ({"ref_model_sync_steps": 0}, "ref_model_sync_steps"),
        ({"ref_model_sync_steps": 2.5}, "ref_model_sync_steps"),
        ({"sync_ref_model": "yes please"}, "sync_ref_model"),
        ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True: the precomputed .* stale"),
        ({"loss_type": "simpo"}, "no loss of it reads the reference model"),
        ({"loss_type": ["simpo", "chosen_nll"]}, "no loss of it reads the reference model"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(kwargs, needle):
    with pytest.raises(ConfigurationError, match=needle):
        DPOConfig(**{**RUN, **kwargs})


def test_fsdp_and_peft_and_another_architecture_are_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="each rank holds only its rows"):
        DPOConfig(**RUN, fsdp="full_shard")
    from peft import LoraConfig

    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigurationError, match=r"PEFT policy is refused, as TRL refuses it"):
        _trainer(tmp_path, peft_config=lora)
    with pytest.raises(ConfigurationError, match=r"ref_model has parameters the policy lacks .*transformer"):
        _trainer(tmp_path, ref_model=tiny_model("gpt2"))
    assert DPOConfig(**RUN, loss_type=["sigmoid", "chosen_nll"]).sync_ref_model  # one loss reads the reference


def test_the_sync_numbers_warn_when_sync_is_off():
    with pytest.warns(RuntimeWarning, match="ref_model_sync_steps=8 has no effect: it only serves sync_ref_model"):
        DPOConfig(**{**RUN, "sync_ref_model": False, "ref_model_sync_steps": 8})


def test_a_sync_computes_what_trls_callback_computes():
    from trl.trainer.callbacks import SyncRefModelCallback

    policy, ours, theirs = tiny_model("llama"), tiny_model("llama"), tiny_model("llama")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    mix_into(ours, dict(policy.named_parameters()), 0.3)
    SyncRefModelCallback._sync_target_model(policy, theirs, 0.3)
    theirs = dict(theirs.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters())
    assert not torch.equal(theirs["lm_head.weight"], tiny_model("llama").lm_head.weight)
