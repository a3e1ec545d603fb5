"""Peak CUDA memory of one private step of the layerwise engine against its memory model (docs/memory.md, "What
the layerwise engine keeps"): a Llama-shaped model with random weights, full fine-tune, float32 weights, bf16
autocast, activation checkpointing, one ``clipped_grad`` call (forward, backward, norms, clipped sum; no noise, no
optimizer).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/layerwise_memory.py --layers 16 --batch 16 --seq 512

Prints one JSON line: the measured peak above the model's weights and the model's prediction, in GB.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing
from opake_torch.transformers.loss import batch_losses, per_example_loss


def predicted_bytes(config: LlamaConfig, m: int, t: int) -> dict[str, int]:
    """The memory model: float32 clipped sums ``S`` (one per weight), the ghost layers' kept factors ``K`` (bf16
    inputs and output gradients of the linear layers, float32 output gradients and int64 ids of the embedding) and
    the instantiated per-example gradients ``D`` (float32 ``[m, out, in]`` where ``T (in + out) >= in out``, and the
    norm weights), in bytes."""
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    linears = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    ghost = {name for name, (fan_in, fan_out) in linears.items() if t * (fan_in + fan_out) < fan_in * fan_out}
    inputs = {"q": h, "k": h, "v": h, "o": h, "gate": h, "up": h, "down": i}  # q/k/v and gate/up share one tensor
    shared = {"k": "q", "v": "q", "up": "gate"}
    kept_inputs = {shared.get(name, name) if shared.get(name) in ghost else name for name in ghost}
    per_layer = 2 * sum(inputs[name] for name in kept_inputs) + 2 * sum(linears[name][1] for name in ghost)
    head = 2 * h + 2 * v  # its input and logits gradient, bf16
    embedding = 4 * h + 8
    dense = sum(fan_in * fan_out for name, (fan_in, fan_out) in linears.items() if name not in ghost)
    params = 2 * v * h + h + layers * (sum(a * b for a, b in linears.values()) + 2 * h)
    return {
        "sums": 4 * params,
        "kept": m * t * (layers * per_layer + head + embedding),
        "instantiated": 4 * m * layers * (dense + 2 * h),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    apply_runtime_patches()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=4096)  # fmt: skip
    model = LlamaForCausalLM(config).cuda()
    model.config._attn_implementation = "sdpa"
    enable_vmap_checkpointing(model)
    model.train()
    apply, params, frozen = functional_model(model)
    ids = torch.randint(1, config.vocab_size, (args.batch, args.seq), device="cuda")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def loss(p, example):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return batch_losses(apply, p, frozen, b, task="causal_lm")

    engine = Engine(gradients=LayerwiseGradients(model, batch_loss))
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=1, engine=engine)
    for _ in range(2):  # the second call is measured
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        clipped, _ = grad_fn(params, batch, state=state)
        torch.cuda.synchronize()
        seconds, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
        del clipped
    model_bytes = predicted_bytes(config, args.batch, args.seq)
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
        "batch": args.batch, "seq": args.seq, "weights_gb": base / 1e9, "peak_gb": peak / 1e9,
        "step_over_weights_gb": (peak - base) / 1e9, "predicted_gb": {k: b / 1e9 for k, b in model_bytes.items()},
        "predicted_total_gb": sum(model_bytes.values()) / 1e9, "seconds": seconds,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
