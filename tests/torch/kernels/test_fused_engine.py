"""The fused engine: clipped_grad with the kernels' FusedGradients equals the generic engine."""

from __future__ import annotations

import math

import pytest
import torch

from opake_core.clipping import Engine, MaterializedGradients, VmapGradients, clipped_grad
from opake_core.tree import per_group
from opake_torch.patches.kernels import FusedGradients


def _loss(p, x):
    return (p["a"] * x[:3]).sum() + (p["b"] * x[3:]).sum() ** 2


def _run(device, form, bound):
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.ones(3, device=device), "b": torch.ones(4, device=device)}
    x = (torch.randn(9, 7, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(device)
    x[4, 0] = math.nan
    if bound == "groups":
        bound = per_group(params, {"a": 0.5}, fallback=2.0)
    engine = Engine(gradients=VmapGradients(form))
    grad_fn, state = clipped_grad(
        _loss, clipping_norm=bound, normalize_by=5.0, microbatch_size=4, return_diagnostics=True, engine=engine
    )
    (clipped, diag), _ = grad_fn(params, x, state=state)
    return clipped, diag


@pytest.mark.parametrize("bound", [1.0, "groups"])
def test_fused_engine_equals_generic_engine_on_cpu(bound):
    generic, generic_diag = _run("cpu", MaterializedGradients, bound)
    fused, fused_diag = _run("cpu", FusedGradients, bound)
    for k in generic.value:
        assert torch.equal(generic.value[k], fused.value[k]), k
    assert generic.sensitivity == fused.sensitivity
    assert torch.equal(generic_diag.clip_rate, fused_diag.clip_rate)


@pytest.mark.cuda
@pytest.mark.parametrize("bound", [1.0, "groups"])
def test_fused_engine_matches_generic_engine_on_cuda(bound):
    generic, _ = _run("cuda", MaterializedGradients, bound)
    fused, _ = _run("cuda", FusedGradients, bound)
    for k in generic.value:
        torch.testing.assert_close(fused.value[k], generic.value[k], rtol=1e-6, atol=1e-9)
