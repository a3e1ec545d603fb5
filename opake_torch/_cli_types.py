"""``argparse`` value types of the ``opake`` command line: numbers within :mod:`opake_torch.limits` and paths that
can be written, refused as usage errors (exit status 2, one ``error:`` line) before any work starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from opake_core.errors import ConfigurationError
from opake_torch import limits

__all__ = ["number", "writable_dir", "writable_path"]


def number(
    low: float | None,
    high: float | None,
    *,
    integer: bool = False,
    open_low: bool = False,
    open_high: bool = False,
    zero: bool = False,
    why: str = "",
) -> Callable[[str], int | float]:
    """The type of a flag whose value is a finite number (an int with ``integer``) in ``[low, high]`` (sides open as
    in :func:`opake_torch.limits.check_number`); ``zero`` also accepts 0."""

    def parse(text: str) -> int | float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{'an integer' if integer else 'a number'} expected, got {text!r}"
            ) from None
        if zero and value == 0:
            return value
        try:
            return limits.check_number(
                value, "value", low, high, integer=integer, open_low=open_low, open_high=open_high, why=why
            )
        except ConfigurationError as exc:
            raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None

    return parse


def writable_path(text: str) -> str:
    """A file path whose folder exists and may be written, and that is not a folder itself."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name such as {text}/epsilon.png")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: its folder {folder!r} does not exist or is read-only")
    return text


def writable_dir(text: str) -> str:
    """A folder that exists and may be written, or that can be created (its nearest existing parent may be written)."""
    path = os.path.abspath(text)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {path!r} is not a writable folder")
    return text
