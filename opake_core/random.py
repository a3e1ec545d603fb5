"""Explicit, counter-based random keys.

A key is 128 bits of state. ``split`` and ``fold_in`` derive child keys by hashing (BLAKE2b) the parent with a
type-tagged counter or string, so a derived key depends only on its parent and the path that led to it, never on
how many draws happened before. Draws are made from a key with :func:`normal` (on any device) and
:func:`numpy_generator` (host-side sampling):

* ``normal(key, shape, dtype=..., device=...)`` seeds a fresh ``torch.Generator`` on the target device, so the
  values depend only on (key, shape, dtype, device type) and replay bit-exactly. The noise is generated on the
  device it is used on, never on the host and copied over.
* CPU and CUDA generators are different algorithms (Mersenne Twister and Philox): the same key gives different,
  equally distributed values on the two device types.

Keys are reproducible pseudo-random state, not cryptographic secrets: anyone who knows a key can recompute the noise
it generated. Keep keys private and strip them before publishing a checkpoint.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "Key",
    "fold_in",
    "key",
    "key_from_json",
    "key_to_json",
    "normal",
    "numpy_generator",
    "random_key",
    "split",
]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Key:
    """A 128-bit random key. Build one with :func:`key`; derive others with :func:`split` and :func:`fold_in`."""

    hi: int
    lo: int

    def __post_init__(self) -> None:
        for name in ("hi", "lo"):
            word = getattr(self, name)
            if type(word) is not int or not 0 <= word <= _MASK64:
                raise InputTypeError(
                    f"Key.{name} must be an int in [0, 2**64), got {word!r}; build keys with key(seed)."
                )

    def __repr__(self) -> str:
        return f"Key({self.hi:016x}{self.lo:016x})"

    @property
    def hex(self) -> str:
        """The 32-character hexadecimal form used in JSON."""
        return f"{self.hi:016x}{self.lo:016x}"


def _hash(*parts: bytes) -> Key:
    digest = hashlib.blake2b(b"".join(parts), digest_size=16, person=b"opake.random").digest()
    return Key(int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little"))


def _key_bytes(k: Key) -> bytes:
    return k.hi.to_bytes(8, "little") + k.lo.to_bytes(8, "little")


def _check_key(k: Any, where: str) -> None:
    if not isinstance(k, Key):
        raise InputTypeError(
            f"{where} expects an opake_core.random.Key, got {type(k).__name__}; build one with key(seed)."
        )


def key(seed: int) -> Key:
    """The root key for an integer seed (any size, negative allowed)."""
    if type(seed) is not int:
        raise InputTypeError(f"key(seed) needs an int seed, got {type(seed).__name__} {seed!r}.")
    return _hash(b"seed", _encode_int(seed))


def random_key() -> Key:
    """A root key from the operating system's entropy source (for runs that need no replay from a seed)."""
    return key(secrets.randbits(128))


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
    that cannot clash with the integer children of :func:`split`.
    """
    _check_key(k, "fold_in")
    if not data:
        raise ConfigurationError("fold_in(key, *data) needs at least one int or str to fold in, got none.")
    for item in data:
        k = _hash(b"fold", _key_bytes(k), _encode(item))
    return k


def split(k: Key, num: int = 2) -> tuple[Key, ...]:
    """``num`` independent child keys: ``split(k, n)[i] == fold_in(k, i)``."""
    _check_key(k, "split")
    if type(num) is not int or num < 1:
        raise ConfigurationError(f"split(key, num) needs an int num >= 1, got {num!r}.")
    return tuple(fold_in(k, i) for i in range(num))


def _seed64(k: Key) -> int:
    return _hash(b"torch-seed", _key_bytes(k)).lo


def normal(
    k: Key,
    shape: tuple[int, ...] | torch.Size,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal draws of ``shape`` and ``dtype`` generated on ``device``.

    The result depends only on (key, shape, dtype, device type) and is bit-identical on replay.
    """
    _check_key(k, "normal")
    generator = _generator(torch.device(device))
    generator.manual_seed(_seed64(k))  # the whole state comes from the key: reusing the object changes nothing
    return torch.randn(tuple(shape), generator=generator, dtype=dtype, device=generator.device)


_GENERATORS = threading.local()


def _generator(device: torch.device) -> torch.Generator:
    """One generator per device and thread, reseeded at every draw (creating one per draw costs more than the draw
    of a small tensor)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache = _GENERATORS.__dict__.setdefault("by_device", {})
    if device not in cache:
        cache[device] = torch.Generator(device=device)
    return cache[device]


def numpy_generator(k: Key) -> np.random.Generator:
    """A NumPy generator on the counter-based Philox bit generator, keyed by the full 128 bits of ``k``."""
    _check_key(k, "numpy_generator")
    return np.random.Generator(np.random.Philox(key=(k.hi << 64) | k.lo))


def key_to_json(k: Key) -> dict[str, str]:
    """The JSON form of a key: ``{"opake_key": "<32 hex digits>"}``."""
    _check_key(k, "key_to_json")
    return {"opake_key": k.hex}


def key_from_json(obj: Any) -> Key:
    """The key serialized by :func:`key_to_json`."""
    if not isinstance(obj, dict) or set(obj) != {"opake_key"} or not isinstance(obj["opake_key"], str):
        raise InputTypeError(f"key_from_json expects {{'opake_key': '<32 hex digits>'}}, got {obj!r}.")
    text = obj["opake_key"]
    if len(text) != 32:
        raise ConfigurationError(f"a serialized key has 32 hex digits, got {len(text)} in {text!r}.")
    try:
        return Key(int(text[:16], 16), int(text[16:], 16))
    except ValueError as exc:
        raise ConfigurationError(f"a serialized key must be hexadecimal, got {text!r}.") from exc
