"""The privacy plan of a trainer run: sampler, mechanism, clipping rule, noise multiplier and accountant, chosen
together.

``build_plan(args, dataset_size)`` turns :class:`TrainingArguments` and the (sensitive, so not configuration)
dataset size into a :class:`PrivacyPlan`. The accounting process always comes from the sampler that runs
(``sampler.process``), so the epsilon is computed for exactly the sampling, noise and clipping of the run:

* DP-SGD (``gaussian``): Poisson (optionally truncated), k-out-of-t or sequential; adaptive clipping adds its noisy
  count release to every step (``accounting.adaptive_clipping``).
* DP-FTRL (``mf_*``): the strategy is optimized once for the horizon and the sampler's participation pattern, and
  the whole horizon is accounted as one process (``accounting.mf_process``); every reported epsilon is that
  full-horizon value.

Batch-size contract: ``per_device_train_batch_size`` is the expected batch of one rank; the cluster batch is that
times the world size, and ``q = cluster batch / N`` is the sampling rate the accountant sees.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opake_core import accounting, mf, sampling
from opake_core.clipping import adaptive, auto_s
from opake_core.errors import CalibrationError, ConfigurationError, PrivacyBudgetError

__all__ = ["PrivacyPlan", "build_plan", "clipping_rule", "ledger_epsilon", "resolve_delta", "total_steps"]

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
class PrivacyPlan:
    """Everything the trainer needs to run and account a DP run.

    Attributes:
        sampler: the batch sampler (``init``/``sample``/``process``).
        release: what the run releases at this multiplier: the process of one step (per-step runs, recorded in the
            run's :class:`~opake_core.accounting.Ledger` at every step), or the whole horizon (horizon runs,
            recorded once).
        noise_multiplier: resolved multiplier (0 for a non-private run).
        calibration_source: ``"fixed"`` or ``"calibrated"``.
        delta: the delta every epsilon is reported at.
        total_steps: the declared number of steps of this ``train()`` call.
        expected_batch_size: the public normalizer of the clipped sum (cluster-wide).
        sample_rate: the cluster-wide fraction of the dataset per step.
        stop_step: with a target epsilon and a fixed multiplier, the last step whose epsilon (history included) is
            within the target; None otherwise.
        accounted: whether epsilon is computed and reported.
        horizon: whether the run is accounted once for its whole declared horizon.
        strategy: the optimized DP-FTRL strategy (None for DP-SGD).
    """

    sampler: Any
    release: Any
    noise_multiplier: float
    calibration_source: str
    delta: float
    total_steps: int
    expected_batch_size: float
    sample_rate: float
    stop_step: int | None
    accounted: bool
    horizon: bool
    strategy: Any = None

    @property
    def steps_per_epoch(self) -> float:
        return 1 / self.sample_rate


@functools.lru_cache(maxsize=64)
def ledger_epsilon(ledger: accounting.Ledger, delta: float) -> float:
    """Epsilon of ``ledger`` at ``delta`` (a PLD or Monte Carlo query, so computed once per distinct history)."""
    return ledger.epsilon(delta=delta).value


def total_steps(args: Any, dataset_size: int) -> int:
    """``max_steps`` when set, else ``ceil(num_train_epochs * N / cluster batch)``."""
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * dataset_size / args.train_batch_size))


def clipping_rule(args: Any) -> Any:
    """The core clipping rule for ``clipping_mode``: the bound, ``auto_s`` or ``adaptive`` (per-group: a dict)."""
    kwargs = args.clipping_kwargs
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


DDP_SAMPLING_MODES = ("poisson", "cyclic_poisson")


def _rank_sampler(args: Any, dataset_size: int, rate: float) -> Any:
    """Under DDP: this rank's sampler at the global rate (the accountant sees the cluster-wide rate)."""
    from opake_torch.distributed import rank_poisson

    mode, world, rank = args.sampling_mode, args.world_size, args.process_index
    if mode == "poisson":
        if args.sampling_kwargs.get("truncated_batch_size") is not None:
            raise ConfigurationError(
                "truncated Poisson sampling is not supported under DDP (world_size > 1): a per-rank cap is not the "
                "global cap the accountant analyses. Drop sampling_kwargs['truncated_batch_size']."
            )
        return rank_poisson(dataset_size=dataset_size, sample_rate=rate, world_size=world, rank=rank)
    if mode == "cyclic_poisson":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(
            dataset_size=dataset_size, sample_rate=rate, bands=bands, world_size=world, rank=rank
        )
    raise ConfigurationError(
        f"sampling_mode={mode!r} is not supported under DDP (world_size={world}); use one of {DDP_SAMPLING_MODES}, "
        "whose per-rank shards are sampled independently so the union is the sampler the accountant analyses."
    )


def _strategy(args: Any, sampler: Any, steps: int) -> Any:
    kwargs = {k: v for k, v in args.privacy_noise_mechanism_kwargs.items() if k != "compute_dtype"}
    spec = STRATEGIES[args.privacy_noise_mechanism](**kwargs)
    if args.privacy_noise_mechanism == "mf_band" and kwargs.get("bands", 1) > steps:
        raise ConfigurationError(
            f"mf_band needs bands <= total steps, got bands={kwargs['bands']} for {steps} steps; lower bands."
        )
    participation = (
        accounting.sampler_participation(sampler) if args.sampling_mode != "poisson" else mf.SingleParticipation()
    )
    return mf.optimize(spec, steps, participation=participation)


def _release_maker(args: Any, sampler: Any, strategy: Any, steps: int) -> Callable[[float], Any]:
    """``z -> process``: one step of a per-step run, or the whole horizon of a horizon run."""
    if strategy is not None:
        return lambda z: accounting.mf_process(strategy, sampler=sampler, noise_multiplier=z, n_steps=steps)
    if args.sampling_mode == "k_out_of_t":
        return lambda z: sampler.process(z, steps)
    if args.clipping_mode != "adaptive":
        return lambda z: sampler.process(z, 1).process  # the single step inside repeat(step, 1)
    if not isinstance(sampler, sampling.Poisson) or sampler.truncated_batch_size is not None:
        raise ConfigurationError(
            "clipping_mode='adaptive' is accounted for plain Poisson sampling only; use sampling_mode='poisson' "
            "without truncation, or clipping_mode='fixed'."
        )

    def step(z: float) -> Any:
        release = accounting.adaptive_clipping(
            accounting.gaussian(z),
            count_noise_fraction=ADAPTIVE_COUNT_NOISE,
            expected_batch_size=sampler.expected_batch_size,
        )
        return accounting.poisson(release, sampler.sample_rate)

    return step


def resolve_delta(args: Any, dataset_size: int) -> float:
    """``privacy_target_delta`` (or ``1 / N**1.1``), refused at or above ``1/N`` unless explicitly allowed."""
    if args.privacy_target_delta is None:
        return 1 / dataset_size**1.1
    return accounting.check_delta(
        args.privacy_target_delta, dataset_size=dataset_size, allow_large=args.privacy_allow_large_delta
    )


def build_plan(
    args: Any, dataset_size: int, *, spent: Any = None, done: int = 0, resumed_multiplier: float | None = None
) -> PrivacyPlan:
    """Resolve sampler, mechanism, delta, horizon and noise multiplier (calibrating it when a target is given).

    ``spent`` is the :class:`~opake_core.accounting.Ledger` of what the run already released (a resumed checkpoint,
    or earlier ``train()`` calls) and ``done`` the steps of this call already taken (a resume). A target epsilon is
    the total for the whole history: the remaining steps are calibrated against what is left of it, and a spent
    budget is refused with PrivacyBudgetError. ``resumed_multiplier`` is the calibrated multiplier of an unchanged
    resumed run: it is kept while the whole history at it stays within the target, so the resume replays exactly.
    """
    if dataset_size < 1:
        raise ConfigurationError("the training dataset is empty.")
    spent = spent or accounting.Ledger()
    steps = total_steps(args, dataset_size)
    sampler = _sampler(args, dataset_size, steps)
    strategy = _strategy(args, sampler, steps) if args.privacy_noise_mechanism != "gaussian" else None
    release = _release_maker(args, sampler, strategy, steps)
    delta = resolve_delta(args, dataset_size)
    horizon = args.is_complete_horizon
    target, multiplier = args.privacy_target_epsilon, args.privacy_noise_multiplier
    remaining = max(steps - done, 1)
    prefix = None if horizon else spent.process()

    def history(z: float) -> Any:
        """What the whole run releases at multiplier ``z``: the history so far, then the remaining steps."""
        if horizon:
            return release(z)
        rest = accounting.repeat(release(z), remaining)
        return rest if prefix is None else accounting.compose(prefix, rest)

    if target is not None and prefix is not None:
        already = ledger_epsilon(spent, delta)
        if already >= target:
            raise PrivacyBudgetError(
                f"the privacy budget is spent: the {spent.releases} steps already taken cost epsilon {already:.4g} "
                f"of privacy_target_epsilon={target} (the target is the total for the run, resumes and earlier "
                "train() calls included). Stop here, or raise the target if a larger total is acceptable."
            )
    stop, source = None, "fixed"
    if multiplier is None and resumed_multiplier is not None and not horizon:
        if accounting.mf_epsilon(history(resumed_multiplier), delta=delta).value <= target:
            multiplier, source = resumed_multiplier, "calibrated"
    if multiplier is None:
        bounds = args.noise_calibration_kwargs
        try:
            calibrated = accounting.calibrate_mf_noise_multiplier(
                history,
                target_epsilon=target,
                delta=delta,
                min=bounds["min"],
                max=bounds["max"],
                tolerance=bounds["tolerance"],
            )
        except CalibrationError as exc:
            if prefix is None:
                raise
            raise PrivacyBudgetError(
                f"the privacy budget is spent: the {spent.releases} steps already taken cost epsilon "
                f"{ledger_epsilon(spent, delta):.4g} of privacy_target_epsilon={target}, and what is left cannot pay "
                f"for {remaining} more steps even at noise multiplier {bounds['max']} ({exc}). Stop here, or raise "
                "the target if a larger total is acceptable."
            ) from exc
        multiplier, source = float(calibrated.value), "calibrated"
    elif source == "fixed" and target is not None:
        stop = done + _steps_within(release(multiplier), prefix, target, delta, remaining, multiplier)
    expected = float(getattr(sampler, "expected_batch_size", args.train_batch_size))
    return PrivacyPlan(
        sampler=sampler,
        release=release(multiplier),
        noise_multiplier=multiplier,
        calibration_source=source,
        delta=delta,
        total_steps=steps,
        expected_batch_size=expected,
        sample_rate=expected / dataset_size,
        stop_step=stop,
        accounted=bool(args.privacy_accounting) or multiplier == 0,
        horizon=horizon,
        strategy=strategy,
    )


def _steps_within(step: Any, prefix: Any, target: float, delta: float, remaining: int, multiplier: float) -> int:
    """How many more steps of ``step`` (after ``prefix``) keep epsilon within ``target``; refuses zero at once."""
    first = step if prefix is None else accounting.compose(prefix, step)
    if accounting.epsilon(first, delta=delta).value > target:
        raise PrivacyBudgetError(
            f"one more step at privacy_noise_multiplier={multiplier} already exceeds privacy_target_epsilon={target}"
            f"{'' if prefix is None else ' (with the steps already taken)'}: raise the multiplier or the target."
        )
    return int(
        accounting.calibrate_steps(step, target_epsilon=target, delta=delta, prefix=prefix, max_steps=remaining).value
    )
