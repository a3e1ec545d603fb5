"""Coercion and validation helpers of :class:`~opake_torch.transformers.TrainingArguments` and of the settings it
builds (:class:`~opake_torch.transformers.privacy_settings.PrivacySettings`,
:class:`~opake_torch.transformers.compute_settings.ComputeSettings`), and the rules of the arguments' own fields.

Every helper takes the field name so that its message names the argument, the value seen, and the fix. Helpers
return the canonical value; they never mutate their input.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch import limits
from opake_torch.limits import MAX_COUNT, MAX_SCALE, MAX_SEED

__all__ = [
    "COUNT",
    "NUMERIC_LIMITS",
    "SCALE",
    "Limit",
    "as_bool",
    "as_choice",
    "as_dict",
    "as_positive_int",
    "as_steps",
    "check_keys",
    "check_limit",
    "check_schedule_free_best_model",
    "check_types",
    "coerce_scalar",
    "jsonable",
    "plain",
    "report_to",
]


OPTIMIZERS = (
    "sgd",
    "momentum",
    "adam",
    "adamw",
    "adam-bc",
    "adamw-bc",
    "adafactor",
    "lion",
    "ademamix",
    "rmsprop",
    "adagrad",
    "radam",
    "adadelta",
    "schedule_free_adamw",
    "schedule_free",
    "schedule_free_radam",
    "schedule_free_sgd",
    "stable_adamw",
)
OPTIMIZER_ALIASES = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "lion_32bit": "lion",
    "schedule_free": "schedule_free_adamw",
}
_REFUSED_OPTIM_MARKERS = ("8bit", "paged", "apex", "galore", "bnb", "lomo")
# Hugging Face's learning-rate schedulers (transformers.SchedulerType) and their lr_scheduler_kwargs. A schedule is a
# public function of the step, so any of them is private; "constant" warms up over warmup_steps (Hugging Face's
# "constant_with_warmup").
SCHEDULERS = (
    "linear", "cosine", "constant", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "warmup_stable_decay",
)  # fmt: skip
SCHEDULER_ALIASES = {"constant_with_warmup": "constant"}
SCHEDULER_KWARGS = {
    "linear": ("end_value",),
    "cosine": ("end_value", "num_cycles"),
    "constant": (),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio", "num_cycles",
    ),
}  # fmt: skip
_FROM_METRICS = (
    "it sets the learning rate from metrics measured during training ({metric}), so the schedule would depend on "
    "data that no privacy mechanism covers; choose a schedule that is a function of the step, such as 'cosine' or "
    "'warmup_stable_decay'"
)
REFUSED_SCHEDULERS = {
    "reduce_lr_on_plateau": _FROM_METRICS.format(metric="the evaluation loss"),
    "greedy": _FROM_METRICS.format(metric="the training loss"),
}

DDP_BACKENDS = ("nccl", "gloo", "mpi", "ucc")


class Limit(NamedTuple):
    """The values a numeric field takes: an ``int`` (``integer``) or any finite number, in ``[low, high]`` (a side
    is open with ``open_low`` / ``open_high``, absent when ``None``); ``why`` ends the refusal."""

    integer: bool
    low: float | None
    high: float | None
    why: str = ""
    open_low: bool = False
    open_high: bool = False


COUNT = "a count: at most 2**31 - 1, the reach of torch's int32 index arithmetic"
_INTERVAL = "a count of steps, or a float in (0, 1) for a fraction of the run"
SCALE = "far beyond any working value; larger ones overflow a step's float32 arithmetic"
# The numeric fields of TrainingArguments itself (the privacy and compute fields have their tables in
# privacy_settings and compute_settings), checked at construction before any other rule (see opake_torch.limits for
# the reasons), except privacy_noise_seed (a secret, kept out of the message). A subclass adds its own fields to its
# ``_limits``.
NUMERIC_LIMITS: dict[str, Limit] = {
    "per_device_eval_batch_size": Limit(True, 1, MAX_COUNT, COUNT),
    "warmup_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "logging_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "save_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "eval_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "eval_delay": Limit(False, 0, MAX_COUNT, "epochs or steps to wait before the first evaluation"),
    "learning_rate": Limit(False, 0, MAX_SCALE, SCALE),
    "weight_decay": Limit(False, 0, MAX_SCALE, SCALE),
    "adam_epsilon": Limit(False, 0, MAX_SCALE, SCALE),
    "adam_beta1": Limit(False, 0, 1, "a moment decay", open_high=True),
    "adam_beta2": Limit(False, 0, 1, "a moment decay", open_high=True),
    "label_smoothing_factor": Limit(False, 0, 1, "a probability mass", open_high=True),
    "seed": Limit(True, 0, MAX_SEED, "transformers.set_seed seeds numpy, which takes [0, 2**32)"),
    "data_seed": Limit(True, 0, MAX_SEED, "transformers.set_seed seeds numpy, which takes [0, 2**32)"),
    "save_total_limit": Limit(True, 1, MAX_COUNT, COUNT),
    "dataloader_num_workers": Limit(True, 0, limits.MAX_WORKERS, "worker processes: more than any host has cores"),
    "max_length": Limit(True, 1, MAX_COUNT, COUNT),
    "pad_to_multiple_of": Limit(True, 1, MAX_COUNT, COUNT),
    "local_rank": Limit(True, -1, MAX_COUNT, "-1 outside torchrun"),
    "ddp_timeout": Limit(True, 1, MAX_COUNT, "seconds"),
}


def check_limit(value: Any, name: str, limit: Limit) -> int | float:
    """``value`` within ``limit`` (:class:`Limit`), else ``ConfigurationError`` naming the field, value and range."""
    return limits.check_number(
        value,
        name,
        limit.low,
        limit.high,
        integer=limit.integer,
        open_low=limit.open_low,
        open_high=limit.open_high,
        why=limit.why,
    )


def as_bool(value: Any, name: str, *, allow_none: bool = False) -> bool | None:
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    raise ConfigurationError(
        f"{name} must be True or False{' or None' if allow_none else ''}, got {type(value).__name__} {value!r}. A "
        "string or a number is not read as a bool (the string 'False' is true in Python): pass True or False."
    )


@functools.cache
def _typed_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """``(name, kind, optional)`` of every field of the dataclass ``cls`` annotated ``bool``, ``int`` or ``float``
    (``kind``), alone or with None (``optional``), found from the annotations so that a new field is checked without
    being listed."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        optional = type(None) in kinds
        kinds.discard(type(None))
        if len(kinds) == 1 and (kind := kinds.pop()) in (bool, int, float):
            out.append((f.name, kind, optional))
    return tuple(out)


def check_types(obj: Any, limits_of: Mapping[str, Limit], *, skip: frozenset[str] = frozenset()) -> None:
    """Before any other rule of the dataclass ``obj``: every field annotated ``bool`` holds a bool (or None where
    annotated so), and every numeric field with an entry in ``limits_of`` a finite number of its type within it, so
    that no value reaches a step to overflow there or be read as truthy. ``skip``: fields checked elsewhere."""
    for name, kind, optional in _typed_fields(type(obj)):
        value = getattr(obj, name)
        if name in skip or (value is None and optional):
            continue
        if kind is bool:
            as_bool(value, name, allow_none=optional)
        elif name in limits_of:
            check_limit(value, name, limits_of[name])


def plain(value: Any) -> Any:
    """The value of a ``str`` enum (Hugging Face passes ``IntervalStrategy``, ``SchedulerType``, ...) or ``value``."""
    return value.value if isinstance(value, enum.Enum) else value


def coerce_scalar(text: str) -> Any:
    """``"true"``/``"false"`` -> bool, ``"none"``/``"null"`` -> None, then int, then float, else the stripped text."""
    text = text.strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _parse_pairs(text: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(
                f"{name} could not be parsed: {text!r} (item {item!r} is not 'key=value'). "
                'Pass a mapping, a JSON object string such as \'{"a": 1}\', or "a=1,b=2".'
            )
        out[key.strip()] = coerce_scalar(value)
    return out


def as_dict(value: Any, name: str) -> dict[str, Any]:
    """A fresh ``dict`` from None, a Mapping, a JSON object string or ``"a=1,b=2"``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out = dict(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                out = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigurationError(f"{name} is not a valid JSON object: {value!r} ({exc}).") from exc
            if not isinstance(out, dict):
                raise ConfigurationError(f"{name} must be a JSON object, got {value!r}.")
        else:
            out = _parse_pairs(text, name)
    else:
        raise InputTypeError(
            f"{name} must be a mapping, a JSON object string or 'a=1,b=2', got {type(value).__name__}: {value!r}."
        )
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise ConfigurationError(f"{name} keys must be strings, got {bad!r}.")
    return out


def check_keys(mapping: Mapping[str, Any], allowed: Sequence[str], name: str, selector: str) -> None:
    """Refuse keys outside ``allowed``; ``selector`` says which setting chose the allowed set."""
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise ConfigurationError(
            f"{name} contains unsupported keys for {selector}: {unknown}. Allowed: {sorted(allowed) or 'none'}."
        )


def check_schedule_free_best_model(optim: str, load_best_model_at_end: Any) -> None:
    """Refuse a Schedule-Free ``optim`` with ``load_best_model_at_end``: the best checkpoint holds y, not x."""
    if optim.startswith("schedule_free") and load_best_model_at_end:
        raise ConfigurationError(
            f"optim={optim!r} cannot be combined with load_best_model_at_end=True: a checkpoint holds the "
            "training iterate y (so that a resume continues exactly), not the averaged weights x that evaluation "
            "scored. Set load_best_model_at_end=False (the weights after train() are x), or choose another optim."
        )


def as_choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    value = plain(value)
    if not isinstance(value, str) or value not in allowed:
        raise ConfigurationError(f"{name} must be one of {list(allowed)}, got {value!r}.")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """An ``int`` in ``[minimum, 2**31 - 1]`` (:data:`~opake_torch.limits.MAX_COUNT`)."""
    if not _is_int(value) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return limits.check_number(value, name, minimum, MAX_COUNT, integer=True, why=COUNT)


def as_number(value: Any, name: str) -> float:
    """An ``int`` or ``float`` (not a bool), not NaN; a huge int is returned as is, never converted."""
    if not limits.is_real(value) or (isinstance(value, float) and math.isnan(value)):
        raise ConfigurationError(f"{name} must be a number, got {value!r}.")
    return value


def as_steps(value: Any, name: str, *, allow_zero: bool = False) -> int | float:
    """A step interval: an int >= 1 (or 0 when allowed), or a float in (0, 1) read as a fraction of the run.

    A float >= 1 must be integral (``500.0`` -> ``500``); ``1.5`` is refused, as in Hugging Face.
    """
    value = as_number(value, name)
    if isinstance(value, float):
        if 0 < value < 1:
            return value
        if value == 0 and allow_zero:
            return 0
        if value >= 1 and value.is_integer():
            return int(value)
        raise ConfigurationError(
            f"{name} must be an integer if bigger than 1, or a float in (0, 1) for a fraction of the run; "
            f"got {value!r}."
        )
    if value < (0 if allow_zero else 1):
        raise ConfigurationError(
            f"{name} must be >= {0 if allow_zero else 1} (or a fraction in (0, 1)), got {value!r}."
        )
    return value


def as_path(value: Any, name: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be a path string, got {type(value).__name__}: {value!r}.")
    return os.path.expanduser(value)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"the environment variable {name} must be an integer, got {raw!r}.") from None


def report_to(value: Any) -> list[str]:
    if value is None or value == "none":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return [v for v in value if v != "none"]
    raise InputTypeError(f"report_to must be None, 'none', 'all', a name or a list of names; got {value!r}.")


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
