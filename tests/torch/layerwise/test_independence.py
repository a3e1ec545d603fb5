"""The layerwise engine called directly (an ``Engine`` of ``clipped_grad``, no trainer): it refuses a model whose
examples interact in the batch and an input changed in place after its layer ran, and an in-place operation on a
layer's output gives the float64 loop's norms and clipped sum."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients

M = 6


class Two(nn.Module):
    """Two linear layers; ``mix`` is applied to the first one's output ``[m, T, 8]``."""

    def __init__(self, mix) -> None:
        super().__init__()
        self.a, self.b, self.mix = nn.Linear(4, 8), nn.Linear(8, 3), mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.mix(self, self.a(x)))).mean(dim=1)


def _case(mix, seed=0):
    torch.manual_seed(seed)
    model = Two(mix).double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(M, 5, 4, dtype=torch.float64), torch.randint(0, 3, (M,))

    def loss(p, xi, yi):
        return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    return model, params, loss, batch_loss, (x, y)


def _clipped(model, params, loss, batch_loss, batch, bound, microbatch=None):
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=bound,
        batch_argnums=(1, 2),
        microbatch_size=microbatch,
        return_diagnostics=True,
        engine=Engine(gradients=LayerwiseGradients(model, batch_loss)),
    )
    (clipped, diagnostics), _ = grad_fn(params, *batch, state=state)
    return clipped, diagnostics


def _loop(loss, params, batch, bound):
    """Norms and ``sum_i g_i min(1, C / ||g_i||)``, one example at a time in float64."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(batch[0].shape[0]):
        g = torch.func.grad(loss)(params, *(b[i] for b in batch))
        norms.append(math.sqrt(sum(float(v.square().sum()) for v in g.values())))
        for k in total:
            total[k] += g[k] * min(1.0, bound / norms[-1])
    return torch.tensor(norms, dtype=torch.float64), total


COUPLINGS = {
    "batch_mean": lambda module, h: h - h.mean(dim=0),  # the case: norms wrong by about 100%
    "batch_norm_like": lambda module, h: (h - h.mean(dim=(0, 1))) / h.std(dim=(0, 1)),
    "similarity": lambda module, h: h + 0.1 * torch.einsum("itd,jsd->itd", h, h),  # each row reads every other
    "running_sum": lambda module, h: h.cumsum(dim=0),  # row i reads the rows before it only
}


@pytest.mark.parametrize("coupling", sorted(COUPLINGS))
@pytest.mark.parametrize("microbatch", [None, 4])
def test_examples_that_interact_are_refused_through_the_direct_api(coupling, microbatch):
    model, params, loss, batch_loss, batch = _case(COUPLINGS[coupling])
    with pytest.raises(ConfigurationError, match="interact"):
        _clipped(model, params, loss, batch_loss, batch, 0.5, microbatch)


def test_a_coupling_in_training_mode_only_is_checked_when_the_mode_changes():
    """Checked once per training mode: a first call in eval mode passes and equals the loop; the same engine in
    training mode, where the model mixes the batch, refuses."""
    model, params, loss, batch_loss, batch = _case(lambda module, h: h - h.mean(dim=0) if module.training else h)
    engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=engine)
    model.eval()
    clipped, _ = grad_fn(params, *batch, state=state)
    _, expected = _loop(loss, params, batch, 0.5)
    for k in params:
        torch.testing.assert_close(clipped.value[k], expected[k], rtol=1e-9, atol=1e-12)
    model.train()
    with pytest.raises(ConfigurationError, match="interact"):
        grad_fn(params, *batch, state=state)


INPLACE = {
    "relu_on_tapped_output": lambda module, h: F.relu(h, inplace=True),  # the first layer's output: tapped
    "scale_on_tapped_output": lambda module, h: h.mul_(2.0).add_(0.5),
}


@pytest.mark.parametrize("inplace", sorted(INPLACE))
@pytest.mark.parametrize("bound", [math.inf, 0.05])
def test_an_in_place_operation_on_a_layer_output_gives_the_float64_loop(inplace, bound):
    model, params, loss, batch_loss, batch = _case(INPLACE[inplace])
    clipped, diagnostics = _clipped(model, params, loss, batch_loss, batch, bound)
    norms, expected = _loop(loss, params, batch, bound)
    torch.testing.assert_close(diagnostics.norms.double(), norms.float().double(), rtol=1e-6, atol=0)
    for k in params:
        torch.testing.assert_close(clipped.value[k], expected[k], rtol=1e-9, atol=1e-12)


class OutputInPlace(nn.Module):
    """An in-place operation on the output of the second layer, which needs a gradient (a tensor hook, no tap)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))).mul_(3.0))).mean(dim=1)


class InputInPlace(nn.Module):
    """``b``'s input changed in place after ``b`` ran: ``b``'s weight gradient reads the values it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + 1.0
        y = self.b(h)
        h.mul_(2.0)
        return (y + h[..., :3]).mean(dim=1)


def _module_case(cls):
    torch.manual_seed(0)
    model = cls().double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(M, 5, 4, dtype=torch.float64), torch.randint(0, 3, (M,))
    return (
        model,
        params,
        lambda p, xi, yi: F.cross_entropy(apply(p, frozen, xi[None]), yi[None]),
        lambda p, xb, yb: F.cross_entropy(apply(p, frozen, xb), yb, reduction="none"),
        (x, y),
    )


def test_an_in_place_operation_on_a_hooked_output_gives_the_float64_loop():
    model, params, loss, batch_loss, batch = _module_case(OutputInPlace)
    clipped, diagnostics = _clipped(model, params, loss, batch_loss, batch, 0.05)
    norms, expected = _loop(loss, params, batch, 0.05)
    torch.testing.assert_close(diagnostics.norms.double(), norms.float().double(), rtol=1e-6, atol=0)
    for k in params:
        torch.testing.assert_close(clipped.value[k], expected[k], rtol=1e-9, atol=1e-12)


def test_an_input_changed_in_place_after_its_layer_ran_is_refused():
    """Plain autograd refuses it too (``b``'s weight gradient needs the input it ran on); the engine, whose parameters
    need no gradient, must not form ``b``'s gradients from the changed values."""
    model, params, loss, batch_loss, batch = _module_case(InputInPlace)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _loop(loss, params, batch, math.inf)
    with pytest.raises(ConfigurationError, match="modified in place"):
        _clipped(model, params, loss, batch_loss, batch, 0.5)


class Dropped(nn.Module):
    """Dropout between two linear layers: a training-mode model whose rows are independent."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x)))).mean(dim=1)


def test_the_check_leaves_dropout_and_the_random_stream_as_without_it():
    """In training mode with dropout, the check's pass draws the chunk's masks (no false refusal), and the chunk's
    pass then draws what it draws without the check: the clipped sum and the generator's state after the call equal
    those of an engine that checked the model on an earlier call."""
    model, params, loss, batch_loss, batch = _module_case(Dropped)
    model.train()
    checked = LayerwiseGradients(model, batch_loss)
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=checked))
    grad_fn(params, *batch, state=state)  # checks the model (training mode)
    fresh = LayerwiseGradients(model, batch_loss)
    results = []
    for engine in (checked, fresh):
        grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=engine))
        torch.manual_seed(11)
        clipped, _ = grad_fn(params, *batch, state=state)
        results.append((clipped.value, torch.get_rng_state()))
    (first, after_first), (second, after_second) = results
    assert all(torch.equal(first[k], second[k]) for k in params)
    assert torch.equal(after_first, after_second)
    torch.manual_seed(11)
    assert not torch.equal(torch.get_rng_state(), after_first)  # the pass did draw dropout masks
