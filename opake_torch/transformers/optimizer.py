"""The optimizer and learning-rate schedule a trainer run asks for, built from :mod:`opake_core.optim`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opake_core import optim
from opake_core.errors import ConfigurationError
from opake_core.optim import schedules
from opake_torch.transformers._parsing import OPTIMIZERS, check_schedule_free_best_model

__all__ = ["build_optimizer", "build_schedule"]


@dataclass(frozen=True)
class ScheduleFreeWarmup:
    """``schedule(step) * min(1, (step + 1) / warmup_steps)``: Schedule-Free AdamW's own warm-up (the authors'
    implementation and Hugging Face's ``schedule_free_adamw``), whose first update already has a non-zero rate."""

    schedule: Any
    warmup_steps: int

    def __call__(self, step: int) -> float:
        return float(self.schedule(step)) * min(1.0, (int(step) + 1) / self.warmup_steps)


def build_schedule(args: Any, total_steps: int) -> Any:
    """``lr_scheduler`` over ``total_steps`` with ``warmup_steps`` (a count, or a fraction of the run).

    The warm-up ramps linearly from 0 at the first update (:func:`~opake_core.optim.schedules.with_warmup`); with
    ``optim="schedule_free_adamw"`` it is the optimizer's own ramp, ``(step + 1) / warmup_steps``.
    """
    warmup = args.warmup_steps
    warmup = round(warmup * total_steps) if isinstance(warmup, float) else int(warmup)
    warmup = min(warmup, total_steps)
    lr, end = args.learning_rate, args.lr_scheduler_kwargs.get("end_value", 0.0)
    decay = max(total_steps - warmup, 1)
    if args.lr_scheduler == "linear":
        schedule = schedules.linear(lr, end, decay, transition_begin=warmup)
    elif args.lr_scheduler == "cosine":
        schedule = schedules.cosine(lr, end, decay, transition_begin=warmup)
    else:
        schedule = schedules.constant(lr)
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
}


def build_optimizer(args: Any, total_steps: int) -> optim.Optimizer:
    """The optimizer named by ``args.optim`` with the run's schedule; ``optim_args`` override its keywords.

    ``weight_decay`` goes to every optimizer but adam (which has none). ``adam_beta1``/``adam_beta2`` give the
    betas of adam, adamw, radam, schedule_free_adamw, lion (as Hugging Face's ``lion_32bit``) and ademamix (its
    ``b3`` from ``optim_args["beta3"]``, default 0.9999; Hugging Face's ``beta1``/``beta2`` there too), and
    ``adam_epsilon`` their ``eps`` (lion has none). rmsprop, adagrad and adadelta keep ``torch.optim``'s other
    defaults, as Hugging Face does. ``adam-bc``/``adamw-bc`` are adam/adamw with ``noise_bias_correction=True``.
    """
    lr = build_schedule(args, total_steps)
    betas = (args.adam_beta1, args.adam_beta2)
    extra = dict(args.optim_args)
    name = args.optim.removesuffix("-bc")
    if name not in _FACTORIES:
        raise ConfigurationError(f"optim must be one of {list(OPTIMIZERS)}, got {args.optim!r}.")
    defaults: dict[str, Any] = {} if name == "adam" else {"weight_decay": args.weight_decay}
    if name in ("adam", "adamw"):
        defaults.update(betas=betas, eps=args.adam_epsilon, noise_bias_correction=args.optim.endswith("-bc"))
    elif name in ("radam", "schedule_free_adamw"):
        defaults.update(betas=betas, eps=args.adam_epsilon)
    elif name == "lion":
        defaults["betas"] = betas
    elif name == "ademamix":
        b1, b2 = extra.pop("beta1", betas[0]), extra.pop("beta2", betas[1])
        defaults.update(betas=(b1, b2, extra.pop("beta3", 0.9999)), eps=args.adam_epsilon)
    check_schedule_free_best_model(name, getattr(args, "load_best_model_at_end", False))
    return _FACTORIES[name](lr, **{**defaults, **extra})
