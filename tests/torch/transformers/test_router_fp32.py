"""``router_fp32``: the MoE routers of Mixtral, Qwen3-MoE and gpt-oss compute their logits, softmax and top-k in
float32 (float64 in a float64 model). Checked: the patched router equals a float64 router written from Hugging Face's
source; in float32 it is the stock router bit for bit; the per-example clipped gradients of a patched float64 model,
under vmap(grad) and under the layerwise engine, equal a float64 per-example loop; in
bf16 a tie that bf16 logits make is decided by the float32 logits; and the option reaches the model through
``TrainingArguments``."""

from __future__ import annotations

import pytest
import torch
from clipped_loop import clipped_sum_loop
from tiny_hf import VOCAB, padded_batch, tiny_model, tiny_moe, token_data

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.router_fp32 import apply_router_fp32
from opake_torch.patches.runtime import applied_patches
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.loss import batch_losses, per_example_loss

pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
C = 0.05


def _written_router(self, hidden_states):
    """A router in float64, written from transformers 5's ``*TopKRouter.forward`` with every step in float64."""
    x = hidden_states.reshape(-1, self.hidden_dim).double()
    logits = x @ self.weight.double().T
    if getattr(self, "bias", None) is not None:
        logits = logits + self.bias.double()
    if type(self).__name__ == "GptOssTopKRouter":  # top-k of the logits, softmax over those k
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.exp(top - top.logsumexp(dim=-1, keepdim=True)), experts
    probs = torch.exp(logits - logits.logsumexp(dim=-1, keepdim=True))
    top, experts = torch.topk(probs, self.top_k, dim=-1)
    if type(self).__name__ == "MixtralTopKRouter" or self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, experts


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_router_is_the_written_float64_router_and_the_stock_one_in_float32(model_type) -> None:
    model = tiny_moe(model_type, torch.float64)
    assert apply_router_fp32(model) == 2
    assert applied_patches(model) == ("router_fp32",)
    gen = torch.Generator().manual_seed(1)
    for router in _routers(model):
        router.weight.data = torch.randn(router.weight.shape, generator=gen, dtype=torch.float64)
        x = torch.randn(11, router.hidden_dim, generator=gen, dtype=torch.float64)
        got, want = router(x), _written_router(router, x)
        assert torch.equal(got[2], want[2])
        for a, b in zip(got[:2], want[:2], strict=True):
            assert a.dtype == torch.float64
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)
    stock, patched = tiny_moe(model_type, torch.float32), tiny_moe(model_type, torch.float32)
    apply_router_fp32(patched)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    assert torch.equal(stock(input_ids=ids).logits, patched(input_ids=ids).logits)


@pytest.mark.parametrize("layerwise", [False, True], ids=["vmap", "layerwise"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_patched_float64_moe_per_example_gradients_match_a_float64_loop(model_type, layerwise) -> None:
    """The patched routers run under vmap(grad) and under the layerwise engine's router taps (their float32-or-wider
    logits are the tapped tensor): the clipped sum equals the per-example loop through the same patched model to
    1e-12 of each tensor's largest entry."""
    apply_runtime_patches()
    model = tiny_moe(model_type, torch.float64)
    apply_router_fp32(model)
    apply, params, frozen = functional_model(model)

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    kwargs: dict = {"microbatch_size": 2}
    if layerwise:
        batched = lambda p, b: batch_losses(apply, p, frozen, b, task="causal_lm")  # noqa: E731
        kwargs = {"engine": Engine(gradients=LayerwiseGradients(model, batched))}
    grad_fn, state = clipped_grad(loss, clipping_norm=C, batch_argnums=1, **kwargs)
    data = padded_batch()
    clipped, _ = grad_fn(params, data, state=state)
    reference = clipped_sum_loop(loss, params, data, C)
    for name, value in reference.items():
        assert float((clipped.value[name] - value).abs().max()) <= 1e-12 * float(value.abs().max()), name
    assert all("forward" in vars(router) for router in _routers(model))  # still the patched routers


def test_a_bf16_tie_is_decided_by_the_float32_logits() -> None:
    """Expert 1's logit is 1 + 2^-8 and expert 0's is 1: bf16 rounds both to 1.0 (a tie, left to topk's tie-break),
    float32 keeps them apart, so the patched top-1 router picks expert 1."""
    for model_type in ("mixtral", "qwen3_moe"):
        router = _routers(tiny_moe(model_type, torch.bfloat16))[0]
        router.top_k = 1
        weight = torch.zeros_like(router.weight)
        weight[:, 0] = -1.0
        weight[0, :2] = torch.tensor([1.0, 0.0])
        weight[1, :2] = torch.tensor([1.0, 2.0**-8])
        router.weight.data = weight
        x = torch.zeros(1, router.hidden_dim, dtype=torch.bfloat16)
        x[0, :2] = 1.0
        stock_logits = router(x)[0]
        assert stock_logits.dtype == torch.bfloat16 and stock_logits[0, 0] == stock_logits[0, 1]  # the tie
        apply_router_fp32(router)
        logits, _, experts = router(x)
        assert logits.dtype == torch.float32 and float(logits[0, 1] - logits[0, 0]) == 2.0**-8
        assert experts.tolist() == [[1]]


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, privacy_noise_multiplier=1.0,
                             use_cpu=True, disable_tqdm=True, save_strategy="no", report_to="none", **kw)  # fmt: skip


def test_the_option_patches_the_trainer_model_and_is_off_by_default(tmp_path) -> None:
    assert TrainingArguments(privacy_noise_multiplier=1.0).router_fp32 is False
    plain = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path / "off"), train_dataset=token_data(8))
    assert "router_fp32" not in applied_patches(plain.model)
    trainer = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path / "on", router_fp32=True), train_dataset=token_data(8))
    assert "router_fp32" in applied_patches(trainer.model)
    assert all("forward" in vars(m) for m in _routers(trainer.model))
    assert trainer.train().global_step == 1
    with pytest.raises(ConfigurationError, match=r"router_fp32=True .* no top-k router"):
        DPTrainer(tiny_model("llama"), _args(tmp_path / "dense", router_fp32=True), train_dataset=token_data(8))
