"""What a harness run ran on: date, command, device, versions, commit and settings (``meta`` in ``results.json``)."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from typing import Any

import torch
from settings import Settings


def version(name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checked-out commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(settings: Settings, argv: list[str]) -> dict[str, Any]:
    device = settings.device
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/harness.py " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "python": platform.python_version(),
        "versions": {name: version(name) for name in ("torch", "transformers", "peft", "opacus", "opake")},
        "git_commit": git_commit(),
        "settings": {k: str(v) for k, v in settings.__dict__.items()},
    }
