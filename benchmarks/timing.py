"""Timing, memory and table helpers shared by the GPU benchmarks (they also run on CPU, where memory is not
measured)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Collect garbage, empty the CUDA cache and reset the peak-memory statistics."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """``torch.cuda.max_memory_allocated`` in GiB; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reserved_gib(device: torch.device) -> float | None:
    """``torch.cuda.max_memory_reserved`` in GiB (what the caching allocator held, CUDA-graph pools included); None
    off CUDA. A replayed CUDA graph allocates nothing, so its working memory shows here and not in
    :func:`peak_gib`."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an out-of-memory error."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def failure(exc: BaseException) -> str:
    """How a failed measurement is recorded: ``"OOM"``, or the exception's type and the start of its message."""
    return "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:400]}"


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on or off inside the block, restored after it."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def timed_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Run ``warmup`` untimed then ``steps`` timed calls (seconds each, synchronized); the peak-memory statistics
    are reset after the warm-ups."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync(device)
        begin = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - begin)
    return times


def fmt(value: object, spec: str) -> str:
    """``format(value, spec)``, or an empty cell for a missing value."""
    return "" if value is None else format(value, spec)


def table_row(cells: list[str]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule and one line per row of cells."""
    return [table_row(header), "|" + "---|" * len(header), *(table_row(cells) for cells in rows)]
