"""The examples in the docstrings of the public face run, and every entry point of the face has one.

Each docstring's examples run in a namespace of their own (they import what they use), on the CPU.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
import types

import pytest
from public_face import PACKAGES, face

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _face() -> dict:
    out: dict = {}
    for package in PACKAGES:
        out.update(face(package))
    return out


def _modules() -> list[types.ModuleType]:
    """The packages and the families of their face: their module docstrings are the overview examples."""
    modules = [importlib.import_module(package) for package in PACKAGES]
    for package in PACKAGES:
        for name in importlib.import_module(package).__all__:
            value = getattr(importlib.import_module(package), name)
            if isinstance(value, types.ModuleType):
                modules.append(value)
    return modules


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests: dict[str, doctest.DocTest] = {}
    seen: set[int] = set()
    for module in _modules():
        for test in finder.find(module, module.__name__, globs={}):
            if test.name == module.__name__:  # the module docstring only; its members are collected below
                tests[test.name] = test
    for path, value in _face().items():
        if id(value) in seen or not (inspect.isfunction(value) or inspect.isclass(value)):
            continue
        seen.add(id(value))
        for test in finder.find(value, path, module=inspect.getmodule(value), globs={}):
            tests.setdefault(test.name, test)
    return [tests[name] for name in sorted(tests) if tests[name].examples]


EXAMPLES = _examples()


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_example_runs(example):
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    result = runner.run(example, out=report.append)
    assert result.failed == 0, "".join(report)


def _returned_classes(values: list) -> set[str]:
    """Names of the classes that the face's functions name in their return annotations (the records they build)."""
    names: set[str] = set()
    for value in values:
        if inspect.isfunction(value):
            annotation = inspect.signature(value).return_annotation
            names.update(re.findall(r"[A-Za-z_]\w*", annotation if isinstance(annotation, str) else repr(annotation)))
    return names


def test_every_entry_point_has_an_example():
    """Every function of the face, and every class a user builds directly, shows how it is called: exceptions and the
    records a face function returns (named in its return annotation) are shown by that function's example."""
    everything = _face()
    returned = _returned_classes(list(everything.values()))
    missing = []
    for path, value in everything.items():
        if inspect.isclass(value) and (issubclass(value, BaseException) or value.__name__ in returned):
            continue
        if (inspect.isfunction(value) or inspect.isclass(value)) and ">>>" not in (inspect.getdoc(value) or ""):
            missing.append(path)
    assert not missing, f"entry points without an example in their docstring: {sorted(missing)}"
