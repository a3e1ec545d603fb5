"""``router_fp32``: the mixture-of-experts routers of a model compute their logits and routing softmax in float32.

In a bf16 model a Hugging Face top-k router computes its logits ``F.linear(x, W)`` in bf16, whose 8-bit mantissa
rounds nearby logits to the same value: the top-k choice between them is then decided by the tie-break (the lower
expert index), not by the router, and the routing weights carry bf16 rounding. The patched router computes
``F.linear(x, W, b)`` on ``x``, ``W`` (and ``b``) cast to float32, the softmax and the top-k from those float32
logits, and returns them in float32 (what the router release and the layerwise engine's tap read); the routing
weights are cast as the router casts them (to the input's dtype where it does, so the experts run as before). In a
float64 model everything stays float64 (the computation is in the wider of the input's dtype and float32), where the
stock Mixtral and Qwen routers take their softmax in float32. In a float32 model the patched router is the stock one
bit for bit.

The patch changes one model instance (its routers' ``forward``), never a class; :func:`~opake_torch.patches.
runtime.applied_patches` lists it. It changes what the model computes, not the privacy: the clipping and noise see
the gradients of whatever function the model is. Supported: the routers in :data:`RULES` (Mixtral; Qwen2-MoE,
Qwen3-MoE, Qwen3-Next, OLMoE; gpt-oss); another top-k router is refused, not guessed at.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from opake_core.errors import ConfigurationError
from opake_torch.patches.runtime import mark, marked

__all__ = ["RULES", "apply_router_fp32"]

NAME = "router_fp32"

# router class -> how it turns logits into (scores, experts), as its own forward in transformers 5:
#   "softmax_renorm": softmax, top-k, the top-k renormalized; scores in the softmax's dtype (Mixtral)
#   "softmax": softmax, top-k, renormalized if norm_topk_prob; scores cast to the logits' dtype (Qwen, OLMoE)
#   "topk_softmax": top-k of the logits, softmax over those k; scores in the logits' dtype (gpt-oss)
RULES = {
    "MixtralTopKRouter": "softmax_renorm",
    "Qwen2MoeTopKRouter": "softmax",
    "Qwen3MoeTopKRouter": "softmax",
    "Qwen3NextTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax",
    "GptOssTopKRouter": "topk_softmax",
}


def _is_router(module: nn.Module) -> bool:
    kind = type(module)
    return kind.__module__.startswith("transformers.") and kind.__name__.lower().endswith("topkrouter")


def _float32_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's forward with its logits, softmax and top-k in ``promote_types(input dtype, float32)``."""
    rule = RULES[type(self).__name__]
    dtype = hidden_states.dtype
    wide = torch.promote_types(dtype, torch.float32)
    x = hidden_states.reshape(-1, self.hidden_dim).to(wide)
    bias = getattr(self, "bias", None)
    logits = F.linear(x, self.weight.to(wide), None if bias is None else bias.to(wide))
    if rule == "topk_softmax":
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=1).to(dtype), experts
    top, experts = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if rule == "softmax_renorm" or self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top if rule == "softmax_renorm" else top.to(dtype), experts


def apply_router_fp32(model: nn.Module) -> int:
    """Patch every top-k router of ``model`` (idempotent); returns how many the model has.

    Raises:
        ConfigurationError: the model has no top-k router (a dense model), or one whose rule is not in
            :data:`RULES`.
    """
    routers = [m for m in model.modules() if _is_router(m)]
    unknown = sorted({type(m).__name__ for m in routers if type(m).__name__ not in RULES})
    if not routers or unknown:
        found = f"routers of an unsupported kind {unknown}" if unknown else "no top-k router (a dense model?)"
        raise ConfigurationError(
            f"router_fp32=True runs mixture-of-experts routers in float32, but {type(model).__name__} has {found}. "
            f"Supported routers: {sorted(RULES)}. Set router_fp32=False."
        )
    for module in routers:
        if not marked(module, NAME):
            module.forward = types.MethodType(_float32_forward, module)
            mark(module, NAME)
    return len(routers)
