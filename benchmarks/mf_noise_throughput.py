"""Time DP-FTRL's streaming correlated noise for a model-sized tree against the memory-bandwidth floor.

Usage: ``python benchmarks/mf_noise_throughput.py [--params 1e9] [--leaves 64] [--repeats 5]``. For BandMF
(bands=16) and BLT (4 buffers), in the given state dtype, one noise step reads the clipped sum and the strategy's
buffers, draws fresh normals, and writes the output and the updated buffers. The floor is the bytes that must move
(a lower bound: buffers read and written once, the sum read once, the output written once, the normals written once)
divided by the measured device-to-device copy bandwidth. Prints one JSON object per strategy.
"""

from __future__ import annotations

import argparse
import json

import torch

from opake_core import mf, random
from opake_core.mf.streaming import mf_gaussian_noise
from opake_core.tree import Clipped


def _copy_bandwidth(numel: int, device: torch.device) -> float:
    """Bytes per second of a float32 device copy, counting bytes read and written."""
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    return 2 * 4 * numel * 10 / (start.elapsed_time(stop) / 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-steps", type=int, default=1000)
    parser.add_argument("--state-dtype", default="bfloat16")
    args = parser.parse_args()
    device = torch.device("cuda")
    per_leaf = int(args.params) // args.leaves
    template = {f"w{i}": torch.zeros(per_leaf, dtype=torch.float32, device=device) for i in range(args.leaves)}
    numel = per_leaf * args.leaves
    bandwidth = _copy_bandwidth(1 << 28, device)
    state_dtype = getattr(torch, args.state_dtype)
    state_bytes, io_bytes = torch.finfo(state_dtype).bits // 8, 4
    for name, spec in (("band_mf(bands=16)", mf.band_mf(16)), ("blt(max_buffers=4)", mf.blt(4, min_buffers=4))):
        strategy = mf.optimize(spec, args.n_steps)
        buffers = mf.num_buffers(strategy, args.n_steps)
        noise_fn, state = mf_gaussian_noise(
            template, strategy, n_steps=args.n_steps, noise_multiplier=1.0, key=random.key(0), state_dtype=state_dtype
        )
        clipped = Clipped(template, 1.0)
        for _ in range(2):  # warm-up, fills the buffers
            _, state = noise_fn(clipped, state)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.repeats):
            _, state = noise_fn(clipped, state)
        stop.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(stop) / 1000 / args.repeats
        moved = numel * (io_bytes * 2 + state_bytes * 2 * buffers + state_bytes)
        floor = moved / bandwidth
        print(json.dumps({
            "strategy": name, "buffers": buffers, "params": numel, "state_dtype": args.state_dtype,
            "step_s": seconds, "floor_s": floor, "ratio_to_floor": seconds / floor,
            "copy_bandwidth_TBps": bandwidth / 1e12, "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
        }))  # fmt: skip
        del state, noise_fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
