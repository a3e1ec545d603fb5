"""``ReleasedNorm``: the squared norm of the noised tree an optimizer receives, kept for the ``grad_norm`` log, for
leaves of every floating dtype (float64 ones in float64: a float32 norm would narrow them), by ``update`` and by
``apply_in_place``, against a float64 sum of squares."""

from __future__ import annotations

import pytest
import torch

from opake_core import Noised, optim
from opake_torch.transformers.released_norm import ReleasedNorm


def _tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "wide": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "plain": torch.randn(7, generator=g),
        "half": torch.randn(4, 2, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("path", ["update", "apply_in_place"])
def test_the_kept_norm_is_the_float64_norm_of_every_leaf(path):
    noised = Noised(_tree(), 1.0, noise_std=0.5)
    expected = sum(float(leaf.double().square().sum()) for leaf in noised.value.values())
    opt = ReleasedNorm(optim.sgd(lr=0.1))
    params = {name: torch.zeros_like(leaf) for name, leaf in noised.value.items()}
    state = opt.init(params)
    if path == "update":
        opt.update(noised, state, params=params)
    else:
        opt.apply_in_place(noised, state, params)
    assert opt.squared.dtype == torch.float32
    assert float(opt.squared) == pytest.approx(expected, rel=1e-6)
