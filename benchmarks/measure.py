"""One record per workload and mode: median and p90 step time, throughput, peak memory, and the largest batch.

A mode's warm-up and timed steps run under the run's TF32 setting, with memory freed before and after; a failing
mode (OOM included) is a record with its error, not the end of the run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

from modes import BUILDERS, OPACUS_MODES, TRAINER_MODES, opacus_available, opake_trainer
from profiling import profile_core
from settings import Settings
from timing import failure, free, is_oom, peak_gib, reserved_gib, tf32, timed_steps
from workloads import Workload, make_batch


def measure(
    mode: str, workload: Workload, size: int, settings: Settings, warmup: int, steps: int, *, profile: bool = False
) -> dict[str, Any]:
    """Times and peak memory of one mode at batch ``size`` (raises on failure, OOM included).

    With ``profile`` (opake_core only), the phase breakdown of the same warmed-up step follows the timed steps.
    """
    batch = make_batch(workload, size, settings.device)
    if mode in TRAINER_MODES:
        short = dataclasses.replace(settings, warmup=warmup, steps=steps)
        kernels, graphs = mode == "opake_trainer_kernels", mode == "opake_trainer_graphs"
        return opake_trainer(workload, batch, short, kernels=kernels, graphs=graphs)
    step = BUILDERS[mode](workload, batch, settings)
    times = timed_steps(step, settings.device, warmup, steps)
    out = {"times": times, "peak_gib": peak_gib(settings.device), "reserved_gib": reserved_gib(settings.device)}
    if profile and mode == "opake_core":
        out["phases"] = profile_core(step, batch, settings)
    return out


def run_mode(
    mode: str, workload: Workload, settings: Settings, *, find_max_batch: bool, profile: bool = False
) -> dict[str, Any]:
    """One record: median step time, throughput, peak memory (and the largest batch that fits, when asked)."""
    record: dict[str, Any] = {
        "workload": workload.name,
        "mode": mode,
        "batch": workload.batch,
        "seq": workload.seq,
        "dtype": workload.dtype,
        "microbatch": settings.microbatch_for(workload.batch) if mode.startswith("opake") else None,
        "ok": False,
    }
    if mode in OPACUS_MODES and not opacus_available():
        return {**record, "skipped": True, "error": "opacus not installed"}
    if mode == "opake_trainer_graphs" and settings.device.type != "cuda":
        return {**record, "skipped": True, "error": "CUDA graphs need a CUDA device"}
    free(settings.device)
    begin = time.perf_counter()
    try:
        with tf32(settings.tf32):
            out = measure(mode, workload, workload.batch, settings, settings.warmup, settings.steps, profile=profile)
    except Exception as exc:  # a failing mode is a result, not the end of the run
        record["error"] = failure(exc)
        out = None
    free(settings.device)
    if out is not None:
        times = sorted(out["times"])
        median = statistics.median(times)
        record.update(
            ok=True,
            step_s_median=median,
            step_s_p90=times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)],
            steps_timed=len(times),
            examples_per_s=workload.batch / median,
            tokens_per_s=workload.batch * workload.seq / median,
            peak_mem_gib=out["peak_gib"],
            peak_reserved_gib=out["reserved_gib"],
        )
        if "per_example_gradients" in out:
            record["per_example_gradients"] = out["per_example_gradients"]
        if "phases" in out:
            phases = {"workload": workload.name, **out["phases"], "step_ms_unprofiled": 1e3 * median}
            record["phase_breakdown"] = phases
    if find_max_batch and out is not None:
        record.update(max_batch(mode, workload, settings))
    record["wall_s"] = round(time.perf_counter() - begin, 2)
    return record


def max_batch(mode: str, workload: Workload, settings: Settings) -> dict[str, Any]:
    """Double the batch from the workload's until the first OOM, the cap or the time budget, whichever is first."""
    if mode in TRAINER_MODES:
        return {"max_batch": None, "max_batch_note": "not searched: same step as opake_core"}
    begin, fits, size = time.perf_counter(), workload.batch, workload.batch * 2
    note = f"cap {settings.max_batch_cap} reached"
    while size <= settings.max_batch_cap:
        if time.perf_counter() - begin > settings.max_batch_budget_s:
            note = f"time budget {settings.max_batch_budget_s:g} s spent; at least this much fits"
            break
        try:
            with tf32(settings.tf32):
                measure(mode, workload, size, settings, warmup=1, steps=1)
        except Exception as exc:
            note = f"OOM at {size}" if is_oom(exc) else f"{type(exc).__name__} at {size}: {str(exc)[:200]}"
            break
        finally:
            free(settings.device)
        fits, size = size, size * 2
    return {"max_batch": fits, "max_batch_note": note}
