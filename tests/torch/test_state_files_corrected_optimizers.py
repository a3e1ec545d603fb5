"""State files round-trip the states of the noise-corrected, stable and wrapped schedule-free optimizers bit for bit."""

from __future__ import annotations

import optree
import pytest
import torch

from opake_core import optim
from opake_core.tree import Noised

pytest.importorskip("safetensors")  # the adapter's hf extra

from opake_torch.state_files import load_tree, save_tree

MAKERS = {
    "rmsprop_bc": lambda: optim.rmsprop(1e-2, weight_decay=0.1, momentum=0.9, noise_bias_correction=True),
    "adagrad_bc": lambda: optim.adagrad(1e-2, noise_bias_correction=True),
    "radam_bc": lambda: optim.radam(1e-2, noise_bias_correction=True),
    "ademamix_bc": lambda: optim.ademamix(1e-2, noise_bias_correction=True),
    "adafactor_bc": lambda: optim.adafactor(1e-2, weight_decay=0.1, noise_bias_correction=True),
    "stable_adamw": lambda: optim.stable_adamw(1e-2),
    "stable_adamw_bc": lambda: optim.stable_adamw(1e-2, noise_bias_correction=True),
    "schedule_free_adam_bc": lambda: optim.schedule_free(optim.adam(1e-2, noise_bias_correction=True)),
    "schedule_free_rmsprop": lambda: optim.schedule_free(optim.rmsprop(1e-2), warmup_steps=1),
}


@pytest.mark.parametrize("name", MAKERS)
def test_state_round_trips_and_resumes_bit_for_bit(tmp_path, name):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}
    grads = [Noised({k: torch.randn(v.shape, generator=gen) for k, v in params.items()}, 1.0, 0.3) for _ in range(3)]
    opt = MAKERS[name]()
    state = opt.init(params)
    for g in grads[:2]:
        _, state = opt.update(g, state, params=params)
    digest = save_tree(tmp_path / "state.safetensors", state)
    back = load_tree(tmp_path / "state.safetensors", template=opt.init(params), expected_sha256=digest)
    assert optree.tree_structure(back) == optree.tree_structure(state)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(back), strict=True))
    want, _ = opt.update(grads[2], state, params=params)
    got, _ = opt.update(grads[2], back, params=params)
    assert all(torch.equal(want[k], got[k]) for k in params)
