"""The public face of the two packages, and what docs/api.md documents, as public path -> object."""

from __future__ import annotations

import importlib
import importlib.util
import re
import types
from pathlib import Path
from typing import Any

PACKAGES = ("opake_core", "opake_torch")
API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def face(package: str) -> dict[str, Any]:
    """Every name of ``package.__all__``; a module there (a family such as ``opake_core.accounting``) stands for the
    names of its own ``__all__``, recursively."""
    out: dict[str, Any] = {}
    _members(importlib.import_module(package), package, list(importlib.import_module(package).__all__), out)
    return out


def _members(module: types.ModuleType, path: str, names: list[str], out: dict[str, Any]) -> None:
    for name in names:
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            _members(value, f"{path}.{name}", list(value.__all__), out)
        else:
            out[f"{path}.{name}"] = value


def directives(page: Path = API_PAGE) -> list[tuple[str, list[str] | bool | None]]:
    """The ``::: target`` directives of a mkdocstrings page with their ``members`` option: a list of names, False
    (the target's docstring only) or None (not given)."""
    found: list[tuple[str, list[str] | bool | None]] = []
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.fullmatch(r":::\s+(\S+)\s*", line)
        if not match:
            continue
        block: list[str] = []
        for following in lines[i + 1 :]:
            if following and not following[0].isspace():
                break
            block.append(following.strip())
        text = "\n".join(block)
        members: list[str] | bool | None = None
        option = re.search(r"^members:[ \t]*(.*)$", text, flags=re.MULTILINE)
        if option:
            value = option.group(1).strip()
            if value in ("false", "true"):
                members = value == "true"
            elif value.startswith("["):
                members = [m.strip() for m in value.strip("[]").split(",") if m.strip()]
            else:  # a YAML block list on the lines that follow
                rest = text[option.end() :].splitlines()
                members = [item[2:].strip() for item in rest if item.startswith("- ")]
        found.append((match.group(1), members))
    return found


def resolve(target: str) -> Any:
    """The module or object a mkdocstrings identifier names."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError:
        parent, _, name = target.rpartition(".")
        return getattr(resolve(parent), name)


def documented(page: Path = API_PAGE) -> dict[str, Any]:
    """What the page renders: each directive on an object documents it; on a module, the members it lists (all of
    the module's ``__all__`` when none are listed, nothing with ``members: false``).

    A listed name that is also a submodule of that module (``sampling.poisson`` the function and
    ``sampling/poisson.py``) is rendered as the submodule by the documentation tool, so it does not count: such a
    function is documented by its full path (``::: opake_core.sampling.poisson.poisson``).
    """
    out: dict[str, Any] = {}
    for target, members in directives(page):
        value = resolve(target)
        if not isinstance(value, types.ModuleType):
            out[target] = value
            continue
        names = list(value.__all__) if members is None or members is True else (members or [])
        for name in names:
            if hasattr(value, "__path__") and importlib.util.find_spec(f"{target}.{name}") is not None:
                continue  # rendered as the submodule of that name
            out[f"{target}.{name}"] = getattr(value, name)
    return out
