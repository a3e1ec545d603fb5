"""The stateful PyTorch adapter of Opake: models, data loaders, files and the command line."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

__all__ = ["__version__"]


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
