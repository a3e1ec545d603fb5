"""A model made ready for private training: the inputs refused, the patches applied, the weights on the device.

Everything here runs once, when a :class:`~opake_torch.transformers.DPTrainer` is built: the compatibility patches
that let ``vmap(grad)`` run Hugging Face models, activation checkpointing that survives ``vmap``, the performance
kernels the arguments ask for, and (under DDP) rank 0's weights on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from opake_core.errors import ConfigurationError
from opake_torch.patches import apply_compat_patches, check_attention_implementation
from opake_torch.patches.checkpointing import check_memory_knobs, enable_vmap_checkpointing
from opake_torch.patches.families import apply_family_patches
from opake_torch.patches.performance import apply_performance_kernels

__all__ = ["check_inputs", "prepare_model"]


def check_inputs(model: nn.Module, args: Any, optimizers: tuple[Any, Any], arguments_type: type) -> None:
    """ConfigurationError for what a private trainer cannot take: other arguments, a torch optimizer, a wrapped
    model, CUDA graphs off CUDA."""
    if not isinstance(args, arguments_type):
        raise ConfigurationError(
            "DPTrainer needs args=opake_torch.transformers.TrainingArguments(...) with privacy_noise_multiplier "
            "or privacy_target_epsilon; convert Hugging Face arguments with TrainingArguments.from_hf."
        )
    if tuple(optimizers) != (None, None):
        raise ConfigurationError(
            "optimizers=(optimizer, scheduler) is not supported: a torch.optim optimizer cannot check that its "
            "gradients were noised. Choose the optimizer with args.optim and the schedule with args.lr_scheduler."
        )
    if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            f"pass the bare model, not {type(model).__name__}: DPTrainer handles DDP itself; DataParallel is "
            "not supported (use torchrun)."
        )
    if args.cuda_graphs and args.device.type != "cuda":
        raise ConfigurationError(
            f"cuda_graphs={args.cuda_graphs} captures CUDA graphs and needs a CUDA device; this run is on "
            f"{args.device}. Set cuda_graphs=0."
        )


def prepare_model(model: nn.Module, args: Any, topology: Any) -> tuple[nn.Module, list[str], list[str]]:
    """``(model on args.device, compat patches, performance patches)``, with rank 0's weights on every rank."""
    compat = apply_compat_patches() + apply_family_patches(model) if args.use_compat_patches else []
    check_attention_implementation(model)
    if args.gradient_checkpointing:
        enable_vmap_checkpointing(model)
    check_memory_knobs(model, args)
    model = model.to(args.device)
    topology.broadcast_params(dict(model.named_parameters()))
    kernels_config = dict(args.performance_kernels_config or {})
    if args.per_example_gradients != "vmap" and kernels_config.get("lora", True):
        # the fused LoRA kernel bypasses the adapter layers, which the layerwise engine reads
        kernels_config["lora"] = False
    performance = apply_performance_kernels(
        model, use_performance_kernels=args.use_performance_kernels, performance_kernels_config=kernels_config
    )
    return model, compat, performance
