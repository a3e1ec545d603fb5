"""Model patches: what lets Hugging Face models run under ``torch.func.vmap``, and the performance kernels.

Per-instance patches change one model's modules; process-level patches are applied only for a scope
(:func:`apply_runtime_patches`, undone after) and :func:`applied_patches` lists what is in effect now. Importing
Opake patches nothing.
"""

from opake_torch.patches.compat import check_attention_implementation
from opake_torch.patches.runtime import (
    VMAP_PATCHES,
    AppliedPatches,
    RuntimePatch,
    applied_patches,
    apply_runtime_patches,
)

__all__ = [
    "VMAP_PATCHES",
    "AppliedPatches",
    "RuntimePatch",
    "applied_patches",
    "apply_runtime_patches",
    "check_attention_implementation",
]
