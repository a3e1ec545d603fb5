#!/usr/bin/env python
"""Causal language modelling with the Trainer, in the flow of transformers' example
``examples/pytorch/language-modeling/run_clm.py``: ``HfArgumentParser`` over ``ModelArguments``,
``DataTrainingArguments`` and ``TrainingArguments``, the last-checkpoint check, ``set_seed``, ``load_dataset`` on local
text or JSON files, tokenization then ``group_texts`` (the tokenized documents concatenated and cut into blocks of
``block_size`` tokens, the labels a copy of the inputs), ``default_data_collator``, ``preprocess_logits_for_metrics``
(the argmax of each batch's logits) with a next-token accuracy in ``compute_metrics``, train, evaluate with perplexity,
``save_model``, ``log_metrics`` / ``save_metrics`` / ``save_state`` and the model card.

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
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
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
    """Which data to train and evaluate on, and how to cut it."""

    train_file: str | None = field(default=None, metadata={"help": "Training data: a .txt, .json or .jsonl file."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data, in the same format."})
    text_column_name: str = field(default="text", metadata={"help": "The column of the JSON files holding the text."})
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per training block after concatenation (default: the model's maximum length)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep this many training blocks at most."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep this many evaluation blocks at most."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks when reading .txt files."})

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
        raw_datasets = load_dataset("text", data_files=data_files, keep_linebreaks=data_args.keep_linebreaks)
    else:
        raw_datasets = load_dataset("json", data_files=data_files)

    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))  # room for every token id the tokenizer can give

    split = "train" if training_args.do_train else "validation"
    column_names = list(raw_datasets[split].features)
    text_column_name = data_args.text_column_name if data_args.text_column_name in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(
            tokenize_function, batched=True, remove_columns=column_names, desc="Running tokenizer on dataset"
        )

    block_size = data_args.block_size or min(tokenizer.model_max_length, config.max_position_embeddings)
    if block_size > tokenizer.model_max_length:
        logger.warning(f"block_size={block_size} exceeds the tokenizer's maximum length {tokenizer.model_max_length}.")

    def group_texts(examples):
        # one long stream per column, cut into blocks of block_size; the tail that fills no block is dropped
        joined = {name: list(chain.from_iterable(examples[name])) for name in examples}
        length = len(joined[next(iter(examples))]) // block_size * block_size
        blocks = {
            name: [tokens[start : start + block_size] for start in range(0, length, block_size)]
            for name, tokens in joined.items()
        }
        blocks["labels"] = [list(block) for block in blocks["input_ids"]]
        return blocks

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(
            group_texts, batched=True, desc=f"Grouping texts in blocks of {block_size}"
        )

    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

        def preprocess_logits_for_metrics(logits, labels):
            if isinstance(logits, tuple):  # extra outputs of the model (past key values)
                logits = logits[0]
            return logits.argmax(dim=-1)

        def compute_metrics(eval_preds):
            preds, labels = eval_preds
            # the prediction at position t is scored against the token at t + 1
            targets = labels[:, 1:].reshape(-1)
            predicted = preds[:, :-1].reshape(-1)
            scored = targets != -100
            return {"accuracy": float((predicted[scored] == targets[scored]).astype(np.float32).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
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

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-generation"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
