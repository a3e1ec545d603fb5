"""The two norm routes of the layerwise engine's ghost linear and Conv1D calls, the product route's rounding margin,
the route chooser, and the bf16 clipped sum in two parts.

* Both routes give the per-example norms of a float64 loop over examples (tiny Llama, GPT-2 and BERT, float32 and
  bf16 autocast, with and without checkpointing, grouped examples).
* The product route's reported norm bounds the exact norm of the product of its factors on adversarial inputs:
  positions whose products cancel, at a large ``T``, with terms at the edge of float32 rounding. An accumulator that
  rounds to nearest in the positions' order loses the small terms (``1 + 2^-24 = 1``), so the accumulated gradient is
  0 where the exact one is not: without the margin the example is not clipped and its contribution exceeds the bound.
* The chooser's decisions follow the stated cost model, computed here independently.
* The two-part sum equals the float64 sum of ``c'_i G_i`` (``c'_i``: the clip factor rounded down to bf16).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from tiny_hf import tiny_model, token_data
from torch import nn

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, ghost, hooks, precision
from opake_torch.layerwise.calls import Call
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.kernels import product_norms
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss


@pytest.fixture(autouse=True)
def _two_part_sums(monkeypatch):
    """These tests are of the norm routes: the one-pass bf16 sum, whose margin the norms would carry where its kernel
    runs, is set aside (its tests: ``tests/torch/kernels/test_product_sums.py``)."""
    monkeypatch.setattr(hooks, "one_pass_sum", lambda call, total: False)


# ---------------------------------------------------------------------------------------------------------------
# both routes against a float64 loop over examples


def _task(family: str) -> str:
    return "sequence_classification" if family == "bert" else "causal_lm"


def _batch(family: str, n: int = 5) -> dict:
    batch = collate(token_data(n, classes=3 if family == "bert" else None), pad_token_id=0)
    return batch if family == "bert" else language_modeling_labels(batch)


def _losses(model: nn.Module, family: str, autocast: bool) -> tuple:
    apply, params, frozen = functional_model(model)
    scope = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def loss(p, example):
        with scope():
            return per_example_loss(apply, p, frozen, example, task=_task(family))

    def batch_loss(p, b):
        with scope():
            return batch_losses(apply, p, frozen, b, task=_task(family))

    return params, loss, batch_loss


def _model(family: str, checkpointing: bool) -> nn.Module:
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    model = tiny_model(family)
    if checkpointing:
        enable_vmap_checkpointing(model)
    return model.train()  # no dropout in the tiny models; training mode runs the checkpointing


def _engine_norms(model, batch_loss, params, batch, route: str, grouped: bool = False) -> tuple[dict, set]:
    """Squared norms ``{name: [m]}`` of the engine with every weight (used once) ghost and ``route`` forced, and the
    names of the ghost linear and Conv1D weights (not a tied one, whose norms hold its embedding's part too:
    test_tied.py)."""
    engine = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6, norm_route=route, grouped=grouped)
    with torch.no_grad():
        grads, _ = engine(None, (params, batch), (1,))
        squared = grads.squared_norms()
    ghosts = {n for n, (call, _) in grads.ghost.items() if call.kind in ("linear", "conv1d") and n not in grads.tied}
    return dict(zip(grads.names, squared, strict=True)), ghosts


def _float64_loop(family: str, batch: dict) -> dict:
    """``{name: [m]}`` squared norms of each example's gradient by plain autograd of its own loss, in float64."""
    model = tiny_model(family).double().train()
    params, loss, _ = _losses(model, family, autocast=False)
    m = next(iter(batch.values())).shape[0]
    rows = []
    for i in range(m):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        found = torch.autograd.grad(loss(leaves, {k: v[i] for k, v in batch.items()}), list(leaves.values()))
        rows.append({k: g.double().square().sum() for k, g in zip(leaves, found, strict=True)})
    return {k: torch.stack([row[k] for row in rows]) for k in params}


def _bf16_factor_loop(family: str, batch: dict, wrap=None, m: int | None = None) -> dict:
    """``{name: [m]}`` squared norms of ``G_i = sum_t g_it bf16(a_it)^T`` in float64, one example at a time, from the
    factors of a plain batched pass under bf16 autocast (the inputs and output gradients of every linear and Conv1D
    layer, read by hooks): the weight gradients the bf16 forward's products define. ``wrap`` (of the batched loss)
    and ``m``: those of grouped examples (an example's rows are consecutive, their positions summed over)."""
    from transformers.pytorch_utils import Conv1D

    model = tiny_model(family).train()
    params, _, batch_loss = _losses(model, family, autocast=True)
    batch_loss = wrap(batch_loss) if wrap else batch_loss
    factors, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)):

            def keep(mod, inputs, output, name=name):
                factors[name] = [inputs[0].detach()]
                output.register_hook(lambda grad: factors[name].append(grad))

            handles.append(module.register_forward_hook(keep))
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    batch_loss(leaves, batch).sum().backward()
    for handle in handles:
        handle.remove()
    m, out = m or next(iter(batch.values())).shape[0], {}
    for name, (a, g) in factors.items():
        assert g.dtype == torch.bfloat16
        a = a.to(torch.bfloat16).double().reshape(m, -1, a.shape[-1])
        g = g.double().reshape(m, -1, g.shape[-1])
        out[f"{name}.weight"] = torch.stack([(g[i].T @ a[i]).square().sum() for i in range(m)])
    return out


CASES = [(family, autocast, False) for family in ("llama", "gpt2", "bert") for autocast in (False, True)]
CASES += [("llama", False, True), ("llama", True, True), ("gpt2", True, True)]


@pytest.mark.parametrize(("family", "autocast", "checkpointing"), CASES)
def test_both_routes_give_the_float64_loop_norms(family, autocast, checkpointing):
    """Every ghost linear and Conv1D weight's per-example norms by either route equal the float64 loop (float32:
    plain autograd of each example's loss on a float64 copy, to 1e-4; bf16 autocast: the float64 products of each
    example's bf16 factors, the Gram route to 1e-10, the product route an upper bound within its margin, 1e-4)."""
    batch = _batch(family)
    expected = _float64_loop(family, batch) if not autocast else _bf16_factor_loop(family, batch)
    for route in ("gram", "product"):
        model = _model(family, checkpointing)
        params, _, batch_loss = _losses(model, family, autocast)
        norms, ghosts = _engine_norms(model, batch_loss, params, batch, route)
        assert len(ghosts) >= 4, ghosts  # attention and MLP projections (and the head) take ghost norms
        for name in ghosts:
            ours, ref = norms[name], expected[name]
            if not autocast:  # float32 forward and backward against float64
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=0, msg=f"{route} {name}")
            elif route == "gram":  # the same factors, float64 arithmetic
                torch.testing.assert_close(ours, ref, rtol=1e-10, atol=0, msg=name)
            else:  # an upper bound: the float32 accumulation's margin
                assert (ours >= ref * (1 - 1e-12)).all() and (ours <= ref * (1 + 1e-4)).all(), name


def _users(m: int = 3, k: int = 3) -> dict:
    """Causal-LM rows laid out ``[m, k, T]`` by user, each user's rows its own."""
    rows = language_modeling_labels(collate(token_data(m * k), pad_token_id=0))
    return {name: v.reshape(m, k, *v.shape[1:]) for name, v in rows.items()}


def _grouped(batch_loss):
    """The batched loss of users ``[m, k, ...]``: the model runs on the ``m k`` rows, a user's loss is their sum."""

    def grouped_loss(p, b):
        flat = {name: v.reshape(-1, *v.shape[2:]) for name, v in b.items()}
        return batch_loss(p, flat).reshape(b["input_ids"].shape[:2]).sum(dim=1)

    return grouped_loss


@pytest.mark.parametrize("autocast", [False, True])
def test_both_routes_give_the_float64_loop_norms_of_grouped_examples(autocast):
    """Grouped examples (a user's ``k`` rows, ``k T`` positions): the norms of each user's summed gradient by either
    route equal a float64 loop over users (float32: plain autograd of the sum of its rows' losses, to 1e-4; bf16
    autocast: the float64 products of the user's bf16 factors), and the product route bounds the Gram route's from
    above within its margin."""
    users = _users()
    m = users["input_ids"].shape[0]
    if autocast:
        expected = _bf16_factor_loop("llama", users, _grouped, m)
    else:
        reference = tiny_model("llama").double().train()
        ref_params, ref_loss, _ = _losses(reference, "llama", autocast=False)
        rows = []
        for u in range(m):
            leaves = {k: v.detach().clone().requires_grad_() for k, v in ref_params.items()}
            total = sum(ref_loss(leaves, {k: v[u, j] for k, v in users.items()}) for j in range(3))
            found = torch.autograd.grad(total, list(leaves.values()))
            rows.append({k: g.square().sum() for k, g in zip(leaves, found, strict=True)})
        expected = {k: torch.stack([row[k] for row in rows]) for k in ref_params}
    norms = {}
    for route in ("gram", "product"):
        model = _model("llama", checkpointing=False)
        params, _, batch_loss = _losses(model, "llama", autocast)
        norms[route], ghosts = _engine_norms(model, _grouped(batch_loss), params, users, route, grouped=True)
        assert len(ghosts) >= 4, ghosts
        for name in ghosts:
            ours, ref = norms[route][name], expected[name]
            if not autocast or route == "gram":
                torch.testing.assert_close(ours, ref, rtol=1e-4 if not autocast else 1e-10, atol=0, msg=name)
            else:
                assert (ours >= ref * (1 - 1e-12)).all() and (ours <= ref * (1 + 1e-3)).all(), name
    for name in ghosts:
        product, gram = norms["product"][name], norms["gram"][name]
        assert (product >= gram * (1 - 1e-12)).all() and (product <= gram * (1 + 1e-3)).all(), name


# ---------------------------------------------------------------------------------------------------------------
# the product route's margin on adversarial inputs

WIDTH, POSITIONS = 8, 4096


def _cancelling(positions: int = POSITIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x`` and output gradients ``v`` ``[1, T, W]`` (bf16 numbers): position 0 adds ``1`` to every entry
    of the example's gradient, positions ``1 .. T-2`` add ``2^-24`` each (half of float32's spacing at 1: a tie that
    rounds back to 1), position ``T-1`` subtracts ``1``. Exact gradient: ``(T - 2) 2^-24`` in every entry."""
    x, v = torch.full((positions, WIDTH), 2.0**-12), torch.full((positions, WIDTH), 2.0**-12)
    x[0], v[0], x[-1], v[-1] = 1.0, 1.0, 1.0, -1.0
    return x[None], v[None]


def _edge(positions: int = POSITIONS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of positions whose inputs are about one bf16 spacing apart and whose output gradients are opposite:
    each pair adds ``v (x - x')^T``, a spacing's worth of a large term, so that the large terms cancel and the sum is
    made of the rounding-sized remainders; plus small bf16 noise of either sign on the inputs."""
    gen = torch.Generator().manual_seed(seed)
    half = positions // 2
    x = (1 + torch.randint(0, 128, (half, WIDTH), generator=gen) / 128.0) * torch.exp2(
        torch.randint(-4, 4, (half, WIDTH), generator=gen).float()
    )
    neighbour = x * (1 + 2.0**-7)  # about one bf16 spacing up, rounded to bf16 below
    v = torch.randint(1, 256, (half, WIDTH), generator=gen).float() * 2.0**-4
    noise = (torch.randn(positions, WIDTH, generator=gen) * 2.0**-10).to(torch.bfloat16).float()
    xs = torch.cat([x, neighbour]) + noise
    return xs.to(torch.bfloat16).float()[None], torch.cat([v, -v])[None].to(torch.bfloat16).float()


def _linear_case(autocast: bool) -> tuple:
    """A bias-free linear layer whose loss at position ``t`` is ``y_t . v_t``: the example's weight gradient is
    ``sum_t v_t x_t^T`` (under bf16 autocast, of the bf16-rounded factors)."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH, bias=False)
    apply, params, frozen = functional_model(model)
    scope = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def batch_loss(p, x, v):
        with scope():
            y = apply(p, frozen, x)
        return (y.float() * v).sum(dim=(1, 2))

    def loss(p, x, v):
        return batch_loss(p, x[None], v[None])[0]

    return model, params, loss, batch_loss


def _exact_norm(x: torch.Tensor, v: torch.Tensor, autocast: bool) -> float:
    """The float64 norm of the example's exact weight gradient ``sum_t v_t x_t^T`` (its factors as the layer
    multiplies them)."""
    if autocast:
        x, v = x.to(torch.bfloat16), v.to(torch.bfloat16)
    return (v[0].double().T @ x[0].double()).norm().item()


def _reported(autocast: bool, x: torch.Tensor, v: torch.Tensor) -> float:
    model, params, _, batch_loss = _linear_case(autocast)
    engine = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6, norm_route="product")
    with torch.no_grad():
        grads, _ = engine(None, (params, x, v), (1, 2))
        return grads.squared_norms()[0, 0].sqrt().item()


def _in_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched, accumulated in float32 one position at a time in order, each addition rounded to nearest
    (products of bf16 factors are exact): one summation order a matmul may take."""
    a, b = a.float(), b.float()
    total = torch.zeros(a.shape[0], a.shape[1], b.shape[2])
    for k in range(a.shape[2]):
        total = total + a[:, :, k : k + 1] * b[:, k : k + 1, :]
    return total


def test_the_cancelling_example_is_what_it_claims():
    x, v = _cancelling()
    exact = _exact_norm(x, v, autocast=True)
    assert exact == pytest.approx(WIDTH * (POSITIONS - 2) * 2.0**-24, rel=1e-12)
    accumulated = _in_order(v.transpose(1, 2).to(torch.bfloat16), x.to(torch.bfloat16))
    assert accumulated.norm().item() == 0.0  # every small term rounded away: ||G~|| < ||G||


def _in_order_products(monkeypatch) -> None:
    """The product route forms its gradients with :func:`_in_order` (the norm kernel, where Triton runs, set aside)."""
    monkeypatch.setattr(ghost, "bmm_accumulated", _in_order)
    monkeypatch.setattr(ghost, "product_squared_norms_supported", lambda *args: False)


@pytest.mark.parametrize("margin", [True, False])
def test_the_margin_bounds_the_norm_of_an_accumulator_that_loses_the_cancelling_terms(monkeypatch, margin):
    """With the in-order accumulator the product route's gradient is 0; its reported norm (``0 + gamma S``) still
    bounds the exact one. Without the margin it reports 0: the bound fails (the ``margin=False`` case checks that
    this test would catch it)."""
    _in_order_products(monkeypatch)
    if not margin:
        monkeypatch.setattr(ghost, "product_norm_error", lambda *args, **kwargs: 0.0)
    x, v = _cancelling()
    exact, reported = _exact_norm(x, v, autocast=True), _reported(True, x, v)
    if margin:
        assert reported >= exact
        assert reported <= 10 * exact  # gamma S: about 4 times the exact norm here, no more
    else:
        assert reported < exact


def _contribution(monkeypatch, bound: float, *, margin: bool) -> float:
    """The norm of the one (cancelling) example's clipped contribution: norms by the in-order accumulator, the sum's
    products exact (float64), so that the contribution is ``c'_i G_i`` itself."""
    _in_order_products(monkeypatch)
    monkeypatch.setattr(precision, "_mm_float32", lambda a, b: (a.double() @ b.double()).float())
    if not margin:
        monkeypatch.setattr(ghost, "product_norm_error", lambda *args, **kwargs: 0.0)
    model, params, loss, batch_loss = _linear_case(autocast=True)
    hooks = Engine(gradients=LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6, norm_route="product"))
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), normalize_by=1.0, engine=hooks)
    clipped, _ = grad_fn(params, *_cancelling(), state=state)
    return clipped.value["weight"].double().norm().item()


def test_the_clipped_contribution_stays_within_the_bound(monkeypatch):
    x, v = _cancelling()
    bound = _exact_norm(x, v, autocast=True) / 2
    assert _contribution(monkeypatch, bound, margin=True) <= bound


def test_without_the_margin_the_contribution_exceeds_the_bound(monkeypatch):
    x, v = _cancelling()
    bound = _exact_norm(x, v, autocast=True) / 2
    assert _contribution(monkeypatch, bound, margin=False) > 1.5 * bound


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("inputs", ["cancelling", "edge0", "edge1", "random"])
def test_the_reported_norm_bounds_the_exact_one_on_adversarial_inputs(autocast, inputs):
    """The route's own matmul (whatever its summation order): the reported norm is at least the exact float64 norm
    of the example's gradient (float32 factors: the products of the float32 numbers), and at most ``2 gamma S``
    above it (``||G~|| <= ||G|| + gamma S``, plus the margin ``gamma S``; ``gamma`` about ``T 2^-23``)."""
    if inputs == "cancelling":
        x, v = _cancelling()
    elif inputs.startswith("edge"):
        x, v = _edge(seed=int(inputs[-1]))
    else:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(1, POSITIONS, WIDTH, generator=gen) * torch.exp2(torch.randint(-8, 8, (1, POSITIONS, 1)))
        v = torch.randn(1, POSITIONS, WIDTH, generator=gen)
    exact, reported = _exact_norm(x, v, autocast), _reported(autocast, x, v)
    assert reported >= exact
    factors = (x.to(torch.bfloat16), v.to(torch.bfloat16)) if autocast else (x, v)
    spread = (factors[0][0].double().norm(dim=-1) * factors[1][0].double().norm(dim=-1)).sum().item()
    gamma = POSITIONS * 2.0**-23 / (1 - POSITIONS * 2.0**-23) + (0 if autocast else 2 * 2.0**-23)
    assert reported <= exact * (1 + 1e-6) + 2 * gamma * spread


# ---------------------------------------------------------------------------------------------------------------
# the route chooser

LLAMA_1B = {  # (in, out) of the 1.1B Llama's ghost layers: hidden 2048, 4 KV heads of 64, MLP 5632, vocabulary 32000
    "q_proj": (2048, 2048),
    "k_proj": (2048, 256),
    "v_proj": (2048, 256),
    "o_proj": (2048, 2048),
    "gate_proj": (2048, 5632),
    "up_proj": (2048, 5632),
    "down_proj": (5632, 2048),
    "lm_head": (2048, 32000),
}


def _predicted(positions, width_in, width_out, factors, device, matmul, share=1.0) -> str:
    """The cost model as documented: flops at the device's rate for the dtype (CUDA: bf16 1, IEEE float32, TF32 and
    float64 1/15; CPU: float32 1, float64 1/2) and memory traffic at 300 (CUDA) or 10 (CPU) flops a byte:
    the Gram route reads its factors, copies them to float64 and reads them again, and writes and reads two float64
    ``T x T`` matrices, of which the input's (its Gram matrix and its factor's traffic) counts ``share`` times; the
    product route writes and reads the ``[out, in]`` float32 gradient once and reads its factors twice."""
    cuda = device == "cuda"
    fp64, per_byte = (1 / 15, 300) if cuda else (1 / 2, 10)
    if factors == torch.bfloat16:
        rate, size = 1.0, 2
    else:
        rate, size = ({"ieee": 1 / 15, "tf32": 1 / 15, "bf16": 1.0}[matmul] if cuda else 1.0), 4
    factor_numbers = positions * (width_in + width_out)
    input_side = (
        2 * positions**2 * width_in / fp64 + (positions * width_in * (size + 8 + 8) + 2 * 8 * positions**2) * per_byte
    )
    output_side = 2 * positions**2 * (width_out + 1) / fp64
    output_side += (positions * width_out * (size + 8 + 8) + 2 * 8 * positions**2) * per_byte
    gram = output_side + share * input_side
    product = 2 * positions * width_in * width_out / rate
    product += (2 * 4 * width_in * width_out + 2 * factor_numbers * size) * per_byte
    return "product" if product < gram else "gram"


def test_the_chooser_takes_the_product_route_for_the_1b_model_on_cuda_bf16():
    for width_in, width_out in LLAMA_1B.values():
        assert ghost.norm_route(512, width_in, width_out, torch.bfloat16, "cuda", "ieee") == "product"
        assert ghost.norm_route(16, width_in, width_out, torch.bfloat16, "cuda", "ieee") == "gram"  # small T
        # grouped: 8 rows of 64 positions are one example of 512; 64 positions alone stay on Gram matrices
        assert ghost.norm_route(64, width_in, width_out, torch.bfloat16, "cuda", "ieee") == "gram"
        assert ghost.norm_route(8 * 64, width_in, width_out, torch.bfloat16, "cuda", "ieee") == "product"
    # float32 factors: IEEE float32 is as slow as float64 on a GPU, and TF32's product route measured no faster
    assert ghost.norm_route(512, 2048, 2048, torch.float32, "cuda", "ieee") == "gram"
    assert ghost.norm_route(512, 2048, 2048, torch.float32, "cuda", "tf32") == "gram"


def test_the_norm_kernel_runs_only_for_the_factors_it_bounds_on_tensor_core_gpus(monkeypatch):
    """bf16 factors, or float32 ones under TF32, on a CUDA device of compute capability 8 or more with Triton; never
    IEEE float32, float64, a CUDA device without those tensor cores, or a machine without Triton."""
    runs = product_norms.product_kernel_runs
    monkeypatch.setattr(product_norms, "triton", object())  # as if Triton were installed
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    capability = {0: 9, 1: 7}
    monkeypatch.setattr(product_norms, "_tensor_cores", lambda index: capability[index] >= 8)
    assert runs(torch.device("cuda", 0), torch.bfloat16, "ieee")
    assert runs(torch.device("cuda", 0), torch.float32, "tf32")
    assert not runs(torch.device("cuda", 0), torch.float32, "ieee")
    assert not runs(torch.device("cuda", 0), torch.float64, "tf32")
    assert not runs(torch.device("cuda", 1), torch.bfloat16, "ieee")  # compute capability 7
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not runs(torch.device("cpu"), torch.bfloat16, "ieee")  # a CPU only under the interpreter
    monkeypatch.setattr(product_norms, "triton", None)
    assert not runs(torch.device("cuda", 0), torch.bfloat16, "ieee")


def test_the_chooser_follows_the_stated_cost_model():
    widths = (16, 64, 256, 768, 2048, 5632, 32000)
    for positions, width_in, width_out in itertools.product((1, 4, 16, 64, 128, 512, 2048), widths, widths):
        for device, factors, matmul in itertools.product(
            ("cuda", "cpu"), (torch.bfloat16, torch.float32), ("ieee", "tf32", "bf16")
        ):
            expected = _predicted(positions, width_in, width_out, factors, device, matmul)
            assert ghost.norm_route(positions, width_in, width_out, factors, device, matmul) == expected
            for share in (0.0, 1 / 3):
                expected = _predicted(positions, width_in, width_out, factors, device, matmul, share)
                assert ghost.norm_route(positions, width_in, width_out, factors, device, matmul, share) == expected


def test_a_shared_input_gram_is_priced_once():
    """Attention projections of width 768 at 160 positions with bf16 factors on CUDA: priced alone, a projection's
    Gram route costs more than its product route; the three projections that read one input share its Gram matrix,
    so the first pays a third of it and the others nothing, and all three take the Gram route."""
    args = (160, 768, 768, torch.bfloat16, "cuda", "ieee")
    assert ghost.norm_route(*args) == "product"
    assert ghost.norm_route(*args, 1 / 3) == ghost.norm_route(*args, 0.0) == "gram"


class _SharedInput(nn.Module):
    """q, k and v read one input (one Gram matrix); the output projection reads its own."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(12, 12, bias=False) for _ in range(3))
        self.o = nn.Linear(12, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))


def test_the_engine_prices_a_shared_input_gram_once(monkeypatch):
    """The share each call is priced with: the first of the three readers of one input pays a third of its Gram
    matrix, the two after it none (the first formed it); the output projection, its input's only reader, all of it.
    Forcing the Gram route in the chooser keeps the Gram matrix formed, as the test's first reader would."""
    torch.manual_seed(0)
    model = _SharedInput()
    apply, params, frozen = functional_model(model)
    x = torch.randn(3, 5, 12)
    shares = []
    monkeypatch.setattr(ghost, "norm_route", lambda *args: shares.append(args[-1]) or "gram")
    engine = LayerwiseGradients(
        model, lambda p, xb: apply(p, frozen, xb).square().sum(dim=(1, 2)), ghost_advantage=1e-6
    )
    with torch.no_grad():
        grads, _ = engine(None, (params, x), (1,))
    assert set(grads.ghost) == {f"{n}.weight" for n in "qkvo"}
    assert shares[:4] == [1.0, 1 / 3, 0.0, 0.0]  # backward order: o, then v, k, q (the coupling check's pass)
    assert shares[4:] == shares[:4]  # the chunk's own pass


class _TwoWidths(nn.Module):
    """A linear layer over many positions of narrow rows (product route on the CPU) and a head over one pooled
    position of wide rows (Gram route)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.narrow(x)).mean(dim=1, keepdim=True))


def test_auto_takes_the_predicted_route_per_call_and_the_same_norms(monkeypatch):
    torch.manual_seed(0)
    model = _TwoWidths()
    apply, params, frozen = functional_model(model)
    x = torch.randn(4, 64, 16)

    def batch_loss(p, xb):
        return apply(p, frozen, xb).square().sum(dim=(1, 2))

    taken = []
    product_norms = ghost.product_norms
    monkeypatch.setattr(ghost, "product_norms", lambda call, *a: taken.append(call.module) or product_norms(call, *a))
    assert _predicted(64, 16, 16, torch.float32, "cpu", "ieee") == "product"
    assert _predicted(1, 16, 64, torch.float32, "cpu", "ieee") == "gram"
    norms = {}
    for route in ("auto", "gram"):
        engine = LayerwiseGradients(model, batch_loss, ghost_advantage=1e-6, norm_route=route)
        with torch.no_grad():
            grads, _ = engine(None, (params, x), (1,))
            norms[route] = grads.squared_norms()
        assert set(grads.ghost) == {"narrow.weight", "head.weight"}
    assert set(taken) == {model.narrow}  # the coupling check's pass and the chunk's
    # the product route's norms bound the Gram route's from above, within its margin (about T 2^-23 sqrt(T))
    assert (norms["auto"] >= norms["gram"] * (1 - 1e-12)).all() and (norms["auto"] <= norms["gram"] * (1 + 1e-3)).all()


def test_an_unknown_route_is_refused():
    with pytest.raises(ConfigurationError, match=r"norm_route must be one of .*'fast'"):
        LayerwiseGradients(nn.Linear(2, 2), lambda p, x: x.sum(dim=1), norm_route="fast")


def test_the_product_route_bounds_its_transient_memory():
    """The ``[m_c, out, in]`` float32 gradients of ``m_c`` examples at a time hold at most the larger of 64 MiB and
    the call's factors: 9 examples of a ``1024 x 2048`` layer (8 MiB each) run 8, then 1."""
    chunks = []

    def spy(a, b):
        chunks.append(a.shape[0])
        return torch.zeros(a.shape[0], a.shape[1], b.shape[2])

    m, positions = 9, 4
    call = Call("linear", nn.Identity(), {}, torch.zeros(m, positions, 2048), positions,
                grad=torch.zeros(m, positions, 1024))  # fmt: skip
    original = ghost.bmm_accumulated
    try:
        ghost.bmm_accumulated = spy
        ghost.product_norms(call, m, "ieee")
    finally:
        ghost.bmm_accumulated = original
    assert chunks == [8, 1]


# ---------------------------------------------------------------------------------------------------------------
# the clipped sum of bf16 factors in two parts


def _floor_bf16(c: torch.Tensor) -> torch.Tensor:
    """The largest bf16 number at most ``c`` (``c >= 0``), from the binary exponent: ``c = f 2^e``, ``f`` in
    ``[1/2, 1)``, kept to 8 significand bits (to multiples of ``2^-133``, bf16's subnormal spacing, below
    ``2^-126``)."""
    _, e = torch.frexp(c.double())
    spacing = torch.exp2(torch.clamp(e.double() - 8, min=-133))
    return torch.floor(c.double() / spacing) * spacing


def test_the_clip_factor_is_rounded_down_to_bf16():
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(100_000, generator=gen) * torch.exp2(-torch.randint(0, 120, (100_000,), generator=gen).float())
    c = torch.cat([c, torch.tensor([0.0, 1.0, 0.5, 1 - 2.0**-24, 2.0**-126, 3.0e-39])])
    rounded = precision.bf16_floor(c)
    assert torch.equal(rounded.double(), _floor_bf16(c))
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # a bf16 number
    normal = c >= 2.0**-126
    assert (rounded <= c).all() and (rounded >= c * (1 - 2.0**-7))[normal].all()


def test_two_bf16_parts_hold_the_scaled_factor_exactly():
    """``c' g`` (``c'``: the factor rounded down to bf16, ``g`` bf16) is the exact sum of its two parts for
    ``|c' g| >= 2^-118``, and within ``2^-133`` (bf16's smallest subnormal) below; a dropped example is zero."""
    gen = torch.Generator().manual_seed(1)
    m, positions, d = 64, 16, 32
    exponents = torch.randint(-100, 100, (m, positions, d), generator=gen).float()
    g = (torch.randn(m, positions, d, generator=gen) * torch.exp2(exponents)).to(torch.bfloat16)
    scale = torch.rand(m, 1, 1, generator=gen) * torch.exp2(-torch.randint(0, 20, (m, 1, 1), generator=gen).float())
    scale[0] = 1.0
    drop = torch.zeros(m, 1, 1, dtype=torch.bool)
    drop[5] = True
    parts = precision.bf16_scaled_parts(g, scale, drop).double()
    total = parts[..., :d] + parts[..., d:]
    exact = torch.where(drop, 0.0, g.double() * _floor_bf16(scale))
    big = exact.abs() >= 2.0**-118
    assert torch.equal(total[big], exact[big])
    assert ((total - exact).abs()[~big] <= 2.0**-133).all()
    assert not total[5].any()
    tiny = (torch.randn(1, 8, d, generator=gen) * 2.0**-120).to(torch.bfloat16)
    parts = precision.bf16_scaled_parts(tiny, torch.full((1, 1, 1), 0.7), torch.zeros(1, 1, 1, dtype=torch.bool))
    exact = tiny.double() * _floor_bf16(torch.tensor(0.7))
    assert ((parts[..., :d].double() + parts[..., d:].double() - exact).abs() <= 2.0**-133).all()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_the_two_part_sum_is_the_float64_sum_of_the_rounded_down_contributions(kind):
    """``add_bf16_product`` adds ``sum_i c'_i G_i`` (float32 accumulation of exact products: within 1e-6 of the
    float64 sum), not ``sum_i c_i G_i`` (``c - c'`` is up to ``2^-7 c``); a dropped example adds nothing even with an
    infinite output gradient; each example alone, at the clipping rule's scale, stays within the bound."""
    gen = torch.Generator().manual_seed(2)
    m, positions, width, out = 6, 7, 24, 16
    grad = (torch.randn(m, positions, out, generator=gen) * 3).to(torch.bfloat16)
    grad[2, 1, 0] = float("inf")
    inputs = torch.randn(m, positions, width, generator=gen).to(torch.bfloat16)
    scale = torch.tensor([0.3, 1.0, 0.0, 1e-3, 0.777, 0.123456]).reshape(m, 1, 1)
    drop = scale == 0
    per_example = torch.einsum("mto,mti->moi", torch.where(drop, 0.0, grad.double()), inputs.double())
    expected = torch.einsum("m,moi->oi", _floor_bf16(scale).reshape(m), per_example)
    if kind == "conv1d":
        expected = expected.T
    total = torch.zeros(expected.shape)
    precision.add_bf16_product(Call(kind, nn.Identity(), {}, inputs, positions, grad=grad), drop, scale, total)
    assert torch.isfinite(total).all()
    assert (total.double() - expected).norm() <= 1e-6 * expected.norm()
    unrounded = torch.einsum("m,moi->oi", scale.double().reshape(m), per_example)
    if kind == "conv1d":
        unrounded = unrounded.T
    assert (unrounded - expected).norm() > 1e-4 * expected.norm()  # the test tells the two factors apart

    bound = 0.5
    for i in range(m):
        if drop[i]:
            continue
        norm = per_example[i].norm().item()
        c = torch.tensor(min(1.0, bound * (1 - 4 * 2.0**-24) / norm), dtype=torch.float32).reshape(1, 1, 1)
        one = torch.zeros(expected.shape)
        call = Call(kind, nn.Identity(), {}, inputs[i : i + 1], positions, grad=grad[i : i + 1])
        precision.add_bf16_product(call, c == 0, c, one)
        assert (_floor_bf16(c).item() * per_example[i]).norm().item() <= bound
        assert one.double().norm().item() <= bound
        assert one.double().norm().item() >= min(norm, bound) * (1 - 2.0**-7) * (1 - 1e-5)


def test_product_norm_error_is_the_stated_bound():
    eps = 2.0**-23
    gamma = 512 * eps / (1 - 512 * eps)
    assert precision.summation_error(512) == pytest.approx(gamma, rel=1e-12)
    assert precision.product_norm_error(512, factors=torch.bfloat16, precision="tf32") == pytest.approx(
        gamma, rel=1e-12
    )
    assert precision.product_norm_error(512, factors=torch.float32, precision="ieee") == pytest.approx(
        (1 + eps) * (1 + gamma) - 1, rel=1e-12
    )
    tf32 = precision.product_error("tf32")
    assert precision.product_norm_error(512, factors=torch.float32, precision="tf32") == pytest.approx(
        (1 + tf32) * (1 + gamma) - 1, rel=1e-12
    )
    assert precision.summation_error(2**23) == math.inf


def test_the_parts_stay_exact_when_compiled():
    """Inductor keeps a value that a kernel stores in bf16 and reads back in float32 (a split by rounding through
    bf16 then loses its low part, and the sum its exactness); the parts are formed by integer masking and exact
    float32 arithmetic instead, so the compiled split is the eager one, bit for bit, and exact."""
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(16, 8, 32, generator=gen).to(torch.bfloat16)
    scale, drop = torch.rand(16, 1, 1, generator=gen), torch.zeros(16, 1, 1, dtype=torch.bool)
    eager = precision.bf16_scaled_parts(g, scale, drop)
    compiled = torch.compile(precision.bf16_scaled_parts, fullgraph=True)(g, scale, drop)
    assert torch.equal(compiled, eager)
    exact = g.double() * _floor_bf16(scale)
    assert torch.equal(compiled[..., :32].double() + compiled[..., 32:].double(), exact)
    assert compiled[..., 32:].any()  # the low parts carry bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_spread_bounds_its_float64_value(dtype):
    """``S_i = sum_t ||g_t|| ||a_t||``, from row norms taken in float32 (float64 for float64 factors), products in
    their dtype and a float64 sum, is at least its float64 value for every one of 256 examples, and within 5e-5 of it
    (the bounds of the two float32 norms: about 150 roundings of 2^-23 here). Roundings go either way: without the
    stated rounding bounds the bf16, float16 and float32 cases fail (some examples fall below)."""
    gen = torch.Generator().manual_seed(0)
    m, positions, out, width = 256, 64, 96, 200
    g = (torch.randn(m, positions, out, generator=gen, dtype=torch.float64) * 3).to(dtype)
    a = torch.rand(m, positions, width, generator=gen, dtype=torch.float64).to(dtype)
    exact = (g.double().norm(dim=-1) * a.double().norm(dim=-1)).sum(dim=1)
    sums, rounding = ghost._spread(ghost._row_norms(g), ghost._row_norms(a), out, width)
    spread = sums * rounding
    assert spread.dtype == torch.float64
    assert bool((spread >= exact).all())
    assert float((spread / exact).max()) < 1 + 5e-5


def test_bounds_finish_the_same_alone_and_together():
    """A chunk finishes its calls' bounds together, a group of equal numbers at a time: each row equals the bound
    finished alone, bit for bit, and the stated formula ``(rounding sqrt(squares) + (alpha + margin) spread_rounding
    spread)^2`` in float64; a spread whose bound reaches the limit reports an infinite norm, and a NaN stays NaN (its
    example is dropped)."""
    gen = torch.Generator().manual_seed(0)
    squares, spread = torch.rand(3, 6, generator=gen, dtype=torch.float64), torch.rand(3, 6, generator=gen).double()
    squares[1, 2], spread[1, 2] = float("nan"), 0.1  # a NaN below the limit
    bounds = [
        ghost.Bound(squares[0], 1.0 + 1e-5, spread[0], 1.0 + 2e-5, 3e-3),
        ghost.Bound(squares[1], 1.0, spread[1], 1.0 + 1e-5, 7e-4, limit=0.5, margin=2e-4),
        ghost.Bound(squares[2], 1.0 + 3e-6, spread[2], 1.0, 0.0),
    ]
    together = torch.stack(ghost.finish([*bounds, bounds[0]]))  # the first twice: a group of two
    assert torch.equal(together[3], together[0])
    together = together[:3]
    alone = torch.stack([ghost.finish([b])[0] for b in bounds])
    assert torch.equal(together.isnan(), alone.isnan())
    finite = ~together.isnan()
    assert torch.equal(together[finite], alone[finite])
    for row, b in zip(together, bounds, strict=True):
        expected = (b.squares.sqrt() * b.rounding + (b.alpha + b.margin) * b.spread_rounding * b.spread).square()
        expected = torch.where(b.spread * b.spread_rounding >= b.limit, torch.inf, expected)
        torch.testing.assert_close(row, expected, rtol=1e-15, atol=0, equal_nan=True)
    assert bool(together[1].isinf().any()) and bool(together[1, 2].isnan())
