"""Checkpoint folders: layout, atomic writes, discovery and rotation.

A checkpoint is a folder ``checkpoint-<step>`` holding

==================== ===========================================================================
``model.safetensors`` the model weights (Hugging Face layout; PEFT models save their adapters)
``dp_state.pt``       the DP runtime: step, sampler state, keys, noise and clipping configuration, versions
``dp_optimizer.pt``   the optimizer state
``accountant.json``   what was composed, with which parameters, and the epsilon spent (when accounted)
``trainer_state.json`` Hugging Face ``TrainerState`` (log history, best metric, ...)
``training_args.json`` the arguments of the run
==================== ===========================================================================

Writes are atomic: files go to a hidden sibling folder that is renamed to ``checkpoint-<step>`` only once every
file is complete, so a crash part way never leaves a folder that looks complete. Hidden folders are ignored by
discovery and removed by the next successful write.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from opake_core.errors import CheckpointError

__all__ = [
    "ACCOUNTANT",
    "DP_OPTIMIZER",
    "DP_STATE",
    "PREFIX",
    "TRAINER_STATE",
    "TRAINING_ARGS",
    "checkpoints",
    "latest_checkpoint",
    "require_resumable",
    "rotate",
    "write_atomically",
]

PREFIX = "checkpoint"
DP_STATE = "dp_state.pt"
DP_OPTIMIZER = "dp_optimizer.pt"
ACCOUNTANT = "accountant.json"
TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.json"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


def write_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a hidden sibling folder, then rename it to ``folder`` (replacing an old one)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.parent / f".{folder.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if folder.exists():
            old = folder.parent / f".{folder.name}.partial-old-{uuid.uuid4().hex[:8]}"
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders under ``output_dir``, oldest step first."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob(f"{PREFIX}-*") if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint with the highest step, or None."""
    found = checkpoints(output_dir)
    return found[-1] if found else None


def require_resumable(folder: Path, *, accounted: bool) -> None:
    """Raise :class:`CheckpointError` unless ``folder`` is a complete DP checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={str(folder)!r} is not a folder.")
    needed = [DP_STATE, DP_OPTIMIZER] + ([ACCOUNTANT] if accounted else [])
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{folder} is not a complete DP checkpoint (missing {', '.join(missing)}): it holds weights only. "
            "To start a new DP run from these weights, load them as the model (model=...); the new run begins "
            "with a zero accountant, which is correct only if those weights cost no privacy."
        )


def rotate(output_dir: Path, limit: int | None, *, protect: tuple[Path, ...] = ()) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``, never one in ``protect``; returns the deleted folders."""
    if limit is None:
        return []
    found = checkpoints(output_dir)
    protected = {Path(p).resolve() for p in protect}
    keep_count = max(limit, len([p for p in found if p.resolve() in protected]))
    removable = [p for p in found if p.resolve() not in protected]
    excess = len(found) - keep_count
    deleted = removable[: max(excess, 0)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted
