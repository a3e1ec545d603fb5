"""Per-example gradients from layer inputs and output gradients: one batched forward and backward, no vmap.

For a layer ``y = W a (+ b)`` applied to the ``T`` positions of example ``i``, the example's weight gradient is
``G_i = sum_t g_it a_it^T`` where ``g_it = dL_i / dy_it``. Both factors come out of one ordinary batched pass: the
inputs ``a`` from a forward hook, the output gradients ``g`` from a tensor hook on the output (or, for the first
layers, whose outputs need no gradient yet, a tap that links them to a scalar anchor: the backward runs to the anchor
and forms no parameter gradient). From them, per layer:

* **instantiate**: ``G_i`` itself (``[m, out, in]``), cheap when ``out * in`` is small (LoRA adapters, biases,
  norm weights), written into one buffer per (dtype, size) group so that norms and scaled sums take one launch per
  group;
* **ghost norm** (Li et al. 2022, arXiv 2110.05679, section 4.2): ``||G_i||^2 = sum_{t,s} (a_it . a_is)(g_it . g_is)``,
  taken in float64 from two ``T x T`` Gram matrices when ``T (in + out) < in * out`` (:data:`GHOST_ADVANTAGE`); the
  clipped sum is then ``sum_i c_i G_i = g^T (c * a)``, one matmul, the same as a non-private weight gradient
  ("book-keeping", Bu et al. 2023, arXiv 2210.00038); the scaled input ``c * a`` is formed once for the layers that
  read the same input (q, k and v).

A linear layer that ran in bfloat16 (bf16 weights or bf16 autocast: its output gradient is bf16) has the weight
gradient ``g^T bf16(a)``, a product of bf16 factors, so its norms are taken from the bf16-rounded input and its
clipped sum runs on bf16 tensor cores with float32 accumulation: the scaled factor ``fl32(c_i g_it)`` of the float32
sum is split exactly into three bf16 parts (8 + 8 + 8 significand bits), so the contribution of every example is the
float32 one: three bf16 tensor-core products in place of one float32 matmul without tensor cores (see
:func:`_bf16_parts`).

:class:`LayerwiseGradients` is the ``gradients`` part of an :class:`opake_core.clipping.Engine`. Clipping itself
stays in :mod:`opake_core.clipping.rules`, which takes the squared norms, forms the scales with the same rule and
margin as for materialized gradients and asks for the scaled sum: the two engines release the same clipped sum up to
float rounding.

Under activation checkpointing (:func:`opake_torch.patches.checkpointing.checkpoint_layer`) a checkpointed layer's
forward runs without gradients and keeps nothing: the hooks note only which layers ran. Its recompute in the
backward takes the pass's anchor as an input (:func:`active_anchor`) and runs in plain autograd, so the recomputed
layers are tapped like the others and their gradients are formed there, inside the backward, while the layer's
recomputed activations exist: small gradients (adapters) are instantiated at once; a large weight keeps its
recomputed input and output gradient for the book-keeping sum, ``T (in + out)`` numbers per example instead of the
``in * out`` of its per-example gradient (so a full fine-tune under checkpointing keeps, per layer, the inputs and
output gradients of its linear layers, not the layer's whole activations).

Supported layers: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face's ``Conv1D`` and
Llama- and gpt-oss-style ``*RMSNorm`` layers, with their stock ``forward``; every layer must see the batch in dimension
0 (Hugging Face models are batch-first). Attention sinks (gpt-oss) through Hugging Face's eager attention, which
expands them over the batch (:class:`_BroadcastTap`). Hugging Face's mixture-of-experts layers too, which see the
tokens flattened to ``[m T, d]``: top-k routers (a linear layer on those rows; a tensor hook on the logits they
return sees the gradient through the routing weights) and stacked ``[E, ...]`` experts, which run
:func:`_tapped_experts_forward` during the pass (one row per token and chosen expert; ghost norms per expert from the
rows of each example routed to it, the clipped sum one matmul per expert). A layer other than an embedding whose
input is two-dimensional with a multiple of ``m`` rows takes them as tokens flattened example-major (``[m T, d]``: MoE
shared experts, the gated norm's heads). The gated delta-net of Qwen3-Next and Qwen3.5-MoE: its zero-centred and gated
RMSNorms are norm layers; its ``A_log``, ``dt_bias`` and depthwise causal ``nn.Conv1d``, used in the layer's own
code, are followed during its call and tapped where they meet the batch (:mod:`opake_torch.layerwise_uses`).

A parameter used by several layers or calls (tied embeddings) is instantiated per call and summed before its norm
is taken. The batched pass assumes that examples do not interact: modules that mix
examples (batch normalization) are refused, and :meth:`LayerwiseGradients.check` compares the per-example gradients with
``grad`` of the per-example loss, one example at a time, on a few examples: that catches a parameter used outside a
supported layer and any other coupling. Hooks exist only for the duration of one call.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import nn

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.layerwise_uses import DEPTHWISE, ELEMENTWISE, ParameterUses, Watched, add_conv_gradient, uses_kind

__all__ = ["LayerwiseGradients", "active_anchor", "unsupported_parameters"]

_ACTIVE = threading.local()


def active_anchor() -> torch.Tensor | None:
    """The anchor of the layerwise pass running on this thread, None outside one: a checkpointed layer takes it as an
    input, so that its recompute runs in the backward and its taps link to it."""
    return getattr(_ACTIVE, "anchor", None)


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _llama_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _gpt_oss_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _zero_centered_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _zero_centered_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


# never called: the code of the gated delta-net's ``*RMSNormGated.forward``, compared by :func:`_same_code`
def _gated_rms_norm(self: Any, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))  # noqa: F821
    return hidden_states.to(input_dtype)


def _same_code(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions compile to the same code (same source up to their names and modules)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def _kind(module: nn.Module) -> str | None:
    """The layer kind this engine knows, for a module whose ``forward`` is the stock one; otherwise None.

    RMSNorm: ``nn.RMSNorm``, and Hugging Face's Llama-style ``*RMSNorm`` (Llama, Mistral, Qwen2, Qwen3, ...), whose
    ``forward`` must compile to exactly :func:`_llama_rms_norm`, or to :func:`_gpt_oss_rms_norm` (gpt-oss: the weight
    multiplies the float32 normalized input, then the cast), or, with ``_norm``, to :func:`_zero_centered_rms_norm`
    (``1 + weight``: Gemma, Qwen3-Next, Qwen3.5-MoE); the gated delta-net's ``*RMSNormGated``
    (:func:`_gated_rms_norm`: ``weight * norm(x) * silu(gate)``). The gated delta-net's own ``A_log`` and ``dt_bias``
    and its depthwise ``nn.Conv1d``: see :mod:`opake_torch.layerwise_uses`.
    Attention sinks: a Hugging Face attention layer's own ``sinks`` parameter (gpt-oss), see :class:`_BroadcastTap`.
    """
    conv1d = _conv1d_type()
    bases = (("linear", nn.Linear), ("embedding", nn.Embedding), ("layer_norm", nn.LayerNorm), ("rms_norm", nn.RMSNorm))
    for kind, base in bases:
        if isinstance(module, base) and type(module).forward is base.forward:
            if kind == "embedding" and (module.max_norm is not None or module.sparse or module.scale_grad_by_freq):
                return None  # renormalized rows, sparse gradients, or a batch-frequency scale that couples examples
            return kind
    if conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward:
        return "conv1d"
    if hasattr(module, "variance_epsilon") and _same_code(type(module).forward, _llama_rms_norm):
        return "llama_rms_norm"
    if hasattr(module, "variance_epsilon") and _same_code(type(module).forward, _gpt_oss_rms_norm):
        return "gpt_oss_rms_norm"
    forward, norm = type(module).forward, getattr(type(module), "_norm", None)
    zero_centered = _same_code(forward, _zero_centered_rms_norm) and _same_code(norm, _zero_centered_norm)
    if hasattr(module, "eps") and zero_centered:
        return "zero_centered_rms_norm"
    if getattr(module, "activation", None) == "silu" and _same_code(forward, _gated_rms_norm):
        return "gated_rms_norm"
    if (kind := uses_kind(module)) is not None:
        return kind
    sinks = module._parameters.get("sinks")
    if type(module).__module__.startswith("transformers.") and isinstance(sinks, nn.Parameter):
        return "attention_sinks"
    return _moe_kind(module)


def _owners(model: nn.Module, names: set[str]) -> tuple[dict[str, list[tuple[nn.Module, str, str]]], list[str]]:
    """For every trainable name, the ``(module, attribute, kind)`` places it is used; and the names without one."""
    canonical = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in names:
            canonical[id(param)] = name
    places: dict[str, list[tuple[nn.Module, str, str]]] = {name: [] for name in names}
    orphans = set()
    for module in model.modules():
        kind = _kind(module)
        for attr, param in module.named_parameters(recurse=False):
            name = canonical.get(id(param))
            if name is None:
                continue
            if kind is None:
                orphans.add(name)
            else:
                places[name].append((module, attr, kind))
    missing = sorted(orphans | {name for name, where in places.items() if not where})
    return places, missing


def unsupported_parameters(model: nn.Module, params: dict[str, torch.Tensor]) -> list[str]:
    """Trainable names the layerwise engine cannot serve (empty when :class:`LayerwiseGradients` applies).

    Each entry says which parameter and why: it lives outside a supported layer, or the model mixes examples.
    """
    if not isinstance(params, dict):
        raise InputTypeError(f"params must be a dict of name -> tensor, got {type(params).__name__}.")
    reasons = [f"{type(m).__name__} mixes examples in training mode" for m in model.modules() if _mixes(m)]
    _, missing = _owners(model, set(params))
    owner = dict(model.named_modules())
    for name in missing:
        parent = owner.get(name.rpartition(".")[0])
        reasons.append(f"{name} (in {type(parent).__name__ if parent is not None else 'the model'})")
    return reasons


def _mixes(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm | nn.SyncBatchNorm) and module.training


class _Tap(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to ``record``.

    It also links the output to ``anchor`` (a scalar leaf), so that a backward to the anchor reaches every tapped
    layer and nothing else: no parameter gradient is ever formed.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, anchor: torch.Tensor, record: Callable[[torch.Tensor], None]) -> Any:
        ctx.record = record
        ctx.anchor = (anchor.dtype, anchor.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        ctx.record(grad)
        dtype, device = ctx.anchor
        return grad, torch.zeros((), dtype=dtype, device=device), None


class _BroadcastTap(torch.overrides.TorchFunctionMode):
    """Active during one call of an attention layer with sinks: the expansion of its ``sinks`` parameter over the
    batch (``sinks.reshape(1, -1, 1, 1).expand(m, -1, T, -1)`` in Hugging Face's eager attention, the only place it
    is used) goes through ``on_expand``, which taps it; the tap's gradient ``[m, H, T, 1]`` summed over the positions
    is each example's gradient of the sinks. ``tapped`` says whether that expansion happened (other attention
    implementations use the sinks otherwise, and are refused)."""

    def __init__(self, param: torch.Tensor, m: int, on_expand: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.seen, self.m, self.on_expand, self.tapped = [param], m, on_expand, False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not args or not any(args[0] is seen for seen in self.seen):
            return out
        if func is torch.Tensor.expand and out.dim() and out.shape[0] == self.m:
            self.tapped = True
            return self.on_expand(out)
        if func in (torch.Tensor.reshape, torch.Tensor.view):
            self.seen.append(out)
        return out


@dataclass(frozen=True)
class _Routing:
    """Where the ``m R`` rows of an experts layer went (example ``i`` owns rows ``i R ... i R + R - 1``), read from
    the device once per layer: ``order`` lists the rows grouped by expert (ascending within each), ``counts[e]`` is
    how many went to expert ``e`` and ``widths[e]`` the most that one example sent it."""

    experts: torch.Tensor  # [m R]: the expert of every row
    order: torch.Tensor
    counts: list[int]
    widths: list[int]

    @staticmethod
    def of(experts: torch.Tensor, num_experts: int, m: int) -> _Routing:
        example = torch.div(torch.arange(experts.shape[0], device=experts.device), experts.shape[0] // m,
                            rounding_mode="floor")  # fmt: skip
        per_pair = torch.bincount(experts * m + example, minlength=num_experts * m).view(num_experts, m)
        counts, widths = torch.stack([per_pair.sum(dim=1), per_pair.max(dim=1).values]).tolist()
        return _Routing(experts, torch.argsort(experts, stable=True), counts, widths)

    def groups(self) -> Iterator[tuple[int, torch.Tensor, int]]:
        """``(expert, its rows in ascending order, widest example)`` for every expert that got rows."""
        start = 0
        for e, (count, width) in enumerate(zip(self.counts, self.widths, strict=True)):
            if count:
                yield e, self.order[start : start + count], width
            start += count


@dataclass
class _Call:
    """One call of a supported layer: its input, and the gradient of its output once the backward reached it."""

    kind: str
    module: nn.Module
    names: dict[str, str]  # attribute -> trainable name
    inputs: torch.Tensor | None  # None for the forward of a checkpointed layer, which keeps nothing
    positions: int  # T: the positions of one example the layer runs on
    grad: torch.Tensor | None = None
    input_key: tuple[Any, ...] | None = None  # the identity of ``inputs`` (:func:`_same_tensor`)
    routing: _Routing | None = None  # kind "experts": which rows went to which expert
    transposed: bool = False  # kind "experts": weights stored ``[E, in, out]`` instead of ``[E, out, in]``
    gate: torch.Tensor | None = None  # kind "gated_rms_norm": the gate input


def _in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (itself when it already is: no dispatch for a no-op conversion)."""
    return x if x.dtype == dtype else x.to(dtype)


def _rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``[m, ..., d]`` as ``[m, T, d]`` (``T = 1`` for a layer applied once per example)."""
    return x.reshape(m, -1, x.shape[-1])


def _live_ids(call: _Call, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding call's ids ``[m, T]`` and which of them get a gradient (not ``padding_idx``)."""
    ids = call.inputs.reshape(m, -1)
    pad = call.module.padding_idx
    return ids, (ids != pad) if pad is not None else torch.ones_like(ids, dtype=torch.bool)


def _bf16_factors(call: _Call) -> bool:
    """Whether a linear or Conv1D call ran in bfloat16 (its output gradient is bf16: bf16 weights or bf16 autocast),
    so that its weight gradient is the product of bf16 factors, the output gradient and the bf16-rounded input."""
    return call.kind in ("linear", "conv1d") and call.grad is not None and call.grad.dtype == torch.bfloat16


def _input_factor(call: _Call, m: int) -> torch.Tensor:
    """``[m, T, in]``: the input the call's weight gradient multiplies (rounded to bf16 where the layer ran in bf16,
    as its forward rounded it)."""
    x = _rows(call.inputs, m)
    return _in(x, torch.bfloat16) if _bf16_factors(call) else x


def _bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 ``[..., d]``) as three bfloat16 parts concatenated on the last dimension (``[..., 3d]``) whose
    sum in exact arithmetic is ``x``: each part rounds what the previous ones left to 8 significand bits, and the
    remainders shrink by ``2^-8`` at least, so three parts hold a 24-bit float32 significand. Exact for ``|x| >=
    2^-110``; below, the last part loses the bits under ``2^-133`` (bf16's smallest subnormal). Products with a bf16
    factor accumulate in float32 as ``x``'s would."""
    high = x.to(torch.bfloat16)
    rest = x - high.float()
    mid = rest.to(torch.bfloat16)
    low = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([high, mid, low], dim=-1)


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices with a float32 result: on tensor cores with float32 accumulation on CUDA
    (``out_dtype``, torch >= 2.8), as float32 matmuls elsewhere or where that overload is missing (the same sums of
    exact products)."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError, TypeError):
            pass
    return torch.mm(a.float(), b.float())


def _add_bf16_product(call: _Call, drop: torch.Tensor, scale: torch.Tensor, total: torch.Tensor) -> None:
    """``total += sum_i scale_i G_i`` for a layer with bf16 factors (float32 ``total``): the float32 scaled factor
    ``fl32(scale_i g_it)`` in three exact bf16 parts times the bf16 input, one matmul, then the parts' three
    products added, smallest first. ``drop`` (``[m, 1, 1]``) masks the examples with scale 0."""
    m, out = scale.shape[0], call.grad.shape[-1]
    g = torch.where(drop, 0.0, _in(_rows(call.grad, m), torch.float32) * scale)
    parts = _bf16_parts(g).reshape(-1, 3 * out)
    a = torch.where(drop, 0.0, _input_factor(call, m)).reshape(m * g.shape[1], -1)
    if call.kind == "linear":
        high, mid, low = _mm_float32(parts.T, a).view(3, out, -1).unbind(0)
    else:  # conv1d: weight [in, out]
        high, mid, low = _mm_float32(a.T, parts).view(-1, 3, out).unbind(1)
    total.add_(high + (mid + low))


def _gram(x: torch.Tensor) -> torch.Tensor:
    """float64 ``[m, T, T]`` Gram matrices of ``x`` ``[m, T, d]``."""
    x = x.to(torch.float64)
    return torch.bmm(x, x.transpose(1, 2))


def _frobenius(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[m]`` inner products ``sum_{t,s} a_its b_its`` of two ``[m, T, T]`` tensors, in one launch."""
    m = a.shape[0]
    return torch.bmm(a.reshape(m, 1, -1), b.reshape(m, -1, 1)).reshape(m)


@dataclass
class _Group:
    """Instantiated per-example gradients of the names that share an accumulation dtype and a size: one contiguous
    buffer ``[c, m, numel]`` (name ``j``'s gradients are ``buffer[j]``), so that their norms and their scaled sum
    take one batched operation each instead of one per name."""

    names: list[str]
    dtype: torch.dtype
    numel: int
    buffer: torch.Tensor | None = None  # zeros from the backward's first write into the group; None before


@dataclass
class _Gradients:
    """The chunk's per-example gradients: per trainable name, instantiated ``[m, *shape]`` or ghost calls.

    Instantiated gradients live in the buffers of :class:`_Group` (``dense[name]`` is a view of its rows), grouped
    once the forward has shown which names they are (:meth:`group`); a group's buffer is allocated at the backward's
    first write into it (:meth:`block`), past the forward's peak, and a group never written holds zero gradients.
    """

    names: list[str]
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]  # accumulation dtype: float64 for float64 parameters, else float32
    m: int
    device: torch.device
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [m, *shape], a view of its group's buffer
    ghost: dict[str, tuple[_Call, torch.Tensor]] = field(default_factory=dict)  # name -> (call, squared norms)
    groups: list[_Group] = field(default_factory=list)
    group_of: dict[str, _Group] = field(default_factory=dict)
    product_error: float = 0.0  # of the float32 ghost sums, at the run's matmul precision (:func:`product_error`)

    def group(self, names: Sequence[str]) -> None:
        """The (dtype, size) groups of the instantiated gradients of ``names``."""
        by_size: dict[tuple[torch.dtype, int], list[str]] = {}
        for name in names:
            by_size.setdefault((self.dtypes[name], math.prod(self.shapes[name])), []).append(name)
        for (dtype, numel), members in by_size.items():
            self.groups.append(_Group(members, dtype, numel))
            self.group_of.update(dict.fromkeys(members, self.groups[-1]))

    def block(self, name: str) -> torch.Tensor:
        """``[m, *shape]``: where the gradients of ``name`` are written (its group's buffer, allocated at the first
        request)."""
        if name not in self.dense:
            group = self.group_of[name]
            group.buffer = torch.zeros(len(group.names), self.m, group.numel, dtype=group.dtype, device=self.device)
            for member, rows in zip(group.names, group.buffer.unbind(0), strict=True):
                self.dense[member] = rows.view(self.m, *self.shapes[member])
        return self.dense[name]

    def squared_norms(self) -> torch.Tensor:
        rows = {name: sq for name, (_, sq) in self.ghost.items()}
        for group in self.groups:  # vector_norm accumulates in float64 without a float64 copy of the buffer
            if group.buffer is None:
                continue
            sq = torch.linalg.vector_norm(group.buffer, dim=2, dtype=torch.float64).square()
            rows.update(zip(group.names, sq.unbind(0), strict=True))
        zeros = torch.zeros(self.m, dtype=torch.float64, device=self.device)
        return torch.stack([rows.get(name, zeros) for name in self.names])

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        """Consumes the instantiated buffers (scaled in place): call once, after :meth:`squared_norms`."""
        index = {name: k for k, name in enumerate(self.names)}
        for group in self.groups:
            if group.buffer is None:
                continue
            leaves = [index[name] for name in group.names]
            rows = scales[group.buffer.dtype]  # [L, m]; stride 0: one row for every leaf
            scale = rows[0].expand(len(leaves), -1) if not rows.stride(0) else torch.stack([rows[k] for k in leaves])
            scaled = group.buffer.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(scale[:, :, None])
            torch._foreach_add_([sums[k].view(-1) for k in leaves], list(scaled.sum(dim=1).unbind(0)))
        rows_of: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        inputs = _ScaledInputs(self.m)
        with _float32_matmuls(self.device, highest=not self.product_error):  # the precision the norms assumed
            for name, (call, _) in self.ghost.items():
                if call.grad is None:  # the loss does not depend on this layer's output: a zero gradient
                    continue
                k = index[name]
                total = sums[k]
                rows = scales[total.dtype]
                key = (total.dtype, k if rows.stride(0) else 0)  # one row for all leaves (stride 0): one mask
                if key not in rows_of:
                    scale = rows[k].reshape(self.m, 1, 1)
                    rows_of[key] = (scale, scale == 0)
                _add_ghost(call, *rows_of[key], total, inputs)


def _matmul_backend(device: torch.device) -> Any:
    """The settings object of ``device``'s float32 matmuls (``torch.backends.<backend>.matmul``)."""
    return torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul


def matmul_precision(device: torch.device) -> str:
    """The precision of ``device``'s float32 matmuls: ``"ieee"``, ``"tf32"`` or ``"bf16"``. Read through the
    per-backend setting, which answers whichever of PyTorch's two APIs set it (``torch.backends.fp32_precision``, as
    ``transformers`` does, or ``allow_tf32`` / ``set_float32_matmul_precision``); ``"none"`` is IEEE."""
    precision = _matmul_backend(device).fp32_precision
    return "ieee" if precision == "none" else precision


@contextlib.contextmanager
def _float32_matmuls(device: torch.device, *, highest: bool) -> Iterator[None]:
    """The matmuls of the ghost layers' scaled sums on ``device``: float32 ones in IEEE arithmetic with ``highest``
    (else at the precision the run set, which :func:`product_error` accounts for in the norms), and bf16 ones reduced
    in float32 (no reduced-precision split-K reduction). Set and restored through the per-backend setting, which
    leaves either API's later reads working."""
    backend, cuda_matmul = _matmul_backend(device), torch.backends.cuda.matmul
    previous, reduced = backend.fp32_precision, cuda_matmul.allow_bf16_reduced_precision_reduction
    if highest:
        backend.fp32_precision = "ieee"
    cuda_matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        backend.fp32_precision = previous
        cuda_matmul.allow_bf16_reduced_precision_reduction = reduced


_FACTOR_BITS = {"tf32": 10, "bf16": 7}  # explicit significand bits of a reduced-precision float32 matmul's factors


def product_error(precision: str) -> float:
    """``eps``: a bound on the relative error of one product ``(c_i a_t)_k (g_t)_o`` inside a float32 matmul at
    ``precision`` (:func:`matmul_precision`), beyond the IEEE product: 0 for ``"ieee"``; under ``"tf32"`` each factor
    is rounded to 10 explicit significand bits, under ``"bf16"`` to 7 (an unknown setting counts as bf16), by
    truncation at worst (relative error ``2^-b``), and the scaled input ``c_i a_t`` was rounded to float32 before,
    so ``eps = (1 + 2^-b)^2 (1 + 2^-24) - 1``; the rounded factors' product is exact in the float32 accumulator.

    Then each example's contribution to the sum is ``c_i G~_i`` with ``G~_i = sum_t g~_t a~_t^T`` and, entry by
    entry, ``|G~_i - G_i| <= eps sum_t |g_t| |a_t|^T``, so ``||G~_i - G_i||_F <= eps S_i`` with
    ``S_i = sum_t ||g_t|| ||a_t||`` (:func:`_ghost_norms` clips by ``||G_i|| + eps S_i``, which bounds
    ``||c_i G~_i||`` by the clipping bound, as the IEEE sum's contributions are)."""
    if precision == "ieee":
        return 0.0
    bits = _FACTOR_BITS.get(precision, _FACTOR_BITS["bf16"])
    return (1 + 2.0**-bits) ** 2 * (1 + 2.0**-24) - 1


def _add_product(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``total += x @ y``: the one matmul of a ghost linear or Conv1D layer's scaled sum."""
    total.addmm_(x, y)


class _ScaledInputs:
    """The scaled input factor ``scale_i a_it`` (zero rows for dropped examples) of a ghost linear or Conv1D call,
    formed once for consecutive calls that read the same input with the same scales (q, k and v, in the forward's
    order). Only the last one is kept, so that the scaled copies of the layer inputs never pile up."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.key: tuple[Any, ...] | None = None
        self.value: torch.Tensor | None = None

    def __call__(self, call: _Call, scale: torch.Tensor, drop: torch.Tensor, dtype: torch.dtype) -> Any:
        key = (call.input_key, dtype, scale.data_ptr())
        if key != self.key:
            self.key = self.value = None  # the previous copy is freed before the next is made
            self.key, self.value = key, torch.where(drop, 0.0, _in(_rows(call.inputs, self.m), dtype) * scale)
        return self.value


def _add_ghost(
    call: _Call, scale: torch.Tensor, drop: torch.Tensor, total: torch.Tensor, inputs: _ScaledInputs
) -> None:
    """``total += sum_i scale_i G_i`` from the call's input and output gradient; ``scale`` and ``drop`` (whether the
    scale is 0) are ``[m, 1, 1]``; an example with scale 0 adds exactly 0 whatever its values."""
    m = scale.shape[0]
    if _bf16_factors(call) and total.dtype == torch.float32:
        _add_bf16_product(call, drop, scale, total)
        return
    g = _in(_rows(call.grad, m), total.dtype)
    if call.kind in ("linear", "conv1d"):  # sum_i scale_i g_i^T a_i = g^T (scale a)
        a = inputs(call, scale, drop, total.dtype).reshape(-1, call.inputs.shape[-1])
        g = torch.where(drop, 0.0, g).reshape(-1, g.shape[-1])
        if call.kind == "linear":
            _add_product(total, g.T, a)
        else:  # conv1d: weight [in, out]
            _add_product(total, a.T, g)
        return
    g = torch.where(drop, 0.0, g * scale)
    if call.kind == "experts":  # their norms carry no margin for reduced-precision products
        a = torch.where(drop, 0.0, _in(_rows(call.inputs, m), total.dtype))
        with _float32_matmuls(total.device, highest=True):
            _add_expert_products(call, g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1]), total)
        return
    # embedding
    ids, live = _live_ids(call, m)
    g = torch.where(live[..., None], g, 0.0)
    total.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]))


def _ghost_norms(
    call: _Call, m: int, input_gram: Callable[[_Call], torch.Tensor], *, error: float = 0.0
) -> torch.Tensor:
    """float64 ``[m]`` squared norms of the call's per-example weight gradients, from Gram matrices (the input's
    from ``input_gram``, which shares one among the calls that read the same tensor). ``error``: the relative error
    of the products of the layer's float32 scaled sum (:func:`product_error`): a linear or Conv1D layer with float32
    factors then reports ``(||G_i|| + error S_i)^2``, ``S_i = sum_t ||g_t|| ||a_t||``, the bound of the norm of the
    gradient its sum forms."""
    g = _rows(call.grad, m)
    if call.kind == "embedding":
        ids, live = _live_ids(call, m)
        same = (ids[:, :, None] == ids[:, None, :]) & live[:, :, None] & live[:, None, :]
        return _frobenius(same.to(torch.float64), _gram(g))
    if call.kind == "experts":
        return _expert_norms(call, m)
    squares = _frobenius(input_gram(call), _gram(g))
    if not error or _bf16_factors(call) or g.dtype != torch.float32:  # bf16 factors: exact products (three parts)
        return squares
    row_norms = lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)  # noqa: E731
    spread = (row_norms(g) * row_norms(_rows(call.inputs, m))).sum(dim=1)
    return (squares.sqrt() + error * spread).square()


def _same_tensor(x: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a layer input among the calls of one pass (q, k and v read the same hidden states)."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())


class _InputGrams:
    """The float64 Gram matrices of layer inputs, each formed once for the calls that read the same tensor and kept
    until the last of those calls has been recorded (``readers`` counts them as the forward registers them)."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.readers: dict[tuple[Any, ...], int] = {}
        self.grams: dict[tuple[Any, ...], tuple[bool, torch.Tensor]] = {}  # key -> (bf16-rounded, Gram)

    def read_by(self, call: _Call) -> None:
        self.readers[call.input_key] = self.readers.get(call.input_key, 0) + 1

    def __call__(self, call: _Call) -> torch.Tensor:
        rounded = _bf16_factors(call)
        rounded_then, gram = self.grams.get(call.input_key, (rounded, None))
        if gram is None or rounded_then != rounded:
            gram = _gram(_input_factor(call, self.m))
            if self.readers.get(call.input_key, 0) > 1:
                self.grams[call.input_key] = (rounded, gram)
        return gram

    def done(self, call: _Call) -> None:
        left = self.readers.get(call.input_key, 0) - 1
        self.readers[call.input_key] = left
        if left <= 0:
            self.grams.pop(call.input_key, None)


def _add_dense(call: _Call, attr: str, out: torch.Tensor, *, first: bool) -> None:
    """``out += `` the ``[m, *shape]`` per-example gradient of ``call.module.<attr>`` in this call (``out``'s dtype);
    ``first``: ``out`` holds zeros, so it is written instead."""
    m, dtype = out.shape[0], out.dtype
    g = _in(call.grad, dtype)
    if call.kind == "attention_sinks":  # the gradient of the sinks broadcast to [m, H, T, 1]
        if first:
            torch.sum(g, dim=(2, 3), out=out)
        else:
            out.add_(g.sum(dim=(2, 3)))
        return
    if call.kind == ELEMENTWISE:  # the gradient of the parameter expanded to [m, 1, ..., 1, *shape]
        _add_sum(g.reshape(m, -1, *out.shape[1:]), out, first=first)
        return
    if call.kind == DEPTHWISE:
        add_conv_gradient(attr, call.inputs, call.grad, out, first=first)
        return
    if call.kind == "zero_centered_rms_norm":  # ``normalized * (1 + weight.float())``: a float32 weight gradient
        g = _in(call.grad, torch.float32)  # summed in its own memory order, as autograd sums the model's
        g = g if g.shape[0] == m else g.reshape(m, -1, g.shape[-1])
        product = g * _normalized(call).reshape(g.shape)
        dims = tuple(range(1, product.dim() - 1))
        summed = product.sum(dim=dims) if dims else product
        out.copy_(summed) if first else out.add_(summed)
        return
    if call.kind in _NORMS:
        dims = len(call.module.normalized_shape) if call.kind in ("layer_norm", "rms_norm") else 1
        g = g.reshape(m, -1, *g.shape[-dims:])
        if attr == "weight":
            g = g * _in(_normalized(call), dtype).reshape(g.shape)
        _add_sum(g, out, first=first)
        return
    g = _rows(g, m)
    if call.kind == "experts":
        _add_expert_dense(call, attr, g, _in(_rows(call.inputs, m), dtype), out)
    elif attr == "bias":
        _add_sum(g, out, first=first)
    elif call.kind == "embedding":
        ids, live = _live_ids(call, m)
        rows = torch.arange(m, device=g.device)[:, None].expand_as(ids)
        out.index_put_((rows, ids), torch.where(live[..., None], g, 0.0), accumulate=True)
    elif call.kind == "linear":
        out.baddbmm_(g.transpose(1, 2), _in(_input_factor(call, m), dtype))  # [m, out, in]
    else:  # conv1d: [m, in, out]
        out.baddbmm_(_in(_input_factor(call, m), dtype).transpose(1, 2), g)


def _add_sum(g: torch.Tensor, out: torch.Tensor, *, first: bool) -> None:
    """``out += g.sum(dim=1)`` (one launch when ``out`` holds zeros)."""
    if first:
        torch.sum(g, dim=1, out=out)
    else:
        out.add_(g.sum(dim=1))


_NORMS = ("layer_norm", "rms_norm", "llama_rms_norm", "gpt_oss_rms_norm", "zero_centered_rms_norm", "gated_rms_norm")


def _normalized(call: _Call) -> torch.Tensor:
    """What a norm layer multiplies its weight by: its input normalized, as its forward computes it."""
    x, module = call.inputs, call.module
    if call.kind == "layer_norm":
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)
    if call.kind == "rms_norm":
        return F.rms_norm(x, module.normalized_shape, eps=module.eps)
    if call.kind == "zero_centered_rms_norm":
        hidden = x.float()
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.eps)
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    if call.kind == "gated_rms_norm":  # weight * normalized * silu(gate)
        return hidden.to(x.dtype) * F.silu(call.gate.to(torch.float32))
    return hidden if call.kind == "gpt_oss_rms_norm" else hidden.to(x.dtype)


def _ghost_names(calls: list[_Call], out: _Gradients) -> dict[str, tuple[_Call, torch.Tensor]]:
    """The weights whose norms come from Gram matrices (zero until the backward reaches their call): used by one
    call, of a linear, Conv1D or embedding layer, where that costs less than instantiating them."""
    uses: dict[str, int] = {}
    for call in calls:
        for name in call.names.values():
            uses[name] = uses.get(name, 0) + 1
    zeros = torch.zeros(out.m, dtype=torch.float64, device=out.device)
    return {
        name: (call, zeros)
        for call in calls
        if call.kind not in _NORMS
        if (name := call.names.get("weight")) is not None and uses[name] == 1
        if _prefers_ghost(call, out.shapes[name], out.m)
    }


def _example_grad(loss_fn: Callable[..., torch.Tensor], params: dict[str, torch.Tensor], example: Any) -> dict:
    """``grad`` of ``loss_fn(params, *example)`` by plain autograd, one example: no ``torch.func`` transform, so the
    model runs the kernels of the batched pass (inside a transform Hugging Face models build an explicit attention
    mask and SDPA takes another kernel; in bf16 that alone moved an 8B model's gradients by about 6%)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    with torch.enable_grad():
        grads = torch.autograd.grad(loss_fn(leaves, *example), list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads, strict=True)}


GHOST_ADVANTAGE = 1.0
"""A weight takes ghost norms when the factors it keeps, ``T (in + out)`` numbers per example, times this are fewer
than the ``in * out`` of its instantiated gradient (experts: than the ``E * in * out`` of all experts); 1 keeps
whichever holds less memory. By their flops, instantiating is the faster of the two wherever it fits: it costs the
weight gradient's flops at the matmul rate, where ghost norms add two float64 Gram matrices (``T (in + out) /
(in out)`` of those flops again) and a float32 sum at full precision. A larger value instantiates the weights near
the boundary (GPT-2 small at 512 tokens: its ``c_attn``, ``c_fc`` and MLP ``c_proj``, whose factors hold 83% to 89%
of their gradients) at the cost of memory, which the instantiated buffers take from the start of the backward; the
harness's diagnostic mode ``dp_instantiate`` measures 1.5."""


def _prefers_ghost(call: _Call, shape: torch.Size, m: int) -> bool:
    """Ghost norm when its Gram factors, weighted by :data:`GHOST_ADVANTAGE`, hold less than instantiating
    ``[m, *shape]`` (Li et al. 2022)."""
    if call.kind == "embedding":
        return True
    if call.kind == DEPTHWISE:  # C K numbers per example, against T x T Gram matrices per channel
        return False
    if call.kind == "experts":  # [E, out, in]: one example's T rows against E instantiated experts
        return call.positions * sum(shape[1:]) * GHOST_ADVANTAGE < math.prod(shape)
    return call.positions * sum(shape) * GHOST_ADVANTAGE < math.prod(shape)


# -- mixture-of-experts layers (Hugging Face v5: routers and stacked experts) ------------------------------------------


def _moe_kind(module: nn.Module) -> str | None:
    """``"router"`` for a Hugging Face top-k router (``*TopKRouter``: its logits are ``F.linear`` of the flattened
    tokens with its ``weight`` (and ``bias``), returned first, and its scores come from them), ``"experts"`` for a
    stacked experts layer of ``transformers.integrations.moe.use_experts_implementation`` (``[E, ...]`` weights,
    without expert parallelism or a post-expert norm), else None."""
    if not type(module).__module__.startswith("transformers."):
        return None
    if type(module).__name__.endswith("TopKRouter") and isinstance(getattr(module, "weight", None), nn.Parameter):
        return "router"
    flags = ("has_gate", "has_bias", "is_transposed")
    # releases before transformers 5.2x have neither a post-expert norm nor expert parallelism (nor their flags)
    later = getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False)
    if all(hasattr(module, f) for f in flags) and not later:
        first = "gate_up_proj" if module.has_gate else "up_proj"
        stacked = [getattr(module, name, None) for name in (first, "down_proj")]
        if all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in stacked):
            return "experts"
    return None


def _expert_linear(module: nn.Module, attr: str, x: torch.Tensor, routing: _Routing) -> torch.Tensor:
    """Row ``r`` of ``x`` ``[S, in]`` through its expert's projection ``attr`` (and its bias): the rows grouped by
    expert, one matmul per expert, back in their order."""
    weight = getattr(module, attr)  # [E, out, in], or [E, in, out] when transposed
    bias = getattr(module, f"{attr}_bias") if module.has_bias else None
    pieces = []
    for e, rows, _ in routing.groups():
        xe = x.index_select(0, rows)
        y = xe @ weight[e] if module.is_transposed else F.linear(xe, weight[e])
        pieces.append(y if bias is None else y + bias[e])
    return torch.cat(pieces)[torch.argsort(routing.order)]


def _tapped_experts_forward(
    module: nn.Module, tap: Callable[..., torch.Tensor], hidden_states: torch.Tensor, top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor, *, examples: int,
) -> torch.Tensor:  # fmt: skip
    """The experts layer's function (that of Hugging Face's ``batched_mm`` implementation: token ``n``'s ``k`` rows
    are rows ``n k ... n k + k - 1``), with its two projections tapped (``tap``), so that an example's rows are
    contiguous: ``[m * T * k, d]`` from ``m = examples`` examples of ``T`` tokens."""
    tokens, k = top_k_index.shape
    x = hidden_states.repeat_interleave(k, dim=0)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    routing = _Routing.of(top_k_index.reshape(-1), getattr(module, first).shape[0], examples)
    h = tap(module, first, x, routing, _expert_linear(module, first, x, routing))
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    y = tap(module, "down_proj", h, routing, _expert_linear(module, "down_proj", h, routing))
    weighted = y * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


class _Restore:
    """Undoes :func:`_replace_forward` (the ``remove()`` of a hook handle)."""

    def __init__(self, module: nn.Module, previous: Any) -> None:
        self.module, self.previous = module, previous

    def remove(self) -> None:
        if self.previous is None:
            del self.module.forward
        else:
            self.module.forward = self.previous


def _replace_forward(module: nn.Module, forward: Callable[..., Any], tap: Callable[..., Any]) -> _Restore:
    """Run ``forward(module, tap, ...)`` as ``module``'s forward until the returned handle is removed."""
    previous = module.__dict__.get("forward")
    module.forward = lambda *args: forward(module, tap, *args)
    return _Restore(module, previous)


def _expert_norms(call: _Call, m: int) -> torch.Tensor:
    """float64 ``[m]`` squared norms of an experts call's per-example gradients. Rows routed to different experts
    meet different weights, so they have no cross term: for each expert, the Gram matrices of the rows of each example
    routed to it (``[m, P, d]``, padded with zero rows to the widest example ``P``), about ``(T k / E)^2`` entries
    per example instead of the ``(T k)^2`` of all its rows."""
    x, g = call.inputs, call.grad  # [m R, in], [m R, out]: example i owns rows i R ... i R + R - 1
    per_example = x.shape[0] // m
    total = torch.zeros(m, dtype=torch.float64, device=x.device)
    for _, rows, width in call.routing.groups():
        example = torch.div(rows, per_example, rounding_mode="floor")  # sorted, as the rows are
        slot = torch.arange(rows.shape[0], device=x.device) - torch.searchsorted(example, example)
        xe = x.new_zeros(m, width, x.shape[-1]).index_put_((example, slot), x.index_select(0, rows))
        ge = g.new_zeros(m, width, g.shape[-1]).index_put_((example, slot), g.index_select(0, rows))
        total += _frobenius(_gram(xe), _gram(ge))
    return total


def _add_expert_dense(call: _Call, attr: str, g: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """``out += `` the per-example gradients of a stacked expert weight (``[m, E, out, in]``, or ``[m, E, in, out]``
    transposed) or bias (``[m, E, out]``) from output gradients ``g`` ``[m, R, out]`` and inputs ``a``
    ``[m, R, in]`` (``R`` rows per example)."""
    m, count = out.shape[0], out.shape[1]
    experts = call.routing.experts.reshape(m, -1)
    if attr == "bias":
        flat = torch.arange(m, device=g.device)[:, None] * count + experts
        out.view(m * count, -1).index_add_(0, flat.reshape(-1), g.reshape(-1, g.shape[-1]))
        return
    for e in range(count):
        ge = torch.where((experts == e)[..., None], g, 0.0)
        if call.transposed:
            out[:, e].baddbmm_(a.transpose(1, 2), ge)
        else:
            out[:, e].baddbmm_(ge.transpose(1, 2), a)


def _add_expert_products(call: _Call, g: torch.Tensor, a: torch.Tensor, total: torch.Tensor) -> None:
    """``total[e] += g_e^T a_e`` (``a_e^T g_e`` transposed) over the rows ``g`` ``[S, out]``, ``a`` ``[S, in]``
    routed to each expert ``e``."""
    for e, rows, _ in call.routing.groups():
        ge, ae = g.index_select(0, rows), a.index_select(0, rows)
        if call.transposed:
            total[e].addmm_(ae.T, ge)
        else:
            total[e].addmm_(ge.T, ae)


class LayerwiseGradients:
    """Per-example gradients from one batched pass: the ``gradients`` of an :class:`opake_core.clipping.Engine`
    (``Engine(gradients=LayerwiseGradients(model, batch_loss))``).

    Args:
        model: the module whose trainable parameters are differentiated; every one of them must live in a supported
            layer (see :func:`unsupported_parameters`).
        batch_loss: ``batch_loss(params, *batch) -> losses [m]``: the arguments of the ``loss_fn`` given to
            ``clipped_grad`` (the parameters first), batched; it runs ``model`` (through
            ``torch.func.functional_call`` with ``params``) and returns each example's loss, the same per-example
            losses as ``loss_fn``, which is not called. With ``clipped_grad(has_aux=True)`` it returns
            ``(losses [m], aux)``, the per-example auxiliary values stacked ``[m, ...]``.
    """

    def __init__(self, model: nn.Module, batch_loss: Callable[..., torch.Tensor]) -> None:
        if not isinstance(model, nn.Module):
            raise InputTypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        self.model = model
        self.batch_loss = batch_loss
        self._layout: tuple[tuple[str, ...], dict[nn.Module, tuple[str, dict[str, str]]]] | None = None
        self._batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._others: list[torch.Tensor] = []  # the model's parameters outside the trainable names

    def _layers(self, params: dict[str, torch.Tensor]) -> dict[nn.Module, tuple[str, dict[str, str]]]:
        """``{layer: (kind, {attribute: trainable name})}``, checked and computed once per set of names."""
        names = tuple(sorted(params))
        if self._layout is not None and self._layout[0] == names:
            return self._layout[1]
        reasons = unsupported_parameters(self.model, params)
        if reasons:
            raise ConfigurationError(
                "layerwise per-example gradients serve Linear, Embedding, LayerNorm, RMSNorm and Conv1D layers, "
                "Hugging Face MoE routers and experts and gated delta-nets, in models whose examples do not interact; "
                "not: "
                f"{'; '.join(reasons[:5])}. Use vmap(grad) (the default engine)."
            )
        places, _ = _owners(self.model, set(params))
        by_module: dict[nn.Module, tuple[str, dict[str, str]]] = {}
        for name, where in places.items():
            for module, attr, kind in where:
                by_module.setdefault(module, (kind, {}))[1][attr] = name
        self._layout = (names, by_module)
        self._others = [p for name, p in self.model.named_parameters() if name not in params]
        return by_module

    def __call__(
        self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]
    ) -> tuple[_Gradients, torch.Tensor]:
        """The chunk's gradients and losses ``[m]`` from ``batch_loss(*args)``; ``example_grad`` is not needed."""
        with torch.enable_grad():  # clipped_grad runs under no_grad; this engine runs autograd
            return self._run(args[0], tuple(args[1:]), instantiate=False)

    def check(
        self, params: dict[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor], *batch: Any, rtol: float = 1e-2
    ) -> float:
        """Compare with ``grad(loss_fn)`` example by example on ``batch`` (a few examples); returns the largest relative
        error.

        ``loss_fn(params, *example)`` is the per-example loss. Raises ConfigurationError, naming the parameter with
        the largest difference, when an example's whole gradient differs by more than ``rtol`` (relative L2 over
        all parameters): a parameter used outside the supported layers, or examples that interact in the batched
        pass. The default tolerance leaves room for bf16 autocast, whose batched and per-example passes round
        differently.
        """
        training = self.model.training
        self.model.eval()  # no dropout: both passes see the same function
        try:
            grads, _ = self._run(params, batch, instantiate=True)
            rows = [_example_grad(loss_fn, params, optree.tree_map(lambda x, i=i: x[i], batch)) for i in range(grads.m)]
            expected = {k: torch.stack([row[k] for row in rows]) for k in grads.names}
        finally:
            self.model.train(training)
        diff_sq = torch.zeros(grads.m, dtype=torch.float64, device=grads.device)
        ref_sq = torch.zeros_like(diff_sq)
        worst_diff, worst_name = -1.0, ""
        for name in grads.names:
            ref = expected[name].detach().to(torch.float64).reshape(grads.m, -1)
            ours = grads.dense[name].to(torch.float64).reshape(grads.m, -1) if name in grads.dense else 0 * ref
            diff = (ours - ref).square().sum(dim=1)
            diff_sq += diff
            ref_sq += ref.square().sum(dim=1)
            if not diff.max().item() <= worst_diff:  # NaN counts as the worst
                worst_diff, worst_name = diff.max().item(), name
        worst = (diff_sq.sqrt() / ref_sq.sqrt().clamp(min=1e-30)).max().item()
        if not worst <= rtol:
            raise ConfigurationError(  # no number: the check may run on private records, and messages reach logs
                f"layerwise per-example gradients differ from grad of the per-example loss by more than rtol={rtol} "
                f"(relative), most on {worst_name!r}: a parameter is used outside a supported layer, or examples "
                "interact in the batched pass. Use vmap(grad) for this model."
            )
        return worst

    def _run(self, params: dict[str, torch.Tensor], batch: tuple[Any, ...], *, instantiate: bool) -> tuple[Any, Any]:
        if any(_mixes(module) for module in self._batch_norms):
            self._layout = None  # a layer switched to training mode since: check again
        by_module = self._layers(params)
        names = [path[0] for path in optree.tree_paths(params)]
        first = next(iter(params.values()))
        anchor = torch.zeros((), device=first.device, requires_grad=True)
        shapes = {k: v.shape for k, v in params.items()}
        dtypes = {k: torch.float64 if v.dtype == torch.float64 else torch.float32 for k, v in params.items()}
        leaves = optree.tree_leaves(batch)
        sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim()}
        if len(sizes) != 1:
            raise ConfigurationError(f"batched tensors need one leading batch dimension, got sizes {sorted(sizes)}.")
        out = _Gradients(
            names,
            shapes,
            dtypes,
            sizes.pop(),
            first.device,
            product_error=product_error(matmul_precision(first.device)),
        )
        # Nothing outside the taps needs a gradient (the parameters are detached; the batch and the other parameters
        # need none): a layer output that requires one is then downstream of a tap, so the backward to the anchor
        # reaches it and a tensor hook on it suffices (cheaper than another tap).
        hooks_suffice = not any(p.requires_grad for p in self._others) and not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
        )
        calls: list[_Call] = []
        written: set[str] = set()  # instantiated names the backward has written (their buffers held zeros)
        grams = _InputGrams(out.m)

        def record(call: _Call, grad: torch.Tensor) -> None:
            """Runs inside the backward: instantiated gradients are formed at once and the layer's tensors freed."""
            call.grad = grad.detach()
            for attr, name in call.names.items():
                if name in out.ghost:
                    error = out.product_error if out.dtypes[name] == torch.float32 else 0.0
                    out.ghost[name] = (call, _ghost_norms(call, out.m, grams, error=error))
                else:
                    _add_dense(call, attr, out.block(name), first=name not in written)
                    written.add(name)
            if call.input_key is not None:
                grams.done(call)
            if not any(name in out.ghost for name in call.names.values()):
                call.inputs = call.grad = None

        def forward_hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
            kind, attrs = by_module[module]
            if kind == "router":  # flattened tokens [m * T, d] in, (logits, scores, experts) out
                return router_hook(module, attrs, inputs[0].detach(), output[0])
            x = inputs[0].detach()
            # tokens flattened to rows [m * T, d], example-major (MoE blocks' shared experts, the gated norm's heads)
            rows = kind != "embedding" and x.dim() == 2 and x.shape[0] % out.m == 0
            lead = out.m if rows else x.shape[0]
            positions = x.numel() // max(1, lead * (1 if kind == "embedding" else x.shape[-1]))
            if not torch.is_grad_enabled():  # a checkpointed layer's forward: its recompute is tapped
                calls.append(_Call(kind, module, attrs, None, positions))
                return None
            if kind == "embedding" and x.shape[0] == 1 and out.m > 1:  # positions shared by the batch: one per example
                x, output = x.expand(out.m, *x.shape[1:]), output.expand(out.m, *output.shape[1:])
            if (not rows and x.shape[0] != out.m) or (kind == "gated_rms_norm" and len(inputs) != 2):
                raise ConfigurationError(
                    f"a {type(module).__name__} layer runs on a tensor of leading size {x.shape[0]}, not the batch of "
                    f"{out.m}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
                )
            gate = inputs[1].detach() if kind == "gated_rms_norm" else None
            return tap(_Call(kind, module, attrs, x, positions, gate=gate), output)

        def register(call: _Call) -> None:
            calls.append(call)
            if call.kind not in ("embedding", "experts"):
                call.input_key = _same_tensor(call.inputs)
                grams.read_by(call)

        def tap(call: _Call, output: torch.Tensor) -> torch.Tensor | None:
            """Record ``call`` and hand it its output's gradient in the backward (None: the output is unchanged)."""
            register(call)
            if hooks_suffice and output.requires_grad:
                output.register_hook(lambda grad: record(call, grad))
                return None
            return _Tap.apply(output, anchor, lambda grad: record(call, grad))

        def router_hook(module: nn.Module, attrs: dict[str, str], x: torch.Tensor, logits: torch.Tensor) -> None:
            """A router's logits are ``F.linear`` of its input, and its scores are computed from that very tensor: a
            tensor hook on it sees the whole gradient (``link_router_input`` made it require one)."""
            positions = x.shape[0] // out.m
            if not torch.is_grad_enabled():
                calls.append(_Call("linear", module, attrs, None, positions))
                return None
            if x.shape[0] % out.m or not logits.requires_grad:
                raise ConfigurationError(
                    f"a {type(module).__name__} router runs on {x.shape[0]} rows, not a multiple of the batch of "
                    f"{out.m}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
                )
            call = _Call("linear", module, attrs, x, positions)
            register(call)
            logits.register_hook(lambda grad: record(call, grad))
            return None

        def link_router_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            x = args[0]
            if not torch.is_grad_enabled() or x.requires_grad:
                return None
            return (_Tap.apply(x, anchor, lambda grad: None), *args[1:])

        def tap_experts(module: nn.Module, attr: str, x: torch.Tensor, routing: _Routing, y: torch.Tensor) -> Any:
            """One projection of an experts layer (``attr``: its weight): rows ``x`` ``[m * T, in]`` routed as
            ``routing`` says, output ``y``; returns the output the layer continues with."""
            attrs = by_module[module][1]
            names = {k: attrs[a] for k, a in (("weight", attr), ("bias", f"{attr}_bias")) if a in attrs}
            if not names:
                return y
            positions = x.shape[0] // out.m
            if not torch.is_grad_enabled():
                calls.append(_Call("experts", module, names, None, positions))
                return y
            if x.shape[0] % out.m:
                raise ConfigurationError(
                    f"a {type(module).__name__} layer runs on {x.shape[0]} rows, not a multiple of the batch of "
                    f"{out.m}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
                )
            call = _Call("experts", module, names, x.detach(), positions, routing=routing,
                         transposed=bool(module.is_transposed))  # fmt: skip
            tapped = tap(call, y)
            return y if tapped is None else tapped

        modes: list[_BroadcastTap | ParameterUses] = []  # the taps of the attention and scope calls in progress

        def enter_sinks(module: nn.Module, args: tuple[Any, ...]) -> None:
            attrs = by_module[module][1]

            def on_expand(expanded: torch.Tensor) -> torch.Tensor:
                call = _Call("attention_sinks", module, attrs, None, expanded.shape[2])
                calls.append(call)
                if not torch.is_grad_enabled():  # a checkpointed layer's forward: its recompute is tapped
                    return expanded
                return _Tap.apply(expanded, anchor, lambda grad: record(call, grad))

            modes.append(_BroadcastTap(module.sinks, out.m, on_expand))
            modes[-1].__enter__()

        def leave_sinks(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            mode = modes.pop()
            mode.__exit__(None, None, None)
            if not mode.tapped:
                raise ConfigurationError(
                    f"the attention sinks of {type(module).__name__} are served with eager attention only (the "
                    "sinks expanded over the batch); this attention implementation uses them otherwise. Set "
                    "attn_implementation='eager', freeze the sinks, or use vmap(grad) for this model."
                )

        def on_use(kind: str, module: nn.Module, names: dict[str, str], value: torch.Tensor, x: Any) -> torch.Tensor:
            """One use of parameters followed by :class:`ParameterUses`: ``value`` tapped (``x``: a conv's input)."""
            grad = torch.is_grad_enabled()  # else a checkpointed layer's forward: its recompute is tapped
            call = _Call(kind, module, names, x if grad else None, 1 if x is None else x.shape[-1])
            calls.append(call)
            return _Tap.apply(value, anchor, lambda g: record(call, g)) if grad else value

        def enter_uses(scope: nn.Module, args: tuple[Any, ...]) -> None:
            watched = [(w, getattr(w.module, w.attr)) for w in scopes[scope]]  # as reparametrized for this call
            modes.append(ParameterUses(watched, out.m, on_use))
            modes[-1].__enter__()

        def leave_uses(scope: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            mode = modes.pop()
            mode.__exit__(None, None, None)
            mode.finish(scope)

        def guard_conv(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not any(isinstance(mode, ParameterUses) and mode.watches(module) for mode in modes):
                raise ConfigurationError(
                    f"a depthwise {type(module).__name__} runs outside the call of the module that holds it (its "
                    "weight is followed during that call): its per-example gradients cannot be formed. Use "
                    "vmap(grad) for this model."
                )

        scopes: dict[nn.Module, list[Watched]] = {}
        if any(kind in (ELEMENTWISE, DEPTHWISE) for kind, _ in by_module.values()):
            parents = {child: parent for parent in self.model.modules() for child in parent.children()}
            for module, (kind, attrs) in by_module.items():
                if kind in (ELEMENTWISE, DEPTHWISE):
                    scope = module if kind == ELEMENTWISE else parents.get(module, module)
                    scopes.setdefault(scope, []).extend(Watched(module, a, name, kind) for a, name in attrs.items())
        handles = []
        for scope in scopes:
            handles.append(scope.register_forward_pre_hook(enter_uses))
            handles.append(scope.register_forward_hook(leave_uses))
        for module, (kind, _) in by_module.items():
            if kind == DEPTHWISE:
                handles.append(module.register_forward_pre_hook(guard_conv))
            if kind in (ELEMENTWISE, DEPTHWISE):
                continue
            if kind == "attention_sinks":
                handles.append(module.register_forward_pre_hook(enter_sinks))
                handles.append(module.register_forward_hook(leave_sinks))
                continue
            if kind == "experts":
                forward = functools.partial(_tapped_experts_forward, examples=out.m)
                handles.append(_replace_forward(module, forward, tap_experts))
                continue
            if kind == "router":
                handles.append(module.register_forward_pre_hook(link_router_input))
            handles.append(module.register_forward_hook(forward_hook))
        _ACTIVE.anchor = anchor
        try:
            detached = {k: v.detach() if v.requires_grad else v for k, v in params.items()}
            with torch.enable_grad():
                result = self.batch_loss(detached, *batch)
            return self._backward(result, out, calls, anchor, instantiate=instantiate)
        finally:
            _ACTIVE.anchor = None
            while modes:  # a forward that raised left its taps active
                modes.pop().__exit__(None, None, None)
            for handle in handles:
                handle.remove()

    @staticmethod
    def _backward(result: Any, out: _Gradients, calls: list[_Call], anchor: torch.Tensor, *, instantiate: bool) -> Any:
        """The backward of the batched pass to ``anchor``: the hooks, still in place, record every layer's gradients
        (a checkpointed layer's recompute runs its forward hooks in the backward)."""
        losses, aux = result if isinstance(result, tuple) else (result, None)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ConfigurationError(f"batch_loss must return per-example losses [m], got {losses!r:.80}.")
        if losses.shape[0] != out.m:
            raise ConfigurationError(f"batch_loss returned {losses.shape[0]} losses for a batch of {out.m} examples.")
        if not instantiate:
            out.ghost.update(_ghost_names(calls, out))
        used = {name for call in calls for name in call.names.values()}
        out.group([name for name in out.names if name in used and name not in out.ghost])
        if losses.requires_grad:
            torch.autograd.backward(losses.sum(), inputs=[anchor])
        if aux is None:
            return out, losses.detach()
        return out, (losses.detach(), optree.tree_map(torch.Tensor.detach, aux))
