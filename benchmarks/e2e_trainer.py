"""``trainer.train()`` as a user runs it: Hugging Face's ``Trainer`` against ``DPTrainer``, end to end.

Each row is one ``train()`` call (or, for Opacus, the loop its tutorials show) on the same model, the same dataset and
AdamW at the same learning rate. The private rows sample Poisson batches at rate q = 0.01 from a dataset of
100 x the batch (about 100 expected batches), so sampling, collation and the host-to-device copy are part of each
step, as in a real run. The arguments are the trainers' defaults except what the comparison needs:
``per_device_train_batch_size`` (the expected batch of DPTrainer), ``learning_rate``, ``max_steps`` and, for
DPTrainer, ``privacy_noise_multiplier=1.0`` (fixed noise; the default clipping norm 1, Poisson sampling, no
accounting during the run).

Modes (per workload):

* ``hf``: ``transformers.Trainer`` with its own defaults (fused AdamW, shuffled fixed batches); the reference.
* ``dp``: ``DPTrainer`` with its defaults (engine picked by ``per_example_gradients="auto"``).
* ``dp_q1``: diagnostic. The dataset is one batch and q = 1, so every draw is that full batch: the cost of a DP
  step without the variable batch sizes of Poisson sampling. Not a configuration anyone trains with.
* ``dp_graphs``: ``DPTrainer`` with ``cuda_graphs=1`` (one knob set): each chunk, padded to the microbatch size,
  captured once and replayed. ``dp_graphs4``: ``cuda_graphs=4``, chunks rounded up to the next quarter of the
  microbatch, four captures.
* ``dp_fixed``: ``DPTrainer`` with ``sampling_mode="fixed_size"`` (one knob set): every step draws exactly the batch
  size without replacement, one shape and one chunk per step. A different guarantee (replace-one adjacency, a
  looser accountant: docs/accounting.md), so it is compared for speed only.
* ``dp_rows4``, ``dp_expandable``: diagnostics of ``dp`` with each chunk's rows rounded up to a multiple of 4 (dead
  rows; ``per_example_row_multiple=4``), or with the CUDA allocator's expandable segments.
* ``dp_instantiate``: diagnostic of ``dp`` with ``layerwise_ghost_advantage=1.5``: the layerwise
  engine instantiates the weights whose Gram factors hold more than two thirds of their per-example gradients
  (faster, more memory) instead of taking their ghost norms.
* ``dp_compile``: ``DPTrainer`` with ``torch_compile=True`` (one knob set): each chunk (forward, per-example norms,
  clipped sum) compiled by inductor, one graph for every chunk (the rows and positions are symbolic; a chunk of one
  row runs with a dead row). The row records the graphs compiled, the graph breaks and whether the
  compilation fell back to eager; ``first_steps_s`` includes the compile time. ``dp_compile_graphs``: the same with
  ``torch_compile_mode="reduce-overhead"`` (inductor replays each chunk as CUDA graphs, one recording per row count)
  and each chunk's rows rounded up to a quarter of the batch (``per_example_row_multiple``: dead rows), so that the
  draws meet four row counts, as in ``dp_graphs4``.
* ``dp_kernels``: ``DPTrainer`` with ``use_performance_kernels=True``; its ratios are against ``hf_kernels``.
* ``dp_user4``: ``DPTrainer`` with ``privacy_unit="user"``: the rows grouped into users of 4 rows each, batch / 4
  users a step (the same rows a step on average as ``dp``, each user one example of 4 rows: the layerwise engine's
  ghost norms over a user's 4 T positions). A different guarantee (one user), compared for speed.
* ``hf_kernels``: ``transformers.Trainer`` on a model patched by ``apply_performance_kernels`` with the switches
  DPTrainer uses under ``per_example_gradients="auto"`` (the LoRA kernel off), so that both kernel rows run the same
  patched modules. The loss-level kernels are taken only by DPTrainer's loss; HF keeps the model's loss. Its ratios
  are against ``hf``.
* ``hf_bf16_experts``: diagnostic of ``hf`` with an autocast rule for ``torch._grouped_mm``, which has none (torch
  2.11 to 2.13): under ``bf16`` Hugging Face's stacked experts then multiply bf16 factors, as ``F.linear`` does and as
  ``DPTrainer``'s experts forward does, where ``hf`` multiplies them in float32. The like-with-like baseline of a
  mixture-of-experts ``dp`` row (compare their times by hand; the row's own ratios are against ``hf``).
* ``opacus``: Opacus ``PrivacyEngine.make_private`` (per-sample hooks, its Poisson data loader at the same q, noise
  multiplier 1, max grad norm 1) and the plain ``zero_grad / model(**batch).loss.backward() / step`` loop; explicit
  per-example ``position_ids``, and an empty draw (which HF models cannot run) gets zero-length per-sample gradients,
  a noise-only step. Skipped when opacus cannot be imported.

Measured: the wall time between consecutive step ends (a ``TrainerCallback.on_step_end`` that synchronizes CUDA first)
after ``--warmup`` steps, its mean and median over ``--steps`` steps; the peaks of ``torch.cuda.max_memory_allocated``
and ``max_memory_reserved`` over those steps (reset at the end of the warm-up, so weights and optimizer state are
included). Each (workload, mode) runs in a fresh subprocess (``--in-process`` runs them one after the other here:
quicker on CPU, but process-wide state carries over). A failing row, OOM included, is recorded with its error; rows
not started when ``--budget-s`` is spent are recorded as skipped.

    python benchmarks/e2e_trainer.py --out e2e_results                  # one GPU, the four workloads, every mode
    python benchmarks/e2e_trainer.py --workloads bert_base_s128_b32 --modes hf dp --out e2e_bert
    python benchmarks/e2e_trainer.py --tiny --in-process --out e2e_tiny   # tiny CPU configuration (smoke)
    python benchmarks/e2e_trainer.py --workloads llama8b_lora16_s4096_b8_ckpt --modes hf dp --out e2e_8b

The models at scale (``workloads.SCALE``: an 8B-shaped Llama with LoRA, a 1.1B full fine-tune) run only when named;
their ``trainer_args`` (gradient checkpointing, bf16) go to both trainers. So do the CPU stand-ins
(``workloads.HOST``), which keep a GPU workload's depth or its ratio of tokens to width (which weights take ghost
norms) at a size where a CPU step is bound by host work, as BERT-base's step is on the GPU:
``--device cpu --workloads host_bert12_w48_s8_b32 --modes hf dp dp_fixed``. ``--seq`` runs the named workloads at
another sequence length (``max_sequence.py`` searches the longest that fits with it).

``--kernel-owners PATTERN ...`` (a diagnostic, with ``--profile-steps``) records in each row's profile who launched
the GPU kernels whose names contain a pattern: the operator, its input shapes and the Opake frames on its stack
(``--kernel-owners simt_sgemm`` finds the float32 SIMT matmuls of a step).

Writes ``results.json`` and ``results.md`` to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from environment import environment
from modes import LR, opacus_available, trainable
from settings import Settings
from timing import failure, fmt, free, peak_gib, reserved_gib, sync, table, tf32
from workloads import HOST, SCALE, SUITES, Workload, build_model, make_batch

MODES = (
    "hf",
    "dp",
    "dp_q1",
    "dp_graphs",
    "dp_graphs4",
    "dp_fixed",
    "dp_rows4",
    "dp_expandable",
    "dp_instantiate",
    "dp_compile",
    "dp_compile_graphs",
    "dp_kernels",
    "dp_user4",
    "hf_kernels",
    "hf_bf16_experts",
    "opacus",
)
BASELINES = {"dp_kernels": "hf_kernels"}  # every other mode is compared with "hf"
DIAGNOSTIC = ("dp_q1", "dp_rows4", "dp_expandable", "dp_instantiate", "hf_bf16_experts")
SAMPLING_RATE = 0.01
NOISE_MULTIPLIER = 1.0
USER_ROWS = 4  # rows of each user in the dp_user4 rows
CLIPPING_NORM = 1.0  # DPTrainer's default; Opacus gets the same bound
EAGER_FAMILIES = ("gpt2",)  # run with eager attention (the workload builder picks SDPA)
# DPTrainer turns the LoRA kernel off unless per_example_gradients="vmap" (the layerwise engine reads the adapter
# layers); hf_kernels patches with the same switches so that the two kernel rows run the same modules.
HF_KERNELS_CONFIG = {"lora": False}


# -- the measured run of one (workload, mode) --------------------------------------------------------------------


class StepClock:
    """Host timestamps of step ends (after a device synchronize) and the memory peaks over the timed steps; then, with
    ``profile`` steps, a profile of that many more steps (:func:`step_profile`). Each step end is printed to stderr
    with the seconds since the clock was made, so that the log of a row cut off by its timeout says how far it got
    (a compiled row's first step holds its compilation)."""

    def __init__(
        self, device: torch.device, warmup: int, total: int, profile: int = 0, owners: tuple[str, ...] = ()
    ) -> None:
        self.device, self.warmup, self.total, self.profile, self.owners = device, warmup, total, profile, owners
        self.stamps: list[float] = []
        self.peak: float | None = None
        self.reserved: float | None = None
        self.profiler: Any = None
        self.profiled: dict[str, Any] | None = None
        self.start = time.perf_counter()

    @property
    def max_steps(self) -> int:
        """The steps the run makes: the warm-up, the timed steps and the profiled ones."""
        return self.total + self.profile

    def tick(self) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        print(f"step {len(self.stamps)} of {self.max_steps} ended at {self.stamps[-1] - self.start:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        if len(self.stamps) == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if len(self.stamps) == self.total:
            self.peak, self.reserved = peak_gib(self.device), reserved_gib(self.device)
            if self.profile:
                self.profiler = profiler(self.device, stacks=bool(self.owners))
                self.profiler.__enter__()
        if self.profiler is not None and len(self.stamps) == self.max_steps:
            self.profiler.__exit__(None, None, None)
            self.profiled = step_profile(self.profiler, self.profile)
            if self.owners:
                self.profiled["kernel_owners"] = kernel_owners(self.profiler, self.owners, self.profile)
            self.profiler = None

    def callback(self) -> Any:
        """A ``TrainerCallback`` that ticks at every step end (both trainers accept it)."""
        from transformers import TrainerCallback

        clock = self

        class StepEnds(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                clock.tick()

        return StepEnds()

    def summary(self) -> dict[str, Any]:
        if len(self.stamps) < self.max_steps:
            raise RuntimeError(f"only {len(self.stamps)} of {self.max_steps} steps ran")
        gaps = [end - start for start, end in itertools.pairwise(self.stamps[self.warmup - 1 : self.total])]
        ordered = sorted(gaps)
        return {
            "steps_timed": len(gaps),
            "step_s_mean": statistics.fmean(gaps),
            "step_s_median": statistics.median(gaps),
            "step_s_p90": ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)],
            "peak_gib": self.peak,
            "reserved_gib": self.reserved,
            **({"profile": self.profiled} if self.profile else {}),
        }


def profiler(device: torch.device, *, stacks: bool = False) -> Any:
    """A profiler of the host and, on CUDA, the device; ``stacks``: with the Python frames and input shapes of each
    operator (:func:`kernel_owners`), which slow the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, with_stack=stacks, record_shapes=stacks)


def kernel_owners(prof: Any, patterns: tuple[str, ...], steps: int, top: int = 12) -> list[dict[str, Any]]:
    """Who launched the GPU kernels whose names contain one of ``patterns`` (on a CPU: the operators so named), per
    profiled step: the top-level operator, the launching operator's input shapes, and the innermost Opake,
    Transformers or checkpoint frames on its Python stack (a profiler with ``stacks``), most frequent first."""
    found: dict[tuple[str, ...], float] = {}

    def frames(event: Any) -> str:
        names, parent = [], event.cpu_parent
        while parent is not None and len(names) < 5:
            if "opake_" in parent.name:
                names.append(parent.name[parent.name.index("opake_") :])
            elif "transformers/" in parent.name or "checkpoint" in parent.name:
                names.append(parent.name.rsplit("site-packages/", 1)[-1])
            parent = parent.cpu_parent
        return " < ".join(names)

    def add(name: str, event: Any) -> None:
        outer = event
        while outer.cpu_parent is not None and outer.cpu_parent.name.startswith("aten::"):
            outer = outer.cpu_parent
        key = (name[:80], outer.name, str(getattr(event, "input_shapes", ""))[:200], frames(event))
        found[key] = found.get(key, 0.0) + 1 / steps

    for event in prof.events():
        for kernel in getattr(event, "kernels", None) or []:
            if any(pattern in kernel.name for pattern in patterns):
                add(kernel.name, event)
        on_host = str(getattr(event, "device_type", "")).endswith("CPU")
        if on_host and any(pattern == event.name for pattern in patterns):
            add(event.name, event)
    rows = sorted(found.items(), key=lambda kv: -kv[1])[:top]
    return [{"kernel": k, "operator": op, "shapes": shapes, "frames": where, "calls": round(n, 1)}
            for (k, op, shapes, where), n in rows]  # fmt: skip


def step_profile(prof: Any, steps: int, top: int = 15) -> dict[str, Any]:
    """Where one step's time goes, averaged over ``steps`` profiled steps: the operators the host dispatched (top-level
    ``aten::`` calls), the GPU kernels launched and their summed time, the host time of each ``opake::`` range, and
    the operators with the most host time of their own, and the GPU kernels with the most time (names cut to 90
    characters)."""
    events = prof.events()
    ops = [
        e
        for e in events
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    kernels = [
        e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA") and not e.name.startswith("opake::")
    ]
    ranges: dict[str, float] = {}
    for e in events:
        if e.name.startswith("opake::") and str(getattr(e, "device_type", "")).endswith("CPU"):
            ranges[e.name] = ranges.get(e.name, 0.0) + e.cpu_time_total / 1e3 / steps
    by_op: dict[str, list[float]] = {}
    for e in events:
        if e.name.startswith("aten::"):
            row = by_op.setdefault(e.name, [0.0, 0.0])
            row[0] += e.self_cpu_time_total / 1e3 / steps
            row[1] += 1 / steps
    heaviest = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        row = by_kernel.setdefault(e.name[:90], [0.0, 0.0])
        row[0] += getattr(e, "device_time_total", 0.0) / 1e3 / steps
        row[1] += 1 / steps
    longest = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "steps": steps,
        "host_ops_per_step": len(ops) / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(getattr(e, "device_time_total", 0.0) for e in kernels) / 1e3 / steps,
        "opake_ranges_host_ms": {k: round(v, 3) for k, v in sorted(ranges.items())},
        "top_host_ops_ms": {name: {"self_ms": round(ms, 3), "calls": round(n, 1)} for name, (ms, n) in heaviest},
        "top_kernels_ms": {name: {"ms": round(ms, 3), "calls": round(n, 1)} for name, (ms, n) in longest},
    }


def model_for(workload: Workload, device: torch.device) -> torch.nn.Module:
    """The workload's model (random weights, seed 0), with eager attention for the families that ask for it."""
    model = build_model(workload, device)
    if workload.family in EAGER_FAMILIES:
        model.set_attn_implementation("eager")
    return model


def dataset(workload: Workload, size: int) -> list[dict[str, torch.Tensor]]:
    """``size`` examples (the workload's synthetic tokens, with an all-ones attention mask), as a list of dicts."""
    columns = make_batch(workload, size, torch.device("cpu"))
    columns["attention_mask"] = torch.ones_like(columns["input_ids"])
    return [{name: values[i] for name, values in columns.items()} for i in range(size)]


def dataset_size(workload: Workload, mode: str) -> int:
    return workload.batch if mode == "dp_q1" else round(workload.batch / SAMPLING_RATE)


def autocast_grouped_mm(device_type: str) -> Any:
    """Register an autocast rule for ``aten::_grouped_mm`` on ``device_type`` for this process (each row runs in its
    own): under autocast its floating-point arguments are cast to the autocast dtype, as ``F.linear``'s are. Returns
    the library that holds the rule (the rule lives as long as it)."""
    from torch.utils._pytree import tree_map

    key = {"cuda": torch._C.DispatchKey.AutocastCUDA, "cpu": torch._C.DispatchKey.AutocastCPU}[device_type]
    op = torch.ops.aten._grouped_mm.default

    def cast(x: Any) -> Any:
        floating = isinstance(x, torch.Tensor) and x.is_floating_point()
        return x.to(torch.get_autocast_dtype(device_type)) if floating else x

    def rule(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    library = torch.library.Library("aten", "IMPL")
    library.impl("_grouped_mm", rule, key.name)
    return library


def run_hf(
    workload: Workload, opts: argparse.Namespace, clock: StepClock, *, kernels: bool, bf16_experts: bool = False
) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from opake_torch.patches import apply_runtime_patches
    from opake_torch.patches.performance import apply_performance_kernels, runtime_patches

    rule = autocast_grouped_mm(opts.device.type) if bf16_experts else None  # noqa: F841 (held for the run)
    model = model_for(workload, opts.device)
    applied = None
    if kernels:
        applied = apply_performance_kernels(
            model, use_performance_kernels=True, performance_kernels_config=HF_KERNELS_CONFIG
        )
    data = dataset(workload, dataset_size(workload, "hf"))
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            folder,
            per_device_train_batch_size=workload.batch,
            learning_rate=LR,
            max_steps=clock.max_steps,
            use_cpu=opts.device.type == "cpu",
            **workload.trainer_args,
        )
        if args.n_gpu > 1:  # HF's Trainer would wrap the model in DataParallel over every visible GPU
            raise RuntimeError(f"{args.n_gpu} GPUs are visible; set CUDA_VISIBLE_DEVICES to one GPU")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock.callback()])
        with apply_runtime_patches(runtime_patches(applied or [])):  # the RoPE kernel, as DPTrainer applies it
            trainer.train()
    return {"engine": "autograd", "optim": getattr(args.optim, "value", args.optim), "kernels_applied": applied}


def run_dp(workload: Workload, opts: argparse.Namespace, clock: StepClock, *, mode: str) -> dict[str, Any]:
    from opake_torch.transformers import DPTrainer, TrainingArguments

    if mode == "dp_expandable" and opts.device.type == "cuda":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    quarter = max(1, workload.batch // 4)
    extra = {
        "dp_kernels": {"use_performance_kernels": True},
        "dp_graphs": {"cuda_graphs": 1},
        "dp_graphs4": {"cuda_graphs": 4},
        "dp_fixed": {"sampling_mode": "fixed_size"},
        "dp_compile": {"torch_compile": True},
        "dp_compile_graphs": {"torch_compile_mode": "reduce-overhead", "per_example_row_multiple": quarter},
        "dp_rows4": {"per_example_row_multiple": 4},
        "dp_instantiate": {"layerwise_ghost_advantage": 1.5},
    }.get(mode, {})
    from torch._dynamo.utils import counters

    counters.clear()  # --in-process: this row's compilations only
    if mode.startswith("dp_compile"):  # the log says when the compilation starts and how long it took
        compile_log = logging.getLogger("opake_torch.transformers.compile")
        compile_log.setLevel(logging.INFO)
        if not compile_log.handlers:  # --in-process: one handler for every row
            compile_log.addHandler(logging.StreamHandler(sys.stderr))
    data = dataset(workload, dataset_size(workload, mode))
    batch = workload.batch
    if mode == "dp_user4":  # user-level: users of 4 rows each, batch / 4 users a step (the same rows on average)
        data = [{**row, "user": i // USER_ROWS} for i, row in enumerate(data)]
        extra = {"privacy_unit": "user", "privacy_user_column": "user", "privacy_max_rows_per_user": USER_ROWS}
        batch = max(1, workload.batch // USER_ROWS)
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            folder,
            per_device_train_batch_size=batch,
            learning_rate=LR,
            max_steps=clock.max_steps,
            privacy_noise_multiplier=NOISE_MULTIPLIER,
            privacy_noise_seed=opts.privacy_seed,
            use_cpu=opts.device.type == "cpu",
            **workload.trainer_args,
            **extra,
        )
        trainer = DPTrainer(model_for(workload, opts.device), args, train_dataset=data, callbacks=[clock.callback()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    for warning in caught:  # shown as they would have been
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    compiled = {
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],  # a mode with CUDA graphs that ran without them
        "compile_fallback": [str(w.message)[:300] for w in caught if "running it eagerly" in str(w.message)],
    }
    return {
        **(compiled if mode.startswith("dp_compile") else {}),
        "engine": trainer.per_example_gradients_engine,
        "optim": args.optim,
        "sampling_mode": args.sampling_mode,
        "clipping_norm": args.clipping_norm,
        "microbatch_size": args.microbatch_size,
        "kernels_applied": trainer.performance_patches if mode == "dp_kernels" else None,
    }


def run_opacus(workload: Workload, opts: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    from opacus import PrivacyEngine

    if workload.trainer_args:
        raise ValueError(f"the Opacus loop has no counterpart of {sorted(workload.trainer_args)}: not compared")

    model = model_for(workload, opts.device)
    data = dataset(workload, dataset_size(workload, "opacus"))
    for example in data:  # a broadcast [1, T] position tensor breaks the hooks of a trained position embedding
        example.setdefault("position_ids", torch.arange(workload.seq))
    loader = torch.utils.data.DataLoader(data, batch_size=workload.batch)
    optimizer = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=0.0)  # the trainers' default weight decay
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=CLIPPING_NORM,
        poisson_sampling=True,
    )
    model.train()
    empty = 0
    while len(clock.stamps) < clock.max_steps:
        for batch in loader:
            batch = {k: v.to(opts.device, non_blocking=True) for k, v in batch.items()}
            optimizer.zero_grad()
            if batch["input_ids"].shape[0]:
                model(**batch).loss.backward()
            else:  # HF models cannot run an empty batch: zero-length per-sample gradients, so the step is noise only
                empty += 1
                for param in optimizer.params:
                    param.grad_sample = param.new_zeros((0, *param.shape))
            optimizer.step()
            clock.tick()
            if len(clock.stamps) == clock.max_steps:
                break
    return {"engine": "opacus hooks", "optim": "torch AdamW", "sampling_mode": "poisson", "empty_draws": empty}


RUNNERS: dict[str, Callable[[Workload, argparse.Namespace, StepClock], dict[str, Any]]] = {
    "hf": lambda w, o, c: run_hf(w, o, c, kernels=False),
    "hf_kernels": lambda w, o, c: run_hf(w, o, c, kernels=True),
    "hf_bf16_experts": lambda w, o, c: run_hf(w, o, c, kernels=False, bf16_experts=True),
    "dp": lambda w, o, c: run_dp(w, o, c, mode="dp"),
    "dp_q1": lambda w, o, c: run_dp(w, o, c, mode="dp_q1"),
    "dp_graphs": lambda w, o, c: run_dp(w, o, c, mode="dp_graphs"),
    "dp_graphs4": lambda w, o, c: run_dp(w, o, c, mode="dp_graphs4"),
    "dp_fixed": lambda w, o, c: run_dp(w, o, c, mode="dp_fixed"),
    "dp_rows4": lambda w, o, c: run_dp(w, o, c, mode="dp_rows4"),
    "dp_expandable": lambda w, o, c: run_dp(w, o, c, mode="dp_expandable"),
    "dp_instantiate": lambda w, o, c: run_dp(w, o, c, mode="dp_instantiate"),
    "dp_compile": lambda w, o, c: run_dp(w, o, c, mode="dp_compile"),
    "dp_compile_graphs": lambda w, o, c: run_dp(w, o, c, mode="dp_compile_graphs"),
    "dp_kernels": lambda w, o, c: run_dp(w, o, c, mode="dp_kernels"),
    "dp_user4": lambda w, o, c: run_dp(w, o, c, mode="dp_user4"),
    "opacus": run_opacus,
}


def record_for(workload: Workload, mode: str) -> dict[str, Any]:
    size = dataset_size(workload, mode)
    return {
        "workload": workload.name,
        "mode": mode,
        "diagnostic": mode in DIAGNOSTIC,
        "batch": workload.batch,
        "seq": workload.seq,
        "dtype": workload.dtype,
        "dataset_size": size,
        "sampling_rate": None if mode.startswith("hf") else workload.batch / size,
        "trainer_args": workload.trainer_args,
        "ok": False,
    }


def measure_row(workload: Workload, mode: str, opts: argparse.Namespace) -> dict[str, Any]:
    """One row, in this process: never raises (a failure, OOM included, is recorded in the row)."""
    record = record_for(workload, mode)
    if mode == "opacus" and not opacus_available():
        return {**record, "skipped": True, "error": "opacus is not importable"}
    free(opts.device)
    begin = time.perf_counter()
    clock = StepClock(opts.device, opts.warmup, opts.warmup + opts.steps, opts.profile_steps, opts.kernel_owners)
    try:
        with tf32(opts.tf32):
            record.update(RUNNERS[mode](workload, opts, clock))
        summary = clock.summary()
    except ImportError as exc:
        record.update(skipped=mode == "opacus", error=failure(exc))
    except Exception as exc:  # a failing row is a result, not the end of the run
        record["error"] = failure(exc)
    else:
        record.update(
            ok=True,
            **summary,
            examples_per_s=workload.batch / summary["step_s_mean"],
            tokens_per_s=workload.batch * workload.seq / summary["step_s_mean"],
            first_steps_s=clock.stamps[opts.warmup - 1] - begin,  # model build, setup and the warm-up steps
        )
    record["wall_s"] = round(time.perf_counter() - begin, 2)
    free(opts.device)
    return record


# -- orchestration: one subprocess per row, the time budget, the outputs -----------------------------------------


def child_command(opts: argparse.Namespace, workload: Workload, mode: str, result: Path) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(result)]
    command += ["--workloads", workload.name, "--modes", mode, "--device", str(opts.device), "--seq", str(workload.seq)]
    command += ["--steps", str(opts.steps), "--warmup", str(opts.warmup), "--profile-steps", str(opts.profile_steps)]
    seed = [] if opts.privacy_seed is None else ["--privacy-seed", str(opts.privacy_seed)]
    owners = ["--kernel-owners", *opts.kernel_owners] if opts.kernel_owners else []
    return command + ["--tiny"] * opts.tiny + ["--tf32"] * opts.tf32 + seed + owners


def child_environment() -> dict[str, str]:
    """This environment, with only the first visible GPU left visible (the benchmark is of one GPU)."""
    env = dict(os.environ)
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return env


def run_in_subprocess(workload: Workload, mode: str, opts: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """The row measured by a fresh ``python e2e_trainer.py --child`` process; its output goes to ``logs/``."""
    logs = opts.out / "logs"
    logs.mkdir(exist_ok=True)
    log = logs / f"{workload.name}.{mode}.log"
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "row.json"
        try:
            with log.open("w") as sink:
                command = child_command(opts, workload, mode, result)
                done = subprocess.run(
                    command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=child_environment()
                )
            if result.exists():
                return json.loads(result.read_text())
            failure = f"the process exited with {done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s (see {log})"
    tail = log.read_text(errors="replace")[-600:]
    return {**record_for(workload, mode), "error": f"{failure}: {tail}"}


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Each row over its baseline row of the same workload (``hf``, or ``hf_kernels`` for ``dp_kernels``), and over
    ``hf``."""
    done = {(r["workload"], r["mode"]): r for r in records if r["ok"]}
    for r in records:
        r["baseline"] = BASELINES.get(r["mode"], "hf")
        for suffix, base_mode in (("baseline", r["baseline"]), ("hf", "hf")):
            base = done.get((r["workload"], base_mode), {}) if r["ok"] else {}
            r[f"time_vs_{suffix}"] = ratio(r.get("step_s_mean"), base.get("step_s_mean"))
            r[f"median_time_vs_{suffix}"] = ratio(r.get("step_s_median"), base.get("step_s_median"))
            r[f"peak_vs_{suffix}"] = ratio(r.get("peak_gib"), base.get("peak_gib"))
            r[f"reserved_vs_{suffix}"] = ratio(r.get("reserved_gib"), base.get("reserved_gib"))


COLUMNS = (  # (header, key, format)
    ("step s (mean)", "step_s_mean", ".4f"),
    ("step s (median)", "step_s_median", ".4f"),
    ("peak GiB", "peak_gib", ".2f"),
    ("reserved GiB", "reserved_gib", ".2f"),
    ("time x (mean)", "time_vs_baseline", ".2f"),
    ("time x (median)", "median_time_vs_baseline", ".2f"),
    ("peak x", "peak_vs_baseline", ".2f"),
    ("reserved x", "reserved_vs_baseline", ".2f"),
)


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    rows = []
    for r in report["records"]:
        status = "ok" if r["ok"] else ("skipped: " if r.get("skipped") else "failed: ") + r.get("error", "")[:100]
        if r.get("compile_fallback"):  # timed, but not compiled: the row measures the eager step
            status += ", ran eagerly: " + r["compile_fallback"][0][:100]
        mode = r["mode"] + (" (diagnostic)" if r["diagnostic"] else "")
        q = "fixed batches" if r["sampling_rate"] is None else f"q = {r['sampling_rate']:g}"
        data = f"{q}, N = {r['dataset_size']}"
        cells = [r["workload"], mode, r.get("engine") or "", f"{r['batch']} x {r['seq']}", data]
        numbers = [fmt(r.get(key), spec) for _, key, spec in COLUMNS]
        rows.append([*cells, *numbers, r["baseline"], status.replace("|", "/").replace("\n", " ")])
    header = ["workload", "mode", "engine", "batch x seq", "data", *(h for h, _, _ in COLUMNS), "vs", "status"]
    lines = [
        f"# trainer.train() end to end ({meta['date_utc']})",
        "",
        f"Device: {meta['device']}; CUDA {meta['cuda']}; {versions}; commit {meta['git_commit']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Wall time between step ends over {report['settings']['steps']} steps after {report['settings']['warmup']} "
        "warm-up steps; peak memory over those steps. Ratios (x) are over the row named in `vs`, same workload.",
        "",
        *table(header, rows),
        "",
    ]
    profiled = [r for r in report["records"] if r.get("profile")]
    if profiled:
        lines += [
            "Profile of the steps after the timed ones (per step; host operators are top-level `aten::` calls):",
            "",
        ]
        prows = []
        for r in profiled:
            prof = r["profile"]
            ranges = ", ".join(f"{k.removeprefix('opake::')} {v:.1f}" for k, v in prof["opake_ranges_host_ms"].items())
            heavy = ", ".join(
                f"{k.removeprefix('aten::')} {v['self_ms']:.1f}" for k, v in list(prof["top_host_ops_ms"].items())[:5]
            )
            cells = [
                f"{prof['host_ops_per_step']:.0f}",
                f"{prof['kernels_per_step']:.0f}",
                f"{prof['kernel_ms_per_step']:.1f}",
            ]
            prows.append([r["workload"], r["mode"], *cells, ranges or "-", heavy])
        header = [
            "workload",
            "mode",
            "host ops",
            "kernels",
            "kernel ms",
            "opake ranges, host ms",
            "heaviest host ops, ms",
        ]
        lines += [*table(header, prows), ""]
    return "\n".join(lines)


def write_results(report: dict[str, Any], out: Path) -> None:
    add_ratios(report["records"])
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "results.md").write_text(markdown(report))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for results.json, results.md and the rows' logs")
    parser.add_argument("--workloads", nargs="+", help="workload names (default: all of the suite)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), help=f"subset of {' '.join(MODES)}")
    parser.add_argument("--steps", type=int, help="timed steps per row (default 30; 4 with --tiny)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5; 1 with --tiny)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), help="default: cuda (the first visible GPU; cpu with --tiny)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="after the timed steps, profile this many more (0: none)"
    )
    parser.add_argument("--seq", type=int, help="run every named workload at this sequence length instead of its own")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU workloads of the smoke suite")
    parser.add_argument("--in-process", action="store_true", help="run every row in this process, not a subprocess")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="rows not started after this are skipped")
    parser.add_argument("--row-timeout-s", type=float, default=600.0, help="kill a row's subprocess after this")
    parser.add_argument("--tf32", action="store_true", help="TF32 matmuls on both sides (default off, as in PyTorch)")
    parser.add_argument(
        "--privacy-seed",
        type=int,
        help="diagnostic: the private rows' keys from this seed (privacy_noise_seed), so that two commits draw the "
        "same Poisson batches; the noise is then public (default: secret keys, as users run)",
    )
    parser.add_argument(
        "--kernel-owners",
        nargs="+",
        default=(),
        help="diagnostic: with --profile-steps, the operators and Python frames that launched the GPU kernels whose "
        "names contain these strings (on a CPU: the operators named exactly so), in the row's profile",
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: measure one row, write it here
    opts = parser.parse_args(argv)
    suite = SUITES["smoke" if opts.tiny else "gpu"]
    known = {w.name: w for w in suite + SCALE + HOST}  # the scale and host workloads run when named
    names = [n for item in opts.workloads or [w.name for w in suite] for n in item.split(",")]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(known)}")
    opts.workloads = [known[name] for name in dict.fromkeys(names)]
    if opts.seq is not None:
        if opts.seq < 2:
            parser.error("--seq must be at least 2 (a causal LM predicts from the second token)")
        opts.workloads = [dataclasses.replace(w, seq=opts.seq) for w in opts.workloads]
    opts.modes = [m for item in opts.modes for m in item.split(",")]
    if set(opts.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(set(opts.modes) - set(MODES))}; choose from {list(MODES)}")
    opts.steps = (4 if opts.tiny else 30) if opts.steps is None else opts.steps
    opts.warmup = (1 if opts.tiny else 5) if opts.warmup is None else opts.warmup
    if opts.profile_steps < 0:
        parser.error("--profile-steps must be >= 0")
    if opts.kernel_owners and not opts.profile_steps:
        parser.error("--kernel-owners needs --profile-steps")
    opts.kernel_owners = tuple(opts.kernel_owners)
    if opts.steps < 1 or opts.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first timed gap starts at the last warm-up step)")
    opts.device = torch.device(opts.device or ("cpu" if opts.tiny else "cuda"))
    if opts.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --tiny (or --device cpu)")
    if opts.child is None and opts.out is None:
        parser.error("--out is required")
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse(argv)
    if opts.child is not None:  # one row, in this fresh process
        (workload,), (mode,) = opts.workloads, opts.modes
        opts.child.write_text(json.dumps(measure_row(workload, mode, opts), default=str))
        return 0
    opts.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "steps": opts.steps,
        "warmup": opts.warmup,
        "tf32": opts.tf32,
        "privacy_seed": opts.privacy_seed,
        "sampling_rate": SAMPLING_RATE,
        "noise_multiplier": NOISE_MULTIPLIER,
        "learning_rate": LR,
        "isolation": "in-process" if opts.in_process else "subprocess per row",
        "budget_s": opts.budget_s,
    }
    shared = Settings(  # the harness's run-wide settings, for its environment capture; the unused ones zero
        device=opts.device,
        steps=opts.steps,
        warmup=opts.warmup,
        noise_multiplier=NOISE_MULTIPLIER,
        clipping_norm=CLIPPING_NORM,
        microbatch=None,
        tf32=opts.tf32,
        profile_steps=0,
        max_batch_cap=0,
        max_batch_budget_s=0.0,
    )
    command = "python benchmarks/e2e_trainer.py " + " ".join(argv)
    meta = {**environment(shared, argv), "command": command, "settings": settings}
    report: dict[str, Any] = {"meta": meta, "settings": settings, "records": []}
    begin = time.perf_counter()
    for workload in opts.workloads:
        for mode in opts.modes:
            if time.perf_counter() - begin >= opts.budget_s:
                record = {**record_for(workload, mode), "skipped": True, "error": "time budget spent"}
            elif opts.in_process or (mode == "opacus" and not opacus_available()):  # the latter: a skipped row
                record = measure_row(workload, mode, opts)
            else:
                record = run_in_subprocess(workload, mode, opts, timeout=opts.row_timeout_s)
            report["records"].append(record)
            print(json.dumps(record, default=str), file=sys.stderr, flush=True)
            write_results(report, opts.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
