"""``full_determinism=True`` is honoured as transformers.Trainer honours it: ``enable_full_determinism(seed)`` when the
trainer is built (deterministic torch kernels, cuBLAS workspace, cuDNN), from Opake's arguments and from a converted
``transformers.TrainingArguments``; a run with it and ``privacy_noise_seed`` replays bitwise."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from tiny_hf import tiny_model, token_data

from opake_torch.transformers import DPTrainer, TrainingArguments

ENVIRONMENT = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
               "FLASH_ATTENTION_DETERMINISTIC")  # fmt: skip
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(autouse=True)
def process_state(monkeypatch):
    """Start with torch's default (non-deterministic) settings and none of the variables; restore them after."""
    for name in ENVIRONMENT:
        monkeypatch.setenv(name, "unset")  # records the value to restore (or its absence)
        monkeypatch.delenv(name)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def _args(tmp_path, device: str = "cpu", **kw) -> TrainingArguments:
    base = dict(per_device_train_batch_size=4, max_steps=3, privacy_noise_multiplier=1.0, use_cpu=device == "cpu",
                disable_tqdm=True, save_strategy="no", report_to="none", logging_strategy="no")  # fmt: skip
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


@pytest.mark.parametrize("full", [True, False])
def test_full_determinism_switches_torch_to_deterministic_kernels(tmp_path, full):
    DPTrainer(tiny_model("llama"), _args(tmp_path, full_determinism=full), train_dataset=token_data(16))
    assert torch.are_deterministic_algorithms_enabled() is full
    assert torch.backends.cudnn.deterministic is full
    assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":16:8") is full


def test_a_transformers_training_arguments_keeps_full_determinism(tmp_path):
    hf = transformers.TrainingArguments(str(tmp_path / "hf"), full_determinism=True, report_to="none", use_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # neither dropped nor ignored
        args = TrainingArguments.from_hf(hf, privacy_noise_multiplier=1.0)
    assert args.full_determinism is True and args.to_dict()["full_determinism"] is True


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_with_full_determinism_and_a_noise_seed_replays_bitwise(tmp_path, device):
    trained = []
    for run in range(2):
        args = _args(tmp_path / str(run), device, full_determinism=True, privacy_noise_seed=7, seed=3)
        trainer = DPTrainer(tiny_model("llama"), args, train_dataset=token_data(40))
        trainer.train()
        trained.append({name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()})
    assert torch.are_deterministic_algorithms_enabled()  # the run kept the deterministic kernels it asked for
    moved = {name for name, p in tiny_model("llama").named_parameters() if not torch.equal(p, trained[0][name])}
    assert moved  # training changed the weights: the comparison below is not of two untouched models
    assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])
