"""The Hugging Face adapter: ``TrainingArguments`` and ``DPTrainer``.

``TrainingArguments`` needs no Hugging Face library; ``DPTrainer`` imports ``transformers`` when first accessed.
"""

from typing import Any

from opake_torch.transformers.arguments import TrainingArguments, as_training_arguments

__all__ = ["DPTrainer", "DPTrainerState", "TrainingArguments", "as_training_arguments"]


def __getattr__(name: str) -> Any:
    if name in ("DPTrainer", "DPTrainerState"):
        from opake_torch.transformers import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'opake_torch.transformers' has no attribute {name!r}")
