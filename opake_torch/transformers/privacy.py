"""The privacy plan of a trainer run: the arguments' :class:`~.privacy_settings.PrivacySettings` mapped onto the
core's :func:`opake_core.plan.plan`, which validates sampler, mechanism, clipping, budget and horizon together.

``build_plan(args, dataset_size)`` turns the privacy settings (``args.privacy``) and the (sensitive, so not
configuration) dataset size into the sampler, the strategy specification and the clipping rule, and lets the core
resolve the rest: the accounting always comes from the sampler that runs, so the epsilon is computed for exactly the
sampling, noise and clipping of the run, and a combination without a correct accountant is refused there with the
fix. The clipping rule is built here, once, and the trainer's step clips with the plan's
(:meth:`PrivacyPlan.clipping_for`).

Batch-size contract: ``per_device_train_batch_size`` is the expected batch of one rank; the cluster batch is that
times the world size, and ``q = cluster batch / N`` is the sampling rate the accountant sees.

The functions take the privacy settings, or training arguments (whose ``privacy`` they read).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opake_core import accounting, mf, sampling
from opake_core.clipping import adaptive, auto_s
from opake_core.errors import ConfigurationError
from opake_core.plan import Plan, plan
from opake_core.tree import per_group
from opake_torch.transformers.privacy_settings import PrivacySettings

__all__ = [
    "PrivacyPlan",
    "build_plan",
    "check_next_segment",
    "clipping_rule",
    "resolve_delta",
    "resume_fields",
    "settings_of",
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
    """The core :class:`~opake_core.plan.Plan`, whether the trainer computes and reports epsilon, and the clipping
    rule the plan was validated with.

    ``accounted`` is True unless ``privacy_accounting=False`` was set (fixed-noise independent DP-SGD only: the
    arguments refuse it with a target epsilon or a whole-horizon mechanism or sampler), and always True for a
    non-private run (``privacy_noise_multiplier=0.0``), whose epsilon is reported as inf so that it cannot pass for a
    private one. ``clipping`` is :func:`clipping_rule` of the run's settings: a bound, an AUTO-S or adaptive rule,
    or a per-group dict of name patterns (applied to the parameters by :meth:`clipping_for`).
    """

    accounted: bool = True
    clipping: Any = None

    @property
    def planned_steps(self) -> int:
        """The steps the run is planned to take: ``stop_step``, where a target epsilon stops a fixed noise multiplier
        before ``total_steps`` (predicted before the first step), else ``total_steps``. The learning-rate schedule,
        the progress bar and ``TrainerState.max_steps`` are planned to it."""
        return self.total_steps if self.stop_step is None else min(self.stop_step, self.total_steps)

    def clipping_for(self, params: dict[str, Any]) -> Any:
        """The plan's clipping rule for the trainable ``params`` (names to tensors): a per-group bound becomes its
        :class:`~opake_core.tree.PerGroup`, any other rule is the plan's own."""
        return _per_group(self.clipping, params) if isinstance(self.clipping, dict) else self.clipping


def settings_of(args: Any) -> PrivacySettings:
    """``args`` when it is :class:`~.privacy_settings.PrivacySettings`, else the privacy settings of training
    arguments (``args.privacy``)."""
    return args if isinstance(args, PrivacySettings) else args.privacy


def total_steps(args: Any, dataset_size: int) -> int:
    """``max_steps`` when set, else ``ceil(num_train_epochs * N / cluster batch)``."""
    privacy = settings_of(args)
    if privacy.max_steps > 0:
        return privacy.max_steps
    return max(1, math.ceil(privacy.num_train_epochs * dataset_size / privacy.train_batch_size))


def check_next_segment(args: Any) -> None:
    """ConfigurationError for a second ``train()`` of a trainer whose run is accounted as one whole horizon."""
    privacy = settings_of(args)
    if privacy.is_complete_horizon:
        raise ConfigurationError(
            f"this trainer already ran its {privacy.privacy_noise_mechanism!r} / {privacy.sampling_mode!r} horizon, "
            "which is accounted once as a whole; a second train() would start another horizon with noise the "
            "accountant does not cover. To continue an interrupted run, resume from its checkpoint "
            "(train(resume_from_checkpoint=True)); to train further, start a new DPTrainer."
        )


def clipping_rule(args: Any, params: dict[str, Any] | None = None) -> Any:
    """The core clipping rule for ``clipping_mode``: the bound, ``auto_s`` or ``adaptive``. A per-group bound (a
    dict of name patterns and a ``fallback``) is a dict without ``params``, its :class:`PerGroup` with them."""
    privacy = settings_of(args)
    bound, kwargs = privacy.clipping_norm, privacy.clipping_kwargs
    if isinstance(bound, dict):
        return bound if params is None else _per_group(bound, params)
    if privacy.clipping_mode == "auto":
        return auto_s(bound, gamma=kwargs.get("gamma", 0.01))
    if privacy.clipping_mode == "adaptive":
        return adaptive(
            bound,
            target_quantile=kwargs.get("target_quantile", 0.5),
            clipping_norm_max=kwargs.get("clipping_norm_max", 1e3),
            count_noise_fraction=ADAPTIVE_COUNT_NOISE,
        )
    return bound


def _per_group(bound: dict[str, float], params: dict[str, Any]) -> Any:
    return per_group(params, {k: v for k, v in bound.items() if k != "fallback"}, fallback=bound["fallback"])


def _sampler(privacy: PrivacySettings, dataset_size: int, steps: int, rank: int) -> Any:
    mode, kwargs = privacy.sampling_mode, privacy.sampling_kwargs
    batch = privacy.train_batch_size
    rate = batch / dataset_size
    # ddp_shard="global": each rank draws the whole dataset at its own batch / N (a record may be in several ranks'
    # draws), so only one rank's batch must fit; the strided shards split one draw at the cluster's batch / N
    drawn, name = batch, "expected batch"
    if privacy.ddp_shard == "global":
        drawn, name = privacy.per_device_train_batch_size, "expected batch of a rank"
    if drawn > dataset_size:
        raise ConfigurationError(
            f"the {name} {drawn} exceeds the dataset size {dataset_size}: lower per_device_train_batch_size."
        )
    if privacy.world_size > 1:
        return _rank_sampler(privacy, dataset_size, rate, rank)
    bands = privacy.privacy_noise_mechanism_kwargs.get("bands")
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
        return sampling.cyclic_poisson(dataset_size=dataset_size, sample_rate=rate, bands=bands)
    if mode == "b_min_sep":
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


def _rank_sampler(privacy: PrivacySettings, dataset_size: int, rate: float, rank: int) -> Any:
    """Under DDP: this rank's sampler at the global rate (the accountant sees the cluster-wide rate); with
    ``ddp_shard="global"``, this rank's draw of the whole dataset at ``rate / world_size`` (per device batch / N),
    accounted as a group of ``world_size`` records.

    The core refuses what has no per-rank form (truncated Poisson, fewer examples than ranks)."""
    mode, world = privacy.sampling_mode, privacy.world_size
    if mode == "poisson" and privacy.ddp_shard == "global":  # the settings allow no truncation with it
        rate = privacy.per_device_train_batch_size / dataset_size
        return sampling.poisson(
            dataset_size=dataset_size, sample_rate=rate, world_size=world, rank=rank, sharding="global"
        )
    if mode == "poisson":
        cap = privacy.sampling_kwargs.get("truncated_batch_size")
        return sampling.poisson(
            dataset_size=dataset_size, sample_rate=rate, truncated_batch_size=cap, world_size=world, rank=rank
        )
    if mode == "cyclic_poisson":
        bands = privacy.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(
            dataset_size=dataset_size, sample_rate=rate, bands=bands, world_size=world, rank=rank
        )
    if mode == "fixed_size":
        batch = privacy.train_batch_size
        return sampling.fixed_size(dataset_size=dataset_size, batch_size=batch, world_size=world, rank=rank)
    raise ConfigurationError(
        f"sampling_mode={mode!r} is not supported under DDP (world_size={world}); use one of {DDP_SAMPLING_MODES}, "
        "whose per-rank parts together are the sampler the accountant analyses."
    )


def resolve_delta(args: Any, dataset_size: int) -> float:
    """``privacy_target_delta`` (or ``1 / N**1.1``), refused at or above ``1/N`` unless explicitly allowed."""
    privacy = settings_of(args)
    if privacy.privacy_target_delta is None:
        return 1 / dataset_size**1.1
    return accounting.check_delta(
        privacy.privacy_target_delta, dataset_size=dataset_size, allow_large=privacy.privacy_allow_large_delta
    )


def build_plan(
    args: Any,
    dataset_size: int,
    *,
    spent: accounting.Ledger | None = None,
    done: int = 0,
    resumed_multiplier: float | None = None,
    delta: float | None = None,
    users: Any = None,
) -> PrivacyPlan:
    """The plan of a run of ``args`` over ``dataset_size`` records (see :func:`opake_core.plan.plan` for ``spent``,
    ``done`` and ``resumed_multiplier``: what a resumed or repeated run already released); ``delta``: the one a
    resume keeps (None: :func:`resolve_delta`).

    ``args``: training arguments, whose privacy settings (``args.privacy``) are everything the plan reads, and whose
    ``process_index`` is this rank's part of a DDP sampler; or the privacy settings themselves (rank 0).

    ``users`` (:class:`.users.Users`, required with ``privacy_unit="user"``): the plan is over the users, not the
    rows: its sampler draws ``users.count`` users (each contributing at most ``users.max_rows`` rows,
    :func:`opake_core.sampling.by_user`), and its rate, horizon, default delta and accountant are theirs."""
    if dataset_size < 1:
        raise ConfigurationError("the training dataset is empty.")
    privacy = settings_of(args)
    if privacy.user_level != (users is not None):
        raise ConfigurationError("privacy_unit='user' plans over the dataset's users: pass them (and only then).")
    if users is not None:
        dataset_size = users.count
    rank = 0 if isinstance(args, PrivacySettings) else args.process_index
    steps = total_steps(privacy, dataset_size)
    calibration = privacy.noise_calibration_kwargs
    clipping = clipping_rule(privacy)
    resolved = plan(
        sampler=_sampler(privacy, dataset_size, steps, rank),
        steps=steps,
        delta=resolve_delta(privacy, dataset_size) if delta is None else delta,
        strategy=_strategy_spec(privacy),
        clipping=clipping,
        noise_multiplier=privacy.privacy_noise_multiplier,
        target_epsilon=privacy.privacy_target_epsilon,
        calibration=(calibration["min"], calibration["max"], calibration["tolerance"]),
        spent=spent,
        done=done,
        resumed_multiplier=resumed_multiplier,
        router_ratio=privacy.router_aux_kwargs["ratio"] if privacy.router_release else None,
    )
    accounted = privacy.privacy_accounting is not False or resolved.noise_multiplier == 0
    fields = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}
    if users is not None:  # the accounting above is over users; the run draws each one's rows
        fields["sampler"] = users.sampler(resolved.sampler)
    return PrivacyPlan(**fields, accounted=accounted, clipping=clipping)


def resume_fields(args: Any, plan: PrivacyPlan) -> dict[str, Any]:
    """What a horizon run cannot change on resume, as ``dp_state.json`` stores it: the mechanism and its kwargs, the
    sampler, and what the settings resolve to in ``plan`` (multiplier, horizon, expected batch) and the clipping
    bound, all read from the privacy settings of ``args`` (or the settings themselves)."""
    privacy = settings_of(args)
    return {
        "mechanism": privacy.privacy_noise_mechanism,
        "mechanism_kwargs": {k: str(v) for k, v in privacy.privacy_noise_mechanism_kwargs.items()},
        "sampling_mode": privacy.sampling_mode,
        "noise_multiplier": plan.noise_multiplier,
        "total_steps": plan.total_steps,
        "expected_batch_size": plan.expected_batch_size,
        "clipping_norm": str(privacy.clipping_norm),
    }


def _strategy_spec(privacy: PrivacySettings) -> Any:
    """The DP-FTRL strategy specification of ``privacy_noise_mechanism`` (None for DP-SGD)."""
    if privacy.privacy_noise_mechanism == "gaussian":
        return None
    kwargs = {k: v for k, v in privacy.privacy_noise_mechanism_kwargs.items() if k != "compute_dtype"}
    return STRATEGIES[privacy.privacy_noise_mechanism](**kwargs)
