"""A mechanism and an engine defined here, outside the package, run through ``dp_step`` and ``clipped_grad`` as they
are: the privatizer contract (:mod:`opake_core.noise`) and the engine seam (:mod:`opake_core.clipping.engine`) are
all a new one has to meet."""

from __future__ import annotations

import math

import optree
import optree.dataclasses
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from opake_core import optim, random
from opake_core.clipping import VMAP, Engine, MaterializedGradients, clipped_grad
from opake_core.errors import InputTypeError
from opake_core.step import dp_step
from opake_core.tree import Clipped, Noised
from opake_torch.functional import functional_model

# --- a toy mechanism: Gaussian noise of twice the std -----------------------------------------------------------------


@optree.dataclasses.dataclass(frozen=True, namespace="opake")
class DoubledState:
    key: random.Key = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False, default=0)


def doubled_gaussian(*, noise_multiplier: float, key: random.Key):
    """``N(0, (2 z Delta)^2)`` on every coordinate, drawn from ``fold_in(key, "test.doubled", t)``."""

    def noise_fn(clipped, state):
        if isinstance(clipped, Noised) or not isinstance(clipped, Clipped):
            raise InputTypeError(f"doubled_gaussian expects a Clipped tree, got {type(clipped).__name__}.")
        std = 2 * noise_multiplier * clipped.sensitivity
        leaves, treedef = optree.tree_flatten(clipped.value)
        draws = random.normal_tree(random.fold_in(state.key, "test.doubled", state.step), leaves, dtype=leaves[0].dtype)
        noised = [leaf + std * draw for leaf, draw in zip(leaves, draws, strict=True)]
        return Noised(optree.tree_unflatten(treedef, noised), clipped.sensitivity, std), DoubledState(
            state.key, state.step + 1
        )

    return noise_fn, DoubledState(key)


N = 200_000


def test_a_mechanism_from_outside_runs_through_dp_step():
    """A zero gradient, so an SGD step with learning rate 1 releases minus the noise. The draws must be N(0, s^2) with
    ``s`` the std the mechanism reports (twice the Gaussian mechanism's): a KS test at level 0.01 (false alarm 1%;
    the key is fixed, so the outcome is deterministic) and the RMS within 6 standard errors of ``s`` (false alarm
    below 2e-9). The same checks reject the Gaussian mechanism's std ``s / 2``."""
    params = {"w": torch.zeros(N, dtype=torch.float64)}
    batch = (torch.zeros(5, N, dtype=torch.float64),)
    opt = optim.sgd(1.0)
    step_fn, dp_state = dp_step(
        lambda p, x: (p["w"] * x).sum(),
        clipping=1.0,
        noise=doubled_gaussian(noise_multiplier=1.5, key=random.key(3)),
        optimizer=opt,
        expected_batch_size=4.0,
    )
    new, _, state, metrics = step_fn(params, opt.init(params), dp_state, batch)
    std = 2 * 1.5 * 1.0 / 4.0
    assert metrics.noise_std == std and state.noise.step == 1 and isinstance(state.noise, DoubledState)
    draws = (params["w"] - new["w"]).numpy()
    assert stats.kstest(draws / std, "norm").pvalue > 0.01
    band = 6 / math.sqrt(2 * N)  # the RMS estimator's relative standard error is 1 / sqrt(2N)
    assert abs(math.sqrt((draws**2).mean()) / std - 1) < band
    assert stats.kstest(draws / (std / 2), "norm").pvalue < 0.01
    assert abs(math.sqrt((draws**2).mean()) / (std / 2) - 1) > band
    again, *_ = step_fn(params, opt.init(params), dp_state, batch)  # the key lives in the state: the step replays
    assert torch.equal(again["w"], new["w"])


# --- a toy engine: per-example gradients from a Python loop -----------------------------------------------------------


def loop_gradients(example_grad, args, batch_argnums):
    """``example_grad`` (``torch.func.grad`` of one example's loss) called once per example, stacked."""
    m = optree.tree_leaves(args[batch_argnums[0]])[0].shape[0]
    rows = []
    for i in range(m):
        example = [optree.tree_map(lambda x, i=i: x[i], a) if j in batch_argnums else a for j, a in enumerate(args)]
        rows.append(example_grad(*example))
    leaves = [torch.stack(per_leaf) for per_leaf in zip(*(optree.tree_leaves(g) for g, _ in rows), strict=True)]
    return MaterializedGradients(leaves), torch.stack([value for _, value in rows])


def _mlp_case():
    torch.manual_seed(0)
    apply, params, frozen = functional_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double())

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(7, 5, generator=gen, dtype=torch.float64) * 3, torch.randint(0, 3, (7,), generator=gen))
    return params, loss, batch


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_an_engine_from_outside_equals_the_vmap_engine_in_float64(microbatch_size):
    params, loss, batch = _mlp_case()
    results = []
    for engine in (VMAP, Engine(gradients=loop_gradients)):
        grad_fn, state = clipped_grad(
            loss,
            clipping_norm=2.5,
            batch_argnums=(1, 2),
            normalize_by=4.0,
            microbatch_size=microbatch_size,
            return_diagnostics=True,
            engine=engine,
        )
        results.append(grad_fn(params, *batch, state=state)[0])
    (vmapped, vmap_diag), (looped, loop_diag) = results
    assert 0 < vmap_diag.clip_rate.item() < 1  # the bound is active for part of the batch
    assert looped.sensitivity == vmapped.sensitivity
    for k in params:
        torch.testing.assert_close(looped.value[k], vmapped.value[k], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loop_diag.norms, vmap_diag.norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(loop_diag.losses, vmap_diag.losses, rtol=1e-12, atol=0)


def test_the_toy_engine_and_mechanism_compose_in_dp_step():
    params, loss, batch = _mlp_case()
    opt = optim.sgd(0.1)
    steps = []
    for engine in (VMAP, Engine(gradients=loop_gradients)):
        step_fn, dp_state = dp_step(
            loss,
            clipping=2.5,
            noise=doubled_gaussian(noise_multiplier=1.0, key=random.key(5)),
            optimizer=opt,
            expected_batch_size=4.0,
            microbatch_size=2,
            engine=engine,
        )
        steps.append(step_fn(params, opt.init(params), dp_state, batch)[0])
    for k in params:
        torch.testing.assert_close(steps[1][k], steps[0][k], rtol=1e-12, atol=1e-15)
