"""Non-finite gradients in DPTrainer: counted per example (both engines), warned, charged; a run of nothing but
non-finite gradients stops; a run without a finite loss reports train_loss NaN, not 0."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_model, token_data
from transformers import TrainerCallback

from opake_core import random, sampling
from opake_core.errors import StateError
from opake_torch.transformers import DPTrainer, TrainingArguments

MARK = 1  # rows whose first token is MARK get a NaN gradient with a finite loss
N, BATCH, STEPS, SEED = 48, 8, 6, 11


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": BATCH,
        "max_steps": STEPS,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": SEED,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def nan_gradient_loss(logits, labels):
    """The causal-LM cross-entropy, plus ``sqrt(s - s) = 0`` for marked rows: the loss is unchanged and finite, its
    gradient NaN (``sqrt`` has an infinite derivative at 0, ``s - s`` sends it back as ``inf - inf``)."""
    base = F.cross_entropy(logits[:-1].float(), labels[1:])
    s = logits.float().sum()
    at_zero = torch.where(labels[0] == MARK, s - s, 1.0 + 0.0 * s)
    return base + torch.sqrt(at_zero) - 1.0


def _data(marked):
    rows = []
    for i, row in enumerate(token_data(N, seed=2)):
        ids = row["input_ids"].clone()
        ids[0] = MARK if i in marked else 2 + ids[0] % 40  # never MARK unless marked
        rows.append({"input_ids": ids, "attention_mask": row["attention_mask"], "labels": ids})
    return rows


def _sampled(steps):
    """The rows the trainer's Poisson sampler draws at each step: the same sampler and key, replayed."""
    sampler = sampling.poisson(dataset_size=N, sample_rate=BATCH / N)
    key = random.fold_in(random.key(SEED), "opake.trainer.sampler")
    state, out = sampler.init(), []
    for _ in range(steps):
        indices, state = sampler.sample(key, state)
        out.append([int(i) for i in indices])
    return out


@pytest.mark.parametrize("engine", ["vmap", "layerwise"])
def test_examples_with_a_nan_gradient_are_counted_warned_and_charged(tmp_path, engine, caplog):
    marked = set(range(2, N, 5))  # not rows 0 and 1, on which the layerwise engine is checked against grad
    expected = sum(len(set(batch) & marked) for batch in _sampled(STEPS))
    assert expected > 0
    args = _args(tmp_path, per_example_gradients=engine)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=_data(marked), compute_loss_func=nan_gradient_loss)
    with caplog.at_level(logging.WARNING):
        output = trainer.train()
    assert trainer.per_example_gradients_engine == engine
    assert output.metrics["nonfinite_examples"] == expected
    rows = [row for row in trainer.state.log_history if "nonfinite_examples" in row and "loss" in row]
    assert [row["nonfinite_examples"] for row in rows] == [
        sum(len(set(batch) & marked) for batch in _sampled(step)) for step in (2, 4, 6)
    ]
    assert "non-finite gradient" in caplog.text and "charged to epsilon" in caplog.text
    assert output.metrics["nonfinite_loss_steps"] == 0 and math.isfinite(output.training_loss)
    assert trainer.privacy_plan is not None and trainer.ledger.releases == STEPS  # every step charged
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _stop_step(first_nan_step, log_every, steps):
    """The log row at which a run whose examples all have a NaN gradient from step ``first_nan_step`` (1-based) on
    stops: the first whose run of dropped examples reaches max(16, 2 expected batches), from the replayed draws."""
    streak = 0
    for step, batch in enumerate(_sampled(steps), start=1):
        streak += len(batch) if step >= first_nan_step else 0
        if step % log_every == 0 and streak >= max(16, 2 * BATCH):
            return step
    return None


def test_a_run_of_only_non_finite_gradients_stops_with_an_error(tmp_path):
    steps = 12
    expected = _stop_step(1, 2, steps)
    assert expected is not None and expected < steps
    args = _args(tmp_path, logging_steps=2, max_steps=steps)
    data = _data(set(range(N)))
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=data, compute_loss_func=nan_gradient_loss)
    with pytest.raises(StateError, match=r"examples of the last \d+ steps had a non-finite gradient"):
        trainer.train()
    assert trainer.state.global_step == expected  # stopped at that log row, not after all the steps
    assert trainer.ledger.releases == expected  # the steps that ran stay charged
    keys = trainer._keys
    with pytest.raises(StateError):  # a later train() is a new segment with new keys, the ledger continued
        trainer.train()
    assert trainer._keys != keys and trainer.ledger.releases > expected


def test_a_stretch_of_only_non_finite_gradients_after_finite_ones_stops(tmp_path):
    """Finite gradients for two steps, then (as when the weights became NaN) every example non-finite: the run stops
    at the log row where two expected batches of them (16 examples) were dropped in a row."""
    steps = 14
    expected = _stop_step(3, 2, steps)
    assert expected is not None and expected < steps
    calls = {"step": 0}

    def loss(logits, labels):  # NaN gradients for every example from the 3rd step on
        poison = torch.tensor(float(calls["step"] >= 2))
        s = logits.float().sum()
        at_zero = torch.where(poison > 0, s - s, 1.0 + 0.0 * s)
        return F.cross_entropy(logits[:-1].float(), labels[1:]) + torch.sqrt(at_zero) - 1.0

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            calls["step"] = state.global_step

    args = _args(tmp_path, logging_steps=2, max_steps=steps, per_example_gradients="vmap")
    trainer = DPTrainer(
        tiny_model("llama"), args, train_dataset=_data(set()), compute_loss_func=loss, callbacks=[Count()]
    )
    with pytest.raises(StateError, match=r"examples of the last \d+ steps had a non-finite gradient"):
        trainer.train()
    assert trainer.state.global_step == expected


def test_a_few_bad_records_in_a_small_batch_do_not_stop_the_run(tmp_path):
    """Every example of the first log row dropped, but fewer than 16 of them: the run goes on (warned)."""
    first = _sampled(1)[0]
    assert 0 < len(first) < 16
    args = _args(tmp_path, logging_steps=1, max_steps=3)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=_data(set(first)), compute_loss_func=nan_gradient_loss)
    output = trainer.train()
    assert output.global_step == 3 and output.metrics["nonfinite_examples"] >= len(first)


def test_train_loss_is_nan_not_zero_without_a_finite_loss(tmp_path, caplog):
    """An infinite constant in the loss: every loss is inf, every gradient finite (so nothing is dropped)."""

    def loss(logits, labels):
        return F.cross_entropy(logits[:-1].float(), labels[1:]) + math.inf

    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=_data(set()), compute_loss_func=loss)
    with caplog.at_level(logging.WARNING):
        output = trainer.train()
    assert math.isnan(output.training_loss) and math.isnan(output.metrics["train_loss"])
    assert output.metrics["nonfinite_examples"] == 0 and output.metrics["nonfinite_loss_steps"] > 0
    assert "train_loss is NaN" in caplog.text
