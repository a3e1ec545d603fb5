#!/usr/bin/env python
"""Fine-tuning a text classifier with the Trainer, as in transformers' example
``examples/pytorch/text-classification/run_classification.py`` and the "Fine-tune a pretrained model" tutorial:
tokenizer, dataset map, ``TrainingArguments``, ``Trainer``, train, evaluate, predict, ``save_model``,
``log_metrics`` / ``save_metrics`` / ``save_state`` and the model card.

``tests/torch/transformers/test_hf_script.py`` runs this file as it is: a ``transformers`` script whose only changes
are the import of ``Trainer`` and ``TrainingArguments`` (from Opake) and the DP arguments (the lines marked ``# DP``);
it also runs the same script with transformers' own import and without those lines. The JSON-lines files stand in for
``datasets.load_dataset("json", data_files=...)`` and ``map_batched`` for ``Dataset.map(..., batched=True)``, since
the test environment has no ``datasets``.
"""

import argparse
import json
import logging
import os
import sys

import numpy as np
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, set_seed

from opake_torch.transformers import DPTrainer as Trainer, TrainingArguments  # isort: skip

logger = logging.getLogger(__name__)


def load_json_lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def map_batched(rows, function):
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    mapped = function(columns)
    return [{**row, **{key: values[i] for key, values in mapped.items()}} for i, row in enumerate(rows)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_seq_length", type=int, default=32)
    script_args = parser.parse_args()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    logger.setLevel(logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(42)

    raw_datasets = {
        "train": load_json_lines(script_args.train_file),
        "validation": load_json_lines(script_args.validation_file),
    }
    label_list = sorted({row["label"] for row in raw_datasets["train"]})
    label_to_id = {label: i for i, label in enumerate(label_list)}

    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        script_args.model_name_or_path,
        num_labels=len(label_list),
        label2id=label_to_id,
        id2label={i: label for label, i in label_to_id.items()},
    )

    def preprocess_function(examples):
        result = tokenizer(examples["sentence"], padding=False, max_length=script_args.max_seq_length, truncation=True)
        result["label"] = [label_to_id[label] for label in examples["label"]]
        return result

    train_dataset = map_batched(raw_datasets["train"], preprocess_function)
    eval_dataset = map_batched(raw_datasets["validation"], preprocess_function)

    def compute_metrics(p):
        preds = np.argmax(p.predictions, axis=1)
        return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}

    data_collator = DataCollatorWithPadding(tokenizer)

    training_args = TrainingArguments(
        output_dir=script_args.output_dir,
        learning_rate=2e-3,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        num_train_epochs=2,
        weight_decay=0.01,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        logging_steps=2,
        report_to="none",
        use_cpu=True,
        seed=42,
        privacy_target_epsilon=8.0,  # DP
        clipping_norm=1.0,  # DP
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )

    train_result = trainer.train()
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.save_model()  # Saves the tokenizer too for easy upload
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    logger.info("*** Evaluate ***")
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    metrics["eval_samples"] = len(eval_dataset)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    logger.info("*** Predict ***")
    predictions = trainer.predict(eval_dataset, metric_key_prefix="predict").predictions
    predictions = np.argmax(predictions, axis=1)
    output_predict_file = os.path.join(training_args.output_dir, "predict_results.txt")
    if trainer.is_world_process_zero():
        with open(output_predict_file, "w") as writer:
            writer.write("index\tprediction\n")
            for index, item in enumerate(predictions):
                writer.write(f"{index}\t{label_list[item]}\n")

    kwargs = {"finetuned_from": script_args.model_name_or_path, "tasks": "text-classification"}
    trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
