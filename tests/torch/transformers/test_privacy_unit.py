"""The privacy unit stays honest: rows that look like packed blocks of documents (run_clm.py's group_texts) are
named as such in the logs and on the model card, and a collator that lets a record attend to padding is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_hf import tiny_model, token_data

from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.data import collate

DOCUMENTS = token_data(60)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 7,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def group_texts(documents, block_size):
    """run_clm.py's group_texts: concatenate the documents, drop the remainder, cut blocks, labels = input_ids."""
    tokens = torch.cat([doc["input_ids"] for doc in documents])
    total = len(tokens) // block_size * block_size
    blocks = tokens[:total].view(-1, block_size)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b.clone()} for b in blocks]


def _train(tmp_path, rows, caplog, **kw):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, **kw), train_dataset=rows)
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train()
    return trainer, (trainer.save_model() / "README.md").read_text()


def test_packed_blocks_are_named_in_the_logs_and_on_the_card(tmp_path, caplog):
    blocks = group_texts(DOCUMENTS, 8)
    trainer, card = _train(tmp_path, blocks, caplog)
    assert trainer.packed_block == 8
    assert f"train_dataset looks packed: its {len(blocks)} rows all hold exactly 8 tokens" in caplog.text
    assert "a document spanning k blocks is protected only at group level" in caplog.text
    assert "The privacy unit is **one block of 8 tokens**" in card
    assert "| privacy unit | one block of 8 tokens" in card and "group privacy" in card


@pytest.mark.parametrize(
    "rows",
    [
        DOCUMENTS,  # one document a row, of their own lengths
        [
            {"input_ids": r["input_ids"], "attention_mask": torch.tensor([1] * 7 + [0])}
            for r in group_texts(DOCUMENTS, 8)
        ],
        [{**r, "labels": torch.where(torch.arange(8) < 3, -100, r["input_ids"])} for r in group_texts(DOCUMENTS, 8)],
    ],
    ids=["documents", "padded", "prompt-masked"],
)
def test_rows_that_are_not_packed_blocks_keep_the_sequence_unit(tmp_path, caplog, rows):
    trainer, card = _train(tmp_path, rows, caplog)
    assert trainer.packed_block is None and "looks packed" not in caplog.text
    assert "The privacy unit is **one sequence**" in card and "Packed rows" not in card


def _attends_to_padding(rows):
    """Right padding with the pad positions out of the loss (label -100), but an attention mask of ones."""
    batch = collate(rows)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def test_a_collator_that_marks_padding_as_attended_is_refused(tmp_path):
    trainer = DPTrainer(
        tiny_model("llama"), _args(tmp_path), train_dataset=DOCUMENTS, data_collator=_attends_to_padding
    )
    with pytest.raises(ConfigurationError, match="marks padding as attended") as info:
        trainer.train()
    assert "DataCollatorWithPadding" in str(info.value)
    assert trainer.state.global_step == 0 and trainer.ledger.releases == 0  # refused before any budget is spent


def test_a_collator_that_masks_padding_passes(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DOCUMENTS, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 2
