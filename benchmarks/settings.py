"""Run-wide choices of the harness (its command-line flags), handed to every mode, check and profile."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Settings:
    """Run-wide choices (command-line flags)."""

    device: torch.device
    steps: int
    warmup: int
    noise_multiplier: float
    clipping_norm: float
    microbatch: int | None
    tf32: bool
    profile_steps: int
    max_batch_cap: int
    max_batch_budget_s: float

    def microbatch_for(self, batch: int) -> int:
        return min(self.microbatch or batch, batch)
