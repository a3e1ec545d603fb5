"""Time Opake's Gaussian noise generators against torch's own ``normal_`` on the same device, for per-step noise sizes.

Usage: ``python benchmarks/noise_throughput.py [--workloads lora_8b,full_1b] [--dtype float32] [--device cuda]
[--repeats 10] [--chunk-sweep 19,20,21,22]``.

Workloads are the trainable leaves of one step: ``lora_8b`` is the LoRA r=16 adapters of every linear layer of a
Llama-3-8B (448 leaves, 41.9 M values), ``full_1b`` a full fine-tune of a TinyLlama-1.1B (201 leaves, 1.10 G values);
``--numel N`` adds one flat tensor of N values. For each, in ms per step: ``torch.Tensor.normal_`` into one
preallocated buffer of the total size (the floor), then for each key type (``philox``, ``chacha20``) one
``random.normal`` of the total size (``flat``), one ``random.normal`` per leaf (``per_leaf``, what the noise mechanism
does), ``random.normal_many`` over the leaves, and the full ``add_gaussian_noise`` of a clipped tree (draw + add),
with every time also as a ratio to ``normal_``. ``--chunk-sweep`` times ``flat`` chacha20 on the largest workload for
chunks of 2**k blocks (a private constant of ``opake_core.random``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from opake_core import random
from opake_core.noise import add_gaussian_noise
from opake_core.tree import Clipped


def _llama_lora_leaves(layers=32, hidden=4096, kv=1024, inter=14336, rank=16) -> list[tuple[int, int]]:
    """The LoRA A (rank, in) and B (out, rank) matrices of q, k, v, o, gate, up, down in every layer."""
    linears = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter)]
    linears.append((inter, hidden))
    return [s for _ in range(layers) for fan_in, fan_out in linears for s in ((rank, fan_in), (fan_out, rank))]


def _llama_full_leaves(layers=22, hidden=2048, kv=256, inter=5632, vocab=32000) -> list[tuple[int, ...]]:
    """Every parameter of a Llama-style model (TinyLlama-1.1B by default): embeddings, blocks, norm, head."""
    block = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    block += [(hidden, inter), (hidden,), (hidden,)]
    return [(vocab, hidden), *[s for _ in range(layers) for s in block], (hidden,), (vocab, hidden)]


WORKLOADS = {"lora_8b": _llama_lora_leaves, "full_1b": _llama_full_leaves}


def _time_ms(fn, device: torch.device, repeats: int, budget_s: float) -> float:
    """Mean ms per call after one warm-up, over ``repeats`` calls or fewer if they would take over ``budget_s``."""
    _sync(device)
    begin = time.perf_counter()
    fn()  # warm-up
    _sync(device)
    n = max(1, min(repeats, int(budget_s / max(time.perf_counter() - begin, 1e-9))))
    begin = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - begin) / n * 1000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _calls(impl: str, shapes, *, dtype, device) -> dict:
    """The draws to time for one key type, by name."""
    key = random.key(0, impl=impl)
    keys = [random.fold_in(key, i) for i in range(len(shapes))]
    numel = sum(torch.Size(s).numel() for s in shapes)
    clipped = Clipped({f"w{i}": torch.zeros(s, dtype=dtype, device=device) for i, s in enumerate(shapes)}, 1.0)
    steps = iter(range(10**9))
    return {
        "flat": lambda: random.normal(key, (numel,), dtype=dtype, device=device),
        "per_leaf": lambda: [random.normal(k, s, dtype=dtype, device=device) for k, s in zip(keys, shapes)],  # noqa: B905
        "normal_many": lambda: random.normal_many(keys, shapes, dtype=dtype, device=device),
        "add_gaussian_noise": lambda: add_gaussian_noise(
            clipped, noise_multiplier=1.0, key=key, step=next(steps), compute_dtype=dtype
        ),
    }


def _measure(shapes, *, dtype, device, repeats, budget_s) -> dict:
    numel = sum(torch.Size(s).numel() for s in shapes)
    buffer = torch.empty(numel, dtype=dtype, device=device)
    floor = _time_ms(buffer.normal_, device, repeats, budget_s)
    del buffer
    row = {"leaves": len(shapes), "numel": numel, "torch_normal_ms": floor}
    for impl in random.IMPLS:
        for name, fn in _calls(impl, shapes, dtype=dtype, device=device).items():
            ms = _time_ms(fn, device, repeats, budget_s)
            row[f"{impl}_{name}_ms"], row[f"{impl}_{name}_ratio"] = ms, ms / floor
            _free(device)
        _free(device)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default="lora_8b,full_1b", help="comma-separated names from WORKLOADS")
    parser.add_argument("--numel", type=float, default=None, help="also one flat tensor of this many values")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=3.0, help="fewer repeats where they would take longer")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk-sweep", default="", help="comma-separated k: chacha20 chunks of 2**k blocks")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    workloads = {name: WORKLOADS[name]() for name in args.workloads.split(",") if name}
    if args.numel:
        workloads[f"flat_{args.numel:.3g}"] = [(int(args.numel),)]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "workloads": {
            name: _measure(shapes, dtype=dtype, device=device, repeats=args.repeats, budget_s=args.budget_s)
            for name, shapes in workloads.items()
        },
    }
    if args.chunk_sweep:
        numel = max(sum(torch.Size(s).numel() for s in shapes) for shapes in workloads.values())
        sweep, key, default = {}, random.key(0, impl="chacha20"), random._CHUNK_BLOCKS[device.type]
        for k in (int(k) for k in args.chunk_sweep.split(",")):
            random._CHUNK_BLOCKS[device.type] = 1 << k
            draw = lambda: random.normal(key, (numel,), dtype=dtype, device=device)  # noqa: E731
            sweep[f"2**{k}"] = _time_ms(draw, device, args.repeats, args.budget_s)
            _free(device)
        random._CHUNK_BLOCKS[device.type] = default
        result["chacha20_flat_ms_by_chunk_blocks"] = {"numel": numel, "default": default, **sweep}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
