"""The optimizer and learning-rate schedule a trainer run asks for, built from :mod:`opake_core.optim`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opake_core import optim
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.optim import schedules
from opake_torch.transformers._parsing import OPTIMIZERS, check_schedule_free_best_model

__all__ = [
    "OptimizerFactory",
    "build_optimizer",
    "build_schedule",
    "check_optimizer_factory",
    "check_schedule_free_base",
    "check_schedule_kwargs",
    "probe_optimizer",
]


@dataclass(frozen=True)
class ScheduleFreeWarmup:
    """``schedule(step) * min(1, (step + 1) / warmup_steps)``: Schedule-Free AdamW's own warm-up (the authors'
    implementation and Hugging Face's ``schedule_free_adamw``), whose first update already has a non-zero rate."""

    schedule: Any
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return float(self.schedule(step)) * min(1.0, (int(step) + 1) / self.warmup_steps)


def check_schedule_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """The ``lr_scheduler_kwargs`` that ``name`` needs (their names are checked against ``SCHEDULER_KWARGS`` first;
    their values by the schedule, when the run's length is known)."""
    with_min_lr = name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr")
    if with_min_lr and ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
        raise ConfigurationError(
            f"lr_scheduler={name!r} needs exactly one of lr_scheduler_kwargs['min_lr'] (a learning rate) or "
            f"['min_lr_rate'] (a fraction of learning_rate), got {sorted(kwargs)}; e.g. {{'min_lr_rate': 0.1}}."
        )
    if name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        raise ConfigurationError(
            "lr_scheduler='warmup_stable_decay' needs lr_scheduler_kwargs['num_decay_steps'] (as in Hugging Face), "
            f"got {sorted(kwargs)}; e.g. {{'num_decay_steps': 100}}."
        )


def _min_lr(lr: float, kwargs: dict[str, Any]) -> float:
    return float(kwargs["min_lr"]) if "min_lr" in kwargs else lr * float(kwargs["min_lr_rate"])


def _decay(name: str, lr: float, kwargs: dict[str, Any], warmup: int, total_steps: int) -> Any:
    """The schedule after the warm-up, constant at ``lr`` until ``warmup`` (Hugging Face's formulas, in
    ``transformers.optimization``)."""
    steps = max(total_steps - warmup, 1)
    if name == "linear":
        return schedules.linear(lr, kwargs.get("end_value", 0.0), steps, transition_begin=warmup)
    if name in ("cosine", "cosine_with_min_lr"):
        end = _min_lr(lr, kwargs) if name == "cosine_with_min_lr" else kwargs.get("end_value", 0.0)
        return schedules.cosine(lr, end, steps, transition_begin=warmup, num_cycles=kwargs.get("num_cycles", 0.5))
    if name == "cosine_with_restarts":
        return schedules.cosine_restarts(lr, steps, transition_begin=warmup, num_cycles=kwargs.get("num_cycles", 1))
    if name == "polynomial":
        end = kwargs.get("lr_end", 1e-7)
        return schedules.polynomial(lr, end, steps, transition_begin=warmup, power=kwargs.get("power", 1.0))
    if name == "inverse_sqrt":
        return schedules.inverse_sqrt(lr, kwargs.get("timescale") or warmup or 10_000, transition_begin=warmup)
    return schedules.constant(lr)


def _warmup_count(args: Any, total_steps: int) -> int:
    """``warmup_steps`` as a count of updates: a fraction of the run is rounded up, as Hugging Face counts it."""
    warmup = args.warmup_steps
    warmup = math.ceil(warmup * total_steps) if isinstance(warmup, float) else int(warmup)
    return min(warmup, total_steps)


def build_schedule(args: Any, total_steps: int) -> Any:
    """``lr_scheduler`` over ``total_steps`` with ``warmup_steps`` (a count, or a fraction of the run rounded up), as
    Hugging Face's scheduler of that name (``lr_scheduler_kwargs`` with its names), value for value at every step.

    The warm-up ramps linearly from 0 at the first update (:func:`~opake_core.optim.schedules.with_warmup`); with
    ``optim="schedule_free_adamw"`` it is the optimizer's own ramp, ``(step + 1) / warmup_steps``.
    ``"warmup_stable_decay"`` has its own warm-up, and ``"cosine_warmup_with_min_lr"`` Hugging Face's ramp
    ``(step + 1) / warmup_steps`` (or from ``warmup_lr_rate``) with its decay one step ahead.
    """
    warmup = _warmup_count(args, total_steps)
    name, lr, kwargs = args.lr_scheduler, args.learning_rate, args.lr_scheduler_kwargs
    if name == "warmup_stable_decay":
        decay = int(kwargs["num_decay_steps"])
        stable = kwargs.get("num_stable_steps", total_steps - warmup - decay)
        shape = {k: kwargs[k] for k in ("warmup_type", "decay_type", "min_lr_ratio", "num_cycles") if k in kwargs}
        return schedules.warmup_stable_decay(lr, warmup_steps=warmup, stable_steps=stable, decay_steps=decay, **shape)
    if name == "cosine_warmup_with_min_lr":
        begin = max(warmup - 1, 0)
        cycles = kwargs.get("num_cycles", 0.5)
        schedule = schedules.cosine(lr, _min_lr(lr, kwargs), max(total_steps - warmup, 1), begin, num_cycles=cycles)
        if warmup == 0:  # Hugging Face's decay would start one step ahead, before the first update
            raise ConfigurationError(
                "lr_scheduler='cosine_warmup_with_min_lr' needs a warm-up (warmup_steps resolves to 0 updates); set "
                "warmup_steps, or use lr_scheduler='cosine_with_min_lr' for no warm-up."
            )
        start = kwargs.get("warmup_lr_rate")
        return schedules.with_warmup(schedule, max(warmup - 1, 1), init_value=1 / warmup if start is None else start)
    schedule = _decay(name, lr, kwargs, warmup, total_steps)
    if warmup <= 0:
        return schedule
    if args.optim == "schedule_free_adamw":
        return ScheduleFreeWarmup(schedule, warmup)
    return schedules.with_warmup(schedule, warmup)


_FACTORIES = {
    "sgd": optim.sgd,
    "momentum": optim.momentum,
    "adam": optim.adam,
    "adamw": optim.adamw,
    "adafactor": optim.adafactor,
    "lion": optim.lion,
    "ademamix": optim.ademamix,
    "rmsprop": optim.rmsprop,
    "adagrad": optim.adagrad,
    "radam": optim.radam,
    "adadelta": optim.adadelta,
    "schedule_free_adamw": optim.schedule_free_adamw,
    "stable_adamw": optim.stable_adamw,
}


# optim names that wrap a base optimizer in optim.schedule_free; "schedule_free" takes its base from optim_args["base"]
_SCHEDULE_FREE_BASES = {"schedule_free_radam": "radam", "schedule_free_sgd": "sgd"}
# the keywords of optim.schedule_free itself, taken from optim_args; the others go to the base
_WRAPPER_KEYWORDS = ("beta", "warmup_steps")


def check_schedule_free_base(name: str, optim_args: dict[str, Any]) -> None:
    """ConfigurationError unless ``optim_args["base"]`` (when given) names a base for ``optim="schedule_free"``: an
    ``optim`` name that is not itself Schedule-Free."""
    if "base" not in optim_args:
        return
    base = optim_args["base"]
    if name != "schedule_free":
        fixed = f"its base is fixed by the name ({_SCHEDULE_FREE_BASES[name]})" if name in _SCHEDULE_FREE_BASES else ""
        raise ConfigurationError(
            f"optim_args['base'] ({base!r}) names the optimizer that optim='schedule_free' wraps, but optim={name!r}"
            f"{'; ' + fixed if fixed else ''}. Set optim='schedule_free' to wrap {base!r}, or drop optim_args['base']."
        )
    bases = [n for n in OPTIMIZERS if not n.startswith("schedule_free")]
    if not isinstance(base, str) or base not in bases:
        raise ConfigurationError(
            f"optim_args['base'] must be one of {bases} (an optimizer that is not itself Schedule-Free), got {base!r}."
        )


OptimizerFactory = Callable[..., optim.Optimizer]
"""``factory(lr=schedule, **kwargs) -> opake_core.optim.Optimizer``: ``DPTrainer``'s ``optimizer_cls_and_kwargs[0]``."""


def check_optimizer_factory(value: Any) -> tuple[OptimizerFactory, dict[str, Any]] | None:
    """``DPTrainer``'s ``optimizer_cls_and_kwargs`` checked: None, or ``(factory, kwargs)`` where ``factory(lr=schedule,
    **kwargs)`` returns an :class:`opake_core.optim.Optimizer` (checked when the run builds it)."""
    if value is None:
        return None
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise InputTypeError(
            f"optimizer_cls_and_kwargs must be a pair (factory, kwargs), got {value!r:.80}; e.g. "
            "(opake_core.optim.lion, {'betas': (0.9, 0.99)})."
        )
    factory, kwargs = value
    if isinstance(factory, type) and issubclass(factory, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer_cls_and_kwargs[0] is the torch optimizer {factory.__name__}, which would step on gradients "
            "without checking that they were clipped and noised. Pass a factory (lr=schedule, **kwargs) -> "
            "opake_core.optim.Optimizer instead, e.g. (opake_core.optim.sgd, {'momentum': 0.9}) for torch.optim.SGD."
        )
    if not callable(factory):
        raise InputTypeError(
            f"optimizer_cls_and_kwargs[0] must be callable as factory(lr=schedule, **kwargs), got {factory!r:.80}."
        )
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InputTypeError(f"optimizer_cls_and_kwargs[1] must be a dict of keyword arguments, got {kwargs!r:.80}.")
    if "lr" in kwargs:
        raise ConfigurationError(
            f"optimizer_cls_and_kwargs[1] sets lr={kwargs['lr']!r}, but the factory receives the run's schedule as lr "
            "(learning_rate, lr_scheduler and warmup_steps). Drop 'lr' and set those arguments instead."
        )
    return factory, dict(kwargs)


def _custom(factory: tuple[OptimizerFactory, dict[str, Any]], lr: Any, args: Any) -> optim.Optimizer:
    build, kwargs = factory
    try:
        optimizer = build(lr=lr, **kwargs)
    except TypeError as error:
        raise InputTypeError(
            f"optimizer_cls_and_kwargs[0](lr=schedule, **{sorted(kwargs)}) raised TypeError: {error}. The factory must "
            "take the learning rate (a schedule step -> rate) as the keyword lr, and the given kwargs."
        ) from error
    if not isinstance(optimizer, optim.Optimizer):
        raise InputTypeError(
            f"optimizer_cls_and_kwargs[0](lr=..., **kwargs) returned a {type(optimizer).__qualname__}, not an "
            "opake_core.optim.Optimizer: only those refuse gradients that were not noised and keep their state in "
            "the run's checkpoints. Return one of opake_core.optim's optimizers (or opake_core.optim.Optimizer "
            "around a torchopt transformation)."
        )
    if optimizer.eval_fn is not None and getattr(args, "load_best_model_at_end", False):
        raise ConfigurationError(
            f"the optimizer from optimizer_cls_and_kwargs ({optimizer.name}) publishes other weights than it trains "
            "(a Schedule-Free average), and cannot be combined with load_best_model_at_end=True: a checkpoint holds "
            "the training iterate, not the averaged weights that evaluation scored. Set load_best_model_at_end=False."
        )
    return optimizer


def _named(name: str, args: Any, lr: Any, extra: dict[str, Any]) -> optim.Optimizer:
    """The optimizer ``name`` (an ``optim`` value, not a Schedule-Free wrapper) with the fields' keywords."""
    betas = (args.adam_beta1, args.adam_beta2)
    plain = name.removesuffix("-bc")
    if plain not in _FACTORIES:
        raise ConfigurationError(f"optim must be one of {list(OPTIMIZERS)}, got {name!r}.")
    defaults: dict[str, Any] = {} if plain == "adam" else {"weight_decay": args.weight_decay}
    if plain in ("adam", "adamw", "stable_adamw"):
        defaults.update(betas=betas, eps=args.adam_epsilon, noise_bias_correction=name.endswith("-bc"))
    elif plain in ("radam", "schedule_free_adamw"):
        defaults.update(betas=betas, eps=args.adam_epsilon)
    elif plain == "lion":
        defaults["betas"] = betas
    elif plain == "ademamix":
        b1, b2 = extra.pop("beta1", betas[0]), extra.pop("beta2", betas[1])
        defaults.update(betas=(b1, b2, extra.pop("beta3", 0.9999)), eps=args.adam_epsilon)
    return _FACTORIES[plain](lr, **{**defaults, **extra})


def build_optimizer(
    args: Any, total_steps: int, factory: tuple[OptimizerFactory, dict[str, Any]] | None = None
) -> optim.Optimizer:
    """The optimizer named by ``args.optim`` with the run's schedule; ``optim_args`` override its keywords.

    ``weight_decay`` goes to every optimizer but adam (which has none). ``adam_beta1``/``adam_beta2`` give the
    betas of adam, adamw, radam, schedule_free_adamw, lion (as Hugging Face's ``lion_32bit``) and ademamix (its
    ``b3`` from ``optim_args["beta3"]``, default 0.9999; Hugging Face's ``beta1``/``beta2`` there too), and
    ``adam_epsilon`` their ``eps`` (lion has none). rmsprop, adagrad and adadelta keep ``torch.optim``'s other
    defaults, as Hugging Face does. ``adam-bc``/``adamw-bc`` are adam/adamw with ``noise_bias_correction=True``.

    ``schedule_free_radam``, ``schedule_free_sgd`` and ``schedule_free`` with ``optim_args["base"]`` are
    :func:`~opake_core.optim.schedule_free` around that base, built as ``optim=base`` would be (the schedule with
    its warm-up, the fields, the other ``optim_args``); the wrapper takes ``optim_args["beta"]`` (default 0.9) and
    ``optim_args["warmup_steps"]`` (default: the run's warm-up, during which the average follows the iterate).

    ``factory``: ``optimizer_cls_and_kwargs`` (:func:`check_optimizer_factory`), called as ``factory(lr=schedule,
    **kwargs)`` in place of the named optimizer; ``optim`` and ``optim_args`` are then unused.
    """
    return _build(args, build_schedule(args, total_steps), _warmup_count(args, total_steps), factory)


def probe_optimizer(args: Any, factory: tuple[OptimizerFactory, dict[str, Any]] | None = None) -> optim.Optimizer:
    """The optimizer :func:`build_optimizer` builds for ``args`` (and ``factory``, called once more), at the constant
    rate ``learning_rate`` and without a Schedule-Free warm-up, for what it does before the run's length is known:
    whether it corrects for the noise (``noise_aware``) and whether it ``needs_whole_leaves``. Never used to train."""
    return _build(args, schedules.constant(args.learning_rate), 0, factory)


def _build(args: Any, lr: Any, warmup: int, factory: tuple[OptimizerFactory, dict[str, Any]] | None) -> optim.Optimizer:
    if factory is not None:
        return _custom(factory, lr, args)
    extra = dict(args.optim_args)
    base = _SCHEDULE_FREE_BASES.get(args.optim)
    if args.optim == "schedule_free":
        base = extra.pop("base", "adamw")
    check_schedule_free_best_model(args.optim, getattr(args, "load_best_model_at_end", False))
    if base is None:
        return _named(args.optim, args, lr, extra)
    wrapper = {k: extra.pop(k) for k in _WRAPPER_KEYWORDS if k in extra}
    wrapper.setdefault("warmup_steps", warmup)
    return optim.schedule_free(_named(base, args, lr, extra), **wrapper)
