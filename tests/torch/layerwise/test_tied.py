"""A tied embedding and language-model head (one ``[V, d]`` weight read by both calls): ghost norms with their cross
term and both calls' sums, against a float64 loop over examples; no ``[m, V, d]`` gradient formed."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_hf import VOCAB, functional_losses, tiny_model, token_data

from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, engine
from opake_torch.layerwise.precision import product_error
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses


def _tied_llama() -> torch.nn.Module:
    """A tiny Llama whose head is its embedding, with ``padding_idx`` 0: the batch's padding ids give that embedding
    part nothing (the head part reads every position)."""
    model = tiny_model("llama", tie_word_embeddings=True, pad_token_id=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


MODELS = {"gpt2": lambda: tiny_model("gpt2"), "llama_tied": _tied_llama}
TIED = {"gpt2": "transformer.wte.weight", "llama_tied": "model.embed_tokens.weight"}


def _loop(loss, params, batch, bound):
    """Per example in float64: the tied weight's squared norm, the whole gradient's norm, and the clipped sum."""
    m = batch["input_ids"].shape[0]
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    leaf, norms = [], []
    for i in range(m):
        g = torch.func.grad(loss)(params, {k: v[i] for k, v in batch.items()})
        norm = math.sqrt(sum(float(v.square().sum()) for v in g.values()))
        norms.append(norm)
        leaf.append(g)
        for k in total:
            total[k] += g[k] * min(1.0, bound / norm)
    return leaf, torch.tensor(norms, dtype=torch.float64), total


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_tied_weight_takes_ghost_norms_equal_to_the_float64_loop(family):
    """The tied weight takes the embedding's and the head's ghost parts and their cross term: its per-example
    squared norms equal the float64 loop's (1e-10), it holds no instantiated ``[m, V, d]`` buffer, and the clipped
    sum (both calls adding into the one weight) equals the loop's."""
    model = MODELS[family]().double()
    params, loss, batch_loss, batch = functional_losses(model, family)
    name = TIED[family]
    batch["input_ids"][0, :2] = 0  # the padding index (the Llama's embedding gives these rows no gradient)
    batch["input_ids"][1] = 7  # one token throughout: the embedding part's and the cross term's repeated ids
    grads, _ = LayerwiseGradients(model, batch_loss)._run(params, (batch,), instantiate=False)
    assert name in grads.tied and name in grads.ghost and name not in grads.dense
    squared = dict(zip(grads.names, grads.squared_norms(), strict=True))
    leaf, norms, expected = _loop(loss, params, batch, 0.05)
    reference = torch.stack([g[name].square().sum() for g in leaf])
    torch.testing.assert_close(squared[name], reference, rtol=1e-10, atol=0)

    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=0.05,
        batch_argnums=1,
        return_diagnostics=True,
        engine=Engine(gradients=LayerwiseGradients(model, batch_loss)),
    )
    (clipped, diagnostics), _ = grad_fn(params, batch, state=state)
    torch.testing.assert_close(diagnostics.norms.double(), norms, rtol=1e-6, atol=0)
    for k in params:
        torch.testing.assert_close(clipped.value[k].double(), expected[k], rtol=1e-9, atol=1e-12, msg=k)


def test_the_heads_sum_margin_is_added_after_the_embeddings_part(monkeypatch):
    """With a rounding margin on the head's float32 sum (TF32 products: ``margin S_i``, ``S_i = sum_t ||g_t||
    ||a_t||`` of the head's factors), the stored contribution ``E_i + H~_i`` may be ``margin S_i`` away from
    ``G_i = E_i + H_i``: the reported norm must be at least ``||G_i|| + margin S_i``. The margin added to the head's
    part alone, inside the root, gives less wherever ``||G_i|| > ||H_i||``, which holds for some example here."""
    monkeypatch.setattr(engine, "matmul_precision", lambda device: "tf32")
    margin = product_error("tf32")
    model = tiny_model("gpt2").float()
    params, loss, batch_loss, batch = functional_losses(model, "gpt2")  # (float64; the engine below runs float32)
    model.float()
    params32 = {k: v.float() for k, v in params.items()}
    factors: list[torch.Tensor] = []

    def keep(module, inputs, output):
        factors.append(inputs[0].detach())
        output.register_hook(factors.append)

    handle = model.lm_head.register_forward_hook(keep)
    try:
        grads, _ = LayerwiseGradients(model, batch_loss)._run(params32, (batch,), instantiate=False)
    finally:
        handle.remove()
    name = TIED["gpt2"]
    assert name in grads.tied
    squared = dict(zip(grads.names, grads.squared_norms(), strict=True))[name]

    model.double()
    leaf, _, _ = _loop(loss, params, batch, math.inf)
    exact = torch.stack([g[name].square().sum() for g in leaf]).sqrt()
    a, g = factors[0].double(), factors[1].double()  # [m, T, d], [m, T, V]
    head = torch.stack([(g[i].T @ a[i]).norm() for i in range(len(leaf))])
    spread = (g.norm(dim=-1) * a.norm(dim=-1)).sum(dim=1)
    assert bool((exact > 1.05 * head).any())  # an example whose embedding part adds to the head's
    assert bool((squared.sqrt() >= (exact + margin * spread) * (1 - 1e-6)).all())
    assert bool((squared.sqrt() <= (exact + margin * spread) * (1 + 1e-4)).all())


def test_bf16_tied_norms_against_the_float64_norms_of_their_factors():
    """Under bf16 autocast the head multiplies bf16 factors and the embedding's part is its float32 output gradient:
    the tied weight's norms equal the float64 norms of ``E_i + g_i^T bf16(a_i)`` by the Gram route (1e-10) and bound
    them from above within the product route's margin, or the one-pass sum's where the kernels run (1e-4), padding
    rows excluded from ``E_i``."""
    apply_runtime_patches()
    model = _tied_llama().train()
    apply, params, frozen = functional_model(model)
    batch = language_modeling_labels(collate(token_data(5), pad_token_id=0))
    batch["input_ids"][0, :2] = 0  # the padding index
    batch["input_ids"][1] = 7  # one token throughout

    def batch_loss(p, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return batch_losses(apply, p, frozen, b, task="causal_lm")

    kept: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, inputs, output):
            kept[name] = [inputs[0].detach()]
            output.register_hook(kept[name].append)

        return hook

    handles = [
        model.model.embed_tokens.register_forward_hook(keep("embed")),
        model.lm_head.register_forward_hook(keep("head")),
    ]
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    batch_loss(leaves, batch).sum().backward()
    for handle in handles:
        handle.remove()
    ids, u = kept["embed"]
    a, g = kept["head"]
    assert g.dtype == torch.bfloat16 and u.dtype == torch.float32
    m, d = ids.shape[0], u.shape[-1]
    expected = []
    for i in range(m):
        live = ids[i] != 0
        part = torch.zeros(VOCAB, d, dtype=torch.float64).index_add_(0, ids[i][live], u[i][live].double())
        part += g[i].double().T @ a[i].to(torch.bfloat16).double()
        expected.append(part.square().sum())
    expected = torch.stack(expected)
    name = "model.embed_tokens.weight"
    for route in ("gram", "product"):
        grads, _ = LayerwiseGradients(model, batch_loss, norm_route=route)(None, (params, batch), (1,))
        assert name in grads.tied
        ours = dict(zip(grads.names, grads.squared_norms(), strict=True))[name]
        if route == "gram" and name not in grads.one_pass:  # float64 arithmetic, the sum in exact parts
            torch.testing.assert_close(ours, expected, rtol=1e-10, atol=0)
        else:  # the product route's margin, or (with the Triton kernels) the one-pass sum's
            assert bool((ours >= expected * (1 - 1e-12)).all() and (ours <= expected * (1 + 1e-4)).all()), route


def test_a_wide_gram_is_formed_a_few_examples_at_a_time(monkeypatch):
    """A factor whose float64 copy exceeds ``GRAM_COPY_BYTES`` (a head's output gradient over its vocabulary) takes
    its Gram matrices a few examples at a time, each chunk's copy within the cap: the same matrices as the float64
    products of each example (1e-13), in ``ceil(m / step)`` batched products."""
    from opake_torch.layerwise import ghost

    x = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(ghost, "GRAM_COPY_BYTES", 2 * 8 * 7 * 48)  # two examples' float64 copy
    launches = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: launches.append(a.shape[0]) or bmm(a, b, **kw))
    chunked = ghost.gram(x)
    assert launches == [2, 2, 1]
    expected = torch.stack([row.double() @ row.double().T for row in x])
    torch.testing.assert_close(chunked, expected, rtol=1e-13, atol=0)
