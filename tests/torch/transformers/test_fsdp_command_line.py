"""The FSDP2 launch line of docs/distributed.md through ``transformers.HfArgumentParser``: ``--fsdp`` and
``--fsdp_config`` give what the constructor gives for the same values."""

from __future__ import annotations

import json

import pytest
from transformers import HfArgumentParser

from opake_torch.transformers import TrainingArguments

KWARGS = {"privacy_noise_multiplier": 1.0, "use_cpu": True, "report_to": "none"}
DP = ["--privacy_noise_multiplier", "1.0", "--use_cpu", "true", "--report_to", "none"]


def parse(tmp_path, *args: str) -> TrainingArguments:
    (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), *DP, *args]
    )
    return parsed


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("full_shard auto_wrap", "auto_wrap full_shard"),  # the documented torchrun line
        ("shard_grad_op", "shard_grad_op"),
        ("true", "full_shard"),  # Hugging Face's --fsdp true
    ],
)
def test_fsdp_on_the_command_line_equals_the_constructor(tmp_path, given, expected):
    config = {"version": 2, "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(config))
    parsed = parse(tmp_path, "--fsdp", given, "--fsdp_config", str(path))
    built = TrainingArguments(str(tmp_path), fsdp=given if given != "true" else True, fsdp_config=config, **KWARGS)
    assert parsed.fsdp == built.fsdp == expected
    assert (
        parsed.fsdp_config
        == built.fsdp_config
        == {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    )


def test_fsdp_config_as_json_text_round_trips(tmp_path):
    """``to_dict()``'s value of ``fsdp_config`` typed back on the command line (JSON text) rebuilds the same field."""
    built = TrainingArguments(str(tmp_path), fsdp="full_shard", fsdp_config={"reshard_after_forward": False}, **KWARGS)
    text = json.dumps(built.to_dict()["fsdp_config"])
    parsed = parse(tmp_path, "--fsdp", "full_shard", "--fsdp_config", text)
    assert parsed.fsdp_config == built.fsdp_config == {"reshard_after_forward": False}
