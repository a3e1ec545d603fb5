"""Phase breakdown of the ``opake_core`` step (``--profile``): its ``opake::`` profiler ranges, the per-example
forward/backward alone, and the host cost of one accounting query."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from modes import CoreStep
from settings import Settings
from timing import failure, sync, timed_steps


def phase_times(prof: Any, steps: int) -> dict[str, dict[str, float]]:
    """Per-step milliseconds of each ``opake::`` range: host wall time, GPU span and summed kernel time."""
    phases: dict[str, dict[str, float]] = {}
    for event in prof.events():
        name = event.name
        if not name.startswith("opake::"):
            continue
        row = phases.setdefault(name, {"host_ms": 0.0, "gpu_span_ms": 0.0, "kernel_ms": 0.0, "calls": 0})
        if str(getattr(event, "device_type", "")).endswith("CPU"):
            row["host_ms"] += event.cpu_time_total / 1e3 / steps
            row["kernel_ms"] += getattr(event, "device_time_total", 0.0) / 1e3 / steps
            row["calls"] += 1
        else:  # the GPU-side span of a user annotation
            row["gpu_span_ms"] += (event.time_range.end - event.time_range.start) / 1e3 / steps
    return phases


def profile_core(step: CoreStep, batch: dict[str, torch.Tensor], settings: Settings) -> dict[str, Any]:
    """Profile a warmed-up core step by ``opake::`` phase, and time a plain vmap(grad) sum of the same chunks."""
    from torch.func import grad, vmap
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {"ok": False, "steps_profiled": settings.profile_steps}
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if settings.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(settings.profile_steps):
                step()
            sync(settings.device)
        result["phases"] = phase_times(prof, settings.profile_steps)
        del prof

        # forward + backward alone: the same vmap(grad) chunks, summed without norms or scaling
        per_example = vmap(grad(step.loss_fn), in_dims=(None, 0), randomness="different")

        def grads_only() -> None:
            with torch.no_grad():
                sums = None
                size, chunk = batch["input_ids"].shape[0], step.microbatch
                for start in range(0, size, chunk):
                    part = {k: v[start : start + chunk] for k, v in batch.items()}
                    grads = per_example(step.params, part)
                    chunk_sum = {k: g.float().sum(0) for k, g in grads.items()}
                    sums = chunk_sum if sums is None else {k: sums[k] + chunk_sum[k] for k in sums}

        result["per_example_grads_ms"] = 1e3 * statistics.median(
            timed_steps(grads_only, settings.device, 1, settings.profile_steps)
        )
        result["noised_numel"] = sum(p.numel() for p in step.params.values())
        result["ok"] = True
    except Exception as exc:
        result["error"] = failure(exc)
    return result


def accounting_query_ms() -> float:
    """Host milliseconds of one epsilon query (PLD) for 1000 Poisson-subsampled Gaussian steps (q=0.01, z=1).

    It does not depend on the model: DPTrainer asks it at logging and checkpoint steps only, never per step.
    """
    from opake_core import accounting

    process = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 1000)
    accounting.epsilon(process, delta=1e-5)  # imports and caches outside the timing
    begin = time.perf_counter()
    accounting.epsilon(process, delta=1e-5)
    return 1e3 * (time.perf_counter() - begin)
