"""The transformers.Trainer surface that example scripts use: refused overrides, report_to through Hugging Face's
integrations (TensorBoard for real), log_metrics / save_metrics / save_state, speed metrics, data loaders."""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest
import torch
import transformers.integrations as hf_integrations
from tiny_hf import tiny_model, token_data
from transformers import trainer_pt_utils
from transformers.integrations import TensorBoardCallback
from transformers.utils import logging as hf_logging

from opake_core.errors import ConfigurationError, PrivacyBudgetError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.reporting import RunLogCallback

DATA = token_data(40, classes=3)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 4,
        "privacy_noise_multiplier": 1.0,
        "privacy_accounting": True,
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 7,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _trainer(tmp_path, cls=DPTrainer, **kw):
    return cls(tiny_model("bert"), _args(tmp_path, **kw), train_dataset=DATA, eval_dataset=DATA[:10])


# -- overridden transformers.Trainer methods are refused with the seam to use -------------------------------------


class _ComputeLoss(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise AssertionError("never called")


class _TrainingStep(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        raise AssertionError("never called")


class _CreateOptimizer(DPTrainer):
    def create_optimizer(self):
        raise AssertionError("never called")


class _Inherited(_ComputeLoss):  # an override further up the hierarchy counts too
    pass


@pytest.mark.parametrize(
    ("cls", "method", "seam"),
    [
        (_ComputeLoss, "compute_loss", "compute_per_example_loss"),
        (_TrainingStep, "training_step", "compute_batch_losses"),
        (_CreateOptimizer, "create_optimizer", "args.optim"),
        (_Inherited, "compute_loss", "compute_per_example_loss"),
    ],
)
def test_overridden_trainer_methods_are_refused_with_the_seam(tmp_path, cls, method, seam):
    with pytest.raises(ConfigurationError, match=rf"overrides {method}\(\), which DPTrainer never calls") as info:
        _trainer(tmp_path, cls)
    assert seam in str(info.value)


def test_the_seams_themselves_are_accepted(tmp_path):
    class PerExample(DPTrainer):
        def compute_per_example_loss(self, params, example):
            return super().compute_per_example_loss(params, example)

        def compute_batch_losses(self, params, batch):
            return super().compute_batch_losses(params, batch)

    _trainer(tmp_path, PerExample)


def test_hugging_face_arguments_without_a_budget_are_refused_with_the_conversion(tmp_path):
    import transformers

    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(PrivacyBudgetError, match="from_hf"):
        DPTrainer(tiny_model("bert"), hf_args, train_dataset=DATA)


# -- report_to ----------------------------------------------------------------------------------------------------


def _integrations(trainer):
    kinds = tuple(hf_integrations.INTEGRATION_TO_CALLBACK.values())
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, kinds)]


def test_report_to_none_adds_no_integration_and_keeps_the_run_log(tmp_path):
    trainer = _trainer(tmp_path, report_to="none")
    assert _integrations(trainer) == []
    assert any(isinstance(cb, RunLogCallback) for cb in trainer.callback_handler.callbacks)


def test_report_to_all_means_every_installed_integration(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_integrations, "get_available_reporting_integrations", lambda: [])
    assert _integrations(_trainer(tmp_path, report_to="all")) == []


def test_a_missing_backend_fails_at_construction_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_integrations, "is_wandb_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"pip install wandb"):
        _trainer(tmp_path, report_to=["wandb"])
    monkeypatch.setattr(hf_integrations, "is_mlflow_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"pip install mlflow"):
        _trainer(tmp_path, report_to="mlflow")
    monkeypatch.setattr(hf_integrations, "is_tensorboard_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"pip install tensorboard"):
        _trainer(tmp_path, report_to="tensorboard")


def test_an_unknown_integration_gets_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigurationError, match=r"(?i)did you mean 'tensorboard'"):
        _trainer(tmp_path, report_to="tensorbord")


def test_integrations_get_every_log_row_privacy_included(tmp_path, monkeypatch):
    """Hugging Face's integration callback classes are what report_to builds; a stand-in backend records on_log."""
    seen = []

    class Recorder(hf_integrations.TensorBoardCallback):
        def __init__(self):  # no tensorboard needed
            self.logging_dir = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

        def on_train_begin(self, *a, **k):
            pass

        def on_train_end(self, *a, **k):
            pass

    monkeypatch.setitem(hf_integrations.INTEGRATION_TO_CALLBACK, "tensorboard", Recorder)
    monkeypatch.setattr(hf_integrations, "is_tensorboard_available", lambda: True)
    trainer = _trainer(tmp_path, report_to="tensorboard")
    assert [type(cb) for cb in _integrations(trainer)] == [Recorder]
    output = trainer.train()
    rows = [row for row in seen if "loss" in row]
    assert len(rows) == 2 and all("privacy_epsilon" in row and "privacy_noise_multiplier" in row for row in rows)
    assert seen[-1]["privacy_epsilon"] == output.metrics["privacy_epsilon"]


def test_tensorboard_integration_writes_the_privacy_scalars(tmp_path):
    """Hugging Face's TensorBoardCallback for real; the event file read back holds epsilon as logged."""
    pytest.importorskip(
        "tensorboard",
        reason="tensorboard is not installed (no extra of pyproject.toml has it); `pip install tensorboard` runs it",
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _trainer(tmp_path, report_to=["tensorboard"])
    assert [type(cb) for cb in _integrations(trainer)] == [TensorBoardCallback]
    output = trainer.train()
    logdir = tmp_path / "out" / "runs"  # logging_dir, beside log.jsonl: never uploaded
    events = sorted(logdir.glob("events.out.tfevents.*"))
    assert events and (logdir / "log.jsonl").is_file()
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert {"train/privacy_epsilon", "train/privacy_delta", "train/privacy_noise_multiplier", "train/loss"} <= set(tags)
    epsilons = accumulator.Scalars("train/privacy_epsilon")
    assert [e.step for e in epsilons] == [2, 4, 4]  # two log rows and the final metrics
    assert epsilons[-1].value == pytest.approx(output.metrics["privacy_epsilon"], rel=1e-6)  # stored as float32


# -- methods and metrics of example scripts -----------------------------------------------------------------------


def test_hugging_face_metric_helpers_are_the_transformers_functions(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    assert DPTrainer.log_metrics is trainer_pt_utils.log_metrics
    assert DPTrainer.save_metrics is trainer_pt_utils.save_metrics
    assert DPTrainer.save_state is trainer_pt_utils.save_state
    assert trainer.is_local_process_zero() and trainer.is_world_process_zero()
    metrics = trainer.train().metrics
    assert trainer.metrics_format(metrics) == trainer_pt_utils.metrics_format(metrics)
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "privacy_epsilon" in printed
    trainer.save_metrics("train", metrics)
    eval_metrics = trainer.evaluate()
    trainer.save_metrics("eval", eval_metrics)
    trainer.save_state()
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text()) == pytest.approx(metrics)
    combined = json.loads((out / "all_results.json").read_text())
    assert combined["privacy_epsilon"] == metrics["privacy_epsilon"] and "eval_loss" in combined
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["log_history"] == json.loads(json.dumps(trainer.state.log_history))


def test_train_metrics_have_hugging_faces_names(tmp_path):
    trainer = _trainer(tmp_path)
    output = trainer.train()
    metrics = output.metrics
    for name in ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"):
        assert name in metrics, name
    assert metrics["train_samples"] == len(DATA)
    assert metrics["epoch"] == pytest.approx(4 * 8 / len(DATA)) == trainer.state.epoch
    # the expected rows of the steps run, per second (Hugging Face counts the nominal batch too)
    rate = metrics["train_samples_per_second"] / metrics["train_steps_per_second"]
    assert rate == pytest.approx(8.0, rel=1e-2)
    assert trainer.state.log_history[-1] == {**metrics, "step": 4}


def test_eval_and_predict_metrics_have_speed_and_epoch(tmp_path):
    trainer = _trainer(tmp_path, per_device_eval_batch_size=4)
    trainer.train()
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"} <= set(metrics)
    assert 0 <= metrics["eval_runtime"] < 600
    if metrics["eval_runtime"] > 0:
        ratio = metrics["eval_samples_per_second"] / metrics["eval_steps_per_second"]
        assert ratio == pytest.approx(10 / 3, rel=1e-2)  # 10 rows in 3 batches of at most 4
    predicted = trainer.predict(DATA[:6], metric_key_prefix="predict")
    assert {"predict_loss", "predict_runtime", "predict_samples_per_second"} <= set(predicted.metrics)


def test_train_dataloader_draws_like_training_without_touching_it(tmp_path):
    loader = _trainer(tmp_path).get_train_dataloader()
    assert len(loader) == 5  # one expected epoch: N / expected batch
    sizes = []
    for _ in range(20):
        batches = list(loader)
        assert len(batches) == 5
        sizes += [len(batch["labels"]) for batch in batches]
        assert all(set(batch) == {"input_ids", "attention_mask", "labels"} for batch in batches)
    assert len(set(sizes)) > 3 and np.mean(sizes) == pytest.approx(8.0, abs=1.0)  # Poisson: variable size, mean 8
    first = torch.cat([b["labels"] for b in loader])
    assert not all(torch.equal(first, torch.cat([b["labels"] for b in loader])) for _ in range(3))  # fresh keys
    # the loader's draws do not move training: with the same noise seed the weights are identical
    plain, used = _trainer(tmp_path / "a"), _trainer(tmp_path / "b")
    list(used.get_train_dataloader())
    plain.train()
    used.train()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), used.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert used.num_examples(loader) == len(DATA)


def test_eval_dataloader_holds_the_rows_evaluation_runs_in_order(tmp_path):
    trainer = _trainer(tmp_path, per_device_eval_batch_size=4)
    loader = trainer.get_eval_dataloader()
    batches = list(loader)
    assert [len(b["labels"]) for b in batches] == [4, 4, 2] and trainer.num_examples(loader) == 10
    labels = torch.cat([b["labels"] for b in batches])
    assert torch.equal(labels, torch.stack([row["labels"] for row in DATA[:10]]))
    assert [len(b["labels"]) for b in trainer.get_test_dataloader(DATA[:5])] == [4, 1]
    trainer.eval_dataset = {"small": DATA[:3]}
    assert [len(b["labels"]) for b in trainer.get_eval_dataloader("small")] == [3]


def test_loaders_and_evaluation_honour_dataloader_num_workers_and_pin_memory(tmp_path):
    plain = _trainer(tmp_path / "plain", per_device_eval_batch_size=4)
    workers = _trainer(tmp_path / "workers", per_device_eval_batch_size=4, dataloader_num_workers=2)
    for loader in (
        workers.get_eval_dataloader(),
        workers.get_test_dataloader(DATA[:5]),
        workers.get_train_dataloader(),
    ):
        assert loader.num_workers == 2 and not loader.pin_memory  # pinned memory serves CUDA copies only
    batches = list(workers.get_eval_dataloader())  # collated in worker processes, moved in this one
    assert [len(b["labels"]) for b in batches] == [4, 4, 2]
    assert all(b["labels"].device == workers.args.device for b in batches)
    for batch, expected in zip(batches, plain.get_eval_dataloader(), strict=True):
        assert batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k]) for k in batch)
    assert workers.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    assert plain.get_eval_dataloader().num_workers == 0


@pytest.fixture
def restore_log_levels():
    opake = logging.getLogger("opake_torch")
    levels = (opake.level, hf_logging.get_verbosity())
    yield
    opake.setLevel(levels[0])
    hf_logging.set_verbosity(levels[1])


def test_the_trainer_applies_the_log_level_as_hugging_face_does(tmp_path, restore_log_levels, monkeypatch):
    opake = logging.getLogger("opake_torch")
    hf_logging.set_verbosity_warning()
    opake.setLevel(logging.NOTSET)
    _trainer(tmp_path)  # log_level="passive": nothing changes
    assert (hf_logging.get_verbosity(), opake.level) == (logging.WARNING, logging.NOTSET)
    trainer = _trainer(tmp_path, log_level="error")
    assert trainer.args.get_process_log_level() == logging.ERROR
    assert (hf_logging.get_verbosity(), opake.level) == (logging.ERROR, logging.ERROR)
    _trainer(tmp_path, log_level="debug")
    assert (hf_logging.get_verbosity(), opake.level) == (logging.DEBUG, logging.DEBUG)
    assert logging.getLogger("opake_torch.transformers.trainer").getEffectiveLevel() == logging.DEBUG
    monkeypatch.setenv("LOCAL_RANK", "1")  # a replica: log_level_replica ("warning" by default)
    _trainer(tmp_path, log_level="debug")
    assert (hf_logging.get_verbosity(), opake.level) == (logging.WARNING, logging.WARNING)


def test_epoch_is_added_to_logs_as_hugging_face_does(tmp_path):
    trainer = _trainer(tmp_path)
    logs = {"custom": 1.0}
    trainer.log(logs)
    assert logs == {"custom": 1.0, "epoch": trainer.state.epoch}
    trainer.train()
    logs = {"custom": 2.0}
    trainer.log(logs)
    assert logs["epoch"] == trainer.state.epoch and trainer.state.log_history[-1]["custom"] == 2.0
    assert not math.isnan(logs["epoch"])


def test_log_with_a_start_time_adds_the_runtime_as_hugging_face_does(tmp_path):
    trainer = _trainer(tmp_path)
    logs = {"custom": 1.0}
    trainer.log(logs, start_time=time.time() - 2.0)
    assert 2.0 <= logs["train_runtime"] < 60.0 and logs["custom"] == 1.0
