"""clipped_grad against an independent float64 loop over single examples."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

from opake_core.clipping import FixedClipState, clipped_grad
from opake_core.errors import ConfigurationError, InputTypeError, VmapCompatibilityError
from opake_core.tree import Clipped, per_group


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.mean(dim=-2))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 13, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens)))).mean(dim=-2)


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 3)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(2, 6) * 0.5)
        self.lora_b = nn.Parameter(torch.randn(3, 2) * 0.5)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _data(name: str, n: int, gen: torch.Generator):
    if name in {"mlp", "lora"}:
        x = torch.randn(n, 6, generator=gen) * 3
    elif name == "cnn":
        x = torch.randn(n, 2, 6, 6, generator=gen)
    elif name == "attention":
        x = torch.randint(0, 11, (n, 5), generator=gen)
    else:
        x = torch.randint(0, 13, (n, 5), generator=gen)
    classes = 13 if name == "tied" else 3
    return x, torch.randint(0, classes, (n,), generator=gen)


MODELS = {"mlp": MLP, "cnn": CNN, "attention": Attention, "tied": TiedLM, "lora": LoRALinear}


def _split(model: nn.Module):
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    frozen.update(dict(model.named_buffers()))
    return params, frozen


def _loss(model: nn.Module):
    def loss(params, frozen, x, y):
        logits = functional_call(model, {**frozen, **params}, (x.unsqueeze(0),), tie_weights=True)
        return F.cross_entropy(logits, y.unsqueeze(0))

    return loss


def _reference(model: nn.Module, x, y, bound, normalize_by, group_of=None):
    """Float64 loop: one backward pass per example, clip in float64, sum, divide."""
    model64 = copy.deepcopy(model).double()
    names = [k for k, v in model64.named_parameters() if v.requires_grad]
    total = {k: torch.zeros_like(v) for k, v in model64.named_parameters() if v.requires_grad}
    for i in range(x.shape[0]):
        model64.zero_grad()
        xi = x[i : i + 1].double() if x.is_floating_point() else x[i : i + 1]
        F.cross_entropy(model64(xi), y[i : i + 1]).backward()
        grads = {k: v.grad.clone() for k, v in model64.named_parameters() if v.requires_grad}
        if group_of is None:
            norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
            scales = dict.fromkeys(names, min(1.0, bound / norm.item()))
        else:
            scales = {}
            for group, c in bound.items():
                members = [k for k in names if group_of[k] == group]
                norm = torch.sqrt(sum((grads[k] ** 2).sum() for k in members))
                scales.update(dict.fromkeys(members, min(1.0, c / norm.item())))
        for k in names:
            total[k] += grads[k] * scales[k]
    return {k: v / normalize_by for k, v in total.items()}


def _rel_err(ours, ref):
    num = math.sqrt(sum(((ours[k].double() - ref[k]) ** 2).sum().item() for k in ref))
    den = math.sqrt(sum((ref[k] ** 2).sum().item() for k in ref))
    return num / den


def _median_norm(model, params, frozen, x, y) -> float:
    grad_fn, state = clipped_grad(_loss(model), clipping_norm=math.inf, batch_argnums=(2, 3), return_diagnostics=True)
    (_, diag), _ = grad_fn(params, frozen, x, y, state=state)
    return diag.norms.median().item()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("microbatch_size", [1, 3, None])
def test_matches_float64_loop(name, microbatch_size):
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _data(name, 8, torch.Generator().manual_seed(1))
    params, frozen = _split(model)
    bound = _median_norm(model, params, frozen, x, y)  # the bound is active for about half the batch
    grad_fn, state = clipped_grad(
        _loss(model),
        clipping_norm=bound,
        batch_argnums=(2, 3),
        normalize_by=6.0,
        microbatch_size=microbatch_size,
        return_diagnostics=True,
    )
    (clipped, diag), new_state = grad_fn(params, frozen, x, y, state=state)
    assert isinstance(clipped, Clipped) and new_state is state
    assert 0 < diag.clip_rate.item() < 1
    assert diag.norms.shape == (8,) and diag.losses.shape == (8,) and diag.batch_size == 8
    assert clipped.sensitivity == pytest.approx(bound / 6.0)
    assert set(clipped.value) == set(params)
    assert _rel_err(clipped.value, _reference(model, x, y, bound, 6.0)) < 1e-6


def test_microbatch_sizes_agree_to_summation_order():
    torch.manual_seed(0)
    model = CNN()
    x, y = _data("cnn", 10, torch.Generator().manual_seed(2))
    params, frozen = _split(model)
    results = []
    for mb in (1, 3, 10, None):
        grad_fn, state = clipped_grad(_loss(model), clipping_norm=0.3, batch_argnums=(2, 3), microbatch_size=mb)
        results.append(grad_fn(params, frozen, x, y, state=state)[0].value)
    assert all(torch.equal(results[2][k], results[3][k]) for k in params)  # one chunk either way: bitwise
    for other in results[1:]:  # otherwise only float32 summation order differs
        assert _rel_err(other, {k: v.double() for k, v in results[0].items()}) < 1e-6


def test_per_group_matches_loop():
    torch.manual_seed(0)
    model = MLP()
    x, y = _data("mlp", 7, torch.Generator().manual_seed(3))
    params, frozen = _split(model)
    groups = per_group(params, {r"^fc1\.": 0.2}, fallback=0.7)  # both groups clip part of the batch
    grad_fn, state = clipped_grad(_loss(model), clipping_norm=groups, batch_argnums=(2, 3), microbatch_size=2)
    clipped, _ = grad_fn(params, frozen, x, y, state=state)
    assert clipped.sensitivity.effective == pytest.approx(math.hypot(0.2, 0.7))
    ref = _reference(model, x, y, {r"^fc1\.": 0.2, "fallback": 0.7}, 1.0, groups.group_of)
    assert _rel_err(clipped.value, ref) < 1e-6


def test_infinite_bound_is_plain_sum_of_gradients():
    torch.manual_seed(0)
    model = MLP()
    x, y = _data("mlp", 5, torch.Generator().manual_seed(4))
    params, frozen = _split(model)
    grad_fn, state = clipped_grad(_loss(model), clipping_norm=math.inf, batch_argnums=(2, 3))
    clipped, _ = grad_fn(params, frozen, x, y, state=state)
    assert clipped.sensitivity == math.inf
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(clipped.value[k], p.grad, rtol=1e-5, atol=1e-6)


def test_empty_batch_gives_zeros_with_metadata():
    model = MLP()
    params, frozen = _split(model)
    grad_fn, state = clipped_grad(
        _loss(model), clipping_norm=2.0, batch_argnums=(2, 3), normalize_by=4.0, return_diagnostics=True
    )
    (clipped, diag), _ = grad_fn(params, frozen, torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), state=state)
    assert clipped.sensitivity == 0.5
    assert all(torch.count_nonzero(v) == 0 and v.shape == params[k].shape for k, v in clipped.value.items())
    assert diag.batch_size == 0 and diag.norms.numel() == 0 and diag.clip_rate.item() == 0


def test_non_finite_example_contributes_nothing():
    def loss(p, x):
        return (p["w"] * x).sum()

    params = {"w": torch.ones(3)}
    x = torch.tensor([[1.0, 0.0, 0.0], [math.nan, 1.0, 1.0], [math.inf, 0.0, 0.0], [0.0, 3.0, 4.0]])
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, return_diagnostics=True)
    (clipped, diag), _ = grad_fn(params, x, state=state)
    torch.testing.assert_close(clipped.value["w"], torch.tensor([1.0, 0.6, 0.8]), rtol=1e-6, atol=0)
    assert torch.isnan(diag.norms[1]) and torch.isinf(diag.norms[2])


def test_has_aux_and_dropout_is_per_example():
    def loss(p, x):
        h = F.dropout(x * p["w"], p=0.5, training=True)
        return h.sum(), h

    params = {"w": torch.ones(64)}
    x = torch.ones(4, 64)
    grad_fn, state = clipped_grad(loss, clipping_norm=1e6, has_aux=True)
    (clipped, aux), _ = grad_fn(params, x, state=state)
    assert aux.shape == (4, 64)
    masks = aux != 0
    assert not torch.equal(masks[0], masks[1])  # independent masks: equal with probability 2**-64
    torch.testing.assert_close(clipped.value["w"], aux.sum(dim=0))


def test_buffers_and_frozen_parameters_pass_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4).eval(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    params, frozen = _split(model)
    assert set(params) == {"1.weight", "1.bias", "2.weight", "2.bias"}
    assert {"0.weight", "1.running_mean"} <= set(frozen)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    grad_fn, state = clipped_grad(_loss(model), clipping_norm=1.0, batch_argnums=(2, 3))
    clipped, _ = grad_fn(params, frozen, x, y, state=state)
    ref = _reference(model, x, y, 1.0, 1.0)
    assert _rel_err(clipped.value, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_parameters_accumulate_in_float32(dtype):
    def loss(p, x):
        return (p["w"] * x).sum()

    params = {"w": torch.ones(5, dtype=dtype)}
    x = torch.randn(6, 5).to(dtype)
    grad_fn, state = clipped_grad(loss, clipping_norm=0.25)
    clipped, _ = grad_fn(params, x, state=state)
    assert clipped.value["w"].dtype == torch.float32
    x64 = x.double()
    ref = (x64 * torch.clamp(0.25 / x64.norm(dim=1, keepdim=True), max=1)).sum(0)
    torch.testing.assert_close(clipped.value["w"].double(), ref, rtol=1e-6, atol=1e-7)


_values = st.one_of(
    st.just(0.0),
    st.floats(min_value=-1e-30, max_value=1e-30),
    st.floats(min_value=-1e30, max_value=1e30, allow_nan=False),
    st.floats(min_value=-3.0, max_value=3.0),
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(_values, min_size=1, max_size=40), bound=st.sampled_from([1e-3, 0.5, 1.0, 7.0, 1e4]))
def test_stored_contribution_never_exceeds_bound(dtype, values, bound):
    """A single example's stored clipped contribution has norm <= C, computed exactly in float64."""

    def loss(p, g):
        return (p["w"] * g).sum()

    g = torch.tensor(values, dtype=torch.float64).to(dtype)  # values beyond the dtype's range become inf
    params = {"w": torch.ones(len(values), dtype=dtype)}
    grad_fn, state = clipped_grad(loss, clipping_norm=bound)
    stored = grad_fn(params, g.unsqueeze(0), state=state)[0].value["w"]
    assert torch.isfinite(stored).all()
    assert stored.double().norm().item() <= bound
    finite = torch.isfinite(g).all()
    if finite and g.double().norm() <= bound * (1 - 1e-6):
        assert torch.equal(stored, g.to(stored.dtype))  # unclipped examples pass through unchanged


def test_vmap_errors_explain_the_cause():
    def inplace(p, x):
        y = torch.zeros(3)
        y.add_(p["w"] * x)
        return y.sum()

    def branch(p, x):
        return (p["w"] * x).sum() if x.sum() > 0 else p["w"].sum()

    params, x = {"w": torch.ones(3)}, torch.ones(2, 3)
    for fn, word in ((inplace, "in place"), (branch, "branches on a tensor")):
        grad_fn, state = clipped_grad(fn, clipping_norm=1.0)
        with pytest.raises(VmapCompatibilityError, match=word):
            grad_fn(params, x, state=state)


def test_batch_loss_is_refused():
    grad_fn, state = clipped_grad(lambda p, x: p["w"] * x, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="scalar"):
        grad_fn({"w": torch.ones(3)}, torch.ones(2, 3), state=state)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clipping_norm": -1.0}, ConfigurationError, "positive"),
        ({"clipping_norm": 0.0}, ConfigurationError, "positive"),
        ({"clipping_norm": math.nan}, ConfigurationError, "clipping_norm"),
        ({"clipping_norm": "1"}, InputTypeError, "clipping_norm"),
        ({"clipping_norm": 1.0, "normalize_by": 0}, ConfigurationError, "normalize_by"),
        ({"clipping_norm": 1.0, "normalize_by": math.nan}, ConfigurationError, "normalize_by"),
        ({"clipping_norm": 1.0, "microbatch_size": 0}, ConfigurationError, "microbatch_size"),
        ({"clipping_norm": 1.0, "argnums": 1}, ConfigurationError, "overlap"),
        ({"clipping_norm": 1.0, "batch_argnums": ()}, ConfigurationError, "at least one"),
        ({"clipping_norm": 1.0, "argnums": -1}, ConfigurationError, "non-negative"),
    ],
)
def test_bad_configuration(kwargs, error, match):
    with pytest.raises(error, match=match):
        clipped_grad(lambda p, x: (p * x).sum(), **kwargs)


def test_bad_call_inputs():
    grad_fn, state = clipped_grad(lambda p, x, y: (p["w"] * x).sum() + y.sum(), clipping_norm=1.0, batch_argnums=(1, 2))
    params = {"w": torch.ones(3)}
    with pytest.raises(ConfigurationError, match="same leading batch dimension"):
        grad_fn(params, torch.ones(2, 3), torch.ones(3), state=state)
    with pytest.raises(InputTypeError, match="FixedClipState"):
        grad_fn(params, torch.ones(2, 3), torch.ones(2), state=None)
    with pytest.raises(InputTypeError, match="floating-point"):
        grad_fn({"w": torch.ones(3, dtype=torch.long)}, torch.ones(2, 3), torch.ones(2), state=FixedClipState())
    groups = per_group({"v": torch.ones(3)}, fallback=1.0)
    grad_fn, state = clipped_grad(lambda p, x: (p["w"] * x).sum(), clipping_norm=groups)
    with pytest.raises(ConfigurationError, match="no group for parameters"):
        grad_fn(params, torch.ones(2, 3), state=state)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_float64_loop_on_cuda(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = _data(name, 8, torch.Generator().manual_seed(1))
    params, frozen = _split(model)
    bound = _median_norm(model, params, frozen, x, y)
    reference = _reference(model, x, y, bound, 6.0)
    model = model.cuda()
    params, frozen = _split(model)
    grad_fn, state = clipped_grad(
        _loss(model), clipping_norm=bound, batch_argnums=(2, 3), normalize_by=6.0, microbatch_size=3
    )
    clipped, _ = grad_fn(params, frozen, x.cuda(), y.cuda(), state=state)
    assert all(v.device.type == "cuda" for v in clipped.value.values())
    assert _rel_err({k: v.cpu() for k, v in clipped.value.items()}, reference) < 1e-6
