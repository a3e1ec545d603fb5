"""Keys: derivation, replay, serialization, repr, refusals; the philox generator on CPU and CUDA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.noise import gaussian_noise


def test_derivation_is_deterministic_and_domain_separated():
    k = random.key(42)
    assert k == random.key(42) and k != random.key(43)
    assert random.split(k, 3) == tuple(random.fold_in(k, i) for i in range(3))
    assert random.fold_in(k, 1, "a") == random.fold_in(random.fold_in(k, 1), "a")
    assert random.fold_in(k, 1) != random.fold_in(k, "1")
    assert random.fold_in(k, "ab", "c") != random.fold_in(k, "a", "bc")
    assert random.key(-1) != random.key(2**64 - 1)
    assert len(set(random.split(k, 1000))) == 1000


@pytest.mark.parametrize("impl", random.IMPLS)
def test_impl_is_kept_by_derivation(impl):
    k = random.key(42, impl=impl)
    assert k.impl == impl and random.key(42).impl == "philox"
    assert random.fold_in(k, 1, "a").impl == impl
    assert {c.impl for c in random.split(k, 3)} == {impl}
    assert random.random_key(impl=impl).impl == impl
    assert random.random_key(impl=impl) != random.random_key(impl=impl)


def test_keys_with_the_same_bits_and_other_impls_differ():
    philox, chacha = random.key(7), random.key(7, impl="chacha20")
    assert philox.hex == chacha.hex and philox != chacha
    assert random.fold_in(philox, 3).hex == random.fold_in(chacha, 3).hex


@pytest.mark.parametrize("impl", random.IMPLS)
def test_json_round_trip(impl):
    k = random.fold_in(random.key(2**100, impl=impl), "stream")
    text = json.dumps(random.key_to_json(k))
    assert random.key_from_json(json.loads(text)) == k


def test_json_of_philox_keys_is_unchanged_and_impl_is_written_otherwise():
    k = random.key(1)
    assert random.key_to_json(k) == {"opake_key": k.hex}
    assert random.key_from_json({"opake_key": k.hex}) == k  # checkpoints written before impl existed
    assert random.key_from_json({"opake_key": k.hex, "impl": "philox"}) == k
    c = random.key(1, impl="chacha20")
    assert random.key_to_json(c) == {"opake_key": c.hex, "impl": "chacha20"}


def test_repr_shows_a_fingerprint_and_never_the_key():
    k = random.key(3)
    text = repr(k)
    assert k.hex not in text and k.hex[:8] not in text and k.hex[-8:] not in text
    assert text.startswith("Key(fingerprint=") and text.endswith(", impl=philox)")
    fingerprint = text.split("=")[1].split(",")[0]
    assert len(fingerprint) == 8 and int(fingerprint, 16) >= 0
    assert repr(random.key(3)) == text and repr(random.key(4)) != text
    assert "impl=chacha20" in repr(random.key(3, impl="chacha20"))
    _, state = gaussian_noise(noise_multiplier=1.0, key=k)
    assert k.hex not in repr(state) and text in repr(state)  # keys reach logs through the reprs of states


def test_normal_replays_and_depends_on_key_shape_and_dtype():
    k = random.key(5)
    a = random.normal(k, (3, 4))
    assert a.dtype == torch.float32 and a.shape == (3, 4)
    assert torch.equal(a, random.normal(k, (3, 4)))
    assert not torch.equal(a, random.normal(random.key(6), (3, 4)))
    assert not torch.equal(a.double(), random.normal(k, (3, 4), dtype=torch.float64))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        draw = random.normal(k, (3,), dtype=dtype)
        assert draw.dtype == dtype and torch.equal(draw, random.normal(k, (3,), dtype=dtype))
    assert torch.equal(random.normal(k, (3,), dtype=torch.bfloat16), random.normal(k, (3,)).bfloat16())
    assert random.normal(k, ()).shape == () and random.normal(k, (0, 5)).shape == (0, 5)


def test_normal_leaves_the_global_generators_untouched():
    torch.manual_seed(0)
    np.random.seed(0)
    before = torch.rand(1), np.random.rand()
    torch.manual_seed(0)
    np.random.seed(0)
    for impl in random.IMPLS:
        random.normal(random.key(5, impl=impl), (10,))
    assert torch.equal(torch.rand(1), before[0]) and np.random.rand() == before[1]


def test_cpu_philox_is_keyed_by_128_bits():
    # The draw is NumPy's Philox-4x64 keyed by a 128-bit hash of the key (torch's CPU generator would keep 32 bits of
    # a seed): flipping any bit of the Philox key, high or low, changes the draw.
    k = random.key(11)
    bits = int.from_bytes(random._digest(b"philox-normal", random._key_bytes(k)), "little")
    want = np.random.Generator(np.random.Philox(key=bits)).standard_normal((64,), dtype=np.float32)
    assert np.array_equal(random.normal(k, (64,)).numpy(), want)
    for flip in (0, 31, 32, 63, 64, 127):
        other = np.random.Generator(np.random.Philox(key=bits ^ (1 << flip))).standard_normal((64,), dtype=np.float32)
        assert not np.array_equal(other, want)


def test_normal_many_of_philox_keys_equals_one_normal_per_key():
    keys, shapes = random.split(random.key(1), 3), [(2, 3), (), (5,)]
    for k, s, draw in zip(keys, shapes, random.normal_many(keys, shapes), strict=True):
        assert torch.equal(draw, random.normal(k, s))
    with pytest.raises(ConfigurationError):
        random.normal_many(keys, shapes[:2])


@pytest.mark.parametrize("impl", random.IMPLS)
def test_normal_tree_cuts_one_draw_per_device_into_the_leaves_in_order(impl):
    k = random.key(3, impl=impl)
    leaves = [torch.zeros(2, 3), torch.zeros(()), torch.zeros(0), torch.zeros(5, 1)]
    draws = random.normal_tree(k, leaves, dtype=torch.float64)
    flat = random.normal(random.fold_in(k, 0), (12,), dtype=torch.float64)
    assert [d.shape for d in draws] == [leaf.shape for leaf in leaves]
    assert all(d.dtype == torch.float64 for d in draws)
    assert torch.equal(torch.cat([d.reshape(-1) for d in draws]), flat)
    assert random.normal_tree(k, [], dtype=torch.float32) == []
    with pytest.raises(ConfigurationError, match="normal draws one of"):
        random.normal_tree(k, leaves, dtype=torch.int32)
    with pytest.raises(InputTypeError):
        random.normal_tree(7, leaves, dtype=torch.float32)


def test_numpy_generator_replays():
    k = random.key(9)
    assert np.array_equal(random.numpy_generator(k).random(5), random.numpy_generator(k).random(5))
    assert not np.array_equal(random.numpy_generator(k).random(5), random.numpy_generator(random.key(8)).random(5))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: random.key(1.5), InputTypeError),
        (lambda: random.key(True), InputTypeError),
        (lambda: random.key(1, impl="threefry"), ConfigurationError),
        (lambda: random.random_key(impl="mt19937"), ConfigurationError),
        (lambda: random.fold_in(random.key(0)), ConfigurationError),
        (lambda: random.fold_in(random.key(0), True), InputTypeError),
        (lambda: random.fold_in(random.key(0), 1.0), InputTypeError),
        (lambda: random.fold_in(0, 1), InputTypeError),
        (lambda: random.split(random.key(0), 0), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "zz"}), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "g" * 32}), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "0" * 32, "impl": "aes"}), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "0" * 32, "seed": 1}), InputTypeError),
        (lambda: random.key_from_json([1]), InputTypeError),
        (lambda: random.Key(-1, 0), InputTypeError),
        (lambda: random.Key(0, 0, "mt19937"), ConfigurationError),
        (lambda: random.normal(random.key(0), (2,), dtype=torch.int64), ConfigurationError),
        (lambda: random.normal(random.key(0), (2,), device="meta"), ConfigurationError),
    ],
)
def test_refusals(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.cuda
def test_cuda_normal_replays_and_ignores_device_index():
    k = random.key(1)
    a = random.normal(k, (1 << 16,), device="cuda")
    assert a.device.type == "cuda"
    assert torch.equal(a, random.normal(k, (1 << 16,), device="cuda"))
    assert torch.equal(a, random.normal(k, (1 << 16,), device=torch.device("cuda", torch.cuda.current_device())))
    assert not torch.equal(a, random.normal(random.key(2), (1 << 16,), device="cuda"))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert random.normal(k, (5,), dtype=dtype, device="cuda").dtype == dtype


@pytest.mark.cuda
def test_cuda_philox_depends_on_the_offset_bits():
    # Two keys equal in the 64 seed bits and different in the 62 offset bits give different draws.
    shape, seed = (1 << 20,), 0x0123_4567_89AB_CDEF
    base = random._philox_cuda_normal(seed, 0, shape, dtype=torch.float32, device=torch.device("cuda"))
    for offset in (4, 1 << 40, 2**64 - 4):
        draw = random._philox_cuda_normal(seed, offset, shape, dtype=torch.float32, device=torch.device("cuda"))
        assert torch.equal(
            draw, random._philox_cuda_normal(seed, offset, shape, dtype=torch.float32, device=torch.device("cuda"))
        )
        assert (draw != base).float().mean() > 0.99
    k = random.key(3)
    bits = int.from_bytes(random._digest(b"philox-normal", random._key_bytes(k)), "little")
    assert torch.equal(
        random.normal(k, shape, device="cuda"),
        random._philox_cuda_normal(
            bits & (2**64 - 1), (bits >> 64) & ~3, shape, dtype=torch.float32, device=torch.device("cuda")
        ),
    )


@pytest.mark.cuda
def test_cuda_normal_leaves_the_global_cuda_generator_untouched():
    before = torch.cuda.get_rng_state()
    for impl in random.IMPLS:
        random.normal(random.key(5, impl=impl), (1 << 16,), device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
