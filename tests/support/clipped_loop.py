"""The clipped sum of per-example gradients written as a loop: the reference the clipping engines are compared with."""

from __future__ import annotations

import math

import torch


def clipped_sum_loop(loss, params: dict, batch: dict, clipping_norm: float) -> dict[str, torch.Tensor]:
    """``sum_i min(1, C / ||g_i||) g_i`` with ``g_i = grad(loss)(params, example_i)``, one example at a time (no vmap,
    no layerwise taps) in the dtype of ``params`` (float64 in the tests). ``batch`` maps names to tensors of shape
    ``[n, ...]``; example ``i`` is row ``i`` of each."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(batch["input_ids"].shape[0]):
        g = torch.func.grad(loss)(params, {k: v[i] for k, v in batch.items()})
        norm = math.sqrt(sum(float(v.square().sum()) for v in g.values()))
        for k in total:
            total[k] += min(1.0, clipping_norm / norm) * g[k]
    return total
