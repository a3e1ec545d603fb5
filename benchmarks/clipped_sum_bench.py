"""GPU diagnostic: the clipped sum of a bf16 linear layer in the engine's two forms.

The layerwise engine adds ``sum_i c_i G_i`` (``G_i = g_i^T a_i``, bf16 factors) to a float32 sum in one of two forms:

* ``two_parts`` (:func:`~opake_torch.layerwise.precision.add_bf16_product`): the scaled output gradient split into two
  exact bf16 parts, one tensor-core matmul of twice the output width, then the two halves added: twice the flops of
  the layer's weight gradient, plus the parts and the ``[2, out, in]`` product in memory;
* ``one_pass`` (:func:`~opake_torch.patches.kernels.product_sums.clipped_product_sum`, where the kernel runs): a
  Triton program per tile of the sum accumulates each example's tile in float32 on tensor cores and adds ``c_i G~_i``
  in registers: one pass of the weight gradient's flops; the norms carry its rounding margin.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/clipped_sum_bench.py [--repeats 10]

Prints one JSON line per shape (the 1.1B Llama's projections at 16 x 512): both forms' mean milliseconds and peak
memory above the inputs (MiB), and each form's relative error against the float64 sum of the same clipped
contributions (``c'_i``, the clip factor rounded down to bf16, for the two parts; ``c_i`` for one pass).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.precision import add_bf16_product, bf16_floor
from opake_torch.patches.kernels.product_sums import clipped_product_sum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import _measure

SHAPES = [  # (name, m, T, in, out)
    ("llama1b.q_proj", 16, 512, 2048, 2048),
    ("llama1b.k_proj", 16, 512, 2048, 256),
    ("llama1b.gate_proj", 16, 512, 2048, 5632),
    ("llama1b.down_proj", 16, 512, 5632, 2048),
    ("llama1b.lm_head", 16, 512, 2048, 32000),
]


def measure(name: str, m: int, positions: int, width_in: int, width_out: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, positions, width_in, device="cuda", generator=gen).bfloat16()
    g = torch.randn(m, positions, width_out, device="cuda", generator=gen).bfloat16()
    scale = torch.rand(m, device="cuda", generator=gen) * 0.9 + 0.05
    scale[1] = 0.0  # one dropped example
    drop = (scale == 0).reshape(m, 1, 1)
    call = Call("linear", torch.nn.Linear(1, 1), {}, a.reshape(-1, width_in), positions, g.reshape(-1, width_out))
    forms = {  # form: (add the clipped sum to a float32 total, the clip factors its contributions carry)
        "two_parts": (lambda t: add_bf16_product(call, drop, scale.reshape(m, 1, 1), t), bf16_floor(scale)),
        "one_pass": (lambda t: clipped_product_sum(g, a, scale, t), scale),
    }
    row = {"shape": name, "m": m, "T": positions, "in": width_in, "out": width_out}
    for form, (add, factor) in forms.items():
        total = torch.zeros(width_out, width_in, device="cuda")
        add(total)
        exact = torch.einsum("i,ito,itk->ok", factor.double(), g.double(), a.double())
        row[f"{form}_rel_error"] = ((total.double() - exact).norm() / exact.norm()).item()
        row[form] = _measure(lambda add=add, total=total: add(total), repeats)
    row["speedup"] = round(row["two_parts"]["ms"] / row["one_pass"]["ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    for shape in SHAPES:
        print(json.dumps(measure(*shape, opts.repeats)), flush=True)


if __name__ == "__main__":
    main()
