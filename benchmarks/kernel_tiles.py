"""GPU diagnostic: the launch settings of the one-pass clipped sum and the norm kernel, swept.

For the 1.1B Llama's projections at 16 x 512 and BERT-base's at 32 x 128 (bf16 factors), each ``(BO, BK, BT, warps,
stages)`` of :data:`CONFIGS` times (mean of 10, milliseconds):

* ``loop_*``: the library's sum kernel (``product_sums._clipped_sum_kernel``: one pipeline per example);
* ``flat_*``: a variant whose loop runs over all of a program's (example, step) pairs, one software pipeline across
  examples (the form of Triton's persistent matmul), kept here as the alternative measured;
* ``norms_*``: the norm kernel (``product_norms._tile_squares_kernel``);

each with its relative error against float64 (sum: Frobenius; norms: largest over examples), and ``cublas_ms``, the
non-private weight gradient (one bf16 matmul of the same flops) as the rate to compare with.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/kernel_tiles.py
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import torch

from opake_torch.patches.kernels._triton import jit, tl, triton
from opake_torch.patches.kernels.product_norms import _tile_squares_kernel
from opake_torch.patches.kernels.product_sums import _clipped_sum_kernel, _groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import _measure

SHAPES = [
    ("q", 16, 512, 2048, 2048),
    ("k", 16, 512, 2048, 256),
    ("gate", 16, 512, 2048, 5632),
    ("down", 16, 512, 5632, 2048),
    ("bert_qkv", 32, 128, 768, 768),
    ("bert_ffn", 32, 128, 768, 3072),
]
CONFIGS = [
    (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
]


@jit
def flat_kernel(
    G,
    A,
    SCALE,
    OUT,
    m,
    T,
    D_OUT,
    D_IN,
    sgm,
    sgt,
    sgo,
    sam,
    sat,
    sai,
    TILES_IN,
    PER_GROUP,
    BO: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    tile, group = tl.program_id(0), tl.program_id(1)
    rows = ((tile // TILES_IN) * BO + tl.arange(0, BO)).to(tl.int64)
    cols = ((tile % TILES_IN) * BK + tl.arange(0, BK)).to(tl.int64)
    rows_in, cols_in = rows[:, None] < D_OUT, cols[None, :] < D_IN
    out_ptrs = OUT + group.to(tl.int64) * D_OUT * D_IN + rows[:, None] * D_IN + cols[None, :]
    if ACCUMULATE:
        total = tl.load(out_ptrs, mask=rows_in & cols_in, other=0.0)
    else:
        total = tl.zeros([BO, BK], dtype=tl.float32)
    first = group * PER_GROUP
    count = tl.minimum(first + PER_GROUP, m) - first
    steps_per = tl.cdiv(T, BT)
    steps = tl.arange(0, BT)
    acc = tl.zeros([BO, BK], dtype=tl.float32)
    for it in range(0, count * steps_per):
        example = (first + it // steps_per).to(tl.int64)
        start = (it % steps_per) * BT
        t = start + steps
        g = tl.load(
            G + example * sgm + t[None, :].to(tl.int64) * sgt + rows[:, None] * sgo,
            mask=(t[None, :] < T) & rows_in,
            other=0.0,
        )
        a = tl.load(
            A + example * sam + t[:, None].to(tl.int64) * sat + cols[None, :] * sai,
            mask=(t[:, None] < T) & cols_in,
            other=0.0,
        )
        acc = tl.dot(g, a, acc)
        if it % steps_per == steps_per - 1:
            c = tl.load(SCALE + example)
            total += tl.where(c != 0.0, acc * c, 0.0)
            acc = tl.zeros([BO, BK], dtype=tl.float32)
    tl.store(out_ptrs, total, mask=rows_in & cols_in)


def timed(fn) -> float:
    """Mean milliseconds of 10 calls after one (:func:`kernels_bench._measure`)."""
    return _measure(fn, 10)["ms"]


def run_sum(kernel, g, a, scale, total, cfg, flat):
    bo, bk, bt, warps, stages = cfg
    m, T, out = g.shape
    width = a.shape[-1]
    ti = triton.cdiv(width, bk)
    tiles = triton.cdiv(out, bo) * ti
    groups = _groups(g.device, tiles, m)
    per = triton.cdiv(m, groups)
    groups = triton.cdiv(m, per)
    target = total if groups == 1 else torch.empty(groups, out, width, dtype=torch.float32, device=g.device)
    args = (g, a, scale, target, m, T, out, width, *g.stride(), *a.stride(), ti, per)
    if flat:
        kernel[(tiles, groups)](*args, BO=bo, BK=bk, BT=bt, ACCUMULATE=groups == 1, num_warps=warps, num_stages=stages)
    else:
        kernel[(tiles, groups)](
            *args, BO=bo, BK=bk, BT=bt, ACCUMULATE=groups == 1, UPCAST=False, num_warps=warps, num_stages=stages
        )
    if groups > 1:
        total.add_(target.sum(dim=0))


def run_norms(g, a, cfg):
    bo, bk, bt, warps, stages = cfg
    m, T, out = g.shape
    width = a.shape[-1]
    ti = triton.cdiv(width, bk)
    tiles = triton.cdiv(out, bo) * ti
    partial = torch.empty(m, tiles, dtype=torch.float64, device=g.device)
    _tile_squares_kernel[(tiles, m)](
        g,
        a,
        partial,
        T,
        out,
        width,
        *g.stride(),
        *a.stride(),
        ti,
        tiles,
        BO=bo,
        BK=bk,
        BT=bt,
        TF32=False,
        UPCAST=False,
        num_warps=warps,
        num_stages=stages,
    )
    return partial.sum(dim=1)


def _row(name: str, m: int, positions: int, width_in: int, width_out: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, positions, width_in, device="cuda", generator=gen).bfloat16()
    g = torch.randn(m, positions, width_out, device="cuda", generator=gen).bfloat16()
    scale = torch.rand(m, device="cuda", generator=gen) * 0.9 + 0.05
    exact = torch.einsum("i,ito,itk->ok", scale.double(), g.double(), a.double())
    squares = torch.einsum("ito,itk->iok", g.double(), a.double()).flatten(1).square().sum(1)
    row = {"shape": name, "cublas_ms": timed(functools.partial(torch.mm, g.reshape(-1, width_out).t(),
                                                               a.reshape(-1, width_in)))}  # fmt: skip
    for flat, cfg in itertools.product((False, True), CONFIGS):
        total = torch.zeros(width_out, width_in, device="cuda")
        add = functools.partial(run_sum, flat_kernel if flat else _clipped_sum_kernel, g, a, scale, total, cfg, flat)
        try:
            add()
            error = ((total.double() - exact).norm() / exact.norm()).item()
            row[("flat_" if flat else "loop_") + "x".join(map(str, cfg))] = [timed(add), f"{error:.1e}"]
        except Exception as exc:  # a setting the compiler or the GPU refuses
            row[("flat_" if flat else "loop_") + "x".join(map(str, cfg))] = repr(exc)[:80]
    for cfg in CONFIGS:
        norms = functools.partial(run_norms, g, a, cfg)
        try:
            error = ((norms() - squares).abs() / squares).max().item()
            row["norms_" + "x".join(map(str, cfg))] = [timed(norms), f"{error:.1e}"]
        except Exception as exc:
            row["norms_" + "x".join(map(str, cfg))] = repr(exc)[:80]
    return row


def main() -> None:
    for shape in SHAPES:
        print(json.dumps(_row(*shape)), flush=True)


if __name__ == "__main__":
    main()
