"""Core DP steps under DDP (2 Gloo processes): the cross-rank ``reduce`` hook equals a single process on the union."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import ddp_worker as w
from _launch import launch

from opake_core import random
from opake_core.errors import InputTypeError
from opake_core.step import dp_sgd
from opake_core.tree import Clipped


def _single_process(kind: str, empty_rank: int | None = None) -> dict[str, torch.Tensor]:
    """The same run in one process: at every step, the union of the ranks' draws (same per-rank keys)."""
    x, y = w.core_data()
    params = w.core_params()
    step_fn, dp_state, opt_state = w.core_step(kind, params, None)
    samplers = [w.core_sampler(kind, 2, r) for r in range(2)]
    states = [s.init() for s in samplers]
    key = random.key(7)
    for _ in range(w.STEPS):
        parts = []
        for r, sampler in enumerate(samplers):
            idx, states[r] = sampler.sample(key, states[r])
            parts.append(idx[:0] if r == empty_rank else idx)
        union = np.sort(np.concatenate(parts))
        params, opt_state, dp_state, _ = step_fn(params, opt_state, dp_state, (x[union], y[union]))
    return params


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "mf"])
def test_ddp_equals_single_process_on_the_union(tmp_path, kind):
    ranks = launch(kind, tmp_path)
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name  # identical noise and sum
    _close(ranks[0]["params"], _single_process(kind))


def test_empty_local_batch_neither_hangs_nor_desynchronizes(tmp_path):
    ranks = launch("sgd_empty", tmp_path, timeout=90)
    assert ranks[1]["sizes"] == [0] * w.STEPS and sum(ranks[0]["sizes"]) > 0
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    _close(ranks[0]["params"], _single_process("sgd", empty_rank=1))


def test_check_synchronized_refuses_different_keys(tmp_path):
    ranks = launch("mismatch", tmp_path, timeout=90)
    for rank in ranks:
        assert rank["error"] is not None and "noise_key" in rank["error"] and "step" not in rank["error"].split("[")[1]
        assert "<secret>" in rank["error"] and rank["key_hex"] not in rank["error"]  # the key is never shown


def test_reduce_must_keep_the_sensitivity():
    _, x, y = None, *w.core_data()
    params = w.core_params()
    opt_state = None
    from opake_core import optim

    opt = optim.sgd(0.1)
    step_fn, dp_state = dp_sgd(
        w.core_loss,
        optimizer=opt,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        key=random.key(1),
        reduce=lambda c: Clipped(c.value, c.sensitivity * 2),
    )
    opt_state = opt.init(params)
    with pytest.raises(InputTypeError, match="same sensitivity"):
        step_fn(params, opt_state, dp_state, (x[:3], y[:3]))
