"""``PrivacySettings``: the training arguments that decide a run's privacy guarantee, resolved and validated together.

These are the values :func:`opake_torch.transformers.privacy.build_plan` maps onto the core's
:func:`opake_core.plan.plan` (sampler, rate, horizon, mechanism, clipping, budget, accounting, router release), and
so exactly those a resume must keep: the horizon check of a resume compares what they resolve to
(:func:`opake_torch.transformers.privacy.resume_fields`). Everything else (compute flags,
:class:`~opake_torch.transformers.compute_settings.ComputeSettings`; optimizer, logging, saving) changes how a run
computes or reports, never its epsilon.

A value is frozen: ``__post_init__`` reads each field (strings, Hugging Face enums, ``"auto"``, ``None`` for a
default), stores the canonical value, and applies every rule of these fields; ``dataclasses.replace`` validates
again. :class:`~opake_torch.transformers.TrainingArguments` builds one (``args.privacy``) from its fields of the same
names, so every message names the argument a user passed. The dict-valued fields are fresh copies that nothing else
holds: treat them as read-only.

The keys (``privacy_noise_seed``, ``privacy_noise_generator``) are not here: they decide which noise is drawn, not
how much, and the seed is a secret that no configuration value holds.

Decisions on points where the reference designs disagree:

- Adaptive clipping with an ``mf_*`` mechanism raises. Matrix-factorization noise is calibrated to a constant
  per-step sensitivity; silently switching to fixed clipping would run something the user did not ask for.
- Per-group clipping (a ``clipping_norm`` dict) is supported with ``clipping_mode="fixed"`` only. Adaptive clipping
  estimates one private quantile; per-group adaptive would spend budget on one quantile per group and is not
  implemented. AUTO-S normalizes by the whole per-example norm, which has no per-group form.
- ``privacy_noise_mechanism_kwargs["bound"]`` raises "no matching accountant".
- ``clipping_norm`` dict keys are regular expressions matched with ``re.search`` on dotted parameter names, the
  semantics of :func:`opake_core.tree.per_group`; the patterns are compiled here.
- ``privacy_accounting`` is on unless set to ``False``: a fixed-noise run reports its epsilon. A non-private run
  (``privacy_noise_multiplier=0.0``) always reports epsilon = inf.
- ``ddp_shard="global"`` (every rank draws the whole dataset independently) is accepted on one process, where it is
  the plain sampler (a group of one rank is the Poisson step itself), so the same arguments run on one GPU and on
  many; its combination rules (Poisson, DP-SGD, fixed clipping, record-level) are checked there too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opake_core.errors import ConfigurationError, InputTypeError, PrivacyBudgetError
from opake_core.noise import compute_dtype_of
from opake_core.plan import SAMPLERS, check_combination, is_horizon
from opake_torch import limits
from opake_torch.limits import MAX_COUNT, MAX_SCALE
from opake_torch.transformers import _parsing as p

__all__ = [
    "CALIBRATION_DEFAULTS",
    "CLIPPING_KWARGS",
    "DDP_SHARDS",
    "MECHANISM_DEFAULTS",
    "MECHANISM_KWARGS",
    "PRIVACY_LIMITS",
    "PRIVACY_UNITS",
    "ROUTER_AUX_DEFAULTS",
    "SAMPLING_KWARGS",
    "PrivacySettings",
    "parse_clipping_norm",
]

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
SAMPLING_KWARGS = {"poisson": ("truncated_batch_size",), "k_out_of_t": ("k", "allocation")}
CLIPPING_KWARGS = {"fixed": (), "adaptive": ("target_quantile", "clipping_norm_max"), "auto": ("gamma",)}
CALIBRATION_DEFAULTS = {"min": 0.11, "max": 10.0, "tolerance": 1e-3}
ROUTER_AUX_DEFAULTS: dict[str, Any] = {"ratio": 0.02, "mean_tokens": None, "filter_beta": 0.99}
ROUTER_AUX_KWARGS = ("max_tokens", *ROUTER_AUX_DEFAULTS)
# The numeric fields checked by range before any other rule (opake_torch.limits gives the reasons). The budget and
# the clipping bound have rules of their own below, which read strings and raise PrivacyBudgetError.
PRIVACY_UNITS = ("record", "user")
DDP_SHARDS = ("per_rank", "global")
"""How data-parallel ranks draw a step's sample (:data:`opake_core.sampling.poisson.SHARDINGS`)."""
REDUCTIONS = ("mean", "sum")
"""How a user's row gradients combine before the clip (:func:`opake_core.clipping.user_loss`)."""
PRIVACY_LIMITS: dict[str, p.Limit] = {
    "per_device_train_batch_size": p.Limit(True, 1, MAX_COUNT, p.COUNT),
    "world_size": p.Limit(True, 1, MAX_COUNT, "the WORLD_SIZE of torchrun; " + p.COUNT),
    "max_steps": p.Limit(True, -1, MAX_COUNT, "a count, or -1 to use num_train_epochs"),
    "num_train_epochs": p.Limit(False, 0, MAX_SCALE, p.SCALE, open_low=True),
    "privacy_max_rows_per_user": p.Limit(True, 1, MAX_COUNT, p.COUNT),
}


@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """The privacy settings of a run (module docstring); the fields are those of
    :class:`~opake_torch.transformers.TrainingArguments` with the same names, documented on the 'Training arguments'
    page, plus ``world_size``.

    Attributes:
        per_device_train_batch_size: the expected batch of one rank; ``train_batch_size`` is the cluster's.
        world_size: the number of ranks (``WORLD_SIZE``) whose expected batches together are one step's sample.
        num_train_epochs, max_steps: the horizon (``max_steps`` when positive, else epochs over the dataset).
        clipping_norm, clipping_mode, clipping_kwargs: the clipping rule.
        privacy_target_epsilon, privacy_target_delta, privacy_noise_multiplier: the budget (a fixed multiplier,
            0.0 for a non-private run, or a target to calibrate to; delta None is ``1 / N**1.1``).
        privacy_accounting, privacy_allow_large_delta: the accounting choices.
        privacy_noise_mechanism, privacy_noise_mechanism_kwargs: DP-SGD (``"gaussian"``) or a DP-FTRL strategy.
        noise_calibration_kwargs: ``min``, ``max`` and ``tolerance`` of the multiplier search.
        sampling_mode, sampling_kwargs: the sampler (``"auto"`` resolved for the mechanism).
        router_aux_loss_coef, router_aux_kwargs: the private MoE router release (off: None or 0.0).
        privacy_unit, privacy_user_column, privacy_max_rows_per_user, privacy_user_reduction: what one neighbour
            adds or removes: a row (``"record"``), or a user and all its rows (``"user"``: the users are the values
            of the dataset column ``privacy_user_column``; a sampled user contributes at most
            ``privacy_max_rows_per_user`` rows, and the ``"mean"`` or ``"sum"`` of their gradients is clipped).
        ddp_shard: under DDP, ``"per_rank"`` (disjoint strided shards at the cluster rate) or ``"global"`` (every
            rank draws the whole dataset at ``per_device_train_batch_size / N``, accounted as a group of
            ``world_size`` records).
    """

    per_device_train_batch_size: int
    world_size: int = 1
    num_train_epochs: float
    max_steps: int
    clipping_norm: float | dict[str, float]
    clipping_mode: str
    clipping_kwargs: dict[str, Any] | None
    privacy_target_epsilon: float | None
    privacy_target_delta: float | None
    privacy_noise_multiplier: float | None
    privacy_accounting: bool | None
    privacy_allow_large_delta: bool
    privacy_noise_mechanism: str
    privacy_noise_mechanism_kwargs: dict[str, Any] | None
    noise_calibration_kwargs: dict[str, float] | None
    sampling_mode: str
    sampling_kwargs: dict[str, Any] | None
    router_aux_loss_coef: float | None
    router_aux_kwargs: dict[str, Any] | None
    privacy_unit: str = "record"
    privacy_user_column: str | None = None
    privacy_max_rows_per_user: int | None = None
    privacy_user_reduction: str = "mean"
    ddp_shard: str = "per_rank"

    def __post_init__(self) -> None:
        p.check_types(self, PRIVACY_LIMITS)
        if self.max_steps == 0:
            raise ConfigurationError("max_steps must be a positive int, or -1 to use num_train_epochs; got 0.")
        self._resolve_mechanism()
        self._resolve_budget()
        self._resolve_clipping()
        self._resolve_router()
        self._resolve_unit()
        self._resolve_ddp_shard()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the canonical value, once, while the frozen value is built

    @property
    def train_batch_size(self) -> int:
        """The cluster-wide expected batch; the sample rate is ``train_batch_size / N``."""
        return self.per_device_train_batch_size * self.world_size

    @property
    def is_complete_horizon(self) -> bool:
        """True when the mechanism or sampler is accounted once over the declared horizon (mf_*, k_out_of_t)."""
        return is_horizon(self.privacy_noise_mechanism, self.sampling_mode)

    @property
    def router_release(self) -> bool:
        """Whether the run releases the MoE router load statistic (``router_aux_loss_coef > 0``)."""
        return bool(self.router_aux_loss_coef)

    def _resolve_mechanism(self) -> None:
        mechanism = p.as_choice(self.privacy_noise_mechanism, "privacy_noise_mechanism", tuple(MECHANISM_DEFAULTS))
        self._set("privacy_noise_mechanism", mechanism)
        self._set("privacy_noise_mechanism_kwargs", _mechanism_kwargs(mechanism, self.privacy_noise_mechanism_kwargs))
        mode, kwargs = _sampling(mechanism, self.sampling_mode, self.sampling_kwargs)
        self._set("sampling_mode", mode)
        self._set("sampling_kwargs", kwargs)

    def _resolve_budget(self) -> None:
        nm, eps, delta = self.privacy_noise_multiplier, self.privacy_target_epsilon, self.privacy_target_delta
        if nm is None and eps is None:
            raise PrivacyBudgetError(
                "Set either privacy_noise_multiplier (use 0.0 for non-private training) or privacy_target_epsilon "
                "(to calibrate noise to a budget); neither was provided."
            )
        if nm is not None:  # bounds before float(): a huge int does not convert
            if not 0 <= p.as_number(nm, "privacy_noise_multiplier") < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_noise_multiplier must be finite and >= 0 (0.0 = non-private), got {nm!r}."
                )
            if nm != 0:
                limits.check_number(
                    nm, "privacy_noise_multiplier", limits.MIN_NOISE_MULTIPLIER, limits.MAX_NOISE_MULTIPLIER,
                    why="or 0.0 for a non-private run; see opake_torch.limits", error=PrivacyBudgetError,
                )  # fmt: skip
            self._set("privacy_noise_multiplier", float(nm))
        if eps is not None:
            if not 0 < p.as_number(eps, "privacy_target_epsilon") < math.inf:
                raise PrivacyBudgetError(
                    f"privacy_target_epsilon must be finite and > 0, got {eps!r}. For a non-private run set "
                    "privacy_noise_multiplier=0.0 and leave privacy_target_epsilon unset."
                )
            limits.check_number(
                eps, "privacy_target_epsilon", 0, limits.MAX_SCALE, open_low=True,
                why="an epsilon anywhere near it protects nothing", error=PrivacyBudgetError,
            )  # fmt: skip
            self._set("privacy_target_epsilon", float(eps))
        if delta is not None:
            if not 0 < p.as_number(delta, "privacy_target_delta") < 1:
                raise PrivacyBudgetError(
                    f"privacy_target_delta must be in (0, 1), got {delta!r}; leave it None for 1 / N**1.1."
                )
            self._set("privacy_target_delta", float(delta))
        self._resolve_accounting()
        self._set("noise_calibration_kwargs", _calibration(self.noise_calibration_kwargs))

    def _resolve_accounting(self) -> None:
        accounting = self.privacy_accounting  # a bool or None: check_types
        if accounting is False and self.privacy_target_epsilon is not None:
            raise ConfigurationError(
                "privacy_accounting=False cannot be combined with privacy_target_epsilon: the target needs the "
                "accountant. Remove privacy_accounting=False."
            )
        if accounting is False and self.is_complete_horizon:
            raise ConfigurationError(
                f"privacy_accounting=False is not allowed with privacy_noise_mechanism={self.privacy_noise_mechanism!r}"
                f" / sampling_mode={self.sampling_mode!r}: the horizon snapshot lets a resumed run detect a changed "
                "strategy or multiplier, so it is always recorded. Remove privacy_accounting=False."
            )
        if accounting is None:  # the default: every run reports its epsilon unless asked not to
            self._set("privacy_accounting", True)

    def _resolve_clipping(self) -> None:
        bound = parse_clipping_norm(self.clipping_norm)
        self._set("clipping_norm", bound)
        mode = p.as_choice(self.clipping_mode, "clipping_mode", tuple(CLIPPING_KWARGS))
        self._set("clipping_mode", mode)
        bounds = bound.values() if isinstance(bound, dict) else (bound,)
        if any(math.isinf(b) for b in bounds) and self.privacy_noise_multiplier != 0.0:
            raise ConfigurationError(
                f"clipping_norm=inf disables clipping and is allowed only with privacy_noise_multiplier=0.0 (got "
                f"{self.privacy_noise_multiplier!r}): infinite sensitivity with noise gives infinite noise."
            )
        if isinstance(bound, dict) and mode != "fixed":
            raise ConfigurationError(
                f"per-group clipping_norm is supported only with clipping_mode='fixed', got {mode!r}. Use a scalar "
                "clipping_norm or fixed clipping."
            )
        self._set("clipping_kwargs", _clipping_kwargs(mode, self.clipping_kwargs))
        check_combination(  # the core's rule: sampler, mechanism, clipping and budget have one accountant together
            mechanism=self.privacy_noise_mechanism,
            sampler=self.sampling_mode,
            adaptive_clipping=mode == "adaptive",
            noise_multiplier=self.privacy_noise_multiplier,
            target=self.privacy_target_epsilon,
        )

    def _resolve_router(self) -> None:
        coefficient, kwargs = _router_aux(self.router_aux_loss_coef, self.router_aux_kwargs)
        self._set("router_aux_kwargs", kwargs)
        if not coefficient:  # off: None (the default, as TRL's) or 0.0, as given
            self._set("router_aux_loss_coef", None if p.plain(self.router_aux_loss_coef) is None else 0.0)
            return
        self._set("router_aux_loss_coef", coefficient)
        if self.privacy_noise_mechanism != "gaussian":
            raise ConfigurationError(
                f"router_aux_loss_coef={coefficient!r} (the private router release) needs "
                f"privacy_noise_mechanism='gaussian', got {self.privacy_noise_mechanism!r}: the router release is a "
                "DP-SGD release, accounted next to independent Gaussian noise only. Use 'gaussian', or set "
                "router_aux_loss_coef=0.0."
            )
        if self.clipping_mode != "fixed" or isinstance(self.clipping_norm, dict):
            what = "a per-group clipping_norm" if isinstance(self.clipping_norm, dict) else repr(self.clipping_mode)
            raise ConfigurationError(
                f"router_aux_loss_coef={coefficient!r} (the private router release) needs fixed scalar clipping "
                f"(clipping_mode='fixed', one clipping_norm), got {what}. Use a scalar clipping_norm with "
                "clipping_mode='fixed', or set router_aux_loss_coef=0.0."
            )

    @property
    def user_level(self) -> bool:
        """Whether the privacy unit is a user (all its rows) rather than one row."""
        return self.privacy_unit == "user"

    def _resolve_unit(self) -> None:
        unit = p.as_choice(self.privacy_unit, "privacy_unit", PRIVACY_UNITS)
        self._set("privacy_unit", unit)
        self._set("privacy_user_reduction", p.as_choice(self.privacy_user_reduction, "privacy_user_reduction",
                                                        REDUCTIONS))  # fmt: skip
        column, rows = self.privacy_user_column, self.privacy_max_rows_per_user
        if unit == "record":
            if column is not None or rows is not None:
                raise ConfigurationError(
                    "privacy_user_column and privacy_max_rows_per_user apply to privacy_unit='user', got "
                    f"privacy_unit='record' with privacy_user_column={column!r}, privacy_max_rows_per_user={rows!r}. "
                    "Set privacy_unit='user' to protect users, or drop them."
                )
            return
        if not isinstance(column, str) or not column:
            raise ConfigurationError(
                f"privacy_unit='user' needs privacy_user_column, the dataset column that names each row's user (or "
                f"document), got {column!r}. Example: privacy_user_column='user_id'."
            )
        if rows is None:
            raise ConfigurationError(
                "privacy_unit='user' needs privacy_max_rows_per_user, the most rows a sampled user contributes to a "
                "step (for example 8; a user's rows beyond it are left out of that step, chosen at random)."
            )
        if self.router_release:
            raise ConfigurationError(
                "privacy_unit='user' is not combined with the private router release (router_aux_loss_coef > 0): its "
                "load statistic is released per row. Set router_aux_loss_coef=0.0, or privacy_unit='record'."
            )

    def _resolve_ddp_shard(self) -> None:
        shard = p.as_choice(self.ddp_shard, "ddp_shard", DDP_SHARDS)
        self._set("ddp_shard", shard)
        if shard == "per_rank":
            return
        rules = (
            (self.sampling_mode != "poisson", f"sampling_mode={self.sampling_mode!r}", "sampling_mode='poisson'"),
            (
                self.privacy_noise_mechanism != "gaussian",
                f"privacy_noise_mechanism={self.privacy_noise_mechanism!r}",
                "privacy_noise_mechanism='gaussian' (matrix-factorization noise assumes one participation per step)",
            ),
            (
                "truncated_batch_size" in self.sampling_kwargs,
                "sampling_kwargs['truncated_batch_size']",
                "untruncated Poisson sampling",
            ),
            (
                self.clipping_mode == "adaptive",
                "clipping_mode='adaptive'",
                "a fixed or AUTO-S bound (the adaptive count release counts a record once)",
            ),
            (self.user_level, "privacy_unit='user'", "privacy_unit='record'"),
        )
        for broken, seen, instead in rules:
            if broken:
                raise ConfigurationError(
                    f"ddp_shard='global' (parallel Poisson sampling, accounted as a group of world_size records under "
                    f"Poisson sampling) has no accountant with {seen}. Use {instead}, or ddp_shard='per_rank'."
                )


# -- the rules of the dict-shaped and string-read fields -------------------------------------------------------------


def _positive_bound(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise InputTypeError(f"{name} must be a number, not a bool; got {value!r}.")
    if isinstance(value, str):
        value = p.coerce_scalar(value)
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
        scalar = p.coerce_scalar(value)
        value = (
            scalar
            if isinstance(scalar, int | float) and not isinstance(scalar, bool)
            else p.as_dict(value, "clipping_norm")
        )
    if not isinstance(value, Mapping):
        return _positive_bound(value, "clipping_norm")
    bounds = p.as_dict(value, "clipping_norm")
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


def _mechanism_kwargs(mechanism: str, value: Any) -> dict[str, Any]:
    """The user's mechanism kwargs over the defaults table, validated for ``mechanism``."""
    user = p.as_dict(value, "privacy_noise_mechanism_kwargs")
    if "bound" in user:
        raise ConfigurationError(
            "privacy_noise_mechanism_kwargs['bound'] (bounded Gaussian) is unsupported: there is no matching "
            "accountant for bounded noise in Opake. Remove 'bound'."
        )
    selector = f"privacy_noise_mechanism={mechanism!r}"
    p.check_keys(user, MECHANISM_KWARGS[mechanism], "privacy_noise_mechanism_kwargs", selector)
    kwargs = {**MECHANISM_DEFAULTS[mechanism], **user}
    if "compute_dtype" in kwargs:
        kwargs["compute_dtype"] = compute_dtype_of(kwargs["compute_dtype"])
    for key in _INT_MECHANISM_KWARGS:
        if key in kwargs:
            p.as_positive_int(kwargs[key], f"privacy_noise_mechanism_kwargs[{key!r}]")
    if mechanism == "mf_bsr" and not p.as_number(kwargs["alpha"], "alpha") > p.as_number(kwargs["beta"], "beta"):
        raise ConfigurationError(
            f"mf_bsr requires alpha > beta, got alpha={kwargs['alpha']!r}, beta={kwargs['beta']!r}."
        )
    return kwargs


def _sampling(mechanism: str, requested: Any, value: Any) -> tuple[str, dict[str, Any]]:
    """``(sampling_mode, sampling_kwargs)``: ``"auto"`` resolved for ``mechanism`` and the pair validated."""
    allowed = SAMPLERS[mechanism]  # opake_core.plan.SAMPLERS: the pairs with an accountant, the usual one first
    mode = p.plain(requested)
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
    kwargs = p.as_dict(value, "sampling_kwargs")
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
    p.check_keys(kwargs, SAMPLING_KWARGS.get(mode, ()), "sampling_kwargs", f"sampling_mode={mode!r}")
    if "truncated_batch_size" in kwargs:
        p.as_positive_int(kwargs["truncated_batch_size"], "sampling_kwargs['truncated_batch_size']")
    if mode == "k_out_of_t":
        if set(kwargs) != {"k", "allocation"}:
            raise ConfigurationError(
                f"sampling_mode='k_out_of_t' requires both sampling_kwargs 'k' and 'allocation', got {kwargs!r}. "
                "Example: sampling_kwargs={'k': 2, 'allocation': 'block'}."
            )
        p.as_positive_int(kwargs["k"], "sampling_kwargs['k']")
        p.as_choice(kwargs["allocation"], "sampling_kwargs['allocation']", ("block", "total"))
    return mode, kwargs


def _calibration(value: Any) -> dict[str, float]:
    """The calibration search bounds merged over the defaults; ``0 < min < max < inf`` and ``tolerance > 0``."""
    kwargs = {**CALIBRATION_DEFAULTS, **p.as_dict(value, "noise_calibration_kwargs")}
    p.check_keys(kwargs, tuple(CALIBRATION_DEFAULTS), "noise_calibration_kwargs", "noise calibration")
    low, high, tol = (p.as_number(kwargs[k], f"noise_calibration_kwargs[{k!r}]") for k in CALIBRATION_DEFAULTS)
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


def _router_aux(coefficient: Any, value: Any) -> tuple[float, dict[str, Any]]:
    """``(router_aux_loss_coef, router_aux_kwargs)`` validated: a coefficient >= 0 (None is 0.0), and for a non-zero
    one the kwargs of the private router release over :data:`ROUTER_AUX_DEFAULTS` (``max_tokens`` required)."""
    coefficient = 0.0 if p.plain(coefficient) is None else p.plain(coefficient)
    if isinstance(coefficient, str):
        coefficient = p.coerce_scalar(coefficient)
    limits.check_number(
        coefficient, "router_aux_loss_coef", 0.0, MAX_SCALE,
        why="0.0 (the default) trains without router load balancing, a small value such as 0.01 turns the private "
        "router release on",
    )  # fmt: skip
    kwargs = p.as_dict(value, "router_aux_kwargs")
    if coefficient == 0.0:
        if kwargs:
            raise ConfigurationError(
                f"router_aux_kwargs={kwargs!r} is set but router_aux_loss_coef is 0.0, so no router release runs: "
                "set router_aux_loss_coef > 0 (for example 0.01), or drop router_aux_kwargs."
            )
        return 0.0, {}
    p.check_keys(kwargs, ROUTER_AUX_KWARGS, "router_aux_kwargs", "the private router release")
    if "max_tokens" not in kwargs:
        raise ConfigurationError(
            "router_aux_kwargs needs 'max_tokens' (an int >= 1, the public bound on the tokens of one example that "
            "count in full; usually max_length), e.g. router_aux_kwargs={'max_tokens': 1024}."
        )
    kwargs = {**ROUTER_AUX_DEFAULTS, **kwargs}
    p.as_positive_int(kwargs["max_tokens"], "router_aux_kwargs['max_tokens']")
    ratio = p.as_number(kwargs["ratio"], "router_aux_kwargs['ratio']")
    if not 0.0 < ratio < math.inf:
        raise ConfigurationError(
            f"router_aux_kwargs['ratio'] must be a finite number > 0, got {ratio!r}: the release's noise multiplier "
            "is z / sqrt(ratio). 0.02 (the default) costs about 1% more gradient noise."
        )
    beta = p.as_number(kwargs["filter_beta"], "router_aux_kwargs['filter_beta']")
    if not 0.0 <= beta < 1.0:
        raise ConfigurationError(
            f"router_aux_kwargs['filter_beta'] must be in [0, 1), got {beta!r}; 0.99 is the default."
        )
    if kwargs["mean_tokens"] is not None:
        mean = p.as_number(kwargs["mean_tokens"], "router_aux_kwargs['mean_tokens']")
        if not 0.0 < mean < math.inf:
            raise ConfigurationError(
                f"router_aux_kwargs['mean_tokens'] must be a finite number > 0, got {mean!r}; leave it unset for "
                "max_tokens."
            )
    return float(coefficient), kwargs


def _clipping_kwargs(mode: str, value: Any) -> dict[str, Any]:
    """The kwargs of ``clipping_mode``: none for fixed, ``target_quantile``/``clipping_norm_max``, ``gamma``."""
    kwargs = p.as_dict(value, "clipping_kwargs")
    p.check_keys(kwargs, CLIPPING_KWARGS[mode], "clipping_kwargs", f"clipping_mode={mode!r}")
    if "target_quantile" in kwargs and not 0 < p.as_number(kwargs["target_quantile"], "target_quantile") < 1:
        raise ConfigurationError(
            f"clipping_kwargs['target_quantile'] must be in (0, 1), got {kwargs['target_quantile']!r}."
        )
    for key in ("clipping_norm_max", "gamma"):
        if key in kwargs and not p.as_number(kwargs[key], key) > 0:
            raise ConfigurationError(f"clipping_kwargs[{key!r}] must be > 0, got {kwargs[key]!r}.")
        if key in kwargs:
            limits.check_number(kwargs[key], f"clipping_kwargs[{key!r}]", 0, MAX_SCALE, open_low=True, why=p.SCALE)
    return kwargs
