"""The one-run audit around real training runs: positive without privacy, below the theoretical epsilon with it.

False-alarm rate: every private audit here runs at confidence 0.999, so a correct mechanism fails one of these
assertions with probability at most 1e-3 per run (and the seeds are fixed, so the outcome is reproducible).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_model, token_data

from opake_core import mf, optim, random
from opake_core.errors import ConfigurationError
from opake_torch.auditing import audit_core_run, audit_trainer, make_canaries
from opake_torch.transformers import DPTrainer, TrainingArguments

D, H, K = 16, 48, 10
KEY = random.key(0)


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(D, H, generator=g) / D**0.5,
        "b1": torch.zeros(H),
        "w2": torch.randn(H, K, generator=g) / H**0.5,
    }


def _loss(p, x, y):
    return F.cross_entropy((torch.relu(x @ p["w1"] + p["b1"]) @ p["w2"])[None], y[None])


def _data(n=50):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


CANARIES = make_canaries(key=KEY, num_canaries=200, num_features=D, num_classes=K)


def test_non_private_run_gives_a_clearly_positive_bound():
    report = audit_core_run(
        _loss,
        _params(),
        _data(),
        CANARIES,
        key=KEY,
        noise_multiplier=0.0,
        clipping_norm=math.inf,
        steps=60,
        optimizer=optim.adam(0.02, non_private=True),
    )
    assert report.theoretical_epsilon == math.inf
    assert report.epsilon_lower_bound > 1.5, report.result


@pytest.mark.parametrize("score", ["loss", "gradient"])
def test_dp_sgd_bound_stays_below_theoretical_epsilon(score):
    report = audit_core_run(
        _loss,
        _params(),
        _data(),
        CANARIES,
        key=KEY,
        noise_multiplier=2.0,
        clipping_norm=1.0,
        sample_rate=0.2,
        steps=40,
        score=score,
        confidence=0.999,
    )
    assert math.isfinite(report.theoretical_epsilon)
    assert report.consistent, (report.result, report.theoretical_epsilon)


def test_band_mf_bound_stays_below_theoretical_epsilon():
    report = audit_core_run(
        _loss,
        _params(),
        _data(),
        CANARIES,
        key=KEY,
        noise_multiplier=3.0,
        clipping_norm=1.0,
        steps=24,
        strategy=mf.band_mf(bands=4),
        confidence=0.999,
    )
    assert math.isfinite(report.theoretical_epsilon)
    assert report.consistent, (report.result, report.theoretical_epsilon)


def test_score_name_is_checked():
    with pytest.raises(ConfigurationError, match="score"):
        audit_core_run(
            _loss, _params(), _data(), CANARIES, key=KEY, noise_multiplier=1.0, clipping_norm=1.0, steps=1, score="x"
        )


def test_audit_around_dp_trainer(tmp_path):
    def make(dataset):
        args = TrainingArguments(
            str(tmp_path / "out"),
            per_device_train_batch_size=8,
            max_steps=3,
            privacy_noise_multiplier=1.0,
            privacy_accounting=True,
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
            report_to="none",
        )
        return DPTrainer(tiny_model("bert"), args, train_dataset=dataset)

    report = audit_trainer(
        make, token_data(24, classes=3), token_data(40, seed=9, classes=3), key=KEY, confidence=0.999
    )
    assert len(report.scores) == 40 and report.included.dtype == bool
    assert math.isfinite(report.theoretical_epsilon) and report.consistent
