"""Where a trainer runs: one process, or DDP ranks under torchrun. Everything that differs lives here.

:class:`SingleProcess` makes every cross-rank operation the identity; :class:`DataParallel` implements them on
``torch.distributed`` (:mod:`opake_torch.distributed`): rank 0's weights and keys on every rank, the cross-rank SUM of
the clipped sums (and of adaptive clipping's counts) before the one noise draw, checks that the ranks agree, and one
writer for checkpoints whose failure stops every rank. :func:`topology` picks one from the arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake_core.errors import ConfigurationError
from opake_core.random import Key
from opake_core.sampling.state import SamplerState
from opake_torch import distributed

__all__ = ["DataParallel", "SingleProcess", "topology"]


class SingleProcess:
    """One process: collectives are the identity."""

    is_distributed = False
    reduce: Callable[..., Any] | None = None  # the cross-rank sum of the clipped sums (none here)
    reduce_count: Callable[..., Any] | None = None  # the cross-rank sum of adaptive clipping's counts

    def broadcast_params(self, params: dict[str, torch.Tensor]) -> None:
        """Rank 0's parameters on every rank, in place."""

    def shared_key(self, key: Key) -> Key:
        """Rank 0's key on every rank."""
        return key

    def check_agree(self, **fields: Any) -> None:
        """ConfigurationError naming the fields (keys, counters, configuration) that differ between ranks."""

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        """StateError when the ranks' parameters diverged."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a logged value over ranks."""
        return value

    def write(self, should_write: bool, write: Callable[[], Any], what: str) -> None:
        """``write()`` on the writing rank; under DDP a failure there stops every rank."""
        if should_write:
            write()

    def sampler_state(self, saved: SamplerState, fresh: SamplerState) -> SamplerState:
        """A checkpoint's sampler state for this run's sampler: the saved one, or (a per-step run resumed at another
        rate) this sampler continued at the saved step."""
        return saved if saved.config == fresh.config else SamplerState(saved.step, fresh.config)


class DataParallel(SingleProcess):
    """DDP ranks under torchrun on ``torch.distributed``."""

    is_distributed = True
    reduce = staticmethod(distributed.sum_gradients)
    reduce_count = staticmethod(distributed.sum_counts)

    def broadcast_params(self, params: dict[str, torch.Tensor]) -> None:
        distributed.broadcast_params(params)

    def shared_key(self, key: Key) -> Key:
        return distributed.broadcast_key(key)

    def check_agree(self, **fields: Any) -> None:
        distributed.check_synchronized(secret=frozenset({"dataset"}), **fields)

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        distributed.check_params_synchronized(params)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return distributed.reduce_mean(value)

    def write(self, should_write: bool, write: Callable[[], Any], what: str) -> None:
        try:
            if should_write:
                write()
        except BaseException:
            distributed.all_ok(False, what)
            raise
        distributed.all_ok(True, what)

    def sampler_state(self, saved: SamplerState, fresh: SamplerState) -> SamplerState:
        return distributed.local_sampler_state(saved, fresh)  # rank 0 wrote it; each rank keeps its own sampler


def topology(args: Any) -> SingleProcess:
    """The topology of a run: DDP under torchrun (``WORLD_SIZE > 1``, the process group initialized here), else one
    process; refuses what DDP cannot synchronize."""
    if args.world_size <= 1:
        if distributed.is_distributed():
            raise ConfigurationError(
                f"a process group of {distributed.get_world_size()} ranks is initialized but WORLD_SIZE is not set: "
                "launch with torchrun (or set WORLD_SIZE, RANK and LOCAL_RANK), so that sampling and accounting see "
                "the cluster."
            )
        return SingleProcess()
    if args.auto_find_microbatch_size:
        raise ConfigurationError(
            "auto_find_microbatch_size is not supported under DDP: an out-of-memory retry on one rank would "
            "desynchronize the cross-rank sum. Set microbatch_size explicitly."
        )
    if not distributed.init_process_group(args.ddp_backend, args.ddp_timeout, args.device):
        return SingleProcess()
    if distributed.get_rank() != args.process_index:
        raise ConfigurationError(
            f"the process group rank {distributed.get_rank()} differs from RANK={args.process_index}; launch with "
            "torchrun, whose RANK is the process group rank."
        )
    return DataParallel()
