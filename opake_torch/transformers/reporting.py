"""Run logs under ``logging_dir`` (``<output_dir>/runs`` by default): JSON lines, and TensorBoard on request.

Every logged value except the privacy parameters (epsilon, delta, noise multiplier, noise std, clipping bound) is
an exact statistic of the private data and is **outside** the privacy guarantee. The ``runs/`` folder is never
uploaded by the hub helpers; review anything else before publishing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerCallback

__all__ = ["RunLogCallback"]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLogCallback(TrainerCallback):
    """Append every log row to ``<logging_dir>/log.jsonl``; mirror scalars to TensorBoard when asked."""

    def __init__(self) -> None:
        self._writer = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        _forget_after(Path(args.logging_dir) / "log.jsonl", state.global_step)
        if "tensorboard" in args.report_to and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run drops the events an interrupted attempt logged after its checkpoint
            self._writer = SummaryWriter(log_dir=str(args.logging_dir), purge_step=state.global_step or None)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        folder = Path(args.logging_dir)
        folder.mkdir(parents=True, exist_ok=True)
        row = {"step": state.global_step, **{k: _json_safe(v) for k, v in logs.items()}}
        with open(folder / "log.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for name, value in logs.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(_tag(name), value, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _forget_after(path: Path, step: int) -> None:
    """Drop the rows of ``path`` logged after ``step``: a run resumed at ``step`` logs those steps again."""
    if not step or not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
    path.write_text("".join(kept))


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0.0  # a damaged row is kept as it is


def _tag(name: str) -> str:
    """``privacy_epsilon`` -> ``privacy/epsilon``; ``eval_loss`` -> ``eval/loss``; ``loss`` -> ``train/loss``."""
    for prefix in ("privacy", "eval", "test"):
        if name.startswith(prefix + "_"):
            return f"{prefix}/{name[len(prefix) + 1 :]}"
    return f"train/{name}"
