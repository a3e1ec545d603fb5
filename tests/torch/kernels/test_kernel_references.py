"""CPU tests of the performance kernels: the torch references against plain formulas (also under vmap(grad)), the
CPU fallback of every public kernel, the LoRA functions (pure torch, so they run here), the CPU path of the fused
clip-and-sum against the core engine, and the dispatch of the performance patches (a no-op with a logged reason on
CPU)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from opake_core.clipping import MaterializedGradients
from opake_core.clipping.rules import ClipRule, bounds_on
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import per_group as per_group_of
from opake_torch.patches import applied_patches, apply_runtime_patches, performance
from opake_torch.patches import kernels as K
from opake_torch.patches.kernels import clip_sum
from opake_torch.patches.kernels import reference as R


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _per_example_loop(loss, params, *batch):
    """Per-example gradients by a Python loop over examples (the definition vmap(grad) must match)."""
    out = []
    for i in range(batch[0].shape[0]):
        out.append(torch.func.grad(loss)(params, *(b[i] for b in batch)))
    return torch.stack(out)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- references against plain formulas -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 7, 33), (1, 1, 1)])
def test_rms_norm_reference_is_the_formula(shape):
    x, w = torch.randn(shape), torch.randn(shape[-1])  # the reference computes in float32, like LlamaRMSNorm
    x64, w64 = x.double(), w.double()
    expected = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(R.rms_norm(x, w, 1e-6).double(), expected, rtol=1e-6, atol=1e-6)


def test_rms_norm_reference_casts_like_llama():
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(8, eps=1e-5).to(torch.bfloat16)
    module.weight.data.copy_(w)
    assert torch.equal(R.rms_norm(x, w, 1e-5), module(x))


def test_fused_add_rms_norm_reference_is_the_add_then_the_norm():
    x, res, w = torch.randn(3, 5, 12), torch.randn(3, 5, 12), torch.randn(12)
    y, h = R.fused_add_rms_norm(x, res, w, 1e-6)
    h64 = x.double() + res.double()
    expected = w.double() * h64 / torch.sqrt(h64.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(h.double(), h64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)
    xb, rb = x.bfloat16(), res.bfloat16()  # the sum is rounded to the input dtype before the norm, as in the layer
    assert torch.equal(R.fused_add_rms_norm(xb, rb, w.bfloat16())[1], rb + xb)


def test_activation_references_are_the_formulas():
    g, u = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
    torch.testing.assert_close(R.swiglu(g, u), g / (1 + torch.exp(-g)) * u)
    torch.testing.assert_close(R.geglu(g, u), 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u)
    tanh = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    torch.testing.assert_close(R.geglu(g, u, "tanh"), tanh * u)


def test_rope_reference_rotates_pairs_and_keeps_norms():
    b, h, s, d = 2, 3, 5, 8
    q, k = torch.randn(b, h, s, d, dtype=torch.float64), torch.randn(b, 1, s, d, dtype=torch.float64)
    angle = torch.randn(b, s, d // 2, dtype=torch.float64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rq, rk = R.rope(q, k, cos, sin)
    half = d // 2
    c, sn = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
    expected = torch.cat([q[..., :half] * c - q[..., half:] * sn, q[..., half:] * c + q[..., :half] * sn], -1)
    torch.testing.assert_close(rq, expected)
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))


def test_cross_entropy_reference_means_over_kept_tokens():
    logits, target = torch.randn(2, 6, 11, dtype=torch.float64), torch.randint(0, 11, (2, 6))
    target[0, :3] = -100
    per_token = torch.logsumexp(logits, -1) - logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = torch.where(target == -100, 0.0, per_token)
    torch.testing.assert_close(R.cross_entropy(logits, target, reduction="none"), per_token.float())
    torch.testing.assert_close(R.cross_entropy(logits, target), per_token.float().sum() / 9)
    assert R.cross_entropy(logits, torch.full_like(target, -100)).item() == 0.0
    hidden, weight = torch.randn(2, 6, 4), torch.randn(11, 4)
    torch.testing.assert_close(
        R.fused_linear_cross_entropy(hidden, weight, target), R.cross_entropy(hidden @ weight.T, target)
    )


def test_lora_references_are_the_formulas():
    x, w, a, b, bias = torch.randn(3, 5, 8), torch.randn(6, 8), torch.randn(2, 8), torch.randn(6, 2), torch.randn(6)
    torch.testing.assert_close(R.lora_w(x, w, a, b, 0.5, bias), x @ w.T + bias + 0.5 * (x @ a.T) @ b.T)


# --- references under vmap(grad) --------------------------------------------------------------------------------------


def test_references_give_per_example_gradients_under_vmap():
    x, w = torch.randn(4, 5, 12, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    target = torch.randint(0, 12, (4, 5))

    def loss(w, x, t):
        h = R.rms_norm(x, w)
        return R.cross_entropy(R.swiglu(h, h.flip(-1)), t)

    batched = vmap(grad(loss), in_dims=(None, 0, 0))(w, x, target)
    torch.testing.assert_close(batched, _per_example_loop(loss, w, x, target))


# --- the public kernels fall back to the references on CPU -----------------------------------------------------------


def test_available_is_false_without_cuda():
    assert K.available() is False


def test_public_kernels_fall_back_to_the_reference_on_cpu():
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    assert torch.equal(K.opake_rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5))
    fused, fused_ref = K.opake_fused_add_rms_norm(x, x.flip(0), w, 1e-5), R.fused_add_rms_norm(x, x.flip(0), w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(fused, fused_ref, strict=True))
    assert torch.equal(K.opake_swiglu(x, x.flip(-1)), R.swiglu(x, x.flip(-1)))
    assert torch.equal(K.opake_geglu(x, x, "tanh"), R.geglu(x, x, "tanh"))
    q, cos = torch.randn(2, 2, 3, 8), torch.randn(2, 3, 8)
    assert all(torch.equal(a, b) for a, b in zip(K.opake_rope(q, q, cos, cos), R.rope(q, q, cos, cos), strict=True))
    target = torch.randint(0, 8, (2, 3))
    assert torch.equal(K.opake_cross_entropy_loss(x, target), R.cross_entropy(x, target))
    weight = torch.randn(5, 8)
    assert torch.equal(
        K.opake_fused_linear_cross_entropy(x, weight, target.clamp(max=4)),
        R.fused_linear_cross_entropy(x, weight, target.clamp(max=4)),
    )


def test_public_kernels_refuse_bad_arguments():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="approximate"):
        K.opake_geglu(x, x, "erf")
    with pytest.raises(ValueError, match="reduction"):
        K.opake_cross_entropy_loss(x, torch.zeros(2, dtype=torch.long), reduction="avg")


# --- LoRA (pure torch Functions: they run here) -----------------------------------------------------------------------


def _projection(d_in, d_out, rank, bias, dtype=torch.float64):
    return K.LoRAProjection(
        torch.randn(d_out, d_in, dtype=dtype),
        torch.randn(rank, d_in, dtype=dtype),
        torch.randn(d_out, rank, dtype=dtype),
        torch.randn(d_out, dtype=dtype) if bias else None,
    )


@pytest.mark.parametrize("bias", [False, True])
def test_lora_w_matches_the_reference_per_example(bias):
    p = _projection(7, 5, 3, bias)
    x = torch.randn(4, 6, 7, dtype=torch.float64)

    def loss(fn):
        return lambda ab, x: fn(x, p.weight, ab[0], ab[1], 0.7, p.bias).sin().sum()

    torch.testing.assert_close(K.opake_lora_w(x, *p[:3], 0.7, p.bias), R.lora_w(x, *p[:3], 0.7, p.bias))
    ours = vmap(grad(loss(K.opake_lora_w)), in_dims=(None, 0))((p.lora_A, p.lora_B), x)
    ref = vmap(grad(loss(R.lora_w)), in_dims=(None, 0))((p.lora_A, p.lora_B), x)
    for a, b in zip(ours, ref, strict=True):
        assert a.shape[0] == 4
        torch.testing.assert_close(a, b)


def test_lora_w_gives_base_weight_and_input_gradients_when_asked():
    p = _projection(7, 5, 3, True)
    x = torch.randn(6, 7, dtype=torch.float64)
    for fn in (K.opake_lora_w, R.lora_w):
        args = [t.clone().requires_grad_() for t in (x, *p[:3], p.bias)]
        fn(args[0], args[1], args[2], args[3], 0.3, args[4]).square().sum().backward()
        if fn is K.opake_lora_w:
            ours = [a.grad for a in args]
        else:
            for a, b in zip(ours, [a.grad for a in args], strict=True):
                torch.testing.assert_close(a, b)


def test_lora_mlp_matches_the_reference_per_example():
    gate, up, down = _projection(8, 12, 2, False), _projection(8, 12, 4, False), _projection(12, 8, 2, True)
    x = torch.randn(3, 5, 8, dtype=torch.float64)

    def mlp_loss(fn, activation):
        def loss(adapters, x):
            projections = [p._replace(lora_A=a, lora_B=b) for p, (a, b) in zip((gate, up, down), adapters, strict=True)]
            return fn(x, *projections, 0.5, activation).sin().sum()

        return loss

    adapters = [(p.lora_A, p.lora_B) for p in (gate, up, down)]
    for activation in ("silu", "gelu", "gelu_tanh"):
        ours = vmap(grad(mlp_loss(K.opake_lora_mlp, activation)), in_dims=(None, 0))(adapters, x)
        ref = vmap(grad(mlp_loss(R.lora_mlp, activation)), in_dims=(None, 0))(adapters, x)
        torch.testing.assert_close(ours, ref)


# --- clip-and-sum -----------------------------------------------------------------------------------------------------


def _grads(m):
    grads = [torch.randn(m, 3, 4) * 2, torch.randn(m, 5, dtype=torch.float64), torch.randn(m, 7).to(torch.bfloat16)]
    grads[0][1, 0, 0] = float("nan")
    grads[2][2, 3] = float("inf")
    return grads


def _clip(form, grads, bound, params):
    """The core rule's clipped sum of ``grads`` held as ``form``: (sums, norms)."""
    rule, floats = ClipRule.of(params, bound)
    sums, norms, _ = rule(form(grads), list(params.values()), bounds_on(floats, torch.device("cpu")), None)
    return sums, norms


_PARAMS = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64), "c": torch.zeros(7, dtype=torch.bfloat16)}


@pytest.mark.parametrize("per_group", [False, True])
def test_fused_gradients_on_cpu_are_the_core_engine(per_group):
    grads = _grads(5)
    bound = per_group_of(_PARAMS, {"^a$": 1.5, "^b$": 0.25, "^c$": 1.5}) if per_group else 1.5
    engine_sums, engine_norms = _clip(MaterializedGradients, grads, bound, _PARAMS)
    sums, norms = _clip(clip_sum.FusedGradients, grads, bound, _PARAMS)
    for ours, theirs in zip(sums, engine_sums, strict=True):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(norms, engine_norms, rtol=0, atol=0, equal_nan=True)


def test_fused_gradients_never_exceed_the_bound_and_drop_non_finite_examples():
    grads = _grads(5)
    for i in range(5):
        sums, _ = _clip(clip_sum.FusedGradients, [g[i : i + 1] for g in grads], 0.5, _PARAMS)
        total = math.sqrt(sum(s.double().square().sum().item() for s in sums))
        assert total <= 0.5
        if i in (1, 2):
            assert total == 0.0


def test_fused_clip_and_sum_is_not_selected_on_cpu():
    grads = _grads(3)
    sums = [torch.zeros(g.shape[1:]) for g in grads]
    assert not clip_sum.fused_supported(grads, sums)


# --- performance patches ---------------------------------------------------------------------------------------------


def test_resolve_refuses_unknown_kernels_and_non_bools():
    with pytest.raises(ConfigurationError, match="unknown kernels"):
        performance.resolve_performance_kernels(True, {"flash": True})
    with pytest.raises(InputTypeError):
        performance.resolve_performance_kernels(True, {"rope": 1})
    with pytest.raises(InputTypeError):
        performance.resolve_performance_kernels("yes")


def test_patches_are_a_no_op_with_a_logged_reason_on_cpu(caplog):
    from tiny_hf import tiny_model

    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="opake_torch.patches.performance"):
        assert performance.apply_performance_kernels(model) == []
    assert "performance kernels off" in caplog.text
    with caplog.at_level(logging.WARNING, logger="opake_torch.patches.performance"):
        assert performance.apply_performance_kernels(model, use_performance_kernels=True) == []
    assert "cannot run here" in caplog.text
    assert applied_patches(model) == ()


def test_switches_turn_kernels_off(monkeypatch):
    monkeypatch.setattr(performance, "available", lambda: True)
    switches = performance.resolve_performance_kernels(None, {"fused_linear_cross_entropy": False})
    assert switches["fused_linear_cross_entropy"] is False and switches["rms_norm"] is True
    assert not any(performance.resolve_performance_kernels(False, {"rope": True}).values())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_patched_model_computes_the_same_function(monkeypatch, family):
    """With the kernels forced on (they fall back to the references on CPU), a patched model's per-example
    gradients equal the unpatched model's: the dispatch and the patched forwards are correct."""
    from tiny_hf import tiny_model

    monkeypatch.setattr(performance, "available", lambda: True)
    model = tiny_model(family).double()
    ids = torch.randint(0, 48, (3, 6))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, ids):
        out = torch.func.functional_call(model, params, (ids.unsqueeze(0),))
        return F.cross_entropy(out.logits[0, :-1], ids[1:])

    before = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    applied = performance.apply_performance_kernels(model, performance_kernels_config={"fused_add_rms_norm": True})
    assert {"rms_norm", "fused_add_rms_norm", "activation"} <= set(applied)
    assert "fused_add_rms_norm" not in performance.apply_performance_kernels(tiny_model(family))  # opt-in
    assert any(a.startswith("rope:") for a in applied)
    assert (
        performance.apply_performance_kernels(model, performance_kernels_config={"fused_add_rms_norm": True}) == applied
    )
    with apply_runtime_patches(performance.runtime_patches(applied)):  # the family's RoPE kernel, for this scope
        after = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    for name in before:
        torch.testing.assert_close(after[name], before[name], msg=name)


def _tiny_decoder(family: str) -> torch.nn.Module:
    """A two-layer float64 decoder of ``family`` (the fused add feeds the next layer's residual stream)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    for name, p in model.named_parameters():
        if "layernorm" in name:  # away from the initial ones, so that a wrong weight gradient shows
            p.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_fused_add_rms_norm_patch_computes_the_same_per_example_gradients(monkeypatch, family):
    """Only the fused add + RMSNorm patch on (falling back to the reference on CPU): every decoder layer takes the
    fused path, and the per-example gradients of every parameter equal the unpatched model's."""
    monkeypatch.setattr(performance, "available", lambda: True)
    model = _tiny_decoder(family)
    ids = torch.randint(0, 48, (3, 7))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, ids):
        out = torch.func.functional_call(model, params, (ids.unsqueeze(0),))
        return F.cross_entropy(out.logits[0, :-1], ids[1:])

    before = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    only = {name: name == "fused_add_rms_norm" for name in performance.KERNELS}
    assert performance.apply_performance_kernels(model, performance_kernels_config=only) == ["fused_add_rms_norm"]
    calls = []
    fused = performance.opake_fused_add_rms_norm
    monkeypatch.setattr(performance, "opake_fused_add_rms_norm", lambda *a: calls.append(1) or fused(*a))
    after = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    assert len(calls) == model.config.num_hidden_layers
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=1e-10, atol=1e-12, msg=name)


def test_fused_add_rms_norm_patch_lets_hooks_on_the_norm_see_it(monkeypatch):
    """A forward hook on the post-attention norm (the layerwise engine reads the norm's input there) makes the
    patched layer run the stock forward, so the hook sees the call; the output is unchanged."""
    monkeypatch.setattr(performance, "available", lambda: True)
    model = _tiny_decoder("llama")
    ids = torch.randint(0, 48, (2, 5))
    expected = model(ids).logits
    only = {name: name == "fused_add_rms_norm" for name in performance.KERNELS}
    performance.apply_performance_kernels(model, performance_kernels_config=only)
    seen = []
    handle = model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-12, atol=1e-12)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (2, 5, 16)


def test_fused_add_rms_norm_patch_keeps_the_layerwise_clipped_sum(monkeypatch):
    """The layerwise engine, whose hooks read the norm layers, on a model with the fused patch: its clipped sum
    (every example clipped) equals a float64 loop over examples on the unpatched model, leaf by leaf (the
    post-attention norm weight's share of an example's squared norm is about 4e-8: the norms alone would not show
    it missing)."""
    from tiny_hf import functional_losses, tiny_model

    from opake_core.clipping import Engine, clipped_grad
    from opake_torch.layerwise import LayerwiseGradients

    monkeypatch.setattr(performance, "available", lambda: True)
    model = tiny_model("llama").double()
    params, loss, batch_loss, batch = functional_losses(model, "llama")
    bound = 0.05
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(next(iter(batch.values())).shape[0]):
        g = grad(loss)(params, {k: v[i] for k, v in batch.items()})
        norm = math.sqrt(sum(v.square().sum().item() for v in g.values()))
        for k in expected:
            expected[k] += g[k] * min(1.0, bound / norm)
    only = {name: name == "fused_add_rms_norm" for name in performance.KERNELS}
    assert performance.apply_performance_kernels(model, performance_kernels_config=only) == ["fused_add_rms_norm"]
    grad_fn, state = clipped_grad(
        loss, clipping_norm=bound, batch_argnums=1, engine=Engine(gradients=LayerwiseGradients(model, batch_loss))
    )
    clipped, _ = grad_fn(params, batch, state=state)
    for name in expected:
        assert _rel(clipped.value[name], expected[name]) < 1e-9, name


def test_patched_lora_model_computes_the_same_function(monkeypatch):
    peft = pytest.importorskip("peft")
    from tiny_hf import tiny_model

    monkeypatch.setattr(performance, "available", lambda: True)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    )
    model = peft.get_peft_model(tiny_model("llama").double(), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    ids = torch.randint(0, 48, (2, 5))
    trainable = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss(trainable, ids):
        out = torch.func.functional_call(model, trainable, (ids.unsqueeze(0),), strict=False)
        return F.cross_entropy(out.logits[0, :-1], ids[1:])

    before = vmap(grad(loss), in_dims=(None, 0))(trainable, ids)
    assert "lora" in performance.apply_performance_kernels(model)
    after = vmap(grad(loss), in_dims=(None, 0))(trainable, ids)
    for name in before:
        torch.testing.assert_close(after[name], before[name], msg=name)
