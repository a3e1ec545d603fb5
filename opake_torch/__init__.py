"""The stateful PyTorch adapter of Opake: models, data loaders, files and the command line.

The names a user trains with are importable from here and listed in ``__all__``; ``docs/api.md`` documents exactly
these:

* Hugging Face training: ``TrainingArguments`` and ``DPTrainer``; with TRL's data formats ``SFTConfig`` /
  ``SFTTrainer`` and ``DPOConfig`` / ``DPOTrainer``; ``pack_documents``, the ``group_texts`` whose blocks keep their
  document (the document as the privacy unit). The arguments and configs need neither ``transformers`` nor
  ``trl``; the trainers need the ``hf`` extra (``pip install 'opake[hf]'``), and asking for one without it raises an
  ImportError that says so.
* Composing the core's steps with an ``nn.Module``: ``functional_model`` (a module as a pure function of its
  parameters), the per-example losses of Hugging Face models, ``per_example_loss`` and ``batch_losses``, and the
  process-level patches ``vmap`` needs over them, applied for a scope only (``apply_runtime_patches``, with
  ``applied_patches`` saying what is in effect).

Every name loads on first use, so ``import opake_torch`` (``opake --version``) imports neither torch nor Hugging Face.

    >>> import opake_torch
    >>> args = opake_torch.TrainingArguments(output_dir="out", privacy_noise_multiplier=1.0, report_to=[])
    >>> args.privacy_noise_multiplier
    1.0
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from opake_core import _lazy

# Each name of the face -> the public module it is re-exported from (which may itself load it lazily).
_HOME = {
    "DPTrainer": "opake_torch.transformers",
    "TrainingArguments": "opake_torch.transformers",
    "DPOConfig": "opake_torch.transformers.trl",
    "DPOTrainer": "opake_torch.transformers.trl",
    "SFTConfig": "opake_torch.transformers.trl",
    "SFTTrainer": "opake_torch.transformers.trl",
    "functional_model": "opake_torch.functional",
    "batch_losses": "opake_torch.transformers.loss",
    "per_example_loss": "opake_torch.transformers.loss",
    "pack_documents": "opake_torch.transformers",
    "applied_patches": "opake_torch.patches",
    "apply_runtime_patches": "opake_torch.patches",
}

__all__ = sorted(_HOME)


__getattr__, __dir__ = _lazy.exports(__name__, _HOME)


def _version() -> str:
    """The installed distribution's version; in a checkout that is not installed, ``pyproject.toml``'s."""
    try:
        return importlib.metadata.version("opake")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    except OSError:
        return "0+unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.MULTILINE)
    return found.group(1) if found else "0+unknown"


__version__ = _version()
