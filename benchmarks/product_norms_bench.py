"""GPU micro-benchmark of the layerwise engine's per-example norms of one linear call, by route: the Gram route
(float64 Gram matrices), the product route with each example's gradient formed (a batched matmul, then its norm) and
the product route through the norm kernel (:mod:`opake_torch.patches.kernels.product_norms`, the gradient kept in
registers). A diagnostic: the shapes of the 1.1B Llama's projections at 16 x 512 (bf16 factors) and GPT-2 small's
at 16 x 512 and BERT-base's at 32 x 128 (float32 factors under TF32), and the cost model's choice for each (which
prices the formed gradients' traffic even where the kernel runs).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/product_norms_bench.py [--repeats 10]

Prints one JSON line per shape: for each route the mean milliseconds over ``--repeats`` calls (CUDA events, after
one warm-up call) and the peak memory above the inputs (MiB), and the route
:func:`~opake_torch.layerwise.ghost.norm_route` picks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from opake_torch.layerwise import ghost
from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.precision import matmul_precision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import _measure

SHAPES = [  # (name, m, T, in, out, factors dtype)
    ("llama1b.q_proj", 16, 512, 2048, 2048, torch.bfloat16),
    ("llama1b.k_proj", 16, 512, 2048, 256, torch.bfloat16),
    ("llama1b.gate_proj", 16, 512, 2048, 5632, torch.bfloat16),
    ("llama1b.down_proj", 16, 512, 5632, 2048, torch.bfloat16),
    ("llama1b.lm_head", 16, 512, 2048, 32000, torch.bfloat16),
    ("gpt2.c_fc", 16, 512, 768, 3072, torch.float32),
    ("gpt2.c_attn", 16, 512, 768, 2304, torch.float32),
    ("bert.intermediate", 32, 128, 768, 3072, torch.float32),
    ("bert.query", 32, 128, 768, 768, torch.float32),
]


def measure(name: str, m: int, positions: int, width_in: int, width_out: int, dtype: torch.dtype, repeats: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m * positions, width_in, device="cuda", generator=gen).to(dtype)
    g = torch.randn(m * positions, width_out, device="cuda", generator=gen).to(dtype)
    call = Call("linear", torch.nn.Linear(1, 1), {}, a, positions, g)
    precision = matmul_precision(a.device)
    grams = ghost.InputGrams(m)
    row = {"shape": name, "m": m, "T": positions, "in": width_in, "out": width_out, "dtype": str(dtype)[6:]}
    row["gram"] = _measure(lambda: ghost.ghost_norms(call, m, grams, route="gram"), repeats)
    row["kernel"] = _measure(lambda: ghost.finish([ghost.product_norms(call, m, precision)]), repeats)
    kernel_runs = ghost.product_squared_norms_supported
    ghost.product_squared_norms_supported = lambda *args: False
    try:
        row["formed"] = _measure(lambda: ghost.finish([ghost.product_norms(call, m, precision)]), repeats)
    finally:
        ghost.product_squared_norms_supported = kernel_runs
    row["route"] = ghost.norm_route(positions, width_in, width_out, dtype, "cuda", precision)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    for name, m, positions, width_in, width_out, dtype in SHAPES:
        torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32  # the float32 rows: TF32, as a user sets it
        print(json.dumps(measure(name, m, positions, width_in, width_out, dtype, opts.repeats)), flush=True)


if __name__ == "__main__":
    main()
