"""A package's public face loaded on first use: each name is imported from its home module when first asked for."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def exports(
    package: str, home: dict[str, str], families: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: a name of ``home`` (name -> module) is imported from
    its module and bound in the package, a name of ``families`` is the package's submodule of that name."""

    def __getattr__(name: str) -> Any:
        if name in families:
            return importlib.import_module(f"{package}.{name}")  # the import binds it in the package too
        if name in home:
            value = getattr(importlib.import_module(home[name]), name)
            vars(sys.modules[package])[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *families, *home})

    return __getattr__, __dir__
