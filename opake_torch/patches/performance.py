"""Performance kernels applied as model patches: :func:`apply_performance_kernels`.

Supported families: Llama, Mistral and Qwen2 (``model.config.model_type``), their ``*RMSNorm`` modules, the SwiGLU
activation of their ``*MLP`` modules, the residual add and post-attention RMSNorm of their ``*DecoderLayer`` modules
(one fused kernel), ``apply_rotary_pos_emb``, and PEFT LoRA ``Linear`` layers (any model).
Each patch replaces a forward of one module of the model given (never a class) with the Triton kernel of
:mod:`opake_torch.patches.kernels`, which computes the same function (see
:mod:`~opake_torch.patches.kernels.reference`), with per-example gradients under ``vmap``. The patches are
idempotent; a patched forward falls back to the original for anything it does not serve (multiple active adapters,
DoRA, active dropout, mixed dtypes).

RoPE is the exception: Hugging Face's attention calls its modeling module's ``apply_rotary_pos_emb``, a function that
every model of the family shares, so :func:`apply_performance_kernels` only reports ``"rope:<module>"``, and
:func:`rope_patch` is the process-level patch that ``DPTrainer`` applies while it trains and undoes after
(:func:`runtime_patches` turns the names into patches; :func:`~opake_torch.patches.runtime.apply_runtime_patches`
applies them).

Without CUDA or without Triton nothing is patched and the reason is logged: a CPU run is never changed.
``fused_linear_cross_entropy`` is a loss-level patch: for the supported families it is reported as applied, and
``DPTrainer``'s causal-LM loss then reads the final hidden states and calls
:func:`~opake_torch.patches.kernels.opake_fused_linear_cross_entropy` with the (frozen) head's weight, so the logits
are never materialized. ``cross_entropy`` is loss-level too, for any model: ``DPTrainer``'s token losses (causal LM,
token classification; without label smoothing) then go through
:func:`~opake_torch.patches.kernels.opake_cross_entropy_loss`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.patches.kernels import (
    _triton,
    available,
    opake_fused_add_rms_norm,
    opake_lora_mlp,
    opake_lora_w,
    opake_rms_norm,
    opake_rope,
    opake_swiglu,
)
from opake_torch.patches.kernels.reference import LoRAProjection
from opake_torch.patches.runtime import RuntimePatch, mark, marked, module_attribute

__all__ = [
    "CUDNN_ATTENTION_OFF",
    "KERNELS",
    "SUPPORTED_MODEL_TYPES",
    "apply_performance_kernels",
    "resolve_performance_kernels",
    "rope_patch",
    "runtime_patches",
]

logger = logging.getLogger(__name__)

KERNELS = (
    "rms_norm",
    "fused_add_rms_norm",
    "activation",
    "rope",
    "lora",
    "cross_entropy",
    "fused_linear_cross_entropy",
)
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
OPT_IN = ("fused_add_rms_norm",)
"""Switches off unless named in ``performance_kernels_config``: kernels not yet measured and checked on a GPU."""
_SWIGLU_ACTIVATIONS = ("silu", "swish")
_DECODER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ROPE = "rope:"  # "rope:<module>": the RoPE of that modeling module, a process-level patch (module docstring)


def resolve_performance_kernels(
    use_performance_kernels: bool | None = None, performance_kernels_config: Mapping[str, bool] | None = None
) -> dict[str, bool]:
    """The per-kernel switches in effect.

    Args:
        use_performance_kernels: ``None`` (auto) enables the kernels where :func:`kernels.available`; ``True``
            asks for them (still off, with a warning, where they cannot run); ``False`` turns them all off.
        performance_kernels_config: per-kernel overrides, e.g. ``{"fused_linear_cross_entropy": False}``; keys from
            :data:`KERNELS`.

    Returns:
        ``{kernel: enabled}`` for every name in :data:`KERNELS`; all False where the kernels cannot run.
    """
    if use_performance_kernels is not None and not isinstance(use_performance_kernels, bool):
        raise InputTypeError(f"use_performance_kernels must be None or a bool, got {use_performance_kernels!r}.")
    config = dict(performance_kernels_config or {})
    unknown = sorted(set(config) - set(KERNELS))
    if unknown:
        raise ConfigurationError(
            f"performance_kernels_config has unknown kernels {unknown}; the switches are {list(KERNELS)}."
        )
    for name, value in config.items():
        if not isinstance(value, bool):
            raise InputTypeError(f"performance_kernels_config[{name!r}] must be a bool, got {value!r}.")
    if use_performance_kernels is False:
        return dict.fromkeys(KERNELS, False)
    if not available():
        reason = _unavailable_reason()
        if use_performance_kernels:
            logger.warning("use_performance_kernels=True, but the kernels cannot run here (%s): they are off.", reason)
        else:
            logger.info("performance kernels off: %s.", reason)
        return dict.fromkeys(KERNELS, False)
    return {name: config.get(name, name not in OPT_IN) for name in KERNELS}


def _unavailable_reason() -> str:
    if _triton.triton is None:
        return "Triton is not installed"
    if torch.version.cuda is None:
        return "this torch build has no CUDA (ROCm and CPU builds use the torch path)"
    return "no CUDA device"


def apply_performance_kernels(
    model: torch.nn.Module,
    *,
    use_performance_kernels: bool | None = None,
    performance_kernels_config: Mapping[str, bool] | None = None,
) -> list[str]:
    """Patch the supported modules of ``model`` (this instance) with the Triton kernels (idempotent).

    Returns:
        The names of the patches in effect (``"rms_norm"``, ``"fused_add_rms_norm"``, ``"activation"``,
        ``"fused_linear_cross_entropy"``,
        ``"cross_entropy"``, ``"lora"``) and ``"rope:<module>"``, the process-level RoPE patch the model needs
        while it trains (not applied here: :func:`runtime_patches`); empty where nothing applies (CPU, no Triton,
        switched off, unsupported family); the reason is logged.
    """
    switches = resolve_performance_kernels(use_performance_kernels, performance_kernels_config)
    if not any(switches.values()):
        return []
    applied: list[str] = []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        logger.info("no RMSNorm/activation/RoPE kernels for model_type %r (supported: %s).", model_type,
                    sorted(SUPPORTED_MODEL_TYPES))  # fmt: skip
    else:
        hidden_act = getattr(model.config, "hidden_act", None)
        for module in model.modules():
            name = type(module).__name__
            if switches["rms_norm"] and name.endswith("RMSNorm") and _patch(module, "rms_norm", _rms_norm_forward):
                _note(applied, "rms_norm")
            elif (
                switches["fused_add_rms_norm"]
                and name.endswith("DecoderLayer")
                and all(hasattr(module, a) for a in _DECODER_PARTS)
                and _patch(module, "fused_add_rms_norm", _decoder_layer_forward)
            ):
                _note(applied, "fused_add_rms_norm")
            elif (
                switches["activation"]
                and name.endswith("MLP")
                and hidden_act in _SWIGLU_ACTIVATIONS
                and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
                and _patch(module, "activation", functools.partial(_swiglu_mlp_forward, lora=switches["lora"]))
            ):
                _note(applied, "activation")
        if switches["rope"]:
            applied.append(f"{_ROPE}transformers.models.{family}.modeling_{family}")
        if switches["fused_linear_cross_entropy"]:
            applied.append("fused_linear_cross_entropy")  # a loss-level patch: DPTrainer's causal-LM loss takes it
    if switches["cross_entropy"]:
        applied.append("cross_entropy")  # loss-level, any model: DPTrainer's token losses take the kernel
    if switches["lora"]:
        for module in model.modules():
            if _is_lora_linear(module) and _patch(module, "lora", _lora_forward):
                _note(applied, "lora")
    logger.info("performance kernels applied: %s", applied or "none")
    return applied


def _note(applied: list[str], name: str) -> None:
    if name not in applied:
        applied.append(name)


def _patch(module: torch.nn.Module, name: str, forward: Any) -> bool:
    """Replace ``module.forward`` by ``forward(module, original, *args)`` and mark it ``name`` (once); True."""
    if not marked(module, name):
        module.forward = functools.partial(forward, module, module.forward)
        mark(module, name)
    return True


def _rms_norm_forward(module: torch.nn.Module, original: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        return original(hidden_states)
    return opake_rms_norm(hidden_states, module.weight, eps)


def _decoder_layer_forward(
    module: torch.nn.Module, original: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """The Llama/Mistral/Qwen2 decoder layer with its residual add and post-attention norm fused
    (:func:`~opake_torch.patches.kernels.opake_fused_add_rms_norm`); keyword arguments go to the attention as the
    stock layer passes them. The original runs for positional extras, a norm without ``variance_epsilon``, and a norm
    with forward hooks: the fused path never calls the norm module, so hooks that read its inputs (the layerwise
    per-example engine's) would miss it."""
    norm = module.post_attention_layernorm
    eps = getattr(norm, "variance_epsilon", None)
    if args or eps is None or _hooked(norm):
        return original(hidden_states, *args, **kwargs)
    attention, _ = module.self_attn(hidden_states=module.input_layernorm(hidden_states), **kwargs)
    normed, residual = opake_fused_add_rms_norm(attention, hidden_states, norm.weight, eps)
    return residual + module.mlp(normed)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a forward (pre-)hook would see a call of ``module``: its own or a global one."""
    hooks = torch.nn.modules.module
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
    )


def _swiglu_mlp_forward(module: torch.nn.Module, original: Any, x: torch.Tensor, *, lora: bool) -> torch.Tensor:
    projections = [_lora_projection(getattr(module, p), x) for p in ("gate_proj", "up_proj", "down_proj")]
    if lora and all(p is not None for p in projections):
        (gate, scaling), (up, _), (down, _) = projections  # type: ignore[misc]
        if all(p[1] == scaling for p in projections):  # type: ignore[index]
            return opake_lora_mlp(x, gate, up, down, scaling)
    return module.down_proj(opake_swiglu(module.gate_proj(x), module.up_proj(x)))


def rope_patch(module: str) -> RuntimePatch:
    """The process-level patch that runs the ``apply_rotary_pos_emb`` of the Hugging Face modeling module
    ``module`` (``"transformers.models.llama.modeling_llama"``) through :func:`~opake_torch.patches.kernels.opake_rope`,
    for every model of that family while it is applied."""
    return module_attribute(module, "apply_rotary_pos_emb", _kernel_rope)


CUDNN_ATTENTION_OFF = RuntimePatch(
    "torch.backends.cuda.enable_cudnn_sdp",
    read=torch.backends.cuda.cudnn_sdp_enabled,
    write=torch.backends.cuda.enable_cudnn_sdp,
    wrap=lambda enabled: False,
)
"""The process-level patch that turns scaled-dot-product attention's cuDNN backend off while ``DPTrainer`` runs
(SDPA then takes FlashAttention or the memory-efficient kernel, as it does where cuDNN does not apply). cuDNN builds
an execution plan for every new input shape, on the host, and a private step meets many: a Poisson draw has a
different number of rows each step, and draws above the microbatch run as two chunks. On one H100 (torch 2.11, the
1.1B Llama full fine-tune at 16 x 512 under checkpointing) cuDNN attention took 152 ms of host time in a profiled
private step; with it off the ``Trainer``'s fixed batches ran as before (0.193 s with cuDNN, 0.192 s without).
What it saves the private step in its ratio is not measured on the same draws yet (docs/performance.md)."""


def runtime_patches(applied: list[str]) -> tuple[RuntimePatch, ...]:
    """The process-level patches that the performance patches ``applied`` (as :func:`apply_performance_kernels`
    returns them) need while the model trains: one :func:`rope_patch` per ``"rope:<module>"``."""
    return tuple(rope_patch(name.removeprefix(_ROPE)) for name in applied if name.startswith(_ROPE))


def _kernel_rope(original: Any) -> Any:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # the signature HF calls
        return opake_rope(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _is_lora_linear(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    return isinstance(module, LoraLinear)


def _lora_projection(module: torch.nn.Module, x: torch.Tensor) -> tuple[LoRAProjection, float] | None:
    """The single active adapter of a PEFT LoRA ``Linear`` as a :class:`LoRAProjection`, or None when the kernel
    does not serve it (several or no active adapters, merged, DoRA, active dropout, non-Linear base, mixed dtypes)."""
    if not _is_lora_linear(module) or module.disable_adapters or module.merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return None
    adapter = active[0]
    base = module.base_layer
    dropout = module.lora_dropout[adapter]
    if (
        type(base) is not torch.nn.Linear
        or module.use_dora.get(adapter, False)
        or (module.training and not isinstance(dropout, torch.nn.Identity))
        or getattr(module, "lora_bias", {}).get(adapter, False)
    ):
        return None
    lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    if len({x.dtype, base.weight.dtype, lora_a.dtype, lora_b.dtype}) != 1:
        return None
    return LoRAProjection(base.weight, lora_a, lora_b, base.bias), float(module.scaling[adapter])


def _lora_forward(module: torch.nn.Module, original: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    found = None if args or kwargs else _lora_projection(module, x)
    if found is None:
        return original(x, *args, **kwargs)
    projection, scaling = found
    return opake_lora_w(x, projection.weight, projection.lora_A, projection.lora_B, scaling, projection.bias)
