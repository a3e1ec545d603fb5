"""End-to-end effect of the performance kernels: step time and peak memory of a DP training step, kernels on and off.

The Llama-style 1.1B LoRA workload (hidden 2048, intermediate 5632, 16 layers, 16 heads, 8 KV heads, vocab 32000,
bf16 base weights, SDPA attention, LoRA r=16 alpha=32 on q,k,v,o,gate,up,down; PEFT keeps the adapters float32
unless ``--base-dtype-adapters``), at seq 512 (batch 16) and seq 2048 (batch 8). Per sequence length, each row in
a fresh model build:

* ``non-private``: ``model(**batch).loss.backward()`` and ``torch.optim.AdamW`` (the reference of the ratios);
* ``kernels off, torch clip``: ``opake_core.step.dp_sgd`` on the trainer's per-example loss, the default engine
  (``vmap(grad)``, materialized gradients clipped and summed with torch arithmetic);
* ``kernels off, fused clip``: the same with ``VmapGradients(FusedGradients)`` (Triton norms and scaled sums;
  DPTrainer's default on CUDA);
* ``kernels on, fused clip``: ``apply_performance_kernels(model, use_performance_kernels=True)`` first, as DPTrainer
  does with ``TrainingArguments(use_performance_kernels=True)``;
* ``layerwise, kernels off`` / ``layerwise, kernels on``: per-example gradients from one batched pass
  (``opake_torch.layerwise``, DPTrainer's choice for this model), where no materialized gradient exists for the
  fused clip to work on.

The DP steps use noise multiplier 1, clipping norm 1, ``opake_core.optim.adamw`` (lr 1e-4, weight decay 0.01) and
``--microbatch`` examples per vmap chunk (default: the whole batch). Each row: the median of ``--steps`` timed steps
after ``--warmup`` warm-ups, ``torch.cuda.synchronize()`` around each step; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (reset after the warm-ups: weights and optimizer state
included). Then the clip phase alone: ``FusedGradients`` (fused Triton) against ``MaterializedGradients`` (the
torch path of the default engine) on per-example gradients shaped like this model's LoRA leaves, ``m`` = the
microbatch.

Bounded by ``--budget-s``: rows left when it is spent are recorded as skipped. A failing row (OOM included) is
recorded with its error. Prints one JSON document to stdout (progress to stderr); ``--out DIR`` also writes
``results.json`` and ``results.md`` there after every row.

    python benchmarks/kernels_e2e.py --out kernels_e2e   # one H200: about 3 minutes (kernel JIT included)
    python benchmarks/kernels_e2e.py --layers 4          # quicker
    python benchmarks/kernels_e2e.py --tiny              # tiny fp32 model on CPU (kernels off, torch fallback)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from modes import LR, WEIGHT_DECAY, nonprivate_step
from timing import fmt, free, is_oom, peak_gib, table_row, timed_steps
from workloads import LLAMA_1B, LORA_TARGETS, Workload, make_batch

CONFIGS = {  # name: (use_performance_kernels, fused clip, layerwise); None: the non-private reference
    "non-private": None,
    "kernels off, torch clip": (False, False, False),
    "kernels off, fused clip": (False, True, False),
    "kernels on, fused clip": (True, True, False),
    "layerwise, kernels off": (False, False, True),
    "layerwise, kernels on": (True, False, True),
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="decoder layers (default 16; 2 with --tiny)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads of the full-size model")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default 512 2048; 16 with --tiny)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch per sequence length (default 16 8; 2 --tiny)")
    parser.add_argument("--microbatch", type=int, help="examples per vmap chunk (default: the whole batch)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--base-dtype-adapters", action="store_true",
                        help="keep the LoRA adapters in the base dtype (PEFT upcasts them to float32 by default); "
                        "the LoRA kernel serves only adapters of the base dtype")  # fmt: skip
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip-repeats", type=int, default=20, help="timed calls per clip-phase measurement")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--device", help="default: cuda (cpu with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 128, seq 16, batch 2, fp32")
    parser.add_argument("--no-tf32", action="store_true", help="fp32 matmuls without TF32 (TF32 is on by default)")
    parser.add_argument("--out", type=Path, help="folder for results.json and results.md")
    args = parser.parse_args(argv)
    args.seqs = args.seqs or ([16] if args.tiny else [512, 2048])
    args.batches = args.batches or ([2] if args.tiny else [16, 8])
    if len(args.batches) != len(args.seqs):
        parser.error("--batches needs one batch size per --seqs entry")
    args.device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    config = dict(TINY) if args.tiny else {**LLAMA_1B, "num_attention_heads": args.heads}
    config["num_hidden_layers"] = args.layers or config["num_hidden_layers"]
    args.config, args.dtype = config, "float32" if args.tiny else "bfloat16"
    args.adapter_dtype = args.dtype if args.base_dtype_adapters else "float32"
    return args


def build(args: argparse.Namespace, device: torch.device | str) -> torch.nn.Module:
    """The workload's model (seed 0) on ``device``: Llama with SDPA attention, LoRA on every linear of the blocks."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(attn_implementation="sdpa", **args.config)
    with torch.device(device):
        base = transformers.LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    # PEFT's default upcasts adapters of a half-precision base to float32; without it they keep the base dtype
    return peft.get_peft_model(base, lora, autocast_adapter_dtype=not args.base_dtype_adapters).train()


def _dp_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    kernels: bool,
    fused: bool,
    microbatch: int,
    layerwise: bool = False,
) -> tuple[Callable[[], None], list[str]]:
    """One ``dp_sgd`` step as DPTrainer builds it: family patches, performance kernels, functional model, the
    per-example causal-LM loss, the process-level patches applied while it runs; returns the step and the kernel
    patches in effect."""
    from opake_core import random
    from opake_core.clipping import Engine, MaterializedGradients, VmapGradients
    from opake_core.optim import adamw
    from opake_core.step import dp_sgd
    from opake_torch.functional import functional_model
    from opake_torch.layerwise import LayerwiseGradients
    from opake_torch.patches import VMAP_PATCHES, apply_runtime_patches
    from opake_torch.patches.families import apply_family_patches
    from opake_torch.patches.kernels import FusedGradients
    from opake_torch.patches.performance import apply_performance_kernels, runtime_patches
    from opake_torch.transformers.loss import batch_losses, fused_causal_lm_losses, fused_head, per_example_loss

    apply_family_patches(model)
    applied = apply_performance_kernels(model, use_performance_kernels=kernels)
    patches = (*VMAP_PATCHES, *runtime_patches(applied))  # process-level (the RoPE kernel): applied per step
    apply, params, frozen = functional_model(model)

    head = fused_head(model, set(params)) if "fused_linear_cross_entropy" in applied else None

    def loss_fn(p: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
        if head is not None:  # as DPTrainer: the fused linear cross-entropy on the final hidden states
            return fused_causal_lm_losses(apply, p, frozen, {k: v[None] for k, v in example.items()}, head)[0]
        return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        if head is not None:
            return fused_causal_lm_losses(apply, p, frozen, b, head)
        return batch_losses(apply, p, frozen, b, task="causal_lm")

    optimizer = adamw(LR, weight_decay=WEIGHT_DECAY)
    step_fn, dp_state = dp_sgd(
        loss_fn,
        optimizer=optimizer,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=float(batch["input_ids"].shape[0]),
        microbatch_size=microbatch,
        engine=Engine(
            gradients=LayerwiseGradients(model, batch_loss)
            if layerwise
            else VmapGradients(FusedGradients if fused else MaterializedGradients)
        ),
        key=random.key(0),
    )
    state = [params, optimizer.init(params), dp_state]

    def step() -> None:
        with apply_runtime_patches(patches):
            state[0], state[1], state[2], _ = step_fn(*state, (batch,))

    return step, applied


def _measure(args: argparse.Namespace, name: str, seq: int, batch_size: int) -> dict[str, Any]:
    device, choice = args.device, CONFIGS[name]
    workload = Workload(f"llama_lora_s{seq}_b{batch_size}", "llama_lora", batch_size, seq, args.dtype, args.config)
    batch = make_batch(workload, batch_size, device)
    model = build(args, device)
    out: dict[str, Any] = {}
    if choice is None:
        step = nonprivate_step(model, batch)
    else:
        kernels, fused, layerwise = choice
        step, out["kernels_applied"] = _dp_step(
            model, batch, kernels, fused, min(args.microbatch or batch_size, batch_size), layerwise
        )
    times = timed_steps(step, device, args.warmup, args.steps)
    median = statistics.median(times)
    return {
        **out,
        "step_s": median,
        "step_s_min": min(times),
        "tokens_per_s": batch_size * seq / median,
        "peak_gib": peak_gib(device),
    }


def _clip_phase(args: argparse.Namespace, m: int) -> dict[str, Any]:
    """Time the clip phase (norms, scales, scaled sum of one chunk) on ``[m, *leaf]`` float gradients of this model's
    LoRA leaves: materialized torch arithmetic against the fused Triton kernels (``FusedGradients``)."""
    from opake_core.clipping import MaterializedGradients
    from opake_core.clipping.rules import ClipRule, bounds_on
    from opake_torch.patches.kernels import FusedGradients
    from opake_torch.patches.kernels.clip_sum import fused_supported

    device = args.device
    shapes = [(p.shape, p.dtype) for p in build(args, "meta").parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(m, *shape, generator=gen, device=device, dtype=dtype) for shape, dtype in shapes]
    params = [torch.zeros(shape, device=device, dtype=torch.float32) for shape, _ in shapes]
    rule, bounds = ClipRule((0,) * len(grads), 1), bounds_on((1.0,), device)
    result: dict[str, Any] = {
        "leaves": len(grads),
        "elements_per_example": sum(g[0].numel() for g in grads),
        "fused_backend": "triton" if fused_supported(grads, params) else "torch (fallback: no CUDA/Triton)",
    }
    for label, form in (("torch", MaterializedGradients), ("fused", FusedGradients)):
        free(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        times = timed_steps(lambda form=form: rule(form(grads), params, bounds, None), device, 2, args.clip_repeats)
        result[f"{label}_ms"] = 1e3 * statistics.median(times)
        if device.type == "cuda":
            result[f"{label}_peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    result["speedup"] = result["torch_ms"] / result["fused_ms"]
    return result


def _error(exc: BaseException) -> str:
    if is_oom(exc):
        return "failed: out of memory"
    return f"failed: {type(exc).__name__}: {str(exc)[:300]}"


def _run(status_row: dict[str, Any], began: float, args: argparse.Namespace, fn: Callable[[], dict]) -> dict:
    """``fn()`` merged into the row, or the row with its skip/failure status; memory freed either way."""
    if time.perf_counter() - began > args.budget_s:
        return {**status_row, "status": "skipped: time budget"}
    free(args.device)
    begin = time.perf_counter()
    try:
        row = {**status_row, **fn(), "status": "ok"}
    except Exception as exc:  # a failing row is a result, not the end of the benchmark
        row = {**status_row, "status": _error(exc)}
    free(args.device)
    return {**row, "wall_s": round(time.perf_counter() - begin, 2)}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {r["seq"]: r for r in rows if r["config"] == "non-private" and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["seq"])
        ok = r["status"] == "ok" and b is not None
        r["time_vs_nonprivate"] = r["step_s"] / b["step_s"] if ok else None
        r["mem_vs_nonprivate"] = r["peak_gib"] / b["peak_gib"] if ok and r["peak_gib"] and b["peak_gib"] else None


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# Performance kernels end to end ({meta['device']}, torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Command: `{meta['command']}`. {meta['model']}; LoRA kernel serves the adapters: "
        f"{'yes' if meta['lora_kernel_serves'] else 'no (adapter dtype differs from the base dtype)'}.",
        "",
        "| seq | config | batch x seq | step s (median) | tokens/s | peak GiB | time vs non-private "
        "| memory vs non-private | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cells = [
            str(r["seq"]),
            r["config"] + (f" (microbatch {r['microbatch']})" if r.get("microbatch") else ""),
            f"{r['batch']} x {r['seq']}",
            fmt(r.get("step_s"), ".4f"),
            fmt(r.get("tokens_per_s"), ".0f"),
            fmt(r.get("peak_gib"), ".2f"),
            fmt(r.get("time_vs_nonprivate"), ".2f"),
            fmt(r.get("mem_vs_nonprivate"), ".2f"),
            r["status"][:120].replace("|", "/"),
        ]
        lines.append(table_row(cells))
    lines += [
        "",
        "## Clip phase alone (per-example gradients of the LoRA leaves, m examples)",
        "",
        "| seq | m | leaves | elements per example | torch ms | fused ms | speedup | fused backend | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["clip"]:
        cells = [
            str(c["seq"]),
            str(c["m"]),
            fmt(c.get("leaves"), "d"),
            fmt(c.get("elements_per_example"), ".3g"),
            fmt(c.get("torch_ms"), ".3f"),
            fmt(c.get("fused_ms"), ".3f"),
            fmt(c.get("speedup"), ".2f"),
            c.get("fused_backend", ""),
            c["status"][:120].replace("|", "/"),
        ]
        lines.append(table_row(cells))
    return "\n".join(lines) + "\n"


def _write(report: dict[str, Any], out: Path | None) -> None:
    add_ratios(report["rows"])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=1))
        (out / "results.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny (or --device cpu) on a machine without one.")
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not args.no_tf32
    import peft
    import transformers

    from opake_torch.patches.kernels import available

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = args.device.type == "cuda"
    c = args.config
    model = (
        f"Llama {c['hidden_size']} hidden, {c['intermediate_size']} intermediate, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}, {args.dtype} base, "
        f"LoRA r={args.rank} alpha={2 * args.rank} ({args.adapter_dtype}) on {','.join(LORA_TARGETS)}, SDPA"
    )
    meta = {
        "command": "python benchmarks/kernels_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(args.device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "kernels_available": available(),
        "model": model,
        "config": c,
        "dtype": args.dtype,
        "adapter_dtype": args.adapter_dtype,
        # the LoRA kernel serves one dtype only: PEFT's float32 adapters on a bf16 base run PEFT's own forward
        "lora_kernel_serves": args.adapter_dtype == args.dtype,
        "lora_rank": args.rank,
        "tf32": not args.no_tf32,
        "steps": args.steps,
        "warmup": args.warmup,
        "budget_s": args.budget_s,
    }
    report: dict[str, Any] = {"meta": meta, "rows": [], "clip": []}
    began = time.perf_counter()
    for seq, batch in zip(args.seqs, args.batches, strict=True):
        microbatch = min(args.microbatch or batch, batch)
        for name in args.configs:
            row = {
                "seq": seq,
                "batch": batch,
                "config": name,
                "microbatch": None if name == "non-private" else microbatch,
            }
            row = _run(row, began, args, lambda n=name, s=seq, b=batch: _measure(args, n, s, b))
            report["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            _write(report, args.out)
        clip = _run({"seq": seq, "m": microbatch}, began, args, lambda m=microbatch: _clip_phase(args, m))
        report["clip"].append(clip)
        print(json.dumps(clip), file=sys.stderr, flush=True)
        _write(report, args.out)
    meta["wall_s"] = round(time.perf_counter() - began, 1)
    _write(report, args.out)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
