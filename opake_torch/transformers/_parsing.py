"""Coercion and validation helpers for :class:`~opake_torch.transformers.TrainingArguments`.

Every helper takes the field name so that its message names the argument, the value seen, and the fix. Helpers
return the canonical value; they never mutate their input.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.noise import compute_dtype_of
from opake_core.plan import SAMPLERS
from opake_torch import limits
from opake_torch.limits import MAX_COUNT, MAX_SCALE, MAX_SEED

__all__ = [
    "NUMERIC_LIMITS",
    "Limit",
    "as_choice",
    "as_dict",
    "as_positive_int",
    "as_steps",
    "calibration",
    "check_keys",
    "check_limit",
    "check_schedule_free_best_model",
    "clipping_kwargs",
    "coerce_scalar",
    "jsonable",
    "mechanism_kwargs",
    "parse_clipping_norm",
    "plain",
    "report_to",
    "router_aux",
    "sampling",
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
)
OPTIMIZER_ALIASES = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "lion_32bit": "lion",
    "schedule_free": "schedule_free_adamw",
}
_REFUSED_OPTIM_MARKERS = ("8bit", "paged", "apex", "galore", "bnb", "lomo")
SCHEDULERS = ("linear", "cosine", "constant")
SCHEDULER_ALIASES = {"constant_with_warmup": "constant"}
SCHEDULER_KWARGS = {"linear": ("end_value",), "cosine": ("end_value",), "constant": ()}

MECHANISM_DEFAULTS: dict[str, dict[str, Any]] = {
    "gaussian": {},
    "mf_band": {"bands": 16},
    "mf_blt": {"max_buffers": 10},
    "mf_bisr": {"bandwidth": 4},
    "mf_bsr": {"bandwidth": 8, "alpha": 1.0, "beta": 0.9},
    "mf_lambda_cgd": {"lambda_": 0.5},
    "mf_identity": {},
}
MECHANISM_KWARGS = {
    "gaussian": ("compute_dtype",),
    "mf_band": ("bands", "momentum", "lr_schedule"),
    "mf_blt": ("max_buffers", "momentum", "lr_schedule"),
    "mf_bisr": ("bandwidth", "normalized", "momentum", "lr_schedule", "inv_coefficients"),
    "mf_bsr": ("bandwidth", "alpha", "beta"),
    "mf_lambda_cgd": ("lambda_", "normalized", "lr_schedule"),
    "mf_identity": (),
}
_INT_MECHANISM_KWARGS = ("bands", "max_buffers", "bandwidth")
# Samplers each mechanism has an accountant for; the first is what "auto" resolves to.
SAMPLING_KWARGS = {"poisson": ("truncated_batch_size",), "k_out_of_t": ("k", "allocation")}
CLIPPING_KWARGS = {"fixed": (), "adaptive": ("target_quantile", "clipping_norm_max"), "auto": ("gamma",)}
CALIBRATION_DEFAULTS = {"min": 0.11, "max": 10.0, "tolerance": 1e-3}
ROUTER_AUX_DEFAULTS: dict[str, Any] = {"ratio": 0.02, "mean_tokens": None, "filter_beta": 0.99}
ROUTER_AUX_KWARGS = ("max_tokens", *ROUTER_AUX_DEFAULTS)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
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


_COUNT = "a count: at most 2**31 - 1, the reach of torch's int32 index arithmetic"
_INTERVAL = "a count of steps, or a float in (0, 1) for a fraction of the run"
_SCALE = "far beyond any working value; larger ones overflow a step's float32 arithmetic"
# Every numeric field of TrainingArguments, checked at construction before any other rule (see opake_torch.limits
# for the reasons), except those bounded by their own parser: clipping_norm and router_aux_loss_coef (which read
# strings), the privacy budget (PrivacyBudgetError) and privacy_noise_seed (a secret, kept out of the message). A
# subclass adds its own fields to its ``_limits``.
NUMERIC_LIMITS: dict[str, Limit] = {
    "per_device_train_batch_size": Limit(True, 1, MAX_COUNT, _COUNT),
    "per_device_eval_batch_size": Limit(True, 1, MAX_COUNT, _COUNT),
    "microbatch_size": Limit(True, 1, MAX_COUNT, _COUNT),
    "max_steps": Limit(True, -1, MAX_COUNT, "a count, or -1 to use num_train_epochs"),
    "num_train_epochs": Limit(False, 0, MAX_SCALE, _SCALE, open_low=True),
    "warmup_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "logging_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "save_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "eval_steps": Limit(False, 0, MAX_COUNT, _INTERVAL),
    "eval_delay": Limit(False, 0, MAX_COUNT, "epochs or steps to wait before the first evaluation"),
    "learning_rate": Limit(False, 0, MAX_SCALE, _SCALE),
    "weight_decay": Limit(False, 0, MAX_SCALE, _SCALE),
    "adam_epsilon": Limit(False, 0, MAX_SCALE, _SCALE),
    "adam_beta1": Limit(False, 0, 1, "a moment decay", open_high=True),
    "adam_beta2": Limit(False, 0, 1, "a moment decay", open_high=True),
    "label_smoothing_factor": Limit(False, 0, 1, "a probability mass", open_high=True),
    "cuda_graphs": Limit(True, 0, MAX_COUNT, "the number of graph signatures to retain, 0 disables; e.g. 8"),
    "seed": Limit(True, 0, MAX_SEED, "transformers.set_seed seeds numpy, which takes [0, 2**32)"),
    "data_seed": Limit(True, 0, MAX_SEED, "transformers.set_seed seeds numpy, which takes [0, 2**32)"),
    "save_total_limit": Limit(True, 1, MAX_COUNT, _COUNT),
    "dataloader_num_workers": Limit(True, 0, limits.MAX_WORKERS, "worker processes: more than any host has cores"),
    "max_length": Limit(True, 1, MAX_COUNT, _COUNT),
    "pad_to_multiple_of": Limit(True, 1, MAX_COUNT, _COUNT),
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
    """Refuse ``optim="schedule_free_adamw"`` with ``load_best_model_at_end``: the best checkpoint holds y, not x."""
    if optim == "schedule_free_adamw" and load_best_model_at_end:
        raise ConfigurationError(
            "optim='schedule_free_adamw' cannot be combined with load_best_model_at_end=True: a checkpoint holds the "
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
    return limits.check_number(value, name, minimum, MAX_COUNT, integer=True, why=_COUNT)


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


def _positive_bound(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise InputTypeError(f"{name} must be a number, not a bool; got {value!r}.")
    if isinstance(value, str):
        value = coerce_scalar(value)
    if not limits.is_real(value) or not value > 0:  # NaN fails the comparison
        raise ConfigurationError(
            f"{name} must be a positive number (use math.inf to disable clipping for a non-private run); got {value!r}."
        )
    if value != math.inf:
        limits.check_number(
            value,
            name,
            limits.MIN_CLIPPING_NORM,
            MAX_SCALE,
            why="the bound of one example's gradient, e.g. 1.0; beyond this range the noise it scales leaves float32; "
            "math.inf disables clipping for a non-private run",
        )
    return float(value)


def parse_clipping_norm(value: Any) -> float | dict[str, float]:
    """A positive float (``math.inf`` disables clipping) or ``{regex: bound, ..., "fallback": bound}``.

    Strings are a number (``"1.0"``, ``"inf"``), a JSON object or ``"regex=bound,fallback=bound"``. A dict that holds
    only ``"fallback"`` becomes its scalar. Patterns must compile; they are matched with ``re.search`` on dotted
    parameter names by :func:`opake_core.tree.per_group`.
    """
    if value is None:
        raise ConfigurationError(
            "clipping_norm must be a positive number (use math.inf to disable clipping for a non-private run); "
            "got None."
        )
    if isinstance(value, str):
        scalar = coerce_scalar(value)
        value = (
            scalar
            if isinstance(scalar, int | float) and not isinstance(scalar, bool)
            else as_dict(value, "clipping_norm")
        )
    if not isinstance(value, Mapping):
        return _positive_bound(value, "clipping_norm")
    bounds = as_dict(value, "clipping_norm")
    if "fallback" not in bounds:
        raise ConfigurationError(
            f"clipping_norm dict must include a 'fallback' key with the default per-example clip bound; got {bounds!r}."
        )
    out = {k: _positive_bound(v, f"clipping_norm[{k!r}]") for k, v in bounds.items()}
    for pattern in out:
        if pattern == "fallback":
            continue
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigurationError(
                f"clipping_norm pattern {pattern!r} is not a valid regular expression: {exc}."
            ) from exc
    return out["fallback"] if len(out) == 1 else out


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


def mechanism_kwargs(mechanism: str, value: Any) -> dict[str, Any]:
    """The user's mechanism kwargs over the defaults table, validated for ``mechanism``."""
    user = as_dict(value, "privacy_noise_mechanism_kwargs")
    if "bound" in user:
        raise ConfigurationError(
            "privacy_noise_mechanism_kwargs['bound'] (bounded Gaussian) is unsupported: there is no matching "
            "accountant for bounded noise in Opake. Remove 'bound'."
        )
    selector = f"privacy_noise_mechanism={mechanism!r}"
    check_keys(user, MECHANISM_KWARGS[mechanism], "privacy_noise_mechanism_kwargs", selector)
    kwargs = {**MECHANISM_DEFAULTS[mechanism], **user}
    if "compute_dtype" in kwargs:
        kwargs["compute_dtype"] = compute_dtype_of(kwargs["compute_dtype"])
    for key in _INT_MECHANISM_KWARGS:
        if key in kwargs:
            as_positive_int(kwargs[key], f"privacy_noise_mechanism_kwargs[{key!r}]")
    if mechanism == "mf_bsr" and not as_number(kwargs["alpha"], "alpha") > as_number(kwargs["beta"], "beta"):
        raise ConfigurationError(
            f"mf_bsr requires alpha > beta, got alpha={kwargs['alpha']!r}, beta={kwargs['beta']!r}."
        )
    return kwargs


def sampling(mechanism: str, requested: Any, value: Any) -> tuple[str, dict[str, Any]]:
    """``(sampling_mode, sampling_kwargs)``: ``"auto"`` resolved for ``mechanism`` and the pair validated."""
    allowed = SAMPLERS[mechanism]  # opake_core.plan.SAMPLERS: the pairs with an accountant
    mode = plain(requested)
    if mode == "auto":
        mode = allowed[0]
    if mode not in allowed:
        reason = ""
        if mechanism == "mf_band" and mode == "poisson":
            reason = (
                " Plain Poisson draws from the whole dataset every step and does not realize the banded "
                "participation that mf_band's accountant assumes; use 'b_min_sep' if cyclic rotation does not fit."
            )
        raise ConfigurationError(
            f"sampling_mode={requested!r} has no matching accountant for privacy_noise_mechanism={mechanism!r}. "
            f"Allowed: {['auto', *allowed]}.{reason}"
        )
    kwargs = as_dict(value, "sampling_kwargs")
    owned = sorted({"bands", "sampling_prob"} & set(kwargs))
    if owned:
        raise ConfigurationError(
            f"sampling_kwargs may not set {owned}: they are derived from the privacy configuration "
            "(privacy_noise_mechanism_kwargs['bands'], per_device_train_batch_size and the dataset size)."
        )
    if "truncated_batch_size" in kwargs and mode != "poisson":
        raise ConfigurationError(
            f"sampling_kwargs['truncated_batch_size'] is only supported with sampling_mode='poisson', got {mode!r}."
        )
    check_keys(kwargs, SAMPLING_KWARGS.get(mode, ()), "sampling_kwargs", f"sampling_mode={mode!r}")
    if "truncated_batch_size" in kwargs:
        as_positive_int(kwargs["truncated_batch_size"], "sampling_kwargs['truncated_batch_size']")
    if mode == "k_out_of_t":
        if set(kwargs) != {"k", "allocation"}:
            raise ConfigurationError(
                f"sampling_mode='k_out_of_t' requires both sampling_kwargs 'k' and 'allocation', got {kwargs!r}. "
                "Example: sampling_kwargs={'k': 2, 'allocation': 'block'}."
            )
        as_positive_int(kwargs["k"], "sampling_kwargs['k']")
        as_choice(kwargs["allocation"], "sampling_kwargs['allocation']", ("block", "total"))
    return mode, kwargs


def calibration(value: Any) -> dict[str, float]:
    """The calibration search bounds merged over the defaults; ``0 < min < max < inf`` and ``tolerance > 0``."""
    kwargs = {**CALIBRATION_DEFAULTS, **as_dict(value, "noise_calibration_kwargs")}
    check_keys(kwargs, tuple(CALIBRATION_DEFAULTS), "noise_calibration_kwargs", "noise calibration")
    low, high, tol = (as_number(kwargs[k], f"noise_calibration_kwargs[{k!r}]") for k in CALIBRATION_DEFAULTS)
    if not (0 < low < high < math.inf and tol > 0):
        raise ConfigurationError(
            f"noise_calibration_kwargs needs 0 < min < max < inf and tolerance > 0, got {kwargs!r}."
        )
    why = "the noise multipliers that opake_torch.limits lets a run use"
    for key in ("min", "max"):
        limits.check_number(
            kwargs[key], f"noise_calibration_kwargs[{key!r}]", limits.MIN_NOISE_MULTIPLIER, limits.MAX_NOISE_MULTIPLIER,
            why=why,
        )  # fmt: skip
    limits.check_number(
        tol, "noise_calibration_kwargs['tolerance']", limits.MIN_TOLERANCE, 1, open_high=True,
        why="relative; below 1e-9 the search runs into the rounding of epsilon itself",
    )  # fmt: skip
    return {"min": float(low), "max": float(high), "tolerance": float(tol)}


def router_aux(coefficient: Any, value: Any) -> tuple[float, dict[str, Any]]:
    """``(router_aux_loss_coef, router_aux_kwargs)`` validated: a coefficient >= 0 (None is 0.0), and for a non-zero
    one the kwargs of the private router release over :data:`ROUTER_AUX_DEFAULTS` (``max_tokens`` required)."""
    coefficient = 0.0 if plain(coefficient) is None else plain(coefficient)
    if isinstance(coefficient, str):
        coefficient = coerce_scalar(coefficient)
    limits.check_number(
        coefficient, "router_aux_loss_coef", 0.0, MAX_SCALE,
        why="0.0 (the default) trains without router load balancing, a small value such as 0.01 turns the private "
        "router release on",
    )  # fmt: skip
    kwargs = as_dict(value, "router_aux_kwargs")
    if coefficient == 0.0:
        if kwargs:
            raise ConfigurationError(
                f"router_aux_kwargs={kwargs!r} is set but router_aux_loss_coef is 0.0, so no router release runs: "
                "set router_aux_loss_coef > 0 (for example 0.01), or drop router_aux_kwargs."
            )
        return 0.0, {}
    check_keys(kwargs, ROUTER_AUX_KWARGS, "router_aux_kwargs", "the private router release")
    if "max_tokens" not in kwargs:
        raise ConfigurationError(
            "router_aux_kwargs needs 'max_tokens' (an int >= 1, the public bound on the tokens of one example that "
            "count in full; usually max_length), e.g. router_aux_kwargs={'max_tokens': 1024}."
        )
    kwargs = {**ROUTER_AUX_DEFAULTS, **kwargs}
    as_positive_int(kwargs["max_tokens"], "router_aux_kwargs['max_tokens']")
    ratio = as_number(kwargs["ratio"], "router_aux_kwargs['ratio']")
    if not 0.0 < ratio < math.inf:
        raise ConfigurationError(
            f"router_aux_kwargs['ratio'] must be a finite number > 0, got {ratio!r}: the release's noise multiplier "
            "is z / sqrt(ratio). 0.02 (the default) costs about 1% more gradient noise."
        )
    beta = as_number(kwargs["filter_beta"], "router_aux_kwargs['filter_beta']")
    if not 0.0 <= beta < 1.0:
        raise ConfigurationError(
            f"router_aux_kwargs['filter_beta'] must be in [0, 1), got {beta!r}; 0.99 is the default."
        )
    if kwargs["mean_tokens"] is not None:
        mean = as_number(kwargs["mean_tokens"], "router_aux_kwargs['mean_tokens']")
        if not 0.0 < mean < math.inf:
            raise ConfigurationError(
                f"router_aux_kwargs['mean_tokens'] must be a finite number > 0, got {mean!r}; leave it unset for "
                "max_tokens."
            )
    return float(coefficient), kwargs


def clipping_kwargs(mode: str, value: Any) -> dict[str, Any]:
    """The kwargs of ``clipping_mode``: none for fixed, ``target_quantile``/``clipping_norm_max``, ``gamma``."""
    kwargs = as_dict(value, "clipping_kwargs")
    check_keys(kwargs, CLIPPING_KWARGS[mode], "clipping_kwargs", f"clipping_mode={mode!r}")
    if "target_quantile" in kwargs and not 0 < as_number(kwargs["target_quantile"], "target_quantile") < 1:
        raise ConfigurationError(
            f"clipping_kwargs['target_quantile'] must be in (0, 1), got {kwargs['target_quantile']!r}."
        )
    for key in ("clipping_norm_max", "gamma"):
        if key in kwargs and not as_number(kwargs[key], key) > 0:
            raise ConfigurationError(f"clipping_kwargs[{key!r}] must be > 0, got {kwargs[key]!r}.")
        if key in kwargs:
            limits.check_number(kwargs[key], f"clipping_kwargs[{key!r}]", 0, MAX_SCALE, open_low=True, why=_SCALE)
    return kwargs


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
