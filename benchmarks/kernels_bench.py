"""GPU micro-benchmark of the performance kernels: each kernel (forward + per-example backward under vmap) against its
torch reference, and the clip phase alone (torch path vs fused clip-and-sum) on a LoRA-7B-like gradient tree.

Usage: ``python benchmarks/kernels_bench.py [--repeats 20] [--clip-leaves 392] [--clip-elements 40.4e6] [--m 2 16]``.
Prints one JSON object: per case the mean time (ms) and peak memory (MiB) of the reference and of the kernel, and
the speed-up. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch.func import grad, vmap

from opake_torch.patches import kernels as K
from opake_torch.patches.kernels import reference as R


def _measure(fn, repeats: int) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return {
        "ms": round(start.elapsed_time(stop) / repeats, 4),
        "peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20, 2),
    }


def _compare(name: str, ours, ref, repeats: int) -> dict[str, object]:
    a, b = _measure(ref, repeats), _measure(ours, repeats)
    return {"case": name, "torch": a, "kernel": b, "speedup": round(a["ms"] / b["ms"], 3)}


def _kernel_cases(batch: int, seq: int, dtype: torch.dtype, repeats: int) -> list[dict[str, object]]:
    dev, hidden, inter, heads, dim, vocab = "cuda", 4096, 14336, 32, 128, 128256
    out = []
    x, w = torch.randn(batch, seq, hidden, device=dev, dtype=dtype), torch.ones(hidden, device=dev, dtype=dtype)

    def per_example(fn, params, *batch_args, in_dims):
        g = vmap(grad(fn), in_dims=in_dims)
        return lambda: g(params, *batch_args)

    rms = {k: per_example(lambda w, x, f=f: f(x, w).float().sum(), w, x, in_dims=(None, 0))
           for k, f in (("ref", R.rms_norm), ("ours", K.opake_rms_norm))}  # fmt: skip
    out.append(_compare("rms_norm fwd+per-example bwd", rms["ours"], rms["ref"], repeats))
    r = torch.randn(batch, seq, hidden, device=dev, dtype=dtype)
    add_rms = {k: per_example(lambda w, x, r, f=f: sum(t.float().sum() for t in f(x, r, w)), w, x, r,
                              in_dims=(None, 0, 0))
               for k, f in (("ref", R.fused_add_rms_norm), ("ours", K.opake_fused_add_rms_norm))}  # fmt: skip
    out.append(_compare("fused_add_rms_norm fwd+per-example bwd", add_rms["ours"], add_rms["ref"], repeats))
    g, u = (
        torch.randn(batch, seq, inter, device=dev, dtype=dtype),
        torch.randn(batch, seq, inter, device=dev, dtype=dtype),
    )
    for name, ours, ref in (("swiglu", K.opake_swiglu, R.swiglu), ("geglu", K.opake_geglu, R.geglu)):
        cases = {k: per_example(lambda g, u, f=f: f(g, u).float().sum(), g, u, in_dims=(0, 0))
                 for k, f in (("ref", ref), ("ours", ours))}  # fmt: skip
        out.append(_compare(f"{name} fwd+bwd", cases["ours"], cases["ref"], repeats))
    q = torch.randn(batch, 1, heads, seq, dim, device=dev, dtype=dtype)
    angle = torch.randn(batch, 1, seq, dim, device=dev)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    cases = {k: per_example(lambda q, c, s, f=f: f(q, q, c, s)[0].float().sum(), q, cos, sin, in_dims=(0, 0, 0))
             for k, f in (("ref", R.rope), ("ours", K.opake_rope))}  # fmt: skip
    out.append(_compare("rope fwd+bwd", cases["ours"], cases["ref"], repeats))
    h = torch.randn(batch, seq, hidden, device=dev, dtype=dtype)
    head = torch.randn(vocab, hidden, device=dev, dtype=dtype) / math.sqrt(hidden)
    t = torch.randint(0, vocab, (batch, seq), device=dev)
    flce = (("ref", R.fused_linear_cross_entropy), ("ours", K.opake_fused_linear_cross_entropy))
    cases = {k: per_example(lambda h, t, f=f: f(h, head, t), h, t, in_dims=(0, 0)) for k, f in flce}
    out.append(_compare("fused_linear_cross_entropy (frozen head) fwd+bwd", cases["ours"], cases["ref"], repeats))
    logits = torch.randn(batch, seq, 32000, device=dev, dtype=dtype)
    cases = {k: per_example(lambda z, t, f=f: f(z, t), logits, t.clamp(max=31999), in_dims=(0, 0))
             for k, f in (("ref", R.cross_entropy), ("ours", K.opake_cross_entropy_loss))}  # fmt: skip
    out.append(_compare("cross_entropy fwd+bwd", cases["ours"], cases["ref"], repeats))
    return out


def _clip_cases(leaves: int, elements: float, ms: list[int], repeats: int) -> list[dict[str, object]]:
    from opake_core.clipping import MaterializedGradients
    from opake_core.clipping.rules import ClipRule, bounds_on

    out = []
    per_leaf = max(1, int(elements // leaves))
    rule, bounds = ClipRule((0,) * leaves, 1), bounds_on((1.0,), torch.device("cuda"))
    for m in ms:
        grads = [torch.randn(m, per_leaf, device="cuda") for _ in range(leaves)]
        params = [torch.zeros(per_leaf, device="cuda") for _ in range(leaves)]
        result = _compare(
            f"clip phase: {leaves} leaves, {per_leaf * leaves:.3g} elements, m={m}",
            lambda g=grads, p=params: rule(K.FusedGradients(g), p, bounds, None),
            lambda g=grads, p=params: rule(MaterializedGradients(g), p, bounds, None),
            repeats,
        )
        out.append(result)
        del grads, params
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--clip-leaves", type=int, default=392)
    parser.add_argument("--clip-elements", type=float, default=40.4e6)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 16])
    args = parser.parse_args()
    if not K.available():
        raise SystemExit("kernels_bench needs CUDA and Triton.")
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "clip": _clip_cases(args.clip_leaves, args.clip_elements, args.m, args.repeats),
        "kernels": _kernel_cases(args.batch, args.seq, getattr(torch, args.dtype), args.repeats),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
