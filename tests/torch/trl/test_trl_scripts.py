"""Acceptance: TRL's own example scripts ``sft.py`` and ``dpo.py`` (``trl/scripts/`` of the installed trl) run with
only their ``from trl import`` lines switched to ``opake_torch.transformers.trl`` and the DP argument added to their
command line. The model is given by path (a tiny random Llama and its tokenizer saved here) and loaded as TRL loads
it, the dataset is a folder of JSON-lines files read by ``datasets.load_dataset``; nothing is downloaded.

Each script is read from the installed ``trl`` and only its import lines are switched here, so the test runs TRL's
scripts as shipped by whatever ``trl`` is installed, not versions edited to suit Opake.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
from tiny_hf import tiny_model  # noqa: E402
from trl_scripts import SWITCH, switched, upstream  # noqa: E402
from trl_support import preference_rows, text_rows, tiny_tokenizer  # noqa: E402

DP = ["--privacy_target_epsilon", "8"]
RUN = (
    "--per_device_train_batch_size 8 --num_train_epochs 1 --learning_rate 1e-3 --max_length 32 --logging_steps 1 "
    "--report_to none --use_cpu --save_strategy no --dtype float32"
).split()


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_only_the_trl_imports_are_switched(name):
    theirs_lines = upstream(name).read_text().splitlines()
    ours = switched(name).splitlines()
    changed = [(theirs, mine) for theirs, mine in zip(theirs_lines, ours, strict=True) if theirs != mine]
    assert len(changed) >= 1, "the script imports nothing from trl: the test would run TRL's own trainer"
    assert not [line for line in ours if re.match(r"\s*(from trl[\s.]|import trl\b)", line)]  # nothing left on TRL's
    for theirs, mine in changed:
        assert theirs.strip().startswith(SWITCH[0]) and mine == theirs.replace(*SWITCH)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny 'pretrained' Llama with its tokenizer, and two datasets (language modelling, preferences) on disk."""
    root = tmp_path_factory.mktemp("trl_scripts")
    model = tiny_model("llama")
    tokenizer = tiny_tokenizer()
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(root / "tiny-llama")
    tokenizer.save_pretrained(root / "tiny-llama")
    for name, rows in (("text", text_rows(32)), ("preference", preference_rows(32))):
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _run(script: Path, arguments: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    done = subprocess.run([sys.executable, str(script), *arguments], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done


@pytest.mark.parametrize(("name", "data"), [("sft", "text"), ("dpo", "preference")])
def test_trls_script_trains_privately_with_its_imports_switched(workspace, tmp_path, name, data):
    output = tmp_path / name
    arguments = ["--model_name_or_path", str(workspace / "tiny-llama"), "--dataset_name", str(workspace / data),
                 "--output_dir", str(output), *RUN, *DP]  # fmt: skip
    script = tmp_path / f"trl_{name}.py"
    script.write_text(switched(name))
    done = _run(script, arguments)
    assert "Training completed" in done.stdout and f"Model saved to {output}" in done.stdout
    assert "'privacy_epsilon'" in done.stdout + done.stderr  # in the training logs
    for file in ("model.safetensors", "config.json", "tokenizer.json", "accountant.json", "README.md"):
        assert (output / file).is_file(), file
    accountant = json.loads((output / "accountant.json").read_text())
    assert 0 < accountant["epsilon"] <= 8.0 and accountant["steps"] >= 1
    assert f"ε = {accountant['epsilon']:.4g}" in (output / "README.md").read_text()
