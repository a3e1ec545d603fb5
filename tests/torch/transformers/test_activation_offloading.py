"""Activation offloading (``activation_offloading=True``): a run whose saved activations make a round trip through
another buffer ends bit for bit where the run without it ends, for both engines, with and without gradient
checkpointing; the copies really happen (the layerwise engine's forward activations, the inputs a checkpointed layer
keeps, under vmap(grad) too), never to the weights, and the recompute of a checkpointed layer keeps its activations
where they are. On a CUDA device the saved tensors are in pinned host memory while the backward waits.

On a CPU run host memory is the device's, so :func:`opake_torch.offloading.to_host` returns a tensor as it is; the
tests replace it with a copy into a new buffer that records what it copied, so that a tensor restored from the wrong
copy, or not restored, changes the result."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_hf import VOCAB, tiny_model, token_data
from torch.func import grad, vmap
from torch.nn.utils.stateless import _reparametrize_module
from transformers import LlamaConfig, LlamaForCausalLM

from opake_core.errors import ConfigurationError
from opake_torch import offloading
from opake_torch.patches.activation_checkpointing import checkpoint_layer
from opake_torch.transformers import DPTrainer, TrainingArguments

DATA = token_data(24)
LAYERS = 2


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=16, intermediate_size=40,
                         num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def _args(tmp_path, **kw) -> TrainingArguments:
    base = {
        "per_device_train_batch_size": 8,
        "microbatch_size": 4,
        "max_steps": 2,
        "privacy_noise_multiplier": 1.0,
        "privacy_noise_seed": 5,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
        "learning_rate": 1e-2,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


class _Copies:
    """Stands in for :func:`offloading.to_host`: a copy into a new buffer, and the shape of what it copied."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.storages: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        if not torch._C._functorch.is_functorch_wrapped_tensor(x):
            self.storages.append(x.untyped_storage().data_ptr())
        return x.clone()


def test_the_weights_are_saved_as_they_are(monkeypatch):
    """``OffloadedGradients`` copies what the pass saves except the tensors of its arguments that are not batched
    (the parameters): ``x @ w`` saves ``w`` (for the gradient of ``x``), which stays; ``sin`` saves its input, which
    moves; the gradient is the same."""
    copies = _Copies()
    monkeypatch.setattr(offloading, "to_host", copies)
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    x = torch.randn(4, 3, dtype=torch.float64)

    def inner(example_grad, args, batch_argnums):
        xi = args[1].clone().requires_grad_(True)
        (xi @ args[0]["w"]).sin().sum().backward()
        return xi.grad, None

    ours, _ = offloading.OffloadedGradients(inner)(None, (params, x), (1,))
    assert copies.shapes == [(4, 5)]  # the product, not the weight
    assert params["w"].untyped_storage().data_ptr() not in copies.storages
    assert torch.equal(ours, inner(None, (params, x), (1,))[0])


def _train(tmp_path, **kw) -> tuple[dict[str, torch.Tensor], DPTrainer]:
    trainer = DPTrainer(_llama(), _args(tmp_path, **kw), train_dataset=DATA)
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, trainer


CASES = [("layerwise", False), ("layerwise", True), ("vmap", True)]


@pytest.mark.parametrize(("engine", "checkpointing"), CASES)
def test_offloaded_run_equals_the_run_without_it(tmp_path, monkeypatch, engine, checkpointing):
    common = {"per_example_gradients": engine, "gradient_checkpointing": checkpointing}
    plain, _ = _train(tmp_path / "plain", **common)
    copies = _Copies()
    monkeypatch.setattr(offloading, "to_host", copies)
    offloaded, trainer = _train(tmp_path / "offloaded", activation_offloading=True, **common)
    assert trainer.per_example_gradients_engine == engine
    assert copies.shapes, "nothing was offloaded"
    if engine == "layerwise" and not checkpointing:  # the MLP's activations [m, T, intermediate] among them
        assert any(len(s) == 3 and s[-1] == 40 for s in copies.shapes), copies.shapes
    if checkpointing:  # every checkpointed layer's hidden states [m, T, hidden] (under vmap: [1, T, hidden])
        hidden = sum(1 for s in copies.shapes if len(s) == 3 and s[-1] == 16)
        assert hidden >= LAYERS, copies.shapes
    for name, value in plain.items():
        assert torch.equal(offloaded[name], value), name
    assert not torch.equal(offloaded["model.embed_tokens.weight"], _llama().model.embed_tokens.weight)  # it trained


def test_the_recompute_of_a_checkpointed_layer_keeps_its_activations(tmp_path, monkeypatch):
    """Under the layerwise engine with checkpointing every layer's recompute runs in the backward, inside the hooks
    that offload the pass; its activations, read at once, are not copied."""
    copies = _Copies()
    monkeypatch.setattr(offloading, "to_host", copies)
    inside: list[int] = []  # per recompute: the copies made while it ran
    original = offloading.on_device

    @contextlib.contextmanager
    def watched():
        before = len(copies.shapes)
        with original():
            yield
        inside.append(len(copies.shapes) - before)

    monkeypatch.setattr(offloading, "on_device", watched)
    _train(
        tmp_path,
        activation_offloading=True,
        per_example_gradients="layerwise",
        gradient_checkpointing=True,
        max_steps=1,
    )
    assert len(inside) >= LAYERS and copies.shapes  # every layer recomputed, and the pass offloaded
    assert inside == [0] * len(inside)


def test_a_checkpointed_call_offloads_its_inputs_once_under_vmap_grad(monkeypatch):
    """Under ``vmap(grad)`` the recompute's Function copies each tensor of the call once per application (functorch
    runs its setup at the levels below grad too, where nothing is kept for a backward), never the weights, and
    restores them for the backward: the per-example gradients equal those of the function without checkpointing."""
    copies = _Copies()
    monkeypatch.setattr(offloading, "to_host", copies)
    layer = torch.nn.Linear(4, 4)
    x, scale = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    layer.double()

    def f(w, b, xi):
        with _reparametrize_module(layer, {"weight": w, "bias": b}):
            return checkpoint_layer(layer, lambda h, s: torch.tanh(layer(h) * s), xi, scale, offload=True).sum()

    def g(w, b, xi):
        return torch.tanh((xi @ w.T + b) * scale).sum()

    w, b = layer.weight.detach(), layer.bias.detach()
    ours = vmap(grad(f, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    ref = vmap(grad(g, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    assert copies.shapes == [(5, 4), (5, 1)]  # the example's input and the scale, once each; no weight
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-12, rtol=0)


class _Pinned:
    """Wraps :func:`offloading.to_host` and records where each copy it returns lives."""

    def __init__(self) -> None:
        self.inner, self.seen = offloading.to_host, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        host = self.inner(x)
        physical = host  # under vmap, the batched wrapper's tensor (is_pinned has no batching rule)
        while torch._C._functorch.is_functorch_wrapped_tensor(physical):
            physical = torch._C._functorch.get_unwrapped(physical)
        self.seen.append((physical.device.type, physical.is_pinned()))
        return host


@pytest.mark.cuda
def test_saved_tensors_wait_in_pinned_host_memory_on_cuda(monkeypatch):
    pinned = _Pinned()
    monkeypatch.setattr(offloading, "to_host", pinned)
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, 64, device="cuda")
    with offloading.saved_on_host(keep=[w]):
        y = (x @ w).sin().sum()
    y.backward()
    expected = torch.autograd.grad((x @ w).sin().sum(), x)[0]
    assert pinned.seen and all(seen == ("cpu", True) for seen in pinned.seen)
    assert torch.equal(x.grad, expected)


@pytest.mark.cuda
def test_a_checkpointed_call_under_vmap_grad_offloads_to_pinned_memory_on_cuda(monkeypatch):
    pinned = _Pinned()
    monkeypatch.setattr(offloading, "to_host", pinned)
    layer = torch.nn.Linear(4, 4).cuda()
    x = torch.randn(3, 5, 4, device="cuda")

    def f(w, b, xi, offload):
        with _reparametrize_module(layer, {"weight": w, "bias": b}):
            return checkpoint_layer(layer, lambda h: torch.tanh(layer(h)), xi, offload=offload).sum()

    w, b = layer.weight.detach(), layer.bias.detach()
    ours = vmap(grad(f, argnums=(0, 1)), in_dims=(None, None, 0, None))(w, b, x, True)
    plain = vmap(grad(f, argnums=(0, 1)), in_dims=(None, None, 0, None))(w, b, x, False)
    assert pinned.seen == [("cpu", True)]
    for a, r in zip(ours, plain, strict=True):
        assert torch.equal(a, r)


def test_vmap_without_checkpointing_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match=r"needs gradient_checkpointing=True .* torch\.func\.grad refuses"):
        _args(tmp_path, activation_offloading=True, per_example_gradients="vmap")

    # 'auto' that falls back to vmap(grad) (a per-example loss of its own, which the layerwise engine cannot run)
    # refuses before the first step
    class OwnLoss(DPTrainer):
        def compute_per_example_loss(self, params, example):
            return super().compute_per_example_loss(params, example)

    trainer = OwnLoss(tiny_model("llama"), _args(tmp_path, activation_offloading=True), train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="needs gradient_checkpointing=True"):
        trainer.train()


@pytest.mark.parametrize(("knob", "message"), [({"torch_compile": True}, "torch_compile"),
                                               ({"cuda_graphs": 2}, "cuda_graphs=2")])  # fmt: skip
def test_compiled_or_captured_chunks_are_refused(tmp_path, knob, message):
    with pytest.raises(ConfigurationError, match=f"activation_offloading=True is incompatible with {message}"):
        _args(tmp_path, activation_offloading=True, **knob)
