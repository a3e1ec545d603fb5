"""clipped_grad with an engine transform: the same clipped sum through a wrapped chunk function, with padded chunks."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core.clipping import Engine, MaterializedGradients, adaptive, auto_s, clipped_grad
from opake_core.clipping.microbatching import chunk_sizes
from opake_core.clipping.rules import ClipRule, bounds_on
from opake_core.errors import ConfigurationError
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
    """Batch 7 in chunks of at most 3: three equal chunks (3, 2, 2 rows), each padded to 3; the sum equals the float64
    loop over the 7."""
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
    assert [call["live"].tolist() for call in recorder.calls] == [[True] * 3, [True, True, False], [True, True, False]]
    assert diag.norms.shape == (7,) and diag.losses.shape == (7,) and diag.batch_size == 7
    assert torch.isfinite(diag.norms).all()
    assert _rel_err(clipped.value, _reference(model, x, y, bound, 5.0)) < 1e-6
    plain_fn, _ = clipped_grad(
        _loss(model), clipping_norm=bound, batch_argnums=(2, 3), normalize_by=5.0, microbatch_size=3
    )
    plain = plain_fn(params, frozen, x, y, state=state)[0]  # float32 rounding differs with the chunk's row count
    assert _rel_err(clipped.value, {k: v.double() for k, v in plain.value.items()}) < 1e-6


@pytest.mark.parametrize("name", ["mlp", "tied"])
def test_bucketed_chunks_meet_few_shapes_and_equal_the_loop(name):
    """Draws of 1..16 rows in chunks of at most 8 rounded to multiples of 4 (the trainer's ``cuda_graphs=2``): the
    transform sees 4 or 8 rows only, every chunk with a live mask marking its real rows, and every sum equals the
    float64 loop over the real rows."""
    torch.manual_seed(0)
    model = MODELS[name]()
    params, frozen = _split(model)
    x_all, y_all = _data(name, 16, torch.Generator().manual_seed(5))
    bound = _median_norm(model, params, frozen, x_all, y_all)
    recorder = Recorder()
    grad_fn, state = clipped_grad(
        _loss(model),
        clipping_norm=bound,
        batch_argnums=(2, 3),
        normalize_by=8.0,
        microbatch_size=8,
        engine=Engine(transform=recorder, row_multiple=4),
    )
    for n in range(1, 17):
        recorder.calls.clear()
        clipped, _ = grad_fn(params, frozen, x_all[:n], y_all[:n], state=state)
        assert set().union(*(call["rows"] for call in recorder.calls)) <= {4, 8}
        reals = [real for real, _ in chunk_sizes(n, 8, row_multiple=4)]
        assert [int(call["live"].sum()) for call in recorder.calls] == reals
        assert _rel_err(clipped.value, _reference(model, x_all[:n], y_all[:n], bound, 8.0)) < 1e-6


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


# --- Poisson batches of varying size: equal chunks, rounded up to a few shapes ---------------------------------------


@pytest.mark.parametrize("microbatch", [1, 3, 16])
@pytest.mark.parametrize("multiple", [1, 2, 4, 5])
def test_chunk_sizes_split_evenly_within_the_bound(microbatch, multiple):
    for n in range(0, 4 * microbatch + 3):
        sizes = chunk_sizes(n, microbatch, row_multiple=multiple)
        reals = [real for real, _ in sizes]
        assert sum(reals) == n and len(sizes) == -(-n // microbatch)  # every row once, in the fewest chunks
        assert not reals or max(reals) - min(reals) <= 1  # as equal as possible
        for real, rows in sizes:
            assert real <= rows <= microbatch  # never above the memory bound
            assert rows == microbatch or rows % multiple == 0  # a multiple, or the bound itself
            assert rows - real < multiple  # the fewest dead rows that reach a multiple
        padded = chunk_sizes(n, microbatch, row_multiple=microbatch)  # one shape: the bound
        assert [real for real, _ in padded] == reals and all(rows == microbatch for _, rows in padded)
    assert chunk_sizes(9, None) == [(9, 9)] and chunk_sizes(0, 4) == []


@pytest.mark.parametrize("microbatch", [1, 2, 3, 16])
@pytest.mark.parametrize("multiple", [1, 4])
def test_chunk_sizes_run_at_least_min_rows(microbatch, multiple):
    """min_rows pads a small chunk with dead rows up to it (never above the microbatch) and changes nothing else."""
    for n in range(0, 3 * microbatch + 3):
        plain = chunk_sizes(n, microbatch, row_multiple=multiple)
        sizes = chunk_sizes(n, microbatch, row_multiple=multiple, min_rows=2)
        assert [real for real, _ in sizes] == [real for real, _ in plain]
        assert [rows for _, rows in sizes] == [max(rows, min(2, microbatch)) for _, rows in plain]
    assert chunk_sizes(1, 8, min_rows=2) == [(1, 2)] and chunk_sizes(1, 1, min_rows=2) == [(1, 1)]
    with pytest.raises(ConfigurationError, match="min_rows must be an int >= 1"):
        Engine(min_rows=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dead_rows_add_exactly_nothing_whatever_they_hold(dtype):
    """The clipped sum, norms and flags of a chunk do not depend, bit for bit, on what its dead rows hold: zeros,
    NaN, infinities, huge values, or copies of the last example."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (300,), (4, 3, 2)]
    m, dead = 5, 3
    real = [(torch.randn(m, *shape, generator=gen) * 3).to(dtype) for shape in shapes]
    params = [torch.zeros(shape, dtype=dtype) for shape in shapes]
    rule, bounds = ClipRule((0, 1, 0), 2), bounds_on((1.0, 2.0), torch.device("cpu"))
    live = torch.arange(m + dead) < m
    results = []
    for fill in (0.0, math.nan, math.inf, -1e30, "copy"):
        tails = [
            g[-1:].expand(dead, *g.shape[1:]) if fill == "copy" else torch.full((dead, *g.shape[1:]), fill, dtype=dtype)
            for g in real
        ]
        grads = [torch.cat([g, tail]) for g, tail in zip(real, tails, strict=True)]
        sums, norms, clipped = rule(MaterializedGradients(grads), params, bounds, live)
        results.append((sums, norms[:m], clipped[:m]))
    for sums, norms, clipped in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(sums, results[0][0], strict=True))
        assert torch.equal(norms, results[0][1]) and torch.equal(clipped, results[0][2])
    assert torch.isfinite(results[0][1]).all()


@pytest.mark.parametrize("name", ["mlp", "attention", "tied"])
def test_padded_equal_and_unchunked_sums_agree_with_the_float64_loop(name):
    """A draw of 11 with chunks of at most 4: unchunked, equal chunks (4, 4, 3), and equal chunks rounded up to
    multiples of 4 with dead rows. In float64 the three agree to 1e-12 (summation order only) and each equals the
    float64 loop over the 11 examples; the padded run's diagnostics cover the 11 real rows only."""
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x, y = _data(name, 11, torch.Generator().manual_seed(5))
    x = x.double() if x.is_floating_point() else x
    params, frozen = _split(model)
    bound = _median_norm(model, params, frozen, x, y)
    reference = _reference(model, x, y, bound, 9.0)
    runs = {}
    for label, microbatch, engine in (
        ("unchunked", None, Engine()),
        ("equal", 4, Engine()),
        ("padded", 4, Engine(row_multiple=4)),
    ):
        grad_fn, state = clipped_grad(
            _loss(model),
            clipping_norm=bound,
            batch_argnums=(2, 3),
            normalize_by=9.0,
            microbatch_size=microbatch,
            return_diagnostics=True,
            engine=engine,
        )
        runs[label] = grad_fn(params, frozen, x, y, state=state)[0]
    for label, (clipped, diag) in runs.items():
        assert _rel_err(clipped.value, reference) < 1e-12, label
        assert diag.norms.shape == (11,) and diag.losses.shape == (11,) and diag.batch_size == 11
        torch.testing.assert_close(diag.norms, runs["unchunked"][1].norms, rtol=1e-6, atol=0)
    assert 0 < runs["padded"][1].clip_rate.item() < 1
