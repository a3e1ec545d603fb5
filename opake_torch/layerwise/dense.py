"""Instantiated per-example gradients: each layer kind's ``[m, *shape]`` gradients from its input and output gradient.

Cheap where ``out * in`` is small (LoRA adapters, biases, norm weights) and the only form for the parameters that a
ghost norm does not serve (norm weights, parameters used by several calls, the depthwise conv of
:mod:`opake_torch.layerwise.uses`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opake_torch.layerwise.calls import Call, by_example, cast, live_ids
from opake_torch.layerwise.experts import grouped_sums
from opake_torch.layerwise.kinds import NORMS
from opake_torch.layerwise.precision import bf16_factors, bmm_accumulated, input_factor
from opake_torch.layerwise.uses import DEPTHWISE, ELEMENTWISE, add_conv_gradient

__all__ = ["add_dense"]


def add_dense(call: Call, attr: str, out: torch.Tensor, *, first: bool) -> None:
    """``out += `` the ``[m, *shape]`` per-example gradient of ``call.module.<attr>`` in this call (``out``'s dtype);
    ``first``: ``out`` holds zeros, so it is written instead."""
    m, dtype = out.shape[0], out.dtype
    g = cast(call.grad, dtype)
    if call.kind == "attention_sinks":  # the gradient of the sinks broadcast to [R, H, T, 1]
        if g.shape[0] != m:  # grouped examples: an example's k rows summed first
            g = g.reshape(m, -1, *g.shape[1:]).sum(dim=1)
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
        g = cast(call.grad, torch.float32)  # summed in its own memory order, as autograd sums the model's
        g = g if g.shape[0] == m else g.reshape(m, -1, g.shape[-1])
        product = g * _normalized(call).reshape(g.shape)
        dims = tuple(range(1, product.dim() - 1))
        summed = product.sum(dim=dims) if dims else product
        out.copy_(summed) if first else out.add_(summed)
        return
    if call.kind in NORMS:
        dims = len(call.module.normalized_shape) if call.kind in ("layer_norm", "rms_norm") else 1
        g = _shaped(g, (m, -1, *g.shape[-dims:]))
        if attr == "weight":
            g = g * _shaped(cast(_normalized(call), dtype), g.shape)
        _add_sum(g, out, first=first)
        return
    if attr == "weight" and dtype == torch.float32 and bf16_factors(call):
        _add_bf16_weight_product(call, out, m)
        return
    g = by_example(g, m)
    if call.kind == "experts":
        _add_expert_dense(call, attr, g, cast(by_example(call.inputs, m), dtype), out)
    elif attr == "bias":
        _add_sum(g, out, first=first)
    elif call.kind == "embedding":
        ids, live = live_ids(call, m)
        rows = torch.arange(m, device=g.device)[:, None].expand_as(ids)
        out.index_put_((rows, ids), torch.where(live[..., None], g, 0.0), accumulate=True)
    elif call.kind == "linear":
        out.baddbmm_(g.transpose(1, 2), cast(input_factor(call, m), dtype))  # [m, out, in]
    else:  # conv1d: [m, in, out]
        out.baddbmm_(cast(input_factor(call, m), dtype).transpose(1, 2), g)


def _add_bf16_weight_product(call: Call, out: torch.Tensor, m: int) -> None:
    """``out += `` the float32 ``[m, out, in]`` (Conv1D: ``[m, in, out]``) weight gradients of a linear or Conv1D call
    that ran in bfloat16: the products of its bf16 factors on tensor cores, accumulated in float32
    (:func:`~opake_torch.layerwise.precision.bmm_accumulated`), not float32 copies of them multiplied by float32
    matmuls (IEEE unless the run set TF32: several times slower, the same exact products summed in float32)."""
    g, a = by_example(call.grad, m), input_factor(call, m)
    left, right = (g.transpose(1, 2), a) if call.kind == "linear" else (a.transpose(1, 2), g)
    out.add_(bmm_accumulated(left, right))


def _shaped(x: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """``x.reshape(shape)``, or ``x`` itself where it has that shape already (no operator dispatched: this runs for
    each norm layer's call)."""
    if len(shape) == x.dim() and all(n in (-1, d) for n, d in zip(shape, x.shape, strict=True)):
        return x
    return x.reshape(shape)


def _add_sum(g: torch.Tensor, out: torch.Tensor, *, first: bool) -> None:
    """``out += g.sum(dim=1)`` (one launch when ``out`` holds zeros)."""
    if first:
        torch.sum(g, dim=1, out=out)
    else:
        out.add_(g.sum(dim=1))


def _normalized(call: Call) -> torch.Tensor:
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


def _add_expert_dense(call: Call, attr: str, g: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """``out += `` the per-example gradients of a stacked expert weight (``[m, E, out, in]``, or ``[m, E, in, out]``
    transposed) or bias (``[m, E, out]``) from output gradients ``g`` ``[m, R, out]`` and inputs ``a``
    ``[m, R, in]`` (``R`` rows per example): the weights' from the rows sorted by (expert, example) pair, one grouped
    product over the pairs."""
    m, count = out.shape[0], out.shape[1]
    routing = call.routing
    if attr == "bias":
        flat = torch.arange(m, device=g.device)[:, None] * count + routing.experts.reshape(m, -1)
        out.view(m * count, -1).index_add_(0, flat.reshape(-1), g.reshape(-1, g.shape[-1]))
        return
    g, a = (t.reshape(-1, t.shape[-1]).index_select(0, routing.order) for t in (g, a))
    left, right = (a, g) if call.transposed else (g, a)
    flat = out.view(m * count, *out.shape[2:])
    for pairs, product in grouped_sums(left, right, routing, pairs=True):  # pair e m + i, at i E + e in out
        pairs = torch.arange(m * count, device=g.device) if pairs is None else pairs
        flat.index_add_(0, pairs % m * count + torch.div(pairs, m, rounding_mode="floor"), product)
