"""The optimizers selected by name in TrainingArguments (optim=..., Hugging Face's names included): the trainer's
steps equal the core step composed by hand with the named optimizer; Schedule-Free AdamW evaluates and publishes
its averaged weights x, checkpoints its training iterate y and resumes exactly."""

from __future__ import annotations

import warnings
from functools import partial

import optree
import pytest
import torch
from safetensors.torch import load_file
from tiny_hf import StopAt, tiny_model, token_data
from trainer_reference import BETAS, DECAY, EPS, LR, reference_run, replayable_args

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_core.optim.schedule_free import ScheduleFreeState
from opake_core.tree import Noised
from opake_torch.state_files import load_tree
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.optimizer import build_optimizer, build_schedule

DATA = token_data(40)
_args = partial(replayable_args, max_steps=2, logging_steps=2)


# name -> (optim_args, other arguments, the optimizer those arguments must build)
CASES = {
    "lion": ({}, {}, lambda: optim.lion(LR, BETAS, DECAY)),
    "ademamix": (
        {"beta3": 0.99, "alpha": 3.0, "t_alpha": 10, "t_beta3": 5},
        {},
        lambda: optim.ademamix(LR, (*BETAS, 0.99), 3.0, EPS, DECAY, t_alpha=10, t_beta3=5),
    ),
    "rmsprop": (
        {"momentum": 0.5, "centered": True},
        {},
        lambda: optim.rmsprop(LR, weight_decay=DECAY, momentum=0.5, centered=True),
    ),
    "adagrad": ({"lr_decay": 0.1}, {}, lambda: optim.adagrad(LR, lr_decay=0.1, weight_decay=DECAY)),
    "radam": (
        {"decoupled_weight_decay": True},
        {},
        lambda: optim.radam(LR, BETAS, EPS, DECAY, decoupled_weight_decay=True),
    ),
    "adadelta": ({"rho": 0.8}, {}, lambda: optim.adadelta(LR, rho=0.8, weight_decay=DECAY)),
    "schedule_free_adamw": (
        {"r": 1.0},
        {"warmup_steps": 2},  # the trainer's warm-up is the optimizer's own ramp, (t) / warmup_steps
        lambda: optim.schedule_free_adamw(LR, BETAS, EPS, DECAY, warmup_steps=2, r=1.0),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_trainer_steps_equal_the_core_step_with_the_named_optimizer(tmp_path, name):
    optim_args, extra, expected = CASES[name]
    args = _args(tmp_path, optim=name, optim_args=optim_args, **extra)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    trainer.train()
    want = reference_run(expected(), data=DATA, steps=2).published
    start = dict(tiny_model("llama").named_parameters())
    for param_name, value in trainer.model.named_parameters():
        assert torch.equal(value.detach(), want[param_name]), param_name
    assert any(not torch.equal(v.detach(), start[k]) for k, v in trainer.model.named_parameters())


@pytest.mark.parametrize(
    ("name", "optim_args", "expected"),
    [
        ("rmsprop", {"weight_decay": 0.5, "eps": 1e-3}, lambda lr: optim.rmsprop(lr, eps=1e-3, weight_decay=0.5)),
        (
            "ademamix",  # Hugging Face's optim_args for its ademamix
            {"beta1": 0.5, "beta2": 0.9, "eps": 1e-3, "alpha": 8},
            lambda lr: optim.ademamix(lr, (0.5, 0.9, 0.9999), 8, 1e-3, DECAY),
        ),
        ("adamw", {"betas": (0.5, 0.6)}, lambda lr: optim.adamw(lr, (0.5, 0.6), EPS, DECAY)),
        ("adam-bc", {"eps": 1e-3}, lambda lr: optim.adam(lr, BETAS, 1e-3, noise_bias_correction=True)),
    ],
)
def test_optim_args_override_the_fields(tmp_path, name, optim_args, expected):
    args = _args(tmp_path, optim=name, optim_args=optim_args)
    built, want = build_optimizer(args, 10), expected(build_schedule(args, 10))
    params = {"w": torch.arange(6.0).view(3, 2), "b": torch.ones(2)}
    grads = Noised({"w": torch.linspace(-1, 1, 6).view(3, 2), "b": torch.tensor([0.5, -2.0])}, 1.0, 0.1)
    got, _ = built.update(grads, built.init(params), params=params)
    ref, _ = want.update(grads, want.init(params), params=params)
    assert built.name == want.name
    assert all(torch.equal(got[k], ref[k]) for k in params)


@pytest.mark.parametrize(
    ("name", "optim_args", "corrected"),
    [
        ("adamw-bc", {}, True),
        ("adamw", {"noise_bias_correction": True}, True),
        ("adam", {"noise_bias_correction": True}, True),
        ("adafactor", {"noise_bias_correction": True}, True),
        ("rmsprop", {"noise_bias_correction": True}, True),
        ("schedule_free", {"base": "adamw-bc"}, True),
        ("schedule_free", {"base": "ademamix", "noise_bias_correction": True}, True),
        ("adamw", {}, False),
        ("adafactor", {}, False),
        ("schedule_free", {"base": "adamw"}, False),
    ],
)
def test_noise_bias_correction_answers_from_the_built_optimizer(tmp_path, name, optim_args, corrected):
    """Both spellings (the ``-bc`` name, ``optim_args["noise_bias_correction"]``) and a Schedule-Free base. The
    oracle is the built optimizer's first update: a corrected one depends on the noise std it is told, a plain one
    does not."""
    args = _args(tmp_path, optim=name, optim_args=optim_args)
    assert args.noise_bias_correction is corrected
    built = build_optimizer(args, 10)
    params = {"w": torch.arange(6.0).view(3, 2), "b": torch.ones(2)}
    grads = {"w": torch.linspace(-1, 1, 6).view(3, 2), "b": torch.tensor([0.5, -2.0])}
    first = [built.update(Noised(grads, 1.0, std), built.init(params), params=params)[0] for std in (0.0, 0.3)]
    assert any(not torch.equal(first[0][k], first[1][k]) for k in params) is corrected


@pytest.mark.parametrize(
    ("given", "expected"),
    [("lion_32bit", "lion"), ("schedule_free", "schedule_free_adamw"), ("rmsprop", "rmsprop"), ("radam", "radam")],
)
def test_aliases(given, expected):
    assert TrainingArguments(optim=given, privacy_noise_multiplier=1.0).optim == expected


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ("schedule_free_lion", "optim must be one of"),
        ("lion_8bit", "no functional torchopt"),
        ("paged_lion_32bit", "no functional torchopt"),
        ("ademamix_8bit", "no functional torchopt"),
        ("rmsprop_bnb", "no functional torchopt"),
    ],
)
def test_unsupported_names_are_refused(given, match):
    with pytest.raises(ConfigurationError, match=match):
        TrainingArguments(optim=given, privacy_noise_multiplier=1.0)


@pytest.mark.parametrize(
    ("hf_name", "expected"),
    [
        ("lion_32bit", "lion"),
        ("rmsprop", "rmsprop"),
        ("adagrad", "adagrad"),
        ("ademamix", "ademamix"),
        ("schedule_free_adamw", "schedule_free_adamw"),
    ],
)
def test_from_hf_maps_the_names_with_the_same_update(tmp_path, hf_name, expected):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's own notices are not under test
        hf_args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, optim=hf_name
        )
    assert TrainingArguments.from_hf(hf_args, privacy_target_epsilon=8.0).optim == expected


def test_from_hf_refuses_the_schedule_free_variants_without_an_equivalent(tmp_path):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, optim="schedule_free_radam"
        )
    with pytest.raises(ConfigurationError, match="the authors' schedule_free_radam optimizer, whose update"):
        TrainingArguments.from_hf(hf_args, privacy_target_epsilon=8.0)


def _schedule_free_run(tmp_path, *, stop=None, resume=None, **kw):
    args = _args(tmp_path, optim="schedule_free_adamw", max_steps=4, save_strategy="steps", save_steps=2, **kw)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA, eval_dataset=DATA[:8])
    if stop is not None:
        trainer.add_callback(StopAt(stop))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_schedule_free_publishes_and_evaluates_x_and_checkpoints_y(tmp_path):
    trainer = _schedule_free_run(tmp_path, eval_strategy="steps", eval_steps=4)
    folder = tmp_path / "out" / f"{ckpt.PREFIX}-4"
    y = load_file(str(folder / "model.safetensors"))
    state = load_tree(folder / ckpt.DP_OPTIMIZER)
    assert isinstance(state, ScheduleFreeState) and int(state.count) == 4
    names = sorted(state.z)
    # x = y + (1 - 1/b1)(z - y), from the checkpoint's files alone
    lerped = torch._foreach_lerp([y[k] for k in names], [state.z[k] for k in names], 1 - 1 / BETAS[0])
    x = dict(zip(names, lerped, strict=True))
    model = dict(trainer.model.named_parameters())
    for k in names:
        assert torch.equal(model[k].detach(), x[k]), k
    assert any(not torch.equal(x[k], y[k]) for k in names)

    logged = [row["eval_loss"] for row in trainer.state.log_history if "eval_loss" in row]
    assert logged == [trainer.evaluate()["eval_loss"]]  # the evaluation during training scored x too

    saved = load_file(str(trainer.save_model(str(tmp_path / "final")) / "model.safetensors"))
    assert all(torch.equal(saved[k], x[k]) for k in names)


def test_schedule_free_resume_is_bitwise_identical(tmp_path):
    full = _schedule_free_run(tmp_path / "a")
    _schedule_free_run(tmp_path / "b", stop=2)
    resumed = _schedule_free_run(tmp_path / "b", resume=True)
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    a = load_tree(tmp_path / "a/out/checkpoint-4" / ckpt.DP_OPTIMIZER)
    b = load_tree(tmp_path / "b/out/checkpoint-4" / ckpt.DP_OPTIMIZER)
    assert all(torch.equal(p, q) for p, q in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True))


BEST = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2}
REFUSAL = r"optim='schedule_free_adamw' cannot be combined with load_best_model_at_end=True.*averaged"


@pytest.mark.parametrize("name", ["schedule_free_adamw", "schedule_free"])
def test_schedule_free_refuses_load_best_model_at_end_when_constructed(tmp_path, name):
    with pytest.raises(ConfigurationError, match=REFUSAL):
        _args(tmp_path, optim=name, load_best_model_at_end=True, **BEST)
    args = _args(tmp_path, optim=name, load_best_model_at_end=False, **BEST)
    assert (args.optim, args.load_best_model_at_end) == ("schedule_free_adamw", False)
    args.load_best_model_at_end = True
    with pytest.raises(ConfigurationError, match=REFUSAL):
        build_optimizer(args, 4)
