"""The optimizer and learning-rate schedule a trainer run asks for, built from :mod:`opake_core.optim`."""

from __future__ import annotations

from typing import Any

from opake_core import optim
from opake_core.optim import schedules

__all__ = ["build_optimizer", "build_schedule"]


def build_schedule(args: Any, total_steps: int) -> Any:
    """``lr_scheduler`` over ``total_steps`` with ``warmup_steps`` (a count, or a fraction of the run)."""
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
    return schedules.with_warmup(schedule, warmup) if warmup > 0 else schedule


def build_optimizer(args: Any, total_steps: int) -> optim.Optimizer:
    """The optimizer named by ``args.optim`` with the run's schedule; ``optim_args`` override its keywords."""
    lr = build_schedule(args, total_steps)
    betas = (args.adam_beta1, args.adam_beta2)
    extra = dict(args.optim_args)
    name = args.optim
    if name == "sgd":
        return optim.sgd(lr, weight_decay=args.weight_decay, **extra)
    if name == "momentum":
        return optim.momentum(lr, weight_decay=args.weight_decay, **extra)
    if name in ("adam", "adam-bc"):
        return optim.adam(lr, betas, args.adam_epsilon, noise_bias_correction=name == "adam-bc", **extra)
    if name in ("adamw", "adamw-bc"):
        return optim.adamw(
            lr,
            betas,
            args.adam_epsilon,
            args.weight_decay,
            noise_bias_correction=name == "adamw-bc",
            **extra,
        )
    return optim.adafactor(lr, weight_decay=args.weight_decay, **extra)
