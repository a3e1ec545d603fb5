"""Per-phase step times in the logs (``TrainingArguments.step_perf``).

A step runs four phases, one after the other; each log row gets their mean time per step (seconds) over the steps
since the last row:

==========================  ==========================================================================
``perf/sample_sec``         drawing the batch from the sampler, reading its rows and collating them
``perf/gradients_sec``      per-example gradients, their clipping and sum (under DDP, the cross-rank sum)
``perf/noise_sec``          the noise (DP-SGD's Gaussian, or DP-FTRL's correlated noise)
``perf/optimizer_sec``      the optimizer's update, its application to the weights and their write-back
``perf/step_sec``           the whole step, from the sampler's draw to the written-back weights
``perf/peak_memory_gb``     on CUDA, the largest memory any step of the row allocated (GiB, ``2**30`` bytes)
==========================  ==========================================================================

The phases partition the step, so their times add up to ``perf/step_sec`` (callbacks and logging run outside it).
The boundaries are marks: the step's start, after the batch is collated, when the clipped sum leaves the cross-rank
reduction (the core step's ``reduce`` seam, called once a step, twice for a pair of private moments), when the
optimizer receives the noised sum, and when the step returns. Each mark synchronizes the device first, so a phase is
charged for its own kernels, not for those queued before it; that synchronization slows the step, which is why the
option is off by default. Off, none of this is built and the step runs no mark at all.

The times are measurements of the private batch (a larger Poisson draw takes longer): like ``train_runtime`` they are
outside the guarantee (docs: "What is logged, and what is private").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PHASES", "StepPerf", "TimedOptimizer"]

PHASES = ("sample", "gradients", "noise", "optimizer")


class StepPerf:
    """The phase clock of a run's steps on ``device``: :meth:`begin` a step, :meth:`mark` the end of each phase,
    :meth:`end` the step; :meth:`drain` gives the log row's values and starts the next row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._step_sum, self._steps, self._peak = 0.0, 0, 0
        self._start = self._last = 0.0

    def _now(self) -> float:
        if self._cuda:  # the phase's queued kernels belong to it
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin(self) -> None:
        """Start a step (before the sampler's draw)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = self._last = self._now()

    def mark(self, phase: str) -> None:
        """End ``phase`` (one of :data:`PHASES`) now: the time since the previous mark is charged to it."""
        now = self._now()
        self._sums[phase] += now - self._last
        self._last = now

    def end(self) -> None:
        """End the step (the optimizer phase, after the step returned)."""
        self.mark("optimizer")
        self._step_sum += self._last - self._start
        self._steps += 1
        if self._cuda:
            self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))

    def drain(self) -> dict[str, float]:
        """The mean seconds per step of each phase and of the whole step since the last call (and the peak memory on
        CUDA); empty when no step ended since."""
        steps = self._steps
        if not steps:
            return {}
        logs = {f"perf/{phase}_sec": total / steps for phase, total in self._sums.items()}
        logs["perf/step_sec"] = self._step_sum / steps
        if self._cuda:
            logs["perf/peak_memory_gb"] = self._peak / 2**30
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._step_sum, self._steps, self._peak = 0.0, 0, 0
        return logs

    def timed_reduce(self, reduce: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
        """The core step's ``reduce`` (the cross-rank sum; None: the identity) that ends the gradients phase."""

        def timed(clipped: Any) -> Any:
            out = clipped if reduce is None else reduce(clipped)
            self.mark("gradients")
            return out

        return timed


class TimedOptimizer:
    """``optimizer`` whose ``update`` (and ``apply_in_place``) first ends the noise phase of ``perf``; every other
    attribute is the optimizer's."""

    def __init__(self, optimizer: Any, perf: StepPerf) -> None:
        self.optimizer, self.perf = optimizer, perf

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def update(self, updates: Any, state: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.perf.mark("noise")
        return self.optimizer.update(updates, state, **kwargs)

    def apply_in_place(self, updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        self.perf.mark("noise")
        return self.optimizer.apply_in_place(updates, state, params)
