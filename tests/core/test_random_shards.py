"""Sharded noise: slices of a key's flat vector, and the shards of a tree's draw, equal the one-process draw."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from opake_core import random, testing
from opake_core.errors import ConfigurationError, InputTypeError

SMALL_BLOCK = 64  # philox blocks this small make crossing many block boundaries cheap


def _reference(k, total, dtype, device="cpu"):
    """The flat vector by its definition, drawn whole: the keystream from block 0 for chacha20, one draw up to a
    block and one draw per block above for philox."""
    block = random._PHILOX_BLOCK[torch.device(device).type]
    if k.impl == "chacha20" or total <= block:
        return random.normal(k, (total,), dtype=dtype, device=device)
    draws = [
        random.normal(random.fold_in(k, "opake.block", b), (min(block, total - b * block),), dtype=dtype, device=device)
        for b in range(-(-total // block))
    ]
    return torch.cat(draws)


def _partitions(total, rng):
    """The whole range, one empty slice, and random cuts with repeats (empty slices) and cuts at block edges."""
    yield [0, total]
    yield [0, 0, total, total]
    edges = list(range(0, total + 1, SMALL_BLOCK))
    yield [0, *edges, total]
    for parts in (2, 3, 7, 20):
        cuts = sorted(rng.integers(0, total + 1, size=parts - 1).tolist() + rng.choice(edges, 2).tolist())
        yield [0, *cuts, total]


@pytest.mark.parametrize("impl", random.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("total", [1, 8 * SMALL_BLOCK + 13, SMALL_BLOCK, SMALL_BLOCK + 1])
def test_the_slices_of_any_partition_concatenate_to_the_whole_draw(monkeypatch, impl, dtype, total):
    monkeypatch.setitem(random._PHILOX_BLOCK, "cpu", SMALL_BLOCK)
    k = random.fold_in(random.key(11, impl=impl), "stream")
    whole = _reference(k, total, dtype)
    assert whole.shape == (total,) and torch.equal(random.normal_slice(k, total, 0, total, dtype=dtype), whole)
    rng = np.random.default_rng(total)
    for cuts in _partitions(total, rng):
        pieces = [random.normal_slice(k, total, a, b, dtype=dtype) for a, b in itertools.pairwise(cuts)]
        assert [p.numel() for p in pieces] == np.diff(cuts).tolist()
        assert all(p.dtype == dtype and p.device.type == "cpu" for p in pieces)
        assert torch.equal(torch.cat(pieces), whole), cuts


def test_a_philox_vector_of_one_block_is_the_plain_draw_and_longer_ones_are_blocks():
    k = random.key(2)
    block = random._PHILOX_BLOCK["cpu"]
    assert torch.equal(random.normal_slice(k, block, 5, block), random.normal(k, (block,))[5:])
    longer = random.normal_slice(k, block + 3, block - 2, block + 3)
    first = random.normal(random.fold_in(k, "opake.block", 0), (block,))
    assert torch.equal(longer, torch.cat([first[-2:], random.normal(random.fold_in(k, "opake.block", 1), (3,))]))


def test_a_chacha20_slice_far_into_the_stream_draws_only_its_own_blocks():
    k = random.key(3, impl="chacha20")
    total = 1 << 40  # a whole draw of this size could not be made: the slice starts at its block of the keystream
    far = random.normal_slice(k, total, total - 20, total, dtype=torch.float64)
    assert far.shape == (20,) and torch.isfinite(far).all()
    assert torch.equal(far[4:], random.normal_slice(k, total, total - 16, total, dtype=torch.float64))
    assert not torch.equal(far, random.normal_slice(k, total, 0, 20, dtype=torch.float64))


def _rows(shape, world):
    """Each rank's (start, stop) flat range of a leaf sharded on dim 0 as FSDP2 does (torch.chunk of the rows;
    ranks past the last chunk hold none)."""
    if not shape:
        return [(0, 1)] + [(0, 0)] * (world - 1)  # a scalar is not sharded: rank 0 holds it
    row = math.prod(shape[1:])
    chunks = torch.arange(shape[0]).chunk(world)
    out = [(int(c[0]) * row, (int(c[-1]) + 1) * row) if len(c) else (0, 0) for c in chunks]
    return out + [(shape[0] * row, shape[0] * row)] * (world - len(out))


@pytest.mark.parametrize("impl", random.IMPLS)
@pytest.mark.parametrize("world", [2, 4])
def test_normal_tree_is_the_union_of_the_shards_of_its_leaves(monkeypatch, impl, world):
    monkeypatch.setitem(random._PHILOX_BLOCK, "cpu", SMALL_BLOCK)
    shapes = [(37, 5), (5,), (1, 4), (0, 2), (), (3, 7, 2), (130,)]  # 383 values: six blocks of 64
    k = random.key(5, impl=impl)
    whole = random.normal_tree(k, [torch.zeros(s) for s in shapes], dtype=torch.float32)
    flat = torch.cat([w.reshape(-1) for w in whole])
    assert torch.equal(flat, _reference(random.fold_in(k, 0), flat.numel(), torch.float32))
    per_rank = [[_rows(s, world)[r] for s in shapes] for r in range(world)]
    shards = [random.normal_tree_shard(k, shapes, ranges, dtype=torch.float32) for ranges in per_rank]
    for i, shape in enumerate(shapes):
        for r in range(world):
            assert shards[r][i].shape == (per_rank[r][i][1] - per_rank[r][i][0],)
        assert torch.equal(torch.cat([shards[r][i] for r in range(world)]).view(shape), whole[i])


def test_philox_blocks_are_independent_draws(monkeypatch):
    """Distinct blocks of one vector are draws of distinct keys. With n = 4096 values per block, the correlation of
    two independent blocks is about N(0, 1/n): |corr| > 6 / sqrt(n) has probability 2e-9 per pair (6 pairs)."""
    block = 4096
    monkeypatch.setitem(random._PHILOX_BLOCK, "cpu", block)
    k = random.key(6)
    blocks = random.normal_slice(k, 4 * block, 0, 4 * block, dtype=torch.float64).view(4, block)
    corr = torch.corrcoef(torch.cat([blocks, random.normal(k, (1, block), dtype=torch.float64)]))
    off_diagonal = corr[~torch.eye(5, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 6 / math.sqrt(block)


@pytest.mark.parametrize("impl", random.IMPLS)
def test_a_slice_across_a_block_edge_is_standard_normal(impl):
    """check_noise at alpha 1e-3: a false alarm of at most 2e-3 (two tests) for a correct generator."""
    block = random._PHILOX_BLOCK["cpu"]
    k = random.key(7, impl=impl)
    piece = random.normal_slice(k, 2 * block, block - 20_000, block + 20_000, dtype=torch.float64)
    assert testing.check_noise(piece, std=1.0, alpha=1e-3).passed
    assert not testing.check_noise(piece, std=1.05, alpha=1e-3).passed


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: random.normal_slice(random.key(0), 10, 4, 3), ConfigurationError),
        (lambda: random.normal_slice(random.key(0), 10, 0, 11), ConfigurationError),
        (lambda: random.normal_slice(random.key(0), 10, -1, 3), ConfigurationError),
        (lambda: random.normal_slice(random.key(0), 10, True, 3), ConfigurationError),
        (lambda: random.normal_slice(random.key(0), 10.0, 0, 3), ConfigurationError),
        (lambda: random.normal_slice(random.key(0), 10, 0, 3, dtype=torch.int32), ConfigurationError),
        (lambda: random.normal_slice(7, 10, 0, 3), InputTypeError),
        (lambda: random.normal_tree_shard(random.key(0), [(2, 3)], [], dtype=torch.float32), ConfigurationError),
        (lambda: random.normal_tree_shard(random.key(0), [(2, 3)], [(0, 7)], dtype=torch.float32), ConfigurationError),
        (lambda: random.normal_tree_shard(random.key(0), [(2, 3)], [3], dtype=torch.float32), InputTypeError),
    ],
)
def test_refusals(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.cuda
@pytest.mark.parametrize("impl", random.IMPLS)
def test_cuda_slices_concatenate_to_the_whole_cuda_draw(monkeypatch, impl):
    monkeypatch.setitem(random._PHILOX_BLOCK, "cuda", 1 << 12)
    k = random.key(8, impl=impl)
    total, cuts = 5 * (1 << 12) + 7, [0, 1, 4095, 4097, 13_000, 5 * (1 << 12) + 7]
    whole = _reference(k, total, torch.float32, device="cuda")
    pieces = [random.normal_slice(k, total, a, b, device="cuda") for a, b in itertools.pairwise(cuts)]
    assert all(p.device.type == "cuda" for p in pieces) and torch.equal(torch.cat(pieces), whole)
