"""Adam and AdamW applied in place by torch's fused kernel (``Optimizer.apply_in_place`` on CUDA): the arithmetic of
``torch.optim.Adam(fused=True)`` / ``AdamW(fused=True)`` bit for bit, enabled here on the CPU (whose fused kernel is
the same algorithm) by widening ``FUSED_DEVICES``; where it does not apply (a device outside the list, mixed dtypes)
``apply_in_place`` writes exactly what ``update(inplace=True)`` then ``apply_updates`` write."""

from __future__ import annotations

import pytest
import torch

from opake_core import Noised, optim
from opake_core.errors import InputTypeError
from opake_core.optim import _fused

SHAPES = {"w": (7, 5), "b": (5,), "s": ()}
GRADS = 4


def _tree(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


def _schedule(step: int) -> float:
    return 0.05 / (1 + step)


def _ours(opt, grads, params):
    state = opt.init(params)
    for g in grads:
        params, state = opt.apply_in_place(
            Noised({k: v.clone() for k, v in g.items()}, 1.0, noise_std=0.1), state, params
        )
    return params, state


@pytest.mark.parametrize(("name", "decay"), [("adam", 0.0), ("adamw", 0.1)])
def test_the_fused_update_is_torchs_fused_optimizer_bit_for_bit(monkeypatch, name, decay):
    monkeypatch.setattr(_fused, "FUSED_DEVICES", ("cpu", "cuda"))
    grads = [_tree(10 + t) for t in range(GRADS)]
    opt = optim.adam(lr=_schedule) if name == "adam" else optim.adamw(lr=_schedule, weight_decay=decay)
    start = _tree(0)
    params, state = _ours(opt, grads, {k: v.clone() for k, v in start.items()})
    reference = [torch.nn.Parameter(start[k].clone()) for k in SHAPES]
    torch_opt = (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(reference, lr=_schedule(0), fused=True,
                                                                            weight_decay=decay)  # fmt: skip
    for t, g in enumerate(grads):
        for group in torch_opt.param_groups:
            group["lr"] = _schedule(t)
        for p, k in zip(reference, SHAPES, strict=True):
            p.grad = g[k].clone()
        torch_opt.step()
    adam_state = state[0]
    assert int(adam_state.count) == GRADS
    for p, k in zip(reference, SHAPES, strict=True):
        assert torch.equal(params[k], p.detach()), k
        assert torch.equal(adam_state.mu[k], torch_opt.state[p]["exp_avg"]), k
        assert torch.equal(adam_state.nu[k], torch_opt.state[p]["exp_avg_sq"]), k
    assert not torch.equal(params["w"], start["w"])  # the steps moved the weights


def _unfused(opt, grads, params):
    state = opt.init(params)
    for g in grads:
        steps, state = opt.update(Noised({k: v.clone() for k, v in g.items()}, 1.0, noise_std=0.1), state,
                                  params=params, inplace=True)  # fmt: skip
        params = optim.apply_updates(params, steps, inplace=True)
    return params, state


@pytest.mark.parametrize("widened", [False, True])
def test_where_the_kernel_does_not_apply_the_multi_tensor_path_runs(monkeypatch, widened):
    """On a device outside ``FUSED_DEVICES`` (the CPU by default), or with bf16 parameters and float32 gradients and
    moments (mixed dtypes), ``apply_in_place`` is the multi-tensor update and add, bit for bit."""
    if widened:
        monkeypatch.setattr(_fused, "FUSED_DEVICES", ("cpu", "cuda"))
    dtype = torch.bfloat16 if widened else torch.float32
    grads = [_tree(10 + t) for t in range(GRADS)]
    opt = optim.adamw(lr=_schedule, weight_decay=0.1)
    ours, our_state = _ours(opt, grads, _tree(0, dtype))
    theirs, their_state = _unfused(opt, grads, _tree(0, dtype))
    for k in SHAPES:
        assert torch.equal(ours[k], theirs[k]), k
        assert torch.equal(our_state[0].mu[k], their_state[0].mu[k]), k
    assert int(our_state[2].count) == int(their_state[2].count) == GRADS


def test_the_fused_update_writes_the_given_tensors(monkeypatch):
    monkeypatch.setattr(_fused, "FUSED_DEVICES", ("cpu", "cuda"))
    opt = optim.adamw(lr=0.1)
    params = _tree(0)
    state = opt.init(params)
    given = [*params.values(), *state[0].mu.values(), *state[0].nu.values()]
    new_params, new_state = opt.apply_in_place(Noised(_tree(1), 1.0, noise_std=0.1), state, params)
    written = [*new_params.values(), *new_state[0].mu.values(), *new_state[0].nu.values()]
    assert all(a is b for a, b in zip(given, written, strict=True))
    with pytest.raises(InputTypeError, match="not a Noised tree"):  # the DP refusal holds on this path too
        opt.apply_in_place(_tree(1), new_state, new_params)


@pytest.mark.cuda
def test_on_cuda_the_donated_update_is_torchs_fused_adamw():
    """On CUDA, by default: the fused kernel runs (its bits are torch's fused AdamW's, not the multi-tensor path's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = lambda tree: {k: v.cuda() for k, v in tree.items()}  # noqa: E731
    grads = [cuda(_tree(10 + t)) for t in range(GRADS)]
    opt = optim.adamw(lr=_schedule, weight_decay=0.1)
    params, _ = _ours(opt, grads, cuda(_tree(0)))
    unfused, _ = _unfused(opt, grads, cuda(_tree(0)))
    reference = [torch.nn.Parameter(v.clone()) for v in cuda(_tree(0)).values()]
    torch_opt = torch.optim.AdamW(reference, lr=_schedule(0), weight_decay=0.1, fused=True)
    for t, g in enumerate(grads):
        torch_opt.param_groups[0]["lr"] = _schedule(t)
        for p, k in zip(reference, SHAPES, strict=True):
            p.grad = g[k].clone()
        torch_opt.step()
    assert all(torch.equal(params[k], p.detach()) for p, k in zip(reference, SHAPES, strict=True))
    assert not all(torch.equal(params[k], unfused[k]) for k in SHAPES)
