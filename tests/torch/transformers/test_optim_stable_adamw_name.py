"""optim="stable_adamw" (Hugging Face's name for StableAdamW) builds opake_core's stable_adamw with the run's
schedule, betas, eps and weight decay; optim_args set its threshold; from_hf keeps the name."""

from __future__ import annotations

import warnings

import pytest
import torch

from opake_core import optim
from opake_core.tree import Noised
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.optimizer import build_optimizer, build_schedule

LR, BETAS, EPS, DECAY = 0.01, (0.8, 0.95), 1e-6, 0.01


@pytest.mark.parametrize(("optim_args", "clip"), [({}, 1.0), ({"update_rms_clip": 0.5}, 0.5)])
def test_stable_adamw_by_name(tmp_path, optim_args, clip):
    args = TrainingArguments(
        str(tmp_path), optim="stable_adamw", optim_args=optim_args, learning_rate=LR, weight_decay=DECAY,
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, privacy_noise_multiplier=1.0, use_cpu=True,
        report_to="none",
    )  # fmt: skip
    built = build_optimizer(args, 10)
    want = optim.stable_adamw(build_schedule(args, 10), BETAS, EPS, DECAY, update_rms_clip=clip)
    params = {"w": torch.arange(6.0).view(3, 2), "b": torch.ones(2)}
    grads = Noised({"w": torch.linspace(-1, 1, 6).view(3, 2), "b": torch.tensor([0.5, -2.0])}, 1.0, 0.1)
    got, state = built.update(grads, built.init(params), params=params)
    ref, ref_state = want.update(grads, want.init(params), params=params)
    got, _ = built.update(Noised({k: 10 * v for k, v in grads.value.items()}, 1.0, 0.1), state, params=params)
    ref, _ = want.update(Noised({k: 10 * v for k, v in grads.value.items()}, 1.0, 0.1), ref_state, params=params)
    assert built.name == "stable_adamw"
    assert all(torch.equal(got[k], ref[k]) for k in params)


def test_from_hf_keeps_stable_adamw(tmp_path):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, optim="stable_adamw"
        )
    assert TrainingArguments.from_hf(hf_args, privacy_target_epsilon=8.0).optim == "stable_adamw"
