"""Hugging Face's ``fsdp`` / ``fsdp_config`` arguments: what DPTrainer's FSDP2 path accepts, and what it refuses with
the reason, directly and from a ``transformers.TrainingArguments``."""

from __future__ import annotations

import json

import pytest
import transformers
from tiny_hf import tiny_model, token_data

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.topology import ShardedDataParallel

DP = {"privacy_noise_multiplier": 1.0, "use_cpu": True, "report_to": "none"}
ROWS = token_data(8)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("", ""),
        (None, ""),
        (False, ""),
        (True, "full_shard"),
        ("full_shard", "full_shard"),
        ("full_shard auto_wrap", "auto_wrap full_shard"),
        (["auto_wrap", "shard_grad_op"], "auto_wrap shard_grad_op"),
        ("auto_wrap", "auto_wrap full_shard"),
    ],
)
def test_fsdp_options(tmp_path, given, canonical):
    assert TrainingArguments(str(tmp_path), fsdp=given, **DP).fsdp == canonical


@pytest.mark.parametrize(
    ("given", "phrase"),
    [
        ("hybrid_shard", "hybrid sharding .* not supported yet; use full_shard"),
        ("full_shard offload", "CPU offload .* not supported yet"),
        ("no_shard", "built-in DDP"),
        ("full_shard shard_grad_op", "names both full_shard and shard_grad_op"),
        ("zero3", "unknown option 'zero3'"),
    ],
)
def test_fsdp_refusals_say_why(tmp_path, given, phrase):
    with pytest.raises(ConfigurationError, match=phrase):
        TrainingArguments(str(tmp_path), fsdp=given, **DP)


def test_fsdp_config_keys(tmp_path):
    config = {
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer, MistralDecoderLayer",
        "backward_prefetch": "backward_pre",  # FSDP1: accepted, no effect
        "min_num_params": 0,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "activation_checkpointing": False,
        "reshard_after_forward": False,
        "xla": False,
    }
    args = TrainingArguments(str(tmp_path), fsdp="full_shard", fsdp_config=config, **DP)
    assert args.fsdp_config == {
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "MistralDecoderLayer"],
        "reshard_after_forward": False,
    }
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(config))
    assert (
        TrainingArguments(str(tmp_path), fsdp="full_shard", fsdp_config=str(path), **DP).fsdp_config == args.fsdp_config
    )


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        ({"min_num_params": 1_000_000}, "Wrapping by size .* not supported"),
        ({"activation_cpu_offload": True}, "key 'activation_cpu_offload' is not supported"),
        ({"version": 1}, "only FSDP2"),
        ({"reshard_after_forward": "yes"}, "must be True or False"),
        ({"transformer_layer_cls_to_wrap": [3]}, "must be class names"),
        ({"activation_checkpointing": True}, "use gradient_checkpointing=True"),
        ({"fsdp_offload_params": True}, "CPU offload .* not supported yet"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "only TRANSFORMER_BASED_WRAP"),
    ],
)
def test_fsdp_config_refusals(tmp_path, config, phrase):
    with pytest.raises(ConfigurationError, match=phrase):
        TrainingArguments(str(tmp_path), fsdp="full_shard", fsdp_config=config, **DP)


def test_fsdp_config_needs_fsdp(tmp_path):
    with pytest.raises(ConfigurationError, match="fsdp is not; set fsdp='full_shard'"):
        TrainingArguments(str(tmp_path), fsdp_config={"reshard_after_forward": True}, **DP)


def test_from_hugging_face_arguments(tmp_path):
    hf = transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    )
    args = TrainingArguments.from_hf(hf, privacy_noise_multiplier=1.0)
    assert args.fsdp == "full_shard"
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert set(args.fsdp_config) <= {"transformer_layer_cls_to_wrap", "reshard_after_forward"}  # the rest is inert
    plain = TrainingArguments.from_hf(
        transformers.TrainingArguments(str(tmp_path), use_cpu=True), **{"privacy_noise_multiplier": 1.0}
    )
    assert plain.fsdp == "" and plain.fsdp_config == {}


# -- what FSDP2 cannot serve, refused before any step -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"torch_compile": True}, "torch_compile=True is not supported with fsdp yet"),
        ({"cuda_graphs": 2}, "cuda_graphs > 0 is not supported with fsdp yet"),
        (
            {"router_aux_loss_coef": 0.1, "router_aux_kwargs": {"max_tokens": 8}},
            "router_aux_loss_coef > 0 is not supported with fsdp yet",
        ),
    ],
)
def test_sharded_topology_refuses_what_it_cannot_serve(tmp_path, kwargs, phrase):
    args = TrainingArguments(str(tmp_path), fsdp="full_shard", **kwargs, **DP)
    with pytest.raises(ConfigurationError, match=phrase):
        ShardedDataParallel(args)


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"per_example_gradients": "vmap"}, "fsdp needs the layerwise .* vmap\\(grad\\) .* cannot run on sharded"),
        ({"optim": "adafactor"}, "optimizer adafactor reads statistics over each whole weight"),
        ({"optim": "stable_adamw"}, "optimizer stable_adamw reads statistics over each whole weight"),
        ({"optim": "adamw", "optim_args": {"update_rms_clip": 1.0}}, "optimizer stable_adamw reads statistics"),
        ({"optim": "schedule_free", "optim_args": {"base": "adafactor"}}, "optimizer schedule_free_adafactor reads"),
    ],
)
def test_trainer_refuses_to_shard_what_needs_whole_weights(tmp_path, kwargs, phrase):
    trainer = DPTrainer(tiny_model("llama"), TrainingArguments(str(tmp_path), **kwargs, **DP), train_dataset=ROWS)
    with pytest.raises(ConfigurationError, match=phrase):
        trainer._shard()  # what train() does under fsdp once the checks passed, before any step


ADAFACTOR_IN_SCHEDULE_FREE = (lambda lr: optim.schedule_free(optim.adafactor(lr)), {})


@pytest.mark.parametrize(
    ("factory", "refused"),
    [
        ((optim.adafactor, {"weight_decay": 0.01}), "adafactor"),
        (ADAFACTOR_IN_SCHEDULE_FREE, "schedule_free_adafactor"),
        ((optim.lion, {}), None),
        ((lambda lr: optim.schedule_free(optim.adamw(lr)), {}), None),
    ],
    ids=["adafactor", "schedule_free(adafactor)", "lion", "schedule_free(adamw)"],
)
def test_the_refusal_reads_the_built_optimizer_of_a_factory(tmp_path, monkeypatch, factory, refused):
    """optimizer_cls_and_kwargs replaces optim (left at its default, adamw): the factory's optimizer decides."""
    args = TrainingArguments(str(tmp_path), **DP)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=ROWS, optimizer_cls_and_kwargs=factory)
    monkeypatch.setattr(trainer.topology, "shard", lambda model, params: params, raising=False)  # one process here
    if refused is None:
        trainer._shard()
        return
    with pytest.raises(ConfigurationError, match=f"optimizer {refused} reads statistics over each whole weight"):
        trainer._shard()
