"""The options that ``transformers.HfArgumentParser`` makes of :class:`TrainingArguments` and the TRL configs.

``HfArgumentParser`` makes one option per dataclass field, with the argparse type read from the field's annotation
(so the annotations of those classes are ones it reads: ``float`` for a count or a fraction, ``str | None``, ...), and
passes the field's ``metadata`` on to ``ArgumentParser.add_argument``. The metadata built here adds the other names
a field answers to, so that the command line accepts what the constructor accepts:

- :func:`option`: the Hugging Face (or TRL) names of a field are further option strings of the field's option
  (``--max_grad_norm`` of ``clipping_norm``, ``--lr_scheduler_type`` of ``lr_scheduler``).
- :func:`carrier`: the names that are no field (``--fp16``, ``--gradient_accumulation_steps``,
  ``--ddp_find_unused_parameters``) are further option strings of one field's option (``local_rank`` for the
  Hugging Face names, ``padding_free`` for the TRL ones), which ``--help`` does not list. Their values have no fixed
  type: :func:`command_line_value` reads them.

The options' action, :class:`GivenAs`, stores each value under the field, keyed by the name it was given as
(:class:`NamedValues`); the constructor reads those names and values as keyword arguments (:func:`as_keywords`), so
that a name on the command line is mapped, ignored with a warning or refused exactly as by
``TrainingArguments(**kwargs)``. ``parse_dict`` and ``parse_json_file`` pass only the keys that are fields, so
a dict or a JSON file uses Opake's names.

Opacus' names (``target_epsilon``, ...) are keyword arguments only: a script's own ``--target_epsilon`` next to
these arguments would otherwise make argparse refuse the parser (a conflicting option string).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from opake_torch.transformers._parsing import coerce_scalar

__all__ = ["KEYWORD_ONLY", "GivenAs", "NamedValues", "as_keywords", "carrier", "command_line_value", "option"]

KEYWORD_ONLY = ("target_epsilon", "target_delta", "noise_multiplier")  # Opacus' names: not options
_TRUE, _FALSE = ("yes", "true", "t", "y"), ("no", "false", "f", "n")  # Hugging Face's words (string_to_bool)


class NamedValues(dict):
    """The values given on the command line for one field's option, keyed by the name each was given as."""


class GivenAs(argparse.Action):
    """The argparse action of an option with several names: stores ``{name: value}`` (:class:`NamedValues`) under
    the field. ``loose``: the values have no fixed type and are read by :func:`command_line_value`."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, loose: bool = False, **kwargs: Any) -> None:
        if loose:
            kwargs["type"] = command_line_value
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None)
        if not isinstance(given, NamedValues):  # the first of these options on this command line
            given = NamedValues()
            setattr(namespace, self.dest, given)
        given[(option_string or self.dest).lstrip("-").replace("-", "_")] = values


def command_line_value(text: str) -> Any:
    """A command-line value whose option fixes no type: Hugging Face's words for booleans (``yes``/``no``,
    ``true``/``false``, ``t``/``f``, ``y``/``n``), ``none`` for None, an int, a float, else the text."""
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    return coerce_scalar(text)


def _strings(names: Sequence[str]) -> list[str]:
    names = [name for name in names if name not in KEYWORD_ONLY]
    return [f"--{name}" for name in names] + [f"--{name.replace('_', '-')}" for name in names if "_" in name]


def option(*names: str, loose: bool = False) -> dict[str, Any]:
    """Field metadata: ``names`` (Hugging Face's or TRL's names of the field) as further option strings of the
    field's option; ``loose``: values read by :func:`command_line_value` instead of the annotation's type."""
    return {"aliases": _strings(names), "action": GivenAs, "loose": loose}


def carrier(*names: str) -> dict[str, Any]:
    """Field metadata: the field's option also takes ``names`` (names that are no field), with or without a value
    (``--fp16`` is ``--fp16 true``), read by :func:`command_line_value`; hidden from ``--help``."""
    return {"aliases": _strings(names), "action": GivenAs, "loose": True, "nargs": "?", "const": True,
            "help": argparse.SUPPRESS}  # fmt: skip


def as_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each :class:`NamedValues` replaced by the names and values it holds."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if isinstance(value, NamedValues):
            out.update(value)
        else:
            out[name] = value
    return out
