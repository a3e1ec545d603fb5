#!/usr/bin/env python
"""Masked language modelling with the Trainer, in the flow of transformers' example
``examples/pytorch/language-modeling/run_mlm.py``: ``HfArgumentParser`` over ``ModelArguments``,
``DataTrainingArguments`` and ``TrainingArguments``, the last-checkpoint check, ``set_seed``, ``load_dataset`` on local
text or JSON files, tokenization line by line (one non-empty line a row, truncated) or grouped (the tokenized lines
concatenated and cut into blocks of ``max_seq_length`` tokens), ``DataCollatorForLanguageModeling`` with
``mlm_probability`` (it draws which tokens to mask), ``preprocess_logits_for_metrics`` with an accuracy over the masked
tokens in ``compute_metrics``, train, evaluate with perplexity, ``save_model``, ``log_metrics`` / ``save_metrics`` /
``save_state`` and the model card.

``tests/torch/transformers/test_language_modeling_scripts.py`` runs this file as it is: a ``transformers`` script whose
only change is the import of ``Trainer`` and ``TrainingArguments`` (from Opake); the DP arguments are on its command
line. It also runs the same script with transformers' own import and without those arguments. The accuracy is
computed with NumPy (the ``evaluate`` package is not a dependency); the dataclasses keep the fields of the original
that this script reads.
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from opake_torch.transformers import DPTrainer as Trainer, TrainingArguments  # isort: skip

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune from."""

    model_name_or_path: str = field(metadata={"help": "A local folder or a model id of the Hub."})
    config_name: str | None = field(default=None, metadata={"help": "A config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "A tokenizer name or path, if not the model's."})


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on, how to cut it, and how much of it to mask."""

    train_file: str | None = field(default=None, metadata={"help": "Training data: a .txt, .json or .jsonl file."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data, in the same format."})
    text_column_name: str = field(default="text", metadata={"help": "The column of the JSON files holding the text."})
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per row after tokenization (default: the tokenizer's maximum length)."},
    )
    line_by_line: bool = field(
        default=False,
        metadata={"help": "One non-empty line a row, rather than the lines concatenated and cut into blocks."},
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every row to max_seq_length when tokenizing (else the collator pads each batch)."},
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "The share of tokens the collator masks."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep this many training rows at most."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep this many evaluation rows at most."})

    def __post_init__(self):
        if self.train_file is None and self.validation_file is None:
            raise ValueError("Pass a train_file or a validation_file.")
        for path in (self.train_file, self.validation_file):
            if path is not None and path.rsplit(".", 1)[-1] not in ("txt", "json", "jsonl"):
                raise ValueError(f"{path}: the data files must be .txt, .json or .jsonl files.")


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        # one argument, a JSON file: the arguments are read from it
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()  # passive by default: log at info level
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, n_gpu: {training_args.n_gpu}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}"
    )
    logger.info(f"Training/evaluation parameters {training_args}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint found, training resumes from {last_checkpoint}.")

    set_seed(training_args.seed)  # before the model is built

    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    if next(iter(data_files.values())).endswith(".txt"):
        raw_datasets = load_dataset("text", data_files=data_files)
    else:
        raw_datasets = load_dataset("json", data_files=data_files)

    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForMaskedLM.from_pretrained(model_args.model_name_or_path, config=config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))  # room for every token id the tokenizer can give

    split = "train" if training_args.do_train else "validation"
    column_names = list(raw_datasets[split].features)
    text_column_name = data_args.text_column_name if data_args.text_column_name in column_names else column_names[0]
    max_seq_length = min(data_args.max_seq_length or tokenizer.model_max_length, tokenizer.model_max_length)

    if data_args.line_by_line:
        padding = "max_length" if data_args.pad_to_max_length else False

        def tokenize_function(examples):
            lines = [line for line in examples[text_column_name] if len(line) > 0 and not line.isspace()]
            return tokenizer(
                lines,
                padding=padding,
                truncation=True,
                max_length=max_seq_length,
                # the collator never masks special tokens; it reads them from here
                return_special_tokens_mask=True,
            )

        with training_args.main_process_first(desc="dataset map tokenization"):
            tokenized_datasets = raw_datasets.map(
                tokenize_function,
                batched=True,
                remove_columns=column_names,
                desc="Running tokenizer on dataset line_by_line",
            )
    else:

        def tokenize_function(examples):
            return tokenizer(examples[text_column_name], return_special_tokens_mask=True)

        with training_args.main_process_first(desc="dataset map tokenization"):
            tokenized_datasets = raw_datasets.map(
                tokenize_function, batched=True, remove_columns=column_names, desc="Running tokenizer on every text"
            )

        def group_texts(examples):
            # one long stream per column, cut into blocks of max_seq_length; the tail that fills no block is dropped
            joined = {name: list(chain.from_iterable(examples[name])) for name in examples}
            length = len(joined[next(iter(examples))]) // max_seq_length * max_seq_length
            return {
                name: [tokens[start : start + max_seq_length] for start in range(0, length, max_seq_length)]
                for name, tokens in joined.items()
            }

        with training_args.main_process_first(desc="grouping texts together"):
            tokenized_datasets = tokenized_datasets.map(
                group_texts, batched=True, desc=f"Grouping texts in blocks of {max_seq_length}"
            )

    if training_args.do_train:
        train_dataset = tokenized_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    if training_args.do_eval:
        eval_dataset = tokenized_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

        def preprocess_logits_for_metrics(logits, labels):
            if isinstance(logits, tuple):  # extra outputs of the model
                logits = logits[0]
            return logits.argmax(dim=-1)

        def compute_metrics(eval_preds):
            preds, labels = eval_preds
            labels = labels.reshape(-1)
            preds = preds.reshape(-1)
            scored = labels != -100  # the masked tokens only
            return {"accuracy": float((preds[scored] == labels[scored]).astype(np.float32).mean())}

    data_collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=data_args.mlm_probability)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # the tokenizer too
        metrics = train_result.metrics
        max_train_samples = data_args.max_train_samples or len(train_dataset)
        metrics["train_samples"] = min(max_train_samples, len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        max_eval_samples = data_args.max_eval_samples or len(eval_dataset)
        metrics["eval_samples"] = min(max_eval_samples, len(eval_dataset))
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "fill-mask"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
