"""``transformers.HfArgumentParser`` with Opake's ``TrainingArguments`` and the TRL configs, as Hugging Face's example
scripts use it: the command line, ``parse_dict``, ``parse_json_file`` and ``--help``. Every value must equal what the
constructor gives for the same keyword arguments, Hugging Face's names included (mapped, ignored with a warning or
refused, as by the constructor)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field

import pytest

transformers = pytest.importorskip("transformers")

from transformers import HfArgumentParser  # noqa: E402

from opake_core.errors import ConfigurationError  # noqa: E402
from opake_torch.transformers import TrainingArguments, arguments  # noqa: E402
from opake_torch.transformers import _command_line as cli  # noqa: E402
from opake_torch.transformers import _from_hf as hf  # noqa: E402

COMMAND_LINE = (
    "--output_dir out --per_device_train_batch_size 8 --learning_rate 1e-4 --max_steps 3 --report_to none "
    "--privacy_target_epsilon 8 --warmup_steps 0.1 --logging_steps 5 --clipping_norm 1.0 --lr_scheduler_type cosine "
    "--max_grad_norm 1.0 --do_train --seed 3 --bf16 false"
).split()
KEYWORDS = dict(
    output_dir="out", per_device_train_batch_size=8, learning_rate=1e-4, max_steps=3, report_to="none",
    privacy_target_epsilon=8.0, warmup_steps=0.1, logging_steps=5, clipping_norm=1.0, lr_scheduler_type="cosine",
    max_grad_norm=1.0, do_train=True, seed=3, bf16=False,
)  # fmt: skip
DP = ["--privacy_target_epsilon", "8"]


def parse(*args: str, dtype: type = TrainingArguments) -> TrainingArguments:
    (parsed,) = HfArgumentParser(dtype).parse_args_into_dataclasses(args=[*DP, *args])
    return parsed


def command_line(values: dict) -> list[str]:
    """``values`` (a ``to_dict()``) as command-line arguments, as a user would type them."""
    out = []
    for name, value in values.items():
        if value is None or value == [] or value == "<SECRET>":
            continue
        if isinstance(value, bool):
            text = ["true" if value else "false"]
        elif isinstance(value, list):
            text = [str(v) for v in value]
        elif isinstance(value, dict):
            text = [json.dumps(value)]
        else:
            text = [str(value)]
        out += [f"--{name}", *text]
    return out


@pytest.fixture
def fresh_inert_warnings(monkeypatch):
    monkeypatch.setattr(arguments, "_WARNED_INERT", set())


# -- the command line ------------------------------------------------------------------------------------------------


def test_a_realistic_command_line_gives_what_the_constructor_gives():
    args = parse(*COMMAND_LINE)
    assert args.to_dict() == TrainingArguments(**KEYWORDS).to_dict()
    assert (args.warmup_steps, args.logging_steps, args.lr_scheduler, args.report_to) == (0.1, 5, "cosine", [])
    assert (args.do_train, args.seed, args.data_seed, args.bf16, args.clipping_norm) == (True, 3, 3, False, 1.0)


@pytest.mark.parametrize("dtype_name", ["TrainingArguments", "SFTConfig", "DPOConfig"])
def test_every_field_parses_from_its_value_on_the_command_line(dtype_name):
    dtype = TrainingArguments
    if dtype_name != "TrainingArguments":
        pytest.importorskip("trl")
        from opake_torch.transformers import trl as opake_trl

        dtype = getattr(opake_trl, dtype_name)
    assert parse(dtype=dtype).to_dict() == dtype(privacy_target_epsilon=8).to_dict()  # the defaults
    given = dtype(
        "out", privacy_target_epsilon=3.0, per_device_train_batch_size=16, microbatch_size=4, warmup_steps=5,
        logging_steps=0.25, eval_strategy="steps", eval_steps=0.5, save_steps=10, clipping_norm=0.5,
        optim_args="momentum=0.9", report_to=["tensorboard"], include_for_metrics=["loss"], label_names=["labels"],
        trackio_static_space_id=False, include_num_input_tokens_seen="non_padding", local_rank=0,
    )  # fmt: skip
    assert parse(*command_line(given.to_dict()), dtype=dtype).to_dict() == given.to_dict()


@pytest.mark.parametrize(
    ("argv", "keywords"),
    [
        (["--max_grad_norm", "0.5"], {"max_grad_norm": 0.5}),
        (["--max-grad-norm=0.5"], {"max_grad_norm": 0.5}),
        (["--lr_scheduler_type", "constant_with_warmup"], {"lr_scheduler_type": "constant_with_warmup"}),
        (["--auto_find_batch_size"], {"auto_find_batch_size": True}),
        (["--use_liger_kernel", "false"], {"use_liger_kernel": False}),
        (["--activation_checkpointing_kwargs", '{"use_reentrant": false}'], {"activation_checkpointing_kwargs": {
            "use_reentrant": False}}),
        (["--evaluation_strategy", "epoch"], {"evaluation_strategy": "epoch"}),
        (["--per_gpu_train_batch_size", "16"], {"per_gpu_train_batch_size": 16}),
        (["--push_to_hub_model_id", "me/model"], {"push_to_hub_model_id": "me/model"}),
        (["--gradient_accumulation_steps", "1", "--fp16", "no"], {"gradient_accumulation_steps": 1, "fp16": False}),
        (["--clipping_norm", "attn=0.5,fallback=1"], {"clipping_norm": "attn=0.5,fallback=1"}),
        (["--include_num_input_tokens_seen"], {"include_num_input_tokens_seen": True}),
    ],
)  # fmt: skip
def test_hugging_face_names_on_the_command_line_map_like_the_constructor(argv, keywords):
    expected = TrainingArguments(privacy_target_epsilon=8, **keywords)
    assert parse(*argv).to_dict() == expected.to_dict()


def test_max_grad_norm_on_the_command_line_is_the_per_example_bound():
    assert parse("--max_grad_norm", "0.5").clipping_norm == 0.5
    with pytest.raises(ConfigurationError, match="max_grad_norm=0 means 'no clipping' in transformers"):
        parse("--max_grad_norm", "0")


def test_every_hugging_face_name_is_an_option_except_opacus_names():
    parser = HfArgumentParser(TrainingArguments)
    strings = {s for action in parser._actions for s in action.option_strings}
    names = set(hf.ALIASES) | set(hf.REFUSED) | set(hf.INERT)
    assert {f"--{name}" for name in names - set(cli.KEYWORD_ONLY)} <= strings
    assert not {f"--{name}" for name in cli.KEYWORD_ONLY} & strings
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser.*--target_epsilon"):
        parse("--target_epsilon", "3")


@pytest.mark.parametrize("name", sorted(set(hf.REFUSED) | set(hf.INERT)))
def test_hugging_face_defaults_are_accepted_silently_on_the_command_line(name):
    default = (hf.REFUSED.get(name) or hf.INERT[name])[0]
    text = "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse(f"--{name}", text).to_dict() == TrainingArguments(privacy_target_epsilon=8).to_dict()


@pytest.mark.parametrize(
    ("argv", "keywords"),
    [
        (["--gradient_accumulation_steps", "4"], {"gradient_accumulation_steps": 4}),
        (["--fp16"], {"fp16": True}),
        (["--group_by_length", "yes"], {"group_by_length": True}),
        (["--deepspeed", "ds_config.json"], {"deepspeed": "ds_config.json"}),
    ],
)
def test_a_refused_name_fails_with_the_constructors_message(argv, keywords):
    with pytest.raises(ConfigurationError) as expected:
        TrainingArguments(privacy_target_epsilon=8, **keywords)
    with pytest.raises(ConfigurationError) as parsed:
        parse(*argv)
    assert str(parsed.value) == str(expected.value)
    assert "Instead, " in str(parsed.value)


def test_an_inert_name_warns_as_the_constructor(fresh_inert_warnings):
    with pytest.warns(RuntimeWarning, match="TrainingArguments ignores ddp_find_unused_parameters=True: the trainer"):
        args = parse("--ddp_find_unused_parameters", "true")
    assert args.to_dict() == TrainingArguments(privacy_target_epsilon=8).to_dict()


def test_an_alias_and_its_field_with_different_values_conflict_as_in_the_constructor():
    for argv in (
        ["--clipping_norm", "1", "--max_grad_norm", "0.5"],
        ["--max_grad_norm", "0.5", "--clipping_norm", "1"],
    ):
        with pytest.raises(ConfigurationError, match=r"both set TrainingArguments\.clipping_norm; pass only one"):
            parse(*argv)
    assert parse("--clipping_norm", "0.5", "--max_grad_norm", "0.5").clipping_norm == 0.5
    assert parse("--max_grad_norm", "2", "--max_grad_norm", "0.5").clipping_norm == 0.5  # argparse: the last wins


def test_an_invalid_value_fails_with_the_constructors_message():
    with pytest.raises(ConfigurationError, match="warmup_steps must be an integer if bigger than 1"):
        parse("--warmup_steps", "1.5")
    with pytest.raises(ConfigurationError, match="privacy_target_epsilon must be finite and > 0"):
        parse("--privacy_target_epsilon", "0")


def test_help_lists_the_fields_and_the_hugging_face_names_of_fields(capsys):
    with pytest.raises(SystemExit) as exited:
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for name in ("privacy_target_epsilon", "privacy_target_delta", "privacy_noise_multiplier", "clipping_norm",
                 "clipping_mode", "sampling_mode", "privacy_noise_mechanism", "microbatch_size", "max_grad_norm",
                 "lr_scheduler_type", "warmup_steps", "report_to", "do_train"):  # fmt: skip
        assert f"--{name} " in text, name
    assert "--fp16" not in text and "--gradient_accumulation_steps" not in text  # no field: not listed


# -- dicts and JSON files ----------------------------------------------------------------------------------------------


def test_parse_dict_and_parse_json_file(tmp_path):
    values = {**KEYWORDS, "lr_scheduler": "cosine", "clipping_norm": 1.0}
    del values["lr_scheduler_type"], values["max_grad_norm"]  # a dict holds the fields' names
    expected = TrainingArguments(**values).to_dict()
    parser = HfArgumentParser(TrainingArguments)
    assert parser.parse_dict(values)[0].to_dict() == expected
    path = tmp_path / "args.json"
    path.write_text(json.dumps(values))
    assert parser.parse_json_file(str(path))[0].to_dict() == expected
    full = TrainingArguments(**values).to_dict()  # every field, resolved
    assert parser.parse_dict(full)[0].to_dict() == expected
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['max_grad_norm'\]"):
        parser.parse_dict({**values, "max_grad_norm": 1.0})  # Hugging Face's names are keyword arguments only


# -- an example script's argument parsing ------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    """As in transformers' examples/pytorch/text-classification/run_classification.py."""

    model_name_or_path: str = field(metadata={"help": "Path to pretrained model or model identifier"})
    config_name: str | None = field(default=None, metadata={"help": "Pretrained config name or path"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Whether to use a fast tokenizer."})
    token: str = field(default=None, metadata={"help": "The token to use as HTTP bearer authorization."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Trust the code of remote models."})


@dataclass
class DataTrainingArguments:
    """As in the same script."""

    train_file: str | None = field(default=None, metadata={"help": "A csv or a json file of training data."})
    validation_file: str | None = field(default=None, metadata={"help": "A csv or a json file of validation data."})
    max_seq_length: int = field(default=128, metadata={"help": "The maximum total input sequence length."})
    pad_to_max_length: bool = field(default=True, metadata={"help": "Pad all samples to max_seq_length."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training examples."})


def test_an_example_scripts_argument_parsing(tmp_path):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    argv = [
        "--model_name_or_path", "tiny-bert", "--train_file", "train.json", "--validation_file", "valid.json",
        "--max_seq_length", "32", "--no_pad_to_max_length", "--do_train", "--do_eval", "--output_dir", str(tmp_path),
        "--per_device_train_batch_size", "16", "--learning_rate", "2e-3", "--num_train_epochs", "2",
        "--eval_strategy", "epoch", "--save_strategy", "epoch", "--load_best_model_at_end", "--report_to", "none",
        "--use_cpu", "--max_grad_norm", "1.0", "--privacy_target_epsilon", "8",
    ]  # fmt: skip
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    assert (model_args.model_name_or_path, model_args.use_fast_tokenizer) == ("tiny-bert", True)
    assert (data_args.max_seq_length, data_args.pad_to_max_length) == (32, False)
    assert isinstance(training_args, TrainingArguments)
    assert (training_args.do_train, training_args.do_eval, training_args.load_best_model_at_end) == (True, True, True)
    assert (training_args.privacy_target_epsilon, training_args.clipping_norm) == (8.0, 1.0)
    # what the script reads next
    assert training_args.should_log and training_args.get_process_log_level() in range(0, 51)
    assert (training_args.local_rank, training_args.n_gpu, training_args.fp16) == (-1, 0, False)
    assert training_args.parallel_mode.value == "not_parallel" and str(training_args.device) == "cpu"
    assert not training_args.overwrite_output_dir and training_args.resume_from_checkpoint is None

    # `python run_classification.py args.json`: the same arguments from a JSON file
    data = {**vars(model_args), **vars(data_args), **training_args.to_dict()}
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data))
    from_file = parser.parse_json_file(json_file=str(path))
    assert from_file[2].to_dict() == training_args.to_dict()
    assert (from_file[0], from_file[1]) == (model_args, data_args)


def test_a_scripts_own_opacus_option_does_not_conflict():
    @dataclass
    class PrivacyArguments:
        target_epsilon: float = 3.0

    privacy, args = HfArgumentParser((PrivacyArguments, TrainingArguments)).parse_args_into_dataclasses(
        args=["--target_epsilon", "2", "--privacy_target_epsilon", "4"]
    )
    assert (privacy.target_epsilon, args.privacy_target_epsilon) == (2.0, 4.0)


# -- TRL's configs -----------------------------------------------------------------------------------------------------


def test_trl_configs_with_trls_script_dataclasses(fresh_inert_warnings):
    trl = pytest.importorskip("trl")
    from opake_torch.transformers.trl import DPOConfig, SFTConfig

    parser = HfArgumentParser((trl.ScriptArguments, SFTConfig, trl.ModelConfig))
    argv = ["--dataset_name", "data", "--model_name_or_path", "tiny", "--use_peft", *DP, "--max_length", "64"]
    script, config, model = parser.parse_args_into_dataclasses(args=[*argv, "--chat_template_path", "{{ x }}"])
    assert (script.dataset_name, model.use_peft, config.max_length, config.chat_template) == (
        "data",
        True,
        64,
        "{{ x }}",
    )
    with pytest.warns(RuntimeWarning, match="SFTConfig: dataset_num_proc=4 has no effect"):
        parser.parse_args_into_dataclasses(args=[*argv, "--dataset_num_proc", "4"])
    for refused in (["--packing"], ["--padding_free", "true"], ["--shuffle_dataset"], ["--fp16"]):
        with pytest.raises(ConfigurationError, match=r"refused|does not support"):
            parser.parse_args_into_dataclasses(args=[*argv, *refused])

    from opake_torch.transformers.trl.config import DPO_NAMES, SFT_NAMES

    for config, names in ((SFTConfig, SFT_NAMES), (DPOConfig, DPO_NAMES)):  # every TRL name is an option
        strings = {s for action in HfArgumentParser(config)._actions for s in action.option_strings}
        assert {f"--{name}" for name in names} <= strings, config
    trl_parser = trl.TrlParser((trl.ScriptArguments, SFTConfig, trl.ModelConfig))  # TRL's scripts' parser
    assert trl_parser.parse_args_and_config(args=[*argv, "--max_grad_norm", "0.3"])[1].clipping_norm == 0.3

    parser = HfArgumentParser((trl.ScriptArguments, DPOConfig, trl.ModelConfig))
    argv = ["--dataset_name", "data", *DP, "--loss_type", "robust", "--label_smoothing", "0.1", "--beta", "0.2"]
    _, config, _ = parser.parse_args_into_dataclasses(args=argv)
    assert (config.loss_type, config.label_smoothing, config.beta) == ("robust", 0.1, 0.2)
    _, config, _ = parser.parse_args_into_dataclasses(args=[*argv, "--sync_ref_model", "--ref_model_sync_steps", "4"])
    assert (config.sync_ref_model, config.ref_model_sync_steps, config.ref_model_mixup_alpha) == (True, 4, 0.6)


def test_the_command_line_value_reader():
    read = cli.command_line_value
    assert [read(t) for t in ("yes", "No", "t", "f", "none", "4", "0.5", "inf", "ds.json")] == [
        True, False, True, False, None, 4, 0.5, float("inf"), "ds.json",
    ]  # fmt: skip
