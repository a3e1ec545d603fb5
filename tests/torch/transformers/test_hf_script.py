"""Acceptance: an unmodified transformers text-classification script (run_text_classification.py) runs with only
its imports switched to Opake's and DP arguments added, on CPU with a tiny BERT, tokenizer and dataset made here (no
hub), and ends with a model card that states the guarantee. The same script with transformers' own import and
without the DP lines runs under transformers.Trainer, so it is a genuine transformers script."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import BertConfig, BertModel, BertTokenizer

from opake_torch.hub import publishable_files

SCRIPT = Path(__file__).with_name("run_text_classification.py")
OPAKE_IMPORT = "from opake_torch.transformers import DPTrainer as Trainer, TrainingArguments  # isort: skip"
HF_IMPORT = "from transformers import Trainer, TrainingArguments"
GOOD = ["good", "great", "fine", "nice", "superb", "lovely"]
BAD = ["bad", "awful", "poor", "dull", "boring", "weak"]
FILLER = ["the", "movie", "was", "a", "plot", "and", "very", "film", "story", "really"]


def _hf_variant(text: str) -> str:
    """The script as written for transformers.Trainer: transformers' import, no DP lines."""
    assert text.count(OPAKE_IMPORT) == 1
    lines = [line for line in text.replace(OPAKE_IMPORT, HF_IMPORT).splitlines() if not line.endswith("# DP")]
    return "\n".join(lines) + "\n"


def _sentences(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "positive" if i % 2 else "negative"
        words = [*rng.sample(FILLER, 4), rng.choice(GOOD if label == "positive" else BAD)]
        rng.shuffle(words)
        rows.append({"sentence": " ".join(words), "label": label})
    return rows


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny 'pretrained' BERT (random weights, no head) with its tokenizer, and JSON-lines data, on disk."""
    root = tmp_path_factory.mktemp("hf_script")
    model_dir = root / "tiny-bert"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *GOOD, *BAD, *FILLER]
    BertTokenizer(vocab={word: i for i, word in enumerate(vocab)}).save_pretrained(model_dir)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    BertModel(config).save_pretrained(model_dir)
    for name, rows in (("train.jsonl", _sentences(64, 0)), ("validation.jsonl", _sentences(16, 1))):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _run(script: Path, workspace: Path, output: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        str(script),
        "--model_name_or_path",
        str(workspace / "tiny-bert"),
        "--train_file",
        str(workspace / "train.jsonl"),
        "--validation_file",
        str(workspace / "validation.jsonl"),
        "--output_dir",
        str(output),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_the_script_differs_from_its_transformers_form_only_in_imports_and_dp_arguments():
    text = SCRIPT.read_text()
    hf = _hf_variant(text).splitlines()
    ours = text.splitlines()
    changed = [line for line in ours if line not in hf]
    assert changed[0] == OPAKE_IMPORT
    assert [line.strip() for line in changed[1:]] == [
        "privacy_target_epsilon=8.0,  # DP",
        "clipping_norm=1.0,  # DP",
    ]
    assert "opake" not in _hf_variant(text).lower().replace("# isort: skip", "").split('"""')[-1]


def test_unmodified_text_classification_script_runs_privately(workspace, tmp_path):
    output = tmp_path / "private"
    done = _run(SCRIPT, workspace, output)
    assert "***** train metrics *****" in done.stdout and "***** eval metrics *****" in done.stdout
    for name in ("README.md", "accountant.json", "model.safetensors", "config.json", "tokenizer.json"):
        assert (output / name).is_file(), name
    for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json"):
        assert (output / name).is_file(), name
    assert (output / "predict_results.txt").read_text().startswith("index\tprediction\n")
    train = json.loads((output / "train_results.json").read_text())
    evaluation = json.loads((output / "eval_results.json").read_text())
    assert train["train_samples"] == 64 and train["epoch"] == pytest.approx(2.0)
    assert {"train_runtime", "train_samples_per_second", "privacy_epsilon"} <= set(train)
    assert {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second", "eval_samples"} <= set(evaluation)

    accountant = json.loads((output / "accountant.json").read_text())
    assert accountant["epsilon"] <= 8.0 and accountant["steps"] == 8  # 2 epochs of 64 rows at expected batch 16
    assert train["privacy_epsilon"] == pytest.approx(accountant["epsilon"])
    card = (output / "README.md").read_text()
    assert f"ε = {accountant['epsilon']:.4g}" in card and f"δ = {accountant['delta']:.3g}" in card
    assert "one example" in card and "Poisson sampling" in card and "DP-SGD" in card
    assert "clipped to L2 norm 1" in card and "Outside the guarantee" in card
    data = ModelCard.load(output / "README.md").data
    assert data.pipeline_tag == "text-classification" and "differential-privacy" in data.tags
    published = publishable_files(output)  # what push_to_hub would upload: the card, not the results
    assert {"README.md", "accountant.json", "model.safetensors"} <= set(published)
    assert not [name for name in published if "results" in name or name.startswith(("runs/", "checkpoint-"))]


def test_the_same_script_runs_under_transformers_trainer(workspace, tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    script = tmp_path / "run_text_classification_hf.py"
    script.write_text(_hf_variant(SCRIPT.read_text()))
    output = tmp_path / "hf"
    done = _run(script, workspace, output)
    assert "***** train metrics *****" in done.stdout
    assert (output / "model.safetensors").is_file() and not (output / "accountant.json").exists()
