"""A custom optimizer in the trainer: ``optimizer_cls_and_kwargs=(factory, kwargs)`` (Hugging Face's argument) runs
``factory(lr=schedule, **kwargs)``, equal step by step to the run of the named optimizer it builds; the Schedule-Free
names around another base (``schedule_free_radam``, ``schedule_free_sgd``, ``schedule_free`` with
``optim_args["base"]``) equal ``optim.schedule_free`` around that base composed by hand; what is not a core optimizer
is refused with the reason."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import optree
import pytest
import torch
from tiny_hf import tiny_model, token_data
from torchopt.base import GradientTransformation
from trainer_reference import BETAS, DECAY, EPS, LR, reference_run, replayable_args
from transformers import TrainerCallback

from opake_core import optim
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.optim import schedules
from opake_torch.transformers import DPTrainer, TrainingArguments

DATA = token_data(40)
STEPS = 3
_args = partial(replayable_args, max_steps=STEPS, logging_steps=1)


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


def _reference_steps(opt: optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """The parameters after each step of the run of :func:`_args` composed by hand from the core."""
    return reference_run(opt, data=DATA, steps=STEPS).steps


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
    _assert_equal_steps(custom, _reference_steps(optim.lion(by_hand, BETAS, DECAY)))


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
    _assert_equal_steps(_trainer_steps(args), _reference_steps(expected))


def test_factory_of_a_schedule_free_optimizer_publishes_its_average(tmp_path):
    factory = (lambda lr, **kw: optim.schedule_free(optim.momentum(lr, **kw)), {"momentum": 0.5})
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DATA, optimizer_cls_and_kwargs=factory)
    trainer.train()
    assert trainer.optimizer.name == "schedule_free_momentum"
    expected = optim.schedule_free(optim.momentum(schedules.constant(LR), 0.5))
    steps, x = reference_run(expected, data=DATA, steps=STEPS)
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
