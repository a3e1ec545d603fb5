"""Qwen3-Next and Qwen3.5-MoE (gated delta-net linear attention, full attention, experts with a shared expert):
per-example norms and clipped sums of the layerwise engine and of ``vmap(grad)`` against a float64 loop of
single-record backwards, with and without gradient checkpointing; the refusal of a conv weight used out of the
engine's sight; the switch to Hugging Face's torch reference path; private training with DPTrainer."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import padded_batch, tiny_gated_deltanet, token_data

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, unsupported_parameters
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.compat import reference_kernels
from opake_torch.patches.families import apply_family_patches
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.loss import batch_losses, per_example_loss

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
C = 2.5
# A_log, dt_bias (elementwise), the depthwise conv, the gated norm, the zero-centred (1 + weight) norms
OWN = (".linear_attn.A_log", ".linear_attn.dt_bias", ".linear_attn.conv1d.weight", ".linear_attn.norm.weight",
       ".self_attn.q_norm.weight", "model.norm.weight")  # fmt: skip


def _single_record_loop(model_type: str, params: dict, data: dict) -> tuple[dict, list[float]]:
    """sum_i min(1, C/||g_i||) g_i and the norms ||g_i||, where g_i is the plain autograd backward of example i's loss
    alone, on a float64 model of the same weights without patches or checkpointing (its cache on, as shipped)."""
    model = tiny_gated_deltanet(model_type, torch.float64)
    apply, _, frozen = functional_model(model)
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(data["input_ids"].shape[0]):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        loss = per_example_loss(apply, leaves, frozen, {k: v[i] for k, v in data.items()}, task="causal_lm")
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
        norms.append(math.sqrt(sum(float(g.square().sum()) for g in grads.values())))
        for k in total:
            total[k] += min(1.0, C / norms[-1]) * grads[k]
    return total, norms


def _clipped(model: torch.nn.Module, engine: Engine | None) -> tuple[dict, torch.Tensor, dict]:
    apply, params, frozen = functional_model(model)

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def losses(p, batch):
        return batch_losses(apply, p, frozen, batch, task="causal_lm")

    if engine is None:
        engine = Engine(gradients=LayerwiseGradients(model, losses))
    grad_fn, state = clipped_grad(loss, clipping_norm=C, batch_argnums=1, microbatch_size=2,
                                  return_diagnostics=True, engine=engine)  # fmt: skip
    (clipped, diagnostics), _ = grad_fn(params, padded_batch(), state=state)
    return clipped.value, diagnostics.norms, params


def _assert_close(clipped: dict, norms: torch.Tensor, reference: dict, expected: list[float], rtol: float) -> None:
    # the diagnostics hold the norms rounded to float32: equal up to one rounding of each
    eps = torch.finfo(norms.dtype).eps
    torch.testing.assert_close(norms, torch.tensor(expected, dtype=norms.dtype), rtol=max(rtol, eps), atol=0)
    assert min(expected) < C < max(expected)  # some examples clipped, some not
    for name, value in reference.items():
        assert float((clipped[name] - value).norm()) <= rtol * float(value.norm()), name
    for suffix in OWN:  # the new layer kinds carry gradient (the comparison above is not with zeros)
        assert any(name.endswith(suffix) and float(value.norm()) > 0 for name, value in reference.items()), suffix


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_layerwise_norms_and_clipped_sum_equal_a_single_record_loop(model_type, checkpointing, monkeypatch) -> None:
    """Every parameter trained, float64: the layerwise engine's per-example norms and clipped sum equal those of
    single-record backwards to 1e-10. Checkpointed decoder layers keep nothing in the forward and are tapped in
    their recompute (counted)."""
    from opake_torch.patches import activation_checkpointing as ckpt

    recomputes = []
    plain = ckpt._plain_recompute
    monkeypatch.setattr(ckpt, "_plain_recompute", lambda *a: recomputes.append(1) or plain(*a))
    apply_runtime_patches()
    model = tiny_gated_deltanet(model_type, torch.float64)
    layers = ckpt.enable_vmap_checkpointing(model) if checkpointing else 0
    _, params, _ = functional_model(model)
    assert unsupported_parameters(model, params) == []
    clipped, norms, params = _clipped(model, None)
    reference, expected = _single_record_loop(model_type, params, padded_batch())
    _assert_close(clipped, norms, reference, expected, rtol=1e-10)
    assert len(recomputes) == 3 * layers  # each checkpointed layer once in each chunk and in the coupling check
    assert not any("forward" in vars(m) for m in model.modules())  # no forward left replaced


@pytest.mark.parametrize("model_type", FAMILIES)
def test_vmap_norms_and_clipped_sum_equal_a_single_record_loop(model_type) -> None:
    """``vmap(grad)`` with the family patch (no in-place cache write, the torch reference path inside the
    transform). Hugging Face runs the gated delta rule in float32 whatever the model's dtype, and vmap batches its
    float32 matmuls otherwise than a single record: 8 float32 unit roundoffs, relative."""
    apply_runtime_patches()
    model = tiny_gated_deltanet(model_type, torch.float64)
    assert apply_family_patches(model) == ["gated_deltanet"]
    clipped, norms, params = _clipped(model, Engine())
    reference, expected = _single_record_loop(model_type, params, padded_batch())
    _assert_close(clipped, norms, reference, expected, rtol=8 * torch.finfo(torch.float32).eps)


def _modeling(model: torch.nn.Module) -> types.ModuleType:
    return sys.modules[type(model).__module__]


@pytest.mark.parametrize(
    "kernel",
    [
        lambda x, weight, bias=None, activation=None, **kw: F.silu(
            F.conv1d(x, weight.contiguous().unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
        )[..., : x.shape[-1]],
        lambda x, weight, bias=None, activation=None, **kw: F.silu(x),
    ],
    ids=["weight through an op it does not follow", "weight never meets the batch"],
)
def test_a_conv_weight_used_out_of_sight_is_refused(kernel, monkeypatch) -> None:
    """A stand-in for causal-conv1d's CUDA kernel, which takes the conv weight where the engine cannot follow it:
    refused (it would otherwise leave the weight's gradient unformed), not trained with a zero gradient."""
    apply_runtime_patches()
    model = tiny_gated_deltanet("qwen3_5_moe_text", torch.float64)
    monkeypatch.setattr(_modeling(model), "causal_conv1d_fn", kernel)
    with pytest.raises(ConfigurationError, match=r"conv1d\.weight.*out of sight"):
        _clipped(model, None)


@pytest.mark.parametrize("case", ["layerwise, followed", "layerwise, frozen", "vmap"])
def test_the_delta_net_runs_the_torch_path_in_the_private_step_only_where_needed(case, monkeypatch) -> None:
    """Inside the step, the conv runs with Hugging Face's switch to its torch reference path on: under the layerwise
    engine where the delta-net's own parameters are followed, and inside vmap (the family patch); not where they are
    all frozen (adapters, linear layers: the kernels' autograd functions hide no trained parameter), nor outside."""
    from transformers.integrations import hub_kernels

    apply_runtime_patches()
    model = tiny_gated_deltanet("qwen3_5_moe_text", torch.float64)
    switch = []
    original = _modeling(model).causal_conv1d_fn
    monkeypatch.setattr(
        _modeling(model), "causal_conv1d_fn",
        lambda *a, **k: switch.append(hub_kernels.is_torchdynamo_exporting()) or original(*a, **k),
    )  # fmt: skip
    if case == "layerwise, frozen":
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith(("A_log", "dt_bias", "conv1d.weight")))
    if case == "vmap":
        apply_family_patches(model)
    clipped, _, _ = _clipped(model, Engine() if case == "vmap" else None)
    assert switch and set(switch) == {case != "layerwise, frozen"}
    assert all(torch.isfinite(v).all() for v in clipped.values())
    switch.clear()
    model(**padded_batch())  # outside the step: the layer's own choice
    assert switch == [False]


class _DepthwiseConvModel(torch.nn.Module):
    """An embedding, a depthwise ``nn.Conv1d`` with a bias called through its own forward (kernel 3, padding 1), and
    a linear head; ``listed``: the conv held in a ModuleList, which is never called itself."""

    def __init__(self, listed: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        conv = torch.nn.Conv1d(8, 8, kernel_size=3, groups=8, padding=1)
        self.convs = torch.nn.ModuleList([conv]) if listed else None
        self.conv = None if listed else conv
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        conv = self.convs[0] if self.convs is not None else self.conv
        return self.head(torch.tanh(conv(self.embed(ids).transpose(1, 2))).transpose(1, 2)).mean(dim=1)


@pytest.mark.parametrize("listed", [False, True], ids=["own forward", "in a ModuleList"])
def test_a_depthwise_conv_through_its_own_forward(listed) -> None:
    """A depthwise conv with a bias, called through its stock forward inside its parent's call: weight and bias
    equal the float64 single-record loop to 1e-12. Held by a ModuleList, which is never called (no call to follow it
    in), it is refused."""
    torch.manual_seed(0)
    model = _DepthwiseConvModel(listed).double()
    apply, params, frozen = functional_model(model)
    ids, labels = torch.randint(0, 40, (5, 7)), torch.randint(0, 3, (5,))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    def losses(p, x, y):
        return F.cross_entropy(apply(p, frozen, x), y, reduction="none")

    engine = Engine(gradients=LayerwiseGradients(model, losses))
    grad_fn, state = clipped_grad(loss, clipping_norm=0.1, batch_argnums=(1, 2), engine=engine)
    if listed:
        with pytest.raises(ConfigurationError, match="outside the call of the module that holds it"):
            grad_fn(params, ids, labels, state=state)
        return
    clipped, _ = grad_fn(params, ids, labels, state=state)
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(5):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        grads = dict(
            zip(leaves, torch.autograd.grad(loss(leaves, ids[i], labels[i]), list(leaves.values())), strict=True)
        )
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        for k in total:
            total[k] += min(1.0, 0.1 / norm) * grads[k]
    for name in ("conv.weight", "conv.bias", "head.weight", "embed.weight"):
        assert float(total[name].norm()) > 0
        assert float((clipped.value[name] - total[name]).norm()) <= 1e-12 * float(total[name].norm()), name


def test_reference_kernels_take_hugging_faces_torch_path(monkeypatch) -> None:
    """A function decorated like ``causal_conv1d_fn``, whose kernel package is importable, runs the package's kernel,
    and the torch function inside :func:`reference_kernels` (restored on exit, also after an error)."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    package = types.ModuleType("opake_test_kernels")
    package.scale = lambda x: ("kernel", x)
    monkeypatch.setitem(sys.modules, "opake_test_kernels", package)

    @use_kernel_func_from_hub_with_fallback("scale", "opake_test_kernels")
    def scale(x):
        return ("torch", x)

    assert scale(torch.ones(1))[0] == "kernel"
    with reference_kernels():
        assert scale(torch.ones(1))[0] == "torch"
    assert scale(torch.ones(1))[0] == "kernel"
    with pytest.raises(RuntimeError, match="inside"), reference_kernels():
        raise RuntimeError("inside")
    assert scale(torch.ones(1))[0] == "kernel"


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=2, privacy_noise_multiplier=1.0,
        privacy_accounting=True, use_cpu=True, disable_tqdm=True, optim="sgd", learning_rate=0.1,
        save_strategy="no", report_to="none", logging_steps=1, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("engine", ["auto", "vmap"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_trainer_trains_each_family_privately(model_type, engine, tmp_path) -> None:
    """float32, every parameter: 'auto' picks the layerwise engine (the check and the neighbour test pass), and
    'vmap' trains too (the family patch); the delta-net's own parameters move."""
    model = tiny_gated_deltanet(model_type, torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model, _args(tmp_path, per_example_gradients=engine), train_dataset=token_data(16))
    assert trainer.per_example_gradients_engine == ("layerwise" if engine == "auto" else "vmap")
    out = trainer.train()
    assert out.global_step == 2 and 0 < out.metrics["privacy_epsilon"] < math.inf
    after = dict(trainer.model.named_parameters())
    for suffix in OWN:
        moved = [n for n in before if n.endswith(suffix) and not torch.equal(after[n].detach(), before[n])]
        assert moved, suffix
