"""Acceptance: transformers' language-modelling scripts (run_clm.py and run_mlm.py, in this project's rendition) run
with only their imports switched to Opake's and DP arguments added to their command line, on CPU with a tiny GPT-2
or BERT, a tokenizer and JSON-lines data made here (no hub, datasets' ``load_dataset`` on local files). run_clm.py's
``group_texts`` packs documents into blocks: the log and the model card say that the privacy unit is a block. The
same scripts with transformers' own import and without the DP arguments run under transformers.Trainer, so they are
genuine transformers scripts."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from itertools import chain
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertTokenizer, GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).parent
SCRIPTS = {"clm": HERE / "run_clm.py", "mlm": HERE / "run_mlm.py"}
OPAKE_IMPORT = "from opake_torch.transformers import DPTrainer as Trainer, TrainingArguments  # isort: skip"
HF_IMPORT = "from transformers import Trainer, TrainingArguments"
WORDS = ["the", "movie", "was", "a", "plot", "and", "very", "film", "story", "really", "good", "bad", "dull", "great"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
BLOCK = 16
# transformers' flags (max_grad_norm: per-example clipping under DP)
TRAINING = (
    "--do_train --do_eval --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --max_steps 3 "
    "--learning_rate 2e-3 --logging_steps 1 --report_to none --use_cpu --seed 42 --max_grad_norm 1.0"
).split()
DP = ["--privacy_target_epsilon", "8"]


def _hf_variant(text: str) -> str:
    """The script as written for transformers.Trainer: transformers' import."""
    assert text.count(OPAKE_IMPORT) == 1
    return text.replace(OPAKE_IMPORT, HF_IMPORT)


def _documents(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))} for _ in range(n)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny 'pretrained' GPT-2 and BERT masked LM (random weights) with a word-level tokenizer, and JSON-lines
    documents, on disk."""
    root = tmp_path_factory.mktemp("lm_scripts")
    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    torch.manual_seed(0)
    gpt = GPT2Config(
        vocab_size=len(VOCAB), n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=2, eos_token_id=3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    bert = BertConfig(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    for name, model in (("tiny-gpt2", GPT2LMHeadModel(gpt)), ("tiny-bert", BertForMaskedLM(bert))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    for name, rows in (("train.jsonl", _documents(60, 0)), ("validation.jsonl", _documents(16, 1))):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _arguments(workspace: Path, model: str, output: Path, *extra: str) -> list[str]:
    files = ["--train_file", str(workspace / "train.jsonl"), "--validation_file", str(workspace / "validation.jsonl")]
    model_path = ["--model_name_or_path", str(workspace / model)]
    return [*model_path, *files, "--output_dir", str(output), *TRAINING, *extra]


def _run(script: Path, arguments: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(cache),
        "CUDA_VISIBLE_DEVICES": "",
    }
    command = [sys.executable, str(script), *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def _results(output: Path) -> tuple[dict, dict, dict]:
    read = lambda name: json.loads((output / name).read_text())  # noqa: E731
    return read("train_results.json"), read("eval_results.json"), read("accountant.json")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_script_differs_from_its_transformers_form_only_in_its_import(name):
    text = SCRIPTS[name].read_text()
    hf = _hf_variant(text).splitlines()
    assert [line for line in text.splitlines() if line not in hf] == [OPAKE_IMPORT]
    assert "HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))" in text
    assert "opake" not in _hf_variant(text).lower().replace("# isort: skip", "").split('"""')[-1]


def _eval_blocks(workspace: Path) -> dict[str, torch.Tensor]:
    """run_clm.py's evaluation rows, rebuilt here: the validation documents tokenized, each column concatenated and
    cut in blocks of BLOCK tokens (``[N, BLOCK]`` each)."""
    tokenizer = BertTokenizer.from_pretrained(workspace / "tiny-gpt2")
    lines = (workspace / "validation.jsonl").read_text().splitlines()
    encoded = [tokenizer(json.loads(line)["text"]) for line in lines]
    blocks = {}
    for name in encoded[0]:  # input_ids, token_type_ids (which GPT-2 embeds), attention_mask
        stream = list(chain.from_iterable(row[name] for row in encoded))
        blocks[name] = torch.tensor(stream[: len(stream) // BLOCK * BLOCK]).view(-1, BLOCK)
    return blocks


def test_run_clm_runs_privately_and_names_the_block_as_its_privacy_unit(workspace, tmp_path):
    output = tmp_path / "private"
    done = _run(SCRIPTS["clm"], _arguments(workspace, "tiny-gpt2", output, "--block_size", str(BLOCK), *DP), tmp_path)
    assert "***** train metrics *****" in done.stdout and "***** eval metrics *****" in done.stdout
    train, evaluation, accountant = _results(output)
    assert accountant["steps"] == 3 and accountant["epsilon"] <= 8.0
    assert train["privacy_epsilon"] == pytest.approx(accountant["epsilon"])
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["eval_loss"]))

    # preprocess_logits_for_metrics kept the argmax, which compute_metrics scored against the next token: the same
    # accuracy as the saved model's own predictions on the evaluation blocks
    blocks = _eval_blocks(workspace)
    ids = blocks["input_ids"]
    assert evaluation["eval_samples"] == len(ids)
    with torch.no_grad():
        predicted = GPT2LMHeadModel.from_pretrained(output).eval()(**blocks).logits.argmax(-1)
    reference = (predicted[:, :-1] == ids[:, 1:]).double().mean().item()
    assert evaluation["eval_accuracy"] == pytest.approx(reference, abs=1e-6)

    # group_texts packed the documents: the log and the card say the unit is a block of BLOCK tokens
    assert f"train_dataset looks packed: its {train['train_samples']} rows all hold exactly {BLOCK} tokens" in (
        done.stdout + done.stderr
    )
    card = (output / "README.md").read_text()
    assert f"The privacy unit is **one block of {BLOCK} tokens**" in card and "**Packed rows.**" in card
    assert f"| privacy unit | one block of {BLOCK} tokens" in card and "group privacy" in card


def test_run_mlm_line_by_line_runs_privately_with_one_sequence_a_row(workspace, tmp_path):
    output = tmp_path / "private"
    extra = ["--line_by_line", "--max_seq_length", str(BLOCK), *DP]
    done = _run(SCRIPTS["mlm"], _arguments(workspace, "tiny-bert", output, *extra), tmp_path)
    assert "***** train metrics *****" in done.stdout and "***** eval metrics *****" in done.stdout
    train, evaluation, accountant = _results(output)
    assert accountant["steps"] == 3 and accountant["epsilon"] <= 8.0
    assert train["privacy_epsilon"] == pytest.approx(accountant["epsilon"]) and train["train_samples"] == 60
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["eval_loss"]))
    assert 0.0 <= evaluation["eval_accuracy"] <= 1.0 and evaluation["eval_samples"] == 16
    card = (output / "README.md").read_text()
    assert "The privacy unit is **one sequence**" in card and "Packed rows" not in card
    assert "looks packed" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("name", "model", "extra"),
    [("clm", "tiny-gpt2", ["--block_size", str(BLOCK)]), ("mlm", "tiny-bert", ["--max_seq_length", str(BLOCK)])],
    ids=["clm", "mlm-grouped"],
)
def test_the_same_script_runs_under_transformers_trainer(workspace, tmp_path, name, model, extra):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    script = tmp_path / f"run_{name}_hf.py"
    script.write_text(_hf_variant(SCRIPTS[name].read_text()))
    output = tmp_path / "hf"
    done = _run(script, _arguments(workspace, model, output, *extra), tmp_path)
    assert "***** train metrics *****" in done.stdout and "***** eval metrics *****" in done.stdout
    assert (output / "model.safetensors").is_file() and not (output / "accountant.json").exists()
    evaluation = json.loads((output / "eval_results.json").read_text())
    assert np.isfinite(evaluation["perplexity"]) and "eval_accuracy" in evaluation
