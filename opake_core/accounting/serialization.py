"""JSON form of processes (dicts in, dicts out; the adapter writes them to ``accountant.json``).

``to_json(p)`` gives ``{"format": "opake.accounting.process/1", "process": {...}, "versions": {...}}``; every
node is ``{"type": <name>, <fields>...}`` and children nest. ``from_json`` rebuilds the identical (equal)
process through the public factories, so a tampered document is validated like user input.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from opake_core.accounting.mf import BallsInBinsMF, BMinSepMF
from opake_core.accounting.processes import (
    AdaptiveClipping,
    Compose,
    Gaussian,
    Poisson,
    PoissonGroup,
    Process,
    RandomAllocation,
    Repeat,
    TruncatedPoisson,
    WithoutReplacement,
)
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["FORMAT", "from_json", "library_versions", "to_json"]

FORMAT = "opake.accounting.process/1"


def library_versions() -> dict[str, str]:
    """Versions of the libraries that decide the numbers (``"unknown"`` if not installed).

    Example:

        >>> from opake_core import accounting
        >>> sorted(accounting.library_versions())
        ['dp-accounting', 'opake']
    """
    out = {}
    for name in ("opake", "dp-accounting"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def _node(p: Process) -> dict[str, Any]:
    """The JSON node of ``p``: its type name and the fields :data:`_BUILDERS` lists for it."""
    for name, (cls, fields) in _BUILDERS.items():
        if isinstance(p, cls):
            return {"type": name, **{field: _encode(field, getattr(p, field)) for field in fields}}
    raise InputTypeError(f"to_json expects a process, got {type(p).__name__} {p!r}.")


def _encode(field: str, value: Any) -> Any:
    if field in ("inner", "process"):
        return _node(value)
    if field == "processes":
        return [_node(c) for c in value]
    if field == "coef":
        return list(value)
    return value


_BUILDERS = {  # type name -> (class, fields): the node format both ways
    "gaussian": (Gaussian, ("noise_multiplier",)),
    "adaptive_clipping": (AdaptiveClipping, ("inner", "count_noise_fraction", "expected_batch_size")),
    "poisson": (Poisson, ("inner", "sample_rate")),
    "truncated_poisson": (TruncatedPoisson, ("inner", "sample_rate", "dataset_size", "truncated_batch_size")),
    "without_replacement": (WithoutReplacement, ("inner", "dataset_size", "sample_size")),
    "random_allocation": (RandomAllocation, ("inner", "num_steps")),
    "poisson_group": (PoissonGroup, ("inner", "sample_rate", "group_size")),
    "repeat": (Repeat, ("process", "count")),
    "compose": (Compose, ("processes",)),
    "mf_balls_in_bins": (BallsInBinsMF, ("coef", "noise_multiplier", "num_bins", "n_steps")),
    "mf_b_min_sep": (BMinSepMF, ("coef", "noise_multiplier", "min_sep", "sampling_prob", "n_steps")),
}


def _build(obj: Any) -> Process:
    if not isinstance(obj, dict) or obj.get("type") not in _BUILDERS:
        raise ConfigurationError(
            f"a serialized process node needs a 'type' in {sorted(_BUILDERS)}, got {obj!r}; "
            "pass the 'process' part of a document made by to_json."
        )
    cls, fields = _BUILDERS[obj["type"]]
    if set(obj) != {"type", *fields}:
        raise ConfigurationError(
            f"a {obj['type']!r} node has fields {sorted(fields)}, got {sorted(set(obj) - {'type'})}."
        )
    args = []
    for name in fields:
        value = obj[name]
        if name in ("inner", "process"):
            value = _build(value)
        elif name == "processes":
            value = tuple(_build(v) for v in value)
        args.append(value)
    return cls(*args)


def to_json(process: Process) -> dict[str, Any]:
    """The JSON-ready dict of ``process``, with the format tag and the library versions.

    Example:

        >>> import json
        >>> from opake_core import accounting
        >>> run = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 1_000)
        >>> document = json.dumps(accounting.to_json(run))
        >>> accounting.from_json(json.loads(document)) == run
        True
    """
    return {"format": FORMAT, "process": _node(process), "versions": library_versions()}


def from_json(obj: dict[str, Any]) -> Process:
    """The process of a dict made by :func:`to_json` (versions are informational and not checked).

    A document is validated like user input: a bad value is refused, never accounted.

    Example:

        >>> from opake_core import ConfigurationError, accounting
        >>> document = accounting.to_json(accounting.gaussian(1.0))
        >>> accounting.from_json(document)
        Gaussian(noise_multiplier=1.0)
        >>> try:
        ...     accounting.from_json({**document, "format": "something else"})
        ... except ConfigurationError:
        ...     print("refused")
        refused
    """
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or "process" not in obj:
        raise ConfigurationError(
            f"from_json expects a dict with format {FORMAT!r} and a 'process', got {str(obj)[:200]!r}."
        )
    return _build(obj["process"])
