"""Hugging Face's Trainer contracts that example scripts rely on: model_init, preprocess_logits_for_metrics,
compute_loss_func(outputs, labels, num_items_in_batch), set_seed(args.seed), the budget stop (logged, and the progress
bar and schedule planned to it), iterable datasets, the accelerator and the other attributes scripts read, and
grad_norm (the norm of the privatized gradient only)."""

from __future__ import annotations

import copy
import logging
from functools import partial

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, pld
from tiny_hf import VOCAB, tiny_args, tiny_model, token_data
from transformers import BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.transformers import DPTrainer

DATA = token_data(40, classes=3)
TEXT = token_data(40)  # causal LM rows: labels from input_ids
_args = partial(tiny_args, max_steps=3, logging_steps=1, privacy_noise_seed=7)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- model_init and preprocess_logits_for_metrics ------------------------------------------------------------------


def test_model_init_builds_the_model_after_set_seed(tmp_path):
    config = tiny_model("bert").config
    built = []

    def model_init():  # draws its initial weights from the global generator, which set_seed(args.seed) seeds
        built.append(BertForSequenceClassification(config))
        return built[-1]

    first = DPTrainer(None, _args(tmp_path), train_dataset=DATA, model_init=model_init)
    torch.rand(100)  # whatever ran before, the same seed gives the same model
    second = DPTrainer(None, _args(tmp_path), train_dataset=DATA, model_init=model_init)
    assert first.model is built[0] and second.model is built[1]
    firsts, seconds = _params(first.model), _params(second.model)
    assert all(torch.equal(firsts[name], seconds[name]) for name in firsts)
    other = DPTrainer(None, _args(tmp_path, seed=43), train_dataset=DATA, model_init=lambda trial: model_init())
    assert not torch.equal(other.model.classifier.weight, first.model.classifier.weight)
    other.train()
    assert other.state.global_step == 3


def test_model_and_model_init_together_or_neither_are_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="both model and model_init"):
        DPTrainer(tiny_model("bert"), _args(tmp_path), train_dataset=DATA, model_init=lambda: tiny_model("bert"))
    with pytest.raises(ConfigurationError, match="needs a model"):
        DPTrainer(None, _args(tmp_path), train_dataset=DATA)


def test_preprocess_logits_for_metrics_shapes_what_compute_metrics_sees(tmp_path):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}

    model = tiny_model("bert")
    plain = DPTrainer(model, _args(tmp_path), eval_dataset=DATA[:10]).predict(DATA[:10])
    trainer = DPTrainer(
        model,
        _args(tmp_path),
        eval_dataset=DATA[:10],
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(dim=-1),
    )
    metrics = trainer.evaluate()
    expected = plain.predictions.argmax(axis=-1)
    np.testing.assert_array_equal(seen[0].predictions, expected)  # [10] class ids, not [10, 3] logits
    assert metrics["eval_accuracy"] == pytest.approx(float((expected == plain.label_ids).mean()))
    assert metrics["eval_loss"] == pytest.approx(plain.metrics["test_loss"])  # the loss reads the logits themselves


# -- compute_loss_func with Hugging Face's contract ------------------------------------------------------------------


def _weighted_sum(logits, labels):
    """Per-token cross-entropy of a causal LM, weighted 2 on even targets and 1 on odd ones, summed."""
    logits, target = logits[..., :-1, :], labels[..., 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="none")
    weight = torch.where(target.reshape(-1) % 2 == 0, 2.0, 1.0).to(ce.dtype)
    return (ce * weight).sum()


def hf_style_loss(outputs, labels, num_items_in_batch):
    return _weighted_sum(outputs.logits.float(), labels) / num_items_in_batch


def test_an_hf_compute_loss_func_gets_each_example_alone_on_the_layerwise_engine(tmp_path, caplog):
    model = tiny_model("llama")
    rows = [
        {**row, "labels": torch.where(torch.arange(len(row["input_ids"])) < 2, -100, row["input_ids"])} for row in TEXT
    ]
    trainer = DPTrainer(model, _args(tmp_path, max_steps=2), train_dataset=rows, compute_loss_func=hf_style_loss)
    batch = trainer.fetch_batch(rows, np.arange(6))  # padded to the longest of six rows
    losses = trainer.compute_batch_losses(trainer.trainable_params, batch).detach().double()

    reference = copy.deepcopy(model).double().eval()  # float64, one example at a time, its own token count
    expected = []
    for row in rows[:6]:
        logits = reference(input_ids=row["input_ids"][None]).logits
        own = (row["labels"][1:] != -100).sum()
        expected.append(_weighted_sum(logits, row["labels"][None]) / own)
    torch.testing.assert_close(losses, torch.stack(expected).detach(), rtol=1e-5, atol=1e-6)

    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train()
    assert "fall back" not in caplog.text
    assert trainer.per_example_gradients_engine == "layerwise"  # its check against grad passed
    assert np.isfinite(trainer.evaluate(rows[:8])["eval_loss"])


# -- set_seed ----------------------------------------------------------------------------------------------------------


def _dropout_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.3,
                        embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
    return GPT2LMHeadModel(config)


def test_the_seed_reaches_dropout_two_runs_are_bitwise_equal(tmp_path):
    model = _dropout_gpt2()
    runs = []
    for seed in (42, 42, 43):  # the runs follow each other: without set_seed, each starts from another RNG state
        trainer = DPTrainer(copy.deepcopy(model), _args(tmp_path, seed=seed), train_dataset=TEXT)
        trainer.train()
        runs.append(_params(trainer.model))
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])
    assert any(not torch.equal(runs[0][name], runs[2][name]) for name in runs[0])


# -- the budget stop --------------------------------------------------------------------------------------------------


def _epsilon(steps: int, delta: float) -> float:
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(0.2, dp_event.GaussianDpEvent(1.0)), steps)
    return accountant.get_epsilon(delta)


class _Bar(TrainerCallback):
    """The progress bar's total and the state's max_steps, seen at every step."""

    def __init__(self):
        self.totals, self.max_steps, self.progress = [], [], None

    def on_step_end(self, args, state, control, **kwargs):
        self.totals.append(self.progress.training_bar.total)
        self.max_steps.append(state.max_steps)


def test_the_budget_stop_is_logged_and_the_bar_and_schedule_are_planned_to_it(tmp_path, caplog):
    delta = 1e-4
    target = (_epsilon(5, delta) + _epsilon(6, delta)) / 2  # dp-accounting directly: step 5 is the last within
    args = _args(
        tmp_path, max_steps=400, privacy_target_epsilon=target, privacy_target_delta=delta, learning_rate=0.01,
        lr_scheduler="linear", warmup_steps=0, disable_tqdm=False,
    )  # fmt: skip
    bar = _Bar()
    trainer = DPTrainer(tiny_model("bert"), args, train_dataset=DATA, callbacks=[bar])
    bar.progress = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ProgressCallback))
    with caplog.at_level(logging.INFO, logger="opake_torch"):
        trainer.train()
    assert trainer.state.global_step == 5 and trainer.state.privacy_target_epsilon_reached
    assert f"target epsilon {target:g} reached at step 5" in caplog.text
    assert "is reached at step 5 of the 400" in caplog.text  # said before the first step too
    assert bar.totals == [5] * 5 and bar.max_steps == [5] * 5
    rates = [row["learning_rate"] for row in trainer.state.log_history if "learning_rate" in row]
    np.testing.assert_allclose(rates, [0.01 * (1 - k / 5) for k in range(5)], rtol=1e-6)  # linear decay over 5 steps


# -- iterable datasets ----------------------------------------------------------------------------------------------


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(DATA)


@pytest.mark.parametrize("name", ["train_dataset", "eval_dataset"])
def test_iterable_datasets_are_refused_when_the_trainer_is_built_with_the_fix(tmp_path, name):
    rows = [{k: v.tolist() for k, v in row.items()} for row in DATA]
    for stream in (datasets.Dataset.from_list(rows).to_iterable_dataset(), _Stream()):
        with pytest.raises(InputTypeError, match=rf"{name} is an iterable dataset") as info:
            DPTrainer(tiny_model("bert"), _args(tmp_path), **{name: stream})
        assert "Poisson sampling" in str(info.value) and "streaming=True" in str(info.value)


# -- the attributes scripts read ---------------------------------------------------------------------------------------


def test_the_accelerator_and_attributes_scripts_read(tmp_path, capsys):
    model = tiny_model("bert")
    trainer = DPTrainer(model, _args(tmp_path, hub_model_id="org/private-bert"), train_dataset=DATA)
    accelerator = trainer.accelerator
    assert accelerator is trainer.accelerator
    assert (accelerator.num_processes, accelerator.process_index, accelerator.is_main_process) == (1, 0, True)
    assert accelerator.is_local_main_process and accelerator.device == torch.device("cpu")
    assert accelerator.unwrap_model(model) is model
    accelerator.wait_for_everyone()
    accelerator.print("done")
    assert capsys.readouterr().out == "done\n"
    assert trainer.model_wrapped is model and trainer.hub_model_id == "org/private-bert"
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    trainer.train()
    assert trainer.optimizer.name == "adamw" and trainer.lr_scheduler(0) == pytest.approx(trainer.args.learning_rate)
    with pytest.raises(ConfigurationError, match="every trial"):
        trainer.hyperparameter_search(n_trials=2)
    trainer.end()  # one process: nothing to tear down


def test_create_model_card_takes_hugging_faces_and_trls_arguments(tmp_path):
    from huggingface_hub import ModelCard

    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path), train_dataset=DATA)
    trainer.train()
    trainer.create_model_card(
        language="en", license="apache-2.0", tags=["text"], model_name="tiny", finetuned_from="org/base",
        tasks="text-classification", dataset_args="default", dataset_name="org/reviews",
    )  # fmt: skip
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.language == "en" and card.data.license == "apache-2.0" and card.data.base_model == "org/base"
    assert card.data.datasets == ["org/reviews"] and "text" in card.data.tags
    assert card.data.pipeline_tag == "text-classification" and "differentially private" in card.text


# -- grad_norm ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("multiplier", [1.0, 20.0])
def test_grad_norm_is_the_norm_of_the_released_noised_gradient(tmp_path, multiplier):
    """With SGD (no momentum, no weight decay) the update is -lr times the noised gradient the step released, so
    grad_norm must be |update| / lr: a function of the published weights, nothing else of the batch."""
    model = tiny_model("bert")
    before = _params(model)
    args = _args(tmp_path, max_steps=1, optim="sgd", learning_rate=0.5, weight_decay=0.0,
                 privacy_noise_multiplier=multiplier)  # fmt: skip
    trainer = DPTrainer(model, args, train_dataset=DATA)
    trainer.train()
    after = _params(trainer.model)
    update = torch.sqrt(sum(((after[n] - before[n]).double() ** 2).sum() for n in before))
    logged = next(row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row)
    assert logged == pytest.approx(float(update) / 0.5, rel=1e-5)
    # the noise dominates: its norm is about std * sqrt(parameters), far above the clipped mean (at most 1)
    std = trainer.state.log_history[0]["privacy_noise_std"]
    parameters = sum(p.numel() for p in before.values())
    assert logged == pytest.approx(std * parameters**0.5, rel=0.1)
