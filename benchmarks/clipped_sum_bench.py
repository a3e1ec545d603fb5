"""GPU diagnostic: the clipped sum of a bf16 linear layer, as the engine forms it against a one-pass candidate.

The layerwise engine adds ``sum_i c_i G_i`` (``G_i = g_i^T a_i``, bf16 factors) to a float32 sum in two exact bf16
parts (:func:`~opake_torch.layerwise.precision.add_bf16_product`): the scaled output gradient split in two, one
tensor-core matmul of twice the output width, then the two halves added. That is twice the flops of the layer's
weight gradient, plus the parts and the ``[2, out, in]`` product in memory.

The candidate here (a prototype kept in this file, not used by the library) makes one pass of the weight gradient's
flops: a Triton program per ``128 x 128`` tile of the sum (and group of examples) accumulates each example's tile
``G~_i`` in float32 on tensor cores, then adds ``c_i G~_i`` to its running tile in float32 (nothing for an example
with ``c_i = 0``, whatever its values); the groups' tiles are summed once at the end (no atomics: the same bits every
run). Its per-example rounding is that of the product norm route (``|G~_i - G_i| <= gamma sum_t |g_t| |a_t|^T``,
``gamma`` about ``T 2^-23``), so the norms would carry that margin (``gamma S_i``, about 1e-3 of the norm at
``T = 512``) where the two-part sum needs none: what it buys is measured here before the engine takes it.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/clipped_sum_bench.py [--repeats 10]

Prints one JSON line per shape (the 1.1B Llama's projections at 16 x 512): both forms' mean milliseconds and peak
memory above the inputs (MiB), and each form's relative error against the float64 sum of the same clipped
contributions (``c'_i``, the clip factor rounded down to bf16, for the two-part form; ``c_i`` for the candidate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.precision import add_bf16_product, bf16_floor
from opake_torch.patches.kernels.product_norms import TILE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import _measure

SHAPES = [  # (name, m, T, in, out)
    ("llama1b.q_proj", 16, 512, 2048, 2048),
    ("llama1b.k_proj", 16, 512, 2048, 256),
    ("llama1b.gate_proj", 16, 512, 2048, 5632),
    ("llama1b.down_proj", 16, 512, 5632, 2048),
    ("llama1b.lm_head", 16, 512, 2048, 32000),
]
BO, BK, BT = TILE  # the norm kernel's tiles


@triton.jit
def _one_pass_kernel(
    G, A, SCALE, PARTIAL, m, T, D_OUT, D_IN, TILES_IN, PER_GROUP, BO: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr
):
    tile, group = tl.program_id(0), tl.program_id(1)
    rows = ((tile // TILES_IN) * BO + tl.arange(0, BO)).to(tl.int64)
    cols = ((tile % TILES_IN) * BK + tl.arange(0, BK)).to(tl.int64)
    steps = tl.arange(0, BT).to(tl.int64)
    rows_in, cols_in = rows[:, None] < D_OUT, cols[None, :] < D_IN
    total = tl.zeros([BO, BK], dtype=tl.float32)
    first = group * PER_GROUP
    for i in range(first, tl.minimum(first + PER_GROUP, m)):
        c = tl.load(SCALE + i)
        g_ptrs = G + i * T * D_OUT + steps[None, :] * D_OUT + rows[:, None]  # g_i^T, [m, T, out]
        a_ptrs = A + i * T * D_IN + steps[:, None] * D_IN + cols[None, :]
        acc = tl.zeros([BO, BK], dtype=tl.float32)
        for start in range(0, T, BT):
            g = tl.load(g_ptrs, mask=(start + steps[None, :] < T) & rows_in, other=0.0)
            a = tl.load(a_ptrs, mask=(start + steps[:, None] < T) & cols_in, other=0.0)
            acc = tl.dot(g, a, acc)
            g_ptrs += BT * D_OUT
            a_ptrs += BT * D_IN
        total += tl.where(c != 0.0, acc * c, 0.0)
    out = PARTIAL + group.to(tl.int64) * D_OUT * D_IN + rows[:, None] * D_IN + cols[None, :]
    tl.store(out, total, mask=rows_in & cols_in)


def one_pass_sum(g: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, total: torch.Tensor) -> None:
    """``total += sum_i scale_i g_i^T a_i`` for contiguous bf16 ``g`` ``[m, T, out]``, ``a`` ``[m, T, in]``, float32
    ``scale`` ``[m]`` and ``total`` ``[out, in]``: examples split into groups so that the grid fills the GPU."""
    m, positions, out = g.shape
    width = a.shape[-1]
    tiles_in = triton.cdiv(width, BK)
    tiles = triton.cdiv(out, BO) * tiles_in
    groups = max(1, min(m, triton.cdiv(2 * torch.cuda.get_device_properties(g.device).multi_processor_count, tiles)))
    per_group = triton.cdiv(m, groups)
    groups = triton.cdiv(m, per_group)
    partial = torch.empty(groups, out, width, dtype=torch.float32, device=g.device)
    _one_pass_kernel[(tiles, groups)](
        g,
        a,
        scale,
        partial,
        m,
        positions,
        out,
        width,
        tiles_in,
        per_group,
        BO=BO,
        BK=BK,
        BT=BT,
        num_warps=8,
        num_stages=3,
    )
    total.add_(partial.sum(dim=0) if groups > 1 else partial[0])


def measure(name: str, m: int, positions: int, width_in: int, width_out: int, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, positions, width_in, device="cuda", generator=gen).bfloat16()
    g = torch.randn(m, positions, width_out, device="cuda", generator=gen).bfloat16()
    scale = torch.rand(m, device="cuda", generator=gen) * 0.9 + 0.05
    scale[1] = 0.0  # one dropped example
    drop = (scale == 0).reshape(m, 1, 1)
    call = Call("linear", torch.nn.Linear(1, 1), {}, a.reshape(-1, width_in), positions, g.reshape(-1, width_out))
    total = torch.zeros(width_out, width_in, device="cuda")
    row = {"shape": name, "m": m, "T": positions, "in": width_in, "out": width_out}
    row["two_parts"] = _measure(lambda: add_bf16_product(call, drop, scale.reshape(m, 1, 1), total), repeats)
    row["one_pass"] = _measure(lambda: one_pass_sum(g, a, scale, total), repeats)
    row["speedup"] = round(row["two_parts"]["ms"] / row["one_pass"]["ms"], 3)
    for form, factor in (("two_parts", bf16_floor(scale)), ("one_pass", scale)):
        ours = torch.zeros_like(total)
        if form == "two_parts":
            add_bf16_product(call, drop, scale.reshape(m, 1, 1), ours)
        else:
            one_pass_sum(g, a, scale, ours)
        exact = torch.einsum("i,ito,itk->ok", factor.double(), g.double(), a.double())
        row[f"{form}_rel_error"] = ((ours.double() - exact).norm() / exact.norm()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    for shape in SHAPES:
        print(json.dumps(measure(*shape, opts.repeats)), flush=True)


if __name__ == "__main__":
    main()
