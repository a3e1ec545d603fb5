"""Model patches: compatibility patches that let Hugging Face models run under ``torch.func.vmap``."""

from opake_torch.patches.compat import apply_compat_patches, check_attention_implementation

__all__ = ["apply_compat_patches", "check_attention_implementation"]
