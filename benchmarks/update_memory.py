"""Peak memory of the part of a private step after the engine (noise, AdamW update, new parameters), out of place
against donated (docs/memory.md, "What the rest of the step keeps"). A diagnostic: it runs what ``dp_step`` runs after
the clipped sum is formed, on a synthetic tree of ``--values`` float32 values in ``--leaves`` equal leaves, from a
state that holds the parameters, the AdamW moments and the clipped sum (``16P`` bytes for ``P`` values).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/update_memory.py --values 268435456 --leaves 64

On CUDA the peak is ``torch.cuda.max_memory_allocated``; on the CPU, the growth of the process's peak resident set
(each mode in its own process). Prints one JSON line per mode: the peak above the state, in units of ``4P`` bytes
(one float32 tree), with the model's prediction (out of place: up to 4 more trees; donated: the group scratch only),
and the seconds of the noise and update (on CUDA the donated update is torch's fused AdamW kernel).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import optree
import torch

from opake_core import Clipped, optim, random
from opake_core.noise import gaussian_noise


def optim_tensors(state: object) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]


def run(values: int, leaves: int, donate: bool, device: str) -> dict[str, float]:
    size = values // leaves
    params = {f"w{i}": torch.randn(size, device=device) for i in range(leaves)}
    opt = optim.adamw(lr=1e-3, weight_decay=0.01)
    opt_state = opt.init(params)
    for moment in optim_tensors(opt_state):  # written once, so that a CPU resident set counts their pages
        moment.fill_(0)
    noise_fn, noise_state = gaussian_noise(noise_multiplier=1.0, key=random.key(0), inplace=donate)
    tree_bytes = 4 * size * leaves
    # CUDA: the last of three steps; CPU: the first (a peak resident set only grows)
    for _step in range(3 if device == "cuda" else 1):
        clipped = Clipped({name: torch.randn(size, device=device) for name in params}, sensitivity=0.01)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        begin = time.perf_counter()
        noised, noise_state = noise_fn(clipped, noise_state)
        del clipped
        if donate:  # as dp_step(donate=True): on CUDA, torch's fused AdamW kernel
            params, opt_state = opt.apply_in_place(noised, opt_state, params)
        else:
            updates, opt_state = opt.update(noised, opt_state, params=params)
            params = optim.apply_updates(params, updates)
            del updates
        del noised
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        seconds = time.perf_counter() - begin
    return {
        "mode": "donated" if donate else "out of place",
        "device": device,
        "values": values,
        "leaves": leaves,
        "peak_above_state_trees": round(peak / tree_bytes, 3),
        "seconds": round(seconds, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=2**26)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--mode", choices=["both", "donated", "out-of-place"], default="both")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.mode == "both":  # one process per mode: a CPU peak resident set only grows
        for mode in ("out-of-place", "donated"):
            command = [sys.executable, __file__, "--values", str(args.values), "--leaves", str(args.leaves)]
            subprocess.run([*command, "--mode", mode], check=True)
        return
    print(json.dumps(run(args.values, args.leaves, args.mode == "donated", device)), flush=True)


if __name__ == "__main__":
    main()
