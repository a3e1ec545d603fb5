"""Layerwise per-example gradients against an independent float64 loop over examples, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_hf import functional_losses, tiny_lora, tiny_model, token_data
from torch import nn

from opake_core.clipping import VMAP, Engine, adaptive, auto_s, clipped_grad
from opake_core.errors import ConfigurationError
from opake_core.random import key
from opake_core.tree import per_group
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, unsupported_parameters
from opake_torch.layerwise.precision import bmm_accumulated, product_sum_error
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.kernels.product_norms import product_kernel_runs
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import batch_losses, per_example_loss

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Mixer(nn.Module):
    """Embedding (with padding), LayerNorm, a wide Linear (ghost norm at T=5) and a narrow one (instantiated)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 48, padding_idx=0)
        self.norm = nn.LayerNorm(48)
        self.wide = nn.Linear(48, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(self.norm(self.embed(ids))))).mean(dim=-2)


def _mixer_case() -> tuple:
    torch.manual_seed(0)
    model = Mixer().double()
    apply, params, frozen = functional_model(model)
    ids = torch.randint(0, 40, (6, 5))
    ids[0, :3] = 0  # padding rows get no gradient
    ids[1] = 7  # one token repeated: the ghost norm's cross terms
    labels = torch.randint(0, 3, (6,))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    def batch_loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x), y, reduction="none")

    return model, params, loss, batch_loss, (ids, labels)


def _hf_case(family: str, lora: bool) -> tuple:
    model = tiny_model(family).double()
    if lora:
        model = tiny_lora(targets=LORA_TARGETS, std=1.0, model=model)
    params, loss, batch_loss, batch = functional_losses(model, family)
    return model, params, loss, batch_loss, (batch,)


CASES = {
    "mixer": _mixer_case,
    "llama_lora": lambda: _hf_case("llama", True),
    "qwen2_lora": lambda: _hf_case("qwen2", True),
    "gpt2_full_tied": lambda: _hf_case("gpt2", False),
    "llama_full_rmsnorm": lambda: _hf_case("llama", False),
    "qwen2_full_rmsnorm": lambda: _hf_case("qwen2", False),
    "bert_full": lambda: _hf_case("bert", False),
}


def _loop_reference(loss, params, batch, bound):
    """sum_i g_i min(1, C/||g_i||) and the norms, one example at a time in float64."""
    size = next(iter(b for b in batch if isinstance(b, torch.Tensor)), None)
    size = size.shape[0] if size is not None else next(iter(batch[0].values())).shape[0]
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    norms = []
    for i in range(size):
        example = [{k: v[i] for k, v in b.items()} if isinstance(b, dict) else b[i] for b in batch]
        g = torch.func.grad(loss)(params, *example)
        norm = math.sqrt(sum(float(v.double().square().sum()) for v in g.values()))
        norms.append(norm)
        for k in total:
            total[k] += g[k].double() * min(1.0, bound / norm)
    return total, torch.tensor(norms)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bound", [math.inf, 0.05])
@pytest.mark.parametrize(("microbatch", "multiple"), [(None, 1), (4, 1), (4, 4)], ids=["whole", "equal", "padded"])
def test_clipped_sum_equals_a_float64_loop(case, bound, microbatch, multiple):
    """Whole, in equal chunks of at most 4, and in chunks rounded up to 4 rows with dead rows (Poisson draws of
    varying size meeting a few shapes): each equals the float64 loop."""
    model, params, loss, batch_loss, batch = CASES[case]()
    argnums = tuple(range(1, 1 + len(batch)))
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=bound,
        batch_argnums=argnums,
        microbatch_size=microbatch,
        return_diagnostics=True,
        engine=Engine(gradients=LayerwiseGradients(model, batch_loss), row_multiple=multiple),
    )
    (clipped, diagnostics), _ = grad_fn(params, *batch, state=state)
    expected, norms = _loop_reference(loss, params, batch, bound)
    torch.testing.assert_close(diagnostics.norms.double(), norms.float().double(), rtol=1e-6, atol=0)
    flat = torch.cat([clipped.value[k].reshape(-1) for k in sorted(params)])
    ref = torch.cat([expected[k].reshape(-1) for k in sorted(params)])
    assert ((flat - ref).norm() / ref.norm()).item() < 1e-9


@pytest.mark.parametrize("advantage", [1.0, 10.0])
def test_ghost_advantage_instantiates_a_ghost_layer_with_the_same_sum(advantage):
    """``ghost_advantage`` trades memory for time only: at 10 the wide layer (its factors, ``T (in + out)`` per
    example, 18% of its gradient at T = 5) is instantiated instead of taking ghost norms; the clipped sum equals the
    float64 loop either way."""
    model, params, loss, batch_loss, batch = CASES["mixer"]()
    engine = LayerwiseGradients(model, batch_loss, ghost_advantage=advantage)
    grads, _ = engine._run(params, batch, instantiate=False)
    assert ("wide.weight" in grads.ghost) == (advantage == 1.0) and "embed.weight" in grads.ghost
    grad_fn, state = clipped_grad(loss, clipping_norm=0.05, batch_argnums=(1, 2), engine=Engine(gradients=engine))
    clipped, _ = grad_fn(params, *batch, state=state)
    expected, _ = _loop_reference(loss, params, batch, 0.05)
    flat = torch.cat([clipped.value[k].reshape(-1) for k in sorted(params)])
    ref = torch.cat([expected[k].reshape(-1) for k in sorted(params)])
    assert ((flat - ref).norm() / ref.norm()).item() < 1e-9


def test_chunks_do_not_change_the_result_and_the_rules_carry_over():
    model, params, loss, batch_loss, batch = _mixer_case()
    engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
    rules = {
        "fixed": {"clipping_norm": 0.05},
        "auto_s": {"clipping_norm": auto_s(0.05)},
        "per_group": {"clipping_norm": per_group(params, {"wide": 0.02}, fallback=0.05)},
        "adaptive": {"clipping_norm": adaptive(0.05), "key": key(3)},
    }
    for name, kwargs in rules.items():
        outs = []
        for chosen, chunk in ((VMAP, None), (engine, None), (engine, 2)):
            grad_fn, state = clipped_grad(
                loss,
                batch_argnums=(1, 2),
                microbatch_size=chunk,
                engine=chosen,
                **kwargs,
            )
            clipped, state = grad_fn(params, *batch, state=state)
            outs.append((clipped, state))
        (ref, ref_state), *rest = outs
        for clipped, state in rest:
            assert clipped.sensitivity == ref.sensitivity, name
            for k in params:
                torch.testing.assert_close(clipped.value[k], ref.value[k], rtol=1e-10, atol=1e-12, msg=name)
            assert getattr(state, "clipping_norm", None) == getattr(ref_state, "clipping_norm", None), name


def test_a_non_finite_example_adds_nothing():
    model, params, loss, batch_loss, (ids, labels) = _mixer_case()

    def poisoned(p, x, y):
        return batch_loss(p, x, y) * torch.tensor([math.nan, 1, 1, 1, 1, 1], dtype=torch.float64)

    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=0.05,
        batch_argnums=(1, 2),
        engine=Engine(gradients=LayerwiseGradients(model, poisoned)),
    )
    clipped, _ = grad_fn(params, ids, labels, state=state)
    expected, _ = _loop_reference(loss, params, (ids[1:], labels[1:]), 0.05)
    for k in params:
        assert torch.isfinite(clipped.value[k]).all()
        torch.testing.assert_close(clipped.value[k], expected[k], rtol=1e-9, atol=1e-12)


class GemmaStyleNorm(nn.Module):
    """An RMSNorm whose forward is not Llama's (it scales by ``1 + weight``): not served."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_models_it_cannot_serve_are_named():
    norm = nn.Sequential(nn.Linear(3, 4), GemmaStyleNorm())
    _, params, _ = functional_model(norm)
    assert unsupported_parameters(norm, params) == ["1.weight (in GemmaStyleNorm)"]
    freq = nn.Embedding(5, 2, scale_grad_by_freq=True)
    assert unsupported_parameters(freq, functional_model(freq)[1]) == ["weight (in Embedding)"]
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    _, params, frozen = functional_model(bn)
    reasons = unsupported_parameters(bn, params)
    assert any("mixes examples" in r for r in reasons)
    engine = LayerwiseGradients(bn, lambda p, x: functional_model(bn)[0](p, frozen, x)[:, 0])
    with pytest.raises(ConfigurationError, match="mixes examples"):
        engine(None, (params, torch.randn(4, 3)), (1,))


class SideUse(nn.Module):
    """A Linear whose weight is also read directly (not through the layer): the hooks cannot see that use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + x @ self.lin.weight).sum(-1)


def test_the_check_catches_a_parameter_used_outside_its_layer():
    torch.manual_seed(0)
    model = SideUse().double()
    apply, params, frozen = functional_model(model)
    engine = LayerwiseGradients(model, lambda p, x: apply(p, frozen, x) ** 2)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ConfigurationError, match=r"lin\.weight"):
        engine.check(params, lambda p, xi: apply(p, frozen, xi[None])[0] ** 2, x)
    model, params, loss, batch_loss, batch = _mixer_case()
    assert LayerwiseGradients(model, batch_loss).check(params, loss, *batch) < 1e-12


@pytest.mark.parametrize("source", ["batch", "frozen_parameter"])
def test_gradients_outside_the_taps_leave_the_sum_unchanged(source):
    """A batch tensor, or a parameter outside the trainable ones, that requires a gradient: layer outputs then need
    a gradient whether or not a tapped layer feeds them, and every layer is tapped; the sum still equals the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    apply, params, frozen = functional_model(model)
    params = {k: v for k, v in params.items() if not k.startswith("0.")}  # the first layer frozen
    frozen = {**frozen, **{k: v for k, v in model.named_parameters() if k.startswith("0.")}}
    if source == "frozen_parameter":  # the first layer's output needs a gradient, and no tapped layer feeds it
        frozen = {k: v.detach().requires_grad_(k.startswith("0.")) for k, v in frozen.items()}
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.startswith("0."))
    else:
        model.requires_grad_(False)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=source == "batch")
    y = torch.randint(0, 3, (5,))

    def loss(p, xi, yi):
        return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=LayerwiseGradients(model, batch_loss))
    )
    clipped, _ = grad_fn(params, x, y, state=state)
    expected, _ = _loop_reference(loss, params, (x.detach(), y), 0.5)
    for k in params:
        torch.testing.assert_close(clipped.value[k].double(), expected[k], rtol=1e-9, atol=1e-12)


def test_a_layer_the_loss_does_not_reach_has_zero_gradients():
    """A layer that runs but does not feed the loss (its own size group, never written by the backward): zero
    per-example gradients, and the other layers' sum equals the loop."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 3)
            self.unused = nn.Linear(4, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.unused(x)  # runs, feeds nothing
            return self.used(x)

    torch.manual_seed(0)
    model = Branch().double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(p, xi, yi):
        return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    layerwise = LayerwiseGradients(model, batch_loss)
    assert layerwise.check(params, loss, x[:2], y[:2]) < 1e-10
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=layerwise))
    clipped, _ = grad_fn(params, x, y, state=state)
    expected, _ = _loop_reference(loss, params, (x, y), 0.5)
    assert not clipped.value["unused.weight"].any() and not clipped.value["unused.bias"].any()
    for k in params:
        torch.testing.assert_close(clipped.value[k].double(), expected[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("family", "adapters"), [("llama", True), ("qwen2", True), ("llama", False)])
def test_checkpointed_layers_give_the_float64_loop_sum(family, adapters, monkeypatch):
    """LoRA adapters, or every weight (a full fine-tune), inside checkpointed decoder layers
    (``enable_vmap_checkpointing``, training mode, no dropout): the layers' forward keeps nothing, their recompute in
    the backward is tapped, and the clipped sum equals the float64 loop (whose per-example gradients run the same
    checkpointing under torch.func). Adapters are instantiated in the recompute; the full fine-tune's MLP weights
    take ghost norms there (their recomputed inputs and output gradients kept for the book-keeping sum)."""
    from opake_torch.patches import activation_checkpointing as checkpointing

    recomputes = []
    plain = checkpointing._plain_recompute
    monkeypatch.setattr(checkpointing, "_plain_recompute", lambda *a: recomputes.append(1) or plain(*a))
    apply_runtime_patches()
    model = tiny_model(family).double()
    if adapters:
        model = tiny_lora(family, targets=LORA_TARGETS, std=1.0, model=model)
    layers = checkpointing.enable_vmap_checkpointing(model)
    assert layers > 0
    model.train()
    apply, params, frozen = functional_model(model)
    batch = language_modeling_labels(collate(token_data(6), pad_token_id=0))

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        return batch_losses(apply, p, frozen, b, task="causal_lm")

    layerwise = LayerwiseGradients(model, batch_loss)
    recorded = []
    layerwise_run = layerwise._run

    def spy(*args, **kwargs):
        out = layerwise_run(*args, **kwargs)  # the ghost calls' gradients, before the sum consumes them
        recorded.append((out[0], {name: call.grad is not None for name, (call, _) in out[0].ghost.items()}))
        return out

    layerwise._run = spy
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.05, batch_argnums=1, microbatch_size=4, engine=Engine(gradients=layerwise)
    )
    clipped, _ = grad_fn(params, batch, state=state)
    expected, _ = _loop_reference(loss, params, (batch,), 0.05)
    flat = torch.cat([clipped.value[k].reshape(-1) for k in sorted(params)])
    ref = torch.cat([expected[k].reshape(-1) for k in sorted(params)])
    assert ((flat - ref).norm() / ref.norm()).item() < 1e-9
    inside = (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")
    for grads, graded in recorded:
        ghosts = [name for name in grads.ghost if ".layers." in name]
        if adapters:
            assert not ghosts  # adapters: instantiated
        else:  # recomputed inside the backward and used for the scaled sum
            assert set(inside) <= {n[n.rindex(".", 0, n.rindex(".")) :] for n in ghosts}, ghosts
            assert all(graded[n] for n in ghosts)
    assert len(recomputes) == layers * len(recorded)  # every checkpointed layer recomputed once per chunk


def test_the_anchor_reaches_the_engines_checkpointed_layers_only_during_its_pass():
    """The engine hands its anchor to the checkpointed layers of its own model for the duration of its pass
    (``recompute_linked_to``), explicitly: another checkpointed model in the process never sees it, and afterwards
    every layer's checkpointing function is the one ``enable_vmap_checkpointing`` installed."""
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    model, other = tiny_model("llama").double(), tiny_model("llama").double()
    for m in (model, other):
        enable_vmap_checkpointing(m)
        m.train()
    ours, theirs = ([m for m in net.modules() if hasattr(m, "_gradient_checkpointing_func")] for net in (model, other))
    installed = [m._gradient_checkpointing_func for m in ours + theirs]
    apply, params, frozen = functional_model(model)
    batch = language_modeling_labels(collate(token_data(4), pad_token_id=0))
    during = []

    def batch_loss(p, b):
        during.append([m._gradient_checkpointing_func.keywords for m in ours + theirs])
        return batch_losses(apply, p, frozen, b, task="causal_lm")

    LayerwiseGradients(model, batch_loss)._run(params, (batch,), instantiate=False)
    (keywords,) = during
    assert ours and all(isinstance(k.get("anchor"), torch.Tensor) for k in keywords[: len(ours)])
    assert theirs and all("anchor" not in k for k in keywords[len(ours) :])
    assert all(m._gradient_checkpointing_func is f for m, f in zip(ours + theirs, installed, strict=True))


def test_checkpointed_layers_under_bf16_autocast_give_the_plain_pass():
    """bf16 autocast with SDPA attention: the checkpointed layers' recompute re-enters the autocast state, so the
    clipped sum equals the one without checkpointing up to the summation order (the same bf16 roundings)."""
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing

    apply_runtime_patches()
    batch = language_modeling_labels(collate(token_data(6), pad_token_id=0))
    sums = []
    for checkpointing in (False, True):
        model = tiny_lora("llama", targets=LORA_TARGETS, std=1.0, model=tiny_model("llama"))
        model.config._attn_implementation = "sdpa"
        if checkpointing:
            enable_vmap_checkpointing(model)
        model.train()
        apply, params, frozen = functional_model(model)

        def loss(p, example, apply=apply, frozen=frozen):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return per_example_loss(apply, p, frozen, example, task="causal_lm")

        def batch_loss(p, b, apply=apply, frozen=frozen):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return batch_losses(apply, p, frozen, b, task="causal_lm")

        engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
        grad_fn, state = clipped_grad(loss, clipping_norm=0.05, batch_argnums=1, engine=engine)
        clipped, _ = grad_fn(params, batch, state=state)
        sums.append(clipped.value)
    for name in sums[0]:
        torch.testing.assert_close(sums[1][name], sums[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_ghost_sums_run_at_the_runs_float32_precision_and_leave_it_as_it_was(monkeypatch):
    """With TF32 allowed, the ghost layers' scaled sums run at that precision (their norms carry its error bound:
    test_tf32_bound.py) and the bf16 reduced-precision reduction is off; both settings are restored afterwards."""
    from opake_torch.layerwise import gradients

    seen = []
    add_ghost = gradients.add_ghost
    cuda_matmul = torch.backends.cuda.matmul
    record = lambda: (torch.get_float32_matmul_precision(), cuda_matmul.allow_bf16_reduced_precision_reduction)  # noqa: E731
    monkeypatch.setattr(gradients, "add_ghost", lambda *a, **k: seen.append(record()) or add_ghost(*a, **k))
    model, params, loss, batch_loss, batch = _mixer_case()
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=LayerwiseGradients(model, batch_loss))
    )
    previous = record()
    torch.set_float32_matmul_precision("high")  # TF32 allowed
    cuda_matmul.allow_bf16_reduced_precision_reduction = True
    try:
        grad_fn(params, *batch, state=state)
        assert record() == ("high", True)
    finally:
        torch.set_float32_matmul_precision(previous[0])
        cuda_matmul.allow_bf16_reduced_precision_reduction = previous[1]
    assert seen and set(seen) == {("high", False)}


class _Shared(nn.Module):
    """q, k and v read the same hidden states; ``other`` reads another tensor of the same shape; a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.other = (nn.Linear(16, 16, bias=False) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.q(x) * self.k(x).sigmoid() + self.v(x) + self.other(torch.tanh(x))
        return self.head(mixed.mean(dim=1))


def test_layers_reading_one_tensor_share_its_gram_matrix(monkeypatch):
    """Three ghost-norm layers that read the same hidden states (q, k and v) take one Gram matrix of it (formed for
    the chunk's calls together, or at once); a fourth that reads another tensor of the same shape gets its own. The
    clipped sum equals the float64 loop."""
    from opake_torch.layerwise import ghost, gradients

    torch.manual_seed(0)
    model = _Shared().double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(5, 2, 16, dtype=torch.float64), torch.randint(0, 3, (5,))  # T = 2: ghost norms for 16 x 16

    def loss(p, xi, yi):
        return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    shapes, scaled = [], []
    gram, stacked = ghost.gram, ghost._stacked_grams
    monkeypatch.setattr(ghost, "gram", lambda t: shapes.append(t.shape[-1]) or gram(t))
    monkeypatch.setattr(ghost, "_stacked_grams", lambda ts: shapes.extend(t.shape[-1] for t in ts) or stacked(ts))

    class CountedInputs(ghost.ScaledInputs):
        def __call__(self, call, *args):
            before = self.key
            out = super().__call__(call, *args)
            if self.key is not before:  # a scaled copy formed for this call
                scaled.append(call.module)
            return out

    monkeypatch.setattr(gradients, "ScaledInputs", CountedInputs)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=Engine(gradients=LayerwiseGradients(model, batch_loss))
    )
    clipped, _ = grad_fn(params, x, y, state=state)
    expected, _ = _loop_reference(loss, params, (x, y), 0.5)
    for k in params:
        torch.testing.assert_close(clipped.value[k].double(), expected[k], rtol=1e-9, atol=1e-12)
    # inputs: x once for q, k and v, tanh(x) once, the head's input once; outputs: q, k, v, other (16), head (3); in
    # each of the two passes of the first call (the coupling check's and the chunk's)
    assert sorted(shapes) == sorted(([3] + [16] * 7) * 2)
    # the scaled inputs of the clipped sum likewise: x once for q, k and v, then tanh(x), then the head's input
    assert scaled == [model.q, model.other, model.head]


def test_layers_reading_one_tensor_share_its_row_norms(monkeypatch):
    """Under TF32 (the engine told so; the CPU's products stay IEEE) the ghost norms carry the rounding margin of the
    sum's products, ``error S_i`` with ``S_i = sum_t ||g_t|| ||a_t||``. The Gram-route calls of a chunk take ``S_i``
    from the diagonals of their batched Gram matrices and read no row norms; a call that forms its Gram matrices
    itself reads row norms, and q, k and v take one set of them for the hidden states they share. Both give the same
    clipped sum (the spreads differ in their last bits), and the bit-for-bit same one with a set per layer."""
    from opake_torch.layerwise import engine, ghost

    torch.manual_seed(0)
    model = _Shared()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(5, 2, 16), torch.randint(0, 3, (5,))

    def loss(p, xi, yi):
        return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    monkeypatch.setattr(engine, "matmul_precision", lambda device: "tf32")
    read = []
    row_norms = ghost._row_norms
    monkeypatch.setattr(ghost, "_row_norms", lambda t: read.append(t.shape) or row_norms(t))

    def clipped_sum() -> dict:
        read.clear()
        engine_ = Engine(gradients=LayerwiseGradients(model, batch_loss))
        grad_fn, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2), engine=engine_)
        return grad_fn(params, x, y, state=state)[0].value

    batched = clipped_sum()
    assert not read  # every call here is on the Gram route: the spreads come from the Gram matrices
    monkeypatch.setattr(ghost, "_deferrable", lambda call, m: False)  # each call forms its own
    shared = clipped_sum()
    # per pass (the coupling check's and the chunk's): inputs x (once for q, k and v), tanh(x) and the head's; the
    # output gradients of q, k, v, other and the head
    assert len(read) == 2 * (3 + 5)
    monkeypatch.setattr(ghost.InputGrams, "rows", lambda self, call: ghost._row_norms(ghost.input_factor(call, self.m)))
    apart = clipped_sum()
    assert len(read) == 2 * (5 + 5)
    for k in params:
        assert torch.equal(shared[k], apart[k])
        torch.testing.assert_close(batched[k], shared[k])


class _Bf16Stack(nn.Module):
    """Bias-free linear layers whose weights all take ghost norms at T = 4, and a linear head (ghost at T = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(torch.tanh(self.first(x))).mean(dim=1))


def _autocast_case(layers: type[nn.Module], device: str) -> tuple:
    """``layers()`` on ``device`` (seed 0) as a pure function, six inputs ``[4, 32]`` with three-way labels, and the
    per-example and batched cross-entropy losses under bf16 autocast: ``(model, params, (x, y), loss, batch_loss)``."""
    torch.manual_seed(0)
    model = layers().to(device)
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(6, 4, 32, device=device) * 3, torch.randint(0, 3, (6,), device=device)

    def loss(p, xi, yi):
        with torch.autocast(device, dtype=torch.bfloat16):
            return F.cross_entropy(apply(p, frozen, xi[None]), yi[None])

    def batch_loss(p, xb, yb):
        with torch.autocast(device, dtype=torch.bfloat16):
            return F.cross_entropy(apply(p, frozen, xb), yb, reduction="none")

    return model, params, (x, y), loss, batch_loss


def _bf16_factor_reference(model, x, y, bound, device, form):
    """Per-example weight gradients ``G_i = sum_t g_it^T bf16(a_it)`` in float64 from the factors of a plain batched
    autograd pass under bf16 autocast (inputs and output gradients read by hooks), and ``sum_i c_i G_i`` with the
    clipping rule's scale ``c_i = min(1, C (1 - 4u) / N_i)`` in float32. ``form="two_parts"``: ``N_i = ||G_i||`` and
    the scale rounded down to a bf16 number (the largest at most ``c_i``); ``"one_pass"``: ``N_i`` the norm of the
    layers' ``||G_i|| + eps S_i`` (``S_i = sum_t ||g_it|| ||a_it||``, ``eps`` the one-pass sum's margin at the
    layer's ``T``). Returns the sums and the exact norms ``||G_i||``."""
    inputs, grads = {}, {}
    layers = {"first.weight": model.first, "second.weight": model.second, "head.weight": model.head}
    handles = []
    for name, layer in layers.items():

        def keep(module, inp, out, name=name):
            inputs[name] = inp[0]
            out.register_hook(lambda grad: grads.__setitem__(name, grad))

        handles.append(layer.register_forward_hook(keep))
    with torch.autocast(device, dtype=torch.bfloat16):
        losses = F.cross_entropy(model(x), y, reduction="none")
    losses.sum().backward()
    for handle in handles:
        handle.remove()
    m = x.shape[0]
    per_example, margins = {}, {}
    for name in layers:
        assert grads[name].dtype == torch.bfloat16
        a = inputs[name].to(torch.bfloat16).double().reshape(m, -1, inputs[name].shape[-1])
        g = grads[name].double().reshape(m, -1, grads[name].shape[-1])
        per_example[name] = torch.einsum("mto,mti->moi", g, a).detach()
        spread = (g.norm(dim=-1) * a.norm(dim=-1)).sum(dim=1).detach()
        margins[name] = product_sum_error(a.shape[1]) * spread if form == "one_pass" else torch.zeros(m).to(a)
    norms = torch.sqrt(sum(g.square().sum(dim=(1, 2)) for g in per_example.values()))
    bounded = torch.sqrt(sum((per_example[k].norm(dim=(1, 2)) + margins[k]).square() for k in layers))
    scales = torch.clamp(bound * (1 - 4 * 2.0**-24) / bounded, max=1.0).float().double()
    if form == "two_parts":
        _, exponent = torch.frexp(scales)
        spacing = torch.exp2(exponent.double() - 8)  # of bf16 numbers in the binade of the scale
        scales = torch.floor(scales / spacing) * spacing
    return {k: torch.einsum("m,moi->oi", scales, g) for k, g in per_example.items()}, norms


@pytest.mark.parametrize("form", ["two_parts", "one_pass"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_layers_take_norms_and_sums_from_their_bf16_factors(monkeypatch, device, form):
    """Under bf16 autocast the ghost layers' norms come from the bf16-rounded inputs (what the forward multiplied).
    Their clipped sums take two exact bf16 parts of the output gradient scaled by the clip factor rounded down to
    bf16, or, where the kernel runs (CUDA, or the Triton interpreter), one pass with float32 accumulation whose
    rounding the norms carry as a margin. Either way the clipped sum equals the float64 sum of the per-example
    products of those factors with the form's clip factors, and one example's contribution stays within the bound, at
    most ``2^-7`` under it for the two parts and ``1e-5`` for one pass (a batch of one, its gradient far above the
    bound). On CUDA the sums run on bf16 tensor cores."""
    from opake_torch.layerwise import ghost, hooks

    if form == "one_pass" and not product_kernel_runs(torch.device(device), torch.bfloat16, "ieee"):
        pytest.skip("the one-pass sum needs CUDA and Triton, or the Triton interpreter")
    if form == "two_parts":
        monkeypatch.setattr(hooks, "one_pass_sum", lambda call, total: False)
    model, params, (x, y), loss, batch_loss = _autocast_case(_Bf16Stack, device)
    products = []
    taken = "add_bf16_product" if form == "two_parts" else "clipped_product_sum"
    add = getattr(ghost, taken)
    monkeypatch.setattr(ghost, taken, lambda *a: products.append(taken) or add(*a))
    engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
    for bound in (0.05, 10.0):
        grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), engine=engine)
        clipped, _ = grad_fn(params, x, y, state=state)
        expected, norms = _bf16_factor_reference(model, x, y, bound, device, form)
        assert (norms > 0.05).all() and (norms < 10.0).all()  # all clipped at 0.05, none at 10
        for name, value in expected.items():  # float32 accumulation: 1e-6 of the norm (one bf16 part: about 4e-3)
            assert (clipped.value[name].double() - value).norm() <= 1e-6 * value.norm(), name
    assert len(products) == 6  # three layers, two calls of grad_fn: every sum took the form's path
    grad_fn, state = clipped_grad(loss, clipping_norm=1e-3, batch_argnums=(1, 2), engine=engine)
    under = 2.0**-7 if form == "two_parts" else 1e-5
    for i in range(6):
        one, _ = grad_fn(params, x[i : i + 1] * 100, y[i : i + 1], state=state)
        norm = math.sqrt(sum(float(v.double().square().sum()) for v in one.value.values()))
        assert (1 - under) * 1e-3 < norm <= 1e-3


class _Bf16Conv1DStack(nn.Module):
    """A linear layer, a GPT-2 Conv1D with its bias and a linear head: every weight instantiated when the engine's
    ``ghost_advantage`` is large."""

    def __init__(self) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.first, self.second = nn.Linear(32, 48, bias=False), Conv1D(32, 48)  # Conv1D(nf=out, nx=in)
        self.head = nn.Linear(32, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(torch.tanh(self.first(x))).mean(dim=1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_instantiated_bf16_weights_are_the_products_of_their_bf16_factors(monkeypatch, device):
    """Under bf16 autocast an instantiated weight's per-example gradient is the product of its bf16 factors (the
    output gradient and the bf16-rounded input) accumulated in float32, taken by ``bmm_accumulated`` (on CUDA, bf16
    tensor cores), for a linear layer's ``g^T a`` and a Conv1D's ``a^T g`` alike: the norms and the clipped sum
    equal the float64 products of those factors to 1e-6 of their size."""
    from opake_torch.layerwise import dense

    model, params, (x, y), loss, batch_loss = _autocast_case(_Bf16Conv1DStack, device)
    inputs, grads, handles = {}, {}, []
    for name, layer in {"first": model.first, "second": model.second, "head": model.head}.items():

        def keep(module, inp, out, name=name):
            inputs[name] = inp[0].to(torch.bfloat16).double().reshape(6, -1, inp[0].shape[-1])
            out.register_hook(lambda grad: grads.__setitem__(name, grad.double().reshape(6, -1, grad.shape[-1])))

        handles.append(layer.register_forward_hook(keep))
    batch_loss(dict(model.named_parameters()), x, y).sum().backward()
    for handle in handles:
        handle.remove()
    per_example = {
        "first.weight": torch.einsum("mto,mti->moi", grads["first"], inputs["first"]),
        "second.weight": torch.einsum("mti,mto->mio", inputs["second"], grads["second"]),
        "second.bias": grads["second"].sum(dim=1),
        "head.weight": torch.einsum("mto,mti->moi", grads["head"], inputs["head"]),
    }
    norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_example.values()))

    products = []
    monkeypatch.setattr(dense, "bmm_accumulated", lambda a, b: products.append(a.dtype) or bmm_accumulated(a, b))
    gradients = LayerwiseGradients(model, batch_loss, ghost_advantage=1e6)
    with torch.no_grad():
        measured = gradients(None, (params, x, y), (1, 2))[0].squared_norms().sum(dim=0).double().sqrt()
    assert products == [torch.bfloat16] * 6  # the three weights from their bf16 factors, in the chunk's pass and the
    # independence check's
    assert torch.allclose(measured, norms, rtol=1e-6, atol=0)

    bound = 0.05
    grad_fn, state = clipped_grad(loss, clipping_norm=bound, batch_argnums=(1, 2), engine=Engine(gradients=gradients))
    clipped, _ = grad_fn(params, x, y, state=state)
    assert (norms > bound).all()  # every example clipped: the sum depends on the norms
    scales = torch.clamp(bound / norms, max=1.0)
    for name, g in per_example.items():
        expected = torch.einsum("m,m...->...", scales, g)
        assert (clipped.value[name].double() - expected).norm() <= 1e-6 * expected.norm(), name


def test_float32_rmsnorm_weights_equal_autograd_per_example():
    """A float32 Llama's RMSNorm weights, instantiated from the normalized input the engine recomputes as the layer's
    forward computed it (float32 arithmetic, then the cast): each example's gradient equals ``grad`` of its own loss
    in float32, to float32 rounding."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    params, loss, batch_loss, batch = functional_losses(model, "llama", dtype=torch.float32)
    grads, _ = LayerwiseGradients(model, batch_loss)._run(params, (batch,), instantiate=False)
    names = [name for name in params if "norm" in name]
    assert names and all(params[name].dtype == torch.float32 for name in names)
    for i in range(6):
        expected = torch.func.grad(loss)(params, {k: v[i] for k, v in batch.items()})
        for name in names:
            torch.testing.assert_close(grads.dense[name][i], expected[name], rtol=1e-5, atol=1e-7, msg=name)
