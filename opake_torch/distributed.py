"""Data-parallel DP training on ``torch.distributed`` (DDP-style: every rank holds the whole model).

One logical step on ``W`` ranks:

    rank r: sample its local batch -> per-example grads -> clip -> sum / cluster expected batch
    all ranks: SUM the clipped sums (:func:`sum_gradients`) -> the same Gaussian / MF noise on every rank -> update

* The clipped sum of each rank is divided by the **cluster-wide** expected batch (``q * N``); summing those across
  ranks gives exactly the single-process normalized sum, with the single-process sensitivity ``C / (q N)``.
* Noise synchronization: every rank uses the **same noise key and step**, so every rank draws the *identical* noise
  locally, without communication (the noise of step ``t`` depends only on ``(key, t)``). The noise is thus added
  once, after the cross-rank sum, and the released update is the single-process one. This holds bit-exactly on
  the same device type and library versions (the counter-based generator is deterministic); mixing device types
  across ranks is not supported. :func:`check_synchronized` verifies at start (and after a resume) that keys, step
  counters and the privacy configuration agree on every rank; it raises ConfigurationError otherwise.
* Every rank runs every step, even with an empty local batch: the all-reduce happens anyway, so no rank waits.
* Sampling is a core option: ``opake_core.sampling.poisson(..., world_size=W, rank=r)`` gives rank ``r`` the strided
  shard ``r, r + W, r + 2W, ...``, sampled with Poisson at the global rate ``q`` from the key
  ``fold_in(sampler_key, "rank", r)``. The union over ranks is exactly Poisson(q) over the whole dataset, so the
  accountant sees the cluster-wide rate ``q`` and the epsilon equals the single-process epsilon for the cluster
  batch. Cyclic Poisson (BandMF) takes the same ``world_size``/``rank`` options, with its own per-rank shards and
  streams. :func:`local_sampler_state` makes rank 0's saved sampler state this rank's on resume.

This module and :mod:`opake_torch.sharded` (FSDP2) are where the adapter touches ``torch.distributed``; the core stays
free of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from typing import Any

import optree
import torch
import torch.distributed as dist

from opake_core.errors import ConfigurationError, StateError
from opake_core.random import Key
from opake_core.sampling.state import SamplerState
from opake_core.tree import Clipped, Noised

__all__ = [
    "barrier",
    "broadcast_key",
    "broadcast_params",
    "check_params_synchronized",
    "check_synchronized",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_distributed",
    "local_sampler_state",
    "max_over_ranks",
    "reduce_mean",
    "sum_gradients",
]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_process_group(backend: str | None, timeout_s: int, device: torch.device) -> bool:
    """Initialize the default process group from the torchrun environment when ``WORLD_SIZE > 1``.

    The backend is ``backend``, or NCCL on CUDA and Gloo on CPU. An already initialized group is kept, but a
    configured backend that differs from the live one is refused. Returns whether the run is distributed.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return False
    if not dist.is_available():
        raise ConfigurationError(f"WORLD_SIZE={world} but this torch build has no torch.distributed.")
    if dist.is_initialized():
        live = str(dist.get_backend()).lower()
        if backend is not None and backend not in live:
            raise ConfigurationError(
                f"ddp_backend={backend!r} but the live process group uses {live!r}; drop ddp_backend or initialize "
                "the group with the same backend."
            )
        if dist.get_world_size() != world:
            raise ConfigurationError(
                f"WORLD_SIZE={world} but the live process group has {dist.get_world_size()} ranks."
            )
        return True
    chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
    if chosen == "mpi" and not dist.is_mpi_available():
        raise ConfigurationError("ddp_backend='mpi' but this torch build has no MPI support; use 'gloo' or 'nccl'.")
    if chosen == "nccl" and device.type != "cuda":
        raise ConfigurationError("ddp_backend='nccl' needs CUDA devices; use 'gloo' on CPU.")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def sum_gradients(clipped: Clipped) -> Clipped:
    """All-reduce (SUM) every leaf of a clipped sum across ranks; a new Clipped with the same sensitivity.

    Copy-returning: the input is left untouched. Refuses a noised tree (the noise must come after the sum). A no-op
    copy when not distributed.
    """
    if isinstance(clipped, Noised) or not isinstance(clipped, Clipped):
        raise ConfigurationError(
            f"sum_gradients takes the clipped, un-noised sum (a Clipped), got {type(clipped).__name__}: sum across "
            "ranks first, then add the noise once."
        )

    def reduce(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        out = leaf.detach().clone()
        if is_distributed():
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    return Clipped(optree.tree_map(reduce, clipped.value), clipped.sensitivity)


def sum_counts(counts: torch.Tensor) -> torch.Tensor:
    """All-reduce (SUM) adaptive clipping's ``[clipped, batch size]`` counts across ranks (a copy)."""
    out = counts.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over ranks (a copy; the value itself when not distributed)."""
    if not is_distributed():
        return value
    out = value.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_ok(ok: bool, what: str) -> None:
    """All-reduce a failure flag; on ranks where it did not fail locally, raise StateError when another rank did."""
    if not is_distributed():
        return
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    if ok and int(flag.item()):
        raise StateError(f"{what} failed on another rank; aborting this rank too (see that rank's error).")


def max_over_ranks(value: int) -> int:
    """The largest of the ranks' ``value`` (the value itself when not distributed)."""
    if not is_distributed():
        return value
    out = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        out = out.cuda()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def _fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_synchronized(*, secret: frozenset[str] = frozenset(), **fields: Any) -> None:
    """All-gather the fingerprint of ``fields`` (keys as hex, step counters, privacy configuration) and raise
    ConfigurationError naming the fields that differ between ranks. A no-op when not distributed. The message shows
    this rank's values of the public fields only: a key, or a field named in ``secret``, is shown as ``<secret>``."""
    if not is_distributed():
        return
    mine = {k: (v.hex if isinstance(v, Key) else v) for k, v in fields.items()}
    prints = {k: _fingerprint(v) for k, v in mine.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, prints)
    differ = sorted({k for other in gathered for k in prints if other.get(k) != prints[k]})
    if differ:
        hidden = lambda k: isinstance(fields[k], Key) or k in secret  # noqa: E731
        shown = {k: "<secret>" if hidden(k) else mine[k] for k in differ}
        raise ConfigurationError(
            f"ranks disagree on {differ} (rank {dist.get_rank()} has {shown!r}): every rank "
            "must use the same seed, arguments, dataset size and checkpoint, or the noise would not be the same "
            "on every rank and the update would not be private."
        )


def params_checksum(params: dict[str, torch.Tensor]) -> float:
    total = 0.0
    for name in sorted(params):
        value = params[name].detach().double()
        total += float(value.sum()) + float(value.abs().sum())
    return total


def check_params_synchronized(params: dict[str, torch.Tensor]) -> None:
    """Debug check: all-gather a parameter checksum and raise StateError when the ranks' parameters differ."""
    if not is_distributed():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params_checksum(params))
    if len(set(gathered)) > 1:
        raise StateError(f"the ranks' parameters diverged (checksums {gathered}); the runs are not synchronized.")


def broadcast_key(key: Key) -> Key:
    """Rank 0's ``key`` on every rank (sent as two 64-bit words; nothing is pickled)."""
    if not is_distributed():
        return key
    words = torch.tensor([key.hi - (1 << 63), key.lo - (1 << 63)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        words = words.cuda()
    dist.broadcast(words, src=0)
    hi, lo = (int(w) + (1 << 63) for w in words.cpu())
    return dataclasses.replace(key, hi=hi, lo=lo)


def broadcast_params(params: dict[str, torch.Tensor]) -> None:
    """Copy rank 0's values into ``params`` on every rank (in place), so that all ranks start from the same weights."""
    if not is_distributed():
        return
    with torch.no_grad():
        for name in sorted(params):
            dist.broadcast(params[name].data, src=0)


def local_sampler_state(saved: Any, fresh: SamplerState) -> SamplerState:
    """Rank 0's saved sampler state made this rank's: the same step, the config checked up to the ``rank`` entry."""
    state = SamplerState.from_json(saved) if isinstance(saved, dict) else saved
    world = lambda config: dict(config).get("world_size")  # noqa: E731
    if world(state.config) != world(fresh.config):  # a new segment on another world size: this sampler, same step
        return SamplerState(state.step, fresh.config)
    strip = lambda config: tuple(item for item in config if item[0] != "rank")  # noqa: E731
    if strip(state.config) != strip(fresh.config):
        raise StateError(
            f"the checkpoint's sampler configuration {dict(state.config)} differs from this run's {dict(fresh.config)}."
        )
    return SamplerState(state.step, fresh.config)
