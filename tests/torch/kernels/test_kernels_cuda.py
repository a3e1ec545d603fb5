"""GPU acceptance tests of the Triton kernels (all ``@pytest.mark.cuda``; CPU CI deselects them).

Each kernel's forward and per-example gradients under ``vmap(grad)`` against the torch reference on fresh random
inputs of several shapes (odd sizes included): relative error (``||a - b|| / ||b||`` per tensor) below 1e-5 in float32
and 2e-2 in bfloat16. The fused norms and scaled sums (through the core's clipping rule) against the torch path:
within 1e-6, never above the bound.

Run: ``pytest tests/torch/kernels -m cuda``. ``OPAKE_KERNEL_TEST_DEVICE=cpu`` with ``TRITON_INTERPRET=1`` runs the
same tests through the Triton interpreter on CPU (slow; a development aid).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_device import DEVICE, kernel_device  # noqa: F401 (kernel_device: an autouse fixture)
from torch.func import grad, vmap

from opake_core.clipping import MaterializedGradients
from opake_core.clipping.rules import ClipRule
from opake_torch.patches import kernels as K
from opake_torch.patches.kernels import FusedGradients, clip_sum, cross_entropy, fused_add_rms_norm
from opake_torch.patches.kernels import reference as R
from opake_torch.patches.kernels._triton import interpreting

pytestmark = pytest.mark.cuda

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _settings():
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_close(ours, ref, dtype, what):
    ours, ref = (ours,) if isinstance(ours, torch.Tensor) else ours, (ref,) if isinstance(ref, torch.Tensor) else ref
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == b.shape, f"{what}[{i}]: shape {tuple(a.shape)} != {tuple(b.shape)}"
        err = _rel(a, b)
        assert err < TOL[dtype], f"{what}[{i}]: relative error {err:.3g} >= {TOL[dtype]} ({dtype})"


def _per_example(loss, argnums, in_dims, *args):
    return vmap(grad(loss, argnums=argnums), in_dims=in_dims)(*args)


# --- RMSNorm ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 64), (3, 17, 127), (2, 5, 4097), (1, 1, 7)])
def test_rms_norm(shape, dtype):
    x, w = _randn(*shape, dtype=dtype), (1 + 0.1 * _randn(shape[-1])).to(dtype)
    r = _randn(*shape[1:])
    _assert_close(K.opake_rms_norm(x, w, 1e-5), R.rms_norm(x, w, 1e-5), dtype, "forward")

    def loss(fn):
        return lambda w, x: (fn(x, w, 1e-5).float() * r).sum()

    ours = _per_example(loss(K.opake_rms_norm), (0, 1), (None, 0), w, x)
    ref = _per_example(loss(R.rms_norm), (0, 1), (None, 0), w, x)
    assert ours[0].shape == (shape[0], shape[-1])
    _assert_close(ours, ref, dtype, "per-example grads (w, x)")


def test_rms_norm_plain_backward_and_nested_vmap():
    x, w = _randn(2, 3, 5, 96), 1 + 0.1 * _randn(96)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    K.opake_rms_norm(xs, ws).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    R.rms_norm(xr, wr).square().sum().backward()
    _assert_close((xs.grad, ws.grad), (xr.grad, wr.grad), torch.float32, "plain backward")

    def loss(fn):
        return lambda w, x: fn(x, w).sin().sum()

    ours = vmap(vmap(grad(loss(K.opake_rms_norm)), in_dims=(None, 0)), in_dims=(None, 0))(w, x)
    ref = vmap(vmap(grad(loss(R.rms_norm)), in_dims=(None, 0)), in_dims=(None, 0))(w, x)
    _assert_close(ours, ref, torch.float32, "nested vmap")


# --- fused residual add + RMSNorm ------------------------------------------------------------------------------------


def _add_rms_f64(x, residual, w, eps):
    """The float64 definition: ``h = x + residual`` rounded to the input dtype (as the unfused add rounds it), then
    ``w * h / sqrt(mean(h^2) + eps)``."""
    h = (x.double() + residual.double()).to(x.dtype).double()
    return w.double() * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 64), (3, 17, 127), (2, 5, 4097), (1, 1, 7)])
def test_fused_add_rms_norm(shape, dtype):
    x, res, w = _randn(*shape, dtype=dtype), _randn(*shape, dtype=dtype), (1 + 0.1 * _randn(shape[-1])).to(dtype)
    ry, rh = _randn(*shape[1:]), _randn(*shape[1:])
    y, h = K.opake_fused_add_rms_norm(x, res, w, 1e-5)
    assert y.dtype == h.dtype == dtype
    if dtype == torch.float32 or not interpreting():  # the interpreter truncates float32 -> bfloat16 casts
        assert torch.equal(h, x + res)  # the residual stream is the unfused add, bit for bit
    _assert_close((y, h), _add_rms_f64(x, res, w, 1e-5), dtype, "forward")

    def loss(fn):  # both outputs carry gradient: y into the MLP, h along the residual path
        def f(w, x, res):
            y, h = fn(x, res, w, 1e-5)
            return (y.to(ry.dtype) * ry).sum() + (h.to(rh.dtype) * rh).sum()

        return f

    ours = _per_example(loss(K.opake_fused_add_rms_norm), (0, 1, 2), (None, 0, 0), w, x, res)
    ref = _per_example(loss(_add_rms_f64), (0, 1, 2), (None, 0, 0), w, x, res)
    assert ours[0].shape == (shape[0], shape[-1])
    _assert_close(ours, ref, dtype, "per-example grads (w, x, residual)")


def test_fused_add_rms_norm_per_example_weight_grads_equal_a_loop():
    """vmap(grad) over examples (the residual shared, unbatched) equals one plain backward per example."""
    x, res, w = _randn(3, 5, 96), _randn(5, 96), 1 + 0.1 * _randn(96)

    def loss(w, x):
        y, h = K.opake_fused_add_rms_norm(x, res, w)
        return y.sin().sum() + h.square().sum()

    batched = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0))(w, x)
    for i in range(x.shape[0]):
        wi, xi = w.clone().requires_grad_(), x[i].clone().requires_grad_()
        loss(wi, xi).backward()
        _assert_close((batched[0][i], batched[1][i]), (wi.grad, xi.grad), torch.float32, f"example {i}")


def test_fused_add_rms_norm_plain_backward_and_nested_vmap():
    x, res, w = _randn(2, 3, 5, 96), _randn(2, 3, 5, 96), 1 + 0.1 * _randn(96)
    leaves = [t.clone().requires_grad_() for t in (x, res, w)]
    y, h = K.opake_fused_add_rms_norm(*leaves)
    (y.square().sum() + h.sin().sum()).backward()
    refs = [t.double().requires_grad_() for t in (x, res, w)]
    y, h = _add_rms_f64(*refs, 1e-6)
    (y.square().sum() + h.sin().sum()).backward()
    _assert_close([t.grad for t in leaves], [t.grad for t in refs], torch.float32, "plain backward")

    def loss(fn):
        return lambda w, x, res: sum(t.sin().sum() for t in fn(x, res, w, 1e-6))

    def nested(fn):
        return vmap(vmap(grad(loss(fn)), in_dims=(None, 0, 0)), in_dims=(None, 0, 0))(w, x, res)

    _assert_close(nested(K.opake_fused_add_rms_norm), nested(_add_rms_f64), torch.float32, "nested vmap")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_fused_add_rms_norm_patched_decoder_per_example_gradients(monkeypatch, family):
    """A two-layer decoder with only the fused add + RMSNorm patch (the kernel, not the fallback): per-example
    gradients of every parameter equal the unpatched model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from opake_torch.patches import performance

    config = AutoConfig.for_model(
        family, vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(DEVICE)
    for name, p in model.named_parameters():
        if "layernorm" in name:
            p.data.uniform_(0.5, 1.5)
    ids = torch.randint(0, 48, (3, 7), device=DEVICE)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, ids):
        out = torch.func.functional_call(model, params, (ids.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[1:])

    before = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    monkeypatch.setattr(performance, "available", lambda: True)
    only = {name: name == "fused_add_rms_norm" for name in performance.KERNELS}
    assert performance.apply_performance_kernels(model, performance_kernels_config=only) == ["fused_add_rms_norm"]
    launched = []
    forward = fused_add_rms_norm._FusedAddRMSNorm.forward
    monkeypatch.setattr(fused_add_rms_norm._FusedAddRMSNorm, "forward", lambda *a: launched.append(1) or forward(*a))
    after = vmap(grad(loss), in_dims=(None, 0))(params, ids)
    assert launched, "the kernel did not run"
    for name in before:
        _assert_close(after[name], before[name], torch.float32, name)


# --- SwiGLU / GeGLU ---------------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "swiglu": (K.opake_swiglu, R.swiglu),
    "geglu": (K.opake_geglu, R.geglu),
    "geglu_tanh": (lambda g, u: K.opake_geglu(g, u, "tanh"), lambda g, u: R.geglu(g, u, "tanh")),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(ACTIVATIONS))
@pytest.mark.parametrize("shape", [(2, 5, 32), (3, 7, 129), (2, 33, 1001)])
def test_activation(kind, shape, dtype):
    ours_fn, ref_fn = ACTIVATIONS[kind]
    b, s, d = shape
    p, x, u = (_randn(16, d) / 4).to(dtype), _randn(b, s, 16, dtype=dtype), _randn(b, s, d, dtype=dtype)
    _assert_close(ours_fn(x @ p, u), ref_fn(x @ p, u), dtype, "forward")
    r = _randn(s, d)

    def loss(fn):
        return lambda p, x, u: (fn(x @ p, u).float() * r).sum()

    ours = _per_example(loss(ours_fn), (0, 1, 2), (None, 0, 0), p, x, u)
    ref = _per_example(loss(ref_fn), (0, 1, 2), (None, 0, 0), p, x, u)
    _assert_close(ours, ref, dtype, "per-example grads (p, x, u)")


# --- RoPE -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,seq,dim", [(2, 1, 5, 8), (4, 2, 33, 64), (3, 3, 17, 128)])
@pytest.mark.parametrize("shared_positions", [False, True])
def test_rope(heads, kv_heads, seq, dim, dtype, shared_positions):
    b = 3
    q, k = _randn(b, 1, heads, seq, dim, dtype=dtype), _randn(b, 1, kv_heads, seq, dim, dtype=dtype)
    angle = _randn(b, 1, seq, dim // 2) * 3
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    if shared_positions:
        cos, sin = cos[0], sin[0]
    p = (torch.eye(dim, device=DEVICE) + 0.1 * _randn(dim, dim)).to(dtype)
    rq, rk = _randn(1, heads, seq, dim), _randn(1, kv_heads, seq, dim)
    c_dim = None if shared_positions else 0

    def loss(fn):
        def f(p, q, k, cos, sin):
            a, b_ = fn(q @ p, k @ p, cos, sin)
            return (a.float() * rq).sum() + (b_.float() * rk).sum()

        return f

    args = (p, q, k, cos, sin)
    dims = (None, 0, 0, c_dim, c_dim)
    _assert_close(
        vmap(K.opake_rope, in_dims=(0, 0, c_dim, c_dim))(q, k, cos, sin),
        vmap(R.rope, in_dims=(0, 0, c_dim, c_dim))(q, k, cos, sin),
        dtype,
        "forward",
    )
    _assert_close(
        _per_example(loss(K.opake_rope), (0, 1, 2), dims, *args),
        _per_example(loss(R.rope), (0, 1, 2), dims, *args),
        dtype,
        "per-example grads (p, q, k)",
    )


# --- cross-entropy and fused linear cross-entropy ---------------------------------------------------------------------


def _targets(b, s, v):
    t = torch.randint(0, v, (b, s), device=DEVICE)
    t[0, : s // 2] = -100
    return t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,v", [(2, 3, 33), (3, 17, 1000), (2, 9, 32003)])
def test_cross_entropy(b, s, v, dtype):
    h, p, t = _randn(b, s, 16, dtype=dtype), (_randn(16, v) / 2).to(dtype), _targets(b, s, v)
    for reduction in ("mean", "sum", "none"):
        _assert_close(
            K.opake_cross_entropy_loss(h @ p, t, reduction=reduction),
            R.cross_entropy(h @ p, t, reduction=reduction),
            dtype,
            f"forward {reduction}",
        )

    def loss(fn):
        return lambda p, h, t: fn(h @ p, t)

    ours = _per_example(loss(K.opake_cross_entropy_loss), (0, 1), (None, 0, 0), p, h, t)
    ref = _per_example(loss(R.cross_entropy), (0, 1), (None, 0, 0), p, h, t)
    _assert_close(ours, ref, dtype, "per-example grads (p, h)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,hidden,v", [(2, 3, 16, 33), (3, 17, 64, 1000), (2, 9, 40, 32003)])
@pytest.mark.parametrize("chunked", [False, True])
def test_fused_linear_cross_entropy(b, s, hidden, v, dtype, chunked, monkeypatch):
    if chunked:  # several row chunks per call
        monkeypatch.setattr(cross_entropy, "_CHUNK_ELEMENTS", 4 * v)
    h, m = (
        _randn(b, s, hidden, dtype=dtype),
        (torch.eye(hidden, device=DEVICE) + 0.1 * _randn(hidden, hidden)).to(dtype),
    )
    w, t = (_randn(v, hidden) / math.sqrt(hidden)).to(dtype), _targets(b, s, v)
    _assert_close(K.opake_fused_linear_cross_entropy(h, w, t), R.fused_linear_cross_entropy(h, w, t), dtype, "forward")

    def loss(fn):
        return lambda w, m, h, t: fn(h @ m, w, t)

    # trainable head: per-example [B, V, H] head gradients; frozen head: only the upstream parameter
    for argnums in ((0, 1, 2), (1,)):
        ours = _per_example(loss(K.opake_fused_linear_cross_entropy), argnums, (None, None, 0, 0), w, m, h, t)
        ref = _per_example(loss(R.fused_linear_cross_entropy), argnums, (None, None, 0, 0), w, m, h, t)
        _assert_close(ours, ref, dtype, f"per-example grads {argnums}")


# --- LoRA -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_in,d_out,rank", [(16, 24, 4), (127, 65, 8)])
def test_lora(d_in, d_out, rank, dtype):
    def proj(i, o, r, bias=False):
        return K.LoRAProjection(
            (_randn(o, i) / math.sqrt(i)).to(dtype), (_randn(r, i) / math.sqrt(i)).to(dtype),
            (_randn(o, r) / math.sqrt(r)).to(dtype), _randn(o, dtype=dtype) if bias else None,
        )  # fmt: skip

    x = _randn(3, 9, d_in, dtype=dtype)
    gate, up, down = proj(d_in, d_out, rank), proj(d_in, d_out, rank), proj(d_out, d_in, rank)

    def mlp(fn, up_cast):
        def f(ad, x):
            ps = [up_cast(p._replace(lora_A=a, lora_B=b)) for p, (a, b) in zip((gate, up, down), ad, strict=True)]
            return (fn(up_cast(x), *ps, 2.0).float() * r_mlp).sum()

        return f

    def identity(t):
        return t

    def to_float32(t):  # the bfloat16 kernels are held to the float32 torch reference on the same inputs
        if isinstance(t, torch.Tensor):
            return t.float()
        return t._replace(**{f: getattr(t, f).float() for f in t._fields if getattr(t, f) is not None})

    r_mlp = _randn(9, d_in)
    for make, projections in ((mlp, (gate, up, down)),):
        adapters = [(p.lora_A, p.lora_B) for p in projections]
        fused, ref = K.opake_lora_mlp, R.lora_mlp
        ours = vmap(grad(make(fused, identity)), in_dims=(None, 0))(adapters, x)
        theirs = vmap(grad(make(ref, to_float32)), in_dims=(None, 0))(adapters, x)
        ours, theirs = torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)
        _assert_close(ours, theirs, dtype, f"per-example LoRA grads ({make.__name__})")


# --- fused clip-and-sum -----------------------------------------------------------------------------------------------

LEAF_SHAPES = [(3, 7), (11,), (1,), (2, 3, 4), (9001,), (64, 130), (5, 5, 5)]


def _leaves(m, dtypes, scale=1.0):
    grads = []
    for i, shape in enumerate(LEAF_SHAPES):
        dtype = dtypes[i % len(dtypes)]
        grads.append((_randn(m, *shape) * scale * (0.01 + i / 3)).to(dtype))
    return grads


def _sums(grads):
    return [torch.zeros(g.shape[1:], dtype=torch.float64 if g.dtype == torch.float64 else torch.float32,
                        device=g.device) for g in grads]  # fmt: skip


def _clip(form, grads, group_index, bounds, sums):
    """The core rule with the gradients held as ``form``, adding into ``sums``: ``(norms [m], group_norms [G, m])``."""
    rule = ClipRule(tuple(group_index), len(bounds))
    bounds_t = torch.tensor(bounds, dtype=torch.float64, device=grads[0].device)[:, None]
    chunk_sums, norms, _ = rule(
        form(grads), [torch.empty(g.shape[1:], dtype=g.dtype, device=g.device) for g in grads], bounds_t, None
    )
    torch._foreach_add_(sums, chunk_sums)
    leaf_sq = form(grads).squared_norms()
    group_norms = torch.stack(
        [leaf_sq[[i for i, k in enumerate(group_index) if k == g]].sum(dim=0) for g in range(len(bounds))]
    ).sqrt()
    return norms, group_norms


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16, torch.float64)], ids=str
)
@pytest.mark.parametrize("groups", [1, 2])
def test_fused_clip_and_sum_matches_the_torch_path(m, dtypes, groups):
    grads = _leaves(m, dtypes)
    if m > 1:
        grads[0][0, 0, 0] = float("nan")
        grads[4][m - 1, 17] = float("inf")
    group_index = [i % groups for i in range(len(grads))]
    bounds = [1.0, 0.3][:groups]
    assert clip_sum.fused_supported(grads, _sums(grads))
    ours, ref = _sums(grads), _sums(grads)
    for _ in range(2):  # accumulates across calls (microbatches)
        n1, g1 = _clip(FusedGradients, grads, group_index, bounds, ours)
        n2, g2 = _clip(MaterializedGradients, grads, group_index, bounds, ref)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=0, equal_nan=True)
    torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0, equal_nan=True)  # float32 diagnostics
    for a, b in zip(ours, ref, strict=True):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_fused_clip_and_sum_never_exceeds_the_bound(dtype, scale):
    bound = 0.7
    grads = _leaves(8, (dtype,), scale)
    for i in range(8):
        sums = _sums(grads)
        _clip(FusedGradients, [g[i : i + 1] for g in grads], [0] * len(grads), [bound], sums)
        norm = math.sqrt(sum(s.double().square().sum().item() for s in sums))
        assert norm <= bound, f"example {i}: ||clipped|| = {norm!r} > {bound}"


def test_fused_clip_and_sum_drops_non_finite_examples():
    grads = _leaves(2, (torch.float32,))
    grads[3][0, 1, 2, 3] = float("nan")
    sums = _sums(grads)
    norms, _ = _clip(FusedGradients, grads, [0] * len(grads), [1.0], sums)
    assert not math.isfinite(norms[0].item()) and math.isfinite(norms[1].item())
    only = _sums(grads)
    _clip(FusedGradients, [g[1:] for g in grads], [0] * len(grads), [1.0], only)
    for a, b in zip(sums, only, strict=True):
        assert torch.equal(a, b)


def test_fused_clip_and_sum_many_leaves_one_launch_per_pass():
    grads = [_randn(4, 37) for _ in range(200)]
    ours, ref = _sums(grads), _sums(grads)
    _clip(FusedGradients, grads, [0] * 200, [0.5], ours)
    _clip(MaterializedGradients, grads, [0] * 200, [0.5], ref)
    for a, b in zip(ours, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-6
