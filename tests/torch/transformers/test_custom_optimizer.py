"""A custom optimizer in the trainer: ``optimizer_cls_and_kwargs=(factory, kwargs)`` (Hugging Face's argument) runs
``factory(lr=schedule, **kwargs)``, equal step by step to the run of the named optimizer it builds; the Schedule-Free
names around another base (``schedule_free_radam``, ``schedule_free_sgd``, ``schedule_free`` with
``optim_args["base"]``) equal ``optim.schedule_free`` around that base composed by hand; what is not a core optimizer
is refused with the reason."""

from __future__ import annotations

from typing import NamedTuple

import optree
import pytest
import torch
from tiny_hf import tiny_model, token_data
from torchopt.base import GradientTransformation
from transformers import TrainerCallback

from opake_core import optim, random, sampling
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.optim import schedules
from opake_core.step import dp_sgd
from opake_torch.functional import functional_model
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import causal_lm_loss

DATA = token_data(40)
LR, BETAS, EPS, DECAY, STEPS = 0.01, (0.8, 0.95), 1e-6, 0.01, 3


def _args(tmp_path, **kw) -> TrainingArguments:
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": STEPS,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": LR,
        "weight_decay": DECAY,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "per_example_gradients": "vmap",
        "privacy_noise_seed": 42,  # the tests replay the trainer's noise
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


class _Snapshots(TrainerCallback):
    """The model's trainable parameters after every step."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def _trainer_steps(args: TrainingArguments, **kw) -> list[dict[str, torch.Tensor]]:
    snapshots = _Snapshots()
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA, callbacks=[snapshots], **kw)
    trainer.train()
    assert len(snapshots.steps) == STEPS
    return snapshots.steps


def _core_steps(opt: optim.Optimizer, args: TrainingArguments) -> list[dict[str, torch.Tensor]]:
    """The trainer's steps composed by hand from the core (sampler, per-example loss, DP-SGD step, optimizer), with
    the trainer's key derivation; the parameters after each step, then the weights to publish after the last."""
    apply, params, frozen = functional_model(tiny_model("llama"))
    root = random.key(args.privacy_noise_seed)
    sampler = sampling.poisson(dataset_size=len(DATA), sample_rate=8 / len(DATA))
    sampler_key, sampler_state = random.fold_in(root, "opake.trainer.sampler"), sampler.init()

    def loss(p, example):
        inputs = {k: v[None] for k, v in example.items() if k != "labels"}
        return causal_lm_loss(apply(p, frozen, **inputs).logits[0], example["labels"])

    step_fn, dp_state = dp_sgd(
        loss,
        optimizer=opt,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        microbatch_size=8,
        key=random.fold_in(root, "opake.trainer.noise"),
    )
    opt_state, out = opt.init(params), []
    for _ in range(STEPS):
        index, sampler_state = sampler.sample(sampler_key, sampler_state)
        batch = language_modeling_labels(collate([DATA[i] for i in index]))
        params, opt_state, dp_state, _ = step_fn(params, opt_state, dp_state, (batch,))
        out.append({k: v.clone() for k, v in params.items()})
    return [*out, opt.eval_params(opt_state, params)]


def _assert_equal_steps(got, want):
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        assert sorted(a) == sorted(b)
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
    assert any(not torch.equal(got[0][n], got[-1][n]) for n in got[0])  # the steps moved the weights


def test_factory_equals_the_named_optimizer_step_by_step(tmp_path):
    # a warm-up and a decay: the factory receives the run's schedule as lr, step for step
    schedule = {"lr_scheduler": "linear", "warmup_steps": 1}
    named = _trainer_steps(_args(tmp_path / "named", optim="lion", **schedule))
    factory = (optim.lion, {"betas": BETAS, "weight_decay": DECAY})
    custom = _trainer_steps(_args(tmp_path / "custom", optim="sgd", **schedule), optimizer_cls_and_kwargs=factory)
    _assert_equal_steps(custom, named)
    # and both are the core's Lion on the schedule written by hand: linear from 0 at the first update to LR after one
    # step, then down to 0 over the remaining STEPS - 1
    by_hand = schedules.with_warmup(schedules.linear(LR, 0.0, STEPS - 1, transition_begin=1), 1)
    _assert_equal_steps(custom, _core_steps(optim.lion(by_hand, BETAS, DECAY), _args(tmp_path / "core"))[:-1])


@pytest.mark.parametrize(
    ("name", "optim_args", "base"),
    [
        ("schedule_free_radam", {}, lambda lr: optim.radam(lr, BETAS, EPS, DECAY)),
        ("schedule_free_sgd", {"beta": 0.5}, lambda lr: optim.sgd(lr, weight_decay=DECAY)),
        ("schedule_free", {"base": "lion"}, lambda lr: optim.lion(lr, BETAS, DECAY)),
        (
            "schedule_free",
            {"base": "adamw-bc", "warmup_steps": 1},
            lambda lr: optim.adamw(lr, BETAS, EPS, DECAY, noise_bias_correction=True),
        ),
    ],
    ids=["radam", "sgd", "lion", "adamw-bc"],
)
def test_schedule_free_names_wrap_their_base(tmp_path, name, optim_args, base):
    args = _args(tmp_path, optim=name, optim_args=optim_args, warmup_steps=2)
    assert args.optim == name
    lr = schedules.with_warmup(schedules.constant(LR), 2)
    wrapper = {"beta": optim_args.get("beta", 0.9), "warmup_steps": optim_args.get("warmup_steps", 2)}
    expected = optim.schedule_free(base(lr), **wrapper)
    _assert_equal_steps(_trainer_steps(args), _core_steps(expected, args)[:-1])


def test_factory_of_a_schedule_free_optimizer_publishes_its_average(tmp_path):
    factory = (lambda lr, **kw: optim.schedule_free(optim.momentum(lr, **kw)), {"momentum": 0.5})
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DATA, optimizer_cls_and_kwargs=factory)
    trainer.train()
    assert trainer.optimizer.name == "schedule_free_momentum"
    *steps, x = _core_steps(optim.schedule_free(optim.momentum(schedules.constant(LR), 0.5)), _args(tmp_path / "core"))
    model = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(model[k], x[k]) for k in x)
    assert any(not torch.equal(x[k], steps[-1][k]) for k in x)  # the average x, not the last iterate y


class _OwnState(NamedTuple):
    count: torch.Tensor


def _own_state_sgd(lr):
    """SGD whose state is a class the checkpoint files do not know."""
    transform = GradientTransformation(
        lambda params: _OwnState(torch.zeros((), dtype=torch.int64)),
        lambda updates, state, *, params=None, inplace=False: (
            optree.tree_map(lambda g: -lr(int(state.count)) * g, updates),
            _OwnState(state.count + 1),
        ),
    )
    return optim.Optimizer("own_sgd", transform, non_private=False)


class _NoGuard:
    def init(self, params):
        return ()

    def update(self, updates, state, *, params=None, inplace=False):
        return updates, state


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ((torch.optim.SGD, {"momentum": 0.9}), ConfigurationError, "torch optimizer SGD.*without checking"),
        ((optim.lion,), InputTypeError, r"must be a pair \(factory, kwargs\)"),
        (optim.lion, InputTypeError, r"must be a pair \(factory, kwargs\)"),
        (("lion", {}), InputTypeError, "must be callable"),
        ((optim.lion, [("betas", BETAS)]), InputTypeError, r"\[1\] must be a dict"),
        ((optim.lion, {"lr": 0.1}), ConfigurationError, "sets lr=0.1.*receives the run's schedule"),
    ],
    ids=["torch-class", "one-item", "bare", "not-callable", "list-kwargs", "lr"],
)
def test_refused_when_constructed(tmp_path, value, error, match):
    with pytest.raises(error, match=match):
        DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DATA, optimizer_cls_and_kwargs=value)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda lr: _NoGuard(), "returned a _NoGuard, not an opake_core.optim.Optimizer"),
        (
            lambda lr: optim.sgd(lr).transform,
            "returned a ChainedGradientTransformation, not an opake_core.optim.Optimizer",
        ),
        (lambda lr, momentum: optim.momentum(lr, momentum), r"raised TypeError.*keyword lr"),
        (_own_state_sgd, "save_tree cannot save the state of the optimizer from optimizer_cls_and_kwargs"),
    ],
    ids=["duck-typed", "bare-torchopt", "missing-keyword", "unsavable-state"],
)
def test_a_factory_result_that_is_not_a_core_optimizer_is_refused_before_any_step(tmp_path, factory, match):
    trainer = DPTrainer(
        tiny_model("llama"), _args(tmp_path), train_dataset=DATA, optimizer_cls_and_kwargs=(factory, {})
    )
    with pytest.raises(InputTypeError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("optim_name", "optim_args", "match"),
    [
        ("schedule_free", {"base": "schedule_free_sgd"}, "not itself Schedule-Free"),
        ("schedule_free", {"base": "adamw_8bit"}, r"optim_args\['base'\] must be one of"),
        ("schedule_free_radam", {"base": "sgd"}, r"its base is fixed by the name \(radam\)"),
        ("adamw", {"base": "sgd"}, "names the optimizer that optim='schedule_free' wraps"),
    ],
)
def test_schedule_free_base_is_checked(tmp_path, optim_name, optim_args, match):
    with pytest.raises(ConfigurationError, match=match):
        _args(tmp_path, optim=optim_name, optim_args=optim_args)


BEST = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2}


def test_schedule_free_wrappers_refuse_load_best_model_at_end(tmp_path):
    with pytest.raises(ConfigurationError, match="optim='schedule_free_sgd' cannot be combined"):
        _args(tmp_path, optim="schedule_free_sgd", load_best_model_at_end=True, **BEST)
    factory = (lambda lr: optim.schedule_free(optim.sgd(lr)), {})
    args = _args(tmp_path, load_best_model_at_end=True, **BEST)
    trainer = DPTrainer(
        tiny_model("llama"), args, train_dataset=DATA, eval_dataset=DATA[:8], optimizer_cls_and_kwargs=factory
    )
    with pytest.raises(ConfigurationError, match=r"optimizer_cls_and_kwargs \(schedule_free_sgd\).*load_best_model"):
        trainer.train()
    assert trainer.state.global_step == 0
