"""clipped_grad with an engine transform: the same clipped sum through a wrapped chunk function, with padded chunks."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core.clipping import Engine, adaptive, auto_s, clipped_grad
from opake_core.tree import per_group
from tests.core.test_clipping import MODELS, _data, _loss, _median_norm, _reference, _rel_err, _split


class Recorder:
    """A chunk transform that runs the chunk as it is and records the shapes and values each call received."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, fn):
        def run(rule, bounds, live, *args):
            self.calls.append({
                "rule": rule,
                "bounds": bounds.clone(),
                "live": None if live is None else live.clone(),
                "rows": {a.shape[0] for a in args if isinstance(a, torch.Tensor)},
            })  # fmt: skip
            hash(rule)  # a capture keys on it
            return fn(rule, bounds, live, *args)

        return run


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_chunk_through_the_transform_is_bitwise_the_plain_path(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _data(name, 8, torch.Generator().manual_seed(1))
    params, frozen = _split(model)
    bound = _median_norm(model, params, frozen, x, y)
    plain_fn, state = clipped_grad(_loss(model), clipping_norm=bound, batch_argnums=(2, 3), return_diagnostics=True)
    recorder = Recorder()
    wrapped_fn, _ = clipped_grad(
        _loss(model),
        clipping_norm=bound,
        batch_argnums=(2, 3),
        return_diagnostics=True,
        engine=Engine(transform=recorder),
    )
    (plain, plain_diag), _ = plain_fn(params, frozen, x, y, state=state)
    (ours, diag), _ = wrapped_fn(params, frozen, x, y, state=state)
    assert len(recorder.calls) == 1 and recorder.calls[0]["live"] is None  # no microbatch_size: nothing padded
    assert all(torch.equal(ours.value[k], plain.value[k]) for k in params)
    assert torch.equal(diag.norms, plain_diag.norms) and torch.equal(diag.losses, plain_diag.losses)
    assert ours.sensitivity == plain.sensitivity


@pytest.mark.parametrize("name", ["mlp", "attention", "tied"])
def test_padded_chunks_have_one_shape_and_add_nothing(name):
    """Batch 7 in chunks of 3: the last chunk is padded to 3 rows; the sum equals the float64 loop over the 7."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _data(name, 7, torch.Generator().manual_seed(3))
    params, frozen = _split(model)
    bound = _median_norm(model, params, frozen, x, y)
    recorder = Recorder()
    grad_fn, state = clipped_grad(
        _loss(model),
        clipping_norm=bound,
        batch_argnums=(2, 3),
        normalize_by=5.0,
        microbatch_size=3,
        return_diagnostics=True,
        engine=Engine(transform=recorder),
    )
    (clipped, diag), _ = grad_fn(params, frozen, x, y, state=state)
    assert [call["rows"] for call in recorder.calls] == [{3}, {3}, {3}]
    assert [call["live"].tolist() for call in recorder.calls] == [[True] * 3, [True] * 3, [True, False, False]]
    assert diag.norms.shape == (7,) and diag.losses.shape == (7,) and diag.batch_size == 7
    assert torch.isfinite(diag.norms).all()
    assert _rel_err(clipped.value, _reference(model, x, y, bound, 5.0)) < 1e-6
    plain_fn, _ = clipped_grad(
        _loss(model), clipping_norm=bound, batch_argnums=(2, 3), normalize_by=5.0, microbatch_size=3
    )
    plain = plain_fn(params, frozen, x, y, state=state)[0]  # float32 rounding differs with the chunk's row count
    assert _rel_err(clipped.value, {k: v.double() for k, v in plain.value.items()}) < 1e-6


def test_padding_copies_a_non_finite_last_example_without_adding_it():
    """The dead copies of a last example with a NaN gradient add nothing, as the example itself."""

    def loss(p, x):
        return (p["w"] * x).sum()

    params = {"w": torch.ones(3)}
    x = torch.tensor([[0.0, 3.0, 4.0], [1.0, 0.0, 0.0], [math.nan, 1.0, 1.0]])
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, microbatch_size=2, engine=Engine(transform=Recorder()))
    clipped, _ = grad_fn(params, x, state=state)
    torch.testing.assert_close(clipped.value["w"], torch.tensor([1.0, 0.6, 0.8]), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "rule",
    [lambda p: auto_s(0.5), lambda p: per_group(p, {"^fc1": 0.2}, fallback=0.4)],
    ids=["auto_s", "per_group"],
)
def test_the_other_rules_through_the_transform(rule):
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    x, y = _data("mlp", 5, torch.Generator().manual_seed(4))
    params, frozen = _split(model)
    results = []
    for transform in (None, Recorder()):
        grad_fn, state = clipped_grad(
            _loss(model),
            clipping_norm=rule(params),
            batch_argnums=(2, 3),
            microbatch_size=2,
            engine=Engine(transform=transform),
        )
        results.append(grad_fn(params, frozen, x, y, state=state)[0])
    assert _rel_err(results[1].value, {k: v.double() for k, v in results[0].value.items()}) < 1e-6
    assert results[0].sensitivity == results[1].sensitivity


def test_adaptive_bound_reaches_the_chunk_as_a_tensor():
    """Adaptive clipping moves the bound each call; a transform sees it in the bounds tensor, never in the (hashed)
    rule, so one capture serves every step, and the trajectory equals the plain path's."""
    from opake_core import random

    torch.manual_seed(0)
    model = MODELS["mlp"]()
    x, y = _data("mlp", 6, torch.Generator().manual_seed(5))
    params, frozen = _split(model)
    recorder = Recorder()
    runs = []
    for transform in (None, recorder):
        grad_fn, state = clipped_grad(
            _loss(model),
            clipping_norm=adaptive(1.0, learning_rate=1.0),
            batch_argnums=(2, 3),
            microbatch_size=4,
            key=random.key(7),
            engine=Engine(transform=transform),
        )
        bounds, values = [], []
        for _ in range(3):
            out, state = grad_fn(params, frozen, x, y, state=state)
            bounds.append(state.clipping_norm)
            values.append(out.value)
        runs.append((bounds, values))
    assert runs[0][0] == runs[1][0] and len(set(runs[0][0])) == 3  # the same moving bound
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert _rel_err(b, {k: v.double() for k, v in a.items()}) < 1e-6
    assert len({call["rule"] for call in recorder.calls}) == 1
    seen = [call["bounds"].item() for call in recorder.calls[::2]]
    assert seen == [1.0, *runs[0][0][:2]]
