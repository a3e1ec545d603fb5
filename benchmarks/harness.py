"""One-run benchmark: the same model, batch and sequence length in every training mode, side by side.

Usage::

    python benchmarks/harness.py --suite gpu --out DIR [--profile] [--find-max-batch]
    python benchmarks/harness.py --suite smoke --out DIR          # tiny CPU configs, for the test suite

Modes, run one after the other in this process for each workload (memory freed in between):

* ``nonprivate``: plain Hugging Face training, ``model(**batch).loss.backward()`` and ``torch.optim.AdamW``.
* ``opacus_hooks``, ``opacus_ghost``: Opacus per-sample hooks and ghost clipping (skipped when opacus is missing).
* ``opake_core``: ``opake_core.step.dp_sgd`` on the model's functional form; a fixed batch instead of a Poisson draw.
* ``opake_trainer``: ``DPTrainer.train()`` with ``max_steps = warmup + steps``, timed by a callback. Its dataset is
  the batch itself (sampling rate 1), so every Poisson draw is that same full batch.
* ``opake_trainer_kernels``: the same with ``use_performance_kernels=True`` (a logged no-op without CUDA and
  Triton).
* ``opake_trainer_graphs``: the same with ``cuda_graphs=1``: each chunk (per-example gradients, clipping, sum) is
  captured once and replayed (CUDA only; skipped elsewhere).

Every private mode uses noise multiplier 1 and clipping norm 1, AdamW with lr 1e-4 and weight decay 0.01. Each
mode times the median of ``--steps`` steps after ``--warmup`` warm-ups (synchronized wall clock around each step)
and reads the peaks of ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the timed steps (a
replayed graph allocates nothing, so compare CUDA graphs on the reserved peak). Same-batch correctness: our clipped
sum (``clipped_grad``, normalize_by=1, noise off, eval mode) against Opacus's hooks with noise multiplier 0 and
loss reduction "sum", or, without Opacus on the smoke suite, against a float64 per-example autograd loop.

Writes ``results.json`` (meta, one record per workload x mode, checks, phases) and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import fmt, free, is_oom, peak_gib, reserved_gib, rope_restored, sync, table_row, timed_steps
from workloads import SUITES, Workload, build_model, make_batch, model_inputs, per_example_losses

MODES = (
    "nonprivate",
    "opacus_hooks",
    "opacus_ghost",
    "opake_core",
    "opake_trainer",
    "opake_trainer_kernels",
    "opake_trainer_graphs",
)
OPACUS_MODES = ("opacus_hooks", "opacus_ghost")
LR, WEIGHT_DECAY = 1e-4, 0.01
# l2 relative difference of the clipped sums accepted by the same-batch check, by the dtype of the base weights.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
PHASE_LABELS = ("opake::dp_sgd_step", "opake::clipped_grad", "opake::gaussian_noise", "opake::optim.")


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


def opacus_available() -> bool:
    return importlib.util.find_spec("opacus") is not None


# -- timing and memory --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tf32(enabled: bool):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# -- modes: each returns a zero-argument step closure over a freshly built model -------------------------------------


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _nonprivate(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    model = build_model(workload, settings.device)
    opt = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    return step


def _opacus_hooks(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = build_model(workload, settings.device)
    size = batch["input_ids"].shape[0]
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)
    opt = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)
    dpo = DPOptimizer(
        opt, noise_multiplier=settings.noise_multiplier, max_grad_norm=settings.clipping_norm, expected_batch_size=size
    )

    def step() -> None:
        dpo.zero_grad(set_to_none=True)
        per_example_losses(gsm, batch, workload.task).mean().backward()
        dpo.step()

    return step


def _opacus_ghost(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = build_model(workload, settings.device)
    size, bound = batch["input_ids"].shape[0], settings.clipping_norm
    gsm = GradSampleModuleFastGradientClipping(
        model, batch_first=True, loss_reduction="mean", strict=False, max_grad_norm=bound, use_ghost_clipping=True
    )
    opt = torch.optim.AdamW(_trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)
    dpo = DPOptimizerFastGradientClipping(
        opt,
        noise_multiplier=settings.noise_multiplier,
        max_grad_norm=bound,
        expected_batch_size=size,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(gsm, dpo, torch.nn.CrossEntropyLoss(reduction="mean"), "mean")
    labels = batch["labels"]

    def step() -> None:
        dpo.zero_grad(set_to_none=True)
        logits = gsm(**model_inputs(batch)).logits
        if workload.task == "causal_lm":
            shifted = logits[:, :-1].float().contiguous()
            flat = shifted.reshape(-1, shifted.shape[-1])
            loss = criterion(flat, labels[:, 1:].reshape(-1), shape=shifted.shape[:2])
        else:
            loss = criterion(logits.float(), labels)
        loss.backward()
        dpo.step()

    return step


def _core_parts(workload: Workload, settings: Settings) -> tuple[torch.nn.Module, Any, dict, dict, Callable]:
    from opake_torch.functional import functional_model
    from opake_torch.patches import apply_compat_patches
    from opake_torch.transformers.loss import per_example_loss

    apply_compat_patches()
    model = build_model(workload, settings.device)
    apply, params, frozen = functional_model(model)

    def loss_fn(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
        return per_example_loss(apply, params, frozen, example, task=workload.task)

    return model, apply, params, frozen, loss_fn


class _CoreStep:
    """``opake_core.step.dp_sgd`` on a fixed batch; holds the running params and states."""

    def __init__(self, workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> None:
        from opake_core import random
        from opake_core.optim import adamw
        from opake_core.step import dp_sgd

        self.model, _, self.params, _, self.loss_fn = _core_parts(workload, settings)
        size = batch["input_ids"].shape[0]
        self.microbatch = settings.microbatch_for(size)
        optimizer = adamw(LR, weight_decay=WEIGHT_DECAY)
        self.step_fn, self.dp_state = dp_sgd(
            self.loss_fn,
            optimizer=optimizer,
            clipping_norm=settings.clipping_norm,
            noise_multiplier=settings.noise_multiplier,
            expected_batch_size=float(size),
            microbatch_size=self.microbatch,
        )
        self.opt_state = optimizer.init(self.params)
        self.key = random.key(0)
        self.batch = batch

    def __call__(self) -> None:
        self.params, self.opt_state, self.dp_state, _ = self.step_fn(
            self.params, self.opt_state, self.dp_state, (self.batch,), self.key
        )


def _opake_core(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    return _CoreStep(workload, batch, settings)


def _opake_trainer(
    workload: Workload,
    batch: dict[str, torch.Tensor],
    settings: Settings,
    *,
    kernels: bool = False,
    graphs: bool = False,
) -> dict[str, Any]:
    """Run ``DPTrainer.train()`` for warmup + steps steps; returns the step times and peak memory."""
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer, TrainingArguments

    device = settings.device
    size = batch["input_ids"].shape[0]
    rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(size)]
    times: list[float] = []

    class StepTimer(TrainerCallback):
        begin = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync(device)
            if state.global_step == settings.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync(device)
            if state.global_step > settings.warmup:
                times.append(time.perf_counter() - self.begin)

    total = settings.warmup + settings.steps
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=size,
            microbatch_size=settings.microbatch_for(size),
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            optim="adamw",
            lr_scheduler="constant",
            max_steps=total,
            privacy_noise_multiplier=settings.noise_multiplier,
            clipping_norm=settings.clipping_norm,
            sampling_mode="poisson",
            logging_steps=total,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=device.type == "cpu",
            seed=0,
            use_performance_kernels=kernels,
            cuda_graphs=1 if graphs else 0,
        )
        with rope_restored():  # the kernels' RoPE patch is process-wide: later modes and workloads run without it
            trainer = DPTrainer(build_model(workload, device), args, train_dataset=rows, callbacks=[StepTimer()])
            trainer.train()
    engine = "layerwise" if trainer._layerwise is not None else "vmap"
    return {
        "times": times,
        "peak_gib": peak_gib(device),
        "reserved_gib": reserved_gib(device),
        "per_example_gradients": engine,
    }


BUILDERS: dict[str, Callable[..., Any]] = {
    "nonprivate": _nonprivate,
    "opacus_hooks": _opacus_hooks,
    "opacus_ghost": _opacus_ghost,
    "opake_core": _opake_core,
}


def _measure(
    mode: str, workload: Workload, size: int, settings: Settings, warmup: int, steps: int, *, profile: bool = False
) -> dict[str, Any]:
    """Times and peak memory of one mode at batch ``size`` (raises on failure, OOM included).

    With ``profile`` (opake_core only), the phase breakdown of the same warmed-up step follows the timed steps.
    """
    batch = make_batch(workload, size, settings.device)
    if mode.startswith("opake_trainer"):
        short = Settings(**{**settings.__dict__, "warmup": warmup, "steps": steps})
        kernels, graphs = mode == "opake_trainer_kernels", mode == "opake_trainer_graphs"
        return _opake_trainer(workload, batch, short, kernels=kernels, graphs=graphs)
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
        with _tf32(settings.tf32):
            out = _measure(mode, workload, workload.batch, settings, settings.warmup, settings.steps, profile=profile)
    except Exception as exc:  # a failing mode is a result, not the end of the run
        record["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:400]}"
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
        record.update(_max_batch(mode, workload, settings))
    record["wall_s"] = round(time.perf_counter() - begin, 2)
    return record


def _max_batch(mode: str, workload: Workload, settings: Settings) -> dict[str, Any]:
    """Double the batch from the workload's until the first OOM, the cap or the time budget, whichever is first."""
    if mode.startswith("opake_trainer"):
        return {"max_batch": None, "max_batch_note": "not searched: same step as opake_core"}
    begin, fits, size = time.perf_counter(), workload.batch, workload.batch * 2
    note = f"cap {settings.max_batch_cap} reached"
    while size <= settings.max_batch_cap:
        if time.perf_counter() - begin > settings.max_batch_budget_s:
            note = f"time budget {settings.max_batch_budget_s:g} s spent; at least this much fits"
            break
        try:
            with _tf32(settings.tf32):
                _measure(mode, workload, size, settings, warmup=1, steps=1)
        except Exception as exc:
            note = f"OOM at {size}" if is_oom(exc) else f"{type(exc).__name__} at {size}: {str(exc)[:200]}"
            break
        finally:
            free(settings.device)
        fits, size = size, size * 2
    return {"max_batch": fits, "max_batch_note": note}


# -- same-batch check of the clipped sum -----------------------------------------------------------------------------


def _ours_clipped_sum(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> dict[str, Any]:
    from opake_core.clipping import clipped_grad

    model, _, params, _, loss_fn = _core_parts(workload, settings)
    _dropout_off_hooks_on(model)
    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=settings.clipping_norm,
        normalize_by=1.0,
        microbatch_size=settings.microbatch_for(batch["input_ids"].shape[0]),
    )
    clipped, _ = grad_fn(params, batch, state=state)
    return {"model": model, "sums": {k: v.detach() for k, v in clipped.value.items()}}


def _dropout_off_hooks_on(model: torch.nn.Module) -> None:
    """Deterministic forward for the same-batch check that Opacus can still hook.

    Opacus records activations only for modules in training mode, while any module in training mode may apply
    dropout (``nn.Dropout`` or an attention module's own dropout probability). So: everything in eval mode except
    the modules that own trainable parameters directly (linear, embedding, norm layers), which apply no dropout.
    """
    model.eval()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


def _opacus_clipped_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], workload: Workload, bound: float):
    """Opacus hooks, noise multiplier 0, loss reduction "sum": ``p.grad`` after ``pre_step`` is the clipped sum."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
    params = _trainable(model)
    dpo = DPOptimizer(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=bound,
        expected_batch_size=batch["input_ids"].shape[0],
        loss_reduction="sum",
    )
    dpo.zero_grad(set_to_none=True)
    per_example_losses(gsm, batch, workload.task).sum().backward()
    dpo.pre_step()
    sums = {names[id(p)]: p.grad.detach().clone() for p in params}
    if hasattr(gsm, "_close"):
        gsm._close()
    return sums


def _float64_clipped_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], workload: Workload, bound: float):
    """A per-example autograd loop on a float64 copy of the model: the exact clipped sum."""
    ref = copy.deepcopy(model).double().eval()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in named}
    for i in range(batch["input_ids"].shape[0]):
        example = {k: v[i : i + 1] for k, v in batch.items()}
        loss = per_example_losses(ref, example, workload.task)[0]
        grads = torch.autograd.grad(loss, [p for _, p in named])
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        scale = torch.clamp(bound / norm, max=1.0)
        for (n, _), g in zip(named, grads, strict=True):
            sums[n] += scale * g
    return sums


def _compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    missing = sorted(set(ref) ^ set(ours))
    names = sorted(set(ref) & set(ours))
    diff_sq = ref_sq = 0.0
    max_abs = max_ref = 0.0
    for n in names:
        a, b = ours[n].double(), ref[n].double().to(ours[n].device)
        d = a - b
        diff_sq += d.square().sum().item()
        ref_sq += b.square().sum().item()
        max_abs = max(max_abs, d.abs().max().item())
        max_ref = max(max_ref, b.abs().max().item())
    return {
        "leaves_compared": len(names),
        "leaves_unmatched": missing[:10],
        "max_abs_diff": max_abs,
        "max_rel_diff": max_abs / max_ref if max_ref > 0 else math.inf,
        "l2_rel_diff": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.inf,
    }


def check_clipped_sum(workload: Workload, settings: Settings, *, reference: str) -> dict[str, Any]:
    """Our clipped sum against ``reference`` ("opacus_hooks" or "float64_loop") on the workload's batch, noise off."""
    result: dict[str, Any] = {"workload": workload.name, "reference": reference, "ok": False}
    if reference == "opacus_hooks" and not opacus_available():
        return {**result, "skipped": True, "error": "opacus not installed"}
    free(settings.device)
    try:
        with _tf32(False):
            batch = make_batch(workload, workload.batch, settings.device)
            ours = _ours_clipped_sum(workload, batch, settings)
            model = ours.pop("model")
            if reference == "opacus_hooks":
                ref = _opacus_clipped_sum(model, batch, workload, settings.clipping_norm)
            else:
                ref = _float64_clipped_sum(model, batch, workload, settings.clipping_norm)
            stats = _compare(ours["sums"], ref)
        tolerance = TOLERANCE.get(workload.dtype, 1e-4)
        passed = stats["l2_rel_diff"] <= tolerance and not stats["leaves_unmatched"]
        result.update(stats, tolerance_l2_rel=tolerance, ok=passed)
    except Exception as exc:
        result["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:400]}"
    free(settings.device)
    return result


# -- phase breakdown of the core step -------------------------------------------------------------------------------


def _phase_times(prof: Any, steps: int) -> dict[str, dict[str, float]]:
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


def profile_core(step: _CoreStep, batch: dict[str, torch.Tensor], settings: Settings) -> dict[str, Any]:
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
        result["phases"] = _phase_times(prof, settings.profile_steps)
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
        result["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:400]}"
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


# -- outputs ---------------------------------------------------------------------------------------------------------


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(settings: Settings, argv: list[str]) -> dict[str, Any]:
    device = settings.device
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python benchmarks/harness.py " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "transformers", "peft", "opacus", "opake")},
        "git_commit": _git_commit(),
        "settings": {k: str(v) for k, v in settings.__dict__.items()},
    }


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Each record's step time, memory and throughput relative to its workload's non-private record."""
    base = {r["workload"]: r for r in records if r["mode"] == "nonprivate" and r["ok"]}
    for r in records:
        b = base.get(r["workload"])
        ok = r["ok"] and b is not None
        r["time_vs_nonprivate"] = r["step_s_median"] / b["step_s_median"] if ok else None
        r["throughput_vs_nonprivate"] = b["step_s_median"] / r["step_s_median"] if ok else None
        peak, base_peak = r.get("peak_mem_gib"), (b or {}).get("peak_mem_gib")
        r["mem_vs_nonprivate"] = peak / base_peak if ok and peak and base_peak else None


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    lines = [
        f"# Opake benchmark ({meta['date_utc']})",
        "",
        f"Device: {meta['device']}; CUDA {meta['cuda']}; {versions}; commit {meta['git_commit']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| workload | mode | batch x seq | step s (median) | examples/s | tokens/s | peak GiB | peak reserved GiB "
        "| max batch | time vs non-private | memory vs non-private | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        status = "ok" if r["ok"] else ("skipped: " if r.get("skipped") else "failed: ") + r.get("error", "")[:80]
        if r["ok"] and "per_example_gradients" in r:
            status += f" ({r['per_example_gradients']})"
        cells = [
            r["workload"],
            r["mode"] + (f" (microbatch {r['microbatch']})" if r.get("microbatch") else ""),
            f"{r['batch']} x {r['seq']}",
            fmt(r.get("step_s_median"), ".4f"),
            fmt(r.get("examples_per_s"), ".1f"),
            fmt(r.get("tokens_per_s"), ".0f"),
            fmt(r.get("peak_mem_gib"), ".2f"),
            fmt(r.get("peak_reserved_gib"), ".2f"),
            fmt(r.get("max_batch"), "d"),
            fmt(r.get("time_vs_nonprivate"), ".2f"),
            fmt(r.get("mem_vs_nonprivate"), ".2f"),
            status.replace("|", "/"),
        ]
        lines.append(table_row(cells))
    lines += [
        "",
        "## Same-batch clipped sum (noise off)",
        "",
        "| workload | reference | l2 relative diff | max relative diff | max abs diff | tolerance | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["checks"]:
        result = "pass" if c["ok"] else ("skipped: " if c.get("skipped") else "FAIL ") + c.get("error", "")[:80]
        cells = [
            c["workload"],
            c["reference"],
            fmt(c.get("l2_rel_diff"), ".2e"),
            fmt(c.get("max_rel_diff"), ".2e"),
            fmt(c.get("max_abs_diff"), ".2e"),
            fmt(c.get("tolerance_l2_rel"), ".0e"),
            result.replace("|", "/"),
        ]
        lines.append(table_row(cells))
    if report["phases"]:
        lines += [
            "",
            "## Phase breakdown of the opake_core step (ms per step)",
            "",
            "| workload | phase | host ms | GPU span ms | kernel ms |",
            "|---|---|---|---|---|",
        ]
        for p in report["phases"]:
            if not p["ok"]:
                lines.append(f"| {p['workload']} | failed: {p.get('error', '')[:80]} | | | |")
                continue
            for name, row in sorted(p["phases"].items()):
                cells = [p["workload"], name, f"{row['host_ms']:.2f}", f"{row['gpu_span_ms']:.2f}"]
                lines.append(table_row([*cells, f"{row['kernel_ms']:.2f}"]))
            extra = [
                ("step, unprofiled (median)", p["step_ms_unprofiled"]),
                ("per-example grads only (vmap grad, plain sum)", p["per_example_grads_ms"]),
            ]
            lines += [f"| {p['workload']} | {name} | {value:.2f} | | |" for name, value in extra]
        lines += [
            "",
            f"Accounting: one epsilon query (PLD, 1000 Poisson steps, host) takes {report['accounting_query_ms']:.1f} "
            "ms; DPTrainer asks it at logging and checkpoint steps only."
            if report.get("accounting_query_ms") is not None
            else "Accounting: not measured yet (the query runs after the last workload).",
        ]
    return "\n".join(lines) + "\n"


# -- command line ----------------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--workloads", help="comma-separated subset of the suite's workload names")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--steps", type=int, help="timed steps per mode (default 10 gpu, 3 smoke)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per mode (default 3 gpu, 1 smoke)")
    parser.add_argument("--device", help="default: cuda for the gpu suite, cpu for smoke")
    parser.add_argument("--microbatch", type=int, help="vmap chunk of the opake modes (default: the full batch)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clipping-norm", type=float, default=1.0)
    parser.add_argument("--no-tf32", action="store_true", help="fp32 matmuls without TF32 (TF32 is on by default)")
    parser.add_argument("--no-check", action="store_true", help="skip the same-batch clipped-sum check")
    parser.add_argument("--profile", action="store_true", help="phase breakdown of the opake_core step")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--find-max-batch", action="store_true", help="double the batch until OOM, per mode")
    parser.add_argument("--max-batch-cap", type=int, default=1024)
    parser.add_argument("--max-batch-budget-s", type=float, default=60.0, help="time budget per mode and workload")
    return parser.parse_args(argv)


def write_results(report: dict[str, Any], out: Path) -> None:
    """Write ``results.json`` and ``results.md`` (called after every record, so a killed run keeps what finished)."""
    add_ratios(report["records"])
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "results.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    smoke = a.suite == "smoke"
    device = torch.device(a.device or ("cpu" if smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the gpu suite needs CUDA; run --suite smoke (or pass --device cpu) on a machine without it.")
    settings = Settings(
        device=device,
        steps=a.steps or (3 if smoke else 10),
        warmup=a.warmup if a.warmup is not None else (1 if smoke else 3),
        noise_multiplier=a.noise_multiplier,
        clipping_norm=a.clipping_norm,
        microbatch=a.microbatch,
        tf32=not a.no_tf32,
        profile_steps=a.profile_steps,
        max_batch_cap=a.max_batch_cap,
        max_batch_budget_s=a.max_batch_budget_s,
    )
    workloads = SUITES[a.suite]
    if a.workloads:
        wanted = a.workloads.split(",")
        unknown = sorted(set(wanted) - {w.name for w in workloads})
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; the {a.suite} suite has {[w.name for w in workloads]}.")
        workloads = tuple(w for w in workloads if w.name in wanted)
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {MODES}.")
    reference = "opacus_hooks" if opacus_available() or not smoke else "float64_loop"
    report: dict[str, Any] = {"meta": environment(settings, argv), "records": [], "checks": [], "phases": []}
    report["accounting_query_ms"] = None
    a.out.mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        for mode in modes:
            record = run_mode(mode, workload, settings, find_max_batch=a.find_max_batch, profile=a.profile)
            phases = record.pop("phase_breakdown", None)
            if phases is not None:
                report["phases"].append(phases)
            report["records"].append(record)
            print(json.dumps(record), flush=True)
            write_results(report, a.out)
        if not a.no_check:
            check = check_clipped_sum(workload, settings, reference=reference)
            report["checks"].append(check)
            print(json.dumps(check), flush=True)
            for r in report["records"]:
                if r["workload"] == workload.name and r["mode"] == "opake_core":
                    r[f"clipped_sum_max_rel_diff_vs_{reference}"] = check.get("max_rel_diff")
            write_results(report, a.out)
    if a.profile:
        report["accounting_query_ms"] = accounting_query_ms()
    write_results(report, a.out)
    print(markdown(report))
    failed_checks = [c for c in report["checks"] if not c["ok"] and not c.get("skipped")]
    return 1 if failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
