"""``Optimizer.needs_whole_leaves`` tells what the optimizer does: it is True exactly when running the optimizer on a
weight split into blocks of rows (a rank's shard under FSDP) gives another update than running it on the whole weight.

The oracle is that split run itself, for every optimizer of the package (and Schedule-Free around each), not the
optimizer's name."""

from __future__ import annotations

import pytest
import torch

from opake_core import optim
from opake_core.tree import Noised

FACTORIES = {
    "sgd": lambda **kw: optim.sgd(0.1, weight_decay=0.01, **kw),
    "momentum": lambda **kw: optim.momentum(0.1, 0.9, **kw),
    "adam": lambda **kw: optim.adam(0.1, **kw),
    "adamw": lambda **kw: optim.adamw(0.1, **kw),
    "adamw_bc": lambda **kw: optim.adamw(0.1, noise_bias_correction=True, **kw),
    "adamw_update_rms_clip": lambda **kw: optim.adamw(0.1, update_rms_clip=1.0, **kw),
    "stable_adamw": lambda **kw: optim.stable_adamw(0.1, **kw),
    "stable_adamw_bc": lambda **kw: optim.stable_adamw(0.1, noise_bias_correction=True, **kw),
    "adafactor": lambda **kw: optim.adafactor(0.1, **kw),
    "adafactor_bc": lambda **kw: optim.adafactor(0.1, noise_bias_correction=True, **kw),
    "lion": lambda **kw: optim.lion(0.1, **kw),
    "ademamix": lambda **kw: optim.ademamix(0.1, **kw),
    "rmsprop": lambda **kw: optim.rmsprop(0.1, centered=True, momentum=0.5, **kw),
    "adagrad": lambda **kw: optim.adagrad(0.1, noise_bias_correction=True, **kw),
    "radam": lambda **kw: optim.radam(0.1, **kw),
    "adadelta": lambda **kw: optim.adadelta(1.0, **kw),
    "schedule_free_adamw": lambda **kw: optim.schedule_free_adamw(0.1, **kw),
}
WHOLE = {"adamw_update_rms_clip", "stable_adamw", "stable_adamw_bc", "adafactor", "adafactor_bc"}


def _wrapped(name):
    return lambda **kw: optim.schedule_free(FACTORIES[name](**kw), beta=0.5)


CASES = {**FACTORIES, **{f"schedule_free({n})": _wrapped(n) for n in FACTORIES if n != "schedule_free_adamw"}}


def _run(opt: optim.Optimizer, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> dict:
    """The parameters after one update per gradient tree, each a Noised tree of noise std 0.5."""
    state = opt.init(params)
    for grad in grads:
        updates, state = opt.update(Noised(grad, 1.0, noise_std=0.5), state, params=params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", CASES)
def test_needs_whole_leaves_is_true_exactly_when_a_row_split_changes_the_update(name):
    make = CASES[name]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    grads = [torch.randn(6, 5, generator=generator, dtype=torch.float64) * scale for scale in (1.0, 30.0, 0.1)]
    whole = _run(make(), {"w": weight}, [{"w": g} for g in grads])["w"]
    rows = _run(make(), {"a": weight[:2], "b": weight[2:]}, [{"a": g[:2], "b": g[2:]} for g in grads])
    split = torch.cat([rows["a"], rows["b"]])
    assert not torch.equal(whole, weight)  # the updates moved the weight
    differs = not torch.allclose(split, whole, rtol=1e-12, atol=1e-14)
    assert make().needs_whole_leaves == differs == (name.removeprefix("schedule_free(").rstrip(")") in WHOLE)
