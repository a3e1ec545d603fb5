"""TRL's per-pair DPO losses against an independent float64 computation of TRL's formulas (plain ``math``)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from opake_core.errors import ConfigurationError
from opake_torch.transformers.trl.config import DPO_LOSS_TYPES
from opake_torch.transformers.trl.dpo import dpo_loss
from opake_torch.transformers.trl.dpo_losses import REFERENCE_FREE_LOSSES

# dpo_loss holds TRL DPOTrainer's losses; the reference-free ones are tested in test_dpo_pair_losses.py
TRL_DPO_LOSSES = [loss for loss in DPO_LOSS_TYPES if loss not in REFERENCE_FREE_LOSSES]


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _sig(x: float) -> float:
    return math.exp(_logsig(x))


def trl_formula(loss, pc, pr, rc, rr, nc, nr, *, beta, eps, tau):
    """TRL 1.16's ``per_sequence_loss`` (trl/trainer/dpo_trainer.py, f_divergence_type='reverse_kl') for one pair."""
    c, r = pc - rc, pr - rr  # chosen / rejected log-ratios
    d = c - r
    if loss == "sigmoid":
        return -_logsig(beta * d)
    if loss == "hinge":
        return max(0.0, 1 - beta * d)
    if loss == "ipo":
        return (c / max(nc, 1) - r / max(nr, 1) - 1 / (2 * beta)) ** 2
    if loss == "exo_pair":
        qw, ql = _sig(beta * d), _sig(-beta * d)
        return qw * (_logsig(beta * d) - math.log1p(-eps)) + ql * (_logsig(-beta * d) - math.log(eps))
    if loss == "nca_pair":
        return -_logsig(beta * c) - 0.5 * _logsig(-beta * c) - 0.5 * _logsig(-beta * r)
    if loss == "robust":
        return (-(1 - eps) * _logsig(beta * d) + eps * _logsig(-beta * d)) / (1 - 2 * eps)
    if loss == "bco_pair":
        return -_logsig(beta * c) - _logsig(-beta * r)
    if loss == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss == "apo_zero":
        return (1 - _sig(beta * c)) + _sig(beta * r)
    if loss == "apo_down":
        return _sig(beta * c) + (1 - _sig(beta * (c - r)))
    if loss == "discopop":
        logits = beta * d
        m = _sig(logits / tau)
        return -_logsig(logits) * (1 - m) + math.exp(-logits) * m
    if loss == "sigmoid_norm":
        return -_logsig(beta * (c / max(nc, 1) - r / max(nr, 1)))
    raise AssertionError(loss)


def test_every_supported_loss_has_a_reference_formula():
    for loss in TRL_DPO_LOSSES:
        trl_formula(loss, -3.0, -4.0, -3.5, -3.5, 2, 3, beta=0.1, eps=0.1, tau=0.05)


@pytest.mark.parametrize("loss", TRL_DPO_LOSSES)
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_loss_equals_trls_formula_in_float64(loss, beta):
    rng = random.Random(f"{loss}-{beta}")
    eps = 1e-3 if loss == "exo_pair" else 0.1
    rows = []
    for _ in range(64):
        pc, pr, rc, rr = (rng.uniform(-30.0, -0.5) for _ in range(4))
        rows.append((pc, pr, rc, rr, rng.randint(0, 12), rng.randint(1, 12)))
    pc, pr, rc, rr, nc, nr = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))
    ours = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss, chosen_tokens=nc, rejected_tokens=nr,
                    label_smoothing=eps, discopop_tau=0.05)  # fmt: skip
    assert ours.dtype == torch.float64
    expected = [
        trl_formula(loss, *map(float, vals), beta=beta, eps=eps, tau=0.05)
        for vals in zip(pc, pr, rc, rr, nc, nr, strict=True)
    ]
    torch.testing.assert_close(ours, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_each_pair_gets_its_own_loss():
    """Elementwise over a batch: a pair's loss does not change when another pair changes (no batch statistic)."""
    gen = torch.Generator().manual_seed(0)
    base = [-torch.rand(8, generator=gen, dtype=torch.float64) * 10 for _ in range(4)]
    tokens = torch.arange(1, 9, dtype=torch.float64)
    for loss in TRL_DPO_LOSSES:
        kwargs = {"beta": 0.3, "loss_type": loss, "chosen_tokens": tokens, "rejected_tokens": tokens + 1,
                  "label_smoothing": 0.01}  # fmt: skip
        before = dpo_loss(*base, **kwargs)
        changed = [t.clone() for t in base]
        changed[0][3] -= 5.0
        after = dpo_loss(*changed, **kwargs)
        keep = [i for i in range(8) if i != 3]
        assert torch.equal(before[keep], after[keep]), loss
        assert not torch.equal(before[3], after[3]), loss


def test_length_normalized_losses_need_lengths():
    one = torch.tensor(-1.0)
    for loss in ("ipo", "sigmoid_norm"):
        with pytest.raises(ConfigurationError, match="completion lengths"):
            dpo_loss(one, one, one, one, beta=0.1, loss_type=loss)
    with pytest.raises(ConfigurationError, match="loss_type must be one of"):
        dpo_loss(one, one, one, one, beta=0.1, loss_type="aot")
