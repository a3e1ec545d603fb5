"""``ComputeSettings``: the training arguments that choose how a private step computes, never what it releases.

Precision (``bf16``, ``tf32``), memory (``microbatch_size``, gradient checkpointing, activation offloading), the
per-example gradient engine and its tuning (``per_example_gradients``, ``per_example_row_multiple``,
``layerwise_ghost_advantage``), compilation and CUDA graphs, kernels and the device. None of them changes the
sampler, the noise or the epsilon: the clipped sum is the same for any chunking or engine (to float rounding), so two
runs whose arguments differ only here have equal :class:`~opake_torch.transformers.privacy_settings.PrivacySettings`.

A value is frozen: ``__post_init__`` reads each field, stores the canonical value and applies every rule of these
fields; :class:`~opake_torch.transformers.TrainingArguments` builds one (``args.compute``) from its fields of the same
names. Two rules stay with the arguments, since they concern more than these fields: ``microbatch_size`` at most
``per_device_train_batch_size`` (a privacy setting), and ``tf32``, which switches the process's TF32 at construction
as in Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from opake_core.errors import ConfigurationError
from opake_torch.limits import MAX_COUNT, MAX_SCALE
from opake_torch.offloading import VMAP_NEEDS_CHECKPOINTING
from opake_torch.transformers import _parsing as p

__all__ = ["CHECKPOINTING_KWARGS", "COMPILE_MODES", "COMPUTE_LIMITS", "ComputeSettings"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# gradient_checkpointing_kwargs keys the vmap-safe recompute honours (it replaces both of torch's implementations
# and always replays the forward's dropout masks), and those it cannot.
CHECKPOINTING_KWARGS = ("use_reentrant", "preserve_rng_state", "every_n_layers")
COMPUTE_LIMITS: dict[str, p.Limit] = {
    "microbatch_size": p.Limit(True, 1, MAX_COUNT, p.COUNT),
    "cuda_graphs": p.Limit(True, 0, MAX_COUNT, "the number of graph signatures to retain, 0 disables; e.g. 8"),
    "per_example_row_multiple": p.Limit(True, 1, MAX_COUNT, "rows per chunk are rounded up to a multiple of it; 1 "
                                        "runs the real rows only"),
    "layerwise_ghost_advantage": p.Limit(False, 0, MAX_SCALE, "a weight on the size of the Gram factors; 1.0 "
                                         "compares the memory of the two norms as it is", open_low=True),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ComputeSettings:
    """The compute settings of a run (module docstring); the fields are those of
    :class:`~opake_torch.transformers.TrainingArguments` with the same names, documented on the 'Training arguments'
    page.

    Attributes:
        microbatch_size: the most examples per physical chunk (None: the expected batch per device).
        auto_find_microbatch_size: halve the chunk on CUDA out-of-memory and retry.
        per_example_gradients: ``"auto"``, ``"layerwise"`` or ``"vmap"``.
        per_example_row_multiple: each chunk's rows, without CUDA graphs or a compiled layerwise pass, rounded up to
            a multiple of this with dead rows (which add exactly nothing); 1 runs the real rows only.
        layerwise_ghost_advantage: the layerwise engine takes a weight's ghost norm when its Gram factors, times
            this, hold less than the weight's per-example gradients; above 1 it instantiates more weights (time for
            memory), never changing a norm beyond rounding.
        bf16, bf16_full_eval, tf32: precision of the per-example loss, of evaluation, of float32 matmuls.
        gradient_checkpointing, gradient_checkpointing_kwargs: the vmap-safe recompute.
        activation_offloading: the tensors the per-example gradient pass saves for its backward wait in pinned host
            memory (:mod:`opake_torch.offloading`): all of them under the layerwise engine, the checkpointed layers'
            inputs under ``vmap(grad)`` (which needs ``gradient_checkpointing`` for it).
        torch_compile, torch_compile_backend, torch_compile_mode, cuda_graphs: how each chunk runs.
        use_compat_patches, use_performance_kernels, performance_kernels_config: model patches and fused kernels.
        use_cpu: run on the CPU.
    """

    microbatch_size: int | None
    auto_find_microbatch_size: bool
    per_example_gradients: str
    per_example_row_multiple: int
    layerwise_ghost_advantage: float
    bf16: bool
    bf16_full_eval: bool
    tf32: bool | None
    gradient_checkpointing: bool
    gradient_checkpointing_kwargs: dict[str, Any] | None
    activation_offloading: bool
    torch_compile: bool
    torch_compile_backend: str | None
    torch_compile_mode: str | None
    cuda_graphs: int
    use_compat_patches: bool
    use_performance_kernels: bool
    performance_kernels_config: dict[str, Any] | None
    use_cpu: bool

    def __post_init__(self) -> None:
        if self.gradient_checkpointing is None:  # Hugging Face's default in older versions, meaning off
            self._set("gradient_checkpointing", False)
        p.check_types(self, COMPUTE_LIMITS)
        self._set("layerwise_ghost_advantage", float(self.layerwise_ghost_advantage))
        self._resolve_checkpointing()
        self._resolve_compile()
        self._set(
            "per_example_gradients",
            p.as_choice(self.per_example_gradients, "per_example_gradients", ("auto", "layerwise", "vmap")),
        )
        self._resolve_offloading()
        if (kernels := self.performance_kernels_config) is not None:
            self._set("performance_kernels_config", p.as_dict(kernels, "performance_kernels_config"))
        if self.bf16 and not self.use_cpu and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ConfigurationError("Your setup doesn't support bf16 on this GPU; set bf16=False or use_cpu=True.")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the canonical value, once, while the frozen value is built

    def _resolve_checkpointing(self) -> None:
        if self.gradient_checkpointing_kwargs is None:
            return
        kwargs = p.as_dict(self.gradient_checkpointing_kwargs, "gradient_checkpointing_kwargs")
        p.check_keys(kwargs, CHECKPOINTING_KWARGS, "gradient_checkpointing_kwargs", "the vmap-safe recompute")
        for key in ("use_reentrant", "preserve_rng_state"):
            if key in kwargs:
                p.as_bool(kwargs[key], f"gradient_checkpointing_kwargs[{key!r}]")
        if kwargs.get("every_n_layers", 1) != 1:
            raise ConfigurationError(
                f"gradient_checkpointing_kwargs['every_n_layers']={kwargs['every_n_layers']!r} is not supported: the "
                "vmap-safe recompute checkpoints every decoder layer. Remove it (or set 1); lower microbatch_size "
                "to trade speed for memory instead."
            )
        self._set("gradient_checkpointing_kwargs", kwargs)

    def _resolve_compile(self) -> None:
        if self.torch_compile_mode is not None:
            self._set("torch_compile_mode", p.as_choice(self.torch_compile_mode, "torch_compile_mode", COMPILE_MODES))
        if self.torch_compile_mode is not None or self.torch_compile_backend is not None:
            self._set("torch_compile", True)
        if self.torch_compile and self.torch_compile_backend is None:
            self._set("torch_compile_backend", "inductor")
        if self.cuda_graphs and self.torch_compile:
            raise ConfigurationError("cuda_graphs > 0 and torch_compile are mutually exclusive; pick one.")
        if self.cuda_graphs and self.auto_find_microbatch_size:
            raise ConfigurationError(
                "cuda_graphs > 0 is incompatible with auto_find_microbatch_size: the probe's OOM retries would "
                "capture graphs at every probed size. Set microbatch_size explicitly."
            )
        if self.torch_compile and self.auto_find_microbatch_size:
            raise ConfigurationError(
                "torch_compile is incompatible with auto_find_microbatch_size (recompiles at every probed size, "
                "PyTorch #128711). Set microbatch_size explicitly."
            )
        if self.torch_compile and self.gradient_checkpointing:
            raise ConfigurationError("gradient_checkpointing is incompatible with torch_compile; disable one of them.")

    def _resolve_offloading(self) -> None:
        if not self.activation_offloading:
            return
        if self.torch_compile or self.cuda_graphs:
            # a compiled graph does not run saved-tensor hooks, and a captured one cannot allocate host memory
            knob = "torch_compile=True" if self.torch_compile else f"cuda_graphs={self.cuda_graphs}"
            raise ConfigurationError(
                f"activation_offloading=True is incompatible with {knob}: a compiled or captured chunk cannot copy "
                "its saved tensors to host memory. Disable one of them."
            )
        if self.per_example_gradients == "vmap" and not self.gradient_checkpointing:
            raise ConfigurationError(VMAP_NEEDS_CHECKPOINTING)
