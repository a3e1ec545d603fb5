"""Explicit, counter-based random keys.

A key is 128 bits of state plus the name of the generator that turns it into Gaussian noise (``impl``, in the style
of JAX's typed keys). ``split`` and ``fold_in`` derive child keys by hashing (BLAKE2b) the parent with a type-tagged
counter or string, so a derived key depends only on its parent and the path that led to it, never on how many draws
happened before; children keep their parent's ``impl``. Draws are made from a key with :func:`normal` (on any
device) and :func:`numpy_generator` (host-side sampling).

Generators of :func:`normal`, by ``key.impl``:

* ``"philox"`` (the default): counter-based Philox keyed by all 128 bits of a hash of the key. On the CPU, NumPy's
  Philox-4x64 bit generator (128-bit key) with its ziggurat sampler; on CUDA, torch's Philox-4x32 with a 64-bit seed
  and a counter offset taken from 62 more bits, so every draw depends on 126 key bits. Fast, statistically strong,
  not a cryptographic generator.
* ``"chacha20"`` (hardened): the ChaCha20 block function of RFC 8439 keyed by 256 bits derived from the key, run with
  torch integer operations on the target device, and Box-Muller in float64. Slower, cryptographically strong, and the
  same values on every device type.

Keys are secret state: anyone who knows a key can recompute the noise it generated and remove it. ``repr(key)``
shows only a fingerprint; ``key.hex`` is the explicit accessor. Nothing here touches the global random state.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import size_groups

__all__ = [
    "IMPLS",
    "Key",
    "fold_in",
    "key",
    "key_from_json",
    "key_to_json",
    "normal",
    "normal_many",
    "normal_slice",
    "normal_tree",
    "normal_tree_groups",
    "normal_tree_shard",
    "numpy_generator",
    "random_key",
    "split",
]

IMPLS = ("philox", "chacha20")
"""The noise generators a key can name (``Key.impl``): ``"philox"`` (the default) and ``"chacha20"`` (hardened)."""
_MASK64 = (1 << 64) - 1
_PHILOX_BLOCK = {"cpu": 1 << 20, "cuda": 1 << 24}
"""Coordinates per block of a philox key's flat vector above this size (:func:`normal_slice`), by device type.
Neither NumPy's ziggurat nor torch's CUDA kernel can start a draw in the middle, so a long vector is cut into blocks
drawn from keys of their own, and a slice draws only the blocks it overlaps: at most two blocks of values it does not
keep. A block costs some tens of microseconds besides its draw (a key hash, a generator call). On the CPU (about
10 ns a value) 2**20 keeps that cost near 1% and a slice's waste near 20 ms; a GPU draws 2**24 values in well under
a millisecond, so larger blocks there cut the per-block cost at almost no waste."""


@dataclass(frozen=True)
class Key:
    """A 128-bit random key and the name of its noise generator (one of :data:`IMPLS`).

    Build one with :func:`key` or :func:`random_key`; derive others with :func:`split` and :func:`fold_in`.

    Example: a key's repr is a fingerprint, never the secret.

        >>> from opake_core import random
        >>> k = random.key(0)
        >>> repr(k) == repr(random.key(0)) != repr(random.key(1)), k.hex in repr(k)
        (True, False)
        >>> len(k.hex), k.impl
        (32, 'philox')
    """

    hi: int
    lo: int
    impl: str = "philox"

    def __post_init__(self) -> None:
        for name in ("hi", "lo"):
            word = getattr(self, name)
            if type(word) is not int or not 0 <= word <= _MASK64:
                raise InputTypeError(
                    f"Key.{name} must be an int in [0, 2**64), got {word!r}; build keys with key(seed)."
                )
        _check_impl(self.impl)

    def __repr__(self) -> str:
        # Keys reach logs through the reprs of states: show a fingerprint that identifies the key without revealing it.
        fingerprint = hashlib.blake2b(_key_bytes(self), digest_size=4, person=b"opake.keyprint").hexdigest()
        return f"Key(fingerprint={fingerprint}, impl={self.impl})"

    @property
    def hex(self) -> str:
        """The 32-character hexadecimal form of the 128 bits, as written by :func:`key_to_json`. It is the secret."""
        return f"{self.hi:016x}{self.lo:016x}"


def _check_impl(impl: Any) -> None:
    if impl not in IMPLS:
        raise ConfigurationError(f"impl must be one of {IMPLS}, got {impl!r}.")


def _digest(*parts: bytes, size: int = 16, person: bytes = b"opake.random") -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=size, person=person).digest()


def _hash(impl: str, *parts: bytes) -> Key:
    digest = _digest(*parts)
    return Key(int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little"), impl)


def _key_bytes(k: Key) -> bytes:
    return k.hi.to_bytes(8, "little") + k.lo.to_bytes(8, "little")


def _check_key(k: Any, where: str) -> None:
    if not isinstance(k, Key):
        raise InputTypeError(
            f"{where} expects an opake_core.random.Key, got {type(k).__name__}; build one with key(seed)."
        )


def key(seed: int, *, impl: str = "philox") -> Key:
    """The root key for an integer seed (any size, negative allowed), drawing noise with generator ``impl``.

    Whoever knows the seed can recompute every noise draw: use :func:`random_key` for private runs.

    Example: the same seed gives the same key, hence the same draws.

        >>> import torch
        >>> from opake_core import random
        >>> torch.equal(random.normal(random.key(42), (3,)), random.normal(random.key(42), (3,)))
        True
        >>> random.key(42) == random.key(43), random.key(42, impl="chacha20").impl
        (False, 'chacha20')
    """
    if type(seed) is not int:
        raise InputTypeError(f"key(seed) needs an int seed, got {type(seed).__name__} {seed!r}.")
    _check_impl(impl)
    return _hash(impl, b"seed", _encode_int(seed))


def random_key(*, impl: str = "philox") -> Key:
    """A root key from 128 bits of the operating system's entropy source (``secrets``): no seed can replay it.

    Example:

        >>> from opake_core import random
        >>> random.random_key() == random.random_key()  # 2^-128 odds of a repeat
        False
    """
    return key(secrets.randbits(128), impl=impl)


def _encode_int(value: int) -> bytes:
    length = (value.bit_length() + 8) // 8
    return length.to_bytes(2, "little") + value.to_bytes(length, "little", signed=True)


def _encode(item: Any) -> bytes:
    if isinstance(item, bool) or not isinstance(item, int | str):
        raise InputTypeError(f"fold_in data must be int or str (not bool), got {type(item).__name__} {item!r}.")
    if isinstance(item, int):
        return b"i" + _encode_int(item)
    raw = item.encode("utf-8")
    return b"s" + len(raw).to_bytes(4, "little") + raw


def fold_in(k: Key, *data: int | str) -> Key:
    """A child key for the given integers and string tags; ``fold_in(k, a, b) == fold_in(fold_in(k, a), b)``.

    Integer and string data never collide (``fold_in(k, 1) != fold_in(k, "1")``), so string tags name streams
    that cannot clash with the integer children of :func:`split`. The child has the parent's ``impl``.

    Example: the key of step 5 of a named stream, whatever was drawn before it.

        >>> from opake_core import random
        >>> root = random.key(0)
        >>> random.fold_in(root, "noise", 5) == random.fold_in(random.fold_in(root, "noise"), 5)
        True
        >>> random.fold_in(root, 1) == random.fold_in(root, "1")
        False
    """
    _check_key(k, "fold_in")
    if not data:
        raise ConfigurationError("fold_in(key, *data) needs at least one int or str to fold in, got none.")
    for item in data:
        k = _hash(k.impl, b"fold", _key_bytes(k), _encode(item))
    return k


def split(k: Key, num: int = 2) -> tuple[Key, ...]:
    """``num`` independent child keys: ``split(k, n)[i] == fold_in(k, i)``.

    Example:

        >>> from opake_core import random
        >>> noise_key, sampling_key = random.split(random.key(0))
        >>> noise_key != sampling_key, sampling_key == random.fold_in(random.key(0), 1)
        (True, True)
    """
    _check_key(k, "split")
    if type(num) is not int or num < 1:
        raise ConfigurationError(f"split(key, num) needs an int num >= 1, got {num!r}.")
    return tuple(fold_in(k, i) for i in range(num))


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def normal(
    k: Key,
    shape: tuple[int, ...] | torch.Size,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal draws of ``shape`` and floating ``dtype`` generated on ``device``, by the key's generator.

    The values depend only on (key, shape, dtype, device type) and replay bit-exactly; CUDA draws of a philox key
    also depend on the GPU model (torch's kernel splits the Philox counter space by the number of multiprocessors).
    A chacha20 key gives the same values on every device type. The global random state is never touched.

    Example: a million draws have mean 0 and standard deviation 1 to within a few thousandths.

        >>> import torch
        >>> from opake_core import random
        >>> z = random.normal(random.key(0), (1_000_000,), dtype=torch.float64)
        >>> abs(z.mean().item()) < 0.005, abs(z.std().item() - 1) < 0.005
        (True, True)
        >>> z.dtype, random.normal(random.key(0), (2, 3)).shape
        (torch.float64, torch.Size([2, 3]))
    """
    _check_key(k, "normal")
    shape, device = tuple(shape), torch.device(device)
    _check_dtype(dtype)
    if k.impl == "chacha20":
        return _chacha20_normals([k], [shape], dtype=dtype, device=device)[0]
    bits = int.from_bytes(_digest(b"philox-normal", _key_bytes(k)), "little")  # 128 bits
    if device.type == "cpu":
        gen = np.random.Generator(np.random.Philox(key=bits))
        draw = gen.standard_normal(shape, dtype=np.float64 if dtype == torch.float64 else np.float32)
        return torch.from_numpy(draw).to(dtype)
    if device.type == "cuda":
        return _philox_cuda_normal(bits & _MASK64, (bits >> 64) & ~3, shape, dtype=dtype, device=device)
    raise ConfigurationError(
        f"philox keys draw on cpu and cuda, got device {device}; use a chacha20 key (key(seed, impl='chacha20')), "
        "which draws with integer tensor operations on any device."
    )


def normal_many(
    keys: Sequence[Key],
    shapes: Sequence[tuple[int, ...] | torch.Size],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """``[normal(k, s, dtype=dtype, device=device) for k, s in zip(keys, shapes)]``, bit-identical, faster.

    The chacha20 keys' draws are made in one vectorized pass over all their blocks, where one call per key would
    launch ~600 small kernels per key (a tree of many small leaves); philox keys are drawn one by one.

    Example:

        >>> import torch
        >>> from opake_core import random
        >>> keys = random.split(random.key(0, impl="chacha20"), 3)
        >>> draws = random.normal_many(keys, [(2,), (3,), (4,)])
        >>> all(torch.equal(d, random.normal(k, d.shape)) for k, d in zip(keys, draws))
        True
    """
    keys, shapes, device = list(keys), [tuple(s) for s in shapes], torch.device(device)
    if len(keys) != len(shapes):
        raise ConfigurationError(f"normal_many needs one shape per key, got {len(keys)} keys and {len(shapes)} shapes.")
    for k in keys:
        _check_key(k, "normal_many")
    _check_dtype(dtype)
    hardened = [i for i, k in enumerate(keys) if k.impl == "chacha20"]
    draws = _chacha20_normals([keys[i] for i in hardened], [shapes[i] for i in hardened], dtype=dtype, device=device)
    out = dict(zip(hardened, draws, strict=True))
    return [
        out[i] if i in out else normal(k, s, dtype=dtype, device=device)
        for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    ]


def normal_slice(
    k: Key,
    total: int,
    start: int,
    stop: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Coordinates ``[start, stop)`` (a 1-D tensor of ``stop - start`` values) of the flat standard normal vector of
    length ``total`` that ``k`` defines, drawn without the rest: the slices of any partition of ``[0, total)``,
    concatenated, equal ``normal_slice(k, total, 0, total)`` bit for bit (same dtype and device type, and for a
    philox key on CUDA the same GPU model, as for :func:`normal`).

    The vector of a chacha20 key is ``normal(k, (total,))``: slices start at block ``start // 8`` of the keystream. A
    philox key of ``total`` up to a block (2**20 coordinates on the CPU, 2**24 on CUDA) gives ``normal(k, (total,))``
    too; above, block ``b`` (the last one shorter) is ``normal(fold_in(k, "opake.block", b), (its length,))``, and a
    slice draws only the blocks it overlaps. This is how each rank of a sharded model draws the noise of its own
    coordinates only.

    Example: two halves make the whole vector.

        >>> import torch
        >>> from opake_core import random
        >>> k = random.key(0)
        >>> halves = [random.normal_slice(k, 10, 0, 4), random.normal_slice(k, 10, 4, 10)]
        >>> torch.equal(torch.cat(halves), random.normal_slice(k, 10, 0, 10)), halves[1].shape
        (True, torch.Size([6]))
    """
    _check_key(k, "normal_slice")
    _check_dtype(dtype)
    _check_range("normal_slice", total, start, stop, "total")
    return _normal_ranges(k, total, [(start, stop)], dtype=dtype, device=torch.device(device))[0]


def normal_tree(k: Key, tensors: Sequence[torch.Tensor], *, dtype: torch.dtype) -> list[torch.Tensor]:
    """Standard normal draws shaped and placed like ``tensors`` (the leaves of a tree), from one key and one draw
    per device: the tensors on the ``d``-th device to appear are consecutive pieces, in order, of
    ``normal_slice(fold_in(k, d), n, 0, n)`` with ``n`` their total size. One generator call per device (per block
    of 2**20 values on the CPU, 2**24 on CUDA, for a philox key) instead of one per leaf (a model has hundreds of
    leaves); the pieces are views of that draw. :func:`normal_tree_shard` draws any part of it alone.

    Example: two leaves on the CPU are the two pieces of one draw.

        >>> import torch
        >>> from opake_core import random
        >>> k = random.key(0)
        >>> a, b = random.normal_tree(k, [torch.zeros(2, 2), torch.zeros(3)], dtype=torch.float32)
        >>> torch.equal(torch.cat([a.flatten(), b]), random.normal(random.fold_in(k, 0), (7,)))
        True
    """
    _check_key(k, "normal_tree")
    _check_dtype(dtype)
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for d, (device, indices) in enumerate(by_device.items()):
        sizes = [tensors[i].numel() for i in indices]
        flat = _normal_ranges(fold_in(k, d), sum(sizes), [(0, sum(sizes))], dtype=dtype, device=device)[0]
        for i, piece in zip(indices, flat.split(sizes), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out


def normal_tree_groups(
    k: Key, tensors: Sequence[torch.Tensor], *, dtype: torch.dtype, group_numel: int
) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """:func:`normal_tree`'s draws one group of leaves at a time: ``(indices, draws)`` for consecutive leaves of one
    device holding at most ``group_numel`` values together (a larger leaf alone), ``draws[j]`` equal bit for bit to
    ``normal_tree(k, tensors, dtype=dtype)[indices[j]]``. Only one group's draw is in memory at a time: noise for a
    model of P values needs ``group_numel`` values of scratch, not P.

    Example: three leaves in groups of at most 4 values are the pieces of the one draw.

        >>> import torch
        >>> from opake_core import random
        >>> k, leaves = random.key(0), [torch.zeros(3), torch.zeros(2), torch.zeros(2)]
        >>> whole = random.normal_tree(k, leaves, dtype=torch.float32)
        >>> groups = list(random.normal_tree_groups(k, leaves, dtype=torch.float32, group_numel=4))
        >>> [indices for indices, _ in groups]
        [[0], [1, 2]]
        >>> all(torch.equal(d, whole[i]) for indices, draws in groups for i, d in zip(indices, draws))
        True
    """
    _check_key(k, "normal_tree_groups")
    _check_dtype(dtype)
    group_numel = validate.integer("group_numel", group_numel, minimum=1)
    by_device: dict[torch.device, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    for d, (device, indices) in enumerate(by_device.items()):
        sizes = [tensors[i].numel() for i in indices]
        total, device_key, start = sum(sizes), fold_in(k, d), 0
        for group in size_groups(sizes, group_numel):
            stop = start + sum(sizes[j] for j in group)
            flat = _normal_ranges(device_key, total, [(start, stop)], dtype=dtype, device=device)[0]
            pieces = flat.split([sizes[j] for j in group])
            shapes = [tensors[indices[j]].shape for j in group]
            yield [indices[j] for j in group], [p.view(shape) for p, shape in zip(pieces, shapes, strict=True)]
            start = stop


def normal_tree_shard(
    k: Key,
    shapes: Sequence[tuple[int, ...] | torch.Size],
    ranges: Sequence[tuple[int, int]],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """The part of :func:`normal_tree`'s draw that a shard of the tree holds, drawn alone.

    ``shapes``: the global shape of every leaf of the tree, in :func:`normal_tree`'s order, all on one device (one
    device per rank, as under FSDP2). ``ranges``: for each leaf, the range ``(start, stop)`` of its row-major
    flattening that the shard holds (``(0, 0)`` for none; rows ``r0:r1`` of a leaf sharded on dim 0 are
    ``(r0 * row, r1 * row)`` with ``row`` the size of one row). Returns one 1-D tensor of ``stop - start`` values per
    leaf: ``normal_tree(k, leaves)[i].flatten()[start:stop]`` bit for bit, for leaves of those shapes on a device of
    ``device``'s type. The ranks of a sharded model that cover every coordinate once draw every coordinate's noise
    exactly once, and together the one-process noise.

    Example: the two row halves of a (4, 3) leaf, and all of a (2,) leaf on the first shard.

        >>> import torch
        >>> from opake_core import random
        >>> k, shapes = random.key(0), [(4, 3), (2,)]
        >>> first = random.normal_tree_shard(k, shapes, [(0, 6), (0, 2)], dtype=torch.float32)
        >>> second = random.normal_tree_shard(k, shapes, [(6, 12), (2, 2)], dtype=torch.float32)
        >>> whole = random.normal_tree(k, [torch.zeros(4, 3), torch.zeros(2)], dtype=torch.float32)
        >>> torch.equal(torch.cat([first[0], second[0]]).view(4, 3), whole[0]), torch.equal(first[1], whole[1])
        (True, True)
    """
    _check_key(k, "normal_tree_shard")
    _check_dtype(dtype)
    shapes, ranges = [tuple(s) for s in shapes], list(ranges)
    if len(shapes) != len(ranges):
        raise ConfigurationError(
            f"normal_tree_shard needs one (start, stop) range per leaf shape, got {len(shapes)} shapes and "
            f"{len(ranges)} ranges."
        )
    sizes = [math.prod(s) for s in shapes]
    offsets = np.cumsum([0, *sizes]).tolist()
    flat_ranges = []
    for i, (size, offset, leaf_range) in enumerate(zip(sizes, offsets, ranges, strict=False)):
        if not isinstance(leaf_range, Sequence) or len(leaf_range) != 2:
            raise InputTypeError(f"normal_tree_shard: ranges[{i}] must be a (start, stop) pair, got {leaf_range!r}.")
        start, stop = leaf_range
        _check_range("normal_tree_shard", size, start, stop, f"the size of leaf {i}")
        flat_ranges.append((offset + start, offset + stop))
    return _normal_ranges(fold_in(k, 0), offsets[-1], flat_ranges, dtype=dtype, device=torch.device(device))


def _check_range(where: str, total: Any, start: Any, stop: Any, what: str) -> None:
    if not all(type(v) is int for v in (total, start, stop)) or not 0 <= start <= stop <= total:
        raise ConfigurationError(
            f"{where} needs ints 0 <= start <= stop <= {what}, got start={start!r}, stop={stop!r}, {what}={total!r}."
        )


def _normal_ranges(
    k: Key, total: int, ranges: list[tuple[int, int]], *, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """The slices ``[start, stop)`` of the flat vector of :func:`normal_slice` (checked ranges); with ranges in
    increasing order, as :func:`normal_tree_shard` passes them, each block of a philox key is drawn once."""
    if k.impl == "chacha20":
        firsts = [start // 8 for start, _ in ranges]  # 8 normals per keystream block
        counts = [-(-stop // 8) - first for (_, stop), first in zip(ranges, firsts, strict=True)]
        draws = _chacha20_normals(
            [k] * len(ranges), [(8 * n,) for n in counts], dtype=dtype, device=device, first_blocks=firsts
        )
        return [d[start - 8 * f : stop - 8 * f] for d, f, (start, stop) in zip(draws, firsts, ranges, strict=True)]
    block = _PHILOX_BLOCK.get(device.type, _PHILOX_BLOCK["cpu"])  # other devices: normal() refuses philox keys
    if total <= block:
        whole = normal(k, (total,), dtype=dtype, device=device)
        return [whole[start:stop] for start, stop in ranges]
    last: tuple[int, torch.Tensor] | None = None  # ranges come in increasing order: each block is drawn once
    out = []
    for start, stop in ranges:
        piece = torch.empty(stop - start, dtype=dtype, device=device)  # filled block by block: no second copy
        for b in range(start // block, -(-stop // block)):
            if last is None or last[0] != b:
                length = min(block, total - b * block)
                last = b, normal(fold_in(k, "opake.block", b), (length,), dtype=dtype, device=device)
            lo, hi = max(start, b * block), min(stop, (b + 1) * block)
            piece[lo - start : hi - start].copy_(last[1][lo - b * block : hi - b * block])
        out.append(piece)
    return out


def _check_dtype(dtype: Any) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise ConfigurationError(f"normal draws one of {_FLOAT_DTYPES}, got dtype={dtype!r}.")


def _philox_cuda_normal(
    seed: int, offset: int, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """torch's CUDA Philox-4x32-10 with a 64-bit ``seed`` (the Philox key) and a counter ``offset`` (a multiple of 4
    below 2**64, as torch requires: counters advance in blocks of four 32-bit outputs), so a draw depends on 126 bits.
    """
    generator = _generator(device)
    generator.manual_seed(seed)  # resets the offset: the whole state comes from the key, reusing the object is safe
    generator.set_offset(offset)
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)


_GENERATORS = threading.local()


def _generator(device: torch.device) -> torch.Generator:
    """One generator per device and thread, reseeded at every draw (creating one per draw costs more than the draw
    of a small tensor)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    cache = _GENERATORS.__dict__.setdefault("by_device", {})
    if device not in cache:
        cache[device] = torch.Generator(device=device)
    return cache[device]


# ChaCha20 (RFC 8439). Words are uint32 values held in int32 tensors: torch's int32 add wraps modulo 2**32 like the
# uint32 add of the RFC (checked by the RFC's test vectors on every device type), torch has no uint32 add.
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k", RFC 8439 section 2.3
# Blocks per chunk (8 normals each). A chunk runs ~600 elementwise kernels: on the CPU they stay in cache, on a GPU
# each moves megabytes so that the launches hide behind the memory traffic. About 0.4 GiB of temporaries at most.
_CHUNK_BLOCKS = {"cpu": 1 << 16, "cuda": 1 << 20}


def _int32(word: int) -> int:
    """The int32 holding the uint32 ``word``."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _chacha20_key_words(k: Key) -> tuple[int, ...]:
    """The 8 little-endian key words of the 256-bit ChaCha20 key derived from ``k``, as int32."""
    raw = _digest(b"chacha20-key", _key_bytes(k), size=32, person=b"opake.chacha20")
    return tuple(_int32(int.from_bytes(raw[i : i + 4], "little")) for i in range(0, 32, 4))


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    # ">>" is arithmetic on int32: mask the n bits that wrap around
    return (x << n) | ((x >> (32 - n)) & ((1 << n) - 1))


def _quarter_rounds(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RFC 8439 section 2.1, on the four quarters ``(a[i], b[i], c[i], d[i])`` of every block at once."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


def _chacha20_block(state: torch.Tensor) -> torch.Tensor:
    """The ChaCha20 block function (RFC 8439 section 2.3) of a batch of blocks.

    ``state``: the input states, an int32 tensor of shape ``(16, n)`` (constants, key, counter, nonce). Returns the
    output words, shape ``(16, n)``; serialized little-endian, column ``j`` is block ``j``'s 64 keystream bytes. The
    state's rows are a 4x4 matrix: a column round is one quarter round on each of its 4 columns, a diagonal round
    the same after rotating row ``r`` left by ``r`` (RFC 8439 section 2.3.1).
    """
    a, b, c, d = state.view(4, 4, -1)
    for _ in range(10):  # 20 rounds
        a, b, c, d = _quarter_rounds(a, b, c, d)
        a, b, c, d = _quarter_rounds(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return torch.cat((a, b, c, d)) + state


def _chacha20_normals(
    keys: list[Key],
    shapes: list[tuple[int, ...]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    first_blocks: list[int] | None = None,
) -> list[torch.Tensor]:
    """Standard normals of each shape from the ChaCha20 keystream of each key, from block ``first_blocks[i]`` of key
    ``i`` (default 0), on ``device``. A block's values depend only on the key and the block's index.

    Block ``j`` of a key has counter ``j mod 2**32`` in word 12 and ``j // 2**32`` in word 13 (the first nonce word:
    the 64-bit-counter layout of the original ChaCha; below 2**32 blocks it is RFC 8439 with a zero nonce). Each pair
    of words gives a 53-bit uniform, each pair of uniforms two normals by Box-Muller in float64, so a block of 16
    words gives 8 normals, cast to ``dtype`` at the end. Tails beyond 8.57 standard deviations
    (``sqrt(2 * 53 ln 2)``) are cut, a mass below 1e-17. The blocks of all keys run together, in chunks.
    """
    if not keys:
        return []
    sizes = [math.prod(s) for s in shapes]
    firsts = np.cumsum([0] + [-(-n // 8) for n in sizes]).tolist()  # first block of each key, then the total
    table = torch.tensor([_chacha20_key_words(k) for k in keys], dtype=torch.int32, device=device).T  # (8, keys)
    starts = torch.tensor(firsts[:-1], dtype=torch.int64, device=device)
    skips = torch.tensor(first_blocks or [0] * len(keys), dtype=torch.int64, device=device)
    sigma = torch.tensor([_int32(w) for w in _SIGMA], dtype=torch.int32, device=device)[:, None]
    flat = torch.empty(8 * firsts[-1], dtype=dtype, device=device)
    chunk = _CHUNK_BLOCKS.get(device.type, _CHUNK_BLOCKS["cuda"])
    for start in range(0, firsts[-1], chunk):
        j = torch.arange(start, min(start + chunk, firsts[-1]), dtype=torch.int64, device=device)
        owner = torch.searchsorted(starts, j, right=True) - 1
        j = j - starts[owner] + skips[owner]  # block index within its key's keystream
        counter = ((torch.stack((j, j >> 32)) + (1 << 31)) % (1 << 32) - (1 << 31)).int()  # uint32 -> int32, exactly
        key_words = table[:, owner] if len(keys) > 1 else table
        state = torch.cat((sigma.expand(4, len(j)), key_words.expand(8, len(j)), counter, torch.zeros_like(counter)))
        words = _chacha20_block(state)
        del state
        first, second = ((w >> s) & ((1 << (32 - s)) - 1) for w, s in ((words[0::2], 5), (words[1::2], 6)))
        u = (first.double() * 2.0**26 + second.double()) * 2.0**-53  # (8, n) uniforms in [0, 1), 53 bits each
        radius = torch.sqrt(-2.0 * torch.log1p(-u[0::2]))  # 1 - u >= 2**-53: no log(0)
        angle = (2.0 * math.pi) * u[1::2]
        z = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1)  # (4 pairs, 2, n)
        flat[8 * start : 8 * (start + len(j))].view(-1, 4, 2).copy_(z.permute(2, 0, 1))
    return [flat[8 * f : 8 * f + n].view(s) for f, n, s in zip(firsts[:-1], sizes, shapes, strict=True)]


def numpy_generator(k: Key) -> np.random.Generator:
    """A NumPy generator on the counter-based Philox bit generator, keyed by the full 128 bits of ``k``.

    For host-side sampling (batch selection); it ignores ``k.impl``.

    Example:

        >>> from opake_core import random
        >>> first = random.numpy_generator(random.key(0)).permutation(5)
        >>> bool((first == random.numpy_generator(random.key(0)).permutation(5)).all()), sorted(first.tolist())
        (True, [0, 1, 2, 3, 4])
    """
    _check_key(k, "numpy_generator")
    return np.random.Generator(np.random.Philox(key=(k.hi << 64) | k.lo))


def key_to_json(k: Key) -> dict[str, str]:
    """The JSON form of a key: ``{"opake_key": "<32 hex digits>"}``, plus ``"impl"`` for a non-philox key.

    It holds the secret: write it only to private checkpoint state.

    Example:

        >>> from opake_core import random
        >>> stored = random.key_to_json(random.key(0, impl="chacha20"))
        >>> sorted(stored), random.key_from_json(stored) == random.key(0, impl="chacha20")
        (['impl', 'opake_key'], True)
    """
    _check_key(k, "key_to_json")
    return {"opake_key": k.hex} if k.impl == "philox" else {"opake_key": k.hex, "impl": k.impl}


def key_from_json(obj: Any) -> Key:
    """The key serialized by :func:`key_to_json` (a missing ``"impl"`` means philox).

    Example:

        >>> from opake_core import random
        >>> k = random.key(7)
        >>> random.key_from_json({"opake_key": k.hex}) == k
        True
    """
    if (
        not isinstance(obj, dict)
        or not {"opake_key"} <= set(obj) <= {"opake_key", "impl"}
        or not isinstance(obj["opake_key"], str)
    ):
        raise InputTypeError(
            f"key_from_json expects {{'opake_key': '<32 hex digits>'}} with an optional 'impl', got {obj!r}."
        )
    text, impl = obj["opake_key"], obj.get("impl", "philox")
    _check_impl(impl)
    if len(text) != 32:
        raise ConfigurationError(f"a serialized key has 32 hex digits, got {len(text)} in {text!r}.")
    try:
        return Key(int(text[:16], 16), int(text[16:], 16), impl)
    except ValueError as exc:
        raise ConfigurationError(f"a serialized key must be hexadecimal, got {text!r}.") from exc
