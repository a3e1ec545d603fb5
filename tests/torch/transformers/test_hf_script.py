"""Acceptance: an unmodified transformers text-classification script (run_text_classification.py) runs with only
its imports switched to Opake's and a DP argument added to its command line (which HfArgumentParser reads into the
script's dataclasses and Opake's TrainingArguments), on CPU with a tiny BERT, tokenizer and dataset made here (no
hub), and ends with a model card that states the guarantee. The same script with transformers' own import and
without the DP argument runs under transformers.Trainer, so it is a genuine transformers script."""

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


# transformers' flags, as in the example's README (max_grad_norm: per-example clipping under DP)
TRAINING = (
    "--do_train --do_eval --do_predict --learning_rate 2e-3 --per_device_train_batch_size 16 "
    "--per_device_eval_batch_size 16 --num_train_epochs 2 --weight_decay 0.01 --eval_strategy epoch "
    "--save_strategy epoch --load_best_model_at_end --logging_steps 2 --report_to none --use_cpu --seed 42 "
    "--max_grad_norm 1.0 --max_seq_length 32"
).split()
DP = ["--privacy_target_epsilon", "8"]


def _hf_variant(text: str) -> str:
    """The script as written for transformers.Trainer: transformers' import."""
    assert text.count(OPAKE_IMPORT) == 1
    return text.replace(OPAKE_IMPORT, HF_IMPORT)


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


def _arguments(workspace: Path, output: Path, *extra: str) -> list[str]:
    files = ["--train_file", str(workspace / "train.jsonl"), "--validation_file", str(workspace / "validation.jsonl")]
    return [
        "--model_name_or_path",
        str(workspace / "tiny-bert"),
        *files,
        "--output_dir",
        str(output),
        *TRAINING,
        *extra,
    ]


def _run(script: Path, arguments: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(script), *arguments]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_the_script_differs_from_its_transformers_form_only_in_its_import():
    text = SCRIPT.read_text()
    hf = _hf_variant(text).splitlines()
    ours = text.splitlines()
    assert [line for line in ours if line not in hf] == [OPAKE_IMPORT]
    assert "HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))" in text
    assert "opake" not in _hf_variant(text).lower().replace("# isort: skip", "").split('"""')[-1]


def test_unmodified_text_classification_script_runs_privately(workspace, tmp_path):
    output = tmp_path / "private"
    done = _run(SCRIPT, _arguments(workspace, output, *DP))
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
    done = _run(script, _arguments(workspace, output))
    assert "***** train metrics *****" in done.stdout
    assert (output / "model.safetensors").is_file() and not (output / "accountant.json").exists()


def test_the_script_reads_its_arguments_from_a_json_file(workspace, tmp_path):
    output = tmp_path / "from-json"
    config = {
        "model_name_or_path": str(workspace / "tiny-bert"),
        "train_file": str(workspace / "train.jsonl"),
        "validation_file": str(workspace / "validation.jsonl"),
        "output_dir": str(output),
        "do_eval": True,
        "per_device_eval_batch_size": 8,
        "use_cpu": True,
        "report_to": "none",
        "privacy_target_epsilon": 8.0,
        "clipping_norm": 1.0,  # a dict or a JSON file holds the fields' names (max_grad_norm is an option only)
    }
    path = tmp_path / "args.json"
    path.write_text(json.dumps(config))
    done = _run(SCRIPT, [str(path)])
    assert "***** eval metrics *****" in done.stdout
    evaluation = json.loads((output / "eval_results.json").read_text())
    assert evaluation["eval_samples"] == 16 and "eval_accuracy" in evaluation
