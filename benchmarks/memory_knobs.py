"""Peak memory and step time of each memory knob against the plain vmap(grad) path (GPU).

A Llama-style model (hidden 2048, 16 layers by default: about 1B parameters) with LoRA adapters, one clipped
per-example gradient step (``opake_core.clipping.clipped_grad``) per measurement, at sequence lengths 512 and 2048,
in one process. Prints one JSON document. Bounded by ``--budget-s``: configurations left when it runs out are
reported as skipped.

    python benchmarks/memory_knobs.py                 # ~4 minutes on one H200
    python benchmarks/memory_knobs.py --layers 4      # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch


def build(layers: int, bf16: bool) -> torch.nn.Module:
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.device("cuda"):
        base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(base, lora).train()


def measure(knob: str, *, layers: int, seq: int, batch: int, microbatch: int, steps: int) -> dict:
    """One knob: ``plain`` (vmap(grad)), ``checkpointing``, ``bf16``, ``compile`` and ``cuda_graphs`` (each chunk
    wrapped through the engine's ``transform``, as ``DPTrainer`` does), ``layerwise`` (the layerwise
    engine), joined with ``+``."""
    from opake_core.clipping import Engine, VmapGradients, clipped_grad
    from opake_torch.functional import functional_model
    from opake_torch.layerwise import LayerwiseGradients
    from opake_torch.patches import apply_runtime_patches
    from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing
    from opake_torch.transformers.compile import CudaGraphChunk, compile_chunk
    from opake_torch.transformers.loss import batch_losses, per_example_loss

    apply_runtime_patches()
    bf16 = "bf16" in knob
    model = build(layers, bf16=False)
    if "checkpointing" in knob:
        enable_vmap_checkpointing(model)
    apply, params, frozen = functional_model(model)

    def loss(p: dict, example: dict) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    wrapped: dict = {}

    def transform(chunk):
        if "compile" in knob:
            wrapped["chunk"] = compile_chunk(chunk, backend="inductor")
        elif "cuda_graphs" in knob:
            wrapped["chunk"] = CudaGraphChunk(chunk, 1)
        return wrapped.get("chunk", chunk)

    layerwise = None
    if "layerwise" in knob:
        layerwise = LayerwiseGradients(model, lambda p, b: batch_losses(apply, p, frozen, b, task="causal_lm"))
    engine = Engine(gradients=VmapGradients() if layerwise is None else layerwise, transform=transform)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, microbatch_size=microbatch, engine=engine)

    def step(p: dict, data: dict) -> dict:
        return grad_fn(p, data, state=state)[0].value

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32000, (batch, seq), generator=gen).cuda()
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # before the first call: a capture's pool is part of the knob's cost
    base_memory = torch.cuda.memory_allocated()
    times = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(params, data)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {
        "knob": knob,
        "seq": seq,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "model_gib": base_memory / 2**30,
        "first_step_s": times[0],
        "step_s": statistics.median(times[1:]),
        "eager_fallback": bool(getattr(wrapped.get("chunk"), "is_eager", lambda: False)()),
    }
    del model, params, step
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=230.0)
    parser.add_argument(
        "--knobs",
        nargs="+",
        default=[
            "plain",
            "checkpointing",
            "bf16",
            "bf16+checkpointing",
            "compile",
            "cuda_graphs",
            "layerwise",
            "layerwise+checkpointing",
            "layerwise+cuda_graphs",
        ],
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    began, results = time.perf_counter(), []
    for seq in args.seqs:
        for knob in args.knobs:
            if time.perf_counter() - began > args.budget_s:
                results.append({"knob": knob, "seq": seq, "skipped": "time budget"})
                continue
            try:
                results.append(
                    measure(
                        knob,
                        layers=args.layers,
                        seq=seq,
                        batch=args.batch,
                        microbatch=args.microbatch,
                        steps=args.steps,
                    )
                )
            except torch.OutOfMemoryError:
                results.append({"knob": knob, "seq": seq, "error": "out of memory"})
                torch.cuda.empty_cache()
            except Exception as exc:  # a knob that fails is a result, not the end of the benchmark
                results.append({"knob": knob, "seq": seq, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                torch.cuda.empty_cache()
            print(json.dumps(results[-1]), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "hidden": 2048,
        "batch": args.batch,
        "microbatch": args.microbatch,
        "lora": "r=16 on q,k,v,o",
        "wall_s": time.perf_counter() - began,
    }
    print(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
