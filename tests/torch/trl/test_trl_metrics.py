"""TRL's log metrics computed per example: the reduction, its independence across examples, and the values coming
back through the core's clipped gradient as per-example aux outputs (the seam the trainer's step uses)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_model
from trl_support import preference_rows, prompt_completion_rows, tiny_tokenizer

from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from opake_torch.transformers.trl.metrics import (
    DPO_METRICS,
    SFT_METRICS,
    TRLMetrics,
    sft_example_metrics,
    trl_log_metrics,
)

BASE = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf, "use_cpu": True, "disable_tqdm": True,
        "report_to": "none", "save_strategy": "no", "max_steps": 1, "per_device_train_batch_size": 4}  # fmt: skip


def test_sft_example_metrics_against_a_direct_count():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen, dtype=torch.float64)
    labels = torch.tensor([-100, -100, 3, 7, -100, 2])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    out = sft_example_metrics(logits, labels, mask)
    # position t predicts labels[t + 1]: targets at t = 1, 2, 4
    hits = sum(int(logits[t].argmax() == labels[t + 1]) for t in (1, 2, 4))
    probs = [F.softmax(logits[t], -1) for t in (1, 2, 4)]
    entropy = sum(float(-(p * p.log()).sum()) for p in probs)
    assert out["num_tokens"].item() == 5
    assert (out["correct_tokens"].item(), out["accuracy_tokens"].item()) == (hits, 3)
    assert out["entropy_sum"].item() == pytest.approx(entropy, rel=1e-6)
    assert set(sft_example_metrics(None, labels, mask)) == {"num_tokens"}


def test_reduction_per_example_per_token_and_cumulative_tokens():
    metrics = TRLMetrics()
    assert metrics.drain() == {}
    metrics.add({"rewards/chosen": torch.tensor([1.0, 3.0]), "correct_tokens": torch.tensor([1.0, 0.0]),
                 "accuracy_tokens": torch.tensor([1.0, 3.0]), "num_tokens": torch.tensor([5.0, 7.0])})  # fmt: skip
    metrics.add({"rewards/chosen": torch.tensor([5.0]), "correct_tokens": torch.tensor([2.0]),
                 "accuracy_tokens": torch.tensor([4.0]), "num_tokens": torch.tensor([3.0])})  # fmt: skip
    row = metrics.drain()
    assert row == {"rewards/chosen": 3.0, "mean_token_accuracy": 3 / 8, "num_tokens": 15.0}
    metrics.add({"rewards/chosen": torch.tensor([0.0]), "correct_tokens": torch.tensor([0.0]),
                 "accuracy_tokens": torch.tensor([0.0]), "num_tokens": torch.tensor([2.0])})  # fmt: skip
    assert metrics.drain() == {"rewards/chosen": 0.0, "mean_token_accuracy": 0.0, "num_tokens": 17.0}  # cumulative
    metrics.add({"num_tokens": torch.zeros(0)})  # an empty Poisson draw adds no example
    assert metrics.drain() == {"num_tokens": 17.0}
    assert trl_log_metrics({}, 0, 0.0) == {}
    with pytest.raises(InputTypeError, match="batch size"):
        metrics.add({"a": torch.zeros(2), "b": torch.zeros(3)})


def _through_clipped_grad(trainer, rows):
    """The per-example aux values as the core step returns them: clipped_grad(has_aux=True) over the batch."""
    batch = trainer.fetch_batch(trainer.train_dataset, rows)
    grad_fn, state = clipped_grad(
        trainer.compute_per_example_loss_and_metrics, clipping_norm=1.0, batch_argnums=1, has_aux=True,
        return_diagnostics=True, microbatch_size=2,
    )  # fmt: skip
    (_, aux, diagnostics), _ = grad_fn(trainer._params, batch, state=state)
    return batch, aux, diagnostics


def test_sft_metrics_come_back_per_example_from_the_clipped_step(tmp_path):
    data = prompt_completion_rows(5)
    trainer = SFTTrainer(tiny_model("llama"), SFTConfig(str(tmp_path), **BASE), train_dataset=data,
                         processing_class=tiny_tokenizer())  # fmt: skip
    batch, aux, diagnostics = _through_clipped_grad(trainer, [0, 1, 2, 3, 4])
    losses = torch.func.vmap(trainer.compute_per_example_loss, in_dims=(None, 0))(trainer._params, batch)
    torch.testing.assert_close(diagnostics.losses, losses, atol=1e-6, rtol=1e-6)
    for i in range(5):  # each row is that example's own values
        one = trainer.compute_per_example_loss_and_metrics(trainer._params, {k: v[i] for k, v in batch.items()})[1]
        for name, value in one.items():
            torch.testing.assert_close(aux[name][i], value, atol=1e-5, rtol=1e-5)
    metrics = TRLMetrics()
    metrics.add(aux)
    assert set(metrics.drain()) == set(SFT_METRICS)


def test_dpo_metrics_come_back_per_example_and_a_neighbour_changes_only_its_own(tmp_path):
    data = preference_rows(4)
    changed = [*data[:2], {"prompt": "big dog", "chosen": " ran on the mat", "rejected": " no"}, data[3]]
    auxes = []
    for rows in (data, changed):
        trainer = DPOTrainer(tiny_model("llama"), None, DPOConfig(str(tmp_path), **BASE, loss_type="robust",
                             label_smoothing=0.1), train_dataset=rows, processing_class=tiny_tokenizer())  # fmt: skip
        auxes.append(_through_clipped_grad(trainer, [0, 1, 2, 3])[1])
    for name in auxes[0]:
        keep = [0, 1, 3]
        torch.testing.assert_close(auxes[0][name][keep], auxes[1][name][keep], atol=1e-6, rtol=1e-6)
    assert auxes[0]["rewards/accuracies"].tolist() == [0.0] * 4  # reference = initial policy: zero rewards
    metrics = TRLMetrics()
    metrics.add(auxes[0])
    row = metrics.drain()
    assert set(row) == set(DPO_METRICS)
    assert row["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


def test_chunked_nll_reports_num_tokens_only(tmp_path):
    trainer = SFTTrainer(tiny_model("llama"), SFTConfig(str(tmp_path), **BASE, loss_type="chunked_nll"),
                         train_dataset=prompt_completion_rows(2), processing_class=tiny_tokenizer())  # fmt: skip
    example = trainer.train_dataset[0]
    loss, values = trainer.compute_per_example_loss_and_metrics(trainer._params, example)
    torch.testing.assert_close(loss, trainer.compute_per_example_loss(trainer._params, example))
    assert set(values) == {"num_tokens"}


def test_sft_batched_metrics_equal_the_per_example_ones(tmp_path):
    trainer = SFTTrainer(tiny_model("llama"), SFTConfig(str(tmp_path), **BASE), train_dataset=prompt_completion_rows(4),
                         processing_class=tiny_tokenizer())  # fmt: skip
    batch = trainer.fetch_batch(trainer.train_dataset, [0, 1, 2, 3])
    losses, values = trainer.compute_batch_losses_and_metrics(trainer._params, batch)
    one = torch.func.vmap(trainer.compute_per_example_loss_and_metrics, in_dims=(None, 0))
    per_losses, per_values = one(trainer._params, batch)
    torch.testing.assert_close(losses, per_losses, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses, trainer.compute_batch_losses(trainer._params, batch), atol=1e-5, rtol=1e-5)
    assert set(values) == set(per_values)
    for name in values:
        torch.testing.assert_close(values[name], per_values[name], atol=1e-5, rtol=1e-5)
    dft = SFTTrainer(tiny_model("llama"), SFTConfig(str(tmp_path), **BASE, loss_type="dft"),
                     train_dataset=prompt_completion_rows(2), processing_class=tiny_tokenizer())  # fmt: skip
    with pytest.raises(ConfigurationError, match="no batched form"):
        dft.compute_batch_losses_and_metrics(dft._params, dft.fetch_batch(dft.train_dataset, [0, 1]))


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_training_logs_carry_trl_s_metric_names_from_the_step(tmp_path, engine):
    """SFT (both engines: the layerwise one through the batched form) and DPO log TRL's names at each log row, from
    the per-example values the step returns; the loss they log is the step's. The batch is the whole dataset
    (sampling rate 1), so no Poisson draw is empty: an empty draw logs no per-example metric."""
    args = {**BASE, "max_steps": 2, "logging_steps": 1, "per_example_gradients": engine,
            "per_device_train_batch_size": 8}  # fmt: skip
    sft = SFTTrainer(tiny_model("llama"), SFTConfig(str(tmp_path / "sft"), **args),
                     train_dataset=prompt_completion_rows(8), processing_class=tiny_tokenizer())  # fmt: skip
    assert sft.per_example_gradients_engine == engine
    sft.train()
    rows = [row for row in sft.state.log_history if "loss" in row]
    assert len(rows) == 2 and all(set(SFT_METRICS) <= set(row) for row in rows)
    assert all(row["num_tokens"] > 0 and 0 <= row["mean_token_accuracy"] <= 1 for row in rows)
    if engine == "vmap":
        dpo = DPOTrainer(tiny_model("llama"), None, DPOConfig(str(tmp_path / "dpo"), **args),
                         train_dataset=preference_rows(8), processing_class=tiny_tokenizer())  # fmt: skip
        dpo.train()
        rows = [row for row in dpo.state.log_history if "loss" in row]
        assert len(rows) == 2 and all(set(DPO_METRICS) <= set(row) for row in rows)
