"""A model made ready for private training: the inputs refused, the patches applied, the weights on the device.

Everything here runs once, when a :class:`~opake_torch.transformers.DPTrainer` is built: the family patches that let
``vmap(grad)`` run Hugging Face models, activation checkpointing that survives ``vmap``, the performance kernels the
arguments ask for, and (under DDP) rank 0's weights on every rank. These change the model's own modules only. The
process-level patches the model needs (the vmap patches, a family's RoPE kernel) are applied while the trainer runs
(:func:`with_training_patches`) and undone after. :func:`probe_vmap` tells whether a model runs under ``vmap(grad)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opake_core.clipping import clipped_grad
from opake_core.errors import ConfigurationError, OpakeError, VmapCompatibilityError
from opake_torch.functional import functional_model
from opake_torch.patches.activation_checkpointing import check_memory_knobs, enable_vmap_checkpointing
from opake_torch.patches.compat import check_attention_implementation
from opake_torch.patches.families import apply_family_patches, family_of
from opake_torch.patches.performance import CUDNN_ATTENTION_OFF, apply_performance_kernels, runtime_patches
from opake_torch.patches.router_fp32 import apply_router_fp32
from opake_torch.patches.runtime import VMAP_PATCHES, RuntimePatch, apply_runtime_patches
from opake_torch.transformers.loss import infer_task, per_example_loss

__all__ = [
    "check_inputs",
    "check_outputs",
    "prepare_model",
    "probe_outputs",
    "probe_vmap",
    "training_patches",
    "with_training_patches",
]


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


def check_outputs(output: Any, *, task: str | None, classes: int | None, positions: int, where: str) -> None:
    """ConfigurationError when a model's output on one example (a batch of one, ``positions`` tokens; ``where`` names
    the row) is not what the per-example loss reads: a ``.logits`` tensor of floats, ``[1, num_labels]`` for
    sequence classification, ``[1, positions, classes]`` for token classification and causal language modelling
    (``classes``: ``num_labels``, or the output vocabulary; None: unchecked), ``[1, ...]`` for a custom
    ``compute_loss_func`` (``task`` None)."""
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        got = f"an output {type(output).__name__} without .logits" if logits is None else f".logits of {logits!r:.60}"
        raise ConfigurationError(
            f"the model returned {got} on {where}; DPTrainer's loss reads output.logits. Return a ModelOutput (or any "
            "object) with a logits tensor, or override compute_per_example_loss and compute_batch_losses."
        )
    shape = tuple(logits.shape)
    if task == "sequence_classification":
        expected = (1, classes or None)
    elif task in ("token_classification", "causal_lm", "masked_lm"):
        expected = (1, positions or None, classes or None)  # positions 0: inputs without input_ids
    else:
        expected = (1,) + (None,) * max(len(shape) - 1, 0)
    fits = len(shape) == len(expected) and all(e is None or e == n for e, n in zip(expected, shape, strict=True))
    if not logits.is_floating_point() or not fits:
        want = "x".join("?" if e is None else str(e) for e in expected)
        raise ConfigurationError(
            f"the model's logits on {where} are {logits.dtype} of shape {list(shape)}, the {task or 'custom'} loss "
            f"reads floats of shape [{want}] (batch, {'positions, ' if len(expected) == 3 else ''}classes). Check "
            "the head (num_labels, vocab_size) and the model class for the task, or pass compute_loss_func."
        )


def probe_outputs(
    model: nn.Module,
    forward: Any,
    batch: dict[str, torch.Tensor],
    *,
    label_names: tuple[str, ...],
    task: str | None,
    classes: int | None,
    where: str,
) -> None:
    """Run ``forward(**inputs)`` (the model with the trainable parameters filled in) once on ``batch``, one collated
    row, in eval mode and without gradients, and refuse what the loss could not read (:func:`check_outputs`). A
    forward that fails is refused with the row (``where``) and its length: a sequence longer than the model's
    position embeddings, for example, would otherwise fail inside torch at the step that samples it."""
    inputs = {k: v for k, v in batch.items() if k not in label_names}
    ids = batch.get("input_ids")
    positions = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
    was_training = model.training
    model.eval()  # no dropout: the probe draws nothing from the global RNG, so training's draws are unchanged
    try:
        with torch.no_grad():
            output = forward(**inputs)
    except (OpakeError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        raise ConfigurationError(
            f"the model's forward failed on {where} ({positions} positions; the model's max_position_embeddings: "
            f"{limit}): {type(exc).__name__}: {exc}. Fix that row (truncate with max_length), or the model."
        ) from exc
    finally:
        model.train(was_training)
    check_outputs(output, task=task, classes=classes, positions=positions, where=where)


def prepare_model(model: nn.Module, args: Any, topology: Any) -> tuple[nn.Module, list[str], list[str]]:
    """``(model on args.device, compat patches, performance patches)``, with rank 0's weights on every rank.

    The compat names are the process-level vmap patches (applied while the trainer runs) and the family patches of
    this model; the performance names are as :func:`~opake_torch.patches.performance.apply_performance_kernels`
    returns them. :func:`training_patches` turns both into the process-level patches of a run."""
    vmap = [patch.name for patch in VMAP_PATCHES]
    compat = vmap + apply_family_patches(model) if args.use_compat_patches else []
    if args.router_fp32:  # changes the function the model computes: on whenever asked, like a model option
        apply_router_fp32(model)
        compat.append("router_fp32")
    check_attention_implementation(model)
    if args.gradient_checkpointing:
        enable_vmap_checkpointing(model, offload=args.activation_offloading)
    check_memory_knobs(model, args)
    if not topology.is_sharded:  # FSDP2 moves each rank's rows to the device as it shards the model
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


def training_patches(compat: list[str], performance: list[str]) -> tuple[RuntimePatch, ...]:
    """The process-level patches a run needs while it runs, from the names :func:`prepare_model` returned: the vmap
    patches where ``compat`` lists them, the family RoPE kernel where ``performance`` does, and always SDPA's cuDNN
    backend off (:data:`~opake_torch.patches.performance.CUDNN_ATTENTION_OFF`: the private step's shapes vary)."""
    vmap = (patch for patch in VMAP_PATCHES if patch.name in compat)
    return (*vmap, *runtime_patches(performance), CUDNN_ATTENTION_OFF)


def with_training_patches(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of a ``DPTrainer`` with the process-level patches of its run (:func:`training_patches` of its
    ``compat_patches`` and ``performance_patches``) applied while it runs, and undone when it returns or raises: no
    other model of the process sees them afterwards."""

    @functools.wraps(method)
    def patched(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        with apply_runtime_patches(training_patches(trainer.compat_patches, trainer.performance_patches)):
            return method(trainer, *args, **kwargs)

    return patched


def _failing_frame(exc: BaseException) -> str:
    """The innermost frame of model code (transformers, peft, or the user's module) in the traceback chain."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for error in reversed(chain):
        tb, best = error.__traceback__, None
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if "/torch/" not in filename and "opake_" not in filename:
                best = f"{tb.tb_frame.f_code.co_name} ({filename.rsplit('/site-packages/', 1)[-1]}:{tb.tb_lineno})"
            tb = tb.tb_next
        if best is not None:
            return best
    return "unknown (no model frame in the traceback)"


def probe_vmap(model: nn.Module, example: dict[str, torch.Tensor], *, loss: Any = None) -> None:
    """Run one clipped per-example ``vmap(grad)`` step on a one-example batch, with the process-level vmap patches
    applied for the duration (:data:`~opake_torch.patches.runtime.VMAP_PATCHES`); raise if the model cannot.

    Args:
        model: the model as it will be trained (patches applied, PEFT adapters attached).
        example: one example's tensors **without** batch dimension (``input_ids``, ``attention_mask``, ``labels``).
        loss: ``loss(params, example) -> scalar``; defaults to the loss inferred from the model class.

    Raises:
        VmapCompatibilityError naming the family, the failing operation (the innermost frame of model code) and
        the fix.
    """
    apply, params, frozen = functional_model(model)
    if loss is None:
        task = infer_task(model)

        def loss(p: dict[str, torch.Tensor], ex: dict[str, torch.Tensor]) -> torch.Tensor:
            return per_example_loss(apply, p, frozen, ex, task=task)

    batch = {k: v[None] for k, v in example.items()}
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0)
    try:
        with apply_runtime_patches():
            grad_fn(params, batch, state=state)
    except Exception as exc:
        family = family_of(model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        model_type = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
        listed = f"family {family.name!r}" if family else f"unlisted family {model_type!r}"
        fix = (
            "call opake_torch.patches.families.apply_family_patches(model) and load the model with "
            f"attn_implementation in ({family.attention})"
            if family
            else "replace the operation with an out-of-place, branch-free equivalent (see docs/memory.md)"
        )
        raise VmapCompatibilityError(
            f"{type(base).__name__} ({listed}) cannot run per example under torch.func.vmap(grad): the failing "
            f"operation is in {_failing_frame(exc)}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}. "
            f"Fix: {fix}."
        ) from exc
