"""Draw steps from a sampler, checking what every draw must be: sorted, distinct int64 indices."""

from __future__ import annotations

import numpy as np


def draw(sampler, steps, key, state=None):
    """``(batches, state)``: ``steps`` draws of ``sampler`` under ``key`` from ``state`` (default: a fresh one)."""
    state = sampler.init() if state is None else state
    out = []
    for _ in range(steps):
        indices, state = sampler.sample(key, state)
        assert indices.dtype == np.int64
        assert np.all(np.diff(indices) > 0)
        out.append(indices)
    return out, state


def draw_ranks(samplers, steps, key):
    """Per step, each rank's draw: ``steps`` lists of ``len(samplers)`` index arrays, rank ``r``'s from
    ``samplers[r]`` under ``key`` from a fresh state, each checked as in :func:`draw`."""
    per_rank = [draw(sampler, steps, key)[0] for sampler in samplers]
    return [list(parts) for parts in zip(*per_rank, strict=True)]
