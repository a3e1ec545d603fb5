"""What is patched, and for how long: process-level patches applied for a scope, per-instance patches marked.

Two kinds of patch, and no third:

* **Per model instance**: a forward of one module of one model is replaced (the family patches of
  :mod:`~opake_torch.patches.families`, the RMSNorm, SwiGLU and LoRA kernels of
  :mod:`~opake_torch.patches.performance`). :func:`mark` records the patch's name on the module; no other model, and
  no class, changes.
* **Process-level** (:class:`RuntimePatch`): a function of a library module that every model of the process calls,
  where Hugging Face has no per-model switch: the vmap patches (:data:`VMAP_PATCHES`, see
  :mod:`~opake_torch.patches.compat`) and the RoPE kernel of a model family
  (:func:`~opake_torch.patches.performance.rope_patch`). Importing Opake applies none of them.
  :func:`apply_runtime_patches` applies them and returns a handle whose :meth:`~AppliedPatches.undo` (or the end of
  its ``with`` block) puts the originals back. Applications are counted: a patch applied twice is installed once
  and removed when both are undone, so nested scopes (an evaluation inside ``train()``) unwind in order.
  ``DPTrainer`` applies the ones its model needs while ``train()``, ``evaluate()`` and ``predict()`` run, and undoes
  them when these return or raise.

:func:`applied_patches` lists the process-level patches in effect now, or those of one model.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch import nn

from opake_torch.patches.compat import autocast_sdpa, vmap_is_tracing

__all__ = [
    "VMAP_PATCHES",
    "AppliedPatches",
    "RuntimePatch",
    "applied_patches",
    "apply_runtime_patches",
    "mark",
    "marked",
    "module_attribute",
]

logger = logging.getLogger(__name__)

_MARK = "_opake_patches"  # the names of a module's own patches, a tuple of str


@dataclass(frozen=True)
class RuntimePatch:
    """One process-level replacement: the value ``read()`` returns is replaced by ``wrap(original)`` (``write``).

    ``name`` says what is replaced (``"transformers.masking_utils.is_tracing"``) and identifies the patch.
    ``read`` returns None where the installed transformers has nothing to replace; the patch is then skipped.
    """

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    wrap: Callable[[Any], Any]


def module_attribute(module: str, attribute: str, wrap: Callable[[Any], Any]) -> RuntimePatch:
    """The patch that replaces ``attribute`` of the importable module ``module`` by ``wrap(original)``."""

    def read() -> Any:
        return getattr(importlib.import_module(module), attribute, None)

    def write(value: Any) -> None:
        setattr(importlib.import_module(module), attribute, value)

    return RuntimePatch(f"{module}.{attribute}", read, write, wrap)


def _attention_functions() -> dict[str, Any]:
    return importlib.import_module("transformers.modeling_utils").AttentionInterface._global_mapping


VMAP_PATCHES: tuple[RuntimePatch, ...] = (
    module_attribute("transformers.masking_utils", "is_tracing", vmap_is_tracing),
    RuntimePatch(
        "transformers.modeling_utils.AttentionInterface['sdpa']",
        read=lambda: _attention_functions().get("sdpa"),
        write=lambda value: _attention_functions().__setitem__("sdpa", value),
        wrap=autocast_sdpa,
    ),
)


@dataclass
class _Installed:
    patch: RuntimePatch
    original: Any
    replacement: Any
    count: int


_INSTALLED: dict[str, _Installed] = {}  # the process-level patches in effect, by name
_LOCK = threading.Lock()


def _acquire(patch: RuntimePatch) -> bool:
    """Install ``patch`` or count one more application; False where there is nothing to replace."""
    with _LOCK:
        installed = _INSTALLED.get(patch.name)
        if installed is not None:
            installed.count += 1
            return True
        original = patch.read()
        if original is None:
            return False
        replacement = patch.wrap(original)
        patch.write(replacement)
        _INSTALLED[patch.name] = _Installed(patch, original, replacement, 1)
        return True


def _release(name: str) -> None:
    """Count one application of ``name`` undone; the last one puts the original back."""
    with _LOCK:
        installed = _INSTALLED[name]
        installed.count -= 1
        if installed.count:
            return
        del _INSTALLED[name]
        if installed.patch.read() is installed.replacement:
            installed.patch.write(installed.original)
        else:  # someone replaced it after us: theirs stays, and may still call ours
            logger.warning("%s was replaced again after Opake patched it; the original is not restored.", name)


class AppliedPatches:
    """The process-level patches that one :func:`apply_runtime_patches` call applied (``names``).

    :meth:`undo` releases them (once; a second call does nothing); as a context manager the ``with`` block's end does.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._undone = False

    def undo(self) -> None:
        """Undo this application; each patch's original is back once every application of it is undone."""
        if self._undone:
            return
        self._undone = True
        for name in reversed(self.names):
            _release(name)

    def __enter__(self) -> AppliedPatches:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"AppliedPatches({list(self.names)}{', undone' if self._undone else ''})"


def apply_runtime_patches(patches: Iterable[RuntimePatch] = VMAP_PATCHES) -> AppliedPatches:
    """Apply process-level ``patches`` (default: :data:`VMAP_PATCHES`, what ``vmap(grad)`` over a Hugging Face model
    needs) until the returned handle is undone.

    Idempotent: a patch in effect already is not wrapped twice; its count goes up, and it stays until every
    application is undone. Use the handle as a context manager, so that an error undoes it too::

        with apply_runtime_patches():
            grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, batch)

    Example:

        >>> from opake_torch import applied_patches, apply_runtime_patches
        >>> with apply_runtime_patches():
        ...     during = applied_patches()
        >>> len(during) > 0, applied_patches()  # undone on leaving the scope
        (True, ())
    """
    names: list[str] = []
    try:
        for patch in patches:
            if _acquire(patch):
                names.append(patch.name)
    except BaseException:
        AppliedPatches(tuple(names)).undo()
        raise
    return AppliedPatches(tuple(names))


def mark(module: nn.Module, name: str) -> None:
    """Record that ``module`` (this instance) carries the patch ``name``."""
    if not marked(module, name):
        setattr(module, _MARK, (*getattr(module, _MARK, ()), name))


def marked(module: nn.Module, name: str) -> bool:
    """Whether ``module`` carries the patch ``name`` (:func:`mark`)."""
    return name in getattr(module, _MARK, ())


def applied_patches(model: nn.Module | None = None) -> tuple[str, ...]:
    """The names of the process-level patches in effect now (sorted; empty outside ``DPTrainer.train()`` and
    :func:`apply_runtime_patches` scopes) or, given ``model``, of the per-instance patches its modules carry (sorted,
    each once; empty for a model Opake never patched).

    Example: importing Opake patches nothing.

        >>> import torch
        >>> from opake_torch import applied_patches
        >>> applied_patches(), applied_patches(torch.nn.Linear(2, 2))
        ((), ())
    """
    if model is not None:
        return tuple(sorted({name for module in model.modules() for name in getattr(module, _MARK, ())}))
    with _LOCK:
        return tuple(sorted(_INSTALLED))
