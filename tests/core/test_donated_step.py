"""A donated step (``dp_step(donate=True)``) writes the new parameters, the optimizer state and the noised sum into the
tensors it was given, with the bits of the out-of-place step; the noise and Adam's direction are formed one group of
leaves at a time, also with the same bits."""

from __future__ import annotations

import math

import optree
import pytest
import torch

from opake_core import Clipped, Shard, mf, optim, random
from opake_core.mf import streaming
from opake_core.noise import gaussian_noise
from opake_core.optim import _foreach
from opake_core.step import dp_ftrl, dp_sgd

SHAPES = {"a": (5, 3), "b": (7,), "c": (37, 5), "d": ()}
WIDTH = sum(math.prod(s) for s in SHAPES.values())
STEPS = 3

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(lr=0.1),
    "sgd_decay": lambda: optim.sgd(lr=0.1, weight_decay=0.05),
    "momentum": lambda: optim.momentum(lr=0.1, momentum=0.9),
    "nesterov": lambda: optim.momentum(lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(lr=0.05),
    "adamw": lambda: optim.adamw(lr=0.05, weight_decay=0.1),
    "rmsprop": lambda: optim.rmsprop(lr=0.01),  # not built in_place: donate writes the parameters only
}


def _tree(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _loss(params, x, y):
    flat = torch.cat([params[name].reshape(-1) for name in SHAPES])
    return (flat @ x - y) ** 2


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, generator=g)


def _build(mechanism: str, opt, donate: bool):
    common = {
        "clipping_norm": 0.5, "noise_multiplier": 0.8, "key": random.key(3), "optimizer": opt,
        "expected_batch_size": 6.0, "donate": donate,
    }  # fmt: skip
    if mechanism == "dp_sgd":
        return dp_sgd(_loss, **common)
    strategy = mf.optimize(mf.band_mf(bands=2), STEPS)
    return dp_ftrl(_loss, params=_tree(0), strategy=strategy, n_steps=STEPS, **common)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _run(mechanism: str, optimizer: str, donate: bool) -> list[list[torch.Tensor]]:
    """Every step's parameters, optimizer state and noise state, cloned; checks what the step did to its inputs."""
    opt = OPTIMIZERS[optimizer]()
    step_fn, dp_state = _build(mechanism, opt, donate)
    params = _tree(0)
    opt_state = opt.init(params)
    (xs, ys), trace = _data(6 * STEPS), []
    for t in range(STEPS):
        given_params, given = list(params.values()), [(x, x.clone()) for x in _tensors((params, opt_state))]
        batch = (xs[6 * t : 6 * t + 6], ys[6 * t : 6 * t + 6])
        params, opt_state, dp_state, _ = step_fn(params, opt_state, dp_state, batch)
        if not donate:  # the inputs are left as they were
            assert all(torch.equal(x, before) for x, before in given)
        else:  # the new parameters are the given tensors; so are the moments of an optimizer built in_place
            assert all(new is old for new, old in zip(params.values(), given_params, strict=True))
            moments = [m for m in _tensors(opt_state) if m.dtype.is_floating_point]
            if opt.in_place:
                assert {m.data_ptr() for m in moments} <= {x.data_ptr() for x, _ in given}
        trace.append([x.clone() for x in _tensors((params, opt_state, dp_state.noise))])
    return trace


@pytest.mark.parametrize("mechanism", ["dp_sgd", "dp_ftrl"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_donated_step_is_the_out_of_place_step_bit_for_bit(mechanism, optimizer):
    plain, donated = _run(mechanism, optimizer, False), _run(mechanism, optimizer, True)
    moved = (plain[-1][0] - _tree(0)["a"]).abs().max()
    assert moved > 1e-3  # the runs moved: equal untouched parameters would prove nothing
    for t, (a, b) in enumerate(zip(plain, donated, strict=True)):
        assert len(a) == len(b)
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), t


@pytest.mark.parametrize("mechanism", ["dp_sgd", "dp_ftrl"])
@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_work_in_groups_of_leaves_has_the_bits_of_one_group(monkeypatch, mechanism, optimizer):
    whole = _run(mechanism, optimizer, False)  # every leaf in one group (GROUP_NUMEL far above the tree's size)
    monkeypatch.setattr(streaming, "GROUP_NUMEL", 20)  # groups [a], [b], [c], [d]: noise drawn group by group
    monkeypatch.setattr(_foreach, "GROUP_NUMEL", 30)  # Adam's direction: [a, b], [c], [d]
    for donate in (False, True):
        grouped = _run(mechanism, optimizer, donate)
        assert all(torch.equal(u, v) for a, b in zip(whole, grouped, strict=True) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("impl", random.IMPLS)
def test_normal_tree_groups_are_pieces_of_normal_tree(impl):
    # 1.2M values cross the CPU philox block of 2**20; the first leaf is larger than a group and stands alone
    leaves = [torch.zeros(700_000), torch.zeros(3), torch.zeros(500_000), torch.zeros(10, 10)]
    k = random.key(5, impl=impl)
    whole = random.normal_tree(k, leaves, dtype=torch.float32)
    groups = list(random.normal_tree_groups(k, leaves, dtype=torch.float32, group_numel=500_050))
    assert [indices for indices, _ in groups] == [[0], [1, 2], [3]]
    for indices, draws in groups:
        for i, draw in zip(indices, draws, strict=True):
            assert torch.equal(draw, whole[i]), i


def test_in_place_noise_writes_only_what_it_may():
    """Dense float32 leaves take the noise in place, views of one buffer included; a zero-stride stand-in, a bf16 leaf
    (the noise is float32), two leaves sharing memory and two overlapping views are left as they were; every value
    equals the out-of-place noise."""
    g = torch.Generator().manual_seed(0)
    dense, shared, flat, overlapped = (torch.randn(n, generator=g) for n in (40, 6, 20, 20))
    tree = {
        "dense": dense, "stand_in": torch.zeros(()).expand(8), "half": torch.randn(5, generator=g).bfloat16(),
        "shared_1": shared, "shared_2": shared, "view_1": flat[:12], "view_2": flat[12:],
        "overlap_1": overlapped[:12], "overlap_2": overlapped[8:],
    }  # fmt: skip
    before = {name: x.clone() for name, x in tree.items()}
    plain_fn, state = gaussian_noise(noise_multiplier=1.5, key=random.key(2))
    expected, _ = plain_fn(Clipped(dict(before), 0.3), state)
    in_place_fn, state = gaussian_noise(noise_multiplier=1.5, key=random.key(2), inplace=True)
    noised, _ = in_place_fn(Clipped(tree, 0.3), state)
    for name in tree:
        assert torch.equal(noised.value[name], expected.value[name]), name
    for name in ("dense", "view_1", "view_2"):  # written in place
        assert noised.value[name] is tree[name] and not torch.equal(tree[name], before[name]), name
    for name in ("stand_in", "half", "shared_1", "shared_2", "overlap_1", "overlap_2"):  # left as they were
        assert torch.equal(tree[name], before[name]) and noised.value[name] is not tree[name], name


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_draws_its_rows_group_by_group(monkeypatch, world):
    tree = _tree(4)
    shapes = [tuple(x.shape) for x in tree.values()]
    noise_fn, state = gaussian_noise(noise_multiplier=1.1, key=random.key(8))
    whole, _ = noise_fn(Clipped(tree, 0.4), state)
    monkeypatch.setattr(streaming, "GROUP_NUMEL", 10)
    pieces = []
    for rank in range(world):
        shard = Shard.rows(shapes, rank=rank, world_size=world)
        local = {
            name: x.reshape(-1)[start:stop].reshape(local_shape)
            for (name, x), (start, stop), local_shape in zip(
                tree.items(), shard.ranges, shard.local_shapes, strict=True
            )
        }
        fn, first = gaussian_noise(noise_multiplier=1.1, key=random.key(8), shard=shard, inplace=True)
        pieces.append(fn(Clipped({n: x.clone() for n, x in local.items()}, 0.4), first)[0].value)
    for name, x in whole.value.items():
        joined = torch.cat([p[name].reshape(-1) for p in pieces])
        assert torch.equal(joined, x.reshape(-1)), name
