"""clipped_fun / auto_clipped_fun against an independent float64 loop over single examples."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import random
from opake_core import testing as t
from opake_core.clipping import (
    FixedClipState,
    OutputDiagnostics,
    adaptive,
    auto_clipped_fun,
    auto_s,
    clipped_fun,
)
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import Clipped, per_group

GEN = torch.Generator().manual_seed(5)
W = torch.randn(4, 3, generator=GEN, dtype=torch.float64)


def _fun(x, scale):
    """A pytree of per-example statistics of one example ``x [4]`` (``scale`` is an unbatched argument)."""
    h = torch.tanh(x @ W) * scale
    return {"h": h, "sq": (x * x).sum(), "outer": torch.outer(h, x[:2])}


def _batch(n, seed=0, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    # examples of very different norms, so that some are clipped and some are not
    return torch.randn(n, 4, generator=gen, dtype=torch.float64) * torch.logspace(-1, math.log10(spread), n)[:, None]


def _reference(xs, scale, bounds_of, *, normalize_by, gamma=None):
    """The release computed one example at a time in float64.

    ``bounds_of(out) -> {leaf name: bound}`` gives each leaf's bound (one shared bound for a scalar rule). Fixed:
    ``scale_g = min(1, C_g / ||y_g||)`` per group; AUTO-S: ``R / (||y|| + gamma)``.
    """
    total = None
    for x in xs:
        out = _fun(x, scale)
        bounds = bounds_of(out)
        groups = {}
        for name in out:
            groups.setdefault(bounds[name], []).append(name)
        contribution = {}
        for bound, names in groups.items():
            norm = math.sqrt(sum(float((out[k] ** 2).sum()) for k in names))
            factor = bound / (norm + gamma) if gamma is not None else min(1.0, bound / norm)
            contribution.update({k: out[k] * factor for k in names})
        total = contribution if total is None else {k: total[k] + contribution[k] for k in total}
    return {k: v / normalize_by for k, v in total.items()}


def _close(a, b, rtol=1e-12):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=1e-14), (k, a[k], b[k])


@pytest.mark.parametrize("microbatch_size", [None, 1, 3, 7])
def test_fixed_bound_matches_float64_loop(microbatch_size):
    xs = _batch(9)
    fn, state = clipped_fun(_fun, clipping_norm=1.5, normalize_by=8.0, microbatch_size=microbatch_size)
    out, new_state = fn(xs, 0.7, state=state)
    assert isinstance(out, Clipped) and out.sensitivity == 1.5 / 8.0
    assert new_state is state and isinstance(state, FixedClipState)
    _close(out.value, _reference(xs, 0.7, lambda o: dict.fromkeys(o, 1.5), normalize_by=8.0))


@pytest.mark.parametrize("microbatch_size", [None, 4])
def test_auto_s_matches_float64_loop(microbatch_size):
    xs = _batch(7, seed=1)
    fn, state = auto_clipped_fun(_fun, bound=2.0, gamma=0.05, normalize_by=5.0, microbatch_size=microbatch_size)
    out, _ = fn(xs, 1.3, state=state)
    assert out.sensitivity == 2.0 / 5.0
    _close(out.value, _reference(xs, 1.3, lambda o: dict.fromkeys(o, 2.0), normalize_by=5.0, gamma=0.05))
    same, s2 = clipped_fun(_fun, clipping_norm=auto_s(2.0, gamma=0.05), normalize_by=5.0)
    _close(same(xs, 1.3, state=s2)[0].value, out.value)


def test_per_group_bounds_on_the_output_tree():
    xs = _batch(6, seed=2)
    template = _fun(xs[0], 1.0)
    bounds = per_group(template, {"^h$": 0.3, "outer": 0.8}, fallback=0.5)
    fn, state = clipped_fun(_fun, clipping_norm=bounds, normalize_by=6.0, microbatch_size=4)
    out, _ = fn(xs, 1.0, state=state)
    leaf_bound = {"h": 0.3, "outer": 0.8, "sq": 0.5}
    _close(out.value, _reference(xs, 1.0, lambda o: leaf_bound, normalize_by=6.0))
    assert out.sensitivity.value_of == {"^h$": 0.3 / 6.0, "outer": 0.8 / 6.0, "fallback": 0.5 / 6.0}


def test_chunking_does_not_change_the_release():
    xs = _batch(23, seed=3)
    results = []
    for size in (None, 1, 5, 22):
        fn, state = clipped_fun(_fun, clipping_norm=1.0, normalize_by=20.0, microbatch_size=size)
        results.append(fn(xs, 0.5, state=state)[0].value)
    for other in results[1:]:
        _close(other, results[0])


def test_empty_batch_is_refused():
    fn, state = clipped_fun(_fun, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="non-empty batch"):
        fn(torch.zeros(0, 4, dtype=torch.float64), 1.0, state=state)
    auto, auto_state = auto_clipped_fun(_fun)
    with pytest.raises(ConfigurationError, match="non-empty batch"):
        auto(torch.zeros(0, 4, dtype=torch.float64), 1.0, state=auto_state)


def test_neighbouring_batches_move_within_the_sensitivity():
    xs = _batch(8, seed=4)
    fn, state = clipped_fun(_fun, clipping_norm=0.9, normalize_by=8.0)
    t.assert_sensitivity(lambda b: fn(b[0], 1.0, state=state)[0], (xs,), key=random.key(2))
    auto, auto_state = auto_clipped_fun(_fun, bound=0.9, normalize_by=8.0)
    t.assert_sensitivity(lambda b: auto(b[0], 1.0, state=auto_state)[0], (xs,), key=random.key(3))


def test_float32_outputs_keep_the_bound_in_float32():
    big = torch.full((1, 4), 1e4, dtype=torch.float32)
    fn, state = clipped_fun(lambda x: {"a": x * 3, "b": x.sum() * x}, clipping_norm=0.25)
    out, _ = fn(big, state=state)
    assert all(v.dtype == torch.float32 for v in out.value.values())
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in out.value.values()))
    assert norm <= 0.25


def test_aux_and_diagnostics():
    xs = _batch(5, seed=6)
    fn, state = clipped_fun(
        lambda x, s: (_fun(x, s), {"n": x.norm()}),
        clipping_norm=1.0,
        normalize_by=5.0,
        has_aux=True,
        return_diagnostics=True,
        microbatch_size=2,
    )
    out, aux, diagnostics = fn(xs, 1.0, state=state)[0]
    assert isinstance(out, Clipped)
    assert torch.allclose(aux["n"], xs.norm(dim=1))
    assert isinstance(diagnostics, OutputDiagnostics) and diagnostics.batch_size == 5
    norms = torch.tensor(
        [math.sqrt(sum(float((v**2).sum()) for v in _fun(x, 1.0).values())) for x in xs], dtype=torch.float32
    )
    assert torch.allclose(diagnostics.norms, norms, rtol=1e-6)
    assert float(diagnostics.clip_rate) == pytest.approx(float((norms > 1.0).float().mean()))


def test_refusals():
    with pytest.raises(ConfigurationError, match="adaptive"):
        clipped_fun(_fun, clipping_norm=adaptive(1.0))
    with pytest.raises(ConfigurationError, match="normalize_by"):
        clipped_fun(_fun, clipping_norm=1.0, normalize_by=0.0)
    with pytest.raises(ConfigurationError, match="clipping_norm"):
        clipped_fun(_fun, clipping_norm=-1.0)
    fn, state = clipped_fun(lambda x: (x > 0).long(), clipping_norm=1.0)
    with pytest.raises(InputTypeError, match="floating-point"):
        fn(_batch(3), state=state)
    fn, state = clipped_fun(_fun, clipping_norm=1.0)
    with pytest.raises(InputTypeError, match="FixedClipState"):
        fn(_batch(3), 1.0, state=None)
    with pytest.raises(ConfigurationError, match="batch_argnums"):
        clipped_fun(_fun, clipping_norm=1.0, batch_argnums=3)[0](_batch(3), 1.0, state=state)
