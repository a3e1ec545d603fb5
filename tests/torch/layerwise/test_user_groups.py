"""Grouped examples in the layerwise engine (user-level privacy): every batched tensor is ``[m, k, ...]``, the
model runs on the ``m k`` rows, and each user's gradient is the sum of its rows' weighted gradients. Its norms and
clipped sum equal a float64 loop over users (plain autograd of ``sum_r w_r loss_r``, one user at a time) on every
layer kind; rows of weight 0 add nothing; removing a user moves the clipped sum by at most the clipping bound; one
row per user is the ungrouped engine."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_gated_deltanet, tiny_model, tiny_moe, token_data
from torch import nn

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, unsupported_parameters
from opake_torch.layerwise.compiled import GROUPED, CompiledLayerwise, unserved
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss

K = 3
LIVE = (3, 1, 2)  # the rows each user fills; its other slots hold a copy of its first row with loss weight 0


def _users(live: tuple[int, ...] = LIVE, k: int = K, seed: int = 0) -> dict[str, torch.Tensor]:
    """Causal-LM rows of varying length laid out ``[m, k, T]`` by user, and the loss weights ``[m, k]``."""
    rows = language_modeling_labels(collate(token_data(sum(live), seed), pad_token_id=0))
    starts = [0, *itertools.accumulate(live)][: len(live)]
    index = torch.tensor(
        [[start + (j if j < n else 0) for j in range(k)] for start, n in zip(starts, live, strict=True)]
    )
    batch = {name: v[index] for name, v in rows.items()}  # [m, k, T]: the row in each slot
    batch["weight"] = torch.tensor([[1.0 if j < n else 0.0 for j in range(k)] for n in live], dtype=torch.float64)
    return batch


def _losses(apply, frozen, autocast: bool = False) -> tuple:
    """The per-user loss ``sum_r w_r loss_r`` on one user's ``[k, ...]`` tensors (a loop over its rows) and the
    batched one, which flattens the users' rows for the model."""
    precision = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def loss(p, user):
        total = 0.0
        for j in range(user["weight"].shape[0]):
            if user["weight"][j] != 0:
                row = {name: v[j] for name, v in user.items() if name != "weight"}
                with precision():
                    total = total + user["weight"][j] * per_example_loss(apply, p, frozen, row, task="causal_lm")
        return total

    def batch_loss(p, users):
        flat = {name: v.reshape(-1, *v.shape[2:]) for name, v in users.items() if name != "weight"}
        with precision():
            rows = batch_losses(apply, p, frozen, flat, task="causal_lm")
        return (rows.reshape(users["weight"].shape) * users["weight"]).sum(dim=1)

    return loss, batch_loss


def _per_user_loop(loss, params: dict, batch: dict) -> tuple[list[dict], list[float]]:
    """Every user's gradient ``g_u`` in float64, the plain autograd gradient of user u's loss alone, and its norm."""
    grads, norms = [], []
    for u in range(batch["weight"].shape[0]):
        leaves = {name: v.detach().clone().requires_grad_() for name, v in params.items()}
        value = loss(leaves, {name: v[u] for name, v in batch.items()})
        found = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
        grads.append({n: (torch.zeros_like(v) if d is None else d).double()
                      for (n, v), d in zip(leaves.items(), found, strict=True)})  # fmt: skip
        norms.append(math.sqrt(sum(float(d.square().sum()) for d in grads[-1].values())))
    return grads, norms


def _clipped_sum(grads: list[dict], norms: list[float], bound: float) -> dict:
    """``sum_u min(1, C / ||g_u||) g_u``."""
    return {
        name: sum(min(1.0, bound / norm) * g[name] for g, norm in zip(grads, norms, strict=True)) for name in grads[0]
    }


def _grouped(model, params, loss, batch_loss, batch, bound, microbatch=None, advantage=1.0, multiple=1) -> tuple:
    """The clipped sum and the per-user norms of the grouped layerwise engine (``advantage``: its
    ``ghost_advantage``; ``multiple``: chunks rounded up to that many users with dead ones)."""
    layerwise = LayerwiseGradients(model, batch_loss, ghost_advantage=advantage, grouped=True)
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=bound,
        batch_argnums=1,
        microbatch_size=microbatch,
        return_diagnostics=True,
        engine=Engine(gradients=layerwise, row_multiple=multiple),
    )
    (clipped, diagnostics), _ = grad_fn(params, batch, state=state)
    return clipped.value, diagnostics.norms


def _relative(ours: dict, reference: dict) -> float:
    diff = math.sqrt(sum(float((ours[n].double() - v).square().sum()) for n, v in reference.items()))
    return diff / math.sqrt(sum(float(v.square().sum()) for v in reference.values()))


def _assert_equals_the_loop(
    model, params, loss, batch_loss, reference_loss, rtol, microbatch=None, advantage=1.0, multiple=1
) -> None:
    """Norms (float32 diagnostics: one rounding) and clipped sum within ``rtol`` of the per-user loop, with a bound
    that clips two users of three and leaves one."""
    batch = _users()
    grads, norms = _per_user_loop(reference_loss, params, batch)
    low, middle, _ = sorted(norms)
    bound = math.sqrt(low * middle)
    expected = _clipped_sum(grads, norms, bound)
    clipped, ours = _grouped(model, params, loss, batch_loss, batch, bound, microbatch, advantage, multiple)
    eps = torch.finfo(ours.dtype).eps
    torch.testing.assert_close(ours.double(), torch.tensor(norms, dtype=torch.float64), rtol=max(rtol, eps), atol=0)
    assert _relative(clipped, expected) <= rtol


def _model(case: str) -> nn.Module:
    if case in ("llama", "gpt2"):
        return tiny_model(case).double().eval()
    if case in ("qwen3_moe", "gpt_oss"):
        return tiny_moe(case, torch.float64).eval()
    return tiny_gated_deltanet(case, torch.float64)


# every weight used once taking ghost norms over a user's k T positions, or every one instantiated
ADVANTAGES = pytest.mark.parametrize("advantage", [1e-6, 1e6], ids=["ghost", "instantiated"])


@ADVANTAGES
@pytest.mark.parametrize(
    ("case", "microbatch"),
    [("llama", None), ("llama", 2), ("gpt2", None), ("qwen3_moe", None), ("gpt_oss", 2), ("qwen3_next", None)],
)
def test_grouped_norms_and_clipped_sum_equal_a_per_user_float64_loop(case, microbatch, advantage):
    """Every parameter trained, float64: Llama (embeddings, RMSNorm, linear layers), GPT-2 (Conv1D, LayerNorm, the
    tied embedding), Qwen3-MoE (routers, stacked experts), gpt-oss (attention sinks, its RMSNorm), Qwen3-Next (the
    gated delta-net's A_log, dt_bias, depthwise conv and gated norm, a shared expert); users of 3, 1 and 2 live
    rows out of 3 slots; whole, and in chunks of at most two users."""
    apply_runtime_patches()
    model = _model(case)
    apply, params, frozen = functional_model(model)
    assert unsupported_parameters(model, params) == []
    loss, batch_loss = _losses(apply, frozen)
    _assert_equals_the_loop(
        model, params, loss, batch_loss, loss, rtol=1e-9, microbatch=microbatch, advantage=advantage
    )


@pytest.mark.parametrize(("microbatch", "multiple"), [(2, 2), (None, 4)], ids=["chunks", "whole"])
def test_chunks_padded_with_dead_users_give_the_per_user_loop(microbatch, multiple):
    """Chunks rounded up to a multiple of users: the dead users (copies with scale 0) add nothing."""
    apply_runtime_patches()
    model = _model("llama")
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    _assert_equals_the_loop(model, params, loss, batch_loss, loss, rtol=1e-9, microbatch=microbatch, multiple=multiple)


def test_the_check_compares_each_user_with_grad_of_its_loss():
    """``check`` takes each user's ``[k, ...]`` tensors as one example of ``loss_fn``."""
    apply_runtime_patches()
    model = _model("llama")
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    assert LayerwiseGradients(model, batch_loss, grouped=True).check(params, loss, _users()) < 1e-9


@ADVANTAGES
def test_checkpointed_layers_give_the_per_user_loop(advantage):
    """A full fine-tune inside checkpointed decoder layers (their recompute tapped in the backward), against the
    loop on the same weights without checkpointing."""
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    model = tiny_model("llama").double()
    assert enable_vmap_checkpointing(model) > 0
    model.train()
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    plain = tiny_model("llama").double().eval()
    plain.load_state_dict(model.state_dict())
    plain_apply, _, plain_frozen = functional_model(plain)
    reference_loss, _ = _losses(plain_apply, plain_frozen)
    _assert_equals_the_loop(
        model, params, loss, batch_loss, reference_loss, rtol=1e-9, microbatch=2, advantage=advantage
    )


@ADVANTAGES
def test_bf16_autocast_gives_the_per_user_loop_under_autocast(advantage):
    """float32 weights under bf16 autocast, the loop under the same autocast: the engine sums the bf16 products in
    float32 where autograd rounds each weight gradient to bf16, within the 1e-2 that ``check`` allows for bf16."""
    apply_runtime_patches()
    model = tiny_model("llama").eval()
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen, autocast=True)
    _assert_equals_the_loop(model, params, loss, batch_loss, loss, rtol=1e-2, advantage=advantage)


def test_rows_of_weight_zero_add_nothing():
    """The slots a user does not fill, filled with other tokens: the norms and the clipped sum do not move."""
    apply_runtime_patches()
    model = _model("gpt2")
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    batch = _users()
    changed = {name: v.clone() for name, v in batch.items()}
    dead = batch["weight"] == 0
    assert dead.any()
    noise = torch.randint(1, 40, changed["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    changed["input_ids"][dead] = noise[dead]
    changed["labels"][dead] = noise[dead]
    first, norms = _grouped(model, params, loss, batch_loss, batch, 1.0)
    second, norms_then = _grouped(model, params, loss, batch_loss, changed, 1.0)
    torch.testing.assert_close(norms_then, norms, rtol=1e-12, atol=0)
    assert _relative(second, {n: v.double() for n, v in first.items()}) < 1e-12


@pytest.mark.parametrize("removed", range(len(LIVE)))
def test_removing_a_user_moves_the_clipped_sum_by_at_most_the_bound(removed):
    """The neighbour of the user-level unit: all rows of one user gone. With every user clipped (a small bound),
    the clipped sum moves by that user's clipped gradient: at most C, and at least C/2 (the rows are not clipped
    one by one: a user of three rows would then move it by up to 3 C)."""
    apply_runtime_patches()
    model = _model("llama")
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    bound = 0.05
    batch = _users()
    kept = [u for u in range(len(LIVE)) if u != removed]
    neighbour = {name: v[kept] for name, v in batch.items()}
    full, norms = _grouped(model, params, loss, batch_loss, batch, bound)
    without, _ = _grouped(model, params, loss, batch_loss, neighbour, bound)
    assert (norms > bound).all()
    moved = math.sqrt(sum(float((full[n].double() - without[n].double()).square().sum()) for n in full))
    assert bound / 2 <= moved <= bound * (1 + 1e-6)


def test_one_row_per_user_is_the_ungrouped_engine():
    """``k = 1``: the grouped engine on ``[m, 1, ...]`` and the ungrouped one on the same rows ``[m, ...]`` give the
    same norms and clipped sum, to rounding."""
    apply_runtime_patches()
    model = _model("gpt2")
    apply, params, frozen = functional_model(model)
    loss, batch_loss = _losses(apply, frozen)
    users = _users(live=(1, 1, 1, 1), k=1)
    rows = {name: v[:, 0] for name, v in users.items() if name != "weight"}

    def row_loss(p, row):
        return per_example_loss(apply, p, frozen, row, task="causal_lm")

    def row_losses(p, b):
        return batch_losses(apply, p, frozen, b, task="causal_lm")

    grouped, grouped_norms = _grouped(model, params, loss, batch_loss, users, 0.5)
    grad_fn, state = clipped_grad(row_loss, clipping_norm=0.5, batch_argnums=1, return_diagnostics=True,
                                  engine=Engine(gradients=LayerwiseGradients(model, row_losses)))  # fmt: skip
    (clipped, diagnostics), _ = grad_fn(params, rows, state=state)
    torch.testing.assert_close(grouped_norms, diagnostics.norms, rtol=1e-12, atol=0)
    assert _relative(grouped, {n: v.double() for n, v in clipped.value.items()}) < 1e-12


def test_batched_tensors_without_one_k_are_refused():
    apply_runtime_patches()
    model = _model("llama")
    apply, params, frozen = functional_model(model)
    _, batch_loss = _losses(apply, frozen)
    engine = LayerwiseGradients(model, batch_loss, grouped=True)
    batch = _users()
    batch["weight"] = torch.ones(len(LIVE), K + 1, dtype=torch.float64)
    with pytest.raises(ConfigurationError, match=r"grouped examples need .* got shapes .*\(3, 4\)"):
        engine._run(params, (batch,), instantiate=False)
    batch["weight"] = torch.ones(len(LIVE), dtype=torch.float64)
    with pytest.raises(ConfigurationError, match=r"grouped examples need .* got shapes .*\(3,\)"):
        engine._run(params, (batch,), instantiate=False)


def test_the_compiled_pass_leaves_grouped_examples_to_the_hook_engine():
    model = _model("llama")
    apply, _, frozen = functional_model(model)
    _, batch_loss = _losses(apply, frozen)
    assert unserved(LayerwiseGradients(model, batch_loss)) == []
    grouped = LayerwiseGradients(model, batch_loss, grouped=True)
    assert unserved(grouped) == [GROUPED]
    with pytest.raises(ConfigurationError, match="grouped examples"):
        CompiledLayerwise(grouped)


class _Pooled(nn.Module):
    """A linear layer on each row, then the mean over every row of the batch added: users interact."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h + h.mean(dim=0, keepdim=True))).mean(dim=1)


def test_users_that_interact_in_the_batch_are_refused():
    """The coupling check replaces whole users (all their rows) and compares the kept users' norms."""
    torch.manual_seed(0)
    model = _Pooled().double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(4, K, 5, 4, dtype=torch.float64), torch.randint(0, 3, (4, K))

    def loss(p, xu, yu):
        return F.cross_entropy(apply(p, frozen, xu), yu, reduction="sum")

    def batch_loss(p, xb, yb):
        rows = F.cross_entropy(apply(p, frozen, xb.flatten(0, 1)), yb.flatten(), reduction="none")
        return rows.reshape(yb.shape).sum(dim=1)

    engine = Engine(gradients=LayerwiseGradients(model, batch_loss, grouped=True))
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2), engine=engine)
    with pytest.raises(ConfigurationError, match="interact"):
        grad_fn(params, x, y, state=state)
