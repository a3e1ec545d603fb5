"""Examples with a non-finite gradient: dropped from the clipped sum and counted, per example, in the step's metrics.

The reference is independent of the clipping code: a float64 loop over the examples that clips each finite gradient
(computed with ``torch.autograd.grad`` one example at a time) and skips the others, and a count of the examples the
test itself made non-finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from opake_core import optim, random
from opake_core.clipping import auto_clipped_fun, clipped_fun, clipped_grad
from opake_core.step import dp_sgd

D = 4


def _loss(params, x, y, poison):
    """A finite squared error; where ``poison`` is 1 its gradient is NaN although the loss stays finite: ``sqrt``
    at 0 has an infinite derivative, and ``s - s`` sends it back as ``inf - inf``."""
    s = (params["w"] * x).sum() + params["b"]
    at_zero = torch.where(poison > 0, s - s, 1.0 + 0.0 * s)
    return 0.5 * (s - y) ** 2 + torch.sqrt(at_zero) - 1.0


def _data(n, poisoned, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, D, generator=gen), torch.randn(n, generator=gen)
    poison = torch.zeros(n)
    poison[list(poisoned)] = 1.0
    return x, y, poison


def _params():
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(D, generator=gen), "b": torch.randn((), generator=gen)}


def _reference(params, x, y, poison, clipping_norm, n):
    """float64: each example's gradient by autograd, clipped to ``clipping_norm`` where finite, skipped where not;
    the sum divided by ``n``. Returns ``(sum, number skipped, losses)``."""
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    skipped, losses = 0, []
    for i in range(len(x)):
        p = {k: v.detach().double().requires_grad_() for k, v in params.items()}
        loss = _loss(p, x[i].double(), y[i].double(), poison[i].double())
        grads = torch.autograd.grad(loss, list(p.values()))
        losses.append(loss.item())
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        if not math.isfinite(norm):
            skipped += 1
            continue
        scale = min(1.0, clipping_norm / norm)
        for k, g in zip(p, grads, strict=True):
            total[k] += scale * g
    return {k: v / n for k, v in total.items()}, skipped, losses


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_the_clipped_sum_drops_and_counts_the_non_finite_examples(microbatch_size):
    params, poisoned = _params(), (1, 4, 5)
    x, y, poison = _data(9, poisoned)
    reference, skipped, losses = _reference(params, x, y, poison, 0.5, 8.0)
    assert skipped == len(poisoned) and all(math.isfinite(v) for v in losses)  # the losses are finite, the grads not
    grad_fn, state = clipped_grad(
        _loss,
        clipping_norm=0.5,
        normalize_by=8.0,
        batch_argnums=(1, 2, 3),
        microbatch_size=microbatch_size,
        return_diagnostics=True,
    )
    (clipped, diagnostics), _ = grad_fn(params, x, y, poison, state=state)
    assert diagnostics.nonfinite.dtype == torch.int64 and diagnostics.nonfinite.dim() == 0
    assert int(diagnostics.nonfinite) == skipped
    assert (~torch.isfinite(diagnostics.norms)).nonzero().flatten().tolist() == list(poisoned)
    for k in params:
        assert torch.allclose(clipped.value[k].double(), reference[k], rtol=1e-5, atol=1e-7), k


@pytest.mark.parametrize("poisoned", [(), (0,), (2, 3, 6), tuple(range(7))])
def test_dp_sgd_reports_the_count_in_its_metrics(poisoned):
    """Non-private (z = 0) so that the update is the clipped sum itself: the released update equals the reference's
    and ``metrics.nonfinite`` is the number of poisoned examples, a tensor (the step reads nothing back)."""
    params = _params()
    x, y, poison = _data(7, poisoned, seed=3)
    reference, skipped, _ = _reference(params, x, y, poison, 1.0, 4.0)
    step_fn, dp_state = dp_sgd(
        _loss,
        clipping_norm=1.0,
        noise_multiplier=0.0,
        key=random.key(0),
        optimizer=optim.sgd(1.0),
        expected_batch_size=4.0,
    )
    new, _, _, metrics = step_fn(params, optim.sgd(1.0).init(params), dp_state, (x, y, poison))
    assert isinstance(metrics.nonfinite, torch.Tensor) and int(metrics.nonfinite) == skipped == len(poisoned)
    assert metrics.batch_size == 7
    for k in params:
        assert torch.allclose((params[k] - new[k]).double(), reference[k], rtol=1e-5, atol=1e-7), k
        assert torch.isfinite(new[k]).all()


def test_an_empty_batch_counts_nothing():
    params = _params()
    x, y, poison = _data(0, ())
    step_fn, dp_state = dp_sgd(
        _loss,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        key=random.key(0),
        optimizer=optim.sgd(0.1),
        expected_batch_size=4.0,
    )
    *_, metrics = step_fn(params, optim.sgd(0.1).init(params), dp_state, (x, y, poison))
    assert int(metrics.nonfinite) == 0 and metrics.nonfinite.dtype == torch.int64


def test_an_infinite_input_is_counted_as_well():
    params = _params()
    x, y, poison = _data(5, ())
    x[3, 0] = math.inf  # loss and gradient infinite / NaN
    grad_fn, state = clipped_grad(_loss, clipping_norm=1.0, batch_argnums=(1, 2, 3), return_diagnostics=True)
    (_, diagnostics), _ = grad_fn(params, x, y, poison, state=state)
    assert int(diagnostics.nonfinite) == 1


def test_a_huge_finite_gradient_is_clipped_not_counted():
    """A float32 gradient whose float64 norm exceeds float32's range is finite: it is clipped to the bound and adds
    to the sum, so it is not counted (its reported norm saturates at float32's largest value instead of inf)."""
    params = {"w": torch.zeros(D), "b": torch.zeros(())}
    big = torch.finfo(torch.float32).max / 2
    x = torch.full((2, D), big)
    x[0] = 1.0

    def linear(p, xi):  # gradient = xi: finite float32 entries of 1.7e38, norm 3.4e38 * sqrt(D) / 2 > float32 max
        return (p["w"] * xi).sum() + p["b"]

    grad_fn, state = clipped_grad(linear, clipping_norm=1.0, return_diagnostics=True)
    (clipped, diagnostics), _ = grad_fn(params, x, state=state)
    assert int(diagnostics.nonfinite) == 0 and torch.isfinite(diagnostics.norms).all()
    expected = 1.0 / math.sqrt(D + 1) + 1.0 / math.sqrt(D)  # example 0 (norm sqrt(5)), example 1 along (1,1,1,1)
    assert clipped.value["w"][0].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("builder", [clipped_fun, auto_clipped_fun])
def test_clipped_fun_counts_non_finite_outputs(builder):
    x = torch.randn(6, D)
    x[[0, 5], 1] = math.nan
    kwargs = {"clipping_norm": 1.0} if builder is clipped_fun else {"bound": 1.0}
    fn, state = builder(lambda xi: xi * 2.0, return_diagnostics=True, **kwargs)
    (out, diagnostics), _ = fn(x, state=state)
    assert int(diagnostics.nonfinite) == 2
    assert torch.isfinite(out.value).all()
