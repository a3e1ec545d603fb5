"""Private SFT and DPO with TRL-compatible configs and data formats.

The privacy unit is one training example: one text or conversation for SFT, one (prompt, chosen, rejected) pair for
DPO. ``SFTConfig`` and ``DPOConfig`` accept every field name of ``trl.SFTConfig`` / ``trl.DPOConfig`` (honoured,
renamed, inert with a warning, or refused with the reason) and need neither ``trl`` nor ``transformers``; only their
``from_trl`` converters import ``trl`` (the ``opake[trl]`` extra), which the trainers also use on a real TRL config
passed as ``args``. The trainers import ``transformers`` when first accessed; besides the loss they compute TRL's log
metrics per example (:mod:`opake_torch.transformers.trl.metrics`, outside the guarantee). A model given to a trainer
by name or path is loaded as TRL loads it (:mod:`opake_torch.transformers.trl.loading`).

TRL's script helpers (``ScriptArguments``, ``ModelConfig``, ``TrlParser``, ``get_dataset``, ...) are passed through
from ``trl`` unchanged, so that TRL's example scripts switch their ``from trl import ...`` lines to this module.
"""

from typing import Any

from opake_torch import _extras
from opake_torch.transformers.trl.config import DPOConfig, SFTConfig

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]

_TRAINERS = {"SFTTrainer": "opake_torch.transformers.trl.sft", "DPOTrainer": "opake_torch.transformers.trl.dpo"}
# TRL's own script helpers, passed through unchanged so that a TRL script's `from trl import ...` lines switch to this
# module as a whole (they parse options and load data; none of them trains).
_FROM_TRL = ("DatasetMixtureConfig", "ModelConfig", "ScriptArguments", "TrlParser", "get_dataset", "get_peft_config",
             "get_quantization_config")  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _TRAINERS:
        return _extras.load(_TRAINERS[name], name, face=f"{__name__}.{name}")
    if name in _FROM_TRL:
        return _extras.load("trl", name, face=f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
