"""The DP refusal rule, purity (no mutation, resumable states) and profiler labels, for every optimizer."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from opake_core import optim
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import Clipped, Noised, PerGroup

FACTORIES = {
    "sgd": lambda **kw: optim.sgd(0.1, weight_decay=0.01, **kw),
    "momentum": lambda **kw: optim.momentum(0.1, nesterov=True, **kw),
    "adam": lambda **kw: optim.adam(**kw),
    "adamw": lambda **kw: optim.adamw(**kw),
    "adam_bc": lambda **kw: optim.adam(noise_bias_correction=True, **kw),
    "adamw_bc": lambda **kw: optim.adamw(noise_bias_correction=True, **kw),
    "adafactor": lambda **kw: optim.adafactor(weight_decay=0.01, **kw),
    "lion": lambda **kw: optim.lion(1e-3, weight_decay=0.1, **kw),
    "ademamix": lambda **kw: optim.ademamix(weight_decay=0.01, t_alpha=5, t_beta3=5, **kw),
    "rmsprop": lambda **kw: optim.rmsprop(weight_decay=0.01, momentum=0.9, centered=True, **kw),
    "adagrad": lambda **kw: optim.adagrad(lr_decay=0.1, weight_decay=0.01, **kw),
    "radam": lambda **kw: optim.radam(weight_decay=0.01, decoupled_weight_decay=True, **kw),
    "adadelta": lambda **kw: optim.adadelta(weight_decay=0.01, **kw),
    "schedule_free_adamw": lambda **kw: optim.schedule_free_adamw(weight_decay=0.01, warmup_steps=2, **kw),
}
ADDED = ("lion", "ademamix", "rmsprop", "adagrad", "radam", "adadelta", "schedule_free_adamw")


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)}


def _equal(a, b) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_accepts_noised(name: str) -> None:
    opt, params = FACTORIES[name](), _tree(0)
    updates, _ = opt.update(Noised(_tree(1), 1.0, 0.5), opt.init(params), params=params)
    assert optree.tree_structure(updates) == optree.tree_structure(params)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("non_private", [False, True])
def test_refuses_clipped_not_noised(name: str, non_private: bool) -> None:
    opt, params = FACTORIES[name](non_private=non_private), _tree(0)
    with pytest.raises(InputTypeError, match=r"clipped but not noised.*gaussian_noise.*noise_multiplier=0"):
        opt.update(Clipped(_tree(1), 1.0), opt.init(params), params=params)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_plain_tree_needs_non_private(name: str) -> None:
    params = _tree(0)
    opt = FACTORIES[name]()
    with pytest.raises(InputTypeError, match=r"plain dict, not a Noised tree.*non_private=True"):
        opt.update(_tree(1), opt.init(params), params=params)
    opt = FACTORIES[name](non_private=True)
    plain, _ = opt.update(_tree(1), opt.init(params), params=params)
    noised, _ = opt.update(Noised(_tree(1), 1.0, 0.0), opt.init(params), params=params)
    assert _equal(plain, noised)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_inputs_and_states_are_never_mutated(name: str) -> None:
    opt, params = FACTORIES[name](), _tree(0)
    state = opt.init(params)
    for step in range(3):
        grads = Noised(_tree(step + 1), 1.0, 0.5)
        before = copy.deepcopy((params, grads.value, state))
        updates, new_state = opt.update(grads, state, params=params)
        new_params = optim.apply_updates(params, updates)
        assert _equal(before, (params, grads.value, state))
        assert not _equal(new_params, params)
        params, state = new_params, new_state


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_fresh_optimizer_resumes_from_a_saved_state(name: str) -> None:
    params = _tree(0)
    opt = FACTORIES[name]()
    state = opt.init(params)
    for step in range(2):
        _, state = opt.update(Noised(_tree(step + 1), 1.0, 0.5), state, params=params)
    saved = copy.deepcopy(state)
    continued, _ = opt.update(Noised(_tree(9), 1.0, 0.5), state, params=params)
    resumed, _ = FACTORIES[name]().update(Noised(_tree(9), 1.0, 0.5), saved, params=params)
    assert _equal(continued, resumed)


@pytest.mark.parametrize("name", ["sgd", "adamw", "adafactor", *ADDED])  # each built with weight decay
def test_missing_params_is_a_configuration_error(name: str) -> None:
    opt = FACTORIES[name]()
    with pytest.raises(ConfigurationError, match="needs params"):
        opt.update(Noised(_tree(1), 1.0, 0.0), opt.init(_tree(0)))


def test_per_group_noise_must_cover_every_leaf() -> None:
    opt, params = optim.adam(noise_bias_correction=True), _tree(0)
    std = PerGroup.build({"w": "g"}, {"g": 0.5})
    with pytest.raises(InputTypeError, match=r"leaves \['b'\].*no group"):
        opt.update(Noised(_tree(1), 1.0, std), opt.init(params))


def test_apply_updates_is_out_of_place_and_refuses_gradients() -> None:
    params, updates = _tree(0), _tree(1)
    before = copy.deepcopy(params)
    new = optim.apply_updates(params, updates)
    assert _equal(params, before)
    torch.testing.assert_close(new["w"], params["w"] + updates["w"])
    with pytest.raises(InputTypeError, match="through an optimizer's update first"):
        optim.apply_updates(params, Noised(updates, 1.0, 0.1))


def test_profiler_labels() -> None:
    opt, params = optim.adamw(noise_bias_correction=True), _tree(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state = opt.init(params)
        updates, _ = opt.update(Noised(_tree(1), 1.0, 0.1), state, params=params)
        optim.apply_updates(params, updates)
    names = {e.key for e in prof.key_averages()}
    assert {"opake::optim.adamw.init", "opake::optim.adamw", "opake::optim.apply_updates"} <= names


@pytest.mark.parametrize("name", ["lion", "rmsprop", "adagrad", "radam", "adadelta", "ademamix"])
def test_without_weight_decay_params_are_optional(name: str) -> None:
    opt = getattr(optim, name)()
    with_params, _ = opt.update(Noised(_tree(1), 1.0, 0.0), opt.init(_tree(0)), params=_tree(0))
    without, _ = opt.update(Noised(_tree(1), 1.0, 0.0), opt.init(_tree(0)))
    assert _equal(with_params, without)


@pytest.mark.parametrize("name", ADDED)
def test_profiler_labels_of_each_optimizer(name: str) -> None:
    opt, params = FACTORIES[name](), _tree(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state = opt.init(params)
        _, state = opt.update(Noised(_tree(1), 1.0, 0.1), state, params=params)
        opt.eval_params(state, params)
    names = {e.key for e in prof.key_averages()}
    assert {f"opake::optim.{name}.init", f"opake::optim.{name}"} <= names
    assert (f"opake::optim.{name}.eval_params" in names) == (name == "schedule_free_adamw")
