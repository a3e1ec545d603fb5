"""Sharded training end to end under ``torchrun``: ``DPTrainer`` with ``fsdp`` against ``transformers.Trainer`` with
``fsdp`` on the same GPUs, and Opacus' ``ghost_fsdp`` where it is importable.

Every rank runs this script; each row is one ``train()`` (or, for Opacus, the loop of its FSDP example) on a model
built from a config with random weights (``workloads.build_model``, nothing downloaded) and synthetic tokens
(``e2e_trainer.dataset``). Both trainers get the same per-device batch, learning rate, ``max_steps`` and the
workload's ``trainer_args`` (bf16 autocast, gradient checkpointing), and shard with FSDP2 by transformer layer
(``fsdp="full_shard auto_wrap"``, ``fsdp_config={"version": 2}``). The private rows sample Poisson batches at rate
``q`` from a dataset of ``W x batch / q`` examples with noise multiplier 1 and clipping norm 1 (no accounting during
the run), as in ``e2e_trainer.py``.

Modes:

* ``hf``: ``transformers.Trainer`` with ``fsdp="full_shard auto_wrap"`` (Accelerate's FSDP2 plugin); the reference.
* ``dp``: ``DPTrainer`` with ``fsdp="full_shard auto_wrap"`` (the layerwise engine, clipped sums reduce-scattered).
* ``opacus``: Opacus' ``FSDP2Wrapper`` and ``make_private(grad_sample_mode="ghost_fsdp")`` with SGD, as its FSDP
  example (shuffled fixed batches of the per-device size, ``DistributedSampler``), every parameter trainable as in the
  other rows (layers without a ghost sampler, such as Llama's RMSNorm class, take Opacus' per-layer functorch
  fallback), bf16 autocast as the workload says, but without activation checkpointing: its recomputed forward
  counts as a second call of each layer, which ``ghost_fsdp`` refuses ("Parameter tying is not supported with
  FSDP"), so the row's memory is not comparable. Skipped with a message when opacus is not importable.

Measured per rank, after ``--warmup`` steps: the wall time between consecutive step ends (CUDA synchronized first),
mean and median over ``--steps`` steps, and the peak of ``torch.cuda.max_memory_allocated`` over those steps (reset
at the end of the warm-up: weights, optimizer state and the step's peak). Rank 0 prints one JSON row per mode and
appends it to ``OUT/results.jsonl``; a mode that fails prints its error on the failing rank (torchrun then stops the
job, so the run book launches one mode per ``torchrun``).

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_e2e.py --workload llama1b_full_s512_b8_ckpt \
        --modes dp --out fsdp_results
    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_e2e.py --dry-run --out /tmp/fsdp_dry   # CPU, Gloo
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_trainer import StepClock, dataset, model_for
from environment import git_commit, version
from modes import LR, opacus_available
from timing import failure, free
from workloads import CHECKPOINTING, LLAMA3_8B, LLAMA_1B, TINY_LLAMA, Workload

MODES = ("hf", "dp", "opacus")
SAMPLING_RATE = 0.01
NOISE_MULTIPLIER = 1.0
CLIPPING_NORM = 1.0
FSDP = "full_shard auto_wrap"
FSDP_CONFIG = {"version": 2, "reshard_after_forward": True}
BF16_CKPT = {**CHECKPOINTING, "bf16": True}
WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "llama1b_full_s512_b8_ckpt",
            "llama",
            8,
            512,
            config={**LLAMA_1B, "num_hidden_layers": 22},  # TinyLlama's shape: 1.10B parameters
            trainer_args=BF16_CKPT,
            description="Llama-style 1.1B (22 layers), full fine-tune, fp32 weights, bf16 autocast, checkpointing",
        ),
        Workload(
            "llama8b_full_s1024_b2_ckpt",
            "llama",
            2,
            1024,
            config=LLAMA3_8B,
            trainer_args=BF16_CKPT,
            description="Llama-3-8B shape, full fine-tune, fp32 weights, bf16 autocast, checkpointing",
        ),
        Workload("tiny_llama_full_s16_b4", "llama", 4, 16, config=TINY_LLAMA, description="tiny Llama (dry run)"),
    )
}


def local_bytes(model: torch.nn.Module) -> int:
    """The bytes of the parameters this rank holds: its shard of every FSDP2 parameter (``to_local()``)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are FSDP2 shards (DTensors)."""
    return any(hasattr(param, "to_local") for param in model.parameters())


def train_args(folder: str, workload: Workload, opts: argparse.Namespace, steps: int) -> dict[str, Any]:
    """The arguments both trainers get."""
    return {
        "output_dir": folder,
        "per_device_train_batch_size": workload.batch,
        "learning_rate": LR,
        "max_steps": steps,
        "use_cpu": opts.device.type == "cpu",
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "fsdp": FSDP,
        "fsdp_config": dict(FSDP_CONFIG),
        **workload.trainer_args,
    }


def run_hf(workload: Workload, opts: argparse.Namespace, clock: StepClock, world: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    model = model_for(workload, opts.device)
    data = dataset(workload, round(workload.batch * world / opts.sampling_rate))
    with tempfile.TemporaryDirectory() as folder:
        # fsdp=True with the options in fsdp_config is the spelling Hugging Face keeps (the string is deprecated there)
        args = TrainingArguments(**{**train_args(folder, workload, opts, clock.max_steps), "fsdp": True})
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock.callback()])
        trainer.train()
    optim = getattr(args.optim, "value", args.optim)
    wrapped = trainer.model_wrapped
    return {
        "engine": "autograd",
        "optim": optim,
        "local_param_bytes": local_bytes(wrapped),
        "sharded": is_sharded(wrapped),
    }


def run_dp(workload: Workload, opts: argparse.Namespace, clock: StepClock, world: int) -> dict[str, Any]:
    from opake_torch.transformers import DPTrainer, TrainingArguments

    data = dataset(workload, round(workload.batch * world / opts.sampling_rate))
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            **train_args(folder, workload, opts, clock.max_steps),
            privacy_noise_multiplier=NOISE_MULTIPLIER,
            clipping_norm=CLIPPING_NORM,
        )
        trainer = DPTrainer(model_for(workload, opts.device), args, train_dataset=data, callbacks=[clock.callback()])
        trainer.train()
    return {
        "engine": trainer.per_example_gradients_engine,
        "optim": args.optim,
        "sampling_rate": opts.sampling_rate,
        "local_param_bytes": local_bytes(trainer.model),
        "sharded": is_sharded(trainer.model),
    }


def run_opacus(workload: Workload, opts: argparse.Namespace, clock: StepClock, world: int) -> dict[str, Any]:
    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.utils.data import DataLoader, DistributedSampler

    model = model_for(workload, opts.device)
    data = dataset(workload, round(workload.batch * world / opts.sampling_rate))
    loader = DataLoader(data, batch_size=workload.batch, sampler=DistributedSampler(data))
    model = FSDP2Wrapper(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=CLIPPING_NORM,
        grad_sample_mode="ghost_fsdp",
        criterion=torch.nn.CrossEntropyLoss(),
        poisson_sampling=False,
    )
    model.train()
    autocast = torch.autocast(opts.device.type, dtype=torch.bfloat16, enabled=bool(workload.trainer_args.get("bf16")))
    while len(clock.stamps) < clock.max_steps:
        for batch in loader:
            ids = batch["input_ids"].to(opts.device)
            optimizer.zero_grad()
            with autocast:
                logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(opts.device)).logits
            shifted = logits[:, :-1].float()
            loss = criterion(shifted.reshape(-1, shifted.shape[-1]), ids[:, 1:].reshape(-1), shape=shifted.shape)
            loss.backward()  # two backward passes: the per-example norms, then the reweighted loss
            optimizer.step()
            clock.tick()
            if len(clock.stamps) == clock.max_steps:
                break
    module = model._module if hasattr(model, "_module") else model
    return {
        "engine": "opacus ghost_fsdp",
        "optim": "torch SGD",
        "gradient_checkpointing": False,
        "local_param_bytes": local_bytes(module),
        "sharded": is_sharded(module),
    }


RUNNERS = {"hf": run_hf, "dp": run_dp, "opacus": run_opacus}


def setup(dry_run: bool) -> tuple[torch.device, int, int]:
    """The process group (NCCL on CUDA, Gloo on CPU) and this rank's device."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise SystemExit("launch with torchrun --nproc_per_node W (W >= 2): this benchmark measures sharded runs")
    if dry_run or not torch.cuda.is_available():
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return device, rank, world


def measure(workload: Workload, mode: str, opts: argparse.Namespace, world: int) -> dict[str, Any]:
    """This rank's part of one row; raises when the mode fails (so that the other ranks do not wait for it)."""
    free(opts.device)
    begin = time.perf_counter()
    clock = StepClock(opts.device, opts.warmup, opts.warmup + opts.steps)
    extra = RUNNERS[mode](workload, opts, clock, world)
    summary = clock.summary()
    free(opts.device)
    return {**summary, **extra, "wall_s": round(time.perf_counter() - begin, 2)}


def row(workload: Workload, mode: str, parts: list[dict[str, Any]], opts: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's summary of the ranks' parts: rank 0's step times (the ranks run in lockstep), every rank's peak."""
    first = parts[0]
    world = len(parts)
    return {
        "workload": workload.name,
        "mode": mode,
        "world_size": world,
        "batch_per_rank": workload.batch,
        "seq": workload.seq,
        "trainer_args": workload.trainer_args,
        "step_s_mean": first["step_s_mean"],
        "step_s_median": first["step_s_median"],
        "steps_timed": first["steps_timed"],
        "tokens_per_s": workload.batch * world * workload.seq / first["step_s_mean"],
        "peak_gib_per_rank": [part["peak_gib"] for part in parts],
        "local_param_bytes_per_rank": [part.get("local_param_bytes") for part in parts],
        "sharded": all(part.get("sharded") for part in parts),
        **{k: v for k, v in first.items() if k in ("engine", "optim", "sampling_rate", "gradient_checkpointing")},
        "device": torch.cuda.get_device_name(opts.device)
        if opts.device.type == "cuda"
        else platform.processor() or "cpu",
        "versions": {name: version(name) for name in ("torch", "transformers", "accelerate", "opacus")},
        "git_commit": git_commit(),
        "dry_run": opts.dry_run,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="llama1b_full_s512_b8_ckpt", choices=sorted(WORKLOADS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sampling-rate", type=float, default=SAMPLING_RATE)
    parser.add_argument("--out", default="fsdp_results")
    parser.add_argument("--dry-run", action="store_true", help="CPU and Gloo, the tiny model, 2 timed steps")
    opts = parser.parse_args(argv)
    if opts.dry_run:
        opts.workload, opts.steps, opts.warmup, opts.sampling_rate = "tiny_llama_full_s16_b4", 2, 1, 0.1
    opts.device, rank, world = setup(opts.dry_run)
    workload = WORKLOADS[opts.workload]
    out = Path(opts.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    try:
        for mode in opts.modes:
            if mode == "opacus" and not opacus_available():
                if rank == 0:
                    print(f"[fsdp_e2e] {workload.name} opacus: skipped, opacus is not importable", flush=True)
                continue
            try:
                part = measure(workload, mode, opts, world)
            except Exception as exc:
                print(f"[fsdp_e2e] rank {rank} {workload.name} {mode}: {failure(exc)}", file=sys.stderr, flush=True)
                raise
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, part)
            if rank == 0:
                record = row(workload, mode, parts, opts)
                with (out / "results.jsonl").open("a") as file:
                    file.write(json.dumps(record) + "\n")
                print(json.dumps(record), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
