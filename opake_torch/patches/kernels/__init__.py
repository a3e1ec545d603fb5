"""Performance kernels: Triton implementations with autograd and per-example (``vmap``) gradients.

Every public function runs its Triton kernel when its tensors are on a CUDA device and Triton is installed, and the
pure-torch definition in :mod:`~opake_torch.patches.kernels.reference` otherwise (CPU, no Triton, an unsupported
layout), so calling them is always safe. :func:`available` says whether the kernels can run on this machine.
"""

from opake_torch.patches.kernels._triton import available
from opake_torch.patches.kernels.activation import opake_geglu, opake_swiglu
from opake_torch.patches.kernels.clip_sum import FusedGradients
from opake_torch.patches.kernels.cross_entropy import opake_cross_entropy_loss, opake_fused_linear_cross_entropy
from opake_torch.patches.kernels.fused_add_rms_norm import opake_fused_add_rms_norm
from opake_torch.patches.kernels.lora import LoRAProjection, opake_lora_mlp, opake_lora_w
from opake_torch.patches.kernels.rms_norm import opake_rms_norm
from opake_torch.patches.kernels.rope import opake_rope

__all__ = [
    "FusedGradients",
    "LoRAProjection",
    "available",
    "opake_cross_entropy_loss",
    "opake_fused_add_rms_norm",
    "opake_fused_linear_cross_entropy",
    "opake_geglu",
    "opake_lora_mlp",
    "opake_lora_w",
    "opake_rms_norm",
    "opake_rope",
    "opake_swiglu",
]
