"""The optimizer tests' problem: a float64 starting point and a noisy quadratic's gradient, ``h * p + z``, from fixed
per-step draws (so that every step's input depends on every earlier step's output)."""

from __future__ import annotations

import torch

from opake_core import optim
from opake_core.tree import Noised


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }


def gradient(name: str, p: list[float], step: int) -> list[float]:
    """The gradient of leaf ``name`` at its flattened value ``p`` on step ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    h = torch.rand(len(p), generator=gen, dtype=torch.float64).add(0.5).tolist()
    z = torch.randn(len(p), generator=gen, dtype=torch.float64).mul(0.2).tolist()
    return [hi * pi + zi for hi, pi, zi in zip(h, p, z, strict=True)]


def run(opt: optim.Optimizer, steps: int) -> tuple[dict[str, torch.Tensor], object]:
    """``steps`` updates of ``opt`` from :func:`start` on :func:`gradient` (each passed as noised gradients); the
    final parameters and optimizer state."""
    params = start()
    state = opt.init(params)
    for t in range(steps):
        grads = {k: torch.tensor(gradient(k, v.flatten().tolist(), t), dtype=torch.float64).view(v.shape)
                 for k, v in params.items()}  # fmt: skip
        updates, state = opt.update(Noised(grads, 1.0, 0.3), state, params=params)
        params = optim.apply_updates(params, updates)
    return params, state


def flat(tree: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Every leaf as a flat list of floats."""
    return {k: v.flatten().tolist() for k, v in tree.items()}
