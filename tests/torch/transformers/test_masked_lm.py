"""Masked language modelling (run_mlm.py's model and collator): the loss of a ``*ForMaskedLM`` model is each row's
mean cross-entropy over its own masked tokens; ``DataCollatorForLanguageModeling`` draws which tokens to mask for each
row without reading the other rows; the neighbour test compares rows with one draw each, so it neither refuses the
masking collator nor misses a model that couples rows; packed (grouped) rows name a block as the privacy unit."""

from __future__ import annotations

import logging
import random
from itertools import chain

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertTokenizer, DataCollatorForLanguageModeling

from opake_core import accounting
from opake_core.errors import ConfigurationError
from opake_torch import functional_model, per_example_loss
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.loss import infer_task

WORDS = ["the", "movie", "was", "a", "plot", "and", "very", "film", "story", "really", "good", "bad", "dull", "great"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def _tokenizer() -> BertTokenizer:
    return BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})


def _model() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForMaskedLM(config)
    model.config._attn_implementation = "eager"
    return model


def _lines(n: int, seed: int = 0) -> list[dict]:
    """One tokenized line a row (run_mlm.py --line_by_line), of 3 to 12 words."""
    rng, tokenizer = random.Random(seed), _tokenizer()
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]
    return [dict(tokenizer(text)) for text in texts]


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(per_device_train_batch_size=4, max_steps=2, privacy_noise_multiplier=1.0, use_cpu=True,
                disable_tqdm=True, save_strategy="no", report_to="none", logging_strategy="no")  # fmt: skip
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def test_the_loss_of_a_masked_lm_is_each_rows_mean_over_its_masked_tokens():
    model = _model().double()
    assert infer_task(model) == "masked_lm"
    apply, params, frozen = functional_model(model)
    ids = torch.tensor([2, 5, 4, 9, 4, 12, 3])
    labels = torch.tensor([-100, -100, 7, -100, 15, -100, -100])  # two masked tokens
    loss = per_example_loss(apply, params, frozen, {"input_ids": ids, "labels": labels}, task="masked_lm")
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    reference = sum(F.cross_entropy(logits[t], labels[t]) for t in (2, 4)) / 2
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_the_masking_collator_draws_each_rows_masks_without_reading_the_other_rows():
    """With the generator in one state and the batch in one shape, a row's masked inputs and labels are the same
    whatever the other rows hold: the draws that fall on a row depend on its place, never on another row's tokens.
    (Which draws fall on it depends on its place and on the batch's shape; see docs/scripts.md.)"""
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.5)
    first = _lines(1, seed=0)[0]
    length = len(first["input_ids"])
    outputs = []
    for seed in (1, 2, 3):  # other second rows of the same length
        rng = random.Random(seed)
        other = {**first, "input_ids": [2] + [rng.randrange(5, len(VOCAB)) for _ in range(length - 2)] + [3]}
        torch.manual_seed(0)
        outputs.append(collator([first, other]))
    for batch in outputs[1:]:
        assert torch.equal(batch["input_ids"][0], outputs[0]["input_ids"][0])
        assert torch.equal(batch["labels"][0], outputs[0]["labels"][0])
    assert outputs[0]["labels"][0].ne(-100).any()  # something was masked: the comparison is not vacuous
    assert not all(torch.equal(b["labels"][1], outputs[0]["labels"][1]) for b in outputs[1:])  # the rows differ


def test_a_masked_lm_trains_privately_with_the_masking_collator(tmp_path):
    """Before the neighbour test compared rows with one draw each, the collator's fresh draws in its second batch
    were refused as a coupling of the records."""
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.15)
    trainer = DPTrainer(_model(), _args(tmp_path), train_dataset=_lines(40), data_collator=collator)
    trainer.train()
    assert trainer.state.global_step == 2
    run = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 4 / 40), 2)  # expected batch 4 of 40 rows
    assert trainer.ledger.entries == ((run.process, 2),)
    assert trainer.ledger.epsilon(delta=1e-5) == accounting.epsilon(run, delta=1e-5)


class PaddedMean(nn.Module):
    """Adds the mean over every position, padding included: each row's output depends on the batch's padded length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(dim=1, keepdim=True)


def test_the_neighbour_test_still_refuses_a_coupled_model_under_the_masking_collator(tmp_path):
    """(BERT's masked-LM head bias is not a layer the layerwise engine serves: the run is on vmap.)"""
    model = _model()
    model.bert.embeddings.dropout = PaddedMean()
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.15)
    trainer = DPTrainer(model, _args(tmp_path), train_dataset=_lines(40), data_collator=collator)
    with pytest.raises(ConfigurationError, match="not independent under per_example_gradients='vmap'"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.ledger.releases == 0


def test_grouped_rows_of_a_masked_lm_name_a_block_as_the_privacy_unit(tmp_path, caplog):
    """run_mlm.py without --line_by_line: the tokenized lines concatenated and cut in blocks of 16 tokens."""
    lines = _lines(60)
    stream = {name: list(chain.from_iterable(row[name] for row in lines)) for name in ("input_ids", "attention_mask")}
    blocks = len(stream["input_ids"]) // 16
    rows = [{name: values[16 * i : 16 * (i + 1)] for name, values in stream.items()} for i in range(blocks)]
    collator = DataCollatorForLanguageModeling(_tokenizer(), mlm_probability=0.15)
    trainer = DPTrainer(_model(), _args(tmp_path), train_dataset=rows, data_collator=collator)
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train()
    assert trainer.packed_block == 16 and f"its {blocks} rows all hold exactly 16 tokens" in caplog.text
    card = (trainer.save_model() / "README.md").read_text()
    assert "The privacy unit is **one block of 16 tokens**" in card
