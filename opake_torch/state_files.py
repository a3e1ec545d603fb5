"""Pickle-free state files: trees of tensors as safetensors, small records as JSON.

:func:`save_tree` writes one safetensors file: the tensor leaves of a state (named ``"0"``, ``"1"``, ... depth
first; contiguous, on the CPU) and, in the header metadata under ``"opake.tree"``, a JSON description of the rest:
containers, every field of every state class, and the non-tensor leaves (steps, keys, norms, sensitivities).
:func:`write_json` writes a plain JSON record.

Nothing is pickled: unpickling runs whatever code a file names, so a crafted checkpoint read with
``torch.load(weights_only=False)`` takes over the process. Loading here only parses JSON and copies tensor bytes.

Allow-list rule: a node is rebuilt only from a fixed tag of ``_CLASSES`` (tag -> an imported class) or a built-in
tag (none, bool, int, float, str, dtype, key, tensor, list, tuple, dict); no module is imported and no attribute
is looked up by a name read from a file. Saving a type off the list raises InputTypeError: a new state class needs
an entry in ``_CLASSES`` and a round-trip test.

Encoding: each node is ``[tag, payload]``. Floats are ``repr`` strings (exact, inf and nan included), dtypes their
names, keys :func:`~opake_core.random.key_to_json`, dicts ``[str key, node]`` pairs in order; dataclasses are saved
by all their ``dataclasses.fields`` (also non-pytree ones such as ``step``), NamedTuples by their ``_fields``.

Errors: every failure to load raises :class:`~opake_core.errors.CheckpointError` naming the file and what is
wrong. Writers go through a temporary sibling, fsynced and renamed over the target, and return the file's SHA-256
(64 hex digits) for a manifest; readers check it when given ``expected_sha256``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torchopt.base import EmptyState
from torchopt.transform.trace import TraceState

from opake_core import random
from opake_core.clipping import AdaptiveClipState, FixedClipState
from opake_core.errors import CheckpointError, InputTypeError, OpakeError
from opake_core.noise import GaussianNoiseState
from opake_core.optim._foreach import AdamState
from opake_core.optim._lr import LearningRateState
from opake_core.optim.adadelta import AdadeltaState
from opake_core.optim.adafactor import FactoredRmsState
from opake_core.optim.adagrad import AdagradState
from opake_core.optim.ademamix import AdEMAMixState
from opake_core.optim.bias_correction import (
    BiasCorrectedAdagradState,
    BiasCorrectedAdamState,
    BiasCorrectedRMSpropState,
    NoiseVarianceState,
)
from opake_core.optim.lion import LionState
from opake_core.optim.radam import RAdamState
from opake_core.optim.rmsprop import RMSpropState
from opake_core.optim.schedule_free import ScheduleFreeState, ScheduleFreeWrapState
from opake_core.optim.stable_adamw import StableAdamState
from opake_core.router_release import RouterState
from opake_core.step import DPState
from opake_core.tree import PerGroup

__all__ = ["MAX_JSON_BYTES", "check_savable", "load_tree", "read_json", "save_tree", "sha256", "write_json"]

MAX_JSON_BYTES = 64 * 2**20
"""Largest file :func:`read_json` reads (64 MiB)."""

_FORMAT, _TREE = ("opake.format", "tree/1"), "opake.tree"
_CLASSES: dict[str, type] = {
    "opake.DPState": DPState,
    "opake.FixedClipState": FixedClipState,
    "opake.AdaptiveClipState": AdaptiveClipState,
    "opake.GaussianNoiseState": GaussianNoiseState,
    "opake.PerGroup": PerGroup,
    "opake.RouterState": RouterState,
    "opake.AdamState": AdamState,
    "opake.BiasCorrectedAdamState": BiasCorrectedAdamState,
    "opake.BiasCorrectedRMSpropState": BiasCorrectedRMSpropState,
    "opake.BiasCorrectedAdagradState": BiasCorrectedAdagradState,
    "opake.StableAdamState": StableAdamState,
    "opake.NoiseVarianceState": NoiseVarianceState,
    "opake.FactoredRmsState": FactoredRmsState,
    "opake.LearningRateState": LearningRateState,
    "opake.LionState": LionState,
    "opake.AdEMAMixState": AdEMAMixState,
    "opake.RMSpropState": RMSpropState,
    "opake.AdagradState": AdagradState,
    "opake.RAdamState": RAdamState,
    "opake.AdadeltaState": AdadeltaState,
    "opake.ScheduleFreeState": ScheduleFreeState,
    "opake.ScheduleFreeWrapState": ScheduleFreeWrapState,
    "torchopt.TraceState": TraceState,
    "torchopt.EmptyState": EmptyState,
}
_TAG_OF = {cls: tag for tag, cls in _CLASSES.items()}
_SCALARS = {"none": type(None), "bool": bool, "int": int, "str": str}
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _fields(cls: type) -> list[str]:
    return list(cls._fields) if issubclass(cls, tuple) else [f.name for f in dataclasses.fields(cls)]


def _encode(x: Any, tensors: dict[str, torch.Tensor], where: str) -> list[Any]:
    if isinstance(x, torch.Tensor):
        tensors[name := str(len(tensors))] = x
        return ["tensor", name]
    for tag, kind in _SCALARS.items():
        if isinstance(x, kind):  # bool before int; int, float and str subclasses are saved as the builtin
            return [tag, None if x is None else kind(x)]
    if isinstance(x, float):
        return ["float", repr(float(x))]
    if isinstance(x, torch.dtype):
        return ["dtype", str(x).removeprefix("torch.")]
    if isinstance(x, random.Key):
        return ["key", random.key_to_json(x)]
    if type(x) in _TAG_OF:
        return [_TAG_OF[type(x)], {n: _encode(getattr(x, n), tensors, f"{where}.{n}") for n in _fields(type(x))}]
    if type(x) in (list, tuple):
        return [type(x).__name__, [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]]
    if type(x) is dict and all(type(k) is str for k in x):
        return ["dict", [[k, _encode(v, tensors, f"{where}[{k!r}]")] for k, v in x.items()]]
    what = "a dict with non-str keys" if type(x) is dict else f"a {type(x).__module__}.{type(x).__qualname__}"
    raise InputTypeError(
        f"save_tree cannot save {where}, {what}: only tensors, None, bool, int, float, str, torch.dtype, Key, list, "
        f"tuple, str-keyed dict and {sorted(_CLASSES)} are allowed. Add a new state class to _CLASSES in "
        "opake_torch/state_files.py, with a round-trip test."
    )


def check_savable(tree: Any, where: str) -> None:
    """InputTypeError, naming the part of ``where`` (what ``tree`` is), when :func:`save_tree` could not save
    ``tree``; nothing is written or copied."""
    _encode(tree, {}, where)


def save_tree(path: str | os.PathLike, tree: Any) -> str:
    """Write ``tree`` (an optimizer or step state, or any tree of the allowed types) to the safetensors file
    ``path`` atomically; returns its SHA-256.

    Raises:
        InputTypeError: a node whose type is not on the allow-list (named with its path in the tree).
    """
    tensors: dict[str, torch.Tensor] = {}
    metadata = dict([_FORMAT, (_TREE, json.dumps(_encode(tree, tensors, "tree"), separators=(",", ":")))])
    host, storages = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:  # safetensors refuses tensors that share memory
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        host[name] = t
    return _write_atomically(path, lambda tmp: save_file(host, tmp, metadata=metadata))


def _typed(payload: Any, kind: type) -> Any:
    if type(payload) is not kind:
        raise TypeError(f"expected a {kind.__name__} payload, got {type(payload).__name__}")
    return payload


class _Decoder:
    """Rebuilds a tree from its JSON nodes, taking tensors from the open safetensors ``handle``."""

    def __init__(self, file: Path, handle: Any) -> None:
        self.file, self.handle, self.names, self.used = file, handle, set(handle.keys()), set()

    def node(self, node: Any, where: str) -> Any:
        if type(node) is not list or len(node) != 2 or type(node[0]) is not str:
            raise CheckpointError(f"{self.file}: {where} must be a [tag, payload] pair, got a {type(node).__name__}.")
        try:
            return self._build(*node, where)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, OpakeError) as exc:  # a payload the tag's type refuses
            raise CheckpointError(
                f"{self.file}: {where} is an invalid {node[0]!r} node: {str(exc).rstrip('.')}."
            ) from None

    def _build(self, tag: str, payload: Any, where: str) -> Any:
        if tag in _SCALARS:
            return _typed(payload, _SCALARS[tag])
        if tag == "float":
            return float(_typed(payload, str))
        if tag == "dtype":
            return _DTYPES[_typed(payload, str)]
        if tag == "key":
            return random.key_from_json(payload)
        if tag == "tensor":
            return self._tensor(_typed(payload, str))
        if tag in ("list", "tuple"):
            items = [self.node(v, f"{where}[{i}]") for i, v in enumerate(_typed(payload, list))]
            return items if tag == "list" else tuple(items)
        if tag == "dict":
            pairs = [(_typed(k, str), v) for k, v in (_typed(pair, list) for pair in _typed(payload, list))]
            if len(dict(pairs)) != len(pairs):
                raise ValueError("a key repeats")
            return {k: self.node(v, f"{where}[{k!r}]") for k, v in pairs}
        if tag not in _CLASSES:
            raise CheckpointError(
                f"{self.file}: {where} has the unknown type tag {tag!r}; allowed: {sorted(_CLASSES)}."
            )
        cls = _CLASSES[tag]
        if list(_typed(payload, dict)) != _fields(cls):
            raise ValueError(f"its fields are {list(payload)}, {tag} has {_fields(cls)}")
        return cls(**{n: self.node(v, f"{where}.{n}") for n, v in payload.items()})

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self.names or name in self.used:
            raise ValueError(f"tensor {name!r} is {'referenced twice' if name in self.used else 'not in the file'}")
        self.used.add(name)
        with _reading(self.file, f"cannot read tensor {name!r}"):
            return self.handle.get_tensor(name)


def load_tree(
    path: str | os.PathLike,
    *,
    template: Any = None,
    device: str | torch.device = "cpu",
    expected_sha256: str | None = None,
) -> Any:
    """The tree :func:`save_tree` wrote to ``path``, with every tensor on ``device``.

    Args:
        template: a tree the result must match: the same containers and classes, dict keys and lengths, and tensors
            of the same shapes and dtypes (other leaves, such as steps and keys, may differ).
        expected_sha256: the digest :func:`save_tree` returned; checked before anything is parsed.

    Raises:
        CheckpointError: the file is missing, not a safetensors file, truncated or corrupt, has no or invalid tree
            metadata, an unknown type tag, missing or extra tensors, the wrong checksum, or differs from
            ``template`` (the first difference is named).
    """
    device, file = str(torch.device(device)), _existing(path, expected_sha256)
    with _reading(file, "is not a readable safetensors file (truncated, corrupt or another format)"):
        handle = safe_open(str(file), framework="pt", device=device)
        metadata = handle.metadata() or {}
    with handle:
        if metadata.get(_FORMAT[0]) != _FORMAT[1] or _TREE not in metadata:
            raise CheckpointError(f"{file} holds no {_FORMAT[1]!r} metadata: it was not written by save_tree.")
        decoder = _Decoder(file, handle)
        try:
            tree = decoder.node(_parse_json(file, metadata[_TREE]), "tree")
        except RecursionError:
            raise CheckpointError(f"{file} holds tree metadata nested too deeply to be a state.") from None
        extra = sorted(decoder.names - decoder.used)
    if extra:
        raise CheckpointError(f"{file} holds tensors {extra[:5]} that its tree does not reference.")
    difference = None if template is None else _difference(tree, template, "tree")
    if difference:
        raise CheckpointError(f"{file} does not match the expected state: {difference}.")
    return tree


def _difference(saved: Any, template: Any, where: str) -> str | None:
    """The first place where ``saved`` differs from ``template`` in structure, shape or dtype; None if nowhere."""
    if isinstance(saved, torch.Tensor) or isinstance(template, torch.Tensor):
        got, want = (f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else "" for x in (saved, template))
        if got and got == want:
            return None
        return f"{where} is {got or type(saved).__name__} in the file, {want or type(template).__name__} expected"
    # Containers must match; other leaves (and PerGroup, a value like a float) are free.
    if not any(type(x) in (dict, list, tuple, *_TAG_OF) and type(x) is not PerGroup for x in (saved, template)):
        return None
    if type(saved) is not type(template):
        return f"{where} is {type(saved).__name__} in the file, {type(template).__name__} expected"
    if type(saved) is dict:
        if set(saved) != set(template):
            extra, missing = sorted(set(saved) - set(template)), sorted(set(template) - set(saved))
            return f"{where} has the unexpected keys {extra[:5]} and lacks {missing[:5]}"
        pairs = [(f"{where}[{k!r}]", saved[k], template[k]) for k in template]
    elif type(saved) in (list, tuple):
        if len(saved) != len(template):
            return f"{where} has {len(saved)} items in the file, {len(template)} expected"
        pairs = [(f"{where}[{i}]", a, b) for i, (a, b) in enumerate(zip(saved, template, strict=True))]
    else:
        pairs = [(f"{where}.{n}", getattr(saved, n), getattr(template, n)) for n in _fields(type(saved))]
    return next((found for w, a, b in pairs if (found := _difference(a, b, w))), None)


def write_json(path: str | os.PathLike, obj: Any) -> str:
    """Write ``obj`` (JSON values; no NaN or infinite floats) to ``path`` atomically; returns its SHA-256.

    Raises:
        InputTypeError: ``obj`` holds a value strict JSON cannot represent.
    """
    try:
        data = json.dumps(obj, indent=2, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InputTypeError(f"write_json({str(path)!r}) writes strict JSON only (no NaN or inf): {exc}.") from exc
    return _write_atomically(path, lambda tmp: tmp.write_bytes(data))


def read_json(path: str | os.PathLike, *, expected_sha256: str | None = None) -> Any:
    """The JSON value in the file at ``path`` (at most :data:`MAX_JSON_BYTES`, UTF-8, no NaN or Infinity).

    Raises:
        CheckpointError: the file is missing, too large, has the wrong checksum or is not strict JSON.
    """
    file = _existing(path, expected_sha256)
    with _reading(file, "cannot be read"):
        if file.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{file} holds more than {MAX_JSON_BYTES} bytes: too large for a JSON state file.")
        text = file.read_bytes().decode("utf-8")
    return _parse_json(file, text)


def sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file at ``path`` as 64 hex digits, read in chunks."""
    with _reading(path, "cannot be read"), open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not strict JSON")


def _parse_json(file: Path, text: str) -> Any:
    with _reading(file, "is not valid JSON"):
        return json.loads(text, parse_constant=_refuse)


def _existing(path: str | os.PathLike, expected_sha256: str | None) -> Path:
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (or is not a file).")
    if expected_sha256 is not None and (actual := sha256(file)) != expected_sha256.lower():
        raise CheckpointError(f"{file} has SHA-256 {actual}, expected {expected_sha256}: it changed or is corrupt.")
    return file


@contextlib.contextmanager
def _reading(file: str | os.PathLike, what: str) -> Iterator[None]:
    """Any failure of a reader as a CheckpointError naming ``file``.

    The readers (safetensors, json, the OS) raise many types, none a stable API; whichever it is, the file is unusable.
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file} {what}: {type(exc).__name__}: {exc}") from exc


def _write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> str:
    """``write(tmp)`` to a temporary sibling, fsync it, rename it to ``path``; returns the file's SHA-256."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest
