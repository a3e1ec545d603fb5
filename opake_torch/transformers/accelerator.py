"""``trainer.accelerator``: the part of ``accelerate.Accelerator`` that Hugging Face and TRL scripts read.

``DPTrainer`` sets up its processes and devices itself (one process, or DDP and FSDP2 ranks under ``torchrun``:
:mod:`.topology`), so it does not build a real ``Accelerator``, which would take over the device placement and the
wrapping of the model. This object answers what the example scripts ask of one, for the processes the trainer runs:
``print``, ``is_main_process``, ``is_local_main_process``, ``num_processes``, ``process_index``,
``local_process_index``, ``device``, ``wait_for_everyone``, ``unwrap_model`` and ``end_training``. Anything else
(``prepare``, ``backward``, ``gather``...) raises AttributeError: the trainer's step does that work itself.
"""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessAccelerator"]


class ProcessAccelerator:
    """The processes of a trainer run with training arguments ``args`` (their ``world_size``, ``process_index``,
    ``local_process_index`` and ``device``), as ``accelerate.Accelerator`` names them."""

    def __init__(self, args: Any) -> None:
        self._args = args

    @property
    def num_processes(self) -> int:
        return int(self._args.world_size)

    @property
    def process_index(self) -> int:
        return int(self._args.process_index)

    @property
    def local_process_index(self) -> int:
        return int(self._args.local_process_index)

    @property
    def is_main_process(self) -> bool:
        """Whether this is the global main process (rank 0)."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is the main process of its machine (local rank 0)."""
        return self.local_process_index == 0

    @property
    def device(self) -> torch.device:
        return self._args.device

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process of each machine only, as accelerate's."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across the trainer's processes (nothing to wait for in one process)."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True) -> torch.nn.Module:
        """``model`` itself: the trainer never wraps the model it trains."""
        return model

    def end_training(self) -> None:
        """Destroy the process group of a distributed run (as accelerate's, after its trackers: the trainer's
        reporting integrations already finished at the end of ``train()``)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
