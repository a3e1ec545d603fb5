"""The privacy plan of a trainer run: :class:`TrainingArguments` mapped onto the core's
:func:`opake_core.plan.plan`, which validates sampler, mechanism, clipping, budget and horizon together.

``build_plan(args, dataset_size)`` turns the arguments and the (sensitive, so not configuration) dataset size into
the sampler, the strategy specification and the clipping rule, and lets the core resolve the rest: the accounting
always comes from the sampler that runs, so the epsilon is computed for exactly the sampling, noise and clipping of
the run, and a combination without a correct accountant is refused there with the fix.

Batch-size contract: ``per_device_train_batch_size`` is the expected batch of one rank; the cluster batch is that
times the world size, and ``q = cluster batch / N`` is the sampling rate the accountant sees.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opake_core import accounting, mf, sampling
from opake_core.accounting.queries import MAX_PLD_STEPS
from opake_core.clipping import adaptive, auto_s
from opake_core.errors import ConfigurationError
from opake_core.plan import Plan, plan
from opake_core.tree import per_group

__all__ = [
    "PrivacyPlan",
    "build_plan",
    "check_next_segment",
    "clipping_rule",
    "ledger_epsilon",
    "resolve_delta",
    "total_steps",
]

ADAPTIVE_COUNT_NOISE = 0.05  # Andrew et al. 2021: count noise std = expected batch / 20
STRATEGIES: dict[str, Callable[..., Any]] = {
    "mf_band": mf.band_mf,
    "mf_blt": mf.blt,
    "mf_bisr": mf.bisr,
    "mf_bsr": mf.bsr,
    "mf_lambda_cgd": mf.lambda_cgd,
    "mf_identity": mf.identity,
}


@dataclass(frozen=True)
class PrivacyPlan(Plan):
    """The core :class:`~opake_core.plan.Plan` and whether the trainer computes and reports epsilon.

    ``accounted`` is True unless ``privacy_accounting=False`` was set (fixed-noise independent DP-SGD only: the
    arguments refuse it with a target epsilon or a whole-horizon mechanism or sampler), and always True for a
    non-private run (``privacy_noise_multiplier=0.0``), whose epsilon is reported as inf so that it cannot pass for a
    private one.
    """

    accounted: bool = True


@functools.lru_cache(maxsize=64)
def ledger_epsilon(ledger: accounting.Ledger, delta: float) -> float:
    """Epsilon of ``ledger`` at ``delta`` (a PLD or Monte Carlo query, so computed once per distinct history).

    Beyond :data:`~opake_core.accounting.queries.MAX_PLD_STEPS` releases, where a PLD composition takes minutes to
    hours, the RDP accountant answers instead: a looser upper bound, so the reported epsilon is never too small.
    """
    if ledger.releases > MAX_PLD_STEPS:
        return ledger.epsilon(delta=delta, accountant="rdp").value
    return ledger.epsilon(delta=delta).value


def total_steps(args: Any, dataset_size: int) -> int:
    """``max_steps`` when set, else ``ceil(num_train_epochs * N / cluster batch)``."""
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * dataset_size / args.train_batch_size))


def check_next_segment(args: Any) -> None:
    """ConfigurationError for a second ``train()`` of a trainer whose run is accounted as one whole horizon."""
    if args.is_complete_horizon:
        raise ConfigurationError(
            f"this trainer already ran its {args.privacy_noise_mechanism!r} / {args.sampling_mode!r} horizon, "
            "which is accounted once as a whole; a second train() would start another horizon with noise the "
            "accountant does not cover. To continue an interrupted run, resume from its checkpoint "
            "(train(resume_from_checkpoint=True)); to train further, start a new DPTrainer."
        )


def clipping_rule(args: Any, params: dict[str, Any] | None = None) -> Any:
    """The core clipping rule for ``clipping_mode``: the bound, ``auto_s`` or ``adaptive``. A per-group bound (a
    dict of name patterns and a ``fallback``) is a dict without ``params``, its :class:`PerGroup` with them."""
    kwargs = args.clipping_kwargs
    bound = args.clipping_norm
    if isinstance(bound, dict) and params is not None:
        return per_group(params, {k: v for k, v in bound.items() if k != "fallback"}, fallback=bound["fallback"])
    if args.clipping_mode == "auto":
        return auto_s(args.clipping_norm, gamma=kwargs.get("gamma", 0.01))
    if args.clipping_mode == "adaptive":
        return adaptive(
            args.clipping_norm,
            target_quantile=kwargs.get("target_quantile", 0.5),
            clipping_norm_max=kwargs.get("clipping_norm_max", 1e3),
            count_noise_fraction=ADAPTIVE_COUNT_NOISE,
        )
    return args.clipping_norm


def _sampler(args: Any, dataset_size: int, steps: int) -> Any:
    mode, kwargs = args.sampling_mode, args.sampling_kwargs
    batch = args.train_batch_size
    rate = batch / dataset_size
    if rate > 1:
        raise ConfigurationError(
            f"the expected batch {batch} exceeds the dataset size {dataset_size}: lower per_device_train_batch_size."
        )
    if args.world_size > 1:
        return _rank_sampler(args, dataset_size, rate)
    if mode == "poisson":
        cap = kwargs.get("truncated_batch_size")
        return sampling.poisson(dataset_size=dataset_size, sample_rate=rate, truncated_batch_size=cap)
    if mode == "k_out_of_t":
        return sampling.k_out_of_t(dataset_size=dataset_size, k=kwargs["k"], t=steps, allocation=kwargs["allocation"])
    if mode == "fixed_size":
        return sampling.fixed_size(dataset_size=dataset_size, batch_size=batch)
    if mode == "sequential":
        return sampling.sequential(dataset_size=dataset_size, batch_size=batch)
    if mode == "cyclic_poisson":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(dataset_size=dataset_size, sample_rate=rate, bands=bands)
    if mode == "b_min_sep":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.b_min_sep(dataset_size=dataset_size, sample_rate=rate, min_sep=bands)
    if mode == "balls_in_bins":
        bins = max(1, round(dataset_size / batch))
        if steps % bins:
            raise ConfigurationError(
                f"balls_in_bins needs a whole number of epochs: {steps} steps is not a multiple of {bins} bins "
                f"(dataset size / batch). Set max_steps to a multiple of {bins}."
            )
        return sampling.balls_in_bins(dataset_size=dataset_size, num_bins=bins)
    raise ConfigurationError(f"sampling_mode={mode!r} is not supported by the trainer.")


DDP_SAMPLING_MODES = ("poisson", "cyclic_poisson", "fixed_size")


def _rank_sampler(args: Any, dataset_size: int, rate: float) -> Any:
    """Under DDP: this rank's sampler at the global rate (the accountant sees the cluster-wide rate).

    The core refuses what has no per-rank form (truncated Poisson, fewer examples than ranks)."""
    mode, world, rank = args.sampling_mode, args.world_size, args.process_index
    if mode == "poisson":
        cap = args.sampling_kwargs.get("truncated_batch_size")
        return sampling.poisson(
            dataset_size=dataset_size, sample_rate=rate, truncated_batch_size=cap, world_size=world, rank=rank
        )
    if mode == "cyclic_poisson":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(
            dataset_size=dataset_size, sample_rate=rate, bands=bands, world_size=world, rank=rank
        )
    if mode == "fixed_size":
        batch = args.train_batch_size
        return sampling.fixed_size(dataset_size=dataset_size, batch_size=batch, world_size=world, rank=rank)
    raise ConfigurationError(
        f"sampling_mode={mode!r} is not supported under DDP (world_size={world}); use one of {DDP_SAMPLING_MODES}, "
        "whose per-rank parts together are the sampler the accountant analyses."
    )


def resolve_delta(args: Any, dataset_size: int) -> float:
    """``privacy_target_delta`` (or ``1 / N**1.1``), refused at or above ``1/N`` unless explicitly allowed."""
    if args.privacy_target_delta is None:
        return 1 / dataset_size**1.1
    return accounting.check_delta(
        args.privacy_target_delta, dataset_size=dataset_size, allow_large=args.privacy_allow_large_delta
    )


def build_plan(
    args: Any,
    dataset_size: int,
    *,
    spent: accounting.Ledger | None = None,
    done: int = 0,
    resumed_multiplier: float | None = None,
    delta: float | None = None,
) -> PrivacyPlan:
    """The plan of a run of ``args`` over ``dataset_size`` records (see :func:`opake_core.plan.plan` for ``spent``,
    ``done`` and ``resumed_multiplier``: what a resumed or repeated run already released); ``delta``: the one a
    resume keeps (None: :func:`resolve_delta`)."""
    if dataset_size < 1:
        raise ConfigurationError("the training dataset is empty.")
    steps = total_steps(args, dataset_size)
    calibration = args.noise_calibration_kwargs
    resolved = plan(
        sampler=_sampler(args, dataset_size, steps),
        steps=steps,
        delta=resolve_delta(args, dataset_size) if delta is None else delta,
        strategy=_strategy_spec(args),
        clipping=clipping_rule(args),
        noise_multiplier=args.privacy_noise_multiplier,
        target_epsilon=args.privacy_target_epsilon,
        calibration=(calibration["min"], calibration["max"], calibration["tolerance"]),
        spent=spent,
        done=done,
        resumed_multiplier=resumed_multiplier,
        router_ratio=args.router_aux_kwargs["ratio"] if getattr(args, "router_release", False) else None,
    )
    accounted = getattr(args, "privacy_accounting", True) is not False or resolved.noise_multiplier == 0
    return PrivacyPlan(**{f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}, accounted=accounted)


def _strategy_spec(args: Any) -> Any:
    """The DP-FTRL strategy specification of ``privacy_noise_mechanism`` (None for DP-SGD)."""
    if args.privacy_noise_mechanism == "gaussian":
        return None
    kwargs = {k: v for k, v in args.privacy_noise_mechanism_kwargs.items() if k != "compute_dtype"}
    return STRATEGIES[args.privacy_noise_mechanism](**kwargs)
