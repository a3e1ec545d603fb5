"""Peak memory and time of one clipped per-example gradient chunk with and without activation offloading.

A Llama-shaped model with random weights (full fine-tune, float32 weights, bf16 autocast on CUDA), one
``clipped_grad`` call per measurement (forward, backward, norms, clipped sum; no noise, no optimizer), built as
``DPTrainer`` builds it with ``activation_offloading`` (:mod:`opake_torch.offloading`): the layerwise engine wrapped
in ``OffloadedGradients``, and the checkpointed layers keeping their inputs in host memory. Modes: ``layerwise``,
``layerwise+ckpt`` and ``vmap+ckpt`` (``vmap(grad)`` offloads only with checkpointing), each off and on. For each
pair it reports the peak memory above the weights, the median time, the bytes copied to the host per call, and the
largest difference between the two clipped sums (0.0: the same bits).

    python benchmarks/activation_offloading.py --device cuda                      # ~1 minute on one H100
    python benchmarks/activation_offloading.py --device cpu --hidden 64 --layers 2 --seq 32 --vocab 256   # smoke

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opake_core.clipping import Engine, VmapGradients, clipped_grad
from opake_torch import offloading
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.offloading import OffloadedGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.patches.activation_checkpointing import enable_vmap_checkpointing
from opake_torch.transformers.loss import batch_losses, per_example_loss


class _Counted:
    """``offloading.to_host`` that also counts the bytes it moves off the device."""

    def __init__(self) -> None:
        self.bytes = 0
        self.inner = offloading.to_host

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        host = self.inner(x)
        if host is not x:
            self.bytes += x.numel() * x.element_size()
        return host


def _model(args: argparse.Namespace, device: torch.device, *, checkpointing: bool, offload: bool) -> torch.nn.Module:
    h = args.hidden
    config = LlamaConfig(hidden_size=h, intermediate_size=h * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, h // 64), num_key_value_heads=max(1, h // 256),
                         vocab_size=args.vocab, max_position_embeddings=max(args.seq, 32))  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    model.config._attn_implementation = "sdpa"
    if checkpointing:
        enable_vmap_checkpointing(model, offload=offload)
    return model.train()


def measure(args: argparse.Namespace, device: torch.device, mode: str, offload: bool) -> dict:
    engine_name, checkpointing = mode.split("+")[0], mode.endswith("+ckpt")
    model = _model(args, device, checkpointing=checkpointing, offload=offload)
    apply, params, frozen = functional_model(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    cuda = device.type == "cuda"

    def loss(p, example):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return per_example_loss(apply, p, frozen, example, task="causal_lm")

    def batch_loss(p, b):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return batch_losses(apply, p, frozen, b, task="causal_lm")

    if engine_name == "layerwise":
        layerwise = LayerwiseGradients(model, batch_loss)
        engine = Engine(gradients=OffloadedGradients(layerwise) if offload else layerwise)
    else:
        engine = Engine(gradients=VmapGradients())
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=1, engine=engine)
    counted = _Counted()
    times, peak, base, result = [], 0, 0, None
    with contextlib.ExitStack() as stack:
        offloading.to_host = counted  # the module attribute the engine and the recompute read
        stack.callback(setattr, offloading, "to_host", counted.inner)
        for i in range(args.steps + 1):  # the first call warms up (and runs the layerwise independence check)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            counted.bytes = 0
            start = time.perf_counter()
            clipped, _ = grad_fn(params, batch, state=state)
            if cuda:
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() - base) if i else 0
            if i:
                times.append(time.perf_counter() - start)
            result = [leaf.detach().clone() for leaf in clipped.value.values()]
            del clipped
    return {"seconds": statistics.median(times), "peak_over_weights_gb": peak / 1e9,
            "host_copies_gb": counted.bytes / 1e9, "sums": result}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="rows of the chunk (the microbatch)")
    parser.add_argument("--steps", type=int, default=3, help="timed calls per measurement (after one warm-up)")
    parser.add_argument("--modes", default="layerwise,layerwise+ckpt,vmap+ckpt")
    args = parser.parse_args()
    device = torch.device(args.device)
    apply_runtime_patches()
    rows = []
    for mode in args.modes.split(","):
        off, on = measure(args, device, mode, False), measure(args, device, mode, True)
        diff = max((a - b).abs().max().item() for a, b in zip(off.pop("sums"), on.pop("sums"), strict=True))
        rows.append({"mode": mode, "off": off, "on": on, "max_abs_diff_of_clipped_sums": diff,
                     "peak_saved_gb": off["peak_over_weights_gb"] - on["peak_over_weights_gb"],
                     "time_ratio": on["seconds"] / off["seconds"]})  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__}
    print(json.dumps({**meta, **{k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch")},
                      "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
