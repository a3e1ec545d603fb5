"""``--help`` of ``HfArgumentParser`` over the arguments shows a text for every field, the ``privacy_*`` ones included;
the only options it hides are the two that also carry the names which are no field (listing them would list every
such name)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest
from trl_scripts import switched

from opake_torch.transformers import TrainingArguments
from opake_torch.transformers import _field_help as field_help
from opake_torch.transformers.trl import DPOConfig, SFTConfig

transformers = pytest.importorskip("transformers")

CLASSES = [TrainingArguments, SFTConfig, DPOConfig]
HIDDEN = {"local_rank", "padding_free"}  # the carrier options (opake_torch.transformers._command_line.carrier)


def _help_by_field(cls):
    parser = transformers.HfArgumentParser(cls)
    return {action.dest: action.help for action in parser._actions if action.dest != "help"}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_help_text_on_the_command_line(cls):
    shown = _help_by_field(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    hidden = {name for name in fields if shown.get(name) is argparse.SUPPRESS}
    assert hidden <= HIDDEN
    missing = [name for name in fields if name not in hidden and not (shown.get(name) or "").strip()]
    assert not missing
    assert {name for name in fields if name.startswith("privacy_")} <= {n for n in fields if shown.get(n)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_help_texts_name_fields_that_exist(cls):
    texts = {TrainingArguments: field_help.HELP, SFTConfig: field_help.SFT_HELP, DPOConfig: field_help.DPO_HELP}[cls]
    assert set(texts) <= {f.name for f in dataclasses.fields(cls)}


def test_the_help_of_a_script_lists_the_privacy_arguments(tmp_path):
    script = tmp_path / "trl_sft.py"  # TRL's script with its imports switched, as a user runs it
    script.write_text(switched("sft"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = " ".join(done.stdout.split())
    for name in ("privacy_target_epsilon", "privacy_noise_multiplier", "clipping_norm", "model_init_kwargs"):
        text = " ".join(field_help.HELP.get(name, field_help.SFT_HELP.get(name, "")).split())
        assert f"--{name}" in lines and text in lines, name
