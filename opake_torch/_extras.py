"""Names that need an optional extra: imported on first use, with an ImportError that names the extra to install."""

from __future__ import annotations

import importlib
from typing import Any

# The top-level module each extra of pyproject.toml provides -> that extra's name.
EXTRAS = {"transformers": "hf", "peft": "hf", "safetensors": "hf", "trl": "trl", "triton": "kernels"}


def load(module: str, name: str, *, face: str) -> Any:
    """``module.name``, imported now; a missing extra raises ImportError naming ``face`` (the public path asked for)
    and the ``pip install`` line that provides it."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name not in EXTRAS:  # not a missing extra (a submodule missing from an installed one is a version issue)
            raise
        extra = EXTRAS[exc.name]
        raise ImportError(
            f"{face} needs {exc.name!r}, which is not installed; install the {extra!r} extra: "
            f"pip install 'opake[{extra}]'."
        ) from exc
