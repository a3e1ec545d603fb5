"""Bad rows and bad model outputs are refused before the first step: nothing released, nothing charged, no
checkpoint, and an error that names the row, the column, the value and the fix."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from tiny_hf import VOCAB, tiny_model, token_data
from torch import nn
from transformers import TrainerCallback
from transformers.modeling_outputs import SequenceClassifierOutput

from opake_core.errors import ConfigurationError, InputTypeError, OpakeError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.dataset_check import Schema, check_dataset

CLASSES = 3


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps += 1


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 8,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "logging_steps": 2,
        "save_strategy": "steps",
        "save_steps": 1,
        "report_to": "none",
        "privacy_noise_seed": 0,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _refused_before_the_first_step(tmp_path, model, data, match, *, error=OpakeError, **kw):
    """Train on ``data``: the error must come before any step (no step began, the ledger is empty, no
    checkpoint folder exists) and say ``match``."""
    counter = StepCounter()
    trainer = DPTrainer(model, _args(tmp_path, **kw), train_dataset=data, callbacks=[counter])
    with pytest.raises(error, match=match) as info:
        trainer.train()
    assert counter.steps == 0 and trainer.state.global_step == 0
    assert trainer.ledger.releases == 0
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    return info.value


def _classification(n=64):
    return [dict(row) for row in token_data(n, seed=1, classes=CLASSES)]


# -- the acceptance cases --------------------------------------------------------------------------------------------


def test_a_class_label_out_of_range_in_row_40_is_refused_before_step_1(tmp_path):
    data = _classification()
    data[40]["labels"] = torch.tensor(7)
    error = _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"row 40, column 'labels'")
    assert isinstance(error, ConfigurationError)
    assert "class id 7 is not in [0, 3)" in str(error) and "num_labels=3" in str(error)


def test_a_negative_label_is_refused(tmp_path):
    data = _classification()
    data[23]["labels"] = -1
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"row 23, column 'labels': class id -1")


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_token_id_outside_the_vocabulary_is_refused(tmp_path, family):
    data = _classification() if family == "bert" else [dict(row) for row in token_data(64, seed=1)]
    data[51]["input_ids"] = torch.cat([data[51]["input_ids"][:-1], torch.tensor([VOCAB])])
    _refused_before_the_first_step(
        tmp_path, tiny_model(family), data, rf"row 51, column 'input_ids': token id {VOCAB} is not in \[0, {VOCAB}\)"
    )


def test_rows_without_labels_are_refused_for_classification(tmp_path):
    data = _classification()
    del data[17]["labels"]
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"row 17 has no column 'labels' \(or 'label'\)")
    unlabelled = [{k: v for k, v in row.items() if k != "labels"} for row in _classification()]
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), unlabelled, r"row 0 has no column 'labels'")


class _TupleForSequenceClassification(nn.Module):
    """A classifier whose forward returns a plain tuple, as Hugging Face models do with ``return_dict=False``."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_model("bert")
        self.config = self.inner.config

    def forward(self, input_ids=None, attention_mask=None):
        return (self.inner(input_ids=input_ids, attention_mask=attention_mask).logits,)


def test_a_model_without_logits_is_refused(tmp_path):
    error = _refused_before_the_first_step(
        tmp_path, _TupleForSequenceClassification(), _classification(), r"without \.logits", error=ConfigurationError
    )
    assert "override compute_per_example_loss" in str(error)


# -- more rows and outputs the loss cannot take ---------------------------------------------------------------------


def test_a_head_of_another_width_than_num_labels_is_refused(tmp_path):
    model = tiny_model("bert")
    model.classifier = nn.Linear(16, 5)  # config.num_labels stays 3: labels 3 and 4 would be read silently
    _refused_before_the_first_step(tmp_path, model, _classification(), r"shape \[1, 5\].*\[1x3\]")


def test_a_row_longer_than_the_position_embeddings_is_refused(tmp_path):
    data = _classification()
    data[30]["input_ids"] = torch.randint(1, VOCAB, (40,))  # BERT's tiny config has 32 positions
    data[30]["attention_mask"] = torch.ones(40, dtype=torch.long)
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"forward failed on train_dataset row 30")


def test_a_mask_of_another_length_and_mask_values_are_refused(tmp_path):
    data = _classification()
    data[9]["attention_mask"] = data[9]["attention_mask"][:-1]
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"row 9, column 'attention_mask': \d+ values")
    data = _classification()
    data[9]["attention_mask"] = data[9]["attention_mask"] * 2
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"attention mask value 2 is not in \[0, 2\)")


def test_float_token_ids_and_string_labels_are_type_errors(tmp_path):
    data = _classification()
    data[5]["input_ids"] = data[5]["input_ids"].float()
    _refused_before_the_first_step(
        tmp_path, tiny_model("bert"), data, r"row 5.*integer token ids", error=InputTypeError
    )
    data = _classification()
    data[6]["labels"] = "positive"
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), data, r"row 6.*ClassLabel", error=InputTypeError)


def test_regression_takes_finite_floats_and_refuses_class_ids(tmp_path):
    model = tiny_model("bert")
    model.classifier = nn.Linear(16, 1)
    model.config.num_labels = 1
    data = [{**row, "labels": torch.tensor(float(row["labels"]) / 2)} for row in _classification()]
    bad = [dict(row) for row in data]
    bad[12]["labels"] = torch.tensor(math.nan)
    _refused_before_the_first_step(tmp_path, model, bad, r"row 12, column 'labels': a non-finite label")
    ints = [{**row, "labels": int(row["labels"] * 2)} for row in data]
    _refused_before_the_first_step(tmp_path, model, ints, r"integer label for a model with num_labels=1")
    output = DPTrainer(model, _args(tmp_path / "ok", save_strategy="no", max_steps=2), train_dataset=data).train()
    assert math.isfinite(output.training_loss)


def test_regression_over_several_outputs_is_refused(tmp_path):
    """problem_type='regression' with 3 outputs: the loss would take float labels as class probabilities."""
    model = tiny_model("bert")
    model.config.problem_type = "regression"
    data = [{**row, "labels": torch.rand(CLASSES)} for row in _classification()]
    _refused_before_the_first_step(tmp_path, model, data, r"problem_type='regression' with num_labels=3")


def test_empty_records_are_left_to_the_collate_layer():
    """An empty input_ids (with an empty mask) is no error of the dataset check: the collate and loss layer decides
    how it trains."""
    data = _classification(8)
    data[3] = {"input_ids": torch.zeros(0, dtype=torch.long), "attention_mask": torch.zeros(0, dtype=torch.long),
               "labels": torch.tensor(1)}  # fmt: skip
    schema = Schema(vocab_size=VOCAB, label_kind="class", label_bound=CLASSES, require_labels=True)
    summary = check_dataset(data, schema, name="train_dataset")
    assert summary.rows == 8 and summary.probe_row != 3
    data[4]["input_ids"] = []  # a python list: no dtype of its own
    data[4]["attention_mask"] = []
    check_dataset(data, schema, name="train_dataset")


def test_the_eval_dataset_is_checked_at_evaluate_and_may_lack_labels(tmp_path):
    data = _classification(16)
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, save_strategy="no", max_steps=1), train_dataset=data)
    bad = [dict(row) for row in data]
    bad[11]["labels"] = torch.tensor(3)
    with pytest.raises(ConfigurationError, match=r"eval dataset row 11, column 'labels': class id 3"):
        trainer.evaluate(bad)
    unlabelled = [{k: v for k, v in row.items() if k != "labels"} for row in data]
    trainer.predict(unlabelled)  # prediction without labels stays allowed
    counter = StepCounter()
    evaluating = _args(tmp_path / "e", save_strategy="no", eval_strategy="steps", eval_steps=1)
    trainer = DPTrainer(tiny_model("bert"), evaluating, train_dataset=data, eval_dataset=bad, callbacks=[counter])
    with pytest.raises(ConfigurationError, match=r"eval_dataset row 11"):  # refused before the first step too
        trainer.train()
    assert counter.steps == 0


@pytest.mark.parametrize("shuffled", [False, True])
def test_a_datasets_dataset_is_checked_through_arrow_with_the_dataset_row_index(tmp_path, shuffled):
    rows = _classification()
    table = datasets.Dataset.from_dict(
        {
            "input_ids": [r["input_ids"].tolist() for r in rows],
            "attention_mask": [r["attention_mask"].tolist() for r in rows],
            "labels": [int(r["labels"]) for r in rows],
        }
    )
    table = table.shuffle(seed=3) if shuffled else table
    bad_row = 40
    labels = table["labels"]
    labels = [7 if i == bad_row else v for i, v in enumerate(labels)]
    table = table.remove_columns("labels").add_column("labels", labels)
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), table, rf"row {bad_row}, column 'labels': class id 7")
    floats = table.cast_column("input_ids", datasets.List(datasets.Value("float32")))
    _refused_before_the_first_step(tmp_path, tiny_model("bert"), floats, r"integer token ids", error=InputTypeError)


def test_arrow_and_row_checks_agree_on_every_rule():
    """The same bad rows, as a list of dicts and as a datasets.Dataset (one of each rule per case), give the same
    row and column."""
    schema = Schema(vocab_size=VOCAB, type_vocab_size=2, label_kind="class", label_bound=CLASSES, require_labels=True)
    base = [{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0], "token_type_ids": [0, 0, 1], "labels": 2}] * 6
    cases = [("input_ids", [1, -4, 3]), ("attention_mask", [1, 1]), ("token_type_ids", [0, 2, 0]), ("labels", 3)]
    for column, value in cases:
        rows = [dict(r) for r in base]
        rows[4] = {**rows[4], column: value}
        messages = []
        for data in (rows, datasets.Dataset.from_list(rows)):
            with pytest.raises(ConfigurationError) as info:
                check_dataset(data, schema, name="d")
            messages.append(str(info.value).split(":")[0])
        assert messages == [f"d row 4, column {column!r}"] * 2, messages


def test_a_dataset_of_valid_rows_trains(tmp_path):
    output = DPTrainer(
        tiny_model("bert"), _args(tmp_path, save_strategy="no", max_steps=2), train_dataset=_classification()
    ).train()
    assert math.isfinite(output.training_loss) and output.global_step == 2


def test_a_custom_loss_gets_its_own_output_shape_and_labels_present(tmp_path):
    data = _classification()
    loss = lambda logits, label: torch.nn.functional.cross_entropy(logits[None], label[None])  # noqa: E731
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, save_strategy="no", max_steps=1), train_dataset=data,
                        compute_loss_func=loss)  # fmt: skip
    assert trainer.train().global_step == 1
    del data[2]["labels"]
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, max_steps=1), train_dataset=data, compute_loss_func=loss)
    with pytest.raises(ConfigurationError, match="row 2 has no column 'labels'"):
        trainer.train()


def test_sequence_classifier_output_with_logits_passes_the_probe(tmp_path):
    class OutputForSequenceClassification(_TupleForSequenceClassification):
        def forward(self, input_ids=None, attention_mask=None):
            return SequenceClassifierOutput(logits=super().forward(input_ids, attention_mask)[0])

    args = _args(tmp_path, save_strategy="no", max_steps=1)
    trainer = DPTrainer(OutputForSequenceClassification(), args, train_dataset=_classification())
    assert trainer.train().global_step == 1
