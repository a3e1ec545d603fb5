"""Where this process stands in a run, as Hugging Face's ``TrainingArguments`` tells training scripts.

:class:`ProcessView` gives :class:`~opake_torch.transformers.TrainingArguments` the names Hugging Face scripts read
about the process: its rank and the world size (from torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``), its
device, whether it logs or saves, its log level, and ``main_process_first``. It reads the fields ``local_rank``,
``use_cpu``, ``log_on_each_node``, ``log_level``, ``log_level_replica`` and ``save_on_each_node`` of the arguments.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator

import torch

from opake_torch.transformers import _parsing as p

__all__ = ["LOG_LEVELS", "ParallelMode", "ProcessView"]

# Hugging Face's log levels (transformers.utils.logging), "passive" keeping the level already set.
LOG_LEVELS = {"detail": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL, "passive": -1}  # fmt: skip


class ParallelMode(enum.StrEnum):
    """The values of Hugging Face's ``ParallelMode`` that this trainer can run in."""

    NOT_PARALLEL = "not_parallel"
    DISTRIBUTED = "distributed"


class ProcessView:
    """Hugging Face's process properties of :class:`~opake_torch.transformers.TrainingArguments` (module
    docstring)."""

    @property
    def world_size(self) -> int:
        return p.env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        return p.env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        return max(self.local_rank, 0)

    @property
    def device(self) -> torch.device:
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", self.local_process_index)

    @property
    def should_log(self) -> bool:
        """As in Hugging Face: local rank 0 of every node with ``log_on_each_node`` (the default), else global rank
        0."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level of this process, as in Hugging Face: ``log_level`` where :attr:`should_log`, else
        ``log_level_replica``; ``"passive"`` keeps the level of the ``transformers`` logger."""
        level = LOG_LEVELS[self.log_level if self.should_log else self.log_level_replica]
        return logging.getLogger("transformers").getEffectiveLevel() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """As in Hugging Face: under an initialized ``torch.distributed`` process group, the main process (of the
        node with ``local``, else of the cluster) runs the block before the others (which wait at a barrier), so
        that they can reuse what it cached. Without a process group every process runs the block at once."""
        import torch.distributed as dist

        synced = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        main = (self.local_process_index if local else self.process_index) == 0
        if synced and not main:
            dist.barrier()
        try:
            yield
        finally:
            if synced and main:
                dist.barrier()

    @property
    def n_gpu(self) -> int:
        """GPUs used by this process: 1 on CUDA (one per process under DDP; no DataParallel), else 0."""
        return int(self.device.type == "cuda")

    @property
    def parallel_mode(self) -> ParallelMode:
        """``ParallelMode.DISTRIBUTED`` under torchrun (a local rank is set), else ``NOT_PARALLEL``."""
        return ParallelMode.DISTRIBUTED if self.local_rank != -1 else ParallelMode.NOT_PARALLEL

    @property
    def should_save(self) -> bool:
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0
