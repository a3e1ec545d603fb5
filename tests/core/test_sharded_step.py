"""Sharded private training (FSDP2 layout): W ranks that each hold dim-0 rows of every parameter add exactly the
one-process noise, keep exactly their rows of the MF buffers, and together take the one-process step."""

from __future__ import annotations

import math
import threading

import optree
import pytest
import torch

from opake_core import Clipped, Shard, mf, optim, per_group, random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf import mf_gaussian_noise
from opake_core.moments import ClippedMoments
from opake_core.noise import add_gaussian_noise, gaussian_noise, paired_mf_gaussian_noise
from opake_core.step import dp_ftrl, dp_sgd, dp_step

WORLDS = (1, 2, 3, 4)
# (37, 5): 185 values, so that shard edges fall inside and across vectorized blocks of the elementwise kernels
SHAPES = {"a": (5, 3), "b": (7,), "c": (2, 2, 2), "d": (1, 4), "e": (), "f": (37, 5)}


def _leaf_shapes(tree):
    return [tuple(x.shape) for x in optree.tree_leaves(tree)]


def _local(tree, shard):
    """A rank's part of a global tree: its shard's flat ranges (which the first test checks against torch.chunk)."""
    leaves, treedef = optree.tree_flatten(tree)
    pieces = []
    for leaf, (start, stop) in zip(leaves, shard.ranges, strict=True):
        flat = leaf.reshape(-1)[start:stop].clone()
        pieces.append(flat.reshape(()) if leaf.dim() == 0 and stop > start else flat.reshape(-1, *leaf.shape[1:]))
    return optree.tree_unflatten(treedef, pieces)


def _joined(locals_, like):
    """The global tree from the ranks' local trees: rows concatenated in rank order, a 0-d leaf from its holder."""
    per_rank = [optree.tree_leaves(t) for t in locals_]
    leaves, treedef = optree.tree_flatten(like)
    out = []
    for i, leaf in enumerate(leaves):
        pieces = [rank[i] for rank in per_rank]
        out.append(next(p for p in pieces if p.numel()) if leaf.dim() == 0 else torch.cat(pieces))
    return optree.tree_unflatten(treedef, out)


def _tree(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=dtype) for name, shape in SHAPES.items()}


def _shards(tree, world):
    return [Shard.rows(_leaf_shapes(tree), rank=r, world_size=world) for r in range(world)]


# (a) the layout


@pytest.mark.parametrize("world", WORLDS)
def test_rows_cover_every_coordinate_once_as_torch_chunk_cuts_dim_0(world):
    shapes = [*SHAPES.values(), (0, 2), (2, 5)]
    shards = [Shard.rows(shapes, rank=r, world_size=world) for r in range(world)]
    for i, shape in enumerate(shapes):
        size = math.prod(shape)
        covered = torch.zeros(size, dtype=torch.long)
        for shard in shards:
            start, stop = shard.ranges[i]
            covered[start:stop] += 1
        assert torch.equal(covered, torch.ones(size, dtype=torch.long)), (shape, [s.ranges[i] for s in shards])
        whole = torch.arange(size).reshape(shape)
        if shape:  # torch.chunk's rows, then no rows for the ranks past its last chunk
            chunks = whole.chunk(world)
            expected = [chunks[r] if r < len(chunks) else whole[shape[0] :] for r in range(world)]
        else:  # a scalar: rank 0 holds it
            expected = [whole] + [whole.reshape(-1)[:0]] * (world - 1)
        for r, shard in enumerate(shards):
            start, stop = shard.ranges[i]
            assert torch.equal(whole.reshape(-1)[start:stop], expected[r].reshape(-1)), (shape, r)
            assert shard.local_shapes[i] == tuple(expected[r].shape), (shape, r)


@pytest.mark.parametrize(
    ("shapes", "ranges", "error", "match"),
    [
        ([(4, 3)], [(0, 6), (0, 1)], ConfigurationError, "one .start, stop. range per leaf"),
        ([(4, 3)], [(0, 13)], ConfigurationError, "start <= stop <= 12"),
        ([(4, 3)], [(6, 3)], ConfigurationError, "start <= stop"),
        ([(4, 3)], [(0, 4)], ConfigurationError, "multiples of the row size 3"),
        ([(4, 3)], [(-3, 3)], ConfigurationError, "start"),
        ([()], [(0, 2)], ConfigurationError, "<= 1"),
        ([(4, 3)], [(0.0, 3)], InputTypeError, "start"),
        ([(4, 3)], [3], InputTypeError, "pair"),
        ([(4, -3)], [(0, 0)], ConfigurationError, "dims"),
        ([(3, 0)], [(0, 0)], ConfigurationError, "empty rows"),
        ("ab", [(0, 0)], InputTypeError, "sequence"),
    ],
)
def test_a_shard_refuses_what_is_not_whole_rows_of_the_leaves(shapes, ranges, error, match):
    with pytest.raises(error, match=match):
        Shard(shapes, ranges)


def test_rows_refuses_a_rank_outside_the_world():
    with pytest.raises(ConfigurationError, match="rank must be in"):
        Shard.rows([(4,)], rank=2, world_size=2)
    with pytest.raises(ConfigurationError, match="world_size"):
        Shard.rows([(4,)], rank=0, world_size=0)


# (b) the noise


def _mechanisms():
    """``{name: make(template, shard, key) -> (noise_fn, state)}``: the privatizers, one-process for no shard."""
    n_steps = 5

    def matrix(strategy):
        concrete = mf.optimize(strategy, n_steps)
        return lambda template, shard, key: mf_gaussian_noise(
            template, concrete, n_steps=n_steps, noise_multiplier=1.3, key=key, shard=shard
        )

    return {
        "gaussian": lambda template, shard, key: gaussian_noise(noise_multiplier=1.3, key=key, shard=shard),
        "identity": matrix(mf.identity()),
        "band_mf": matrix(mf.band_mf(bands=3)),
        "blt": matrix(mf.blt(max_buffers=2)),
        "bsr": matrix(mf.bsr(bandwidth=3)),
        "bisr": matrix(mf.bisr(bandwidth=3)),
        "lambda_cgd": matrix(mf.lambda_cgd(0.5)),
    }


def _assert_sharded_equals_whole(make, world, impl, sensitivity, *, steps=5, dtype=torch.float32):
    """Run the one-process mechanism and the W ranks' sharded ones side by side over ``steps`` steps: the ranks'
    noised outputs and buffers, put together, equal the one-process ones bit for bit."""
    key = random.key(4, impl=impl)
    template = _tree(0, dtype)
    shards = _shards(template, world)
    whole_fn, whole_state = make(template, None, key)
    ranks = [make(_local(template, s), s, key) for s in shards]
    rank_states = [state for _, state in ranks]
    for step in range(steps):
        clipped = _tree(10 + step, dtype)
        noised, whole_state = whole_fn(Clipped(clipped, sensitivity), whole_state)
        outputs = []
        for r, ((fn, _), shard) in enumerate(zip(ranks, shards, strict=True)):
            out, rank_states[r] = fn(Clipped(_local(clipped, shard), sensitivity), rank_states[r])
            assert _leaf_shapes(out.value) == list(shard.local_shapes)
            assert out.noise_std == noised.noise_std and out.sensitivity == noised.sensitivity
            outputs.append(out.value)
        joined = _joined(outputs, noised.value)
        for name in SHAPES:
            assert torch.equal(joined[name], noised.value[name]), (name, step)
            assert not torch.equal(noised.value[name], clipped[name].to(noised.value[name].dtype)), name
        assert all(s.step == whole_state.step for s in rank_states)
        for j, buffer in enumerate(whole_state.buffers):
            for i, leaf in enumerate(buffer):
                rank_leaves = [s.buffers[j][i] for s in rank_states]
                assert [tuple(x.shape) for x in rank_leaves] == [s.local_shapes[i] for s in shards]
                joined_leaf = next(x for x in rank_leaves if x.numel()) if leaf.dim() == 0 else torch.cat(rank_leaves)
                assert torch.equal(joined_leaf, leaf), (j, i, step)
    return whole_state


@pytest.mark.parametrize("impl", random.IMPLS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mechanism", list(_mechanisms()))
def test_the_ranks_noise_put_together_is_the_one_process_noise(mechanism, world, impl):
    last = _assert_sharded_equals_whole(_mechanisms()[mechanism], world, impl, sensitivity=0.25)
    assert (len(last.buffers) > 0) == (mechanism in ("band_mf", "blt", "bsr", "bisr", "lambda_cgd"))


@pytest.mark.parametrize("world", (2, 3))
def test_sharded_noise_with_bf16_compute_and_float32_buffers(world):
    def make(template, shard, key):
        strategy = mf.optimize(mf.band_mf(bands=2), 3)
        return mf_gaussian_noise(
            template, strategy, n_steps=3, noise_multiplier=1.0, key=key, compute_dtype=torch.bfloat16, shard=shard
        )

    last = _assert_sharded_equals_whole(make, world, "philox", sensitivity=0.5, steps=3, dtype=torch.bfloat16)
    assert last.buffers[0][0].dtype == torch.float32


@pytest.mark.parametrize("world", (2, 4))
def test_per_group_sensitivities_stay_per_leaf_under_a_shard(world):
    groups = per_group(_tree(0), {"^[ab]$": 0.1, "^f$": 2.0}, fallback=1.0)

    def make(template, shard, key):
        return gaussian_noise(noise_multiplier=1.5, key=key, shard=shard)

    _assert_sharded_equals_whole(make, world, "philox", sensitivity=groups, steps=2)


@pytest.mark.parametrize("world", (2, 3))
def test_paired_streams_and_the_pure_function_shard_too(world):
    template, key = _tree(0), random.key(6)
    shards = _shards(template, world)
    moments = ClippedMoments(Clipped(_tree(1), 0.5), Clipped(optree.tree_map(torch.abs, _tree(2)), 0.25))

    def local_moments(shard):
        return ClippedMoments(
            *(Clipped(_local(m.value, shard), m.sensitivity) for m in (moments.first, moments.second))
        )

    strategy = mf.optimize(mf.band_mf(bands=2), 3)
    paired = {"strategy": strategy, "second_moment_strategy": strategy, "n_steps": 3, "noise_multiplier": 1.0}
    makers = [
        lambda t, shard: gaussian_noise(noise_multiplier=1.0, key=key, shard=shard),
        lambda t, shard: paired_mf_gaussian_noise(t, key=key, shard=shard, **paired),
    ]
    for make in makers:
        whole_fn, whole_state = make(template, None)
        rank_runs = [make(_local(template, s), s) for s in shards]
        for _ in range(2):
            whole, whole_state = whole_fn(moments, whole_state)
            outs = []
            for r, shard in enumerate(shards):
                fn, state = rank_runs[r]
                out, state = fn(local_moments(shard), state)
                rank_runs[r] = (fn, state)
                outs.append(out)
            for stream in ("first", "second"):
                joined = _joined([getattr(o, stream).value for o in outs], template)
                assert all(torch.equal(joined[n], getattr(whole, stream).value[n]) for n in SHAPES), stream
    clipped = Clipped(_tree(3), 0.5)
    direct = [
        add_gaussian_noise(Clipped(_local(clipped.value, s), 0.5), noise_multiplier=1.0, key=key, step=3, shard=s)
        for s in shards
    ]
    whole = add_gaussian_noise(clipped, noise_multiplier=1.0, key=key, step=3)
    joined = _joined([d.value for d in direct], template)
    assert all(torch.equal(joined[n], whole.value[n]) for n in SHAPES)


def test_a_sharded_mechanism_refuses_leaves_that_are_not_its_rows():
    template = _tree(0)
    shard = Shard.rows(_leaf_shapes(template), rank=1, world_size=2)
    noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0), shard=shard)
    with pytest.raises(ConfigurationError, match="local leaf shapes"):
        noise_fn(Clipped(template, 1.0), state)  # the global tree, not the rank's rows
    with pytest.raises(ConfigurationError, match="local leaf shapes"):
        mf_gaussian_noise(
            template, mf.band_mf(bands=2), n_steps=3, noise_multiplier=1.0, key=random.key(0), shard=shard
        )
    with pytest.raises(InputTypeError, match="Shard"):
        gaussian_noise(noise_multiplier=1.0, key=random.key(0), shard=[(0, 1)])


# (c) the composed step on W simulated ranks


def _loss(p, x, y):
    """One example's loss; every leaf gets a gradient."""
    h = torch.tanh(p["a"] @ x)  # [5]
    g = torch.tanh(p["f"] @ torch.cat([x, x[:2]]))  # [37]
    pred = p["b"][:5] @ h + h.sum() * p["d"].sum() + p["c"].sum() * p["e"] + g.sum() * 0.1 + (p["b"] ** 2).sum() * 0.01
    return (pred - y) ** 2


def _data(n):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(n, 3, generator=gen) * 2, torch.randn(n, generator=gen)


def _cuts(n, world):
    """Each rank's examples: uneven shares, and from 3 ranks on the last one with none (a valid, empty step)."""
    if world < 3:
        return [(0, n)] if world == 1 else [(0, 4), (4, n)]
    edges = torch.linspace(0, n, world).round().long().tolist()  # world - 1 shares, then an empty one
    return [(edges[i], edges[i + 1]) for i in range(world - 1)] + [(n, n)]


class _Group:
    """W ranks in threads and a reduce-scatter between them: each rank's full-size clipped sum is summed over the
    ranks (in rank order, so every rank computes the same sum) and cut to the rank's rows."""

    def __init__(self, world):
        self.world, self.barrier, self.slots = world, threading.Barrier(world), [None] * world

    def reduce(self, rank, shard):
        def reduce_scatter(clipped):
            self.slots[rank] = clipped.value
            self.barrier.wait()
            total = optree.tree_map(lambda *xs: sum(xs[1:], xs[0]), *self.slots)
            self.barrier.wait()  # every rank has read the slots before any writes the next step's
            return Clipped(_local(total, shard), clipped.sensitivity)

        return reduce_scatter

    def run(self, fns):
        results, errors = [None] * self.world, []

        def target(r):
            try:
                results[r] = fns[r]()
            except BaseException as exc:  # surfaced below, with the barrier broken so no rank waits forever
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:  # the first rank's own failure, not the broken barrier it left the others
            raise sorted(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))[0]
        return results


@pytest.mark.parametrize("impl", random.IMPLS)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("mechanism", ["dp_sgd", "dp_ftrl"])
@pytest.mark.parametrize("world", WORLDS)
def test_w_ranks_take_the_one_process_step_on_the_union_batch(world, mechanism, optimizer, impl):
    steps, n = 4, 11
    opt = optim.sgd(lr=0.2) if optimizer == "sgd" else optim.adam(lr=0.05)
    params, (x, y) = _tree(0), _data(steps * n)
    key = random.key(9, impl=impl)
    common = {"clipping_norm": 0.8, "noise_multiplier": 0.7, "key": key, "optimizer": opt, "expected_batch_size": 10.0}
    strategy = mf.optimize(mf.band_mf(bands=2), steps)

    def build(local, **sharding):
        if mechanism == "dp_sgd":
            return dp_sgd(_loss, **common, **sharding)
        return dp_ftrl(_loss, params=local, strategy=strategy, n_steps=steps, **common, **sharding)

    step_fn, dp_state = build(params)
    whole, opt_state = params, opt.init(params)

    group, shards = _Group(world), _shards(params, world)
    gathered = [optree.tree_map(torch.clone, params) for _ in range(world)]  # each rank's unsharded parameters
    ranks = []
    for r, shard in enumerate(shards):
        local = _local(params, shard)
        fn, state = build(local, shard=shard, sum_like=gathered[r], reduce=group.reduce(r, shard))
        ranks.append([fn, local, opt.init(local), state])

    for t in range(steps):
        batch = (x[t * n : (t + 1) * n], y[t * n : (t + 1) * n])
        whole, opt_state, dp_state, metrics = step_fn(whole, opt_state, dp_state, batch)
        current = _joined([rank[1] for rank in ranks], params)
        for r in range(world):  # FSDP's all-gather: every rank forms its sum at the current global parameters
            optree.tree_map(lambda dst, src: dst.copy_(src), gathered[r], current)

        def rank_step(r, batch=batch):
            fn, local, local_opt, state = ranks[r]
            lo, hi = _cuts(n, world)[r]
            return fn(local, local_opt, state, (batch[0][lo:hi], batch[1][lo:hi]))

        results = group.run([lambda r=r: rank_step(r) for r in range(world)])
        for r, (local, local_opt, state, rank_metrics) in enumerate(results):
            ranks[r][1:] = [local, local_opt, state]
            assert rank_metrics.noise_std == metrics.noise_std > 0
        assert sum(m.batch_size for *_, m in results) == metrics.batch_size

    joined = _joined([rank[1] for rank in ranks], params)
    moved = max((whole[k] - params[k]).abs().max().item() for k in SHAPES)
    assert moved > 0.05  # the runs moved: a comparison of untouched parameters would prove nothing
    for name in SHAPES:
        assert _leaf_shapes({name: joined[name]}) == [SHAPES[name]]
        torch.testing.assert_close(joined[name], whole[name], rtol=1e-6, atol=1e-6, msg=name)


def test_sum_like_forms_the_sum_and_the_default_path_is_unchanged():
    params, (x, y) = _tree(0), _data(6)
    opt = optim.adam(lr=0.1)
    options = {"clipping": 0.8, "optimizer": opt, "expected_batch_size": 5.0}
    default_fn, state = dp_step(_loss, noise=gaussian_noise(noise_multiplier=1.0, key=random.key(1)), **options)
    copy = optree.tree_map(torch.clone, params)
    like_fn, _ = dp_step(_loss, noise=gaussian_noise(noise_multiplier=1.0, key=random.key(1)), sum_like=copy, **options)
    a = default_fn(params, opt.init(params), state, (x, y))[0]
    b = like_fn(params, opt.init(params), state, (x, y))[0]
    assert all(torch.equal(a[k], b[k]) for k in SHAPES)
    # the sum is formed at sum_like's values, the update applied to params
    shifted = optree.tree_map(lambda p: p + 1.0, params)
    shifted_fn, _ = dp_step(
        _loss, noise=gaussian_noise(noise_multiplier=0.0, key=random.key(1)), sum_like=shifted, **options
    )
    reference_fn, _ = dp_step(_loss, noise=gaussian_noise(noise_multiplier=0.0, key=random.key(1)), **options)
    update = shifted_fn(params, opt.init(params), state, (x, y))[0]
    expected = reference_fn(shifted, opt.init(shifted), state, (x, y))[0]
    assert all(torch.allclose(update[k] + 1.0, expected[k], atol=1e-6) for k in SHAPES)


def test_sharded_steps_refuse_a_mismatched_sum_like_or_no_reduce():
    params = _tree(0)
    shard = Shard.rows(_leaf_shapes(params), rank=0, world_size=2)
    local = _local(params, shard)
    common = {"clipping_norm": 1.0, "noise_multiplier": 1.0, "key": random.key(0), "optimizer": optim.sgd(lr=0.1)}
    common["expected_batch_size"] = 4.0
    with pytest.raises(ConfigurationError, match="sum_like= a tree of the global shapes"):
        dp_sgd(_loss, shard=shard, reduce=lambda c: c, **common)
    with pytest.raises(ConfigurationError, match="sum_like= a tree of the global shapes"):
        dp_sgd(_loss, shard=shard, sum_like=local, reduce=lambda c: c, **common)
    with pytest.raises(ConfigurationError, match="needs reduce="):
        dp_ftrl(_loss, params=local, strategy=mf.identity(), n_steps=2, shard=shard, sum_like=params, **common)
    with pytest.raises(InputTypeError, match="floating-point tensors"):
        dp_sgd(_loss, sum_like={"a": 1.0}, **common)
    step_fn, state = dp_sgd(_loss, sum_like={"a": params["a"]}, **common)
    with pytest.raises(InputTypeError, match="tree structure of params"):
        step_fn(params, common["optimizer"].init(params), state, _data(2))
