"""The Hugging Face adapter: ``TrainingArguments`` and ``DPTrainer``.

``TrainingArguments`` needs no Hugging Face library; ``DPTrainer`` needs the ``hf`` extra (``pip install 'opake[hf]'``)
and imports ``transformers`` when first accessed.
"""

from __future__ import annotations

from typing import Any

from opake_torch import _extras

__all__ = ["DPTrainer", "DPTrainerState", "TrainingArguments", "as_training_arguments", "pack_documents"]

_HOME = {
    "DPTrainer": "opake_torch.transformers.trainer",
    "DPTrainerState": "opake_torch.transformers.trainer",
    "TrainingArguments": "opake_torch.transformers.arguments",
    "as_training_arguments": "opake_torch.transformers.arguments",
    "pack_documents": "opake_torch.transformers.packing",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = _extras.load(_HOME[name], name, face=f"{__name__}.{name}")
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
