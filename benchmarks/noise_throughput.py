"""Time Opake's on-device Gaussian noise against torch's own ``normal_`` on the same device.

Usage: ``python benchmarks/noise_throughput.py [--numel 1e9] [--device cuda] [--repeats 10]``.
Prints one JSON object: the mean time per draw of ``numel`` values for ``torch.Tensor.normal_`` (into a preallocated
buffer), for ``opake_core.random.normal`` (allocating, from a key), and for the full ``add_gaussian_noise`` of a
clipped tree of that size (draw + add), with the ratios to ``normal_``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from opake_core import random
from opake_core.noise import add_gaussian_noise
from opake_core.tree import Clipped


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1000 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=float, default=1e9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device, numel, dtype = torch.device(args.device), int(args.numel), getattr(torch, args.dtype)
    buffer = torch.empty(numel, dtype=dtype, device=device)
    key = random.key(0)
    torch_normal = _time(buffer.normal_, device, args.repeats)
    del buffer
    ours_draw = _time(lambda: random.normal(key, (numel,), dtype=dtype, device=device), device, args.repeats)
    clipped = Clipped({"w": torch.zeros(numel, dtype=dtype, device=device)}, sensitivity=1.0)
    steps = iter(range(10**9))
    ours_noise = _time(
        lambda: add_gaussian_noise(clipped, noise_multiplier=1.0, key=key, step=next(steps), compute_dtype=dtype),
        device,
        args.repeats,
    )
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "numel": numel,
        "dtype": args.dtype,
        "torch_normal_s": torch_normal,
        "opake_normal_s": ours_draw,
        "opake_add_gaussian_noise_s": ours_noise,
        "normal_ratio": ours_draw / torch_normal,
        "add_noise_ratio": ours_noise / torch_normal,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
