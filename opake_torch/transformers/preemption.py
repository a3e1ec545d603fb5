"""Just-in-time checkpoints: a scheduler's warning signal ends the run at the next step boundary, with a checkpoint.

Slurm (``--signal``), Kubernetes and most job schedulers send ``SIGTERM`` (Slurm often ``SIGUSR1``) some seconds
before they kill a job. With ``enable_jit_checkpoint=True``, :class:`Preemption` replaces the handlers of these two
signals for the duration of ``train()``: a handler only notes the signal, and the trainer, after the step in progress
(its update applied and its release recorded in the ledger, never between the two), writes the same sealed
``checkpoint-<step>`` as ``save_strategy`` does and raises :class:`TrainingPreempted`. The previous handlers are
restored when ``train()`` returns or raises.

:class:`TrainingPreempted` derives from ``SystemExit`` with the code ``128 + signal`` (143 for ``SIGTERM``, 138 for
``SIGUSR1``), the code of a process killed by that signal: a script that does not catch it exits with that code and
no traceback, so that a scheduler that requeues failed jobs (Kubernetes' ``restartPolicy: OnFailure``, torchrun's
``--max-restarts``, a Slurm script testing ``$?``) requeues it; ``resume_from_checkpoint=True`` then continues the
identical trajectory. Under DDP the ranks agree at every step on whether any of them was signalled (one
``int64`` all-reduce per step), so that all of them save at the same step and stop.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from opake_torch import distributed

__all__ = ["SIGNALS", "Preemption", "TrainingPreempted"]

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingPreempted(SystemExit):
    """``train()`` stopped on a scheduler's signal after writing ``checkpoint``; ``code`` is ``128 + signum``.

    Attributes:
        signum: the signal received (on any rank, under DDP).
        step: the global step the checkpoint holds.
        checkpoint: the folder written.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        return (
            f"training stopped on {signal.Signals(self.signum).name} after step {self.step}, with its checkpoint in "
            f"{self.checkpoint}; resume with resume_from_checkpoint=True (exit code {self.code})."
        )


class Preemption:
    """The signal handlers of one ``train()`` call: :meth:`install` replaces them (when ``enabled``, and only in the
    main thread, the one Python runs handlers in), :meth:`restore` puts the previous ones back."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._received = 0  # the last signal number received; 0: none
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "enable_jit_checkpoint=True has no effect: train() runs outside the main thread, and Python delivers "
                "signals to the main thread only. Call train() from the main thread, or rely on save_strategy."
            )
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # a handler runs between two bytecodes of the main thread: it only notes, the trainer acts at a step boundary
        self._received = signum

    def requested(self) -> int:
        """The signal to stop on (the largest number among the ranks' signals), 0 when none; a collective under DDP,
        called by every rank at the same step."""
        if not self.enabled:
            return 0
        signum = distributed.max_over_ranks(self._received)
        if signum:
            logger.warning("%s received: saving a checkpoint of this step and stopping.", signal.Signals(signum).name)
        return signum
