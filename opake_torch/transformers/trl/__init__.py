"""Private SFT and DPO with TRL-compatible configs and data formats.

The privacy unit is one training example: one text or conversation for SFT, one (prompt, chosen, rejected) pair for
DPO. ``SFTConfig`` and ``DPOConfig`` need neither ``trl`` nor ``transformers``; only their ``from_trl`` converters
import ``trl`` (the ``opake[trl]`` extra). The trainers import ``transformers`` when first accessed.
"""

from typing import Any

from opake_torch.transformers.trl.config import DPOConfig, SFTConfig

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]


def __getattr__(name: str) -> Any:
    if name == "SFTTrainer":
        from opake_torch.transformers.trl.sft import SFTTrainer

        return SFTTrainer
    if name == "DPOTrainer":
        from opake_torch.transformers.trl.dpo import DPOTrainer

        return DPOTrainer
    raise AttributeError(f"module 'opake_torch.transformers.trl' has no attribute {name!r}")
