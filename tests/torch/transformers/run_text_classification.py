#!/usr/bin/env python
"""Fine-tuning a text classifier with the Trainer, as in transformers' example
``examples/pytorch/text-classification/run_classification.py``: ``HfArgumentParser`` over the script's
``ModelArguments`` and ``DataTrainingArguments`` and ``TrainingArguments`` (the command line, or one JSON file), the
logging set-up from ``training_args``, the last-checkpoint check, tokenizer, dataset map, ``Trainer``, train,
evaluate, predict, ``save_model``, ``log_metrics`` / ``save_metrics`` / ``save_state`` and the model card.

``tests/torch/transformers/test_hf_script.py`` runs this file as it is: a ``transformers`` script whose only change is
the import of ``Trainer`` and ``TrainingArguments`` (from Opake); the DP arguments are on its command line. It also
runs the same script with transformers' own import and without those arguments. The JSON-lines files stand in for
``datasets.load_dataset("json", data_files=...)`` and ``map_batched`` for ``Dataset.map(..., batched=True)``, since
the test environment has no ``datasets``; the dataclasses keep the fields of the original that this script reads.
"""

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import transformers
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from opake_torch.transformers import DPTrainer as Trainer, TrainingArguments  # isort: skip

logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    """
    Arguments pertaining to what data we are going to input our model for training and eval.
    """

    max_seq_length: int = field(
        default=128,
        metadata={"help": "The maximum total input sequence length after tokenization."},
    )
    max_train_samples: int | None = field(
        default=None,
        metadata={"help": "For debugging purposes or quicker training, truncate the number of training examples."},
    )
    train_file: str | None = field(
        default=None, metadata={"help": "A csv or a json file containing the training data."}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "A csv or a json file containing the validation data."}
    )

    def __post_init__(self):
        if self.train_file is None or self.validation_file is None:
            raise ValueError("Need a training/validation file.")


@dataclass
class ModelArguments:
    """
    Arguments pertaining to which model/config/tokenizer we are going to fine-tune from.
    """

    model_name_or_path: str = field(
        metadata={"help": "Path to pretrained model or model identifier from huggingface.co/models"}
    )


def load_json_lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def map_batched(rows, function):
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    mapped = function(columns)
    return [{**row, **{key: values[i] for key, values in mapped.items()}} for i, row in enumerate(rows)]


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        # If we pass only one argument to the script and it's the path to a json file,
        # let's parse it to get our arguments.
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    # Setup logging
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )

    if training_args.should_log:
        # The default of training_args.log_level is passive, so we set log level at info here to have that default.
        transformers.utils.logging.set_verbosity_info()

    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    # Log on each process the small summary:
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, n_gpu: {training_args.n_gpu}, "
        + f"distributed training: {training_args.parallel_mode.value == 'distributed'}, "
        + f"16-bits training: {training_args.fp16}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    # Detecting last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    # Set seed before initializing model.
    set_seed(training_args.seed)

    raw_datasets = {
        "train": load_json_lines(data_args.train_file),
        "validation": load_json_lines(data_args.validation_file),
    }
    label_list = sorted({row["label"] for row in raw_datasets["train"]})
    label_to_id = {label: i for i, label in enumerate(label_list)}

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(label_list),
        label2id=label_to_id,
        id2label={i: label for label, i in label_to_id.items()},
    )

    def preprocess_function(examples):
        result = tokenizer(examples["sentence"], padding=False, max_length=data_args.max_seq_length, truncation=True)
        result["label"] = [label_to_id[label] for label in examples["label"]]
        return result

    train_dataset = map_batched(raw_datasets["train"], preprocess_function)
    eval_dataset = map_batched(raw_datasets["validation"], preprocess_function)

    def compute_metrics(p):
        preds = np.argmax(p.predictions, axis=1)
        return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}

    data_collator = DataCollatorWithPadding(tokenizer)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        max_train_samples = (
            data_args.max_train_samples if data_args.max_train_samples is not None else len(train_dataset)
        )
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.save_model()  # Saves the tokenizer too for easy upload
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        predictions = trainer.predict(eval_dataset, metric_key_prefix="predict").predictions
        predictions = np.argmax(predictions, axis=1)
        output_predict_file = os.path.join(training_args.output_dir, "predict_results.txt")
        if trainer.is_world_process_zero():
            with open(output_predict_file, "w") as writer:
                logger.info("***** Predict results *****")
                writer.write("index\tprediction\n")
                for index, item in enumerate(predictions):
                    writer.write(f"{index}\t{label_list[item]}\n")
                logger.info(f"Predict results saved at {output_predict_file}")

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
