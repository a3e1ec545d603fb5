"""The optimizer tests' problem: a float64 starting point and a noisy quadratic's gradient, ``h * p + z``, from fixed
per-step draws (so that every step's input depends on every earlier step's output)."""

from __future__ import annotations

import torch


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
